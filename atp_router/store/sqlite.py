"""The embedded default :class:`~atp_router.store.base.Store`: one SQLite file,
``<state-dir>/state.db`` (stdlib :mod:`sqlite3`).

Durability: WAL journal, ``synchronous=NORMAL`` by default. Every mutating call
is one transaction committed before it returns (``append_event`` is the only
two-statement one: bump the stream's event count, insert the event), so a
change that was acknowledged survives a **kill -9** of the router process
(the WAL is in the OS page cache). A store opened ``exclusive`` with ``redo`` (the
single router, :mod:`atp_router.deploy.single`) makes each of those transactions
durable by one record in ``state.db.redo`` instead and commits SQLite in groups
(:mod:`atp_router.store.redo`); any later open replays what a crash
left there first. An **OS crash or power loss** may lose the
last transactions under ``NORMAL`` (never corrupting the file); pass
``synchronous="FULL"`` to fsync every commit and lose none, at the price of one
fsync per call.

Cost: one writer connection, used by the router on its trio thread (calls are
small and synchronous; a lock makes the object safe if a worker thread uses it
too). Measured on the development machine (2 shared cores, ext4 on a virtual
disk): with NORMAL an ``append_event`` of a 300-byte frame costs 45-100 µs and
a ledger ``commit`` 60-80 µs; with FULL about 270 µs and 210 µs
(``tests/store/test_sqlite_store.py::test_per_call_cost`` prints them).

Bounds: a stored frame is at most ``max_event_bytes`` (default 1 MiB) and a
stream keeps at most ``max_events_per_stream`` events (default 10,000); past
either, :class:`~atp_router.store.base.StoreLimitError`. :meth:`SqliteStore.expire`
drops finished streams and their events; the RIB history keeps the last
:data:`RIB_KEPT` versions. The audit table and its checkpoints (one per
checkpoint interval) are never pruned (append-only). The response cache is
bounded by the ``max_bytes`` each ``cache_put`` passes (expired entries first,
then the least recently used). The nonces of signed frames
(:meth:`SqliteStore.record_nonce`, one ``INSERT`` in one ``BEGIN IMMEDIATE``
transaction, so workers on the file agree) are bounded by the
``max_per_tenant`` each call passes (a per-tenant count row checks it in O(1));
each call sweeps up to :data:`~atp_router.store.base.NONCE_SWEEP` expired rows, oldest
first (index on the expiry), and before a tenant at its bound is refused up to
:data:`NONCE_FULL_SWEEP` more.

Several processes (``atp-router --workers N``): every worker opens the same file
with ``multiprocess=True``. SQLite's WAL lets them read at once and serialises
their write transactions; with ``multiprocess`` a writer waits for another in
the kernel (an ``flock`` on ``state.db.wlock`` around each write transaction)
instead of in SQLite's busy handler, whose sleeps start at 1 ms. Workers open it
with ``autocheckpoint=False`` and the supervisor calls :meth:`SqliteStore.checkpoint`
twice a second, so no worker holds the write lock through a checkpoint's fsync. The shared
budget ledger (``*_shared`` methods) decides each reserve, extend and commit
inside one ``BEGIN IMMEDIATE`` transaction along the account's whole chain,
so a tenant's account is exact across processes; ``owner`` columns say which
process a reservation, account or stream belongs to, for settling a dead one
(:meth:`SqliteStore.recover`, :meth:`SqliteStore.close_owned_accounts`,
:meth:`SqliteStore.interrupt_open_streams` with ``owner``).

Exclusive (``exclusive=True``, issue 25 item 2): a process that alone uses its state
directory for the life of the store (``atp-router`` on one process, which holds the
directory's lock) opens it with ``PRAGMA locking_mode=EXCLUSIVE``, set before the first
access: SQLite then takes the file's lock once and keeps it, and keeps the WAL index
in the process's memory (no ``-shm``), so a transaction makes no lock syscalls
(measured: ~24 ``fcntl`` a task before, ``bench/bench_store_syscalls.py``). Durability
is unchanged (the same WAL commits and ``synchronous``; a kill -9 leaves the WAL, which
the next open replays). The owner holds an ``flock`` on ``state.db.owner`` for the
store's life and every other open takes it shared for a moment: a second process
opening the file — exclusive or not, ``--workers`` included — is refused at once with
one line rather than waiting out SQLite's busy timeout. Never with ``multiprocess``.

Leases and claims of router processes sharing the store (issue 12) are rows
timed by the callers' ``now_ms`` (one machine, one clock); :meth:`SqliteStore.update`
is one ``BEGIN IMMEDIATE`` transaction. So is each shared tenant quota decision
(:meth:`SqliteStore.quota_open`: the tenant's expired ``quota_stream`` rows
dropped, its rows counted, :func:`atp_router.flow.quota.decide` run and its
entry and ``rate_bucket`` time written) and each :meth:`SqliteStore.rate_take`.

The schema is versioned in the ``meta`` table (:data:`SCHEMA_VERSION`); a
state directory written by a newer router is refused with
:class:`~atp_router.store.base.SchemaError` rather than misread; an older one is
migrated in place (version 1 → 2: the ``reserved_*`` and ``owner`` columns; 2 → 3: streams
numbered, ``sno``, and their events keyed by it — the stream and event rows copied in the
migration's one transaction, so a first start on a large state directory takes a moment). The state directory
is created with mode 0700 and ``state.db`` with 0600.

Faults (issue 22 item 5). At start, :meth:`SqliteStore.open` refuses with a one-line
:class:`~atp_router.store.base.StoreError` naming the file: a damaged database
(``PRAGMA quick_check``, at most :data:`QUICK_CHECK_S` — past it the store opens
unchecked, with a warning; the line gives the repair command, ``sqlite3 state.db
".recover" | sqlite3 recovered.db``); a directory that has held state — its
:data:`STATE_MARKER`, written when its database got a schema — whose
``state.db`` is missing, 0 bytes or without tables (delete the marker to accept a
new, empty ledger); a directory or file that cannot be created, opened or written.
A write that finds the disk full (``SQLITE_FULL``) raises
:class:`~atp_router.store.base.StoreFull` ("state store full: <path>: no space left
on device"), an I/O error :class:`~atp_router.store.base.StoreUnavailable`
(:func:`write_fault`); either way the transaction is rolled back first — also a
``COMMIT`` that failed, which would otherwise leave the connection inside it and
every later write refused — so the first write after space returns succeeds.
What the router does meanwhile: :mod:`atp_router.deploy.single`; whether it is ready
for new work (``GET /v1/ready``): :meth:`SqliteStore.writable`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shlex
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import msgspec

from atp_router.flow.budget import (
    AccountState,
    AccountTotals,
    Allowance,
    Charge,
    LedgerSnapshot,
    Reservation,
    SharedResult,
    refusal,
)
from atp_router.flow.quota import QuotaAsk, QuotaGrant, decide, gcra
from atp_router.store.audit_records import GENESIS, AuditCheckpoint, AuditRecord
from atp_router.store.base import (
    NONCE_SWEEP,
    CachePut,
    CacheStats,
    NotFound,
    SchemaError,
    Store,
    StoredEvent,
    StoreError,
    StoreFull,
    StoreLimitError,
    StoreUnavailable,
    StreamRecord,
    check_nonce_args,
    check_quota_args,
    check_rate_args,
    nonce_limit_error,
)
from atp_router.store.redo import RecordingConnection, RedoLog

__all__ = ["EVENT_ID_BITS", "PROBE_ROOM_BYTES", "QUICK_CHECK_S", "RIB_KEPT", "SCHEMA_VERSION", "STATE_MARKER", "SqliteStore", "ledger_snapshot", "write_fault"]

log = logging.getLogger("atp_router.store.sqlite")

#: Version of the schema below; bump it with a migration in ``_migrate``.
SCHEMA_VERSION = 3
#: Room (bytes) :meth:`SqliteStore.writable` wants free beside the database: the next
#: transactions grow its WAL and pages (a write that only reuses WAL space can
#: succeed on a disk where a stream open no longer fits).
PROBE_ROOM_BYTES = 256 * 1024
#: Bits of a stored event's rowid that hold its id, below its stream's number (schema 3,
#: ``_event_key``): a stream's event ids are 1 .. 2**24 - 1.
EVENT_ID_BITS = 24
_EVENT_IDS = 1 << EVENT_ID_BITS
#: Reservation ids the store marks used at a time (``meta.next_reservation_id``, the
#: hi/lo pattern): the mark is written with the first reservation past it, not with
#: every one, so a reservation writes no ``meta`` page; a restart starts past the
#: mark (ids are never reused; up to this many are skipped).
RESERVATION_ID_BLOCK = 1024
#: RIB versions kept in history (the newest is the active one).
RIB_KEPT = 16
#: ``PRAGMA synchronous`` of a store (:meth:`SqliteStore.open`): ``NORMAL`` survives a
#: process crash, ``FULL`` an OS crash too.
SyncMode = Literal["NORMAL", "FULL"]


def sync_mode(name: str) -> SyncMode:
    """``name`` in any case (a router config's or the CLI's ``state_sync``) as a
    :data:`SyncMode`; raises ValueError, as :meth:`SqliteStore.open` does, for any other."""
    mode = name.upper()
    if mode == "NORMAL":
        return "NORMAL"
    if mode == "FULL":
        return "FULL"
    raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {mode!r}")
_APP = "atp-router"
#: The file beside ``state.db`` saying the directory has held state (written
#: once its database has a schema): a directory with it whose database is
#: missing or empty is refused at start, never run on an empty ledger. Delete it
#: to accept one (module docstring, Faults).
STATE_MARKER = "state.marker"
#: The longest ``PRAGMA quick_check`` at start (s): past it the store opens
#: unchecked, with a warning (a file of gigabytes must not hold the start-up).
QUICK_CHECK_S = 10.0

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE account (
    key TEXT PRIMARY KEY, parent TEXT, limit_tokens INTEGER, limit_usd INTEGER,
    committed_tokens INTEGER NOT NULL DEFAULT 0, committed_usd INTEGER NOT NULL DEFAULT 0,
    overage_tokens INTEGER NOT NULL DEFAULT 0, overage_usd INTEGER NOT NULL DEFAULT 0,
    open INTEGER NOT NULL DEFAULT 1,
    reserved_tokens INTEGER NOT NULL DEFAULT 0, reserved_usd INTEGER NOT NULL DEFAULT 0, owner TEXT);
CREATE TABLE reservation (id INTEGER PRIMARY KEY, account TEXT NOT NULL, tokens INTEGER NOT NULL,
    usd_micros INTEGER NOT NULL, owner TEXT);
CREATE TABLE stream (
    sno INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, idempotency_key TEXT,
    state TEXT NOT NULL, close_reason TEXT, created_ms INTEGER NOT NULL, closed_ms INTEGER,
    n_events INTEGER NOT NULL DEFAULT 0, body BLOB NOT NULL, owner TEXT,
    UNIQUE (tenant, stream_id, session_id));
CREATE INDEX stream_idem ON stream (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX stream_done ON stream (state, closed_ms);
CREATE TABLE event (id INTEGER PRIMARY KEY, type TEXT NOT NULL, frame BLOB NOT NULL);
CREATE TABLE rib (n INTEGER PRIMARY KEY AUTOINCREMENT, version INTEGER NOT NULL, text TEXT NOT NULL,
    source TEXT NOT NULL, actor TEXT NOT NULL);
CREATE TABLE audit (seq INTEGER PRIMARY KEY, ts_ms INTEGER NOT NULL, kind TEXT NOT NULL, actor TEXT NOT NULL,
    tenant TEXT, detail TEXT NOT NULL, prev TEXT NOT NULL, hash TEXT NOT NULL);
CREATE TABLE audit_checkpoint (seq INTEGER PRIMARY KEY, hash TEXT NOT NULL, mac TEXT NOT NULL);
CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE INDEX reservation_owner ON reservation (owner) WHERE owner IS NOT NULL;
CREATE INDEX account_owner ON account (owner) WHERE owner IS NOT NULL;
"""

