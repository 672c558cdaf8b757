"""The hash-chained audit log (spec §11 Audit; issue 7 item 6) on a real SQLite
store: every edit, deletion, reordering and truncation is caught and named."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from atp_router.security.audit import (
    AuditError,
    AuditKind,
    AuditLog,
    AuditOptions,
    SyslogSink,
    audit_main,
    chain_record,
    load_audit_key,
    make_checkpoint,
    parse_anchor,
    read_anchor,
    read_head_file,
    record_hash,
    scrub_detail,
    verify,
)
from atp_router.store import SqliteStore
from tests.helpers import durable_db
from atp_router.store.audit_records import GENESIS, AuditCheckpoint

ROOT = Path(__file__).resolve().parents[2]
KINDS = list(AuditKind)


def fill(state: Path, n: int = 20, *, every: int = 8) -> None:
    """``n`` records of every kind, checkpointed every ``every`` and at close."""
    with SqliteStore.open(state) as store:
        log = AuditLog.open(store, state, env={}, every=every, interval_ms=60_000)
        for i in range(1, n + 1):
            log.record(KINDS[i % len(KINDS)], f"user{i % 3}", "alice" if i % 2 else None,
                       {"i": i, "what": f"event {i}"}, now_ms=1_700_000_000_000 + i)
        log.close()


def check(state: Path) -> tuple[int, str]:
    """Run the CLI's verify in-process: (exit code, its line)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = audit_main(["verify", "--state-dir", str(state)])
    return code, out.getvalue().strip()


def db(state: Path) -> sqlite3.Connection:
    return sqlite3.connect(durable_db(state / "state.db"), isolation_level=None)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    d = tmp_path / "state"
    fill(d)
    return d


def test_intact_log_verifies(state: Path):
    code, line = check(state)
    with SqliteStore.open(state) as s:
        head = s.audit_head()
        assert s.audit_checkpoint().seq == 20
    assert (code, line) == (0, f"audit: OK, 20 records, head {head.hash[:12]}")
    assert read_head_file(state / "audit.head").seq == 20
    assert (state / "audit.head").stat().st_mode & 0o777 == 0o600
    assert not (state / "audit.head.tmp").exists()


def test_edited_record_is_named(state: Path):
    with db(state) as c:
        c.execute("UPDATE audit SET detail = ? WHERE seq = 7", (json.dumps({"i": 7, "what": "nothing"}),))
    assert check(state) == (1, "audit: BROKEN at record 7: hash does not match the record's content (edited)")


def test_edited_and_rehashed_tail_is_caught_by_the_checkpoint(state: Path):
    """An attacker who recomputes every hash after an edit still cannot MAC."""
    with SqliteStore.open(state) as s:
        recs = s.audit_records()
    prev = recs[4].hash
    with db(state) as c:
        for r in recs[5:]:
            detail = {"i": 0} if r.seq == 6 else r.detail
            h = record_hash(r.seq, r.ts_ms, r.kind, r.actor, r.tenant, detail, prev)
            c.execute("UPDATE audit SET detail = ?, prev = ?, hash = ? WHERE seq = ?",
                      (json.dumps(detail), prev, h, r.seq))
            prev = h
    code, line = check(state)
    assert code == 1 and line == ("audit: BROKEN at record 8: record 8 differs from its MACed checkpoint "
                                   "(records 1-8 rewritten)")


def test_deleted_record_is_named(state: Path):
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq = 5")
    assert check(state) == (1, "audit: BROKEN at record 5: record 5 is missing (record 6 follows record 4)")


def test_deleted_and_renumbered_records_break_the_chain(state: Path):
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq = 5")
        c.execute("UPDATE audit SET seq = seq - 1 WHERE seq > 5")
    code, line = check(state)
    assert code == 1 and line.startswith("audit: BROKEN at record 5: prev does not match the hash of record 4")


