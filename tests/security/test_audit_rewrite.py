"""The audit chain cannot be rewritten silently (issue 19 item 7; spec §11 Audit).

A real ``atp-router`` process writes audit records (a client's forbidden
``POST /v1/policies/reload`` is an audited ESEC each), is stopped, and its
``state.db`` is then tampered with through sqlite3 as an attacker with write
access to the state directory would; the real ``atp-router audit verify``
judges the result. Two set-ups:

* **development** — the MAC key in the state directory, no anchor, the router's
  default ``--state-dir`` (``$XDG_STATE_HOME/atp-router``; ``audit verify``
  without ``--state-dir`` finds it, issue 20);
* **production** — ``--audit-key-file`` outside the state directory,
  ``--audit-anchor FILE`` and ``--audit-syslog udp://…`` to a UDP listener in
  the test (the received lines are an anchor too).

Each rewrite is caught: a deleted and re-hashed record, the same with every
checkpoint row and ``audit.head`` removed (by the anchor; without one by the
"records no checkpoint covers" rule), a truncated tail, an edited detail, a
replaced key; the router refuses to start on (and re-sign) a rewritten log and
when a configured sink cannot be opened; a ``kill -9`` between checkpoints
verifies with a note naming the unsigned tail. What an anchor is needed for is
shown too: without one, a rollback to an older checkpoint passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from atp_router.security.audit import make_checkpoint, record_hash
from atp_router.store.audit_records import GENESIS
from tests.helpers import ROUTER, RouterProcess, durable_db

ROOT = Path(__file__).resolve().parents[2]
ALICE, OPS = "tok-alice-0123456789", "tok-ops-0123456789"
TOKENS = f"alice:{ALICE},ops:{OPS}:admin+operator"
RIB = (
    "models:\n"
    "  m: {provider: openai_compat, ctx: 8k, cost: 1, base_url: 'http://127.0.0.1:9/v1', model: m, max_out_tokens: 64}\n"
    "agents:\n"
    "  summarizer: {layer: L2, p95_ms: 500, model: m, timeout_ms: 60000}\n"
    "policies:\n"
    "  - {name: summarize, match: {task_type: summarize}, fanout: [summarizer]}\n"
    "clients:\n"
    "  alice: {budget: {tokens: 2500}}\n"
)
#: ESEC records the recorded runs write: past the 100 a crash may leave unsigned.
RECORDS = 150
DEV_WARNING = "the development setting"


@dataclass
class Run:
    """A stopped router's files (copied per test) and what it printed."""

    root: Path
    state: Path
    key: Path | None = None
    anchor: Path | None = None
    syslog: Path | None = None
    output: str = ""

    def copy(self, dest: Path) -> Run:
        shutil.copytree(self.root, dest / "run", symlinks=True)
        moved = {k: (dest / "run" / getattr(self, k).relative_to(self.root)) if getattr(self, k) else None
                 for k in ("state", "key", "anchor", "syslog")}
        return Run(dest / "run", output=self.output, **moved)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATP_AUDIT_KEY", "XDG_STATE_HOME")}
    return env | extra


def _start(*args: str | Path, env: dict[str, str] | None = None) -> RouterProcess:
    """A router on the test RIB; ``env`` replaces the audit-relevant variables."""
    proc = RouterProcess("--policies", *args, "--http-port", "0", "--ws-port", "0", "--no-watch",
                         env={"ATP_ROUTER_TOKENS": TOKENS, **(env or {})})
    trio.run(proc.wait_listening)
    return proc


