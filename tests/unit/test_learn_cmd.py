"""``atp-router learn`` (issue 23): a policy's bandit warm-started from labelled
outcomes into the router's store, so a router started afterwards routes with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from atp_router.deploy import single
from atp_router.deploy.learn_cmd import learn_main, read_outcomes
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.controlplane.learn_entries import ARM_PREFIX, decode_arm
from atp_router.store.sqlite import SqliteStore

RIB = """
agents:
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200}
  sec.bandit: {layer: L1, tool: bandit, p95_ms: 200}
policies:
  - name: qa
    match: {task_type: qa}
    fanout: [lint.ruff, sec.bandit]
    fanout_k: 1
    bandit: {text_features: true, bits: 10, explore: 0}
"""
WEAK, STRONG = "lint.ruff", "sec.bandit"


def _outcomes(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            hard = i % 2 == 0  # hard: only the strong agent answers; easy: only the weak one
            f.write(json.dumps({"prompt": f"{'prove the integral' if hard else 'name the capital'} {rng.integers(99)}",
                                "subject": "math" if hard else "geo", "weak_correct": not hard,
                                "strong_correct": hard}) + "\n")
        f.write(json.dumps({"prompt": "x", "weak_correct": True, "strong_correct": True, "contaminated": True}) + "\n")


def _first_choice(router, subject: str, prompt: str) -> str:
    learner = router.learning.learner
    bandit, feat = learner.policy_bandit("qa")
    ctx = feat({"task_type": "qa", "subject": subject}, prompt)
    return bandit.choose(ctx, np.random.default_rng(0)).order[0]


@pytest.mark.parametrize("method", [["update"], ["fit"], ["fit", "--prior-precision", "10"], ["gain"]])
def test_a_router_started_after_learn_routes_with_the_warm_state(tmp_path, method, capsys):
    rib = tmp_path / "rib.yaml"
    rib.write_text(RIB)
    data = tmp_path / "outcomes.jsonl"
    _outcomes(data, 60)
    state = tmp_path / "state"
    cold = single.build(RouterConfig(policies=rib, state_dir=tmp_path / "cold"))
    try:
        # A cold bandit (explore 0, equal priors, equal costs) picks one arm whatever the task.
        cold_picks = {_first_choice(cold, s, p) for s, p in (("math", "prove the integral 3"),
                                                              ("geo", "name the capital 3"))}
        assert len(cold_picks) == 1
    finally:
        cold.close_state()
    assert learn_main(["--from", str(data), "--policy", "qa", "--policies", str(rib), "--state-dir", str(state),
                       "--arms", f"{WEAK},{STRONG}", "--method", *method]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"LEARN policy=qa rows=60 arms={WEAK},{STRONG}"
    assert any(line.startswith(f"gain {STRONG} over {WEAK}:") for line in out) == (method == ["gain"])
    with SqliteStore.open(state, create=False) as store:
        entries = {k: decode_arm(v) for k, v in store.items(ARM_PREFIX)}
    assert set(entries) == {f"{ARM_PREFIX}qa/{WEAK}", f"{ARM_PREFIX}qa/{STRONG}"}
    assert all(e["state"]["count"] == 60 for e in entries.values())
    router = single.build(RouterConfig(policies=rib, state_dir=state))
    try:
        assert _first_choice(router, "math", "prove the integral 3") == STRONG
        assert _first_choice(router, "geo", "name the capital 3") == WEAK
        est = router.learning.learner.policy_bandit("qa")[0].arms
        assert est[WEAK].count == est[STRONG].count == 60
        # the fitted arms' precision: the prior's (10 where given) plus what the rows added
        assert est[WEAK].q.min() == (10.0 if "--prior-precision" in method else 1.0)
    finally:
        router.close_state()
    # Learning again adds to the stored arms (they start from what the store holds).
    assert learn_main(["--from", str(data), "--policy", "qa", "--policies", str(rib), "--state-dir", str(state),
                       "--arms", f"{WEAK},{STRONG}", "--method", *method]) == 0
    with SqliteStore.open(state, create=False) as store:
        assert all(decode_arm(v)["state"]["count"] == 120 for _, v in store.items(ARM_PREFIX))


def test_unknown_policy_arms_and_bad_rows_are_refused(tmp_path, capsys):
    rib = tmp_path / "rib.yaml"
    rib.write_text(RIB)
    data = tmp_path / "o.jsonl"
    _outcomes(data, 4)
    base = ["--from", str(data), "--policies", str(rib), "--state-dir", str(tmp_path / "s")]
    for extra in (["--policy", "nope"], ["--policy", "qa", "--arms", "lint.ruff,nobody"],
                  ["--policy", "qa", "--prior-precision", "10"]):
        with pytest.raises(SystemExit) as e:
            learn_main(base + extra)
        assert e.value.code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "weak_correct": true}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_outcomes(bad, WEAK, STRONG)
    any_arms = tmp_path / "any.jsonl"
    any_arms.write_text('{"prompt": "p", "meta": {"task_type": "qa"}, "outcomes": {"lint.ruff": 0.25}}\n')
    assert read_outcomes(any_arms, WEAK, STRONG) == [({"task_type": "qa"}, "p", {"lint.ruff": 0.25})]


@pytest.mark.parametrize("heads", [1, 2])
def test_a_gain_warm_start_is_the_routers_model_learns_online_and_survives_a_restart(tmp_path, capsys, heads):
    """``--method gain``: the stored gain model (vocabulary + weights; 2 heads, one per
    arm, by default; 1, of the gain label) is what the router's policy chooses by on the
    SYN path (the featurizer fills its columns); online feedback updates it, the
    router's save keeps that, a restart reads it."""
    from atp_router.policy.learn import Decision
    from atp_router.policy.textgain import TextGain
    from atp_router.runtime.controlplane.learn_entries import GAIN_PREFIX, decode_gain

    rib = tmp_path / "rib.yaml"
    rib.write_text(RIB)
    data = tmp_path / "outcomes.jsonl"
    _outcomes(data, 60)
    state = tmp_path / "state"
    assert learn_main(["--from", str(data), "--policy", "qa", "--policies", str(rib), "--state-dir", str(state),
                       "--arms", f"{WEAK},{STRONG}", "--method", "gain", "--gain-weight", "1"] + (["--gain-heads", "1"] if heads == 1 else [])) == 0
    with SqliteStore.open(state, create=False) as store:
        entry = decode_gain(store.get(f"{GAIN_PREFIX}qa"))
    assert entry["arms"] == [WEAK, STRONG] and entry["weight"] == 1.0
    stored = TextGain.from_state(entry["state"])
    assert stored.count == 60 and stored.heads == heads
    router = single.build(RouterConfig(policies=rib, state_dir=state))
    try:
        learner = router.learning.learner
        bandit, feat = learner.policy_bandit("qa")
        assert isinstance(bandit.gain, TextGain) and feat.vocab is not None and bandit.pair == (WEAK, STRONG)
        ctx = feat({"task_type": "qa", "subject": "math"}, "prove the integral 7")
        assert ctx.aux is not None and bandit.gain.logit(ctx) == pytest.approx(stored.logit(ctx))
        assert _first_choice(router, "math", "prove the integral 3") == STRONG
        assert _first_choice(router, "geo", "name the capital 3") == WEAK
        # online: a decision's feedback teaches the gain model, and the save keeps it
        before = bandit.gain.logit(ctx)
        learner.observe(Decision("qa", (STRONG, WEAK), 1, ctx, 0.0, called=[STRONG]), {STRONG: 0.0})
        assert bandit.gain.logit(ctx) < before
        assert learner.dirty_gain == {"qa"}
        router.learning.save()
    finally:
        router.close_state()
    with SqliteStore.open(state, create=False) as store:
        assert TextGain.from_state(decode_gain(store.get(f"{GAIN_PREFIX}qa"))["state"]).count == 61
    again = single.build(RouterConfig(policies=rib, state_dir=state))
    try:
        assert again.learning.learner.policy_bandit("qa")[0].gain.count == 61
        assert again.learning.learner.policy_bandit("qa")[0].gain.heads == heads
    finally:
        again.close_state()
