"""Learning merged across routers (issue 12), sans-IO: the bandit arms' posterior
merge (:class:`~atp_router.policy.bandit.ArmDelta`), the shared arm entries, the live
statistics' decayed sums and the breaker records routers exchange."""

from __future__ import annotations

import random

import numpy as np
import pytest

from atp_router.flow.breaker import (
    BreakerBoard,
    BreakerEvent,
    BreakerShare,
    BreakerState,
)
from atp_router.policy.bandit import ArmModel, Context, Featurizer
from atp_router.policy.learn import (
    ALPHA,
    Decision,
    LiveMetrics,
    RoutingLearner,
    SharedArm,
    live_stats_of,
    merge_arm_entry,
    merge_live_state,
)
from atp_router.policy.loader import load_rib_text
from atp_router.wire.errors import ErrorCode

BITS = 10


def _ctx(idx: list[int], val: list[float] | None = None) -> Context:
    return Context(np.array(idx, dtype=np.int64), np.array(val or [1.0] * len(idx), dtype=np.float64))


def _stream(rng: np.random.Generator, n: int, pool: list[int], truth: dict[int, float]) -> list[tuple[Context, float]]:
    """``n`` observations whose contexts draw 1..4 features of ``pool``; the
    quality is a Bernoulli draw of the mean truth of those features."""
    out = []
    for _ in range(n):
        idx = sorted(rng.choice(pool, size=int(rng.integers(1, 5)), replace=False).tolist())
        p = float(np.mean([truth[i] for i in idx]))
        out.append((_ctx(idx), float(rng.random() < p)))
    return out


def _learn(arm: ArmModel, obs: list[tuple[Context, float]], weight: float = 1.0) -> ArmModel:
    for ctx, y in obs:
        arm.update(ctx, y, weight)
    return arm


def _shared(arm: ArmModel, fp: str = "fp") -> SharedArm:
    return SharedArm("p", "a", fp, arm, arm.copy())


def _push(entry: dict | None, s: SharedArm, rib: int = 1) -> dict:
    """One router's sync of arm ``s``: push its delta into ``entry``, adopt the result."""
    new = merge_arm_entry(entry, s, s.model.delta(s.base), rib=rib)
    assert new is not None
    assert s.synced(new)
    return new


def test_disjoint_streams_merged_equal_one_learner_that_saw_both():
    """Features no two routers share: a Laplace step touches only its context's
    weights, so two routers merged must be exactly one router fed both streams."""
    rng = np.random.default_rng(1)
    truth = {i: float(rng.random()) for i in range(40)}
    obs_a = _stream(rng, 300, list(range(20)), truth)
    obs_b = _stream(rng, 200, list(range(20, 40)), truth)
    base = ArmModel(bits=BITS, prior=0.6)
    a, b = _shared(base.copy()), _shared(base.copy())
    _learn(a.model, obs_a)
    _learn(b.model, obs_b, weight=2.0)
    entry = _push(None, a)
    entry = _push(entry, b)
    one = _learn(_learn(base.copy(), obs_a), obs_b, weight=2.0)
    merged = ArmModel.from_state(entry["state"])
    np.testing.assert_allclose(merged.q, one.q, rtol=1e-12)
    np.testing.assert_allclose(merged.m, one.m, rtol=1e-9, atol=1e-12)
    assert merged.count == one.count == 300 + 2 * 200
    # B adopted the merged posterior when it pushed; A reads it back at its next sync.
    assert a.model.count == 300 and a.synced(entry) and a.model.delta(a.base).empty
    for s in (a, b):
        np.testing.assert_array_equal(s.model.m, merged.m)
        np.testing.assert_array_equal(s.model.q, merged.q)


