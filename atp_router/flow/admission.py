"""Admission of next-hop calls through every flow gate, as one object (spec §5.1–§5.4,
§9, §10 ``EAGENTDOWN`` / ``EWINDOW`` / ``EBUDGET`` / ``EPREEMPT``). Sans-IO.

:class:`AdmissionControl` composes the router-wide sans-IO pieces — the circuit
breakers (:class:`~atp_router.flow.breaker.BreakerBoard`), the per-next-hop windows and
their class-ordered queues (:class:`~atp_router.flow.window.WindowTable`), the QoS slot
scheduler (:class:`~atp_router.flow.qos.QosScheduler`) — with each stream's own window
and budget account (:class:`StreamFlow`). One call goes through, in order:

0. its **turn** in route order (``turn``: a retry or reroute has none), so the
   same task queues the same way every time; a turn passes when its call asks
   for a slot, or ends before that; then a budget already **exhausted** (§10) is
   ``EBUDGET`` at once;
a. the next-hop's **circuit breaker**: open is ``EAGENTDOWN`` with ``retry_after_ms``;
b. the **stream's window**: an estimate that exceeds the stream's or the
   next-hop's window by itself could never fit (``EWINDOW`` with the refusing
   window); one that does not fit now waits, and its first :class:`Wait` carries
   the NACK (ERROR ``EWINDOW`` "…; queued until the window opens" + WINDOW_UPDATE);
c. a router-wide **QoS slot** (gold reserved, silver and bronze by WFQ; a full
   class queue is ``EWINDOW``; a bronze call shed while queued is ``EPREEMPT``);
d. the **next-hop's window**, holding the slot: the call waits in its class-ordered
   :class:`~atp_router.flow.window.WindowQueue` (gold first) with one NACK, its slot
   reported blocked to the scheduler, which may give that slot to gold at once
   (a *revoke*: the call leaves the queue and waits for its slot again);
e. the **budget**: the estimate is reserved on the stream's account chain
   (``EBUDGET`` when it does not fit or the budget was exhausted meanwhile).

Every step returns a decision instead of acting (as h2's windows do)::

    call = admission.begin(flow, "review.ruff", Estimate(tokens=900, usd_micros=1800), turn=0)
    d = admission.step(call, now)     # Admit | Wait(on=Stage, nack) | Refuse(code, reason, …)
    ...run the call if admitted, stepping again each time it is woken while it waits...
    r = admission.release(call, Outcome(tokens=812, usd_micros=1624, timely=True), now)

``release`` is the only way out, whatever the stage: it gives back exactly what
the call holds — its turn, its place in a queue, its call on either window, its
slot ticket, its reservation (committed with the actual usage: ``Charge``), its
breaker probe — and runs AIMD and the breaker by the outcome: a timely success
grows both windows; ``ETIMEOUT`` / ``EAGENTDOWN`` halve them; a cancelled call and
one the client's input failed (``client_fault``) leave them alone, and only a
peer failure counts against the breaker. A call that failed in doubt (``doubt``:
a tenant-bound next-hop's timeout or crash, :func:`~atp_router.flow.breaker.attribute`)
is settled as the client's, and its :class:`Released` says whether to run a
canary on the next-hop now (``canary``, :meth:`~atp_router.flow.breaker.BreakerBoard.on_doubt`):
the canary's outcome, not the tenant's call, speaks for the next-hop. A refused
call has given back everything already (``release`` after a :class:`Refuse` only
closes it).

Waking: a decision's ``wake`` names the other calls that may move now (room
opened in a window, a slot granted, their turn came, a queued call was shed); the
runtime steps each again. Nothing else wakes a call, and a call woken for nothing
just waits again. The QoS scheduler's clock is :meth:`AdmissionControl.timer` /
:meth:`AdmissionControl.on_timer`, whose :class:`~atp_router.flow.qos.Preempt` values the
runtime carries out (RST ``EPREEMPT``). Time is an argument (``now``, seconds);
nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from msgspec import Struct

from atp_router.flow.breaker import BreakerBoard
from atp_router.flow.budget import BudgetLedger, Charge, Refusal, Reservation
from atp_router.flow.qos import Grant, Preempt, QosScheduler, Refused
from atp_router.flow.window import Estimate, InFlight, Window, WindowQueue, WindowTable
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS, WindowUpdate

#: Failures that say the next-hop is congested or down: AIMD decreases on them.
CONGESTION = frozenset({ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN})


class Stage(enum.StrEnum):
    """Where a call stands (module doc, 0 and a-e). A :class:`Wait` names the
    gate it waits at: ``turn``, ``stream_window``, ``slot`` (also after its slot
    was revoked for gold) or ``hop_window``."""

    TURN = "turn"
    STREAM_WINDOW = "stream_window"
    SLOT = "slot"
    HOP_WINDOW = "hop_window"
    ADMITTED = "admitted"
    REFUSED = "refused"
    RELEASED = "released"


#: Every legal move of a call; anything else is a bug (``_move`` asserts it).
#: A revoke moves HOP_WINDOW back to SLOT; the breaker and budget gates decide
#: within one step and have no stage of their own.
TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.TURN: frozenset({Stage.STREAM_WINDOW, Stage.REFUSED, Stage.RELEASED}),
    Stage.STREAM_WINDOW: frozenset({Stage.SLOT, Stage.REFUSED, Stage.RELEASED}),
    Stage.SLOT: frozenset({Stage.HOP_WINDOW, Stage.REFUSED, Stage.RELEASED}),
    Stage.HOP_WINDOW: frozenset({Stage.SLOT, Stage.ADMITTED, Stage.REFUSED, Stage.RELEASED}),
    Stage.ADMITTED: frozenset({Stage.RELEASED}),
    Stage.REFUSED: frozenset({Stage.RELEASED}),
    Stage.RELEASED: frozenset(),
}


@dataclass(eq=False, slots=True)
class StreamFlow:
    """One stream as the gates see it: its id (QoS tickets and preemptions name
    it), its :class:`~atp_router.flow.window.Window`, its QoS class, and its budget
    account ``ledger_key`` in ``ledger``. ``exhausted`` is why that account can
    spend nothing more (``"<account> <axis> <committed>/<limit>"``), once it is
    (sticky: spec §10 EBUDGET ends the stream's calls). ``turn``: the route-order
    turn whose call may go next."""

    stream_id: str
    window: Window
    qos: QoS
    ledger: BudgetLedger
    ledger_key: str
    exhausted: str | None = None
    turn: int = 0
    _waiting: dict[Call, None] = field(default_factory=dict)  # at the stream window
    _turn_waiters: dict[int, Call] = field(default_factory=dict)
    _skipped: set[int] = field(default_factory=set)  # turns whose call ended before its turn

    def check_exhausted(self) -> str | None:
        """:attr:`exhausted`, read from the ledger while it is still ``None``."""
        if self.exhausted is None:
            self.exhausted = self.ledger.exhausted(self.ledger_key)
        return self.exhausted


@dataclass(eq=False, slots=True)
class Call:
    """One next-hop call being admitted (from :meth:`AdmissionControl.begin`).
    Read-only for the runtime: ``stage``, and once admitted ``reservation`` (the
    budget it holds, grown by :meth:`AdmissionControl.extend`)."""

    flow: StreamFlow
    agent: str
    estimate: Estimate
    turn: int | None = None
    stage: Stage = Stage.TURN
    reservation: Reservation | None = None
    _holds_turn: bool = False
    _probe: bool = False  # breaker admitted it: settle with on_result / on_cancel
    _stream_call: InFlight | None = None
    _slot: int | None = None  # QoS ticket, queued or running
    _granted: bool = False  # the ticket holds a slot
    _hop_queue: WindowQueue[Call] | None = None  # waiting in it
    _hop_window: Window | None = None  # holds _hop_call
    _hop_call: InFlight | None = None
    _dropped: Preempt | None = None  # its queued ticket was shed / withdrawn
    _nacked_stream: bool = False
    _nacked_hop: bool = False


class Nack(Struct, frozen=True):
    """What to tell the client once when a call starts to wait for room (spec §10
    EWINDOW "NACK + WINDOW_UPDATE"): ERROR ``EWINDOW`` with ``reason`` (agent
    first, "…; queued until the window opens"), then ``window_update`` if any."""

    reason: str
    window_update: WindowUpdate | None = None


class Admit(Struct, frozen=True):
    """The call may go: it holds its stream and next-hop window room, a slot and
    ``reservation``. ``stream_update``: the stream's WINDOW_UPDATE due now (§5.4)."""

    reservation: Reservation
    stream_update: WindowUpdate | None = None
    wake: tuple[Call, ...] = ()


class Wait(Struct, frozen=True):
    """The call waits at gate ``on`` until it is woken; send ``stream_update``
    (§5.4), then ``nack`` (the first wait at each window gate only)."""

    on: Stage
    nack: Nack | None = None
    stream_update: WindowUpdate | None = None
    wake: tuple[Call, ...] = ()


class Refuse(Struct, frozen=True):
    """No call: ``code`` (``EBUDGET``, ``EAGENTDOWN``, ``EWINDOW``, ``EPREEMPT``)
    and ``reason``; ``retry_after_ms`` for an open circuit; ``window_update``: the
    refusing window, to send after the ERROR (§10 EWINDOW). Everything the call
    held is given back already; ``stream_update`` as in :class:`Admit`."""

    code: ErrorCode
    reason: str
    retry_after_ms: int | None = None
    window_update: WindowUpdate | None = None
    stream_update: WindowUpdate | None = None
    wake: tuple[Call, ...] = ()


Decision = Admit | Wait | Refuse


class Outcome(Struct, frozen=True, kw_only=True):
    """How an admitted call ended, for :meth:`AdmissionControl.release`: actual
    usage (tokens, USD micros) as the next-hop reported it; ``error`` its failure
    code (``None``: it answered); ``cancelled`` (RST, preemption, deadline: no
    AIMD, no breaker verdict); ``client_fault`` (the client's input failed it: no
    AIMD, not counted against the breaker); ``doubt`` (it failed in a way its task
    may have caused, :attr:`~atp_router.flow.breaker.Fault.DOUBT`: as ``client_fault``,
    and the breaker may ask for a canary); ``local`` (it timed out while the
    router's own loop stalled, :attr:`~atp_router.flow.breaker.Fault.LOCAL`: as
    ``client_fault``, no canary); ``timely``: it answered within its timeout
    (AIMD grows only then)."""

    tokens: int = 0
    usd_micros: int = 0
    error: ErrorCode | None = None
    cancelled: bool = False
    client_fault: bool = False
    doubt: bool = False
    local: bool = False
    timely: bool = False


#: A call that ended before it ran (cancelled while waiting, or refused).
NOT_RUN = Outcome(cancelled=True)


class Released(Struct, frozen=True):
    """What :meth:`AdmissionControl.release` did: the ledger's ``charge`` (``None``
    when the call was never admitted), the stream's WINDOW_UPDATE due now, the
    calls to wake, and ``canary``: run a canary on the call's next-hop now (the
    call failed in doubt; end it with
    :meth:`~atp_router.flow.breaker.BreakerBoard.on_canary`)."""

    charge: Charge | None = None
    stream_update: WindowUpdate | None = None
    wake: tuple[Call, ...] = ()
    canary: bool = False


class Timed(Struct, frozen=True):
    """What :meth:`AdmissionControl.on_timer` decided: ``preempt`` — RST each
    stream with ``EPREEMPT`` (a running call: cancel it, then release it; a
    queued one was shed and its call, in ``wake``, is refused when stepped)."""

    preempt: tuple[Preempt, ...] = ()
    wake: tuple[Call, ...] = ()


class AdmissionControl:
    """The router-wide admission of next-hop calls (see the module docstring):
    ``breakers``, ``agent_windows`` (with their queues) and ``scheduler`` are
    shared by every stream; each call names its :class:`StreamFlow`.

    Methods raise ``ValueError`` when used out of order (stepping a call that
    was released, releasing it twice, usage for a call that never ran)."""

    def __init__(self, breakers: BreakerBoard, agent_windows: WindowTable[Call], scheduler: QosScheduler) -> None:
        self.breakers = breakers
        self.agent_windows = agent_windows
        self.scheduler = scheduler
        self._by_ticket: dict[int, Call] = {}
        self._woken: list[Call] = []

    # ------------------------------------------------------------------ per call

    def begin(self, flow: StreamFlow, agent: str, estimate: Estimate, *, turn: int | None = None) -> Call:
        """A call of ``flow`` to next-hop ``agent`` with preflight ``estimate``
        (tokens in + out, USD micros; spec §5.2) in route-order ``turn`` (``None``:
        no turn, e.g. a retry). Takes nothing yet: :meth:`step` it."""
        return Call(flow, agent, estimate, turn)

    def skip_turn(self, flow: StreamFlow, turn: int | None) -> tuple[Call, ...]:
        """Turn ``turn`` of ``flow`` will have no call (refused before
        :meth:`begin`): the calls behind it need not wait for it. Returns the
        calls to wake."""
        if turn is not None:
            self._skip(flow, turn)
        return self._drain(None)

    def step(self, call: Call, now: float) -> Decision:
        """Take ``call`` through as many gates as it can pass at ``now`` (s).
        Returns :class:`Admit`, :class:`Wait` (step again when woken) or
        :class:`Refuse`. Raises ``ValueError`` when the call was already admitted,
        refused or released."""
        stage = call.stage
        if stage in (Stage.ADMITTED, Stage.REFUSED, Stage.RELEASED):
            raise ValueError(f"call to {call.agent} is {stage}: nothing to step")
        flow = call.flow
        agent = call.agent
        est = call.estimate
        qos = flow.qos
        stream_update: WindowUpdate | None = None

        if stage is Stage.TURN:
            refused = self._at_turn(call, now)
            if refused is not None:
                return refused
            stage = Stage.STREAM_WINDOW

        if stage is Stage.STREAM_WINDOW:
            window = flow.window
            fit = window.admit(est, qos=qos)
            if not fit.admitted:
                flow._waiting[call] = None
                nack = None
                if not call._nacked_stream:
                    call._nacked_stream = True
                    nack = Nack(f"{agent}: {fit.reason}; queued until the window opens", fit.window_update)
                return Wait(Stage.STREAM_WINDOW, nack, wake=self._drain(call))
            flow._waiting.pop(call, None)
            call._stream_call = window.on_send(est, qos=qos)
            stream_update = window.update_due(now)
            # c. a QoS slot; the turn passes as the slot is asked for
            self._pass_turn(call)
            d = self.scheduler.request(flow.stream_id, qos, now, key=agent)
            if isinstance(d, Refused):
                return self._refuse(call, now, d.code, d.reason, stream_update=stream_update)
            call._slot = d.ticket
            self._by_ticket[d.ticket] = call
            stage = self._move(call, Stage.SLOT)
            if isinstance(d, Grant):
                call._granted = True
            elif qos is QoS.GOLD:
                self._reclaim(now)  # blocked silver/bronze slots go to gold (this call, maybe)

        if stage is Stage.SLOT:
            if call._dropped is not None:
                p = call._dropped
                return self._refuse(call, now, p.code, p.reason, stream_update=stream_update)
            if not call._granted:
                return Wait(Stage.SLOT, stream_update=stream_update, wake=self._drain(call))
            self._move(call, Stage.HOP_WINDOW)

        return self._at_hop(call, now, stream_update)

    def _at_turn(self, call: Call, now: float) -> Refuse | Wait | None:
        """:meth:`step`'s first gates, for a call at :attr:`Stage.TURN`: its turn
        in route order, the budget, the circuit breaker (a. in the module doc)
        and what could never fit either window (b.). ``None``: passed, the call
        moved on to :attr:`Stage.STREAM_WINDOW`."""
        flow = call.flow
        agent = call.agent
        est = call.estimate
        qos = flow.qos
        turn = call.turn
        if turn is not None and turn > flow.turn:
            flow._turn_waiters[turn] = call
            return Wait(Stage.TURN, wake=self._drain(call))
        if turn is not None:
            flow._turn_waiters.pop(turn, None)
            call._holds_turn = turn == flow.turn
        why = flow.check_exhausted()
        if why is not None:
            return self._refuse(call, now, ErrorCode.EBUDGET, f"{agent} not called: budget exhausted ({why})")
        # a. circuit breaker
        if not self.breakers.allow(agent, now):
            retry_ms = self.breakers.retry_after_ms(agent, now)
            hint = f" (next probe in {retry_ms} ms)" if retry_ms is not None else ""
            return self._refuse(call, now, ErrorCode.EAGENTDOWN, f"circuit open{hint}", retry_after_ms=retry_ms)
        call._probe = True
        # b. what could never fit, on the stream's window and on the next-hop's
        for w, label in ((flow.window, ""), (self.agent_windows.window(agent), "next-hop window: ")):
            never = w.admit_when_idle(est, qos=qos)
            if not never.admitted:
                return self._refuse(call, now, ErrorCode.EWINDOW, f"{label}{never.reason}",
                                    window_update=never.window_update)
        self._move(call, Stage.STREAM_WINDOW)
        return None

    def _at_hop(self, call: Call, now: float, stream_update: WindowUpdate | None) -> Decision:
        """:meth:`step`'s last gates, for a call holding its QoS slot: the
        next-hop's window (d. in the module doc) and the budget (e.);
        ``stream_update`` is the stream window's update due from this step."""
        flow = call.flow
        agent = call.agent
        est = call.estimate
        qos = flow.qos
        if call._hop_call is None:
            # d. the next-hop's window, class-ordered, holding the slot
            nack = None
            if call._hop_queue is None:
                # Looked up each time: a reload may drop an idle window while a revoked call waits.
                queue = self.agent_windows.queue(agent)
                queue.enqueue(call, est, qos)
                call._hop_queue = queue
                self._pump(queue, now, call)  # may hand this very call its room
                if call._hop_call is None:
                    if not call._nacked_hop:
                        call._nacked_hop = True
                        nack = self._hop_nack(call, queue)
                    assert call._slot is not None
                    self.scheduler.block(call._slot, now)
                    self._reclaim(now)  # may revoke this very slot: then it waits for a slot again
            if call._hop_call is None:
                return Wait(call.stage, nack, stream_update, self._drain(call))

        # e. the budget
        why = flow.check_exhausted()
        if why is not None:
            return self._refuse(call, now, ErrorCode.EBUDGET, f"{agent} not called: budget exhausted ({why})",
                                stream_update=stream_update)
        r = flow.ledger.reserve(flow.ledger_key, est.tokens, est.usd_micros)
        if isinstance(r, Refusal):
            return self._refuse(call, now, ErrorCode.EBUDGET, f"{agent} not called: {r.reason}",
                                retry_after_ms=r.retry_after_ms, stream_update=stream_update)
        call.reservation = r
        self._move(call, Stage.ADMITTED)
        return Admit(r, stream_update, self._drain(call))

    def extend(self, call: Call, tokens: int, usd_micros: int) -> Reservation | Refusal:
        """Hold ``tokens`` / ``usd_micros`` more on an admitted call's reservation
        (its streamed usage passed it, §5): :meth:`BudgetLedger.extend
        <atp_router.flow.budget.BudgetLedger.extend>`; a :class:`~atp_router.flow.budget.Refusal`
        (``EBUDGET``) means cut the call. Raises ``ValueError`` unless admitted."""
        if call.stage is not Stage.ADMITTED or call.reservation is None:
            raise ValueError(f"call to {call.agent} is {call.stage}, not admitted")
        r = call.flow.ledger.extend(call.reservation, tokens, usd_micros)
        if isinstance(r, Reservation):
            call.reservation = r
        return r

    def release(self, call: Call, outcome: Outcome, now: float) -> Released:
        """End ``call`` at ``now`` whatever its stage, giving back all it holds
        (module doc). An admitted call's reservation is committed with
        ``outcome``'s usage (never above what the budget can take: the rest is
        overage, see :meth:`BudgetLedger.commit
        <atp_router.flow.budget.BudgetLedger.commit>`), and AIMD and the breaker run by
        ``outcome``; for a call that never ran ``outcome`` only has to carry no
        usage. Raises ``ValueError`` when released twice, or given usage for a
        call that was never admitted."""
        stage = call.stage
        if stage is Stage.RELEASED:
            raise ValueError(f"call to {call.agent} released twice")
        if stage is not Stage.ADMITTED:
            if outcome.tokens or outcome.usd_micros:
                raise ValueError(f"call to {call.agent} was never admitted ({stage}) but reports usage")
            if stage is not Stage.REFUSED:
                self._give_back(call, now)
            self._move(call, Stage.RELEASED)
            return Released(wake=self._drain(call))
        flow = call.flow
        agent = call.agent
        assert call.reservation is not None and call._stream_call is not None
        assert call._hop_window is not None and call._hop_call is not None
        charge = flow.ledger.commit(call.reservation, outcome.tokens, outcome.usd_micros)
        flow.check_exhausted()
        update = None
        canary = False
        if outcome.cancelled:
            flow.window.on_cancel(call._stream_call)
            call._hop_window.on_cancel(call._hop_call)
            self._free_slot(call, now, done=False)
            self.breakers.on_cancel(agent, now)
        elif outcome.client_fault or outcome.doubt or outcome.local:
            # The client's input failed, or the router's own stalled loop, not the next-hop: no
            # AIMD, no breaker failure; in doubt, the breaker may want a canary to speak for it.
            flow.window.on_cancel(call._stream_call)
            call._hop_window.on_cancel(call._hop_call)
            self._free_slot(call, now, done=True)
            self.breakers.on_result(agent, now, False, outcome.error, client_fault=True)
            canary = outcome.doubt and self.breakers.on_doubt(agent, now)
            update = flow.window.update_due(now)
        else:
            ok = outcome.error is None or outcome.error not in CONGESTION
            for w, c in ((flow.window, call._stream_call), (call._hop_window, call._hop_call)):
                w.on_complete(c, outcome.tokens, outcome.usd_micros, ok=ok, timely=outcome.timely)
            self._free_slot(call, now, done=True)
            self.breakers.on_result(agent, now, outcome.error is None, outcome.error)
            update = flow.window.update_due(now)
        call._stream_call = call._hop_call = call._hop_window = None
        call._probe = False
        self._wake_stream(flow)
        self._pump(self.agent_windows.queue(agent), now)
        self._move(call, Stage.RELEASED)
        return Released(charge, update, self._drain(call), canary)

    # ------------------------------------------------------------------ router-wide

    def pump_all(self, now: float) -> tuple[Call, ...]:
        """Room may have opened in the next-hops' windows (their limits moved: a
        RIB reload): hand it to the calls waiting there, in class order.
        Returns the calls to wake."""
        for agent in self.agent_windows.agents():
            self._pump(self.agent_windows.queue(agent), now)
        return self._drain(None)

    def timer(self) -> float | None:
        """When (s) :meth:`on_timer` may next have something to do (the QoS
        scheduler's preemption and shedding deadlines); ``None``: not until
        another call is stepped or released. May lie in the past."""
        return self.scheduler.get_timer()

    def on_timer(self, now: float) -> Timed:
        """Preempt and shed at ``now`` (spec §9): the scheduler's
        :meth:`~atp_router.flow.qos.QosScheduler.preemptions` and
        :meth:`~atp_router.flow.qos.QosScheduler.shed`. A shed call is refused
        (``EPREEMPT``) when next stepped."""
        out = self.scheduler.preemptions(now) + self.scheduler.shed(now)
        for p in out:
            if not p.running:
                call = self._by_ticket.pop(p.ticket, None)
                if call is not None:
                    call._slot = None
                    call._dropped = p
                    self._woken.append(call)
        return Timed(tuple(out), self._drain(None))

    def cancel_slot(self, ticket: int, now: float) -> tuple[Call, ...]:
        """Withdraw QoS ticket ``ticket`` (a preempted call whose stream is gone):
        its slot goes to the next in line; a call still waiting with it is
        refused (``EPREEMPT``) when next stepped. Unknown tickets are ignored.
        Returns the calls to wake."""
        self._grant(self.scheduler.cancel(ticket, now))
        call = self._by_ticket.pop(ticket, None)
        if call is not None:
            call._slot = None
            call._granted = False
            if call.stage in (Stage.SLOT, Stage.HOP_WINDOW) and call._hop_call is None:
                if call._hop_queue is not None:
                    call._hop_queue.cancel(call)
                    call._hop_queue = None
                call._dropped = Preempt(stream_id=call.flow.stream_id, ticket=ticket, reason="slot withdrawn",
                                        running=False)
                if call.stage is Stage.HOP_WINDOW:
                    self._move(call, Stage.SLOT)
                self._woken.append(call)
        return self._drain(None)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _move(call: Call, stage: Stage) -> Stage:
        assert stage in TRANSITIONS[call.stage], f"{call.stage} -> {stage}"
        call.stage = stage
        return stage

    def _drain(self, exclude: Call | None) -> tuple[Call, ...]:
        woken = self._woken
        if not woken:
            return ()
        out = tuple(c for c in dict.fromkeys(woken) if c is not exclude)
        woken.clear()
        return out

    def _refuse(self, call: Call, now: float, code: ErrorCode, reason: str, *, retry_after_ms: int | None = None,
                window_update: WindowUpdate | None = None, stream_update: WindowUpdate | None = None) -> Refuse:
        self._give_back(call, now)
        self._move(call, Stage.REFUSED)
        return Refuse(code, reason, retry_after_ms, window_update, stream_update, self._drain(call))

    def _give_back(self, call: Call, now: float) -> None:
        """Everything a call that did not run holds, in reverse order of taking."""
        flow = call.flow
        if call.turn is not None:
            if call._holds_turn:
                self._pass_turn(call)
            elif call.stage is Stage.TURN:
                flow._turn_waiters.pop(call.turn, None)
                self._skip(flow, call.turn)
        flow._waiting.pop(call, None)
        if call._hop_queue is not None:
            call._hop_queue.cancel(call)
            call._hop_queue = None
        if call._hop_call is not None:
            assert call._hop_window is not None
            call._hop_window.on_cancel(call._hop_call)
            call._hop_call = call._hop_window = None
            self._pump(self.agent_windows.queue(call.agent), now)
        self._free_slot(call, now, done=False)
        if call._stream_call is not None:
            flow.window.on_cancel(call._stream_call)
            call._stream_call = None
            self._wake_stream(flow)
        if call._probe:
            call._probe = False
            self.breakers.on_cancel(call.agent, now)

    def _free_slot(self, call: Call, now: float, *, done: bool) -> None:
        ticket = call._slot
        if ticket is None:
            return
        call._slot = None
        del self._by_ticket[ticket]
        if done and call._granted:
            self._grant(self.scheduler.release(ticket, now))
        else:
            self._grant(self.scheduler.cancel(ticket, now))
        call._granted = False

    def _grant(self, grants: list[Grant]) -> None:
        for g in grants:
            call = self._by_ticket.get(g.ticket)
            if call is not None:
                call._granted = True
                self._woken.append(call)

    def _reclaim(self, now: float) -> None:
        revoked, grants = self.scheduler.reclaim(now)
        for r in revoked:
            call = self._by_ticket.get(r.ticket)
            if call is not None and call._hop_call is None:
                if call._hop_queue is not None:
                    call._hop_queue.cancel(call)
                    call._hop_queue = None
                call._granted = False
                self._move(call, Stage.SLOT)
        self._grant(grants)

    def _pump(self, queue: WindowQueue[Call], now: float, stepping: Call | None = None) -> None:
        """Hand the room that opened in ``queue``'s window to its waiters (and
        wake them, but not ``stepping``: it is being stepped)."""
        for call, room in queue.pump():
            call._hop_queue = None
            call._hop_call = room
            call._hop_window = queue.window
            if call._slot is not None:
                # At once: a call handed its room is no idle slot to reclaim.
                self.scheduler.unblock(call._slot, now)
            if call is not stepping:
                self._woken.append(call)

    def _wake_stream(self, flow: StreamFlow) -> None:
        # Only this stream's own calls wait there (at most its fan-out).
        self._woken.extend(flow._waiting)

    def _pass_turn(self, call: Call) -> None:
        if call._holds_turn:
            call._holds_turn = False
            self._advance(call.flow)

    def _skip(self, flow: StreamFlow, turn: int) -> None:
        if turn == flow.turn:
            self._advance(flow)
        elif turn > flow.turn:
            flow._skipped.add(turn)

    def _advance(self, flow: StreamFlow) -> None:
        flow.turn += 1
        while flow.turn in flow._skipped:
            flow._skipped.discard(flow.turn)
            flow.turn += 1
        nxt = flow._turn_waiters.get(flow.turn)
        if nxt is not None:
            self._woken.append(nxt)

    @staticmethod
    def _hop_nack(call: Call, queue: WindowQueue[Call]) -> Nack:
        fit = queue.window.admit(call.estimate, qos=call.flow.qos)
        if fit.admitted:
            # It fits, but calls of its class order came first.
            reason = f"{len(queue) - 1} calls queued ahead in the next-hop's window"
            update: WindowUpdate | None = WindowUpdate(window=queue.window.effective())
        else:
            reason, update = fit.reason, fit.window_update
        return Nack(f"{call.agent}: next-hop window: {reason}; queued until the window opens", update)
