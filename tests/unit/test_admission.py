"""Admission of next-hop calls through every flow gate as one sans-IO object
(atp_router.flow.admission; spec §5.1–§5.4, §9, §10 EAGENTDOWN / EWINDOW / EBUDGET /
EPREEMPT). Synchronous: no trio, time is an argument."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from atp_router.flow.admission import (
    NOT_RUN,
    TRANSITIONS,
    AdmissionControl,
    Admit,
    Call,
    Outcome,
    Refuse,
    Stage,
    StreamFlow,
    Wait,
)
from atp_router.flow.breaker import BreakerBoard
from atp_router.flow.budget import Allowance, BudgetLedger, Refusal, Reservation
from atp_router.flow.qos import QosScheduler
from atp_router.flow.window import Estimate, WindowTable
from atp_router.flow.window import Window as FlowWindow
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS, WindowUpdate
from atp_router.wire.frame import Window as W

G, S, B = QoS.GOLD, QoS.SILVER, QoS.BRONZE
ROOMY = W(max_parallel=4, max_tokens=10_000, max_usd_micros=100_000)
HOP = W(max_parallel=2, max_tokens=10_000, max_usd_micros=100_000)
UNLIMITED = Allowance()
EST = Estimate(tokens=400, usd_micros=800)
OK = Outcome(tokens=350, usd_micros=700, timely=True)


@dataclass
class Env:
    """One router's gates, a ledger with a client account, and a clock."""

    adm: AdmissionControl
    ledger: BudgetLedger
    breakers: BreakerBoard
    windows: WindowTable
    sched: QosScheduler
    now: float = 100.0
    flows: list[StreamFlow] = field(default_factory=list)

    def flow(self, qos: QoS = S, *, window: W = ROOMY, budget: Allowance = UNLIMITED,
             name: str | None = None) -> StreamFlow:
        sid = name or f"stream:{len(self.flows)}"
        self.ledger.open(sid, budget, parent="client")
        f = StreamFlow(sid, FlowWindow(window), qos, self.ledger, sid)
        self.flows.append(f)
        return f

    def call(self, flow: StreamFlow, agent: str = "a", est: Estimate = EST, turn: int | None = None) -> Call:
        return self.adm.begin(flow, agent, est, turn=turn)

    def step(self, call: Call):
        return self.adm.step(call, self.now)

    def release(self, call: Call, outcome: Outcome = OK):
        return self.adm.release(call, outcome, self.now)

    def hop(self, agent: str = "a"):
        return self.windows.window(agent).statistics()


def make(*, capacity: int = 4, gold_reserved: int = 1, agent_window: W = HOP,
         limits: dict[str, W | None] | None = None, client: Allowance = UNLIMITED, **qos_kw) -> Env:
    breakers = BreakerBoard(failure_threshold=2, window_s=30.0, base_backoff_s=1.0, max_backoff_s=1.0, jitter=0.0,
                            rng=random.Random(1))
    windows = WindowTable(agent_window, limits)
    sched = QosScheduler(capacity, gold_reserved=gold_reserved, **qos_kw)
    ledger = BudgetLedger()
    ledger.open("client", client)
    return Env(AdmissionControl(breakers, windows, sched), ledger, breakers, windows, sched)


def waits(d, stage: Stage, *, nack: bool = False) -> bool:
    """``d`` is a :class:`Wait` at ``stage``, with a NACK or not."""
    return isinstance(d, Wait) and d.on is stage and (d.nack is not None) == nack


def assert_nothing_held(env: Env, *flows: StreamFlow) -> None:
    """Every window empty, no slot held or queued, no reservation open, no one queued at a next-hop."""
    for f in flows or env.flows:
        assert f.window.in_flight == 0 and f.window.tokens_in_flight == 0 and f.window.usd_micros_in_flight == 0
        assert not f._waiting and not f._turn_waiters
        assert env.ledger.state(f.ledger_key).open_reservations == 0
        assert env.ledger.state(f.ledger_key).reserved_tokens == 0
    for agent, w in env.windows.statistics().items():
        assert w.in_flight == 0 and w.tokens_in_flight == 0, agent
        assert len(env.windows.queue(agent)) == 0, agent
    q = env.sched.statistics()
    assert q.running == 0 and q.queued == 0
    assert q.gold.blocked == q.silver.blocked == q.bronze.blocked == 0
    assert env.ledger.state("client").reserved_tokens == 0
    assert not env.adm._by_ticket


# ------------------------------------------------------------------ admitted at once


