"""The embedded store under faults (issue 22 item 5), on real ``atp-router`` processes.

* **A full disk.** The state directory is on a small tmpfs of its own (``mount -t
  tmpfs -o size=…``: the test runs as root here; elsewhere it skips, saying so) that
  a filler file then fills to the last byte. New streams are refused with HTTP 503,
  ``Retry-After`` and a reason naming the file; a stream whose call was in flight
  finishes (its events reach the client, no hang); once the filler is removed the
  router opens streams again by itself; and every call the upstream served is in
  the ledger (the tenant's committed tokens = 1,000 × the upstream's calls, no
  reservation left), also after a restart.
* **Start-up refusals**, each one line (``atp-router: …``) naming the file, exit
  status 2, no traceback: a corrupt page in the event table (``PRAGMA
  quick_check``; the line gives the ``.recover`` command), ``state.db`` truncated
  to 0 bytes with ``audit.head`` gone (the directory's ``state.marker`` says it
  held state; deleting the marker is the operator's way to accept a new ledger),
  a read-only state directory (a tmpfs remounted read-only: root ignores file
  modes), and a 0-byte key file beside the database.

The upstream is :class:`~tests.replay_server.BillingModel` (1,000 tokens a call,
calls held in flight on demand).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import atp
import httpx
import pytest
import trio

from atp_router.store.redo import COMMIT_EVERY_S
from tests import helpers
from tests.replay_server import BillingModel, serve

TOKEN = "tok-bob-0123456789"
TASK = {"task_type": "summarize"}
CONTENT = {"text": "summarise this"}


def _rib(model_url: str) -> str:
    return (
        "models:\n"
        f"  m: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{model_url}', model: m, max_out_tokens: 64}}\n"
        "agents:\n"
        "  summarizer: {layer: L2, p95_ms: 500, model: m, timeout_ms: 60000}\n"
        "policies:\n"
        "  - {name: summarize, match: {task_type: summarize}, fanout: [summarizer]}\n"
        "clients:\n"
        "  bob: {budget: {tokens: 1000000}}\n"
    )


def _args(policies: Path, state: Path) -> list[str | Path]:
    return ["--policies", policies, "--state-dir", state, "--http-port", "0", "--ws-port", "0", "--no-watch"]


class RouterProcess(helpers.RouterProcess):
    def __init__(self, policies: Path, state: Path) -> None:
        super().__init__(*_args(policies, state), env={"ATP_ROUTER_TOKENS": f"bob:{TOKEN}"})


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (unmounted after); skips the test,
    with the reason, where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full disk needs a small filesystem of its own: mount -t tmpfs failed ({r.stderr.strip()}); "
                    "run as root (or with CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(fs: Path) -> Path:
    """Fill the filesystem of ``fs`` to the last byte with a file; returns it."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        for block in (1 << 16, 512, 1):  # down to the last byte
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * block)
    finally:
        os.close(fd)
    return filler


def _ledger(state: Path) -> tuple[int, int]:
    """``(bob's committed tokens, open reservations)`` as the state directory holds them."""
    db = sqlite3.connect(f"file:{helpers.durable_db(state / 'state.db')}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT committed_tokens FROM account WHERE key = 'client:bob'").fetchone()
        committed = 0 if row is None else row[0]  # no account: bob never opened a stream on this ledger
        (held,) = db.execute("SELECT count(*) FROM reservation").fetchone()
    finally:
        db.close()
    return committed, held


async def _run_one(client: atp.Client) -> list[str]:
    _, st = await client.open_stream(task=TASK, content=CONTENT)
    with trio.fail_after(30):
        return [ev.type async for ev in client.events(st.stream_id)]


async def _open(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(url + "/v1/streams", json={"task": TASK, "content": CONTENT},
                            headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.fixture
def router_procs() -> Iterator[list[RouterProcess]]:
    procs: list[RouterProcess] = []
    yield procs
    for p in procs:
        p.stop()


async def test_a_full_disk_refuses_new_streams_keeps_spend_and_recovers_by_itself(nursery, tmp_path, router_procs):
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_rib(model.url))
    with tmpfs(tmp_path / "fs", "16m") as fs:
        state = fs / "state"
        router = RouterProcess(policies, state)
        router_procs.append(router)
        url = await router.wait_listening()
        async with atp.Client(url, TOKEN) as bob:
            for _ in range(2):
                assert (await _run_one(bob))[-2:] == ["FINAL", "FIN"]
            # A call in flight when the disk fills.
            model.hold = trio.Event()
            _, running = await bob.open_stream(task=TASK, content=CONTENT)
            with trio.fail_after(20):
                while model.waiting == 0:
                    await trio.sleep(0.05)
            filler = _fill(fs)
            # A single router's writes go to its redo log and are committed to SQLite at most
            # COMMIT_EVERY_S apart (atp_router.store.redo): the next write after that commits
            # first, finds no room and is refused, as every write from then on.
            await trio.sleep(COMMIT_EVERY_S + 0.2)

            # New streams: 503 + Retry-After, the reason naming the file; no call is made.
            for _ in range(3):
                r = await _open(url)
                assert r.status_code == 503, r.text
                assert int(r.headers["Retry-After"]) >= 1
                reason = r.json()["error"]["reason"]
                assert reason.startswith(f"state store full: {state / 'state.db'}: no space left on device"), reason
            assert len(model.requests) == 3

            # The running stream finishes: its events reach the client while their writes wait.
            model.hold.set()
            with trio.fail_after(30):
                events = [ev async for ev in bob.events(running.stream_id)]
            assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"], [ev.type for ev in events]

            # Space comes back: the router opens streams again by itself.
            filler.unlink()
            with trio.fail_after(30):
                while (r := await _open(url)).status_code == 503:
                    await trio.sleep(0.2)
            assert r.status_code == 201, r.text
            with trio.fail_after(30):
                after = [ev.type async for ev in bob.events(r.json()["stream_id"])]
            assert after[-2:] == ["FINAL", "FIN"]
            assert (await _run_one(bob))[-2:] == ["FINAL", "FIN"]
        calls = len(model.requests)
        assert calls == 5
        assert router.stop() == 0
        out = "".join(router.lines)
        assert "Traceback" not in out, out[-4000:]
        # Every call the upstream served is in the ledger, nothing held.
        assert _ledger(state) == (1_000 * calls, 0)

        # And it stays there across a restart.
        again = RouterProcess(policies, state)
        router_procs.append(again)
        url = await again.wait_listening()
        async with atp.Client(url, TOKEN) as bob:
            assert (await _run_one(bob))[-2:] == ["FINAL", "FIN"]
        assert again.stop() == 0
        assert _ledger(state) == (1_000 * (calls + 1), 0)


# ------------------------------------------------------------------ start-up refusals
async def _with_state(nursery, tmp_path: Path, state: Path, streams: int = 3) -> Path:
    """A state directory that has held state: a router ran ``streams`` streams on it
    and stopped. Returns the RIB's path."""
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_rib(model.url))
    router = RouterProcess(policies, state)
    try:
        url = await router.wait_listening()
        async with atp.Client(url, TOKEN) as bob:
            for _ in range(streams):
                assert (await _run_one(bob))[-2:] == ["FINAL", "FIN"]
    finally:
        assert router.stop() == 0
    assert _ledger(state) == (1_000 * streams, 0)
    return policies


