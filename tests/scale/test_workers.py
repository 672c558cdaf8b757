"""``atp-router --workers 2`` (issue 10 item 4): a real supervisor process and its two
real worker processes on one state directory, driven over real sockets.

The next-hop is an OpenAI-compatible model on a loopback HTTP server in the test
(the streaming shape the OpenAI-compatible adapter reads, as in
tests/security/test_durability.py) that **over-reports**: every call bills
1,000 tokens, ten times the adapter's estimate, so concurrent calls contend for
the last of a tenant's budget. While :attr:`BillingModel.hold` is set, calls
wait in the model (a call in flight).

Checked: a tenant's budget spent by many concurrent streams on both workers is
charged exactly its limit, never more; a stream opened on one worker is
followed, scored and cancelled by requests the kernel hands to the other; a
worker killed with SIGKILL mid-call is restarted and what it left is settled
once (its reservation committed at the reserved amount, its stream reported
interrupted) while the other worker's calls go on; a reload reaches every
worker; SIGTERM stops them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
from collections import Counter
from pathlib import Path

import httpx
import pytest
import trio

from tests.helpers import ROUTER, RouterProcess
from tests.replay_server import BillingModel, serve
from tests.scale.common import (
    ALICE_TOKENS,
    BILLED,
    CONTENT,
    TASK,
    TOKENS,
    auth,
    summarize_rib,
)

ROOT = Path(__file__).resolve().parents[2]


class Supervisor(RouterProcess):
    """``atp-router --workers 2`` as a child process (tests.helpers.RouterProcess)."""

    def __init__(self, policies: Path, state: Path, workers: int = 2, *, watch: bool = False,
                 extra: tuple[str, ...] = ()):
        super().__init__("--workers", str(workers), "--policies", policies, "--state-dir", state, "--http-port", "0",
                         "--ws-port", "0", *([] if watch else ["--no-watch"]), *extra,
                         env={"ATP_ROUTER_TOKENS": f"alice:{TOKENS['alice']},bob:{TOKENS['bob']},"
                                                   f"ops:{TOKENS['ops']}:admin+operator"})
        self.state = state

    def workers(self) -> list[int]:
        """The worker pids (the supervisor's children, whichever of its threads
        started them)."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
        return sorted(pids)

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.state / 'state.db'}?mode=ro", uri=True)


