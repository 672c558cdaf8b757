"""Dispatcher: fan a task out to its next-hops and merge what comes back (spec §5, §7,
§8 steps 3-6, §9, §10).

For one stream the dispatcher

1. calls every next-hop of the route in parallel. Each call is admitted, in route
   order (best first, so the same task queues the same way every time), by the
   sans-IO :class:`~atp_router.flow.admission.AdmissionControl` (once the next-hop has
   an adapter, the budget is not exhausted and its preflight estimate is known)
   through

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
   call, step again; and ends every attempt — refused, cancelled while it waited,
   or run — with one :meth:`FlowGates.release`, which gives back what it held.

2. runs each call under its own overall deadline (``trio.fail_after``) and the
   stream's deadline; a call whose streamed usage passes what the budget can
   still take (its reservation plus the free headroom of the account chain) is
   cut with ``EBUDGET``. What a call used is committed whatever its outcome
   (success, failure, cut, RST, preemption). The adapter's text fragments reach
   the client as PARTIALs and are joined into the leg's text (the FINAL's
   ``answers``); no frame is built for them inside the router (issue 10).
   AIMD runs on both windows: a timely answer grows ``cwnd``, ``ETIMEOUT`` /
   ``EAGENTDOWN`` halve it; a cancelled call leaves it alone, and so does a call
   that failed on the client's input (below).

3. handles failures per call (§10): ``ETIMEOUT`` is retried on the same next-hop
   with backoff (:class:`~atp_router.flow.breaker.RetryPolicy`), then rerouted;
   ``EAGENTDOWN`` is rerouted at once — to the failing agent's RIB ``fallback``,
   else the route's next FIB ``alternate`` not yet tried — and retried on the same
   agent only when nothing is left to reroute to and the peer gave a short
   ``retry_after_ms``. Attempts are bounded and every agent is tried at most once
   per reroute chain, so a stream never loops. Every failed attempt is reported
   as one ERROR event saying what happens next ("; retry 2/2 in 200 ms",
   "; rerouted to X").

   A failure the client's input caused (:class:`~atp_router.wire.errors.ClientInputError`,
   ``client_fault``: a refused file path, a task over a next-hop's size limit) is
   not the next-hop's: it is not counted by the circuit breaker, halves no window,
   and is neither retried nor rerouted nor escalated (the same input would fail
   everywhere). When no next-hop produced a report and one failed that way,
   :meth:`Dispatcher.run` raises a ``ClientInputError`` — its code when every such
   failure has the same one (``ETIMEOUT``, ``ESEC``), else ``EPROTO`` — whose
   reason names the agents and what they refused, and the router resets the
   stream with it.

   **Faults are attributed** (issue 19, :func:`~atp_router.flow.breaker.attribute`): a
   *tenant-bound* next-hop (:attr:`ProviderAdapter.tenant_bound
   <atp_router.adapters.base.ProviderAdapter.tenant_bound>`: a local tool whose run is the
   task's own — its tests, its files) that runs past the hop's ``timeout_ms``
   (the dispatcher's own deadline: the adapter is cut short and cannot say why),
   or crashes with an exception the adapter did not classify, failed **in
   doubt**: the task may have caused it. (What an adapter raises is its own
   verdict: a tool adapter attributes its own wall clock and abnormal exits
   with a canary of its own first.) The call is then the tenant's — a
   ``ClientInputError``, ``ETIMEOUT`` (a crash: ``EPROTO``), with a reason
   saying so, handled as above: never retried at the router's expense, never
   rerouted, no AIMD decrease, no breaker count — and the release says whether
   to run a **canary** (:class:`~atp_router.flow.admission.Released` ``canary``):
   :data:`CANARY`, a small well-formed in-limit review the router runs itself on
   that next-hop (:meth:`FlowGates.canary`, outside any stream, window or budget;
   at most one at a time per next-hop, one every ``canary_interval_s`` of the
   breakers). Its outcome, not the tenant's, goes to the breaker
   (:meth:`~atp_router.flow.breaker.BreakerBoard.on_canary`). The same failures of a
   next-hop that is not tenant-bound (a model endpoint) are its own, as before.

4. merges the reports by the route's consensus strategy (§7.2); ``two_phase_commit``
   without quorum is reported as ERROR ``ECONSENSUS`` and escalated (§10); when
   an escalation trigger fires (§8 step 6) the escalation next-hop is called and
   the merge runs again; returns the FINAL result of §7.3 with telemetry. A
   next-hop whose last attempt failed while others answered is named in the
   result's ``consensus.uncertainties`` (:data:`NEXT_HOP_FAILED`), so a FINAL
   without findings is never mistaken for a complete review; so is a next-hop
   the FIB left out of the route as down (``Route.skipped``: its circuit open, or
   it announced itself down) — ``"next-hop failed: <agent>: EAGENTDOWN: skipped
   at routing: circuit open (next probe in N ms)"`` — although its slot may have
   gone to the next best.

A code-review task's diff is parsed once, before the fan-out (a large one in a
worker thread): the :class:`~atp_router.task.change.ParsedChange` rides on every leg's
prompt (:attr:`Prompt.change <atp_router.adapters.base.Prompt.change>`; a leg whose
data-scoped diff was rewritten parses its own) and gives the merge's evidence
scorer its changed lines.

Budget exhaustion (§10 ``EBUDGET`` → FIN): once the committed spend of the stream's
account or of its client's reaches a limit, no further call is admitted (queued
next-hops and the escalation get ERROR ``EBUDGET`` "not called: budget exhausted");
calls in flight finish within their reservations. The router then sends the FINAL
of what was gathered and FIN; with nothing gathered, :meth:`Dispatcher.run` raises
``AgentError(EBUDGET)`` and the router ends the stream with ERROR ``EBUDGET`` + FIN.

The stream's WINDOW_UPDATE cadence (§5.4) is driven here too: one is sent when the
window moved by ≥ ``update_delta`` (checked after every send and completion) and
at least every ``update_interval_ms`` while the task runs
(:meth:`Window.update_due <atp_router.flow.window.Window.update_due>`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.consensus.escalation import consensus_error, should_escalate
from atp_router.consensus.strategies import merge
from atp_router.consensus.types import (
    ANSWER_CHARS,
    AgentReport,
    Answer,
    FinalResult,
    Result,
    Telemetry,
    Usage,
)
from atp_router.flow.admission import (
    AdmissionControl,
    Admit,
    Call,
    Decision,
    Outcome,
    Released,
    StreamFlow,
    Wait,
)
from atp_router.flow.breaker import (
    BreakerBoard,
    BreakerState,
    Fault,
    Origin,
    RetryPolicy,
    attribute,
)
from atp_router.flow.budget import BudgetLedger, Refusal, usd_to_micros
from atp_router.flow.qos import Preempt, QosScheduler
from atp_router.flow.window import Estimate, WindowTable
from atp_router.flow.window import Window as FlowWindow
from atp_router.security.redact import scrub
from atp_router.task.change import parse_change
from atp_router.wire.errors import AgentError, ATPError, ClientInputError, ErrorCode
from atp_router.wire.frame import PayloadType, QoS, WindowUpdate

if TYPE_CHECKING:
    from atp_router.policy.rib import EscalationSpec

log = logging.getLogger("atp_router.runtime.dataplane.dispatch")

#: Failures that a reroute to another next-hop can cure.
REROUTABLE = frozenset({ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN})
#: Prefix of the FINAL's ``consensus.uncertainties`` entry for each next-hop of the
#: route (or the escalation) whose last attempt failed — after its retries and
#: reroutes — while others answered: ``"next-hop failed: <agent>: <reason>"``.
#: The merged result then lacks that agent's view (an empty ``findings`` is not
#: "nothing found"); the A2A server fails such a task when nothing was found.
NEXT_HOP_FAILED = "next-hop failed: "

#: The diff of :data:`CANARY`, parsed once at import into its ``change``.
_CANARY_DIFF = (
    "--- /dev/null\n+++ b/atp_canary.py\n@@ -0,0 +1,2 @@\n+def add(a, b):\n+    return a + b\n"
    "--- /dev/null\n+++ b/test_atp_canary.py\n@@ -0,0 +1,2 @@\n+def test_add():\n+    assert 1 + 1 == 2\n"
)
#: The canary the router runs itself on a tenant-bound next-hop after a call to it
#: failed in doubt (module doc, 3): a code review of one small, clean, changed
#: Python module and its one passing test — well-formed and far within every
#: limit, so an analyser or a test runner answers it in well under its timeout
#: when healthy. A next-hop that refuses it as input (a tool for another task
#: type) gives no verdict.
CANARY = Prompt(
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
)


class StreamIO(Protocol):
    """What the dispatcher needs from the stream it serves (implemented by the router)."""

    stream_id: str

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None: ...

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None: ...

    def emit_window_update(self, update: WindowUpdate) -> None: ...


@dataclass(slots=True)
class LegOutcome:
    """What one attempt of one next-hop call produced."""

    agent: str
    report: AgentReport | None = None
    text: str = ""
    usage: Usage = field(default_factory=Usage)
    error: ATPError | None = None
    latency_ms: float = 0.0
    #: Cancelled (stream deadline, RST, preemption) before it answered; no ERROR emitted yet.
    cancelled: bool = False
    #: 1-based attempt on this agent (a retry is attempt 2).
    attempt: int = 1
    #: The call reached the adapter (admitted through breaker, windows, QoS and budget).
    called: bool = False
    #: The WINDOW_UPDATE to send after this attempt's EWINDOW NACK.
    window_update: WindowUpdate | None = None
    #: What the ledger charged for it (``usage`` less any overage the budget could not take).
    charged_tokens: int = 0
    charged_usd_micros: int = 0
    #: Answered from the response cache (spec §13): not called, nothing charged;
    #: ``usage`` is then the stored call's, which consensus ranks its cost by.
    cached: bool = False
    #: It failed in doubt (module doc, 3): ``error`` is then the tenant's
    #: ``ClientInputError`` and a canary may speak for the next-hop.
    doubt: bool = False


@dataclass(slots=True)
class TaskPlan:
    """Everything the dispatcher needs to run one stream's task."""

    prompt: Prompt
    route: Any  # atp_router.policy.fib.Route
    window: FlowWindow
    ledger_key: str
    qos: QoS
    started: float  # trio.current_time() at SYN
    deadline: float  # absolute trio time
    #: The stream's id (QoS tickets name it; ``ledger_key`` is its budget account).
    stream_id: str = ""
    #: The FIB of the stream's RIB generation: fallbacks and data-scope clearance.
    fib: Any = None  # atp_router.policy.fib.Fib
    #: The prompt a given next-hop may see (spec §11 data scope): ``prompt``
    #: itself, or a copy with what the agent is not cleared for redacted. Raises
    #: :class:`~atp_router.wire.errors.ClientInputError` (``ESEC``) when the content
    #: carries a ``forbidden`` category the agent is not cleared for: that
    #: next-hop is not called. ``None``: every next-hop sees ``prompt``.
    prompt_for: Callable[[str], Prompt] | None = None
    #: Every attempt, in order (telemetry sums their usage).
    attempts: list[LegOutcome] = field(default_factory=list)
    #: Agents called or chosen for this stream: a reroute never goes back to one.
    tried: set[str] = field(default_factory=set)
    #: Changed lines of the task's diff (path → after-diff lines) for the
    #: evidence scorer: ``prompt.change.changed``, parsed once before the fan-out.
    changed: Mapping[str, frozenset[int]] | None = None
    #: The policy's champion/challenger bandit chose "cheap then escalate": escalate
    #: (trigger ``bandit``) even when no policy trigger fires.
    escalate: bool = False
    #: The escalation target was called for this task.
    escalated: bool = False
    #: The escalation triggers that fired for this stream (``no_findings``,
    #: ``low_conf``, ``bandit``, …), set when its FINAL is made: the stream's
    #: own, never another's (the dispatcher is shared by a generation's streams).
    triggers: list[str] = field(default_factory=list)
    #: Win rates for the consensus tie-break (§7.2): the router's live quality
    #: per agent (atp_router.policy.learn); None: the RIB's ``win30d``.
    win_rates: Mapping[str, float] | None = None
    #: The stream as the flow gates see it (window, class, budget account, route-order
    #: turns): made by :meth:`Dispatcher.run` unless given.
    flow: StreamFlow | None = None
    #: The response cache as this stream's tenant and policy see it
    #: (:class:`~atp_router.runtime.dataplane.cache.CacheView`; None: the policy does not cache).
    cache: Any = None

    @property
    def exhausted(self) -> str | None:
        """Why the budget is exhausted (spec §10 EBUDGET), once it is."""
        return self.flow.exhausted if self.flow is not None else None


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
    task)."""

    def __init__(
        self,
        agent_windows: WindowTable[Call],
        slots: SlotGate,
        breakers: BreakerBoard,
        retry: RetryPolicy,
        *,
        rng: random.Random | None = None,
    ):
        self.agent_windows = agent_windows
        self.slots = slots
        self.breakers = breakers
        self.retry = retry
        self.rng = rng if rng is not None else random.Random()  # backoff jitter only
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
        :class:`~atp_router.flow.admission.Released` ``canary`` asked (module doc, 3),
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


@dataclass(slots=True)
class _Ready:
    """A call that passed the dispatcher's own checks: what to admit and run."""

    adapter: ProviderAdapter
    prompt: Prompt
    estimate: Estimate


