"""What a caller may do (spec §11 AuthZ, §19 resource abuse), sans-IO.

Two layers, both pure functions of their arguments (time is passed in as ``now``):

* **Roles → actions.** :func:`authorize` checks an :class:`~atp_router.security.identity.Identity`
  against the fixed grant table :data:`GRANTS`:

  ============  ===========================================================
  ``admin``     policy reload and read, routes, audit, tenant admin, metrics, health
  ``operator``  metrics, health
  ``client``    stream open, stream access (its own streams), health
  ============  ===========================================================

  Stream actions need the ``client`` role: an admin-only identity opening a
  stream is refused. A refusal is :class:`Forbidden` (``ESEC``, HTTP 403).

* **Tenant scopes.** :class:`StreamAdmission` decides a SYN against the tenant's
  ``clients.<tenant>`` entry of the RIB (:class:`~atp_router.policy.rib.ClientSpec`):
  task types, data categories, ``qos_max``, ``max_stream_budget``, concurrent
  streams and a stream-open token bucket. It returns :class:`Admit` (the QoS and
  budget to serve, clamped) or :class:`Refuse` (``ESEC`` for a scope violation,
  ``EWINDOW`` with a retry hint for a quota or rate)::

      admission = StreamAdmission()
      match admission.decide(identity, rib.clients.get(identity.tenant, ClientSpec()),
                             task_type="code_review", qos=QoS.GOLD, budget=asked,
                             labels=frozenset(meta_data_scope), open_streams=n, now=trio.current_time()):
          case Admit(qos, budget): ...
          case Refuse(code, reason, retry_after_ms): ...
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from atp_router.policy.rib import ClientSpec, RateSpec
from atp_router.security.identity import Identity, Role
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, QoS

__all__ = [
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_RATE",
    "GRANTS",
    "QUOTA_RETRY_MS",
    "Action",
    "Admit",
    "Forbidden",
    "Refuse",
    "StreamAdmission",
    "authorize",
    "clamp_budget",
    "clamp_qos",
    "is_allowed",
    "rate_refusal",
    "roles_for",
    "streams_refusal",
]


class Action(StrEnum):
    """Everything an ingress asks permission for (spec §11, §22)."""

    STREAM_OPEN = "stream.open"
    #: Frames and events of the caller's own streams.
    STREAM_ACCESS = "stream.access"
    POLICY_RELOAD = "policy.reload"
    POLICY_READ = "policy.read"
    ROUTES_READ = "routes.read"
    AUDIT_READ = "audit.read"
    TENANT_ADMIN = "tenant.admin"
    METRICS_READ = "metrics.read"
    HEALTH_READ = "health.read"


#: The fixed grant table: what each role may do.
GRANTS: dict[Role, frozenset[Action]] = {
    Role.ADMIN: frozenset({
        Action.POLICY_RELOAD, Action.POLICY_READ, Action.ROUTES_READ, Action.AUDIT_READ,
        Action.TENANT_ADMIN, Action.METRICS_READ, Action.HEALTH_READ,
    }),
    Role.OPERATOR: frozenset({Action.METRICS_READ, Action.HEALTH_READ}),
    Role.CLIENT: frozenset({Action.STREAM_OPEN, Action.STREAM_ACCESS, Action.HEALTH_READ}),
}

_ROLES_FOR: dict[Action, tuple[Role, ...]] = {
    a: tuple(r for r in Role if a in GRANTS[r]) for a in Action
}


class Forbidden(ATPError):
    """The caller is authenticated but its roles do not grant the action (spec §11):
    code ``ESEC``; an HTTP ingress answers ``status`` (403)."""

    status = 403

    def __init__(self, reason: str):
        super().__init__(ErrorCode.ESEC, reason)


def roles_for(action: Action) -> tuple[Role, ...]:
    """The roles that grant ``action``, in :class:`Role` order."""
    return _ROLES_FOR[action]


def is_allowed(identity: Identity, action: Action) -> bool:
    """Whether one of ``identity``'s roles grants ``action``."""
    return any(action in GRANTS[r] for r in identity.roles)


def authorize(identity: Identity, action: Action) -> None:
    """Raise :class:`Forbidden` (``ESEC``, 403) unless a role of ``identity`` grants
    ``action``; the reason names the role(s) needed and those held (spec §11)."""
    if is_allowed(identity, action):
        return
    needed = " or ".join(r.value for r in roles_for(action))
    held = ", ".join(sorted(r.value for r in identity.roles)) or "no role"
    raise Forbidden(f"{action.value} needs the {needed} role; {identity.subject!r} (tenant "
                    f"{identity.tenant!r}) has {held}")


# --------------------------------------------------------------------- admission

