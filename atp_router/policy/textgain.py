"""The gain model a router warm-starts from an offline fit (issue 23; spec §6.2,
§18): the offline anchor of ``bench/replay_routing.py`` — an L2 logistic
regression of the gain label ``(strong − weak + 1)/2`` on TF-IDF word 1–2-grams
and meta one-hots (:mod:`atp_router.policy.offline`) — as a Bayesian model the
router computes on the SYN path and keeps updating online.

* :class:`TermVocab` — the TF-IDF vocabulary of a training set, as the
  router's :class:`~atp_router.policy.bandit.Featurizer` sees text: the words of
  the first :data:`~atp_router.policy.bandit.TEXT_CHARS` characters (at most
  :data:`~atp_router.policy.bandit.MAX_WORDS`), each term keyed by the
  featurizer's own 32-bit hash (unigrams: CRC-32; bigrams: the featurizer's
  combination of two, tagged ``1 << 32``), meta ``key=value`` tokens of
  :data:`~atp_router.policy.bandit.META_KEYS` tagged ``1 << 33``. Terms in at
  least ``min_df`` training rows are kept, sorted, with the smoothed idf
  ``ln((1+n)/(1+df)) + 1``. A row's features: sublinear tf × idf of its known
  terms, L2-normalised, then each known meta token with value 1, then the
  intercept column (value 1). So it is scikit-learn's ``TfidfVectorizer(
  ngram_range=(1, 2), sublinear_tf=True, min_df=2)`` up to 32-bit hash
  collisions between kept terms (merged, in the fit and at serve time alike).
  Mapping a prompt costs one ``searchsorted`` of its hashes.
* :class:`TextGain` — a diagonal-Gaussian Bayesian logistic model over those
  columns (like :class:`~atp_router.policy.bandit.ArmModel`), of the gain of
  the dear arm over the cheap one: ``E[q_dear − q_cheap] = 2σ(z) − 1``.
  :meth:`TextGain.fit` is the offline anchor's fit (L-BFGS MAP of the log-loss
  under precision ``1/C`` on every weight but the intercept — scikit-learn's
  objective), with its Laplace precision; :meth:`TextGain.update` one Laplace
  step per observation, as the arms learn online. A
  :class:`~atp_router.policy.bandit.Bandit` chooses by it (:meth:`Bandit.set_gain
  <atp_router.policy.bandit.Bandit.set_gain>`) on the context's ``aux`` part,
  which the policy's featurizer fills when it holds the vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from atp_router.policy.bandit import Context, indicator_tokens, meta_key, text_grams
from atp_router.policy.offline import Sparse, fit_logistic

__all__ = ["GainDelta", "TermVocab", "TextGain", "term_keys"]

_BIGRAM = np.uint64(1 << 32)
_META = np.uint64(1 << 33)
#: The intercept's prior precision (≈ unpenalised, as in scikit-learn).
INTERCEPT_PRECISION = 1e-6
#: Upper bound of a vocabulary's terms (a stored state above it is refused).
MAX_TERMS = 1 << 21


def term_keys(text: str) -> np.ndarray:
    """The text's term keys (uint64, with repeats): unigrams, then tagged bigrams."""
    uni, bi = text_grams(text)
    return np.concatenate((uni, bi | _BIGRAM))