# The response cache (atp_router.policy.cache), in any schema version: created where
# missing, so an older state directory gains it and an older router ignores it.
# ``cache_total`` (one row) keeps the entry count and value bytes, moved in the
# same transaction as every insert and delete (an O(1) size bound check).
_CACHE_SCHEMA = [
    ("CREATE TABLE IF NOT EXISTS cache (key BLOB PRIMARY KEY, tenant TEXT, value BLOB NOT NULL, "
     "size INTEGER NOT NULL, created_ms INTEGER NOT NULL, expires_ms INTEGER NOT NULL, used_ms INTEGER NOT NULL)"),
    "CREATE INDEX IF NOT EXISTS cache_used ON cache (used_ms)",
    "CREATE INDEX IF NOT EXISTS cache_expires ON cache (expires_ms)",
    # Each tenant's own entries by last use (the per-tenant budget, cache_put's tenant_max_bytes).
    "CREATE INDEX IF NOT EXISTS cache_tenant_used ON cache (tenant, used_ms)",
    ("CREATE TABLE IF NOT EXISTS cache_total (id INTEGER PRIMARY KEY CHECK (id = 0), entries INTEGER NOT NULL, "
     "bytes INTEGER NOT NULL)"),
    "INSERT OR IGNORE INTO cache_total (id, entries, bytes) VALUES (0, 0, 0)",
]

# Router leases and claims (issue 12: several routers on one store), in any schema
# version like the cache: created where missing, ignored by an older router.
_LEASE_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS lease (owner TEXT PRIMARY KEY, expires_ms INTEGER NOT NULL, info TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS claim (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_ms INTEGER NOT NULL)",
]

# Nonces of signed frames (issue 19: replay across restarts and workers), in any
# schema version like the cache: one row per (tenant, kid, nonce) until it expires;
# ``nonce_count`` keeps each tenant's rows (moved in the same transaction as every
# insert and delete: an O(1) check of the per-tenant bound); ``nonce_expires``
# serves the sweep. Two B-trees and a count row: a record costs about a kv put.
_NONCE_SCHEMA = [
    ("CREATE TABLE IF NOT EXISTS nonce (tenant TEXT NOT NULL, kid TEXT NOT NULL, nonce TEXT NOT NULL, "
     "expires_ms INTEGER NOT NULL, PRIMARY KEY (tenant, kid, nonce)) WITHOUT ROWID"),
    "CREATE INDEX IF NOT EXISTS nonce_expires ON nonce (expires_ms)",
    "CREATE TABLE IF NOT EXISTS nonce_count (tenant TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
]
# Shared tenant quotas (issue 22 item 3, atp_router.flow.quota), in any schema version
# like the cache: a tenant's open streams, one row per (owner, stream id) until it
# expires (callers' Unix ms: the workers share one machine's clock), and each GCRA
# bucket's theoretical arrival time (ms) by key.
_QUOTA_SCHEMA = [
    ("CREATE TABLE IF NOT EXISTS quota_stream (tenant TEXT NOT NULL, owner TEXT NOT NULL, stream_id TEXT NOT NULL, "
     "expires_ms INTEGER NOT NULL, PRIMARY KEY (tenant, owner, stream_id)) WITHOUT ROWID"),
    "CREATE INDEX IF NOT EXISTS quota_stream_owner ON quota_stream (owner)",
    "CREATE INDEX IF NOT EXISTS quota_stream_expires ON quota_stream (tenant, expires_ms)",
    "CREATE TABLE IF NOT EXISTS rate_bucket (key TEXT PRIMARY KEY, tat_ms REAL NOT NULL) WITHOUT ROWID",
]
#: Expired nonces (oldest first, any tenant) swept before a tenant at its bound is refused.
NONCE_FULL_SWEEP = 4096

# A stream read by its id alone (``find_stream``: GET /v1/streams/{id}/events of a
# stream no longer in the router's memory, or of an unknown id): without an index
# each lookup scans all the tenant's stored streams (≈ 10 ms at 100,000, issue 10).
# Schema 2 had ``stream_by_id`` (tenant, stream_id) for it; schema 3's unique key is
# ordered (tenant, stream_id, session_id) and serves both lookups, one B-tree fewer
# written a task.

# Schema 1 → 2: what a reservation holds is also kept on every account of its
# chain (reserved_*), and reservations, accounts and streams name their owner.
_MIGRATE_2 = [
    "ALTER TABLE account ADD COLUMN reserved_tokens INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE account ADD COLUMN reserved_usd INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE account ADD COLUMN owner TEXT",
    "ALTER TABLE reservation ADD COLUMN owner TEXT",
    "ALTER TABLE stream ADD COLUMN owner TEXT",
    "CREATE INDEX reservation_owner ON reservation (owner) WHERE owner IS NOT NULL",
    "CREATE INDEX account_owner ON account (owner) WHERE owner IS NOT NULL",
]

