"""Several ``atp-router`` processes on one shared store (issue 12): ``--store redis://…``.

Each router is a whole router with its own state directory (lock, keys, the
audit MAC key unless ``ATP_AUDIT_KEY`` is given — give every router the same)
and its own listening sockets; a load balancer, or the client, picks one. What
makes them one router is the store they share (:class:`~atp_router.store.redis.RedisStore`):

================  ==========================================================
budgets           exact: a :class:`ClusterLedger` (a
                  :class:`~atp_router.flow.budget.SharedBudgetLedger`): every reserve,
                  extend, commit and release is one atomic step along the
                  account chain (stream → ``client:<tenant>``) in the store, so
                  ``committed + reserved <= limit`` holds across the routers
streams           stored with their **owner** router (``r.<host>.<pid>.<6
                  hex>``, one name per process start); events, idempotency
                  keys and finished streams are read from the store by any
                  router
audit             one hash chain, each record chained at the store's head
RIB               a reload on one router (the API, or its own ``--policies``
                  watch) gets a store-wide version and is in force on all
                  within :data:`~atp_router.deploy.workers.RIB_POLL_S`
                  (:class:`~atp_router.deploy.workers.SharedRib`); a router started
                  later adopts the active one
leases            each router renews its lease every ``lease_ms / 5``
                  (:meth:`Store.heartbeat <atp_router.store.base.Store.heartbeat>`,
                  with the URL of its HTTP API, ``--advertise-url``) from a
                  thread of its own: a router whose trio loop is busy (some
                  store calls are still made on it) keeps its lease; one whose
                  loop has not run for :attr:`LeaseClock.stall_s` stops
                  renewing it (it cannot serve: the others settle it)
quotas            a tenant's ``max_streams``, open rate and learning rate
                  across all routers (:mod:`atp_router.runtime.dataplane.quotas`):
                  one Lua script per SYN on Redis' clock; each open stream an
                  entry naming its router, removed at its close or when the
                  router is settled (expiring otherwise); the store away:
                  each router's own limits
learning,         :mod:`atp_router.runtime.controlplane.shared_state`: merged bandit and live
breakers          statistics, a breaker opened on one router opened on all
================  ==========================================================

**A router lost** (killed, its host gone, or cut from the store longer than its
lease): every second any router asks the store for owners with open
reservations, accounts or streams and no live lease
(:meth:`Store.lost_owners <atp_router.store.base.Store.lost_owners>`); one of them
takes the claim ``settle/<owner>`` and settles it (:func:`~atp_router.deploy.workers.settle`):
its open reservations are **released** — the issue's rule: the stream is
re-run elsewhere and that run is what is charged, nothing twice —, its stream
accounts closed, its open streams marked interrupted with an RST saying so
(:data:`ROUTER_LOST`; audited). A router that just regained the store waits one
lease before settling anyone (the others renew theirs within a fifth of it);
one that finds, after such a gap, that it was settled itself stops those
streams here (:meth:`ClusterNode.fence`). The settling router first increments
the lost one's **lease epoch** (its fencing token: :meth:`RedisStore.fence_owner
<atp_router.store.redis.RedisStore.fence_owner>`), so whatever the lost router still
sends is refused by the store; it adopts the new epoch only after its fence.

**Charged once**: every completed answer is stored in the same atomic step as
its commit (:meth:`ClusterLedger.attach`, the call journal of
:mod:`atp_router.runtime.dataplane.journal`), so a re-run (below) replays an answer a
lost router was already charged for instead of calling and charging again.

**Re-run** (spec §8 resumption across routers): a stream interrupted by
:data:`ROUTER_LOST` is run again when its tenant re-opens the same
``idempotency_key`` with its task (``POST /v1/streams`` with ``content``, the
OpenAI ingress, A2A ``message/send``, a WebSocket SYN with its task) on any
router: exactly one router wins the claim ``rerun/<tenant>/<key>/<old stream>``
and opens a fresh stream with that key (the newest record of the key is the one
it names from then on); a concurrent HTTP request that lost the claim waits for
that stream and is forwarded to it, a WebSocket SYN that lost is refused with
``EAGENTDOWN`` (resume again). A finished stream's key answers its stored
result on every router. (A single router on SQLite keeps its own rule: a stream
interrupted by its restart is reported, never re-run.)

**Any request on any router**: a request about a stream another live router
owns (``/v1/streams/{id}/events|frames|feedback``, an idempotent open, A2A
``tasks/*``) is forwarded to that router's advertised URL with the caller's own
``Authorization`` (:class:`ClusterForwardingApp`, the
:class:`~atp_router.deploy.workers.ForwardingApp` of ``--workers``); answers carry
``x-atp-router`` (who answered) and, forwarded, ``x-atp-served-by``. While the
owner of an open stream is lost and not yet settled, a request about it answers
503 ``EAGENTDOWN`` with ``Retry-After: 1``.

**Off the loop** (issue 22 item 2): the group commit of stream events — with the
stream's record (in its SYN+ACK's), the commits and releases of calls
(:meth:`ClusterLedger.run_committer` hands them to the next group commit: one
pipeline with a call's last events), audit records, and at a stream's end its
quota entry's removal and its budget account's close (:meth:`ClusterLedger.close_early`)
— and the store's polls (lost routers, RIB, breakers, learning, expiry) run in
store threads (:mod:`atp_router.store.threads`); while the store is down the loop's
own calls fail at once and only those threads probe it (:meth:`RedisStore.probe_off
<atp_router.store.redis.RedisStore.probe_off>`). **Budget leases**
(:mod:`atp_router.flow.lease`): a router takes a slice of a tenant's remaining
budget (a reservation of its own on ``client:<tenant>``, taken and refilled by
:meth:`ClusterLedger.run_leases` off the loop, returned when idle, released with
its other reservations when it is settled) and reserves its calls inside it
without a round trip; a call whose usage the slice covers has its charge known
at once, so its commit goes in the group commit of its FINAL, before it. Still
on the loop, one round trip each: a SYN's **atomic OPEN** (its quota entry and
stream account in one script, :meth:`ClusterLedger.open_admitted`), a call's
reservation when no slice covers it (near the tenant's limit slices are not
used: exact as before), a learning slice — the sans-IO admission and SYN
stages call them synchronously.

**Fail closed**: when the store cannot be reached
(:class:`~atp_router.store.base.StoreUnavailable`) no new spend is allowed — a stream
open is refused (``EBUDGET`` "budget store unavailable: … retry", with
``retry_after_ms``; HTTP 503 + ``Retry-After``), a call's reservation or its
extension is refused (the call is not made, ``EBUDGET``); a commit or release
that fails is kept and retried every :data:`SETTLE_RETRY_S` until the store
answers (the reservation holds its headroom meanwhile, so nothing overspends);
a stream's events wait for the store (a client never gets an event the store
has not: another router may serve the stream from there). ``atp_store_up`` (0/1)
and ``atp_store_unavailable_total{op}`` say so, ``GET /v1/ready`` answers 503 (its
``store`` check, :meth:`ClusterNode._store_check`) while the lease renewal fails or
commits wait, and the audit records written meanwhile are spooled and chained in
order when the store answers (:class:`~atp_router.security.audit.AuditSpool`);
everything resumes when the store answers again, without a restart.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from atp_router.deploy import single
from atp_router.deploy.single import Deployed
from atp_router.deploy.workers import RETRY, ForwardingApp, Peer, SharedRib, settle
from atp_router.flow.budget import (
    AccountState,
    Allowance,
    CallRecord,
    Charge,
    PendingCharge,
    Refusal,
    Reservation,
    SharedAccounts,
    SharedBudgetLedger,
    SharedResult,
    StoredCall,
    _Account,
    _check_amounts,
    refusal,
)
from atp_router.flow.lease import BudgetLease, lease_aim
from atp_router.flow.quota import QuotaAsk, QuotaGrant
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.controlplane import shared_state
from atp_router.runtime.dataplane.journal import CallJournal
from atp_router.runtime.dataplane.opening import DEFAULT_STAGES
from atp_router.runtime.dataplane.persistence import stored_task_digest
from atp_router.runtime.dataplane.quotas import SharedQuotas, with_shared_quotas
from atp_router.runtime.dataplane.stream import task_digest
from atp_router.runtime.deployment import StateParts, SynGate
from atp_router.runtime.router import Router
from atp_router.security.audit import AuditLog
from atp_router.security.authz import Refuse
from atp_router.security.identity import Identity
from atp_router.store import NotFound, StoreError, StoreUnavailable, StreamRecord
from atp_router.store.threads import off_loop
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import ATPError, ErrorCode, IdempotencyConflict
from atp_router.wire.frame import Frame, PayloadType

__all__ = [
    "ROUTER_LOST",
    "ClusterForwardingApp",
    "ClusterLedger",
    "ClusterNode",
    "LeaseClock",
    "deploy",
    "open_store",
    "owner_name",
    "settled_reason",
    "store_unavailable_reason",
]

if TYPE_CHECKING:
    from atp_router.store.redis import RedisStore

log = logging.getLogger("atp_router.deploy.cluster")

#: The RST reason (and stored close reason) of a stream whose router was lost
#: (spec §8): the mark of a stream that is re-run when its key is re-opened.
ROUTER_LOST = ("interrupted: the router running the stream was lost (stopped, or cut from the shared store); "
               "re-open it with the same idempotency_key and its task to run it again on another router")
#: How often any router looks for lost routers to settle, s.
REAP_S = 1.0
#: How often commits and releases the store could not take are tried again, s.
SETTLE_RETRY_S = 0.5
#: ``retry_after_ms`` of a spend refused because the store cannot be reached.
RETRY_AFTER_MS = 1000
#: The environment variable of the kill-after-commit fault hook (:class:`ClusterLedger`).
KILL_AFTER_COMMIT_ENV = "ATP_FAULT_KILL_AFTER_COMMIT"
#: How long an HTTP re-open that lost the re-run claim waits for the winner's stream, s (at most a lease).
_RERUN_WAIT_S = 5.0

_STORE_SCHEMES = ("redis", "rediss", "unix")
try:
    _VERSION = package_version("atp-router")
except PackageNotFoundError:  # run from a checkout that is not installed
    _VERSION = "0"


def owner_name() -> str:
    """This process's owner name in the store: ``r.<hostname>.<pid>.<6 hex>``
    (new at every start: a restarted router never takes over its former self's
    leases, reservations or streams — they are settled as lost)."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"r.{host}.{os.getpid()}.{secrets.token_hex(3)}"


def is_cluster_store(url: str) -> bool:
    """Whether ``--store`` names a shared store (a ``redis://``, ``rediss://``
    or ``unix://`` URL) rather than the embedded ``sqlite``."""
    return url.split("://", 1)[0].lower() in _STORE_SCHEMES and "://" in url


def open_store(url: str, *, namespace: str) -> RedisStore:
    """The shared store at ``url`` (``redis://[:password@]host:port/db``,
    ``rediss://…``, ``unix:///path?db=N``), its keys under ``namespace``.
    Raises :class:`~atp_router.store.base.StoreError` (``StoreUnavailable`` when it
    cannot be reached) or ``ValueError`` for a URL of no known store."""
    if not is_cluster_store(url):
        raise ValueError(f"--store {url!r}: give sqlite or a redis://, rediss:// or unix:// URL")
    from atp_router.store.redis import RedisStore  # only a cluster router imports redis

    return RedisStore.open(url, namespace=namespace)