def test_a_call_that_fits_everywhere_is_admitted_at_once_and_holds_one_of_each():
    env = make()
    f = env.flow()
    c = env.call(f)
    d = env.step(c)
    assert isinstance(d, Admit) and c.stage is Stage.ADMITTED
    assert d.reservation == Reservation(id=d.reservation.id, key=f.ledger_key, tokens=400, usd_micros=800)
    assert d.stream_update == WindowUpdate(window=f.window.effective())  # the first one is due at once (§5.4)
    assert f.window.in_flight == 1 and f.window.tokens_in_flight == 400
    assert env.hop().in_flight == 1 and env.hop().tokens_in_flight == 400
    assert env.sched.statistics().running == 1
    assert env.ledger.state(f.ledger_key).reserved_tokens == 400

    r = env.release(c, OK)
    assert (r.charge.tokens, r.charge.usd_micros) == (350, 700)
    assert env.ledger.state(f.ledger_key).committed_tokens == 350
    assert env.ledger.state("client").committed_usd_micros == 700
    assert env.hop().completed == 1 and env.hop().used_tokens == 350
    assert env.breakers.statistics()["a"].successes == 1
    assert c.stage is Stage.RELEASED
    assert_nothing_held(env)


# ------------------------------------------------------------------ each gate refusing


def test_an_exhausted_budget_refuses_before_any_gate_is_taken():
    env = make()
    f = env.flow(budget=Allowance(tokens=1000))
    first = env.call(f)
    assert isinstance(env.step(first), Admit)
    env.release(first, Outcome(tokens=1000, usd_micros=0, timely=True))
    assert f.exhausted == "'stream:0' tokens 1000/1000"
    d = env.step(env.call(f, "b"))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EBUDGET
    assert d.reason == "b not called: budget exhausted ('stream:0' tokens 1000/1000)"
    assert "b" not in env.breakers.statistics()  # the breaker was not even asked
    assert_nothing_held(env)


def test_an_open_circuit_refuses_with_retry_after_and_takes_nothing():
    env = make()
    for _ in range(2):
        env.breakers.on_result("a", env.now, False, ErrorCode.EAGENTDOWN)
    f = env.flow()
    env.now += 0.25
    d = env.step(env.call(f))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EAGENTDOWN
    assert (d.reason, d.retry_after_ms) == ("circuit open (next probe in 750 ms)", 750)
    assert_nothing_held(env)


@pytest.mark.parametrize(("stream_w", "agent_w", "reason"), [
    (W(max_parallel=2, max_tokens=300, max_usd_micros=100_000), W(max_parallel=2, max_tokens=10_000,
     max_usd_micros=100_000), "tokens: 400 would exceed window 300"),
    (W(max_parallel=2, max_tokens=10_000, max_usd_micros=100_000), W(max_parallel=2, max_tokens=10_000,
     max_usd_micros=500), "next-hop window: usd_micros: 800 would exceed window 500"),
])
def test_an_estimate_that_could_never_fit_is_refused_with_the_refusing_window(stream_w, agent_w, reason):
    """Spec §10 EWINDOW, never queued: waiting could not help. The half-open
    breaker's probe the call took is given back (the next call may probe)."""
    env = make(agent_window=agent_w)
    for _ in range(2):
        env.breakers.on_result("a", env.now, False, ErrorCode.ETIMEOUT)
    env.now += 1.0  # HALF_OPEN: one probe at a time
    f = env.flow(window=stream_w)
    d = env.step(env.call(f))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EWINDOW and d.reason == reason
    refusing = stream_w if not reason.startswith("next-hop") else agent_w
    assert d.window_update == WindowUpdate(window=refusing)
    assert env.breakers.statistics()["a"].probes_in_flight == 0
    assert_nothing_held(env)
    assert env.breakers.allow("a", env.now)  # the probe slot is free again


def test_a_full_class_queue_refuses_and_gives_the_stream_window_back():
    env = make(capacity=2, gold_reserved=1, max_queued=1)
    f = env.flow()
    running = env.call(f)
    assert isinstance(env.step(running), Admit)
    queued = env.call(f)
    assert waits(env.step(queued), Stage.SLOT)
    d = env.step(env.call(f))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EWINDOW
    assert d.reason == "silver queue full: 1 calls waiting (max_queued)"
    assert f.window.in_flight == 2  # the running call and the queued one, not the refused one
    env.release(queued, NOT_RUN)
    env.release(running)
    assert_nothing_held(env)


def test_a_budget_that_cannot_take_the_estimate_refuses_with_everything_given_back():
    env = make()
    f = env.flow(budget=Allowance(tokens=300))
    d = env.step(env.call(f))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EBUDGET
    assert d.reason == ("a not called: reserve 400 tokens / 800 usd_micros on 'stream:0': budget 'stream:0' has "
                        "300 tokens / unlimited usd_micros left")
    assert env.sched.statistics().silver.cancelled == 1  # its slot was taken, then given back
    assert env.hop().in_flight == 0 and f.window.in_flight == 0
    assert_nothing_held(env)


