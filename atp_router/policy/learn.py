"""Routing that learns (spec §6.2, §18): live FIB metrics, the policies'
contextual bandits, quality signals and shadow decisions. Sans-IO: no clock
(callers pass ``now`` in seconds), no I/O (the router persists
:meth:`RoutingLearner.dirty_arms` / :meth:`LiveMetrics.state` in its store).

**Live metrics** (:class:`LiveMetrics`): per next-hop and per (policy,
next-hop), exponentially decayed statistics of every call — latency p50/p95
(ms, from a decayed log-spaced histogram), error and timeout rates, tokens and
USD micros per call — and of quality (0..1, from consensus and client
feedback). The RIB's ``p95_ms`` and ``win30d`` are priors that observations
overwrite: a statistic counts once it has :data:`MIN_OBS` observations, and
quality is the prior blended with observations at :data:`QUALITY_PRIOR_WEIGHT`
pseudo-observations. :meth:`LiveMetrics.view` is what the FIB scores with: a
mapping rebuilt incrementally (only next-hops observed since the last view)
and swapped whole, so a lookup reads one consistent snapshot and never waits.

**Several routers on one store** (``--workers N``, a shared store; issue 12)
learn together by *merging*, never last-writer-wins: each router pushes what it
learned since it last synced and adopts the merged result.

* Bandit arms: a diagonal Gaussian posterior each; :meth:`RoutingLearner.share`
  keeps, per arm, the ``base`` state it last synced (a :class:`SharedArm`), the
  push is :meth:`~atp_router.policy.bandit.ArmModel.delta` against it and
  :func:`merge_arm_entry` adds it to the shared entry (natural parameters add;
  :class:`~atp_router.policy.bandit.ArmDelta` says why that merges posteriors).
* Live statistics are decayed sums, decayed **per observation**; a router's
  contribution since its last sync is itself such a sum started from zero
  (:meth:`LiveMetrics.share` keeps it, with the number ``n`` of calls and the
  quality weight ``w`` it holds), and :func:`merge_live_state` folds it in as
  ``shared · (1−α)^n + contribution``. That is *exactly* the statistic of one
  router that saw the shared history, then this batch — the approximation is
  only the order: observations of routers in the same sync interval are
  counted batch after batch in push order rather than interleaved as they
  happened, so an observation's weight is off by at most a factor
  ``(1−α)^k`` (k: the other routers' observations of that key in the same
  interval, about one second). Totals that do not depend on the order (the
  decayed call count ``Σ (1−α)^i``) are exact; rates (error rate, p95,
  quality) are weighted averages of the same observations with slightly
  permuted weights — what the FIB scorer reads through :meth:`LiveMetrics.view`
  is computed from the merged sums exactly as for one router.

**Bandits** (:class:`RoutingLearner`): one :class:`~atp_router.policy.bandit.Bandit`
per policy with ``bandit:`` in the RIB, over its fanout; :meth:`RoutingLearner.route`
re-orders a FIB route's candidates for one task and returns the
:class:`Decision` (context, order, λ) that :meth:`RoutingLearner.observe`
later learns from, for the called arms only. An arm keeps its learned state
across reloads while its agent's definition (model, tool, endpoint) is
unchanged (:func:`arm_fingerprint`).

**Quality** (:func:`consensus_quality`): what the merged result says of each
called next-hop — the F1 of its findings against those another agent (or the
escalation target) confirmed; a failed call is 0.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from atp_router.policy.bandit import ArmDelta, ArmModel, Bandit, Context, Featurizer
from atp_router.policy.rib import AgentSpec, BanditSpec, Rib
from atp_router.policy.textgain import TextGain

__all__ = [
    "MIN_OBS",
    "Decision",
    "LiveMetrics",
    "LiveView",
    "RoutingLearner",
    "SharedArm",
    "TenantShares",
    "arm_fingerprint",
    "consensus_quality",
    "live_stats_of",
    "merge_arm_entry",
    "merge_live_state",
    "result_quality",
]

#: Separates policy and agent in a per-policy statistics key (no RIB name contains it).
KEY_SEP = "|"
#: Observations before a live statistic replaces the RIB's figure.
MIN_OBS = 5
#: Pseudo-observations the RIB's ``win30d`` prior weighs in the live quality.
QUALITY_PRIOR_WEIGHT = 10.0
#: Decay per observation of the live statistics (effective memory ≈ 1/α calls).
ALPHA = 0.05
#: Latency histogram: bucket i holds 2**(i/4) ms … 2**((i+1)/4) ms (1 ms … ~4.7 h).
_BUCKETS = 96
_EDGES = 2.0 ** (np.arange(_BUCKETS + 1) / 4.0)
#: Tokens per call assumed for an arm's cost before it has been observed.
PRIOR_TOKENS_PER_CALL = 2_000


@dataclass(frozen=True, slots=True)
class LiveView:
    """One next-hop's live figures (see the module doc); ``None`` when fewer
    than :data:`MIN_OBS` observations: the FIB keeps the RIB's figure."""

    calls: float
    p50_ms: float | None
    p95_ms: float | None
    error_rate: float | None
    timeout_rate: float | None
    tokens_per_call: float | None
    usd_micros_per_call: float | None
    quality: float
    quality_obs: float

    def to_json(self) -> dict[str, Any]:
        return {"calls": round(self.calls, 2), "p50_ms": _r(self.p50_ms), "p95_ms": _r(self.p95_ms),
                "error_rate": _r(self.error_rate), "timeout_rate": _r(self.timeout_rate),
                "tokens_per_call": _r(self.tokens_per_call), "usd_micros_per_call": _r(self.usd_micros_per_call),
                "quality": _r(self.quality), "quality_obs": round(self.quality_obs, 2)}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