def test_swapped_records_are_named(state: Path):
    with db(state) as c:
        rows = {r[0]: r[1:] for r in c.execute("SELECT seq, ts_ms, kind, actor, tenant, detail, prev, hash "
                                                 "FROM audit WHERE seq IN (11, 12)")}
        for seq, other in ((11, 12), (12, 11)):
            c.execute("UPDATE audit SET ts_ms = ?, kind = ?, actor = ?, tenant = ?, detail = ?, prev = ?, hash = ? "
                      "WHERE seq = ?", (*rows[other], seq))
    code, line = check(state)
    assert code == 1 and line.startswith("audit: BROKEN at record 11: prev does not match the hash of record 10")
    # Records handed over out of order are named too.
    with SqliteStore.open(state) as s:
        recs = s.audit_records()
    recs[2], recs[3] = recs[3], recs[2]
    rep = verify(recs, [], b"k" * 32)
    assert (rep.ok, rep.first_bad_seq, rep.reason) == (
        False, 3, "out of order: record 4 found where record 3 belongs")


def test_truncated_tail_is_caught(state: Path):
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq > 15")
    assert check(state) == (
        1, "audit: BROKEN at record 16: truncated: a checkpoint covers record 20 but the log ends at record 15")


def test_truncated_tail_and_checkpoint_row_caught_through_head_file(state: Path):
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq > 15")
        c.execute("DELETE FROM audit_checkpoint")
    assert check(state) == (
        1, "audit: BROKEN at record 16: truncated: a checkpoint covers record 20 but the log ends at record 15")
    with SqliteStore.open(state) as s, pytest.raises(AuditError, match="truncated"):
        AuditLog.open(s, state, env={})  # the writer refuses to extend (and overwrite the evidence)


def test_whole_table_emptied_is_caught(state: Path):
    with db(state) as c:
        c.execute("DELETE FROM audit")
        c.execute("DELETE FROM audit_checkpoint")
    assert check(state) == (
        1, "audit: BROKEN at record 1: truncated: a checkpoint covers record 20 but the log ends at record 0")


def test_deleted_head_file_with_checkpoint_in_table(state: Path):
    (state / "audit.head").unlink()
    code, line = check(state)
    assert code == 1 and "audit.head is missing" in line


def test_forged_checkpoint_and_wrong_key(state: Path):
    with SqliteStore.open(state) as s:
        recs = s.audit_records()
        cp = s.audit_checkpoint()
    forged = AuditCheckpoint(seq=cp.seq, hash=cp.hash, mac="0" * 64)
    rep = verify(recs, [forged], load_audit_key(state, {}))
    assert (rep.ok, rep.first_bad_seq) == (False, 20) and "bad MAC" in rep.reason
    rep = verify(recs, [cp], b"another key of enough length")
    assert not rep.ok and "bad MAC" in rep.reason
    rep = verify(recs, [cp], load_audit_key(state, {}))
    assert (rep.ok, rep.records, rep.first_bad_seq, rep.head) == (True, 20, None, recs[-1].hash)


