"""The :class:`~atp_router.store.base.Store` several routers share (issue 12): Redis,
through redis-py's synchronous client.

Why synchronous: redis-py's async client is asyncio-only; the
:class:`~atp_router.store.base.Store` interface is synchronous like the SQLite default,
so the router calls it the same way (on its trio thread, or through
``trio.to_thread.run_sync``: the client's connection pool is thread-safe).
Every operation is **one round trip**: one ``EVALSHA`` of a Lua script
(:mod:`atp_router.store._redis_lua`, loaded once with ``SCRIPT LOAD`` and again after
a ``NOSCRIPT``), atomic on the server — a reserve checks and holds budget along
the account's whole chain in one step, whatever other routers do at the same
time. Ledger amounts are integers (tokens, USD micros), below 2**53 (Lua
numbers are doubles). Reservation ids come from ``INCR``.

Where: ``RedisStore.open("redis://[:password@]host:port/db", namespace="atp")``
(also ``rediss://`` for TLS and ``unix:///path/redis.sock?db=0``); every key is
``<namespace>:…``, so several deployments can share one server. One Redis
server (or a Sentinel-managed primary): the scripts compute their keys, which
Redis Cluster does not allow. :meth:`RedisStore.describe` and ``repr`` mask the
password; it is never logged.

Durability is Redis': with ``appendonly yes`` and ``appendfsync always`` an
acknowledged write survives a kill -9 of Redis; with ``everysec`` (Redis'
default for AOF) up to one second may be lost on a crash of the machine.

Failures:

* **fast fail**: the client times out after ``socket_timeout_s`` (connect:
  ``connect_timeout_s``; both 0.5 s by default) and redis-py's own retries are
  off. A connection error or timeout raises
  :class:`~atp_router.store.base.StoreUnavailable`, and for ``backoff_s`` (0.5 s)
  after it every call raises it at once, without I/O; then one call probes
  again — never one from the thread :meth:`RedisStore.probe_off` names (a
  cluster router's trio loop, which then waits for a stalled Redis at most
  once per outage: its store threads and lease thread probe). So the caller's
  thread is never held longer than one socket timeout,
  and :attr:`RedisStore.available` says which state the store is in. A write
  that timed out may or may not have been applied — or be applied later, when
  Redis reads it from the closed connection's buffer. So a shared reserve is
  named (``request``, remembered :data:`REQUEST_TTL_MS`) and its caller cancels
  a timed-out one (:meth:`RedisStore.cancel_reserve_shared`): the reservation
  released if it was made, the reserve refused if it runs after the cancel —
  nothing is held for good by a call whose answer was lost. A shared commit is
  named too, and settled again by name (:meth:`RedisStore.recommit_shared`):
  a first attempt Redis ran after all stands (its charge returned), one it
  runs later is refused — charged once.
* **deadlines**: every write carries its deadline on Redis' own clock (the
  client's clock plus the offset measured by ``TIME`` at open and at every
  lease renewal, plus :attr:`RedisStore.deadline_ms`: twice the socket timeout,
  at least :data:`MIN_DEADLINE_MS`); one that Redis runs later — it was
  stopped or stalled, and reads the command from a connection whose caller
  gave up — changes nothing and answers ``ATPLATE`` (raised as
  ``StoreUnavailable``, without a back-off: Redis answered). So a write that
  timed out can apply late only inside that deadline, where the named
  cancel and re-commit below settle it; never after.
* **fencing tokens**: a cluster router's writes for its own streams and calls
  carry its owner name and lease epoch (:meth:`RedisStore.fence_as`; the
  epoch comes back from every :meth:`RedisStore.heartbeat`). A router that
  settles a lost one first increments its epoch (:meth:`RedisStore.fence_owner`):
  whatever the lost one still sends is refused (``Fenced``) until it has
  stopped what was settled and taken the new epoch.
* **epoch marker**: on open the store sets ``<ns>:epoch`` to a uuid unless it
  is set (``SET NX``) and remembers it; every script checks it first. When it
  is gone or another (Redis restarted without persistence, ``FLUSHALL``), the
  store raises ``StoreUnavailable("redis lost its data …")`` on every call from
  then on: an empty ledger must never be spent as if it were the real one.
  Opening the store again (a router restart) starts a new epoch.

Leases and claims are ``SET … PX ttl``: timed by Redis' clock, so routers on
several hosts never compare wall clocks (the ``now_ms`` arguments are unused).
So are shared tenant quotas (:meth:`RedisStore.quota_open`, one script per SYN:
``TIME``, the tenant's expired entries dropped, the decision of
:func:`atp_router.flow.quota.decide` made in Lua, the entry and the GCRA time
written) and :meth:`RedisStore.rate_take`.
:meth:`RedisStore.update` is a compare-and-set script retried on conflict.

:meth:`RedisStore.batch` buffers the stream, kv and quota-close writes made inside it
(:meth:`put_stream`, :meth:`close_stream`, :meth:`append_event`, :meth:`put`,
:meth:`close_shared_if_open`, :meth:`quota_close`, which then returns False)
and sends them in one pipeline when it ends — the group commit of outbound
events. Each write is still atomic on its own, but its errors (an unknown
stream, a full one, a duplicate event) are raised when the batch ends, not at
the call: one error as it is, several as one :class:`~atp_router.store.base.StoreError`
naming the first. A call that returns something (a read, a ledger step) made
inside the batch sends the writes buffered before it in the same round trip.
An exception inside the block drops the buffered writes.

Bounds are the SQLite store's: ``max_event_bytes`` per event (checked before
anything is sent), ``max_events_per_stream``, the last :data:`RIB_KEPT` RIBs;
:meth:`expire` drops finished streams (and closed accounts without open
children) in steps of :data:`EXPIRE_STEP` streams per script; the response
cache is bounded by each ``cache_put``'s ``max_bytes`` (least recently used
dropped first) and its entries carry a ``PX`` TTL until they expire.
The nonces of signed frames (:meth:`RedisStore.record_nonce`) live in one
sorted set per tenant, scored by expiry (one atomic script: sweep up to
:data:`~atp_router.store.base.NONCE_SWEEP` expired members, ``ZSCORE`` the nonce,
``ZCOUNT`` the unexpired ones against the call's ``max_per_tenant``, ``ZADD``);
the set carries a ``PX`` TTL until its last nonce expires, so a tenant gone
quiet leaves nothing behind. Its key and members are JSON arrays (``[tenant]``,
``[kid, nonce]``), like the stream keys: an id holding ``:`` cannot forge
another's. Expiry is by the callers' clocks (Unix ms, the frames' own window).

Errors: the :mod:`atp_router.store.base` ones, like SQLite (``NotFound``,
``StoreLimitError``, ``StoreError``); ``SchemaError`` for a namespace written by
another layout version or another application; ``StoreUnavailable`` as above.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from atp_router.flow.budget import (
    Allowance,
    CallRecord,
    Charge,
    LedgerSnapshot,
    Reservation,
    SharedResult,
    StoredCall,
    refusal,
)
from atp_router.flow.quota import QuotaAsk, QuotaGrant
from atp_router.store._redis_lua import LAYOUT_VERSION, OPEN, SCRIPTS
from atp_router.store.audit_records import GENESIS, AuditCheckpoint, AuditRecord
from atp_router.store.base import (
    NONCE_SWEEP,
    CachePut,
    CacheStats,
    Fenced,
    NotFound,
    SchemaError,
    Store,
    StoredEvent,
    StoreError,
    StoreLimitError,
    StoreUnavailable,
    StreamRecord,
    check_nonce_args,
    check_quota_args,
    check_rate_args,
    nonce_limit_error,
)
from atp_router.store.sqlite import RIB_KEPT, _remaining, _totals, ledger_snapshot

__all__ = ["BACKGROUND_OPS", "EXPIRE_STEP", "MIN_DEADLINE_MS", "REQUEST_TTL_MS", "RedisStore"]

log = logging.getLogger("atp_router.store.redis")

#: Races to the audit chain's head a group commit's chained records are sent again in one
#: pipeline for, before they are chained one by one (:meth:`RedisStore.append_audit_chained_then`).
AUDIT_RACES = 8

_APP = "atp-router"
#: Streams :meth:`RedisStore.expire` drops per script (Redis runs one script at a time).
EXPIRE_STEP = 500
#: How long a named reserve call (``<ns>:rq:<request>``: its reservation id, or
#: ``x`` once cancelled) is remembered, ms: far longer than a call can wait in
#: Redis' input buffer after its caller gave up (a Redis paused for minutes).
REQUEST_TTL_MS = 3_600_000
#: Ledger amounts must stay below this (exact integers in Lua's doubles).
_MAX_AMOUNT = 2**53
#: Redis error codes that mean "the server cannot serve now", like a lost connection.
_UNAVAILABLE_CODES = frozenset({"LOADING", "BUSY", "MASTERDOWN", "READONLY", "NOREPLICAS", "OOM", "TRYAGAIN",
                                "CLUSTERDOWN", "NOAUTH"})
#: Operations :meth:`RedisStore.batch` buffers.
_DEFERRED = frozenset({"put_stream", "close_stream", "append_events", "kv_put", "quota_close",
                       "close_account_if_open", "lease_settle"})
#: The least deadline of an operation, ms (it is twice the socket timeout): what a
#: loaded machine may take between building a call and Redis running it.
MIN_DEADLINE_MS = 1_000
#: The writes a router makes for its own streams and calls, which carry its
#: fencing token (:meth:`RedisStore.fence_as`): refused once another router
#: settled it. A cancel, a lease renewal, a claim, the settling of another
#: router and reads carry none.
_FENCED = frozenset({"open_account", "open_stream", "close_account", "close_account_if_open", "reserve_shared", "extend_shared", "settle",
                     "put_stream", "close_stream", "append_events", "lease_take", "lease_settle",
                     "lease_commit"})
#: The operations that carry a deadline: those writes, a limit change, a quota's open
#: and its rate (a late open must not hold a slot: it is refused). A read, a
#: lease renewal (late is harmless: the router is alive, and its writes are fenced), a
#: claim (bounded by its own TTL) or a cancel (it must always apply) carries none.
_DEADLINED = _FENCED | {"set_limit", "quota_open", "rate_take", "rate_take_upto"}
#: The scripts only a router's periodic work runs, whatever its tasks: its lease renewal,
#: the polls for lost routers, a new RIB and the breakers' states, the expiry of closed
#: streams, the renewal of its quota entries, the shared learning's sync (once a second:
#: its reads and compare-and-sets; so are the breakers' state changes and feedback's reads)
#: and the audit chain's checkpoint (its read of the latest and its write, once an interval)
#: (:attr:`RedisStore.background_round_trips`). Every other operation counts as its tasks'.
BACKGROUND_OPS = frozenset({"heartbeat", "renew_lease", "live_owners", "lost_owners", "active_rib_version",
                         "kv_items", "kv_get", "kv_cas", "expire", "quota_renew", "audit_read",
                         "put_audit_checkpoint"})


@dataclass
class _Batch:
    depth: int = 0
    ops: list[tuple[str, tuple]] = field(default_factory=list)
    errors: list[StoreError] = field(default_factory=list)
    #: id(args) of a buffered op -> what its reply is handed to (:meth:`RedisStore.rate_take_upto_then`).
    then: dict[int, Callable[[Any], None]] = field(default_factory=dict)
    #: Chained audit appends buffered (:meth:`RedisStore.append_audit_chained_then`): (build, then).
    audits: list[tuple[Callable[[int, str], AuditRecord], Callable[[AuditRecord], None]]] = \
        field(default_factory=list)


class _Local(threading.local):
    def __init__(self) -> None:
        self.batch = _Batch()


class RedisStore(Store):
    """:class:`~atp_router.store.base.Store` on a Redis server shared by several routers
    (see the module docstring). Build it with :meth:`open`."""

    #: redis-py's connection pool is thread-safe; so are the fast-fail state and the batch
    #: (thread-local): the router calls it from store threads (atp_router.store.threads).
    threaded = True

    def __init__(self, client: redis.Redis, *, url: str, namespace: str, epoch: str, max_event_bytes: int,
                 max_events_per_stream: int, backoff_s: float) -> None:
        self._client = client
        self._url = url
        self.namespace = namespace
        self._prefix = namespace + ":"
        self._epoch_key = self._prefix + "epoch"
        self.epoch = epoch
        self.max_event_bytes = max_event_bytes
        self.max_events_per_stream = max_events_per_stream
        self.backoff_s = backoff_s
        self._sha = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in SCRIPTS.items()}
        self._local = _Local()
        # Fast fail: while monotonic() < _retry_at after a failure, calls raise at once.
        self._up = True
        self._retry_at = 0.0
        #: The thread that never probes a store found down (:meth:`probe_off`), or None.
        self._no_probe: int | None = None
        self._down_reason = ""
        self._lost = False
        #: The operations' deadline budget, ms: twice the client's own socket timeout,
        #: at least :data:`MIN_DEADLINE_MS` (an operation Redis runs later than that is
        #: refused: module docstring).
        timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        self.deadline_ms = max(MIN_DEADLINE_MS, int(2 * float(timeout) * 1000)) if timeout else 0
        #: Redis' clock minus ours, ms (measured at open and at every lease renewal).
        self.clock_offset_ms = 0
        #: The fencing token this process's writes carry: (owner, lease epoch) or None.
        self._fence: tuple[str, str] | None = None
        self._round_trips = 0
        self._background_trips = 0
        self._trips_by_op: dict[str, int] = {}
        self._trips_lock = threading.Lock()
        #: The audit chain's head as this store last saw it (seq, hash): the next chained
        #: append's guess (:meth:`append_audit_chained`); None: read it first.
        self._audit_head: tuple[int, str] | None = None

    # ----------------------------------------------------------------- opening
    @classmethod
    def open(cls, url: str, *, namespace: str = "atp", socket_timeout_s: float = 0.5,
             connect_timeout_s: float = 0.5, backoff_s: float = 0.5, max_event_bytes: int = 1 << 20,
             max_events_per_stream: int = 10_000) -> RedisStore:
        """Connect to the Redis at ``url`` (``redis://[[user]:password@]host[:port][/db]``,
        ``rediss://…``, ``unix:///path?db=N``), check the namespace's layout, set
        or read its epoch and load the scripts. ``socket_timeout_s`` /
        ``connect_timeout_s`` bound every call (s; redis-py's URL options
        ``?socket_timeout=S&socket_connect_timeout=S`` override them: a Redis
        over a slower link), ``backoff_s`` is the fast-fail back-off (see the
        module docstring). Raises ``ValueError`` for a bad URL
        or namespace, :class:`~atp_router.store.base.StoreUnavailable` when Redis cannot
        be reached, :class:`~atp_router.store.base.SchemaError` for a namespace of
        another layout or application, :class:`~atp_router.store.base.StoreError` for
        other refusals (a wrong password)."""
        if not namespace or any(c.isspace() or c in "{}*?[]" for c in namespace):
            raise ValueError(f"namespace must be non-empty, without spaces, braces or glob characters: {namespace!r}")
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {mask_url(url)}")
        if min(socket_timeout_s, connect_timeout_s) <= 0 or backoff_s < 0:
            raise ValueError("timeouts must be > 0 and backoff_s >= 0")
        try:
            client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                                          retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                          health_check_interval=0)
        except ValueError as e:
            raise ValueError(f"bad Redis URL {mask_url(url)}: {e}") from None
        where = mask_url(url)
        prefix = namespace + ":"
        ours = f"{_APP}/{LAYOUT_VERSION}"
        try:
            found, epoch = client.eval(OPEN, 2, prefix + "layout", prefix + "epoch", ours, uuid.uuid4().hex)
            if epoch is not None:
                pipe = client.pipeline(transaction=False)
                for src in SCRIPTS.values():
                    pipe.script_load(src)
                pipe.execute()
        except (RedisConnectionError, RedisTimeoutError) as e:
            client.close()
            if isinstance(e, redis.AuthenticationError):
                raise StoreError(f"redis at {where} refused us: {e}") from None
            raise StoreUnavailable(f"redis at {where} cannot be reached: {e}") from None
        except RedisError as e:
            client.close()
            raise StoreError(f"redis at {where}: {e}") from None
        if epoch is None:
            client.close()
            layout = found.decode(errors="replace")
            app, _, version = layout.partition("/")
            if app == _APP and version.isdigit() and int(version) > LAYOUT_VERSION:
                raise SchemaError(f"redis {where} namespace {namespace!r}: layout version {version} is newer than "
                                  f"this {_APP} supports ({LAYOUT_VERSION}); upgrade {_APP} or use another namespace")
            raise SchemaError(f"redis {where} namespace {namespace!r} is not an {_APP} store (layout {layout!r})")
        store = cls(client, url=url, namespace=namespace, epoch=epoch.decode(), max_event_bytes=max_event_bytes,
                    max_events_per_stream=max_events_per_stream, backoff_s=backoff_s)
        store.sync_clock()
        return store

    def describe(self) -> str:
        return f"{mask_url(self._url)} namespace {self.namespace}"

    def __repr__(self) -> str:
        return f"RedisStore({mask_url(self._url)!r}, namespace={self.namespace!r})"

    @property
    def available(self) -> bool:
        return self._up and not self._lost

    def close(self) -> None:
        self._client.close()

    # --------------------------------------------------------------- execution
    def _check(self) -> None:
        """Raise at once (no I/O) while the store is lost or in its back-off; past
        the back-off, let this call probe and the others wait another back-off."""
        if self._lost:
            raise self._lost_error()
        if not self._up:
            now = time.monotonic()
            if now < self._retry_at or threading.get_ident() == self._no_probe:
                raise StoreUnavailable(self._down_reason)
            self._retry_at = now + self.backoff_s

    def probe_off(self, thread_id: int | None) -> None:
        """While the store is down, calls from thread ``thread_id`` (a cluster
        router's trio loop) raise :class:`~atp_router.store.base.StoreUnavailable`
        at once, past the back-off too: only the other threads (its store
        threads and lease thread, which call it every fraction of a second)
        probe it, so the loop waits for a stalled Redis at most once per outage
        (the call that found it). None: every thread probes (the default)."""
        self._no_probe = thread_id

    def _lost_error(self) -> StoreUnavailable:
        return StoreUnavailable(f"redis lost its data: the epoch marker of namespace {self.namespace!r} at "
                                f"{mask_url(self._url)} is gone or changed (restarted without persistence, or "
                                "flushed); spend is refused until the routers are restarted on it")

    def _down(self, e: Exception | str) -> StoreUnavailable:
        self._up = False
        self._retry_at = time.monotonic() + self.backoff_s
        self._down_reason = f"redis at {mask_url(self._url)} unavailable: {e}"
        return StoreUnavailable(self._down_reason)

    def _args(self, name: str, args: Sequence[Any]) -> tuple:
        deadline = (int(time.time() * 1000) + self.clock_offset_ms + self.deadline_ms
                    if self.deadline_ms and name in _DEADLINED else "")
        fence = self._fence if self._fence is not None and name in _FENCED else ("", "")
        return (self._sha[name], 1, self._epoch_key, self.epoch, self._prefix, deadline, *fence, *args)

    def sync_clock(self) -> int:
        """Measure Redis' clock against ours (``TIME``, the midpoint of the round
        trip) and keep the offset the deadlines use; returns it (ms). Raises
        :class:`~atp_router.store.base.StoreUnavailable`."""
        self._check()
        try:
            self._trip("time", background=True)
            t0 = time.time()
            sec, usec = self._client.time()
            t1 = time.time()
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise self._down(e) from None
        except RedisError as e:
            raise StoreError(f"redis at {mask_url(self._url)}: {e}") from None
        self._up = True
        self._clock(int(sec), int(usec), t0, t1)
        return self.clock_offset_ms

    def _clock(self, sec: int, usec: int, t0: float, t1: float) -> None:
        if t1 - t0 <= max(0.05, self.deadline_ms / 4000):  # a slow round trip says little about the offset
            self.clock_offset_ms = sec * 1000 + usec // 1000 - int((t0 + t1) * 500)

    def fence_as(self, owner: str, epoch: int) -> None:
        """Carry ``owner``'s fencing token (lease epoch ``epoch``) on this store's
        writes for its streams and calls from now on (a cluster router, at start
        and after it found itself settled: :meth:`heartbeat` returns the epoch)."""
        if not owner:
            raise ValueError("fence_as needs an owner")
        self._fence = (owner, str(epoch))

    @property
    def fence_epoch(self) -> int | None:
        """The lease epoch this store's writes carry (None: no fencing token)."""
        return None if self._fence is None else int(self._fence[1])

    def fence_owner(self, owner: str) -> int:
        """Increment ``owner``'s lease epoch (another router is about to settle
        it): every write it makes with the old epoch is refused from now on
        (``Fenced``). Returns the new epoch. Raises :class:`~atp_router.store.base.StoreError`."""
        if not owner:
            raise ValueError("fence_owner needs an owner")
        return int(self._run("fence_owner", owner))

    def _run(self, name: str, *args: Any) -> Any:
        """Run script ``name`` with ``args``; inside a batch, buffer it if it is a
        buffered write (None), else send it with the buffered writes before it."""
        b = self._local.batch
        if b.depth and name in _DEFERRED:
            self._buffer(b, name, args)
            return None
        self._check()
        if b.depth and b.ops:
            ops, b.ops = [*b.ops, (name, args)], []
            replies = self._pipeline(ops)
            self._answer(b, ops, replies)
            b.errors.extend(e for e in map(self._reply_error, replies[:-1]) if e is not None)
            reply = replies[-1]
            err = self._reply_error(reply)
            if err is not None:
                raise err
            return reply
        try:
            background = name in BACKGROUND_OPS
            try:
                reply = self._eval(name, self._args(name, args), background)
            except NoScriptError:  # Redis restarted (scripts are not persisted): load and run again
                self._trip("script_load", background)
                self._client.script_load(SCRIPTS[name])
                reply = self._eval(name, self._args(name, args), background)
        except ResponseError as e:
            self._up = True
            raise self._error(e) from None
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise self._down(e) from None
        except RedisError as e:
            raise StoreError(f"redis at {mask_url(self._url)}: {e}") from None
        self._up = True
        return reply

    @property
    def round_trips(self) -> int:
        """Requests this store sent to Redis and waited for, from every thread: a
        script, a pipeline of them (one), a ``TIME`` (``atp_store_round_trips_total``;
        bench/bench_cluster.py divides it by the tasks run)."""
        return self._round_trips

    @property
    def background_round_trips(self) -> int:
        """Of :attr:`round_trips`, those of a script only the router's periodic
        work runs (:data:`BACKGROUND_OPS`: lease renewals, polls, expiry, quota
        renewals) and the ``TIME`` at open — what a router makes however many
        tasks it runs (``atp_store_background_round_trips_total``); a pipeline
        (a group commit) is never one."""
        return self._background_trips

    @property
    def round_trips_by_op(self) -> dict[str, int]:
        """:attr:`round_trips` by operation: a script's name, ``pipeline`` (a
        group commit, a batch of commits: several scripts in one round trip),
        ``time`` (``TIME``), ``script_load`` (scripts loaded again after a Redis
        restart) — ``atp_store_round_trips_by_op_total{op}``."""
        with self._trips_lock:
            return dict(self._trips_by_op)

    def _trip(self, op: str, background: bool = False) -> None:
        with self._trips_lock:
            self._round_trips += 1
            self._background_trips += background
            self._trips_by_op[op] = self._trips_by_op.get(op, 0) + 1

    def _buffer(self, b: _Batch, name: str, args: tuple[Any, ...]) -> None:
        """Buffer op ``name`` in batch ``b``: no I/O now, so it must not take the
        probe of a back-off (the batch's own round trip at its end is the probe)."""
        self._fail_fast()
        b.ops.append((name, args))

    def _fail_fast(self) -> None:
        """:meth:`_check` for a write buffered in a batch: raise while lost or backing off, never probe."""
        if self._lost or (not self._up and (time.monotonic() < self._retry_at
                                             or threading.get_ident() == self._no_probe)):
            self._check()

    @staticmethod
    def _answer(b: _Batch, ops: list[tuple[str, tuple[Any, ...]]], replies: list[Any]) -> None:
        """Hand the replies of ``ops`` (a pipeline just sent) that a buffered op
        waits for to its ``then`` (:meth:`rate_take_upto_then`); an error reply
        to none (it is the batch's error, as any buffered write's)."""
        if b.then:
            for (_, args), reply in zip(ops, replies, strict=False):
                then = b.then.pop(id(args), None)
                if then is not None and not isinstance(reply, Exception):
                    then(reply)

    def _eval(self, name: str, args: tuple, background: bool = False) -> Any:
        """``EVALSHA args`` on a pooled connection: redis-py's ``execute_command``
        without its retry and instrumentation layers (about a quarter of the
        client's CPU per call). A connection that failed is dropped."""
        self._trip(name, background)
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command("EVALSHA", *args)
            return conn.read_response()
        except ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _pipeline(self, ops: list[tuple[str, tuple]]) -> list[Any]:
        """Run ``ops`` in one pipeline (no MULTI: each script is atomic); the
        replies, errors as exception objects. Scripts Redis forgot are loaded
        and those ops run again, in order."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, args in ops:
                pipe.execute_command("EVALSHA", *self._args(name, args))
            self._trip("pipeline")
            replies = pipe.execute(raise_on_error=False)
            redo = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if redo:
                pipe = self._client.pipeline(transaction=False)
                for src in SCRIPTS.values():
                    pipe.script_load(src)
                for i in redo:
                    name, args = ops[i]
                    pipe.execute_command("EVALSHA", *self._args(name, args))
                self._trip("pipeline")
                for i, r in zip(redo, pipe.execute(raise_on_error=False)[len(SCRIPTS):], strict=True):
                    replies[i] = r
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise self._down(e) from None
        except RedisError as e:
            raise StoreError(f"redis at {mask_url(self._url)}: {e}") from None
        self._up = True
        return replies

    def _reply_error(self, reply: Any) -> StoreError | None:
        if isinstance(reply, ResponseError):
            return self._error(reply)
        if isinstance(reply, Exception):
            return StoreError(f"redis at {mask_url(self._url)}: {reply}")
        return None

    def _error(self, e: ResponseError) -> StoreError:
        """The store error of a script's error reply (codes: :mod:`atp_router.store._redis_lua`)."""
        msg = str(e)
        code, _, rest = msg.partition(" ")
        kind, _, what = rest.partition(" ")
        if code == "ATPEPOCH":
            self._lost = True
            return self._lost_error()
        if code == "ATPLATE":
            # Redis answered (it is up; no back-off), but too late for this operation.
            return StoreUnavailable(f"redis at {mask_url(self._url)}: the operation ran {kind} ms after its "
                                    "deadline (Redis or this process stalled); nothing was changed")
        if code == "ATPFENCED":
            return Fenced(f"router {kind} was settled by another router (its lease lapsed): this write "
                          "of its old lease epoch is refused")
        if code == "ATPNOTFOUND":
            if kind == "acct":
                return NotFound(f"no open budget account {what!r}")
            if kind == "res":
                return NotFound(f"no open reservation {what}")
            t, s, i = json.loads(what)
            return NotFound(f"no stream {t}/{s}/{i}")
        if code == "ATPOPEN":
            return StoreError(f"budget account {rest!r} already open")
        if code == "ATPLIMIT":
            sid = json.loads(what)[2]
            return StoreLimitError(kind, f"stream {sid} has the store's limit of {self.max_events_per_stream} events")
        if code == "ATPDUP" and kind == "event":
            eid, _, sk = what.partition(" ")
            return StoreError(f"event {eid} of stream {json.loads(sk)[2]} is already stored")
        if code == "ATPDUP" and kind == "audit":
            return StoreError(f"audit record {what} already stored (the log is append-only)")
        if code in _UNAVAILABLE_CODES:
            return self._down(e)
        return StoreError(f"redis at {mask_url(self._url)}: {msg}")

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: the stream and kv writes made inside are sent in one
        pipeline when the block ends (see the module docstring); nested blocks
        are one. Raises the buffered writes' errors at the end."""
        b = self._local.batch
        b.depth += 1
        try:
            yield
        except BaseException:
            b.depth -= 1
            if b.depth == 0:
                b.ops.clear()
                b.errors.clear()
                b.then.clear()
                b.audits.clear()
            raise
        b.depth -= 1
        if b.depth:
            return
        ops, b.ops = b.ops, []
        audits, b.audits = b.audits, []
        errors, b.errors = b.errors, []
        try:
            if ops or audits:
                self._check()
                records = self._chain(audits)
                replies = self._pipeline([*ops, *map(_audit_op, records)])
                self._answer(b, ops, replies[:len(ops)])
                errors += [e for e in map(self._reply_error, replies[:len(ops)]) if e is not None]
                self._chained(audits, records, replies[len(ops):])
        finally:
            b.then.clear()  # a batch that failed as a whole answers none
        fenced = next((e for e in errors if isinstance(e, Fenced)), None)
        if fenced is not None:
            raise fenced  # the whole batch waits for the fence (its other errors are its writes' own)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise StoreError(f"{len(errors)} of the batch's {len(ops)} writes failed; the first: {errors[0]}") \
                from errors[0]

    # ------------------------------------------------------------ budget ledgers
    def open_account(self, key: str, parent: str | None, limit: Allowance) -> None:
        self._run("open_account", key, parent or "", *_limit(limit), "", "plain")

    def close_account(self, key: str) -> None:
        self._run("close_account", key)

    def reserve(self, reservation: Reservation) -> None:
        r = reservation
        self._run("reserve", r.id, r.key, _amount(r.tokens), _amount(r.usd_micros))

    def release(self, reservation_id: int) -> None:
        self._run("settle", reservation_id, "release", 0, 0, 0, 0)

    def commit(self, reservation_id: int, charge: Charge) -> None:
        c = charge
        self._run("settle", reservation_id, "charge", _amount(c.tokens), _amount(c.usd_micros),
                  _amount(c.overage_tokens), _amount(c.overage_usd_micros))

    def set_limit(self, key: str, limit: Allowance) -> None:
        self._run("set_limit", key, *_limit(limit), "plain")

    def load_ledger(self) -> LedgerSnapshot:
        accts, res, last = self._run("load_ledger")
        rows = [(k.decode(), p.decode() or None, _opt_int(lt), _opt_int(lu), int(ct), int(cu), int(ot), int(ou))
                for k, p, lt, lu, ct, cu, ot, ou in accts]
        reservations = sorted((Reservation(id=int(i), key=k.decode(), tokens=int(t), usd_micros=int(u))
                               for i, k, t, u in res), key=lambda r: r.id)
        return ledger_snapshot(rows, reservations, int(last) + 1)

    def recover(self, owner: str | None = None) -> list[Reservation]:
        return _reservations(self._run("settle_owned", owner or "", "commit"))

    def close_owned_accounts(self, owner: str | None = None) -> int:
        return int(self._run("close_owned", owner or ""))

    def release_owned(self, owner: str) -> list[Reservation]:
        if not owner:
            raise ValueError("release_owned needs an owner")
        return _reservations(self._run("settle_owned", owner, "release"))

    # ------------------------------------------------- shared budget ledger
    def open_shared(self, key: str, parent: str | None, limit: Allowance, *, owner: str | None) -> SharedResult:
        rows = self._run("open_account", key, parent or "", *_limit(limit), owner or "", "shared")
        return SharedResult(totals=_totals(_rows(rows)))

    def open_stream_shared(self, key: str, parent: str, limit: Allowance, *, owner: str, ask: QuotaAsk,
                           ttl_ms: int) -> tuple[QuotaGrant, SharedResult | None]:
        """The atomic OPEN of a stream (issue 22 item 2): ``ask``'s entry in its
        tenant's shared quota (:meth:`quota_open`, held for ``owner`` ``ttl_ms``)
        and child account ``key`` under ``parent`` (:meth:`open_shared`) in one
        script, one round trip, carrying this store's fencing token and
        deadline — both, or neither. Returns the grant and, admitted, the new
        account's chain (None: refused, nothing opened). Raises
        :class:`~atp_router.store.base.NotFound` (``parent`` not open),
        :class:`~atp_router.store.base.StoreError` (``key`` open already),
        ``Fenced``, :class:`~atp_router.store.base.StoreUnavailable`."""
        check_quota_args(ask, owner, ttl_ms)
        tkey, member = _quota_keys(ask.tenant, owner, ask.stream_id)
        ok, n, refused, wait, rows = self._run(
            "open_stream", key, parent, *_limit(limit), owner, tkey, member, json.dumps([tkey, member]), owner,
            ask.max_streams, repr(float(ask.per_s)), ask.burst, ttl_ms, "open/" + ask.tenant)
        why = refused.decode() or None
        grant = QuotaGrant(bool(ok), int(n), why, int(wait) if why == "rate" else None)
        return grant, (SharedResult(totals=_totals(_rows(rows))) if ok else None)

    def close_shared(self, key: str) -> None:
        self.close_account(key)

    def close_shared_if_open(self, key: str) -> None:
        """Close child account ``key`` unless it is closed already (by the router
        that settled its owner): no ``NotFound``, so inside :meth:`batch` it is
        buffered like the stream writes (a stream's account closed in a group
        commit, off the trio loop). Fenced and deadlined like :meth:`close_shared`."""
        self._run("close_account_if_open", key)

    def reserve_shared(self, key: str, tokens: int, usd_micros: int, *, owner: str,
                       request: str = "") -> SharedResult:
        ok, n, raw = self._run("reserve_shared", key, _amount(tokens), _amount(usd_micros), owner, request,
                               REQUEST_TTL_MS)
        rows = _rows(raw)
        if not ok:
            return _refused(rows, n, f"reserve {tokens} tokens / {usd_micros} usd_micros on {key!r}")
        return SharedResult(totals=_totals(rows),
                            reservation=Reservation(id=int(n), key=key, tokens=tokens, usd_micros=usd_micros))

    def cancel_reserve_shared(self, request: str) -> bool:
        if not request:
            raise ValueError("cancel_reserve_shared needs the request the reserve was named")
        return bool(self._run("cancel_reserve", request, REQUEST_TTL_MS))

    def extend_shared(self, reservation: Reservation, tokens: int, usd_micros: int) -> SharedResult:
        r = reservation
        try:
            ok, n, raw = self._run("extend_shared", r.id, r.key, r.tokens, r.usd_micros, _amount(tokens),
                                   _amount(usd_micros))
        except StoreError as e:
            if "ATPHELD" in str(e):
                raise StoreError(f"reservation {r.id} on {r.key!r} is not held as {r.tokens} tokens / "
                                 f"{r.usd_micros} usd_micros") from None
            raise
        rows = _rows(raw)
        if not ok:
            return _refused(rows, n, f"extend by {tokens} tokens / {usd_micros} usd_micros on {r.key!r}")
        return SharedResult(totals=_totals(rows), reservation=Reservation(
            id=r.id, key=r.key, tokens=r.tokens + tokens, usd_micros=r.usd_micros + usd_micros))

    def commit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                      request: str = "", record: CallRecord | None = None) -> SharedResult:
        """:meth:`Store.commit_shared <atp_router.store.base.Store.commit_shared>`;
        with ``record``, the answer the charge pays for is stored in the same
        atomic step (:meth:`call_record` reads it, with the charge)."""
        raw, t, u, ot, ou = self._run("settle", reservation.id, "actual", _amount(tokens), _amount(usd_micros), 0, 0,
                                      request, REQUEST_TTL_MS, *_record_args(record))
        return SharedResult(totals=_totals(_rows(raw)), charge=Charge(int(t), int(u), int(ot), int(ou)))

    def recommit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                        request: str, record: CallRecord | None = None) -> SharedResult:
        if not request:
            raise ValueError("recommit_shared needs the request the first commit was named")
        raw, t, u, ot, ou = self._run("settle", reservation.id, "recommit", _amount(tokens), _amount(usd_micros),
                                      0, 0, request, REQUEST_TTL_MS, *_record_args(record))
        return SharedResult(totals=_totals(_rows(raw)), charge=Charge(int(t), int(u), int(ot), int(ou)))

    def settle_many(self, ops: Sequence[tuple[str, Reservation, int, int, str, CallRecord | None]]
                    ) -> list[SharedResult | StoreError]:
        """Several settlements of shared reservations in one pipeline (one round
        trip; each its own atomic script): ``(mode, reservation, tokens,
        usd_micros, request, record)`` with mode ``"commit"``
        (:meth:`commit_shared`), ``"recommit"`` (:meth:`recommit_shared`) or
        ``"release"`` (:meth:`release_shared`; amounts, request and record
        unused). Each one's result or store error, in order (issue 22 item 2:
        the commits of concurrent calls together). Inside :meth:`batch` the
        writes it buffered are sent first in the same pipeline. Raises
        :class:`~atp_router.store.base.StoreUnavailable` when the pipeline failed
        as a whole (each may or may not have applied: settle them again by name)."""
        calls: list[tuple[str, tuple[Any, ...]]] = []
        for mode, r, t, u, request, record in ops:
            if mode == "release":
                calls.append(("settle", (r.id, "release", 0, 0, 0, 0)))
            else:
                if mode == "recommit" and not request:
                    raise ValueError("a recommit needs the request the first commit was named")
                calls.append(("settle", (r.id, "actual" if mode == "commit" else "recommit", _amount(t), _amount(u),
                                         0, 0, request, REQUEST_TTL_MS, *_record_args(record))))
        self._check()
        b = self._local.batch
        ahead: list[tuple[str, tuple]] = []
        if b.depth:  # inside a batch (a group commit): its buffered writes go first, in this pipeline
            ahead, b.ops = b.ops, []
        replies = self._pipeline([*ahead, *calls])
        self._answer(b, ahead, replies)
        b.errors.extend(e for e in map(self._reply_error, replies[:len(ahead)]) if e is not None)
        out: list[SharedResult | StoreError] = []
        for (mode, *_), reply in zip(ops, replies[len(ahead):], strict=True):
            err = self._reply_error(reply)
            if err is not None:
                out.append(err)
                continue
            raw, ct, cu, ot, ou = reply
            out.append(SharedResult(totals=_totals(_rows(raw)), charge=None if mode == "release" else
                                    Charge(int(ct), int(cu), int(ot), int(ou))))
        return out

    # ------------------------------------------------- budget leases
    def lease_take(self, parent: str, lease_id: int | None, tokens: int, usd_micros: int, *,
                   owner: str, request: str = "") -> tuple[int, int, int, SharedResult]:
        """Take (``lease_id`` None) or grow a **budget lease** (issue 22 item 2):
        ``owner``'s slice of account ``parent``'s remaining budget, held in the
        store as a reservation of ``owner`` on ``parent`` (so the settling of a
        lost router releases it with its other reservations). Grows it by
        ``min(want, the chain's free room)`` per axis (tokens, USD micros; a
        negative amount shrinks it by as much, at most what it holds), in
        one script carrying the fencing token and a deadline, named ``request``
        (sent again under the same name after its answer was lost, it returns
        what the first one granted — applied once, whichever Redis ran first).
        Returns ``(lease id, granted tokens, granted usd_micros, parent's
        chain)``. Raises
        :class:`~atp_router.store.base.NotFound` (``parent`` not open, or the
        lease gone: settled by another router), ``Fenced``,
        :class:`~atp_router.store.base.StoreUnavailable`, ``StoreError``."""
        if not owner:
            raise ValueError("lease_take needs an owner")
        if lease_id is None and (tokens < 0 or usd_micros < 0):
            raise ValueError("a new lease cannot be taken with a negative amount")
        got = self._run("lease_take", parent, "" if lease_id is None else lease_id, _amount(tokens),
                        _amount(usd_micros), owner, request, REQUEST_TTL_MS)
        lid, t, u, raw = got
        return int(lid), int(t), int(u), SharedResult(totals=_totals(_rows(raw)))

    def lease_settle(self, lease: Reservation, room: tuple[int | None, int | None], tokens: int, usd_micros: int,
                     *, request: str, recommit: bool = False, record: CallRecord | None = None,
                     buffered: bool = True) -> SharedResult | None:
        """The commit of a call reserved inside a budget lease (no reservation
        of its own in the store): ``lease`` names the lease (its id), the
        call's stream account (``key``, a child of the lease's account) and what
        the lease may give the call (``tokens`` / ``usd_micros``: the cap);
        ``room`` is the router's own room on the stream account (None:
        unbounded). Charges per axis ``min(actual, room, each ancestor's free
        room plus the cap)`` (:meth:`commit_shared`'s rule), the rest overage,
        in one script with the call record (``record``), named ``request``
        (``recommit``: the retry of a first attempt whose answer was lost —
        nothing applied twice). Inside :meth:`batch` it is buffered like the
        stream writes (returns None; its errors are the batch's) unless not
        ``buffered`` (the answer is needed: sent then, with what is buffered). Raises
        :class:`~atp_router.store.base.NotFound` (the lease gone), ``Fenced``,
        :class:`~atp_router.store.base.StoreUnavailable`."""
        if not request:
            raise ValueError("lease_settle needs a request name")
        got = self._run("lease_settle" if buffered else "lease_commit", lease.id, lease.key, _amount(lease.tokens),
                        _amount(lease.usd_micros),
                        "" if room[0] is None else _amount(room[0]), "" if room[1] is None else _amount(room[1]),
                        _amount(tokens), _amount(usd_micros), "recommit" if recommit else "actual", request,
                        REQUEST_TTL_MS, *_record_args(record))
        if got is None:
            return None
        raw, t, u, ot, ou = got
        return SharedResult(totals=_totals(_rows(raw)), charge=Charge(int(t), int(u), int(ot), int(ou)))

    def call_record(self, key: str) -> StoredCall | None:
        """The call record a commit stored under ``key`` (:class:`~atp_router.flow.budget.CallRecord`),
        with what that commit charged; None when there is none (never
        committed, or expired)."""
        got = self._run("call_record", key)
        if not got:
            return None
        value, t, u = got
        return StoredCall(value=bytes(value), tokens=int(t), usd_micros=int(u))

    def release_shared(self, reservation: Reservation) -> SharedResult:
        raw, *_ = self._run("settle", reservation.id, "release", 0, 0, 0, 0)
        return SharedResult(totals=_totals(_rows(raw)))

    def set_limit_shared(self, key: str, limit: Allowance, *, clamp: bool) -> SharedResult:
        ok, raw = self._run("set_limit", key, *_limit(limit), "clamp" if clamp else "strict")
        rows = _rows(raw)
        if not ok:
            what = f"limit {limit.tokens} tokens / {limit.usd_micros} usd_micros below use"
            return SharedResult(totals=_totals(rows), refusal=refusal(key, what, _remaining(rows)))
        return SharedResult(totals=_totals(rows))

    def shared_totals(self, key: str) -> SharedResult:
        return SharedResult(totals=_totals(_rows(self._run("shared_totals", key))))

    # ----------------------------------------------------------- router leases
    def heartbeat(self, owner: str, *, ttl_ms: int, now_ms: int, info: Mapping[str, Any]) -> int:
        """Renew ``owner``'s lease; returns its lease epoch (the fencing token
        its writes must carry: :meth:`fence_as`). Measures the clock offset too."""
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        t0 = time.time()
        epoch, sec, usec = self._run("heartbeat", owner, ttl_ms, json.dumps(dict(info), ensure_ascii=False))
        self._clock(int(sec), int(usec), t0, time.time())
        return int(epoch)

    def live_owners(self, *, now_ms: int) -> dict[str, dict[str, Any]]:
        return _owners(self._run("live_owners"))

    def renew_lease(self, owner: str, *, ttl_ms: int, now_ms: int,
                    info: Mapping[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
        """:meth:`heartbeat` and :meth:`live_owners` in one script (one round trip)."""
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        t0 = time.time()
        epoch, sec, usec, flat = self._run("renew_lease", owner, ttl_ms, json.dumps(dict(info), ensure_ascii=False))
        self._clock(int(sec), int(usec), t0, time.time())
        return int(epoch), _owners(flat)

    def drop_lease(self, owner: str) -> None:
        self._run("drop_lease", owner)

    def lost_owners(self, *, now_ms: int) -> list[str]:
        return sorted(o.decode() for o in self._run("lost_owners"))

    def claim(self, name: str, holder: str, *, ttl_ms: int, now_ms: int) -> bool:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        return bool(self._run("claim", name, holder, ttl_ms))

    # ------------------------------------------------ shared tenant quotas
    def quota_open(self, ask: QuotaAsk, *, owner: str, now_ms: int, ttl_ms: int) -> QuotaGrant:
        check_quota_args(ask, owner, ttl_ms)
        tkey, member = _quota_keys(ask.tenant, owner, ask.stream_id)
        ok, n, refused, wait = self._run("quota_open", tkey, member, json.dumps([tkey, member]), owner,
                                         ask.max_streams, repr(float(ask.per_s)), ask.burst, ttl_ms,
                                         "open/" + ask.tenant)
        why = refused.decode() or None
        return QuotaGrant(bool(ok), int(n), why, int(wait) if why == "rate" else None)

    def quota_close(self, tenant: str, stream_id: str, *, owner: str) -> bool:
        tkey, member = _quota_keys(tenant, owner, stream_id)
        return bool(self._run("quota_close", tkey, member, owner, json.dumps([tkey, member])))

    def quota_renew(self, owner: str, held: Collection[tuple[str, str]], *, now_ms: int, ttl_ms: int) -> int:
        check_quota_args(None, owner, ttl_ms)
        keep = [json.dumps(_quota_keys(t, owner, s)) for t, s in held]
        return int(self._run("quota_renew", owner, ttl_ms, *keep))

    def quota_release_owned(self, owner: str) -> int:
        if not owner:
            raise ValueError("quota_release_owned: owner must be a non-empty string")
        return int(self._run("quota_release_owned", owner))

    def quota_open_count(self, tenant: str, *, now_ms: int) -> int:
        return int(self._run("quota_count", json.dumps([tenant])))

    def rate_take(self, key: str, *, per_s: float, burst: int, now_ms: int) -> int | None:
        check_rate_args(per_s, burst)
        wait = int(self._run("rate_take", key, repr(float(per_s)), burst))
        return wait or None

    def rate_take_upto(self, key: str, n: int, *, per_s: float, burst: int, now_ms: int) -> tuple[int, int | None]:
        check_rate_args(per_s, burst)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return _taken(self._run("rate_take_upto", key, repr(float(per_s)), burst, n))

    def rate_take_upto_then(self, key: str, n: int, then: Callable[[tuple[int, int | None]], None], *, per_s: float,
                            burst: int, now_ms: int) -> None:
        """:meth:`Store.rate_take_upto_then <atp_router.store.base.Store.rate_take_upto_then>`:
        inside :meth:`batch`, buffered like the stream writes (no round trip of
        its own) and ``then`` called with its answer when the batch's pipeline
        answers, on that thread; outside, at once."""
        b = self._local.batch
        if not b.depth:
            then(self.rate_take_upto(key, n, per_s=per_s, burst=burst, now_ms=now_ms))
            return
        check_rate_args(per_s, burst)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        args = (key, repr(float(per_s)), burst, n)
        self._buffer(b, "rate_take_upto", args)
        b.then[id(args)] = lambda reply: then(_taken(reply))

    # ------------------------------------------- replay nonces (signed frames)
    def record_nonce(self, tenant: str, kid: str, nonce: str, *, now_ms: int, expires_ms: int,
                     max_per_tenant: int) -> bool:
        check_nonce_args(tenant, kid, nonce, now_ms, expires_ms, max_per_tenant)
        got = int(self._run("nonce_put", msgspec.json.encode([tenant]), msgspec.json.encode([kid, nonce]), now_ms,
                            expires_ms, max_per_tenant, NONCE_SWEEP))
        if got < 0:
            raise nonce_limit_error(tenant, max_per_tenant)
        return got == 1

    # ------------------------------------------------------------------ streams
    def put_stream(self, record: StreamRecord) -> None:
        r = record
        self._run("put_stream", _sk(r.tenant, r.session_id, r.stream_id), msgspec.json.encode(r), r.state,
                  "" if r.close_reason is None else "+" + r.close_reason, r.created_ms,
                  "" if r.closed_ms is None else r.closed_ms, r.owner or "",
                  "" if r.idempotency_key is None else self._index("si", r.tenant, r.idempotency_key),
                  self._index("sx", r.tenant, r.stream_id))

    def close_stream(self, tenant: str, session_id: str, stream_id: str, *, reason: str, closed_ms: int) -> None:
        self._run("close_stream", _sk(tenant, session_id, stream_id), reason, closed_ms)

    def get_stream(self, tenant: str, session_id: str, stream_id: str) -> StreamRecord | None:
        return _stream(self._run("get_stream", _sk(tenant, session_id, stream_id)))

    def find_idempotent(self, tenant: str, idempotency_key: str) -> StreamRecord | None:
        return _stream(self._run("find_newest", self._index("si", tenant, idempotency_key)))

    def find_stream(self, tenant: str, stream_id: str) -> StreamRecord | None:
        return _stream(self._run("find_newest", self._index("sx", tenant, stream_id)))

    def append_event(self, tenant: str, session_id: str, stream_id: str, event_id: int, type: str,
                     frame: bytes) -> None:
        member = self._event_member(stream_id, event_id, type, frame)
        self._run("append_events", _sk(tenant, session_id, stream_id), self.max_events_per_stream, event_id, member)

    def append_events(self, tenant: str, session_id: str, stream_id: str,
                      events: Sequence[tuple[int, str, bytes]]) -> None:
        """:meth:`append_event` for each ``(event_id, type, frame)`` of ``events``
        in order, in **one** script call (a group commit's run: one ``EVALSHA``, one
        epoch, fence and deadline check, not one an event), stopping at the first that
        fails: the ones before it stay appended and its error is raised (in a
        :meth:`batch`: when the batch ends). A frame over ``max_event_bytes`` raises
        :class:`StoreLimitError` at once, after the events before it were sent."""
        args: list[int | bytes] = []
        over: StoreLimitError | None = None
        for event_id, type, frame in events:
            try:
                args += (event_id, self._event_member(stream_id, event_id, type, frame))
            except StoreLimitError as e:
                over = e
                break
        if args:
            self._run("append_events", _sk(tenant, session_id, stream_id), self.max_events_per_stream, *args)
        if over is not None:
            raise over

    def _event_member(self, stream_id: str, event_id: int, type: str, frame: bytes) -> bytes:
        """An event as stored (``b"<id> <len(type)> <type><frame>"``, the sorted set's
        member). Raises :class:`StoreLimitError` for a frame over ``max_event_bytes``."""
        if len(frame) > self.max_event_bytes:
            raise StoreLimitError("event_bytes", f"event {event_id} of stream {stream_id}: frame of {len(frame)} "
                                                 f"bytes is over the store's limit of {self.max_event_bytes}")
        t = type.encode()
        return b"%d %d %s%s" % (event_id, len(t), t, frame)

    def events(self, tenant: str, session_id: str, stream_id: str, after: int = 0) -> list[StoredEvent]:
        out = []
        for m in self._run("events", _sk(tenant, session_id, stream_id), after):
            i1 = m.index(b" ")
            i2 = m.index(b" ", i1 + 1)
            end = i2 + 1 + int(m[i1 + 1:i2])
            out.append(StoredEvent(event_id=int(m[:i1]), type=m[i2 + 1:end].decode(), frame=bytes(m[end:])))
        return out

    def interrupt_open_streams(self, reason: str, *, now_ms: int, owner: str | None = None) -> list[StreamRecord]:
        got = sorted(self._run("interrupt", reason, now_ms, owner or ""), key=lambda x: (int(x[1]), int(x[2])))
        return [msgspec.structs.replace(msgspec.json.decode(b, type=StreamRecord), state="interrupted",
                                        close_reason=reason, closed_ms=now_ms) for b, _, _ in got]

    def expire(self, before_ms: int) -> int:
        n = 0
        while True:
            dropped, more = self._run("expire", before_ms, EXPIRE_STEP)
            n += int(dropped)
            if not more:
                return n

    def _index(self, kind: str, tenant: str, name: str) -> bytes:
        return self._prefix.encode() + kind.encode() + b":" + msgspec.json.encode([tenant, name])

    # --------------------------------------------------------------------- RIB
    def save_rib(self, version: int, text: str, source: str, actor: str) -> None:
        self._run("save_rib", version, msgspec.json.encode([version, text, source, actor]), RIB_KEPT)

    def active_rib(self) -> tuple[int, str, str] | None:
        raw = self._run("active_rib")
        if raw is None:
            return None
        version, text, source, _ = msgspec.json.decode(raw)
        return version, text, source

    def active_rib_version(self) -> int | None:
        raw = self._run("active_rib_version")
        return None if raw is None else int(raw)

    def next_rib_version(self) -> int:
        return int(self._run("next_rib_version"))

    # ------------------------------------------------------------------- audit
    def append_audit(self, record: AuditRecord) -> None:
        self._run("append_audit", record.seq, msgspec.json.encode(record), "")

    def append_audit_chained(self, build: Callable[[int, str], AuditRecord]) -> AuditRecord:
        """:meth:`Store.append_audit_chained <atp_router.store.base.Store.append_audit_chained>`
        in one round trip when no other writer appended since this store's last
        append: chained to the head it last saw, and on a race to the head the
        refusing script answers (one more round trip per race, never a read)."""
        head = self._audit_head
        while True:
            if head is None:
                got = self.audit_head()
                head = (got.seq, got.hash) if got is not None else (0, GENESIS)
            r = build(*head)
            name, args = _audit_op(r)  # chained to head: (r.seq - 1, r.prev)
            reply = self._run(name, *args)
            if reply == 1:
                self._audit_head = (r.seq, r.hash)
                return r
            top = msgspec.json.decode(reply[0], type=AuditRecord) if reply[0] else None
            head = (top.seq, top.hash) if top is not None else (0, GENESIS)
            self._audit_head = head

    def append_audit_chained_then(self, build: Callable[[int, str], AuditRecord],
                                  then: Callable[[AuditRecord], None]) -> None:
        """:meth:`append_audit_chained`, the record handed to ``then`` once stored.
        Inside :meth:`batch` it is buffered: the batch's chained records are built
        from this store's last head, one behind the other, and sent in its
        pipeline (no round trip of their own); each carries the seq and hash of
        the record it follows, so after one that lost a race to another writer
        every later one is refused too, and those are chained again to the head
        the refusal answered (:meth:`_chained`)."""
        b = self._local.batch
        if not b.depth:
            then(self.append_audit_chained(build))
            return
        self._fail_fast()
        b.audits.append((build, then))

    def _chain(self, audits: list[tuple[Callable[[int, str], AuditRecord], Callable[[AuditRecord], None]]]
               ) -> list[AuditRecord]:
        """The records of ``audits`` built one behind the other from this store's last head."""
        if not audits:
            return []
        head = self._audit_head
        if head is None:
            got = self.audit_head()
            head = (got.seq, got.hash) if got is not None else (0, GENESIS)
        records = []
        for build, _ in audits:
            r = build(*head)
            records.append(r)
            head = (r.seq, r.hash)
        return records

    def _chained(self, audits: list[tuple[Callable[[int, str], AuditRecord], Callable[[AuditRecord], None]]],
                 records: list[AuditRecord], replies: list[Any]) -> None:
        """The pipelined chained appends' ``replies``: each stored one handed to its
        ``then``; from the first that lost a race on, built again from the head
        the refusal answered and sent again in one pipeline (a round trip a race,
        not a record), at most :data:`AUDIT_RACES` times, then one by one. A
        refused one (not a race) is logged and dropped with those behind it, as a
        deferred write's store error is (the batch's other writes stand)."""
        for race in range(AUDIT_RACES + 1):
            for i, ((_, then), r, reply) in enumerate(zip(audits, records, replies, strict=True)):
                if reply == 1:
                    self._audit_head = (r.seq, r.hash)
                    then(r)
                    continue
                err = self._reply_error(reply)
                if err is not None:
                    self._audit_head = None  # read again before the next chained append
                    log.error("audit: %d chained records refused by the store (%s); dropped", len(audits) - i, err)
                    return
                top = msgspec.json.decode(reply[0], type=AuditRecord) if reply[0] else None
                self._audit_head = (top.seq, top.hash) if top is not None else (0, GENESIS)
                audits = audits[i:]
                break
            else:
                return
            if race == AUDIT_RACES:
                for build, then in audits:
                    then(self.append_audit_chained(build))
                return
            records = self._chain(audits)
            replies = self._pipeline(list(map(_audit_op, records)))

    def audit_records(self, after: int = 0, limit: int | None = None) -> list[AuditRecord]:
        raw = self._run("audit_records", after, -1 if limit is None else limit)
        return [msgspec.json.decode(r, type=AuditRecord) for r in raw]

    def audit_head(self) -> AuditRecord | None:
        raw = self._run("audit_read", "au", -1)
        return None if raw is None else msgspec.json.decode(raw, type=AuditRecord)

    def audit_checkpoint(self) -> AuditCheckpoint | None:
        raw = self._run("audit_read", "acp", -1)
        return None if raw is None else msgspec.json.decode(raw, type=AuditCheckpoint)

    def audit_checkpoints(self) -> list[AuditCheckpoint]:
        return [msgspec.json.decode(r, type=AuditCheckpoint) for r in self._run("audit_read", "acp", "all")]

    def put_audit_checkpoint(self, checkpoint: AuditCheckpoint) -> None:
        self._run("put_audit_checkpoint", checkpoint.seq, msgspec.json.encode(checkpoint))

    # ---------------------------------------------------------------------- kv
    def get(self, key: str) -> bytes | None:
        return self._run("kv_get", key)

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        flat = self._run("kv_items", prefix)
        return [(flat[i].decode(), flat[i + 1]) for i in range(0, len(flat), 2)]

    def put(self, key: str, value: bytes) -> None:
        self._run("kv_put", key, bytes(value))

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None]) -> bytes | None:
        for _ in range(10_000):
            old = self._run("kv_get", key)
            new = fn(old)
            new = None if new is None else bytes(new)
            if self._run("kv_cas", key, "0" if old is None else "1", old or b"", "0" if new is None else "1",
                         new or b""):
                return new
        raise StoreError(f"kv {key!r}: update did not settle after 10000 tries (changed that often meanwhile)")

    # ------------------------------------------------------- response cache
    def cache_get(self, key: bytes, *, now_ms: int) -> bytes | None:
        return self._run("cache_get", key.hex(), now_ms)

    def cache_put(self, key: bytes, value: bytes, *, tenant: str | None, now_ms: int, expires_ms: int,
                  max_bytes: int, tenant_max_bytes: int | None = None) -> CachePut:
        stored, expired, evicted, n, total = self._run(
            "cache_put", key.hex(), bytes(value), tenant or "", now_ms, expires_ms, max_bytes,
            "" if tenant_max_bytes is None else tenant_max_bytes)
        return CachePut(stored=bool(stored), expired=int(expired), evicted=int(evicted),
                        stats=CacheStats(int(n), int(total)))

    def cache_drop(self, key: bytes) -> None:
        self._run("cache_drop", key.hex())

    def cache_stats(self) -> CacheStats:
        n, total = self._run("cache_stats")
        return CacheStats(int(n), int(total))