class Dispatcher:
    """Runs tasks over the adapters of one RIB generation.

    ``adapters`` maps agent names to live adapters; ``win_rates`` come from the
    RIB; ``sources`` maps agents to the independent source behind them
    (:func:`atp_router.policy.rib.independence_source`: agents on one model count once
    in consensus, spec §19); ``calibration`` maps agents to the function that
    turns a stated finding confidence into the measured one (RIB
    ``agents.<x>.calibration``); ``gates`` is the router-wide :class:`FlowGates`.
    ``on_leg`` is called after every attempt (metrics).
    """

    def __init__(
        self,
        adapters: Mapping[str, ProviderAdapter],
        ledger: BudgetLedger,
        *,
        win_rates: Mapping[str, float],
        gates: FlowGates,
        on_leg: Callable[[LegOutcome], None] | None = None,
        sources: Mapping[str, str] | None = None,
        calibration: Mapping[str, Callable[[float], float]] | None = None,
    ):
        self.adapters = adapters
        self.ledger = ledger
        self.win_rates = win_rates
        self.sources = dict(sources or {})
        self.calibration = dict(calibration or {})
        self.gates = gates
        self.on_leg = on_leg

    async def run(self, io: StreamIO, plan: TaskPlan) -> FinalResult:
        """Fan out, merge, escalate; returns the FINAL result (spec §7.3).

        Raises :class:`AgentError` when no next-hop produced a report at all:
        :class:`~atp_router.wire.errors.ClientInputError` (``EPROTO``, RST) when a
        next-hop refused the client's input, ``EBUDGET`` when the budget stopped
        it (the router ends the stream with ERROR + FIN), else ``EAGENTDOWN`` (RST).
        """
        if plan.flow is None:
            plan.flow = StreamFlow(plan.stream_id or plan.ledger_key, plan.window, plan.qos, self.ledger, plan.ledger_key)
        failure: AgentError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._window_ticker, io, plan)
            try:
                final = await self._run(io, plan)
            except AgentError as e:
                failure = e  # raised outside the nursery, so not wrapped in an ExceptionGroup
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return final

    async def _run(self, io: StreamIO, plan: TaskPlan) -> FinalResult:
        route = plan.route
        await _parse_change(plan)  # once per task: every leg and the merge share it
        plan.tried.update(h.agent for h in route.next_hops)
        legs: dict[int, LegOutcome] = {}
        with trio.move_on_at(plan.deadline) as scope:
            async with trio.open_nursery() as nursery:
                for turn, hop in enumerate(route.next_hops):
                    nursery.start_soon(self._leg, io, plan, hop, legs, turn)
        if scope.cancelled_caught:
            for turn, hop in enumerate(route.next_hops):
                self._deadline_error(io, plan, legs, turn, hop.agent)

        result, reports = self._merge(plan)
        triggers: list[str] = []
        no_quorum = consensus_error(result) is not None
        esc: EscalationSpec | None = getattr(route, "escalation", None)
        hop = route.escalation_hop
        # The input a next-hop refused would be refused by the escalation too.
        refused = [o for o in plan.attempts if _client_fault(o.error)]
        can_escalate = (
            esc is not None and hop is not None and esc.to not in {o.agent for o in plan.attempts}
            and trio.current_time() < plan.deadline and not (refused and not reports)
        )
        if can_escalate and esc is not None:
            triggers = should_escalate(
                result, reports, list(esc.on), threshold=esc.threshold, files=plan.prompt.content.get("files")
            )
            if not triggers and plan.escalate:
                triggers = ["bandit"]
        if no_quorum:
            # Spec §10 ECONSENSUS: no quorum → escalate.
            if triggers and plan.exhausted is None and esc is not None:
                what = f"escalating to {esc.to}"
            elif esc is None or hop is None:
                what = "no escalation target"
            else:
                what = f"not escalated: {esc.to} already called, budget exhausted or deadline passed"
            io.emit_error(ErrorCode.ECONSENSUS, f"{result.consensus.strategy}: no quorum ({what})")
        if triggers and plan.exhausted is None:
            turn = len(route.next_hops)
            plan.tried.add(hop.agent)
            plan.escalated = True
            if getattr(esc, "evidence", False):
                _hand_evidence(plan, reports)
            with trio.move_on_at(plan.deadline) as esc_scope:
                await self._leg(io, plan, hop, legs, turn)
            if esc_scope.cancelled_caught:
                self._deadline_error(io, plan, legs, turn, hop.agent)
            result, reports = self._merge(plan)
        elif triggers:
            io.emit_error(ErrorCode.EBUDGET, f"{hop.agent} not called: budget exhausted ({plan.exhausted})",
                          agent=hop.agent)
            triggers = []
        if not reports:
            if refused:
                codes = {o.error.code for o in refused if o.error}
                # One code everywhere is the stream's: a data-scope refusal ESEC (§11), a task
                # that ran past a tool's time ETIMEOUT; mixed or other refused input EPROTO.
                code = next(iter(codes)) if len(codes) == 1 else ErrorCode.EPROTO
                what = "task timed out: " if code is ErrorCode.ETIMEOUT else "task refused: "
                raise ClientInputError(
                    scrub(what + "; ".join(_agent_reason(o.agent, o.error) for o in refused if o.error)), code=code,
                )
            failed = scrub("; ".join([f"{o.agent}: {o.error.code} {o.error.reason}" for o in plan.attempts if o.error]
                                     + [f"{a}: skipped at routing" for a in getattr(route, "skipped", ())]))
            if plan.exhausted is not None or any(
                o.error is not None and o.error.code is ErrorCode.EBUDGET for o in plan.attempts
            ):
                raise AgentError(ErrorCode.EBUDGET, f"budget exhausted before any next-hop answered ({failed})")
            raise AgentError(ErrorCode.EAGENTDOWN, f"no next-hop produced a result ({failed or 'none ran'})")
        if triggers:
            result.consensus.uncertainties.append("escalated on " + ", ".join(triggers))
        for agent in getattr(route, "skipped", ()):
            # Left out of the route at SYN (module doc, 4): the review lacks its view.
            if agent not in reports:
                result.consensus.uncertainties.append(
                    f"{NEXT_HOP_FAILED}{agent}: {ErrorCode.EAGENTDOWN}: skipped at routing: {self._down_reason(agent)}")
        for _, out in sorted(legs.items()):
            # The final outcome of each turn: a failure its retries and reroutes did not mend.
            if out.error is not None and not out.cancelled:
                reason = out.error.reason.removeprefix(out.agent + ": ")
                note = scrub(f"{NEXT_HOP_FAILED}{out.agent}: {out.error.code}: {reason}")
                result.consensus.uncertainties.append(note[:500])
        # Telemetry is what the stream was charged (§7.3 cost), never above its budget.
        tokens = sum(o.charged_tokens for o in plan.attempts)
        usd_micros = sum(o.charged_usd_micros for o in plan.attempts)
        telemetry = Telemetry(
            tokens=tokens,
            usd=usd_micros / 1_000_000,
            latency_ms=round((trio.current_time() - plan.started) * 1000, 3),
        )
        plan.triggers = triggers
        return FinalResult(result=result, telemetry=telemetry)

    def _down_reason(self, agent: str) -> str:
        """Why the FIB found ``agent`` down at this stream's SYN: its circuit
        (open, or half-open and probing since), else the next-hop's own word."""
        now = trio.current_time()
        board = self.gates.breakers
        stats = board.statistics(now).get(agent)
        if stats is None or stats.state is BreakerState.CLOSED:
            return "the next-hop reported itself down"
        retry_ms = board.retry_after_ms(agent, now)
        return "circuit open" + (f" (next probe in {retry_ms} ms)" if retry_ms is not None else " (probing)")

    @staticmethod
    def _deadline_error(io: StreamIO, plan: TaskPlan, legs: dict[int, LegOutcome], turn: int, agent: str) -> None:
        """ETIMEOUT for a next-hop the stream deadline cut (queued, backing off, or in its call)."""
        out = legs.get(turn)
        if out is not None and not out.cancelled:
            return  # it finished (report or error) before the deadline
        reason = "stream deadline reached before the next-hop answered"
        if out is None:
            out = legs[turn] = LegOutcome(agent)
            plan.attempts.append(out)
        out.error = AgentError(ErrorCode.ETIMEOUT, reason, agent=out.agent)
        out.cancelled = False
        io.emit_error(ErrorCode.ETIMEOUT, f"{out.agent}: {reason}", agent=out.agent)

    def _merge(self, plan: TaskPlan) -> tuple[Result, dict[str, AgentReport]]:
        reports: dict[str, AgentReport] = {}
        costs: dict[str, int] = {}
        for o in plan.attempts:
            costs[o.agent] = costs.get(o.agent, 0) + o.usage.usd_micros
            if o.report is not None:
                reports[o.agent] = o.report
        result = merge(
            reports,
            strategy=plan.route.consensus,
            win_rates={a: (plan.win_rates or {}).get(a, self.win_rates.get(a, 0.5)) for a in reports},
            costs_usd_micros={a: costs.get(a, 0) for a in reports},
            files=plan.prompt.content.get("files"),
            sources=self.sources,
            quorum=plan.route.quorum,
            changed=plan.changed,
            calibration=self.calibration,
        )
        texts: dict[str, LegOutcome] = {}
        for o in plan.attempts:
            if o.report is not None and (o.report.summary or o.text):
                texts[o.agent] = o  # the last answering attempt of each agent
        for agent, o in texts.items():
            text = (o.report.summary or o.text) if o.report is not None else o.text
            result.answers.append(Answer(agent=agent, text=text[:ANSWER_CHARS],
                                         confidence=o.report.confidence if o.report is not None else None,
                                         truncated=len(text) > ANSWER_CHARS))
        return result, reports

    async def _window_ticker(self, io: StreamIO, plan: TaskPlan) -> None:
        """WINDOW_UPDATE every ``update_interval_ms`` while the task runs (§5.4)."""
        while True:
            await trio.sleep_until(plan.window.next_update_at())
            self._window_moved(io, plan)

    @staticmethod
    def _window_moved(io: StreamIO, plan: TaskPlan) -> None:
        update = plan.window.update_due(trio.current_time())
        if update is not None:
            io.emit_window_update(update)

    # ------------------------------------------------------------------ one next-hop

    async def _leg(self, io: StreamIO, plan: TaskPlan, hop: Any, legs: dict[int, LegOutcome], turn: int) -> None:
        """One next-hop of the route: attempts, retries and reroutes (module doc, 3)."""
        attempt = 1
        first = True
        while True:
            out = LegOutcome(hop.agent, attempt=attempt)
            legs[turn] = out
            plan.attempts.append(out)
            try:
                await self._attempt(io, plan, hop, out, turn if first else None)
            except BaseException as e:
                if _is_cancellation(e):
                    out.cancelled = True
                raise
            first = False
            if out.error is None:
                return
            if _client_fault(out.error):
                self._report(io, out, "")  # not retried nor rerouted: the same input fails everywhere
                return
            err = out.error
            agent = out.agent
            retry = self.gates.retry
            retry_hint = err.retry_after_ms
            # EAGENTDOWN: fail over first; ETIMEOUT: retry first (spec §10 rows).
            nxt = self._reroute(plan, agent) if err.code is ErrorCode.EAGENTDOWN else None
            if nxt is None and out.called and retry.should_retry(err.code, attempt, retry_after_ms=retry_hint):
                delay = retry.delay(attempt, self.gates.rng, retry_after_ms=retry_hint)
                if trio.current_time() + delay < plan.deadline:
                    self._report(io, out, f"; retry {attempt + 1}/{retry.max_attempts} in {round(delay * 1000)} ms")
                    attempt += 1
                    try:
                        await trio.sleep(delay)
                    except trio.Cancelled:
                        # Cut while backing off: the retry is what the deadline cut.
                        legs[turn] = pending = LegOutcome(agent, attempt=attempt, cancelled=True)
                        plan.attempts.append(pending)
                        raise
                    continue
            if nxt is None and err.code in REROUTABLE:
                nxt = self._reroute(plan, agent)
            if nxt is None:
                self._report(io, out, "")
                return
            self._report(io, out, f"; rerouted to {nxt.agent}")
            hop, attempt = nxt, 1

    def _report(self, io: StreamIO, out: LegOutcome, what_next: str) -> None:
        err = out.error
        assert err is not None
        reason = scrub(_agent_reason(out.agent, err))
        io.emit_error(err.code, reason + what_next, agent=out.agent, retry_after_ms=err.retry_after_ms)
        if out.window_update is not None:
            io.emit_window_update(out.window_update)

    def _reroute(self, plan: TaskPlan, agent: str) -> Any | None:
        """The next-hop to fail over to from ``agent``: its RIB fallback chain
        first, then the route's alternates, skipping agents already tried, open
        circuits and agents without an adapter. Marks the choice as tried."""
        fib = plan.fib
        meta = plan.prompt.meta
        candidates: list[Any] = []
        if fib is not None:
            name = fib.fallback(agent)
            while name is not None and name not in {c.agent for c in candidates} and name != agent:
                hop = fib.next_hop(name, meta)
                if hop is not None:
                    candidates.append(hop)
                name = fib.fallback(name)
        candidates.extend(getattr(plan.route, "alternates", ()))
        open_now = self.gates.breakers.open_agents(trio.current_time())
        for hop in candidates:
            if hop.agent in plan.tried or hop.agent in open_now or hop.agent not in self.adapters:
                continue
            plan.tried.add(hop.agent)
            return hop
        return None

    async def _attempt(self, io: StreamIO, plan: TaskPlan, hop: Any, out: LegOutcome, turn: int | None) -> None:
        """One call to ``hop``: admit it (module doc, 1a-e), run it, and end it
        with one :meth:`FlowGates.release` whatever happened — refused, cancelled
        while it waited, or run — which commits what it used and settles windows,
        slot and breaker. Sets ``out.error`` on any refusal or failure (the
        caller reports it)."""
        agent = hop.agent
        gates = self.gates
        flow = plan.flow
        assert flow is not None, "run() opens the stream's flow before any attempt"
        ready = self._prepare(plan, agent, out)
        # A cache hit is the attempt's answer: nothing to admit, call or charge (spec §13).
        if ready is None or (plan.cache is not None and await plan.cache.serve(io, agent, ready.prompt, out)):
            gates.wake(gates.admission.skip_turn(flow, turn))
            return
        call = gates.admission.begin(flow, agent, ready.estimate, turn=turn)
        t0 = 0.0
        timely = False
        try:
            if not await self._admit(io, call, out):
                return
            out.called = True
            t0 = trio.current_time()
            origin = Origin.ADAPTER
            crash = ""
            try:
                with trio.fail_after(hop.timeout_ms / 1000):
                    await self._pump(io, agent, ready, call, out)
                timely = True
            except trio.TooSlowError:
                origin = Origin.DEADLINE
                out.error = AgentError(ErrorCode.ETIMEOUT, f"no answer within {hop.timeout_ms} ms", agent=agent)
            except ATPError as e:
                out.error = e
            except trio.Cancelled:
                out.cancelled = True
                raise
            except Exception as e:
                # An adapter that breaks its contract fails its own call, not the stream.
                log.exception("next-hop %s: adapter raised", agent)
                origin, crash = Origin.CRASH, type(e).__name__
                out.error = AgentError(ErrorCode.EAGENTDOWN, f"adapter error: {crash}", agent=agent)
            except BaseExceptionGroup as eg:
                # A cancellation that crossed a nursery inside the adapter (the
                # sandbox's pipe readers) arrives as a group of Cancelled.
                if _is_cancellation(eg):
                    out.cancelled = True
                raise
            if out.error is not None:
                _attribute(out, ready.adapter, origin, crash)
            if timely and plan.cache is not None:
                plan.cache.record(agent, ready.prompt, out)
        finally:
            if self._release(io, call, out, timely, t0):
                gates.canary(agent, ready.adapter, hop.timeout_ms / 1000)

    def _release(self, io: StreamIO, call: Call, out: LegOutcome, timely: bool, t0: float) -> bool:
        """The one release of ``call``: what it used is committed even on failure
        or cancellation (§5, DESIGN principle 4); AIMD and the breaker see the
        outcome (a cancelled call and one the client's input failed leave both
        alone). A call that never ran just gives back what it held. Returns
        whether to run a canary on the next-hop now (it failed in doubt)."""
        err = out.error
        released = self.gates.release(call, Outcome(
            tokens=out.usage.tokens, usd_micros=out.usage.usd_micros, error=err.code if err is not None else None,
            cancelled=out.cancelled, client_fault=_client_fault(err), doubt=out.doubt, timely=timely,
        ))
        charge = released.charge
        if charge is None:
            return False  # never admitted: nothing ran, nothing to account
        out.latency_ms = (trio.current_time() - t0) * 1000
        out.charged_tokens, out.charged_usd_micros = charge.tokens, charge.usd_micros
        if (charge.overage_tokens or charge.overage_usd_micros) and err is None and not out.cancelled:
            # It answered, but billed past what the budget could still take (its
            # FINAL's usage is not checked before it arrives): say so.
            io.emit_error(
                ErrorCode.EBUDGET,
                f"{call.agent}: usage {out.usage.tokens} tokens / {out.usage.usd_micros} usd_micros passes what "
                f"the budget can take: {charge.tokens} / {charge.usd_micros} charged, the rest not",
                agent=call.agent,
            )
        if released.stream_update is not None:
            io.emit_window_update(released.stream_update)
        if self.on_leg is not None:
            self.on_leg(out)
        return released.canary

    def _prepare(self, plan: TaskPlan, agent: str, out: LegOutcome) -> _Ready | None:
        """The dispatcher's own checks before admission: ``agent`` has an adapter,
        the budget is not exhausted, and the preflight estimate (spec §5.2) of
        the prompt it may see. ``None`` with ``out.error`` set when one fails."""
        adapter = self.adapters.get(agent)
        if adapter is None:
            out.error = AgentError(ErrorCode.EAGENTDOWN, "next-hop has no adapter in the running RIB", agent=agent)
            return None
        assert plan.flow is not None, "run() opens the stream's flow before any attempt"
        why = plan.flow.check_exhausted()
        if why is not None:
            out.error = AgentError(ErrorCode.EBUDGET, f"{agent} not called: budget exhausted ({why})", agent=agent)
            return None
        try:
            prompt = _leg_prompt(plan, agent)
            est = adapter.estimate(prompt)
        except ATPError as e:
            out.error = e
            return None
        return _Ready(adapter, prompt, Estimate(tokens=est.in_tokens + est.out_tokens, usd_micros=usd_to_micros(est.usd)))

    async def _admit(self, io: StreamIO, call: Call, out: LegOutcome) -> bool:
        """Step ``call`` through the gates (module doc, 1a-e) until it is admitted
        or refused: send the stream's WINDOW_UPDATE and the NACK a decision
        carries, wait where it says, step again. ``False`` with ``out.error``
        (and ``out.window_update``) set when refused; the caller releases."""
        gates = self.gates
        agent = call.agent
        while True:
            d = gates.step(call)
            if d.stream_update is not None:
                io.emit_window_update(d.stream_update)
            if isinstance(d, Wait):
                if d.nack is not None:
                    # Spec §10 EWINDOW: NACK + WINDOW_UPDATE, then wait visibly.
                    io.emit_error(ErrorCode.EWINDOW, d.nack.reason, agent=agent)
                    if d.nack.window_update is not None:
                        io.emit_window_update(d.nack.window_update)
                await gates.wait(call)
            elif isinstance(d, Admit):
                return True
            else:
                out.error = AgentError(d.code, d.reason, agent=agent, retry_after_ms=d.retry_after_ms)
                out.window_update = d.window_update
                return False

    async def _pump(self, io: StreamIO, agent: str, ready: _Ready, call: Call, out: LegOutcome) -> None:
        """Iterate the adapter's fragments as one reassembled leg message.

        When the cumulative usage of a PARTIAL passes the call's reservation, the
        reservation is extended by the difference (held on the whole account
        chain at once, so concurrent calls never count on the same headroom);
        when the budget cannot take it, raises AgentError(EBUDGET): the call is
        cut (§5 / DESIGN principle 4) and the stream's budget is exhausted."""
        texts: list[str] = []
        final: Fragment | None = None
        async with aclosing(ready.adapter.stream(ready.prompt)) as fragments:
            async for frag in fragments:
                if frag.usage is not None:
                    out.usage = frag.usage
                if frag.usage is not None and frag.type is not PayloadType.FINAL:
                    # A FINAL means the call is over: its spend is committed as is.
                    r = call.reservation
                    assert r is not None
                    more_t = max(0, out.usage.tokens - r.tokens)
                    more_u = max(0, out.usage.usd_micros - r.usd_micros)
                    if (more_t or more_u) and isinstance(self.gates.admission.extend(call, more_t, more_u), Refusal):
                        raise AgentError(
                            ErrorCode.EBUDGET,
                            f"call cut: usage {out.usage.tokens} tokens / {out.usage.usd_micros} usd_micros "
                            "passes what the budget can take",
                            agent=agent,
                        )
                if frag.type is PayloadType.FINAL:
                    final = frag
                    break
                if frag.type is PayloadType.PARTIAL and isinstance(frag.content, str):
                    texts.append(frag.content)
                    io.emit_partial(agent, {"agent": agent, "delta": frag.content}, confidence=frag.confidence)
        if final is None:
            raise AgentError(ErrorCode.EPROTO, "next-hop ended without a FINAL fragment", agent=agent)
        out.text = "".join(texts)
        try:
            out.report = (
                final.content if isinstance(final.content, AgentReport) else msgspec.convert(final.content, AgentReport)
            )
        except msgspec.ValidationError as e:
            raise AgentError(ErrorCode.EPROTO, f"FINAL is not a review report: {e}", agent=agent) from None
        io.emit_partial(
            agent,
            {"agent": agent, "report": msgspec.to_builtins(out.report), "usage": msgspec.to_builtins(out.usage)},
            confidence=final.confidence,
        )


