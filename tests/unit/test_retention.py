"""Closed streams in memory are bounded — by count per tenant, by bytes
router-wide, by age — and a stream that left memory reads the same from the
store (issue 10 item 3; spec §8 resumption).

A real router on loopback (HTTP API and WebSocket ingress), two tenants, a
scripted next-hop streaming two PARTIALs and a FINAL. Every read of a stream
that left memory is compared with a read of the same stream made while it was
in memory — byte for byte for the SSE body, frame for frame for a WebSocket
resumption.
"""

from __future__ import annotations

import gc
import re
import weakref

import httpx
import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.runtime.dataplane.streams import REFUSED_RETAIN_S
from atp_router.security.identity import Role
from atp_router.wire import session as S
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import CLEAN, scripted_agent
from tests.unit.test_router_ws import WINDOW, connect

TOKENS = {"alice": "tok-alice-1111", "bob": "tok-bob-2222"}
ROLES = {"alice": frozenset({Role.CLIENT, Role.OPERATOR})}
TASK = {"task_type": "review"}
RIB = {"agents": {"m.a": scripted_agent()},
       "policies": [{"name": "p", "match": {"task_type": "review"}, "fanout": ["m.a"]}]}


@pytest.fixture
def agent(scripted) -> ScriptedAdapter:
    scripted["m.a"] = ScriptedAdapter.returning("m.a", partials=["first part", "second part"], delay_s=0.01)
    return scripted["m.a"]


async def _env(nursery, tmp_path, **config):
    # Alice may read /v1/metrics too (the retained-stream gauges).
    return await start_router_on(nursery, tmp_path, RIB, client_tokens=TOKENS, client_roles=ROLES, **config)


def _client(env, who: str = "alice") -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {TOKENS[who]}"}, timeout=30)


async def _open(h: httpx.AsyncClient, key: str | None = None, *, task: bool = True) -> httpx.Response:
    body: dict = {"task": TASK}
    if task:
        body["content"] = CLEAN
    if key is not None:
        body["idempotency_key"] = key
    return await h.post("/v1/streams", json=body)


async def _events(h: httpx.AsyncClient, sid: str, after: int | None = None) -> bytes:
    """The SSE body of ``GET /v1/streams/{sid}/events`` (to the stream's end)."""
    headers = {"Last-Event-ID": str(after)} if after is not None else {}
    async with h.stream("GET", f"/v1/streams/{sid}/events", headers=headers) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        return b"".join([b async for b in r.aiter_bytes()])


def _types(body: bytes) -> list[str]:
    return re.findall(rb"^event: (\w+)$", body, re.MULTILINE)


async def _run(h: httpx.AsyncClient, key: str | None = None) -> tuple[str, bytes]:
    """Open a stream with the task, read its events live to the FIN."""
    r = await _open(h, key)
    assert r.status_code == 201, r.text
    sid = r.json()["stream_id"]
    body = await _events(h, sid)
    assert _types(body)[-2:] == [b"FINAL", b"FIN"] and _types(body).count(b"PARTIAL") >= 2, body
    return sid, body


