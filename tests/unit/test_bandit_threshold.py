"""The budget-aware choice as a threshold (issue 23 item 1): with ``target_cost``
the bandit sends the dear arm the tasks whose extra quality clears λ, and λ's
dual-ascent step (:data:`~atp_router.policy.bandit.LAM_STEP`) is noise on that
threshold. A bandit that already knows each task's gain (a warm start) must spend
its dear calls on the tasks that gain most, as an offline ranking would."""

import msgspec
import numpy as np
import pytest

from atp_router.policy.bandit import LAM_STEP, Bandit, Featurizer
from atp_router.policy.learn import RoutingLearner
from atp_router.policy.rib import Rib

GROUPS = 60
#: The dear arm's extra quality per group (the cheap arm is 0.5 everywhere): 0 … 0.12.
GAIN = np.linspace(0.0, 0.12, GROUPS)


def _captured(step: float | None, seed: int, *, n: int = 6000, target: float = 0.3) -> tuple[float, float]:
    """(share of the best possible gain the dear calls bought, dear-call share) of a
    greedy bandit whose arms are known exactly, over ``n`` random tasks."""
    f = Featurizer(bits=12)
    kw = {} if step is None else {"lam_step": step}
    b = Bandit({"weak": 0.0, "strong": 1.0}, bits=12, explore=0.0, target_cost=target, **kw)
    ctxs = [f({"subject": f"g{i}"}) for i in range(GROUPS)]
    for i in range(GROUPS):
        p = 0.5 + GAIN[i]
        b.arms["strong"].m[f.index(f"subject=g{i}")] = np.log(p / (1 - p))
    rng = np.random.default_rng(seed)
    got, strong = 0.0, 0
    for g in rng.integers(0, GROUPS, n):
        arm = b.choose(ctxs[g], rng).order[0]
        b.charge((arm,))
        if arm == "strong":
            got += GAIN[g]
            strong += 1
    best = np.sort(GAIN)[::-1][:round(strong / n * GROUPS)].mean() * strong
    return got / best, strong / n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_lambda_step_spends_the_dear_calls_where_they_gain_most(seed):
    default, share = _captured(None, seed)
    old, old_share = _captured(0.02, seed)  # the step before issue 23
    assert share == pytest.approx(0.3, abs=0.01) and old_share == pytest.approx(0.3, abs=0.01)
    assert default >= 0.985  # within 1.5 % of the offline ranking's gain at the same spend
    assert old < 0.975 and default > old  # the test tells the steps apart


def test_the_router_bandits_use_the_default_step():
    rib = msgspec.convert({
        "agents": {a: {"layer": "L2", "tool": "ruff", "p95_ms": 300, "win30d": w, "strengths": ["code_review"]}
                   for a, w in (("a", 0.6), ("b", 0.8))},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a", "b"], "fanout_k": 1,
                      "bandit": {"target_cost": 0.3}}],
    }, Rib)
    learner = RoutingLearner(seed=0)
    learner.sync(rib)
    got = learner.policy_bandit("p")
    assert got is not None and got[0].lam_step == LAM_STEP == 0.005