#: Citations per report and characters per text handed to an escalation as evidence.
EVIDENCE_FINDINGS = 20
EVIDENCE_CHARS = 2_000


def _hand_evidence(plan: TaskPlan, reports: Mapping[str, AgentReport]) -> None:
    """The escalation ``evidence: true`` of a policy (spec §15.3): from now on
    the stream's next-hops (the escalation, its retries and reroutes) get the
    first stage's reports as ``content["evidence"]``: a list, per agent in name
    order, of ``{"agent", "summary", "confidence", "findings": [{"file",
    "start", "end", "claim", "confidence"}]}`` (at most
    :data:`EVIDENCE_FINDINGS` findings, texts cut to :data:`EVIDENCE_CHARS`
    characters and passed through :func:`~atp_router.security.redact.scrub`: the
    evidence never carries a secret a detector recognises). Added to what the
    next-hop may see (the data-scoped prompt)."""
    evidence = [
        {
            "agent": agent,
            "summary": scrub(r.summary, max_chars=EVIDENCE_CHARS),
            "confidence": r.confidence,
            "findings": [
                {"file": f.file, "start": f.start, "end": f.end, "claim": scrub(f.claim, max_chars=EVIDENCE_CHARS),
                 "confidence": f.confidence}
                for f in r.findings[:EVIDENCE_FINDINGS]
            ],
        }
        for agent, r in sorted(reports.items())
    ]
    base = plan.prompt_for

    def prompt_for(agent: str) -> Prompt:
        p = plan.prompt if base is None else base(agent)
        return msgspec.structs.replace(p, content={**p.content, "evidence": evidence})

    plan.prompt_for = prompt_for