async def _until(cond, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


def _in_memory(env, sid: str, tenant: str = "alice") -> bool:
    return env.router.streams.find(tenant, sid) is not None


async def _metric(h: httpx.AsyncClient, name: str) -> float:
    text = (await h.get("/v1/metrics")).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert m is not None, text[:500]
    return float(m.group(1))


# ------------------------------------------------------------------ count

async def test_count_bound_keeps_each_tenants_newest_and_the_rest_reads_the_same_from_the_store(
        nursery, tmp_path, agent):
    """``retain_closed_max=2``: of Alice's four finished streams the two newest
    stay in memory. The two that left answer ``GET …/events`` with the very
    bytes they answered live (also from a ``Last-Event-ID``), an idempotent
    retry of one returns that stream without a second task, and Bob asking for
    one gets the 404 of an id that never existed."""
    env = await _env(nursery, tmp_path, retain_closed_max=2)
    async with _client(env) as h:
        runs, tails = [], []
        for i in range(4):
            sid, body = await _run(h, key=f"k{i}")
            runs.append((sid, body))
            tails.append(await _events(h, sid, after=2))  # while still in memory
        await _until(lambda: [_in_memory(env, sid) for sid, _ in runs] == [False, False, True, True])
        assert env.router.streams.retained_bytes > 0
        calls = len(agent.calls)
        for (sid, body), tail in zip(runs, tails, strict=True):
            assert await _events(h, sid) == body
            assert await _events(h, sid, after=2) == tail
        again = await _open(h, key="k0")
        assert again.status_code == 201 and again.json()["stream_id"] == runs[0][0]
        assert len(agent.calls) == calls  # no second task
    async with _client(env, "bob") as bob:
        sid = runs[0][0]
        theirs = await bob.get(f"/v1/streams/{sid}/events")
        never = await bob.get(f"/v1/streams/{sid[:-4]}{'0000' if not sid.endswith('0000') else '1111'}/events")
    assert theirs.status_code == never.status_code == 404
    assert theirs.json()["error"]["code"] == never.json()["error"]["code"] == "EPROTO"


# ------------------------------------------------------------------ bytes

async def test_byte_bound_lets_the_oldest_logs_go_router_wide(nursery, tmp_path, agent, scripted):
    """``retain_closed_bytes`` bounds the closed logs kept in memory across
    tenants (``atp_retained_bytes``; a log counts once its reader left, at its
    compacted size): with room for about two logs, three streams of Alice and
    Bob leave only the two newest in memory, whoever owns them; every stream
    still reads as it did live. With a budget of 1 byte no closed stream stays
    once its reader left, and reads are all from the store."""
    env = await _env(nursery, tmp_path)
    async with _client(env) as alice, _client(env, "bob") as bob:
        first, body = await _run(alice)
        await _until(lambda: env.router.streams.retained_bytes > 0)
        one_log = env.router.streams.retained_bytes
        env.router.streams.retain_closed_bytes = int(2.5 * one_log)  # room for two logs
        runs = [(alice, first, body), (bob, *await _run(bob)), (alice, *await _run(alice))]
        await _until(lambda: not _in_memory(env, first))
        assert _in_memory(env, runs[1][1], "bob") and _in_memory(env, runs[2][1])
        assert await _metric(alice, "atp_retained_bytes") <= env.router.streams.retain_closed_bytes
        assert await _metric(alice, "atp_retained_streams") == 2
        for h, sid, live in runs:
            assert await _events(h, sid) == live

        env.router.streams.retain_closed_bytes = 1
        sid, live = await _run(alice)
        await _until(lambda: env.router.streams.retained_bytes == 0)
        assert not _in_memory(env, sid)
        assert await _events(alice, sid) == live


# ------------------------------------------------------------------ age

async def test_age_bound_then_reads_and_websocket_resumption_come_from_the_store(nursery, tmp_path, agent):
    """``retain_closed_s`` (0.5 s here): a finished stream leaves memory after it
    — its ledger account closed, the gauges back to 0 — and still reads the
    same over HTTP, and a WebSocket SYN with its idempotency key replays the
    same frames as the stream sent live (spec §8), without a second task."""
    env = await _env(nursery, tmp_path, retain_closed_s=0.5)
    async with connect(env.ws_url, "json", "sess-ws", token=TOKENS["alice"]) as peer:
        await peer.send(peer.session.open_stream("t1", {**TASK, "idempotency_key": "ws-key"}, WINDOW,
                                                 payload=_task()))
        await peer.pump_until(lambda: peer.closed("t1"))
        live = [f for f in peer.raw if f.stream_id == "t1"]
    async with _client(env) as h:
        sid, body = await _run(h, key="http-key")
        account = env.router.streams.find("alice", sid).account
        await trio.sleep(0.5 + 1.5)  # the age, and the table's timer
        assert not _in_memory(env, sid) and not _in_memory(env, "t1")
        assert not env.router.ledger.has(account)
        assert await _metric(h, "atp_retained_streams") == 0 and await _metric(h, "atp_retained_bytes") == 0
        calls = len(agent.calls)
        assert await _events(h, sid) == body
    async with connect(env.ws_url, "json", "sess-ws2", token=TOKENS["alice"]) as peer:
        # A client that lost its state: a fresh SYN with the key gets everything again.
        await peer.send(peer.session.open_stream("t1", {**TASK, "idempotency_key": "ws-key"}, WINDOW,
                                                 payload=_task()))
        await peer.pump_until(lambda: len([f for f in peer.raw if f.stream_id == "t1"]) >= len(live))
        replay = [f for f in peer.raw if f.stream_id == "t1"]
    assert replay == live
    assert len(agent.calls) == calls


def _task() -> Payload:
    return Payload(type=PayloadType.TASK, content=CLEAN)


# ------------------------------------------------------------------ refused streams

async def test_a_stream_without_a_result_leaves_memory_within_a_second(nursery, tmp_path, agent):
    """A stream that delivered no result (opened without a task, reset with
    ETIMEOUT after ``idle_task_s``) stays in memory at most
    ``REFUSED_RETAIN_S`` although ``retain_closed_s`` is 300 s; its read from
    the store is the one it answered live. A finished stream beside it stays."""
    env = await _env(nursery, tmp_path, idle_task_s=0.3, retain_closed_s=300.0)
    async with _client(env) as h:
        done, _ = await _run(h)
        r = await _open(h, task=False)
        sid = r.json()["stream_id"]
        live = await _events(h, sid)
        assert _types(live) == [b"SYN_ACK", b"RST"] and b"ETIMEOUT" in live
        await trio.sleep(REFUSED_RETAIN_S + 1.2)
        assert not _in_memory(env, sid) and _in_memory(env, done)
        assert await _events(h, sid) == live


async def test_a_syn_refused_at_the_door_leaves_no_session_and_its_late_frames_are_still_dropped(
        nursery, tmp_path, agent):
    """With the router at ``max_streams`` (one idle stream holds it), SYNs are
    refused with EWINDOW — over HTTP (409) and over WebSocket (RST). None leaves
    a session or stream in memory; a late FIN on the refused WebSocket stream
    still draws no RST (the refusal is remembered), and once the slot is free
    the same session opens a stream."""
    env = await _env(nursery, tmp_path, max_streams=1)
    table = env.router.streams
    async with connect(env.ws_url, "json", "sess-hold", token=TOKENS["alice"]) as holder, \
            connect(env.ws_url, "json", "sess-ref", token=TOKENS["alice"]) as peer:
        await holder.send(holder.session.open_stream("hold", TASK, WINDOW))  # no task: the one open stream
        await holder.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in holder.events["hold"]))
        sessions, streams = table.session_count, len(table)
        async with _client(env) as h:
            for _ in range(20):
                r = await _open(h)
                assert r.status_code == 409 and r.json()["error"]["code"] == "EWINDOW", r.text
        await peer.send(peer.session.open_stream("t1", TASK, WINDOW, payload=_task()))
        await peer.pump_until(lambda: peer.closed("t1"))
        assert [e.error.code for e in peer.events["t1"] if isinstance(e, S.StreamReset)] == [ErrorCode.EWINDOW]
        assert table.get_session("alice", "sess-ref") is None
        assert (table.session_count, len(table)) == (sessions, streams)
        await peer.send(Frame(v=1, session_id="sess-ref", stream_id="t1", msg_seq=1, flags=[Flag.FIN]))
        await holder.send(holder.session.reset("hold", ErrorCode.ETIMEOUT, "done"))
        await _until(lambda: env.router.open_count == 0)
        await peer.send(peer.session.open_stream("t2", TASK, WINDOW, payload=_task()))
        await peer.pump_until(lambda: peer.closed("t2"))
        after = [f for f in peer.raw if f.stream_id == "t1"]
        assert len(after) == 1 and Flag.RST in after[0].flags  # the refusal only: the late FIN drew nothing
        assert [e for e in peer.events["t2"] if isinstance(e, S.StreamFinished)]


