"""The redo log of an exclusive SQLite store (issue 25 item 2: durability at the cost of one write).

A router that alone owns its state directory (:meth:`SqliteStore.open
<atp_router.store.sqlite.SqliteStore.open>` with ``exclusive`` and ``redo``) does not
commit each of its write transactions to SQLite. It runs them, as before, on its one
connection — every read sees them, every constraint and bound is checked, a failing
operation undoes only itself — but inside one long SQLite transaction, and makes each
durable by appending the statements it ran to ``state.db.redo`` in **one** ``write``
(plus one ``fdatasync`` under ``synchronous=FULL``). The long transaction is committed
to SQLite's WAL now and then (:data:`COMMIT_EVERY_TXS` transactions, :data:`COMMIT_EVERY_BYTES`
of log or :data:`COMMIT_EVERY_S` seconds, whichever comes first; and at close and
before a checkpoint), with the log's sequence number of its last transaction
(``meta.redo_lsn``); then the log is emptied. A page a task's transactions all touch —
the stream table's last leaf, the event table's, the audit chain's — is written to
the WAL once per commit instead of once per transaction: measured at one task in
flight, 44.8 → 6.8 store syscalls a task (``bench/bench_store_syscalls.py``).

A transaction is acknowledged once its record is written: a **kill -9** after that
leaves the record in the OS page cache, and the next :meth:`RedoLog.replay` (at the
store's open, before anything reads it) runs every record past ``meta.redo_lsn`` again,
in order, in one SQLite transaction. The replay is exact because a record holds the
writing statements with their bound values (never SQL text with values spliced in)
in the order they ran, including the savepoints that undid a failed operation, and
the store's statements take every value from their parameters (no ``random()``, no
clock in SQL). A record is ``<u32 length><u32 crc32><msgpack [lsn, statements]>``;
a torn last record (a crash inside ``write``, an OS crash under ``NORMAL``) fails its
length or checksum and is ignored — it was never acknowledged. A record that cannot
be replayed (a statement SQLite refuses) stops the open with a one-line error naming
the file: nothing is dropped silently.

Faults: a record the disk has no room for (``ENOSPC``) is cut off again (the log never
keeps a torn record ahead of later ones) and raised as :class:`~atp_router.store.base.StoreFull`,
its transaction rolled back in SQLite; a commit to SQLite that fails keeps the log
(the transactions stay durable there) and is tried again at the next commit point;
if SQLite rolled the long transaction back by itself, the log is replayed into a new
one before the next write.

What an operator sees: while the router runs, ``state.db`` has what was last
committed; after a kill -9, the latest transactions are in ``state.db.redo`` until
the store is opened again (``atp-router`` or any command on the directory).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from atp_router.store.base import StoreError, StoreFull, StoreUnavailable

__all__ = ["COMMIT_EVERY_BYTES", "COMMIT_EVERY_S", "COMMIT_EVERY_TXS", "RecordingConnection", "RedoLog"]

#: The long transaction is committed to SQLite after this many redo records…
COMMIT_EVERY_TXS = 2048
#: …or this many bytes of redo log…
COMMIT_EVERY_BYTES = 8 << 20
#: …or once this many seconds have passed since the last commit (checked at each record).
COMMIT_EVERY_S = 1.0
#: ``<u32 length><u32 crc32>`` ahead of each record's msgpack.
_HEADER = struct.Struct("<II")
#: A record longer than this is not believed (a damaged length): the log ends there.
_MAX_RECORD = 1 << 30

#: One statement as recorded: ``(sql, parameters)`` or ``(sql, [parameters, …], 1)`` (executemany).
Statement = tuple[Any, ...]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[int, list[list[Any]]])
_READS = ("SELECT", "PRAGMA")


class RecordingConnection(sqlite3.Connection):
    """A :class:`sqlite3.Connection` that, while :attr:`recording` is a list,
    appends to it each writing statement it ran successfully, with its
    parameters (``SELECT`` and ``PRAGMA`` are not recorded). Made by
    ``sqlite3.connect(..., factory=RecordingConnection)``."""

    recording: list[Statement] | None = None

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        cur = _execute(self, sql, parameters)
        rec = self.recording
        if rec is not None:
            writes = _WRITES.get(sql)
            if writes is None:
                writes = _classify(sql)
            if writes:
                # A copy: the caller may reuse its list or dict for the next statement.
                rec.append((sql, parameters if type(parameters) is tuple
                            else dict(parameters) if isinstance(parameters, dict) else tuple(parameters)))
        return cur

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> sqlite3.Cursor:
        rec = self.recording
        if rec is None:
            return super().executemany(sql, seq_of_parameters)
        rows = [dict(r) if isinstance(r, dict) else tuple(r) for r in seq_of_parameters]  # read once, copied
        cur = super().executemany(sql, rows)
        rec.append((sql, rows, 1))
        return cur


_execute = sqlite3.Connection.execute
#: Whether a statement's text writes (not ``SELECT`` / ``PRAGMA``), by text: the store's
#: statements are a bounded set of constants (cleared past :data:`_WRITES_MAX`).
_WRITES: dict[str, bool] = {}
_WRITES_MAX = 4096


def _classify(sql: str) -> bool:
    if len(_WRITES) >= _WRITES_MAX:
        _WRITES.clear()
    writes = _WRITES[sql] = not sql.lstrip()[:6].upper().startswith(_READS)
    return writes


def _run(c: sqlite3.Connection, statements: list[list[Any]]) -> None:
    """Run a record's statements on ``c`` (not recorded again)."""
    for st in statements:
        sql, params = st[0], st[1]
        if len(st) > 2:
            sqlite3.Connection.executemany(c, sql, params)
        else:
            sqlite3.Connection.execute(c, sql, params)


