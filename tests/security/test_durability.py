"""State that survives ``kill -9`` (issue 7 item 7; spec §5 budgets, §8 resumption, §11 audit).

A real ``atp-router`` process on a state directory is killed with SIGKILL and started
again on the same directory. Its one next-hop is an OpenAI-compatible model on a
loopback HTTP server in the test (the streaming shape with a ``usage`` chunk that
the OpenAI-compatible adapter's own tests replay), so that every call is charged
1,000 tokens and one call can be made to hang across the kill.

After the restart: an exhausted client budget stays exhausted and the model is not
called; a finished stream's events read back identical; the same idempotency key
returns the stored stream with no new call and no charge; a stream that was
running is reported with an RST saying it was interrupted and is never re-run; a
hot-reloaded RIB is still the running one; ``atp-router audit verify`` accepts the
chain and names the first bad record after an edit or a deletion.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path

import atp
import httpx
import pytest
import trio

from tests import helpers
from tests.replay_server import Replay, serve

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"alice": "tok-alice-0123456789", "bob": "tok-bob-0123456789", "ops": "tok-ops-0123456789"}
TASK = {"task_type": "summarize"}
CONTENT = {"text": "summarise this"}


def _sse(text: str, tokens: int) -> list[bytes]:
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    usage = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
             "usage": {"prompt_tokens": tokens // 2, "completion_tokens": tokens - tokens // 2,
                       "total_tokens": tokens}}
    return [f"data: {json.dumps(chunk)}\n\n".encode(), f"data: {json.dumps(usage)}\n\n".encode(), b"data: [DONE]\n\n"]


def _rib(model_url: str, extra_policy: str = "") -> str:
    """The test's RIB; ``extra_policy`` is one more policy line (a reload's mark)."""
    return (
        "models:\n"
        f"  m: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{model_url}/v1', model: m, max_out_tokens: 64}}\n"
        "agents:\n"
        "  summarizer: {layer: L2, p95_ms: 500, model: m, timeout_ms: 60000}\n"
        "policies:\n"
        f"  - {{name: summarize, match: {{task_type: summarize}}, fanout: [summarizer]}}\n"
        f"{extra_policy}"
        "clients:\n"
        "  alice: {budget: {tokens: 2500}}\n"
        "  bob: {budget: {tokens: 100000}}\n"
    )


class RouterProcess(helpers.RouterProcess):
    """``atp-router`` as a child process on ``state`` (tests.helpers.RouterProcess)."""

    def __init__(self, policies: Path, state: Path):
        super().__init__("--policies", policies, "--state-dir", state, "--http-port", "0", "--ws-port", "0",
                         env={"ATP_ROUTER_TOKENS": f"alice:{TOKENS['alice']},bob:{TOKENS['bob']},"
                                                   f"ops:{TOKENS['ops']}:admin+operator"})


async def _events(url: str, tenant: str, stream: str) -> list[atp.Event]:
    async with atp.Client(url, TOKENS[tenant]) as c:
        with trio.fail_after(30):
            return [ev async for ev in c.events(stream)]


def _audit(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*helpers.ROUTER, "audit", "verify", "--state-dir", str(state)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.fixture
def router_procs():
    procs: list[RouterProcess] = []
    yield procs
    for p in procs:
        p.stop()


async def test_kill9_keeps_spend_results_and_interrupted_streams(nursery, tmp_path, router_procs):
    model = await serve(nursery, Replay(chunked=True))
    for _ in range(3):
        model.add(200, {"content-type": "text/event-stream"}, _sse("done", 1000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_rib(model.url))
    state = tmp_path / "state"

    first = RouterProcess(policies, state)
    router_procs.append(first)
    url = await first.wait_listening()
    async with atp.Client(url, TOKENS["alice"]) as alice:
        finals = []
        for i in range(3):
            _, st = await alice.open_stream(task=TASK, content=CONTENT, idempotency_key=f"k{i}")
            evs = await _events(url, "alice", st.stream_id)
            finals.append((st.stream_id, evs))
        first_id, first_events = finals[0]
        assert first_events[-2].type == "FINAL" and first_events[-1].type == "FIN"
        calls_before = len(model.requests)
        # A hot reload through the API (admin): it must survive the crash.
        async with httpx.AsyncClient() as h:
            r = await h.post(url + "/v1/policies/reload", content=_rib(model.url, "  - {name: hot, match: {task_type: hot_reloaded}, fanout: [summarizer]}\n"),
                             headers={"Authorization": f"Bearer {TOKENS['ops']}"})
            assert r.status_code == 200, r.text
            reloaded_version = r.json()["version"]
    # Bob's call hangs at the model when the router is killed.
    model.add(200, {"content-type": "text/event-stream"}, _sse("never", 10)[:1], stall=True)
    async with atp.Client(url, TOKENS["bob"]) as bob:
        _, slow = await bob.open_stream(task=TASK, content=CONTENT, idempotency_key="slow")
        with trio.fail_after(20):
            while len(model.requests) == calls_before:
                await trio.sleep(0.05)
    first.kill9()

    second = RouterProcess(policies, state)
    router_procs.append(second)
    url = await second.wait_listening()
    calls_at_restart = len(model.requests)
    async with atp.Client(url, TOKENS["alice"]) as alice:
        # (a) The exhausted budget is still exhausted: no call is made.
        _, st = await alice.open_stream(task=TASK, content=CONTENT, idempotency_key="after")
        evs = await _events(url, "alice", st.stream_id)
        codes = [ev.payload.get("code") for ev in evs if ev.type == "ERROR"]
        assert "EBUDGET" in codes, [ev.type for ev in evs]
        # (b, c) The same key returns the stored stream; its events read back identical.
        _, again = await alice.open_stream(task=TASK, content=CONTENT, idempotency_key="k0")
        assert again.stream_id == first_id
        replay = await _events(url, "alice", first_id)
        assert [(e.type, e.payload) for e in replay] == [(e.type, e.payload) for e in first_events]
        # The stored key still names its task: another task under it is refused 409 (issue 24).
        async with httpx.AsyncClient() as h:
            other = await h.post(url + "/v1/streams", headers={"Authorization": f"Bearer {TOKENS['alice']}"},
                                 json={"task": TASK, "content": {**CONTENT, "note": "another task"},
                                       "idempotency_key": "k0"})
            assert other.status_code == 409 and "'k0'" in other.json()["error"]["reason"], other.text
    # (d) Bob's interrupted stream: RST saying so, never re-run.
    bob_events = await _events(url, "bob", slow.stream_id)
    assert bob_events[-1].type == "RST" and "interrupted" in json.dumps(bob_events[-1].payload)
    async with atp.Client(url, TOKENS["bob"]) as bob:
        _, again = await bob.open_stream(task=TASK, content=CONTENT, idempotency_key="slow")
        assert again.stream_id == slow.stream_id
    assert len(model.requests) == calls_at_restart  # nothing ran twice, nothing was charged again
    # Another tenant cannot read alice's stream: the same answer as a missing id.
    async with httpx.AsyncClient() as h:
        other = await h.get(f"{url}/v1/streams/{first_id}/events", headers={"Authorization": f"Bearer {TOKENS['bob']}"})
        missing = await h.get(f"{url}/v1/streams/task_nope/events", headers={"Authorization": f"Bearer {TOKENS['bob']}"})
        assert other.status_code == missing.status_code == 404
        # (e) The hot-reloaded RIB came back: its extra policy routes.
        routes = await h.get(url + "/v1/routes", headers={"Authorization": f"Bearer {TOKENS['ops']}"})
        assert routes.status_code == 200
        assert "hot_reloaded" in routes.text and reloaded_version == 2
    # (f0) While it runs, the router's store is its alone (exclusive): the audit command on its
    # state directory is refused at once, in one line, not after SQLite's busy timeout.
    t0 = time.monotonic()
    live = _audit(state)
    assert live.returncode == 2 and live.stdout == "", live.stdout + live.stderr
    assert live.stderr.count("\n") == 1 and "held by a running atp-router" in live.stderr, live.stderr
    assert time.monotonic() - t0 < 8
    second.stop()

    # (f) The audit chain: intact, then edited, then with a record deleted.
    ok = _audit(state)
    assert ok.returncode == 0 and ok.stdout.startswith("audit: OK"), ok.stdout + ok.stderr
    db = sqlite3.connect(helpers.durable_db(state / "state.db"))
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    audit_table = next(t for t in tables if t.startswith("audit") and "check" not in t)
    cols = [r[1] for r in db.execute(f"PRAGMA table_info({audit_table})")]
    detail_col = next(c for c in cols if "detail" in c)
    n = ok.stdout.split(",")[1].split()[0]
    assert int(n) >= 10  # every stream's open and close, the reload, the interruption
    db.execute(f"UPDATE {audit_table} SET {detail_col} = replace({detail_col}, 'FIN', 'RST') WHERE seq = 4")
    db.commit()
    edited = _audit(state)
    assert edited.returncode == 1 and "BROKEN at record 4" in edited.stdout, edited.stdout


def _bandit_rib(model_url: str) -> str:
    """Two next-hops on one OpenAI-compatible server, chosen by a bandit (issue 8)."""
    return (
        "models:\n"
        f"  m1: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{model_url}/v1', model: m1, max_out_tokens: 64}}\n"
        f"  m2: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{model_url}/v1', model: m2, max_out_tokens: 64}}\n"
        "agents:\n"
        "  good: {layer: L2, p95_ms: 500, model: m1, timeout_ms: 60000}\n"
        "  bad: {layer: L2, p95_ms: 500, model: m2, timeout_ms: 60000}\n"
        "policies:\n"
        "  - {name: summarize, match: {task_type: summarize}, fanout: [good, bad], fanout_k: 1,\n"
        "     bandit: {explore: 0.5, text_features: false}}\n"
    )


async def test_kill9_keeps_what_the_router_learned(nursery, tmp_path, router_procs):
    """Issue 8: a router killed with SIGKILL and restarted on its state directory
    routes with the weights it learned (saved every 5 s, so the test waits 6 s
    before the kill)."""
    from atp_router.runtime.controlplane.learning import SAVE_INTERVAL_S

    model = await serve(nursery, Replay(chunked=True))
    for _ in range(40):
        model.add(200, {"content-type": "text/event-stream"}, _sse("done", 100))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_bandit_rib(model.url))
    state = tmp_path / "state"
    ops = {"Authorization": f"Bearer {TOKENS['ops']}"}

    first = RouterProcess(policies, state)
    router_procs.append(first)
    url = await first.wait_listening()
    async with atp.Client(url, TOKENS["alice"]) as alice:
        for _ in range(24):
            _, st = await alice.open_stream(task=TASK, content=CONTENT)
            await alice.result(st)
            await alice.feedback(st, 1.0 if st.route["next_hops"] == ["good"] else 0.0)
        # Two finished streams: one scored before the kill, one to score after it.
        _, scored = await alice.open_stream(task=TASK, content=CONTENT)
        await alice.result(scored)
        await alice.feedback(scored, 1.0)
        _, later = await alice.open_stream(task=TASK, content=CONTENT)
        await alice.result(later)
    async with httpx.AsyncClient() as h:
        learned = (await h.get(url + "/v1/fib", headers=ops)).json()["bandits"]["summarize"]["arms"]
        # (the two extra streams' consensus verdicts are in these counts too)
    assert learned["good"]["count"] > 0
    await trio.sleep(SAVE_INTERVAL_S + 1)
    first.kill9()

    second = RouterProcess(policies, state)
    router_procs.append(second)
    url = await second.wait_listening()
    async with httpx.AsyncClient() as h:
        restored = (await h.get(url + "/v1/fib", headers=ops)).json()["bandits"]["summarize"]["arms"]
    assert {a: v["count"] for a, v in restored.items()} == {a: v["count"] for a, v in learned.items()}
    async with atp.Client(url, TOKENS["alice"]) as alice:
        # Feedback is once per stream, also across the crash; a stream finished before
        # it can still be scored, and the bandit learns it from the stored decision.
        with pytest.raises(atp.ATPClientError) as e:
            await alice.feedback(scored, 0.0)
        assert e.value.status == 409
        out = await alice.feedback(later, 1.0 if later.route["next_hops"] == ["good"] else 0.0)
        assert out["bandit"] is True and out["agents"] == later.route["next_hops"]
    picks = []
    async with atp.Client(url, TOKENS["alice"]) as alice:
        for _ in range(8):
            _, st = await alice.open_stream(task=TASK, content=CONTENT)
            await alice.result(st)
            picks.append(st.route["next_hops"][0])
    assert picks.count("good") >= 6, picks
