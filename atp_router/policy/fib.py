"""FIB: the RIB compiled for the data plane, looked up per task (spec §6.2).

:func:`compile_fib` turns a validated :class:`~atp_router.policy.rib.Rib` into a
:class:`Fib` (pure; matchers compiled, per-agent constants folded).
:meth:`Fib.lookup` routes one task:

1. **Policy selection, ACL-style**: the policies are tried in RIB order and the
   *first* whose ``match`` accepts the task meta wins; later policies are not
   consulted. Put specific policies (``diff_loc: ">400"``) before general ones.
2. **Weighted ECMP over the policy's fanout** (spec §6.2). Each next-hop scores::

       fit × quality × 1/(1 + usd_per_mtok) × 1/(1 + p95_ms/1000) × (1 − error_rate)

   * ``fit``: the fraction of the wanted strengths — the meta ``task_type`` plus
     any meta ``strengths_wanted`` (a string or a list) — found in the agent's
     ``strengths`` ∪ its model's; 1.0 when the task asks for nothing. Floored at
     :data:`FIT_FLOOR` so next-hops that fit nothing are still ordered by the
     other factors instead of collapsing into a zero-weight tie.
   * ``quality``: the live win rate (:class:`~atp_router.policy.learn.LiveView`
     ``quality``: the RIB's ``win30d`` as a prior that consensus and client
     feedback overwrite; per policy once the policy has observed the next-hop,
     else per next-hop), or ``win30d`` with no live view.
   * ``usd_per_mtok``: the model's blended USD per 1M tokens (tools: 0).
   * ``p95_ms``: the live p95 of the router's own calls when it has enough
     observations, else ``Health.p95_ms`` when given and > 0, else the RIB's.
   * ``error_rate``: the worse of ``Health.error_rate`` and the live error rate
     (timeouts included), clamped to 0..1, else 0; a next-hop whose
     ``Health.up`` is False is excluded (and named in the route's ``skipped``,
     so the FINAL can say so).

   Next-hops are ordered by descending score, ties by agent name (so a lookup
   is deterministic), then cut to ``fanout_k`` when the policy sets it — after
   exclusion, so a down next-hop's slot fails over to the next best. The
   candidates past ``fanout_k`` are kept, in the same order, as the route's
   ``alternates``: the dispatcher reroutes a failing call (``EAGENTDOWN``) to
   the first one not yet tried, after the failing agent's RIB ``fallback``
   (:meth:`Fib.next_hop`).
3. **Data scope** (spec §11; grammar in :mod:`atp_router.policy.labels`): labels whose
   category a detector covers (``secrets``/``no_secrets``, ``pii``,
   ``<region>_personal_data``, in ``redact`` or ``forbidden`` mode) exclude no
   next-hop: at dispatch the :class:`~atp_router.security.redact.DataScopeGuard` gives an
   agent not cleared for them redacted content, or refuses it (``ESEC``) when a
   ``forbidden`` category is found in the content. Every other label (opaque: no
   detector can enforce it, e.g. ``acp.policy:P001``) fails closed here: the task
   goes only to agents cleared for it (``agents.<name>.data_scope`` lists it; an
   agent without the key takes any opaque label). When no candidate of the
   matching policy is cleared, the lookup refuses with ``ESEC``.

Lookup failures raise :class:`~atp_router.wire.errors.AgentError` with ``EAGENTDOWN``
(no policy matches; every next-hop down) or ``ESEC`` (no next-hop cleared for
the task's data scope). The router answers them with an RST (spec §10:
EAGENTDOWN → circuit break / reroute, the client fails over; ESEC → RST, audit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from msgspec import Struct

from atp_router.policy.health import Health
from atp_router.policy.labels import clearance_of, parse_label
from atp_router.policy.learn import MIN_OBS, LiveView
from atp_router.policy.match import CompiledMatch, compile_match
from atp_router.policy.rib import (
    AgentSpec,
    Budget,
    EscalationSpec,
    PolicySpec,
    Rib,
    SpecError,
    reference_errors,
)
from atp_router.wire.errors import AgentError, ErrorCode, PolicyError
from atp_router.wire.frame import QoS, RouteEntry, RouteUpdate, Window

__all__ = ["FIT_FLOOR", "Fib", "NextHop", "Route", "compile_fib", "data_scope_labels", "fib_delta"]

#: Lowest capability fit a next-hop gets (see the module doc).
FIT_FLOOR = 0.01

#: RouteEntry.task_type of a policy that does not pin ``task_type`` to values.
ANY_TASK_TYPE = "*"


class NextHop(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One selected agent of a route.

    ``weight`` is its ECMP score (unnormalized, ≥ 0); ``timeout_ms`` its overall
    per-call deadline; ``model`` the RIB model name (``Rib.models`` key) or ``tool``
    the tool name; costs are USD micros per input / output token (0 for tools),
    for preflight estimates (spec §5.2).
    """

    agent: str
    weight: float
    qos: QoS
    timeout_ms: int
    model: str | None = None
    tool: str | None = None
    in_usd_micros_per_token: float = 0.0
    out_usd_micros_per_token: float = 0.0