# Schema 2 → 3 (issue 25 item 2): a stream is numbered (``sno``, its rowid, kept
# explicit so a VACUUM cannot renumber it) and its events are keyed by that number:
# an event's rowid is ``sno << EVENT_ID_BITS | event_id`` (:func:`_event_key`), one
# B-tree and no index. A task's events are appended at the end of the table (SQLite's
# quick balance: one new page), instead of 3 KB a task going to random places of a
# WITHOUT ROWID B-tree keyed (tenant, session, stream, event), whose leaves split and
# rebalanced 4-5 pages a task (~9 WAL frames of events a task,
# bench/bench_store_syscalls.py; keyed (sno, event_id) but still WITHOUT ROWID: 7.7, an
# index B-tree rebalances three siblings on every full leaf, even at its end; a rowid
# table with a (sno, event_id) index: 6.5; this: 4). The rows are copied in the
# migration's transaction (refused if an event id does not fit, never truncated).
_MIGRATE_3 = [
    """CREATE TABLE stream_v3 (
    sno INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, idempotency_key TEXT,
    state TEXT NOT NULL, close_reason TEXT, created_ms INTEGER NOT NULL, closed_ms INTEGER,
    n_events INTEGER NOT NULL DEFAULT 0, body BLOB NOT NULL, owner TEXT,
    UNIQUE (tenant, stream_id, session_id))""",
    ("INSERT INTO stream_v3 (sno, tenant, session_id, stream_id, idempotency_key, state, close_reason, created_ms, "
     "closed_ms, n_events, body, owner) SELECT rowid, tenant, session_id, stream_id, idempotency_key, state, "
     "close_reason, created_ms, closed_ms, n_events, body, owner FROM stream ORDER BY rowid"),
    "CREATE TABLE event_v3 (id INTEGER PRIMARY KEY, type TEXT NOT NULL, frame BLOB NOT NULL)",
    (f"INSERT INTO event_v3 (id, type, frame) SELECT (s.sno << {EVENT_ID_BITS}) | e.event_id, e.type, e.frame FROM event e "
     "JOIN stream_v3 s ON s.tenant = e.tenant AND s.session_id = e.session_id AND s.stream_id = e.stream_id "
     "ORDER BY 1"),
    "DROP TABLE event",
    "DROP TABLE stream",
    "ALTER TABLE stream_v3 RENAME TO stream",
    "ALTER TABLE event_v3 RENAME TO event",
    "CREATE INDEX stream_idem ON stream (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL",
    "CREATE INDEX stream_done ON stream (state, closed_ms)",
]
#: The redo log's last sequence number SQLite has committed (atp_router.store.redo).
_SET_REDO_LSN = ("INSERT INTO meta (key, value) VALUES ('redo_lsn', ?) "
                 "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
#: A stream's number by its key (the events' key, schema 3).
_SNO = "SELECT sno FROM stream WHERE tenant = ? AND session_id = ? AND stream_id = ?"


def _event_key(sno: int, event_id: int) -> int:
    """The rowid of event ``event_id`` of stream ``sno`` (schema 3)."""
    return sno << EVENT_ID_BITS | event_id


# The account and every ancestor, for a charge (and a change of what is held)
# applied along the chain.
_CHAIN_UPDATE = """
WITH RECURSIVE chain(k) AS (
    SELECT :key UNION ALL SELECT a.parent FROM account a JOIN chain c ON a.key = c.k WHERE a.parent IS NOT NULL)
UPDATE account SET committed_tokens = committed_tokens + :t, committed_usd = committed_usd + :u,
    overage_tokens = overage_tokens + :ot, overage_usd = overage_usd + :ou,
    reserved_tokens = reserved_tokens + :rt, reserved_usd = reserved_usd + :ru
WHERE key IN (SELECT k FROM chain)
"""
# The account and every ancestor as they stand, nearest first.
_CHAIN_READ = """
WITH RECURSIVE chain(k, d) AS (
    SELECT :key, 0 UNION ALL SELECT a.parent, c.d + 1 FROM account a JOIN chain c ON a.key = c.k
    WHERE a.parent IS NOT NULL)
SELECT a.key, a.limit_tokens, a.limit_usd, a.committed_tokens, a.committed_usd, a.reserved_tokens, a.reserved_usd,
    a.overage_tokens, a.overage_usd, a.open
FROM chain c JOIN account a ON a.key = c.k ORDER BY c.d
"""


def _moves(*, t: int = 0, u: int = 0, ot: int = 0, ou: int = 0, rt: int = 0, ru: int = 0) -> dict[str, int]:
    return {"t": t, "u": u, "ot": ot, "ou": ou, "rt": rt, "ru": ru}

_STREAM_COLS = "tenant, session_id, stream_id, idempotency_key, state, close_reason, created_ms, closed_ms, body"
_AUDIT_COLS = "seq, ts_ms, kind, actor, tenant, detail, prev, hash"


class SqliteStore(Store):
    """:class:`~atp_router.store.base.Store` on SQLite (see the module docstring).
    Build it with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, max_event_bytes: int,
                 max_events_per_stream: int, write_lock: int | None = None, owner_lock: int | None = None,
                 redo: RedoLog | None = None) -> None:
        self._conn = conn
        self.path = path
        self.max_event_bytes = max_event_bytes
        self.max_events_per_stream = max_events_per_stream
        # Re-entrant: a batch (group commit) holds it around the operations it groups.
        self._lock = threading.RLock()
        self._batch_depth = 0
        # multiprocess: an flock'ed file around each write transaction (module docstring).
        self._wfd = write_lock
        self._wdepth = 0
        # exclusive: the flock'ed ``state.db.owner`` held for the store's life (module docstring).
        self._ofd = owner_lock
        # redo: write transactions made durable in the redo log, committed to SQLite now and then
        # (atp_router.store.redo); _tx_open: a logical write transaction (savepoint ``tx``) is open.
        self._redo = redo
        self._tx_open = False
        self._committed_at = time.monotonic()
        #: Why SQLite refused the last commit of the long transaction (None: it took it).
        self._fault: StoreUnavailable | None = None

    @classmethod
    def open(cls, state_dir: Path | str, *, create: bool = True,
             synchronous: SyncMode = "NORMAL", max_event_bytes: int = 1 << 20,
             max_events_per_stream: int = 10_000, multiprocess: bool = False,
             autocheckpoint: bool = True, check_s: float = QUICK_CHECK_S, exclusive: bool = False,
             redo: bool = False) -> SqliteStore:
        """Open (``create``: and create, directory 0700, file 0600) the store in
        ``state_dir/state.db``; ``multiprocess``: other processes write it at the
        same time (see the module docstring); not ``autocheckpoint``: commits never
        copy the WAL back into the database (nor fsync it) — another connection
        calls :meth:`checkpoint` instead; ``exclusive``: this process alone uses the
        file for the life of the store (``PRAGMA locking_mode=EXCLUSIVE``: no lock
        syscalls per transaction, the WAL index in the process's memory, no ``-shm``;
        module docstring, Exclusive) — never with ``multiprocess``; ``redo`` (only
        ``exclusive``): each write transaction made durable by one record in
        ``state.db.redo`` and committed to SQLite in groups (:mod:`atp_router.store.redo`);
        the log a crash left is replayed here, before anything reads the store.

        Start-up checks (module docstring, Faults): ``PRAGMA quick_check`` for at
        most ``check_s`` seconds (0: none; a ``multiprocess`` open skips it, the
        supervisor's open checked the file), a damaged file refused; a directory
        whose :data:`STATE_MARKER` says it held state refused when its database
        is missing or empty. Raises :class:`~atp_router.store.base.StoreError`
        with a one-line message naming the file for each refusal, when there is
        no state and not ``create``, or when the directory or file cannot be
        opened or written; :class:`~atp_router.store.base.SchemaError` for a newer
        or foreign schema. Refused the same way (one line) while another process
        holds the file ``exclusive`` — or, for an ``exclusive`` open, while
        another process has it open through this class."""
        _check_open(synchronous, max_events_per_stream, multiprocess=multiprocess, exclusive=exclusive, redo=redo)
        d = Path(state_dir)
        path = d / "state.db"
        marker = d / STATE_MARKER
        if not create and not path.exists():
            raise StoreError(f"no state in {d} (no state.db)")
        ofd = _owner_lock(d, path, exclusive=exclusive, create=create)
        try:
            conn = _connect(d, path, marker, create, recording=redo)
        except BaseException:
            os.close(ofd)
            raise
        if not exclusive:
            os.close(ofd)  # checked: no exclusive owner now (one that starts later finds this one's lock)
            ofd = None
        try:
            _prepare(conn, path, marker, create=create, synchronous=synchronous, autocheckpoint=autocheckpoint,
                     check_s=0 if multiprocess else check_s, exclusive=exclusive)
            # Also without ``redo``: what a crashed exclusive router left in its log is replayed first.
            log_ = _open_redo(conn, path, fsync=synchronous == "FULL", keep=redo)
        except BaseException as e:
            conn.close()
            if ofd is not None:
                os.close(ofd)
            if isinstance(e, sqlite3.DatabaseError | OSError):
                raise StoreError(_open_refusal(path, e) if isinstance(e, sqlite3.DatabaseError)
                                 else _unusable(d, e, d)) from None
            raise
        wfd = os.open(d / "state.db.wlock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600) if multiprocess else None
        return cls(conn, path, max_event_bytes=max_event_bytes, max_events_per_stream=max_events_per_stream,
                   write_lock=wfd, owner_lock=ofd, redo=log_)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the cross-process write lock (``multiprocess``) around a write
        transaction; nested uses hold it once. Call with ``self._lock`` held."""
        if self._wfd is None:
            yield
            return
        self._wdepth += 1
        try:
            if self._wdepth == 1:
                fcntl.flock(self._wfd, fcntl.LOCK_EX)
            yield
        finally:
            self._wdepth -= 1
            if self._wdepth == 0:
                fcntl.flock(self._wfd, fcntl.LOCK_UN)

    @contextmanager
    def _faults(self) -> Iterator[None]:
        """A write that failed for want of space or on an I/O error, as
        :class:`~atp_router.store.base.StoreFull` / :class:`~atp_router.store.base.StoreUnavailable`
        naming the file (module docstring, Faults), the transaction rolled back
        first so the next write starts clean. Other errors pass as they are.
        Call with ``self._lock`` held."""
        try:
            yield
        except sqlite3.Error as e:
            if self._batch_depth == 0:
                self._abort()
            fault = write_fault(self.path, e)
            if fault is None:
                raise
            raise fault from e

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._faults():
            c = self._conn
            if self._batch_depth:
                # Inside a batch: one savepoint per operation, so a failed one
                # undoes only itself; the batch commits the rest at once.
                c.execute("SAVEPOINT op")
                try:
                    yield c
                except BaseException:
                    if c.in_transaction:  # SQLite may have rolled the whole batch back (a full disk)
                        with suppress(sqlite3.Error):
                            c.execute("ROLLBACK TO op")
                            c.execute("RELEASE op")
                    raise
                c.execute("RELEASE op")
                return
            with self._writing():
                self._begin()
                try:
                    yield c
                except BaseException:
                    self._abort()
                    raise
                self._end()

    def _begin(self) -> None:
        """Start a write transaction: ``BEGIN IMMEDIATE``; with the redo log a
        savepoint inside the long transaction, its statements recorded. While
        SQLite refuses to commit (:attr:`_fault`: the disk full), the commit is
        tried first and the write refused with that fault as long as it fails —
        as every write was refused before the log (module docstring, Faults)."""
        c = self._conn
        if self._redo is None:
            c.execute("BEGIN IMMEDIATE")
            return
        if self._fault is not None or self._redo.due(time.monotonic() - self._committed_at):
            # The commit due (or refused last time) first: a write is refused as soon as it fails.
            self._open_long()
            self._commit_redo()
            if self._fault is not None:
                raise self._fault
        self._open_long()
        c.execute("SAVEPOINT tx")
        assert isinstance(c, RecordingConnection)
        c.recording = []
        self._tx_open = True

    def _open_long(self) -> None:
        """The long transaction of the redo log open (and the log replayed into it
        when SQLite rolled the last one back by itself, a fault)."""
        c, redo = self._conn, self._redo
        assert redo is not None
        if c.in_transaction:
            return
        c.execute("BEGIN IMMEDIATE")
        if redo.pending:
            try:
                redo.replay(c, redo.committed_lsn)
            except BaseException:
                _rollback(c)
                raise

    def _end(self) -> None:
        """Make the write transaction durable: ``COMMIT``; with the redo log its
        record written (one ``write``), then the savepoint released (the long
        transaction is committed to SQLite when due, at the next :meth:`_begin`)."""
        c = self._conn
        if self._redo is None:
            c.execute("COMMIT")
            return
        assert isinstance(c, RecordingConnection)
        statements, c.recording = c.recording, None
        if statements:
            try:
                self._redo.append(statements)
            except BaseException:
                self._abort()
                raise
        self._tx_open = False
        c.execute("RELEASE tx")

    def _abort(self) -> None:
        """Undo the open write transaction (idempotent): ``ROLLBACK``; with the redo
        log back to its savepoint (what earlier transactions did stays)."""
        c = self._conn
        if self._redo is None:
            _rollback(c)
            return
        if not self._tx_open:
            return
        self._tx_open = False
        assert isinstance(c, RecordingConnection)
        c.recording = None
        if c.in_transaction:  # else SQLite rolled it all back: the next _begin replays the log
            with suppress(sqlite3.Error):
                c.execute("ROLLBACK TO tx")
                c.execute("RELEASE tx")

    def commit_due(self) -> bool:
        """Commit the redo log's transactions to SQLite if a commit is due
        (:meth:`~atp_router.store.redo.RedoLog.due`) and none is under way — for a
        timer, so an idle store commits too. True when it committed; False when
        nothing was due (or there is no redo log); a refused commit keeps its
        fault for the next write (:meth:`_begin`)."""
        redo = self._redo
        if redo is None or not redo.pending or not redo.due(time.monotonic() - self._committed_at):
            return False
        with self._lock:
            if self._tx_open or self._batch_depth or not self._conn.in_transaction:
                return False
            self._commit_redo()
            return self._fault is None

    def _commit_redo(self) -> None:
        """Commit the long transaction to SQLite with the log's last sequence number
        (``meta.redo_lsn``), then empty the log. A commit SQLite refuses keeps the log
        (logged; tried again at the next commit point)."""
        redo, c = self._redo, self._conn
        assert redo is not None
        self._committed_at = time.monotonic()
        if not c.in_transaction or self._tx_open:
            return
        last = redo.next_lsn - 1
        try:
            sqlite3.Connection.execute(c, _SET_REDO_LSN, (str(last),))
            sqlite3.Connection.execute(c, "COMMIT")
        except sqlite3.Error as e:
            fault = write_fault(self.path, e)
            if self._fault is None:
                log.warning("state store %s: commit of %d logged transactions refused (%s); they stay in %s",
                            self.path, redo.pending, e, redo.path)
            self._fault = fault or StoreUnavailable(f"state store {self.path}: commit refused: {e}")
            return
        if self._fault is not None:
            log.warning("state store %s takes commits again", self.path)
        self._fault = None
        redo.reset(last)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: the mutating calls made inside are one transaction,
        durable together when the block ends (each call that raised undone
        alone). Holds the store's lock for the block: keep it short."""
        with self._lock:
            if self._batch_depth:
                self._batch_depth += 1
                try:
                    yield
                finally:
                    self._batch_depth -= 1
                return
            with self._faults(), self._writing():
                self._begin()
                self._batch_depth = 1
                try:
                    yield
                except BaseException:
                    self._batch_depth = 0
                    self._abort()
                    raise
                self._batch_depth = 0
                self._end()

    def checkpoint(self) -> tuple[int, int]:
        """Copy what the WAL holds back into the database file, without blocking
        readers or writers (``PRAGMA wal_checkpoint(PASSIVE)``): ``(WAL frames,
        frames copied)``. For stores whose writers open with ``autocheckpoint``
        off: the router workers' commits then never wait for a checkpoint's
        copy and fsync — the supervisor runs it aside."""
        with self._lock:
            if self._redo is not None:
                self._commit_redo()  # a checkpoint copies only what is committed
            _, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return frames, copied

    def _one(self, sql: str, args: tuple | dict = ()) -> sqlite3.Cursor:
        """One writing statement (its own transaction, or part of a batch)."""
        if self._redo is not None and not self._batch_depth:
            with self._tx() as c:
                return c.execute(sql, args)
        with self._lock, self._faults(), self._writing():
            return self._conn.execute(sql, args)

    def _row(self, sql: str, args: tuple = ()) -> tuple | None:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def writable(self, room_bytes: int = PROBE_ROOM_BYTES) -> StoreUnavailable | None:
        """Whether the store takes writes now (readiness, issue 22 item 4): a write
        transaction (the key ``ready.probe``), then ``room_bytes`` written to
        ``state.db.probe.<pid>`` beside the database, fsync'd and removed — its
        file system has room for the next transactions. None, or the fault as
        a write would raise it (:class:`~atp_router.store.base.StoreFull` on a
        full disk, :class:`~atp_router.store.base.StoreUnavailable` on an I/O
        error). Any thread."""
        try:
            self.put("ready.probe", str(time.time()).encode())
        except StoreUnavailable as e:
            return e
        probe = self.path.with_name(f"{self.path.name}.probe.{os.getpid()}")  # --workers: one each
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(bytes(min(room_bytes, 1 << 16)))
                left = room_bytes
                while left > 0:
                    left -= os.write(fd, view[:left])
                os.fsync(fd)
            finally:
                os.close(fd)
                with suppress(OSError):
                    os.unlink(probe)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return StoreFull(f"state store full: {self.path}: no space left on device (no room for "
                                 f"{room_bytes} bytes beside it)")
            return StoreUnavailable(f"state store I/O error: {self.path}: {e.strerror or e}")
        return None

    def close(self) -> None:
        with self._lock:
            redo = self._redo
            if redo is not None:
                self._commit_redo()
                self._redo = None
            self._conn.close()
            if redo is not None:
                redo.close()
                if redo.pending == 0:  # committed: the log is empty and goes (else the next open replays it)
                    with suppress(OSError):
                        redo.path.unlink()
            if self._wfd is not None:
                os.close(self._wfd)
                self._wfd = None
            if self._ofd is not None:
                os.close(self._ofd)  # after the connection: its exclusive lock is gone
                self._ofd = None

    # ------------------------------------------------------------ budget ledgers
    def open_account(self, key: str, parent: str | None, limit: Allowance) -> None:
        with self._tx() as c:
            _open_account(c, key, parent, limit, owner=None)

    def close_account(self, key: str) -> None:
        if self._one("UPDATE account SET open = 0 WHERE key = ? AND open = 1", (key,)).rowcount == 0:
            raise NotFound(f"no open budget account {key!r}")

    def reserve(self, reservation: Reservation) -> None:
        r = reservation
        with self._tx() as c:
            if not _is_open(c, r.key):
                raise NotFound(f"no open budget account {r.key!r}")
            old = c.execute("SELECT tokens, usd_micros FROM reservation WHERE id = ?", (r.id,)).fetchone() or (0, 0)
            c.execute(
                "INSERT INTO reservation (id, account, tokens, usd_micros) VALUES (?, ?, ?, ?) ON CONFLICT (id) "
                "DO UPDATE SET account = excluded.account, tokens = excluded.tokens, usd_micros = excluded.usd_micros",
                (r.id, r.key, r.tokens, r.usd_micros),
            )
            c.execute(_CHAIN_UPDATE, {"key": r.key, **_moves(rt=r.tokens - old[0], ru=r.usd_micros - old[1])})
            # The ledger's next id survives a restart, so ids are never reused: marked a block at a
            # time (RESERVATION_ID_BLOCK), never lowered (MAX: another process may have marked more).
            # The statement changes no row (writes no page) while the mark is past this id.
            c.execute("INSERT INTO meta (key, value) VALUES ('next_reservation_id', :mark) ON CONFLICT (key) "
                      "DO UPDATE SET value = :mark WHERE CAST(value AS INTEGER) <= :id",
                      {"mark": str(r.id + RESERVATION_ID_BLOCK), "id": r.id})

    def release(self, reservation_id: int) -> None:
        with self._tx() as c:
            key, t, u = _reservation(c, reservation_id)
            c.execute(_CHAIN_UPDATE, {"key": key, **_moves(rt=-t, ru=-u)})
            c.execute("DELETE FROM reservation WHERE id = ?", (reservation_id,))

    def commit(self, reservation_id: int, charge: Charge) -> None:
        with self._tx() as c:
            key, t, u = _reservation(c, reservation_id)
            c.execute(_CHAIN_UPDATE, {"key": key, **_moves(t=charge.tokens, u=charge.usd_micros,
                                                           ot=charge.overage_tokens, ou=charge.overage_usd_micros,
                                                           rt=-t, ru=-u)})
            c.execute("DELETE FROM reservation WHERE id = ?", (reservation_id,))

    def set_limit(self, key: str, limit: Allowance) -> None:
        cur = self._one("UPDATE account SET limit_tokens = ?, limit_usd = ? WHERE key = ? AND open = 1",
                        (limit.tokens, limit.usd_micros, key))
        if cur.rowcount == 0:
            raise NotFound(f"no open budget account {key!r}")

    def load_ledger(self) -> LedgerSnapshot:
        with self._lock:
            accts = self._conn.execute(
                "SELECT key, parent, limit_tokens, limit_usd, committed_tokens, committed_usd, overage_tokens, "
                "overage_usd FROM account WHERE open = 1").fetchall()
            res = [Reservation(id=i, key=k, tokens=t, usd_micros=u) for i, k, t, u in self._conn.execute(
                "SELECT id, account, tokens, usd_micros FROM reservation ORDER BY id")]
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'next_reservation_id'").fetchone()
        return ledger_snapshot(accts, res, int(row[0]) if row else 1)

    def recover(self, owner: str | None = None) -> list[Reservation]:
        where, args = ("", ()) if owner is None else (" WHERE owner = ?", (owner,))
        with self._tx() as c:
            res = [Reservation(id=i, key=k, tokens=t, usd_micros=u) for i, k, t, u in c.execute(
                f"SELECT id, account, tokens, usd_micros FROM reservation{where} ORDER BY id", args).fetchall()]
            for r in res:
                c.execute(_CHAIN_UPDATE, {"key": r.key, **_moves(t=r.tokens, u=r.usd_micros,
                                                                 rt=-r.tokens, ru=-r.usd_micros)})
            c.execute(f"DELETE FROM reservation{where}", args)
        return res

    def close_owned_accounts(self, owner: str | None = None) -> int:
        if owner is None:
            return self._one("UPDATE account SET open = 0 WHERE owner IS NOT NULL AND open = 1").rowcount
        return self._one("UPDATE account SET open = 0 WHERE owner = ? AND open = 1", (owner,)).rowcount

    def release_owned(self, owner: str) -> list[Reservation]:
        if not owner:
            raise ValueError("release_owned needs an owner")
        with self._tx() as c:
            res = [Reservation(id=i, key=k, tokens=t, usd_micros=u) for i, k, t, u in c.execute(
                "SELECT id, account, tokens, usd_micros FROM reservation WHERE owner = ? ORDER BY id",
                (owner,)).fetchall()]
            for r in res:
                c.execute(_CHAIN_UPDATE, {"key": r.key, **_moves(rt=-r.tokens, ru=-r.usd_micros)})
            c.execute("DELETE FROM reservation WHERE owner = ?", (owner,))
        return res

    # ----------------------------------------------------------- router leases
    def heartbeat(self, owner: str, *, ttl_ms: int, now_ms: int, info: Mapping[str, Any]) -> int:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        self._one("INSERT OR REPLACE INTO lease (owner, expires_ms, info) VALUES (?, ?, ?)",
                  (owner, now_ms + ttl_ms, json.dumps(dict(info), ensure_ascii=False)))
        return 0

    def live_owners(self, *, now_ms: int) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute("SELECT owner, info FROM lease WHERE expires_ms > ? ORDER BY owner",
                                      (now_ms,)).fetchall()
        return {o: json.loads(i) for o, i in rows}

    def drop_lease(self, owner: str) -> None:
        self._one("DELETE FROM lease WHERE owner = ?", (owner,))

    def lost_owners(self, *, now_ms: int) -> list[str]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT owner FROM reservation WHERE owner IS NOT NULL "
                "UNION SELECT owner FROM account WHERE open = 1 AND owner IS NOT NULL "
                "UNION SELECT owner FROM stream WHERE state = 'open' AND owner IS NOT NULL "
                "UNION SELECT owner FROM quota_stream "
                "EXCEPT SELECT owner FROM lease WHERE expires_ms > ? ORDER BY 1", (now_ms,)).fetchall()
        return [r[0] for r in rows]

    def claim(self, name: str, holder: str, *, ttl_ms: int, now_ms: int) -> bool:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        with self._tx() as c:
            row = c.execute("SELECT holder, expires_ms FROM claim WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] != holder and row[1] > now_ms:
                return False
            c.execute("INSERT OR REPLACE INTO claim (name, holder, expires_ms) VALUES (?, ?, ?)",
                      (name, holder, now_ms + ttl_ms))
        return True

    # ------------------------------------------------- shared budget ledger
    def open_shared(self, key: str, parent: str | None, limit: Allowance, *, owner: str | None) -> SharedResult:
        with self._tx() as c:
            if parent is None and _is_open(c, key):
                rows = _chain(c, key)
                _set_limit(c, rows, limit, clamp=True)
            else:
                _open_account(c, key, parent, limit, owner=owner)
            return SharedResult(totals=_totals(_chain(c, key)))

    def close_shared(self, key: str) -> None:
        self.close_account(key)

    def reserve_shared(self, key: str, tokens: int, usd_micros: int, *, owner: str,
                       request: str = "") -> SharedResult:
        # ``request`` is not kept: a reserve here is one local transaction that is
        # either committed before the call returns or, when the call raises, never.
        with self._tx() as c:
            rows = _open_chain(c, key)
            refused = _check_room(rows, tokens, usd_micros, f"reserve {tokens} tokens / {usd_micros} usd_micros "
                                                            f"on {key!r}")
            if refused is not None:
                return refused
            (next_id,) = c.execute("SELECT value FROM meta WHERE key = 'next_reservation_id'").fetchone() or (1,)
            rid = int(next_id)
            c.execute("INSERT INTO reservation (id, account, tokens, usd_micros, owner) VALUES (?, ?, ?, ?, ?)",
                      (rid, key, tokens, usd_micros, owner))
            c.execute("INSERT INTO meta (key, value) VALUES ('next_reservation_id', ?) ON CONFLICT (key) "
                      "DO UPDATE SET value = excluded.value", (str(rid + 1),))
            c.execute(_CHAIN_UPDATE, {"key": key, **_moves(rt=tokens, ru=usd_micros)})
            return SharedResult(totals=_totals(rows, rt=tokens, ru=usd_micros),
                                reservation=Reservation(id=rid, key=key, tokens=tokens, usd_micros=usd_micros))

    def extend_shared(self, reservation: Reservation, tokens: int, usd_micros: int) -> SharedResult:
        r = reservation
        with self._tx() as c:
            if _reservation(c, r.id) != (r.key, r.tokens, r.usd_micros):
                raise StoreError(f"reservation {r.id} on {r.key!r} is not held as {r.tokens} tokens / "
                                 f"{r.usd_micros} usd_micros")
            rows = _open_chain(c, r.key)
            refused = _check_room(rows, tokens, usd_micros, f"extend by {tokens} tokens / {usd_micros} usd_micros "
                                                            f"on {r.key!r}")
            if refused is not None:
                return refused
            c.execute("UPDATE reservation SET tokens = tokens + ?, usd_micros = usd_micros + ? WHERE id = ?",
                      (tokens, usd_micros, r.id))
            c.execute(_CHAIN_UPDATE, {"key": r.key, **_moves(rt=tokens, ru=usd_micros)})
            return SharedResult(totals=_totals(rows, rt=tokens, ru=usd_micros),
                                reservation=Reservation(id=r.id, key=r.key, tokens=r.tokens + tokens,
                                                        usd_micros=r.usd_micros + usd_micros))

    def recommit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                        request: str) -> SharedResult:
        """A commit that raised here rolled back (one local transaction), so
        this is the first that applies: :meth:`commit_shared` at these amounts."""
        return self.commit_shared(reservation, tokens, usd_micros)

    def commit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                      request: str = "") -> SharedResult:
        with self._tx() as c:
            key, held_t, held_u = _reservation(c, reservation.id)
            rows = _chain(c, key)
            # What the chain can take once this reservation's hold is lifted.
            room_t = min(_free(r[1], r[3], r[5]) for r in rows) + held_t
            room_u = min(_free(r[2], r[4], r[6]) for r in rows) + held_u
            charge_t, charge_u = int(min(tokens, room_t)), int(min(usd_micros, room_u))
            charge = Charge(charge_t, charge_u, tokens - charge_t, usd_micros - charge_u)
            moves = _moves(t=charge_t, u=charge_u, ot=charge.overage_tokens, ou=charge.overage_usd_micros,
                           rt=-held_t, ru=-held_u)
            c.execute(_CHAIN_UPDATE, {"key": key, **moves})
            c.execute("DELETE FROM reservation WHERE id = ?", (reservation.id,))
            return SharedResult(totals=_totals(rows, **moves), charge=charge)

    def cancel_reserve_shared(self, request: str) -> bool:
        """Nothing to undo here: a :meth:`reserve_shared` that raised rolled back
        (one local transaction), and none can run after its caller gave up."""
        return False

    def release_shared(self, reservation: Reservation) -> SharedResult:
        with self._tx() as c:
            key, held_t, held_u = _reservation(c, reservation.id)
            rows = _chain(c, key)
            c.execute(_CHAIN_UPDATE, {"key": key, **_moves(rt=-held_t, ru=-held_u)})
            c.execute("DELETE FROM reservation WHERE id = ?", (reservation.id,))
            return SharedResult(totals=_totals(rows, rt=-held_t, ru=-held_u))

    def set_limit_shared(self, key: str, limit: Allowance, *, clamp: bool) -> SharedResult:
        with self._tx() as c:
            rows = _open_chain(c, key)
            refused = _set_limit(c, rows, limit, clamp=clamp)
            if refused is not None:
                return SharedResult(totals=_totals(rows), refusal=refused)
            return SharedResult(totals=_totals(_chain(c, key)))

    def shared_totals(self, key: str) -> SharedResult:
        with self._lock:
            return SharedResult(totals=_totals(_open_chain(self._conn, key)))

    # ------------------------------------------------ shared tenant quotas
    def quota_open(self, ask: QuotaAsk, *, owner: str, now_ms: int, ttl_ms: int) -> QuotaGrant:
        check_quota_args(ask, owner, ttl_ms)
        with self._tx() as c:  # BEGIN IMMEDIATE: one decision at a time across the workers
            c.execute("DELETE FROM quota_stream WHERE tenant = ? AND expires_ms <= ?", (ask.tenant, now_ms))
            n = c.execute("SELECT count(*) FROM quota_stream WHERE tenant = ?", (ask.tenant,)).fetchone()[0]
            held = c.execute("SELECT 1 FROM quota_stream WHERE tenant = ? AND owner = ? AND stream_id = ?",
                             (ask.tenant, owner, ask.stream_id)).fetchone() is not None
            rate_key = "open/" + ask.tenant
            row = c.execute("SELECT tat_ms FROM rate_bucket WHERE key = ?", (rate_key,)).fetchone()
            grant, tat = decide(open_now=n, held=held, tat_ms=row[0] if row else None, now_ms=now_ms, ask=ask)
            if grant.admitted:
                c.execute("INSERT OR REPLACE INTO quota_stream (tenant, owner, stream_id, expires_ms) "
                          "VALUES (?, ?, ?, ?)", (ask.tenant, owner, ask.stream_id, now_ms + ttl_ms))
            if tat is not None:
                c.execute("INSERT OR REPLACE INTO rate_bucket (key, tat_ms) VALUES (?, ?)", (rate_key, tat))
        return grant

    def quota_close(self, tenant: str, stream_id: str, *, owner: str) -> bool:
        return self._one("DELETE FROM quota_stream WHERE tenant = ? AND owner = ? AND stream_id = ?",
                         (tenant, owner, stream_id)).rowcount > 0

    def quota_renew(self, owner: str, held: Collection[tuple[str, str]], *, now_ms: int, ttl_ms: int) -> int:
        check_quota_args(None, owner, ttl_ms)
        keep = set(held)
        with self._tx() as c:
            rows = c.execute("SELECT tenant, stream_id, expires_ms FROM quota_stream WHERE owner = ?",
                             (owner,)).fetchall()
            gone = [(owner, t, s) for t, s, x in rows if x <= now_ms or (t, s) not in keep]
            c.executemany("DELETE FROM quota_stream WHERE owner = ? AND tenant = ? AND stream_id = ?", gone)
            c.execute("UPDATE quota_stream SET expires_ms = ? WHERE owner = ?", (now_ms + ttl_ms, owner))
        return len(rows) - len(gone)

    def quota_release_owned(self, owner: str) -> int:
        if not owner:
            raise ValueError("quota_release_owned: owner must be a non-empty string")
        n: int = self._one("DELETE FROM quota_stream WHERE owner = ?", (owner,)).rowcount
        return n

    def quota_open_count(self, tenant: str, *, now_ms: int) -> int:
        row = self._row("SELECT count(*) FROM quota_stream WHERE tenant = ? AND expires_ms > ?", (tenant, now_ms))
        return int(row[0]) if row else 0

    def rate_take(self, key: str, *, per_s: float, burst: int, now_ms: int) -> int | None:
        check_rate_args(per_s, burst)
        with self._tx() as c:
            row = c.execute("SELECT tat_ms FROM rate_bucket WHERE key = ?", (key,)).fetchone()
            tat, wait = gcra(row[0] if row else None, now_ms, per_s, burst)
            if tat is not None:
                c.execute("INSERT OR REPLACE INTO rate_bucket (key, tat_ms) VALUES (?, ?)", (key, tat))
        return wait

    # ------------------------------------------- replay nonces (signed frames)
    def record_nonce(self, tenant: str, kid: str, nonce: str, *, now_ms: int, expires_ms: int,
                     max_per_tenant: int) -> bool:
        check_nonce_args(tenant, kid, nonce, now_ms, expires_ms, max_per_tenant)
        try:
            with self._tx() as c:
                got = _record_nonce(c, tenant, kid, nonce, now_ms, expires_ms, max_per_tenant)
        except sqlite3.Error as e:  # a disk error, or the file locked past the busy timeout
            raise StoreError(f"{self.path}: nonce not recorded: {e}") from None
        if got < 0:
            raise nonce_limit_error(tenant, max_per_tenant)
        return got == 1

    # ------------------------------------------------------------------ streams
    def put_stream(self, record: StreamRecord) -> None:
        key = (record.tenant, record.session_id, record.stream_id)
        with self._tx() as c:
            old = c.execute(_SNO, key).fetchone()
            if old is not None:
                c.execute("DELETE FROM event WHERE id > ? AND id < ?", (_event_key(old[0], 0), _event_key(old[0] + 1, 0)))
            c.execute(
                f"INSERT OR REPLACE INTO stream ({_STREAM_COLS}, n_events, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                (*key, record.idempotency_key, record.state, record.close_reason, record.created_ms,
                 record.closed_ms, msgspec.json.encode(record), record.owner),
            )

    def close_stream(self, tenant: str, session_id: str, stream_id: str, *, reason: str, closed_ms: int) -> None:
        cur = self._one(
            "UPDATE stream SET state = 'closed', close_reason = ?, closed_ms = ? "
            "WHERE tenant = ? AND session_id = ? AND stream_id = ?", (reason, closed_ms, tenant, session_id, stream_id))
        if cur.rowcount == 0:
            raise NotFound(f"no stream {tenant}/{session_id}/{stream_id}")

    def get_stream(self, tenant: str, session_id: str, stream_id: str) -> StreamRecord | None:
        row = self._row(f"SELECT {_STREAM_COLS} FROM stream WHERE tenant = ? AND session_id = ? AND stream_id = ?",
                        (tenant, session_id, stream_id))
        return None if row is None else _stream(row)

    def find_idempotent(self, tenant: str, idempotency_key: str) -> StreamRecord | None:
        row = self._row(
            f"SELECT {_STREAM_COLS} FROM stream WHERE tenant = ? AND idempotency_key = ? "
            "ORDER BY created_ms DESC, rowid DESC LIMIT 1", (tenant, idempotency_key))
        return None if row is None else _stream(row)

    def find_stream(self, tenant: str, stream_id: str) -> StreamRecord | None:
        row = self._row(
            f"SELECT {_STREAM_COLS} FROM stream WHERE tenant = ? AND stream_id = ? "
            "ORDER BY created_ms DESC, rowid DESC LIMIT 1", (tenant, stream_id))
        return None if row is None else _stream(row)

    def append_event(self, tenant: str, session_id: str, stream_id: str, event_id: int, type: str,
                     frame: bytes) -> None:
        if len(frame) > self.max_event_bytes:
            raise StoreLimitError("event_bytes", f"event {event_id} of stream {stream_id}: frame of {len(frame)} "
                                                 f"bytes is over the store's limit of {self.max_event_bytes}")
        if not 0 < event_id < _EVENT_IDS:
            raise StoreLimitError("events_per_stream", f"event {event_id} of stream {stream_id}: the store keeps "
                                                       f"event ids 1 .. {_EVENT_IDS - 1}")
        key = (tenant, session_id, stream_id)
        with self._tx() as c:
            row = c.execute("UPDATE stream SET n_events = n_events + 1 WHERE tenant = ? AND session_id = ? "
                            "AND stream_id = ? AND n_events < ? RETURNING sno",
                            (*key, self.max_events_per_stream)).fetchone()
            if row is None:
                if c.execute(_SNO, key).fetchone() is None:
                    raise NotFound(f"no stream {tenant}/{session_id}/{stream_id}")
                raise StoreLimitError("events_per_stream", f"stream {stream_id} has the store's limit of "
                                                           f"{self.max_events_per_stream} events")
            sno = row[0]
            try:
                c.execute("INSERT INTO event (id, type, frame) VALUES (?, ?, ?)", (_event_key(sno, event_id), type, frame))
            except sqlite3.IntegrityError:
                same = c.execute("SELECT 1 FROM event WHERE id = ? AND type = ? AND frame = ?",
                                 (_event_key(sno, event_id), type, frame)).fetchone()
                if same is None:
                    raise StoreError(f"event {event_id} of stream {stream_id} is already stored") from None
                # The same event again (a retried write): it does not count twice.
                c.execute("UPDATE stream SET n_events = n_events - 1 WHERE sno = ?", (sno,))

    def open_stream_count(self) -> int:
        """Streams open now in the file, whoever runs them (``--workers``: every
        worker's; the index on ``state``)."""
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM stream WHERE state = 'open'").fetchone()[0])

    def append_events(self, tenant: str, session_id: str, stream_id: str,
                      events: Sequence[tuple[int, str, bytes]]) -> None:
        """A run of one stream's events in two statements (the count raised once,
        the rows inserted together) when every frame is within the bounds and no
        id is stored yet; else one by one, as :meth:`append_event` (the same
        errors, the same partial outcome)."""
        if len(events) < 2 or any(len(f) > self.max_event_bytes or not 0 < i < _EVENT_IDS for i, _, f in events):
            super().append_events(tenant, session_id, stream_id, events)
            return
        key = (tenant, session_id, stream_id)
        try:
            with self._tx() as c:
                row = c.execute("UPDATE stream SET n_events = n_events + ? WHERE tenant = ? AND session_id = ? "
                                "AND stream_id = ? AND n_events + ? <= ? RETURNING sno",
                                (len(events), *key, len(events), self.max_events_per_stream)).fetchone()
                if row is None:
                    raise _SlowPath
                c.executemany("INSERT INTO event (id, type, frame) VALUES (?, ?, ?)",
                              [(_event_key(row[0], i), type, frame) for i, type, frame in events])
        except (_SlowPath, sqlite3.IntegrityError):
            # Undone whole: an unknown stream, its event bound, an id already stored (a retry).
            super().append_events(tenant, session_id, stream_id, events)

    def events(self, tenant: str, session_id: str, stream_id: str, after: int = 0) -> list[StoredEvent]:
        with self._lock:
            row = self._conn.execute(_SNO, (tenant, session_id, stream_id)).fetchone()
            if row is None:
                return []
            rows = self._conn.execute(
                "SELECT id, type, frame FROM event WHERE id > ? AND id < ? ORDER BY id",
                (_event_key(row[0], max(0, min(after, _EVENT_IDS - 1))), _event_key(row[0] + 1, 0))).fetchall()
        return [StoredEvent(event_id=i & (_EVENT_IDS - 1), type=t, frame=bytes(f)) for i, t, f in rows]

    def interrupt_open_streams(self, reason: str, *, now_ms: int, owner: str | None = None) -> list[StreamRecord]:
        mine, args = ("", ()) if owner is None else (" AND owner = ?", (owner,))
        with self._tx() as c:
            rows = c.execute(f"SELECT {_STREAM_COLS} FROM stream WHERE state = 'open'{mine} "
                             "ORDER BY created_ms, rowid", args).fetchall()
            c.execute(f"UPDATE stream SET state = 'interrupted', close_reason = ?, closed_ms = ? "
                      f"WHERE state = 'open'{mine}", (reason, now_ms, *args))
        return [msgspec.structs.replace(_stream(r), state="interrupted", close_reason=reason, closed_ms=now_ms)
                for r in rows]

    def expire(self, before_ms: int) -> int:
        with self._tx() as c:
            done = c.execute("SELECT sno FROM stream WHERE state != 'open' AND closed_ms < ?", (before_ms,)).fetchall()
            c.executemany("DELETE FROM event WHERE id > ? AND id < ?",
                          [(_event_key(sno, 0), _event_key(sno + 1, 0)) for (sno,) in done])
            n = c.execute("DELETE FROM stream WHERE state != 'open' AND closed_ms < ?", (before_ms,)).rowcount
            c.execute("DELETE FROM account WHERE open = 0 AND key NOT IN "
                      "(SELECT parent FROM account WHERE open = 1 AND parent IS NOT NULL)")
        return n

    # --------------------------------------------------------------------- RIB
    def save_rib(self, version: int, text: str, source: str, actor: str) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO rib (version, text, source, actor) VALUES (?, ?, ?, ?)",
                      (version, text, source, actor))
            c.execute("DELETE FROM rib WHERE n <= (SELECT MAX(n) FROM rib) - ?", (RIB_KEPT,))

    def active_rib(self) -> tuple[int, str, str] | None:
        row = self._row("SELECT version, text, source FROM rib ORDER BY n DESC LIMIT 1")
        return None if row is None else (row[0], row[1], row[2])

    def active_rib_version(self) -> int | None:
        row = self._row("SELECT version FROM rib ORDER BY n DESC LIMIT 1")
        return None if row is None else row[0]

    def next_rib_version(self) -> int:
        with self._tx() as c:
            row = c.execute("SELECT value FROM meta WHERE key = 'rib_version_seq'").fetchone()
            top = c.execute("SELECT MAX(version) FROM rib").fetchone()[0] or 0
            version = max(int(row[0]) if row else 0, top) + 1
            c.execute("INSERT INTO meta (key, value) VALUES ('rib_version_seq', ?) ON CONFLICT (key) "
                      "DO UPDATE SET value = excluded.value", (str(version),))
        return version

    # ------------------------------------------------------------------- audit
    def append_audit(self, record: AuditRecord) -> None:
        r = record
        try:
            self._one(f"INSERT INTO audit ({_AUDIT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (r.seq, r.ts_ms, r.kind, r.actor, r.tenant, json.dumps(r.detail, ensure_ascii=False),
                       r.prev, r.hash))
        except sqlite3.IntegrityError:
            raise StoreError(f"audit record {r.seq} already stored (the log is append-only)") from None

    def append_audit_chained(self, build: Callable[[int, str], AuditRecord]) -> AuditRecord:
        with self._tx() as c:
            head = c.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
            r = build(head[0], head[1]) if head is not None else build(0, GENESIS)
            try:
                c.execute(f"INSERT INTO audit ({_AUDIT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (r.seq, r.ts_ms, r.kind, r.actor, r.tenant, json.dumps(r.detail, ensure_ascii=False),
                           r.prev, r.hash))
            except sqlite3.IntegrityError:
                raise StoreError(f"audit record {r.seq} already stored (the log is append-only)") from None
        return r

    def audit_records(self, after: int = 0, limit: int | None = None) -> list[AuditRecord]:
        with self._lock:
            rows = self._conn.execute(f"SELECT {_AUDIT_COLS} FROM audit WHERE seq > ? ORDER BY seq LIMIT ?",
                                      (after, -1 if limit is None else limit)).fetchall()
        return [_audit(row) for row in rows]

    def audit_head(self) -> AuditRecord | None:
        row = self._row(f"SELECT {_AUDIT_COLS} FROM audit ORDER BY seq DESC LIMIT 1")
        return None if row is None else _audit(row)

    def audit_checkpoint(self) -> AuditCheckpoint | None:
        row = self._row("SELECT seq, hash, mac FROM audit_checkpoint ORDER BY seq DESC LIMIT 1")
        return None if row is None else AuditCheckpoint(seq=row[0], hash=row[1], mac=row[2])

    def audit_checkpoints(self) -> list[AuditCheckpoint]:
        with self._lock:
            rows = self._conn.execute("SELECT seq, hash, mac FROM audit_checkpoint ORDER BY seq").fetchall()
        return [AuditCheckpoint(seq=q, hash=h, mac=m) for q, h, m in rows]

    def put_audit_checkpoint(self, checkpoint: AuditCheckpoint) -> None:
        self._one("INSERT OR REPLACE INTO audit_checkpoint (seq, hash, mac) VALUES (?, ?, ?)",
                  (checkpoint.seq, checkpoint.hash, checkpoint.mac))

    # ---------------------------------------------------------------------- kv
    def get(self, key: str) -> bytes | None:
        row = self._row("SELECT value FROM kv WHERE key = ?", (key,))
        return None if row is None else bytes(row[0])

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        hi = prefix + "\U0010ffff"
        with self._lock:
            rows = self._conn.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                                      (prefix, hi)).fetchall()
        return [(k, bytes(v)) for k, v in rows]

    def put(self, key: str, value: bytes) -> None:
        self._one("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None]) -> bytes | None:
        with self._tx() as c:  # BEGIN IMMEDIATE: no other writer between the read and the write
            row = c.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            new = fn(None if row is None else bytes(row[0]))
            if new is None:
                c.execute("DELETE FROM kv WHERE key = ?", (key,))
            else:
                c.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, bytes(new)))
        return new

    # ------------------------------------------------------- response cache
    # The response cache's calls raise StoreError for a database error (a disk
    # error, the file locked past the busy timeout): the router serves without
    # the cache then (atp_router.runtime.dataplane.cache), whichever store it runs on.
    def cache_get(self, key: bytes, *, now_ms: int) -> bytes | None:
        with self._store_error("cache read"):
            with self._lock:
                row = self._conn.execute("SELECT value, expires_ms FROM cache WHERE key = ?", (key,)).fetchone()
            if row is None or row[1] <= now_ms:
                return None
            self._one("UPDATE cache SET used_ms = ? WHERE key = ? AND used_ms < ?", (now_ms, key, now_ms))
            return bytes(row[0])

    def cache_put(self, key: bytes, value: bytes, *, tenant: str | None, now_ms: int, expires_ms: int,
                  max_bytes: int, tenant_max_bytes: int | None = None) -> CachePut:
        with self._store_error("cache write"):
            return self._cache_put(key, value, tenant=tenant, now_ms=now_ms, expires_ms=expires_ms,
                                   max_bytes=max_bytes, tenant_max_bytes=tenant_max_bytes)

    def _cache_put(self, key: bytes, value: bytes, *, tenant: str | None, now_ms: int, expires_ms: int,
                   max_bytes: int, tenant_max_bytes: int | None) -> CachePut:
        size = len(value)
        with self._tx() as c:
            # Expired entries first (the one replaced here too, if it expired), then the replaced one.
            expired = _cache_remove(c, "DELETE FROM cache WHERE expires_ms <= ? RETURNING size", (now_ms,))
            _cache_remove(c, "DELETE FROM cache WHERE key = ? RETURNING size", (key,))
            if tenant_max_bytes is not None:
                return _cache_put_own(c, key, value, tenant or "", now_ms, expires_ms, max_bytes,
                                      tenant_max_bytes, expired)
            stored = size <= max_bytes
            if stored:
                c.execute("INSERT INTO cache (key, tenant, value, size, created_ms, expires_ms, used_ms) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, tenant, value, size, now_ms, expires_ms, now_ms))
                c.execute("UPDATE cache_total SET entries = entries + 1, bytes = bytes + ?", (size,))
            evicted = 0
            entries, total = c.execute("SELECT entries, bytes FROM cache_total").fetchone()
            if total > max_bytes:
                evicted = _cache_evict_lru(c, "key != ?", (key,), total - max_bytes)
                entries, total = c.execute("SELECT entries, bytes FROM cache_total").fetchone()
        return CachePut(stored=stored, expired=expired, evicted=evicted, stats=CacheStats(entries, total))

    def cache_drop(self, key: bytes) -> None:
        with self._store_error("cache write"), self._tx() as c:
            _cache_remove(c, "DELETE FROM cache WHERE key = ? RETURNING size", (key,))

    def cache_stats(self) -> CacheStats:
        with self._store_error("cache read"):
            row = self._row("SELECT entries, bytes FROM cache_total")
        return CacheStats(*row) if row is not None else CacheStats()

    @contextmanager
    def _store_error(self, what: str) -> Iterator[None]:
        """A database error inside as :class:`StoreError` naming the file and ``what``."""
        try:
            yield
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: {what}: {e}") from e


#: SQLite's primary result codes of a write that found no room, or failed in the OS
#: (an extended code's low byte is its primary code).
_SQLITE_FULL, _SQLITE_IOERR = 13, 10
_SQLITE_PERM, _SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 3, 8, 11, 14, 26
_SQLITE_BUSY = 5


def write_fault(path: Path, e: sqlite3.Error) -> StoreUnavailable | None:
    """What a failed write of the store in ``path`` means for its callers: the
    disk full (``SQLITE_FULL``) is :class:`~atp_router.store.base.StoreFull`
    ("state store full: <path>: no space left on device"), an I/O error
    :class:`~atp_router.store.base.StoreUnavailable`; None for any other error
    (a bug or a constraint: raised as it is)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is None:
        return None
    if code & 0xFF == _SQLITE_FULL:
        return StoreFull(f"state store full: {path}: no space left on device ({e})")
    if code & 0xFF == _SQLITE_IOERR:
        return StoreUnavailable(f"state store I/O error: {path}: {e}")
    return None


class _SlowPath(Exception):
    """:meth:`SqliteStore.append_events`' two-statement path does not apply: undo it, go one by one."""


def _rollback(c: sqlite3.Connection) -> None:
    """End the connection's open transaction, if SQLite has not already (it
    rolls back by itself after some errors, a full disk among them)."""
    if c.in_transaction:
        with suppress(sqlite3.Error):
            c.execute("ROLLBACK")


def _empty_refusal(path: Path, marker: Path) -> str:
    return (f"{path} is missing or empty but {path.parent} has held state ({marker} exists): refusing to start "
            "on an empty ledger (spend, streams and the audit chain would restart from zero); restore "
            f"{path.name} from a backup, or delete {marker} to start a new, empty ledger")


def _damaged(path: Path, problem: str) -> str:
    fixed = path.with_name("recovered.db")
    problem = " ".join(problem.replace("*** in database main ***", "").split())  # one line
    return (f"{path} is damaged ({problem}); refusing to start on it. Recover what it holds into a new file: "
            f"sqlite3 {shlex.quote(str(path))} \".recover\" | sqlite3 {shlex.quote(str(fixed))} — then move the "
            f"damaged file aside and {fixed.name} to {path.name}")


def _open_refusal(path: Path, e: sqlite3.DatabaseError) -> str:
    """The one line of a start-up refused by SQLite itself: a damaged file, a
    file or directory that cannot be written, anything else as SQLite says it."""
    code = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return _damaged(path, str(e))
    if code in (_SQLITE_READONLY, _SQLITE_CANTOPEN, _SQLITE_PERM, _SQLITE_IOERR):
        return (f"{path} cannot be opened for writing ({e}); the router needs the file and its directory "
                f"{path.parent} readable and writable")
    if code == _SQLITE_BUSY:  # past the busy timeout: another process holds the file (exclusive, or locked)
        return (f"{path}: {e}: another process has it open (a sqlite3 shell, another program); a router that "
                "owns its state directory opens the file alone: close the other one first")
    return f"{path}: {e}"


def _quick_check(conn: sqlite3.Connection, path: Path, check_s: float) -> None:
    """``PRAGMA quick_check`` of the open database for at most ``check_s``
    seconds (a progress handler interrupts it: the store then opens with a
    warning); raises :class:`StoreError` naming the first problem found."""
    deadline = time.monotonic() + check_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        rows = conn.execute("PRAGMA quick_check(4)").fetchall()
    except sqlite3.OperationalError:
        if time.monotonic() <= deadline:
            raise
        log.warning("state: %s: PRAGMA quick_check did not finish within %.0f s; opened unchecked", path, check_s)
        return
    finally:
        conn.set_progress_handler(None, 0)
    problems = [str(r[0]) for r in rows if r[0] != "ok"]
    if problems:
        raise StoreError(_damaged(path, "PRAGMA quick_check: " + "; ".join(problems)[:400]))


def _write_marker(marker: Path) -> None:
    """:data:`STATE_MARKER`, durable (file and directory fsynced) before the
    store is used."""
    fd = os.open(marker, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps({"app": _APP, "db": "state.db", "created_ms": int(time.time() * 1000)})
                      + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(marker.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def ledger_snapshot(accts: list[tuple], res: list[Reservation], next_id: int) -> LedgerSnapshot:
    """The :class:`LedgerSnapshot` of the open accounts ``accts`` (rows ``(key,
    parent, limit_tokens, limit_usd, committed_tokens, committed_usd,
    overage_tokens, overage_usd)``) and the open reservations ``res`` (by id),
    what they hold summed up their chains (shared with the Redis backend).
    Raises :class:`StoreError` for a reservation on an account that is not open."""
    parent = {a[0]: a[1] for a in accts}

    def chain(k: str) -> list[str]:
        out = [k]
        while (p := parent.get(out[-1])) is not None and p in parent:
            out.append(p)
        return out

    held: dict[str, list[int]] = {a[0]: [0, 0, 0] for a in accts}
    for r in res:
        if r.key not in held:
            raise StoreError(f"reservation {r.id} names account {r.key!r}, which is not open")
        held[r.key][2] += 1
        for k in chain(r.key):
            held[k][0] += r.tokens
            held[k][1] += r.usd_micros
    states = [
        AccountState(key=k, parent=p, limit=Allowance(tokens=lt, usd_micros=lu), reserved_tokens=held[k][0],
                     reserved_usd_micros=held[k][1], committed_tokens=ct, committed_usd_micros=cu,
                     overage_tokens=ot, overage_usd_micros=ou, open_reservations=held[k][2])
        for k, p, lt, lu, ct, cu, ot, ou in accts
    ]
    states.sort(key=lambda s: (len(chain(s.key)), s.key))
    return LedgerSnapshot(accounts=tuple(states), reservations=tuple(res),
                          next_id=max(next_id, max((r.id for r in res), default=0) + 1))


def _cache_evict_lru(c: sqlite3.Connection, where: str, params: tuple[Any, ...], excess: int) -> int:
    """Remove the least recently used cache entries matching ``where`` until at
    least ``excess`` bytes are freed (or none is left); how many went."""
    victims: list[bytes] = []
    for k, n in c.execute(f"SELECT key, size FROM cache WHERE {where} ORDER BY used_ms, created_ms", params):
        if excess <= 0:
            break
        victims.append(k)
        excess -= n
    return sum(_cache_remove(c, "DELETE FROM cache WHERE key = ? RETURNING size", (k,)) for k in victims)


def _cache_put_own(c: sqlite3.Connection, key: bytes, value: bytes, tenant: str, now_ms: int, expires_ms: int,
                   max_bytes: int, tenant_max_bytes: int, expired: int) -> CachePut:
    """``cache_put`` with a per-tenant budget (after expired entries and the
    replaced one are gone): the value is refused when over ``tenant_max_bytes``;
    else ``tenant``'s own least recently used entries go until its entries and
    the value fit in ``tenant_max_bytes`` and the whole cache in ``max_bytes``;
    it is stored only if the cache then holds it — another tenant's entry is
    never evicted."""
    size = len(value)
    evicted = 0
    stored = size <= min(tenant_max_bytes, max_bytes)
    if stored:
        (own,) = c.execute("SELECT COALESCE(SUM(size), 0) FROM cache WHERE tenant = ?", (tenant,)).fetchone()
        (total,) = c.execute("SELECT bytes FROM cache_total").fetchone()
        # Room is made from the tenant's own entries only: for its budget and, when
        # the whole cache is full, for the cache's bound.
        excess = max(own + size - tenant_max_bytes, total + size - max_bytes)
        if excess > 0:
            evicted = _cache_evict_lru(c, "tenant = ?", (tenant,), excess)
        (total,) = c.execute("SELECT bytes FROM cache_total").fetchone()
        stored = total + size <= max_bytes
    if stored:
        c.execute("INSERT INTO cache (key, tenant, value, size, created_ms, expires_ms, used_ms) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, tenant, value, size, now_ms, expires_ms, now_ms))
        c.execute("UPDATE cache_total SET entries = entries + 1, bytes = bytes + ?", (size,))
    entries, total = c.execute("SELECT entries, bytes FROM cache_total").fetchone()
    return CachePut(stored=stored, expired=expired, evicted=evicted, stats=CacheStats(entries, total))


def _cache_remove(c: sqlite3.Connection, sql: str, args: tuple) -> int:
    """Run a ``DELETE … FROM cache … RETURNING size`` and take what it removed off
    the cache's totals; returns how many entries it removed."""
    sizes = [r[0] for r in c.execute(sql, args).fetchall()]
    if sizes:
        c.execute("UPDATE cache_total SET entries = entries - ?, bytes = bytes - ?", (len(sizes), sum(sizes)))
    return len(sizes)


def _record_nonce(c: sqlite3.Connection, tenant: str, kid: str, nonce: str, now_ms: int, expires_ms: int,
                  max_per_tenant: int) -> int:
    """:meth:`SqliteStore.record_nonce` inside its transaction: 1 recorded, 0 a
    replay, -1 the tenant at its bound (nothing recorded; the sweeps are kept)."""
    _sweep_nonces(c, "expires_ms <= ? ORDER BY expires_ms LIMIT ?", (now_ms, NONCE_SWEEP))
    row = c.execute("SELECT expires_ms FROM nonce WHERE tenant = ? AND kid = ? AND nonce = ?",
                    (tenant, kid, nonce)).fetchone()
    if row is not None:
        if row[0] > now_ms:
            return 0
        _sweep_nonces(c, "tenant = ? AND kid = ? AND nonce = ?", (tenant, kid, nonce))
    if _nonces_held(c, tenant) >= max_per_tenant:
        _sweep_nonces(c, "expires_ms <= ? ORDER BY expires_ms LIMIT ?", (now_ms, NONCE_FULL_SWEEP))
        if _nonces_held(c, tenant) >= max_per_tenant:
            return -1
    c.execute("INSERT INTO nonce (tenant, kid, nonce, expires_ms) VALUES (?, ?, ?, ?)", (tenant, kid, nonce, expires_ms))
    c.execute("INSERT INTO nonce_count (tenant, n) VALUES (?, 1) ON CONFLICT (tenant) DO UPDATE SET n = n + 1",
              (tenant,))
    return 1


def _sweep_nonces(c: sqlite3.Connection, where: str, args: tuple) -> int:
    """Delete the nonce rows ``SELECT … FROM nonce WHERE <where>`` names and take
    them off their tenants' counts (rows of a count at 0 dropped); returns how
    many it deleted."""
    tenants = [r[0] for r in c.execute(
        "DELETE FROM nonce WHERE (tenant, kid, nonce) IN "
        f"(SELECT tenant, kid, nonce FROM nonce WHERE {where}) RETURNING tenant", args)]
    if tenants:
        by = Counter(tenants)
        c.executemany("UPDATE nonce_count SET n = n - ? WHERE tenant = ?", [(n, t) for t, n in by.items()])
        c.executemany("DELETE FROM nonce_count WHERE tenant = ? AND n <= 0", [(t,) for t in by])
    return len(tenants)


def _nonces_held(c: sqlite3.Connection, tenant: str) -> int:
    row = c.execute("SELECT n FROM nonce_count WHERE tenant = ?", (tenant,)).fetchone()
    return 0 if row is None else row[0]


def _open_account(c: sqlite3.Connection, key: str, parent: str | None, limit: Allowance, *,
                  owner: str | None) -> None:
    if parent is not None and not _is_open(c, parent):
        raise NotFound(f"no open budget account {parent!r}")
    if _is_open(c, key):
        raise StoreError(f"budget account {key!r} already open")
    c.execute(
        "INSERT INTO account (key, parent, limit_tokens, limit_usd, owner) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET parent = excluded.parent, limit_tokens = excluded.limit_tokens, "
        "limit_usd = excluded.limit_usd, committed_tokens = 0, committed_usd = 0, overage_tokens = 0, "
        "overage_usd = 0, open = 1, reserved_tokens = 0, reserved_usd = 0, owner = excluded.owner",
        (key, parent, limit.tokens, limit.usd_micros, owner),
    )


def _reservation(c: sqlite3.Connection, reservation_id: int) -> tuple[str, int, int]:
    """``(account, tokens, usd_micros)`` of an open reservation; NotFound else."""
    row = c.execute("SELECT account, tokens, usd_micros FROM reservation WHERE id = ?", (reservation_id,)).fetchone()
    if row is None:
        raise NotFound(f"no open reservation {reservation_id}")
    return row[0], row[1], row[2]


def _chain(c: sqlite3.Connection, key: str) -> list[tuple]:
    """Rows ``(key, limit_t, limit_u, committed_t, committed_u, reserved_t,
    reserved_u, overage_t, overage_u, open)`` of ``key`` and its ancestors."""
    return c.execute(_CHAIN_READ, {"key": key}).fetchall()


def _open_chain(c: sqlite3.Connection, key: str) -> list[tuple]:
    rows = _chain(c, key)
    if not rows or rows[0][9] != 1:
        raise NotFound(f"no open budget account {key!r}")
    return rows


def _free(limit: int | None, committed: int, reserved: int) -> float:
    return math.inf if limit is None else limit - committed - reserved


def _remaining(rows: list[tuple]) -> Allowance:
    t = min(_free(r[1], r[3], r[5]) for r in rows)
    u = min(_free(r[2], r[4], r[6]) for r in rows)
    return Allowance(tokens=None if t == math.inf else int(t), usd_micros=None if u == math.inf else int(u))


def _check_room(rows: list[tuple], tokens: int, usd_micros: int, what: str) -> SharedResult | None:
    """A refusal naming the nearest account of the chain that cannot hold
    ``tokens`` / ``usd_micros`` more, or None when all can."""
    for i, r in enumerate(rows):
        if tokens > _free(r[1], r[3], r[5]) or usd_micros > _free(r[2], r[4], r[6]):
            return SharedResult(totals=_totals(rows), refusal=refusal(r[0], what, _remaining(rows[i:])))
    return None


def _set_limit(c: sqlite3.Connection, rows: list[tuple], limit: Allowance, *, clamp: bool):
    """BudgetLedger.set_limit on the first account of ``rows``; its Refusal or None."""
    key, _, _, ct, cu, rt, ru = rows[0][:7]
    held_t, held_u = ct + rt, cu + ru
    tokens, usd = limit.tokens, limit.usd_micros
    if clamp:
        tokens = None if tokens is None else max(tokens, held_t)
        usd = None if usd is None else max(usd, held_u)
    elif (tokens is not None and tokens < held_t) or (usd is not None and usd < held_u):
        return refusal(key, f"limit {tokens} tokens / {usd} usd_micros below use", _remaining(rows))
    c.execute("UPDATE account SET limit_tokens = ?, limit_usd = ? WHERE key = ?", (tokens, usd, key))
    return None


def _totals(rows: list[tuple], *, t: int = 0, u: int = 0, ot: int = 0, ou: int = 0, rt: int = 0,
            ru: int = 0) -> tuple[AccountTotals, ...]:
    """``rows`` as AccountTotals, with the moves just applied to every one."""
    return tuple(AccountTotals(key=r[0], limit=Allowance(tokens=r[1], usd_micros=r[2]), committed_tokens=r[3] + t,
                               committed_usd_micros=r[4] + u, reserved_tokens=r[5] + rt,
                               reserved_usd_micros=r[6] + ru, overage_tokens=r[7] + ot,
                               overage_usd_micros=r[8] + ou) for r in rows)


def _is_open(c: sqlite3.Connection, key: str) -> bool:
    row = c.execute("SELECT open FROM account WHERE key = ?", (key,)).fetchone()
    return row is not None and row[0] == 1


def _stream(row: tuple) -> StreamRecord:
    rec = msgspec.json.decode(row[8], type=StreamRecord)
    return msgspec.structs.replace(rec, state=row[4], close_reason=row[5], closed_ms=row[7])


def _audit(row: tuple) -> AuditRecord:
    seq, ts_ms, kind, actor, tenant, detail, prev, h = row
    return AuditRecord(seq=seq, ts_ms=ts_ms, kind=kind, actor=actor, tenant=tenant, detail=json.loads(detail),
                       prev=prev, hash=h)


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema in an empty file, accept ours, refuse a newer or foreign one."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                             [("app", _APP), ("schema_version", str(SCHEMA_VERSION))])
        else:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}
            if meta.get("app") != _APP or "schema_version" not in meta:
                raise SchemaError(f"{path} is not an {_APP} state database")
            version = int(meta["schema_version"])
            if version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{path}: state schema version {version} is newer than this {_APP} supports "
                    f"({SCHEMA_VERSION}); upgrade {_APP} or use another --state-dir")
            if version == 1:
                for stmt in _MIGRATE_2:
                    conn.execute(stmt)
                for key, t, u in conn.execute("SELECT account, tokens, usd_micros FROM reservation").fetchall():
                    conn.execute(_CHAIN_UPDATE, {"key": key, **_moves(rt=t, ru=u)})
            if version <= 2:
                _migrate_3(conn, path)
            if version < SCHEMA_VERSION:
                conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        for stmt in _CACHE_SCHEMA + _LEASE_SCHEMA + _NONCE_SCHEMA + _QUOTA_SCHEMA:
            conn.execute(stmt)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _migrate_3(conn: sqlite3.Connection, path: Path) -> None:
    """Schema 2 → 3 (:data:`_MIGRATE_3`) inside the caller's transaction; raises
    :class:`SchemaError` when an event id does not fit the schema 3 key (none is
    changed: the caller rolls back)."""
    bad = conn.execute("SELECT count(*) FROM event WHERE event_id < 1 OR event_id >= ?", (_EVENT_IDS,)).fetchone()[0]
    if bad:
        raise SchemaError(f"{path}: {bad} stored events have ids outside 1 .. {_EVENT_IDS - 1}; this {_APP} "
                          "cannot migrate the state directory (use the previous version, or another --state-dir)")
    for stmt in _MIGRATE_3:
        conn.execute(stmt)


def _owner_lock(d: Path, path: Path, *, exclusive: bool, create: bool) -> int:
    """The descriptor of ``state.db.owner`` beside ``path``, flock'ed: ``exclusive``
    (held by the caller for the store's life) or shared (the caller closes it once
    its connection is open). Raises :class:`StoreError` (one line) when another
    process holds it in the other mode — an exclusive owner runs, or (``exclusive``)
    another process is opening the file — or the file cannot be made."""
    owner = d / "state.db.owner"
    try:
        if create and not d.exists():
            d.mkdir(mode=0o700, parents=True)
            os.chmod(d, 0o700)
        fd = os.open(owner, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StoreError(_unusable(d, e, owner)) from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if exclusive:
            raise StoreError(f"{path} is in use by another process; a router owning its state directory opens it "
                             "alone (stop the other process first)") from None
        raise StoreError(f"{path} is held by a running atp-router that owns its state directory (exclusive "
                         "store); stop it first, or read its state through its API") from None
    return fd


def _unusable(d: Path, e: OSError, where: Path) -> str:
    """The one-line refusal of a state directory the OS will not let the store use."""
    return (f"state directory {d} cannot be used: {e.strerror or e} ({e.filename or where}); "
            "the router needs it readable and writable")


def _check_open(synchronous: str, max_events_per_stream: int, *, multiprocess: bool, exclusive: bool,
                redo: bool) -> None:
    """:meth:`SqliteStore.open`'s arguments checked (``ValueError``)."""
    if synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
    if not 0 < max_events_per_stream < _EVENT_IDS:
        raise ValueError(f"max_events_per_stream must be 1 .. {_EVENT_IDS - 1}, got {max_events_per_stream}")
    if exclusive and multiprocess:
        raise ValueError("an exclusive store cannot be shared by several processes (multiprocess)")
    if redo and not exclusive:
        raise ValueError("a redo log needs an exclusive store (the only process on the file)")


def _open_redo(conn: sqlite3.Connection, path: Path, *, fsync: bool, keep: bool) -> RedoLog | None:
    """The redo log beside ``path`` (:mod:`atp_router.store.redo`), what a crash left
    in it replayed into the database and committed, the log emptied; not ``keep``:
    then closed and removed (None; nothing is made when there is no log)."""
    where = path.with_name(path.name + ".redo")
    if not keep and not where.exists():
        return None
    redo = RedoLog.open(where, fsync=fsync)
    if keep:
        # The savepoint of each transaction inside the long one keeps the pages it changes in a
        # statement journal: in memory, not a temporary file past its first 64 KiB.
        conn.execute("PRAGMA temp_store=MEMORY")
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'redo_lsn'").fetchone()
            n = redo.replay(conn, int(row[0]) if row is not None else 0)
            if n:
                conn.execute(_SET_REDO_LSN, (str(redo.next_lsn - 1),))
        except BaseException:
            _rollback(conn)
            raise
        conn.execute("COMMIT")
        if n:
            log.warning("state store %s: %d transactions a crash left in %s replayed", path, n, redo.path)
        redo.reset(redo.next_lsn - 1)
        if not keep:
            redo.close()
            with suppress(FileNotFoundError):  # another --workers process replayed it first
                where.unlink()
            return None
    except sqlite3.Error as e:
        redo.close()
        raise StoreError(f"{redo.path}: cannot be replayed into {path}: {e}") from None
    except BaseException:
        redo.close()
        raise
    return redo


def _connect(d: Path, path: Path, marker: Path, create: bool, *, recording: bool = False) -> sqlite3.Connection:
    """A connection to ``path`` (``create``: the directory 0700 and the file 0600
    made first); refused (:class:`StoreError`, one line) when the marker says the
    directory held state its database no longer has, or the directory or file
    cannot be used."""
    try:
        if create and marker.exists() and (not path.exists() or path.stat().st_size == 0):
            raise StoreError(_empty_refusal(path, marker))
        if create:
            if not d.exists():
                d.mkdir(mode=0o700, parents=True)
                os.chmod(d, 0o700)
            if not path.exists():
                os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0,
                               factory=RecordingConnection if recording else sqlite3.Connection)
    except OSError as e:
        raise StoreError(_unusable(d, e, path)) from None
    except sqlite3.Error as e:
        raise StoreError(f"cannot open {path}: {e}") from None


def _prepare(conn: sqlite3.Connection, path: Path, marker: Path, *, create: bool, synchronous: str,
             autocheckpoint: bool, check_s: float, exclusive: bool = False) -> None:
    """WAL, ``synchronous``, the start-up checks (an empty database where the
    marker says state was; ``PRAGMA quick_check`` for at most ``check_s`` s, 0:
    none), the schema migrated, the marker written. Raises :class:`StoreError`,
    ``sqlite3.DatabaseError`` or ``OSError`` (the caller closes ``conn``).
    ``exclusive``: the locking mode set before the first access (SQLite then keeps
    the WAL index in this process's memory and never creates ``-shm``)."""
    if exclusive:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise StoreError(f"{path}: cannot switch to WAL (journal_mode is {mode})")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    if not autocheckpoint:
        conn.execute("PRAGMA wal_autocheckpoint=0")
    # The marker first: another process opening the same new directory writes it only
    # after its schema, so a marker seen before an empty schema means state was lost,
    # while an empty schema read before that process's marker is just a new store.
    marked = create and marker.exists()
    held = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
    if not held and marked:
        raise StoreError(_empty_refusal(path, marker))
    if held and check_s > 0:
        _quick_check(conn, path, check_s)
    if held:
        # What a crashed single router's redo log holds, replayed in the schema it was written in.
        _open_redo(conn, path, fsync=False, keep=False)
    _migrate(conn, path)
    if create and not marker.exists():
        _write_marker(marker)