def test_shared_features_merge_the_evidence_not_the_last_writer():
    """A feature both routers learn (the bias): the merged precision is the base's
    plus both routers' information, its mean as good as one router that saw
    everything; last-writer-wins would keep only one router's half."""
    rng = np.random.default_rng(2)
    bias = _ctx([7])
    obs = [(bias, float(rng.random() < 0.8)) for _ in range(1200)]
    base = ArmModel(bits=BITS, prior=0.5)
    a, b = _shared(base.copy()), _shared(base.copy())
    _learn(a.model, obs[:600])
    _learn(b.model, obs[600:])
    info_a, info_b = a.model.q[7] - base.q[7], b.model.q[7] - base.q[7]
    entry = _push(_push(None, a), b)
    merged = ArmModel.from_state(entry["state"])
    assert merged.q[7] == pytest.approx(base.q[7] + info_a + info_b, rel=1e-12)
    one = _learn(base.copy(), obs)
    assert merged.q[7] == pytest.approx(one.q[7], rel=0.05)  # the same information, linearised elsewhere
    assert merged.mean(bias) == pytest.approx(one.mean(bias), abs=0.01)
    assert merged.mean(bias) == pytest.approx(0.8, abs=0.04)
    assert merged.count == 1200 and b.model.count == 1200
    assert info_a > 0 and info_b > 0  # last-writer-wins would have kept one of them


def test_merging_is_commutative_and_a_resync_without_data_changes_nothing():
    rng = np.random.default_rng(3)
    truth = {i: float(rng.random()) for i in range(30)}
    f = Featurizer(bits=BITS)
    obs = _stream(rng, 200, list(range(30)), truth) + [(f({"subject": "x"}), 1.0)] * 5
    base = ArmModel(bits=BITS, prior=0.3)

    def run(order: str) -> dict:
        arms = {k: _shared(base.copy()) for k in "ab"}
        _learn(arms["a"].model, obs[::2])
        _learn(arms["b"].model, obs[1::2])
        entry = None
        for k in order:
            entry = _push(entry, arms[k])
        return entry

    ab, ba = run("ab"), run("ba")
    np.testing.assert_allclose(ArmModel.from_state(ab["state"]).m, ArmModel.from_state(ba["state"]).m,
                               rtol=1e-9, atol=1e-12)
    assert ArmModel.from_state(ab["state"]).count == ArmModel.from_state(ba["state"]).count == len(obs)

    s = _shared(base.copy())
    _learn(s.model, obs)
    entry = _push(None, s)
    before = ArmModel.from_state(entry["state"])
    assert s.model.delta(s.base).empty
    for _ in range(3):  # idempotent: syncing again adds nothing
        entry = _push(entry, s)
    after = ArmModel.from_state(entry["state"])
    np.testing.assert_array_equal(after.m, before.m)
    np.testing.assert_array_equal(after.q, before.q)
    assert after.count == before.count and entry["seq"] == 4


def test_exact_state_round_trips_bit_for_bit_and_the_float32_format_still_loads():
    arm = _learn(ArmModel(bits=BITS), _stream(np.random.default_rng(4), 50, list(range(10)), dict.fromkeys(range(10), 0.7)))
    exact = ArmModel.from_state(arm.state(exact=True))
    np.testing.assert_array_equal(exact.m, arm.m)
    np.testing.assert_array_equal(exact.q, arm.q)
    old = ArmModel.from_state(arm.state())  # what a single router saves (and earlier versions saved)
    np.testing.assert_allclose(old.m, arm.m, rtol=1e-6, atol=1e-7)
    assert len(arm.state()["m"]) == 4 << BITS and len(arm.state(exact=True)["m"]) == 8 << BITS
    with pytest.raises(ValueError):
        ArmModel.from_state({**arm.state(exact=True), "dtype": "<f2"})
    with pytest.raises(ValueError):
        ArmModel.from_state({**arm.state(exact=True), "m": arm.state()["m"]})  # float32 bytes, float64 claimed
    bad = arm.delta(arm.copy())
    with pytest.raises(ValueError):
        arm.merge(type(bad)(BITS, bad.eta, bad.q - 10.0, 0.0))  # would make a precision negative
    np.testing.assert_array_equal(arm.q, exact.q)  # and changed nothing
    with pytest.raises(ValueError):
        arm.delta(ArmModel(bits=BITS + 1))


