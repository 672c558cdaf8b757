"""Offline routers trained on labelled weak/strong outcomes (spec §18): the
practitioner's baseline a learning router is measured against, in numpy only
(no scikit-learn in the router's dependencies).

* :class:`Tfidf` — a TF-IDF vectoriser fitted on a training set: lower-cased
  words (:data:`atp_router.policy.bandit` tokenisation) and word bigrams seen in
  at least ``min_df`` training documents, sublinear term frequency
  (``1 + log tf``), smoothed idf ``ln((1+n)/(1+df)) + 1``, rows L2-normalised
  (scikit-learn's ``TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True,
  min_df=2)``). Optional meta indicators (e.g. ``subject=astronomy``) are
  appended as one-hot columns of value 1. Out-of-vocabulary terms are dropped.
* :class:`Sparse` — a CSR-like matrix (row ids, column ids, values) with the two
  products a linear model needs.
* :func:`fit_logistic` — L2-regularised logistic regression on fractional
  labels in 0..1 (the log-loss takes them), minimised by L-BFGS; the intercept
  is not penalised. The objective is scikit-learn's:
  ``½‖w‖² + C · Σᵢ logloss(yᵢ, σ(xᵢ·w + b))``.
* :func:`gain_label` — the target a router models: the gain of the strong model
  over the weak one, ``(strong − weak + 1) / 2`` in {0, ½, 1}; the fitted
  ``2σ(z) − 1`` is then the expected gain E[strong − weak] in −1..1. Modelling
  the gain rather than P(weak wrong) ranks prompts by what the strong call buys.
* :func:`gain_table` — the per-meta-value (e.g. per subject) mean gain.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from atp_router.policy.bandit import _WORD, ArmModel, Context

__all__ = ["LogisticModel", "Sparse", "Tfidf", "fit_arm", "fit_logistic", "gain_label", "gain_table", "lbfgs"]


def gain_label(weak: bool, strong: bool) -> float:
    """``(strong − weak + 1) / 2``: 1 when only the strong model is right, 0
    when only the weak one is, ½ when both agree."""
    return (int(strong) - int(weak) + 1) / 2.0


@dataclass(frozen=True, slots=True)
class Sparse:
    """``n_rows × n_cols`` sparse matrix as parallel ``row``/``col`` (int64) and ``val`` (float64)."""

    row: np.ndarray
    col: np.ndarray
    val: np.ndarray
    n_rows: int
    n_cols: int

    def dot(self, w: np.ndarray) -> np.ndarray:
        """``X @ w`` (length ``n_rows``)."""
        return np.bincount(self.row, weights=self.val * w[self.col], minlength=self.n_rows)

    def tdot(self, r: np.ndarray) -> np.ndarray:
        """``Xᵀ @ r`` (length ``n_cols``)."""
        return np.bincount(self.col, weights=self.val * r[self.row], minlength=self.n_cols)

    def sq_tdot(self, r: np.ndarray) -> np.ndarray:
        """``(X ∘ X)ᵀ @ r``: the diagonal of ``Xᵀ diag(r) X``."""
        return np.bincount(self.col, weights=self.val * self.val * r[self.row], minlength=self.n_cols)

    def take(self, rows: np.ndarray) -> Sparse:
        """The sub-matrix of ``rows`` (in that order)."""
        new = np.full(self.n_rows, -1, dtype=np.int64)
        new[rows] = np.arange(len(rows))
        keep = new[self.row] >= 0
        return Sparse(new[self.row[keep]], self.col[keep], self.val[keep], len(rows), self.n_cols)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[np.ndarray, np.ndarray]], n_cols: int) -> Sparse:
        """From per-row ``(col, val)`` pairs (e.g. bandit contexts' ``idx``/``val``)."""
        lens = np.fromiter((len(c) for c, _ in rows), dtype=np.int64, count=len(rows))
        row = np.repeat(np.arange(len(rows), dtype=np.int64), lens)
        col = np.concatenate([c for c, _ in rows]).astype(np.int64) if rows else np.zeros(0, np.int64)
        val = np.concatenate([v for _, v in rows]).astype(np.float64) if rows else np.zeros(0)
        return cls(row, col, val, len(rows), n_cols)


def _terms(text: str) -> list[str]:
    words = _WORD.findall(text.lower())
    return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]


