"""Contextual bandits for next-hop choice (spec §6.2 "use contextual bandits to
adapt weights online", §17 Level 3, §18 shadow routing). Sans-IO: no clock, no
I/O; the caller passes the random generator and persists :meth:`ArmModel.state`.

Three pieces:

* :class:`Featurizer` — a sparse context vector from a task's meta and, when
  enabled, its prompt text, by the hashing trick (no vocabulary, no model
  download; CRC-32 so a feature keeps its slot across processes and restarts).
  Meta features: one indicator per ``key=value`` of :data:`META_KEYS` (lists
  such as ``languages`` give one per item), log₂ buckets of sizes
  (``diff_loc``, the prompt's length), and a bias. Text features: lower-cased
  word unigrams and bigrams of the first :data:`TEXT_CHARS` characters (at most
  :data:`MAX_WORDS` words), signed (a hash bit) and scaled by 1/√n. A context is at most
  :data:`MAX_FEATURES` (index, value) pairs whatever the input.
* :class:`ArmModel` — one arm's quality model: Bayesian logistic regression
  with a diagonal Gaussian posterior over ``2**bits`` weights, updated online by
  one Laplace step per observation (Chapelle & Li, "An Empirical Evaluation of
  Thompson Sampling", NIPS 2011, Algorithm 3). ``sample`` draws a quality in
  0..1 from the posterior (Thompson sampling), ``mean``/``std`` give the
  estimate and its uncertainty. Quality observations are in 0..1 (fractional
  labels are fine: the logistic loss takes them). Several learners of one arm
  (routers sharing a store) merge what each learned: :meth:`ArmModel.delta`
  against the state they last shared, :meth:`ArmModel.merge` into the shared
  one (:class:`ArmDelta`: natural parameters add).
* :class:`Bandit` — the arms of one policy and the budget-aware choice: each arm
  scores ``sampled quality − λ · cost`` (cost normalised to the dearest arm's,
  so λ is "quality points per full-price call"), arms whose sampled quality is
  under the policy's ``bar`` are passed over while a cheaper arm clears it.
  λ is either fixed by the policy or, with ``target_cost`` (a spend rate, e.g.
  "30 % of full price per task"), a Lagrange multiplier the bandit adapts by
  dual ascent after every choice — the knapsack rule of budget-constrained
  routers (PILOT, Panda et al. 2025): spend above target raises λ, spend
  below lowers it, by a step per unit of spend off target. The step sets how
  much λ jitters around its level, and that jitter is noise on the threshold
  the dear arm's extra quality must clear (a bandit warm-started from an
  offline fit loses ranking quality to it); a large step finds the level
  fast. So the step decays, Robbins–Monro style, from :data:`LAM_STEP_START`
  as ``1/√(1 + t/τ)`` (t: choices so far, τ = :data:`LAM_STEP_TAU`) down to
  the bandit's ``lam_step`` (default :data:`LAM_STEP`), where it stays so λ
  keeps tracking a changing mix. Learning is from partial feedback only:
  :meth:`Bandit.update` trains only the arms that were called.

The router runs these objects (``atp_router.policy.learn``) and so does
``bench/replay_routing.py`` — the same code, not a copy.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_BITS",
    "LAM_STEP",
    "LAM_STEP_START",
    "LAM_STEP_TAU",
    "META_KEYS",
    "ArmDelta",
    "ArmModel",
    "Bandit",
    "Choice",
    "Context",
    "Featurizer",
]

#: Weights per arm: 2**bits (4,096: 32 KiB of float32 mean + precision).
DEFAULT_BITS = 12
#: Dual-ascent step of λ per unit of spend off ``target_cost`` (quality points),
#: once the decay from :data:`LAM_STEP_START` has reached it (the module doc).
#: Chosen, with :data:`LAM_STEP_TAU`, on 5-fold cross-validation of the TRAIN half
#: of MMLU's seed-0 split (``bench/replay_routing.py --split 0.5 --validate``;
#: never the test half). Online APGR (19 spend targets, explore 0.25) of the
#: bandit warm-started by a fit, whose own offline ranking is 0.672: constant
#: step 0.02 / 0.01 / 0.005: 0.661 / 0.666 / 0.669; decaying 0.02 → 0.005 over
#: τ = 10 / 30 / 100 / 1000 choices: 0.667 / 0.665 / 0.666 / 0.660; from zero,
#: constant 0.02: 0.566, τ = 10: 0.573. The constant 0.005 is within noise of
#: τ = 10 (± 0.004) but finds λ's level 4× slower (3,000 choices from zero
#: overspend a 30 % target by 3 points); τ = 10 starts as fast as 0.02 did.
LAM_STEP = 0.005
#: The step λ starts with (the constant step before issue 23).
LAM_STEP_START = 0.02
#: Choices over which the step decays: t = 3τ halves it, t = 15τ reaches
#: :data:`LAM_STEP`. ``choices`` survives a reload, not a restart (λ is re-found).
LAM_STEP_TAU = 10.0
#: Meta keys that become indicator features (strings, numbers, bools, lists of them).
#: The tenant and the QoS class are not read from meta (a client could claim any):
#: the router passes the authenticated tenant and the admitted class as ``extra``.
META_KEYS = ("task_type", "language", "languages", "subject", "topic", "risk", "repo")
#: Meta keys whose value is a size: one indicator per log₂ bucket.
SIZE_KEYS = ("diff_loc", "files", "tokens_in")
#: Characters of prompt text the featurizer reads (the rest is ignored).
TEXT_CHARS = 2_000
#: Upper bound of (index, value) pairs per context.
MAX_FEATURES = 640
#: Meta indicator features per context (the bias first).
MAX_META_FEATURES = 64
#: Words of prompt text hashed: MAX_META_FEATURES + unigrams + bigrams < MAX_FEATURES.
MAX_WORDS = 288
#: Items of a list-valued meta key that are read.
MAX_LIST_ITEMS = 16
#: Characters of one meta value that are hashed.
MAX_VALUE_CHARS = 128

_WORD = re.compile(r"[a-z0-9_]+")
_NONE = np.zeros(0, dtype=np.uint64)


def _h(token: str) -> int:
    return zlib.crc32(token.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Context:
    """A sparse context: unique ``idx`` (int64) with their ``val`` (float64)."""

    idx: np.ndarray
    val: np.ndarray
    #: The gain model's columns (:mod:`atp_router.policy.textgain`) when the
    #: featurizer holds its vocabulary; not in :meth:`to_json` (a decision
    #: restored from JSON teaches the gain model nothing).
    aux: Context | None = None

    def to_json(self) -> dict[str, list]:
        return {"idx": self.idx.tolist(), "val": [round(v, 6) for v in self.val.tolist()]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], bits: int) -> Context:
        idx = np.asarray(obj.get("idx", []), dtype=np.int64)
        val = np.asarray(obj.get("val", []), dtype=np.float64)
        if idx.shape != val.shape or idx.ndim != 1 or len(idx) > MAX_FEATURES:
            raise ValueError("context: idx and val must be equal-length lists")
        if len(idx) and (idx.min() < 0 or idx.max() >= 1 << bits):
            raise ValueError("context: index out of range")
        return cls(idx, val)


def indicator_tokens(meta: Mapping[str, Any]) -> list[str]:
    """The ``key=value`` indicator tokens of ``meta``'s :data:`META_KEYS` (lists: one per item)."""
    out = []
    for key in META_KEYS:
        v = meta.get(key)
        if v is None:
            continue
        items = v[:MAX_LIST_ITEMS] if isinstance(v, (list, tuple)) else (v,)
        for item in items:
            if isinstance(item, (str, int, float, bool)):
                out.append(f"{key}={str(item)[:MAX_VALUE_CHARS]}")
    return out