def test_a_redefined_arm_resets_unless_the_entry_is_of_a_newer_rib():
    rng = np.random.default_rng(5)
    obs = _stream(rng, 40, list(range(8)), dict.fromkeys(range(8), 0.9))
    old = _shared(_learn(ArmModel(bits=BITS), obs), fp="old-model")
    entry = merge_arm_entry(None, old, old.model.delta(ArmModel(bits=BITS)), rib=3)
    assert entry is not None and entry["rib"] == 3
    # A router on RIB 4 where the agent's model changed: its fresh arm replaces the entry.
    new = _shared(ArmModel(bits=BITS), fp="new-model")
    new.model.update(_ctx([1]), 1.0)
    replaced = merge_arm_entry(entry, new, new.model.delta(new.base), rib=4)
    assert replaced["fingerprint"] == "new-model" and replaced["rib"] == 4
    assert ArmModel.from_state(replaced["state"]).count == 1  # not 41: the old arm's learning is gone
    # A router still on RIB 3 pushing the old arm leaves the newer entry alone ...
    old.model.update(_ctx([2]), 0.0)
    assert merge_arm_entry(replaced, old, old.model.delta(old.base), rib=3) is None
    # ... and does not adopt it.
    assert not old.synced(replaced) and old.model.count == 41
    # An entry of another bits is another arm too.
    wide = _shared(ArmModel(bits=BITS + 1), fp="new-model")
    assert not wide.synced(replaced)


def _review_rib(bandit_tool: str = "bandit") -> str:
    return f"""
agents:
  lint.ruff: {{layer: L1, tool: ruff, p95_ms: 200}}
  sec.bandit: {{layer: L1, tool: {bandit_tool}, p95_ms: 200}}
  types.mypy: {{layer: L1, tool: mypy, p95_ms: 200}}
policies:
  - name: review
    match: {{task_type: code_review}}
    fanout: [lint.ruff, sec.bandit]
    fanout_k: 1
    escalation: {{on: [low_conf], to: types.mypy}}
    bandit: {{text_features: false, bits: {BITS}}}
"""


def test_every_arm_keeps_its_base_across_reloads_until_its_agent_is_redefined():
    learner = RoutingLearner(seed=0)
    learner.sync(load_rib_text(_review_rib()))
    assert learner.shared_arms() == []  # a router that does not share pays nothing
    learner.share()
    arms = {(s.policy, s.arm): s for s in learner.shared_arms()}
    assert set(arms) == {("review", "lint.ruff"), ("review", "sec.bandit"), ("review#escalation", "cheap"),
                         ("review#escalation", "escalate")}
    ctx = Featurizer(bits=BITS)({"task_type": "code_review"})
    decision = Decision("review", ("lint.ruff", "sec.bandit"), 1, ctx, 0.0, escalate=True)
    learner.observe(decision, {"lint.ruff": 1.0})
    learner.observe_escalation(decision, {"cheap": 0.2, "escalate": 1.0})
    learned = {k for k, s in arms.items() if not s.model.delta(s.base).empty}
    assert learned == {("review", "lint.ruff"), ("review#escalation", "cheap"), ("review#escalation", "escalate")}
    # A reload that keeps every agent keeps every arm, its base and what it learned since.
    learner.sync(load_rib_text(_review_rib() + "    shadow: null\n"))
    assert all(learner_arm is arms[(learner_arm.policy, learner_arm.arm)] for learner_arm in learner.shared_arms())
    # sec.bandit redefined (another tool): its arm resets, and so does the escalation bandit over the fanout.
    learner.sync(load_rib_text(_review_rib("semgrep")))
    after = {(s.policy, s.arm): s for s in learner.shared_arms()}
    assert after[("review", "lint.ruff")] is arms[("review", "lint.ruff")]
    assert not after[("review", "lint.ruff")].model.delta(after[("review", "lint.ruff")].base).empty
    for key in (("review", "sec.bandit"), ("review#escalation", "cheap"), ("review#escalation", "escalate")):
        assert after[key] is not arms[key] and after[key].model.delta(after[key].base).empty
        assert after[key].model.count == 0 and after[key].seq is None


