"""Live FIB metrics and quality signals (atp_router.policy.learn, spec §6.2)."""

import pytest

from atp_router.consensus.types import ConsensusInfo, Finding, Result, Severity
from atp_router.policy.learn import MIN_OBS, LiveMetrics, consensus_quality


def _f(fid, provenance, span="10-12", file="a.py"):
    return Finding(id=fid, severity=Severity.HIGH, file=file, span=span, claim="c", confidence=0.8,
                   provenance=provenance)


def _result(*findings):
    return Result(findings=list(findings), consensus=ConsensusInfo(strategy="union_tiebreak", agreement=0.5))


def test_live_metrics_replace_priors_after_enough_calls():
    live = LiveMetrics()
    for i in range(MIN_OBS - 1):
        live.observe_call("a", policy="p", latency_ms=100, ok=True, timeout=False, tokens=100, usd_micros=50)
    assert live.view()["a"].p95_ms is None  # too few: the RIB's figure stays
    for i in range(40):
        live.observe_call("a", policy="p", latency_ms=100 if i % 10 else 3000, ok=i % 10 != 5, timeout=False,
                          tokens=100, usd_micros=50)
    v = live.view()["a"]
    assert 80 < v.p50_ms < 125 and v.p95_ms >= v.p50_ms
    assert 0.05 < v.error_rate < 0.2 and v.tokens_per_call == pytest.approx(100, rel=0.05)
    assert "p|a" in live.view()
    snapshot = live.view()
    live.observe_call("b", policy=None, latency_ms=5, ok=True, timeout=False, tokens=1, usd_micros=0)
    assert "b" not in snapshot and "b" in live.view()  # swapped, never mutated under a reader


def test_quality_blends_the_prior_and_round_trips():
    live = LiveMetrics()
    live.observe_quality("a", 0.0, policy=None, prior=0.8)
    v = live.view()["a"]
    assert v.quality == pytest.approx(0.8 * 10 / 11)
    back = LiveMetrics()
    assert back.load(live.state()) == 1
    assert back.view()["a"].quality == pytest.approx(v.quality)
    assert back.load({"x": {"prior": 0.5, "hist": "nope"}}) == 0


def test_consensus_quality_signals():
    res = _result(_f("F1", ["a#1", "b#2"]), _f("F2", ["a#3"], span="40-41"), _f("F3", ["b#4"], span="90-90"))
    q = consensus_quality(res, ["a", "b", "c"], failed=["c"])
    # Confirmed: F1 only. a: precision 1/2, recall 1 → 2/3; b the same; c failed.
    assert q == {"a": pytest.approx(2 / 3), "b": pytest.approx(2 / 3), "c": 0.0}
    # The escalation target confirms what it found; a failing test confirms what lies on it.
    q = consensus_quality(res, ["a", "b"], confirmer="b", failing_tests=[("a.py", 40, 40)])
    assert q == {"a": pytest.approx(0.8), "b": pytest.approx(0.8)}  # all three confirmed; each found two
    # Nothing found by anyone: agreeing on "nothing" is 1.0; unconfirmed findings 0.5.
    assert consensus_quality(_result(), ["a"]) == {"a": 1.0}
    assert consensus_quality(_result(_f("F1", ["a#1"])), ["a", "b"]) == {"a": 0.5, "b": 0.5}


def test_statistics_of_agents_gone_from_the_rib_are_dropped():
    live = LiveMetrics()
    for agent in ("team/a", "b"):
        live.observe_call(agent, policy="p/1", latency_ms=5, ok=True, timeout=False, tokens=1, usd_micros=0)
    assert set(live.view()) == {"team/a", "p/1|team/a", "b", "p/1|b"}
    live.set_priors({"team/a": 0.5})
    assert set(live.view()) == {"team/a", "p/1|team/a"} and set(live.state()) == {"team/a", "p/1|team/a"}