def _attribute(out: LegOutcome, adapter: ProviderAdapter, origin: Origin, crash: str) -> None:
    """Attribute ``out``'s failure, given its ``origin`` (and ``crash``: the
    exception's type name), module doc 3, :func:`~atp_router.flow.breaker.attribute`:
    in doubt, it becomes the tenant's ``ClientInputError`` — ``ETIMEOUT`` for a
    deadline, ``EPROTO`` for a crash — with a reason saying so, and
    ``out.doubt`` is set."""
    err = out.error
    assert err is not None
    if attribute(origin, client_fault=_client_fault(err), tenant_bound=adapter.tenant_bound) is not Fault.DOUBT:
        return
    what = f"failed on this task ({crash})" if origin is Origin.CRASH else err.reason
    out.error = ClientInputError(
        f"{what}; a local tool's run is the task's own: not retried, not counted against the next-hop",
        code=ErrorCode.EPROTO if origin is Origin.CRASH else ErrorCode.ETIMEOUT, agent=out.agent,
    )
    out.doubt = True


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


def _is_cancellation(e: BaseException) -> bool:
    """Whether ``e`` is a cancellation: ``trio.Cancelled``, or a group of only
    ``Cancelled`` (what a nursery the cancellation crossed raises — a tool
    adapter's sandbox reads its pipes in one)."""
    if isinstance(e, trio.Cancelled):
        return True
    return isinstance(e, BaseExceptionGroup) and e.split(trio.Cancelled)[1] is None