class _Stats:
    __slots__ = ("calls", "errors", "hist", "prior", "q_sum", "q_w", "timeouts", "tokens", "usd")

    def __init__(self, prior: float):
        self.prior = prior
        self.calls = 0.0  # decayed weight of call observations
        self.errors = 0.0
        self.timeouts = 0.0
        self.tokens = 0.0
        self.usd = 0.0
        self.hist = np.zeros(_BUCKETS, dtype=np.float64)
        self.q_sum = 0.0
        self.q_w = 0.0

    def call(self, latency_ms: float, ok: bool, timeout: bool, tokens: int, usd_micros: int) -> None:
        d = 1.0 - ALPHA
        self.calls = self.calls * d + 1.0
        self.errors = self.errors * d + (0.0 if ok else 1.0)
        self.timeouts = self.timeouts * d + (1.0 if timeout else 0.0)
        self.tokens = self.tokens * d + max(tokens, 0)
        self.usd = self.usd * d + max(usd_micros, 0)
        self.hist *= d
        if ok and latency_ms > 0 and math.isfinite(latency_ms):
            b = min(max(int(4.0 * math.log2(max(latency_ms, 1.0))), 0), _BUCKETS - 1)
            self.hist[b] += 1.0

    def quality(self, q: float, weight: float) -> None:
        d = (1.0 - ALPHA) ** weight
        self.q_sum = self.q_sum * d + weight * min(max(q, 0.0), 1.0)
        self.q_w = self.q_w * d + weight

    def _quantile(self, p: float) -> float | None:
        total = float(self.hist.sum())
        if total <= 0:
            return None
        cum = np.cumsum(self.hist)
        i = int(np.searchsorted(cum, p * total))
        i = min(i, _BUCKETS - 1)
        # Geometric middle of the bucket.
        return float(math.sqrt(_EDGES[i] * _EDGES[i + 1]))

    def view(self) -> LiveView:
        # Observation counts undecayed enough to trust: the decayed weight.
        enough = self.calls >= MIN_OBS * (1.0 - ALPHA) ** MIN_OBS
        per = (lambda x: x / self.calls) if self.calls > 0 else (lambda x: 0.0)
        n0 = QUALITY_PRIOR_WEIGHT
        return LiveView(
            calls=self.calls,
            p50_ms=self._quantile(0.5) if enough else None,
            p95_ms=self._quantile(0.95) if enough else None,
            error_rate=per(self.errors) if enough else None,
            timeout_rate=per(self.timeouts) if enough else None,
            tokens_per_call=per(self.tokens) if enough else None,
            usd_micros_per_call=per(self.usd) if enough else None,
            quality=(n0 * self.prior + self.q_sum) / (n0 + self.q_w),
            quality_obs=self.q_w,
        )

    def state(self) -> dict[str, Any]:
        return {"prior": self.prior, "calls": self.calls, "errors": self.errors, "timeouts": self.timeouts,
                "tokens": self.tokens, "usd": self.usd, "hist": np.round(self.hist, 5).tolist(),
                "q_sum": self.q_sum, "q_w": self.q_w}

    @classmethod
    def from_state(cls, s: Mapping[str, Any]) -> _Stats:
        st = cls(float(s["prior"]))
        st._load(s)
        return st

    def _load(self, s: Mapping[str, Any]) -> None:
        for k in ("calls", "errors", "timeouts", "tokens", "usd", "q_sum", "q_w"):
            v = float(s[k])
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"live stats: bad {k}")
            setattr(self, k, v)
        hist = np.asarray(s["hist"], dtype=np.float64)
        if hist.shape != (_BUCKETS,) or not np.all(np.isfinite(hist)) or np.any(hist < 0):
            raise ValueError("live stats: bad histogram")
        self.hist = hist

    def absorb(self, c: _Pending) -> None:
        """Fold in another router's contribution ``c`` (see the module doc):
        each call statistic ``x := x·(1−α)^n + c.x``, quality ``x := x·(1−α)^w + c.x``."""
        d = (1.0 - ALPHA) ** c.n
        self.calls = self.calls * d + c.calls
        self.errors = self.errors * d + c.errors
        self.timeouts = self.timeouts * d + c.timeouts
        self.tokens = self.tokens * d + c.tokens
        self.usd = self.usd * d + c.usd
        self.hist = self.hist * d + c.hist
        dq = (1.0 - ALPHA) ** c.w
        self.q_sum = self.q_sum * dq + c.q_sum
        self.q_w = self.q_w * dq + c.q_w


class _Pending(_Stats):
    """A router's contribution to one key since it last synced: the same
    decayed sums started from zero, with ``n`` calls and ``w`` quality weight."""

    __slots__ = ("n", "w")

    def __init__(self, prior: float):
        super().__init__(prior)
        self.n = 0.0
        self.w = 0.0

    def call(self, latency_ms: float, ok: bool, timeout: bool, tokens: int, usd_micros: int) -> None:
        super().call(latency_ms, ok, timeout, tokens, usd_micros)
        self.n += 1.0

    def quality(self, q: float, weight: float) -> None:
        super().quality(q, weight)
        self.w += weight

    def state(self) -> dict[str, Any]:
        return {**super().state(), "n": self.n, "w": self.w}

    @classmethod
    def from_state(cls, s: Mapping[str, Any]) -> _Pending:
        st = cls(float(s["prior"]))
        st._load(s)
        st.n, st.w = float(s["n"]), float(s["w"])
        if not (math.isfinite(st.n) and math.isfinite(st.w) and st.n >= 0 and st.w >= 0):
            raise ValueError("live stats: bad contribution counts")
        return st


