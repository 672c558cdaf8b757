"""The durable-state interface (issue 7): what the router keeps across a crash.

Callers hold a :class:`Store` and never learn its backend: the embedded SQLite
default (:mod:`atp_router.store.sqlite`) or Redis, shared by several routers
(:mod:`atp_router.store.redis`). Every mutating method is durable when it returns (for
the SQLite default: across a process kill -9; for Redis: as its AOF is
configured; see there). It holds

* **budget ledgers** (spec §5.1): accounts ``(key, parent, limit, committed,
  overage, open)`` and open reservations ``(id, account, tokens, usd_micros)``,
  in tokens and integer USD micros. :class:`StoreJournal` feeds them from a
  :class:`~atp_router.flow.budget.BudgetLedger`; :meth:`Store.load_ledger` gives the
  :class:`~atp_router.flow.budget.LedgerSnapshot` to rebuild it;
* **streams** (spec §8 resumption) keyed by ``(tenant, session_id, stream_id)``:
  a :class:`StreamRecord`, its idempotency key, and its outbound event log;
* **RIB versions** (the active policy and who set it);
* the **audit** chain (:mod:`atp_router.security.audit`) and its MACed checkpoint;
* a small **kv** for the router's own keys;
* the **response cache** (spec §13, :mod:`atp_router.policy.cache`): values under
  32-byte content keys with their tenant (None: shared), expiry and last use,
  bounded in bytes (expired first, then least recently used, are dropped).
* **shared tenant quotas** (issue 22 item 3, :mod:`atp_router.flow.quota`): per
  tenant its open streams as ``(owner, stream id)`` entries with an expiry and
  its open rate as a GCRA time (:meth:`Store.quota_open`, ``quota_close``,
  ``quota_renew``, ``quota_release_owned``), and any shared GCRA bucket by key
  (:meth:`Store.rate_take`: a tenant's learning rate), each decided in one
  atomic step so every process on the store sees one count;
* the **nonces of signed frames** (spec §11 replay, issue 19): each
  ``(tenant, key id, meta.nonce)`` a router accepted, until the end of its
  timestamp window (:meth:`Store.record_nonce`), so a frame replayed after a
  restart, on another worker or on another router of the store is refused.
  Bounded: at most ``max_per_tenant`` unexpired nonces per tenant (past it the
  call is refused, nothing stored), expired ones swept a bounded batch at a time
  (:data:`NONCE_SWEEP` per call).

Recovery after a crash (:meth:`Store.recover`, :meth:`Store.interrupt_open_streams`):
a reservation still open belonged to a call whose outcome is unknown — it may
have run and been billed by its provider. It is committed at its reserved amount
(what the caller allowed the call to spend: it cuts calls before they pass their
reservation), never released: **a budget never resurrects**. The cost is that an
unknown call is charged its estimate rather than its actual usage. A stream open
at the crash becomes ``"interrupted"``; the router reports it with an RST naming
the crash and never runs it again.

Several router processes on one store (``atp-router --workers N``, issue 10;
several machines on Redis, issue 12): the ``*_shared`` ledger methods
(the :class:`~atp_router.flow.budget.SharedAccounts` of a
:class:`~atp_router.flow.budget.SharedBudgetLedger`) check and hold budget along an
account's chain in one atomic step across processes; reservations, accounts
and streams carry the ``owner`` process, and when an owner dies the same crash
rule settles what it left (``recover(owner)``, ``close_owned_accounts(owner)``,
``interrupt_open_streams(..., owner=)``). RIB versions are handed out by the
store (:meth:`Store.next_rib_version`) so every process numbers a reload
alike, and audit records are chained at the store's head
(:meth:`Store.append_audit_chained`).

Routers on several machines (issue 12, :class:`~atp_router.store.redis.RedisStore`)
also keep **leases** in the store: each router process renews its own
(:meth:`Store.heartbeat`), the others see it in :meth:`Store.live_owners`, and an
owner whose lease expired while it still holds reservations, accounts or open
streams is listed by :meth:`Store.lost_owners`; one survivor takes an expiring
:meth:`Store.claim` on settling it and gives its reservations back
(:meth:`Store.release_owned`: a call re-run elsewhere is what gets charged,
nothing twice). Shared values that several routers change (learning
statistics, breaker state) go through :meth:`Store.update`, an atomic
read-modify-write of one kv key.

Errors: :class:`StoreError` and its subclasses :class:`SchemaError` (a state
directory this version cannot read), :class:`StoreLimitError` (a bound was hit:
frame size, events per stream), :class:`NotFound` (an unknown reservation,
account or stream; also a ``KeyError``) and :class:`StoreUnavailable` (a store
on the network cannot be reached, or lost its data, or — :class:`StoreFull` — an
embedded store's disk is full: spend is refused while it lasts).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Self

from msgspec import Struct

from atp_router.flow.budget import (
    Allowance,
    Charge,
    LedgerSnapshot,
    Reservation,
    SharedResult,
)
from atp_router.flow.quota import QuotaAsk, QuotaGrant
from atp_router.store.audit_records import AuditCheckpoint, AuditRecord
from atp_router.wire.frame import Budget, QoS

_log = logging.getLogger("atp_router.store")

__all__ = [
    "NONCE_FIELD_MAX",
    "NONCE_SWEEP",
    "CachePut",
    "CacheStats",
    "NotFound",
    "SchemaError",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreJournal",
    "StoreLimitError",
    "StoreUnavailable",
    "StoredEvent",
    "StreamRecord",
    "StreamState",
    "check_quota_args",
    "check_rate_args",
]

StreamState = Literal["open", "closed", "interrupted"]

#: Expired nonces each :meth:`Store.record_nonce` call removes at most (a bounded
#: sweep: every call adds one and removes up to this many, so a backlog shrinks).
NONCE_SWEEP = 32
#: The longest tenant, key id or nonce :meth:`Store.record_nonce` stores (characters).
NONCE_FIELD_MAX = 256


class StoreError(Exception):
    """A durable-state operation failed."""


class SchemaError(StoreError):
    """The state directory holds a schema this router cannot use (newer, or not ours)."""


class StoreLimitError(StoreError):
    """A bound was hit: ``limit`` names it (``"event_bytes"``, ``"events_per_stream"``)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class StoreUnavailable(StoreError):
    """The store cannot be reached (connection refused or reset, a timeout, a
    server still loading its data) or it lost its data (a Redis restarted
    without persistence: see :class:`~atp_router.store.redis.RedisStore`, epoch).
    Nothing was decided: spend must be refused while it lasts; the operation
    may be retried later. A write that timed out may or may not have been
    applied (a retried commit then finds its reservation gone: :class:`NotFound`)."""