class Tfidf:
    """TF-IDF of word unigrams + bigrams with optional meta one-hots (module doc)."""

    __slots__ = ("idf", "meta", "min_df", "vocab")

    def __init__(self, *, min_df: int = 2):
        self.min_df = min_df
        self.vocab: dict[str, int] = {}
        self.meta: dict[str, int] = {}
        self.idf = np.zeros(0)

    @property
    def n_cols(self) -> int:
        return len(self.vocab) + len(self.meta)

    def fit(self, texts: Sequence[str], metas: Sequence[str | None] | None = None) -> Tfidf:
        """Learn the vocabulary, idf and meta values of a training set."""
        df: dict[str, int] = {}
        for t in texts:
            for term in set(_terms(t)):
                df[term] = df.get(term, 0) + 1
        kept = sorted(t for t, c in df.items() if c >= self.min_df)
        self.vocab = {t: i for i, t in enumerate(kept)}
        n = len(texts)
        self.idf = np.array([math.log((1 + n) / (1 + df[t])) + 1.0 for t in kept])
        self.meta = {}
        for m in metas or ():
            if m is not None and m not in self.meta:
                self.meta[m] = len(self.vocab) + len(self.meta)
        return self

    def transform(self, texts: Sequence[str], metas: Sequence[str | None] | None = None) -> Sparse:
        """The rows of ``texts`` (and their meta values, when the vectoriser has any)."""
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        for i, t in enumerate(texts):
            tf: dict[int, int] = {}
            for term in _terms(t):
                j = self.vocab.get(term)
                if j is not None:
                    tf[j] = tf.get(j, 0) + 1
            col = np.fromiter(tf.keys(), dtype=np.int64, count=len(tf))
            val = (1.0 + np.log(np.fromiter(tf.values(), dtype=np.float64, count=len(tf)))) * self.idf[col]
            norm = float(np.sqrt(val @ val))
            if norm > 0:
                val = val / norm
            if metas is not None and self.meta:
                j = self.meta.get(metas[i]) if metas[i] is not None else None
                if j is not None:
                    col = np.append(col, j)
                    val = np.append(val, 1.0)
            rows.append((col, val))
        return Sparse.from_rows(rows, self.n_cols)


def lbfgs(f: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray, *, memory: int = 10,
          max_iter: int = 500, tol: float = 1e-6) -> np.ndarray:
    """Minimise a smooth convex ``f`` (returning value and gradient) by L-BFGS
    with a backtracking Armijo line search; stops when the gradient's max-norm
    is under ``tol`` × max(1, |f|) or after ``max_iter`` iterations."""
    x = x0.astype(np.float64).copy()
    fx, g = f(x)
    s_hist: list[np.ndarray] = []
    y_hist: list[np.ndarray] = []
    for _ in range(max_iter):
        if float(np.max(np.abs(g))) <= tol * max(1.0, abs(fx)):
            break
        # two-loop recursion
        q = g.copy()
        alphas = []
        for s, y in zip(reversed(s_hist), reversed(y_hist), strict=True):
            a = float(s @ q) / float(y @ s)
            alphas.append(a)
            q -= a * y
        if s_hist:
            q *= float(s_hist[-1] @ y_hist[-1]) / float(y_hist[-1] @ y_hist[-1])
        for (s, y), a in zip(zip(s_hist, y_hist, strict=True), reversed(alphas), strict=True):
            b = float(y @ q) / float(y @ s)
            q += (a - b) * s
        d = -q
        gd = float(g @ d)
        if gd >= 0:  # not a descent direction: restart from steepest descent
            s_hist.clear()
            y_hist.clear()
            d = -g
            gd = float(g @ d)
        step = 1.0 if s_hist else 1.0 / max(1.0, float(np.sqrt(g @ g)))
        for _ls in range(40):
            x_new = x + step * d
            f_new, g_new = f(x_new)
            if f_new <= fx + 1e-4 * step * gd:
                break
            step *= 0.5
        else:
            break
        s, y = x_new - x, g_new - g
        if float(s @ y) > 1e-12:
            s_hist.append(s)
            y_hist.append(y)
            if len(s_hist) > memory:
                s_hist.pop(0)
                y_hist.pop(0)
        x, fx, g = x_new, f_new, g_new
    return x


