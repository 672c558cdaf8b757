"""What is SQLite's own in the embedded store (issue 7): file modes, the
synchronous option, schema versions, the cost of a call. The behaviour of the
Store interface (ledgers, streams, RIB, kv, bounds, kill -9) is tested on every
backend in tests/store/test_store.py."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from atp_router.flow.budget import Allowance, BudgetLedger, Charge, Refusal, Reservation
from atp_router.store import (
    SchemaError,
    SqliteStore,
    StoreError,
    StoreFull,
    StoreJournal,
    StoreLimitError,
    StreamRecord,
)
from atp_router.store.sqlite import STATE_MARKER
from atp_router.wire.frame import Budget, QoS
from tests.store.conftest import STREAM_EVENT_V2

ROOT = Path(__file__).resolve().parents[2]


def stream(tenant: str, sid: str, *, key: str | None = None, created: int = 1_000, session: str = "sess") -> StreamRecord:
    return StreamRecord(tenant=tenant, session_id=session, stream_id=sid, idempotency_key=key,
                        meta={"task_type": "code_review", "n": 1}, qos=QoS.GOLD, budget=Budget(usd=0.5, tokens=900),
                        created_ms=created)


def test_state_dir_and_file_modes(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d):
        pass
    assert d.stat().st_mode & 0o777 == 0o700
    assert (d / "state.db").stat().st_mode & 0o777 == 0o600
    with pytest.raises(StoreError, match="no state"):
        SqliteStore.open(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()


def test_synchronous_option(tmp_path: Path):
    with SqliteStore.open(tmp_path / "a", synchronous="FULL") as s:
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with SqliteStore.open(tmp_path / "b") as s:
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 1
    with pytest.raises(ValueError, match="synchronous"):
        SqliteStore.open(tmp_path / "c", synchronous="OFF")  # type: ignore[arg-type]


def test_schema_version_refusal(tmp_path: Path):
    d = tmp_path / "state"
    SqliteStore.open(d).close()
    with sqlite3.connect(d / "state.db") as c:
        c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(SchemaError, match="schema version 99 is newer than this atp-router supports"):
        SqliteStore.open(d)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "state.db") as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(SchemaError, match="not an atp-router state database"):
        SqliteStore.open(foreign)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "state.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError):
        SqliteStore.open(tmp_path / "junk")


def test_a_response_cache_call_that_fails_in_sqlite_raises_store_error(tmp_path: Path):
    # The runtime's cache catches StoreError alone (it names no backend): a database
    # error of the cache's calls comes as one, naming the file and the call.
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        s.cache_put(b"k", b"v", tenant=None, now_ms=1, expires_ms=10, max_bytes=100)
        with sqlite3.connect(d / "state.db") as c:
            c.execute("DROP TABLE cache")
        for call in (lambda: s.cache_get(b"k", now_ms=2), lambda: s.cache_drop(b"k"),
                     lambda: s.cache_put(b"k", b"v", tenant=None, now_ms=2, expires_ms=10, max_bytes=100)):
            with pytest.raises(StoreError, match=r"state\.db: cache (read|write): no such table: cache") as e:
                call()
            assert isinstance(e.value.__cause__, sqlite3.OperationalError)
        with sqlite3.connect(d / "state.db") as c:
            c.execute("DROP TABLE cache_total")
        with pytest.raises(StoreError, match="cache read: no such table: cache_total"):
            s.cache_stats()


def _fill(s: SqliteStore) -> None:
    """The store's file may not grow: SQLite answers SQLITE_FULL as on a full disk."""
    (pages,) = s._conn.execute("PRAGMA page_count").fetchone()
    s._conn.execute(f"PRAGMA max_page_count = {pages}")


def _unfill(s: SqliteStore) -> None:
    s._conn.execute("PRAGMA max_page_count = 1073741823")


