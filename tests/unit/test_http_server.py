"""The lean HTTP/1.1 server (``atp_router.runtime.ingress.server``) on real sockets:
a Starlette app served by it, driven by httpx (keep-alive, SSE, HEAD, TLS) and by raw
sockets for the shapes a well-behaved client never sends (pipelining, oversize heads
and bodies, slow-loris, malformed requests, upgrades, a client that leaves mid-stream)."""

from __future__ import annotations

import json
import socket
import ssl
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from atp_router.runtime.ingress.listen import listen_tcp
from atp_router.runtime.ingress.server import ServerLimits, serve_lean


class Events:
    def __init__(self) -> None:
        self.sse_cancelled = trio.Event()
        self.lifespan: list[str] = []


def make_app(ev: Events) -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"n": len(body), "path": request.url.path, "q": request.url.query,
                             "head": request.headers.get("x-h", "")})

    async def sse(request: Request) -> Response:
        async def gen() -> Any:
            try:
                for i in range(int(request.query_params.get("n", "1000000"))):
                    yield f"data: {i}\n\n"
                    await trio.sleep(0.01)
            except BaseException:
                ev.sse_cancelled.set()
                raise
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def boom(request: Request) -> Response:
        raise ValueError("secret detail")

    async def empty(request: Request) -> Response:
        return Response(status_code=204)

    async def lifespan(app: Starlette) -> Any:
        ev.lifespan.append("startup")
        yield
        ev.lifespan.append("shutdown")

    from contextlib import asynccontextmanager
    return Starlette(routes=[Route("/echo", echo, methods=["GET", "POST", "HEAD"]), Route("/sse", sse),
                             Route("/boom", boom), Route("/empty", empty)],
                     lifespan=asynccontextmanager(lifespan))


LIMITS = ServerLimits(max_head_bytes=8 * 1024, max_headers=20, max_body_bytes=1 << 20, head_timeout_s=0.5,
                      keep_alive_s=1.0, body_timeout_s=0.5, max_connections=64)


async def start(nursery: trio.Nursery, ev: Events, tls: ssl.SSLContext | None = None,
                limits: ServerLimits = LIMITS) -> int:
    sock = listen_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    await nursery.start(lambda task_status: serve_lean(make_app(ev), [sock], ssl_context=tls, limits=limits,
                                                       task_status=task_status))
    return port


async def raw(port: int, data: bytes, *, read_until_close: bool = True, timeout: float = 5.0) -> bytes:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(data)
    out = b""
    with trio.move_on_after(timeout):
        while True:
            chunk = await s.receive_some(65536)
            if not chunk:
                break
            out += chunk
            if not read_until_close and b"\r\n\r\n" in out:
                break
    await s.aclose()
    return out


async def test_keep_alive_json_and_query_through_httpx(nursery: trio.Nursery) -> None:
    ev = Events()
    port = await start(nursery, ev)
    assert ev.lifespan == ["startup"]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        for i in range(3):
            r = await c.post(f"/echo?x={i}", content=b"a" * (1000 * i), headers={"x-h": "v"})
            assert r.status_code == 200 and r.json() == {"n": 1000 * i, "path": "/echo", "q": f"x={i}", "head": "v"}
            assert r.headers["date"] and r.http_version == "HTTP/1.1"
        r = await c.head("/echo")
        assert r.status_code == 200 and r.content == b""
        r = await c.get("/empty")
        assert r.status_code == 204 and "content-length" not in r.headers
        r = await c.get("/nowhere")
        assert r.status_code == 404


