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

from atp.security.audit import (
    GENESIS,
    AuditCheckpoint,
    AuditError,
    AuditKind,
    AuditLog,
    audit_main,
    chain_record,
    load_audit_key,
    make_checkpoint,
    read_head_file,
    record_hash,
    scrub_detail,
    verify,
)
from atp.store import SqliteStore

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
    return sqlite3.connect(state / "state.db", isolation_level=None)


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
    cmd = [sys.executable, "-c", "import sys; from atp.security.audit import audit_main; sys.exit(audit_main(sys.argv[1:]))"]
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
