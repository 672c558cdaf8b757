"""The redo log of a single router's store (:mod:`atp_router.store.redo`, issue 25 item 2):
each write transaction one record in ``state.db.redo``, SQLite committed in groups.

A real kill -9 of a writing process whose transactions are only in the log (SQLite's
commits held back): the next open — exclusive, or as ``--workers`` opens the file —
replays them, and every table reads exactly as the dead process read it, including a
batch whose failing operation undid only itself. A torn last record is ignored; a
record the disk has no room for is cut off and refused, its transaction undone."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path

import pytest

from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.store import SqliteStore, StoreFull, StoreJournal, StreamRecord
from atp_router.store import redo as redo_mod

ROOT = Path(__file__).resolve().parents[2]

_TABLES = ("meta", "account", "reservation", "stream", "event", "audit", "kv", "cache", "nonce", "quota_stream")


def dump(c: sqlite3.Connection) -> dict[str, list[list[object]]]:
    """Every row of the tables a router writes (``meta``'s ``redo_lsn`` left out: the
    log's own bookkeeping), blobs as hex: comparable as JSON."""
    out: dict[str, list[list[object]]] = {}
    for t in _TABLES:
        rows = c.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
        out[t] = [[v.hex() if isinstance(v, bytes) else v for v in r] for r in rows
                  if not (t == "meta" and r[0] == "redo_lsn")]
    return out


_CHILD = textwrap.dedent("""
    import json, sys
    from atp_router.flow.budget import Allowance, BudgetLedger
    from atp_router.store import SqliteStore, StoreError, StoreJournal, StreamRecord
    from tests.store.test_redo import dump
    store = SqliteStore.open(sys.argv[1], exclusive=True, redo=True)
    store._redo.commit_every_txs = store._redo.commit_every_bytes = 10**12
    store._redo.commit_every_s = 10.0**9  # nothing reaches SQLite: the log alone holds it
    ledger = BudgetLedger(journal=StoreJournal(store))
    ledger.open("client:k", Allowance(tokens=10**9, usd_micros=10**9))
    for i in range(1, 41):
        sid = f"s{i}"
        store.put_stream(StreamRecord(tenant="k", session_id="sess", stream_id=sid, idempotency_key=f"key{i}",
                                      meta={"i": i}, qos=None, budget=None, created_ms=i))
        ledger.open("stream:" + sid, Allowance(), parent="client:k")
        r = ledger.reserve("stream:" + sid, 10, 10)
        with store.batch():
            store.append_events("k", "sess", sid, [(1, "PARTIAL", bytes([i]) * 300), (2, "FINAL", b"final")])
            try:  # a failing operation inside the batch undoes only itself
                store.append_event("k", "sess", sid, 1, "PARTIAL", b"another frame under id 1")
            except StoreError:
                pass
            store.close_stream("k", "sess", sid, reason="FIN", closed_ms=1000 + i)
        ledger.commit(r, 7, 3)
        ledger.close("stream:" + sid)
        store.put(f"kv/{i}", b"v%d" % i)
        store.record_nonce("k", "kid", f"n{i}", now_ms=i, expires_ms=10**12, max_per_tenant=1000)
    store.cache_put(b"c" * 32, b"cached", tenant="k", now_ms=1, expires_ms=10**12, max_bytes=1 << 20)
    assert store._redo.pending > 100
    print(json.dumps(dump(store._conn)), flush=True)
    sys.stdin.read()  # held until killed
""")


def _killed_writer(state: Path) -> dict[str, list[list[object]]]:
    """Run :data:`_CHILD` on ``state``, kill -9 it once it printed what it reads; returns that."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(state)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the writer ended early"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()
    assert proc.returncode == -signal.SIGKILL
    return json.loads(line)


def _read_file(state: Path) -> dict[str, list[list[object]]]:
    with closing(sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True)) as c:
        return dump(c)


@pytest.mark.parametrize("how", ["exclusive", "workers"])
def test_a_kill9_loses_no_transaction_the_log_alone_held(tmp_path: Path, how: str):
    state = tmp_path / "state"
    seen = _killed_writer(state)
    assert len(seen["stream"]) == 40 and len(seen["event"]) == 80 and seen["reservation"] == []
    assert _read_file(state)["stream"] == []  # SQLite never got them: only the log has them
    store = (SqliteStore.open(state, exclusive=True, redo=True) if how == "exclusive"
             else SqliteStore.open(state, multiprocess=True))  # --workers on a crashed single router's directory
    try:
        assert dump(store._conn) == seen
        assert [e.frame for e in store.events("k", "sess", "s7")] == [bytes([7]) * 300, b"final"]
    finally:
        store.close()
    assert _read_file(state) == seen  # replayed and committed: the file itself now has them
    assert not (state / "state.db.redo").exists() or (state / "state.db.redo").stat().st_size == 0


def test_a_torn_last_record_is_ignored(tmp_path: Path):
    state = tmp_path / "state"
    seen = _killed_writer(state)
    log = state / "state.db.redo"
    whole = log.read_bytes()
    with open(log, "ab") as f:  # a record cut short by a crash inside its write
        f.write(whole[:40])
    store = SqliteStore.open(state, exclusive=True, redo=True)
    try:
        assert dump(store._conn) == seen
    finally:
        store.close()


def test_records_are_one_write_each_and_sqlite_is_committed_in_groups(tmp_path: Path):
    store = SqliteStore.open(tmp_path / "state", exclusive=True, redo=True)
    try:
        assert store._redo is not None
        store._redo.commit_every_s = 10.0**9
        store._redo.commit_every_txs = 50
        wal = tmp_path / "state" / "state.db-wal"
        ledger = BudgetLedger(journal=StoreJournal(store))
        ledger.open("client:k", Allowance(tokens=10**6))
        wal_before = wal.stat().st_size
        for i in range(40):
            store.put_stream(StreamRecord(tenant="k", session_id="s", stream_id=f"t{i}", idempotency_key=None,
                                          meta={}, qos=None, budget=None, created_ms=i))
        assert store._redo.pending == 41 and wal.stat().st_size == wal_before  # 41 records, no WAL frame
        for i in range(10):
            store.append_event("k", "s", f"t{i}", 1, "FINAL", b"x")
        assert store._redo.pending == 0 or wal.stat().st_size > wal_before  # the 51st transaction committed first
        assert store.get_stream("k", "s", "t39") is not None
    finally:
        store.close()


def test_a_record_the_disk_has_no_room_for_is_refused_and_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    state = tmp_path / "state"
    store = SqliteStore.open(state, exclusive=True, redo=True)
    try:
        assert store._redo is not None
        store.put("a", b"1")
        size = store._redo.size
        real_write = os.write

        def full(fd: int, data: bytes) -> int:
            real_write(fd, data[: len(data) // 2])  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(redo_mod.os, "write", full)
        with pytest.raises(StoreFull, match=rf"state store full: {state / 'state.db'}: no space left on device"):
            store.put("b", b"2")
        monkeypatch.setattr(redo_mod.os, "write", real_write)
        assert store.get("b") is None and store._redo.size == size  # undone in SQLite, cut off in the log
        assert (state / "state.db.redo").stat().st_size == size
        store.put("c", b"3")
    finally:
        _die(store)
    again = SqliteStore.open(state, exclusive=True, redo=True)
    try:
        assert (again.get("a"), again.get("b"), again.get("c")) == (b"1", None, b"3")
    finally:
        again.close()


def _die(store: SqliteStore) -> None:
    """What a kill -9 leaves of ``store``: its connection closed without a commit (SQLite
    rolls the long transaction back), its log and lock let go as they are."""
    assert store._redo is not None
    store._conn.close()
    store._redo.close()
    store._redo = None
    assert store._ofd is not None
    os.close(store._ofd)
    store._ofd = None


def test_an_idle_store_commits_when_due_and_full_sync_fsyncs_each_record(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """``commit_due`` (the single router's timer) commits what is due without a new write;
    under ``synchronous=FULL`` each record is fdatasync'ed before its transaction returns."""
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(redo_mod.os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    store = SqliteStore.open(tmp_path / "state", exclusive=True, redo=True, synchronous="FULL")
    try:
        assert store._redo is not None
        store._redo.commit_every_s = 10.0**9
        store.put("a", b"1")
        store.put("b", b"2")
        assert len(synced) == 2 and store._redo.pending == 2
        assert store.commit_due() is False  # not due yet
        store._redo.commit_every_s = 0.0
        assert store.commit_due() is True
        assert store._redo.pending == 0 and (tmp_path / "state" / "state.db.redo").stat().st_size == 0
        assert store.commit_due() is False  # nothing left
        assert (store.get("a"), store.get("b")) == (b"1", b"2")
    finally:
        store.close()