class TermVocab:
    """Hashed TF-IDF vocabulary (module doc): sorted text ``keys`` with their
    ``idf``, sorted ``meta`` keys. Columns: text terms, meta tokens, intercept."""

    __slots__ = ("_digest", "idf", "keys", "meta")

    def __init__(self, keys: np.ndarray, idf: np.ndarray, meta: np.ndarray):
        if keys.shape != idf.shape or len(keys) + len(meta) > MAX_TERMS:
            raise ValueError("vocabulary: keys and idf differ in length, or too many terms")
        self.keys = keys.astype(np.uint64)
        self.idf = idf.astype(np.float64)
        self.meta = meta.astype(np.uint64)
        self._digest = ""

    @property
    def digest(self) -> str:
        """SHA-256 (hex, 16 digits) of the keys and meta keys: which vocabulary a delta was learned over."""
        if not self._digest:
            h = hashlib.sha256(self.keys.astype("<u8").tobytes())
            h.update(self.meta.astype("<u8").tobytes())
            self._digest = h.hexdigest()[:16]
        return self._digest

    @property
    def n_cols(self) -> int:
        """Columns including the intercept (the last)."""
        return len(self.keys) + len(self.meta) + 1

    @classmethod
    def fit(cls, texts: Sequence[str], metas: Sequence[Mapping[str, Any]], *, min_df: int = 2) -> TermVocab:
        """The vocabulary of a training set: ``texts`` and each row's task meta
        (its :func:`~atp_router.policy.bandit.indicator_tokens`: every one seen is kept)."""
        per_doc = [np.unique(term_keys(t)) for t in texts]
        allk = np.concatenate(per_doc) if per_doc else np.zeros(0, np.uint64)
        uniq, df = np.unique(allk, return_counts=True)
        keep = df >= min_df
        idf = np.log((1 + len(texts)) / (1 + df[keep])) + 1.0
        meta = np.unique(np.fromiter((meta_key(t) for m in metas for t in indicator_tokens(m)), dtype=np.uint64))
        return cls(uniq[keep], idf, meta)

    def context(self, keys: np.ndarray, meta: Sequence[int]) -> Context:
        """One row's columns and values (module doc) from its :func:`term_keys` and meta keys."""
        n = len(self.keys)
        if len(keys) and n:
            pos = np.searchsorted(self.keys, keys)
            pos[pos >= n] = 0
            col, tf = np.unique(pos[self.keys[pos] == keys], return_counts=True)
            val = (1.0 + np.log(tf)) * self.idf[col]
            norm = math.sqrt(float(val @ val))
            if norm > 0:
                val = val / norm
        else:
            col, val = np.zeros(0, np.int64), np.zeros(0)
        mk = np.asarray(meta, dtype=np.uint64)
        if len(mk) and len(self.meta):
            mpos = np.searchsorted(self.meta, mk)
            mpos[mpos >= len(self.meta)] = 0
            mcol = np.unique(mpos[self.meta[mpos] == mk]) + n
        else:
            mcol = np.zeros(0, np.int64)
        idx = np.concatenate((col.astype(np.int64), mcol.astype(np.int64), [self.n_cols - 1]))
        return Context(idx, np.concatenate((val, np.ones(len(mcol) + 1))))


@dataclass(frozen=True, slots=True)
class GainDelta:
    """What a :class:`TextGain` learned since a base state over the vocabulary
    ``digest``: Δ(precision × mean) ``eta``, Δprecision ``q``, Δ``count`` —
    natural parameters, which add (as :class:`~atp_router.policy.bandit.ArmDelta`'s)."""

    digest: str
    eta: np.ndarray
    q: np.ndarray
    count: float

    @property
    def empty(self) -> bool:
        return self.count == 0 and not self.eta.any() and not self.q.any()


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