def store_unavailable_reason(e: BaseException) -> str:
    """The one wording of a spend refused while the store cannot be reached."""
    return f"budget store unavailable: {e}; retry"


def settled_reason(key: str) -> str:
    """The wording of a spend refused because the store no longer has its
    budget account or reservation ``key``: another router settled this one."""
    return (f"budget {key!r} was settled by another router (this router could not renew its lease in time); "
            "re-open the stream with the same idempotency_key to run it again")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_lost(rec: StreamRecord | None) -> bool:
    """``rec`` was interrupted because its router was lost: re-run on re-open."""
    return rec is not None and rec.state == "interrupted" and rec.close_reason == ROUTER_LOST


def _rerun_claim(rec: StreamRecord) -> str:
    """The claim whose holder re-runs ``rec`` (one per interrupted record)."""
    return f"rerun/{rec.tenant}/{rec.idempotency_key}/{rec.stream_id}.{rec.created_ms}"


def _open_claim(tenant: str, key: str) -> str:
    """The claim whose holder opens the first stream of ``tenant``'s idempotency
    ``key``: two routers given a new key at once (a client that timed out on one
    and re-opened on the next) would otherwise both run it, and charge it twice."""
    return "open/" + msgspec.json.encode([tenant, key]).decode()


def _has_task(frame: Frame) -> bool:
    return frame.payload is not None and frame.payload.type is PayloadType.TASK


