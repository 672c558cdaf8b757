"""Contextual bandit (spec §6.2): featurizer bounds, the arm model, the
budget-aware choice and its state."""

import subprocess
import sys

import numpy as np
import pytest

from atp_router.policy.bandit import MAX_FEATURES, ArmModel, Bandit, Context, Featurizer


def test_featurizer_is_bounded_and_stable_across_processes():
    f = Featurizer(bits=12, text=True)
    hostile = {"task_type": "x" * 10_000, "languages": [f"l{i}" for i in range(10_000)], "diff_loc": 1e308,
               "subject": {"nested": "ignored"}, "risk": float("nan")}
    ctx = f(hostile, "word " * 100_000 + " ".join(f"w{i}" for i in range(50_000)))
    assert len(ctx.idx) <= MAX_FEATURES and len(set(ctx.idx.tolist())) == len(ctx.idx)
    assert ctx.idx.min() >= 0 and ctx.idx.max() < 4096 and np.all(np.isfinite(ctx.val))
    code = ("from atp_router.policy.bandit import Featurizer; "
            "print(Featurizer(bits=12, text=True)({'task_type': 'code_review', 'languages': ['py']}, 'fix the bug').to_json())")
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    b = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin"}).stdout
    assert a == b and a.strip()


def test_arm_model_learns_and_round_trips():
    f = Featurizer(bits=10)
    good, bad = f({"subject": "good"}), f({"subject": "bad"})
    arm = ArmModel(bits=10, prior=0.5)
    for _ in range(200):
        arm.update(good, 1.0)
        arm.update(bad, 0.0)
    assert arm.mean(good) > 0.9 and arm.mean(bad) < 0.1
    assert arm.std(good) < ArmModel(bits=10).std(good)
    back = ArmModel.from_state(arm.state())
    assert back.mean(good) == pytest.approx(arm.mean(good), abs=1e-4) and back.count == 400
    with pytest.raises(ValueError):
        ArmModel.from_state({**arm.state(), "m": b"\x00" * 8})
    with pytest.raises(ValueError):
        Context.from_json({"idx": [5000], "val": [1.0]}, bits=10)


def test_prior_is_the_rib_win_rate():
    b = Bandit({"cheap": 1.0, "dear": 10.0}, priors={"cheap": 0.6, "dear": 0.86}, bits=10)
    est = b.estimates()
    assert est["cheap"]["mean"] == pytest.approx(0.6, abs=1e-3)
    assert est["dear"]["mean"] == pytest.approx(0.86, abs=1e-3)
    assert est["cheap"]["cost"] == pytest.approx(0.1) and est["dear"]["count"] == 0


def test_partial_feedback_trains_only_called_arms():
    f = Featurizer(bits=10)
    b = Bandit({"a": 1.0, "b": 1.0}, bits=10)
    ctx = f({"task_type": "t"})
    before = b.arms["b"].m.copy()
    b.update(ctx, {"a": 1.0})
    assert np.array_equal(b.arms["b"].m, before) and b.arms["a"].count == 1


def test_bar_prefers_the_cheapest_arm_that_clears_it():
    f = Featurizer(bits=10)
    ctx = f({"task_type": "t"})
    b = Bandit({"cheap": 1.0, "dear": 10.0}, priors={"cheap": 0.8, "dear": 0.95}, bits=10, explore=0.0, bar=0.7)
    assert b.choose(ctx, np.random.default_rng(0)).order == ("cheap", "dear")
    b.bar = 0.9  # only the dear one clears it
    assert b.choose(ctx, np.random.default_rng(0)).order[0] == "dear"
    b.bar = 0.0  # no bar, no λ: best quality first
    assert b.choose(ctx, np.random.default_rng(0)).order[0] == "dear"
    b.lam = 1.0  # 0.95 − 1.0 < 0.8 − 0.1
    assert b.choose(ctx, np.random.default_rng(0)).order[0] == "cheap"


def test_dual_ascent_holds_the_spend_target():
    f = Featurizer(bits=10)
    ctx = f({"task_type": "t"})
    rng = np.random.default_rng(1)
    b = Bandit({"weak": 0.0, "strong": 1.0}, priors={"weak": 0.6, "strong": 0.9}, bits=10, target_cost=0.25)
    strong = 0
    for _ in range(4000):
        arm = b.choose(ctx, rng).order[0]
        b.charge([arm])
        strong += arm == "strong"
    assert strong / 4000 == pytest.approx(0.25, abs=0.03)
    assert b.lam > 0


def test_tenant_and_qos_are_not_read_from_client_meta():
    f = Featurizer(bits=12)
    plain = f({"task_type": "t"})
    claimed = f({"task_type": "t", "tenant": "victim", "qos": "gold"})
    assert plain.idx.tolist() == claimed.idx.tolist()
    assert f.index("tenant=victim") in f({"task_type": "t"}, extra=["tenant=victim"]).idx.tolist()