class Route(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The result of a FIB lookup: the policy that matched and what it says.

    ``next_hops`` is ordered by weight (best first; top-K applied);
    ``alternates`` are the healthy, cleared candidates that top-K left out, in
    the same order (reroute targets);
    ``escalation_hop`` is the escalation target as a next-hop (weight 0 when its
    health says down: the dispatcher decides what to do then; None when the
    task's data scope does not clear it); ``budget`` and
    ``window`` are the policy's (None: the router's default); ``qos`` is the
    policy's override or None (keep the stream's); ``deadline_ms`` the overall
    stream deadline. ``skipped``: the agents of the policy (cleared for the
    task) this lookup left out because their health says down (an open circuit,
    a next-hop that announced itself down), by name — also where
    ``fanout_k`` gave their slot to the next best: the FINAL names them.
    """

    policy: str
    next_hops: list[NextHop]
    escalation: EscalationSpec | None
    escalation_hop: NextHop | None
    budget: Budget | None
    window: Window | None
    consensus: str
    qos: QoS | None
    deadline_ms: int
    quorum: int = 2
    alternates: list[NextHop] = msgspec.field(default_factory=list)
    skipped: list[str] = msgspec.field(default_factory=list)


class _Candidate:
    """Per-agent constants of the score, folded at compile time."""

    __slots__ = ("agent", "clearance", "cost", "fallback", "hop", "p95_ms", "strengths", "win30d")

    def __init__(self, name: str, agent: AgentSpec, rib: Rib):
        self.agent = name
        self.fallback = agent.fallback
        #: Normalised categories of ``agents.<name>.data_scope`` (None: no key).
        self.clearance = clearance_of(agent.data_scope)
        self.p95_ms = agent.p95_ms
        strengths = set(agent.strengths)
        usd_per_mtok = 0.0
        cost_in = cost_out = 0.0
        if agent.model is not None:
            model = rib.models[agent.model]
            strengths.update(model.strengths)
            usd_per_mtok = model.usd_per_mtok
            # USD per 1M tokens is numerically USD micros per token.
            cost_in, cost_out = model.usd_per_mtok_in, model.usd_per_mtok_out
        self.strengths = frozenset(strengths)
        self.win30d = agent.win30d
        self.cost = 1.0 / (1.0 + usd_per_mtok)
        self.hop = NextHop(
            agent=name,
            weight=0.0,
            qos=agent.qos,
            timeout_ms=agent.timeout_ms,
            model=agent.model,
            tool=agent.tool,
            in_usd_micros_per_token=cost_in,
            out_usd_micros_per_token=cost_out,
        )

    def score(self, wanted: frozenset[str], health: Health | None,
              live: Mapping[str, LiveView] | None = None, policy: str | None = None) -> float:
        fit = len(wanted & self.strengths) / len(wanted) if wanted else 1.0
        p95 = self.p95_ms
        err = 0.0
        quality = self.win30d
        if health is not None:
            if health.p95_ms > 0:
                p95 = health.p95_ms
            err = health.error_rate
        if live:
            v = live.get(self.agent)
            if v is not None:
                quality = v.quality
                if v.p95_ms is not None:
                    p95 = v.p95_ms
                if v.error_rate is not None:
                    err = max(err, v.error_rate)
            if policy is not None:
                pv = live.get(f"{policy}|{self.agent}")
                if pv is not None and pv.quality_obs >= MIN_OBS:
                    quality = pv.quality
        ok = 1.0 - min(max(err, 0.0), 1.0)
        return max(fit, FIT_FLOOR) * quality * self.cost / (1.0 + p95 / 1000.0) * ok

    def cleared(self, labels: frozenset[str]) -> bool:
        """May a task with these ``data_scope`` labels be routed to this agent
        (§11)? Yes for labels a detector covers (the dispatcher's guard redacts or
        refuses per agent); an opaque label needs the agent's clearance (an agent
        without ``data_scope`` takes any)."""
        if self.clearance is None:
            return True
        return all(p.detector is not None or p.category in self.clearance for p in map(parse_label, labels))


class _Policy:
    __slots__ = ("candidates", "escalation", "fanout_k", "match", "name", "spec")

    def __init__(
        self,
        name: str,
        spec: PolicySpec,
        match: CompiledMatch,
        candidates: tuple[_Candidate, ...],
        escalation: _Candidate | None,
    ):
        self.name = name
        self.spec = spec
        self.match = match
        self.candidates = candidates
        self.fanout_k = spec.fanout_k
        self.escalation = escalation


def _wanted(meta: Mapping[str, Any]) -> frozenset[str]:
    wanted: set[str] = set()
    task_type = meta.get("task_type")
    if isinstance(task_type, str):
        wanted.add(task_type)
    extra = meta.get("strengths_wanted")
    if isinstance(extra, str):
        wanted.add(extra)
    elif isinstance(extra, (list, tuple)):
        wanted.update(s for s in extra if isinstance(s, str))
    return frozenset(wanted)


def data_scope_labels(meta: Mapping[str, Any]) -> frozenset[str]:
    """The task's ``meta.data_scope`` labels (a string or a list of strings)."""
    scope = meta.get("data_scope")
    if isinstance(scope, str):
        return frozenset({scope})
    if isinstance(scope, (list, tuple)):
        return frozenset(s for s in scope if isinstance(s, str))
    return frozenset()


