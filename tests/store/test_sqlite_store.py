"""Durable state on a real SQLite file (issue 7 item 7): ledgers, streams, RIB,
kv, bounds, schema versions, and a real kill -9 of a writing process."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from atp.flow.budget import Allowance, BudgetLedger, Charge, Refusal, Reservation
from atp.store import (
    NotFound,
    SchemaError,
    SqliteStore,
    StoreError,
    StoreJournal,
    StoreLimitError,
    StreamRecord,
)
from atp.store.sqlite import RIB_KEPT
from atp.wire.frame import Budget, QoS

ROOT = Path(__file__).resolve().parents[2]


def stream(tenant: str, sid: str, *, key: str | None = None, created: int = 1_000, session: str = "sess") -> StreamRecord:
    return StreamRecord(tenant=tenant, session_id=session, stream_id=sid, idempotency_key=key,
                        meta={"task_type": "code_review", "n": 1}, qos=QoS.GOLD, budget=Budget(usd=0.5, tokens=900),
                        created_ms=created)


def journaled(store: SqliteStore) -> BudgetLedger:
    return BudgetLedger(journal=StoreJournal(store))


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


def test_ledger_rebuilt_from_store_equals_snapshot(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        lg = journaled(s)
        lg.open("client:alice", Allowance(tokens=1_000, usd_micros=50_000))
        lg.open("stream:1", Allowance(tokens=600), parent="client:alice")
        lg.open("stream:2", Allowance(), parent="client:alice")
        r1 = lg.reserve("stream:1", 100, 1_000)
        r1 = lg.extend(r1, 50, 0)
        assert lg.commit(r1, 400, 2_000) == Charge(400, 2_000)  # above its reservation: the chain can take it
        r2 = lg.reserve("stream:2", 200, 3_000)
        lg.release(r2)
        r3 = lg.reserve("stream:2", 300, 4_000)
        assert isinstance(lg.commit(lg.reserve("stream:1", 10, 0), 10, 0), Charge)
        assert lg.set_limit("stream:1", Allowance(tokens=100), clamp=True) is None
        open_r = lg.reserve("stream:2", 5, 5)
        assert isinstance(lg.reserve("stream:2", 10_000, 0), Refusal)  # a refusal is not journaled
        lg.open("stream:3", Allowance(), parent="client:alice")
        lg.commit(lg.reserve("stream:3", 1, 1), 1, 1)
        lg.close("stream:3")
        assert lg.snapshot() == s.load_ledger()
        snap = lg.snapshot()
    with SqliteStore.open(d) as s:
        assert s.load_ledger() == snap
        rebuilt = BudgetLedger()
        rebuilt.restore(s.load_ledger())
        assert rebuilt.snapshot() == snap
        assert rebuilt.state("stream:1").limit == Allowance(tokens=410)
        assert not rebuilt.has("stream:3")
        # The rebuilt ledger settles the reservations that were open, journaled again.
        rebuilt.journal = StoreJournal(s)
        rebuilt.commit(r3, 250, 1_000)
        rebuilt.release(open_r)
        assert s.load_ledger() == rebuilt.snapshot()
        assert rebuilt.state("client:alice").committed_tokens == 400 + 10 + 1 + 250


def test_recover_commits_open_reservations_and_exhaustion_survives(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        lg = journaled(s)
        lg.open("client:bob", Allowance(tokens=100))
        lg.open("stream:x", Allowance(), parent="client:bob")
        lg.commit(lg.reserve("stream:x", 60, 0), 60, 0)
        r = lg.reserve("stream:x", 40, 7)  # in flight at the "crash"
        assert isinstance(r, Reservation)
    with SqliteStore.open(d) as s:
        assert s.recover() == [r]
        assert s.recover() == []
        lg = BudgetLedger()
        lg.restore(s.load_ledger())
        st = lg.state("client:bob")
        assert (st.committed_tokens, st.committed_usd_micros, st.reserved_tokens) == (100, 7, 0)
        assert lg.exhausted("stream:x") == "'client:bob' tokens 100/100"
        assert isinstance(lg.reserve("stream:x", 1, 0), Refusal)


def test_store_ledger_errors(tmp_path: Path):
    with SqliteStore.open(tmp_path / "s") as s:
        with pytest.raises(NotFound):
            s.open_account("stream:1", "client:none", Allowance())
        s.open_account("client:a", None, Allowance(tokens=5))
        with pytest.raises(StoreError, match="already open"):
            s.open_account("client:a", None, Allowance())
        with pytest.raises(NotFound):
            s.commit(99, Charge(1, 1))
        with pytest.raises(NotFound):
            s.release(99)
        with pytest.raises(NotFound):
            s.reserve(Reservation(id=1, key="client:zz", tokens=1, usd_micros=0))
        with pytest.raises(NotFound):
            s.set_limit("client:zz", Allowance())
        s.close_account("client:a")
        with pytest.raises(NotFound):
            s.close_account("client:a")
        s.open_account("client:a", None, Allowance(tokens=9))  # a closed key re-opens from zero
        assert s.load_ledger().accounts[0].limit == Allowance(tokens=9)


def test_streams_events_and_idempotency_after_reopen(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        s.put_stream(stream("alice", "s1", key="k1"))
        for i, t in enumerate(["SYN_ACK", "PARTIAL", "FINAL", "FIN"], start=1):
            s.append_event("alice", "sess", "s1", i, t, f"frame-{i}".encode())
        s.close_stream("alice", "sess", "s1", reason="FIN", closed_ms=2_000)
    with SqliteStore.open(d) as s:
        rec = s.find_idempotent("alice", "k1")
        assert rec is not None and rec.stream_id == "s1" and rec.state == "closed" and rec.close_reason == "FIN"
        assert rec.meta == {"task_type": "code_review", "n": 1} and rec.qos is QoS.GOLD
        assert rec.budget == Budget(usd=0.5, tokens=900) and rec.closed_ms == 2_000
        assert s.find_idempotent("bob", "k1") is None  # another tenant learns nothing
        assert s.get_stream("bob", "sess", "s1") is None
        assert [e.type for e in s.events("alice", "sess", "s1")] == ["SYN_ACK", "PARTIAL", "FINAL", "FIN"]
        assert [(e.event_id, e.frame) for e in s.events("alice", "sess", "s1", after=2)] == [
            (3, b"frame-3"), (4, b"frame-4")]
        assert s.events("bob", "sess", "s1") == []
        # Same ids in another tenant are another stream.
        s.put_stream(stream("bob", "s1", key="k1", created=5_000))
        assert s.find_idempotent("bob", "k1").tenant == "bob"
        assert len(s.events("alice", "sess", "s1")) == 4
        # The newest stream with a key wins; a reused id drops its old events.
        s.put_stream(stream("alice", "s2", key="k1", created=3_000))
        assert s.find_idempotent("alice", "k1").stream_id == "s2"
        s.put_stream(stream("alice", "s1", key="k9", created=4_000))
        assert s.events("alice", "sess", "s1") == []
        assert s.get_stream("alice", "sess", "s1").state == "open"


def test_event_bounds_and_errors(tmp_path: Path):
    with SqliteStore.open(tmp_path / "s", max_event_bytes=64, max_events_per_stream=3) as s:
        with pytest.raises(NotFound):
            s.append_event("t", "sess", "nope", 1, "FIN", b"x")
        with pytest.raises(NotFound):
            s.close_stream("t", "sess", "nope", reason="FIN", closed_ms=1)
        s.put_stream(stream("t", "s"))
        with pytest.raises(StoreLimitError, match="65 bytes") as e:
            s.append_event("t", "sess", "s", 1, "PARTIAL", b"x" * 65)
        assert e.value.limit == "event_bytes"
        for i in (1, 2):
            s.append_event("t", "sess", "s", i, "PARTIAL", b"x" * 64)
        with pytest.raises(StoreError, match="already stored"):
            s.append_event("t", "sess", "s", 2, "PARTIAL", b"y")
        s.append_event("t", "sess", "s", 3, "PARTIAL", b"z")  # the duplicate did not count
        with pytest.raises(StoreLimitError, match="limit of 3 events") as e:
            s.append_event("t", "sess", "s", 4, "FIN", b"")
        assert e.value.limit == "events_per_stream"
        assert [ev.frame for ev in s.events("t", "sess", "s")] == [b"x" * 64, b"x" * 64, b"z"]


def test_interrupt_open_streams(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        s.put_stream(stream("alice", "a1", key="ka", created=10))
        s.put_stream(stream("bob", "b1", created=20))
        s.put_stream(stream("bob", "b2", created=30))
        s.close_stream("bob", "sess", "b2", reason="FIN", closed_ms=40)
    with SqliteStore.open(d) as s:
        got = s.interrupt_open_streams("router restarted: stream interrupted", now_ms=1_000)
        assert [(r.tenant, r.stream_id, r.state, r.close_reason, r.closed_ms) for r in got] == [
            ("alice", "a1", "interrupted", "router restarted: stream interrupted", 1_000),
            ("bob", "b1", "interrupted", "router restarted: stream interrupted", 1_000),
        ]
        assert s.interrupt_open_streams("again", now_ms=2_000) == []
        assert s.get_stream("bob", "sess", "b2").state == "closed"
        # The router appends the RST it reports; the idempotency key finds the interrupted stream.
        s.append_event("alice", "sess", "a1", 1, "RST", b"rst")
        assert s.find_idempotent("alice", "ka").state == "interrupted"


def test_expire_drops_finished_streams_and_closed_accounts(tmp_path: Path):
    with SqliteStore.open(tmp_path / "s") as s:
        for sid in ("old", "new", "live", "cut"):
            s.put_stream(stream("t", sid))
            s.append_event("t", "sess", sid, 1, "SYN_ACK", b"a")
        s.close_stream("t", "sess", "old", reason="FIN", closed_ms=100)
        s.close_stream("t", "sess", "new", reason="FIN", closed_ms=900)
        s.interrupt_open_streams("crash", now_ms=50)
        s.put_stream(stream("t", "live2"))
        lg = journaled(s)
        lg.open("client:t", Allowance(tokens=10))
        lg.open("stream:old", Allowance(), parent="client:t")
        lg.commit(lg.reserve("stream:old", 3, 0), 3, 0)
        lg.close("stream:old")
        assert s.expire(before_ms=500) == 3
        assert s.get_stream("t", "sess", "old") is None and s.events("t", "sess", "old") == []
        for sid in ("live", "cut"):  # interrupted at 50
            assert s.get_stream("t", "sess", sid) is None and s.events("t", "sess", sid) == []
        assert s.get_stream("t", "sess", "new") is not None and s.events("t", "sess", "new") != []
        assert s.get_stream("t", "sess", "live2").state == "open"
        assert [r[0] for r in s._conn.execute("SELECT key FROM account")] == ["client:t"]
        assert s.load_ledger().accounts[0].committed_tokens == 3  # spend stays in the parent


def test_rib_versions_and_kv(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        assert s.active_rib() is None and s.get("hmac") is None
        for v in range(1, RIB_KEPT + 5):
            s.save_rib(v, f"version: {v}\n", "POST /v1/policies/reload", "admin@alice")
        s.save_rib(3, "version: 3\n", "rollback", "ops")  # the last saved is active, not the highest
        s.put("router/hmac", b"\x00k1")
        s.put("router/hmac", b"\x00k2")
    with SqliteStore.open(d) as s:
        assert s.active_rib() == (3, "version: 3\n", "rollback")
        assert s._conn.execute("SELECT COUNT(*) FROM rib").fetchone()[0] == RIB_KEPT
        assert s.get("router/hmac") == b"\x00k2"


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


_CHILD = textwrap.dedent("""
    import sys
    from atp.flow.budget import Allowance, BudgetLedger
    from atp.store import SqliteStore, StoreJournal, StreamRecord
    store = SqliteStore.open(sys.argv[1])
    ledger = BudgetLedger(journal=StoreJournal(store))
    ledger.open("client:k", Allowance(tokens=10**9))
    for i in range(1, 10**6):
        sid = f"s{i}"
        store.put_stream(StreamRecord(tenant="k", session_id="sess", stream_id=sid, idempotency_key=f"key{i}",
                                      meta={}, qos=None, budget=None, created_ms=i))
        ledger.open("stream:" + sid, Allowance(), parent="client:k")
        r = ledger.reserve("stream:" + sid, 10, 10)
        ledger.commit(r, 7, 7)
        store.append_event("k", "sess", sid, 1, "FINAL", b"final-" + sid.encode())
        store.close_stream("k", "sess", sid, reason="FIN", closed_ms=i)
        ledger.close("stream:" + sid)
        store.put_stream(StreamRecord(tenant="k", session_id="sess", stream_id="t" + str(i),
                                      idempotency_key=None, meta={}, qos=None, budget=None, created_ms=i))
        ledger.open("stream:t" + str(i), Allowance(), parent="client:k")
        ledger.reserve("stream:t" + str(i), 10, 10)  # left open: in flight
        print(i, flush=True)