async def test_sse_is_streamed_chunked_and_ends(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    async with httpx.AsyncClient() as c, c.stream("GET", f"http://127.0.0.1:{port}/sse?n=5") as r:
        assert r.headers["transfer-encoding"] == "chunked"
        got = [line async for line in r.aiter_lines() if line]
    assert got == [f"data: {i}" for i in range(5)]


async def test_a_client_leaving_mid_stream_cancels_the_handler(nursery: trio.Nursery) -> None:
    ev = Events()
    port = await start(nursery, ev)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(b"GET /sse HTTP/1.1\r\nhost: x\r\n\r\n")
    assert b"data: 0" in await s.receive_some(65536)
    await s.aclose()
    with trio.fail_after(5):
        await ev.sse_cancelled.wait()


async def test_a_client_resetting_mid_stream_is_a_disconnect_not_an_app_error(nursery: trio.Nursery,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A client that resets the connection (RST) while a response streams: the
    handler sees ``http.disconnect`` and is cancelled; nothing is logged as the app failing."""
    ev = Events()
    port = await start(nursery, ev)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(b"GET /sse HTTP/1.1\r\nhost: x\r\n\r\n")
    assert b"data: 0" in await s.receive_some(65536)
    s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await s.aclose()  # SO_LINGER 0: the close is a reset
    with trio.fail_after(5):
        await ev.sse_cancelled.wait()
    await trio.sleep(0.1)
    assert not [r for r in caplog.records if "the app failed" in r.getMessage()], caplog.text


async def test_pipelined_requests_are_answered_in_order(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    reqs = b"".join(b"GET /echo?i=%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3))
    out = await raw(port, reqs + b"GET /echo?i=9 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 4
    assert [out.index(b'"q":"i=%d"' % i) for i in (0, 1, 2, 9)] == sorted(out.index(b'"q":"i=%d"' % i)
                                                                       for i in (0, 1, 2, 9))
    assert out.rstrip().endswith(b'"head":""}')  # closed after the last, as asked


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
    (b"GET /echo HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(25)) + b"\r\n", b"431"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2000000\r\n\r\n" + b"a" * 1_100_000, b"413"),
    (b"GET /echo HTTP/1.1\r\nhost: x\r\ncontent-length: zz\r\n\r\n", b"400"),
    (b"NOT A REQUEST\r\n\r\n", b"400"),
    (b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n", b"501"),
    (b"GET /%ff HTTP/1.1\r\nhost: x\r\n\r\n", b"404"),  # percent-escapes are the app's to read
    (b"GET /\xff HTTP/1.1\r\nhost: x\r\n\r\n", b"400"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd", b"400"),
], ids=["head-bytes", "header-count", "declared-body", "bad-length", "garbage", "upgrade", "escaped", "non-ascii",
        "smuggling-te-and-cl", "smuggling-two-cl"])
async def test_bad_requests_get_a_status_and_the_connection_closes(nursery: trio.Nursery, request_bytes: bytes,
                                                                   status: bytes) -> None:
    port = await start(nursery, Events())
    out = await raw(port, request_bytes)
    assert out.startswith(b"HTTP/1.1 " + status), out[:200]
    if status != b"404":
        assert b"connection: close" in out and b"Traceback" not in out


async def test_a_streamed_body_past_the_limit_is_413(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    out = b""
    with trio.move_on_after(5):
        for _ in range(40):
            try:
                await s.send_all(b"10000\r\n" + b"a" * 0x10000 + b"\r\n")
            except trio.BrokenResourceError:
                break
    with trio.move_on_after(5):
        while chunk := await s.receive_some(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 413")


async def test_an_app_error_is_a_plain_500_without_the_traceback(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    out = await raw(port, b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 500") and b"secret detail" not in out and b"Traceback" not in out


async def test_slow_loris_and_idle_connections_are_closed(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    s = await trio.open_tcp_stream("127.0.0.1", port)
    t0 = trio.current_time()
    with trio.fail_after(5):
        for part in (b"GET /echo HTTP/1.1\r\n", b"host: x\r\n", b"x-a: 1\r\n", b"x-b: 1\r\n", b"x-c: 1\r\n"):
            try:
                await s.send_all(part)
            except trio.BrokenResourceError:
                break
            await trio.sleep(0.2)
        assert await s.receive_some(100) == b""  # closed by the head timeout (0.5 s), nothing answered
    assert trio.current_time() - t0 < 2.0
    idle = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(5):
        assert await idle.receive_some(100) == b""  # keep-alive 1 s


async def test_expect_100_continue(nursery: trio.Nursery) -> None:
    port = await start(nursery, Events())
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n")
    with trio.fail_after(5):
        assert (await s.receive_some(100)).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        await s.send_all(b"abc")
        assert b'"n":3' in await s.receive_some(65536)
    await s.aclose()


async def test_connections_beyond_the_bound_wait_for_a_slot(nursery: trio.Nursery) -> None:
    limits = ServerLimits(max_connections=2, keep_alive_s=30)
    port = await start(nursery, Events(), limits=limits)
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
    for h in held:
        await h.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        assert b"200 OK" in await h.receive_some(65536)
    third = await trio.open_tcp_stream("127.0.0.1", port)  # in the backlog
    await third.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
    with trio.move_on_after(0.5):
        await third.receive_some(65536)
        pytest.fail("a third connection was served past max_connections=2")
    await held[0].aclose()
    with trio.fail_after(5):
        assert b"200 OK" in await third.receive_some(65536)


async def test_one_peer_cannot_hold_the_slots_of_others(nursery: trio.Nursery) -> None:
    """Over ``max_connections_per_peer`` a peer's connection is answered 429 EWINDOW and
    closed at accept; another address is served meanwhile; a freed slot is reused."""
    limits = ServerLimits(max_connections=64, max_connections_per_peer=2, keep_alive_s=30)
    port = await start(nursery, Events(), limits=limits)
    get = b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n"
    held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
    for h in held:
        await h.send_all(get)
        assert b"200 OK" in await h.receive_some(65536)
    refused = await raw(port, get)
    assert refused.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in refused, refused
    head, _, body = refused.partition(b"\r\n\r\n")
    assert json.loads(body) == {"error": {"code": "EWINDOW", "reason": "too many connections from this address"}}
    assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
    other = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
    await other.send_all(get)
    with trio.fail_after(5):
        assert b"200 OK" in await other.receive_some(65536)
    await other.aclose()
    await held[0].aclose()
    with trio.fail_after(5):
        while True:  # the server sees the close when its connection task next reads
            again = await raw(port, get, read_until_close=False)
            if b"200 OK" in again:
                break
            await trio.sleep(0.05)
    await held[1].aclose()


def test_peer_slots_bookkeeping() -> None:
    from atp_router.flow.peer_slots import PeerSlots

    slots = PeerSlots(2)
    assert slots.admit("a") and slots.admit("a") and not slots.admit("a") and slots.admit("b")
    assert (slots.pending("a"), slots.refused, slots.peers()) == (2, 1, 2)
    slots.done("a"), slots.done("a"), slots.done("b")
    assert slots.peers() == 0 and slots.admit("a")
    with pytest.raises(ValueError):
        PeerSlots(0)


async def test_tls_http11(nursery: trio.Nursery, tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(server_ctx)
    server_ctx.set_alpn_protocols(["http/1.1"])
    port = await start(nursery, Events(), tls=server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with httpx.AsyncClient(verify=client_ctx) as c:
        r = await c.post(f"https://127.0.0.1:{port}/echo", content=b"xyz")
        assert r.status_code == 200 and r.json()["n"] == 3
    out = await raw(port, b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")  # plain HTTP to the TLS port
    assert b"200 OK" not in out


def test_the_http_server_option_resolves_auto_by_tls(tmp_path: Path) -> None:
    from atp_router.deploy.http_serve import server_of
    from atp_router.runtime.config import RouterConfig

    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    from atp_router.security.tls import ServerTls

    tls = ServerTls(cert, key)
    assert server_of(RouterConfig(policies=tmp_path)) == "lean"
    assert server_of(RouterConfig(policies=tmp_path, tls=tls)) == "hypercorn"  # HTTP/2 kept for HTTPS
    assert server_of(RouterConfig(policies=tmp_path, tls=tls, http_server="lean")) == "lean"
    assert server_of(RouterConfig(policies=tmp_path, http_server="hypercorn")) == "hypercorn"


@pytest.mark.parametrize("kind", ["lean", "hypercorn"])
async def test_serve_http_serves_the_app_with_either_server(nursery: trio.Nursery, tmp_path: Path, kind: str) -> None:
    from atp_router.deploy.http_serve import serve_http
    from atp_router.runtime.config import RouterConfig

    ev = Events()
    config = RouterConfig(policies=tmp_path, http_server=kind)  # type: ignore[arg-type]
    binds = await nursery.start(lambda task_status: serve_http(make_app(ev), config, ["127.0.0.1:0"],
                                                               task_status=task_status))
    port = int(binds[0].rsplit(":", 1)[1])
    async with httpx.AsyncClient() as c:
        r = await c.post(f"http://127.0.0.1:{port}/echo?a=1", content=b"abc")
    assert r.json() == {"n": 3, "path": "/echo", "q": "a=1", "head": ""} and ev.lifespan == ["startup"]


async def test_pipelined_bytes_during_a_stream_are_not_read_past_the_next_request(nursery: trio.Nursery) -> None:
    """A client that pipelines while a response streams: the server parses the next
    request's head, then reads no further until the stream ends (the socket's buffers
    fill and the client blocks) — its queue of requests is bounded, not its sending."""
    port = await start(nursery, Events(), limits=ServerLimits(keep_alive_s=30))
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(b"GET /sse?n=300 HTTP/1.1\r\nhost: x\r\n\r\n")  # ~3 s of events
    assert b"data: 0" in await s.receive_some(65536)
    one = b"GET /echo HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 4000 + b"\r\n\r\n"
    sent = 0
    with trio.move_on_after(1.5):
        while sent < 256 * 1024 * 1024:
            await s.send_all(one * 64)
            sent += len(one) * 64
    assert sent < 64 * 1024 * 1024, f"the server read {sent} pipelined bytes during one stream"
    await s.aclose()


async def test_a_send_after_the_client_left_is_a_disconnect_not_an_app_error(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """A raw ASGI app streaming without watching ``receive``: once the client is gone, its
    send raises an ``OSError`` (ASGI 2.4, the scope's ``spec_version``) or the server's
    disconnect watch cancels it — either way it stops, and no "app failed" is logged."""
    finished, seen = trio.Event(), []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        assert scope["asgi"]["spec_version"] == "2.4"
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(2000):
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            seen.append("sent all")
        except OSError:
            seen.append("OSError")
            raise
        except trio.Cancelled:
            seen.append("cancelled")
            raise
        finally:
            finished.set()

    sock = listen_tcp("127.0.0.1", 0)
    await nursery.start(lambda task_status: serve_lean(app, [sock], limits=LIMITS, task_status=task_status))
    s = await trio.open_tcp_stream("127.0.0.1", sock.getsockname()[1])
    await s.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await s.receive_some(65536)).startswith(b"HTTP/1.1 200")
    s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await s.aclose()  # a reset: the server's next writes fail
    with trio.fail_after(10):
        await finished.wait()
    assert seen in (["OSError"], ["cancelled"]) and "the app failed" not in caplog.text


async def test_a_silent_stream_whose_client_left_is_cancelled(nursery: trio.Nursery,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A streaming response that sends nothing for a while (an SSE stream waiting on a slow
    model) is cancelled soon after its client leaves — by the server's disconnect watch,
    not at its next send — so what it holds (a model call) stops at once."""
    started, cancelled_at = trio.Event(), []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        started.set()
        try:
            await trio.sleep(60)  # silent
        except trio.Cancelled:
            cancelled_at.append(trio.current_time())
            raise
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sock = listen_tcp("127.0.0.1", 0)
    await nursery.start(lambda task_status: serve_lean(app, [sock], limits=LIMITS, task_status=task_status))
    # past the watch's delay: a streaming response that lasts is watched
    assert await _leave(sock, lambda: started, cancelled_at, after_s=0.3) < 1.0
    assert "the app failed" not in caplog.text

    # A response whose head waits for its first chunk (an SSE stream waiting for its first
    # event): its client leaving is seen too, and nothing is logged or answered.
    async def held_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started_held.set()
        try:
            await trio.sleep(60)  # no chunk yet: nothing has gone out
        except trio.Cancelled:
            cancelled_held.append(trio.current_time())
            raise

    started_held, cancelled_held = trio.Event(), []
    sock2 = listen_tcp("127.0.0.1", 0)
    await nursery.start(lambda task_status: serve_lean(held_app, [sock2], limits=LIMITS, task_status=task_status))
    assert await _leave(sock2, lambda: started_held, cancelled_held) < 1.0
    await trio.sleep(0.1)
    assert "without a complete response" not in caplog.text and "the app failed" not in caplog.text

    # A second connection, its client gone before the watch's delay: still cancelled.
    started = trio.Event()
    cancelled_at.clear()
    assert await _leave(sock, lambda: started, cancelled_at) < 1.0


async def _leave(sock: socket.socket, started: Any, cancelled: list[float], *, after_s: float = 0.0) -> float:
    """A GET to ``sock``'s server; once its app has begun answering (``started()``'s event)
    and ``after_s`` more, the client closes: how long (s) until the app was cancelled."""
    s = await trio.open_tcp_stream("127.0.0.1", sock.getsockname()[1])
    await s.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await started().wait()
    await trio.sleep(after_s)
    left = trio.current_time()
    await s.aclose()
    with trio.fail_after(5):
        while not cancelled:
            await trio.sleep(0.01)
    return cancelled[0] - left


async def test_lean_under_server_tls_is_tls13_http11_and_keeps_mtls(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``--http-server lean`` with ``--tls-cert``: the router's own ServerTls context
    (TLS 1.3 only, client certificates required when configured); ALPN offers only
    http/1.1, so a client asking for HTTP/2 gets HTTP/1.1 (what lean gives up)."""
    from atp_router.deploy.http_serve import serve_http
    from atp_router.runtime.config import RouterConfig
    from atp_router.security.tls import ServerTls

    ca = trustme.CA()
    paths = {n: tmp_path / f"{n}.pem" for n in ("cert", "key", "ca")}
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    tls = ServerTls(paths["cert"], paths["key"], client_ca_file=paths["ca"], require_client_cert=True)
    config = RouterConfig(policies=tmp_path, tls=tls, http_server="lean")
    binds = await nursery.start(lambda task_status: serve_http(make_app(Events()), config, ["127.0.0.1:0"],
                                                               task_status=task_status))
    url = f"https://localhost:{int(binds[0].rsplit(':', 1)[1])}/echo"

    def client_ctx(with_cert: bool, max_version: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        ctx.maximum_version = max_version
        if with_cert:
            ca.issue_cert("client@example").configure_cert(ctx)
        return ctx

    async with httpx.AsyncClient(verify=client_ctx(True), http2=True) as c:
        r = await c.post(url, content=b"ab")
    assert (r.status_code, r.http_version, r.json()["n"]) == (200, "HTTP/1.1", 2)
    for ctx in (client_ctx(False), client_ctx(True, ssl.TLSVersion.TLSv1_2)):
        async with httpx.AsyncClient(verify=ctx) as c:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await c.post(url, content=b"ab")


async def test_cancelling_the_server_runs_the_lifespan_shutdown_and_closes_the_listener() -> None:
    """Shutdown (the CLI cancels on SIGTERM): open connections end, the app's lifespan
    shutdown runs (shielded, at most 5 s), the listening socket is closed."""
    ev = Events()
    async with trio.open_nursery() as nursery:
        port = await start(nursery, ev, limits=ServerLimits(keep_alive_s=30))
        held = await trio.open_tcp_stream("127.0.0.1", port)  # an idle keep-alive connection
        nursery.cancel_scope.cancel()
    assert ev.lifespan == ["startup", "shutdown"]
    with trio.fail_after(5):
        assert await held.receive_some(100) == b""
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
