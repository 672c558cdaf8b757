"""Dispatcher: fan a task out to its next-hops and merge what comes back (spec §5, §7, §8 steps 3-6).

For one stream the dispatcher

1. calls every next-hop of the route in parallel, each call admitted against the
   stream's window (parallel / tokens / USD micros, §5.1) from the adapter's
   preflight ``estimate`` (§5.2) and against the budget ledger (reserve → commit).
   A fan-out wider than the window is queued inside the router: next-hops are
   admitted in route order (best first), and one that does not fit waits, under
   the stream deadline, until a call in flight completes. It is refused with
   ``EWINDOW`` (plus the WINDOW_UPDATE in force) only when its estimate alone
   exceeds the window, i.e. it could never fit;
2. runs each call under its own overall deadline (``trio.fail_after``) and the
   stream's deadline; a call whose streamed usage passes what the budget can
   still take (its reservation plus the free headroom) is cut with ``EBUDGET``;
   what a call used is committed whatever its outcome. The adapter's fragments
   travel as a leg of PARTIAL frames
   with ``MORE`` through a :class:`~atp.wire.reassembly.Reassembler` (the same path
   a remote agent's frames take) and are forwarded to the client as PARTIAL events;
3. merges the agents' reports by the route's consensus strategy (§7.2) and, when an
   escalation trigger fires (§8 step 6), calls the escalation next-hop and merges
   again;
4. returns the FINAL result in the shape of §7.3 with telemetry.

Failures of one next-hop never end the stream: they are reported as ERROR events
(``ETIMEOUT``, ``EAGENTDOWN``, ``EWINDOW``, ``EBUDGET``) and the merge goes on with
the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import trio

from atp.adapters.base import Fragment, ProviderAdapter, Prompt
from atp.consensus.escalation import should_escalate
from atp.consensus.strategies import merge
from atp.consensus.types import AgentReport, FinalResult, Telemetry, Usage
from atp.flow.budget import BudgetLedger, Refusal, Reservation, usd_to_micros
from atp.flow.window import Estimate, InFlight, Window as FlowWindow
from atp.wire.errors import AgentError, ATPError, ErrorCode
from atp.wire.frame import Flag, Frame, Payload, PayloadType
from atp.wire.reassembly import MessageComplete, Reassembler


class StreamIO(Protocol):
    """What the dispatcher needs from the stream it serves (implemented by the router)."""

    stream_id: str

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None: ...

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None: ...

    def emit_window_update(self, update: Any) -> None: ...


@dataclass(slots=True)
class LegOutcome:
    """What one next-hop call produced."""

    agent: str
    report: AgentReport | None = None
    text: str = ""
    usage: Usage = field(default_factory=Usage)
    error: ATPError | None = None
    latency_ms: float = 0.0
    #: Cancelled (stream deadline or reset) before it answered; no ERROR emitted yet.
    cancelled: bool = False


@dataclass(slots=True)
class TaskPlan:
    """Everything the dispatcher needs to run one stream's task."""

    prompt: Prompt
    route: Any  # atp.policy.fib.Route
    window: FlowWindow
    ledger_key: str
    qos: Any  # atp.wire.frame.QoS
    started: float  # trio.current_time() at SYN
    deadline: float  # absolute trio time
    #: Woken whenever a call leaves the window or a next-hop's turn passes.
    slot_freed: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    #: Index (in route order) of the next-hop whose admission is being decided.
    admit_turn: int = 0