# ----------------------------------------------------------------------- ledger
class ClusterLedger(SharedBudgetLedger):
    """The :class:`~atp_router.flow.budget.SharedBudgetLedger` of a cluster router:
    the same decisions, fail closed when the store cannot be reached
    (:class:`~atp_router.store.base.StoreUnavailable`; module docstring):

    * :meth:`reserve` / :meth:`extend` return an ``EBUDGET``
      :class:`~atp_router.flow.budget.Refusal` "budget store unavailable: … retry"
      (the call is not made); a reserve whose answer was lost (a timeout) is
      cancelled in the store by :meth:`settle_pending` once it answers, so a
      reservation Redis made late is released, never held for good;
    * :meth:`open` raises :class:`~atp_router.wire.errors.ATPError` ``EBUDGET`` with
      ``retry_after_ms`` (the SYN is refused); :meth:`set_limit` returns a
      refusal; :meth:`close` raises ``ValueError`` (the stream table tries again);
    * :meth:`commit` / :meth:`release` keep the settlement and return at once:
      :meth:`settle_pending` (a background task of the router) applies it
      once the store answers; until then the reservation holds its headroom
      in the store and the stream's account stays open here. :meth:`commit`
      then returns the usage within the reservation and a
      :class:`~atp_router.flow.budget.PendingCharge` (:meth:`pending_charge`)
      that the runtime waits for before the call's FINAL: the queued commit
      applies the full usage when the store answers (the store checking the
      headroom then, as for any commit), and the FINAL's signed usage reports
      what it charged — the ledger always equals the FINALs. While
      :meth:`run_committer` runs (a router's background service) every
      commit and release takes that path, applied off the trio loop.

    A reservation or account the store no longer has (:class:`~atp_router.store.base.NotFound`:
    another router settled this one after its lease lapsed, or a retried
    commit had been applied) is forgotten here with a warning; a spend on it
    (:meth:`reserve`, :meth:`extend`, :meth:`set_limit`; :meth:`open` under a
    parent the store no longer has) is refused with ``EBUDGET``
    (:func:`settled_reason`) and ``on_settled(key)`` is told, so the router
    stops the streams it no longer owns (:meth:`ClusterNode.fence`).
    ``on_unavailable(op, error)`` is told of every operation that found the
    store unreachable (metrics)."""

    def __init__(self, shared: RecordingAccounts, *, owner: str,
                 on_unavailable: Callable[[str, StoreError], None] | None = None,
                 on_settled: Callable[[str], None] | None = None) -> None:
        super().__init__(shared, owner=owner)
        self.on_unavailable = on_unavailable
        self.on_settled = on_settled
        #: Settlements the store has not taken yet, in order: those it could not take, and
        #: while :meth:`run_committer` runs every commit and release (applied off the loop).
        self._unsettled: list[_Settle] = []
        #: Set to wake :meth:`run_committer`; None while it does not run (settled at once).
        self._wake: trio.Event | None = None
        #: How many of the first settlements the committer is applying in a store thread.
        self._inflight = 0
        #: Commits accepted but not applied yet, by local reservation id (pending_charge).
        self._pending: dict[int, PendingCharge] = {}
        self.shared: RecordingAccounts = shared
        #: Call records to store with their reservation's commit (local reservation id -> record).
        self._records: dict[int, CallRecord] = {}
        #: Fault injection for the chaos tests (tests/scale/): ``ATP_FAULT_KILL_AFTER_COMMIT=1``
        #: kills this process (SIGKILL) right after a call's commit reached the store,
        #: before its FINAL is stored — the point where a charge could be made twice.
        self._kill_after_commit = os.environ.get(KILL_AFTER_COMMIT_ENV) == "1"
        #: Reserve calls whose answer was lost, to cancel (SharedAccounts.cancel_reserve_shared).
        self._cancels: list[str] = []
        #: When set, :meth:`run_committer` applies its settlements in the stream table's next
        #: group commit (:meth:`StreamPersistence.defer
        #: <atp_router.runtime.dataplane.persistence.StreamPersistence.defer>`): one round trip
        #: with the events queued beside them, not one of its own (issue 22 item 2).
        self.defer: Callable[..., bool] | None = None
        #: Store keys of the accounts whose close waits in the group commit (:meth:`close`).
        self._closing: set[str] = set()
        #: Accounts closed in the store at their stream's close, kept here until :meth:`close`.
        self._closed_early: set[str] = set()
        #: Budget leases (atp_router.flow.lease), by the local key of the account they slice.
        self._leases: dict[str, BudgetLease] = {}
        #: Slices whose return was unanswered while a new slice of the same account was taken.
        self._returning: list[tuple[str, BudgetLease]] = []
        #: Calls reserved inside a lease (local ids, negative) -> their lease.
        self._carved: dict[int, BudgetLease] = {}
        #: What calls reserved inside leases hold on each stream account, (tokens, USD micros).
        self._carved_on: dict[str, list[int]] = {}
        #: Lease commits sent in a group commit and not yet over, by lease (no return before).
        self._lease_inflight: dict[int, int] = {}
        self._next_carve = 0
        #: Set to wake :meth:`run_leases` (a take or a return is due).
        self._lease_wake = trio.Event()
        #: How many routers share the store (a slice's size divides by it): set by the node.
        self.routers: Callable[[], int] = lambda: 1

    def attach(self, reservation: Reservation, record: CallRecord) -> None:
        """Store ``record`` (the answer ``reservation``'s call gave) in the same
        atomic step as that reservation's commit, or not at all (a release):
        a stream re-run by its key finds the answer iff it was charged
        (:class:`~atp_router.runtime.dataplane.memo.CallJournal`)."""
        self._records[reservation.id] = record

    @property
    def unsettled(self) -> int:
        """Commits, releases and reserve cancels waiting for the store: those it
        could not take, and those queued behind them (not those the committer
        is about to apply: :meth:`run_committer`)."""
        queued = self._unsettled
        waiting = len(queued) if queued and (self._wake is None or queued[0].tried) else 0
        return waiting + len(self._cancels)

    def _down(self, op: str, e: StoreError) -> None:
        if self.on_unavailable is not None:
            self.on_unavailable(op, e)

    def _settled(self, op: str, key: str, e: NotFound) -> Refusal:
        log.warning("budget %s on %r: the store no longer has it (%s): settled by another router; refused",
                    op, key, e)
        if self.on_settled is not None:
            self.on_settled(key)
        return Refusal(key=key, reason=settled_reason(key), remaining=Allowance(tokens=0, usd_micros=0))

    def open(self, key: str, limit: Allowance, *, parent: str | None = None) -> None:
        try:
            self._closed_first(key, parent)
            super().open(key, limit, parent=parent)
        except StoreUnavailable as e:
            self._down("open", e)
            raise ATPError(ErrorCode.EBUDGET, store_unavailable_reason(e), retry_after_ms=RETRY_AFTER_MS) from None
        except NotFound as e:
            raise ATPError(ErrorCode.EBUDGET, self._settled("open", parent or key, e).reason,
                           retry_after_ms=RETRY_AFTER_MS) from None

    def open_admitted(self, ask: QuotaAsk, key: str, limit: Allowance, parent: str,
                      ttl_ms: int) -> tuple[Callable[[], Any], Callable[[Any], QuotaGrant]]:
        """The atomic OPEN of a stream (issue 22 item 2) as a store step: :meth:`open`
        of its account ``key`` under ``parent`` with ``ask``'s entry in its
        tenant's shared quota (held ``ttl_ms``) taken in the same store step
        (:meth:`RedisStore.open_stream_shared
        <atp_router.store.redis.RedisStore.open_stream_shared>`, carrying the
        lease epoch and a deadline): both or neither. Returns ``(run, then)``
        (a :class:`~atp_router.runtime.dataplane.opening.StoreStep`'s parts):
        ``run()`` makes the store call and touches nothing else here (a worker
        thread may run it); ``then(outcome)``, on the router's thread, opens the
        account here too and returns the grant, or raises what ``run`` raised:
        :class:`~atp_router.store.base.StoreUnavailable` (nothing opened:
        :class:`~atp_router.runtime.dataplane.quotas.SharedQuotas` falls back and
        reports it) or :class:`~atp_router.wire.errors.ATPError` ``EBUDGET``
        (``parent`` settled by another router). Raises ValueError (``key`` open)."""
        skey, pkey = self.open_keys(key, parent)
        reopened = self._reopening(skey)

        def run() -> tuple[QuotaGrant, SharedResult | None]:
            if reopened:
                self.shared.close_shared_if_open(skey)
            return self.shared.open_stream_shared(skey, pkey or "", limit, owner=self.owner, ask=ask, ttl_ms=ttl_ms)

        def then(outcome: Any) -> QuotaGrant:
            if isinstance(outcome, NotFound):
                raise ATPError(ErrorCode.EBUDGET, self._settled("open", parent, outcome).reason,
                               retry_after_ms=RETRY_AFTER_MS) from None
            if isinstance(outcome, BaseException):
                raise outcome
            grant, out = outcome
            if out is not None:
                self.opened(key, parent, limit, out)
            return cast(QuotaGrant, grant)

        return run, then

    def close(self, key: str) -> AccountState:
        """:meth:`~atp_router.flow.budget.SharedBudgetLedger.close`; a stream's
        account (a child, nothing open under it) is closed in the store by the
        next group commit (:attr:`defer`: off the trio loop, with the events of
        other streams; tried again with them while the store cannot be reached)."""
        acct = self._get(key)
        if key in self._closed_early and not acct.open and not acct.children:
            self._closed_early.discard(key)
            return self._forget_account(key)  # closed in the store at its stream's close
        if self.defer is not None and acct.parent is not None and not acct.open and not acct.children:
            skey = self._skeys[key]
            self._closing.add(skey)
            if self.defer(functools.partial(self._close_later, skey),
                          over=functools.partial(self._closing.discard, skey)):
                return self._forget_account(key)
            self._closing.discard(skey)
        try:
            return super().close(key)
        except StoreUnavailable as e:
            self._down("close", e)
            raise ValueError(f"budget account {key!r}: the store cannot be reached") from None
        except NotFound:
            return self._forget_account(key)  # closed by the router that settled this one: forgotten here too

    def close_early(self, key: str) -> None:
        """Stream account ``key`` will take no more spend (its stream closed, its
        calls settled): closed in the store by the next group commit — the one
        of the stream's last events — while this ledger keeps its copy until
        :meth:`close` (the stream leaves memory; no store call then). Nothing
        when a reservation is still open on it (:meth:`close` closes it)."""
        acct = self._accounts.get(key)
        if self.defer is None or acct is None or acct.parent is None or acct.open or acct.children:
            return
        skey = self._skeys[key]
        self._closing.add(skey)
        if self.defer(functools.partial(self._close_later, skey), over=functools.partial(self._closing.discard, skey)):
            self._closed_early.add(key)
        else:
            self._closing.discard(skey)

    # ------------------------------------------------------------ budget leases
    def _lease_of(self, acct: _Account) -> BudgetLease | None:
        return None if acct.parent is None else self._leases.get(acct.parent.key)

    def _local_hold(self, acct: _Account, tokens: int, usd_micros: int) -> None:
        """A call inside a lease holds (or gives back) ``tokens`` / ``usd_micros``
        on ``acct``'s chain as this router sees it (the store holds it in the lease)."""
        for a in acct.chain:
            a.reserved_tokens += tokens
            a.reserved_usd += usd_micros
        on = self._carved_on.setdefault(acct.key, [0, 0])
        on[0] += tokens
        on[1] += usd_micros
        if on == [0, 0]:
            del self._carved_on[acct.key]

    def _reserve_in_lease(self, key: str, tokens: int, usd_micros: int) -> Reservation | None:
        """A call's reservation inside its tenant's lease (no store round trip),
        or None: reserve in the store (and a lease is asked for when worth it)."""
        acct = self._get(key)
        lease = self._lease_of(acct)
        fits = tokens <= acct.free_tokens() and usd_micros <= acct.free_usd()  # the stream's own account
        if lease is None or not fits or not lease.covers(tokens, usd_micros):
            self._want_lease(acct, tokens, usd_micros)
            return None
        lease.carve(tokens, usd_micros, time.monotonic())
        self._next_carve -= 1
        r = Reservation(id=self._next_carve, key=key, tokens=tokens, usd_micros=usd_micros)
        self._local_hold(acct, tokens, usd_micros)
        acct.open += 1
        self._open[r.id] = r
        self._carved[r.id] = lease
        if lease.want() is not None:
            self._lease_wake.set()
        return r

    def _want_lease(self, acct: _Account, tokens: int, usd_micros: int) -> None:
        """Size (or retire) the lease of ``acct``'s parent from what is free
        along its chain, as last seen, and wake :meth:`run_leases` when a step is due."""
        if acct.parent is None or self._wake is None:
            return  # a root's own spend, or no committer running (no group commit to settle in)
        up = acct.parent
        lease = self._leases.get(up.key)
        aim = lease_aim(up.chain_free(), self.routers(), (tokens, usd_micros))
        if lease is None:
            if aim is None:
                return
            limited = (any(a.limit_tokens is not None for a in up.chain),
                       any(a.limit_usd is not None for a in up.chain))
            lease = self._leases[up.key] = BudgetLease(up.key, limited, used_at=time.monotonic())
        lease.aim = aim if aim is not None else (0, 0)
        lease.call = (tokens, usd_micros)
        if aim is None or lease.want() is not None:
            self._lease_wake.set()

    def _give_back(self, key: str) -> bool:
        """Give the unused part of the lease over ``key``'s parent back to the
        tenant now (a store reserve was refused while it held some: the tenant
        is near its limit) and retire the lease. True when something went back.
        Raises :class:`~atp_router.store.base.StoreError`."""
        acct = self._get(key)
        lease = self._lease_of(acct)
        if (lease is None or lease.id is None or lease.busy or lease.take is not None or lease.returning
                or lease.free == (0, 0)):
            return False
        ft, fu = lease.free
        lease.aim = (0, 0)
        request = self.new_request()
        lease.ask(request, -ft, -fu)  # its answer lost: run_leases sends it again by name
        try:
            _, t, u, out = self.shared.lease_take(self._skeys[lease.parent], lease.id, -ft, -fu,
                                                  owner=self.owner, request=request)
        except StoreError as e:
            if not isinstance(e, StoreUnavailable):
                lease.take = None
            raise
        lease.answered(lease.id, t, u)
        self._mirror(out)
        return t < 0 or u < 0

    def _extend_in_lease(self, reservation: Reservation, tokens: int, usd_micros: int) -> Reservation | Refusal:
        _check_amounts(tokens, usd_micros)
        if self._open.get(reservation.id) != reservation:
            raise ValueError(f"reservation {reservation.id} on {reservation.key!r} is not open")
        lease, acct = self._carved[reservation.id], self._get(reservation.key)
        if not (tokens <= acct.free_tokens() and usd_micros <= acct.free_usd() and lease.covers(tokens, usd_micros)):
            ft, fu = lease.free
            left = Allowance(tokens=max(0, min(ft, int(min(acct.free_tokens(), ft)))) if lease.limited[0] else None,
                             usd_micros=max(0, fu) if lease.limited[1] else None)
            return refusal(reservation.key, f"extend by {tokens} tokens / {usd_micros} usd_micros on "
                           f"{reservation.key!r}", left)
        lease.carve(tokens, usd_micros, time.monotonic())
        self._local_hold(acct, tokens, usd_micros)
        grown = Reservation(id=reservation.id, key=reservation.key, tokens=reservation.tokens + tokens,
                            usd_micros=reservation.usd_micros + usd_micros)
        self._open[grown.id] = grown
        if lease.want() is not None:
            self._lease_wake.set()
        return grown

    def _commit_in_lease(self, reservation: Reservation, usage: tuple[int, int]) -> Charge:
        """The commit of a call reserved inside a lease. When the lease covers its
        usage the charge is known here (``min(usage, the stream's room)``, the
        store's rule): returned at once, the commit sent in the next group commit
        before the call's FINAL (one round trip with the stream's last events).
        Otherwise the lease's free part is held for it and the store decides,
        like any commit (:meth:`pending_charge`)."""
        lease = self._carved.pop(reservation.id)
        record = self._records.pop(reservation.id, None)
        acct = self._forget(reservation)
        held = (reservation.tokens, reservation.usd_micros)
        room = (None if acct.limit_tokens is None else int(acct.free_tokens()) + held[0],
                None if acct.limit_usd is None else int(acct.free_usd()) + held[1])
        cap = lease.cap(held)
        stored = Reservation(id=lease.id or 0, key=self._skeys[reservation.key], tokens=cap[0], usd_micros=cap[1])
        request = self.new_request()
        if self._kill_after_commit or not lease.certain(held, usage):
            # The store decides, like any commit, on the call's reservation and all that the slice
            # has free (cap: held for it until answered, so near the limit no slice keeps budget a
            # call's usage could have been charged); the FINAL waits for it. (The fault hook kills
            # right after a commit, before the FINAL exists.)
            lease.hold_for(held, cap)
            pending = (reservation.id, PendingCharge())
            self._pending[reservation.id] = pending[1]
            self._queue(_Settle(stored, usage, acct, request, record, pending,
                                lease=_LeaseCall(lease, held, room, cap)))
            return _certain(reservation, usage)
        ct = usage[0] if room[0] is None else max(0, min(usage[0], room[0]))
        cu = usage[1] if room[1] is None else max(0, min(usage[1], room[1]))
        charge = Charge(ct, cu, usage[0] - ct, usage[1] - cu)
        lease.settle(held, cap, (ct, cu))
        self._local_hold(acct, -held[0], -held[1])
        for a in acct.chain:
            a.committed_tokens += ct
            a.committed_usd += cu
            a.overage_tokens += charge.overage_tokens
            a.overage_usd += charge.overage_usd_micros
        acct.open -= 1
        self._send_lease_commit(lease, stored, room, usage, request, record, acct)
        if lease.want() is not None or self._near_limit(lease, acct):
            self._lease_wake.set()
        return charge

    def _near_limit(self, lease: BudgetLease, acct: _Account) -> bool:
        """After a call in ``lease`` gave back part of what it held (a release,
        a commit below it): when the tenant (``acct``'s parent) is near its
        limit, the slice is retired (:meth:`BudgetLease.resize`) and the lease
        service woken to give that part back at once — near the limit other
        routers' calls need it, and a slice's free part is not theirs."""
        up = acct.parent
        if up is None or not (lease.retired or lease.resize(up.chain_free(), self.routers())):
            return False
        self._lease_wake.set()
        return True

    def _send_lease_commit(self, lease: BudgetLease, stored: Reservation, room: tuple[int | None, int | None],
                           usage: tuple[int, int], request: str, record: CallRecord | None, acct: _Account) -> None:
        """A certain lease commit into the next group commit, before its events
        (a retry of the group commit sends it again as a re-commit by name);
        without a group commit, queued like any settlement (no pending charge)."""
        sent = [False]
        lid = stored.id

        def write() -> None:
            again, sent[0] = sent[0], True
            self.shared.lease_settle(stored, room, *usage, request=request, recommit=again, record=record)

        def over() -> None:
            self._lease_inflight[lid] -= 1
            if not self._lease_inflight[lid]:
                del self._lease_inflight[lid]

        self._lease_inflight[lid] = self._lease_inflight.get(lid, 0) + 1
        if self.defer is not None and self.defer(write, over=over, first=True):
            return
        over()
        acct.open += 1  # the queued settlement accounts for it (_applied)
        self._queue(_Settle(stored, usage, acct, request, record, None, lease=_LeaseCall(lease, held=None, room=room)))

    async def run_leases(self) -> None:
        """Take, refill and return budget leases off the trio loop (a store
        thread), until cancelled — a background service of the router: a
        lease is taken or grown when it has less than half its aim free
        (:class:`~atp_router.flow.lease.BudgetLease`), returned when idle
        (:data:`~atp_router.flow.lease.LEASE_IDLE_S`) or when slices no longer
        pay (the tenant near its limit). Cancelled, the router's stop settles
        what it holds (its reservations are released)."""
        while True:
            with trio.move_on_after(0.5):
                await self._lease_wake.wait()
            self._lease_wake = trio.Event()
            now = time.monotonic()
            returning, self._returning = self._returning, []
            for key, lease in returning:
                await self._return_lease(key, lease)
            for key, lease in list(self._leases.items()):
                up = self._accounts.get(key)
                if up is not None:  # the tenant near its limit as last seen: retired between calls too
                    lease.resize(up.chain_free(), self.routers())
                want = lease.want()
                if lease.take is not None:
                    await self._grow_lease(key, lease, lease.take[1:])  # its answer was lost: again, by name
                elif key not in self._accounts:
                    self._leases.pop(key, None)
                elif lease.retired or lease.returning or lease.idle(now):
                    await self._return_lease(key, lease)
                    if (key in self._leases and lease.retired and not lease.returning and lease.free != (0, 0)
                            and lease.id is not None):
                        await self._grow_lease(key, lease, (-lease.free[0], -lease.free[1]))  # give back what is unused
                elif want is not None and (lease.id is None or want != (0, 0)):
                    await self._grow_lease(key, lease, want)

    async def _grow_lease(self, key: str, lease: BudgetLease, want: tuple[int, ...]) -> None:
        """Take, grow or shrink ``lease`` by ``want`` (tokens, USD micros) in one
        named store step (:meth:`RedisStore.lease_take
        <atp_router.store.redis.RedisStore.lease_take>`). Its answer lost (the
        store unavailable: it may have run, or run late), the step is kept in
        ``lease.take`` and sent again under the same name by the next round —
        applied once, its grant learnt — before anything else is done with the
        slice; no call reserves in it meanwhile."""
        if lease.take is None:
            lease.ask(self.new_request(), want[0], want[1])
            assert lease.take is not None
        request, wt, wu = lease.take
        lease.busy = True
        try:
            lid, t, u, out = await off_loop(self.shared, functools.partial(
                self.shared.lease_take, self._skeys[key], lease.id, wt, wu, owner=self.owner, request=request))
        except StoreError as e:
            if isinstance(e, StoreUnavailable):
                self._down("lease", e)
            else:
                lease.take = None
                log.warning("budget lease on %s: not taken (%s); calls reserve in the store", key, e)
                self._leases.pop(key, None)
            return
        finally:
            lease.busy = False
        lease.answered(lid, t, u)
        self._mirror(out)

    async def _return_lease(self, key: str, lease: BudgetLease) -> None:
        if lease.alloc_t or lease.alloc_u or lease.id is None or self._lease_inflight.get(lease.id):
            if lease.id is None:
                self._leases.pop(key, None)
            return  # calls still hold part of it, or their commits are on their way
        if self._leases.get(key) is lease:
            del self._leases[key]
        back = Reservation(id=lease.id, key=self._skeys[key], tokens=lease.hold_t, usd_micros=lease.hold_u)
        try:
            self._mirror(await off_loop(self.shared, self.shared.release_shared, back))
        except StoreUnavailable as e:
            self._down("lease", e)
            # Returned on the next try (or by the settling of this router); it may have been
            # released already (the answer lost): no call reserves in it from now on. A new
            # slice of the same account taken meanwhile stays the one calls use; this one is
            # returned beside it.
            lease.returning = True
            if self._leases.setdefault(key, lease) is not lease:
                self._returning.append((key, lease))
        except NotFound:
            pass  # released by a first try whose answer was lost, or settled by another router meanwhile

    def _mirror(self, out: SharedResult) -> None:
        """:meth:`SharedBudgetLedger._mirror`, as this router sees it: what its
        own leases hold but no call of it uses is free here, and what its
        calls hold inside them is held on their stream accounts."""
        super()._mirror(out)
        for t in out.totals:
            key = self._lkeys.get(t.key, "")
            a = self._accounts.get(key)
            if a is None:
                continue
            on = self._carved_on.get(key)
            if on is not None:
                a.reserved_tokens += on[0]
                a.reserved_usd += on[1]
            for lease in self._leases.values():
                up = self._accounts.get(lease.parent)
                if up is not None and any(x is a for x in up.chain):
                    ft, fu = lease.free
                    a.reserved_tokens -= ft
                    a.reserved_usd -= fu

    def _lease_answered(self, st: _Settle, charge: Charge | None) -> None:
        """A queued commit of a call reserved inside a lease answered (after its
        chain was mirrored): its reservation leaves the lease, the part of the
        charge it covered leaves the lease's hold (what it held there: its
        reservation and the slice's free part held for it, ``cap``)."""
        lc = st.lease
        if lc is None or lc.held is None:
            return
        r, c = lc.held, lc.cap
        got = (0, 0) if charge is None else (charge.tokens, charge.usd_micros)
        lc.lease.settle(c, c, got)
        self._local_hold(st.acct, -r[0], -r[1])
        # Seen on the ancestors: the slice's free part changed by c - min(got, c), the call's r left.
        lim = lc.lease.limited
        kept = (min(got[0], c[0]) - c[0] + r[0] if lim[0] else 0, min(got[1], c[1]) - c[1] + r[1] if lim[1] else 0)
        for a in st.acct.chain[1:]:
            a.reserved_tokens += kept[0]
            a.reserved_usd += kept[1]
        self._near_limit(lc.lease, st.acct)

    def _forget_account(self, key: str) -> AccountState:
        state = self.state(key)
        acct = self._get(key)
        if acct.parent is not None:
            acct.parent.children -= 1
        del self._accounts[key]
        del self._lkeys[self._skeys.pop(key)]
        return state

    def _close_later(self, skey: str) -> None:
        """A deferred close (a store thread, in a group commit): skipped when a
        re-open of the same key closed it at once meanwhile (:meth:`_closed_first`)."""
        if skey in self._closing:
            self.shared.close_shared_if_open(skey)

    def _closed_first(self, key: str, parent: str | None) -> None:
        """Before account ``key`` is opened again: its close still waiting in the
        group commit is made now (a stream id reused at once)."""
        skey = self._new_store_key(key, parent)
        if self._reopening(skey):
            self.shared.close_shared_if_open(skey)

    def _reopening(self, skey: str) -> bool:
        """Whether store account ``skey``, about to be opened again, still has its
        close waiting in the group commit — taken from it: the opener makes it first."""
        if skey not in self._closing:
            return False
        self._closing.discard(skey)
        return True

    def reserve(self, key: str, tokens: int, usd_micros: int) -> Reservation | Refusal:
        carved = self._reserve_in_lease(key, tokens, usd_micros)
        if carved is not None:
            return carved
        request = self.new_request()
        try:
            got = self.reserve_as(key, tokens, usd_micros, request=request)
            if isinstance(got, Refusal) and self._give_back(key):
                # Near the limit: this router's unused slice went back to the tenant; once more.
                got = self.reserve_as(key, tokens, usd_micros, request=self.new_request())
            return got
        except StoreUnavailable as e:
            self._down("reserve", e)
            # A timeout: the reserve may have been applied, or may be later (from the
            # closed connection's buffer). Cancelled once the store answers, so the
            # refused call never holds the tenant's headroom.
            self._cancels.append(request)
            return Refusal(key=key, reason=store_unavailable_reason(e), remaining=Allowance(tokens=0, usd_micros=0),
                           retry_after_ms=RETRY_AFTER_MS)
        except NotFound as e:
            return self._settled("reserve", key, e)

    def extend(self, reservation: Reservation, tokens: int, usd_micros: int) -> Reservation | Refusal:
        if reservation.id in self._carved:
            return self._extend_in_lease(reservation, tokens, usd_micros)
        try:
            return super().extend(reservation, tokens, usd_micros)
        except StoreUnavailable as e:
            self._down("extend", e)
            return Refusal(key=reservation.key, reason=store_unavailable_reason(e),
                           remaining=Allowance(tokens=0, usd_micros=0))
        except NotFound as e:
            # The reservation stays open here: its commit or release finds it gone and forgets it.
            return self._settled("extend", reservation.key, e)

    def set_limit(self, key: str, limit: Allowance, *, clamp: bool = False) -> Refusal | None:
        try:
            return super().set_limit(key, limit, clamp=clamp)
        except StoreUnavailable as e:
            self._down("set_limit", e)
            return Refusal(key=key, reason=store_unavailable_reason(e), remaining=Allowance(tokens=0, usd_micros=0))
        except NotFound as e:
            return self._settled("set_limit", key, e)

    def commit(self, reservation: Reservation, actual_tokens: int, actual_usd_micros: int) -> Charge:
        if actual_tokens < 0 or actual_usd_micros < 0:
            return super().commit(reservation, actual_tokens, actual_usd_micros)  # its ValueError
        if reservation.id in self._carved:
            return self._commit_in_lease(reservation, (actual_tokens, actual_usd_micros))
        record = self._records.pop(reservation.id, None)
        acct = self._forget(reservation)
        stored = self._stored(reservation)
        usage = (actual_tokens, actual_usd_micros)
        certain = _certain(reservation, usage)
        pending = (reservation.id, PendingCharge())
        if self._unsettled or self._wake is not None:
            # Settled in order (an earlier settlement still waits for the store), or by the
            # committer in a store thread: the call's FINAL waits for its pending charge.
            self._queue(_Settle(stored, usage, acct, self.new_request(), record, pending))
            self._pending[reservation.id] = pending[1]
            return certain
        charge = self._settle_stored(stored, usage, acct, record=record, pending=pending)
        if charge is None:
            self._pending[reservation.id] = pending[1]
            return certain
        return charge

    def pending_charge(self, reservation_id: int) -> PendingCharge | None:
        """The commit of local reservation ``reservation_id`` while it waits for
        the store (:meth:`commit` returned only the usage within the
        reservation): resolved with the charge the store applied, which the
        call's FINAL reports (the runtime waits for it)."""
        return self._pending.get(reservation_id)

    def release(self, reservation: Reservation) -> None:
        self._records.pop(reservation.id, None)
        acct = self._forget(reservation)
        lease = self._carved.pop(reservation.id, None)
        if lease is not None:  # held inside a lease: given back to it, no store step
            lease.uncarve(reservation.tokens, reservation.usd_micros)
            self._local_hold(acct, -reservation.tokens, -reservation.usd_micros)
            acct.open -= 1
            self._near_limit(lease, acct)
            return
        stored = self._stored(reservation)
        if self._unsettled or self._wake is not None:
            self._queue(_Settle(stored, None, acct, "", None, None))
            return
        self._settle_stored(stored, None, acct)

    def _queue(self, settle: _Settle) -> None:
        self._unsettled.append(settle)
        if self._wake is not None:
            self._wake.set()

    def _settle_stored(self, stored: Reservation, usage: tuple[int, int] | None, acct: _Account,
                *, queue: bool = True, request: str = "", record: CallRecord | None = None,
                pending: tuple[int, PendingCharge] | None = None, lease: _LeaseCall | None = None) -> Charge | None:
        """Commit (``usage``) or release ``stored`` in the store; on
        :class:`StoreUnavailable` queue it (``queue``, with its ``pending``
        charge) or raise. Returns the charge.

        A commit queued here is applied later at its full ``usage``, the store
        checking the headroom then as for any commit; the call's FINAL waits
        for that (:meth:`pending_charge`) and reports the charge the store
        applied, so the ledger equals the FINALs' signed usage. A commit is
        named (``request``): the queued one (``queue`` False) is a
        :meth:`~atp_router.flow.budget.SharedAccounts.recommit_shared` of that name,
        so if the first attempt timed out but Redis ran it after all (within its
        deadline; a later one is refused by the store) it is not applied twice."""
        if usage is not None and not request:
            request = self.new_request()
        try:
            if lease is not None and usage is not None:
                out = self.shared.lease_settle(stored, lease.room, *usage, request=request, recommit=not queue,
                                               record=record, buffered=False)
                assert out is not None
            elif usage is None:
                out = self.shared.release_shared(stored)
            elif queue:
                out = self.shared.commit_shared(stored, *usage, request=request, record=record)
            else:
                out = self.shared.recommit_shared(stored, *usage, request=request, record=record)
        except StoreUnavailable as e:
            self._down("commit" if usage is not None else "release", e)
            if not queue:
                raise
            if usage is not None:
                log.warning("reservation %d on %s: the store cannot be reached; its commit (%s) waits for it, "
                            "and so does the call's FINAL", stored.id, stored.key, usage)
            self._unsettled.append(_Settle(stored, usage, acct, request, record,
                                           pending if usage is not None else None, tried=True))
            return None
        except NotFound:
            log.warning("reservation %d on %s is no longer in the store (settled by another router, or a retried "
                        "write that had been applied): forgotten here", stored.id, stored.key)
            acct.open -= 1
            return Charge(0, 0, *usage) if usage is not None else None
        acct.open -= 1
        self._mirror(out)
        if self._kill_after_commit and usage is not None:
            log.error("%s=1: killing this router right after a commit (fault injection)", KILL_AFTER_COMMIT_ENV)
            os.kill(os.getpid(), signal.SIGKILL)
        return out.charge

    def settle_pending(self) -> int:
        """Cancel the reserves whose answer was lost, then apply the commits and
        releases the store could not take, in order, until it cannot be reached
        again; returns how many are left (:attr:`unsettled`). One the store
        refuses otherwise is logged and dropped (its reservation stays held in
        the store until this router's state is settled). Nothing while the
        committer applies some (:meth:`run_committer`)."""
        if self._inflight:
            return self.unsettled
        while self._cancels:
            request = self._cancels[0]
            try:
                if self.shared.cancel_reserve_shared(request):
                    log.warning("reserve %s timed out but had been applied: its reservation is released", request)
            except StoreUnavailable:
                return self.unsettled
            except StoreError:
                log.exception("reserve %s timed out; cancelling it failed; dropped", request)
            self._cancels.pop(0)
        while self._unsettled:
            st = self._unsettled[0]
            charge: Charge | None
            try:
                # Always by name (a recommit): a first attempt may have run, or run late.
                charge = self._settle_stored(st.stored, st.usage, st.acct, queue=False, request=st.request,
                                             record=st.record, lease=st.lease)
            except StoreUnavailable:
                break
            except StoreError:
                log.exception("reservation %d on %s: settling it failed; dropped", st.stored.id, st.stored.key)
                st.acct.open -= 1
                charge = Charge(0, 0, *st.usage) if st.usage is not None else None
            self._unsettled.pop(0)
            self._resolve(st, charge)
        return self.unsettled

    def _resolve(self, st: _Settle, charge: Charge | None) -> None:
        self._lease_answered(st, charge)
        if st.pending is not None:
            del self._pending[st.pending[0]]
            assert charge is not None
            st.pending[1].resolve(charge)

    async def run_committer(self) -> None:
        """Apply the commits and releases in order, off the trio loop (a store
        thread: :func:`~atp_router.store.threads.off_loop`), until cancelled — a
        background service of the router (issue 22 item 2). While it runs,
        :meth:`commit` and :meth:`release` queue their settlement and return at
        once (a commit: the usage within the reservation and a pending charge
        the call's FINAL waits for). A first attempt is a named commit, a retry
        a re-commit by that name; one the store could not take waits for
        :meth:`settle_pending` (the router's retry, once the store answers).
        Cancelled, it waits for the settlements in flight (a thread cannot be
        interrupted: they may apply) and accounts for them."""
        self._wake = wake = trio.Event()
        try:
            while True:
                await wake.wait()
                self._wake = wake = trio.Event()
                batch = self._unsettled[:_COMMIT_BATCH]
                if self._cancels or not batch or self._inflight or batch[0].tried:
                    continue  # a cancel, or a settlement that failed, first: settle_pending's turn
                self._inflight = len(batch)
                try:
                    outcomes = await self._settle_batch(batch)
                except Exception:
                    log.exception("applying %d commits and releases failed: retried by name", len(batch))
                    continue
                finally:
                    self._inflight = 0
                if self._applied(batch, outcomes) and self._unsettled:
                    wake.set()
        finally:
            self._wake = None

    async def _settle_batch(self, batch: list[_Settle]) -> list[SharedResult | StoreError]:
        """:meth:`_apply` of ``batch`` off the trio loop: in the stream table's
        next group commit (:attr:`defer`; the commits in the same pipeline as
        the events queued beside them — a call's last events —, kept and tried
        again with them while the store cannot be reached, by name), else in a
        store thread of its own. The outcomes, or none (the group commit ended
        without running it: left queued, settled again by name)."""
        box: list[list[SharedResult | StoreError]] = []
        over = trio.Event()

        def write() -> None:
            got = self._apply(batch)
            down = next((e for e in got if isinstance(e, StoreUnavailable)), None)
            if down is not None:
                raise down  # the whole group commit is kept and tried again (these as re-commits by name)
            box[:] = [got]

        if self.defer is not None and self.defer(write, over=over.set):
            await over.wait()
            return box[0] if box else []
        return await off_loop(self.shared, self._apply, batch)

    def _apply(self, batch: list[_Settle]) -> list[SharedResult | StoreError]:
        """The store's side of :meth:`run_committer` (a store thread): each
        settlement's outcome, in order, up to the first the store could not take."""
        many = getattr(self.shared, "settle_many", None)
        if many is not None and len(batch) > 1 and not self._kill_after_commit and not any(st.lease for st in batch):
            # (The fault hook kills right after one commit: one at a time then.)
            return self._apply_many(many, batch)
        out: list[SharedResult | StoreError] = []
        for st in batch:
            first, st.tried = not st.tried, True  # tried before it is sent: it may apply whatever we hear
            try:
                if st.lease is not None and st.usage is not None:
                    got = self._lease_commit(st, recommit=not first)
                elif st.usage is None:
                    got = self.shared.release_shared(st.stored)
                elif first:
                    got = self.shared.commit_shared(st.stored, *st.usage, request=st.request, record=st.record)
                else:
                    got = self.shared.recommit_shared(st.stored, *st.usage, request=st.request, record=st.record)
            except StoreError as e:
                out.append(e)
                if isinstance(e, StoreUnavailable):
                    break
                continue
            out.append(got)
            if self._kill_after_commit and st.usage is not None:
                log.error("%s=1: killing this router right after a commit (fault injection)", KILL_AFTER_COMMIT_ENV)
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    def _lease_commit(self, st: _Settle, *, recommit: bool) -> SharedResult:
        assert st.lease is not None and st.usage is not None
        out = self.shared.lease_settle(st.stored, st.lease.room, *st.usage, request=st.request, recommit=recommit,
                                       record=st.record, buffered=False)
        assert out is not None
        return out

    def _apply_many(self, many: Callable[..., list[SharedResult | StoreError]],
                    batch: list[_Settle]) -> list[SharedResult | StoreError]:
        """:meth:`_apply` in one pipeline (:meth:`RedisStore.settle_many
        <atp_router.store.redis.RedisStore.settle_many>`): one round trip for the
        commits of concurrent calls. A pipeline that failed as a whole leaves
        every one of them to be settled again by name."""
        ops = []
        for st in batch:
            mode = "release" if st.usage is None else ("recommit" if st.tried else "commit")
            st.tried = True  # before it is sent: it may apply whatever we hear
            ops.append((mode, st.stored, *(st.usage or (0, 0)), st.request, st.record))
        try:
            out = many(ops)
        except StoreUnavailable as e:
            return [e]
        cut = next((i for i, got in enumerate(out) if isinstance(got, StoreUnavailable)), None)
        return out if cut is None else out[:cut + 1]

    def _applied(self, batch: list[_Settle], outcomes: list[SharedResult | StoreError]) -> bool:
        """On the trio side, after :meth:`_apply`: each settlement done is
        mirrored here and its pending charge resolved; False when the store
        could not take one (it and those after it stay queued)."""
        for st, got in zip(batch, outcomes, strict=False):
            if isinstance(got, StoreUnavailable):
                self._down("commit" if st.usage is not None else "release", got)
                return False
            assert self._unsettled[0] is st
            self._unsettled.pop(0)
            usage = st.usage
            charge: Charge | None = None
            if isinstance(got, SharedResult):
                self._mirror(got)
                charge = got.charge
            elif isinstance(got, NotFound):
                log.warning("reservation %d on %s is no longer in the store (settled by another router): forgotten "
                            "here", st.stored.id, st.stored.key)
                charge = Charge(0, 0, *usage) if usage is not None else None
            else:
                log.error("reservation %d on %s: settling it failed (%s); dropped", st.stored.id, st.stored.key, got)
                charge = Charge(0, 0, *usage) if usage is not None else None
            st.acct.open -= 1
            self._resolve(st, charge)
        return True