class LiveMetrics:
    """Decayed live statistics per next-hop (key ``agent``) and per policy
    (key ``policy|agent``); see the module doc."""

    __slots__ = ("_dirty", "_pending", "_stats", "_view", "changed")

    def __init__(self) -> None:
        self._stats: dict[str, _Stats] = {}
        self._view: dict[str, LiveView] = {}
        self._dirty: set[str] = set()
        #: Keys changed since the store last saved them (the router clears it).
        self.changed: set[str] = set()
        #: Sharing (:meth:`share`): each key's contribution since the last sync.
        self._pending: dict[str, _Pending] | None = None

    def share(self) -> None:
        """Keep, from now on, each key's contribution since the last sync with
        a shared store (:meth:`deltas`, :meth:`adopt`; the module doc)."""
        if self._pending is None:
            self._pending = {}

    def _observed(self, key: str, prior: float) -> _Pending | None:
        if self._pending is None:
            return None
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(prior)
        return p

    def deltas(self) -> dict[str, dict[str, Any]]:
        """JSON-able contributions since the last :meth:`adopt` (``{}``: none,
        or not sharing), to push with :func:`merge_live_state`."""
        return {k: p.state() for k, p in (self._pending or {}).items()}

    def adopt(self, stats: Mapping[str, Mapping[str, Any]], priors: Mapping[str, float], *,
              pushed: bool) -> int:
        """Replace the local statistics with the shared ``stats`` (the
        ``"stats"`` of a :func:`merge_live_state` result), for the agents of
        ``priors`` (the running RIB; their prior is taken from it). ``pushed``:
        ``stats`` include this router's contributions (they are cleared);
        else they are folded in again. Malformed entries are skipped. Returns
        how many keys were adopted."""
        new: dict[str, _Stats] = {}
        for key, s in stats.items():
            agent = key.rpartition(KEY_SEP)[2]
            if agent not in priors:
                continue
            try:
                st = _Stats.from_state(s)
            except (KeyError, TypeError, ValueError):
                continue
            st.prior = priors[agent]
            new[key] = st
        n = len(new)
        pending = self._pending or {}
        if not pushed:
            for key, p in pending.items():
                if key not in new:
                    new[key] = _Stats(p.prior)
                new[key].absorb(p)
        gone = set(self._stats) - set(new)
        self._stats = new
        if gone:
            self._view = {k: v for k, v in self._view.items() if k not in gone}
            self._dirty -= gone
        self._dirty.update(new)
        if self._pending is not None and pushed:
            self._pending = {}
        return n

    def _get(self, key: str, prior: float) -> _Stats:
        st = self._stats.get(key)
        if st is None:
            st = self._stats[key] = _Stats(prior)
        return st

    def set_priors(self, priors: Mapping[str, float]) -> None:
        """The RIB's ``win30d`` per agent (after a reload): the prior each
        agent's quality is blended with. Statistics of agents the RIB no longer
        has are dropped (memory stays bounded by the RIB)."""
        gone = [k for k in self._stats if k.rpartition(KEY_SEP)[2] not in priors]
        if gone:
            new_view = dict(self._view)
            for k in gone:
                del self._stats[k]
                new_view.pop(k, None)
                self._dirty.discard(k)
                if self._pending is not None:
                    self._pending.pop(k, None)
            self._view = new_view
            self.changed.add("")  # the saved state must forget them too
        for key, st in self._stats.items():
            agent = key.rpartition(KEY_SEP)[2]
            if agent in priors and st.prior != priors[agent]:
                st.prior = priors[agent]
                self._dirty.add(key)

    def observe_call(self, agent: str, *, policy: str | None, latency_ms: float, ok: bool, timeout: bool,
                     tokens: int, usd_micros: int, prior: float = 0.5) -> None:
        """One finished next-hop call (latency in ms, tokens, USD micros)."""
        for key in (agent, f"{policy}|{agent}") if policy else (agent,):
            self._get(key, prior).call(latency_ms, ok, timeout, tokens, usd_micros)
            if (p := self._observed(key, prior)) is not None:
                p.call(latency_ms, ok, timeout, tokens, usd_micros)
            self._dirty.add(key)
            self.changed.add(key)

    def observe_quality(self, agent: str, quality: float, *, policy: str | None, weight: float = 1.0,
                        prior: float = 0.5) -> None:
        """One quality observation (0..1) of ``agent``'s answer."""
        for key in (agent, f"{policy}|{agent}") if policy else (agent,):
            self._get(key, prior).quality(quality, weight)
            if (p := self._observed(key, prior)) is not None:
                p.quality(quality, weight)
            self._dirty.add(key)
            self.changed.add(key)

    def view(self) -> Mapping[str, LiveView]:
        """The current snapshot (rebuilt for the keys observed since the last
        call, then swapped whole; callers must not mutate it)."""
        if self._dirty:
            new = dict(self._view)
            for key in self._dirty:
                new[key] = self._stats[key].view()
            self._dirty.clear()
            self._view = new
        return self._view

    def state(self, keys: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """JSON-able state of ``keys`` (default all)."""
        keys = self._stats.keys() if keys is None else keys
        return {k: self._stats[k].state() for k in keys if k in self._stats}

    def load(self, state: Mapping[str, Any]) -> int:
        """Restore saved statistics (:meth:`state`, or a shared
        :func:`merge_live_state` document); malformed entries are skipped.
        Returns how many were loaded."""
        n = 0
        for key, s in live_stats_of(state).items():
            try:
                self._stats[key] = _Stats.from_state(s)
            except (KeyError, TypeError, ValueError):
                continue
            self._dirty.add(key)
            n += 1
        return n


#: Version of the shared live-statistics document (:func:`merge_live_state`).
LIVE_FORMAT = 2


def live_stats_of(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The per-key statistics of a stored live document: a
    :func:`merge_live_state` one (``{"v": 2, "stats": …}``) or the
    single-router :meth:`LiveMetrics.state` map."""
    if doc.get("v") == LIVE_FORMAT and isinstance(doc.get("stats"), Mapping):
        return doc["stats"]
    return doc


def merge_live_state(shared: Mapping[str, Any] | None, deltas: Mapping[str, Mapping[str, Any]], *,
                     rib: int, agents: Iterable[str] | None = None, seq: int = 0) -> dict[str, Any]:
    """The shared live-statistics document after one router pushes ``deltas``
    (:meth:`LiveMetrics.deltas`): ``{"v": 2, "rib", "seq", "stats": {key:
    state}}``. Each key's contribution is folded in as the module doc says (a
    key new to the document starts from zero). ``shared``: the stored document
    (None: none yet; the single-router format is read too); ``rib``: the
    pusher's RIB version — when it is at least the document's, keys of agents
    not in ``agents`` (its RIB) are dropped, so the document stays bounded by
    the RIB; ``seq``: at least the new sequence number (e.g. the wall clock in
    ms; it is also above the stored one). Pure; malformed entries of
    ``shared`` are dropped, malformed deltas raise ValueError."""
    shared = shared or {}
    stats = {k: v for k, v in live_stats_of(shared).items() if isinstance(v, Mapping)}
    old_rib = int(shared.get("rib", 0)) if shared.get("v") == LIVE_FORMAT else 0
    old_seq = int(shared.get("seq", 0)) if shared.get("v") == LIVE_FORMAT else 0
    for key, d in deltas.items():
        try:
            c = _Pending.from_state(d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"live stats: malformed contribution of {key!r}") from e
        try:
            st = _Stats.from_state(stats[key]) if key in stats else _Stats(c.prior)
        except (KeyError, TypeError, ValueError):
            st = _Stats(c.prior)
        st.prior = c.prior
        st.absorb(c)
        stats[key] = st.state()
    if agents is not None and rib >= old_rib:
        keep = set(agents)
        stats = {k: v for k, v in stats.items() if k.rpartition(KEY_SEP)[2] in keep}
    return {"v": LIVE_FORMAT, "rib": max(rib, old_rib), "seq": max(seq, old_seq + 1), "stats": stats}


def arm_fingerprint(agent: AgentSpec) -> str:
    """A short digest of what makes an arm the same arm across reloads: its
    model, tool and endpoint (not its priors, window or timeouts)."""
    ident = {"model": agent.model, "tool": agent.tool, "endpoint": getattr(agent, "endpoint", None),
             "provider": getattr(agent, "provider", None)}
    return hashlib.sha256(msgspec.json.encode(ident)).hexdigest()[:16]


@dataclass(slots=True)
class SharedArm:
    """One bandit arm of a router sharing its learning (:meth:`RoutingLearner.share`):
    ``policy`` (``<name>`` or ``<name>#escalation``), ``arm``, the arm's
    ``fingerprint``, the live ``model`` and its ``base``: the state it had when
    it last synced with the shared entry (``seq``: that entry's sequence
    number; None: never). ``model.delta(base)`` is what to push."""

    policy: str
    arm: str
    fingerprint: str
    model: ArmModel
    base: ArmModel
    seq: int | None = None

    def synced(self, entry: Mapping[str, Any]) -> bool:
        """Adopt a shared entry (:func:`merge_arm_entry`'s shape) as both the
        live state and the base, if it is this arm's (same fingerprint and
        bits). Returns whether it was adopted."""
        if entry.get("fingerprint") != self.fingerprint:
            return False
        try:
            shared = ArmModel.from_state(entry["state"])
        except (KeyError, TypeError, ValueError):
            return False
        if shared.bits != self.model.bits:
            return False
        self.model.adopt(shared)
        self.base = shared
        self.seq = int(entry.get("seq", 0))
        return True


def merge_arm_entry(existing: Mapping[str, Any] | None, arm: SharedArm, delta: ArmDelta, *, rib: int,
                    seq: int = 0) -> dict[str, Any] | None:
    """The shared entry of ``arm`` after pushing ``delta`` (what it learned
    since its base): ``{policy, arm, fingerprint, state (float64), seq, rib}``.

    * ``existing`` is the same arm (fingerprint and bits): the delta is merged
      into it (:meth:`~atp_router.policy.bandit.ArmModel.merge`);
    * missing, unreadable, or an arm of an older-or-equal RIB version than the
      pusher's ``rib`` whose fingerprint or bits differ (the agent was
      redefined: the arm resets, as on one router): replaced by ``arm.model``;
    * an arm of a *newer* RIB version: None — leave it; the pusher's arm is
      rebuilt when it loads that RIB.

    ``seq``: at least the new sequence number (above the stored one anyway). Pure."""
    old_seq = 0
    if existing is not None:
        try:
            old_seq = int(existing.get("seq", 0))
            old_rib = int(existing.get("rib", 0))
            shared = ArmModel.from_state(existing["state"])
            same = existing.get("fingerprint") == arm.fingerprint and shared.bits == arm.model.bits
        except (KeyError, TypeError, ValueError, AttributeError):
            shared, same, old_rib = None, False, 0
        if same and shared is not None:
            try:
                shared.merge(delta)
            except ValueError:
                shared = None
            if shared is not None:
                return {"policy": arm.policy, "arm": arm.arm, "fingerprint": arm.fingerprint,
                        "state": shared.state(exact=True), "seq": max(seq, old_seq + 1), "rib": max(rib, old_rib)}
        elif old_rib > rib:
            return None
    return {"policy": arm.policy, "arm": arm.arm, "fingerprint": arm.fingerprint,
            "state": arm.model.state(exact=True), "seq": max(seq, old_seq + 1), "rib": rib}


@dataclass(slots=True)
class Decision:
    """One bandit choice: ``policy``, the arms in chosen ``order`` (the first
    ``k`` are the route's next-hops), the ``context`` it was made in and ``lam``.
    ``called`` is filled by the router with the arms actually called."""

    policy: str
    order: tuple[str, ...]
    k: int
    context: Context
    lam: float
    called: list[str] = field(default_factory=list)
    #: Champion/challenger (§7.2): the escalation bandit's choice — True
    #: "cheap then escalate" (escalate even when no trigger fires), False
    #: "cheap only" (the policy's triggers still escalate), None: no such bandit.
    escalate: bool | None = None
    #: Whether the task was escalated in the end (filled by the router).
    escalated: bool = False
    #: The tenant the choice was made for (its feature scopes its feedback).
    tenant: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "order": list(self.order), "k": self.k, "lam": round(self.lam, 6),
                "called": list(self.called), "context": self.context.to_json(), "escalate": self.escalate,
                "escalated": self.escalated, "tenant": self.tenant}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], bits: int) -> Decision:
        esc = obj.get("escalate")
        return cls(policy=str(obj["policy"]), order=tuple(map(str, obj["order"])), k=int(obj["k"]),
                   context=Context.from_json(obj["context"], bits), lam=float(obj["lam"]),
                   called=[str(a) for a in obj.get("called", [])], escalate=None if esc is None else bool(esc),
                   escalated=bool(obj.get("escalated", False)),
                   tenant=str(obj["tenant"]) if obj.get("tenant") is not None else None)


#: Arms of a policy's escalation bandit (champion/challenger, §7.2).
CHEAP, ESCALATE = "cheap", "escalate"


def _escalation_key(policy: str) -> str:
    return f"{policy}#escalation"


class _PolicyBandit:
    __slots__ = ("bandit", "escalation", "escalation_fp", "featurizer", "fingerprints", "gain_key", "last", "spec")

    def __init__(self, spec: BanditSpec, bandit: Bandit, fingerprints: dict[str, str]):
        self.spec = spec
        #: "cheap only" vs "cheap then escalate" (policies with an escalation target).
        self.escalation: Bandit | None = None
        self.escalation_fp = ""
        #: The context of the latest choice (``GET /v1/fib`` shows estimates in it).
        self.last: Context | None = None
        self.bandit = bandit
        self.featurizer = Featurizer(bits=spec.bits, text=spec.text_features)
        self.fingerprints = fingerprints
        #: ``(cheap, dear, cheap fingerprint, dear fingerprint)`` of the gain model in use (None: none).
        self.gain_key: tuple[str, str, str, str] | None = None


class TenantShares:
    """Each tenant's share of the shared quality evidence (issue 19: one tenant's
    own tasks moved an agent's shared quality 0.656 → 0.829).

    Rule: per agent, with ``N`` tenants holding evidence on it (the one
    observing included), a tenant's decayed quality weight ``w_t`` (decayed as
    the live statistic's ``q_w`` is, by ``(1−α)^w`` per observation of weight
    ``w``) may be at most ``f × (n0 + W)``, where ``f = max(share, 1/N)`` is the
    tenant's share, ``W`` every tenant's decayed weight and ``n0`` the prior's
    pseudo-observations (:data:`QUALITY_PRIOR_WEIGHT`). An observation's weight
    is cut to what keeps that true (0 once the tenant holds its share), and the
    same cut weight is what the live statistic and the policy's bandit learn.
    Since the live quality is the weighted mean ``(n0·prior + Σ w·q) / (n0 +
    W)``, a tenant whose weight is at most ``f`` of the denominator moves it by
    at most ``f × |its mean − the rest's mean|``: with two tenants on an agent
    neither outweighs the other and the prior together, with four or more none
    holds more than ``share`` of the evidence, whatever its traffic. A tenant
    alone on an agent (``N = 1``) learns it in full: there is no other tenant's
    evidence to protect, and capping it would freeze learning on a router one
    team uses (the cap binds from the second tenant's first observation on;
    the evidence the first gathered alone then decays as observations come).

    ``share`` (``RouterConfig.learn_share``, ``--learn-share``, default 0.25)
    in (0, 1]; 1 turns the rule off (as on a router without credentials, where
    every caller is one tenant). Per router (routers sharing a store each apply
    it to what they observe). Sans-IO."""

    __slots__ = ("_by_agent", "_prior_weight", "share")

    def __init__(self, share: float, *, prior_weight: float = QUALITY_PRIOR_WEIGHT) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"learn share must be in (0, 1], got {share}")
        self.share = share
        self._prior_weight = prior_weight
        #: agent → (every tenant's decayed weight W, {tenant: its decayed weight}).
        self._by_agent: dict[str, tuple[float, dict[str, float]]] = {}

    def held(self, agent: str, tenant: str) -> tuple[float, float]:
        """``(tenant's decayed weight, every tenant's)`` on ``agent``."""
        total, mine = self._by_agent.get(agent, (0.0, {}))
        return mine.get(tenant, 0.0), total

    def admit(self, agent: str, tenant: str | None, weight: float) -> float:
        """The weight ``tenant``'s observation of ``agent`` (weight ``weight``)
        may have (0..weight), now counted in its share. ``tenant`` None: not a
        tenant's (taken whole, uncounted)."""
        if tenant is None or self.share >= 1.0 or weight <= 0:
            return weight
        total, ws = self._by_agent.get(agent, (0.0, {}))
        mine, n0 = ws.get(tenant, 0.0), self._prior_weight
        f = max(self.share, 1.0 / (len(ws) + (tenant not in ws)))

        def room(d: float) -> float:
            # mine·d + x <= f·(n0 + total·d + x), solved for x.
            return (f * (n0 + total * d) - mine * d) / (1.0 - f)

        if f >= 1.0:  # alone on this agent: its evidence counts whole
            eff = weight
        else:
            # The decay the admitted weight brings lies in [(1−α)^weight, 1] and the
            # room is linear in it: the smaller end value holds for any of them.
            eff = max(0.0, min(weight, room((1.0 - ALPHA) ** weight), room(1.0)))
        if eff > 0.0:
            d = (1.0 - ALPHA) ** eff
            ws = {t: w * d for t, w in ws.items() if w * d > 1e-6}
            ws[tenant] = ws.get(tenant, 0.0) + eff
            self._by_agent[agent] = (total * d + eff, ws)
        return eff


class RoutingLearner:
    """The router's learning state (see the module doc). ``seed`` seeds the
    Thompson draws (None: OS entropy); ``share``: :class:`TenantShares`."""

    def __init__(self, *, seed: int | None = None, share: float = 1.0):
        self.rng = np.random.default_rng(seed)
        self.live = LiveMetrics()
        #: Each tenant's share of the quality evidence (issue 19).
        self.shares = TenantShares(share)
        self._bandits: dict[str, _PolicyBandit] = {}
        self._priors: dict[str, float] = {}
        #: (policy, arm) pairs whose state changed since the store saved them.
        self.dirty: set[tuple[str, str]] = set()
        #: Policies whose text gain model learned since the store saved it.
        self.dirty_gain: set[str] = set()
        #: Gain model entries read back from the store (:meth:`load_gain`), by policy.
        self._saved_gain: dict[str, Mapping[str, Any]] = {}
        #: Arm states read back from the store, waiting for a RIB that has them.
        self._saved: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        #: Sharing (:meth:`share`): each arm with the base it last synced.
        self._shared: dict[tuple[str, str], SharedArm] | None = None
        #: Sharing: each policy's gain model's state as it last synced.
        self._gain_base: dict[str, TextGain] = {}

    # ----------------------------------------------------------- sharing
    def share(self) -> None:
        """Learn together with other routers on a shared store (the module doc):
        from now on every arm keeps the base it last synced
        (:meth:`shared_arms`) and the live metrics their contributions. Costs a
        copy of each arm (64 KiB at 12 bits); a router that does not share
        never calls it."""
        if self._shared is None:
            self._shared = {}
            self.live.share()
            self._track()

    def _all_arms(self) -> Iterable[tuple[str, str, str, ArmModel]]:
        for name, pb in self._bandits.items():
            for a, model in pb.bandit.arms.items():
                yield name, a, pb.fingerprints[a], model
            if pb.escalation is not None:
                for a, model in pb.escalation.arms.items():
                    yield _escalation_key(name), a, pb.escalation_fp, model

    def _track(self) -> None:
        """A base for every arm (re)built since the last call: its state now."""
        if self._shared is None:
            return
        new: dict[tuple[str, str], SharedArm] = {}
        for policy, a, fp, model in self._all_arms():
            s = self._shared.get((policy, a))
            if s is None or s.model is not model or s.fingerprint != fp:
                s = SharedArm(policy, a, fp, model, model.copy())
            new[(policy, a)] = s
        self._shared = new
        bases = {}
        for name, pb in self._bandits.items():
            if pb.gain_key is not None:
                b = self._gain_base.get(name)
                bases[name] = b if b is not None and b.vocab is pb.bandit.gain.vocab else pb.bandit.gain.copy()
        self._gain_base = bases

    @property
    def priors(self) -> Mapping[str, float]:
        """The running RIB's agents and their ``win30d`` (as of the last :meth:`sync`)."""
        return self._priors

    def shared_gains(self) -> list[tuple[str, TextGain, TextGain]]:
        """``(policy, gain model, its sync base)`` per policy with a text gain
        model (empty unless :meth:`share` was called)."""
        return [(name, self._bandits[name].bandit.gain, base) for name, base in self._gain_base.items()
                if name in self._bandits]

    def adopt_gain(self, policy: str, entry: Mapping[str, Any]) -> bool:
        """Route by a shared store's gain entry (merged, or fitted anew by
        ``learn``): in place over the same vocabulary, else attached anew; it
        becomes the sync base. Returns whether the policy routes by it."""
        pb = self._bandits.get(policy)
        if pb is None or not isinstance(entry, Mapping):
            return False
        self._saved_gain[policy] = entry
        cur = pb.bandit.gain if pb.gain_key is not None else None
        try:
            model = TextGain.from_state(entry["state"])
        except (KeyError, TypeError, ValueError):
            return False
        if cur is not None and model.vocab.digest == cur.vocab.digest \
                and list(entry.get("arms", ())) == list(pb.gain_key[:2] if pb.gain_key else ()):
            cur.m, cur.q, cur.count = model.m.copy(), model.q.copy(), model.count
        else:
            pb.gain_key = None
            self._attach_gain(policy, pb, None)
            if pb.gain_key is None:
                pb.bandit.set_gain(None)
                pb.featurizer.vocab = None
                self._gain_base.pop(policy, None)
                return False
        if self._shared is not None:
            self._gain_base[policy] = pb.bandit.gain.copy()
        return True

    def shared_arms(self) -> list[SharedArm]:
        """Every arm with its sync base (empty unless :meth:`share` was called)."""
        return list(self._shared.values()) if self._shared is not None else []

    # ----------------------------------------------------------- RIB changes
    def sync(self, rib: Rib) -> None:
        """Build the bandits of ``rib``'s policies (after a load or reload): an
        arm whose policy, agent and :func:`arm_fingerprint` are unchanged keeps
        its state; new arms start from the agent's ``win30d``."""
        self._priors = {name: a.win30d for name, a in rib.agents.items()}
        self.live.set_priors(self._priors)
        new: dict[str, _PolicyBandit] = {}
        for i, p in enumerate(rib.policies):
            if p.bandit is None:
                continue
            name = p.name or f"policy[{i}]"
            fps = {a: arm_fingerprint(rib.agents[a]) for a in p.fanout}
            costs = {a: _price_per_call(rib, a) for a in p.fanout}
            bandit = Bandit(costs or {a: 1.0 for a in p.fanout}, priors={a: self._priors[a] for a in p.fanout},
                            bits=p.bandit.bits, explore=p.bandit.explore, lam=p.bandit.lam or 0.0,
                            target_cost=p.bandit.target_cost, bar=p.bandit.bar)
            old = self._bandits.get(name)
            for a in p.fanout:
                if old is not None and old.fingerprints.get(a) == fps[a] and a in old.bandit.arms \
                        and old.spec.bits == p.bandit.bits:
                    bandit.arms[a] = old.bandit.arms[a]
                elif (saved := self._saved.get((name, a))) is not None and saved[0] == fps[a]:
                    try:
                        arm = ArmModel.from_state(saved[1])
                    except (KeyError, TypeError, ValueError):
                        continue
                    if arm.bits == p.bandit.bits:
                        bandit.arms[a] = arm
            if old is not None and old.spec.target_cost == p.bandit.target_cost:
                bandit.lam, bandit.spent, bandit.choices = old.bandit.lam, old.bandit.spent, old.bandit.choices
            new[name] = pb = _PolicyBandit(p.bandit, bandit, fps)
            if old is not None and old.spec.bits == p.bandit.bits:
                pb.last = old.last
            if p.escalation is not None:
                self._sync_escalation(name, p, rib, pb, old)
            self._attach_gain(name, pb, old)
        self._bandits = new
        self._track()

    def _sync_escalation(self, name: str, p: Any, rib: Rib, pb: _PolicyBandit, old: _PolicyBandit | None) -> None:
        """The policy's champion/challenger bandit: arm ``cheap`` (its fanout
        only; triggers still escalate) vs ``escalate`` (then its escalation
        target whatever the triggers say); cost = the target's price."""
        target = p.escalation.to
        fp = hashlib.sha256("|".join([arm_fingerprint(rib.agents[target]), *sorted(pb.fingerprints.values())])
                            .encode()).hexdigest()[:16]
        cheap_prior = sum(self._priors[a] for a in p.fanout) / len(p.fanout)
        b = Bandit({CHEAP: 0.0, ESCALATE: _price_per_call(rib, target) or 1.0},
                   priors={CHEAP: cheap_prior, ESCALATE: self._priors[target]}, bits=p.bandit.bits,
                   explore=p.bandit.explore, lam=p.bandit.lam or 0.0, target_cost=p.bandit.target_cost,
                   bar=p.bandit.bar)
        key = _escalation_key(name)
        for arm in (CHEAP, ESCALATE):
            if old is not None and old.escalation is not None and old.escalation_fp == fp \
                    and old.spec.bits == p.bandit.bits:
                b.arms[arm] = old.escalation.arms[arm]
            elif (saved := self._saved.get((key, arm))) is not None and saved[0] == fp:
                try:
                    model = ArmModel.from_state(saved[1])
                except (KeyError, TypeError, ValueError):
                    continue
                if model.bits == p.bandit.bits:
                    b.arms[arm] = model
        if old is not None and old.escalation is not None and old.escalation_fp == fp:
            b.lam, b.spent, b.choices = old.escalation.lam, old.escalation.spent, old.escalation.choices
        pb.escalation, pb.escalation_fp = b, fp

    def _attach_gain(self, name: str, pb: _PolicyBandit, old: _PolicyBandit | None) -> None:
        """The policy's text gain model (``atp-router learn --method gain``): kept
        across a reload while its two arms' agents are unchanged, else the
        stored entry's when its arms and fingerprints are the policy's two."""
        if len(pb.bandit.arms) != 2:
            return
        if old is not None and old.gain_key is not None and old.spec.bits == pb.spec.bits \
                and old.gain_key[2:] == tuple(pb.fingerprints.get(a) for a in old.gain_key[:2]):
            model, weight, key = old.bandit.gain, old.bandit.gain_weight, old.gain_key
        else:
            entry = self._saved_gain.get(name)
            try:
                cheap, dear = (str(a) for a in entry["arms"]) if entry is not None else ("", "")
                fps = tuple(str(f) for f in entry["fingerprints"]) if entry is not None else ()
                if entry is None or {cheap, dear} != set(pb.bandit.arms) \
                        or fps != (pb.fingerprints[cheap], pb.fingerprints[dear]):
                    return
                model, weight = TextGain.from_state(entry["state"]), float(entry["weight"])
            except (KeyError, TypeError, ValueError):
                return
            key = (cheap, dear, *fps)
        try:
            pb.bandit.set_gain(model, weight, pair=(key[0], key[1]))
        except ValueError:
            return
        pb.featurizer.vocab = model.vocab
        pb.gain_key = key

    def load_gain(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Saved text gain entries ``{policy, arms: [cheap, dear], fingerprints,
        weight, state: TextGain.state()}`` from the store; applied by the next :meth:`sync`."""
        for e in entries:
            if isinstance(e, Mapping) and isinstance(e.get("policy"), str):
                self._saved_gain[e["policy"]] = e

    def dirty_gains(self) -> list[dict[str, Any]]:
        """The entries (:meth:`load_gain`'s form) of the gain models changed
        since the last call (the router saves them; the set is cleared)."""
        out = []
        for policy in sorted(self.dirty_gain):
            pb = self._bandits.get(policy)
            if pb is not None and pb.gain_key is not None:
                cheap, dear, fc, fd = pb.gain_key
                out.append({"policy": policy, "arms": [cheap, dear], "fingerprints": [fc, fd],
                            "weight": pb.bandit.gain_weight, "state": pb.bandit.gain.state()})
        self.dirty_gain.clear()
        return out

    def load_arms(self, rows: Iterable[tuple[str, str, str, dict[str, Any]]]) -> None:
        """Saved arm states ``(policy, arm, fingerprint, ArmModel.state())``
        from the store; applied by the next :meth:`sync`."""
        for policy, arm, fp, state in rows:
            self._saved[(policy, arm)] = (fp, state)

    def dirty_arms(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """``(policy, arm, fingerprint, state)`` of the arms changed since the
        last call (the router saves them; the set is cleared)."""
        out = []
        for policy, arm in sorted(self.dirty):
            if policy.endswith("#escalation"):
                pb = self._bandits.get(policy.removesuffix("#escalation"))
                if pb is not None and pb.escalation is not None and arm in pb.escalation.arms:
                    out.append((policy, arm, pb.escalation_fp, pb.escalation.arms[arm].state()))
                continue
            pb = self._bandits.get(policy)
            if pb is not None and arm in pb.bandit.arms:
                out.append((policy, arm, pb.fingerprints[arm], pb.bandit.arms[arm].state()))
        self.dirty.clear()
        return out

    def has_bandit(self, policy: str) -> bool:
        return policy in self._bandits

    def policy_bandit(self, policy: str) -> tuple[Bandit, Featurizer] | None:
        """The bandit of ``policy`` and the featurizer its tasks' contexts come
        from (e.g. to warm-start it: ``atp-router learn``); None without one.
        Arms it learns are not marked dirty: the caller saves them."""
        pb = self._bandits.get(policy)
        return (pb.bandit, pb.featurizer) if pb is not None else None

    def fingerprints(self, policy: str) -> Mapping[str, str]:
        """Each arm of ``policy``'s bandit → :func:`arm_fingerprint` of its agent."""
        pb = self._bandits.get(policy)
        return dict(pb.fingerprints) if pb is not None else {}

    def bits(self, policy: str) -> int | None:
        pb = self._bandits.get(policy)
        return pb.spec.bits if pb is not None else None

    # ----------------------------------------------------------- decisions
    def route(self, route: Any, meta: Mapping[str, Any], text: str = "", *, tenant: str | None = None,
              budget_usd_micros: int | None = None, qos: str | None = None) -> tuple[Any, Decision | None]:
        """Re-order ``route`` (an :class:`atp_router.policy.fib.Route`) by its policy's
        bandit: the healthy, cleared candidates (next-hops and alternates) are
        ordered by the bandit and cut to the route's K again. Returns the route
        unchanged and None when the policy has no bandit."""
        pb = self._bandits.get(route.policy)
        if pb is None:
            return route, None
        hops = {h.agent: h for h in (*route.next_hops, *route.alternates)}
        among = [a for a in hops if a in pb.bandit.arms]
        if not among:
            return route, None
        k = len(route.next_hops)
        # Tenant and QoS from the router (authenticated, admitted), never from the client's meta.
        extra = tuple(t for t in (f"tenant={tenant}" if tenant else None, f"qos={qos}" if qos else None) if t)
        ctx = pb.featurizer(meta, text, extra=extra)
        pb.last = ctx
        self._refresh_costs(pb)
        lam = None
        if pb.spec.lam is None and pb.spec.target_cost is None:
            lam = self._budget_lambda(pb, budget_usd_micros)
        choice = pb.bandit.choose(ctx, self.rng, among=among, lam=lam)
        order = list(choice.order) + [a for a in hops if a not in pb.bandit.arms]
        weight = {a: max(choice.utility.get(a, 0.0), 0.0) for a in order}
        ranked = [msgspec.structs.replace(hops[a], weight=round(weight[a], 6)) for a in order]
        new_route = msgspec.structs.replace(route, next_hops=ranked[:k], alternates=ranked[k:])
        pb.bandit.charge(order[:k])
        escalate = None
        if pb.escalation is not None and route.escalation_hop is not None:
            esc_lam = None
            if pb.spec.lam is None and pb.spec.target_cost is None:
                esc_lam = min(1.0, pb.escalation.top_cost / budget_usd_micros) if budget_usd_micros else 0.0
            arm = pb.escalation.choose(ctx, self.rng, lam=esc_lam).order[0]
            pb.escalation.charge((arm,))
            escalate = arm == ESCALATE
        return new_route, Decision(route.policy, tuple(order), k, ctx, choice.lam, escalate=escalate, tenant=tenant)

    def _refresh_costs(self, pb: _PolicyBandit) -> None:
        view = self.live.view()
        costs = {}
        for a in pb.bandit.arms:
            v = view.get(a)
            if v is not None and v.usd_micros_per_call is not None:
                costs[a] = v.usd_micros_per_call
        if costs:
            pb.bandit.set_costs(costs)

    @staticmethod
    def _budget_lambda(pb: _PolicyBandit, budget_usd_micros: int | None) -> float:
        dear = pb.bandit.top_cost
        if not budget_usd_micros or dear <= 0:
            return 0.0
        return min(1.0, dear / budget_usd_micros)

    def _tenant_index(self, pb: _PolicyBandit, decision: Decision) -> int | None:
        return pb.featurizer.index(f"tenant={decision.tenant}") if decision.tenant else None

    def observe(self, decision: Decision, qualities: Mapping[str, float], *, weight: float = 1.0,
                tenant_only: bool = False, tenant: str | None = None) -> None:
        """Learn from one task: ``qualities`` maps each *called* arm to its
        quality (0..1). Arms not called learn nothing (partial feedback).
        ``tenant_only`` (an untrusted client's feedback): only the arms' weight
        of the decision's tenant feature learns, and the shared live quality
        does not move: one tenant's scores route only that tenant. ``tenant``:
        whose task it was; each arm's weight is cut to that tenant's share
        (:class:`TenantShares`)."""
        pb = self._bandits.get(decision.policy)
        weights = {a: weight for a in qualities} if tenant_only else \
            {a: self.shares.admit(a, tenant, weight) for a in qualities}
        if not tenant_only:
            for agent, q in qualities.items():
                if weights[agent] > 0:
                    self.live.observe_quality(agent, q, policy=decision.policy, weight=weights[agent],
                                              prior=self._priors.get(agent, 0.5))
        if pb is None:
            return
        if decision.context.idx.size and int(decision.context.idx.max()) >= 1 << pb.spec.bits:
            return  # made under another ``bits``: not comparable
        only = self._tenant_index(pb, decision) if tenant_only else None
        if tenant_only and only is None:
            return
        rewards = {a: q for a, q in qualities.items() if a in pb.bandit.arms and weights[a] > 0}
        for a, q in rewards.items():
            pb.bandit.update(decision.context, {a: q}, weights[a], only=only)
        self.dirty.update((decision.policy, a) for a in rewards)
        if pb.gain_key is not None and rewards and decision.context.aux is not None and only is None:
            self.dirty_gain.add(decision.policy)

    def observe_escalation(self, decision: Decision, outcome: Mapping[str, float], *, weight: float = 1.0,
                           tenant_only: bool = False) -> None:
        """Learn the champion/challenger choice: ``outcome`` maps ``cheap`` to
        the quality the fanout alone reached and, when the task was escalated,
        ``escalate`` to the escalated result's (the escalation target's verdict
        is the reference, so an escalated task shows both arms)."""
        pb = self._bandits.get(decision.policy)
        if pb is None or pb.escalation is None or decision.escalate is None:
            return
        if decision.context.idx.size and int(decision.context.idx.max()) >= 1 << pb.spec.bits:
            return
        only = self._tenant_index(pb, decision) if tenant_only else None
        if tenant_only and only is None:
            return
        rewards = {a: q for a, q in outcome.items() if a in pb.escalation.arms}
        pb.escalation.update(decision.context, rewards, weight, only=only)
        self.dirty.update((_escalation_key(decision.policy), a) for a in rewards)

    def observe_quality(self, agent: str, quality: float, *, policy: str | None, weight: float = 1.0,
                        tenant: str | None = None) -> None:
        """A quality observation outside a bandit decision (live metrics only),
        of ``tenant``'s task: its weight cut to the tenant's share (:class:`TenantShares`)."""
        weight = self.shares.admit(agent, tenant, weight)
        if weight > 0:
            self.live.observe_quality(agent, quality, policy=policy, weight=weight,
                                      prior=self._priors.get(agent, 0.5))

    def observe_call(self, agent: str, *, policy: str | None, latency_ms: float, ok: bool, timeout: bool,
                     tokens: int, usd_micros: int) -> None:
        self.live.observe_call(agent, policy=policy, latency_ms=latency_ms, ok=ok, timeout=timeout,
                               tokens=tokens, usd_micros=usd_micros, prior=self._priors.get(agent, 0.5))

    def shadow(self, rate: float) -> bool:
        """Sample whether this task also runs the policy's shadow challenger."""
        return bool(self.rng.random() < rate)

    # ----------------------------------------------------------- inspection
    def fib_view(self) -> dict[str, Any]:
        """Per bandit policy ``{arms: {agent: {mean, std, count, cost}}, lambda,
        explore, target_cost, bar, choices}`` — estimates in the context of the
        policy's latest choice (the bias alone before any) — and per next-hop
        live figures: the body of ``GET /v1/fib``."""
        view = self.live.view()
        policies = {}
        for name, pb in self._bandits.items():
            b = pb.bandit
            if pb.escalation is not None:
                e = pb.escalation
                policies[_escalation_key(name)] = {
                    "arms": e.estimates(pb.last), "lambda": round(e.lam, 6), "explore": e.explore,
                    "target_cost": e.target_cost, "bar": e.bar, "choices": e.choices,
                    "text_features": pb.spec.text_features, "bits": pb.spec.bits}
            policies[name] = {"arms": b.estimates(pb.last), "lambda": round(b.lam, 6), "explore": b.explore,
                              "target_cost": b.target_cost, "bar": b.bar, "choices": b.choices,
                              "text_features": pb.spec.text_features, "bits": pb.spec.bits}
        return {"bandits": policies, "live": {k: v.to_json() for k, v in sorted(view.items())}}


def _price_per_call(rib: Rib, agent: str) -> float:
    """Prior cost of one call of ``agent`` in USD micros: its model's blended
    price × :data:`PRIOR_TOKENS_PER_CALL` (tools: 0)."""
    spec = rib.agents[agent]
    if spec.model is None:
        return 0.0
    return rib.models[spec.model].usd_per_mtok * PRIOR_TOKENS_PER_CALL


def _on_test(f: Any, tests: list[tuple[str, int, int]]) -> bool:
    if not tests:
        return False
    lo, _, hi = str(f.span).partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        return False
    return any(f.file == file and a <= end and start <= b for file, start, end in tests)


def result_quality(result: Any, agents: Sequence[str], *, confirmer: str | None = None,
                   failing_tests: Iterable[tuple[str, int, int]] = ()) -> float:
    """Quality (0..1) of what ``agents`` found together: the F1 of the union of
    their findings against the confirmed set (as :func:`consensus_quality`
    defines it); 1.0 when nothing was found or confirmed at all, 0.5 when
    findings exist but none is confirmed."""
    tests = list(failing_tests)
    agents_set = set(agents)
    confirmed, mine = set(), set()
    findings = getattr(result, "findings", []) or []
    for f in findings:
        who = {p.split("#", 1)[0] for p in f.provenance}
        if len(who) >= 2 or (confirmer is not None and confirmer in who) or _on_test(f, tests):
            confirmed.add(f.id)
        if who & agents_set:
            mine.add(f.id)
    if not confirmed:
        return 1.0 if not findings else 0.5
    hit = len(mine & confirmed)
    if hit == 0:
        return 0.0
    p, r = hit / len(mine), hit / len(confirmed)
    return 2 * p * r / (p + r)


def consensus_quality(result: Any, called: Sequence[str], failed: Iterable[str] = (),
                      confirmer: str | None = None,
                      failing_tests: Iterable[tuple[str, int, int]] = ()) -> dict[str, float]:
    """Quality (0..1) of each called next-hop from the merged result (spec §7):

    * confirmed findings are those with two or more distinct agents in their
      provenance (a two-phase-commit ACK is such a second agent), or found by
      ``confirmer`` (the escalation target), or lying on a failing test
      (``failing_tests``: ``(file, start, end)`` a test-running agent reported
      with rule ``test_fail``);
    * an agent's quality is the F1 of its findings against the confirmed set;
      when nothing is confirmed, 0.5 for each agent with findings (unknown) and
      1.0 for one without (it agreed there was nothing) if no one found any,
      else 0.5; an agent in ``failed`` is 0.
    """
    by_agent: dict[str, set[str]] = {a: set() for a in called}
    confirmed: set[str] = set()
    findings = getattr(result, "findings", []) or []
    tests = list(failing_tests)
    for f in findings:
        agents = {p.split("#", 1)[0] for p in f.provenance}
        if len(agents) >= 2 or (confirmer is not None and confirmer in agents) or _on_test(f, tests):
            confirmed.add(f.id)
        for a in agents:
            if a in by_agent:
                by_agent[a].add(f.id)
    failed = set(failed)
    out = {}
    for a, mine in by_agent.items():
        if a in failed:
            out[a] = 0.0
        elif confirmed:
            hit = len(mine & confirmed)
            p = hit / len(mine) if mine else 0.0
            r = hit / len(confirmed)
            out[a] = 0.0 if hit == 0 else 2 * p * r / (p + r)
        elif findings:
            out[a] = 0.5
        else:
            out[a] = 1.0
    return out