""")


def test_kill9_loses_nothing_acknowledged(tmp_path: Path):
    d = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d)], stdout=subprocess.PIPE, env=env, text=True)
    acked = 0
    try:
        deadline = time.monotonic() + 60
        while acked < 150 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "child ended early"
            acked = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL and acked >= 150
    with SqliteStore.open(d) as s:
        before = s.load_ledger()
        client = next(a for a in before.accounts if a.key == "client:k")
        # Each acknowledged iteration committed 7 and left 10 reserved; the kill may
        # have landed one iteration further.
        assert client.committed_tokens % 7 == 0 and client.committed_tokens >= 7 * acked
        done = client.committed_tokens // 7
        assert done in (acked, acked + 1)
        recovered = s.recover()
        assert len(recovered) in (done, done - 1, done + 1) and len(recovered) >= acked
        assert all(r.tokens == 10 for r in recovered)
        after = s.load_ledger()
        client2 = next(a for a in after.accounts if a.key == "client:k")
        assert client2.committed_tokens == 7 * done + 10 * len(recovered)
        assert after.reservations == () and client2.reserved_tokens == 0
        ledger = BudgetLedger()
        ledger.restore(after)
        assert ledger.snapshot() == after
        for i in range(1, acked + 1):
            rec = s.find_idempotent("k", f"key{i}")
            assert rec is not None and rec.state == "closed"
            assert [e.frame for e in s.events("k", "sess", f"s{i}")] == [f"final-s{i}".encode()]
        interrupted = s.interrupt_open_streams("router restarted", now_ms=10**7)
        assert {r.stream_id for r in interrupted} >= {f"t{i}" for i in range(1, acked + 1)}


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