#: Settlements the committer applies in one store-thread call (each its own atomic script).
_COMMIT_BATCH = 64


@dataclass(slots=True, eq=False)
class _Settle:
    """A commit (``usage``) or release (None) of ``stored`` the store has not
    taken yet: its ``account`` here, the commit's name (``request``; "" for a
    release), the call record it stores (the answer it pays for), its
    :class:`~atp_router.flow.budget.PendingCharge` with the local reservation id,
    and whether an attempt was sent (a retry is then a re-commit by name)."""

    stored: Reservation
    usage: tuple[int, int] | None
    acct: _Account
    request: str
    record: CallRecord | None
    pending: tuple[int, PendingCharge] | None
    tried: bool = False
    #: A call reserved inside a budget lease: ``stored`` names the lease (id) and the stream account.
    lease: _LeaseCall | None = None


@dataclass(slots=True, eq=False)
class _LeaseCall:
    """A queued commit of a call reserved inside ``lease``: what it ``held`` there
    (None: the lease's books were settled when it was sent, a certain charge),
    the router's room on its stream account (None: unbounded) and the most the
    slice may give it (``cap``: its reservation and the slice's free part, held
    for it until answered), per axis."""

    lease: BudgetLease
    held: tuple[int, int] | None
    room: tuple[int | None, int | None]
    cap: tuple[int, int] = (0, 0)


