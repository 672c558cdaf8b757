"""The stream table (trio side): every stream the router carries and its
lifecycle (spec §4.4, §8). One stream (:class:`~atp_router.runtime.dataplane.stream.StreamCtx`)
and what closing it returns (:class:`~atp_router.runtime.dataplane.stream.Closed`)
are in :mod:`~atp_router.runtime.dataplane.stream`, its outbound log in
:mod:`~atp_router.runtime.dataplane.eventlog`, the table's writes to the store
and reads from it in :mod:`~atp_router.runtime.dataplane.persistence`.

The table never calls back into the router: what closes a stream returns its
``Closed`` to the caller — :meth:`StreamTable.closed` to the stream, which
returns it to whoever closed it; :meth:`StreamTable.abandon` and
:meth:`StreamTable.handle_timer` (the streams its timers reset) to theirs — and
the caller acts on it. The one thing the table asks of another part is the
budget ledger, a layer below it (:class:`Accounts`): a stream's spend at close,
and closing its account as it leaves memory.

:class:`StreamTable` — the streams and sessions of every tenant, keyed by
**(tenant, session_id, stream_id)** (spec §11 "streams are scoped to the
authenticated principal"). Ids are chosen by clients, so a session or stream id
another tenant uses is simply another session or stream: lookups never cross
tenants, and nothing tells a tenant whether an id exists elsewhere. Within a
tenant a stream id is unique (the HTTP API addresses a stream by its id alone).
The table owns:

==================  =============================================================
lifecycle           open count (router-wide ``max_streams``), closing, removal
idempotency         ``(tenant, idempotency_key)`` → the stream it opened (§8)
resumption          :meth:`StreamTable.resumable`
retention           a closed stream stays in memory for ``retain_closed_s``
                    (one that delivered no result — refused, reset or expired
                    before a PARTIAL or FINAL — for ``REFUSED_RETAIN_S`` at
                    most), at most ``retain_closed_max`` closed streams per
                    tenant and ``retain_closed_bytes`` of closed logs router-wide
                    (the oldest go first); then it leaves memory (its ledger
                    account is closed) and a read of it is served from the
                    store (:meth:`StreamTable.restore`: the same events, the
                    same bytes)
grace               a stream left without a follower (*detached*) is reset with
                    ``ETIMEOUT`` after ``resume_grace_s``
idle expiry         a stream opened without a task (SYN without payload) that
                    gets none within ``idle_task_s`` is reset with ``ETIMEOUT``
refused SYNs        remembered (bounded) so their late frames are dropped;
                    nothing else of them stays (not even their session)
idle trim           with no stream open, once freed memory settled:
                    ``idle_trim()`` (:func:`atp_router.runtime.dataplane.memory.trim`: a full
                    collection and ``malloc_trim``), at most every 10 s
==================  =============================================================

Timed work follows aioquic's shape: :meth:`StreamTable.get_timer` is the next
deadline (trio seconds), :meth:`StreamTable.handle_timer` does what is due at
``now`` and returns the streams it closed; :meth:`StreamTable.next_timers`
sleeps until then (or until an earlier deadline is scheduled) and handles it,
so the router's loop is ``for closed in await table.next_timers(): ...``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import trio

from atp_router.flow.budget import AccountState
from atp_router.runtime.dataplane.memory import TRIM_EVERY_S, IdleTrim
from atp_router.runtime.dataplane.persistence import StreamPersistence
from atp_router.runtime.dataplane.stream import (
    Closed,
    StreamCtx,
    StreamKey,
    stream_account,
)
from atp_router.security.identity import Identity
from atp_router.store.base import Store, StoredEvent
from atp_router.wire import session as S
from atp_router.wire.errors import ATPError, ErrorCode, LocalProtocolError
from atp_router.wire.frame import Budget, QoS

if TYPE_CHECKING:
    from atp_router.observability.metrics import RouterMetrics

__all__ = ["DEFAULT_RETAIN_CLOSED_BYTES", "REFUSED_RETAIN_S", "Accounts", "StreamTable"]

log = logging.getLogger("atp_router.runtime")

#: Refused SYNs remembered for dropping their late frames (bounded memory).
_REFUSED_KEPT = 4096
#: A closed stream whose spend is still settling is tried again this much later, s.
_SETTLE_RETRY_S = 1.0
#: A closed stream that delivered no result (no PARTIAL or FINAL: refused at
#: dispatch, reset or expired first) stays in memory at most this long, s; later
#: reads and resumptions of it are served from the store.
REFUSED_RETAIN_S = 1.0
#: Default router-wide budget of retained closed logs, bytes (``retain_closed_bytes``).
DEFAULT_RETAIN_CLOSED_BYTES = 16 * 2**20
#: The router trims its memory this long after it went idle, s (atp_router.runtime.dataplane.memory).
_IDLE_TRIM_AFTER_S = 2.0
#: Timers of removed streams are purged once more than this many streams left
#: the table (and their timers, up to ~3 each, may be half of them).
_TIMERS_PURGE_AT = 256


class Accounts(Protocol):
    """What the table asks of the budget ledger
    (:class:`~atp_router.flow.budget.BudgetLedger`): a stream's spend at close,
    and closing its account as it leaves memory."""

    def has(self, key: str) -> bool:
        """Whether account ``key`` is open."""
        ...

    def state(self, key: str) -> AccountState:
        """Snapshot of open account ``key``."""
        ...

    def close(self, key: str) -> AccountState:
        """Close account ``key``; ``ValueError`` while it has open reservations."""
        ...


class StreamTable:
    """The streams and sessions of every tenant (module docstring).

    A closed stream's ledger account (in ``accounts``) is closed as it leaves
    the table; it stays while that is not yet possible (a cancelled call has
    not committed its spend: tried again later). Durations are in seconds of
    trio time; ``retain_closed_bytes`` bounds the bytes of the closed logs kept
    in memory (:attr:`EventLog.nbytes`), router-wide, the oldest closed going
    first. Nothing of the router is passed in: closing returns :class:`Closed`.
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        max_streams: int,
        retain_closed_s: float,
        retain_closed_max: int,
        resume_grace_s: float,
        idle_task_s: float,
        hb_interval_s: float,
        accounts: Accounts,
        store: Store | None = None,
        retain_closed_bytes: int = DEFAULT_RETAIN_CLOSED_BYTES,
        idle_trim: Callable[[], float] | None = None,
    ):
        self.metrics = metrics
        #: The durable half: every stream, its events and its close in ``store``.
        self.persistence = StreamPersistence(store)
        self.max_streams = max_streams
        self.retain_closed_s = retain_closed_s
        self.retain_closed_max = retain_closed_max
        self.retain_closed_bytes = retain_closed_bytes
        self._idle = IdleTrim(idle_trim)
        self.resume_grace_s = resume_grace_s
        self.idle_task_s = idle_task_s
        self.hb_interval_s = hb_interval_s
        self.accounts = accounts
        #: Streams not yet closed (the table also keeps closed ones for replay).
        self.open_count = 0
        #: Open streams per tenant (its ``max_streams`` quota, spec §11 AuthZ).
        self.tenant_open: Counter[str] = Counter()
        self._streams: dict[StreamKey, StreamCtx] = {}
        #: (tenant, stream_id) → stream: a stream id is unique within its tenant.
        self._by_id: dict[tuple[str, str], StreamCtx] = {}
        self._by_account: dict[str, StreamCtx] = {}
        self._sessions: dict[tuple[str, str], S.Session] = {}
        self._session_streams: Counter[tuple[str, str]] = Counter()
        self._idempotency: dict[tuple[str, str], StreamCtx] = {}
        self._refused: OrderedDict[StreamKey, None] = OrderedDict()
        #: tenant → its closed streams still in the table, oldest first.
        self._closed: dict[str, OrderedDict[StreamCtx, None]] = {}
        #: Every closed stream in the table, oldest first → its log's bytes as
        #: counted in :attr:`retained_bytes` (the router-wide byte budget).
        self._retained: dict[StreamCtx, int] = {}
        #: Bytes of the closed logs in the table (``retain_closed_bytes`` bounds it).
        self.retained_bytes = 0
        #: (deadline, seq, kind, stream key): timed work, checked again when due (lazy
        #: removal). Keys, not streams: a removed stream's log is not kept alive here.
        self._timers: list[tuple[float, int, str, StreamKey | None]] = []
        #: Streams removed since the timers were last purged (:meth:`_purge_timers`).
        self._gone = 0
        self._seq = itertools.count()
        self._sleeping_until = math.inf
        self._changed = trio.Event()
        self._sweeping = False

    # ------------------------------------------------------------------ lookups
    def get(self, tenant: str, session_id: str, stream_id: str) -> StreamCtx | None:
        """The stream ``stream_id`` of ``tenant``'s session ``session_id``, or None."""
        return self._streams.get((tenant, session_id, stream_id))

    def find(self, tenant: str, stream_id: str) -> StreamCtx | None:
        """``tenant``'s stream ``stream_id`` (in whichever of its sessions), or
        None — also when another tenant has a stream of that id."""
        return self._by_id.get((tenant, stream_id))

    def by_account(self, account: str) -> StreamCtx | None:
        """The stream whose ledger account (and QoS ticket name) is ``account``."""
        return self._by_account.get(account)

    def resumable(self, tenant: str, idempotency_key: str) -> StreamCtx | None:
        """The stream ``tenant`` opened with ``idempotency_key`` (open, or closed
        and retained), or None (spec §8 resumption)."""
        return self._idempotency.get((tenant, idempotency_key))

    def values(self) -> Iterator[StreamCtx]:
        """Every stream in the table, of every tenant (open and retained closed)."""
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def session_count(self) -> int:
        """Sessions in the table, of every tenant (one with no stream left goes at the next sweep)."""
        return len(self._sessions)

    # ------------------------------------------------------------------ sessions
    def session(self, tenant: str, session_id: str, *, now: float) -> S.Session:
        """``tenant``'s session ``session_id``, created on first use. Router
        sessions outlive connections (streams are resumable, §8), so the session
        machine never declares its peer dead (``hb_timeout`` infinite): liveness
        is per connection, in the WebSocket ingress."""
        key = (tenant, session_id)
        sess = self._sessions.get(key)
        if sess is None:
            sess = self._sessions[key] = S.Session(
                S.Role.ROUTER, session_id, now=now, hb_interval=self.hb_interval_s, hb_timeout=math.inf,
            )
            if not self._sweeping:
                self._sweeping = True
                self._schedule(now + self._sweep_s, "sweep", None)
        return sess

    def get_session(self, tenant: str, session_id: str) -> S.Session | None:
        """``tenant``'s session ``session_id`` if it exists."""
        return self._sessions.get((tenant, session_id))

    @property
    def _sweep_s(self) -> float:
        return max(min(self.retain_closed_s, 30.0), 1.0)

    # ------------------------------------------------------------------ lifecycle
    def admit(self, tenant: str, stream_id: str) -> None:
        """Check that ``tenant`` may open a stream ``stream_id`` now (at SYN,
        before anything is reserved for it). A closed stream of the tenant with
        that id is removed (its retained log is dropped). Raises
        :class:`ATPError` ``EWINDOW`` when the router holds ``max_streams`` open
        streams; :class:`LocalProtocolError` ``EPROTO`` when the tenant has an
        open stream of that id, or a closed one still settling its spend."""
        if self.open_count >= self.max_streams:
            raise ATPError(ErrorCode.EWINDOW, f"router is at its limit of {self.max_streams} open streams")
        old = self._by_id.get((tenant, stream_id))
        if old is None:
            return
        if old.closed_at is None:
            raise LocalProtocolError(ErrorCode.EPROTO, f"stream_id {stream_id!r} is already in use")
        if not self._remove(old):
            raise LocalProtocolError(ErrorCode.EPROTO, f"stream_id {stream_id!r} is still settling its spend; retry")

    @contextlib.contextmanager
    def opening(self, tenant: str, session_id: str) -> Iterator[None]:
        """A SYN that passed :meth:`admit` and waits on the store: it counts as
        open (the table's room, its tenant's streams) and its session stays."""
        self.open_count += 1
        self.tenant_open[tenant] += 1
        self._session_streams[(tenant, session_id)] += 1
        try:
            yield
        finally:
            self.open_count -= 1
            _decrement(self.tenant_open, tenant)
            _decrement(self._session_streams, (tenant, session_id))

    def insert(self, ctx: StreamCtx) -> None:
        """Add a stream just accepted (after :meth:`admit`): it counts as open,
        its idempotency key (if any) now resumes it, and it is reset if it gets
        no task within ``idle_task_s``."""
        key = ctx.key
        self._streams[key] = ctx
        self._by_id[(key[0], key[2])] = ctx
        self._by_account[ctx.account] = ctx
        self._session_streams[key[:2]] += 1
        if ctx.idempotency_key is not None:
            self._idempotency[(key[0], ctx.idempotency_key)] = ctx
        self.open_count += 1
        self.tenant_open[key[0]] += 1
        self.persistence.persist_open(ctx)
        self.metrics.open_streams.inc()
        self._schedule(ctx.started + self.idle_task_s, "idle", key)

    def refused(self, tenant: str, session_id: str, stream_id: str) -> None:
        """A SYN was refused: its stream's late frames are dropped (bounded
        memory). Nothing else of it stays: a session the SYN created that holds
        no stream (an HTTP open makes one each) is dropped now, not at the next
        sweep; the same id makes a new one, as after a sweep."""
        self._refused[(tenant, session_id, stream_id)] = None
        if len(self._refused) > _REFUSED_KEPT:
            self._refused.popitem(last=False)
        skey = (tenant, session_id)
        sess = self._sessions.get(skey)
        if sess is not None and skey not in self._session_streams and not sess.open_streams:
            del self._sessions[skey]

    def was_refused(self, tenant: str, session_id: str, stream_id: str) -> bool:
        return (tenant, session_id, stream_id) in self._refused

    def closed(self, ctx: StreamCtx) -> Closed:
        """``ctx`` closed (FIN/RST): it stops counting as open and stays in
        memory for ``retain_closed_s`` (:data:`REFUSED_RETAIN_S` at most if it
        delivered no result) — unless its tenant holds ``retain_closed_max``
        closed streams or the router ``retain_closed_bytes`` of closed logs:
        then the oldest leave first. A stream leaves memory only once nobody
        reads it and its events and close are in the store (a read is then
        served from there); until then it stays, over the bounds if need be.
        Returns what its closer acts on (:class:`Closed`: its last frame and
        spend read before it may leave memory, its log compacted)."""
        self.persistence.persist_close(ctx)
        self.open_count -= 1
        if not self.open_count:
            self._want_trim(ctx.closed_at)
        _decrement(self.tenant_open, ctx.tenant)
        self.metrics.open_streams.dec()
        assert ctx.closed_at is not None
        self._keep(ctx, ctx.closed_at)
        events = ctx.log.events
        closed = Closed(ctx, events[-1].frame if events else None,
                        self.accounts.state(ctx.account) if self.accounts.has(ctx.account) else None,
                        release_gen=not ctx.task_started)
        if ctx.followers == 0:
            ctx.log.compact()  # else when its last follower leaves (StreamCtx.detach)
        self.bound_retention(ctx)
        return closed

    def _keep(self, ctx: StreamCtx, now: float) -> None:
        """Start retaining closed ``ctx`` (closed at, or read back at, ``now``)."""
        retained = self._closed.setdefault(ctx.tenant, OrderedDict())
        retained[ctx] = None
        age = self.retain_closed_s if ctx.log.delivered_result else min(self.retain_closed_s, REFUSED_RETAIN_S)
        ctx.retain_until = now + age
        self._schedule(ctx.retain_until, "retain", ctx.key)

    def bound_retention(self, ctx: StreamCtx) -> None:
        """Count closed ``ctx``'s log in the byte budget (again when it was
        compacted, or its last reader left), then let the oldest closed streams
        go while its tenant is over ``retain_closed_max`` or the router over
        ``retain_closed_bytes``."""
        if self._streams.get(ctx.key) is not ctx:
            return  # already gone (a follower compacted it after it left)
        # A log still being sent counts once its last reader left and it is
        # compacted (a fraction of its frames' size): the bound is on what is kept.
        size = ctx.log.nbytes if ctx.followers == 0 else 0
        self.retained_bytes += size - self._retained.get(ctx, 0)
        self._retained[ctx] = size
        tenant = self._closed.get(ctx.tenant)
        if tenant is not None and len(tenant) > self.retain_closed_max:
            self._evict(tenant, len(tenant) - self.retain_closed_max, math.inf)
        if self.retained_bytes > self.retain_closed_bytes:
            self._evict(self._retained, math.inf, self.retained_bytes - self.retain_closed_bytes)
        self.metrics.retained_bytes.set(self.retained_bytes)
        self.metrics.retained_streams.set(len(self._retained))

    def _evict(self, oldest_first: Any, count: float, nbytes: float) -> None:
        """Remove closed streams, oldest first, until ``count`` streams or
        ``nbytes`` bytes of logs left memory; skips those that may not leave yet
        (:meth:`_may_leave`)."""
        pending = self.persistence.unstored()
        gone: list[StreamCtx] = []
        for old in oldest_first:
            if count <= 0 or nbytes <= 0:
                break
            if old.closed_at is not None and self._may_leave(old, pending):
                gone.append(old)
                count -= 1
                nbytes -= self._retained.get(old, 0)
        for old in gone:
            self._remove(old)  # one still settling stays; its retention timer tries again

    def _want_trim(self, now: float | None) -> None:
        """Memory was freed with no stream open: trim once that settled
        (``_IDLE_TRIM_AFTER_S`` after the last such moment), at most every
        ``TRIM_EVERY_S``."""
        idle = self._idle
        if idle.trim is None:
            return
        idle.at = (now if now is not None else trio.current_time()) + _IDLE_TRIM_AFTER_S
        if not idle.due:
            idle.due = True
            self._schedule(max(idle.at, idle.trimmed_at + TRIM_EVERY_S), "trim", None)

    def _may_leave(self, ctx: StreamCtx, unstored: set[int], *, aged: bool = False) -> bool:
        """Whether closed ``ctx`` may leave memory: nobody is reading it, and
        what a read of it answers is in the store (every event and its close;
        ``unstored``: the ids of streams with writes still queued) — or, for a
        stream the store refused an event of, once it is ``aged`` (closed for
        ``retain_closed_s``)."""
        return (ctx.followers == 0 and (aged or not ctx.unstored) and ctx.log.durable >= len(ctx.log)
                and id(ctx) not in unstored)

    def abandon(self, ctx: StreamCtx, stored: list[StoredEvent]) -> Closed | None:
        """Stream ``ctx`` was settled by another router process while this one
        could not reach the shared store (atp_router.deploy.cluster): ``stored`` — its
        log in the store, ending with the RST the other router wrote — is its
        log from now on. Its task is cancelled and its queued writes dropped;
        followers send what they have not sent of ``stored`` and stop; it
        writes nothing more. Returns its :class:`Closed` (None if it had closed
        before)."""
        self.persistence.drop(ctx)
        ctx.restored = True  # nothing more of it goes to the store
        if ctx.cancel_scope is not None:
            ctx.cancel_scope.cancel()
        ctx.log.replace(stored)
        return ctx._mark_closed()

    def detached(self, ctx: StreamCtx) -> None:
        """``ctx`` lost its last follower: reset it unless one comes back within
        ``resume_grace_s``."""
        assert ctx.detached_at is not None
        self._schedule(ctx.detached_at + self.resume_grace_s, "grace", ctx.key)

    def _release(self, ctx: StreamCtx) -> bool:
        """Close the ledger account of closed ``ctx`` as it leaves the table;
        False while a cancelled call has not committed its spend yet."""
        if not self.accounts.has(ctx.account):
            return True  # read back from the store: its account closed at start-up
        try:
            self.accounts.close(ctx.account)
        except ValueError:
            return False
        return True

    def _remove(self, ctx: StreamCtx) -> bool:
        """Drop closed ``ctx`` from the table once its account closed (:meth:`_release`)."""
        key = ctx.key
        if self._streams.get(key) is not ctx:
            return True
        if not self._release(ctx):
            return False
        del self._streams[key]
        del self._by_id[(key[0], key[2])]
        self._by_account.pop(ctx.account, None)
        if ctx.idempotency_key is not None and self._idempotency.get((key[0], ctx.idempotency_key)) is ctx:
            del self._idempotency[(key[0], ctx.idempotency_key)]
        retained = self._closed.get(key[0])
        if retained is not None:
            retained.pop(ctx, None)
            if not retained:
                del self._closed[key[0]]
        if not self.open_count:
            self._want_trim(trio.current_time())
        size = self._retained.pop(ctx, None)
        if size is not None:
            self.retained_bytes -= size
            self.metrics.retained_bytes.set(self.retained_bytes)
            self.metrics.retained_streams.set(len(self._retained))
        _decrement(self._session_streams, key[:2])
        self._gone += 1
        if self._gone > _TIMERS_PURGE_AT and self._gone * 4 > len(self._timers):  # amortised O(1) a removal
            self._purge_timers()
        return True

    def _purge_timers(self) -> None:
        """Drop the timers of streams no longer in the table. Due, they would
        be skipped; until then each holds a tuple and its stream's key (an idle
        timer for ``idle_task_s``), small objects scattered over the heap that keep
        the allocator from giving the freed pages back."""
        self._timers = [t for t in self._timers if t[3] is None or t[3] in self._streams]
        heapq.heapify(self._timers)
        self._gone = 0

    # ------------------------------------------------------------------ read back
    def restore(self, identity: Identity, *, stream_id: str | None = None,
                idempotency_key: str | None = None, now: float) -> StreamCtx | None:
        """A stream of ``identity``'s tenant that is not in memory but in the store
        (finished before a restart, or interrupted by it): read back as a closed
        stream whose log is the stored events, so a client reads and resumes it
        exactly as before (spec §8). Looked up by ``stream_id`` or by
        ``idempotency_key``; None when the tenant has no such stream (another
        tenant's never matches)."""
        tenant = identity.tenant
        rec = self.persistence.find(tenant, stream_id=stream_id, idempotency_key=idempotency_key)
        if rec is None or rec.state == "open" or (tenant, rec.stream_id) in self._by_id:
            return None
        stored = self.persistence.read_back(rec)
        sess = self.session(tenant, rec.session_id, now=now)
        ctx = StreamCtx(self, sess, rec.stream_id, identity, stored.meta, rec.qos or QoS.SILVER, stored.window,
                        rec.budget or Budget(), stored.route, now, task_started=True, closed_at=now,
                        account=stream_account(tenant, rec.stream_id), idempotency_key=rec.idempotency_key,
                        restored=True, decision=stored.decision, task_digest=stored.task_digest)
        # The stored JSON is what followers sent before: kept, the answer is byte for byte the same.
        ctx.log.replace(stored.events)
        key = ctx.key
        self._streams[key] = ctx
        self._by_id[(tenant, ctx.stream_id)] = ctx
        self._session_streams[key[:2]] += 1
        if ctx.idempotency_key is not None:
            self._idempotency[(tenant, ctx.idempotency_key)] = ctx
        self._keep(ctx, now)
        self.bound_retention(ctx)
        return ctx

    # ------------------------------------------------------------------ timers
    def _schedule(self, deadline: float, kind: str, key: StreamKey | None) -> None:
        heapq.heappush(self._timers, (deadline, next(self._seq), kind, key))
        if deadline < self._sleeping_until:
            self._changed.set()

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work (trio time, s), or None."""
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> list[Closed]:
        """Do what is due at ``now``: reset streams without a task after
        ``idle_task_s`` and detached streams after ``resume_grace_s`` (RST
        ``ETIMEOUT``, their task stops, spend so far is committed); remove closed
        streams past ``retain_closed_s``; drop sessions left without streams.
        Returns the streams it closed (their :class:`Closed`, for the caller to act on)."""
        closed: list[Closed] = []
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(self._timers)
            if kind == "sweep":
                self._sweep(now)
            elif kind == "trim":
                self._trim(now)
            else:
                assert key is not None
                ctx = self._streams.get(key)
                done = self._stream_timer(kind, ctx, now) if ctx is not None else None
                if done is not None:
                    closed.append(done)
        return closed

    def _sweep(self, now: float) -> None:
        """Drop the sessions left without streams; again in ``_sweep_s`` while any remain."""
        for skey in [k for k in self._sessions if k not in self._session_streams]:
            del self._sessions[skey]
        self._sweeping = bool(self._sessions)
        if self._sweeping:
            self._schedule(now + self._sweep_s, "sweep", None)

    def _trim(self, now: float) -> None:
        """The idle trim, once freed memory settled and if the router is still idle."""
        idle = self._idle
        if now < idle.at:  # memory was freed since: let it settle
            self._schedule(idle.at, "trim", None)
            return
        idle.due = False
        if not self.open_count and idle.trim is not None:
            idle.trimmed_at = now
            ms = idle.trim()
            log.debug("router idle: memory trimmed in %.1f ms", ms)

    def _stream_timer(self, kind: str, ctx: StreamCtx, now: float) -> Closed | None:
        """A ``retain``, ``idle`` or ``grace`` timer of ``ctx`` is due: what it closed, if anything."""
        if kind == "retain":
            # The key may name a newer stream since: only one closed long enough goes.
            if ctx.closed_at is not None and ctx.retain_until <= now and not (
                    self._may_leave(ctx, self.persistence.unstored(),
                                    aged=now >= ctx.closed_at + self.retain_closed_s)
                    and self._remove(ctx)):
                self._schedule(now + _SETTLE_RETRY_S, "retain", ctx.key)
        elif ctx.log.closed:
            return None
        elif kind == "idle" and not ctx.task_started and ctx.started + self.idle_task_s <= now:
            log.info("stream %s of %s: no task within %g s, reset", ctx.stream_id, ctx.tenant, self.idle_task_s)
            return ctx.stop(ErrorCode.ETIMEOUT, f"no task within {self.idle_task_s:g} s")
        elif (kind == "grace" and ctx.detached_at is not None
              and ctx.detached_at + self.resume_grace_s <= now):
            log.info("stream %s of %s: client gone for %g s, reset", ctx.stream_id, ctx.tenant,
                     now - ctx.detached_at)
            return ctx.stop(ErrorCode.ETIMEOUT, f"client gone: stream not resumed within {self.resume_grace_s:g} s")
        return None

    async def next_timers(self) -> list[Closed]:
        """Sleep until :meth:`get_timer` (or until an earlier deadline is
        scheduled meanwhile), then :meth:`handle_timer`: the streams it closed.
        The loop that drives the table calls it until cancelled and acts on each."""
        due = self.get_timer()
        self._sleeping_until = math.inf if due is None else due
        with trio.move_on_at(self._sleeping_until):
            await self._changed.wait()
        self._changed = trio.Event()
        # Not sleeping: what is scheduled while handling is seen by the next get_timer.
        self._sleeping_until = -math.inf
        return self.handle_timer(trio.current_time())


def _decrement(counts: Counter[Any], key: Any) -> None:
    """One fewer ``key`` in ``counts``; dropped at 0."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