# ------------------------------------------------------------------ live statistics
PRIORS = {"a": 0.5, "b": 0.7}
CALLS = [
    # (agent, ok, timeout, latency_ms, tokens, usd_micros)
    *[("a", True, False, 120.0, 900, 40) for _ in range(7)],
    ("a", False, True, 0.0, 0, 0),
    *[("b", True, False, 3000.0, 5000, 400) for _ in range(4)],
    ("a", False, False, 0.0, 0, 0),
    *[("a", True, False, 80.0, 1100, 60) for _ in range(9)],
]


def _observe(live: LiveMetrics, calls, qualities=()) -> None:
    for agent, ok, timeout, lat, tok, usd in calls:
        live.observe_call(agent, policy="p", latency_ms=lat, ok=ok, timeout=timeout, tokens=tok, usd_micros=usd,
                          prior=PRIORS[agent])
    for agent, q, w in qualities:
        live.observe_quality(agent, q, policy="p", weight=w, prior=PRIORS[agent])


def _sync(doc: dict | None, live: LiveMetrics, rib: int = 1) -> dict:
    doc = merge_live_state(doc, live.deltas(), rib=rib, agents=PRIORS)
    live.adopt(live_stats_of(doc), PRIORS, pushed=True)
    return doc


def test_live_sums_merged_batch_by_batch_equal_one_router_that_saw_both_batches():
    """Router A's calls then router B's, synced in that order, give exactly the
    statistics of one router fed A's batch and then B's; the decayed call
    count, which does not depend on the order, is exact whatever it was."""
    a, b = LiveMetrics(), LiveMetrics()
    a.share()
    b.share()
    qa = [("a", 1.0, 1.0), ("b", 0.0, 2.0)]
    qb = [("a", 0.0, 1.0), ("a", 1.0, 2.0)]
    _observe(a, CALLS[:12], qa)
    _observe(b, CALLS[12:], qb)
    doc = _sync(_sync(None, a), b)
    one = LiveMetrics()
    _observe(one, CALLS[:12], qa)
    _observe(one, CALLS[12:], qb)
    want = one.state()
    got = live_stats_of(doc)
    assert set(got) == set(want) == {"a", "p|a", "b", "p|b"}
    for key in want:
        for field in ("calls", "errors", "timeouts", "tokens", "usd", "q_sum", "q_w"):
            assert got[key][field] == pytest.approx(want[key][field], rel=1e-12), (key, field)
        np.testing.assert_allclose(got[key]["hist"], want[key]["hist"], atol=1e-5)
    n_a = sum(1 for c in CALLS if c[0] == "a")
    assert got["a"]["calls"] == pytest.approx((1 - (1 - ALPHA) ** n_a) / ALPHA, rel=1e-12)
    # Both routers now score with the merged figures (what the FIB reads): B pushed last, A reads it back.
    a.adopt(live_stats_of(doc), PRIORS, pushed=False)
    for live in (a, b):
        for key in ("a", "p|b"):
            got_v, want_v = live.view()[key].to_json(), one.view()[key].to_json()
            assert {k for k, v in got_v.items() if v is None} == {k for k, v in want_v.items() if v is None}
            assert {k: v for k, v in got_v.items() if v is not None} == pytest.approx(
                {k: v for k, v in want_v.items() if v is not None}, rel=1e-9)
    assert a.deltas() == {} and b.deltas() == {}


