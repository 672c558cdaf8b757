"""The SDK over WebSocket (``atp.Client("ws://…")``, spec §4.1, §8, §11, §22)
against a real router in process, and its frames against the router's codec.

The client reaches the router's WebSocket port through :class:`Proxy`, a TCP
relay the test can stall (bytes from the router dropped, as if lost in flight)
and cut (both sockets closed at once): a dropped connection as a client sees
one. Every stream's events over WebSocket are compared with the router's own
log of the stream, its SSE events over HTTP (``GET /v1/streams/{id}/events``):
same ids, same types, same frames — no duplicate, no gap.
"""

from __future__ import annotations

import base64
import json
import sys
import textwrap

import atp
import msgspec
import pytest
import trio
from atp import _frames
from hypothesis import given, settings
from hypothesis import strategies as hst

import atp_router.runtime.ingress.ws as ingress_ws
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import FinalResult
from atp_router.wire.codec import FrameCodec, KeyRing, canonical_bytes
from atp_router.wire.frame import Frame
from tests.conftest import RouterEnv, start_router
from tests.helpers import golden, start_router_on
from tests.unit.test_router_dispatch import scripted_agent

META = {"task_type": "code_review", "languages": ["py"]}
BUDGET = {"usd": 0.10, "tokens": 200_000}
TASK = golden("bugsinpy-thefuck-23")


class Proxy:
    """A TCP relay to the router's WebSocket port. :meth:`stall` drops what the
    router sends on the connections relayed so far (``dropped`` counts the
    bytes); :meth:`cut` closes their two sockets at once; with ``refusing`` set
    new connections are closed as soon as they come. ``connections`` counts the
    connections made through it; ``seen`` keeps the first MiB the router sent."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self.dropped = 0
        self.refusing = False
        self.seen = bytearray()
        #: The live relays: cancel scope → stalled.
        self._live: dict[trio.CancelScope, bool] = {}
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"ws://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.start_soon(trio.serve_listeners, self._relay, listeners)
        return self.url

    async def _relay(self, client: trio.SocketStream) -> None:
        self.connections += 1
        if self.refusing:
            await trio.aclose_forcefully(client)
            return
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        with trio.CancelScope() as scope:
            self._live[scope] = False
            async with trio.open_nursery() as n:
                n.start_soon(self._pump, client, upstream, False, scope)
                n.start_soon(self._pump, upstream, client, True, scope)
        del self._live[scope]
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(upstream)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, down: bool, scope: trio.CancelScope) -> None:
        try:
            async for chunk in src:
                if down and self._live.get(scope):
                    self.dropped += len(chunk)
                    continue
                if down and len(self.seen) < 1 << 20:
                    self.seen += chunk
                await dst.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()  # one side is gone: the relay of this connection ends

    @property
    def stalled(self) -> bool:
        return any(self._live.values())

    def stall(self) -> None:
        for scope in self._live:
            self._live[scope] = True

    def cut(self) -> None:
        for scope in list(self._live):
            scope.cancel()


async def via_proxy(nursery: trio.Nursery, env: RouterEnv) -> Proxy:
    proxy = Proxy(int(env.ws_url.rsplit(":", 1)[1]))
    await proxy.start(nursery)
    return proxy


async def sse(env: RouterEnv, stream_id: str, token: str | None = None) -> list[atp.Event]:
    """The stream's events as the router logged them (HTTP SSE)."""
    async with atp.Client(env.url, token) as h:
        with trio.fail_after(30):
            return [ev async for ev in h.events(stream_id)]


def rows(events: list[atp.Event]) -> list[tuple[int, str, dict]]:
    return [(ev.id, ev.type, ev.frame) for ev in events]