def _cleared(policy: _Policy, labels: frozenset[str]) -> Sequence[_Candidate]:
    """``policy``'s candidates cleared for the task's ``data_scope`` ``labels``
    (all of them when there are none); AgentError(ESEC) when none is."""
    cleared = [c for c in policy.candidates if c.cleared(labels)] if labels else policy.candidates
    if not cleared:
        opaque = sorted(lb for lb in labels if parse_label(lb).detector is None)
        raise AgentError(
            ErrorCode.ESEC,
            f"data_scope {opaque} is not cleared for any next-hop of policy {policy.name} "
            f"({', '.join(c.agent for c in policy.candidates)})",
        )
    return cleared


class Fib:
    """A compiled, immutable FIB of RIB generation ``version`` (see module doc).

    ``rib`` is the RIB it was compiled from (adapters are built from its
    ``models`` / ``agents``).
    """

    __slots__ = ("_candidates", "_policies", "rib", "version")

    def __init__(self, rib: Rib, version: int, policies: tuple[_Policy, ...],
                 candidates: Mapping[str, _Candidate] | None = None):
        self.rib = rib
        self.version = version
        self._policies = policies
        self._candidates = dict(candidates or {})

    def next_hop(self, agent: str, meta: Mapping[str, Any] | None = None) -> NextHop | None:
        """``agent`` as a next-hop (weight 0: it is chosen by name, not by score),
        for a reroute; ``None`` when the RIB has no such agent or the task's
        ``data_scope`` (in ``meta``) does not clear it."""
        c = self._candidates.get(agent)
        if c is None or (meta is not None and not c.cleared(data_scope_labels(meta))):
            return None
        return c.hop

    def clearance(self, agent: str) -> frozenset[str] | None:
        """The data-scope categories ``agent`` is cleared for (normalised
        ``agents.<agent>.data_scope``, see :func:`atp_router.policy.labels.clearance_of`),
        for :meth:`~atp_router.security.redact.DataScopeGuard.for_agent`; None when the
        agent has no ``data_scope`` or the RIB no such agent."""
        c = self._candidates.get(agent)
        return c.clearance if c is not None else None

    def fallback(self, agent: str) -> str | None:
        """``agents.<agent>.fallback`` of the RIB (acyclic, checked at load)."""
        c = self._candidates.get(agent)
        return c.fallback if c is not None else None

    @property
    def policy_names(self) -> list[str]:
        """Policy names in lookup (RIB) order."""
        return [p.name for p in self._policies]

    def lookup(self, meta: Mapping[str, Any], *, health: Mapping[str, Health] | None = None,
               live: Mapping[str, LiveView] | None = None) -> Route:
        """Route a task by its frame ``meta`` (spec §6.2).

        ``health`` maps agent names to live :class:`~atp_router.policy.health.Health`;
        agents absent from it count as healthy with their RIB figures.
        ``live`` is :meth:`LiveMetrics.view() <atp_router.policy.learn.LiveMetrics.view>`
        (keys ``agent`` and ``policy|agent``): the router's own observations.
        Raises AgentError(EAGENTDOWN) when no policy matches or when every
        next-hop of the matching policy is down, AgentError(ESEC) when none is
        cleared for the task's opaque ``data_scope`` labels (see the module doc)."""
        policy = self._match(meta)
        wanted = _wanted(meta)
        labels = data_scope_labels(meta)
        cleared = _cleared(policy, labels)
        scored: list[tuple[float, str, _Candidate]] = []
        down: list[str] = []
        for c in cleared:
            h = health.get(c.agent) if health is not None else None
            if h is not None and not h.up:
                down.append(c.agent)
                continue
            scored.append((-c.score(wanted, h, live, policy.name), c.agent, c))
        if not scored:
            raise AgentError(ErrorCode.EAGENTDOWN, f"no healthy next-hop for policy {policy.name}")
        scored.sort(key=lambda t: (t[0], t[1]))
        alternates: list[tuple[float, str, _Candidate]] = []
        if policy.fanout_k is not None:
            alternates = scored[policy.fanout_k :]
            del scored[policy.fanout_k :]
        escalation_hop = None
        if policy.escalation is not None and policy.escalation.cleared(labels):
            e = policy.escalation
            h = health.get(e.agent) if health is not None else None
            weight = 0.0 if h is not None and not h.up else e.score(wanted, h, live, policy.name)
            escalation_hop = msgspec.structs.replace(e.hop, weight=weight)
        spec = policy.spec
        return Route(
            policy=policy.name,
            next_hops=[msgspec.structs.replace(c.hop, weight=-neg) for neg, _, c in scored],
            escalation=spec.escalation,
            escalation_hop=escalation_hop,
            budget=spec.budget,
            window=spec.window,
            consensus=spec.consensus,
            qos=spec.qos,
            deadline_ms=spec.deadline_ms,
            quorum=spec.quorum or 2,
            alternates=[msgspec.structs.replace(c.hop, weight=-neg) for neg, _, c in alternates],
            skipped=sorted(down),
        )

    def _match(self, meta: Mapping[str, Any]) -> _Policy:
        """The first policy (RIB order) matching ``meta``; AgentError(EAGENTDOWN) if none."""
        for policy in self._policies:
            if policy.match(meta):
                return policy
        raise AgentError(ErrorCode.EAGENTDOWN, f"no route for task_type={meta.get('task_type')!r}")

    def routes(self, live: Mapping[str, LiveView] | None = None) -> list[RouteEntry]:
        """The FIB as ROUTE_UPDATE entries (spec §4.3), in lookup order: one per
        (policy, task_type) — ``"*"`` when the policy does not pin task_type to
        values — with the next-hops and weights a task of that type gets with no
        health data, scored with the ``live`` view when given (§6.1: the FIB is
        computed with live metrics). Several entries may share a task_type (e.g.
        a large-diff policy before the general one); the first matching one wins."""
        entries = []
        for policy in self._policies:
            task_types = policy.match.equals_values("task_type") or [ANY_TASK_TYPE]
            for tt in task_types:
                meta = {} if tt == ANY_TASK_TYPE else {"task_type": tt}
                wanted = _wanted(meta)
                scored = sorted((-c.score(wanted, None, live, policy.name), c.agent) for c in policy.candidates)
                if policy.fanout_k is not None:
                    del scored[policy.fanout_k :]
                entries.append(
                    RouteEntry(task_type=str(tt), next_hops=[a for _, a in scored], weights=[-s for s, _ in scored],
                               policy=policy.name, match=dict(policy.spec.match))
                )
        return entries

    def route_update(self, previous: Fib | None = None) -> RouteUpdate:
        """A ROUTE_UPDATE of this FIB; ``withdrawn`` lists the task types routed
        by ``previous`` and by no entry of this one."""
        routes = self.routes()
        current = {r.task_type for r in routes}
        withdrawn = sorted({r.task_type for r in previous.routes()} - current) if previous is not None else []
        return RouteUpdate(version=self.version, routes=routes, withdrawn=withdrawn)