def test_interleaved_calls_keep_exact_totals_and_close_rates():
    """Calls of two routers interleaved in time: the call count is exact, the
    error rate within the documented bound of one sync interval's reordering."""
    rnd = random.Random(6)
    calls = [("a", rnd.random() > 0.3, False, 100.0, 1000, 50) for _ in range(60)]
    a, b, one = LiveMetrics(), LiveMetrics(), LiveMetrics()
    a.share()
    b.share()
    doc = None
    for i in range(0, 60, 10):  # a sync every 10 calls, each router taking every other call
        batch = calls[i:i + 10]
        _observe(a, batch[::2])
        _observe(b, batch[1::2])
        _observe(one, batch)
        doc = _sync(doc, a)
        doc = _sync(doc, b)
    got, want = one.view()["a"], b.view()["a"]  # B pushed last: it holds the merged figures
    assert got.calls == pytest.approx(want.calls, rel=1e-12)
    assert want.error_rate == pytest.approx(got.error_rate, abs=0.05)


def test_a_router_that_only_reads_keeps_its_own_contribution_pending():
    a, b = LiveMetrics(), LiveMetrics()
    a.share()
    b.share()
    _observe(a, CALLS[:5])
    doc = _sync(None, a)
    _observe(b, CALLS[5:8])
    b.adopt(live_stats_of(doc), PRIORS, pushed=False)  # read what A pushed; B's own not pushed yet
    assert b.view()["a"].calls == pytest.approx(sum((1 - ALPHA) ** i for i in range(8)))
    doc = _sync(doc, b)
    assert live_stats_of(doc)["a"]["calls"] == pytest.approx(sum((1 - ALPHA) ** i for i in range(8)))


def test_agents_gone_from_the_newest_rib_leave_the_shared_document():
    a = LiveMetrics()
    a.share()
    _observe(a, CALLS)
    doc = merge_live_state(None, a.deltas(), rib=5, agents=PRIORS)
    old = merge_live_state(doc, {}, rib=4, agents={"a"})  # an older RIB drops nothing
    assert set(live_stats_of(old)) == {"a", "p|a", "b", "p|b"} and old["rib"] == 5
    new = merge_live_state(doc, {}, rib=6, agents={"a"})
    assert set(live_stats_of(new)) == {"a", "p|a"} and new["seq"] > doc["seq"]
    # The single-router format is read as the starting document.
    single = merge_live_state(a.state(), {}, rib=1, agents=PRIORS)
    assert live_stats_of(single)["a"] == a.state()["a"]
    fresh = LiveMetrics()
    assert fresh.load(doc) == 4 and fresh.view()["a"] == a.view()["a"]


# ------------------------------------------------------------------ breakers
def _board(**kw) -> tuple[BreakerBoard, list]:
    seen: list = []
    board = BreakerBoard(failure_threshold=3, base_backoff_s=2.0, jitter=0.0, rng=random.Random(0), **kw)
    board.add_listener(seen.append)
    return board, seen