async def until(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


@pytest.fixture
def follows(monkeypatch) -> list[tuple[str, int]]:
    """``(stream id, event id)`` each time the router's WebSocket ingress starts
    sending a stream's events after that event (a SYN opening or re-opening it)."""
    seen: list[tuple[str, int]] = []
    start = ingress_ws._start_follow

    def recording(conn, nursery, ctx, after):
        seen.append((ctx.stream_id, after))
        start(conn, nursery, ctx, after)

    monkeypatch.setattr(ingress_ws, "_start_follow", recording)
    return seen


class GatedAdapter(ScriptedAdapter):
    """A scripted next-hop that sends its first fragment at once and the others
    (``delay_s`` apart) once the test sets ``gate``: what the router sends
    after the first PARTIAL waits for the test."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.gate = trio.Event()

    async def stream(self, prompt):
        self.calls.append(prompt)
        for i, fragment in enumerate(self.fragments):
            if i:
                await self.gate.wait()
                await trio.sleep(self.delay_s)
            yield fragment


async def gated_router(nursery: trio.Nursery, tmp_path, scripted, **config) -> RouterEnv:
    """A router whose one next-hop (``scripted["gated"]``) streams text PARTIALs
    "one" (at once), then "two", "three", "four" and its FINAL 0.05 s apart once
    its gate is set."""
    scripted["gated"] = GatedAdapter.returning("gated", partials=["one", "two", "three", "four"], delay_s=0.05,
                                               summary="gated: done")
    rib = {"agents": {"gated": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["gated"]}]}
    return await start_router_on(nursery, tmp_path, rib, **config)


@pytest.fixture
async def gated_env(nursery, tmp_path, scripted) -> RouterEnv:
    return await gated_router(nursery, tmp_path, scripted)


# ------------------------------------------------------------------ a task over WebSocket

@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_task_runs_to_final_over_websocket(router_env, nursery, encoding):
    """JSON and CBOR: SYN with the task → SYN_ACK (window and route as over
    HTTP), PARTIALs, FINAL in the §7.3 shape, FIN; typed events whose ids and
    frames are the router's log (SSE); the subprotocol's framing on the wire;
    and the client's FIN frees the router's side of the stream."""
    proxy = await via_proxy(nursery, router_env)
    async with atp.Client(proxy.url, encoding=encoding) as c:
        assert c.transport == "websocket"
        session_id, st = await c.open_stream(task=META, budget=BUDGET, content=TASK)
        assert session_id == st.session_id
        assert st.window == {"max_parallel": 4, "max_tokens": 200_000, "max_usd_micros": 50_000}
        assert set(st.route["next_hops"]) == {"lint.ruff", "sec.bandit"} and st.route["policy"] == "code_review"
        with trio.fail_after(60):
            events = [ev async for ev in c.events(st)]
        assert await c.result(st) == events[-2].payload  # replayed from what the client holds
        sess = router_env.router.streams.get_session("anonymous", st.session_id)
        await until(lambda: sess.open_streams == ())  # our FIN answered the router's
    types = [ev.type for ev in events]
    assert types[0] == "SYN_ACK" and types[-2:] == ["FINAL", "FIN"] and types.count("PARTIAL") >= 2, types
    assert [ev.id for ev in events] == list(range(1, len(events) + 1))
    assert rows(events) == rows(await sse(router_env, st.stream_id))
    final = msgspec.convert(events[-2].payload, FinalResult)
    assert {p.split("#")[0] for f in final.result.findings for p in f.provenance} == {"lint.ruff", "sec.bandit"}
    json_framing = b'"session_id":' in proxy.seen
    assert json_framing is (encoding == "json") and b"session_id" in proxy.seen
    assert proxy.connections == 1


async def test_open_errors_carry_spec_codes(router_env):
    """A refused SYN raises the router's code: no route (EAGENTDOWN), a bad
    budget (EPROTO); a stream whose every next-hop is refused ends in RST
    EAGENTDOWN, which result() raises, and a BUDGET_UPDATE on it then has no
    answer; a stream this client never opened and the control API without
    ``http_url`` are EPROTO."""
    async with atp.Client(router_env.ws_url) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task={"task_type": "no_such_task"}, content=TASK)
        assert ei.value.code == "EAGENTDOWN"
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, budget={"usd": -1}, content=TASK)
        assert ei.value.code == "EPROTO" and "budget" in ei.value.reason
        _, st = await c.open_stream(task=META, content=TASK,
                                    window={"max_parallel": 0, "max_tokens": 1000, "max_usd_micros": 1000})
        with pytest.raises(atp.ATPClientError) as ei:
            await c.result(st)
        assert ei.value.code == "EAGENTDOWN"
        types = [ev.type async for ev in c.events(st)]
        assert types.count("ERROR") == 2 and types[-1] == "RST" and "FINAL" not in types
        assert await c.budget_update(st, usd=1.0) == []
        with pytest.raises(atp.ATPClientError) as ei:
            [ev async for ev in c.events("task_not_ours")]
        assert ei.value.code == "EPROTO" and "idempotency_key" in ei.value.reason
        with pytest.raises(atp.ATPClientError) as ei:
            await c.fib()
        assert ei.value.code == "EPROTO" and "http_url" in ei.value.reason


async def test_handshake_refuses_a_bad_token(nursery, policies_dir):
    env = await start_router(nursery, policies_dir, tokens=frozenset({"tok-good-0123456789"}))
    for token in (None, "tok-bad"):
        with pytest.raises(atp.ATPClientError) as ei:
            async with atp.Client(env.ws_url, token):
                pass
        assert (ei.value.code, ei.value.status) == ("ESEC", 401)
    async with atp.Client(env.ws_url, "tok-good-0123456789", http_url=env.url) as c:
        _, st = await c.open_stream(task=META, content=TASK)
        assert (await c.result(st))["result"]["findings"]
        assert [ev.id async for ev in c.events(st)] == [ev.id for ev in await sse(env, st.stream_id,
                                                                                   "tok-good-0123456789")]


# ------------------------------------------------------------------ idempotency and resumption

async def test_reopen_by_key_is_the_same_stream_over_both_transports(router_env):
    """§8: the same idempotency key gives the same stream — in the same client,
    in another WebSocket client later (events resumed from ``last_event_id``),
    and for a key opened over HTTP; the task runs once. Another task under the
    key is refused (EPROTO)."""
    router = router_env.router
    async with atp.Client(router_env.ws_url, encoding="cbor") as a:
        _, st = await a.open_stream(task=META, content=TASK, idempotency_key="ws-key-1")
        _, again = await a.open_stream(task=META, content=TASK, idempotency_key="ws-key-1")
        assert again == st
        first = [ev async for ev in a.events(st)]
    async with atp.Client(router_env.ws_url) as b:
        _, other = await b.open_stream(task=META, content=TASK, idempotency_key="ws-key-1")
        assert other.stream_id == st.stream_id and other.session_id == st.session_id  # the router's ids
        rest = [ev async for ev in b.events(other, last_event_id=2)]
        assert rows(rest) == rows(first)[2:]
        with pytest.raises(atp.ATPClientError) as ei:  # known here: refused without asking the router
            await b.open_stream(task=META, content=golden("bugsinpy-thefuck-1"), idempotency_key="ws-key-1")
        assert ei.value.code == "EPROTO" and "'ws-key-1'" in ei.value.reason
    async with atp.Client(router_env.ws_url) as c:
        with pytest.raises(atp.ATPClientError) as ei:  # the router's refusal
            await c.open_stream(task=META, content=golden("bugsinpy-thefuck-1"), idempotency_key="ws-key-1")
        assert ei.value.code == "EPROTO" and "'ws-key-1'" in ei.value.reason and ei.value.detail["code"] == "EPROTO"
    async with atp.Client(router_env.url) as h:
        _, over_http = await h.open_stream(task=META, content=TASK, idempotency_key="http-key-1")
    async with atp.Client(router_env.ws_url) as c:
        _, adopted = await c.open_stream(task=META, content=TASK, idempotency_key="http-key-1")
        assert (adopted.session_id, adopted.stream_id) == (over_http.session_id, over_http.stream_id)
        events = [ev async for ev in c.events(adopted)]
        assert events[-2].type == "FINAL"
    assert rows(events) == rows(await sse(router_env, over_http.stream_id))
    for key in ("ws-key-1", "http-key-1"):
        assert len([s for s in router.streams.values() if s.idempotency_key == key]) == 1


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_a_dropped_connection_resumes_with_no_duplicate_and_no_gap(gated_env, nursery, scripted, follows,
                                                                        encoding):
    """The connection is cut mid-stream after an ACKed BUDGET_UPDATE and after
    the router's next frames were dropped (lost in flight). The client
    reconnects and resumes with ``resume_after``: the router replays from its
    last complete message, before the ACK (a duplicate the client drops), and
    the client's events are exactly the router's log; the task ran once."""
    proxy = await via_proxy(nursery, gated_env)
    agent = scripted["gated"]
    async with atp.Client(proxy.url, encoding=encoding) as c:
        _, st = await c.open_stream(task=META, content=TASK)
        events: list[atp.Event] = []
        with trio.fail_after(30):
            async for ev in c.events(st):
                events.append(ev)
                if ev.type == "PARTIAL" and not agent.gate.is_set():
                    answer = await c.budget_update(st, usd=0.2)
                    assert [f["flags"] for f in answer] == [["ACK"]] and answer[0]["msg_seq"] == 1
                    proxy.stall()
                    agent.gate.set()
                    await until(lambda: proxy.dropped > 0)  # the router's next frames are lost
                    proxy.cut()
        assert proxy.connections == 2
    assert events[-2].type == "FINAL" and events[-1].type == "FIN"
    assert rows(events) == rows(await sse(gated_env, st.stream_id))
    ack = next(ev.id for ev in events if ev.type == "ACK")
    assert [ev.type for ev in events].count("ACK") == 1
    assert [sid for sid, _ in follows] == [st.stream_id] * 2
    assert follows[0][1] == 0 and 1 <= follows[1][1] < ack  # resumed after a PARTIAL, the ACK replayed
    assert len(agent.calls) == 1


async def test_a_syn_lost_in_flight_is_sent_again(gated_env, nursery, scripted, follows):
    """The router got the SYN but its SYN+ACK was lost with the connection: the
    client sends the SYN again on the new one, the router resumes the stream it
    opened (no second task), and open_stream returns it."""
    proxy = await via_proxy(nursery, gated_env)
    async with atp.Client(proxy.url) as c:
        proxy.stall()
        opened: list[atp.StreamHandle] = []

        async def open_() -> None:
            opened.append((await c.open_stream(task=META, content=TASK, idempotency_key="lost-syn"))[1])

        nursery.start_soon(open_)
        await until(lambda: any(s.idempotency_key == "lost-syn" for s in gated_env.router.streams.values()))
        proxy.cut()
        await until(lambda: bool(opened))
        scripted["gated"].gate.set()
        events = [ev async for ev in c.events(opened[0])]
    assert rows(events) == rows(await sse(gated_env, opened[0].stream_id))
    assert len(scripted["gated"].calls) == 1 and proxy.connections == 2
    assert follows == [(opened[0].stream_id, 0)] * 2  # opened, then re-opened from the start by the SYN again


async def test_a_silent_connection_is_declared_dead_and_replaced(nursery, tmp_path, scripted, follows):
    """Nothing from the router for ``hb_timeout_s`` (its frames stalled, the
    socket still open; its HBs every 0.2 s keep a live connection talking): the
    client drops the connection, reconnects and resumes both its streams."""
    env = await gated_router(nursery, tmp_path, scripted, hb_interval_s=0.2)
    proxy = await via_proxy(nursery, env)
    async with atp.Client(proxy.url, encoding="cbor", hb_timeout_s=0.8) as c:
        handles = [(await c.open_stream(task=META, content=TASK))[1] for _ in range(2)]
        first = [[ev async for ev in _until_type(c.events(h), "PARTIAL")] for h in handles]
        await trio.sleep(1.0)  # the router's HBs alone keep the connection up
        assert proxy.connections == 1
        proxy.stall()
        scripted["gated"].gate.set()
        with trio.fail_after(30):
            events = [[ev async for ev in c.events(h)] for h in handles]
    assert proxy.connections == 2 and proxy.dropped > 0
    for h, head, evs in zip(handles, first, events, strict=True):
        assert evs[-2].type == "FINAL" and rows(evs) == rows(await sse(env, h.stream_id))
        assert rows(head) == rows(evs)[:len(head)]
        assert [after > 0 for sid, after in follows if sid == h.stream_id] == [False, True]


async def _until_type(events, type_: str):
    async for ev in events:
        yield ev
        if ev.type == type_:
            return


async def test_reconnecting_gives_up_after_reconnect_s(gated_env, nursery, scripted):
    """A router out of reach for ``reconnect_s``: the waiting ``events()`` and
    every later call raise ETRANSPORT; a new client re-opens the stream by its
    key and gets all of it (the router ran it on meanwhile)."""
    proxy = await via_proxy(nursery, gated_env)
    async with atp.Client(proxy.url, reconnect_s=0.3) as c:
        _, st = await c.open_stream(task=META, content=TASK, idempotency_key="gives-up")
        with pytest.raises(atp.ATPClientError) as ei:
            with trio.fail_after(30):
                async for ev in c.events(st):
                    if ev.type == "PARTIAL":
                        proxy.refusing = True
                        proxy.cut()
        assert ei.value.code == "ETRANSPORT" and "0.3 s" in ei.value.reason
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, content=TASK)
        assert ei.value.code == "ETRANSPORT"
    assert proxy.connections >= 3  # tried again, with backoff
    scripted["gated"].gate.set()
    async with atp.Client(gated_env.ws_url) as again:
        _, same = await again.open_stream(task=META, content=TASK, idempotency_key="gives-up")
        assert same.stream_id == st.stream_id
        events = [ev async for ev in again.events(same)]
    assert events[-2].type == "FINAL" and rows(events) == rows(await sse(gated_env, st.stream_id))


# ------------------------------------------------------------------ signed frames

def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


K1, K2, WRONG = b"1" * 32, b"2" * 32, b"w" * 32
RING = f"k2:{_b64(K2)},k1:{_b64(K1)}"


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_signed_frames_are_accepted(nursery, policies_dir, encoding):
    """§11: a router keyed ``k2`` (signing) and ``k1`` accepts the SDK's frames
    signed with ``k1`` (``"k1:<base64>"``, a fresh nonce and ts each) — the SYN,
    a BUDGET_UPDATE, the heartbeats — and the SDK checks the router's ``k2``
    sigs (the same two keys, the other one first: a rotation in progress)."""
    env = await start_router(nursery, policies_dir, keyring=KeyRing.from_env(RING))
    proxy = await via_proxy(nursery, env)
    esec_before = env.router.metrics.errors.labels("ESEC")._value.get()
    async with atp.Client(proxy.url, encoding=encoding, keys=f"k1:{_b64(K1)},k2:{_b64(K2)}",
                          hb_interval_s=0.2) as c:
        _, st = await c.open_stream(task=META, content=TASK)
        answer = await c.budget_update(st, usd=0.5)
        assert answer[0]["flags"] == ["ACK"]
        await trio.sleep(0.5)  # heartbeats go out signed too
        assert (await c.result(st))["result"]["findings"]
        events = [ev async for ev in c.events(st)]
    assert rows(events) == rows(await sse(env, st.stream_id))
    assert b"k2:" in proxy.seen  # the router's frames carry its kid
    assert env.router.metrics.errors.labels("ESEC")._value.get() == esec_before


@pytest.mark.parametrize("keys", [WRONG, f"k9:{_b64(WRONG)}", None], ids=["wrong_key", "unknown_kid", "unsigned"])
async def test_a_wrong_key_is_refused_with_esec(nursery, policies_dir, keys):
    """A frame without a valid sig is refused with ESEC and opens nothing: the
    router's refusal (signed with a key the client cannot check) fails the open."""
    env = await start_router(nursery, policies_dir, keyring=KeyRing.from_env(RING))
    async with atp.Client(env.ws_url, keys=keys) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, content=TASK)
        assert ei.value.code == "ESEC"
        assert "sig" in ei.value.reason, ei.value.reason
    assert not list(env.router.streams.values())
    assert env.router.metrics.errors.labels("ESEC")._value.get() >= 1