# ------------------------------------------------------------------ WebSocket followers

def _tasks_under(task) -> int:
    return 1 + sum(_tasks_under(t) for n in task.child_nurseries for t in n.child_tasks)


async def test_idle_websocket_streams_hold_no_task_and_wake_on_their_task_and_on_their_reset(
        nursery, tmp_path, agent):
    """Forty streams opened over one WebSocket without a task add no trio task
    (their followers are parked on the log, issue 10). One then gets its task and
    streams every event to its FINAL; the others, left without a task, get their
    RST ETIMEOUT after ``idle_task_s`` — each woken from parking."""
    env = await _env(nursery, tmp_path, idle_task_s=3.0)
    root = trio.lowlevel.current_root_task()
    async with connect(env.ws_url, "json", "sess-idle", token=TOKENS["alice"]) as peer:
        await peer.send(peer.session.open_stream("s0", TASK, WINDOW))
        await peer.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in peer.events["s0"]))
        await trio.sleep(0.2)
        before = _tasks_under(root)
        for i in range(1, 40):
            await peer.send(peer.session.open_stream(f"s{i}", TASK, WINDOW))
        await peer.pump_until(lambda: all(any(isinstance(e, S.StreamAccepted) for e in peer.events[f"s{i}"])
                                          for i in range(40)))
        await trio.sleep(0.2)
        assert _tasks_under(root) - before < 5
        await peer.send(peer.session.send_message("s0", _task()))
        await peer.pump_until(lambda: peer.closed("s0"))
        assert [p.type for p in peer.messages("s0")].count(PayloadType.PARTIAL) >= 2
        peer.final("s0")
        await peer.pump_until(lambda: all(peer.closed(f"s{i}") for i in range(1, 40)), timeout=30)
        resets = [e for i in range(1, 40) for e in peer.events[f"s{i}"] if isinstance(e, S.StreamReset)]
        assert len(resets) == 39 and {e.error.code for e in resets} == {ErrorCode.ETIMEOUT}