#: Concurrently open streams of a tenant whose ``clients.<tenant>.max_streams`` is unset.
DEFAULT_MAX_STREAMS = 1000
#: Stream-open token bucket of a tenant whose ``clients.<tenant>.rate`` is unset.
DEFAULT_RATE = RateSpec(per_s=50.0, burst=100)
#: Retry hint (ms) when a tenant is at its concurrent-stream quota: no time is
#: known at which one of its streams will close.
QUOTA_RETRY_MS = 1000

_QOS_RANK = {QoS.GOLD: 0, QoS.SILVER: 1, QoS.BRONZE: 2}


@dataclass(frozen=True, slots=True)
class Admit:
    """Open the stream with ``qos`` (at most the tenant's ``qos_max``) and ``budget``
    (the asked budget capped by ``max_stream_budget`` on each axis; None: no cap
    from either, the policy's budget still applies)."""

    qos: QoS | None
    budget: Budget | None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Refuse the SYN: ``code`` is ``ESEC`` (scope: role, task type, data category)
    or ``EWINDOW`` (quota, rate) with ``retry_after_ms`` (ms) for EWINDOW, else None."""

    code: ErrorCode
    reason: str
    retry_after_ms: int | None = None


def clamp_qos(qos: QoS, qos_max: QoS) -> QoS:
    """``qos`` lowered to ``qos_max`` when it asks for more (spec §9, §11)."""
    return qos_max if _QOS_RANK[qos] < _QOS_RANK[qos_max] else qos


def _min_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def clamp_budget(asked: Budget | None, cap: Budget | None) -> Budget | None:
    """The tighter of ``asked`` and ``cap`` on each axis (float USD, tokens); an
    axis one of them leaves open takes the other's value."""
    if cap is None:
        return asked
    if asked is None:
        return cap
    tokens = _min_opt(asked.tokens, cap.tokens)
    return Budget(usd=_min_opt(asked.usd, cap.usd), tokens=None if tokens is None else int(tokens))


def streams_refusal(tenant: str, limit: int) -> Refuse:
    """A SYN over the tenant's ``max_streams`` (``EWINDOW``, retry hint :data:`QUOTA_RETRY_MS`)."""
    return Refuse(ErrorCode.EWINDOW, f"tenant {tenant!r} is at its limit of {limit} open streams", QUOTA_RETRY_MS)


def rate_refusal(tenant: str, rate: RateSpec, retry_after_ms: int) -> Refuse:
    """A SYN over the tenant's open ``rate`` (``EWINDOW``, retry when a token is due)."""
    return Refuse(ErrorCode.EWINDOW, f"tenant {tenant!r} exceeds its rate of {rate.per_s:g} stream "
                                     f"opens/s (burst {rate.burst})", retry_after_ms)


class _Bucket:
    """One tenant's token bucket: ``tokens`` held at time ``at`` (s), filling at
    ``rate`` (the tenant's rate when last used)."""

    __slots__ = ("at", "rate", "tokens")

    def __init__(self, tokens: float, at: float, rate: RateSpec):
        self.tokens = tokens
        self.at = at
        self.rate = rate

    def level(self, now: float) -> float:
        return min(float(self.rate.burst), self.tokens + max(0.0, now - self.at) * self.rate.per_s)


