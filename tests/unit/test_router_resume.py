"""Resumption (spec §8) and dead-peer detection (§4.4 HB) on a real router over the
wire: the WebSocket ingress with the project's sans-IO client
:class:`~atp_router.wire.session.Session`, and the HTTP API with the SDK.

A stream belongs to its client, not to its connection: when the connection drops
(closed, or declared dead by the heartbeat watchdog) the stream is detached and
keeps running; the client re-opens it with the same idempotency key and gets the
events it missed — no second agent call, no second charge, duplicates dropped. A
stream nobody comes back for within ``resume_grace_s`` is reset with ``ETIMEOUT``
and what its call streamed until then is committed.

The next-hop is a :class:`~atp_router.adapters.testing.ScriptedAdapter` streaming PARTIALs
with cumulative usage at a fixed pace (the shape of a model adapter streaming
tokens), so a test can drop the connection in the middle of a call.
"""

from __future__ import annotations

import json

import atp
import msgspec
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentReport, Usage
from atp_router.security.identity import ANONYMOUS
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
from tests.conftest import start_router
from tests.unit.test_router_dispatch import CLEAN, META, scripted_agent
from tests.unit.test_router_ws import WINDOW, Peer, connect

STEPS = 8  # PARTIALs per call, 100 tokens each (cumulative usage)


class Streamer(ScriptedAdapter):
    """STEPS PARTIALs of 100 tokens each, ``delay_s`` apart, then a FINAL; records
    the cumulative usage of every fragment it handed out."""

    def __init__(self, name: str, delay_s: float = 0.1):
        frags = [Fragment(type=PayloadType.PARTIAL, content=f"part {i}", usage=Usage(in_tokens=100 * (i + 1)))
                 for i in range(STEPS)]
        frags.append(Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=Usage(in_tokens=100 * STEPS)))
        super().__init__(name, frags, delay_s=delay_s)
        self.yielded: list[int] = []

    async def stream(self, prompt: Prompt):
        async for frag in super().stream(prompt):
            self.yielded.append(frag.usage.tokens if frag.usage else 0)
            yield frag


