"""Dispatcher: fan a task out to its next-hops and merge what comes back (spec §5, §7,
§8 steps 3-6, §9, §10).

For one stream the dispatcher

1. calls every next-hop of the route in parallel, each call admitted in route
   order (best first, so the same task queues the same way every time) through
   the router-wide :class:`~atp_router.runtime.dataplane.gates.FlowGates` (their module
   doc, a-e): the next-hop's circuit breaker, the stream's window (a call that
   does not fit is NACKed with ``EWINDOW`` + WINDOW_UPDATE and waits visibly), a
   QoS slot (gold preempts bronze with ``EPREEMPT``), the next-hop's AIMD window
   and the budget ledger (``EBUDGET``). One attempt of one call — admit, run,
   release — is a :class:`~atp_router.runtime.dataplane.call.Caller`'s.

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
   so is a call whose reserve the shared store did not answer (``EBUDGET`` with
   ``retry_after_ms``: nothing was decided nor called), after ``retry_after_ms``;
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
   :data:`~atp_router.runtime.dataplane.gates.CANARY`, a small well-formed in-limit
   review the router runs itself on that next-hop
   (:meth:`~atp_router.runtime.dataplane.gates.FlowGates.canary`, outside any stream, window or budget;
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

A code-review task's diff is parsed once, before the fan-out
(:func:`~atp_router.runtime.dataplane.plan.parse_task_change`): every leg's prompt carries
it and the merge's evidence scorer gets its changed lines.

Budget exhaustion (§10 ``EBUDGET`` → FIN): once the committed spend of the stream's
account or of its client's reaches a limit, no further call is admitted (queued
next-hops and the escalation get ERROR ``EBUDGET`` "not called: budget exhausted");
calls in flight finish within their reservations. The router then sends the FINAL
of what was gathered and FIN; with nothing gathered, :meth:`Dispatcher.run` raises
``AgentError(EBUDGET)`` and the router ends the stream with ERROR ``EBUDGET`` + FIN.

The stream's WINDOW_UPDATE cadence (§5.4) is driven here too: one is sent when the
window moved by ≥ ``update_delta`` (checked after every send and completion) and
at the check every ``update_interval_ms`` when it changed at all, and every
``update_keepalive_ms`` (10 s by default) when it did not, while the task runs
(:meth:`Window.update_due <atp_router.flow.window.Window.update_due>`); the
periodic checks of every running task are one router-wide timer
(:mod:`~atp_router.runtime.dataplane.ticks`), not a trio task per stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from atp_router.adapters.base import ProviderAdapter
from atp_router.consensus.escalation import consensus_error, should_escalate
from atp_router.consensus.strategies import merge
from atp_router.consensus.types import (
    ANSWER_CHARS,
    AgentReport,
    Answer,
    FinalResult,
    Result,
    Telemetry,
)
from atp_router.flow.admission import StreamFlow
from atp_router.flow.breaker import BreakerState, RetryPolicy
from atp_router.flow.budget import BudgetLedger
from atp_router.runtime.dataplane.call import Caller, is_cancellation
from atp_router.runtime.dataplane.gates import FlowGates
from atp_router.runtime.dataplane.plan import (
    LegOutcome,
    StreamIO,
    TaskPlan,
    client_fault,
    hand_evidence,
    parse_task_change,
    review_files,
)
from atp_router.security.redact import scrub
from atp_router.wire.errors import AgentError, ATPError, ClientInputError, ErrorCode

if TYPE_CHECKING:
    from atp_router.policy.rib import EscalationSpec


#: Failures that a reroute to another next-hop can cure.
REROUTABLE = frozenset({ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN})
#: Prefix of the FINAL's ``consensus.uncertainties`` entry for each next-hop of the
#: route (or the escalation) whose last attempt failed — after its retries and
#: reroutes — while others answered: ``"next-hop failed: <agent>: <reason>"``.
#: The merged result then lacks that agent's view (an empty ``findings`` is not
#: "nothing found"); the A2A server fails such a task when nothing was found.
NEXT_HOP_FAILED = "next-hop failed: "


class Dispatcher:
    """Runs tasks over the adapters of one RIB generation.

    ``adapters`` maps agent names to live adapters; ``win_rates`` come from the
    RIB; ``sources`` maps agents to the independent source behind them
    (:func:`atp_router.policy.rib.independence_source`: agents on one model count once
    in consensus, spec §19); ``calibration`` maps agents to the function that
    turns a stated finding confidence into the measured one (RIB
    ``agents.<x>.calibration``); ``gates`` is the router-wide
    :class:`~atp_router.runtime.dataplane.gates.FlowGates`.
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
        """Fan out, merge, escalate; returns the FINAL result (spec §7.3; module
        doc, 1-4): the change parsed once for every leg and the merge, every
        next-hop of the route in parallel, each a leg of its own (its attempts,
        retries and reroutes) under the stream deadline — a turn the deadline
        cut gets its ETIMEOUT — then :meth:`_settle`; the window's periodic
        WINDOW_UPDATE check is filed with the router-wide
        :class:`~atp_router.runtime.dataplane.ticks.WindowTicks` meanwhile.

        Raises :class:`AgentError` when no next-hop produced a report at all:
        :class:`~atp_router.wire.errors.ClientInputError` (``EPROTO``, RST) when a
        next-hop refused the client's input, ``EBUDGET`` when the budget stopped
        it (the router ends the stream with ERROR + FIN), else ``EAGENTDOWN`` (RST).
        """
        if plan.flow is None:
            plan.flow = StreamFlow(plan.stream_id or plan.ledger_key, plan.window, plan.qos, self.ledger, plan.ledger_key)
        ticking = self.gates.ticks.add(plan.window, io.emit_window_update)
        try:
            await parse_task_change(plan)  # once per task: every leg and the merge share it
            hops = plan.route.next_hops
            plan.tried.update(h.agent for h in hops)
            legs: dict[int, LegOutcome] = {}
            with trio.move_on_at(plan.deadline) as deadline:
                if len(hops) == 1:
                    # The one leg in this task (a task of its own cost ~14 us); what it raises
                    # grouped as the nursery of several legs groups it (Cancelled included).
                    try:
                        await self._leg(io, plan, hops[0], legs, 0)
                    except BaseException as e:
                        raise BaseExceptionGroup("Exceptions from Trio nursery", [e]) from None
                else:
                    async with trio.open_nursery() as nursery:
                        for turn, hop in enumerate(hops):
                            nursery.start_soon(self._leg, io, plan, hop, legs, turn)
            if deadline.cancelled_caught:
                for turn, hop in enumerate(hops):
                    self._deadline_error(io, plan, legs, turn, hop.agent)
            return await self._settle(io, plan, legs)
        finally:
            self.gates.ticks.remove(ticking)

    async def _settle(self, io: StreamIO, plan: TaskPlan, legs: dict[int, LegOutcome]) -> FinalResult:
        """Merge the legs' reports, escalate when a trigger fires and the budget
        allows, then the FINAL or the error of no report (module doc, 2-4)."""
        result, reports = self._merge(plan)
        triggers = escalation_triggers(plan, result, reports, trio.current_time())
        if consensus_error(result) is not None:
            # Spec §10 ECONSENSUS: no quorum → escalate.
            io.emit_error(ErrorCode.ECONSENSUS, no_quorum_reason(plan, result, triggers))
        if triggers and plan.exhausted is None:
            result, reports = await self._escalate(io, plan, legs, reports)
        elif triggers:
            hop = plan.route.escalation_hop
            io.emit_error(ErrorCode.EBUDGET, f"{hop.agent} not called: budget exhausted ({plan.exhausted})",
                          agent=hop.agent)
            triggers = []
        if not reports:
            raise no_report_error(plan)
        result.consensus.uncertainties.extend(uncertainties(plan, legs, reports, triggers, self._down_reason))
        plan.triggers = triggers
        return FinalResult(result=result, telemetry=telemetry(plan, trio.current_time()))

    async def _escalate(self, io: StreamIO, plan: TaskPlan, legs: dict[int, LegOutcome],
                        reports: Mapping[str, AgentReport]) -> tuple[Result, dict[str, AgentReport]]:
        """Call the route's escalation next-hop as one more leg (§8 step 6; with
        the first stage's ``reports`` as evidence when the policy says so) under
        the stream deadline, and merge again."""
        route = plan.route
        hop = route.escalation_hop
        turn = len(route.next_hops)
        plan.tried.add(hop.agent)
        plan.escalated = True
        if getattr(getattr(route, "escalation", None), "evidence", False):
            hand_evidence(plan, reports)
        with trio.move_on_at(plan.deadline) as scope:
            await self._leg(io, plan, hop, legs, turn)
        if scope.cancelled_caught:
            self._deadline_error(io, plan, legs, turn, hop.agent)
        return self._merge(plan)

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
            files=review_files(plan.prompt),
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

    # ------------------------------------------------------------------ one next-hop

    async def _leg(self, io: StreamIO, plan: TaskPlan, hop: Any, legs: dict[int, LegOutcome], turn: int) -> None:
        """One next-hop of the route: attempts, retries and reroutes (module doc, 3)."""
        caller = Caller(self.adapters, self.gates, self.on_leg)
        attempt = 1
        first = True
        while True:
            out = LegOutcome(hop.agent, attempt=attempt)
            legs[turn] = out
            plan.attempts.append(out)
            try:
                await caller.attempt(io, plan, hop, out, turn if first else None)
            except BaseException as e:
                if is_cancellation(e):
                    out.cancelled = True
                raise
            first = False
            if out.error is None:
                return
            if client_fault(out.error):
                self._report(io, out, "")  # not retried nor rerouted: the same input fails everywhere
                return
            err = out.error
            agent = out.agent
            retry = self.gates.retry
            # EAGENTDOWN: fail over first; ETIMEOUT: retry first (spec §10 rows); a
            # timeout of the router's own (out.local) is retried first, as an ETIMEOUT.
            nxt = self._reroute(plan, agent) if err.code is ErrorCode.EAGENTDOWN and not out.local else None
            if nxt is None:
                delay = retry_delay(out, retry, self.gates.rng, trio.current_time(), plan.deadline)
                if delay is not None:
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
        circuits and agents without an adapter (:func:`reroute_target`). Marks
        the choice as tried."""
        hop = reroute_target(plan, agent, self.gates.breakers.open_agents(trio.current_time()), self.adapters)
        if hop is not None:
            plan.tried.add(hop.agent)
        return hop


# ------------------------------------------------------------------ decisions
# What to do next, from what the stream has gathered: functions of their arguments
# alone (the time ``now`` and the jitter's ``rng`` among them) that change nothing
# they are given but ``rng``; tests/unit/test_dispatch_decisions.py tables them.


def retry_delay(out: LegOutcome, retry: RetryPolicy, rng: random.Random, now: float,
                deadline: float) -> float | None:
    """Whether to retry the failed attempt ``out`` on the same next-hop (spec §10,
    :class:`~atp_router.flow.breaker.RetryPolicy`): the backoff in seconds (its
    jitter drawn from ``rng``), or ``None`` — the call never reached the
    adapter (unless its reserve was undecided: ``EBUDGET`` with ``retry_after_ms``,
    the shared store did not answer), the policy retries neither its code nor another attempt, or the
    retry would start at or after the stream ``deadline`` (trio seconds, as
    ``now``)."""
    err = out.error
    assert err is not None
    code = ErrorCode.ETIMEOUT if out.local else err.code  # the router's own timeout (LegOutcome.local)
    # A call that never reached its adapter is retried only when its reserve was
    # undecided (EBUDGET with retry_after_ms: the shared store did not answer).
    undecided = not out.called and code is ErrorCode.EBUDGET and err.retry_after_ms is not None
    if not (out.called or undecided) or not retry.should_retry(code, out.attempt, retry_after_ms=err.retry_after_ms):
        return None
    delay = retry.delay(out.attempt, rng, retry_after_ms=err.retry_after_ms)
    return delay if now + delay < deadline else None


def reroute_target(plan: TaskPlan, agent: str, open_now: Collection[str],
                   adapters: Mapping[str, ProviderAdapter]) -> Any | None:
    """The next-hop to fail over to from ``agent`` (spec §10): the first of its
    RIB fallback chain (``plan.fib``; a cycle ends the chain), then of the
    route's FIB alternates, that is not in ``plan.tried``, not in ``open_now``
    (open circuits) and has an adapter in ``adapters``; ``None`` when none is."""
    fib = plan.fib
    candidates: list[Any] = []
    if fib is not None:
        name = fib.fallback(agent)
        while name is not None and name not in {c.agent for c in candidates} and name != agent:
            hop = fib.next_hop(name, plan.prompt.meta)
            if hop is not None:
                candidates.append(hop)
            name = fib.fallback(name)
    candidates.extend(getattr(plan.route, "alternates", ()))
    for hop in candidates:
        if hop.agent not in plan.tried and hop.agent not in open_now and hop.agent in adapters:
            return hop
    return None


def escalation_triggers(plan: TaskPlan, result: Result, reports: Mapping[str, AgentReport],
                        now: float) -> list[str]:
    """The escalation triggers that fire for the first stage's merged ``result``
    and ``reports`` (spec §8 step 6, the policy's ``escalation.on``; ``bandit``
    when the policy's bandit chose "cheap then escalate" and nothing else
    fired). Empty when the route cannot escalate: it has no escalation next-hop,
    that agent already ran, the stream deadline has passed at ``now`` (trio
    seconds), or no next-hop answered and one refused the client's input (the
    escalation would refuse it too)."""
    route = plan.route
    esc: EscalationSpec | None = getattr(route, "escalation", None)
    refused = any(client_fault(o.error) for o in plan.attempts)
    if (esc is None or route.escalation_hop is None or esc.to in {o.agent for o in plan.attempts}
            or now >= plan.deadline or (refused and not reports)):
        return []
    triggers = should_escalate(result, reports, list(esc.on), threshold=esc.threshold,
                               files=review_files(plan.prompt))
    return triggers or (["bandit"] if plan.escalate else [])


def no_quorum_reason(plan: TaskPlan, result: Result, triggers: Sequence[str]) -> str:
    """The reason of the ERROR ``ECONSENSUS`` (spec §10) for a merge without
    quorum: the strategy, and whether it is escalated (``triggers`` fired and
    the budget is not exhausted) or why not."""
    esc: EscalationSpec | None = getattr(plan.route, "escalation", None)
    if triggers and plan.exhausted is None and esc is not None:
        what = f"escalating to {esc.to}"
    elif esc is None or plan.route.escalation_hop is None:
        what = "no escalation target"
    else:
        what = f"not escalated: {esc.to} already called, budget exhausted or deadline passed"
    return f"{result.consensus.strategy}: no quorum ({what})"


def no_report_error(plan: TaskPlan) -> AgentError:
    """The error :meth:`Dispatcher.run` raises when no next-hop produced a report
    (module doc, 3 and budget exhaustion): a
    :class:`~atp_router.wire.errors.ClientInputError` naming what the next-hops
    refused when one refused the client's input (its code when every refusal has
    the same one, else ``EPROTO``), ``EBUDGET`` when the budget stopped the
    stream (with ``retry_after_ms`` when every such refusal was a reserve the
    shared store did not answer: nothing spent, try again), ``ETIMEOUT`` when every next-hop that was tried timed out and none
    was skipped (a gateway timeout: HTTP 504), else ``EAGENTDOWN``; reasons
    scrubbed of secrets."""
    refused = [o for o in plan.attempts if client_fault(o.error)]
    if refused:
        codes = {o.error.code for o in refused if o.error}
        # One code everywhere is the stream's: a data-scope refusal ESEC (§11), a task
        # that ran past a tool's time ETIMEOUT; mixed or other refused input EPROTO.
        code = next(iter(codes)) if len(codes) == 1 else ErrorCode.EPROTO
        what = "task timed out: " if code is ErrorCode.ETIMEOUT else "task refused: "
        return ClientInputError(
            scrub(what + "; ".join(_agent_reason(o.agent, o.error) for o in refused if o.error)), code=code,
        )
    failed = scrub("; ".join([f"{o.agent}: {o.error.code} {o.error.reason}" for o in plan.attempts if o.error]
                             + [f"{a}: skipped at routing" for a in getattr(plan.route, "skipped", ())]))
    budget = [o.error for o in plan.attempts if o.error is not None and o.error.code is ErrorCode.EBUDGET]
    if plan.exhausted is None and budget and all(e.retry_after_ms is not None and not o.called
                                                 for o in plan.attempts if (e := o.error) in budget):
        # Every budget refusal was a reserve the shared store did not answer: nothing was
        # decided, so the budget is not spent — try again later (HTTP 503 + Retry-After).
        return AgentError(ErrorCode.EBUDGET, f"budget store unavailable: no next-hop could reserve ({failed}); retry",
                          retry_after_ms=max(e.retry_after_ms or 0 for e in budget))
    if plan.exhausted is not None or budget:
        return AgentError(ErrorCode.EBUDGET, f"budget exhausted before any next-hop answered ({failed})")
    codes = {o.error.code for o in plan.attempts if o.error is not None}
    if codes == {ErrorCode.ETIMEOUT} and not getattr(plan.route, "skipped", ()):
        return AgentError(ErrorCode.ETIMEOUT, f"every next-hop timed out ({failed})")
    return AgentError(ErrorCode.EAGENTDOWN, f"no next-hop produced a result ({failed or 'none ran'})")


def uncertainties(plan: TaskPlan, legs: Mapping[int, LegOutcome], reports: Mapping[str, AgentReport],
                  triggers: Sequence[str], down_reason: Callable[[str], str]) -> list[str]:
    """What the FINAL's ``consensus.uncertainties`` gain (module doc, 4): the
    escalation ``triggers`` that fired; each agent the FIB left out of the route
    that did not report (``down_reason(agent)`` says why it was down); and the
    failure of each turn of ``legs`` its retries and reroutes did not mend
    (:data:`NEXT_HOP_FAILED`, at most 500 characters, scrubbed)."""
    notes: list[str] = []
    if triggers:
        notes.append("escalated on " + ", ".join(triggers))
    for agent in getattr(plan.route, "skipped", ()):
        # Left out of the route at SYN (module doc, 4): the review lacks its view.
        if agent not in reports:
            notes.append(f"{NEXT_HOP_FAILED}{agent}: {ErrorCode.EAGENTDOWN}: skipped at routing: {down_reason(agent)}")
    for _, out in sorted(legs.items()):
        # The final outcome of each turn: a failure its retries and reroutes did not mend.
        if out.error is not None and not out.cancelled:
            reason = out.error.reason.removeprefix(out.agent + ": ")
            note = scrub(f"{NEXT_HOP_FAILED}{out.agent}: {out.error.code}: {reason}")
            notes.append(note[:500])
    return notes


def telemetry(plan: TaskPlan, now: float) -> Telemetry:
    """The FINAL's telemetry (spec §7.3): what the stream was charged — never
    above its budget — and its latency from SYN to ``now`` (trio seconds), in ms;
    the class asked and served when the tenant's ``qos_max`` lowered it."""
    tokens = sum(o.charged_tokens for o in plan.attempts)
    usd_micros = sum(o.charged_usd_micros for o in plan.attempts)
    clamped = plan.qos_asked is not None
    return Telemetry(tokens=tokens, usd=usd_micros / 1_000_000,
                     latency_ms=round((now - plan.started) * 1000, 3),
                     qos_asked=plan.qos_asked, qos_served=plan.qos if clamped else None)


def _agent_reason(agent: str, err: ATPError) -> str:
    """``err.reason`` prefixed with ``agent`` unless it already starts with it."""
    return err.reason if err.reason.startswith(agent) else f"{agent}: {err.reason}"
