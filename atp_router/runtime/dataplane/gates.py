"""The flow gates: router-wide flow state every next-hop call is admitted through
(spec §5, §9, §10), and its trio side.

:class:`FlowGates` holds, for every stream and RIB generation, the per-next-hop
windows (AIMD) and their class-ordered queues, the QoS slots, the circuit
breakers and the retry policy, admitted through one sans-IO
:class:`~atp_router.flow.admission.AdmissionControl`. A next-hop call
(:mod:`~atp_router.runtime.dataplane.call`) is admitted, in route order (best first, so
the same task queues the same way every time), once the next-hop has an adapter,
the budget is not exhausted and its preflight estimate is known, through

a. the next-hop's **circuit breaker** (:class:`~atp_router.flow.breaker.BreakerBoard`):
   an open circuit is ``EAGENTDOWN`` with its ``retry_after_ms``, no call;
b. the **stream's window** (§5.1, §5.2): the adapter's preflight ``estimate``
   must fit it. A call that does not fit now is answered with a NACK — ERROR
   ``EWINDOW`` "…; queued until the window opens" — and a WINDOW_UPDATE
   carrying the refusing window, then waits (under the stream deadline) and
   goes when one of the stream's calls completes: never a silent queue. A
   call whose estimate alone exceeds the stream's or the next-hop's window
   could never fit: NACK + WINDOW_UPDATE and no call;
c. a router-wide **QoS slot** (§9, :class:`~atp_router.flow.qos.QosScheduler`):
   gold has reserved slots, silver and bronze share by WFQ, and a gold call
   kept waiting makes the router RST a bronze stream with ``EPREEMPT``
   (:class:`SlotGate` runs the scheduler's clock). This is where the classes
   compete, so the slot comes before the next-hop's window: a call holds its
   slot while it waits there;
d. the **next-hop's window** (shared by every stream calling that agent,
   AIMD): a call that does not fit waits in the window's
   :class:`~atp_router.flow.window.WindowQueue` — gold first, then silver and
   bronze by WFQ — with NACK + WINDOW_UPDATE as in b; room that opens is
   handed to one waiter at a time. The wait is reported to the QoS scheduler
   (the slot is *blocked*), so a gold call held up at a next-hop makes the
   router preempt a bronze call running *at that next-hop*, and a blocked
   silver or bronze slot may be given to gold at once (the call then waits
   for a slot again);
e. the **budget ledger** (reserve the estimate on the stream's account and its
   client's; a refusal is ``EBUDGET``, no call).

The trio side only loops: step the call (:meth:`FlowGates.step`), send the
WINDOW_UPDATE and NACK the decision carries, park until a decision names the
call (:meth:`FlowGates.wait`), step again; and ends every attempt — refused,
cancelled while it waited, or run — with one :meth:`FlowGates.release`, which
gives back what it held.

The gates also run the **canaries** (:mod:`~atp_router.runtime.dataplane.dispatch`
module doc, 3): after a call to a tenant-bound next-hop failed in doubt,
:data:`CANARY` is run on that next-hop outside any stream, window or budget, and
its outcome, not the tenant's, goes to the breaker.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from contextlib import aclosing

import msgspec
import trio

from atp_router.adapters.base import Prompt, ProviderAdapter
from atp_router.consensus.types import AgentReport
from atp_router.flow.admission import (
    AdmissionControl,
    Call,
    Decision,
    Outcome,
    Released,
)
from atp_router.flow.breaker import BreakerBoard, BreakerTransition, RetryPolicy
from atp_router.flow.qos import Preempt, QosScheduler
from atp_router.flow.window import WindowTable
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.dataplane.ticks import WindowTicks
from atp_router.runtime.loopstalls import LoopStalls
from atp_router.security.redact import scrub
from atp_router.task.body import TaskBody
from atp_router.task.change import parse_change
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ATPError, ErrorCode
from atp_router.wire.frame import PayloadType

log = logging.getLogger("atp_router.runtime.dataplane.gates")

#: The diff of :data:`CANARY`, parsed once at import into its ``change``.
_CANARY_DIFF = (
    "--- /dev/null\n+++ b/atp_canary.py\n@@ -0,0 +1,2 @@\n+def add(a, b):\n+    return a + b\n"
    "--- /dev/null\n+++ b/test_atp_canary.py\n@@ -0,0 +1,2 @@\n+def test_add():\n+    assert 1 + 1 == 2\n"
)
#: The canary the router runs itself on a tenant-bound next-hop after a call to it
#: failed in doubt (:mod:`~atp_router.runtime.dataplane.dispatch` module doc, 3): a
#: code review of one small, clean, changed Python module and its one passing
#: test — well-formed and far within every limit, so an analyser or a test
#: runner answers it in well under its timeout when healthy. A next-hop that refuses it as input (a tool for another task
#: type) gives no verdict.
CANARY: Prompt[TaskBody] = Prompt(
    task_type="code_review",
    content={
        "diff": _CANARY_DIFF,
        "files": {
            "atp_canary.py": "def add(a, b):\n    return a + b\n",
            "test_atp_canary.py": "def test_add():\n    assert 1 + 1 == 2\n",
        },
    },
    meta={"task_type": "code_review", "languages": ["py"], "canary": True},
    change=parse_change(_CANARY_DIFF),
    task=TaskMeta(task_type="code_review"),
)


class SlotGate:
    """The clock of the router-wide :class:`~atp_router.flow.qos.QosScheduler` (spec §9).

    :meth:`run` (a router task) sleeps until the scheduler's next deadline, or
    until a call moves, and hands every :class:`~atp_router.flow.qos.Preempt` that
    :meth:`AdmissionControl.on_timer <atp_router.flow.admission.AdmissionControl.on_timer>`
    decides (a running bronze call when gold waited too long for a slot or at
    that bronze call's next-hop, or a queued bronze call shed under congestion)
    to ``on_preempt``, which RSTs the stream with ``EPREEMPT``. Calls take and
    give back slots through :class:`FlowGates`, which drives this gate.
    """

    def __init__(self, scheduler: QosScheduler, on_preempt: Callable[[Preempt], None]):
        self.scheduler = scheduler
        self.on_preempt = on_preempt
        self._gates: FlowGates | None = None
        self._changed = trio.Event()

    def cancel(self, ticket: int) -> None:
        """Withdraw slot ``ticket`` (a preempted call whose stream is already
        closed): the slot goes to the next in line."""
        gates = self._bound()
        gates.wake(gates.admission.cancel_slot(ticket, trio.current_time()))

    def poke(self) -> None:
        """The scheduler's state may have moved, and its next deadline with it:
        :meth:`run` looks again (once for any number of pokes before it runs;
        not computed here, as that is linear in the calls waiting)."""
        self._changed.set()

    async def run(self) -> None:
        """Preempt and shed at the scheduler's deadlines, forever (a router task)."""
        while True:
            gates = self._bound()
            deadline = gates.admission.timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._changed.wait()
            self._changed = trio.Event()
            timed = gates.admission.on_timer(trio.current_time())
            gates.unpark(timed.wake)  # a shed call is refused at its next step
            for p in timed.preempt:
                self.on_preempt(p)

    def _bound(self) -> FlowGates:
        if self._gates is None:
            raise RuntimeError("SlotGate is used without its FlowGates")
        return self._gates


class FlowGates:
    """Router-wide flow state shared by every stream and RIB generation: the
    per-next-hop windows (AIMD) and their class-ordered queues, the QoS slots,
    the circuit breakers and the retry policy (spec §5, §9, §10), admitted
    through one sans-IO :class:`~atp_router.flow.admission.AdmissionControl`.

    This is its trio side: :meth:`step` and :meth:`release` run the sans-IO
    decisions at ``trio.current_time()`` and set the wake-up of every call a
    decision names; :meth:`wait` parks a call until it is woken; :meth:`canary`
    runs the canaries the breakers ask for, in :meth:`run_canaries` (a router
    task). ``stalls`` watches the router's own event loop (the router installs
    it while it serves)."""

    def __init__(
        self,
        agent_windows: WindowTable[Call],
        slots: SlotGate,
        breakers: BreakerBoard,
        retry: RetryPolicy,
        *,
        rng: random.Random | None = None,
        stalls: LoopStalls | None = None,
    ):
        self.agent_windows = agent_windows
        self.slots = slots
        self.breakers = breakers
        self.retry = retry
        self.rng = rng if rng is not None else random.Random()  # backoff jitter only
        #: The router's own loop stalls: a call timed out during one is the router's fault,
        #: not the next-hop's (:attr:`~atp_router.flow.breaker.Fault.LOCAL`).
        self.stalls = stalls if stalls is not None else LoopStalls()
        #: The running tasks' periodic WINDOW_UPDATE checks, one timer for all (:meth:`WindowTicks.run
        #: <atp_router.runtime.dataplane.ticks.WindowTicks.run>`, a router task).
        self.ticks = WindowTicks()
        self.admission = AdmissionControl(breakers, agent_windows, slots.scheduler)
        #: Calls parked in :meth:`wait`, by their wake-up.
        self._parked: dict[Call, trio.Event] = {}
        self._canaries: trio.Nursery | None = None
        slots._gates = self

    def step(self, call: Call) -> Decision:
        """:meth:`AdmissionControl.step <atp_router.flow.admission.AdmissionControl.step>` now."""
        d = self.admission.step(call, trio.current_time())
        self.wake(d.wake)
        return d

    def release(self, call: Call, outcome: Outcome) -> Released:
        """:meth:`AdmissionControl.release <atp_router.flow.admission.AdmissionControl.release>` now."""
        r = self.admission.release(call, outcome, trio.current_time())
        self.wake(r.wake)
        return r

    async def wait(self, call: Call) -> None:
        """Park ``call`` until a decision names it (no lost wake-up: a call is
        only named for a change that happened after its last step, and nothing
        checkpoints between that step and this park)."""
        ev = self._parked[call] = trio.Event()
        try:
            await ev.wait()
        finally:
            del self._parked[call]

    def wake(self, calls: Sequence[Call]) -> None:
        """After a step or release: :meth:`unpark` ``calls``, and have the slot
        gate look at the scheduler's deadlines again (they may have moved)."""
        self.unpark(calls)
        self.slots.poke()

    def unpark(self, calls: Sequence[Call]) -> None:
        """Wake ``calls`` parked in :meth:`wait` (those not parked are stepping anyway)."""
        for c in calls:
            ev = self._parked.get(c)
            if ev is not None:
                ev.set()

    async def run_canaries(self) -> None:
        """Run the canaries :meth:`canary` starts, forever (a router task);
        cancelling it cancels them (their breakers count nothing)."""
        async with trio.open_nursery() as nursery:
            self._canaries = nursery
            try:
                await trio.sleep_forever()
            finally:
                self._canaries = None

    def canary(self, agent: str, adapter: ProviderAdapter, timeout_s: float) -> None:
        """Run :data:`CANARY` on ``agent`` (``adapter``) under ``timeout_s``, as a
        :class:`~atp_router.flow.admission.Released` ``canary`` asked (module doc),
        and hand its outcome to the breaker — again at once while the breaker
        wants a failure confirmed. Without :meth:`run_canaries` running, the
        canary is not run and nothing is counted."""
        if self._canaries is None:
            log.warning("next-hop %s: no canary runner; a failure in doubt stays uncounted", agent)
            self.breakers.on_canary_cancel(agent, trio.current_time())
            return
        self._canaries.start_soon(self._canary, agent, adapter, timeout_s)

    async def _canary(self, agent: str, adapter: ProviderAdapter, timeout_s: float) -> None:
        again = True
        while again:
            ok, code, client_fault, why = False, None, False, ""
            try:
                with trio.fail_after(timeout_s):
                    await _run_canary(adapter)
            except trio.TooSlowError:
                code, why = ErrorCode.ETIMEOUT, f"no answer within {round(timeout_s * 1000)} ms"
            except ATPError as e:
                code, why = e.code, e.reason
                client_fault = isinstance(e, AgentError) and e.client_fault
            except Exception as e:
                log.exception("next-hop %s: canary raised", agent)
                why = f"adapter error: {type(e).__name__}"
            except BaseException:
                self.breakers.on_canary_cancel(agent, trio.current_time())  # the router stops: no verdict
                raise
            else:
                ok = True
            again = self.breakers.on_canary(agent, trio.current_time(), ok, code, client_fault=client_fault)
            if ok:
                log.info("next-hop %s: canary answered (a failure in doubt was the task's)", agent)
            elif client_fault:
                log.info("next-hop %s: canary refused as input (%s): no verdict", agent, scrub(why))
            else:
                log.warning("next-hop %s: canary failed (%s)%s", agent, scrub(why), "; confirming" if again else "")

    def wake_all(self) -> None:
        """Limits may have moved (RIB reload): pump every next-hop queue. The
        first RIB is adopted before ``trio.run`` (no clock yet), when no call
        can be waiting: nothing to do then."""
        if trio.lowlevel.in_trio_run():
            self.wake(self.admission.pump_all(trio.current_time()))


async def _run_canary(adapter: ProviderAdapter) -> None:
    """Run :data:`CANARY` on ``adapter`` to its FINAL, a review report; raises
    what the adapter raises, or ``AgentError(EPROTO)`` for no or a malformed FINAL."""
    async with aclosing(adapter.stream(CANARY)) as fragments:
        async for frag in fragments:
            if frag.type is PayloadType.FINAL:
                if not isinstance(frag.content, AgentReport):
                    try:
                        msgspec.convert(frag.content, AgentReport)
                    except msgspec.ValidationError as e:
                        raise AgentError(ErrorCode.EPROTO, f"canary FINAL is not a review report: {e}") from None
                return
    raise AgentError(ErrorCode.EPROTO, "canary ended without a FINAL fragment")


def flow_gates(config: RouterConfig, *, on_preempt: Callable[[Preempt], None],
                on_breaker: Callable[[BreakerTransition], None]) -> FlowGates:
    """The router-wide flow gates of ``config`` (spec §5, §9): the per-next-hop
    windows, the QoS slot scheduler, the circuit breakers and the retry policy."""
    rng = random.Random(config.seed)  # backoff jitter only
    windows: WindowTable[Call] = WindowTable(config.agent_window, update_interval_ms=config.window_update_interval_ms,
                          update_delta=config.window_update_delta)
    slots = SlotGate(QosScheduler(config.slots, gold_reserved=config.gold_reserved, gold_sla_ms=config.gold_sla_ms,
                                  preempt_after_ms=config.preempt_after_ms), on_preempt)
    breakers = BreakerBoard(failure_threshold=config.breaker_failures, window_s=config.breaker_window_s,
                            base_backoff_s=config.breaker_backoff_s, max_backoff_s=config.breaker_max_backoff_s,
                            rng=rng, on_transition=on_breaker)
    return FlowGates(windows, slots, breakers, config.retry, rng=rng)
