"""The embedded default :class:`~atp.store.base.Store`: one SQLite file,
``<state-dir>/state.db`` (stdlib :mod:`sqlite3`).

Durability: WAL journal, ``synchronous=NORMAL`` by default. Every mutating call
is one transaction committed before it returns (``append_event`` is the only
two-statement one: bump the stream's event count, insert the event), so a
change that was acknowledged survives a **kill -9** of the router process
(the WAL is in the OS page cache). An **OS crash or power loss** may lose the
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
either, :class:`~atp.store.base.StoreLimitError`. :meth:`SqliteStore.expire`
drops finished streams and their events; the RIB history keeps the last
:data:`RIB_KEPT` versions. The audit table and its checkpoints (one per
checkpoint interval) are never pruned (append-only).

The schema is versioned in the ``meta`` table (:data:`SCHEMA_VERSION`); a
state directory written by a newer router is refused with
:class:`~atp.store.base.SchemaError` rather than misread. The state directory
is created with mode 0700 and ``state.db`` with 0600.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import msgspec

from atp.flow.budget import AccountState, Allowance, Charge, LedgerSnapshot, Reservation
from atp.security.audit import AuditCheckpoint, AuditRecord
from atp.store.base import (
    NotFound,
    SchemaError,
    Store,
    StoredEvent,
    StoreError,
    StoreLimitError,
    StreamRecord,
)

__all__ = ["RIB_KEPT", "SCHEMA_VERSION", "SqliteStore"]

#: Version of the schema below; bump it with a migration in ``_migrate``.
SCHEMA_VERSION = 1
#: RIB versions kept in history (the newest is the active one).
RIB_KEPT = 16
_APP = "atp-router"

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE account (
    key TEXT PRIMARY KEY, parent TEXT, limit_tokens INTEGER, limit_usd INTEGER,
    committed_tokens INTEGER NOT NULL DEFAULT 0, committed_usd INTEGER NOT NULL DEFAULT 0,
    overage_tokens INTEGER NOT NULL DEFAULT 0, overage_usd INTEGER NOT NULL DEFAULT 0,
    open INTEGER NOT NULL DEFAULT 1);
CREATE TABLE reservation (id INTEGER PRIMARY KEY, account TEXT NOT NULL, tokens INTEGER NOT NULL,
    usd_micros INTEGER NOT NULL);
CREATE TABLE stream (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, idempotency_key TEXT,
    state TEXT NOT NULL, close_reason TEXT, created_ms INTEGER NOT NULL, closed_ms INTEGER,
    n_events INTEGER NOT NULL DEFAULT 0, body BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id, stream_id));
CREATE INDEX stream_idem ON stream (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX stream_done ON stream (state, closed_ms);
CREATE TABLE event (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, event_id INTEGER NOT NULL,
    type TEXT NOT NULL, frame BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id, stream_id, event_id)) WITHOUT ROWID;
CREATE TABLE rib (n INTEGER PRIMARY KEY AUTOINCREMENT, version INTEGER NOT NULL, text TEXT NOT NULL,
    source TEXT NOT NULL, actor TEXT NOT NULL);
CREATE TABLE audit (seq INTEGER PRIMARY KEY, ts_ms INTEGER NOT NULL, kind TEXT NOT NULL, actor TEXT NOT NULL,
    tenant TEXT, detail TEXT NOT NULL, prev TEXT NOT NULL, hash TEXT NOT NULL);
CREATE TABLE audit_checkpoint (seq INTEGER PRIMARY KEY, hash TEXT NOT NULL, mac TEXT NOT NULL);
CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL);
"""

# The account and every ancestor, for a charge applied along the chain.
_CHAIN_UPDATE = """
WITH RECURSIVE chain(k) AS (
    SELECT :key UNION ALL SELECT a.parent FROM account a JOIN chain c ON a.key = c.k WHERE a.parent IS NOT NULL)
UPDATE account SET committed_tokens = committed_tokens + :t, committed_usd = committed_usd + :u,
    overage_tokens = overage_tokens + :ot, overage_usd = overage_usd + :ou
WHERE key IN (SELECT k FROM chain)
"""

_STREAM_COLS = "tenant, session_id, stream_id, idempotency_key, state, close_reason, created_ms, closed_ms, body"
_AUDIT_COLS = "seq, ts_ms, kind, actor, tenant, detail, prev, hash"