def meta_key(token: str) -> int:
    """The gain vocabulary's key of an indicator token (CRC-32 tagged ``1 << 33``)."""
    return zlib.crc32(token.encode("utf-8", "surrogatepass")) | (1 << 33)


def text_grams(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The hashes (uint64, 32-bit values) of the words of ``text``'s first
    :data:`TEXT_CHARS` characters (at most :data:`MAX_WORDS`) and of their
    bigrams: CRC-32 per word, a bigram's combined from its two in numpy."""
    words = _WORD.findall(text[:TEXT_CHARS].lower())[:MAX_WORDS]
    h = np.fromiter(map(zlib.crc32, map(str.encode, words)), dtype=np.uint64, count=len(words))
    return h, ((h[:-1] * np.uint64(1_000_003)) ^ h[1:]) & np.uint64(0xFFFFFFFF)


class Featurizer:
    """Task meta (+ prompt text) → :class:`Context` (see the module doc).

    ``bits``: hashed dimension 2**bits; ``text``: read prompt text too.
    ``vocab``: a :class:`~atp_router.policy.textgain.TermVocab` (or None): the
    context's ``aux`` gets its columns (the policy's gain model's features).
    """

    __slots__ = ("_mask", "bits", "text", "text_weight", "vocab")

    def __init__(self, *, bits: int = DEFAULT_BITS, text: bool = False, text_weight: float = 0.5):
        if not 4 <= bits <= 20:
            raise ValueError("bits must be 4..20")
        self.bits = bits
        self.text = text
        self.text_weight = text_weight
        self._mask = (1 << bits) - 1
        self.vocab: Any = None

    def index(self, token: str) -> int:
        """The weight index of indicator ``token`` (e.g. ``"tenant=acme"``)."""
        return _h(token[:MAX_VALUE_CHARS]) & self._mask

    def __call__(self, meta: Mapping[str, Any], text: str = "", *, extra: Iterable[str] = ()) -> Context:
        """The context of one task. ``extra``: more indicator tokens (e.g.
        ``"tenant=acme"`` the router adds from the caller's identity)."""
        feats: dict[int, float] = {}
        mask = self._mask

        def add(token: str, value: float = 1.0) -> None:
            if len(feats) < MAX_META_FEATURES:
                i = _h(token) & mask
                feats[i] = feats.get(i, 0.0) + value

        add("\x00bias")
        meta_tokens = indicator_tokens(meta)
        for token in meta_tokens:
            add(token)
        for key in SIZE_KEYS:
            v = meta.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v):
                add(f"{key}~{int(math.log2(1 + v))}")
        for token in extra:
            add(token[:MAX_VALUE_CHARS])
        if text:
            add(f"\x00len~{int(math.log2(1 + len(text)))}")
        idx = np.fromiter(feats.keys(), dtype=np.int64, count=len(feats))
        val = np.fromiter(feats.values(), dtype=np.float64, count=len(feats))
        uni, bi = text_grams(text) if text and (self.text or self.vocab is not None) else (_NONE, _NONE)
        if self.text and text and len(uni):
            # Unigram hashes by CRC-32; bigram hashes combined from them in numpy (text_grams).
            grams = np.concatenate((uni, bi))
            scale = self.text_weight / math.sqrt(len(grams))
            t_idx = ((grams >> np.uint64(1)) & np.uint64(mask)).astype(np.int64)
            t_val = np.where((grams & np.uint64(1)).astype(bool), scale, -scale)
            idx = np.concatenate((idx, t_idx))
            val = np.concatenate((val, t_val))
            idx, inverse = np.unique(idx, return_inverse=True)
            val = np.bincount(inverse, weights=val, minlength=len(idx))
        if len(idx) > MAX_FEATURES:
            idx, val = idx[:MAX_FEATURES], val[:MAX_FEATURES]
        if self.vocab is None:
            return Context(idx, val)
        keys = np.concatenate((uni, bi | np.uint64(1 << 32)))
        return Context(idx, val, self.vocab.context(keys, [meta_key(t) for t in meta_tokens]))


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