def _certain(r: Reservation, usage: tuple[int, int]) -> Charge:
    """What a commit the store has not taken yet will charge at least: the usage
    within the reservation (the rest, overage until settled)."""
    t, u = min(usage[0], r.tokens), min(usage[1], r.usd_micros)
    return Charge(t, u, usage[0] - t, usage[1] - u)


class RecordingAccounts(SharedAccounts, Protocol):
    """The :class:`~atp_router.flow.budget.SharedAccounts` of a cluster's store
    (:class:`~atp_router.store.redis.RedisStore`): a commit can store the answer
    it pays for in the same atomic step (:class:`~atp_router.flow.budget.CallRecord`)."""

    def commit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                      request: str = "", record: CallRecord | None = None) -> SharedResult: ...

    def recommit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                        request: str, record: CallRecord | None = None) -> SharedResult: ...

    def call_record(self, key: str) -> StoredCall | None: ...

    def open_stream_shared(self, key: str, parent: str, limit: Allowance, *, owner: str, ask: QuotaAsk,
                           ttl_ms: int) -> tuple[QuotaGrant, SharedResult | None]: ...

    def close_shared_if_open(self, key: str) -> None: ...

    def lease_take(self, parent: str, lease_id: int | None, tokens: int, usd_micros: int, *,
                   owner: str, request: str = "") -> tuple[int, int, int, SharedResult]: ...

    def lease_settle(self, lease: Reservation, room: tuple[int | None, int | None], tokens: int, usd_micros: int,
                     *, request: str, recommit: bool = False, record: CallRecord | None = None,
                     buffered: bool = True) -> SharedResult | None: ...