def _moved(old: list[RouteEntry], new: list[RouteEntry], rel: float) -> bool:
    """Do two entry lists of one task type differ in policy, match or
    next-hops, or in a weight by more than ``rel`` (relative)?"""
    if len(old) != len(new):
        return True
    for a, b in zip(old, new, strict=True):
        if (a.policy, a.match, a.next_hops) != (b.policy, b.match, b.next_hops):
            return True
        for x, y in zip(a.weights, b.weights, strict=True):
            if abs(x - y) > rel * max(abs(x), abs(y), 1e-12):
                return True
    return False


def fib_delta(previous: list[RouteEntry] | None, current: list[RouteEntry], *, version: int,
              rel: float = 0.0) -> RouteUpdate:
    """The ROUTE_UPDATE that takes a subscriber from the entries it has
    (``previous``, from :meth:`Fib.routes`) to ``current`` (spec §4.3), by task
    type: ``routes`` holds *every* current entry of each task type whose
    entries changed — next-hops, policy, match, or a weight by more than
    ``rel`` — (a subscriber replaces all its entries of that task type with
    them), ``withdrawn`` the task types no longer routed. With ``previous``
    None: the whole FIB. ``version`` is the RIB generation."""
    cur: dict[str, list[RouteEntry]] = {}
    for e in current:
        cur.setdefault(e.task_type, []).append(e)
    if previous is None:
        return RouteUpdate(version=version, routes=[e for es in cur.values() for e in es])
    old: dict[str, list[RouteEntry]] = {}
    for e in previous:
        old.setdefault(e.task_type, []).append(e)
    changed = [e for tt, es in cur.items() if tt not in old or _moved(old[tt], es, rel) for e in es]
    return RouteUpdate(version=version, routes=changed, withdrawn=sorted(set(old) - set(cur)))