@dataclass(frozen=True, slots=True)
class ArmDelta:
    """What an :class:`ArmModel` learned since a base state, as the change of its
    diagonal Gaussian posterior's natural parameters: ``eta`` = Δ(precision ×
    mean) and ``q`` = Δprecision (float64 arrays of ``2**bits``), ``count`` =
    Δobservations (weighted).

    Why adding them merges learners: each Laplace step of :meth:`ArmModel.update`
    multiplies the posterior by a Gaussian site factor (precision ``w·p(1−p)·x²``
    per weight), and a product of Gaussians adds natural parameters. Two
    learners that started from the same base and saw disjoint observations hold
    ``base × sites₁`` and ``base × sites₂``; ``base + Δ₁ + Δ₂`` is ``base ×
    sites₁ × sites₂``: one posterior with both streams' information (the sites
    were linearised where each learner stood, so with overlapping features this
    equals a single learner that saw both streams only to first order; with
    disjoint features, exactly). Merging is commutative, and a delta against
    the state just merged is zero (re-syncing without new data changes
    nothing)."""

    bits: int
    eta: np.ndarray
    q: np.ndarray
    count: float

    @property
    def empty(self) -> bool:
        """Nothing learned (the learner's state is its base)."""
        return self.count == 0 and not self.eta.any() and not self.q.any()