def test_an_opening_is_published_and_trips_the_other_router_until_its_deadline():
    a_board, _ = _board()
    b_board, b_seen = _board()
    a, b = BreakerShare("router-a"), BreakerShare("router-b")
    a_board.add_listener(lambda t: a.on_transition(t, 1_000_000 + int(t.at * 1000)))
    b_board.add_listener(lambda t: b.on_transition(t, 1_000_000 + int(t.at * 1000)))
    for t in (10.0, 10.1, 10.2):
        a_board.on_result("llm", t, ok=False, code=ErrorCode.ETIMEOUT)
    assert a_board.open_agents(10.2) == {"llm"}
    store: dict[str, dict] = {}
    for agent, rec in a.take().items():
        store[agent] = BreakerShare.merge(store.get(agent), rec, 1_010_200)
    rec = store["llm"]
    assert rec["state"] == "open" and rec["owner"] == "router-a" and rec["open_until_ms"] == 1_012_200
    assert rec["openings"] == 1 and "peer failures" in rec["reason"]
    # Router B, whose clock reads 500.0 s at wall clock 1_010_700 ms: open until 500 + 1.5 s.
    moved = b.follow(b_board, store, now=500.0, now_ms=1_010_700, agents={"llm"})
    assert [agent for agent, _ in moved] == ["llm"]
    assert b_board.open_agents(500.0) == {"llm"} and not b_board.allow("llm", 501.4)
    assert b_board.retry_after_ms("llm", 500.0) == 1500
    assert b_seen[-1].event is BreakerEvent.REMOTE_TRIP and b_seen[-1].new is BreakerState.OPEN
    assert b.take() == {}  # a remote trip is not published again
    assert b.follow(b_board, store, now=500.5, now_ms=1_010_900, agents={"llm"}) == []  # applied once
    # Then the normal probing: half-open at the deadline; a success closes and is published.
    assert b_board.allow("llm", 501.5)
    b_board.on_result("llm", 501.9, ok=True)
    assert b_board.breaker("llm").state(501.9) is BreakerState.CLOSED
    closed = b.take()["llm"]
    assert closed["state"] == "closed"
    # A's own record is still in force: B's closing does not overwrite it ...
    assert BreakerShare.merge(store["llm"], closed, 1_011_000) == store["llm"]
    # ... once it expired it does, and A's breaker (open on its own evidence) is not released by it.
    store["llm"] = BreakerShare.merge(store["llm"], closed, 1_012_300)
    assert store["llm"]["state"] == "closed"
    assert a.follow(a_board, store, now=11.0, now_ms=1_011_000, agents={"llm"}) == []
    assert a_board.open_agents(11.0) == {"llm"}


def test_a_closing_elsewhere_half_opens_a_remotely_opened_breaker_and_failed_probes_back_off_longer():
    board, _ = _board()
    share = BreakerShare("me")
    board.add_listener(lambda t: share.on_transition(t, 1_000 + int(t.at * 1000)))
    records = {"llm": {"state": "open", "open_until_ms": 60_000, "owner": "other", "reason": "x", "openings": 3,
                       "at_ms": 1_000}}
    share.follow(board, records, now=0.0, now_ms=1_000, agents={"llm"})
    assert board.open_agents(30.0) == {"llm"}
    records["llm"] = {"state": "closed", "owner": "other", "reason": "a probe succeeded", "openings": 0, "at_ms": 2_000}
    moved = share.follow(board, records, now=1.0, now_ms=2_000, agents={"llm"})
    assert moved and board.breaker("llm").state(1.0) is BreakerState.HALF_OPEN
    assert board.allow("llm", 1.0)
    board.on_result("llm", 1.1, ok=False, code=ErrorCode.EAGENTDOWN)  # our own probe fails
    # openings was raised to the other router's 3: backoff 2·2³ = 16 s, not 2 s
    assert board.retry_after_ms("llm", 1.1) == 16_000
    assert share.take()["llm"]["openings"] == 4


def test_client_faults_never_reach_the_other_routers_and_unknown_agents_are_skipped():
    board, seen = _board()
    share = BreakerShare("me")
    board.add_listener(lambda t: share.on_transition(t, 0))
    for i in range(20):
        board.on_result("llm", float(i) / 10, ok=False, code=ErrorCode.EAGENTDOWN, client_fault=True)
        board.on_result("llm", float(i) / 10, ok=False, code=ErrorCode.EBUDGET)
    assert seen == [] and share.take() == {}
    records = {"gone": {"state": "open", "open_until_ms": 10_000, "owner": "x", "openings": 1, "at_ms": 1},
               "llm": {"state": "open", "open_until_ms": 500, "owner": "x", "openings": 1, "at_ms": 1}}
    assert share.follow(board, records, now=0.0, now_ms=1_000, agents={"llm"}) == []  # expired / not in the RIB
    assert board.open_agents(0.0) == set() and "gone" not in board.statistics()
