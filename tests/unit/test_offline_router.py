"""The offline routers of atp_router.policy.offline and replay's score_curve /
warm_bandit (issue 23: the practitioner's anchors the bandit is measured against)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from atp_router.policy.bandit import Featurizer
from atp_router.policy.offline import (
    Sparse,
    Tfidf,
    fit_logistic,
    gain_label,
    gain_table,
    lbfgs,
)
from atp_router.policy.replay import (
    STRONG,
    WEAK,
    Row,
    apgr,
    oracle_curve,
    run_bandit,
    score_curve,
    warm_bandit,
)


def test_gain_label_and_table():
    assert [gain_label(w, s) for w, s in ((True, True), (False, True), (True, False), (False, False))] == \
        [0.5, 1.0, 0.0, 0.5]
    t = gain_table(["a", "a", "b"], [1.0, 0.0, -1.0])
    assert t == {"a": 0.5, "b": -1.0}
    shrunk = gain_table(["a", "a", "b"], [1.0, 0.0, -1.0], prior_weight=1.0)
    assert shrunk["b"] == pytest.approx((-1.0 + 0.0) / 2)


def test_tfidf_matches_the_formula_by_hand():
    docs = ["the cat sat", "the cat ran", "a dog ran"]
    vec = Tfidf(min_df=2).fit(docs, ["x", "y", "x"])
    assert set(vec.vocab) == {"the", "cat", "ran", "the cat"}
    X = vec.transform(["the cat the"], ["y"])
    dense = np.zeros(vec.n_cols)
    np.add.at(dense, X.col, X.val)
    idf = {t: math.log(4 / (1 + df)) + 1 for t, df in (("the", 2), ("cat", 2), ("the cat", 2))}
    raw = {"the": (1 + math.log(2)) * idf["the"], "cat": idf["cat"], "the cat": idf["the cat"]}
    norm = math.sqrt(sum(v * v for v in raw.values()))
    for t, v in raw.items():
        assert dense[vec.vocab[t]] == pytest.approx(v / norm)
    assert dense[vec.vocab["ran"]] == 0
    assert dense[vec.meta["y"]] == 1.0 and dense[vec.meta["x"]] == 0.0


def test_sparse_products_and_take():
    rng = np.random.default_rng(0)
    A = rng.random((5, 4)) * (rng.random((5, 4)) < 0.5)
    r, c = np.nonzero(A)
    X = Sparse(r.astype(np.int64), c.astype(np.int64), A[r, c], 5, 4)
    w, v = rng.random(4), rng.random(5)
    assert np.allclose(X.dot(w), A @ w)
    assert np.allclose(X.tdot(v), A.T @ v)
    assert np.allclose(X.sq_tdot(v), (A * A).T @ v)
    assert np.allclose(X.take(np.array([3, 1])).dot(w), (A @ w)[[3, 1]])


def test_lbfgs_minimises_a_quadratic():
    M = np.array([[3.0, 1.0], [1.0, 2.0]])
    b = np.array([1.0, -1.0])
    x = lbfgs(lambda x: (0.5 * x @ M @ x - b @ x, M @ x - b), np.zeros(2), tol=1e-10)
    assert np.allclose(x, np.linalg.solve(M, b), atol=1e-6)


def test_fit_logistic_reaches_the_optimum_and_learns_the_signal():
    rng = np.random.default_rng(1)
    n, d = 400, 6
    A = rng.standard_normal((n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-(2 * A[:, 0] - A[:, 1] + 0.5)))).astype(float)
    y[:20] = 0.5  # fractional labels are fine
    r, c = np.nonzero(A)
    X = Sparse(r.astype(np.int64), c.astype(np.int64), A[r, c], n, d)
    m = fit_logistic(X, y, C=0.5)
    p = 1 / (1 + np.exp(-(A @ m.coef + m.intercept)))
    # first-order optimality of ½‖w‖² + C Σ logloss: w + C Aᵀ(p − y) = 0, Σ(p − y) = 0
    assert np.allclose(m.coef + 0.5 * A.T @ (p - y), 0, atol=1e-4)
    assert abs(float(np.sum(p - y))) < 1e-3
    assert m.coef[0] > 1.0 and m.coef[1] < -0.4 and abs(m.coef[3]) < 0.3
    with pytest.raises(ValueError):
        fit_logistic(X, y[:-1])


def _rows(n: int, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        hard = i % 2 == 0  # "hard" prompts: the weak model fails, the strong one answers
        out.append(Row(f"{'integral proof' if hard else 'capital city'} q{i}", weak=not hard and rng.random() < 0.9,
                       strong=rng.random() < 0.9, subject="math" if hard else "geo"))
    return out


def test_score_curve_ranks_by_score_and_a_perfect_score_is_the_oracle_at_the_gain_share():
    rows = _rows(200)
    gains = [int(r.strong) - int(r.weak) for r in rows]
    shares = [i / 100 for i in range(101)]
    c = score_curve("perfect", rows, gains, shares)
    o = oracle_curve(rows, shares)
    wk = sum(r.weak for r in rows) / len(rows)
    st = sum(r.strong for r in rows) / len(rows)
    assert apgr(c, wk, st) == pytest.approx(apgr(o, wk, st), abs=0.01)
    worst = score_curve("inverse", rows, [-g for g in gains], shares)
    assert apgr(worst, wk, st) < 0.5 < apgr(c, wk, st)
    with pytest.raises(ValueError):
        score_curve("x", rows, gains[:-1], shares)


def test_warm_bandit_learned_the_train_rows_and_routes_better_than_from_zero():
    rows = _rows(400)
    feat = Featurizer(bits=10, text=True)
    ctx = [feat({"task_type": "qa", "subject": r.subject}, r.prompt) for r in rows]
    warm = warm_bandit(rows[:200], ctx[:200], bits=10, explore=0.25)
    assert warm.arms[WEAK].count == warm.arms[STRONG].count == 200
    hard, easy = ctx[0], ctx[1]
    assert warm.arms[STRONG].mean(hard) - warm.arms[WEAK].mean(hard) > \
        warm.arms[STRONG].mean(easy) - warm.arms[WEAK].mean(easy) + 0.3
    cold_acc = run_bandit(rows[200:], 0.5, text=True, seed=0, explore=0.25, bits=10, contexts=ctx[200:])[1]
    warm_acc = run_bandit(rows[200:], 0.5, text=True, seed=0, explore=0.25, bits=10, contexts=ctx[200:],
                          warm=warm)[1]
    assert warm_acc > cold_acc
    assert warm.arms[WEAK].count == 200  # run_bandit learned on a copy


def test_fit_arm_is_the_map_under_the_arms_prior_with_its_laplace_precision():
    from atp_router.policy.bandit import ArmModel, Context
    from atp_router.policy.offline import fit_arm

    rng = np.random.default_rng(3)
    ctxs = [Context(np.array([1, 2 + i % 3]), np.array([1.0, rng.random()])) for i in range(50)]
    y = np.array([float(rng.random() < (0.8 if c.idx[1] == 2 else 0.2)) for c in ctxs])
    arm = ArmModel(bits=4, prior_precision=2.0)
    m0, q0 = arm.m.copy(), arm.q.copy()
    fit_arm(arm, ctxs, y)
    grad = q0 * (arm.m - m0)
    hess = q0.copy()
    for c, t in zip(ctxs, y, strict=True):
        p = 1 / (1 + np.exp(-(arm.m[c.idx] @ c.val)))
        grad[c.idx] += (p - t) * c.val
        hess[c.idx] += p * (1 - p) * c.val ** 2
    assert np.allclose(grad, 0, atol=1e-5)
    assert np.allclose(arm.q, hess, rtol=1e-4)
    assert arm.count == 50 and arm.m[2] > arm.m[3]


def test_bandit_gain_model_learns_the_gain_and_chooses_by_it():
    from atp_router.policy.bandit import Bandit, Context

    with pytest.raises(ValueError):
        Bandit({"a": 0, "b": 1, "c": 2}, gain=True)
    b = Bandit({"cheap": 0.1, "dear": 1.0}, bits=6, explore=0.0, lam=0.3, gain=True)
    assert b.pair == ("cheap", "dear")
    hard, easy = Context(np.array([3]), np.array([1.0])), Context(np.array([5]), np.array([1.0]))
    for _ in range(30):  # both arms equally often right overall: only the gain tells them apart
        b.update(hard, {"cheap": 0.0, "dear": 1.0})
        b.update(easy, {"cheap": 1.0, "dear": 0.0})
    assert b.gain is not None and b.gain.mean(hard) > 0.9 and b.gain.mean(easy) < 0.1
    rng = np.random.default_rng(0)
    assert b.choose(hard, rng).order[0] == "dear"
    assert b.choose(easy, rng).order[0] == "cheap"
    # One arm's outcome: the gain learns it against the other arm's posterior mean.
    before = b.gain.mean(hard)
    b.update(hard, {"dear": 0.0})
    assert b.gain.mean(hard) < before