class ArmModel:
    """One arm's online Bayesian logistic quality model (see the module doc).

    ``prior``: the quality the arm has before any observation (the RIB's
    ``win30d``), encoded in the bias weight; ``prior_precision``: the weights'
    prior precision (higher: slower to move). ``count`` observations so far
    (float: feedback may be weighted). Memory: two float64 arrays of
    ``2**bits`` (64 KiB at the default 12 bits).
    """

    __slots__ = ("bits", "count", "m", "prior", "q")

    def __init__(self, *, bits: int = DEFAULT_BITS, prior: float = 0.5, prior_precision: float = 1.0):
        self.bits = bits
        self.prior = prior
        self.m = np.zeros(1 << bits, dtype=np.float64)
        self.q = np.full(1 << bits, prior_precision, dtype=np.float64)
        self.m[_h("\x00bias") & ((1 << bits) - 1)] = _logit(prior)
        self.count = 0.0

    def mean(self, ctx: Context) -> float:
        """Posterior-mean quality of this arm in ``ctx`` (0..1)."""
        return _sigmoid(float(self.m[ctx.idx] @ ctx.val))

    def std(self, ctx: Context) -> float:
        """Posterior standard deviation of the logit in ``ctx``."""
        return math.sqrt(float((ctx.val * ctx.val) @ (1.0 / self.q[ctx.idx])))

    def sample(self, ctx: Context, rng: np.random.Generator, explore: float = 1.0) -> float:
        """A Thompson draw of this arm's quality in ``ctx``: the logit's
        posterior (mean, ``explore`` × std) sampled (0: the mean)."""
        z = float(self.m[ctx.idx] @ ctx.val)
        if explore > 0:
            z += explore * self.std(ctx) * float(rng.standard_normal())
        return _sigmoid(z)

    def update(self, ctx: Context, quality: float, weight: float = 1.0, *, only: int | None = None) -> None:
        """One observation: quality in 0..1 (clamped), weighted. ``only``: the
        prediction uses the whole context but only that one weight index
        learns (e.g. a tenant's own feature)."""
        y = min(max(float(quality), 0.0), 1.0)
        idx, val = ctx.idx, ctx.val
        m = self.m[idx]
        p = _sigmoid(float(m @ val))
        if only is not None:
            sel = idx == only
            if not sel.any():
                return
            idx, val, m = idx[sel], val[sel], m[sel]
        q = self.q[idx] + weight * p * (1.0 - p) * val * val
        self.q[idx] = q
        self.m[idx] = m + weight * (y - p) * val / q
        self.count += weight

    # ---------------------------------------------------------------- merging
    def copy(self) -> ArmModel:
        """An independent copy (e.g. the base a learner syncs against)."""
        arm = ArmModel.__new__(ArmModel)
        arm.bits, arm.prior, arm.count = self.bits, self.prior, self.count
        arm.m, arm.q = self.m.copy(), self.q.copy()
        return arm

    def delta(self, base: ArmModel) -> ArmDelta:
        """What this arm learned since ``base`` (its own earlier state, or the
        shared state it last adopted): see :class:`ArmDelta`. Raises ValueError
        when ``base`` has other ``bits``."""
        if base.bits != self.bits:
            raise ValueError(f"arm delta: bits {self.bits} against a base of {base.bits}")
        return ArmDelta(self.bits, self.q * self.m - base.q * base.m, self.q - base.q, self.count - base.count)

    def merge(self, delta: ArmDelta) -> None:
        """Add another learner's :class:`ArmDelta` to this posterior (natural
        parameters add: η += Δη, q += Δq, m = η / q; count += Δcount). Raises
        ValueError (and changes nothing) when the bits differ or a precision
        would not stay positive and finite."""
        if delta.bits != self.bits or delta.eta.shape != self.m.shape or delta.q.shape != self.q.shape:
            raise ValueError("arm merge: the delta has another shape")
        if delta.empty:
            return  # bit for bit: η/q would round
        q = self.q + delta.q
        eta = self.q * self.m + delta.eta
        if not (np.all(q > 0) and np.all(np.isfinite(q)) and np.all(np.isfinite(eta))):
            raise ValueError("arm merge: the merged precision is not positive and finite")
        self.q = q
        self.m = eta / q
        self.count += delta.count

    def adopt(self, other: ArmModel) -> None:
        """Take ``other``'s posterior and count (copied) in place: the learner
        keeps this object (decisions in flight refer to its policy's bandit)."""
        if other.bits != self.bits:
            raise ValueError(f"arm adopt: bits {other.bits} into {self.bits}")
        self.m, self.q, self.count = other.m.copy(), other.q.copy(), other.count

    # ---------------------------------------------------------------- state
    def state(self, *, exact: bool = False) -> dict[str, Any]:
        """``{bits, prior, count, m: bytes, q: bytes}``, float32 little-endian;
        ``exact``: float64 (``"dtype": "<f8"``, what routers sharing a store
        merge: float32 would round every merge)."""
        dtype = "<f8" if exact else "<f4"
        out = {"bits": self.bits, "prior": self.prior, "count": self.count,
               "m": self.m.astype(dtype).tobytes(), "q": self.q.astype(dtype).tobytes()}
        if exact:
            out["dtype"] = dtype
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ArmModel:
        """Inverse of :meth:`state` (either precision); raises ValueError on a
        malformed state."""
        bits = int(state["bits"])
        if not 4 <= bits <= 20:
            raise ValueError("arm state: bits out of range")
        dtype = state.get("dtype", "<f4")
        if dtype not in ("<f4", "<f8"):
            raise ValueError(f"arm state: unknown dtype {dtype!r}")
        arm = cls(bits=bits, prior=float(state["prior"]))
        m = np.frombuffer(state["m"], dtype=dtype)
        q = np.frombuffer(state["q"], dtype=dtype)
        if m.shape != (1 << bits,) or q.shape != (1 << bits,) or not np.all(q > 0) \
                or not np.all(np.isfinite(m)) or not np.all(np.isfinite(q)):
            raise ValueError("arm state: wrong shape, non-finite value or non-positive precision")
        arm.m = m.astype(np.float64)
        arm.q = q.astype(np.float64)
        arm.count = float(state["count"])
        return arm