async def _open(url: str, tenant: str, **body) -> tuple[dict, str]:
    """POST /v1/streams on a fresh connection: ``(response body, worker slot)``."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        r = await h.post("/v1/streams", json={"task": TASK, "content": CONTENT, **body}, headers=auth(tenant))
        assert r.status_code == 201, r.text
        return r.json(), r.headers["x-atp-worker"]


@contextlib.asynccontextmanager
async def _other_worker(url: str, avoid: str | None, tenant: str, timeout: float = 60):
    """An HTTP client whose (kept-alive) connection the kernel handed to a worker
    other than ``avoid`` (``x-atp-worker`` of a ``GET /v1/health`` on it says
    which): fresh connections until one is."""
    for _ in range(200):
        h = httpx.AsyncClient(base_url=url, timeout=timeout, headers=auth(tenant))
        r = await h.get("/v1/health")
        if avoid is None or r.headers["x-atp-worker"] != avoid:
            try:
                yield h
            finally:
                await h.aclose()
            return
        await h.aclose()
    raise AssertionError(f"200 connections all went to worker {avoid}")


async def _on_other_worker(url: str, method: str, path: str, avoid: str, tenant: str, **kw) -> httpx.Response:
    """``method path`` once, on a connection to a worker other than ``avoid``."""
    async with _other_worker(url, avoid, tenant) as h:
        r = await h.request(method, path, **kw)
        assert r.headers["x-atp-worker"] != avoid
        return r


async def _events(url: str, tenant: str, sid: str, *, avoid: str | None = None) -> tuple[list[tuple[str, dict]], dict]:
    """A stream's SSE events to its end, read through a worker other than
    ``avoid`` when given: ``([(event type, frame)], response headers)``."""
    async with _other_worker(url, avoid, tenant) as h, h.stream("GET", f"/v1/streams/{sid}/events") as r:
        assert r.status_code == 200, await r.aread()
        assert avoid is None or r.headers["x-atp-worker"] != avoid
        text = (await r.aread()).decode()
        events = [(m[1], json.loads(m[2])) for m in re.finditer(r"event: (\w+)\ndata: (.*)\n", text)]
        return events, dict(r.headers)


@pytest.fixture
async def setup(nursery, tmp_path, request):
    model = await serve(nursery, BillingModel(BILLED))
    policies = tmp_path / "rib" / "rib.yaml"
    policies.parent.mkdir()
    policies.write_text(summarize_rib(model.url))
    sup = Supervisor(policies.parent, tmp_path / "state", watch="watch" in request.node.name)
    try:
        await sup.wait_listening()
        yield sup, model, policies
    finally:
        sup.stop()


async def test_a_tenant_budget_is_exact_across_workers(setup):
    """Sixty concurrent streams of one tenant, on both workers, each call billing
    ten times its estimate: the tenant is charged exactly its limit. The model holds
    the calls until no more arrive, so both workers' calls are in flight (reserved)
    before the first commit — which worker wins the last tokens is then the ledger's
    decision, not which worker happened to start first."""
    sup, model, _ = setup
    opened: list[tuple[str, str]] = []
    model.hold = trio.Event()

    async def one() -> None:
        body, slot = await _open(sup.url, "alice")
        opened.append((body["stream_id"], slot))

    async with trio.open_nursery() as n:
        for _ in range(60):
            n.start_soon(one)
    assert Counter(slot for _, slot in opened).keys() == {"0", "1"}, opened  # the kernel spread them
    with trio.fail_after(60):
        seen, still = -1, 0
        while still < 10 and model.waiting < 60:  # no new call for 1 s
            seen, still = model.waiting, still + 1 if model.waiting == seen else 0
            await trio.sleep(0.1)
    model.hold.set()
    model.hold = None
    ends = []

    async def follow(sid: str) -> None:
        events, _ = await _events(sup.url, "alice", sid)
        ends.append(events[-1][0])

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            for sid, _ in opened:
                n.start_soon(follow, sid)
    assert len(ends) == 60 and set(ends) <= {"FIN", "RST"}
    with sup.db() as db:
        committed, overage, reserved, limit = db.execute(
            "SELECT committed_tokens, overage_tokens, reserved_tokens, limit_tokens FROM account "
            "WHERE key = 'client:alice'").fetchone()
        by_worker = Counter()
        for owner, spent in db.execute(
                "SELECT s.owner, a.committed_tokens FROM stream s JOIN account a "
                "ON a.key = 'stream:alice:' || s.stream_id || '@' || s.owner WHERE s.tenant = 'alice'"):
            by_worker[owner.split(".")[0]] += spent
        left = db.execute("SELECT COUNT(*) FROM reservation").fetchone()[0]
    assert limit == ALICE_TOKENS
    assert committed == ALICE_TOKENS  # contended to the last token, and 0 overshoot
    assert overage > 0 and reserved == 0 and left == 0
    assert by_worker.keys() == {"w0", "w1"} and sum(by_worker.values()) == committed  # both spent from it


async def test_a_stream_is_followed_scored_and_cancelled_through_the_other_worker(setup):
    sup, model, _ = setup
    # A finished stream: read and scored through the worker that did not run it.
    body, owner = await _open(sup.url, "bob")
    events, headers = await _events(sup.url, "bob", body["stream_id"], avoid=owner)
    # (a WINDOW_UPDATE may come between, when the window timer fires on a busy machine)
    assert [t for t, _ in events if t != "WINDOW_UPDATE"] == ["SYN_ACK", "PARTIAL", "PARTIAL", "FINAL", "FIN"], events
    assert headers["x-atp-served-by"] == owner != headers["x-atp-worker"]
    r = await _on_other_worker(sup.url, "POST", f"/v1/streams/{body['stream_id']}/feedback", owner, "bob",
                               json={"score": 1.0})
    assert r.status_code == 200 and r.json()["agents"] == ["summarizer"], r.text
    again = await _on_other_worker(sup.url, "POST", f"/v1/streams/{body['stream_id']}/feedback", owner, "bob",
                                   json={"score": 0.0})
    assert again.status_code == 409  # once per stream, whichever worker is asked
    # Another tenant asking the other worker: the same 404 as an id that never existed.
    other = await _on_other_worker(sup.url, "GET", f"/v1/streams/{body['stream_id']}/events", owner, "alice")
    missing = await _on_other_worker(sup.url, "GET", "/v1/streams/task_nope/events", owner, "alice")
    assert other.status_code == missing.status_code == 404 and other.json() == {
        "error": {"code": "EPROTO", "reason": f"unknown stream {body['stream_id']!r}"}}

    # A running stream: followed live and cancelled (RST) through the other worker.
    model.hold = trio.Event()
    body, owner = await _open(sup.url, "bob", idempotency_key="live-1")
    sid = body["stream_id"]
    with trio.fail_after(20):
        while model.waiting < 1:
            await trio.sleep(0.02)
    followed: list[str] = []
    served: dict[str, str] = {}

    async def follow() -> None:
        events, headers = await _events(sup.url, "bob", sid, avoid=owner)
        followed.extend(t for t, _ in events)
        served.update(headers)

    async with trio.open_nursery() as n:
        n.start_soon(follow)
        await trio.sleep(0.5)
        # The same idempotency key on the other worker is the same stream, not a second task.
        again = await _on_other_worker(sup.url, "POST", "/v1/streams", owner, "bob",
                                       json={"task": TASK, "content": CONTENT, "idempotency_key": "live-1"})
        assert again.status_code == 201 and again.json()["stream_id"] == sid
        assert again.headers["x-atp-served-by"] == owner
        rst = {"v": 1, "session_id": body["session_id"], "stream_id": sid, "msg_seq": 0, "flags": ["RST", "CTRL"],
               "payload": {"type": "control", "content": {"kind": "ERROR", "code": "EPREEMPT", "reason": "user"}}}
        r = await _on_other_worker(sup.url, "POST", f"/v1/streams/{sid}/frames", owner, "bob", json=rst)
        assert r.status_code == 200 and r.json() == {"frames": []} and r.headers["x-atp-served-by"] == owner
    # The RST ended the live follow: no result, no closing frame of ours (an RST is never answered).
    assert followed[0] == "SYN_ACK" and not {"FINAL", "FIN", "RST"} & set(followed), followed
    assert served["x-atp-served-by"] == owner
    assert model.waiting == 1  # one call: the retry did not run the task again
    # The cancelled call settles on the owner once its cancelled task unwinds, after the RST's 200.
    with trio.fail_after(30):
        while True:
            with contextlib.closing(sup.db()) as db:
                if db.execute("SELECT COUNT(*) FROM reservation").fetchone()[0] == 0:
                    break
            await trio.sleep(0.05)


async def test_kill9_of_a_worker_settles_once_and_the_other_goes_on(setup):
    sup, model, _ = setup
    model.hold = trio.Event()
    opened: list[tuple[dict, str]] = []
    with trio.fail_after(60):
        i = 0
        while {slot for _, slot in opened} != {"0", "1"} or len(opened) < 4:
            opened.append(await _open(sup.url, "bob", idempotency_key=f"k{i}"))
            i += 1
        while model.waiting < len(opened):
            await trio.sleep(0.02)
    with sup.db() as db:
        owners = dict(db.execute("SELECT stream_id, owner FROM stream WHERE tenant = 'bob'").fetchall())
        held = db.execute("SELECT owner, SUM(tokens), COUNT(*) FROM reservation GROUP BY owner").fetchall()
        before = db.execute("SELECT committed_tokens FROM account WHERE key = 'client:bob'").fetchone()[0]
    victim = next(o for o in owners.values() if o.startswith("w0."))
    survivor = next(o for o in owners.values() if o.startswith("w1."))
    victim_tokens = next(t for o, t, _ in held if o == victim)
    assert {o for o, _, _ in held} == {victim, survivor}
    old_pids = set(sup.workers())
    os.kill(int(victim.split(".")[1]), signal.SIGKILL)

    with trio.fail_after(60):  # the supervisor settles the dead worker and starts another
        while True:
            pids = set(sup.workers())
            with sup.db() as db:
                left = db.execute("SELECT COUNT(*) FROM reservation WHERE owner = ?", (victim,)).fetchone()[0]
            if left == 0 and len(pids) == 2 and pids != old_pids:
                break
            await trio.sleep(0.1)
    with sup.db() as db:
        after = db.execute("SELECT committed_tokens FROM account WHERE key = 'client:bob'").fetchone()[0]
        states = dict(db.execute("SELECT stream_id, state FROM stream WHERE tenant = 'bob'").fetchall())
        survivor_held = db.execute("SELECT COUNT(*) FROM reservation WHERE owner = ?", (survivor,)).fetchone()[0]
    assert after == before + victim_tokens  # committed at the reserved amount, once
    assert {sid: states[sid] for sid, o in owners.items() if o == victim} == \
        {sid: "interrupted" for sid, o in owners.items() if o == victim}
    assert {states[sid] for sid, o in owners.items() if o == survivor} == {"open"}  # still running
    assert survivor_held == sum(1 for o in owners.values() if o == survivor)

    dead_sid = next(sid for sid, o in owners.items() if o == victim)
    events, _ = await _events(sup.url, "bob", dead_sid)
    assert events[-1][0] == "RST" and "interrupted" in json.dumps(events[-1][1])
    calls = len(model.requests)
    # The same idempotency key returns the interrupted stream: it is not run again.
    dead_key = f"k{[b['stream_id'] for b, _ in opened].index(dead_sid)}"
    again_body, _ = await _open(sup.url, "bob", idempotency_key=dead_key)
    assert again_body["stream_id"] == dead_sid
    model.hold.set()  # the survivor's calls answer: its streams finish on the worker that kept running
    for sid, o in owners.items():
        if o == survivor:
            events, _ = await _events(sup.url, "bob", sid)
            assert [t for t, _ in events][-2:] == ["FINAL", "FIN"]
    assert len(model.requests) == calls == len(opened)  # nothing ran twice
    # Both workers serve new streams, the restarted one included.
    model.hold = None
    slots = set()
    with trio.fail_after(60):
        while slots != {"0", "1"}:
            body, slot = await _open(sup.url, "bob")
            events, _ = await _events(sup.url, "bob", body["stream_id"])
            assert events[-2][0] == "FINAL"
            slots.add(slot)
    assert sup.stop() == 0
    verify = await trio.run_process([*ROUTER, "audit", "verify", "--state-dir", str(sup.state)], capture_stdout=True,
                                    capture_stderr=True, check=False, cwd=ROOT)
    assert verify.returncode == 0 and verify.stdout.startswith(b"audit: OK"), verify.stdout + verify.stderr


async def _versions(url: str, want: int, marker: str) -> None:
    """Wait until both workers run RIB generation ``want`` routing ``marker``."""
    ops = auth("ops")
    seen: dict[str, tuple[int, bool]] = {}
    with trio.fail_after(30):
        while set(seen) != {"0", "1"} or any(v != (want, True) for v in seen.values()):
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                health = await h.get("/v1/health", headers=ops)
                routes = await h.get("/v1/routes", headers=ops)
            if health.headers["x-atp-worker"] == routes.headers["x-atp-worker"]:
                seen[health.headers["x-atp-worker"]] = (health.json()["rib_version"], marker in routes.text)


async def test_a_reload_or_a_policy_file_watch_reaches_every_worker_and_sigterm_stops_them(setup):
    sup, model, policies = setup
    async with httpx.AsyncClient(base_url=sup.url, timeout=30) as h:
        r = await h.post("/v1/policies/reload", headers=auth("ops"), content=summarize_rib(
            model.url, "  - {name: hot, match: {task_type: hot_reloaded}, fanout: [summarizer]}\n"))
        assert r.status_code == 200, r.text
        version = r.json()["version"]
    assert version > 1
    await _versions(sup.url, version, "hot_reloaded")
    # An edited --policies file: worker 0 watches it, its reload reaches worker 1 through the store.
    (policies.parent / "rib.yaml").write_text(summarize_rib(
        model.url, "  - {name: edited, match: {task_type: file_edited}, fanout: [summarizer]}\n"))
    with trio.fail_after(30):
        while True:
            with sup.db() as db:
                now = db.execute("SELECT version FROM rib ORDER BY n DESC LIMIT 1").fetchone()[0]
            if now > version:
                break
            await trio.sleep(0.1)
    await _versions(sup.url, now, "file_edited")
    workers = sup.workers()
    assert len(workers) == 2
    assert sup.stop() == 0
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                   for pid in workers)


async def test_refusals_before_any_worker_starts(tmp_path):
    """A bad RIB, or a state directory another router holds, is refused by the
    supervisor itself (exit 2, the reason on stderr), as by a single router."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents:\n  a: {layer: L9}\n")
    r = await trio.run_process([*ROUTER, "--workers", "2", "--policies", str(bad), "--state-dir", str(tmp_path / "s1"),
                                "--http-port", "0", "--ws-port", "0"], capture_stdout=True, capture_stderr=True,
                               check=False, cwd=ROOT)
    assert r.returncode == 2 and b"policy refused" in r.stderr and b"listening" not in r.stdout
    policies = tmp_path / "rib.yaml"
    policies.write_text(summarize_rib("http://127.0.0.1:9/v1"))
    first = Supervisor(policies, tmp_path / "s2")
    try:
        await first.wait_listening()
        second = await trio.run_process(
            [*ROUTER, "--workers", "2", "--policies", str(policies), "--state-dir", str(tmp_path / "s2"),
             "--http-port", "0", "--ws-port", "0"], capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)
        assert second.returncode == 2 and b"is in use by another atp-router" in second.stderr
        single = await trio.run_process(
            [*ROUTER, "--policies", str(policies), "--state-dir", str(tmp_path / "s2"), "--http-port", "0",
             "--ws-port", "0"], capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT)
        assert single.returncode == 2 and b"is in use by another atp-router" in single.stderr
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_sigterm_right_after_listening_is_a_clean_stop(tmp_path, workers):
    """The SIGTERM handler is in place before the ``listening`` line (and before a
    worker reports ready): a supervisor that stops the router the moment it is up
    gets exit 0 and the router's shutdown, never death by the signal (-15)."""
    policies = tmp_path / "rib.yaml"
    policies.write_text(summarize_rib("http://127.0.0.1:9/v1"))
    proc = (Supervisor(policies, tmp_path / "state", workers) if workers > 1 else
            RouterProcess("--policies", policies, "--state-dir", tmp_path / "state", "--http-port", "0",
                          "--ws-port", "0", "--no-watch"))
    await proc.wait_listening()
    assert proc.stop() == 0, "".join(proc.lines)