@dataclass(frozen=True, slots=True)
class LogisticModel:
    """A fitted logistic model: ``coef`` per column and the ``intercept``."""

    coef: np.ndarray
    intercept: float

    def logit(self, X: Sparse) -> np.ndarray:
        return X.dot(self.coef) + self.intercept

    def proba(self, X: Sparse) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logit(X)))


def fit_logistic(X: Sparse, y: np.ndarray, *, C: float = 1.0, max_iter: int = 500) -> LogisticModel:
    """L2-regularised logistic regression of labels ``y`` in 0..1 (module doc;
    ``C``: inverse regularisation strength, as scikit-learn's)."""
    y = np.clip(np.asarray(y, dtype=np.float64), 0.0, 1.0)
    if y.shape != (X.n_rows,):
        raise ValueError("fit_logistic: one label per row")
    d = X.n_cols

    def f(wb: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = wb[:d], wb[d]
        z = X.dot(w) + b
        # log(1 + e^z) − y z, stably
        loss = float(np.sum(np.logaddexp(0.0, z) - y * z))
        r = 1.0 / (1.0 + np.exp(-z)) - y
        grad = np.empty(d + 1)
        grad[:d] = C * X.tdot(r) + w
        grad[d] = C * float(r.sum())
        return 0.5 * float(w @ w) + C * loss, grad

    wb = lbfgs(f, np.zeros(d + 1), max_iter=max_iter)
    return LogisticModel(wb[:d], float(wb[d]))


def gain_table(metas: Sequence[str | None], gains: Sequence[float], *, prior_weight: float = 0.0
               ) -> Mapping[str | None, float]:
    """Mean gain per meta value (``prior_weight`` pseudo-observations of the
    overall mean shrink small groups toward it)."""
    overall = float(np.mean(gains)) if len(gains) else 0.0
    sums: dict[str | None, list[float]] = {}
    for m, g in zip(metas, gains, strict=True):
        s = sums.setdefault(m, [0.0, 0.0])
        s[0] += g
        s[1] += 1
    return {m: (s + prior_weight * overall) / (n + prior_weight) for m, (s, n) in sums.items()}


def fit_arm(arm: ArmModel, contexts: Sequence[Context], labels: Sequence[float] | np.ndarray, *,
            max_iter: int = 300) -> ArmModel:
    """Fit ``arm``'s posterior to labelled contexts in one batch: the MAP of the
    logistic likelihood under the arm's current diagonal Gaussian posterior as
    the prior (mean ``m₀``, precision ``q₀``), then the Laplace approximation's
    diagonal precision ``q₀ + Σᵢ pᵢ(1−pᵢ)xᵢ²`` at the optimum — what the online
    :meth:`ArmModel.update` approximates one observation at a time, without its
    order dependence. ``count`` grows by the number of rows. In place; returns ``arm``."""
    y = np.clip(np.asarray(labels, dtype=np.float64), 0.0, 1.0)
    if y.shape != (len(contexts),):
        raise ValueError("fit_arm: one label per context")
    if not len(contexts):
        return arm
    X = Sparse.from_rows([(c.idx, c.val) for c in contexts], len(arm.m))
    used = np.unique(X.col)
    col = np.searchsorted(used, X.col)
    Xc = Sparse(X.row, col, X.val, X.n_rows, len(used))
    m0, q0 = arm.m[used].copy(), arm.q[used].copy()

    def f(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = Xc.dot(w)
        r = 1.0 / (1.0 + np.exp(-z)) - y
        dw = w - m0
        return (0.5 * float(q0 @ (dw * dw)) + float(np.sum(np.logaddexp(0.0, z) - y * z)),
                q0 * dw + Xc.tdot(r))

    w = lbfgs(f, m0, max_iter=max_iter)
    p = 1.0 / (1.0 + np.exp(-Xc.dot(w)))
    arm.m[used] = w
    arm.q[used] = q0 + Xc.sq_tdot(p * (1.0 - p))
    arm.count += float(len(contexts))
    return arm
