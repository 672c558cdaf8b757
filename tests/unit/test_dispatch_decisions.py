"""The dispatcher's decisions as functions (atp_router.runtime.dataplane.dispatch,
"decisions"; spec §8 step 6, §10), table-tested without a dispatcher or a clock:
retry or not, where to reroute, which escalation triggers fire, what error a
stream without a report gets, and what its FINAL's uncertainties gain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from atp_router.adapters.base import Prompt
from atp_router.consensus.strategies import merge
from atp_router.consensus.types import AgentReport, Result
from atp_router.flow.breaker import RetryPolicy
from atp_router.flow.window import Window as FlowWindow
from atp_router.policy.fib import NextHop, Route
from atp_router.policy.rib import EscalationSpec
from atp_router.runtime.dataplane.dispatch import (
    NEXT_HOP_FAILED,
    escalation_triggers,
    no_quorum_reason,
    no_report_error,
    reroute_target,
    retry_delay,
    uncertainties,
)
from atp_router.runtime.dataplane.plan import LegOutcome, TaskPlan
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import QoS, Window

ROOMY = Window(max_parallel=8, max_tokens=1_000_000, max_usd_micros=10_000_000)


def hop(agent: str) -> NextHop:
    return NextHop(agent=agent, weight=1.0, qos=QoS.SILVER, timeout_ms=10_000)


def route(*agents: str, escalate_to: str | None = None, on: tuple[str, ...] = ("no_findings",),
          alternates: tuple[str, ...] = (), skipped: tuple[str, ...] = ()) -> Route:
    esc = EscalationSpec(on=list(on), to=escalate_to) if escalate_to is not None else None
    return Route(policy="p", next_hops=[hop(a) for a in agents], escalation=esc,
                 escalation_hop=hop(escalate_to) if escalate_to is not None else None, budget=None, window=None,
                 consensus="union_tiebreak", qos=QoS.SILVER, deadline_ms=60_000,
                 alternates=[hop(a) for a in alternates], skipped=list(skipped))


@dataclass
class Fallbacks:
    """A FIB as reroute_target reads it: each agent's RIB fallback, and which agents it has."""

    fallbacks: dict[str, str] = field(default_factory=dict)
    missing: frozenset[str] = frozenset()

    def fallback(self, agent: str) -> str | None:
        return self.fallbacks.get(agent)

    def next_hop(self, agent: str, meta: object) -> NextHop | None:
        return None if agent in self.missing else hop(agent)


def plan_of(r: Route, *attempts: LegOutcome, fib: object = None, tried: tuple[str, ...] = (),
            escalate: bool = False, deadline: float = 100.0) -> TaskPlan:
    p = TaskPlan(prompt=Prompt(task_type="code_review", content={"diff": "", "files": {}}), route=r,
                 window=FlowWindow(ROOMY), ledger_key="s", qos=QoS.SILVER, started=0.0, deadline=deadline, fib=fib,
                 escalate=escalate)
    p.attempts.extend(attempts)
    p.tried.update(tried)
    return p


def failed(agent: str, code: ErrorCode, reason: str = "failed", *, called: bool = True, attempt: int = 1,
           retry_after_ms: int | None = None) -> LegOutcome:
    return LegOutcome(agent, error=AgentError(code, reason, agent=agent, retry_after_ms=retry_after_ms),
                      called=called, attempt=attempt)


def refused(agent: str, code: ErrorCode, reason: str = "refused") -> LegOutcome:
    return LegOutcome(agent, error=ClientInputError(reason, code=code, agent=agent), called=True)


def merged(reports: dict[str, AgentReport]) -> Result:
    return merge(reports, strategy="union_tiebreak", win_rates={a: 0.5 for a in reports},
                 costs_usd_micros={a: 0 for a in reports}, files=None)


# ------------------------------------------------------------------ retry_delay

RETRY = RetryPolicy(max_attempts=2, base_backoff_s=0.2, max_backoff_s=2.0, jitter=0.0)