def _corrupt_event_root(db_path: Path) -> None:
    """Overwrite the event table's root page past its header byte with garbage."""
    db = sqlite3.connect(db_path)
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'event'").fetchone()
    (page_size,) = db.execute("PRAGMA page_size").fetchone()
    db.close()
    with open(db_path, "r+b") as f:
        f.seek((root - 1) * page_size + 8)
        f.write(bytes(range(256)) * ((page_size - 8) // 256))


def _remount_read_only(fs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)


def _refused(policies: Path, state: Path) -> str:
    """Start ``atp-router`` on ``state``: it must refuse (exit status 2) with one
    line ``atp-router: …`` and no traceback; returns that line. A router that
    starts listening instead fails the test at once."""
    proc = subprocess.Popen([*helpers.ROUTER, *map(str, _args(policies, state))], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, cwd=helpers._ROOT,
                            env={**os.environ, "ATP_ROUTER_TOKENS": f"bob:{TOKEN}"})
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for ln in proc.stdout:
            lines.append(ln)
            if "listening" in ln:
                pytest.fail("the router started on it:\n" + "".join(lines)[-4000:])
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(lines)
    assert rc == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    refusal = [ln.rstrip("\n") for ln in lines if ln.startswith("atp-router: ")]
    assert len(refusal) == 1, out[-4000:]
    return refusal[0]


async def test_a_corrupt_page_in_the_event_table_is_refused_at_start(nursery, tmp_path):
    state = tmp_path / "state"
    policies = await _with_state(nursery, tmp_path, state, streams=6)
    db_path = state / "state.db"
    assert not (state / "state.db-wal").exists() or (state / "state.db-wal").stat().st_size == 0
    _corrupt_event_root(db_path)
    line = _refused(policies, state)
    assert str(db_path) in line and "damaged" in line and "quick_check" in line, line
    assert f'sqlite3 {db_path} ".recover" | sqlite3 {state / "recovered.db"}' in line, line


async def test_a_truncated_database_in_a_directory_that_held_state_is_refused(nursery, tmp_path):
    state = tmp_path / "state"
    policies = await _with_state(nursery, tmp_path, state)
    for name in ("state.db-wal", "state.db-shm", "audit.head"):
        (state / name).unlink(missing_ok=True)
    os.truncate(state / "state.db", 0)
    line = _refused(policies, state)
    marker = state / "state.marker"
    assert str(state / "state.db") in line and "empty ledger" in line and f"delete {marker}" in line, line
    assert (state / "state.db").stat().st_size == 0  # nothing written over it
    (state / "state.db").unlink()
    assert _refused(policies, state) == line  # a missing file likewise

    # The operator's explicit choice: the marker deleted, a new ledger starts.
    marker.unlink()
    router = RouterProcess(policies, state)
    try:
        await router.wait_listening()
    finally:
        assert router.stop() == 0
    assert marker.exists() and _ledger(state) == (0, 0)


async def test_a_read_only_state_directory_is_refused_in_one_line(nursery, tmp_path):
    with tmpfs(tmp_path / "fs", "16m") as fs:
        state = fs / "state"
        policies = await _with_state(nursery, tmp_path, state, streams=1)
        _remount_read_only(fs)
        line = _refused(policies, state)
    assert str(state) in line and ("read-only" in line.lower() or "readonly" in line.lower()), line


async def test_a_zero_byte_key_file_is_refused_in_one_line(nursery, tmp_path):
    state = tmp_path / "state"
    policies = await _with_state(nursery, tmp_path, state, streams=1)
    (state / "usage.pem").write_bytes(b"")
    line = _refused(policies, state)
    assert str(state / "usage.pem") in line, line
