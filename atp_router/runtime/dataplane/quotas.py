"""A tenant's quotas held across the router processes that share a store (issue 22
item 3; spec §11 AuthZ, §19): its ``max_streams``, its stream-open ``rate`` and its
learning rate, enforced across every router on one Redis (``--store redis://…``,
:mod:`atp_router.deploy.cluster`) and every worker on one SQLite file
(``--workers N``, :mod:`atp_router.deploy.workers`). A router alone keeps its own
(:class:`~atp_router.security.authz.StreamAdmission`); these are parts its
deployment mode injects, never overrides of the SYN path:

* :class:`SharedQuotas` — the shared counter over the :class:`~atp_router.store.base.Store`
  (one atomic store step per SYN, :meth:`~atp_router.store.base.Store.quota_open`;
  the decision is :func:`atp_router.flow.quota.decide`): each stream this router
  admits holds an entry ``(owner, stream id)`` until it closes; the entries of
  the streams it holds are renewed every ``ttl_ms / 4`` while the router lives
  and its others dropped (:meth:`SharedQuotas.run`: an entry a timed-out open
  left, which the router fell back from, is gone within a renewal),
  removed all at once when its owner is settled
  (:meth:`~atp_router.store.base.Store.quota_release_owned`, from
  :func:`atp_router.deploy.workers.settle`: a router lost or stopped, a worker
  dead), and expire ``ttl_ms`` after the last renewal otherwise. A close the
  store could not take is retried by :meth:`SharedQuotas.run` (the entry is not
  renewed meanwhile);
* :class:`SharedTenantAdmission` — the ``tenant_admission`` SYN stage with the
  tenant's quota and open rate decided by :class:`SharedQuotas` (``EWINDOW``,
  the single router's codes, reasons and retry hints: HTTP 429 + Retry-After);
  a :class:`~atp_router.runtime.dataplane.opening.Holding` stage, so its entry is
  released when a later stage refuses the SYN and when the stream closes;
  built with :meth:`SharedTenantAdmission.using` (``Router(syn_stages=
  with_shared_quotas(stages, quotas))``, :func:`with_shared_quotas`);
* :class:`SharedBudgetOpen` — the **atomic OPEN** where the store can make it
  (:attr:`SharedQuotas.opener`: a cluster router on Redis): ``tenant_admission``
  leaves the quota's limits in ``o.shared_quota`` and ``budget_open`` takes the
  stream's entry and opens its budget account in one store step, both or
  neither (same codes, reasons and retry hints; a SYN refused for its quota
  is then refused after the route and bandit stages, not before);
* :meth:`SharedQuotas.may_learn` — a tenant's learning rate as a shared GCRA
  bucket (``learn/<tenant>``), :attr:`Learning.shared_rate
  <atp_router.runtime.controlplane.learning.Learning.shared_rate>`, taken in
  slices of :data:`LEARN_SLICE_S` of its rate handed out locally (one store
  step per slice, not per finished task); when a slice's last token is handed
  out, the next one is taken in the group commit under way (the finished
  task's FINAL: no round trip of its own, :meth:`SharedQuotas.may_learn`).

**The store down**: a decision the store cannot make
(:class:`~atp_router.store.base.StoreError`) falls back to this router's own limit —
the tenant's ``max_streams`` against its streams open here, its own token
buckets — neither refusing everything nor admitting without limit; logged once
per outage (and once when the store answers again), counted
(``atp_quota_fallback_total{quota}``), and reported to the deployment's
``on_unavailable(op, error)`` (a cluster's ``atp_store_up``). A stream admitted
meanwhile holds no shared entry (the shared count misses it until it closes).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import trio

from atp_router.flow.budget import Allowance
from atp_router.flow.quota import QuotaAsk, QuotaGrant
from atp_router.policy.fib import data_scope_labels
from atp_router.policy.rib import RateSpec
from atp_router.runtime.dataplane.opening import (
    CONTINUE,
    Continue,
    OpenCtx,
    OpenParts,
    Stage,
    StageType,
    StoreStep,
    min_budget,
    refusal,
    replace_stage,
)
from atp_router.runtime.dataplane.stream import stream_account
from atp_router.security.authz import (
    Refuse,
    StreamAdmission,
    rate_refusal,
    streams_refusal,
)
from atp_router.store.base import Store, StoreError, StoreUnavailable
from atp_router.wire.errors import ATPError

if TYPE_CHECKING:
    from atp_router.flow.budget import BudgetLedger
    from atp_router.observability.metrics import RouterMetrics
    from atp_router.policy.rib import ClientSpec
    from atp_router.runtime.dataplane.streams import StreamTable

__all__ = ["LEARN_SLICE_S", "QUOTA_TTL_MS", "SharedBudgetOpen", "SharedQuotas", "SharedTenantAdmission",
           "with_shared_quotas"]

log = logging.getLogger("atp_router.runtime.quotas")

#: How long a quota entry outlives its owner's last renewal (ms): the backstop for
#: an owner gone and never settled. Renewed every quarter of it.
QUOTA_TTL_MS = 60_000
#: A tenant's learning tokens are taken from the shared bucket in slices (the budget-lease
#: pattern, issue 22 item 2): up to this long of its rate (and at most a quarter of its
#: burst, so several routers hold slices at once), handed out here until used or this old
#: — an unused token is lost, never lent again: the shared rate is never exceeded, at worst
#: under-used. s; chosen a priori (a quarter second: a slice outlives no reload by much).
LEARN_SLICE_S = 0.25
#: Tenants whose learning slices are kept before the expired ones are dropped.
_SLICES_KEPT = 1024


class SharedQuotas:
    """The shared counter of one router process ``owner`` over ``store`` (module
    docstring). ``metrics``: the router's (``atp_quota_refused_total``,
    ``atp_quota_fallback_total``); ``on_unavailable(op, error)``: told when a
    store call fails (ops ``open``, ``close``, ``lease``); ``clock``: Unix
    seconds (the store's ``now_ms``; Redis uses its own clock)."""

    def __init__(self, store: Store, *, owner: str, metrics: RouterMetrics, ttl_ms: int = QUOTA_TTL_MS,
                 on_unavailable: Callable[[str, StoreError], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        self.store, self.owner, self.metrics, self.ttl_ms = store, owner, metrics, ttl_ms
        self.on_unavailable = on_unavailable
        self.clock = clock
        #: (tenant, stream id) of the streams holding a shared entry.
        self.held: set[tuple[str, str]] = set()
        #: Closes the store could not take, retried by :meth:`run`.
        self.unreleased: set[tuple[str, str]] = set()
        #: When set, :meth:`release` hands its store write to it (True: taken) — the stream
        #: table's group commit, where the close goes in one round trip with the stream's
        #: last events, off the trio loop, and is retried with them (atp_router.deploy.cluster:
        #: :meth:`StreamPersistence.defer <atp_router.runtime.dataplane.persistence.StreamPersistence.defer>`).
        self.defer: Callable[..., bool] | None = None
        #: When set, the atomic OPEN (issue 22 item 2; atp_router.deploy.cluster):
        #: ``opener(ask, account, limit, parent, ttl_ms)`` opens a stream's budget account
        #: with its quota entry in one store step, as ``(run, then)``: ``run()`` the store call,
        #: ``then(outcome)`` the grant (refused: neither taken), raising StoreUnavailable or
        #: ATPError (EBUDGET); :func:`with_shared_quotas` then has ``budget_open`` decide the
        #: quota (:class:`SharedBudgetOpen`, a :class:`~atp_router.runtime.dataplane.opening.StoreStep`).
        self.opener: Callable[[QuotaAsk, str, Allowance, str, int],
                              tuple[Callable[[], Any], Callable[[Any], QuotaGrant]]] | None = None
        #: When set (atp_router.deploy.cluster): ``closer(account)`` closes a closed stream's budget
        #: account in the store with its last events (:meth:`SharedBudgetOpen.release`).
        self.closer: Callable[[str], None] | None = None
        #: tenant -> (learning tokens left in this router's slice, when it expires: time.monotonic());
        #: (-1, t): the shared bucket refused, none before t.
        self._slices: dict[str, tuple[int, float]] = {}
        #: Tenants whose next learning slice is being taken in a group commit (:meth:`_refill`).
        self._refilling: set[str] = set()
        self._down = False

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _failed(self, op: str, e: StoreError) -> None:
        if not self._down:
            self._down = True
            log.error("shared tenant quotas: the store cannot be reached (%s: %s): each router enforces its own "
                      "limits until it answers", op, e)
        if self.on_unavailable is not None:
            self.on_unavailable(op, e)

    def _ok(self) -> None:
        if self._down:
            self._down = False
            log.warning("shared tenant quotas: the store answers again: quotas are shared again")

    def open(self, tenant: str, stream_id: str, max_streams: int, rate: RateSpec) -> QuotaGrant | None:
        """Decide stream ``stream_id`` of ``tenant`` against its shared quota
        (:meth:`Store.quota_open <atp_router.store.base.Store.quota_open>`); admitted,
        it holds an entry until :meth:`release`. None: the store could not
        decide (fall back to this router's own limits)."""
        ask = QuotaAsk(tenant, stream_id, max_streams, rate.per_s, rate.burst)
        try:
            grant = self.store.quota_open(ask, owner=self.owner, now_ms=self._now_ms(), ttl_ms=self.ttl_ms)
        except StoreError as e:
            self._failed("open", e)
            self.metrics.quota_fallback.labels("streams").inc()
            return None
        return self._granted(grant, tenant, stream_id)

    def open_with_account(self, ask: QuotaAsk, account: str, limit: Allowance,
                          parent: str) -> tuple[Callable[[], Any], Callable[[Any], QuotaGrant | None]]:
        """:meth:`open` together with the stream's budget ``account`` (``limit``,
        under ``parent``) in one atomic store step (:attr:`opener`), as ``(run,
        then)``: ``run()`` the store call (a worker thread may run it),
        ``then(outcome)`` on the router's thread the grant (admitted: both
        taken; refused: neither). None: the store could not decide — nothing
        was opened (fall back to this router's own limits; the account's own
        open then refuses while the store is away). ``then`` raises
        :class:`~atp_router.wire.errors.ATPError` (``EBUDGET``: the tenant's
        account was settled by another router)."""
        assert self.opener is not None, "open_with_account needs an opener"
        run, opened = self.opener(ask, account, limit, parent, self.ttl_ms)

        def then(outcome: Any) -> QuotaGrant | None:
            try:
                grant = opened(outcome)
            except StoreUnavailable as e:
                self._failed("open", e)
                self.metrics.quota_fallback.labels("streams").inc()
                return None
            return self._granted(grant, ask.tenant, ask.stream_id)

        return run, then

    def _granted(self, grant: QuotaGrant, tenant: str, stream_id: str) -> QuotaGrant:
        """The store decided ``grant``: held until :meth:`release` when admitted, else counted refused."""
        self._ok()
        if grant.admitted:
            self.held.add((tenant, stream_id))
        else:
            self.metrics.quota_refused.labels(grant.refused or "").inc()
        return grant

    def release(self, tenant: str, stream_id: str) -> None:
        """Stream ``stream_id`` of ``tenant`` closed (or its SYN was refused
        later): its entry, if it holds one, is removed (or retried by :meth:`run`)."""
        key = (tenant, stream_id)
        if key not in self.held:
            return
        self.held.discard(key)
        if self.defer is not None and self.defer(functools.partial(self.store.quota_close, tenant, stream_id,
                                                                   owner=self.owner)):
            return
        try:
            self.store.quota_close(tenant, stream_id, owner=self.owner)
        except StoreError as e:
            self.unreleased.add(key)
            self._failed("close", e)

    def may_learn(self, tenant: str, rate_per_s: float, burst: int) -> bool | None:
        """Whether ``tenant`` may teach the routing state one more finished task
        (its shared learning bucket ``learn/<tenant>``): a token of this
        router's slice while it lasts (:data:`LEARN_SLICE_S`), else a new slice
        taken from the store in one step
        (:meth:`Store.rate_take_upto <atp_router.store.base.Store.rate_take_upto>`);
        refused, the store's wait is kept and refuses here until it passes.
        The slice's last token handed out, the next slice is taken in the
        group commit under way (:meth:`_refill`); so is a slice asked for less
        than :data:`LEARN_SLICE_S` after such a wait passed (the tenant
        finishes tasks faster than its rate here: this task is refused, the
        slice serves the next ones — as many learn a second). None: the store
        could not say (the caller's own bucket decides)."""
        now = time.monotonic()
        left, until = self._slices.get(tenant, (0, 0.0))
        n = max(1, min(int(rate_per_s * LEARN_SLICE_S), burst // 4))
        if now < until and left:
            if left < 0:
                return False  # the shared bucket had none, and gets none before `until` (others only take)
            self._slices[tenant] = (left - 1, until)
            if left == 1:
                self._refill(tenant, n, rate_per_s, burst)
            return True
        if left < 0 and now < until + LEARN_SLICE_S and self._refill(tenant, n, rate_per_s, burst):
            return False
        try:
            taken, wait = self.store.rate_take_upto("learn/" + tenant, n, per_s=rate_per_s, burst=burst,
                                                 now_ms=self._now_ms())
        except StoreError as e:
            self._failed("open", e)
            self.metrics.quota_fallback.labels("learn").inc()
            return None
        self._ok()
        if len(self._slices) >= _SLICES_KEPT:
            self._slices = {t: v for t, v in self._slices.items() if v[1] > now}
        if not taken:
            self._slices[tenant] = (-1, now + (wait or 1) / 1000)
            return False
        self._slices[tenant] = (taken - 1, now + LEARN_SLICE_S)
        if taken == 1:
            self._refill(tenant, n, rate_per_s, burst)
        return True

    def _refill(self, tenant: str, n: int, rate_per_s: float, burst: int) -> bool:
        """Take ``tenant``'s next learning slice (up to ``n`` tokens) in the next
        group commit (:attr:`defer`: the FINAL of the task that used the last
        token — no round trip of its own), handed out from when that answers
        (:meth:`_refilled`). Its tokens are taken from the shared bucket like a
        slice taken at once, and handed out at most :data:`LEARN_SLICE_S` after
        the group commit was sent: the shared rate is never exceeded; a slice
        the router does not use in time is lost (under-used, as any slice).
        Whether one is on its way (False: no group commit runs, or this is not
        the trio loop)."""
        if tenant in self._refilling:
            return True
        if self.defer is None:
            return False
        sent: list[float] = []
        answer: list[tuple[int, int | None]] = []

        def write() -> None:
            sent[:] = [time.monotonic()]  # sent after this: its tokens expire LEARN_SLICE_S from here
            answer.clear()
            self.store.rate_take_upto_then("learn/" + tenant, n, answer.append, per_s=rate_per_s, burst=burst,
                                           now_ms=self._now_ms())

        # first: ahead of the group commit's events, in its one pipeline.
        if not self.defer(write, over=functools.partial(self._refilled, tenant, sent, answer), first=True):
            return False
        self._refilling.add(tenant)
        return True

    def _refilled(self, tenant: str, sent: list[float], answer: list[tuple[int, int | None]]) -> None:
        """The group commit of :meth:`_refill` is over: its slice (the store's
        ``answer`` ``(taken, wait)``, taken after ``sent``; no answer: none)
        handed out here unless a slice taken at once meanwhile still serves."""
        self._refilling.discard(tenant)
        if not answer:
            return
        (taken, wait), base = answer[0], sent[0]
        left, until = self._slices.get(tenant, (0, 0.0))
        now = time.monotonic()
        if left > 0 and now < until:
            return  # its tokens are lost: under-used, never over
        if len(self._slices) >= _SLICES_KEPT:
            self._slices = {t: v for t, v in self._slices.items() if v[1] > now}
        self._slices[tenant] = (taken, base + LEARN_SLICE_S) if taken else (-1, base + (wait or 1) / 1000)

    def renew(self) -> int:
        """Retry the closes the store could not take, then renew the entries of
        the streams this router holds and drop its others — one a timed-out
        :meth:`open` made after it fell back
        (:meth:`Store.quota_renew <atp_router.store.base.Store.quota_renew>`).
        Returns the entries held; raises :class:`~atp_router.store.base.StoreError`."""
        for tenant, stream_id in sorted(self.unreleased):
            self.store.quota_close(tenant, stream_id, owner=self.owner)
            self.unreleased.discard((tenant, stream_id))
        return self.store.quota_renew(self.owner, self.held, now_ms=self._now_ms(), ttl_ms=self.ttl_ms)

    async def run(self) -> None:
        """:meth:`renew` every ``ttl_ms / 4`` until cancelled (a background
        service of the router: :meth:`service`)."""
        while True:
            await trio.sleep(self.ttl_ms / 4000)
            try:
                self.renew()
            except StoreError as e:
                self._failed("lease", e)
            else:
                self._ok()

    def service(self, router: object) -> list[Callable[[], Awaitable[None]]]:
        """The router's background service (:data:`~atp_router.runtime.deployment.Service`): :meth:`run`."""
        return [self.run]


class SharedTenantAdmission:
    """Spec §11 AuthZ: role, task types, data categories (ESEC); stream quota and rate shared across routers (EWINDOW)."""

    name: ClassVar[str] = "tenant_admission"
    __slots__ = ("admission", "client_spec", "joined", "quotas", "streams")

    def __init__(self, admission: StreamAdmission, client_spec: Callable[[str], ClientSpec], streams: StreamTable,
                 quotas: SharedQuotas, *, joined: bool = False) -> None:
        self.admission = admission
        self.client_spec = client_spec
        self.streams = streams
        self.quotas = quotas
        #: The quota is decided by ``budget_open`` with the stream's account (:class:`SharedBudgetOpen`):
        #: this stage leaves its limits in ``o.shared_quota``.
        self.joined = joined

    @classmethod
    def using(cls, quotas: SharedQuotas, *, joined: bool = False) -> StageType:
        """The stage type that builds this stage on ``quotas`` (for ``Router(syn_stages=...)``)."""
        return _Using(quotas, joined)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        tenant = o.tenant
        spec = self.client_spec(tenant)
        decision = self.admission.scope(o.identity, spec, task_type=str(o.meta.get("task_type", "")), qos=o.qos,
                                        budget=o.client_budget, labels=data_scope_labels(o.meta))
        if isinstance(decision, Refuse):
            return decision
        max_streams, rate = self.admission.limits(spec)
        if self.joined:
            if self.streams.tenant_open[tenant] >= max_streams:
                # Already at the limit on this router alone (its opens waiting on the store
                # counted): no store step — a tenant's queued opens never fill the router's table.
                return streams_refusal(tenant, max_streams)
            o.shared_quota = (max_streams, rate)  # decided with the stream's account (SharedBudgetOpen)
        else:
            refused = _decided(self.quotas.open(tenant, o.stream_id, max_streams, rate), self, o)
            if refused is not None:
                return refused
        o.client_budget, o.admitted_qos = decision.budget, decision.qos
        return CONTINUE

    def release(self, tenant: str, stream_id: str) -> None:
        """:class:`~atp_router.runtime.dataplane.opening.Holding`: the stream's shared entry removed."""
        self.quotas.release(tenant, stream_id)


def _decided(grant: QuotaGrant | None, stage: SharedTenantAdmission | SharedBudgetOpen, o: OpenCtx) -> Refuse | None:
    """The refusal of a shared quota's ``grant`` for ``o`` (its single-router codes,
    reasons and retry hints); None: admitted. ``grant`` None (the store could not
    decide): this router's own limits decide."""
    tenant = o.tenant
    spec = stage.client_spec(tenant)
    max_streams, rate = stage.admission.limits(spec)
    if grant is None:
        return stage.admission.quota(tenant, spec, open_streams=stage.streams.tenant_open[tenant], now=o.now)
    if grant.refused == "streams":
        return streams_refusal(tenant, max_streams)
    if grant.refused is not None:
        return rate_refusal(tenant, rate, grant.retry_after_ms or 1)
    return None


class SharedBudgetOpen:
    """The stream's ledger account opened with its shared quota entry in one store step (EWINDOW, EBUDGET)."""

    name: ClassVar[str] = "budget_open"
    __slots__ = ("admission", "client_account", "client_spec", "ledger", "quotas", "streams")

    def __init__(self, parts: OpenParts, quotas: SharedQuotas) -> None:
        self.ledger: BudgetLedger = parts.ledger
        self.client_account = parts.client_account
        self.admission = parts.admission
        self.client_spec = parts.client_spec
        self.streams = parts.streams
        self.quotas = quotas

    def __call__(self, o: OpenCtx) -> Continue | Refuse | StoreStep:
        """The atomic OPEN (issue 22 item 2): ``o.shared_quota`` (left by
        :class:`SharedTenantAdmission`) and the stream's account at the tighter
        of client and policy budget, both or neither (:meth:`SharedQuotas.open_with_account`),
        as a :class:`~atp_router.runtime.dataplane.opening.StoreStep` (the store
        round trip off the trio loop). The store away: this router's own limits,
        then the account's own open (which refuses ``EBUDGET`` "budget store unavailable")."""
        assert o.route is not None, "budget_open runs after route"
        o.budget = budget = min_budget(o.client_budget, o.route.budget)
        limit, parent = Allowance.from_budget(budget), self.client_account(o.tenant)
        if o.shared_quota is None:
            return self._own_open(o, limit, parent)
        max_streams, rate = o.shared_quota
        ask = QuotaAsk(o.tenant, o.stream_id, max_streams, rate.per_s, rate.burst)
        run, then = self.quotas.open_with_account(ask, o.account, limit, parent)
        return StoreStep(run, functools.partial(self._decide, o, then, limit, parent), self.quotas.store)

    def _decide(self, o: OpenCtx, then: Callable[[Any], QuotaGrant | None], limit: Allowance, parent: str,
                outcome: Any) -> Continue | Refuse:
        """The store step's ``outcome``: the grant's refusal, or the stream let
        through; the store could not decide: this router's limits, then the account's own open."""
        try:
            grant = then(outcome)
        except ATPError as e:
            return refusal(e)
        refused = _decided(grant, self, o)
        if refused is not None or grant is not None:
            return CONTINUE if refused is None else refused
        return self._own_open(o, limit, parent)

    def _own_open(self, o: OpenCtx, limit: Allowance, parent: str) -> Continue | Refuse:
        try:
            self.ledger.open(o.account, limit, parent=parent)  # no shared quota, or the store away
        except ATPError as e:
            return refusal(e)
        return CONTINUE

    def release(self, tenant: str, stream_id: str) -> None:
        """:class:`~atp_router.runtime.dataplane.opening.Holding`: the stream
        closed — its account is closed in the store in the group commit of its
        last events (:attr:`SharedQuotas.closer`; the router's own copy stays
        until the stream leaves memory)."""
        if self.quotas.closer is not None:
            self.quotas.closer(stream_account(tenant, stream_id))


class _Using:
    """:meth:`SharedTenantAdmission.using`: a stage type bound to its :class:`SharedQuotas`."""

    name = SharedTenantAdmission.name
    __doc__ = SharedTenantAdmission.__doc__

    def __init__(self, quotas: SharedQuotas, joined: bool) -> None:
        self.quotas = quotas
        self.joined = joined

    def of(self, parts: OpenParts) -> Stage:
        return SharedTenantAdmission(parts.admission, parts.client_spec, parts.streams, self.quotas,
                                     joined=self.joined)


class _Joined:
    """:class:`SharedBudgetOpen` bound to its :class:`SharedQuotas`."""

    name = SharedBudgetOpen.name
    __doc__ = SharedBudgetOpen.__doc__

    def __init__(self, quotas: SharedQuotas) -> None:
        self.quotas = quotas

    def of(self, parts: OpenParts) -> Stage:
        return SharedBudgetOpen(parts, self.quotas)


def with_shared_quotas(stages: Sequence[StageType], quotas: SharedQuotas) -> list[StageType]:
    """``stages`` with their ``tenant_admission`` deciding the tenant's quota and
    open rate in ``quotas`` (:class:`SharedTenantAdmission`); unchanged when
    they have none. With :attr:`SharedQuotas.opener` set and a ``budget_open``
    stage, the quota is decided there instead, with the stream's account in
    one store step (:class:`SharedBudgetOpen`: the atomic OPEN)."""
    if not any(s.name == SharedTenantAdmission.name for s in stages):
        return list(stages)
    joined = quotas.opener is not None and any(s.name == SharedBudgetOpen.name for s in stages)
    out = replace_stage(stages, SharedTenantAdmission.name, SharedTenantAdmission.using(quotas, joined=joined))
    return replace_stage(out, SharedBudgetOpen.name, _Joined(quotas)) if joined else out
