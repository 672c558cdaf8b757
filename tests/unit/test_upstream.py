"""The lean upstream client (atp_router.adapters.upstream, issue 25 item 3) against
real loopback servers: a raw trio HTTP/1.1 server (keep-alive, one answer script per
request) and the same over TLS with a trustme CA made here."""

from __future__ import annotations

import functools
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trustme

from atp_router.adapters import upstream
from atp_router.adapters.http import RetryPolicy
from atp_router.wire.errors import AgentError, ErrorCode

Answer = Callable[[trio.abc.Stream], Awaitable[bool]]  # writes one answer; False closes the connection


class Server:
    """Reads requests (head + content-length body) on each connection and answers each
    with the next of ``answers``; counts connections."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.connections = 0
        self.heads: list[bytes] = []
        self.url = ""

    async def handle(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                need = int(m[1]) if m else 0
                while len(buf) < need:
                    buf += await stream.receive_some(65536)
                buf = buf[need:]
                self.heads.append(head)
                if not await self.answers.pop(0)(stream):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


async def start(nursery: trio.Nursery, server: Server, tls: ssl.SSLContext | None = None) -> Server:
    handler: Any = server.handle
    if tls is not None:
        async def handler(tcp: trio.SocketStream) -> None:
            s = trio.SSLStream(tcp, tls, server_side=True, https_compatible=True)
            try:
                await s.do_handshake()
            except trio.BrokenResourceError:
                return
            await server.handle(s)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://localhost:{port}/v1/x"
    return server


def raw(data: bytes, keep: bool = True, then: Callable[[], Awaitable[None]] | None = None) -> Answer:
    async def answer(stream: trio.abc.Stream) -> bool:
        await stream.send_all(data)
        if then is not None:
            await then()
        return keep

    return answer


def length(body: bytes, status: str = "200 OK", headers: bytes = b"") -> Answer:
    return raw(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n" % (status.encode(), len(body), headers) + body)


def chunked(pieces: list[bytes], ctype: bytes = b"text/event-stream") -> Answer:
    data = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % ctype
    data += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return raw(data)


async def body_of(client: upstream.UpstreamClient, url: str) -> bytes:
    async with await client.send("POST", url, {"authorization": "Bearer k"}, b"{}", "application/json") as r:
        return await r.read(1 << 20)


async def test_keep_alive_reuse_with_content_length_and_chunked_bodies(nursery: trio.Nursery) -> None:
    server = await start(nursery, Server([length(b"hello"), chunked([b"ab", b"cd"]), length(b"")]))
    client = upstream.UpstreamClient(timeout_s=2)
    assert await body_of(client, server.url) == b"hello"
    assert await body_of(client, server.url) == b"abcd"
    assert await body_of(client, server.url) == b""
    assert server.connections == 1 and client.opened == 1 and client.idle(server.url) == 1
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/x HTTP/1.1") and "authorization: Bearer k" in head
    assert "content-length: 2" in head and re.search(r"host: localhost:\d+", head)
    await client.aclose()


async def test_a_body_left_unread_is_not_reused(nursery: trio.Nursery) -> None:
    server = await start(nursery, Server([length(b"x" * 1_000_000), length(b"ok")]))
    client = upstream.UpstreamClient(timeout_s=2)
    async with await client.send("GET", server.url) as r:
        assert r.status == 200  # closed without reading the body
    assert client.idle(server.url) == 0
    assert await body_of(client, server.url) == b"ok"
    assert server.connections == 2 and client.opened == 2
    await client.aclose()


async def test_server_closing_mid_body_is_agentdown_and_not_reused(nursery: trio.Nursery) -> None:
    cut = raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this", keep=False)
    server = await start(nursery, Server([cut, length(b"ok")]))
    client = upstream.UpstreamClient(timeout_s=2)
    with pytest.raises(upstream.RemoteProtocolError) as e:
        await body_of(client, server.url)
    err = upstream.transport_error(e.value, server.url, 2000)
    assert err.code is ErrorCode.EAGENTDOWN and "complete message body" in err.reason
    assert client.idle(server.url) == 0
    assert await body_of(client, server.url) == b"ok" and server.connections == 2
    await client.aclose()


async def test_slow_server_is_a_read_timeout(nursery: trio.Nursery) -> None:
    stall = raw(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", then=trio.sleep_forever)
    server = await start(nursery, Server([stall]))
    client = upstream.UpstreamClient(timeout_s=0.2)
    t0 = trio.current_time()
    with pytest.raises(upstream.ReadTimeout) as e:
        await body_of(client, server.url)
    assert 0.15 < trio.current_time() - t0 < 2
    err = upstream.transport_error(e.value, server.url, 200)
    assert (err.code, err.reason) == (ErrorCode.ETIMEOUT, "ReadTimeout after 200 ms")
    await client.aclose()


async def test_an_answer_over_the_cap_is_eproto(nursery: trio.Nursery) -> None:
    server = await start(nursery, Server([chunked([b"x" * 600, b"y" * 600])]))
    client = upstream.UpstreamClient(timeout_s=2, max_body_bytes=1000)
    with pytest.raises(upstream.TooLarge) as e:
        await body_of(client, server.url)
    assert upstream.transport_error(e.value, server.url, 2000).code is ErrorCode.EPROTO
    assert client.idle(server.url) == 0
    await client.aclose()


async def test_a_compressed_answer_is_refused(nursery: trio.Nursery) -> None:
    server = await start(nursery, Server([length(b"\x1f\x8b", headers=b"content-encoding: gzip\r\n")]))
    client = upstream.UpstreamClient(timeout_s=2)
    with pytest.raises(upstream.UnsupportedEncoding):
        await body_of(client, server.url)
    await client.aclose()


async def test_connect_refused_is_agentdown() -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = upstream.UpstreamClient(timeout_s=2)
    with pytest.raises(upstream.ConnectError) as e:
        await body_of(client, f"http://127.0.0.1:{port}/")
    assert "cannot connect" in upstream.transport_error(e.value, "b", 2000).reason


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _server_tls(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(ctx)
    return ctx


async def test_tls_with_a_trusted_ca(nursery: trio.Nursery, ca: trustme.CA) -> None:
    server = await start(nursery, Server([length(b"secure"), length(b"again")]), _server_tls(ca))
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    client = upstream.UpstreamClient(timeout_s=2, ssl_context=trusted)
    assert await body_of(client, server.url) == b"secure"
    assert await body_of(client, server.url) == b"again"
    assert client.opened == 1 and server.connections == 1
    await client.aclose()


async def test_tls_refuses_an_untrusted_certificate(nursery: trio.Nursery, ca: trustme.CA) -> None:
    server = await start(nursery, Server([length(b"secure")]), _server_tls(ca))
    client = upstream.UpstreamClient(timeout_s=2, ssl_context=ssl.create_default_context())
    with pytest.raises(upstream.ConnectError) as e:
        await body_of(client, server.url)
    err = upstream.transport_error(e.value, server.url, 2000)
    assert err.code is ErrorCode.EAGENTDOWN and "CERTIFICATE_VERIFY_FAILED" in err.reason
    assert server.heads == []  # nothing was sent over the refused connection


async def test_429_retry_after_is_retried_then_raised(nursery: trio.Nursery) -> None:
    busy = length(b'{"error":"slow down"}', "429 Too Many", b"retry-after: 0\r\n")
    server = await start(nursery, Server([busy, length(b"late", "429 Too Many", b"retry-after: 3\r\n")]))
    client = upstream.UpstreamClient(timeout_s=2)
    policy = RetryPolicy(retries=2, base_ms=1, cap_ms=1000)
    with pytest.raises(AgentError) as e:
        async with upstream.open_upstream(client, "POST", server.url, json={"a": 1}, retry=policy):
            pass
    assert (e.value.code, e.value.retry_after_ms) == (ErrorCode.EAGENTDOWN, 3000)
    assert "HTTP 429 from http://localhost" in e.value.reason and "late" in e.value.reason
    assert len(server.heads) == 2 and client.idle(server.url) == 1  # error bodies read to the end: reused
    await client.aclose()


def _events(pieces: list[bytes]) -> list[bytes]:
    dec = upstream.SSEDecoder(max_line=64)
    out: list[bytes] = []
    for p in pieces:
        dec.feed(p)
        while (d := dec.next()) is not None:
            out.append(bytes(d))
    return out


def test_sse_decoder_lines_fields_and_splits() -> None:
    stream = b": comment\r\ndata: a\r\ndata:b\r\n\r\nevent: x\n\ndata: c\rid: 7\r\rdata: tail"
    expected = [b"a\nb", b"", b"c"]
    assert _events([stream]) == expected
    assert _events([stream[i : i + 1] for i in range(len(stream))]) == expected  # byte by byte
    assert _events([b"\n\n\n", b"datax: no\n\n", b"data\n\n"]) == [b""]
    with pytest.raises(upstream.TooLarge):
        _events([b"data: " + b"x" * 100])