def test_a_client_budget_refuses_for_every_stream_of_the_client():
    env = make(client=Allowance(usd_micros=1000))
    f1, f2 = env.flow(), env.flow()
    c1 = env.call(f1)
    assert isinstance(env.step(c1), Admit)
    d = env.step(env.call(f2))
    assert isinstance(d, Refuse) and d.code is ErrorCode.EBUDGET and "budget 'client' has" in d.reason
    env.release(c1)
    assert_nothing_held(env)


# ------------------------------------------------------------------ waiting, then admitted


def test_turns_keep_route_order_and_a_skipped_turn_lets_the_next_go():
    env = make()
    f = env.flow()
    c2, c1, c0 = env.call(f, "c", turn=2), env.call(f, "b", turn=1), env.call(f, "a", turn=0)
    assert waits(env.step(c2), Stage.TURN)
    assert waits(env.step(c1), Stage.TURN)
    d0 = env.step(c0)
    assert isinstance(d0, Admit) and d0.wake == (c1,)  # its turn passed as it asked for a slot
    assert isinstance(env.step(c1), Admit) and f.turn == 2
    env.release(c2, NOT_RUN)  # cancelled before its turn
    assert f.turn == 3
    c3 = env.call(f, "d", turn=4)
    assert waits(env.step(c3), Stage.TURN)
    assert env.adm.skip_turn(f, 3) == (c3,)  # turn 3's next-hop was refused before admission
    assert isinstance(env.step(c3), Admit)
    for c in (c0, c1, c3):
        env.release(c)
    assert_nothing_held(env)