def _client_fault(err: ATPError | None) -> bool:
    """Did the client's input cause ``err`` (:class:`~atp_router.wire.errors.ClientInputError`)?"""
    return isinstance(err, AgentError) and err.client_fault


def _agent_reason(agent: str, err: ATPError) -> str:
    """``err.reason`` prefixed with ``agent`` unless it already starts with it."""
    return err.reason if err.reason.startswith(agent) else f"{agent}: {err.reason}"


#: Diffs up to this many characters are parsed on the event loop (~100 µs).
_INLINE_DIFF_CHARS = 32 * 1024


def _diff_of(prompt: Prompt) -> str | None:
    diff = prompt.content.get("diff") if isinstance(prompt.content, Mapping) else None
    return diff if isinstance(diff, str) else None


async def _parse_change(plan: TaskPlan) -> None:
    """Parse the task's diff once (:func:`~atp_router.task.change.parse_change`; a large
    one in a worker thread, never on the loop) onto ``plan.prompt.change``, which
    every leg gets (:func:`_leg_prompt`), and set ``plan.changed`` for the evidence
    scorer (``None`` when the task has no diff or an empty one). A prompt that
    already carries its change (a shadow run of a task) is not parsed again."""
    diff = _diff_of(plan.prompt)
    if diff is None:
        return
    if plan.prompt.change is None:
        if len(diff) > _INLINE_DIFF_CHARS:
            change = await trio.to_thread.run_sync(parse_change, diff)
        else:
            change = parse_change(diff)
        plan.prompt = msgspec.structs.replace(plan.prompt, change=change)
    assert plan.prompt.change is not None
    plan.changed = plan.prompt.change.changed if diff else None


def _leg_prompt(plan: TaskPlan, agent: str) -> Prompt:
    """The prompt ``agent`` may see (``plan.prompt_for``, spec §11) carrying the
    task's parsed diff (``plan.prompt.change``) when its diff is the task's; a
    data-scope redaction that rewrote the diff leaves that leg to parse its own."""
    prompt = plan.prompt if plan.prompt_for is None else plan.prompt_for(agent)
    change = plan.prompt.change
    if change is None:
        return prompt
    diff, task_diff = _diff_of(prompt), _diff_of(plan.prompt)
    if diff is not None and (diff is task_diff or diff == task_diff):
        return prompt if prompt.change is change else msgspec.structs.replace(prompt, change=change)
    return msgspec.structs.replace(prompt, change=None) if prompt.change is not None else prompt