async def test_a_single_raw_key_and_http_frames_are_signed_too(nursery, policies_dir):
    """The router's legacy one-key mode (``ATP_HMAC_KEY``: sig without a kid)
    over WebSocket; and the HTTP transport signs the frames it posts
    (BUDGET_UPDATE), which that router refuses unsigned (ESEC 403)."""
    env = await start_router(nursery, policies_dir, hmac_key=K1)
    async with atp.Client(env.ws_url, keys=K1) as c:
        _, st = await c.open_stream(task=META, content=TASK)
        assert (await c.result(st))["result"]["findings"]
    async with atp.Client(env.url, keys=K1) as signed, atp.Client(env.url) as unsigned:
        _, st = await signed.open_stream(task=META, content=TASK)
        assert [f["flags"] for f in await signed.budget_update(st, usd=0.3)] == [["ACK"]]
        with pytest.raises(atp.ATPClientError) as ei:
            await unsigned.budget_update(st, usd=0.3, msg_seq=2)
        assert (ei.value.code, ei.value.status) == ("ESEC", 403)


# ------------------------------------------------------------------ asyncio

_ASYNCIO = textwrap.dedent(
    """
    import asyncio, importlib.abc, json, sys

    url, encoding = sys.argv[1], sys.argv[2]
    BLOCKED = {"trio", "msgspec", "starlette", "hypercorn"} | ({"cbor2"} if encoding == "json" else set())

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: a client application does not have it")
            return None

    sys.meta_path.insert(0, Block())
    import atp

    async def relay(port):
        live, count = [], [0]

        async def handle(r, w):
            count[0] += 1
            ur, uw = await asyncio.open_connection("127.0.0.1", port)
            live.append((w, uw))

            async def pump(a, b):
                try:
                    while data := await a.read(65536):
                        b.write(data)
                        await b.drain()
                except OSError:
                    pass
                b.close()

            await asyncio.gather(pump(r, uw), pump(ur, w))

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server, live, count

    async def main(task):
        server, live, count = await relay(int(url.rsplit(":", 1)[1]))
        proxied = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        out = []
        async with atp.Client(proxied, encoding=encoding) as c:
            _, st = await c.open_stream(task={"task_type": "code_review"}, content=task)
            async for ev in c.events(st):
                out.append([ev.id, ev.type, ev.frame])
                if ev.type == "PARTIAL" and count[0] == 1 and live:
                    for w, uw in live:  # the connection drops, abruptly
                        w.transport.abort()
                        uw.transport.abort()
                    live.clear()
        server.close()
        return st.stream_id, out, count[0]

    stream_id, events, connections = asyncio.run(main(json.loads(sys.stdin.read())))
    leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print(json.dumps({"stream_id": stream_id, "events": events, "connections": connections, "leaked": leaked}))
    """
)


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_the_websocket_client_runs_under_asyncio(gated_env, nursery, scripted, follows, tmp_path, encoding):
    """The WebSocket client under asyncio, without the router's dependencies
    (trio, msgspec, starlette, hypercorn; cbor2 too for JSON): a stream to FINAL
    whose connection is aborted after the first PARTIAL and resumed (the rest
    of the task waits for the resumption), events = the router's log."""
    done: list[trio.CompletedProcess] = []

    async def run() -> None:
        done.append(await trio.run_process(
            [sys.executable, "-c", _ASYNCIO, gated_env.ws_url, encoding], stdin=json.dumps(TASK).encode(),
            capture_stdout=True, capture_stderr=True, cwd=tmp_path, check=False))

    nursery.start_soon(run)
    await until(lambda: len(follows) == 2 or bool(done), timeout=60)
    scripted["gated"].gate.set()
    await until(lambda: bool(done), timeout=60)
    proc = done[0]
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout)
    assert out["leaked"] == [] and out["connections"] == 2
    assert out["events"][-2][1] == "FINAL" and out["events"][-1][1] == "FIN"
    assert out["events"] == [list(r) for r in rows(await sse(gated_env, out["stream_id"]))]
    assert [after > 0 for _, after in follows] == [False, True]