def mask_url(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` query
    parameter) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis URL>"
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    if "password" in query:
        query = urlencode([(k, "***" if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)])
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    # urlunsplit drops the empty authority of unix:///path: keep the "//" of the original.
    return parts.scheme + "://" + urlunsplit(("", netloc, parts.path, query, parts.fragment)).removeprefix("//")


def _owners(flat: list) -> dict[str, dict[str, Any]]:
    """A flat ``[owner, info JSON, …]`` reply as ``owner -> info``, by owner."""
    return {flat[i].decode(): json.loads(flat[i + 1]) for i in sorted(range(0, len(flat), 2), key=lambda i: flat[i])}


def _quota_keys(tenant: str, owner: str, stream_id: str) -> tuple[str, str]:
    """A quota entry's zset key suffix (JSON [tenant]) and member (JSON [owner, stream id])."""
    return json.dumps([tenant]), json.dumps([owner, stream_id])


def _record_args(record: CallRecord | None) -> tuple[Any, ...]:
    if record is None:
        return ()
    if not record.key or record.ttl_ms < 1:
        raise ValueError("a call record needs a key and a ttl_ms >= 1")
    return (record.key, record.value, record.ttl_ms)


def _taken(reply: list[Any]) -> tuple[int, int | None]:
    """A ``rate_take_upto`` reply as ``(taken, None)`` or ``(0, wait ms)``."""
    taken, wait = reply
    return (int(taken), None) if int(taken) else (0, int(wait))


def _sk(tenant: str, session_id: str, stream_id: str) -> bytes:
    return msgspec.json.encode([tenant, session_id, stream_id])


def _amount(v: int) -> int:
    if not -_MAX_AMOUNT < v < _MAX_AMOUNT:
        raise ValueError(f"amount {v} is out of the Redis store's range (|amount| < 2**53)")
    return v


def _limit(limit: Allowance) -> tuple[int | str, int | str]:
    return ("" if limit.tokens is None else _amount(limit.tokens),
            "" if limit.usd_micros is None else _amount(limit.usd_micros))


def _opt_int(v: bytes | int | None) -> int | None:
    return None if v is None or v == b"" else int(v)


def _rows(raw: list) -> list[tuple]:
    """A script's chain rows as the SQLite store's tuples ``(key, limit_t,
    limit_u, committed_t, committed_u, reserved_t, reserved_u, overage_t,
    overage_u, open)``."""
    return [(r[0].decode(), _opt_int(r[1]), _opt_int(r[2]), *(int(x) for x in r[3:9]), 1) for r in raw]


def _refused(rows: list[tuple], n: int, what: str) -> SharedResult:
    i = int(n) - 1
    return SharedResult(totals=_totals(rows), refusal=refusal(rows[i][0], what, _remaining(rows[i:])))


def _reservations(raw: list) -> list[Reservation]:
    return [Reservation(id=int(i), key=k.decode(), tokens=int(t), usd_micros=int(u)) for i, k, t, u in raw]


def _stream(raw: list | None) -> StreamRecord | None:
    if raw is None:
        return None
    body, state, reason, closed = raw
    rec = msgspec.json.decode(body, type=StreamRecord)
    return msgspec.structs.replace(rec, state=state.decode(), close_reason=None if reason is None else reason.decode(),
                                   closed_ms=None if closed is None else int(closed))


def _audit_op(r: AuditRecord) -> tuple[str, tuple[Any, ...]]:
    """The ``append_audit`` script call of chained record ``r``: checked against the
    head it is chained to (its seq ``r.seq - 1`` and hash ``r.prev``)."""
    return "append_audit", (r.seq, msgspec.json.encode(r), r.seq - 1, r.prev)