async def test_a_long_lived_websocket_does_not_keep_the_streams_it_carried(nursery, tmp_path, agent):
    """Streams that ran on a WebSocket that stays open leave memory with their
    retention age: the connection keeps no reference to them (it kept every
    stream it ever carried before, issue 10)."""
    env = await _env(nursery, tmp_path, retain_closed_s=0.3)
    async with connect(env.ws_url, "json", "sess-long", token=TOKENS["alice"]) as peer:
        refs = []
        for i in range(3):
            await peer.send(peer.session.open_stream(f"t{i}", TASK, WINDOW, payload=_task()))
            await peer.pump_until(lambda i=i: peer.closed(f"t{i}"))
            refs.append(weakref.ref(env.router.streams.find("alice", f"t{i}")))
        await trio.sleep(0.3 + 1.5)
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
        await peer.send(peer.session.open_stream("t9", TASK, WINDOW, payload=_task()))  # the connection still works
        await peer.pump_until(lambda: peer.closed("t9"))
        peer.final("t9")


# ------------------------------------------------------------------ the store side

def test_reading_a_stream_by_its_id_is_an_index_search_also_in_an_older_state_dir(tmp_path):
    """A stream no longer in memory is found by (tenant, stream id) with an index
    search, not a scan of the tenant's stored streams; a state directory made
    before any index for it (schema 2 without ``stream_by_id``) gains one when
    opened (schema 3's unique key, ordered tenant, stream id, session)."""
    from atp_router.store.sqlite import SqliteStore
    from tests.store.conftest import STREAM_EVENT_V2

    store = SqliteStore.open(tmp_path)
    store._conn.executescript(STREAM_EVENT_V2 + "DROP INDEX stream_by_id;")  # as a state directory from before it
    store.close()
    store = SqliteStore.open(tmp_path)
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)  # the query find_stream runs, values inline
    assert store.find_stream("t", "s") is None
    store._conn.set_trace_callback(None)
    [query] = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    plan = store._conn.execute("EXPLAIN QUERY PLAN " + query).fetchall()
    store.close()
    assert any("USING INDEX sqlite_autoindex_stream_1 (tenant=? AND stream_id=?)" in row[-1] for row in plan), plan


# ------------------------------------------------------------------ idle trim

async def test_memory_is_trimmed_only_once_no_stream_is_open(nursery, tmp_path, agent, monkeypatch):
    """The router gives memory back (:func:`atp_router.runtime.dataplane.memory.trim`) when it went
    idle: not while a stream is open, once within seconds after the last one
    closed and left memory — and never with ``idle_trim=False``."""
    from atp_router.runtime.dataplane import memory

    calls: list[float] = []
    real = memory.trim
    monkeypatch.setattr(memory, "trim", lambda: calls.append(trio.current_time()) or real())
    env = await _env(nursery, tmp_path)
    (tmp_path / "off").mkdir()
    off = await start_router_on(nursery, tmp_path / "off", RIB, client_tokens=TOKENS, idle_trim=False)
    async with _client(env) as h, _client(off) as h_off:
        idle = (await _open(h, task=False)).json()["stream_id"]  # open, no task: the router is not idle
        await _run(h)
        await _run(h_off)
        await trio.sleep(3.0)
        assert calls == []
        closed_at = trio.current_time()
        env.router.streams.find("alice", idle).stop(ErrorCode.ETIMEOUT, "test")
        await _until(lambda: len(calls) == 1, timeout=8.0)
        # 2 s after the last memory freed: the stream's close, then its leaving memory (no result: 1 s).
        assert calls[0] - closed_at < REFUSED_RETAIN_S + 2.0 + 1.0
        await trio.sleep(1.0)
        assert len(calls) == 1  # the router that does not trim never called it


async def test_timers_of_streams_that_left_memory_do_not_pile_up(tmp_path, agent, autojump_clock):
    """600 finished streams with room for 10 in memory: the table's timers of
    the 590 that left (their retention and idle deadlines, 300 s and 30 s
    away) are purged, not kept until due."""
    from tests.unit.test_router_flow import drain, serving, tenant

    async with serving(tmp_path, RIB, retain_closed_max=10, retain_closed_s=300.0, idle_task_s=30.0) as router:
        for _ in range(600):
            ctx = router.open_stream(task=TASK, content=CLEAN, budget=None, qos=None, window=None,
                                     idempotency_key=None, identity=tenant("alice"))
            await drain(ctx)
        await trio.sleep(0.5)
        assert len(router.streams) <= 10 + 1
        assert len(router.streams._timers) < 600  # two a stream (idle, retain) were they kept until due