def test_cli_as_a_real_process(state: Path):
    cmd = [sys.executable, "-c", "import sys; from atp_router.security.audit import audit_main; sys.exit(audit_main(sys.argv[1:]))"]
    env = {k: v for k, v in os.environ.items() if k != "ATP_AUDIT_KEY"} | {"PYTHONPATH": str(ROOT)}
    ok = subprocess.run([*cmd, "verify", "--state-dir", str(state)], capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("audit: OK, 20 records, head ")
    shown = subprocess.run([*cmd, "show", "--state-dir", str(state), "--since", "19", "--json"],
                           capture_output=True, text=True, env=env, check=False)
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert shown.returncode == 0 and [r["seq"] for r in rows] == [19, 20]
    assert rows[0]["detail"] == {"i": 19, "what": "event 19"} and rows[0]["tenant"] == "alice"
    text = subprocess.run([*cmd, "show", "--state-dir", str(state)], capture_output=True, text=True, env=env, check=False)
    lines = text.stdout.splitlines()
    assert len(lines) == 20 and "actor=user1" in lines[0] and "tenant=alice" in lines[0]
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq = 3")
    bad = subprocess.run([*cmd, "verify", "--state-dir", str(state)], capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 1 and bad.stdout.startswith("audit: BROKEN at record 3: ")
    none = subprocess.run([*cmd, "verify", "--state-dir", str(state.parent / "nowhere")],
                          capture_output=True, text=True, env=env, check=False)
    assert none.returncode == 2 and "no state" in none.stderr
    assert not (state.parent / "nowhere").exists()


def test_writer_resumes_the_chain_and_checkpoints_on_cadence(tmp_path: Path):
    d = tmp_path / "state"
    with SqliteStore.open(d) as s:
        log = AuditLog.open(s, d, env={}, every=3, interval_ms=1_000)
        assert log.head == (0, GENESIS) and log.checkpoint() is None and log.next_checkpoint_ms() is None
        log.record("session_open", "alice-key", "alice", {}, now_ms=10_000)
        assert s.audit_checkpoint() is None and log.next_checkpoint_ms() == 11_000
        assert log.tick(10_999) is None
        assert log.tick(11_000).seq == 1  # T elapsed
        for t in (12_000, 12_001, 12_002):
            log.record("window_change", "router", "alice", {"cwnd": 4}, now_ms=t)
        assert s.audit_checkpoint().seq == 4  # N reached
        log.record("error", "router", "alice", {"code": "ETIMEOUT"}, now_ms=12_003)
        assert s.audit_checkpoint().seq == 4
    # A crash: the unsigned tail (record 5) is kept and signed by the next writer.
    with SqliteStore.open(d) as s:
        log = AuditLog.open(s, d, env={}, every=3, interval_ms=1_000)
        assert log.head[0] == 5 and log.next_checkpoint_ms() == 13_003
        rec = log.record("session_close", "alice-key", "alice", {"reason": "FIN"}, now_ms=20_000)
        assert rec.seq == 6 and rec.prev == s.audit_records()[4].hash
        assert s.audit_checkpoint().seq == 6  # the tail was older than interval_ms
        log.close()
        rep = verify(s.audit_records(), [s.audit_checkpoint(), read_head_file(d / "audit.head")],
                     load_audit_key(d, {}))
        assert rep.ok and rep.records == 6
        with pytest.raises(ValueError):
            log.record("made_up_kind", "x", None, {}, now_ms=1)
        assert log.head[0] == 6


@pytest.mark.parametrize("state_sync", ["normal", "full"])
def test_the_head_file_is_as_durable_as_the_store(tmp_path: Path, monkeypatch, state_sync: str):
    """audit.head is fsynced (file and directory) only when the store survives an OS
    crash too (--state-sync full): under the default, an fsynced head could outlive
    the store's last commits in an OS crash and make the log look cut. Either way
    the head is replaced atomically and verifies."""
    from atp_router.deploy.single import open_state
    from atp_router.runtime.config import RouterConfig

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    d = tmp_path / "state"
    parts = open_state(RouterConfig(policies=tmp_path, state_dir=d, state_sync=state_sync))
    try:
        log = parts.audit_log
        assert log.fsync_head is (state_sync == "full")
        log.record("session_open", "alice-key", "alice", {}, now_ms=10_000)
        synced.clear()
        cp = log.checkpoint()
        assert read_head_file(d / "audit.head") == cp
        assert len(synced) == (2 if state_sync == "full" else 0), synced  # the file, then its directory
    finally:
        parts.close()
    assert not list(d.glob("audit.head.*.tmp"))


def test_chain_record_is_pure_and_canonical():
    a = chain_record(0, GENESIS, kind="esec", actor="bob", tenant="bob", detail={"b": 1, "a": [1, 2]}, now_ms=5)
    b = chain_record(0, GENESIS, kind="esec", actor="bob", tenant="bob", detail={"a": (1, 2), "b": 1}, now_ms=5)
    assert a == b and a.seq == 1 and a.prev == GENESIS and len(a.hash) == 64
    assert a.hash == record_hash(1, 5, "esec", "bob", "bob", {"a": [1, 2], "b": 1}, GENESIS)
    c = chain_record(a.seq, a.hash, kind="refusal", actor="router", tenant=None, detail=None, now_ms=6)
    assert verify([a, c], [make_checkpoint(2, c.hash, b"k" * 16)], b"k" * 16).ok


def test_detail_never_carries_secrets():
    detail = {
        "token": "sk-live-123", "api_key": "AKIA...", "Authorization": "Bearer x", "hmacKey": "k",
        "client_secret": "s", "db_password": "p", "accessToken": "t", "nested": {"x": 1, "private_key": "-----"},
        "list": [{"password": "p", "ok": 1}],
        "idempotency_key": "idem-1", "api_key_env": "OPENAI_API_KEY", "tokens": 500, "max_tokens": 10, "kid": "k1",
        "long": "x" * 2_000, "blob": b"\x00" * 10, "many": list(range(100)), "nan": float("nan"),
    }
    out = scrub_detail(detail)
    flat = json.dumps(out)
    for secret in ("sk-live-123", "AKIA", "Bearer x", "-----"):
        assert secret not in flat
    assert out["_dropped"] == sorted(["Authorization", "accessToken", "api_key", "client_secret", "db_password",
                                      "hmacKey", "token"])
    assert out["nested"] == {"x": 1, "_dropped": ["private_key"]}
    assert out["list"] == [{"ok": 1, "_dropped": ["password"]}]
    assert (out["idempotency_key"], out["api_key_env"], out["tokens"], out["max_tokens"], out["kid"]) == (
        "idem-1", "OPENAI_API_KEY", 500, 10, "k1")
    assert out["long"].startswith("x" * 512) and out["long"].endswith("[+1488 chars]")
    assert out["blob"] == "<10 bytes>" and len(out["many"]) == 65 and out["nan"] == "nan"
    deep: dict = {}
    cur = deep
    for _ in range(10):
        cur["d"] = {}
        cur = cur["d"]
    assert "<nested too deep>" in json.dumps(scrub_detail(deep))


def test_audit_key_sources(tmp_path: Path):
    d = tmp_path / "s"
    d.mkdir()
    with pytest.raises(AuditError, match="no audit key"):
        load_audit_key(d, {}, create=False)
    key = load_audit_key(d, {})
    assert (d / "audit.key").stat().st_mode & 0o777 == 0o600 and len(key) == 64
    assert load_audit_key(d, {}) == key
    assert load_audit_key(d, {"ATP_AUDIT_KEY": "an operator key, long"}) == b"an operator key, long"
    with pytest.raises(AuditError, match="at least 16"):
        load_audit_key(d, {"ATP_AUDIT_KEY": "short"})
    os.chmod(d / "audit.key", 0o644)
    with pytest.raises(AuditError, match="readable by others"):
        load_audit_key(d, {})


# ------------------------------------------------ issue 19 item 7: no silent rewrite
def _rehash_without(state: Path, gone: int) -> None:
    """The attacker's rewrite: record ``gone`` deleted, the later ones renumbered
    and re-hashed into a consistent chain (without the key: no new MACs)."""
    with SqliteStore.open(state) as s:
        recs = s.audit_records()
    prev = recs[gone - 2].hash if gone > 1 else GENESIS
    with db(state) as c:
        c.execute("DELETE FROM audit WHERE seq >= ?", (gone,))
        for r in recs[gone:]:
            seq = r.seq - 1
            h = record_hash(seq, r.ts_ms, r.kind, r.actor, r.tenant, r.detail, prev)
            c.execute("INSERT INTO audit (seq, ts_ms, kind, actor, tenant, detail, prev, hash) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (seq, r.ts_ms, r.kind, r.actor, r.tenant, json.dumps(r.detail), prev, h))
            prev = h


def test_records_without_a_checkpoint_beyond_a_crash_tail_are_refused(tmp_path: Path, monkeypatch):
    """Delete a record, re-hash, drop every checkpoint row and audit.head: the
    chain is consistent, but 119 records no checkpoint covers are more than a
    crash leaves (100): BROKEN, and the writer refuses to re-sign it."""
    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    d = tmp_path / "state"
    fill(d, 120, every=100)
    _rehash_without(d, 5)
    with db(d) as c:
        c.execute("DELETE FROM audit_checkpoint")
    (d / "audit.head").unlink()
    assert check(d) == (1, ("audit: BROKEN at record 1: records 1-119 (119) are not covered by any checkpoint; a "
                           "crash leaves at most 116: checkpoints were removed or the log rewritten"))
    with SqliteStore.open(d) as s, pytest.raises(AuditError, match="records 1-119 are not covered"):
        AuditLog.open(s, d, env={})


def test_a_crash_tail_verifies_with_a_note(tmp_path: Path, monkeypatch):
    """A writer killed between checkpoints (no close): its unsigned tail is
    accepted and named; the next writer signs it."""
    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    d = tmp_path / "state"
    with SqliteStore.open(d) as store:
        log = AuditLog.open(store, d, env={}, every=100, interval_ms=60_000)
        for i in range(1, 131):
            log.record("admin", "ops", None, {"i": i}, now_ms=1_000 + i)
        # no close(): the process died
    code, line = check(d)
    assert code == 0 and line.endswith("; 30 records after the last checkpoint (record 100): the tail a crash leaves "
                                       "unsigned (at most 116); removed or rewritten records there cannot be told apart")
    rep = verify(SqliteStore.open(d).audit_records(), [], load_audit_key(d, {}), max_unsigned=100)
    assert (rep.ok, rep.first_bad_seq, rep.signed) == (False, 1, 0)  # the same log with its checkpoints removed
    with SqliteStore.open(d) as store:
        log = AuditLog.open(store, d, env={}, every=100, interval_ms=60_000)
        log.record("admin", "ops", None, {"i": 131}, now_ms=100_000)  # the tail is older than interval_ms
        assert store.audit_checkpoint().seq == 131
    assert check(d)[1].startswith("audit: OK, 131 records, head ") and "after the last" not in check(d)[1]


def test_shared_writers_keep_the_unsigned_tail_within_every(tmp_path: Path):
    """Three writers on one chain (--workers): whatever the interleaving, the
    records after the newest checkpoint never exceed ``every`` (before, each
    writer counted only its own records: up to 3 × every)."""
    key = b"k" * 32
    stores = [SqliteStore.open(tmp_path, multiprocess=True) for _ in range(3)]
    logs = [AuditLog(s, key, shared=True, every=10, interval_ms=10**9) for s in stores]
    worst = 0
    for i in range(300):
        logs[(i * 7 // 3) % 3].record("admin", "w", None, {"i": i}, 1_000 + i)
        cp = stores[0].audit_checkpoint()
        worst = max(worst, stores[0].audit_head().seq - (cp.seq if cp else 0))
    assert worst <= 10
    rep = verify(stores[0].audit_records(), stores[0].audit_checkpoints(), key, max_unsigned=10)
    assert rep.ok and rep.records == 300
    for s in stores:
        s.close()


def test_anchor_file_catches_what_the_state_dir_cannot(tmp_path: Path, monkeypatch):
    """Checkpoints appended to a file outside the state directory: a rollback to
    an older checkpoint (later records, rows and audit.head replaced) passes
    without it and is caught with it; the writer refuses to extend it."""
    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    d, anchor = tmp_path / "state", tmp_path / "elsewhere" / "audit.anchor"
    anchor.parent.mkdir()
    with SqliteStore.open(d) as store:
        log = AuditLog.open(store, d, env={}, options=AuditOptions(anchor=anchor, every=10, interval_ms=60_000))
        for i in range(1, 36):
            log.record("admin", "ops", None, {"i": i}, now_ms=1_000 + i)
        log.close()
    assert anchor.stat().st_mode & 0o777 == 0o600
    cps, torn = read_anchor(anchor)
    assert [c.seq for c in cps] == [10, 20, 30, 35] and not torn
    with db(d) as c:
        c.execute("DELETE FROM audit WHERE seq > 20")
        c.execute("DELETE FROM audit_checkpoint WHERE seq > 20")
        old = c.execute("SELECT seq, hash, mac FROM audit_checkpoint WHERE seq = 20").fetchone()
    (d / "audit.head").write_text(json.dumps({"seq": old[0], "hash": old[1], "mac": old[2]}))
    assert check(d) == (0, f"audit: OK, 20 records, head {old[1][:12]}")  # the limit without an anchor
    code, line = check_with(d, "--anchor", str(anchor))
    assert (code, line) == (1, ("audit: BROKEN at record 21: truncated: an anchored checkpoint covers record 35 but "
                               "the log ends at record 20"))
    with SqliteStore.open(d) as s, pytest.raises(AuditError, match="truncated: checkpoint at record 35"):
        AuditLog.open(s, d, env={}, options=AuditOptions(anchor=anchor))


def check_with(state: Path, *args: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = audit_main(["verify", "--state-dir", str(state), *args])
    return code, out.getvalue().strip()


def test_anchor_parsing_torn_lines_and_syslog_prefixes():
    cp = make_checkpoint(7, "a" * 64, b"k" * 32)
    line = json.dumps({"seq": 7, "hash": "a" * 64, "mac": cp.mac})
    data = f"{line}\n\n<86>atp-router[12]: atp-audit checkpoint {line}\x00\n{line[:30]}".encode()
    assert parse_anchor(data) == ([cp, cp], True)
    assert parse_anchor(f"<86>x: {line}\x00<86>x: {line}\x00".encode()) == ([cp, cp], False)  # syslog over TCP
    with pytest.raises(AuditError, match="line 2 is not an audit checkpoint"):
        parse_anchor(f"{line}\nnot json\n{line}\n".encode(), "a")
    with pytest.raises(AuditError, match="line 1 is not an audit checkpoint"):
        parse_anchor(b'{"seq": "7", "hash": "x", "mac": "y"}\n')


def test_sinks_that_cannot_be_set_up_are_refused(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    d = tmp_path / "state"
    with SqliteStore.open(d) as store:
        for opts, msg in (
            (AuditOptions(anchor=tmp_path / "no" / "such" / "dir" / "a"), "cannot be opened for appending"),
            (AuditOptions(anchor=tmp_path), "cannot be opened for appending"),  # a directory
            (AuditOptions(anchor=d / "anchor"), "inside the state directory"),
            (AuditOptions(syslog=str(tmp_path / "no.sock")), "cannot be reached"),
            (AuditOptions(syslog="udp://nohost.invalid:514"), "cannot be reached"),
            (AuditOptions(syslog="syslog.example:514"), "give a Unix socket path"),
            (AuditOptions(key_file=tmp_path / "missing.key"), "does not exist"),
        ):
            with pytest.raises(AuditError, match=msg):
                AuditLog.open(store, d, env={}, options=opts)
        with pytest.raises(AuditError, match="both ATP_AUDIT_KEY and an audit key file"):
            AuditLog.open(store, d, env={"ATP_AUDIT_KEY": "x" * 32}, options=AuditOptions(key_file=d / "audit.key"))


def test_syslog_sink_sends_each_checkpoint_over_a_unix_socket(tmp_path: Path, monkeypatch):
    """A real datagram socket standing in for /dev/log: each checkpoint arrives
    as ``<PRI>atp-router[pid]: atp-audit checkpoint {json}`` (facility authpriv,
    level info) and the received lines are an anchor verify accepts."""
    import socket

    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    path = tmp_path / "log.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(5)
    d = tmp_path / "state"
    with SqliteStore.open(d) as store:
        log = AuditLog.open(store, d, env={}, options=AuditOptions(syslog=str(path), every=5, interval_ms=60_000))
        for i in range(1, 13):
            log.record("admin", "ops", None, {"i": i}, now_ms=1_000 + i)
        log.close()
    got = [server.recv(4096) for _ in range(3)]
    server.close()
    pri = 10 * 8 + 6  # authpriv.info
    assert all(g.startswith(f"<{pri}>atp-router[{os.getpid()}]: atp-audit checkpoint {{".encode()) for g in got)
    cps, _ = parse_anchor(b"\n".join(got) + b"\n")
    assert [c.seq for c in cps] == [5, 10, 12]
    assert check_with(d, "--anchor", str(_write(tmp_path / "syslog.txt", b"\n".join(got) + b"\n")))[0] == 0


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_syslog_sink_over_tcp(tmp_path: Path):
    """A TCP syslog listener here receives NUL-terminated messages that parse as an anchor."""
    import socket

    cp = make_checkpoint(3, "b" * 64, b"k" * 32)
    with pytest.raises(AuditError, match="cannot be reached"):
        SyslogSink(f"tcp://127.0.0.1:{_closed_port()}")
    server = socket.create_server(("127.0.0.1", 0))
    sink = SyslogSink(f"tcp://127.0.0.1:{server.getsockname()[1]}")
    conn, _ = server.accept()
    sink.append(cp)
    sink.append(cp)
    sink.close()
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    conn.close()
    server.close()
    assert parse_anchor(data) == ([cp, cp], False)


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_key_outside_the_state_dir_and_the_dev_warning(tmp_path: Path, monkeypatch, caplog):
    """The production key lives in a file outside the state directory (made by
    ``audit keygen``, never replaced); the state-dir key is warned about once;
    a key put in the state directory later signs nothing the verifier takes."""
    import atp_router.security.audit as audit_mod

    monkeypatch.delenv("ATP_AUDIT_KEY", raising=False)
    monkeypatch.setattr(audit_mod, "_dev_key_warned", False)
    key_file = tmp_path / "secrets" / "audit.key"
    key_file.parent.mkdir()
    assert audit_main(["keygen", str(key_file)]) == 0
    assert key_file.stat().st_mode & 0o777 == 0o600 and audit_main(["keygen", str(key_file)]) == 2  # never replaced
    d = tmp_path / "state"
    with caplog.at_level("WARNING", "atp_router.security.audit"), SqliteStore.open(d) as store:
        log = AuditLog.open(store, d, env={}, options=AuditOptions(key_file=key_file))
        for i in range(3):
            log.record("admin", "ops", None, {"i": i}, now_ms=1 + i)
        log.close()
        assert not (d / "audit.key").exists() and not caplog.records
        for _ in range(2):  # the development setting: a key made in the state directory
            with pytest.raises(AuditError, match="bad MAC"):
                AuditLog.open(store, d, env={})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "the development setting" in warned[0] and str(d / "audit.key") in warned[0]
    assert check_with(d, "--key-file", str(key_file))[0] == 0
    assert check(d) == (1, ("audit: BROKEN at record 3: checkpoint at record 3 has a bad MAC (forged, or another "
                           "audit key)"))


def test_a_tcp_syslog_sink_reconnects_after_the_server_dropped_it():
    """A syslog server that closes the connection (a restart) gets the next
    checkpoints on a new one; the standard library's handler never reconnects,
    so every later checkpoint went unanchored (review of issue 19 item 7)."""
    import socket
    import threading
    import time

    from atp_router.security.audit import SyslogSink, make_checkpoint

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    got: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            got.append(conn.recv(65536))
            conn.close()  # one message a connection: the server "restarts"

    threading.Thread(target=serve, daemon=True).start()
    sink = SyslogSink(f"tcp://127.0.0.1:{srv.getsockname()[1]}")
    try:
        for i in range(1, 5):
            try:
                sink.append(make_checkpoint(i, "ab" * 32, b"k" * 32))
            except Exception as e:  # noqa: BLE001 - the assertion below names it
                raise AssertionError(f"checkpoint {i}: {e}") from None
            time.sleep(0.1)
    finally:
        sink.close()
        srv.close()
    assert len(got) >= 2 and all(b"atp-audit checkpoint" in m for m in got), got