class SqliteStore(Store):
    """:class:`~atp.store.base.Store` on SQLite (see the module docstring).
    Build it with :meth:`open`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, max_event_bytes: int,
                 max_events_per_stream: int) -> None:
        self._conn = conn
        self.path = path
        self.max_event_bytes = max_event_bytes
        self.max_events_per_stream = max_events_per_stream
        self._lock = threading.Lock()

    @classmethod
    def open(cls, state_dir: Path | str, *, create: bool = True,
             synchronous: Literal["NORMAL", "FULL"] = "NORMAL", max_event_bytes: int = 1 << 20,
             max_events_per_stream: int = 10_000) -> SqliteStore:
        """Open (``create``: and create, directory 0700, file 0600) the store in
        ``state_dir/state.db``. Raises :class:`~atp.store.base.StoreError` when
        there is no state and not ``create`` or the file cannot be opened, and
        :class:`~atp.store.base.SchemaError` for a newer or foreign schema."""
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}")
        d = Path(state_dir)
        path = d / "state.db"
        if not create and not path.exists():
            raise StoreError(f"no state in {d} (no state.db)")
        if create:
            if not d.exists():
                d.mkdir(mode=0o700, parents=True)
                os.chmod(d, 0o700)
            if not path.exists():
                os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open {path}: {e}") from None
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StoreError(f"{path}: cannot switch to WAL (journal_mode is {mode})")
            conn.execute(f"PRAGMA synchronous={synchronous}")
            _migrate(conn, path)
        except sqlite3.DatabaseError as e:
            conn.close()
            raise StoreError(f"{path}: {e}") from None
        except StoreError:
            conn.close()
            raise
        return cls(conn, path, max_event_bytes=max_event_bytes, max_events_per_stream=max_events_per_stream)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    def _one(self, sql: str, args: tuple | dict = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._conn.execute(sql, args)

    def _row(self, sql: str, args: tuple = ()) -> tuple | None:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------ budget ledgers
    def open_account(self, key: str, parent: str | None, limit: Allowance) -> None:
        with self._tx() as c:
            if parent is not None and not _is_open(c, parent):
                raise NotFound(f"no open budget account {parent!r}")
            if _is_open(c, key):
                raise StoreError(f"budget account {key!r} already open")
            c.execute(
                "INSERT INTO account (key, parent, limit_tokens, limit_usd) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET parent = excluded.parent, limit_tokens = excluded.limit_tokens, "
                "limit_usd = excluded.limit_usd, committed_tokens = 0, committed_usd = 0, overage_tokens = 0, "
                "overage_usd = 0, open = 1",
                (key, parent, limit.tokens, limit.usd_micros),
            )

    def close_account(self, key: str) -> None:
        if self._one("UPDATE account SET open = 0 WHERE key = ? AND open = 1", (key,)).rowcount == 0:
            raise NotFound(f"no open budget account {key!r}")

    def reserve(self, reservation: Reservation) -> None:
        r = reservation
        with self._tx() as c:
            if not _is_open(c, r.key):
                raise NotFound(f"no open budget account {r.key!r}")
            c.execute(
                "INSERT INTO reservation (id, account, tokens, usd_micros) VALUES (?, ?, ?, ?) ON CONFLICT (id) "
                "DO UPDATE SET account = excluded.account, tokens = excluded.tokens, usd_micros = excluded.usd_micros",
                (r.id, r.key, r.tokens, r.usd_micros),
            )
            # The ledger's next id survives a restart, so ids are never reused.
            c.execute("INSERT INTO meta (key, value) VALUES ('next_reservation_id', ?) ON CONFLICT (key) "
                      "DO UPDATE SET value = MAX(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))",
                      (str(r.id + 1),))

    def release(self, reservation_id: int) -> None:
        if self._one("DELETE FROM reservation WHERE id = ?", (reservation_id,)).rowcount == 0:
            raise NotFound(f"no open reservation {reservation_id}")

    def commit(self, reservation_id: int, charge: Charge) -> None:
        with self._tx() as c:
            row = c.execute("SELECT account FROM reservation WHERE id = ?", (reservation_id,)).fetchone()
            if row is None:
                raise NotFound(f"no open reservation {reservation_id}")
            c.execute(_CHAIN_UPDATE, {"key": row[0], "t": charge.tokens, "u": charge.usd_micros,
                                      "ot": charge.overage_tokens, "ou": charge.overage_usd_micros})
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
                              next_id=max(int(row[0]) if row else 1, max((r.id for r in res), default=0) + 1))

    def recover(self) -> list[Reservation]:
        with self._tx() as c:
            res = [Reservation(id=i, key=k, tokens=t, usd_micros=u) for i, k, t, u in c.execute(
                "SELECT id, account, tokens, usd_micros FROM reservation ORDER BY id").fetchall()]
            for r in res:
                c.execute(_CHAIN_UPDATE, {"key": r.key, "t": r.tokens, "u": r.usd_micros, "ot": 0, "ou": 0})
            c.execute("DELETE FROM reservation")
        return res

    # ------------------------------------------------------------------ streams
    def put_stream(self, record: StreamRecord) -> None:
        key = (record.tenant, record.session_id, record.stream_id)
        with self._tx() as c:
            c.execute("DELETE FROM event WHERE tenant = ? AND session_id = ? AND stream_id = ?", key)
            c.execute(
                f"INSERT OR REPLACE INTO stream ({_STREAM_COLS}, n_events) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (*key, record.idempotency_key, record.state, record.close_reason, record.created_ms,
                 record.closed_ms, msgspec.json.encode(record)),
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
        key = (tenant, session_id, stream_id)
        with self._tx() as c:
            cur = c.execute("UPDATE stream SET n_events = n_events + 1 WHERE tenant = ? AND session_id = ? "
                            "AND stream_id = ? AND n_events < ?", (*key, self.max_events_per_stream))
            if cur.rowcount == 0:
                if c.execute("SELECT 1 FROM stream WHERE tenant = ? AND session_id = ? AND stream_id = ?",
                             key).fetchone() is None:
                    raise NotFound(f"no stream {tenant}/{session_id}/{stream_id}")
                raise StoreLimitError("events_per_stream", f"stream {stream_id} has the store's limit of "
                                                           f"{self.max_events_per_stream} events")
            try:
                c.execute("INSERT INTO event VALUES (?, ?, ?, ?, ?, ?)", (*key, event_id, type, frame))
            except sqlite3.IntegrityError:
                raise StoreError(f"event {event_id} of stream {stream_id} is already stored") from None

    def events(self, tenant: str, session_id: str, stream_id: str, after: int = 0) -> list[StoredEvent]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT event_id, type, frame FROM event WHERE tenant = ? AND session_id = ? AND stream_id = ? "
                "AND event_id > ? ORDER BY event_id", (tenant, session_id, stream_id, after)).fetchall()
        return [StoredEvent(event_id=i, type=t, frame=bytes(f)) for i, t, f in rows]

    def interrupt_open_streams(self, reason: str, *, now_ms: int) -> list[StreamRecord]:
        with self._tx() as c:
            rows = c.execute(f"SELECT {_STREAM_COLS} FROM stream WHERE state = 'open' "
                             "ORDER BY created_ms, rowid").fetchall()
            c.execute("UPDATE stream SET state = 'interrupted', close_reason = ?, closed_ms = ? WHERE state = 'open'",
                      (reason, now_ms))
        return [msgspec.structs.replace(_stream(r), state="interrupted", close_reason=reason, closed_ms=now_ms)
                for r in rows]

    def expire(self, before_ms: int) -> int:
        with self._tx() as c:
            done = "SELECT tenant, session_id, stream_id FROM stream WHERE state != 'open' AND closed_ms < ?"
            c.execute(f"DELETE FROM event WHERE (tenant, session_id, stream_id) IN ({done})", (before_ms,))
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

    # ------------------------------------------------------------------- audit
    def append_audit(self, record: AuditRecord) -> None:
        r = record
        try:
            self._one(f"INSERT INTO audit ({_AUDIT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (r.seq, r.ts_ms, r.kind, r.actor, r.tenant, json.dumps(r.detail, ensure_ascii=False),
                       r.prev, r.hash))
        except sqlite3.IntegrityError:
            raise StoreError(f"audit record {r.seq} already stored (the log is append-only)") from None

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
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