class StreamAdmission:
    """Decides stream opens against tenant scopes (spec §11 AuthZ, §19), sans-IO.

    Holds one token bucket per tenant (``now`` in seconds, any monotonic origin).
    A bucket that has refilled to ``burst`` is forgotten (a fresh one is the same),
    and at most ``max_tenants`` buckets are kept (least recently used dropped
    first), so memory stays bounded whatever the number of tenants.

    ``default_max_streams`` / ``default_rate`` apply to a tenant whose ``ClientSpec``
    leaves ``max_streams`` / ``rate`` unset — tenants absent from the RIB included
    (pass ``ClientSpec()`` for them).
    """

    __slots__ = ("_buckets", "default_max_streams", "default_rate", "max_tenants")

    def __init__(
        self,
        *,
        default_max_streams: int = DEFAULT_MAX_STREAMS,
        default_rate: RateSpec = DEFAULT_RATE,
        max_tenants: int = 100_000,
    ):
        if default_max_streams < 1 or max_tenants < 1:
            raise ValueError("default_max_streams and max_tenants must be >= 1")
        self.default_max_streams = default_max_streams
        self.default_rate = default_rate
        self.max_tenants = max_tenants
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def decide(
        self,
        identity: Identity,
        spec: ClientSpec,
        *,
        task_type: str,
        qos: QoS | None,
        budget: Budget | None,
        labels: frozenset[str],
        open_streams: int,
        now: float,
    ) -> Admit | Refuse:
        """Decide one SYN of ``identity`` (tenant ``identity.tenant``, whose RIB entry
        is ``spec``).

        ``task_type`` is the task's ``task_type`` meta; ``qos`` the class asked for
        (None: the route's, which the caller clamps with :func:`clamp_qos`);
        ``budget`` the stream budget asked (``meta.budget``; None if none);
        ``labels`` the ``meta.data_scope`` labels (Agent Context labels included);
        ``open_streams`` the tenant's streams open now; ``now`` seconds.

        Checks, in order: the ``client`` role (``ESEC``), ``task_types`` (``ESEC``),
        ``data_categories`` (``ESEC``), ``max_streams`` (``EWINDOW``, retry hint
        :data:`QUOTA_RETRY_MS`), ``rate`` (``EWINDOW``, retry hint = ms until a
        token is due). A refused SYN takes no token. Never raises. (Routers
        sharing a store decide the last two there instead, across all of them:
        :meth:`scope`, then the shared quota, then :meth:`quota` as the fallback
        — atp_router.runtime.dataplane.quotas.)
        """
        scoped = self.scope(identity, spec, task_type=task_type, qos=qos, budget=budget, labels=labels)
        if isinstance(scoped, Refuse):
            return scoped
        refused = self.quota(identity.tenant, spec, open_streams=open_streams, now=now)
        return scoped if refused is None else refused

    def scope(self, identity: Identity, spec: ClientSpec, *, task_type: str, qos: QoS | None,
              budget: Budget | None, labels: frozenset[str]) -> Admit | Refuse:
        """:meth:`decide`'s scope checks alone (the ``client`` role, ``task_types``,
        ``data_categories``: ``ESEC``) and the QoS and budget clamped; no quota."""
        if not is_allowed(identity, Action.STREAM_OPEN):
            return Refuse(ErrorCode.ESEC, f"opening a stream needs the client role; {identity.subject!r} "
                                          f"(tenant {identity.tenant!r}) has "
                                          f"{', '.join(sorted(r.value for r in identity.roles)) or 'no role'}")
        tenant = identity.tenant
        if spec.task_types is not None and task_type not in spec.task_types:
            allowed = ", ".join(spec.task_types) or "none"
            return Refuse(ErrorCode.ESEC, f"task_type {task_type[:64]!r} is outside the scope of tenant "
                                          f"{tenant!r} (allowed: {allowed})")
        if spec.data_categories is not None:
            outside = sorted(labels.difference(spec.data_categories))
            if outside:
                allowed = ", ".join(spec.data_categories) or "none"
                return Refuse(ErrorCode.ESEC, f"data_scope label(s) {', '.join(repr(x[:64]) for x in outside[:8])} "
                                              f"outside the data categories of tenant {tenant!r} (allowed: {allowed})")
        return Admit(None if qos is None else clamp_qos(qos, spec.qos_max),
                     clamp_budget(budget, spec.max_stream_budget))

    def limits(self, spec: ClientSpec) -> tuple[int, RateSpec]:
        """A tenant's ``max_streams`` and open ``rate`` (its RIB entry's, else this admission's defaults)."""
        return (spec.max_streams if spec.max_streams is not None else self.default_max_streams,
                spec.rate or self.default_rate)

    def quota(self, tenant: str, spec: ClientSpec, *, open_streams: int, now: float) -> Refuse | None:
        """:meth:`decide`'s quota checks on this router alone: ``max_streams``
        against ``open_streams`` (:func:`streams_refusal`), then a token of the
        tenant's bucket at ``now`` (:func:`rate_refusal`). None: admitted (a
        token taken); a refused SYN takes none."""
        limit, rate = self.limits(spec)
        if open_streams >= limit:
            return streams_refusal(tenant, limit)
        wait_s = self._take(tenant, rate, now)
        if wait_s is not None:
            return rate_refusal(tenant, rate, max(1, math.ceil(wait_s * 1000)))
        return None

    def _take(self, tenant: str, rate: RateSpec, now: float) -> float | None:
        """Take one token of ``tenant``'s bucket: None when taken, else the seconds
        until one is due."""
        buckets = self._buckets
        b = buckets.get(tenant)
        if b is None:
            self._forget_idle(now)
            b = buckets[tenant] = _Bucket(float(rate.burst), now, rate)
            if len(buckets) > self.max_tenants:
                buckets.popitem(last=False)  # the least recently used tenant regains a full bucket
        else:
            buckets.move_to_end(tenant)
            b.rate = rate  # a reload may have changed it: refill at the new rate, cap at the new burst
        tokens = b.level(now)
        b.at = max(b.at, now)
        if tokens < 1.0:
            b.tokens = tokens
            return (1.0 - tokens) / rate.per_s
        b.tokens = tokens - 1.0
        return None

    def _forget_idle(self, now: float) -> None:
        """Drop buckets at the least recently used end that have refilled (their
        tenants were idle: a fresh bucket is the same). Amortised O(1) per call."""
        buckets = self._buckets
        while buckets:
            tenant, b = next(iter(buckets.items()))
            if b.level(now) < b.rate.burst:
                return
            del buckets[tenant]

    def statistics(self) -> dict[str, int]:
        """``{"tenants": buckets held}``."""
        return {"tenants": len(self._buckets)}