class Dispatcher:
    """Runs tasks over the adapters of the running RIB.

    ``adapters`` maps agent names to live adapters; ``win_rates`` and per-agent costs
    come from the RIB. ``on_leg`` is called after every next-hop call (metrics, FIB
    health feedback).
    """

    def __init__(
        self,
        adapters: Mapping[str, ProviderAdapter],
        ledger: BudgetLedger,
        *,
        win_rates: Mapping[str, float],
        on_leg: Callable[[LegOutcome], None] | None = None,
    ):
        self.adapters = adapters
        self.ledger = ledger
        self.win_rates = win_rates
        self.on_leg = on_leg

    async def run(self, io: StreamIO, plan: TaskPlan) -> FinalResult:
        """Fan out, merge, escalate; returns the FINAL result (spec §7.3).

        Raises :class:`AgentError` (``EAGENTDOWN``) only when no next-hop produced
        a report at all.
        """
        route = plan.route
        outcomes: dict[str, LegOutcome] = {}
        with trio.move_on_at(plan.deadline) as scope:
            async with trio.open_nursery() as nursery:
                for turn, hop in enumerate(route.next_hops):
                    nursery.start_soon(self._leg, io, plan, hop, outcomes, turn)
        if scope.cancelled_caught:
            for hop in route.next_hops:
                self._deadline_error(io, hop.agent, outcomes)

        result, reports = self._merge(plan, outcomes)
        esc = getattr(route, "escalation", None)
        triggers: list[str] = []
        if esc is not None and esc.to not in outcomes and trio.current_time() < plan.deadline:
            triggers = should_escalate(
                result, reports, list(esc.on), threshold=esc.threshold, files=plan.prompt.content.get("files")
            )
            if triggers:
                hop = route.escalation_hop
                with trio.move_on_at(plan.deadline) as esc_scope:
                    await self._leg(io, plan, hop, outcomes, len(route.next_hops))
                if esc_scope.cancelled_caught:
                    self._deadline_error(io, hop.agent, outcomes)
                result, reports = self._merge(plan, outcomes)
        if not reports:
            errors = "; ".join(f"{o.agent}: {o.error.code} {o.error.reason}" for o in outcomes.values() if o.error)
            raise AgentError(ErrorCode.EAGENTDOWN, f"no next-hop produced a result ({errors or 'none ran'})")
        if triggers:
            result.consensus.uncertainties.append("escalated on " + ", ".join(triggers))
        usage = Usage()
        for o in outcomes.values():
            usage = usage + o.usage
        telemetry = Telemetry(
            tokens=usage.tokens,
            usd=usage.usd_micros / 1_000_000,
            latency_ms=round((trio.current_time() - plan.started) * 1000, 3),
        )
        self.last_triggers = triggers
        return FinalResult(result=result, telemetry=telemetry)

    @staticmethod
    def _deadline_error(io: StreamIO, agent: str, outcomes: dict[str, LegOutcome]) -> None:
        """ETIMEOUT for a next-hop the stream deadline cut (queued or in its call)."""
        out = outcomes.get(agent)
        if out is not None and not out.cancelled:
            return  # it finished (report or error) before the deadline
        reason = "stream deadline reached before the next-hop answered"
        if out is None:
            out = outcomes[agent] = LegOutcome(agent)
        out.error = AgentError(ErrorCode.ETIMEOUT, reason, agent=agent)
        out.cancelled = False
        io.emit_error(ErrorCode.ETIMEOUT, f"{agent}: {reason}", agent=agent)

    def _merge(self, plan: TaskPlan, outcomes: Mapping[str, LegOutcome]):
        reports = {a: o.report for a, o in outcomes.items() if o.report is not None}
        costs = {a: o.usage.usd_micros for a, o in outcomes.items()}
        result = merge(
            reports,
            strategy=plan.route.consensus,
            win_rates={a: self.win_rates.get(a, 0.5) for a in reports},
            costs_usd_micros=costs,
            files=plan.prompt.content.get("files"),
        )
        return result, reports

    async def _leg(self, io: StreamIO, plan: TaskPlan, hop: Any, outcomes: dict[str, LegOutcome], turn: int) -> None:
        agent = hop.agent
        out = LegOutcome(agent)
        outcomes[agent] = out
        try:
            admitted = await self._admit(io, plan, agent, out, turn)
        except trio.Cancelled:
            out.cancelled = True
            raise
        if admitted is None:
            return
        adapter, reservation, in_flight = admitted
        t0 = trio.current_time()
        timely = False
        try:
            with trio.fail_after(hop.timeout_ms / 1000):
                await self._pump(io, plan, agent, adapter, out, reservation)
            timely = True
        except trio.TooSlowError:
            out.error = AgentError(ErrorCode.ETIMEOUT, f"no answer within {hop.timeout_ms} ms", agent=agent)
        except ATPError as e:
            out.error = e
        except trio.Cancelled:
            out.cancelled = True
            out.error = AgentError(ErrorCode.ETIMEOUT, "cancelled before the next-hop answered", agent=agent)
            raise
        finally:
            out.latency_ms = (trio.current_time() - t0) * 1000
            # Commit what was actually used, even on failure or cancellation (§5, DESIGN principle 4).
            self.ledger.commit(reservation, out.usage.tokens, out.usage.usd_micros)
            plan.window.on_complete(in_flight, out.usage.tokens, out.usage.usd_micros, ok=out.error is None, timely=timely)
            plan.slot_freed.unpark_all()
            if self.on_leg is not None:
                self.on_leg(out)
        if out.error is not None:
            io.emit_error(
                out.error.code, f"{agent}: {out.error.reason}", agent=agent, retry_after_ms=out.error.retry_after_ms
            )

    async def _admit(
        self, io: StreamIO, plan: TaskPlan, agent: str, out: LegOutcome, turn: int
    ) -> tuple[ProviderAdapter, Reservation, InFlight] | None:
        """Admit one next-hop call: wait for its ``turn`` (next-hops are admitted in
        route order, best first, so the same task queues the same way every time),
        then for room in the stream's window, then reserve its estimate on the
        budget ledger. Returns ``None`` after emitting the ERROR when it is refused:
        EAGENTDOWN (no adapter), the estimate's error, EWINDOW (the estimate alone
        exceeds the window), EBUDGET (the reservation does not fit)."""
        while plan.admit_turn != turn:
            await plan.slot_freed.park()
        try:
            adapter = self.adapters.get(agent)
            if adapter is None:
                out.error = AgentError(ErrorCode.EAGENTDOWN, "next-hop has no adapter in the running RIB", agent=agent)
                io.emit_error(out.error.code, f"{agent}: {out.error.reason}", agent=agent)
                return None
            try:
                est = adapter.estimate(plan.prompt)
            except ATPError as e:
                out.error = e
                io.emit_error(e.code, f"{agent}: {e.reason}", agent=agent)
                return None
            estimate = Estimate(tokens=est.in_tokens + est.out_tokens, usd_micros=usd_to_micros(est.usd))
            while True:
                admission = plan.window.admit(estimate, qos=plan.qos)
                if admission.admitted:
                    break
                if plan.window.in_flight == 0:
                    # Nothing in flight and still refused: this call can never fit.
                    out.error = AgentError(ErrorCode.EWINDOW, admission.reason, agent=agent)
                    io.emit_error(ErrorCode.EWINDOW, f"{agent}: {admission.reason}", agent=agent)
                    if admission.window_update is not None:
                        io.emit_window_update(admission.window_update)
                    return None
                await plan.slot_freed.park()
            reservation = self.ledger.reserve(plan.ledger_key, estimate.tokens, estimate.usd_micros)
            if isinstance(reservation, Refusal):
                out.error = AgentError(ErrorCode.EBUDGET, reservation.reason, agent=agent)
                io.emit_error(ErrorCode.EBUDGET, f"{agent} not called: {reservation.reason}", agent=agent)
                return None
            return adapter, reservation, plan.window.on_send(estimate, qos=plan.qos)
        finally:
            plan.admit_turn += 1
            plan.slot_freed.unpark_all()

    async def _pump(self, io: StreamIO, plan: TaskPlan, agent: str, adapter: ProviderAdapter, out: LegOutcome,
                    reservation: Reservation) -> None:
        """Iterate the adapter's fragments as one reassembled leg message.

        Raises AgentError(EBUDGET) as soon as the cumulative usage of a PARTIAL
        passes what the stream's budget can still take: this call's reservation plus the free
        headroom of the account chain (the call is cut, §5 / DESIGN principle 4)."""
        reasm = Reassembler()
        frag_seq = 0
        final: Fragment | None = None
        async with aclosing(adapter.stream(plan.prompt)) as fragments:
            async for frag in fragments:
                if frag.usage is not None:
                    out.usage = frag.usage
                if frag.usage is not None and frag.type is not PayloadType.FINAL:
                    # A FINAL means the call is over: its spend is committed as is.
                    free = self.ledger.remaining(plan.ledger_key)
                    over_t = free.tokens is not None and out.usage.tokens > reservation.tokens + free.tokens
                    over_u = free.usd_micros is not None and out.usage.usd_micros > reservation.usd_micros + free.usd_micros
                    if over_t or over_u:
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
                    reasm.add(_leg_frame(plan, agent, frag_seq, frag.content, more=True))
                    frag_seq += 1
                    io.emit_partial(agent, {"agent": agent, "delta": frag.content}, confidence=frag.confidence)
        if final is None:
            raise AgentError(ErrorCode.EPROTO, "next-hop ended without a FINAL fragment", agent=agent)
        for ev in reasm.add(_leg_frame(plan, agent, frag_seq, "", more=False)):
            if isinstance(ev, MessageComplete):
                out.text = ev.payload.content or ""
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


def _leg_frame(plan: TaskPlan, agent: str, frag_seq: int, text: str, *, more: bool) -> Frame:
    return Frame(
        v=1,
        session_id=agent,
        stream_id=plan.ledger_key,
        msg_seq=0,
        frag_seq=frag_seq,
        flags=[Flag.MORE] if more else [],
        payload=Payload(type=PayloadType.PARTIAL, content=text),
    )