def _forbidden_reloads(url: str, n: int, *, fresh: bool = False) -> None:
    """``n`` audited ESECs (``fresh``: a new connection each, spread over workers by the kernel)."""
    limits = httpx.Limits(max_keepalive_connections=0) if fresh else httpx.Limits()
    with httpx.Client(base_url=url, timeout=30, limits=limits) as h:
        for _ in range(n):
            assert h.post("/v1/policies/reload", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 403


def verify(run: Run, *args: str | Path, state_flag: bool = True, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``atp-router audit verify`` as a process: (exit status, stdout + stderr)."""
    cmd = [*ROUTER, "audit", "verify", *(["--state-dir", str(run.state)] if state_flag else []), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env or _env(), check=False)
    return p.returncode, (p.stdout + p.stderr).strip()


def _prod_args(run: Run) -> list[str | Path]:
    return ["--key-file", run.key, "--anchor", run.anchor]


@pytest.fixture(scope="module")
def dev_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The development set-up: no --state-dir (XDG_STATE_HOME), key in the state dir."""
    root = tmp_path_factory.mktemp("dev")
    (root / "rib.yaml").write_text(RIB)
    xdg = root / "xdg"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ATP_AUDIT_KEY", raising=False)
        mp.setenv("XDG_STATE_HOME", str(xdg))
        proc = _start(root / "rib.yaml")
        try:
            _forbidden_reloads(proc.url, RECORDS)
        finally:
            assert proc.stop() == 0
    return Run(root, xdg / "atp-router", output="".join(proc.lines))


@pytest.fixture(scope="module")
def prod_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The production set-up: --audit-key-file, --audit-anchor and --audit-syslog
    to a UDP listener here, all outside the state directory."""
    root = tmp_path_factory.mktemp("prod")
    (root / "rib.yaml").write_text(RIB)
    run = Run(root, root / "state", key=root / "keys" / "audit.key", anchor=root / "anchor" / "audit.anchor",
              syslog=root / "syslog.txt")
    run.key.parent.mkdir()
    run.anchor.parent.mkdir()
    made = subprocess.run([*ROUTER, "audit", "keygen", str(run.key)], capture_output=True, text=True, env=_env(),
                          check=False)
    assert made.returncode == 0, made.stderr
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(0.2)
    received: list[bytes] = []
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                received.append(listener.recv(65536))
            except TimeoutError:
                continue

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ATP_AUDIT_KEY", raising=False)
        proc = _start(root / "rib.yaml", "--state-dir", run.state, "--audit-key-file", run.key,
                      "--audit-anchor", run.anchor, "--audit-syslog", f"udp://127.0.0.1:{listener.getsockname()[1]}")
        try:
            _forbidden_reloads(proc.url, RECORDS)
        finally:
            assert proc.stop() == 0
    done.set()
    thread.join()
    listener.setblocking(False)  # what the router sent before it exited and the thread had not read yet
    while True:
        try:
            received.append(listener.recv(65536))
        except BlockingIOError:
            break
    listener.close()
    run.syslog.write_bytes(b"".join(m.rstrip(b"\x00") + b"\n" for m in received))
    run.output = "".join(proc.lines)
    return run


@contextlib.contextmanager
def db(run: Run) -> Iterator[sqlite3.Connection]:
    """A connection to ``run``'s store, **closed** at the block's end (``with
    sqlite3.connect(...)`` does not close it: left to the garbage collector, its close
    removed the WAL while a later test copied the directory)."""
    c = sqlite3.connect(durable_db(run.state / "state.db"), isolation_level=None)
    try:
        yield c
    finally:
        c.close()


def delete_and_rehash(run: Run, gone: int) -> None:
    """Record ``gone`` deleted, the later ones renumbered and re-hashed into a
    consistent chain (all an attacker without the key can do)."""
    with db(run) as c:
        rows = c.execute("SELECT seq, ts_ms, kind, actor, tenant, detail, prev, hash FROM audit ORDER BY seq").fetchall()
        prev = rows[gone - 2][7] if gone > 1 else GENESIS
        c.execute("DELETE FROM audit WHERE seq >= ?", (gone,))
        for seq, ts, kind, actor, tenant, detail, _, _ in rows[gone:]:
            h = record_hash(seq - 1, ts, kind, actor, tenant, json.loads(detail), prev)
            c.execute("INSERT INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (seq - 1, ts, kind, actor, tenant, detail,
                                                                            prev, h))
            prev = h


def drop_checkpoints(run: Run) -> None:
    with db(run) as c:
        c.execute("DELETE FROM audit_checkpoint")
    (run.state / "audit.head").unlink()


def counts(run: Run) -> tuple[int, list[int]]:
    """(last record, checkpoint seqs) in the store."""
    with db(run) as c:
        last = c.execute("SELECT max(seq) FROM audit").fetchone()[0]
        return last, [r[0] for r in c.execute("SELECT seq FROM audit_checkpoint ORDER BY seq")]


# ---------------------------------------------------------------------- intact
def test_intact_runs_verify_with_the_default_state_dir_and_every_sink(dev_run: Run, prod_run: Run):
    last, cps = counts(dev_run)
    assert last >= RECORDS and cps and cps[-1] == last  # checkpointed at the clean stop
    env = _env(XDG_STATE_HOME=str(dev_run.state.parent))
    code, out = verify(dev_run, state_flag=False, env=env)  # issue 20: the router's default state dir
    assert code == 0 and out.startswith(f"audit: OK, {last} records, head "), out
    shown = subprocess.run([*ROUTER, "audit", "show", "--json", "--since", str(last)], capture_output=True, text=True,
                           env=env, cwd=ROOT, check=False)
    assert shown.returncode == 0 and json.loads(shown.stdout)["kind"] == "esec"
    assert dev_run.output.count(DEV_WARNING) == 1  # the state-dir key, said once

    last, cps = counts(prod_run)
    anchored = [json.loads(line)["seq"] for line in prod_run.anchor.read_text().splitlines()]
    assert anchored == cps and prod_run.anchor.stat().st_mode & 0o777 == 0o600
    assert not (prod_run.state / "audit.key").exists() and DEV_WARNING not in prod_run.output
    code, out = verify(prod_run, *_prod_args(prod_run))
    assert (code, out) == (0, (f"audit: OK, {last} records, head {out.split('head ')[1][:12]}, {len(cps)} anchored "
                              "checkpoints"))
    lines = prod_run.syslog.read_text().splitlines()
    assert lines and all(" atp-audit checkpoint {" in line and line.startswith("<86>atp-router[") for line in lines)
    code, out = verify(prod_run, "--key-file", prod_run.key, "--anchor", prod_run.syslog)
    assert code == 0 and f"{len(lines)} anchored checkpoints" in out, out


# -------------------------------------------------------------------- rewrites
def test_delete_rehash_and_drop_every_checkpoint_without_an_anchor(dev_run: Run, tmp_path: Path):
    """The issue's attack on the development set-up: caught because more
    records than a crash leaves have no checkpoint; the router will not
    start on the log (it would re-sign the rewrite)."""
    run = dev_run.copy(tmp_path)
    last, _ = counts(run)
    delete_and_rehash(run, 7)
    drop_checkpoints(run)
    code, out = verify(run)
    assert code == 1 and out == (f"audit: BROKEN at record 1: records 1-{last - 1} ({last - 1}) are not covered by "
                                 "any checkpoint; a crash leaves at most 116: checkpoints were removed or the log "
                                 "rewritten"), out
    proc = RouterProcess("--policies", run.root / "rib.yaml", "--state-dir", run.state, "--http-port", "0",
                         "--ws-port", "0", "--no-watch", env={"ATP_ROUTER_TOKENS": TOKENS})
    status, said = proc.proc.wait(60), proc.proc.stdout.read()
    assert status == 2 and f"atp-router: audit log: records 1-{last - 1} are not covered by any checkpoint" in said, said
    assert counts(run)[1] == []  # nothing re-signed


def test_delete_rehash_and_drop_every_checkpoint_caught_by_the_anchor(prod_run: Run, tmp_path: Path):
    run = prod_run.copy(tmp_path)
    _, cps = counts(run)
    delete_and_rehash(run, 7)
    drop_checkpoints(run)
    code, out = verify(run, *_prod_args(run))
    assert (code, out) == (1, (f"audit: BROKEN at record {cps[0]}: record {cps[0]} differs from its MACed anchored "
                              f"checkpoint (records 1-{cps[0]} rewritten)"))
    code, out = verify(run, "--key-file", run.key, "--anchor", run.syslog)  # the syslog copy catches it too
    assert code == 1 and f"record {cps[0]} differs from its MACed anchored checkpoint" in out
    code, out = verify(run, "--key-file", run.key)  # without the anchor: the unsigned-records rule
    assert code == 1 and out.startswith("audit: BROKEN at record 1: records 1-") and "not covered" in out


def test_delete_and_rehash_with_checkpoints_kept(prod_run: Run, tmp_path: Path):
    run = prod_run.copy(tmp_path)
    _, cps = counts(run)
    assert len(cps) >= 2
    delete_and_rehash(run, cps[0] - 10)
    code, out = verify(run, "--key-file", run.key)
    assert (code, out) == (1, (f"audit: BROKEN at record {cps[0]}: record {cps[0]} differs from its MACed checkpoint "
                              f"(records 1-{cps[0]} rewritten)"))


def test_truncated_tail_and_rollback_to_an_older_checkpoint(prod_run: Run, tmp_path: Path):
    """Cutting the last records is caught by the store's own checkpoint; a full
    rollback (records, rows and audit.head back to an older checkpoint) passes
    the state directory's checks — the limit without an anchor — and is
    caught by the anchor."""
    run = prod_run.copy(tmp_path)
    last, cps = counts(run)
    with db(run) as c:
        c.execute("DELETE FROM audit WHERE seq > ?", (last - 10,))
    code, out = verify(run, "--key-file", run.key)
    assert (code, out) == (1, (f"audit: BROKEN at record {last - 9}: truncated: a checkpoint covers record {last} but "
                              f"the log ends at record {last - 10}"))
    older = cps[0]
    with db(run) as c:
        c.execute("DELETE FROM audit WHERE seq > ?", (older,))
        c.execute("DELETE FROM audit_checkpoint WHERE seq > ?", (older,))
        seq, h, mac = c.execute("SELECT seq, hash, mac FROM audit_checkpoint WHERE seq = ?", (older,)).fetchone()
    (run.state / "audit.head").write_text(json.dumps({"seq": seq, "hash": h, "mac": mac}))
    code, out = verify(run, "--key-file", run.key)
    assert code == 0 and out.startswith(f"audit: OK, {older} records"), out  # indistinguishable without the anchor
    code, out = verify(run, *_prod_args(run))
    assert (code, out) == (1, (f"audit: BROKEN at record {older + 1}: truncated: an anchored checkpoint covers record "
                              f"{last} but the log ends at record {older}"))


def test_edited_detail(prod_run: Run, tmp_path: Path):
    run = prod_run.copy(tmp_path)
    with db(run) as c:
        c.execute("UPDATE audit SET detail = replace(detail, 'alice', 'mallory') WHERE seq = 42")
    code, out = verify(run, *_prod_args(run))
    assert (code, out) == (1, "audit: BROKEN at record 42: hash does not match the record's content (edited)")


def test_replaced_key(prod_run: Run, tmp_path: Path):
    """The attacker rewrites the chain and re-signs every checkpoint in the
    state directory with a key of their own, left as ``audit.key`` there: the
    verifier's key (outside) and the anchor's earlier MACs both refuse it."""
    run = prod_run.copy(tmp_path)
    delete_and_rehash(run, 7)
    theirs = b"an attacker's own audit key, long enough"
    (run.state / "audit.key").write_bytes(theirs + b"\n")
    (run.state / "audit.key").chmod(0o600)
    with db(run) as c:
        last = c.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        c.execute("DELETE FROM audit_checkpoint")
        cp = make_checkpoint(last[0], last[1], theirs)
        c.execute("INSERT INTO audit_checkpoint VALUES (?, ?, ?)", (cp.seq, cp.hash, cp.mac))
    (run.state / "audit.head").write_text(json.dumps({"seq": cp.seq, "hash": cp.hash, "mac": cp.mac}))
    assert verify(run)[0] == 0  # the development setting: a key beside the log proves nothing
    code, out = verify(run, "--key-file", run.key)
    assert (code, out) == (1, (f"audit: BROKEN at record {cp.seq}: checkpoint at record {cp.seq} has a bad MAC "
                              "(forged, or another audit key)"))
    code, out = verify(run, "--anchor", run.anchor)  # the state dir's key, but the anchor's lines were not its MACs
    assert code == 1 and "anchored checkpoint at record" in out and "bad MAC" in out, out


# ------------------------------------------------------- crash and refusals
def test_kill9_between_checkpoints_verifies_with_a_note(tmp_path: Path):
    """A crash leaves an unsigned tail: accepted and named; the next start signs it."""
    (tmp_path / "rib.yaml").write_text(RIB)
    run = Run(tmp_path, tmp_path / "state")
    env = {"ATP_AUDIT_KEY": "a production key from the environment"}
    for _ in range(5):  # the 5 s timer may sign the burst before the kill: try again
        proc = _start(tmp_path / "rib.yaml", "--state-dir", run.state, env=env)
        _forbidden_reloads(proc.url, 12)
        proc.kill9()
        last, cps = counts(run)
        if last > (cps[-1] if cps else 0):
            break
    signed = cps[-1] if cps else 0
    assert last > signed
    code, out = verify(run, env=_env(**env))
    assert code == 0 and out.endswith(f"; {last - signed} records after the last checkpoint (record {signed}): the "
                                      "tail a crash leaves unsigned (at most 116); removed or rewritten records "
                                      "there cannot be told apart"), out
    proc = _start(tmp_path / "rib.yaml", "--state-dir", run.state, env=env)
    assert proc.stop() == 0
    code, out = verify(run, env=_env(**env))
    assert code == 0 and "after the last checkpoint" not in out and DEV_WARNING not in "".join(proc.lines)


def test_the_router_refuses_to_start_without_its_configured_sinks(tmp_path: Path):
    (tmp_path / "rib.yaml").write_text(RIB)
    state = tmp_path / "state"
    for args, message in (
        (["--audit-anchor", tmp_path / "missing" / "audit.anchor"],
         "--audit-anchor {p}/missing/audit.anchor cannot be opened for appending: No such file or directory"),
        (["--audit-anchor", state / "audit.anchor"], ("--audit-anchor {p}/state/audit.anchor is inside the state "
                                                      "directory")),
        (["--audit-syslog", tmp_path / "no.sock"], "--audit-syslog {p}/no.sock cannot be reached"),
        (["--audit-key-file", tmp_path / "none.key"], "no audit key: {p}/none.key does not exist"),
    ):
        proc = RouterProcess("--policies", tmp_path / "rib.yaml", "--state-dir", state, "--http-port", "0",
                             "--ws-port", "0", "--no-watch", *args, env={"ATP_ROUTER_TOKENS": TOKENS})
        status, out = proc.proc.wait(60), proc.proc.stdout.read()
        assert status == 2 and f"atp-router: {message.format(p=tmp_path)}" in out, out


def test_workers_share_one_anchor(tmp_path: Path):
    """``--workers 2``: the supervisor and both workers append to one anchor
    (O_APPEND: whole lines); every anchored checkpoint matches the one chain and
    no more than ``every`` records were ever unsigned; a rewrite is caught."""
    (tmp_path / "rib.yaml").write_text(RIB)
    run = Run(tmp_path, tmp_path / "state", key=tmp_path / "audit.key", anchor=tmp_path / "anchor" / "audit.anchor")
    run.anchor.parent.mkdir()
    assert subprocess.run([*ROUTER, "audit", "keygen", str(run.key)], env=_env(), check=False).returncode == 0
    proc = _start(tmp_path / "rib.yaml", "--state-dir", run.state, "--workers", "2", "--audit-key-file", run.key,
                  "--audit-anchor", run.anchor, env={"ATP_AUDIT_KEY": ""})
    try:
        _forbidden_reloads(proc.url, 250, fresh=True)
    finally:
        assert proc.stop() == 0
    last, cps = counts(run)
    anchored = [json.loads(line) for line in run.anchor.read_text().splitlines()]
    assert sorted(a["seq"] for a in anchored) == cps and last >= 250
    gaps = [b - a for a, b in zip([0, *cps], cps, strict=False)]
    assert max(gaps) <= 100, gaps
    code, out = verify(run, *_prod_args(run))
    assert code == 0 and out.endswith(f", {len(cps)} anchored checkpoints"), out
    delete_and_rehash(run, 3)
    drop_checkpoints(run)
    code, out = verify(run, *_prod_args(run))
    assert code == 1 and f"record {cps[0]} differs from its MACed anchored checkpoint" in out, out
