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
  the dear arm over the cheap one: ``E[q_dear − q_cheap] = 2σ(z) − 1`` (1 head),
  or ``σ(z_dear) − σ(z_cheap)`` from one such model of each arm's quality (2
  heads, each learning only its own arm's observed outcomes online: what
  ``atp-router learn --method gain`` writes by default).
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
    precision ``q`` per column and head, ``count`` observations. Reads
    ``ctx.aux``; a context without one (a featurizer without the vocabulary)
    gives the intercept's gain and teaches nothing.

    ``heads``: 1 — one logistic model of the gain label ``(q_dear − q_cheap +
    1)/2`` (the offline anchor's form); 2 — two, of each arm's quality (cheap,
    then dear), the gain ``σ(z_dear) − σ(z_cheap)``: each head learns online only
    from its own arm's observed outcome (:meth:`observe`), never from a label the
    other arm's estimate filled in. ``m`` and ``q`` hold the heads one after the
    other (``heads × vocab.n_cols``), so a delta, a merge and a state carry both."""

    __slots__ = ("count", "heads", "m", "q", "vocab")

    def __init__(self, vocab: TermVocab, *, prior_precision: float = 1.0, heads: int = 1):
        if heads not in (1, 2):
            raise ValueError("a gain model has 1 head (the gain) or 2 (the cheap and the dear arm)")
        self.vocab = vocab
        self.heads = heads
        n = vocab.n_cols
        self.m = np.zeros(heads * n)
        self.q = np.full(heads * n, float(prior_precision))
        self.q[n - 1::n] = INTERCEPT_PRECISION
        self.count = 0.0

    def _aux(self, ctx: Context) -> Context:
        aux = ctx.aux
        if aux is None or (len(aux.idx) and int(aux.idx[-1]) != self.vocab.n_cols - 1):
            return Context(np.array([self.vocab.n_cols - 1]), np.ones(1))
        return aux

    def _cols(self, aux: Context, head: int) -> np.ndarray:
        """``head``'s positions in ``m`` and ``q`` of the context's columns."""
        return aux.idx + head * self.vocab.n_cols if head else aux.idx

    def _z(self, aux: Context, head: int) -> float:
        return float(self.m[self._cols(aux, head)] @ aux.val)

    def _var(self, aux: Context, head: int) -> float:
        return float((aux.val * aux.val) @ (1.0 / self.q[self._cols(aux, head)]))

    def logit(self, ctx: Context) -> float:
        """The logit of :meth:`mean` (1 head: the model's own logit)."""
        if self.heads == 1:
            return self._z(self._aux(ctx), 0)
        p = min(max(self.mean(ctx), 1e-12), 1.0 - 1e-12)
        return math.log(p / (1.0 - p))

    def mean(self, ctx: Context) -> float:
        """``(E[gain] + 1) / 2`` at the posterior means: σ of the logit (1 head),
        ``(σ(z_dear) − σ(z_cheap) + 1)/2`` (2 heads)."""
        aux = self._aux(ctx)
        if self.heads == 1:
            return _sigmoid(self._z(aux, 0))
        return (_sigmoid(self._z(aux, 1)) - _sigmoid(self._z(aux, 0)) + 1.0) / 2.0

    def std(self, ctx: Context) -> float:
        """The posterior std of the logit (2 heads: of the two logits' difference)."""
        aux = self._aux(ctx)
        return math.sqrt(sum(self._var(aux, h) for h in range(self.heads)))

    def sample(self, ctx: Context, rng: np.random.Generator, explore: float = 1.0) -> float:
        """A Thompson draw of ``(gain + 1)/2`` (``explore`` × std on each logit; 0: the mean)."""
        if explore <= 0:
            return self.mean(ctx)
        aux = self._aux(ctx)
        z = [self._z(aux, h) + explore * math.sqrt(self._var(aux, h)) * float(rng.standard_normal())
             for h in range(self.heads)]
        return _sigmoid(z[0]) if self.heads == 1 else (_sigmoid(z[1]) - _sigmoid(z[0]) + 1.0) / 2.0

    def _step(self, aux: Context, head: int, y: float, weight: float) -> None:
        """One Laplace step of ``head`` on the label ``y`` in 0..1."""
        idx = self._cols(aux, head)
        m = self.m[idx]
        p = _sigmoid(float(m @ aux.val))
        q = self.q[idx] + weight * p * (1.0 - p) * aux.val * aux.val
        self.q[idx] = q
        self.m[idx] = m + weight * (min(max(float(y), 0.0), 1.0) - p) * aux.val / q

    def update(self, ctx: Context, label: float, weight: float = 1.0, *, only: int | None = None) -> None:
        """One Laplace step on the label ``(q_dear − q_cheap + 1)/2`` in 0..1 (1
        head). Nothing is learned from a context without ``aux`` or with ``only``
        (a tenant-scoped update: the gain model has no tenant features).
        Raises ValueError on a 2-head model (it learns by :meth:`observe`)."""
        if self.heads != 1:
            raise ValueError("a 2-head gain model learns each arm's outcome (observe), not a gain label")
        if ctx.aux is None or only is not None:
            return
        self._step(self._aux(ctx), 0, label, weight)
        self.count += weight

    def observe(self, ctx: Context, cheap: float | None, dear: float | None, weight: float = 1.0, *,
                only: int | None = None) -> None:
        """A 2-head model's online step: each arm's head on its observed quality
        in 0..1 (None: that arm was not called, its head learns nothing). As
        :meth:`update` for ``aux`` and ``only``; raises ValueError on 1 head."""
        if self.heads != 2:
            raise ValueError("a 1-head gain model learns a gain label (update)")
        if ctx.aux is None or only is not None or (cheap is None and dear is None):
            return
        aux = self._aux(ctx)
        for head, y in ((0, cheap), (1, dear)):
            if y is not None:
                self._step(aux, head, y, weight)
        self.count += weight

    def fit(self, contexts: Sequence[Context], labels: Sequence[Any] | np.ndarray, *, C: float = 1.0) -> TextGain:
        """The offline anchor's fit on ``contexts``' ``aux`` rows (module doc): the
        MAP with precision ``1/C`` (intercept unpenalised) and its Laplace
        precision, per head. ``labels``: the gain label per row (1 head), or
        ``(cheap, dear)`` qualities in 0..1 per row (2 heads; shape ``(n, 2)``).
        Replaces the posterior; ``count`` grows by the rows. Returns self.
        Raises ValueError when the labels' shape does not fit the heads."""
        y = np.asarray(labels, dtype=np.float64)
        if y.shape != ((len(contexts),) if self.heads == 1 else (len(contexts), 2)):
            raise ValueError(f"gain fit: labels of shape {y.shape} for {len(contexts)} rows and {self.heads} head(s)")
        rows = [(c.aux.idx[:-1], c.aux.val[:-1]) if c.aux is not None else (np.zeros(0, np.int64), np.zeros(0))
                for c in contexts]
        X = Sparse.from_rows(rows, self.vocab.n_cols - 1)
        ms, qs = [], []
        for h in range(self.heads):
            model = fit_logistic(X, y if self.heads == 1 else y[:, h], C=C)
            w = 1.0 / (1.0 + np.exp(-model.logit(X)))
            w = w * (1.0 - w)
            ms.append(np.append(model.coef, model.intercept))
            qs.append(np.append(1.0 / C + X.sq_tdot(w), INTERCEPT_PRECISION + float(w.sum())))
        self.m, self.q = np.concatenate(ms), np.concatenate(qs)
        self.count += float(len(contexts))
        return self

    # ------------------------------------------------------------ merging
    def copy(self) -> TextGain:
        """An independent copy of the posterior (the vocabulary is shared: it never changes)."""
        g = TextGain.__new__(TextGain)
        g.vocab, g.heads, g.m, g.q, g.count = self.vocab, self.heads, self.m.copy(), self.q.copy(), self.count
        return g

    def delta(self, base: TextGain) -> GainDelta:
        """What this model learned since ``base`` (the state it last shared);
        raises ValueError when ``base`` is over another vocabulary."""
        if base.vocab.digest != self.vocab.digest or base.heads != self.heads:
            raise ValueError("gain delta: another vocabulary or another number of heads")
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
        """``{keys, idf, meta, m, q: bytes, count, heads}`` (little-endian u8 / f8)."""
        v = self.vocab
        return {"keys": v.keys.astype("<u8").tobytes(), "idf": v.idf.astype("<f8").tobytes(),
                "meta": v.meta.astype("<u8").tobytes(), "m": self.m.astype("<f8").tobytes(),
                "q": self.q.astype("<f8").tobytes(), "count": self.count, "heads": self.heads}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TextGain:
        """Inverse of :meth:`state`; raises ValueError (or KeyError/TypeError) on a malformed one."""
        keys = np.frombuffer(state["keys"], dtype="<u8")
        vocab = TermVocab(keys, np.frombuffer(state["idf"], dtype="<f8"), np.frombuffer(state["meta"], dtype="<u8"))
        if len(keys) > 1 and not np.all(keys[1:] > keys[:-1]):
            raise ValueError("gain state: the vocabulary is not sorted")
        heads = state.get("heads", 1)  # states written before 2-head models: 1
        if heads not in (1, 2) or isinstance(heads, bool):
            raise ValueError("gain state: heads must be 1 or 2")
        g = cls(vocab, heads=int(heads))
        m, q = np.frombuffer(state["m"], dtype="<f8"), np.frombuffer(state["q"], dtype="<f8")
        if m.shape != (g.heads * vocab.n_cols,) or q.shape != m.shape or not np.all(q > 0) \
                or not np.all(np.isfinite(m)) or not np.all(np.isfinite(q)) or not np.all(np.isfinite(vocab.idf)):
            raise ValueError("gain state: wrong shape, non-finite value or non-positive precision")
        g.m, g.q, g.count = m.astype(np.float64), q.astype(np.float64), float(state["count"])
        return g