def test_a_call_queued_at_the_stream_window_is_nacked_once_then_admitted_when_a_call_completes():
    env = make()
    f = env.flow(window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    first, second = env.call(f, "a"), env.call(f, "b")
    assert isinstance(env.step(first), Admit)
    d = env.step(second)
    assert waits(d, Stage.STREAM_WINDOW, nack=True)
    assert d.nack.reason == "b: parallel: 2 would exceed window 1; queued until the window opens"
    assert d.nack.window_update == WindowUpdate(window=f.window.effective())
    assert waits(env.step(second), Stage.STREAM_WINDOW)  # woken for nothing: waits again, no second NACK
    assert "b" not in env.windows.statistics() or env.hop("b").in_flight == 0
    r = env.release(first)
    assert r.wake == (second,)
    assert isinstance(env.step(second), Admit)
    env.release(second)
    assert_nothing_held(env)


def test_a_call_queued_for_a_slot_is_admitted_when_a_slot_frees():
    env = make(capacity=2, gold_reserved=1)
    f1, f2 = env.flow(), env.flow(B)
    c1, c2 = env.call(f1), env.call(f2, "b")
    assert isinstance(env.step(c1), Admit)
    assert waits(env.step(c2), Stage.SLOT)  # silver and bronze share one slot: gold keeps one
    assert f2.window.in_flight == 1  # it holds its stream window while it waits
    assert env.release(c1).wake == (c2,)
    assert isinstance(env.step(c2), Admit)
    env.release(c2)
    assert_nothing_held(env)


def test_a_call_queued_at_the_next_hop_window_holds_its_slot_blocked_and_gets_the_room_handed_over():
    env = make(agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    f1, f2 = env.flow(), env.flow()
    c1, c2 = env.call(f1), env.call(f2)
    assert isinstance(env.step(c1), Admit)
    d = env.step(c2)
    assert isinstance(d, Wait) and d.on is Stage.HOP_WINDOW
    assert d.nack.reason == "a: next-hop window: parallel: 2 would exceed window 1; queued until the window opens"
    assert d.nack.window_update == WindowUpdate(window=env.windows.window("a").effective())
    q = env.sched.statistics()
    assert q.running == 2 and q.silver.blocked == 1
    r = env.release(c1)
    assert r.wake == (c2,)
    assert env.hop().in_flight == 1 and env.sched.statistics().silver.blocked == 0  # handed, not raced for
    assert isinstance(env.step(c2), Admit)
    env.release(c2)
    assert_nothing_held(env)


def test_room_that_fits_but_is_promised_to_an_earlier_call_is_nacked_as_queued_ahead():
    """A small call does not overtake a large one that waits ahead of it in its
    class (no starvation of large calls): it queues too, and is told why."""
    env = make(agent_window=W(max_parallel=3, max_tokens=1_000, max_usd_micros=100_000))
    big, large, small = (env.call(env.flow(), est=Estimate(tokens=t, usd_micros=0)) for t in (800, 400, 100))
    assert isinstance(env.step(big), Admit)
    assert waits(env.step(large), Stage.HOP_WINDOW, nack=True)
    d = env.step(small)
    assert waits(d, Stage.HOP_WINDOW, nack=True)
    assert d.nack.reason == ("a: next-hop window: 1 calls queued ahead in the next-hop's window; "
                             "queued until the window opens")
    assert env.release(big).wake == (large, small)
    assert isinstance(env.step(large), Admit) and isinstance(env.step(small), Admit)
    env.release(large)
    env.release(small)
    assert_nothing_held(env)


def test_gold_goes_before_bronze_at_a_next_hop_window():
    env = make(agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    running, bronze, gold = env.call(env.flow(S)), env.call(env.flow(B)), env.call(env.flow(G))
    assert isinstance(env.step(running), Admit)
    assert env.step(bronze).on is Stage.HOP_WINDOW
    assert env.step(gold).on is Stage.HOP_WINDOW
    assert env.release(running).wake == (gold,)
    assert isinstance(env.step(gold), Admit)
    assert waits(env.step(bronze), Stage.HOP_WINDOW)
    assert env.release(gold).wake == (bronze,)
    assert isinstance(env.step(bronze), Admit)
    env.release(bronze)
    assert_nothing_held(env)


def test_a_blocked_bronze_slot_is_revoked_for_gold_and_the_bronze_call_queues_again():
    env = make(capacity=2, gold_reserved=0, agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    holder, bronze, gold = env.call(env.flow(S)), env.call(env.flow(B)), env.call(env.flow(G), "other")
    assert isinstance(env.step(holder), Admit)
    assert env.step(bronze).on is Stage.HOP_WINDOW  # both slots taken; bronze blocked at "a"
    assert isinstance(env.step(gold), Admit)  # bronze's idle slot went to gold at once
    assert bronze.stage is Stage.SLOT and len(env.windows.queue("a")) == 0
    assert env.sched.statistics().bronze.revoked == 1
    assert waits(env.step(bronze), Stage.SLOT)
    assert env.release(gold).wake == (bronze,)  # its slot back
    assert waits(env.step(bronze), Stage.HOP_WINDOW)  # queues again, NACKed once only
    assert env.release(holder).wake == (bronze,)
    assert isinstance(env.step(bronze), Admit)
    env.release(bronze)
    assert_nothing_held(env)


def test_a_call_that_blocks_at_its_next_hop_while_gold_waits_gives_gold_its_slot_at_once():
    """Gold queued before the bronze call reached its next-hop: the slot goes to
    gold as soon as bronze blocks there, not when gold's preemption deadline passes."""
    env = make(capacity=2, gold_reserved=0, agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    holder, other, bronze = env.call(env.flow(S)), env.call(env.flow(S), "x"), env.call(env.flow(B))
    gold = env.call(env.flow(G), "y")
    assert isinstance(env.step(holder), Admit) and isinstance(env.step(other), Admit)
    assert waits(env.step(bronze), Stage.SLOT)
    assert env.release(other).wake == (bronze,)  # granted; before bronze runs again, gold asks:
    assert waits(env.step(gold), Stage.SLOT)
    d = env.step(bronze)
    assert waits(d, Stage.SLOT, nack=True) and d.wake == (gold,)  # NACKed at "a", then revoked for gold
    assert isinstance(env.step(gold), Admit)
    for c in (gold, holder):
        env.release(c)
    assert isinstance(env.step(bronze), Admit)
    env.release(bronze)
    assert_nothing_held(env)


# ------------------------------------------------------------------ cancelled while waiting


def _waiting_at(env: Env, stage: Stage) -> tuple[list[Call], Call]:
    """A call waiting at ``stage`` and the calls that keep it waiting."""
    if stage is Stage.TURN:
        f = env.flow()
        return [], env.call(f, turn=1)
    if stage is Stage.STREAM_WINDOW:
        f = env.flow(window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
        return [env.call(f, "b")], env.call(f)
    if stage is Stage.SLOT:
        return [env.call(env.flow(), agent) for agent in "bcd"], env.call(env.flow())  # silver's 3 slots taken
    return [env.call(env.flow()), env.call(env.flow())], env.call(env.flow())


@pytest.mark.parametrize("stage", [Stage.TURN, Stage.STREAM_WINDOW, Stage.SLOT, Stage.HOP_WINDOW])
def test_a_call_cancelled_while_it_waits_gives_back_all_it_held(stage):
    env = make()
    for _ in range(2):
        env.breakers.on_result("a", env.now, False, ErrorCode.ETIMEOUT)
    env.breakers.on_result("a", env.now + 1, True)  # HALF_OPEN then CLOSED: a clean breaker
    holders, call = _waiting_at(env, stage)
    for h in holders:
        assert isinstance(env.step(h), Admit)
    d = env.step(call)
    assert isinstance(d, Wait) and d.on is stage
    r = env.release(call, NOT_RUN)
    assert r.charge is None and call.stage is Stage.RELEASED
    if stage is Stage.TURN:
        assert call.flow.turn == 0  # turn 1 will be skipped when turn 0 passes
    for h in holders:
        env.release(h)
    assert_nothing_held(env)
    assert env.sched.statistics().running == 0
    if stage is Stage.SLOT:
        assert env.sched.statistics().silver.cancelled == 1


def test_a_call_handed_its_room_then_cancelled_passes_the_room_on():
    env = make(agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    c1, c2, c3 = (env.call(env.flow()) for _ in range(3))
    assert isinstance(env.step(c1), Admit)
    assert isinstance(env.step(c2), Wait) and isinstance(env.step(c3), Wait)
    assert env.release(c1).wake == (c2,)  # c2 holds the room now, not yet stepped...
    assert env.release(c2, NOT_RUN).wake == (c3,)  # ...and is cancelled: c3 gets it
    assert isinstance(env.step(c3), Admit)
    env.release(c3)
    assert_nothing_held(env)


def test_a_cancelled_half_open_probe_frees_the_probe_slot():
    env = make()
    for _ in range(2):
        env.breakers.on_result("a", env.now, False, ErrorCode.ETIMEOUT)
    env.now += 1.0
    probe = env.call(env.flow())
    assert isinstance(env.step(probe), Admit)
    assert isinstance(env.step(env.call(env.flow())), Refuse)  # one probe at a time
    env.release(probe, Outcome(tokens=10, cancelled=True))
    assert env.breakers.statistics()["a"].probes_in_flight == 0
    c = env.call(env.flow())
    assert isinstance(env.step(c), Admit)
    env.release(c)
    assert_nothing_held(env)


# ------------------------------------------------------------------ release after the call


def _halved(env: Env, f: StreamFlow) -> tuple[float, float]:
    return f.window.cwnd, env.windows.window("a").cwnd


@pytest.mark.parametrize(("outcome", "cwnd", "breaker"), [
    (Outcome(tokens=300, usd_micros=600, timely=True), (4, 2), {"successes": 1}),
    (Outcome(tokens=300, usd_micros=600, error=ErrorCode.ETIMEOUT), (2, 1), {"failures": 1}),
    (Outcome(tokens=0, error=ErrorCode.EAGENTDOWN, timely=True), (2, 1), {"failures": 1}),
    (Outcome(tokens=300, usd_micros=600, error=ErrorCode.EPROTO, client_fault=True, timely=True), (4, 2),
     {"ignored": 1}),
    (Outcome(tokens=300, usd_micros=600, cancelled=True), (4, 2), {}),
])
def test_release_commits_actual_usage_and_runs_aimd_and_the_breaker_by_the_outcome(outcome, cwnd, breaker):
    env = make()
    f = env.flow()
    c = env.call(f)
    assert isinstance(env.step(c), Admit)
    r = env.release(c, outcome)
    assert (r.charge.tokens, r.charge.usd_micros) == (outcome.tokens, outcome.usd_micros)
    assert env.ledger.state(f.ledger_key).committed_tokens == outcome.tokens  # whatever the outcome
    assert _halved(env, f) == cwnd
    stats = env.breakers.statistics()["a"]
    assert {k: getattr(stats, k) for k in ("successes", "failures", "ignored")} == {
        "successes": 0, "failures": 0, "ignored": 0, **breaker}
    completed = 0 if outcome.cancelled or outcome.client_fault else 1
    assert f.window.statistics().completed == env.hop().completed == completed
    q = env.sched.statistics().silver
    assert (q.cancelled, q.running) == (1 if outcome.cancelled else 0, 0)
    # A WINDOW_UPDATE may be due after a completion, never after a cancellation.
    assert r.stream_update is None or not outcome.cancelled
    assert_nothing_held(env)


def test_a_call_failed_in_doubt_is_settled_as_the_clients_and_asks_for_a_canary():
    """A tenant-bound next-hop's timeout (issue 19): no AIMD decrease, no breaker
    failure (the threshold here is 2), and the release says to run a canary —
    once while one runs; its outcome, not the calls', counts."""
    env = make()
    f = env.flow()
    doubt = Outcome(error=ErrorCode.ETIMEOUT, client_fault=True, doubt=True)
    canaries = []
    for _ in range(3):
        c = env.call(f)
        assert isinstance(env.step(c), Admit)
        canaries.append(env.release(c, doubt).canary)
    assert canaries == [True, False, False]
    assert _halved(env, f) == (4, 2)
    stats = env.breakers.statistics()["a"]
    assert (stats.failures, stats.ignored, stats.doubts, stats.canary_in_flight) == (0, 3, 3, True)
    assert env.breakers.open_agents(env.now) == set()
    # A client fault that is not in doubt asks for nothing.
    c = env.call(f)
    assert isinstance(env.step(c), Admit)
    assert env.release(c, Outcome(error=ErrorCode.EPROTO, client_fault=True)).canary is False
    assert_nothing_held(env)


def test_usage_past_the_reservation_is_extended_while_the_budget_takes_it_then_cut():
    env = make()
    f = env.flow(budget=Allowance(tokens=1000))
    c = env.call(f)
    assert isinstance(env.step(c), Admit)
    grown = env.adm.extend(c, 500, 0)
    assert isinstance(grown, Reservation) and c.reservation == grown and grown.tokens == 900
    assert isinstance(env.adm.extend(c, 200, 0), Refusal)  # 1100 > 1000: cut the call
    r = env.release(c, Outcome(tokens=1100, error=ErrorCode.EBUDGET))
    assert (r.charge.tokens, r.charge.overage_tokens) == (1000, 100)
    assert f.exhausted == "'stream:0' tokens 1000/1000"
    assert_nothing_held(env)


def test_budget_exhausted_while_a_call_waits_refuses_it_with_everything_given_back():
    env = make(agent_window=W(max_parallel=1, max_tokens=10_000, max_usd_micros=100_000))
    f = env.flow(budget=Allowance(tokens=1000))
    first, second = env.call(f), env.call(f)
    assert isinstance(env.step(first), Admit)
    assert env.step(second).on is Stage.HOP_WINDOW
    r = env.release(first, Outcome(tokens=1000, timely=True))
    assert r.wake == (second,)  # handed the next-hop's room...
    d = env.step(second)  # ...but the budget is gone
    assert isinstance(d, Refuse) and d.code is ErrorCode.EBUDGET
    assert d.reason == "a not called: budget exhausted ('stream:0' tokens 1000/1000)"
    assert_nothing_held(env)


def test_a_queued_bronze_call_shed_under_congestion_is_refused_with_epreempt():
    env = make(capacity=2, gold_reserved=1, shed_after_ms=100.0)
    silver, bronze, silver2 = env.call(env.flow(S)), env.call(env.flow(B)), env.call(env.flow(S))
    assert isinstance(env.step(silver), Admit)
    assert waits(env.step(bronze), Stage.SLOT)
    assert waits(env.step(silver2), Stage.SLOT)
    assert env.adm.timer() == pytest.approx(env.now + 0.1)
    env.now += 0.1
    t = env.adm.on_timer(env.now)
    assert [(p.stream_id, p.running) for p in t.preempt] == [(bronze.flow.stream_id, False)]
    assert t.wake == (bronze,)
    d = env.step(bronze)
    assert isinstance(d, Refuse) and d.code is ErrorCode.EPREEMPT and d.reason.startswith("bronze shed")
    env.release(bronze, NOT_RUN)
    assert env.release(silver).wake == (silver2,)
    assert isinstance(env.step(silver2), Admit)
    env.release(silver2)
    assert_nothing_held(env)


def test_gold_kept_waiting_preempts_a_running_bronze_call_whose_slot_then_goes_to_gold():
    env = make(capacity=2, gold_reserved=0, preempt_after_ms=250.0)
    b1, b2, gold = env.call(env.flow(B)), env.call(env.flow(B)), env.call(env.flow(G))
    assert isinstance(env.step(b1), Admit) and isinstance(env.step(b2), Admit)
    assert waits(env.step(gold), Stage.SLOT)
    env.now += 0.25
    t = env.adm.on_timer(env.now)
    assert [(p.stream_id, p.running) for p in t.preempt] == [(b2.flow.stream_id, True)]  # the youngest
    assert t.wake == ()  # the runtime RSTs the stream; its call ends cancelled:
    assert env.release(b2, Outcome(tokens=120, cancelled=True)).wake == (gold,)
    assert isinstance(env.step(gold), Admit)
    env.release(gold)
    env.release(b1)
    assert_nothing_held(env)


def test_misuse_is_a_clear_error():
    env = make()
    c = env.call(env.flow())
    with pytest.raises(ValueError, match="never admitted"):
        env.release(c, Outcome(tokens=5))
    assert isinstance(env.step(c), Admit)
    with pytest.raises(ValueError, match="admitted: nothing to step"):
        env.step(c)
    env.release(c)
    with pytest.raises(ValueError, match="released twice"):
        env.release(c)
    refused = env.call(env.flow(budget=Allowance(tokens=1)))
    assert isinstance(env.step(refused), Refuse)
    with pytest.raises(ValueError, match="not admitted"):
        env.adm.extend(refused, 1, 1)
    env.release(refused, NOT_RUN)  # a refused call just closes
    assert_nothing_held(env)


# ------------------------------------------------------------------ many calls at once


AGENTS = {"a": W(max_parallel=2, max_tokens=900, max_usd_micros=100_000),
          "b": W(max_parallel=1, max_tokens=600, max_usd_micros=100_000),
          "c": W(max_parallel=3, max_tokens=2_000, max_usd_micros=3_000)}
ERRORS = [None, None, None, ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN, ErrorCode.EPROTO, ErrorCode.EBUDGET]


def reachable(stage: Stage) -> set[Stage]:
    """``stage`` and every stage :data:`TRANSITIONS` leads to from it."""
    seen, todo = {stage}, [stage]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


class AdmissionMachine(RuleBasedStateMachine):
    """Many calls of several streams and classes interleaved at random, stepped
    the way the runtime steps them (each woken call again until none is), with
    time moving and the scheduler preempting and shedding. After every rule
    nothing leaks and no limit is passed; a waiting call that was not woken
    cannot move (no lost wake-up); turns are taken in route order."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.env = make(capacity=3, gold_reserved=1, agent_window=AGENTS["a"], limits=dict(AGENTS),
                        client=Allowance(tokens=12_000, usd_micros=20_000), max_queued=2, shed_after_ms=80.0,
                        preempt_after_ms=30.0, gold_sla_ms=60.0)
        self.flows = [self.env.flow(q, window=W(max_parallel=p, max_tokens=1_500, max_usd_micros=100_000),
                                    budget=Allowance(tokens=t))
                      for q, p, t in ((G, 2, 4_000), (S, 3, 3_000), (B, 2, 5_000), (B, 1, 2_000))]
        self.turns = Counter()
        self.live: list[Call] = []
        self.woken: set[Call] = set()
        self.slot_order: dict[StreamFlow, list[int]] = {f: [] for f in self.flows}
        self.asked_slot: set[Call] = set()
        self.actual = Counter()
        self.charged = Counter()
        self.stages: dict[Call, Stage] = {}

    # -- the runtime's part

    def _note(self, call: Call, decision) -> None:
        assert call.stage in reachable(self.stages.get(call, Stage.TURN))  # one step may pass several gates
        self.stages[call] = call.stage
        if call.stage in (Stage.SLOT, Stage.HOP_WINDOW, Stage.ADMITTED) and call not in self.asked_slot:
            self.asked_slot.add(call)
            if call.turn is not None:
                self.slot_order[call.flow].append(call.turn)
        self.woken.update(decision.wake)
        self.woken.discard(call)

    def _settle(self) -> None:
        for _ in range(10_000):
            ready = [c for c in self.live if c in self.woken and c.stage not in (Stage.ADMITTED,)]
            self.woken -= set(ready)
            if not ready:
                return
            for c in ready:
                if c.stage in (Stage.ADMITTED, Stage.REFUSED):
                    continue
                d = self.env.step(c)
                self._note(c, d)
                if isinstance(d, Refuse):
                    self._end(c, NOT_RUN)
        raise AssertionError("wake-ups never settle")

    def _end(self, call: Call, outcome: Outcome) -> None:
        r = self.env.release(call, outcome)
        if r.charge is not None:
            self.actual["tokens"] += outcome.tokens
            self.charged["tokens"] += r.charge.tokens
            self.charged["overage"] += r.charge.overage_tokens
        self.live.remove(call)
        self.woken.discard(call)
        self.stages.pop(call, None)
        self._note(call, r)

    # -- rules

    @rule(i=st.integers(0, 3), agent=st.sampled_from(sorted(AGENTS)), tokens=st.integers(0, 700),
          routed=st.booleans())
    def begin(self, i: int, agent: str, tokens: int, routed: bool) -> None:
        f = self.flows[i]
        turn = None
        if routed:
            turn = self.turns[i]
            self.turns[i] += 1
        c = self.env.call(f, agent, Estimate(tokens=tokens, usd_micros=tokens // 2), turn=turn)
        self.live.append(c)
        d = self.env.step(c)
        self._note(c, d)
        if isinstance(d, Refuse):
            self._end(c, NOT_RUN)
        self._settle()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), usage=st.floats(0.0, 2.0), err=st.sampled_from(ERRORS), how=st.integers(0, 5))
    def end(self, data, usage: float, err, how: int) -> None:
        c = data.draw(st.sampled_from(self.live))
        if c.stage is not Stage.ADMITTED:
            self._end(c, NOT_RUN)  # cancelled while it waits (RST, deadline)
        else:
            tokens = int(c.estimate.tokens * usage)
            outcome = Outcome(tokens=tokens, usd_micros=tokens // 2, error=err, timely=how > 1,
                              cancelled=how == 0, client_fault=how == 1 and err is not None)
            self._end(c, outcome)
        self._settle()

    @precondition(lambda self: any(c.stage is Stage.ADMITTED for c in self.live))
    @rule(data=st.data(), more=st.integers(0, 400))
    def extend(self, data, more: int) -> None:
        c = data.draw(st.sampled_from([c for c in self.live if c.stage is Stage.ADMITTED]))
        self.env.adm.extend(c, more, more // 2)

    @rule(i=st.integers(0, 3))
    def refused_before_admission(self, i: int) -> None:
        """A routed next-hop the dispatcher refused itself (no adapter, a refused
        estimate): its turn is skipped."""
        turn = self.turns[i]
        self.turns[i] += 1
        self.woken.update(self.env.adm.skip_turn(self.flows[i], turn))
        self._settle()

    @rule(wide=st.booleans())
    def reload(self, wide: bool) -> None:
        """A RIB reload moves the next-hops' limits; their queues are pumped."""
        scale = 2 if wide else 1
        self.env.windows.configure({a: W(max_parallel=w.max_parallel * scale, max_tokens=w.max_tokens * scale,
                                         max_usd_micros=w.max_usd_micros * scale) for a, w in AGENTS.items()})
        self.woken.update(self.env.adm.pump_all(self.env.now))
        self._settle()

    @precondition(lambda self: any(c.stage in (Stage.SLOT, Stage.HOP_WINDOW) for c in self.live))
    @rule(data=st.data())
    def slot_withdrawn(self, data) -> None:
        """The runtime withdraws the slot ticket of a waiting call (its stream
        closed as it was preempted): the call is refused at its next step."""
        c = data.draw(st.sampled_from([c for c in self.live if c.stage in (Stage.SLOT, Stage.HOP_WINDOW)]))
        if c._slot is not None:
            self.woken.update(self.env.adm.cancel_slot(c._slot, self.env.now))
        self._settle()

    @rule(dt=st.floats(0.0, 0.1))
    def tick(self, dt: float) -> None:
        self.env.now += dt
        t = self.env.adm.on_timer(self.env.now)
        self.woken.update(t.wake)
        for p in t.preempt:
            if p.running:  # the runtime RSTs the stream: its calls end cancelled
                for c in [c for c in self.live if c.flow.stream_id == p.stream_id]:
                    self._end(c, Outcome(cancelled=True) if c.stage is not Stage.ADMITTED else
                              Outcome(tokens=c.estimate.tokens // 2, cancelled=True))
        self._settle()

    # -- invariants

    @invariant()
    def nothing_leaks_and_no_limit_is_passed(self) -> None:
        env = self.env
        holding = (Stage.SLOT, Stage.HOP_WINDOW, Stage.ADMITTED)
        for f in self.flows:
            mine = [c for c in self.live if c.flow is f]
            assert f.window.in_flight == sum(c.stage in holding for c in mine)
            assert f.window.tokens_in_flight == sum(c.estimate.tokens for c in mine if c.stage in holding)
            assert f.window.tokens_in_flight <= f.window.limits.max_tokens
            s = env.ledger.state(f.ledger_key)
            assert s.open_reservations == sum(c.stage is Stage.ADMITTED for c in mine)
            assert s.reserved_tokens == sum(c.reservation.tokens for c in mine if c.stage is Stage.ADMITTED)
            assert s.committed_tokens + s.reserved_tokens <= s.limit.tokens
        client = env.ledger.state("client")
        assert client.committed_tokens + client.reserved_tokens <= client.limit.tokens
        assert client.committed_usd_micros + client.reserved_usd_micros <= client.limit.usd_micros
        assert client.committed_tokens == self.charged["tokens"]
        assert self.charged["tokens"] + self.charged["overage"] == self.actual["tokens"]
        for agent, w in env.windows.statistics().items():
            admitted = [c for c in self.live if c.agent == agent and c.stage is Stage.ADMITTED]
            assert w.in_flight == len(admitted)  # after settling, nobody holds room without being admitted
            assert w.tokens_in_flight == sum(c.estimate.tokens for c in admitted)
            assert w.tokens_in_flight <= 2 * AGENTS[agent].max_tokens
        q = env.sched.statistics()
        assert q.running <= env.sched.capacity
        assert q.running >= sum(c.stage in (Stage.HOP_WINDOW, Stage.ADMITTED) for c in self.live)
        assert q.running + q.queued == len(env.adm._by_ticket)

    @invariant()
    def a_waiting_call_nobody_woke_cannot_move(self) -> None:
        for c in list(self.live):
            if c.stage is Stage.ADMITTED:
                continue
            d = self.env.step(c)
            assert isinstance(d, Wait) and d.nack is None and d.wake == (), (c.stage, d)

    @invariant()
    def turns_are_taken_in_route_order(self) -> None:
        for order in self.slot_order.values():
            assert order == sorted(order)

    def teardown(self) -> None:
        if not hasattr(self, "env"):
            return
        while self.live:  # settling may refuse (and end) calls woken by these releases
            c = self.live[0]
            self._end(c, NOT_RUN if c.stage is not Stage.ADMITTED else OK)
            self._settle()
        assert not self.live
        assert_nothing_held(self.env)
        for i, f in enumerate(self.flows):
            assert f.turn == self.turns[i]  # every turn passed or was skipped
        client = self.env.ledger.state("client")
        assert client.committed_tokens == self.charged["tokens"] <= client.limit.tokens


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