def compile_fib(rib: Rib, *, version: int) -> Fib:
    """Compile ``rib`` into a FIB of generation ``version`` (pure; spec §6).

    ``rib`` is normally the output of :func:`atp_router.policy.loader.load_rib`; a Rib
    built in code is checked here too: raises PolicyError("<rib>", key, reason)
    on a dangling reference or a malformed ``match``."""
    for ref in reference_errors(rib):
        entry = f".{ref.entry}" if ref.section == "agents" else ("" if ref.entry == -1 else f"[{ref.entry}]")
        raise PolicyError("<rib>", f"{ref.section}{entry}{ref.field}", ref.reason)
    candidates = {name: _Candidate(name, agent, rib) for name, agent in rib.agents.items()}
    policies = []
    for i, spec in enumerate(rib.policies):
        try:
            match = compile_match(spec.match)
        except SpecError as e:
            raise PolicyError("<rib>", f"policies[{i}].match.{e.field}", e.reason) from None
        escalation = candidates[spec.escalation.to] if spec.escalation is not None else None
        policies.append(
            _Policy(
                spec.name or f"policy[{i}]",
                spec,
                match,
                tuple(candidates[a] for a in spec.fanout),
                escalation,
            )
        )
    return Fib(rib, version, tuple(policies), candidates)