async def env_with_streamer(nursery, tmp_path, scripted, **config):
    adapter = scripted["m.stream"] = Streamer("m.stream")
    doc = {"agents": {"m.stream": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.stream"]}]}
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    return await start_router(nursery, path, **config), adapter


def deltas(peer: Peer, stream_id: str) -> list[str]:
    return [p.content["delta"] for p in peer.messages(stream_id)
            if p.type is PayloadType.PARTIAL and "delta" in p.content]


def syn_task(session: S.Session, stream_id: str, key: str) -> Frame:
    return session.open_stream(stream_id, {**META, "idempotency_key": key}, WINDOW,
                               payload=Payload(type=PayloadType.TASK, content=CLEAN))


async def test_ws_drop_then_reopen_with_the_key_replays_everything_once(nursery, tmp_path, scripted):
    """The client drops the WebSocket after two PARTIALs and comes back with a fresh
    session (it lost its state) and the same key: the router answers on the same
    stream with the SYN+ACK and every event in order, then the rest live. The
    agent was called once, the budget charged once."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted)
    async with connect(env.ws_url, "json", "s-res") as peer:
        await peer.send(syn_task(peer.session, "t1", "k1"))
        await peer.pump_until(lambda: len(deltas(peer, "t1")) >= 2)
    ctx = env.router.streams.find("anonymous", "t1")
    with trio.fail_after(5):
        while ctx.detached_at is None:
            await trio.sleep(0.01)
    assert not ctx.log.closed  # detached, still running

    async with connect(env.ws_url, "json", "s-res") as peer:
        await peer.send(syn_task(peer.session, "t1", "k1"))
        await peer.pump_until(lambda: peer.closed("t1"))
        assert deltas(peer, "t1") == [f"part {i}" for i in range(STEPS)]
        assert len([e for e in peer.events["t1"] if isinstance(e, S.StreamAccepted)]) == 1
        assert not any(isinstance(e, (S.FrameDropped, S.ProtocolViolation)) for e in peer.events["t1"])
        peer.final("t1")
    assert len(adapter.calls) == 1
    stream, client = env.router.ledger.state("stream:anonymous:t1"), env.router.ledger.state("client:anonymous")
    assert stream.committed_tokens == client.committed_tokens == 100 * STEPS


async def test_ws_resume_after_the_last_message_seen_continues_the_same_session(nursery, tmp_path, scripted):
    """A client that kept its session state re-opens with ``resume_after`` = the
    last router msg_seq it received: only what followed is sent (its session
    delivers it in order: no gap, no duplicate), then the stream goes on live."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted)
    async with connect(env.ws_url, "cbor", "s-keep") as peer:
        await peer.send(syn_task(peer.session, "t1", "k2"))
        await peer.pump_until(lambda: len(deltas(peer, "t1")) >= 3)
        kept, kept_events = peer.session, list(peer.events["t1"])
        last = max(e.msg_seq for e in kept_events if isinstance(e, S.MessageReceived))

    async with connect(env.ws_url, "cbor", "s-keep") as peer:
        peer.session, peer.events["t1"] = kept, kept_events
        resume = Frame(v=1, session_id="s-keep", stream_id="t1", msg_seq=0, flags=[Flag.SYN],
                       meta={**META, "idempotency_key": "k2", "resume_after": last})
        await peer.send(resume)
        await peer.pump_until(lambda: peer.closed("t1"))
    data = [f for f in peer.raw if f.stream_id == "t1" and f.payload is not None
            and f.payload.type is not PayloadType.CONTROL and Flag.ACK not in f.flags]
    assert data[0].msg_seq == last + 1  # nothing before what the client asked for
    assert deltas(peer, "t1") == [f"part {i}" for i in range(STEPS)]
    assert not any(isinstance(e, (S.FrameDropped, S.ProtocolViolation)) for e in peer.events["t1"])
    peer.final("t1")
    assert len(adapter.calls) == 1


async def test_duplicate_task_frame_after_a_reconnect_is_dropped(nursery, tmp_path, scripted):
    """After a reconnect the client re-opens (``resume_after``) and re-sends its
    task message (msg_seq 1), not knowing whether it arrived: the router's
    session drops the duplicate, so the agent is not called again."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted)
    async with connect(env.ws_url, "json", "s-dup") as peer:
        await peer.send(peer.session.open_stream("t1", {**META, "idempotency_key": "k3"}, WINDOW))
        await peer.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in peer.events["t1"]))
        task = peer.session.send_message("t1", Payload(type=PayloadType.TASK, content=CLEAN))
        await peer.send(task)
        await peer.pump_until(lambda: len(deltas(peer, "t1")) >= 1)
        kept, kept_events = peer.session, list(peer.events["t1"])
        last = max(e.msg_seq for e in kept_events if isinstance(e, S.MessageReceived))

    async with connect(env.ws_url, "json", "s-dup") as peer:
        peer.session, peer.events["t1"] = kept, kept_events
        await peer.send(Frame(v=1, session_id="s-dup", stream_id="t1", msg_seq=0, flags=[Flag.SYN],
                              meta={**META, "idempotency_key": "k3", "resume_after": last}))
        await peer.send(task)  # the very same frame again
        await peer.pump_until(lambda: peer.closed("t1"))
        peer.final("t1")
        assert peer.errors("t1") == []
        assert deltas(peer, "t1") == [f"part {i}" for i in range(STEPS)]
    assert len(adapter.calls) == 1


async def test_heartbeat_detects_a_dead_peer_and_its_stream_stays_resumable(nursery, tmp_path, scripted):
    """HB: the router sends HB every hb_interval_s; a peer silent for hb_timeout_s
    is dead: the connection is closed (1001, going away) and its stream detached —
    still running, not reset — and the client resumes it on a new connection."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted, hb_interval_s=0.1, hb_timeout_s=0.5)
    codec = FrameCodec("json")
    session = S.Session(S.Role.CLIENT, "s-hb", now=trio.current_time())
    received: list[Frame] = []
    t0 = trio.current_time()
    async with open_websocket_url(env.ws_url, subprotocols=["atp.v1.json"]) as ws:
        await ws.send_message(codec.encode(syn_task(session, "t1", "k4")).decode())
        with pytest.raises(ConnectionClosed) as ei, trio.fail_after(5):
            while True:  # read, never answer: a peer that stopped talking
                received.append(codec.decode(await ws.get_message()))
    assert ei.value.reason.code == 1001
    assert 0.5 <= trio.current_time() - t0 < 5
    hbs = [f for f in received if f.stream_id == S.HB_STREAM_ID]
    assert len(hbs) >= 3 and all(f.flags == [Flag.HB] for f in hbs)
    ctx = env.router.streams.find("anonymous", "t1")
    assert ctx.detached_at is not None and not ctx.log.closed

    async with connect(env.ws_url, "json", "s-hb") as peer:
        await peer.send(syn_task(peer.session, "t1", "k4"))
        await peer.pump_until(lambda: peer.closed("t1"))
        peer.final("t1")
    assert len(adapter.calls) == 1


async def test_stream_not_resumed_within_the_grace_period_is_reset_and_its_streamed_spend_committed(
        nursery, tmp_path, scripted):
    """Nobody comes back: after resume_grace_s the stream is reset (RST ETIMEOUT),
    the call is cancelled mid-way, and exactly the usage it streamed until then
    is committed — no more (not the estimate), no less."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted, resume_grace_s=0.3)
    async with connect(env.ws_url, "json", "s-gone") as peer:
        await peer.send(syn_task(peer.session, "t1", "k5"))
        await peer.pump_until(lambda: len(deltas(peer, "t1")) >= 2)
    ctx = env.router.streams.find("anonymous", "t1")
    with trio.fail_after(5):
        while not ctx.log.closed:
            await trio.sleep(0.01)
        while env.router.ledger.state("stream:anonymous:t1").open_reservations:
            await trio.sleep(0.01)
    last = ctx.log.events[-1].frame
    err = msgspec.convert(last.payload.content, dict)
    assert Flag.RST in last.flags and err["code"] == "ETIMEOUT" and "not resumed within 0.3 s" in err["reason"]
    state = env.router.ledger.state("stream:anonymous:t1")
    assert 2 <= len(adapter.yielded) < STEPS + 1  # cut mid-call
    assert state.committed_tokens == adapter.yielded[-1] and state.reserved_tokens == 0


async def test_http_client_drop_then_reopen_with_the_key_and_last_event_id(nursery, tmp_path, scripted):
    """The SDK's client goes away after two PARTIALs (its SSE request ends); a new
    client re-opens with the same idempotency key, gets the same stream, and
    ``last_event_id`` resumes right after the last event it had."""
    env, adapter = await env_with_streamer(nursery, tmp_path, scripted)
    seen: list[atp.Event] = []
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=CLEAN, idempotency_key="k6")
        async for ev in c.events(st):
            seen.append(ev)
            if sum(e.type == "PARTIAL" for e in seen) == 2:
                break
    async with atp.Client(env.url) as c:
        _, again = await c.open_stream(task=META, content=CLEAN, idempotency_key="k6")
        assert again.stream_id == st.stream_id
        rest = [ev async for ev in c.events(again, last_event_id=seen[-1].id)]
    ids = [ev.id for ev in seen + rest]
    assert ids == list(range(1, len(ids) + 1))  # no gap, no duplicate
    assert [ev.payload["delta"] for ev in seen + rest if ev.type == "PARTIAL" and "delta" in ev.payload] == [
        f"part {i}" for i in range(STEPS)]
    assert rest[-2].type == "FINAL" and rest[-1].type == "FIN"
    assert len(adapter.calls) == 1
    assert env.router.ledger.state(f"stream:anonymous:{st.stream_id}").committed_tokens == 100 * STEPS


async def test_another_clients_key_does_not_resume(nursery, tmp_path, scripted):
    """Keys are scoped to the tenant (its token): another tenant with the same key
    gets a stream of its own, and cannot see the first one's (404, as for an id
    that never existed)."""
    scripted["m.stream"] = Streamer("m.stream", delay_s=0.0)
    doc = {"agents": {"m.stream": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.stream"]}]}
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    env = await start_router(nursery, path, client_tokens={"alice": "tok-a", "bob": "tok-b"})
    async with atp.Client(env.url, "tok-a") as a, atp.Client(env.url, "tok-b") as b:
        _, sa = await a.open_stream(task=META, content=CLEAN, idempotency_key="same")
        _, sb = await b.open_stream(task=META, content=CLEAN, idempotency_key="same")
        await a.result(sa)
        await b.result(sb)
        with pytest.raises(atp.ATPClientError) as ei:
            [ev async for ev in a.events(sb)]
    assert sa.stream_id != sb.stream_id and (ei.value.code, ei.value.status) == ("EPROTO", 404)
    assert env.router.streams.find("alice", sa.stream_id).tenant == "alice"
    assert env.router.streams.find("bob", sb.stream_id).tenant == "bob"
    assert env.router.streams.find("alice", sb.stream_id) is None


# ------------------------------------------------------------------ frames after the router closed a stream

def _frames_of(peer: Peer, stream_id: str) -> list[tuple[list[Flag], dict | None]]:
    """(flags, ERROR content) of every frame the router sent on ``stream_id``, in order."""
    out = []
    for f in peer.raw:
        if f.stream_id == stream_id:
            c = f.payload.content if f.payload is not None and f.payload.type is PayloadType.CONTROL else None
            out.append((f.flags, c if isinstance(c, dict) and c.get("kind") == "ERROR" else None))
    return out


async def test_late_frames_on_a_stream_the_router_closed_never_draw_an_rst(nursery, tmp_path, scripted):
    """The router resets a stream (its only next-hop is down: RST EAGENTDOWN)
    while the client, not having read that RST yet, still ACKs, sends a
    BUDGET_UPDATE and a message on it; and ACKs a SYN the router refused. The
    client must see each stream's own RST as its only close, with its real
    cause: the late ACK and control frames are dropped (counted in
    ``atp_frames{direction="dropped"}``), the late message draws a lone ERROR
    EPROTO "stream is closed" — after the RST, never an RST of its own."""
    from atp_router.wire.frame import Budget, BudgetUpdate

    scripted["m.down"] = ScriptedAdapter("m.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 503")
    doc = {"agents": {"m.down": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.down"]}]}
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    env = await start_router(nursery, path)
    async with connect(env.ws_url, "json", "s-late") as peer:
        await peer.open("t1")
        await peer.send(peer.session.send_message("t1", Payload(type=PayloadType.TASK, content=CLEAN)))
        ctx = env.router.streams.find("anonymous", "t1")
        with trio.fail_after(5):
            while not ctx.log.closed:  # reset in the router; the client has not read it
                await trio.sleep(0.01)
        await peer.send(peer.session.ack("t1"))
        await peer.send(peer.session.send_control("t1", BudgetUpdate(budget=Budget(tokens=10))))
        await peer.send(peer.session.send_message("t1", Payload(type=PayloadType.TASK, content=CLEAN)))
        # A SYN the router refuses (meta.budget is not a budget), and the client's ACK sent right after it.
        await peer.send(peer.session.open_stream("t0", {**META, "budget": "lots"}, WINDOW))
        await peer.send(Frame(v=1, session_id="s-late", stream_id="t0", msg_seq=0, flags=[Flag.ACK]))
        await peer.pump_until(lambda: peer.closed("t1") and peer.closed("t0"))
        await peer.send(Frame(v=1, session_id="s-late", stream_id="t0", msg_seq=0, flags=[Flag.ACK]))
        with trio.move_on_after(0.5):  # the reply to the late message, and anything else, comes now
            await peer.pump_until(lambda: False)
    t1 = _frames_of(peer, "t1")
    closes = [(flags, e) for flags, e in t1 if Flag.RST in flags or Flag.FIN in flags]
    assert len(closes) == 1 and closes[0][1]["code"] == "EAGENTDOWN", t1
    late = [(i, flags, e) for i, (flags, e) in enumerate(t1) if e is not None and "stream is closed" in e["reason"]]
    assert len(late) == 1 and late[0][2]["code"] == "EPROTO" and Flag.RST not in late[0][1]
    assert late[0][0] > t1.index(closes[0])  # the stream's own RST came first
    t0 = _frames_of(peer, "t0")
    assert [e["code"] for flags, e in t0 if Flag.RST in flags] == ["EPROTO"] and len(t0) == 1
    assert "meta.budget" in t0[0][1]["reason"]
    dropped = {kind: env.router.metrics.frames.labels("dropped", kind)._value.get() for kind in ("ACK", "CTRL", "DATA")}
    # Our three ACKs (and the client session's own ACKs of what it read before the
    # RST), the BUDGET_UPDATE, the message.
    assert dropped["ACK"] >= 3 and dropped["CTRL"] == 1 and dropped["DATA"] == 1, dropped


# ------------------------------------------------------------------ a client leaving under a heartbeat

async def test_peer_gone_while_a_heartbeat_is_sent_ends_the_connection_without_a_traceback(tmp_path, scripted,
                                                                                            caplog):
    """The WebSocket watchdog sends HB on the sessions a connection carries. A
    client that goes away makes that send fail with ConnectionClosed while the
    receive loop still waits: a normal disconnect — the connection ends, its
    stream is detached (still resumable), and nothing is logged as an error.
    Real trio-websocket connections over an in-memory stream pair: the client's
    side stops reading, as a vanished TCP peer does, so the watchdog's HB is the
    first write to fail, deterministically."""
    from trio.testing import memory_stream_pair
    from trio_websocket import wrap_client_stream, wrap_server_stream

    from atp_router.deploy import single
    from atp_router.runtime.config import RouterConfig
    from atp_router.runtime.ingress.ws import _connection

    scripted["m.stream"] = Streamer("m.stream")
    doc = {"agents": {"m.stream": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.stream"]}]}
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    router = single.build(RouterConfig(policies=path, hb_interval_s=0.05, hb_timeout_s=30.0))
    codec = FrameCodec("json")
    client_end, server_end = memory_stream_pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(router.serve)
        client_ws = None

        async def dial() -> None:
            nonlocal client_ws
            client_ws = await wrap_client_stream(nursery, client_end, "localhost", "/")

        nursery.start_soon(dial)
        server_ws = await (await wrap_server_stream(nursery, server_end)).accept()
        session = S.Session(S.Role.CLIENT, "s-gone", now=trio.current_time())
        with trio.fail_after(5):
            while client_ws is None:
                await trio.sleep(0.01)
        await client_ws.send_message(codec.encode(syn_task(session, "t1", "k-gone")).decode())
        caplog.set_level("DEBUG")
        with trio.fail_after(5):
            async with trio.open_nursery() as conn:
                conn.start_soon(_connection, router, server_ws, codec, ANONYMOUS)
                while router.streams.find("anonymous", "t1") is None:
                    await trio.sleep(0.01)
                await client_end.receive_stream.aclose()  # the client stops reading: it is gone
        ctx = router.streams.find("anonymous", "t1")
        assert ctx.detached_at is not None and not ctx.log.closed
        nursery.cancel_scope.cancel()
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
    assert not any(r.exc_info for r in caplog.records)