class TextGain:
    """The gain model (module doc): ``vocab``, posterior mean ``m`` and
    precision ``q`` per column, ``count`` observations. Reads ``ctx.aux``; a
    context without one (a featurizer without the vocabulary) gives the
    intercept's gain and teaches nothing."""

    __slots__ = ("count", "m", "q", "vocab")

    def __init__(self, vocab: TermVocab, *, prior_precision: float = 1.0):
        self.vocab = vocab
        self.m = np.zeros(vocab.n_cols)
        self.q = np.full(vocab.n_cols, float(prior_precision))
        self.q[-1] = INTERCEPT_PRECISION
        self.count = 0.0

    def _aux(self, ctx: Context) -> Context:
        aux = ctx.aux
        if aux is None or (len(aux.idx) and int(aux.idx[-1]) != self.vocab.n_cols - 1):
            return Context(np.array([self.vocab.n_cols - 1]), np.ones(1))
        return aux

    def logit(self, ctx: Context) -> float:
        aux = self._aux(ctx)
        return float(self.m[aux.idx] @ aux.val)

    def mean(self, ctx: Context) -> float:
        """σ of the posterior-mean logit: ``(E[gain] + 1) / 2``."""
        return _sigmoid(self.logit(ctx))

    def std(self, ctx: Context) -> float:
        aux = self._aux(ctx)
        return math.sqrt(float((aux.val * aux.val) @ (1.0 / self.q[aux.idx])))

    def sample(self, ctx: Context, rng: np.random.Generator, explore: float = 1.0) -> float:
        """A Thompson draw (``explore`` × std on the logit; 0: the mean)."""
        z = self.logit(ctx)
        if explore > 0:
            z += explore * self.std(ctx) * float(rng.standard_normal())
        return _sigmoid(z)

    def update(self, ctx: Context, label: float, weight: float = 1.0, *, only: int | None = None) -> None:
        """One Laplace step on the label ``(q_dear − q_cheap + 1)/2`` in 0..1.
        Nothing is learned from a context without ``aux`` or with ``only``
        (a tenant-scoped update: the gain model has no tenant features)."""
        if ctx.aux is None or only is not None:
            return
        aux = self._aux(ctx)
        y = min(max(float(label), 0.0), 1.0)
        m = self.m[aux.idx]
        p = _sigmoid(float(m @ aux.val))
        q = self.q[aux.idx] + weight * p * (1.0 - p) * aux.val * aux.val
        self.q[aux.idx] = q
        self.m[aux.idx] = m + weight * (y - p) * aux.val / q
        self.count += weight

    def fit(self, contexts: Sequence[Context], labels: Sequence[float] | np.ndarray, *, C: float = 1.0) -> TextGain:
        """The offline anchor's fit on ``contexts``' ``aux`` rows (module doc): the
        MAP with precision ``1/C`` (intercept unpenalised) and its Laplace
        precision. Replaces the posterior; ``count`` grows by the rows. Returns self."""
        rows = [(c.aux.idx[:-1], c.aux.val[:-1]) if c.aux is not None else (np.zeros(0, np.int64), np.zeros(0))
                for c in contexts]
        d = self.vocab.n_cols - 1
        X = Sparse.from_rows(rows, d)
        model = fit_logistic(X, np.asarray(labels, dtype=np.float64), C=C)
        self.m = np.append(model.coef, model.intercept)
        z = model.logit(X)
        w = 1.0 / (1.0 + np.exp(-z))
        w = w * (1.0 - w)
        self.q = np.append(1.0 / C + X.sq_tdot(w), INTERCEPT_PRECISION + float(w.sum()))
        self.count += float(len(contexts))
        return self

    # ------------------------------------------------------------ merging
    def copy(self) -> TextGain:
        """An independent copy of the posterior (the vocabulary is shared: it never changes)."""
        g = TextGain.__new__(TextGain)
        g.vocab, g.m, g.q, g.count = self.vocab, self.m.copy(), self.q.copy(), self.count
        return g

    def delta(self, base: TextGain) -> GainDelta:
        """What this model learned since ``base`` (the state it last shared);
        raises ValueError when ``base`` is over another vocabulary."""
        if base.vocab.digest != self.vocab.digest:
            raise ValueError("gain delta: another vocabulary")
        return GainDelta(self.vocab.digest, self.q * self.m - base.q * base.m, self.q - base.q,
                         self.count - base.count)

    def merge(self, delta: GainDelta) -> None:
        """Add another learner's :class:`GainDelta`. Raises ValueError (and
        changes nothing) when its vocabulary differs or a precision would not
        stay positive and finite."""
        if delta.digest != self.vocab.digest or delta.q.shape != self.q.shape or delta.eta.shape != self.m.shape:
            raise ValueError("gain merge: the delta is over another vocabulary")
        if delta.empty:
            return
        q = self.q + delta.q
        eta = self.q * self.m + delta.eta
        if not (np.all(q > 0) and np.all(np.isfinite(q)) and np.all(np.isfinite(eta))):
            raise ValueError("gain merge: the merged precision is not positive and finite")
        self.q, self.m = q, eta / q
        self.count += delta.count

    # ------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """``{keys, idf, meta, m, q: bytes, count}`` (little-endian u8 / f8)."""
        v = self.vocab
        return {"keys": v.keys.astype("<u8").tobytes(), "idf": v.idf.astype("<f8").tobytes(),
                "meta": v.meta.astype("<u8").tobytes(), "m": self.m.astype("<f8").tobytes(),
                "q": self.q.astype("<f8").tobytes(), "count": self.count}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TextGain:
        """Inverse of :meth:`state`; raises ValueError (or KeyError/TypeError) on a malformed one."""
        keys = np.frombuffer(state["keys"], dtype="<u8")
        vocab = TermVocab(keys, np.frombuffer(state["idf"], dtype="<f8"), np.frombuffer(state["meta"], dtype="<u8"))
        if len(keys) > 1 and not np.all(keys[1:] > keys[:-1]):
            raise ValueError("gain state: the vocabulary is not sorted")
        g = cls(vocab)
        m, q = np.frombuffer(state["m"], dtype="<f8"), np.frombuffer(state["q"], dtype="<f8")
        if m.shape != (vocab.n_cols,) or q.shape != m.shape or not np.all(q > 0) \
                or not np.all(np.isfinite(m)) or not np.all(np.isfinite(q)) or not np.all(np.isfinite(vocab.idf)):
            raise ValueError("gain state: wrong shape, non-finite value or non-positive precision")
        g.m, g.q, g.count = m.astype(np.float64), q.astype(np.float64), float(state["count"])
        return g