@pytest.mark.parametrize(("out", "now", "expected"), [
    (failed("a", ErrorCode.ETIMEOUT), 0.0, 0.2),  # ETIMEOUT: retried with backoff
    (failed("a", ErrorCode.ETIMEOUT), 99.9, None),  # the retry would start past the deadline
    (failed("a", ErrorCode.ETIMEOUT, called=False), 0.0, None),  # never reached the adapter
    (failed("a", ErrorCode.ETIMEOUT, attempt=2), 0.0, None),  # attempts spent
    (failed("a", ErrorCode.EPROTO), 0.0, None),  # not a retryable code
    (failed("a", ErrorCode.EAGENTDOWN), 0.0, None),  # down without a hint: reroute, not retry
    (failed("a", ErrorCode.EAGENTDOWN, retry_after_ms=500), 0.0, 0.5),  # a short hint: its wait
    (failed("a", ErrorCode.EAGENTDOWN, called=False, retry_after_ms=500), 0.0, None),  # circuit open: not called
    (failed("a", ErrorCode.EBUDGET, called=False), 0.0, None),  # a budget that does not fit
    # A reserve the shared store did not answer: nothing decided, nothing called — after its hint.
    (failed("a", ErrorCode.EBUDGET, called=False, retry_after_ms=1000), 0.0, 1.0),
    (failed("a", ErrorCode.EBUDGET, called=False, retry_after_ms=1000, attempt=2), 0.0, None),
    (failed("a", ErrorCode.EBUDGET, retry_after_ms=1000), 99.5, None),  # past the deadline
])
def test_retry_delay(out: LegOutcome, now: float, expected: float | None) -> None:
    assert retry_delay(out, RETRY, random.Random(1), now, 100.0) == expected


# ------------------------------------------------------------------ reroute_target

@pytest.mark.parametrize(("fib", "alternates", "tried", "open_now", "adapters", "expected"), [
    (Fallbacks({"a": "b", "b": "c"}), ("d",), ("a",), (), "abcd", "b"),  # the fallback first
    (Fallbacks({"a": "b", "b": "c"}), ("d",), ("a", "b"), (), "abcd", "c"),  # down the chain
    (Fallbacks({"a": "b", "b": "c"}), ("d",), ("a",), ("b",), "abcd", "c"),  # an open circuit is skipped
    (Fallbacks({"a": "b", "b": "c"}), ("d",), ("a",), (), "acd", "c"),  # so is an agent without an adapter
    (Fallbacks({"a": "b"}, missing=frozenset("b")), ("d",), ("a",), (), "abd", "d"),  # not in the FIB
    (Fallbacks({"a": "b", "b": "a"}), ("d",), ("a", "b"), (), "abd", "d"),  # a cycle ends the chain
    (None, ("d", "e"), ("a", "d"), (), "ade", "e"),  # no FIB: the route's alternates
    (None, ("d",), ("a", "d"), (), "ad", None),  # nothing left
])
def test_reroute_target(fib: Fallbacks | None, alternates: tuple[str, ...], tried: tuple[str, ...],
                        open_now: tuple[str, ...], adapters: str, expected: str | None) -> None:
    p = plan_of(route("a", alternates=alternates), fib=fib, tried=tried)
    got = reroute_target(p, "a", set(open_now), dict.fromkeys(adapters))
    assert (got.agent if got is not None else None) == expected
    assert p.tried == set(tried)  # choosing marks nothing: the dispatcher does


# ------------------------------------------------------------------ escalation

ANSWERED = LegOutcome("a", report=AgentReport(summary="nothing to see"), called=True)


@pytest.mark.parametrize(("p", "now", "expected"), [
    (plan_of(route("a", escalate_to="big"), ANSWERED), 0.0, ["no_findings"]),
    (plan_of(route("a"), ANSWERED), 0.0, []),  # no escalation next-hop
    (plan_of(route("a", escalate_to="big"), ANSWERED), 100.0, []),  # the deadline has passed
    (plan_of(route("a", escalate_to="big"), ANSWERED, LegOutcome("big", called=True)), 0.0, []),  # already ran
    (plan_of(route("a", escalate_to="big", on=("low_conf",)), ANSWERED), 0.0, []),  # its trigger did not fire
    (plan_of(route("a", escalate_to="big", on=("low_conf",)), ANSWERED, escalate=True), 0.0, ["bandit"]),
])
def test_escalation_triggers(p: TaskPlan, now: float, expected: list[str]) -> None:
    reports = {o.agent: o.report for o in p.attempts if o.report is not None}
    assert escalation_triggers(p, merged(reports), reports, now) == expected


def test_no_escalation_when_every_next_hop_refused_the_input() -> None:
    """The escalation would refuse the same input: no trigger, not even the bandit's."""
    p = plan_of(route("a", escalate_to="big"), refused("a", ErrorCode.ESEC), escalate=True)
    assert escalation_triggers(p, merged({}), {}, 0.0) == []


@pytest.mark.parametrize(("r", "triggers", "what"), [
    (route("a", escalate_to="big"), ["no_quorum"], "escalating to big"),
    (route("a"), [], "no escalation target"),
    (route("a", escalate_to="big"), [], "not escalated: big already called, budget exhausted or deadline passed"),
])
def test_no_quorum_reason(r: Route, triggers: list[str], what: str) -> None:
    result = merged({})
    assert no_quorum_reason(plan_of(r), result, triggers) == f"{result.consensus.strategy}: no quorum ({what})"