@dataclass(frozen=True, slots=True)
class Choice:
    """What :meth:`Bandit.choose` decided: ``order`` is the arm names best
    first; ``sampled``/``utility`` the draw and ``sampled − λ·cost`` per arm;
    ``lam`` the λ it used."""

    order: tuple[str, ...]
    sampled: Mapping[str, float]
    utility: Mapping[str, float]
    lam: float


class Bandit:
    """The arms of one policy (see the module doc).

    ``arms`` maps arm names to their cost per call (any unit: only ratios
    matter; normalised to the dearest) and ``priors`` to their prior quality.
    ``explore`` scales posterior draws (0: greedy on the mean); ``lam`` the
    fixed cost weight λ; ``target_cost`` (0..1, a share of the dearest arm's
    cost per choice) makes λ adaptive instead, stepping by ``lam_step`` once
    the step's decay over ``lam_tau`` choices has reached it (module doc);
    ``bar``: the lowest sampled quality an arm should clear (0: no bar).

    ``gain`` (two arms only): also model the *gain* of the dearer arm over the
    cheaper one, ``E[q_dear − q_cheap] = 2σ(z) − 1``, as one more
    :class:`ArmModel` (:attr:`gain`) over the same context, and choose by it:
    the dear arm's draw is the cheap arm's draw plus a Thompson draw of the gain
    (exploration on the gain's own uncertainty). It learns ``(q_dear −
    q_cheap + 1)/2`` when both arms' qualities are known (labelled outcomes,
    shadow calls) and, from one arm's, that quality against the other arm's
    posterior mean (the direct-method estimate of the unseen arm).
    """

    __slots__ = ("_pair", "_top", "arms", "bar", "choices", "cost", "explore", "gain", "gain_weight", "lam",
                 "lam_step", "lam_tau", "spent", "target_cost")

    def __init__(
        self,
        arms: Mapping[str, float],
        *,
        priors: Mapping[str, float] | None = None,
        bits: int = DEFAULT_BITS,
        explore: float = 1.0,
        lam: float = 0.0,
        target_cost: float | None = None,
        lam_step: float = LAM_STEP,
        bar: float = 0.0,
        prior_precision: float = 1.0,
        gain: bool = False,
        lam_tau: float = LAM_STEP_TAU,
    ):
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        top = max(arms.values()) or 1.0
        self._top = top
        self.cost = {a: max(c, 0.0) / top for a, c in arms.items()}
        priors = priors or {}
        self.arms = {a: ArmModel(bits=bits, prior=priors.get(a, 0.5), prior_precision=prior_precision)
                     for a in arms}
        self.explore = explore
        self.lam = lam
        self.target_cost = target_cost
        self.lam_step = lam_step
        self.lam_tau = lam_tau
        self.bar = bar
        self.spent = 0.0
        self.choices = 0
        self.gain: Any = None  # ArmModel, or a TextGain (set_gain)
        self.gain_weight = 1.0
        self._pair: tuple[str, str] | None = None
        if gain:
            if len(arms) != 2:
                raise ValueError("a gain model needs exactly two arms")
            cheap, dear = sorted(arms, key=lambda a: arms[a])
            self._pair = (cheap, dear)
            self.gain = ArmModel(bits=bits, prior=0.5, prior_precision=prior_precision)

    def set_gain(self, model: Any, weight: float = 1.0, *, pair: tuple[str, str] | None = None) -> None:
        """Choose by ``model`` — a :class:`~atp_router.policy.textgain.TextGain`
        (e.g. warm-started from an offline fit) or an :class:`ArmModel` — as
        the gain of the dearer of two arms over the cheaper, as ``gain`` does
        (class doc), with ``weight`` (0..1): the dear arm's draw is ``(1 − w)
        ×`` its own arm's draw ``+ w × (`` the cheap arm's draw ``+`` the
        gain's ``)``, the average of the two estimates of its quality at ½;
        None: by the arms alone again. A 2-head TextGain (one model per arm)
        learns each arm's observed outcome in its own head; the others the gain
        label as the class doc says. ``pair``: the ``(cheap, dear)`` arms
        (default: by cost, then name). Raises ValueError unless the bandit has
        two arms (``pair``'s) and ``weight`` is in 0..1."""
        if model is not None and len(self.arms) != 2:
            raise ValueError("a gain model needs exactly two arms")
        if not 0.0 <= weight <= 1.0:
            raise ValueError("the gain weight must be in 0..1")
        self.gain_weight = float(weight)
        if pair is not None and (len(pair) != 2 or set(pair) != set(self.arms)):
            raise ValueError("the gain pair must be the bandit's two arms")
        cheap, dear = (pair or sorted(self.arms, key=lambda a: (self.cost[a], a))) if model is not None \
            else (None, None)
        self.gain = model
        self._pair = (cheap, dear) if model is not None and cheap is not None and dear is not None else None

    @property
    def pair(self) -> tuple[str, str] | None:
        """``(cheap, dear)`` arms of the gain model (None without one)."""
        return self._pair

    @property
    def top_cost(self) -> float:
        """The dearest arm's cost, in the unit costs were given in."""
        return self._top

    def set_costs(self, costs: Mapping[str, float]) -> None:
        """Replace some arms' costs (e.g. observed USD per call), renormalised."""
        raw = {a: self.cost[a] * self._top for a in self.cost}
        raw.update({a: max(c, 0.0) for a, c in costs.items() if a in raw})
        self._top = max(raw.values()) or 1.0
        self.cost = {a: c / self._top for a, c in raw.items()}

    def choose(self, ctx: Context, rng: np.random.Generator, *, among: Sequence[str] | None = None,
               lam: float | None = None) -> Choice:
        """Order ``among`` (default: every arm) for ``ctx``: by utility
        ``sampled − λ·cost`` (``lam`` overrides λ for this choice), except that
        while some arm's draw clears ``bar`` the arms that clear it come first,
        cheapest first (ties: utility)."""
        names = list(among) if among is not None else list(self.arms)
        lam = self.lam if lam is None else lam
        sampled = {a: self.arms[a].sample(ctx, rng, self.explore) for a in names}
        if self.gain is not None and self._pair is not None and self._pair[0] in sampled \
                and self._pair[1] in sampled:
            cheap, dear = self._pair
            w = self.gain_weight
            sampled[dear] = (1.0 - w) * sampled[dear] + w * (sampled[cheap] + 2.0 * self.gain.sample(ctx, rng,
                                                                                                    self.explore) - 1.0)
        utility = {a: sampled[a] - lam * self.cost[a] for a in names}
        if self.bar > 0 and any(sampled[a] >= self.bar for a in names):
            order = sorted(names, key=lambda a: (sampled[a] < self.bar,
                                                 self.cost[a] if sampled[a] >= self.bar else 0.0, -utility[a], a))
        else:
            order = sorted(names, key=lambda a: (-utility[a], a))
        return Choice(tuple(order), sampled, utility, lam)

    def charge(self, arms: Iterable[str]) -> None:
        """Account the calls of one choice; with ``target_cost`` set, one dual
        ascent step on λ (spend over target raises it; the step as the module
        doc says: from :data:`LAM_STEP_START` down to ``lam_step``)."""
        cost = sum(self.cost.get(a, 0.0) for a in arms)
        if self.target_cost is not None:
            step = max(self.lam_step, LAM_STEP_START / math.sqrt(1.0 + self.choices / max(self.lam_tau, 1e-9)))
            self.lam = max(0.0, self.lam + step * (cost - self.target_cost))
        self.spent += cost
        self.choices += 1

    def update(self, ctx: Context, rewards: Mapping[str, float], weight: float = 1.0, *,
               only: int | None = None) -> None:
        """Learn from the arms that were called (partial feedback): ``rewards``
        maps each called arm to its observed quality in 0..1; ``only`` as for
        :meth:`ArmModel.update`; the gain model (if any) as the class doc says."""
        if self.gain is not None and self._pair is not None:
            cheap, dear = self._pair
            if getattr(self.gain, "heads", 1) == 2:  # a TextGain of both arms: each head its own arm's outcome
                self.gain.observe(ctx, rewards.get(cheap), rewards.get(dear), weight, only=only)
            elif cheap in rewards or dear in rewards:
                qc = rewards[cheap] if cheap in rewards else self.arms[cheap].mean(ctx)
                qd = rewards[dear] if dear in rewards else self.arms[dear].mean(ctx)
                self.gain.update(ctx, (min(max(qd, 0.0), 1.0) - min(max(qc, 0.0), 1.0) + 1.0) / 2.0, weight,
                                 only=only)
        for a, q in rewards.items():
            arm = self.arms.get(a)
            if arm is not None:
                arm.update(ctx, q, weight, only=only)

    def estimates(self, ctx: Context | None = None) -> dict[str, dict[str, float]]:
        """Per arm ``{mean, std, count, cost}`` in ``ctx`` (default: the bias
        alone, i.e. the arm's context-free quality)."""
        if ctx is None:
            any_arm = next(iter(self.arms.values()))
            i = _h("\x00bias") & ((1 << any_arm.bits) - 1)
            ctx = Context(np.array([i], dtype=np.int64), np.array([1.0]))
        return {a: {"mean": round(m.mean(ctx), 4), "std": round(m.std(ctx), 4), "count": round(m.count, 3),
                    "cost": round(self.cost[a], 4)} for a, m in self.arms.items()}