class RedoLog:
    """``state.db.redo`` of one store (module docstring): records appended by
    :meth:`append`, emptied by :meth:`reset` once SQLite committed them, replayed
    by :meth:`replay`. Not thread-safe: the store calls it under its lock."""

    def __init__(self, path: Path, fd: int, *, next_lsn: int, fsync: bool) -> None:
        self.path = path
        self._fd = fd
        self._fsync = fsync
        #: The sequence number the next record gets.
        self.next_lsn = next_lsn
        #: The last sequence number SQLite has committed (``meta.redo_lsn``).
        self.committed_lsn = next_lsn - 1
        #: Bytes in the log now.
        self.size = 0
        #: When the long transaction is committed to SQLite: after this many records, bytes
        #: of log, or seconds since the last commit (:data:`COMMIT_EVERY_TXS` …).
        self.commit_every_txs = COMMIT_EVERY_TXS
        self.commit_every_bytes = COMMIT_EVERY_BYTES
        self.commit_every_s = COMMIT_EVERY_S

    @classmethod
    def open(cls, path: Path, *, fsync: bool) -> RedoLog:
        """Open (create, 0600) the log at ``path`` for appending; call :meth:`replay` before any write."""
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StoreError(f"cannot open the redo log {path}: {e.strerror or e}") from None
        log = cls(path, fd, next_lsn=1, fsync=fsync)
        log.size = os.fstat(fd).st_size
        return log

    def due(self, since_s: float) -> bool:
        """Whether to commit to SQLite now, ``since_s`` seconds after the last commit."""
        return (self.pending >= self.commit_every_txs or self.size >= self.commit_every_bytes
                or since_s >= self.commit_every_s)

    @property
    def pending(self) -> int:
        """Records written since SQLite's last commit."""
        return self.next_lsn - 1 - self.committed_lsn

    def records(self) -> Iterator[tuple[int, list[list[Any]]]]:
        """``(lsn, statements)`` of each whole record in the file, in order, up to the first torn one."""
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        at = 0
        while at + _HEADER.size <= len(data):
            n, crc = _HEADER.unpack_from(data, at)
            body = data[at + _HEADER.size:at + _HEADER.size + n]
            if n > _MAX_RECORD or len(body) < n or zlib.crc32(body) != crc:
                return
            try:
                yield _decoder.decode(body)
            except msgspec.ValidationError:
                return
            at += _HEADER.size + n

    def replay(self, c: sqlite3.Connection, committed_lsn: int) -> int:
        """Run every record past ``committed_lsn`` on ``c`` (which must be inside a
        write transaction), in order; returns how many. Sets :attr:`next_lsn` past
        the last record. Raises :class:`~atp_router.store.base.StoreError` naming
        the log when SQLite refuses a statement of a record."""
        self.committed_lsn = committed_lsn
        self.next_lsn = max(self.next_lsn, committed_lsn + 1)
        n = 0
        for lsn, statements in self.records():
            if lsn <= committed_lsn:
                continue
            try:
                _run(c, statements)
            except sqlite3.Error as e:
                raise StoreError(f"{self.path}: record {lsn} cannot be replayed ({e}); the transactions it and "
                                 "the ones after it hold are not in the store. Move the file aside to start "
                                 "without them") from e
            self.next_lsn = lsn + 1
            n += 1
        return n

    def append(self, statements: list[Statement]) -> int:
        """Write one record (one ``write``; ``fdatasync`` too with ``fsync``) and return
        its sequence number. On a failed or short write the file is cut back to its
        size before and :class:`~atp_router.store.base.StoreFull` (no room) or
        :class:`~atp_router.store.base.StoreUnavailable` is raised: nothing was written."""
        body = _encoder.encode((self.next_lsn, statements))
        data = _HEADER.pack(len(body), zlib.crc32(body)) + body
        try:
            wrote = os.write(self._fd, data)
            if wrote != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self._fsync:
                os.fdatasync(self._fd)
        except OSError as e:
            try:
                os.ftruncate(self._fd, self.size)
            except OSError:
                pass
            # Named by the database, as SQLite's own faults are (atp_router.store.sqlite.write_fault).
            db = self.path.with_suffix("")
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"state store full: {db}: no space left on device (its redo log "
                                f"{self.path.name})") from None
            raise StoreUnavailable(f"state store I/O error: {db}: {e.strerror or e} (its redo log "
                                   f"{self.path.name})") from None
        self.size += len(data)
        lsn = self.next_lsn
        self.next_lsn += 1
        return lsn

    def reset(self, committed_lsn: int) -> None:
        """SQLite has committed every record up to ``committed_lsn``: empty the log."""
        self.committed_lsn = committed_lsn
        if self.size:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                return  # kept: its records are all <= meta.redo_lsn, skipped by a replay
            self.size = 0

    def close(self) -> None:
        os.close(self._fd)