# ------------------------------------------------------------------ no report

@pytest.mark.parametrize(("attempts", "cls", "code", "start"), [
    ((refused("a", ErrorCode.ESEC), refused("b", ErrorCode.ESEC)), ClientInputError, ErrorCode.ESEC,
     "task refused: a: refused; b: refused"),
    ((refused("a", ErrorCode.ETIMEOUT),), ClientInputError, ErrorCode.ETIMEOUT, "task timed out: a: refused"),
    ((refused("a", ErrorCode.ESEC), refused("b", ErrorCode.ETIMEOUT)), ClientInputError, ErrorCode.EPROTO,
     "task refused: "),
    ((failed("a", ErrorCode.EBUDGET, "not called"),), AgentError, ErrorCode.EBUDGET,
     "budget exhausted before any next-hop answered (a: EBUDGET not called; z: skipped at routing)"),
    # A reserve the shared store did not answer, every time: not spent — retry (503), not "exhausted" (402).
    ((failed("a", ErrorCode.EBUDGET, "store down", called=False, retry_after_ms=1000),), AgentError,
     ErrorCode.EBUDGET, "budget store unavailable: no next-hop could reserve (a: EBUDGET store down"),
    ((failed("a", ErrorCode.EBUDGET, "store down", called=False, retry_after_ms=1000),
      failed("b", ErrorCode.EBUDGET, "not called")), AgentError, ErrorCode.EBUDGET,
     "budget exhausted before any next-hop answered"),
    ((failed("a", ErrorCode.ETIMEOUT, "slow"),), AgentError, ErrorCode.EAGENTDOWN,
     "no next-hop produced a result (a: ETIMEOUT slow; z: skipped at routing)"),
    ((), AgentError, ErrorCode.EAGENTDOWN, "no next-hop produced a result (z: skipped at routing)"),
])
def test_no_report_error(attempts: tuple[LegOutcome, ...], cls: type[AgentError], code: ErrorCode,
                         start: str) -> None:
    e = no_report_error(plan_of(route("a", "b", skipped=("z",)), *attempts))
    assert type(e) is cls and e.code is code and e.reason.startswith(start)


@pytest.mark.parametrize(("attempts", "code", "start"), [
    ((failed("a", ErrorCode.ETIMEOUT, "slow"),), ErrorCode.ETIMEOUT, "every next-hop timed out (a: ETIMEOUT slow)"),
    ((failed("a", ErrorCode.ETIMEOUT, "slow"), failed("b", ErrorCode.ETIMEOUT, "slow too")), ErrorCode.ETIMEOUT,
     "every next-hop timed out (a: ETIMEOUT slow; b: ETIMEOUT slow too)"),
    ((failed("a", ErrorCode.ETIMEOUT, "slow"), failed("b", ErrorCode.EAGENTDOWN, "500")), ErrorCode.EAGENTDOWN,
     "no next-hop produced a result (a: ETIMEOUT slow; b: EAGENTDOWN 500)"),
])
def test_only_timeouts_with_nothing_skipped_are_a_gateway_timeout(attempts: tuple[LegOutcome, ...],
                                                                 code: ErrorCode, start: str) -> None:
    """Issue 24: a stream whose only next-hops all timed out ends ETIMEOUT (HTTP 504), not EAGENTDOWN."""
    e = no_report_error(plan_of(route("a", "b"), *attempts))
    assert type(e) is AgentError and e.code is code and e.reason.startswith(start)


def test_uncertainties_name_triggers_skipped_agents_and_unmended_failures_in_turn_order() -> None:
    legs = {1: failed("b", ErrorCode.ETIMEOUT, "b: no answer within 10 ms"), 0: ANSWERED,
            2: LegOutcome("c", cancelled=True, error=AgentError(ErrorCode.ETIMEOUT, "cut"))}
    notes = uncertainties(plan_of(route("a", "b", "c", skipped=("y", "a"))), legs, {"a": ANSWERED.report},
                          ["no_findings"], lambda agent: f"circuit of {agent} open")
    assert notes == [
        "escalated on no_findings",
        f"{NEXT_HOP_FAILED}y: EAGENTDOWN: skipped at routing: circuit of y open",  # "a" reported after all
        f"{NEXT_HOP_FAILED}b: ETIMEOUT: no answer within 10 ms",  # a cancelled turn is not named
    ]