# ----------------------------------------------------------------------- leases
class LeaseClock:
    """What a router's lease thread and its trio side decide about the lease
    (sans-IO: every time passed in is ``time.monotonic()`` s; not locked — the
    router holds a lock around it, the thread and the trio loop share it).

    * the **thread** renews every ``lease_ms / 5`` while :meth:`should_renew`:
      the trio loop ticked (:meth:`tick`) within :attr:`stall_s` (default
      ``max(30 s, 6 leases)``) — past that the router is wedged, cannot serve,
      and lets its lease lapse so the others settle it; it reports each
      renewal (:meth:`renewed`) or failure (:meth:`failed`);
    * a renewal that comes ``0.8 × lease`` or more after the previous one
      (the lease may have lapsed: the gap is timed here, the lease by the
      store) makes a **fence** due (:attr:`fence_due`), as does
      :meth:`request_fence` (the ledger found an account settled by another
      router); the trio side runs :meth:`ClusterNode.fence` and calls
      :meth:`fenced`;
    * :meth:`writes_allowed`: queued stream writes may go to the store only
      with no fence due and a renewal less than ``0.8 × lease`` ago."""

    def __init__(self, lease_ms: int, *, now: float, stall_s: float | None = None) -> None:
        if lease_ms < 1:
            raise ValueError(f"lease_ms must be >= 1, got {lease_ms}")
        self.lease_s = lease_ms / 1000
        #: How long the trio loop may go without ticking before the lease is let lapse, s.
        self.stall_s = max(30.0, 6 * self.lease_s) if stall_s is None else stall_s
        self.ticked = now
        self.ok_at = now
        #: The live routers as of the last renewal (owner → lease info).
        self.peers: dict[str, dict[str, Any]] = {}
        self.error: StoreError | None = None
        self.error_at = -math.inf
        #: Failures counted so far (the trio side reports each new one once).
        self.failures = 0
        self.fence_seq = 0
        self.fenced_seq = 0
        #: The lease epoch (fencing token) the store last reported, and the one
        #: this router's writes carry (adopted after the fence it makes due).
        self.epoch: int | None = None
        self.adopted: int | None = None

    @property
    def period_s(self) -> float:
        """How often the thread renews (and the trio loop ticks), s."""
        return self.lease_s / 5

    def tick(self, now: float) -> None:
        """The trio loop ran at ``now``."""
        self.ticked = max(self.ticked, now)

    def should_renew(self, now: float) -> bool:
        """Whether the thread renews at ``now``: the loop ticked within :attr:`stall_s`."""
        return now - self.ticked < self.stall_s

    def renewed(self, now: float, peers: dict[str, dict[str, Any]], epoch: int = 0) -> float | None:
        """A renewal succeeded at ``now`` (``peers``: the live routers it read;
        ``epoch``: the lease epoch the store reported). Returns the gap since
        the previous one (s) when it makes a fence due — a gap of 0.8 lease or
        more, or an epoch other than the adopted one (another router settled
        this one: the gap is then reported whatever it was) —, else None."""
        gap = now - self.ok_at
        self.ok_at = max(self.ok_at, now)
        self.peers = peers
        self.epoch = epoch
        if self.adopted is None:
            self.adopted = epoch  # the first renewal, before this router owns anything
        if gap >= 0.8 * self.lease_s or epoch != self.adopted:
            self.fence_seq += 1
            return gap
        return None

    def adopt(self) -> int | None:
        """The fence is done: the epoch the store reported is the one this
        router's writes carry from now on; returns it when it changed."""
        if self.epoch is None or self.epoch == self.adopted:
            return None
        self.adopted = self.epoch
        return self.epoch

    def failed(self, now: float, error: StoreError) -> None:
        """A renewal found the store unreachable at ``now``."""
        self.error, self.error_at = error, now
        self.failures += 1

    def request_fence(self) -> None:
        """Make a fence due (this router was found settled by another)."""
        self.fence_seq += 1

    @property
    def fence_due(self) -> bool:
        """Whether a fence is due (:meth:`fenced` not yet called for it)."""
        return self.fence_seq != self.fenced_seq

    def fenced(self, seq: int) -> None:
        """The fence that began when :attr:`fence_seq` was ``seq`` is done."""
        self.fenced_seq = max(self.fenced_seq, seq)

    def writes_allowed(self, now: float) -> bool:
        """Whether queued writes may go to the store at ``now``."""
        return not self.fence_due and now - self.ok_at < 0.8 * self.lease_s


# ----------------------------------------------------------------------- router
def deploy(config: RouterConfig, **kw: Any) -> Deployed:
    """A cluster router (:func:`build`) with its HTTP middleware
    (:meth:`ClusterNode.http_app`: forwarding, a store that cannot be reached
    answering 503) and the advertising of its URL with its lease
    (:meth:`ClusterNode.advertise`). Raises :class:`~atp_router.store.base.StoreError`
    when the store cannot be opened."""
    node = ClusterNode(config, **kw)
    return Deployed(node.router, http_middleware=node.http_app, advertise=node.advertise)


def build(config: RouterConfig, **kw: Any) -> Router:
    """The :class:`~atp_router.runtime.router.Router` of one router of a cluster
    (:class:`ClusterNode`; ``kw`` as for the Router: ``syn_stages``). Raises
    :class:`~atp_router.store.base.StoreError` when the store cannot be opened."""
    return ClusterNode(config, **kw).router