# ------------------------------------------------------------------ frames, byte for byte

_json_value = hst.recursive(
    hst.none() | hst.booleans() | hst.integers(-(2**63), 2**64) | hst.floats(allow_nan=False, allow_infinity=False)
    | hst.text(max_size=12),
    lambda inner: hst.lists(inner, max_size=4) | hst.dictionaries(hst.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(meta=hst.dictionaries(hst.text(max_size=8), _json_value, max_size=5), content=_json_value,
       usd=hst.floats(min_value=0, max_value=1e6), flags=hst.sampled_from([[], ["SYN"], ["CTRL"], ["MORE"]]),
       frag=hst.integers(0, 3), qos=hst.sampled_from(["gold", "silver", "bronze"]), ttl=hst.integers(0, 255))
def test_sdk_frames_are_the_routers_byte_for_byte(meta, content, usd, flags, frag, qos, ttl):
    """The SDK's canonical bytes are the router's (``canonical_bytes``) for any
    JSON meta and content, defaults given or not; a frame the SDK seals and
    signs passes the router's codec in both encodings, and one the router seals
    and signs passes the SDK's checks."""
    frame = {"v": 1, "session_id": "s", "stream_id": "t", "msg_seq": 3, "frag_seq": frag, "flags": flags,
             "qos": qos, "ttl": ttl, "meta": meta,
             "payload": {"type": "agent.result.partial", "content": content, "cost_est": {"in_tokens": 0, "usd": usd}}}
    assert _frames.frame_canonical(frame) == canonical_bytes(msgspec.convert(frame, Frame))
    keys, ring = atp.FrameKeys.parse(RING), KeyRing.from_env(RING)
    for encoding in ("json", "cbor"):
        decoded = FrameCodec(encoding, keyring=ring).decode(_frames.encode(_frames.seal(frame, keys), encoding))
        back = FrameCodec(encoding, keyring=ring).encode(decoded)
        _frames.verify(_frames.decode(back.decode() if encoding == "json" else back, encoding), keys)


def test_frame_keys_sign_as_the_routers_key_ring():
    raw = b'{"v":1}'
    assert atp.FrameKeys.parse(RING).sign(raw) == KeyRing.from_env(RING).sign(raw)
    assert atp.FrameKeys.parse(RING).sign(raw).startswith("k2:")
    assert atp.FrameKeys.single(K1).sign(raw) == KeyRing.single(K1).sign(raw) and ":" not in KeyRing.single(K1).sign(raw)
    with pytest.raises(atp.ATPClientError) as ei:
        atp.FrameKeys.parse(f"k1:{_b64(K1)}").check(KeyRing.from_env(RING).sign(raw), raw)
    assert ei.value.code == "ESEC" and "'k2'" in ei.value.reason
    for bad in ("k1", f"k1:{_b64(b'short')}", "bad kid!:AAAA", f"k1:{_b64(K1)},k1:{_b64(K2)}", " , "):
        with pytest.raises(ValueError):
            atp.FrameKeys.parse(bad)
    with pytest.raises(ValueError):
        _frames.seal({"v": 1, "session_id": "s", "stream_id": "t", "msg_seq": 1, "meta": {"x": float("nan")}})