class StoreFull(StoreUnavailable):
    """An embedded store's file cannot grow: its disk (or quota) is full
    (SQLite ``SQLITE_FULL``). The write was rolled back, nothing of it applied;
    the next write tries again, so the store recovers by itself when space
    returns. Its message names the file: ``state store full: <path>: …``."""


class NotFound(StoreError, KeyError):
    """No such reservation, account or stream."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Fenced(NotFound):
    """A write carrying a fencing token (a router's lease epoch) the store no
    longer honours: another router settled that router after its lease lapsed
    (what it wrote for is gone — a :class:`NotFound` to its callers), and it
    must stop the streams it no longer owns before writing again."""


class StreamRecord(Struct, frozen=True, forbid_unknown_fields=True):
    """A stream as the router opened it (spec §8). ``tenant`` is the RIB client
    that owns it; ``meta`` the SYN's meta; ``created_ms`` / ``closed_ms`` are
    Unix ms; ``state`` ends ``"closed"`` (FIN or RST sent) or ``"interrupted"``
    (open when the router crashed), with ``close_reason``. ``owner`` names the
    router process running it when several share the store (``None``: a
    single-process router)."""

    tenant: str
    session_id: str
    stream_id: str
    idempotency_key: str | None
    meta: dict[str, Any]
    qos: QoS | None
    budget: Budget | None
    created_ms: int
    state: StreamState = "open"
    close_reason: str | None = None
    closed_ms: int | None = None
    owner: str | None = None


class StoredEvent(Struct, frozen=True, forbid_unknown_fields=True):
    """One outbound event of a stream's log: its id (1, 2, … per stream), SDK
    event type (``"SYN_ACK"``, ``"FINAL"``, …) and the encoded frame bytes."""

    event_id: int
    type: str
    frame: bytes


class CacheStats(Struct, frozen=True, forbid_unknown_fields=True):
    """The response cache's size: ``entries`` and ``bytes`` of their stored values."""

    entries: int = 0
    bytes: int = 0


class CachePut(Struct, frozen=True, forbid_unknown_fields=True):
    """What :meth:`Store.cache_put` did: whether the value was ``stored``, how
    many entries it dropped as ``expired`` and ``evicted`` for room (least
    recently used first), and the cache's size afterwards (``stats``)."""

    stored: bool
    expired: int = 0
    evicted: int = 0
    stats: CacheStats = CacheStats()


class Store(ABC):
    """Durable router state (see the module docstring). Every mutating method is
    its own atomic, durable transaction; methods are synchronous and small.
    Tenant data is keyed by tenant: streams, idempotency keys and event logs by
    ``(tenant, session_id, stream_id)`` or ``(tenant, key)``."""

    #: Whether this store's client may be called from several threads at once: a
    #: trio caller then makes its calls in store threads, off the event loop
    #: (:func:`atp_router.store.threads.off_loop`; the Redis store several routers share).
    threaded: bool = False

    # ------------------------------------------------------------ budget ledgers
    @abstractmethod
    def open_account(self, key: str, parent: str | None, limit: Allowance) -> None:
        """Create account ``key`` (or re-create a closed one, from zero) under
        ``parent`` with ``limit``. Raises :class:`StoreError` if an open account
        ``key`` exists, :class:`NotFound` if ``parent`` is not open."""

    @abstractmethod
    def close_account(self, key: str) -> None:
        """Mark account ``key`` closed (its spend stays in its ancestors; it is
        no longer part of :meth:`load_ledger`). Raises :class:`NotFound`."""

    @abstractmethod
    def reserve(self, reservation: Reservation) -> None:
        """Record open ``reservation`` (tokens, USD micros on ``reservation.key``);
        the same id again records an extend (the new totals). Raises
        :class:`NotFound` if the account is not open."""

    @abstractmethod
    def release(self, reservation_id: int) -> None:
        """Remove an open reservation with no charge. Raises :class:`NotFound`."""

    @abstractmethod
    def commit(self, reservation_id: int, charge: Charge) -> None:
        """In one transaction: add ``charge`` (committed tokens / USD micros and
        overage) to the reservation's account and every ancestor, and remove
        the reservation. Raises :class:`NotFound`."""

    @abstractmethod
    def set_limit(self, key: str, limit: Allowance) -> None:
        """Set account ``key``'s own limit. Raises :class:`NotFound`."""

    @abstractmethod
    def load_ledger(self) -> LedgerSnapshot:
        """The open accounts and reservations as a
        :class:`~atp_router.flow.budget.LedgerSnapshot` for
        :meth:`~atp_router.flow.budget.BudgetLedger.restore`; its ``next_id``
        is past every reservation id ever recorded (no lower than the ledger's,
        maybe higher: a store may mark ids used a block at a time)."""

    @abstractmethod
    def recover(self, owner: str | None = None) -> list[Reservation]:
        """Commit every open reservation (``owner``: every one that process
        left) at its reserved amount (the crash rule of the module docstring)
        and return them, in id order."""

    @abstractmethod
    def close_owned_accounts(self, owner: str | None = None) -> int:
        """Close every open account ``owner`` opened (``None``: every account
        with an owner) — a dead process's stream accounts; returns how many."""

    # ------------------------------------------- shared budget ledger (workers)
    @abstractmethod
    def open_shared(self, key: str, parent: str | None, limit: Allowance, *, owner: str | None) -> SharedResult:
        """:meth:`SharedAccounts.open_shared <atp_router.flow.budget.SharedAccounts.open_shared>`:
        a root account already open is adopted (its limit set, clamped); a child
        is created for ``owner``. Raises :class:`NotFound` (parent not open),
        :class:`StoreError` (child already open)."""

    @abstractmethod
    def close_shared(self, key: str) -> None:
        """Close child account ``key``. Raises :class:`NotFound`."""

    @abstractmethod
    def reserve_shared(self, key: str, tokens: int, usd_micros: int, *, owner: str,
                       request: str = "") -> SharedResult:
        """In one atomic step: if every account of ``key``'s chain has
        ``limit - committed - reserved >= amount`` on both axes, record a new
        reservation (a fresh id, never reused) for ``owner`` and hold it along
        the chain; else a refusal (nothing changed). ``request`` names the call
        for :meth:`cancel_reserve_shared` (``""``: none). Raises :class:`NotFound`."""

    @abstractmethod
    def cancel_reserve_shared(self, request: str) -> bool:
        """Undo the :meth:`reserve_shared` call named ``request`` whose answer
        was lost (a timeout): release its reservation if it was made, and make
        the call a no-op if the store runs it after this. True when one was
        released."""

    @abstractmethod
    def extend_shared(self, reservation: Reservation, tokens: int, usd_micros: int) -> SharedResult:
        """Atomically grow an open reservation by ``tokens`` / ``usd_micros`` if
        the chain can hold them, else a refusal. Raises :class:`NotFound`, or
        :class:`StoreError` when the store holds other amounts for it."""

    @abstractmethod
    def commit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                      request: str = "") -> SharedResult:
        """Atomically settle ``reservation`` with its actual usage: charged
        ``min(actual, the chain's room once its hold is lifted)`` per axis,
        the rest recorded as overage. ``request`` names the call for
        :meth:`recommit_shared` (``""``: none). Raises :class:`NotFound`."""

    @abstractmethod
    def recommit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                        request: str) -> SharedResult:
        """Settle again, at the actual usage, a commit whose first attempt (named
        ``request``) lost its answer: if that attempt was applied, its charge
        stands and is returned (nothing applied twice); else this one applies by
        :meth:`commit_shared`'s rule, and the first is refused if it runs later.
        Raises :class:`NotFound` (the reservation settled otherwise, and no
        first attempt on record)."""

    @abstractmethod
    def release_shared(self, reservation: Reservation) -> SharedResult:
        """Settle ``reservation`` with no charge. Raises :class:`NotFound`."""

    @abstractmethod
    def set_limit_shared(self, key: str, limit: Allowance, *, clamp: bool) -> SharedResult:
        """Atomically set ``key``'s own limit; below what it holds: clamped to
        it (``clamp``) or a refusal. Raises :class:`NotFound`."""

    @abstractmethod
    def shared_totals(self, key: str) -> SharedResult:
        """``key``'s chain as it stands. Raises :class:`NotFound`."""

    # ------------------------------------------- router leases (several routers)
    @abstractmethod
    def heartbeat(self, owner: str, *, ttl_ms: int, now_ms: int, info: Mapping[str, Any]) -> int:
        """(Re)set process ``owner``'s lease to expire ``ttl_ms`` ms from now,
        keeping ``info`` (JSON-able, e.g. ``{"url": ..., "started_ms": ...}``)
        with it. ``now_ms`` is the caller's Unix ms; a backend with a clock of
        its own (Redis) times the lease by it instead, so hosts never compare
        wall clocks. Returns the owner's lease epoch, the fencing token its
        writes carry (Redis; it grows when another router settles the owner);
        0 for a store without fencing tokens (SQLite: one host, whose
        ``--workers`` supervisor settles a worker only once its process has
        ended). Raises ``ValueError`` when ``ttl_ms < 1``."""

    @abstractmethod
    def live_owners(self, *, now_ms: int) -> dict[str, dict[str, Any]]:
        """``owner -> info`` of every lease that has not expired at ``now_ms``
        (Unix ms; Redis: by its own clock)."""

    def renew_lease(self, owner: str, *, ttl_ms: int, now_ms: int,
                    info: Mapping[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
        """:meth:`heartbeat` then :meth:`live_owners`: the lease epoch and the live
        owners (a cluster router's renewal). This default makes the two calls;
        Redis makes them one script, one round trip."""
        epoch = self.heartbeat(owner, ttl_ms=ttl_ms, now_ms=now_ms, info=info)
        return epoch, self.live_owners(now_ms=now_ms)

    @abstractmethod
    def drop_lease(self, owner: str) -> None:
        """Remove ``owner``'s lease (a clean shutdown); nothing if it has none."""

    @abstractmethod
    def lost_owners(self, *, now_ms: int) -> list[str]:
        """The owners (never ``None``), sorted, that still own an open
        reservation, an open account, an open stream or a quota entry
        (:meth:`quota_open`) and have no live lease
        at ``now_ms`` — router processes that died (or lost the store for
        longer than their lease) and must be settled."""

    @abstractmethod
    def claim(self, name: str, holder: str, *, ttl_ms: int, now_ms: int) -> bool:
        """An expiring mutual-exclusion claim on ``name``: True if ``holder``
        holds it now for ``ttl_ms`` ms (taken, or extended when it held it
        already), False while another holder's claim lasts. Used for "who
        settles lost router X" and "who re-runs idempotency key K". Raises
        ``ValueError`` when ``ttl_ms < 1``."""

    @abstractmethod
    def release_owned(self, owner: str) -> list[Reservation]:
        """Give back (charge nothing) every open reservation ``owner`` holds,
        each atomically along its account chain; returns them in id order. The
        lease-expiry rule of issue 12: the call is re-run elsewhere and that
        run is what gets charged — nothing twice (compare :meth:`recover`, the
        restart rule of a single router, which charges what was reserved).
        Raises ``ValueError`` for an empty ``owner``."""

    # ------------------------------------- shared tenant quotas (several routers)
    @abstractmethod
    def quota_open(self, ask: QuotaAsk, *, owner: str, now_ms: int, ttl_ms: int) -> QuotaGrant:
        """Decide a SYN against its tenant's stream quota and open rate across
        every process on the store (:func:`atp_router.flow.quota.decide`), in one
        atomic step: the tenant's expired entries dropped, the decision made,
        and when admitted the entry ``(owner, ask.stream_id)`` held until
        ``now_ms + ttl_ms`` and the rate moved. ``now_ms``: the caller's Unix ms
        (Redis decides by its own clock, so routers never compare theirs).
        Raises ``ValueError`` for an empty ``owner`` or ``ttl_ms < 1``."""

    @abstractmethod
    def quota_close(self, tenant: str, stream_id: str, *, owner: str) -> bool:
        """The stream ``stream_id`` of ``tenant`` that ``owner`` opened closed:
        its quota entry is removed. False: it held none (settled, expired)."""

    @abstractmethod
    def quota_renew(self, owner: str, held: Collection[tuple[str, str]], *, now_ms: int, ttl_ms: int) -> int:
        """Hold the quota entries of ``owner`` named in ``held`` (``(tenant,
        stream id)``: its streams still running) until ``now_ms + ttl_ms`` and
        remove its others (an entry a timed-out :meth:`quota_open` made after its
        caller gave up on it); returns how many it holds."""

    @abstractmethod
    def quota_release_owned(self, owner: str) -> int:
        """Remove every quota entry of ``owner`` (a process stopped or lost:
        its streams are interrupted); returns how many."""

    @abstractmethod
    def quota_open_count(self, tenant: str, *, now_ms: int) -> int:
        """``tenant``'s unexpired quota entries, every owner (what :meth:`quota_open` counts)."""

    @abstractmethod
    def rate_take(self, key: str, *, per_s: float, burst: int, now_ms: int) -> int | None:
        """One take of the shared GCRA bucket ``key`` (:func:`atp_router.flow.quota.gcra`:
        ``per_s`` a second, bursts of ``burst``), atomically across processes:
        None when taken, else the ms until one would pass (nothing taken).
        Redis times it by its own clock. Raises ``ValueError`` unless
        ``per_s > 0`` and ``burst >= 1``."""

    def rate_take_upto(self, key: str, n: int, *, per_s: float, burst: int, now_ms: int) -> tuple[int, int | None]:
        """Up to ``n`` takes of :meth:`rate_take`'s bucket ``key`` in one atomic
        step (a slice a process hands out locally: the learning rate across
        routers, :meth:`SharedQuotas.may_learn
        <atp_router.runtime.dataplane.quotas.SharedQuotas.may_learn>`):
        ``(taken, None)`` with ``1 <= taken <= n`` (as many as the bucket
        holds), or ``(0, ms until one would pass)``. This default takes one;
        Redis takes the slice in one script. Raises ``ValueError`` as
        :meth:`rate_take`, and for ``n < 1``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        wait = self.rate_take(key, per_s=per_s, burst=burst, now_ms=now_ms)
        return (1, None) if wait is None else (0, wait)

    def rate_take_upto_then(self, key: str, n: int, then: Callable[[tuple[int, int | None]], None], *, per_s: float,
                            burst: int, now_ms: int) -> None:
        """:meth:`rate_take_upto`, its answer handed to ``then`` — at once here;
        inside :meth:`batch` on a store that buffers (Redis) it goes in the
        batch's round trip and ``then`` is called when that answers (not at
        all if the batch failed as a whole, or the take was refused with an
        error: nothing was taken). So a slice can be refilled in a group commit
        the router makes anyway (:meth:`SharedQuotas.may_learn
        <atp_router.runtime.dataplane.quotas.SharedQuotas.may_learn>`). Raises
        as :meth:`rate_take_upto`."""
        then(self.rate_take_upto(key, n, per_s=per_s, burst=burst, now_ms=now_ms))

    @abstractmethod
    def update(self, key: str, fn: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Atomic read-modify-write of kv ``key``: ``fn(current value or None)``
        gives the new value (``None`` deletes the key); when another process
        changed the key meanwhile, ``fn`` is called again on the new value
        (keep it pure). Returns the value stored (``None``: deleted)."""

    # ------------------------------------------- replay nonces (signed frames)
    @abstractmethod
    def record_nonce(self, tenant: str, kid: str, nonce: str, *, now_ms: int, expires_ms: int,
                     max_per_tenant: int) -> bool:
        """Atomically record that ``tenant`` used ``nonce`` in a frame signed with
        key ``kid`` (spec §11 replay), kept until ``expires_ms`` (Unix ms: the end
        of the frame's timestamp window; the caller adds its clock slack). Returns
        True when it was fresh (now recorded), False when an unexpired record of
        the same ``(tenant, kid, nonce)`` exists — a replay, nothing changed. The
        key is the three strings as such: no separator a client-chosen id could
        forge. ``now_ms`` is the caller's Unix ms: records with ``expires_ms <=
        now_ms`` are gone for it, and up to :data:`NONCE_SWEEP` of them are swept
        by the call.

        Raises :class:`StoreLimitError` (``limit`` ``"nonces_per_tenant"``, nothing
        recorded) when ``tenant`` already holds ``max_per_tenant`` unexpired
        nonces, ``ValueError`` for an empty or over-long (:data:`NONCE_FIELD_MAX`)
        field, ``expires_ms <= now_ms`` or ``max_per_tenant < 1``, and
        :class:`StoreUnavailable` as every call (the caller must then refuse
        the frame: it cannot tell a replay)."""

    # ------------------------------------------------------------------ streams
    @abstractmethod
    def put_stream(self, record: StreamRecord) -> None:
        """Store ``record``; a record with the same ``(tenant, session_id,
        stream_id)`` is replaced and its events dropped (a finished stream's
        id reused)."""

    @abstractmethod
    def close_stream(self, tenant: str, session_id: str, stream_id: str, *, reason: str, closed_ms: int) -> None:
        """Mark the stream ``"closed"`` with ``reason`` at ``closed_ms`` (Unix ms).
        Raises :class:`NotFound`."""

    @abstractmethod
    def get_stream(self, tenant: str, session_id: str, stream_id: str) -> StreamRecord | None:
        """The stream's record, or ``None`` (also for another tenant's stream)."""

    @abstractmethod
    def find_idempotent(self, tenant: str, idempotency_key: str) -> StreamRecord | None:
        """The newest stream ``tenant`` opened with ``idempotency_key``, or ``None``."""

    @abstractmethod
    def find_stream(self, tenant: str, stream_id: str) -> StreamRecord | None:
        """``tenant``'s newest stream ``stream_id`` (any session), or None; another
        tenant's stream of that id is never returned (no oracle)."""

    @abstractmethod
    def append_event(self, tenant: str, session_id: str, stream_id: str, event_id: int, type: str,
                     frame: bytes) -> None:
        """Append event ``event_id`` (the next id of the stream's log, from 1) of
        ``type`` with the encoded ``frame``; allowed in every state (the RST of
        an interrupted stream is appended after :meth:`interrupt_open_streams`).
        Appending exactly the event already stored under ``event_id`` (type and
        frame) changes nothing and raises nothing: a retried write whose first
        attempt was applied (a timeout of a shared store). Raises
        :class:`NotFound` for an unknown stream, :class:`StoreLimitError` when
        the frame or the stream's event count passes the store's bounds,
        :class:`StoreError` when another event is stored under ``event_id``."""

    def append_events(self, tenant: str, session_id: str, stream_id: str,
                      events: Sequence[tuple[int, str, bytes]]) -> None:
        """:meth:`append_event` for each ``(event_id, type, frame)`` of ``events``
        in order (consecutive ids of one stream: a group commit's run), stopping
        at the first that raises (the ones before it stay appended; inside a
        :meth:`batch` whose errors are raised when it ends, as Redis', every one
        is tried). A store may write them in fewer statements; the outcome is the
        same."""
        for event_id, type, frame in events:
            self.append_event(tenant, session_id, stream_id, event_id, type, frame)

    @abstractmethod
    def events(self, tenant: str, session_id: str, stream_id: str, after: int = 0) -> list[StoredEvent]:
        """The stream's events with id > ``after``, in id order (empty if unknown)."""

    @abstractmethod
    def interrupt_open_streams(self, reason: str, *, now_ms: int, owner: str | None = None) -> list[StreamRecord]:
        """At start-up, or when process ``owner`` died: every ``"open"`` stream
        (of ``owner``) becomes ``"interrupted"`` with ``reason`` at ``now_ms``;
        returns the updated records."""

    @abstractmethod
    def expire(self, before_ms: int) -> int:
        """Drop streams closed or interrupted before ``before_ms`` (Unix ms) with
        their events, and closed ledger accounts without open children;
        returns how many streams were dropped."""

    # --------------------------------------------------------------------- RIB
    @abstractmethod
    def save_rib(self, version: int, text: str, source: str, actor: str) -> None:
        """Make RIB ``version`` (its YAML ``text``, where it came from, who set
        it) the active one. Older versions may be pruned."""

    @abstractmethod
    def active_rib(self) -> tuple[int, str, str] | None:
        """``(version, text, source)`` of the active RIB, or ``None``."""

    @abstractmethod
    def active_rib_version(self) -> int | None:
        """The active RIB's version, or ``None`` (cheap: polled by workers)."""

    @abstractmethod
    def next_rib_version(self) -> int:
        """A RIB version no process has used (above every stored one): the
        number a reload compiles its generation with."""

    # ------------------------------------------------------------------- audit
    @abstractmethod
    def append_audit(self, record: AuditRecord) -> None:
        """Append ``record`` (append-only; its ``seq`` must be new, else
        :class:`StoreError`)."""

    @abstractmethod
    def append_audit_chained(self, build: Callable[[int, str], AuditRecord]) -> AuditRecord:
        """Append ``build(head_seq, head_hash)`` — the record chained to the
        stored head (``(0, GENESIS)`` when empty) — in one atomic step, so
        several processes extend one chain; returns it."""

    def append_audit_chained_then(self, build: Callable[[int, str], AuditRecord],
                                  then: Callable[[AuditRecord], None]) -> None:
        """:meth:`append_audit_chained`, the record handed to ``then`` once stored
        (a store may buffer it in its :meth:`batch`: the Redis store)."""
        then(self.append_audit_chained(build))

    @abstractmethod
    def audit_records(self, after: int = 0, limit: int | None = None) -> list[AuditRecord]:
        """Audit records with ``seq`` > ``after``, in ``seq`` order, at most
        ``limit`` of them (``None``: all)."""

    @abstractmethod
    def audit_head(self) -> AuditRecord | None:
        """The audit record with the highest ``seq``, or ``None``."""

    @abstractmethod
    def audit_checkpoint(self) -> AuditCheckpoint | None:
        """The latest MACed audit checkpoint, or ``None``."""

    @abstractmethod
    def audit_checkpoints(self) -> list[AuditCheckpoint]:
        """Every stored audit checkpoint, in ``seq`` order (each narrows where a
        rewritten chain went wrong)."""

    @abstractmethod
    def put_audit_checkpoint(self, checkpoint: AuditCheckpoint) -> None:
        """Store a new audit checkpoint (the latest is the one with the highest
        ``seq``)."""

    # ---------------------------------------------------------------------- kv
    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The router's value under ``key``, or ``None``."""

    @abstractmethod
    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` of the key-value area whose key starts with ``prefix``."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Set the router's value under ``key``."""

    # ------------------------------------------------------- response cache
    @abstractmethod
    def cache_get(self, key: bytes, *, now_ms: int) -> bytes | None:
        """The response-cache value under ``key`` (:mod:`atp_router.policy.cache`), or
        ``None`` when there is none or it expired (``expires_ms <= now_ms``,
        Unix ms). A hit marks the entry used at ``now_ms`` (eviction is least
        recently used first)."""

    @abstractmethod
    def cache_put(self, key: bytes, value: bytes, *, tenant: str | None, now_ms: int, expires_ms: int,
                  max_bytes: int, tenant_max_bytes: int | None = None) -> CachePut:
        """In one transaction: store ``value`` under ``key`` (replacing it) for
        ``tenant`` (None: a shared entry) until ``expires_ms``, then drop every
        expired entry and, least recently used first, as many others as it takes
        to keep the stored values within ``max_bytes`` bytes. A value larger than
        ``max_bytes`` is not stored (``CachePut.stored`` false).

        With ``tenant_max_bytes`` (the per-tenant budget): ``tenant`` is the
        entry's owner, the tenant whose call made it; only that tenant's own
        least recently used entries are dropped, until its entries and the value
        fit in ``tenant_max_bytes``, and the value is not stored when the whole
        cache could then not hold it within ``max_bytes``: another tenant's entry
        is never evicted."""

    @abstractmethod
    def cache_drop(self, key: bytes) -> None:
        """Remove the entry under ``key`` if there is one (a value that did not decode)."""

    @abstractmethod
    def cache_stats(self) -> CacheStats:
        """How many entries the response cache holds and their values' bytes."""

    # -------------------------------------------------------------- lifecycle
    @abstractmethod
    def batch(self) -> AbstractContextManager[None]:
        """Group commit: the mutating calls made inside the block are durable
        together when it ends (a call that raised is undone alone). Backends
        without transactions make each call durable on its own (the default).
        A backend that sends the block's writes when it ends (Redis) raises
        their errors (:class:`NotFound`, :class:`StoreLimitError`, …) there
        rather than at the call; an exception inside the block drops them."""
        return nullcontext()

    @property
    def available(self) -> bool:
        """Whether the store answered its last call (False while a network
        store is unreachable: calls raise :class:`StoreUnavailable` at once
        for a short back-off). Always True for an embedded store."""
        return True

    def describe(self) -> str:
        """Where the state lives, for logs and the status page (no secrets:
        a URL's password is masked)."""
        return type(self).__name__

    def close(self) -> None:
        """Release the backend (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_nonce_args(tenant: str, kid: str, nonce: str, now_ms: int, expires_ms: int, max_per_tenant: int) -> None:
    """The argument checks of :meth:`Store.record_nonce` (every backend's):
    ``ValueError`` naming the first one that fails."""
    for name, v in (("tenant", tenant), ("kid", kid), ("nonce", nonce)):
        if not isinstance(v, str) or not 0 < len(v) <= NONCE_FIELD_MAX:
            raise ValueError(f"record_nonce: {name} must be a string of 1-{NONCE_FIELD_MAX} characters")
    if expires_ms <= now_ms:
        raise ValueError(f"record_nonce: expires_ms ({expires_ms}) must be after now_ms ({now_ms})")
    if max_per_tenant < 1:
        raise ValueError(f"record_nonce: max_per_tenant must be >= 1, got {max_per_tenant}")


def check_quota_args(ask: QuotaAsk | None, owner: str, ttl_ms: int) -> None:
    """The argument checks of :meth:`Store.quota_open` / :meth:`Store.quota_renew`
    (every backend's): ``ValueError`` naming the first one that fails."""
    if not owner:
        raise ValueError("quota: owner must be a non-empty string")
    if ttl_ms < 1:
        raise ValueError(f"quota: ttl_ms must be >= 1, got {ttl_ms}")
    if ask is not None:
        if ask.max_streams < 0:
            raise ValueError(f"quota: max_streams must be >= 0, got {ask.max_streams}")
        check_rate_args(ask.per_s, ask.burst)


def check_rate_args(per_s: float, burst: int) -> None:
    """The argument checks of a GCRA rate (:meth:`Store.rate_take`)."""
    if not per_s > 0 or burst < 1:
        raise ValueError(f"rate: per_s must be > 0 and burst >= 1, got {per_s} and {burst}")


def nonce_limit_error(tenant: str, max_per_tenant: int) -> StoreLimitError:
    """The :class:`StoreLimitError` of a tenant holding ``max_per_tenant`` nonces."""
    return StoreLimitError("nonces_per_tenant", f"tenant {tenant!r} already holds {max_per_tenant} unexpired nonces "
                                                "of signed frames (the store's bound per tenant)")


class StoreJournal:
    """A :class:`~atp_router.flow.budget.LedgerJournal` writing every ledger mutation to
    ``store``: ``BudgetLedger(journal=StoreJournal(store))``. Store errors
    propagate to the ledger's caller, but for a store that cannot take writes
    for a while (:class:`StoreUnavailable`: :class:`StoreFull`, a full disk):

    * a settlement of spend already made or held — commit, release, extend,
      close, limit change — is kept (:attr:`pending`, in order) and written
      before the next mutation, or by :meth:`flush` (the router calls it twice
      a second), once the store takes writes again: nothing spent is lost
      while the process lives; if it dies first, its reservations are in the
      store and the restart commits them at their reserved amount, as for any
      call in flight at a crash;
    * new spend — :meth:`on_open`, :meth:`on_reserve` — first writes what is
      kept and raises :class:`StoreUnavailable` while it cannot: the ledger
      undoes it (:class:`~atp_router.flow.budget.BudgetLedger`) and the caller
      refuses it.

    With :attr:`defer` set (the router's group commit,
    :meth:`StreamPersistence.defer <atp_router.runtime.dataplane.persistence.StreamPersistence.defer>`),
    the settlements at a stream's end — commit, release, close — are not
    written alone but in the next group commit, in the same transaction as the
    events queued with them (issue 25 item 2): a call's commit is made before
    its stream's FINAL is queued, so the FINAL is sent only once its commit is
    stored, and a crash before that leaves the reservation in the store (the
    restart commits it at its reserved amount; no FINAL was sent)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[Callable[[], None]] = []
        self._fault: StoreUnavailable | None = None
        #: ``defer(write, done) -> bool``: hand a settlement to the next group commit
        #: (False: none runs, it is written at once), ``done()`` called once it is
        #: stored. None: every settlement written at once.
        self.defer: Callable[[Callable[[], object], Callable[[], None] | None], bool] | None = None
        #: Write the group commit now (with :attr:`defer`): an account opened again
        #: under a key whose close is still deferred has that close stored first.
        self.flush_deferred: Callable[[], object] | None = None
        #: Account keys whose close waits in the group commit.
        self._closing: set[str] = set()

    @property
    def pending(self) -> int:
        """Settlements kept until the store takes writes again."""
        return len(self._pending)

    def flush(self) -> bool:
        """Write the kept settlements in order; False while the store cannot take
        them (they stay kept). One the store refuses otherwise is dropped with
        its error logged (its reservation stays held in the store; a restart
        commits it at its reserved amount)."""
        while self._pending:
            try:
                self._pending[0]()
            except StoreUnavailable as e:
                self._fault = e
                return False
            except StoreError:
                _log.exception("budget ledger: a kept settlement was refused by the store; dropped")
            self._pending.pop(0)
        self._fault = None
        return True

    def _spend(self, write: Callable[[], None]) -> None:
        if not self.flush():
            assert self._fault is not None
            raise self._fault
        write()

    def _settle(self, write: Callable[[], None]) -> None:
        if self.flush():
            try:
                write()
                return
            except StoreUnavailable as e:
                self._fault = e
                _log.error("budget ledger: %s; the settlement is kept and written when the store takes writes", e)
        self._pending.append(write)

    def _settle_later(self, write: Callable[[], None]) -> None:
        """A settlement at a stream's end: in the next group commit (:attr:`defer`)
        unless settlements are kept (they go first, in order), else as :meth:`_settle`."""
        if self.defer is not None and not self._pending and self.defer(write, None):
            return
        self._settle(write)

    def on_open(self, key: str, parent: str | None, limit: Allowance) -> None:
        if key in self._closing and self.flush_deferred is not None:
            self.flush_deferred()  # a stream id reused at once: its old account's close is stored first
        self._spend(lambda: self.store.open_account(key, parent, limit))

    def on_close(self, key: str) -> None:
        def close() -> None:
            self.store.close_account(key)

        if self.defer is not None and not self._pending:
            self._closing.add(key)
            if self.defer(close, lambda: self._closing.discard(key)):
                return
            self._closing.discard(key)
        self._settle(close)

    def on_reserve(self, reservation: Reservation) -> None:
        self._spend(lambda: self.store.reserve(reservation))

    def on_extend(self, reservation: Reservation) -> None:
        self._settle(lambda: self.store.reserve(reservation))

    def on_commit(self, reservation: Reservation, charge: Charge) -> None:
        self._settle_later(lambda: self.store.commit(reservation.id, charge))

    def on_release(self, reservation: Reservation) -> None:
        self._settle_later(lambda: self.store.release(reservation.id))

    def on_set_limit(self, key: str, limit: Allowance) -> None:
        self._settle(lambda: self.store.set_limit(key, limit))