class ClusterNode(SynGate):
    """What makes a :class:`~atp_router.runtime.router.Router` one of several on a
    shared store (module docstring), and the router it assembles
    (:attr:`router`): the store opened from ``config.store`` (a ``redis://``
    URL), its own state-directory lock, budgets in a :class:`ClusterLedger`,
    the shared audit chain, RIB versions from the store
    (:class:`~atp_router.deploy.workers.SharedRib`), no crash recovery at start (the
    others are running: lost routers are settled by the reaper), its lease
    renewed every ``config.lease_ms / 5`` ms by a thread of its own while it
    serves (:class:`LeaseClock`) — background services of the router —, its
    streams stored with its owner name, and the gate on its SYNs (:meth:`refuse`,
    :meth:`resumes`): a stream re-opened by key runs once, across routers. Raises
    :class:`~atp_router.store.base.StoreError` when the store cannot be opened."""

    def __init__(self, config: RouterConfig, **kw: Any) -> None:
        self.owner = owner_name()
        self.lease_ms = config.lease_ms
        self.advertise_url = config.advertise_url
        self.started_ms = _now_ms()
        #: owner → lease info of the live routers, as of the last heartbeat.
        self.peers: dict[str, dict[str, Any]] = {}
        self._peers_at = -math.inf
        self._key_memo: tuple[Frame, StreamRecord | None] | None = None
        self._store_ok = True
        now = time.monotonic()
        #: When an operation last found the store unreachable (time.monotonic()).
        self._down_at = -math.inf
        self._lease_lock = threading.Lock()
        self._lease_failures = 0
        self._lease_thread: threading.Thread | None = None
        self._lease_stop = threading.Event()
        #: The reaper settles no one before this (time.monotonic()): one lease after
        #: the start, or after the store came back (the others renew theirs first).
        self._reap_after = now + self.lease_ms / 1000
        #: The router's metrics (atp_store_up, atp_store_unavailable_total), reported before it exists.
        self.metrics = RouterMetrics()
        state = self._open_state(config)
        self._export_round_trips()
        #: A tenant's quotas counted across the routers in the store (atp_router.runtime.dataplane.quotas).
        self.quotas = SharedQuotas(self.store, owner=self.owner, metrics=self.metrics,
                                   on_unavailable=self.store_unavailable)
        # The atomic OPEN: a SYN's quota entry and its stream's account in one store step; the
        # account closed in the store with the stream's last events (the END).
        self.quotas.opener = self.ledger.open_admitted
        self.quotas.closer = self.ledger.close_early
        self.ledger.routers = lambda: max(1, len(self.peers))  # budget leases: a slice per live router
        # Merged learning and breaker propagation through the store (atp_router.runtime.controlplane.shared_state).
        self.router = router = Router(
            config, state, rib_version=self.rib.next_version,
            services=(self.rib.service, self._services, lambda r: shared_state.background_tasks(r, self.owner),
                      self.quotas.service),
            syn_gates=(self,), store_refusal=self._refusal, metrics=self.metrics,
            syn_stages=with_shared_quotas(kw.pop("syn_stages", DEFAULT_STAGES), self.quotas), **kw)
        router.learning.shared_rate = self.quotas.may_learn
        router.streams.persistence.owner = self.owner
        # A stream's record goes in the group commit of its SYN+ACK (one round trip less; another
        # router cannot look it up before: the client learns its id from that SYN+ACK, and a new
        # idempotency key is held by the open claim meanwhile, _keyed_syn).
        router.streams.persistence.record_in_group_commit = True
        router.streams.persistence.on_store_unavailable = self.store_unavailable
        router.streams.persistence.flush_gate = self._writes_allowed
        router.streams.persistence.on_fenced = lambda: self._found_settled("")
        # A stream's quota entry is removed with its last events: one round trip, off the loop.
        self.quotas.defer = router.streams.persistence.defer
        # Audit records chained to the shared chain in the group commit of the events beside them.
        router.audit_log.defer = router.streams.persistence.defer
        # The commits of calls in the group commit of the events beside them (a call's last events).
        self.ledger.defer = router.streams.persistence.defer
        #: The lease thread's and the trio side's shared view (under _lease_lock).
        self._lease = LeaseClock(self.lease_ms, now=time.monotonic())
        self._heartbeat()  # the lease exists before this router owns anything
        if not self._store_ok:
            raise StoreUnavailable(f"the store {self.store.describe()} cannot be reached")
        log.info("router %s on the shared store %s (lease %d ms)", self.owner, self.store.describe(), self.lease_ms)

    # ------------------------------------------------------------ durable state
    def _export_round_trips(self) -> None:
        """The store's round trips in the router's metrics: all, the background's, by operation."""
        self.metrics.store_round_trips.set_function(lambda: self.store.round_trips)
        self.metrics.store_background_round_trips.set_function(lambda: self.store.background_round_trips)
        self.metrics.store_round_trips_by_op.set_function(lambda: self.store.round_trips_by_op)

    def _open_state(self, config: RouterConfig) -> StateParts:
        """This router's state: its own state directory locked
        (:func:`~atp_router.deploy.single.state_directory`), the shared store opened
        from ``config.store``, budgets in a :class:`ClusterLedger`, the shared
        audit chain; no crash recovery at start (other routers run: a lost one
        is settled by the reaper); restored by adopting the store's active RIB
        (or saving the running one as the first); closed by :meth:`_close_state`."""
        state_dir, tmp, lock = single.state_directory(config)
        store = open_store(config.store, namespace=config.store_namespace)
        ledger = ClusterLedger(store, owner=self.owner, on_unavailable=self.store_unavailable,
                               on_settled=self._found_settled)
        audit_log = AuditLog.open(store, state_dir, shared=True, options=config.audit)
        close = single.closing(audit_log, store, lock=lock, tmp=tmp)
        self.store, self.ledger, self.audit_log = store, ledger, audit_log
        #: Answers charged in a lost router's run, replayed by this router's re-runs of their keys.
        self.journal = CallJournal(store, ledger)
        #: RIB versions from the store, the RIB other routers load followed (atp_router.deploy.workers.SharedRib).
        self.rib = SharedRib(store)
        return StateParts(state_dir=state_dir, store=store, audit_log=audit_log, ledger=ledger,
                          close=lambda: self._close_state(close), store_check=self._store_check,
                          restore=(self._restore_rib,), journal=self.journal)

    def _found_settled(self, key: str) -> None:
        # The ledger found an account of ours settled by another router: check our streams (writes wait).
        with self._lease_lock:
            self._lease.request_fence()

    def _restore_rib(self, router: Router) -> None:
        if self.store.active_rib() is None:
            self.store.save_rib(router.gen.version, "", router.gen.source, "router")
        else:
            self.rib.adopt(router)

    def _close_state(self, close: Callable[[], None]) -> None:
        """Clean shutdown: what the store could not take is tried once more,
        this router's own state settled as the reaper would (its streams still
        open are interrupted with :data:`ROUTER_LOST`: re-opened elsewhere they
        run again), its lease dropped; then the store is closed (``close``). A
        store that cannot be reached leaves it to the other routers (after the lease)."""
        try:
            if self.ledger.settle_pending():
                log.warning("%d commits or releases could not reach the store: the other routers release the "
                            "reservations when this router's lease expires", self.ledger.unsettled)
            done = settle(self.store, self.audit_log, self.owner, reason=ROUTER_LOST, release=True, who="router")
            self.store.drop_lease(self.owner)
            if any(done.values()):
                log.info("router %s stopped; settled %s", self.owner, done)
        except StoreError as e:
            log.error("router %s stopped without settling its state (%s): the other routers will, when its lease "
                      "expires", self.owner, e)
        finally:
            close()

    # ------------------------------------------------------------ store health
    def store_unavailable(self, op: str, e: StoreError) -> None:
        """Operation ``op`` found the store unreachable: counted
        (``atp_store_unavailable_total{op}``), ``atp_store_up`` 0, logged once."""
        self.metrics.store_unavailable.labels(op).inc()
        self._down_at = time.monotonic()
        if self._store_ok:
            self._store_ok = False
            self.metrics.store_up.set(0)
            log.error("the shared store cannot be reached (%s: %s): new spend is refused until it answers", op, e)

    def _store_back(self) -> None:
        if not self._store_ok:
            self._store_ok = True
            self.metrics.store_up.set(1)
            self._reap_after = time.monotonic() + self.lease_ms / 1000
            log.warning("the shared store answers again: spend resumes (lost routers are settled after one lease)")

    @property
    def store_ok(self) -> bool:
        """Whether the store answered this router's last heartbeat."""
        return self._store_ok

    def _store_check(self) -> str | None:
        """Readiness (``GET /v1/ready``): the store answered the last lease
        renewal (:attr:`store_ok`) and no commit or release waits for it."""
        if not self._store_ok:
            return f"the shared store {self.store.describe()} cannot be reached: new spend is refused"
        if self.ledger.unsettled:
            return f"{self.ledger.unsettled} commits or releases wait for the shared store {self.store.describe()}"
        return None

    # ------------------------------------------------------------ leases
    def advertise(self, url: str) -> None:
        """The URL other routers forward requests to (``--advertise-url``, else
        the bound HTTP address): published with the lease at once."""
        self.advertise_url = url
        self._heartbeat()

    def _info(self) -> dict[str, Any]:
        return {"url": self.advertise_url, "started_ms": self.started_ms, "version": _VERSION,
                "pid": os.getpid()}

    def _renew(self) -> bool:
        """Renew the lease and read the live routers (any thread; no trio call):
        the outcome goes to :attr:`_lease` (:class:`LeaseClock`). False when the
        store cannot be reached."""
        try:
            epoch, peers = self.store.renew_lease(self.owner, ttl_ms=self.lease_ms, now_ms=_now_ms(), info=self._info())
        except StoreUnavailable as e:
            with self._lease_lock:
                self._lease.failed(time.monotonic(), e)
            return False
        with self._lease_lock:
            first = self._lease.adopted is None
            gap = self._lease.renewed(time.monotonic(), peers, epoch)
        if first:
            self._fence_as(epoch)
        if gap is not None:
            log.warning("router %s renewed its lease after %.0f ms (lease %d ms): checking its streams", self.owner,
                        gap * 1000, self.lease_ms)
        return True

    def _heartbeat(self) -> bool:
        """Renew the lease now (on the trio thread: at start, :meth:`advertise`)
        and act on it (:meth:`_lease_news`). False when the store cannot be reached."""
        ok = self._renew()
        self._lease_news()
        return ok

    def _lease_news(self) -> None:
        """On the trio thread: act on what the lease thread found since last
        time — each failure counted (``atp_store_up`` 0), the live routers
        read, a fence run when due (:meth:`fence`, before any queued write
        goes to the store: the flush gate waits for it), and the store back
        (spend resumes) once a renewal succeeded after the last failure."""
        with self._lease_lock:
            lease = self._lease
            failures, error, error_at = lease.failures, lease.error, lease.error_at
            ok_at, peers = lease.ok_at, lease.peers
            fence_seq, fence_due = lease.fence_seq, lease.fence_due
        if failures != self._lease_failures:
            self._lease_failures = failures
            if error is not None:
                down_at = self._down_at
                self.store_unavailable("lease", error)
                self._down_at = max(down_at, error_at)  # when the thread found it, not now
        if ok_at <= self._down_at:
            return  # the store has not answered a renewal since it was last found unreachable
        if ok_at > self._peers_at:
            self.peers, self._peers_at = peers, ok_at
        if fence_due:
            try:
                self.fence()
            except StoreUnavailable as e:
                self.store_unavailable("lease", e)
                return  # tried again at the next tick; the writes wait
            with self._lease_lock:
                lease.fenced(fence_seq)
                epoch = lease.adopt()
            if epoch is not None:
                # Its settled streams are stopped: its writes carry the new epoch from now on.
                log.warning("router %s was settled by another router (lease epoch now %d): its writes resume",
                            self.owner, epoch)
                self._fence_as(epoch)
        self._store_back()

    def _fence_as(self, epoch: int) -> None:
        self.store.fence_as(self.owner, epoch)  # the fencing token of this router's writes

    def _writes_allowed(self) -> bool:
        """The stream table's flush gate: the store answered, no fence is due
        and the lease was renewed within 0.8 of it."""
        if not self._store_ok:
            return False
        with self._lease_lock:
            return self._lease.writes_allowed(time.monotonic())

    def _lease_thread_main(self) -> None:
        """The lease thread: renew every ``lease / 5`` while the trio loop ticks
        (:meth:`LeaseClock.should_renew`). Makes no trio call."""
        stalled = False
        while not self._lease_stop.wait(self._lease.period_s):
            with self._lease_lock:
                renew = self._lease.should_renew(time.monotonic())
                stall_s = self._lease.stall_s
            if not renew:
                if not stalled:
                    log.error("router %s: its event loop has not run for %.0f s: its lease is no longer renewed "
                              "(the other routers settle it)", self.owner, stall_s)
                stalled = True
                continue
            if stalled:
                log.warning("router %s: its event loop runs again: renewing its lease", self.owner)
                stalled = False
            try:
                self._renew()
            except Exception:  # a store error other than unavailable: logged, tried again
                log.exception("router %s: renewing its lease failed", self.owner)

    async def _leases(self) -> None:
        """The trio side of the lease: starts the lease thread, ticks every
        ``lease / 5`` (:meth:`LeaseClock.tick`) and acts on the thread's news;
        cancelled, stops the thread (at most one store call's time)."""
        period = self._lease.period_s
        self._lease_stop.clear()
        with self._lease_lock:
            self._lease.tick(time.monotonic())
        thread = threading.Thread(target=self._lease_thread_main, name=f"atp-lease-{self.owner}", daemon=True)
        self._lease_thread = thread
        thread.start()
        # While the store is down, the loop's calls fail at once: the lease thread and the
        # store threads (atp_router.store.threads) probe it, so a stalled Redis holds the loop once.
        self.store.probe_off(threading.get_ident())
        try:
            while True:
                before = time.monotonic()
                await trio.sleep(period)
                now = time.monotonic()
                with self._lease_lock:
                    self._lease.tick(now)
                if now - before - period >= 0.8 * self._lease.lease_s:
                    # Without the thread this router would have lost its lease (finding of issue 12's load test).
                    log.warning("router %s: its event loop did not run for %.0f ms (lease %d ms): the lease was "
                                "renewed by its thread meanwhile", self.owner, (now - before - period) * 1000,
                                self.lease_ms)
                self._lease_news()
        finally:
            self.store.probe_off(None)  # at shutdown the loop's last calls may probe (nothing else will)
            self._lease_stop.set()
            thread.join(timeout=5)  # the thread waits on the event: it ends at once unless in a store call
            if thread.is_alive():
                log.warning("router %s: the lease thread did not stop within 5 s", self.owner)
            self._lease_thread = None

    def fence(self) -> int:
        """This router's lease may have lapsed (it could not renew it for a
        lease or more): each of its streams still running or with events not
        yet stored that the store no longer has open was settled by another
        router — it is stopped here without a frame of ours
        (:meth:`StreamTable.abandon <atp_router.runtime.dataplane.streams.StreamTable.abandon>`:
        its task cancelled, what the store has not got dropped; a client reads
        it, and re-runs it, from the store). Runs before any queued write goes
        to the store again (the stream table's flush waits for the heartbeat
        that calls it). Returns how many."""
        n = 0
        for ctx in self.router.streams.values():
            if ctx.restored or (ctx.log.closed and ctx.log.durable >= len(ctx.log)):
                continue  # all of it is in the store already
            rec = self.store.get_stream(ctx.tenant, ctx.session_id, ctx.stream_id)
            if rec is not None and rec.state == "open" and rec.owner == self.owner:
                continue
            if rec is None and not ctx.log.durable:
                continue  # its record is still queued (group commit): not in the store, so settled by no one
            log.warning("stream %s/%s was settled by another router while this one was cut from the store: "
                        "stopped here", ctx.tenant, ctx.stream_id)
            self.router.stream_closed(
                self.router.streams.abandon(ctx, self.store.events(ctx.tenant, ctx.session_id, ctx.stream_id)))
            n += 1
        return n

    # ------------------------------------------------------------ settling lost routers
    async def _reaper(self) -> None:
        while True:
            await trio.sleep(REAP_S)
            if not self._store_ok or time.monotonic() < self._reap_after:
                continue
            try:
                # The poll in a store thread (off the loop: a stalled store holds the thread);
                # the rare settling of a lost router on the loop, with the audit log it writes.
                lost = await off_loop(self.store, functools.partial(self.store.lost_owners, now_ms=_now_ms()))
                if [o for o in lost if o != self.owner]:
                    self.reap(lost)
            except StoreUnavailable as e:
                self.store_unavailable("reap", e)
            except Exception:
                log.exception("settling lost routers failed")

    def reap(self, lost: list[str] | None = None) -> dict[str, dict[str, int]]:
        """Settle every lost router (``lost``: the store's
        :meth:`~atp_router.store.base.Store.lost_owners`, read here when None)
        this one wins the claim of (module docstring): ``owner → counts`` of
        what was settled. Raises :class:`~atp_router.store.base.StoreError`."""
        now = _now_ms()
        done: dict[str, dict[str, int]] = {}
        for owner in self.store.lost_owners(now_ms=now) if lost is None else lost:
            if owner == self.owner:
                continue  # this router's own lease lapsed: the next heartbeat renews it (and fences)
            if not self.store.claim("settle/" + owner, self.owner, ttl_ms=2 * self.lease_ms, now_ms=now):
                continue  # another router settles it
            self.store.fence_owner(owner)  # whatever it still sends is refused from here: it cannot undo the settling
            done[owner] = settle(self.store, self.audit_log, owner, reason=ROUTER_LOST, release=True, who="router")
            self.peers.pop(owner, None)
            log.warning("router %s lost (no lease for %d ms): settled by %s: %s", owner, self.lease_ms, self.owner,
                        done[owner], extra={"lost_router": owner})
        return done

    async def _settle_commits(self) -> None:
        ledger = self.ledger
        assert isinstance(ledger, ClusterLedger)
        while True:
            await trio.sleep(SETTLE_RETRY_S)
            if ledger.unsettled and self._store_ok and not ledger.settle_pending():
                log.info("commits and releases held while the store was unreachable: all applied")

    def _services(self, router: Router) -> list[Callable[[], Awaitable[None]]]:
        """The cluster's background services: the lease, the reaper of lost
        routers and the settling of what the store could not take."""
        ledger = self.ledger
        assert isinstance(ledger, ClusterLedger)
        return [self._leases, self._reaper, self._settle_commits, ledger.run_committer, ledger.run_leases]

    # ------------------------------------------------------------ forwarding
    @property
    def instance_tag(self) -> tuple[bytes, bytes]:
        """The header every answer of this router carries: ``x-atp-router: <owner>``."""
        return (b"x-atp-router", self.owner.encode())

    def live_peer(self, owner: str) -> dict[str, Any] | None:
        """The lease info of router ``owner`` if it is live (as of the last
        heartbeat; read again when it is not there or has no URL yet: a router
        that just started)."""
        info = self.peers.get(owner)
        if info is None or not info.get("url"):
            self.peers = self.store.live_owners(now_ms=_now_ms())
            self._peers_at = time.monotonic()
            info = self.peers.get(owner)
        return info

    def forward_target(self, rec: StreamRecord | None) -> Any:
        """Where a request about stored stream ``rec`` goes: the
        :class:`~atp_router.deploy.workers.Peer` of its owner when that is another
        live router with an advertised URL; :data:`~atp_router.deploy.workers.RETRY`
        when its owner is lost (or not yet reachable) with the stream open; None:
        served here (ours, or finished: from the store)."""
        if rec is None or rec.owner is None or rec.owner == self.owner:
            return None
        info = self.live_peer(rec.owner)
        if info is not None and info.get("url"):
            # A finished stream is all in the store: served here if its owner just went.
            return Peer(rec.owner, str(info["url"]), or_here=rec.state != "open")
        return RETRY if rec.state == "open" else None

    def http_app(self, app: Any) -> ClusterForwardingApp:
        """``app`` (the HTTP API, :func:`~atp_router.runtime.ingress.http_api.build_app`) behind
        forwarding, a store that cannot be reached answering 503 ``EAGENTDOWN``
        with ``Retry-After`` instead of 500."""
        async def unavailable(request: Request, exc: Exception) -> JSONResponse:
            self.store_unavailable("read", exc)  # type: ignore[arg-type]
            return JSONResponse({"error": {"code": str(ErrorCode.EAGENTDOWN),
                                           "reason": f"state store unavailable: {exc}; retry"}},
                                status_code=503, headers={"Retry-After": str(max(1, RETRY_AFTER_MS // 1000))})

        app.add_exception_handler(StoreUnavailable, unavailable)
        return ClusterForwardingApp(app, self)

    # ------------------------------------------------------------ resumption and re-run
    def _refusal(self, op: str, e: StoreUnavailable) -> ATPError:
        """The router's ``store_refusal``: a store that cannot be reached refuses
        an open (:meth:`Router.open_stream <atp_router.runtime.router.Router.open_stream>`;
        ``EBUDGET``, ``retry_after_ms``)."""
        self.store_unavailable(op, e)
        return ATPError(ErrorCode.EBUDGET, store_unavailable_reason(e), retry_after_ms=RETRY_AFTER_MS)

    def resumes(self, frame: Frame, identity: Identity, key: str) -> bool:
        """:meth:`Router.resume_point <atp_router.runtime.router.Router.resume_point>`
        across routers (:class:`~atp_router.runtime.deployment.SynGate`): a SYN with its
        task re-opening a stream interrupted by :data:`ROUTER_LOST` is not a
        resumption (it is re-run: :meth:`refuse`), and a key whose newest stream
        is not the one this router holds in memory resumes the newest (read from
        the store)."""
        try:
            local = self.router.streams.resumable(identity.tenant, key)
            if local is None or local.log.closed:
                rec = self._keyed_record(frame, identity.tenant, key)
                if rec is not None:
                    if _is_lost(rec) and _has_task(frame):
                        return False
                    if local is not None and (local.session_id, local.stream_id) != (rec.session_id,
                                                                                      rec.stream_id):
                        if rec.state == "open":
                            return False  # runs elsewhere: refuse() refuses, HTTP forwards
                        self.router.streams.restore(identity, idempotency_key=key, now=trio.current_time())
        except StoreUnavailable as e:
            self.store_unavailable("read", e)
            return False  # refuse() refuses it
        return True

    def refuse(self, frame: Frame, identity: Identity, task: TaskMeta | None) -> Refuse | None:
        """The gate on every SYN (:class:`~atp_router.runtime.deployment.SynGate`, before
        its session sees it): one re-opening (by idempotency key) a stream that
        runs on another router, or whose lost router is not settled yet, or that
        another router is re-running, is refused with ``EAGENTDOWN`` (resume
        again; over HTTP it is forwarded) instead of running its task twice; one
        that re-opens a stream interrupted by :data:`ROUTER_LOST` with its task
        runs it again if this router wins the re-run claim. A store that cannot
        be reached refuses it (``EBUDGET`` with ``retry_after_ms``
        :data:`RETRY_AFTER_MS`: over HTTP 503 + ``Retry-After``)."""
        key = task.idempotency_key if task is not None else None
        if frame.ttl == 0 or key is None:
            return None
        try:
            return self._keyed_syn(frame, identity, key)
        except StoreUnavailable as e:
            self.store_unavailable("read", e)
            # Like every spend refused while the store is away: retry in a moment (HTTP 503
            # + Retry-After), not a bare 402 that a client reads as a spent budget.
            return Refuse(ErrorCode.EBUDGET, store_unavailable_reason(e), RETRY_AFTER_MS)

    def _keyed_record(self, frame: Frame, tenant: str, key: str) -> StreamRecord | None:
        """The newest stored stream of ``tenant``'s idempotency ``key``, read once
        per SYN: :meth:`resumes` and :meth:`refuse` (each called twice for one
        SYN by the ingresses and the core) share the read, made in one
        synchronous pass."""
        memo = self._key_memo
        if memo is not None and memo[0] is frame:
            return memo[1]
        rec = self.store.find_idempotent(tenant, key)
        self._key_memo = (frame, rec)
        return rec

    def _keyed_syn(self, frame: Frame, identity: Identity, key: str) -> Refuse | None:
        local = self.router.streams.resumable(identity.tenant, key)
        if local is not None and not local.log.closed:
            return None  # running here: resumed
        rec = self._keyed_record(frame, identity.tenant, key)
        if rec is None:
            if _has_task(frame) and not self.store.claim(_open_claim(identity.tenant, key), self.owner,
                                                         ttl_ms=self.lease_ms, now_ms=_now_ms()):
                return Refuse(ErrorCode.EAGENTDOWN, "a stream of this idempotency_key is being opened on another "
                              "router; re-open it again in a moment to resume that stream")
            return None
        if rec.state == "open" and rec.owner not in (None, self.owner):
            if self.live_peer(rec.owner) is not None:
                return Refuse(ErrorCode.EAGENTDOWN,
                              f"stream {rec.stream_id!r} of this idempotency_key runs on another router ({rec.owner}): "
                              "follow it over HTTP (GET /v1/streams/{id}/events, any router) or resume it there")
            return Refuse(ErrorCode.EAGENTDOWN,
                          f"stream {rec.stream_id!r} of this idempotency_key ran on a router that was lost and is "
                          "being settled; re-open it again in a moment (with its task it is run again)")
        if _is_lost(rec) and _has_task(frame):
            stored = stored_task_digest(rec)
            assert frame.payload is not None
            if stored is not None and stored != task_digest(frame.meta, frame.payload.content):
                # Its calls' answers in the journal are the first task's: another task never gets them.
                raise IdempotencyConflict(key)
            if not self.store.claim(_rerun_claim(rec), self.owner, ttl_ms=self.lease_ms, now_ms=_now_ms()):
                return Refuse(ErrorCode.EAGENTDOWN,
                              f"stream {rec.stream_id!r} of this idempotency_key is being re-run by another router; "
                              "re-open it again in a moment to resume the new run")
            self.journal.mark_rerun(identity.tenant, key)  # its calls ask the journal first
            log.info("stream %s/%s (key %r) was interrupted with its router %s: re-running it here", rec.tenant,
                     rec.stream_id, key, rec.owner)
        return None


# ------------------------------------------------------------------- forwarding
class _Opening(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b"null")  # absent or null: no task


class ClusterForwardingApp(ForwardingApp):
    """:class:`~atp_router.deploy.workers.ForwardingApp` of a cluster router (module
    docstring): forwards to the owner's advertised URL; a request re-opening by
    key a stream whose router was lost (with its task) takes the re-run claim
    — won, the stream runs here; lost, the request waits for the winner's
    stream and is forwarded to it. A store that cannot be reached answers 503."""

    settling_reason = "the router running this stream was lost and is being settled; retry"
    unreachable_reason = "the router running this stream cannot be reached; retry"

    def __init__(self, app: Any, node: ClusterNode) -> None:
        super().__init__(app, node.router, node, metric="atp_router_forwarded")
        self.node = node

    async def _target(self, scope: Any, receive: Any) -> tuple[Any, Any, bytes | None]:
        try:
            return await super()._target(scope, receive)
        except StoreUnavailable as e:
            self.node.store_unavailable("read", e)
            return f"state store unavailable: {e}; retry", receive, None

    async def _keyed(self, identity: Identity, key: str, body: bytes, path: str) -> Any:
        node = self.node
        local = node.router.streams.resumable(identity.tenant, key)
        if local is not None and not local.log.closed:
            return None
        rec = node.store.find_idempotent(identity.tenant, key)
        if rec is None and _carries_task(path, body):
            # A new key: whoever wins the open claim runs it; the others follow its stream.
            if node.store.claim(_open_claim(identity.tenant, key), node.owner, ttl_ms=node.lease_ms, now_ms=_now_ms()):
                return None  # opened here (the SYN gate, refuse(), holds the claim already)
            return await self._winner(identity, key, None)
        if not _is_lost(rec) or not _carries_task(path, body):
            return node.forward_target(rec)
        assert rec is not None
        if node.store.claim(_rerun_claim(rec), node.owner, ttl_ms=node.lease_ms, now_ms=_now_ms()):
            return None  # re-run here (the SYN gate, refuse(), holds the claim already)
        return await self._winner(identity, key, rec)

    async def _winner(self, identity: Identity, key: str, rec: StreamRecord | None) -> Any:
        """Wait (up to a lease) for the stream another router opens for ``key``
        — the newest stored one other than ``rec`` — and forward to it (or serve
        it from the store, when it ended); :data:`RETRY` when none came."""
        node = self.node
        with trio.move_on_after(min(_RERUN_WAIT_S, node.lease_ms / 1000)):
            while True:
                await trio.sleep(0.05)
                new = node.store.find_idempotent(identity.tenant, key)
                if new is not None and (rec is None or (new.session_id, new.stream_id, new.created_ms) != (
                        rec.session_id, rec.stream_id, rec.created_ms)):
                    return node.forward_target(new)  # the winner's run (or here, from the store, when it ended)
        return RETRY


def _carries_task(path: str, body: bytes) -> bool:
    """Whether an opening request carries its task (only ``POST /v1/streams``
    may open a stream without one: ``content`` absent)."""
    if path != "/v1/streams":
        return True
    try:
        return bytes(msgspec.json.decode(body, type=_Opening).content) != b"null"
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