def test_a_full_file_is_store_full_and_the_next_write_after_space_returns_works(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        s.put_stream(stream("t", "s1"))
        _fill(s)
        big = b"x" * 200_000
        for write in (lambda: s.put("k", big), lambda: s.append_event("t", "sess", "s1", 1, "PARTIAL", big)):
            with pytest.raises(StoreFull, match=rf"^state store full: {d / 'state.db'}: no space left on device"), \
                    s.batch():
                write()
        with pytest.raises(StoreFull):
            s.put("k", big)
        assert not s._conn.in_transaction  # rolled back: nothing holds the next write
        assert s.get("k") is None and s.events("t", "sess", "s1") == []
        _unfill(s)
        s.put("k", big)
        s.append_event("t", "sess", "s1", 1, "PARTIAL", big)
        assert s.get("k") == big and len(s.events("t", "sess", "s1")) == 1


def test_a_journal_keeps_settlements_the_full_store_cannot_take_and_refuses_new_spend(tmp_path: Path):
    with _tmpfs(tmp_path / "fs") as fs, SqliteStore.open(fs / "state") as s:
        journal = StoreJournal(s)
        ledger = BudgetLedger(journal=journal)
        ledger.open("client:t", Allowance(tokens=10_000))
        ledger.open("stream:t:1", Allowance(tokens=5_000), parent="client:t")
        r = ledger.reserve("stream:t:1", 1_000, 0)
        assert not isinstance(r, Refusal)
        filler = _fill_fs(fs)  # every write appends to the WAL: none fits now
        # New spend: refused, and the ledger is as it was.
        before = ledger.snapshot()
        with pytest.raises(StoreFull):
            ledger.open("stream:t:2", Allowance(tokens=5_000), parent="client:t")
        with pytest.raises(StoreFull):
            ledger.reserve("stream:t:1", 500, 0)
        assert ledger.snapshot() == before
        # The spend already made: kept, in order, and written once the store takes writes.
        ledger.commit(r, 1_200, 0)
        ledger.close("stream:t:1")
        assert journal.pending == 2 and not journal.flush()
        with pytest.raises(StoreFull):  # new spend waits for them
            ledger.open("stream:t:3", Allowance(tokens=5_000), parent="client:t")
        filler.unlink()
        assert journal.flush() and journal.pending == 0
        snap = s.load_ledger()
        assert [(a.key, a.committed_tokens, a.reserved_tokens) for a in snap.accounts] == [("client:t", 1_200, 0)]
        assert snap.reservations == ()


@contextlib.contextmanager
def _tmpfs(where: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at ``where``; skips, saying why, where mounting is not allowed."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(where)], check=False,
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full disk needs a filesystem of its own: mount -t tmpfs failed ({r.stderr.strip()}); "
                    "run as root (or with CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill_fs(fs: Path) -> Path:
    filler = fs / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        for block in (1 << 16, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)
    return filler


def test_quick_check_at_start_is_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s, s.batch():
        for i in range(3_000):
            s.put(f"k{i}", b"v" * 200)
    with SqliteStore.open(d, check_s=1e-9):  # interrupted at its first progress callback: opened unchecked
        pass
    assert "PRAGMA quick_check did not finish within" in caplog.text
    caplog.clear()
    with SqliteStore.open(d):
        pass
    assert "quick_check" not in caplog.text and (d / STATE_MARKER).exists()


def test_per_call_cost(tmp_path: Path):
    """The router calls the store on its trio thread: append_event and a ledger
    commit must stay small (printed with -s; numbers go in the docs)."""
    with SqliteStore.open(tmp_path / "s") as s:
        s.put_stream(stream("t", "s"))
        s.open_account("client:t", None, Allowance())
        s.open_account("stream:s", "client:t", Allowance())
        n = 500
        frame = b"f" * 300
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            s.append_event("t", "sess", "s", i, "PARTIAL", frame)
        append_us = (time.perf_counter() - t0) / n * 1e6
        for i in range(1, n + 1):
            s.reserve(Reservation(id=i, key="stream:s", tokens=10, usd_micros=10))
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            s.commit(i, Charge(7, 7))
        commit_us = (time.perf_counter() - t0) / n * 1e6
    print(f"append_event {append_us:.0f} µs, commit {commit_us:.0f} µs per call")
    assert append_us < 2_000 and commit_us < 2_000


def test_two_processes_opening_a_new_state_dir_at_once_both_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``--workers`` and bench processes open one new state directory together. The
    race, made deterministic: B reads the empty schema, then A opens the store whole
    (schema, then marker), then B checks the marker. B must start — the marker is
    read before the schema, so a marker written after B's read is a new store's, not
    a sign of lost state (a marker seen *before* an empty schema still refuses)."""
    import atp_router.store.sqlite as sq

    d = tmp_path / "state"
    real_connect = sq._connect

    class RaceConn:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn, self.raced = conn, False

        def execute(self, sql: str, *a: object) -> sqlite3.Cursor:
            cur = self.conn.execute(sql, *a)
            if "sqlite_master" in sql and not self.raced:
                self.raced = True
                rows = cur.fetchall()
                with monkeypatch.context() as m:
                    m.setattr(sq, "_connect", real_connect)
                    SqliteStore.open(d, multiprocess=True).close()  # process A, between B's read and B's marker check
                return self.conn.execute("SELECT ?", (rows[0][0],))
            return cur

        def __getattr__(self, name: str) -> object:
            return getattr(self.conn, name)

    monkeypatch.setattr(sq, "_connect", lambda *a, **k: RaceConn(real_connect(*a, **k)))
    b = SqliteStore.open(d, multiprocess=True)  # B: starts on the store A made
    monkeypatch.setattr(sq, "_connect", real_connect)
    b.close()
    assert (d / STATE_MARKER).exists()
    (d / "state.db").write_bytes(b"")  # state lost behind a marker: still refused
    with pytest.raises(StoreError, match="state"):
        SqliteStore.open(d, multiprocess=True)


_OPEN_IN_ANOTHER_PROCESS = """
import sys, time
from atp_router.store import SqliteStore, StoreError
t0 = time.monotonic()
try:
    SqliteStore.open(sys.argv[1], multiprocess=sys.argv[2] == "multiprocess", exclusive=sys.argv[2] == "exclusive")
except StoreError as e:
    print(f"refused in {time.monotonic() - t0:.1f} s: {e}")
    sys.exit(2)
print("opened")
"""


def test_an_exclusive_store_is_its_process_alone_and_a_second_process_is_refused_at_once(tmp_path: Path):
    """``exclusive`` (the single router's store): no ``-shm``, no lock syscall per
    transaction (bench_store_syscalls.py), and a second process opening the file —
    plain, ``multiprocess`` or exclusive — is refused at once with one line (not after
    SQLite's 10 s busy timeout, not a traceback); a plain sqlite3 reader gets SQLite's
    'database is locked'. Closed, the file opens as before, with what was written."""
    d = tmp_path / "state"
    with pytest.raises(ValueError, match="exclusive"):
        SqliteStore.open(d, exclusive=True, multiprocess=True)
    with SqliteStore.open(d, exclusive=True) as s:
        s.put("k", b"v")
        assert s._conn.execute("PRAGMA locking_mode").fetchone()[0] == "exclusive"
        assert not (d / "state.db-shm").exists() and (d / "state.db-wal").stat().st_size > 0
        for mode in ("plain", "multiprocess", "exclusive"):
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-c",
                                _OPEN_IN_ANOTHER_PROCESS, str(d), mode], capture_output=True, text=True, timeout=60,
                               cwd=ROOT, env=_env(), check=False)
            assert p.returncode == 2 and p.stderr == "", (mode, p.stdout, p.stderr)
            assert time.monotonic() - t0 < 8, mode
            assert len(p.stdout.splitlines()) == 1 and str(d / "state.db") in p.stdout, p.stdout
        raw = sqlite3.connect(d / "state.db", timeout=0)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                raw.execute("SELECT value FROM kv").fetchall()
        finally:
            raw.close()
        s.put("k2", b"v2")  # the owner goes on writing
    with SqliteStore.open(d) as s:
        assert s.get("k") == b"v" and s.get("k2") == b"v2"


def test_an_exclusive_store_keeps_what_it_committed_across_kill9(tmp_path: Path):
    """Kill -9 of a process on an exclusive store (the WAL index was in its memory):
    every committed write is there at the next open, which replays the WAL."""
    d = tmp_path / "state"
    code = ("import sys, time\nfrom atp_router.store import SqliteStore\n"
            "s = SqliteStore.open(sys.argv[1], exclusive=True)\n"
            "for i in range(200):\n    s.put(f'k{i}', b'v' * 300)\n"
            "print('written', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "written"
    finally:
        p.kill()
        p.wait(timeout=30)
    assert (d / "state.db-wal").stat().st_size > 0  # nothing checkpointed at a clean close: the WAL is replayed
    with SqliteStore.open(d, exclusive=True) as s:
        assert all(s.get(f"k{i}") == b"v" * 300 for i in range(200))


def _env() -> dict[str, str]:
    """This environment with the tree under test first on the path (a subprocess imports it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_schema_2_streams_and_events_are_migrated_to_numbered_streams(tmp_path: Path):
    """A schema 2 state directory (events keyed by tenant, session and stream) opens
    as schema 3: every stream keeps its record, state, event count and events, in
    order; idempotency and by-id lookups, expiry and new events work on it."""
    d = tmp_path / "state"
    with SqliteStore.open(d):
        pass
    c = sqlite3.connect(d / "state.db", isolation_level=None)
    try:
        c.executescript(STREAM_EVENT_V2)
        for i, sid in enumerate(("b", "a", "c")):  # rowid order is not key order
            rec = stream("t", sid, key=f"idem-{sid}", created=1_000 + i)
            c.execute("INSERT INTO stream (tenant, session_id, stream_id, idempotency_key, state, created_ms, "
                      "closed_ms, n_events, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      ("t", "sess", sid, f"idem-{sid}", "closed" if sid == "c" else "open", rec.created_ms,
                       2_000 if sid == "c" else None, 3, msgspec.json.encode(rec)))
            for e in (1, 2, 3):
                c.execute("INSERT INTO event VALUES (?, ?, ?, ?, ?, ?)", ("t", "sess", sid, e, "PARTIAL",
                                                                           f"{sid}{e}".encode()))
    finally:
        c.close()
    with SqliteStore.open(d) as s:
        assert s._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "3"
        for sid in ("a", "b", "c"):
            assert [(e.event_id, e.frame) for e in s.events("t", "sess", sid)] == [
                (i, f"{sid}{i}".encode()) for i in (1, 2, 3)]
            assert s.events("t", "sess", sid, after=2)[0].frame == f"{sid}3".encode()
            found = s.find_idempotent("t", f"idem-{sid}")
            assert found is not None and found.stream_id == sid and s.find_stream("t", sid) is not None
        s.append_event("t", "sess", "a", 4, "FINAL", b"a4")
        assert [e.event_id for e in s.events("t", "sess", "a")] == [1, 2, 3, 4]
        assert s.expire(3_000) == 1 and s.get_stream("t", "sess", "c") is None  # the closed one, with its events
        assert s._conn.execute("SELECT count(*) FROM event").fetchone()[0] == 7
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_event_ids_past_the_schema_3_key_are_refused_not_folded(tmp_path: Path):
    """Schema 3 keys an event by its stream's number and its id (:data:`EVENT_ID_BITS`
    bits): an id that does not fit is refused (a bound, as the event count is), never
    stored under another stream's key; a schema 2 file holding one is not migrated."""
    from atp_router.store.sqlite import EVENT_ID_BITS

    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        s.put_stream(stream("t", "a"))
        s.put_stream(stream("t", "b"))
        with pytest.raises(StoreLimitError) as e:
            s.append_event("t", "sess", "a", 1 << EVENT_ID_BITS, "PARTIAL", b"x")
        assert e.value.limit == "events_per_stream"
        s.append_event("t", "sess", "a", (1 << EVENT_ID_BITS) - 1, "PARTIAL", b"last")
        assert s.events("t", "sess", "b") == [] and [x.frame for x in s.events("t", "sess", "a")] == [b"last"]
    with pytest.raises(ValueError, match="max_events_per_stream"):
        SqliteStore.open(d, max_events_per_stream=1 << EVENT_ID_BITS)
    c = sqlite3.connect(d / "state.db", isolation_level=None)
    try:
        c.executescript(STREAM_EVENT_V2)
        c.execute("INSERT INTO stream (tenant, session_id, stream_id, state, created_ms, body) "
                  "VALUES ('t', 's', 'a', 'open', 1, x'7b7d')")
        c.execute("INSERT INTO event VALUES ('t', 's', 'a', ?, 'PARTIAL', x'00')", (1 << EVENT_ID_BITS,))
    finally:
        c.close()
    with pytest.raises(SchemaError, match="cannot migrate"):
        SqliteStore.open(d)
    c = sqlite3.connect(d / "state.db")
    try:
        assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "2"
    finally:
        c.close()
