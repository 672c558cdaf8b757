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

**Bandits** (:class:`RoutingLearner`): one :class:`~atp.policy.bandit.Bandit`
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

from atp.policy.bandit import ArmModel, Bandit, Context, Featurizer
from atp.policy.rib import AgentSpec, BanditSpec, Rib

__all__ = [
    "MIN_OBS",
    "Decision",
    "LiveMetrics",
    "LiveView",
    "RoutingLearner",
    "arm_fingerprint",
    "consensus_quality",
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
                "tokens": self.tokens, "usd": self.usd, "hist": [round(x, 5) for x in self.hist.tolist()],
                "q_sum": self.q_sum, "q_w": self.q_w}

    @classmethod
    def from_state(cls, s: Mapping[str, Any]) -> _Stats:
        st = cls(float(s["prior"]))
        for k in ("calls", "errors", "timeouts", "tokens", "usd", "q_sum", "q_w"):
            v = float(s[k])
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"live stats: bad {k}")
            setattr(st, k, v)
        hist = np.asarray(s["hist"], dtype=np.float64)
        if hist.shape != (_BUCKETS,) or not np.all(np.isfinite(hist)) or np.any(hist < 0):
            raise ValueError("live stats: bad histogram")
        st.hist = hist
        return st


class LiveMetrics:
    """Decayed live statistics per next-hop (key ``agent``) and per policy
    (key ``policy|agent``); see the module doc."""

    __slots__ = ("_dirty", "_stats", "_view", "changed")

    def __init__(self) -> None:
        self._stats: dict[str, _Stats] = {}
        self._view: dict[str, LiveView] = {}
        self._dirty: set[str] = set()
        #: Keys changed since the store last saved them (the router clears it).
        self.changed: set[str] = set()

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
            self._dirty.add(key)
            self.changed.add(key)

    def observe_quality(self, agent: str, quality: float, *, policy: str | None, weight: float = 1.0,
                        prior: float = 0.5) -> None:
        """One quality observation (0..1) of ``agent``'s answer."""
        for key in (agent, f"{policy}|{agent}") if policy else (agent,):
            self._get(key, prior).quality(quality, weight)
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

    def load(self, state: Mapping[str, Mapping[str, Any]]) -> int:
        """Restore saved statistics; malformed entries are skipped. Returns how
        many were loaded."""
        n = 0
        for key, s in state.items():
            try:
                self._stats[key] = _Stats.from_state(s)
            except (KeyError, TypeError, ValueError):
                continue
            self._dirty.add(key)
            n += 1
        return n


def arm_fingerprint(agent: AgentSpec) -> str:
    """A short digest of what makes an arm the same arm across reloads: its
    model, tool and endpoint (not its priors, window or timeouts)."""
    ident = {"model": agent.model, "tool": agent.tool, "endpoint": getattr(agent, "endpoint", None),
             "provider": getattr(agent, "provider", None)}
    return hashlib.sha256(msgspec.json.encode(ident)).hexdigest()[:16]


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
    __slots__ = ("bandit", "escalation", "escalation_fp", "featurizer", "fingerprints", "last", "spec")

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


class RoutingLearner:
    """The router's learning state (see the module doc). ``seed`` seeds the
    Thompson draws (None: OS entropy)."""

    def __init__(self, *, seed: int | None = None):
        self.rng = np.random.default_rng(seed)
        self.live = LiveMetrics()
        self._bandits: dict[str, _PolicyBandit] = {}
        self._priors: dict[str, float] = {}
        #: (policy, arm) pairs whose state changed since the store saved them.
        self.dirty: set[tuple[str, str]] = set()
        #: Arm states read back from the store, waiting for a RIB that has them.
        self._saved: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}

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
        self._bandits = new

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

    def bits(self, policy: str) -> int | None:
        pb = self._bandits.get(policy)
        return pb.spec.bits if pb is not None else None

    # ----------------------------------------------------------- decisions
    def route(self, route: Any, meta: Mapping[str, Any], text: str = "", *, tenant: str | None = None,
              budget_usd_micros: int | None = None, qos: str | None = None) -> tuple[Any, Decision | None]:
        """Re-order ``route`` (an :class:`atp.policy.fib.Route`) by its policy's
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
                tenant_only: bool = False) -> None:
        """Learn from one task: ``qualities`` maps each *called* arm to its
        quality (0..1). Arms not called learn nothing (partial feedback).
        ``tenant_only`` (an untrusted client's feedback): only the arms' weight
        of the decision's tenant feature learns, and the shared live quality
        does not move: one tenant's scores route only that tenant."""
        pb = self._bandits.get(decision.policy)
        if not tenant_only:
            for agent, q in qualities.items():
                self.live.observe_quality(agent, q, policy=decision.policy, weight=weight,
                                          prior=self._priors.get(agent, 0.5))
        if pb is None:
            return
        if decision.context.idx.size and int(decision.context.idx.max()) >= 1 << pb.spec.bits:
            return  # made under another ``bits``: not comparable
        only = self._tenant_index(pb, decision) if tenant_only else None
        if tenant_only and only is None:
            return
        rewards = {a: q for a, q in qualities.items() if a in pb.bandit.arms}
        pb.bandit.update(decision.context, rewards, weight, only=only)
        self.dirty.update((decision.policy, a) for a in rewards)

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

    def observe_quality(self, agent: str, quality: float, *, policy: str | None, weight: float = 1.0) -> None:
        """A quality observation outside a bandit decision (live metrics only)."""
        self.live.observe_quality(agent, quality, policy=policy, weight=weight, prior=self._priors.get(agent, 0.5))

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
