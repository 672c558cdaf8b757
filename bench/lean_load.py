"""A lean HTTP/1.1 load generator for the router's HTTP+SSE task (bench only).

bench_gateway.py's ``Drivers`` runs a task with httpx on trio: 3–4.5 ms of the
client's CPU a task, a whole core of this 2-core machine at ~230 tasks/s, so a
closed loop measures what the load generator leaves to the routers, not what
they serve. This driver does what wrk or h2load would do: one pre-built request
written per step on a kept-alive connection, the answer framed by httptools (the
C parser; Content-Length and chunked), no per-request objects beyond the bytes.
It checks each task as ``Drivers`` does — ``POST /v1/streams`` answered 2xx with a
``stream_id``, then ``GET /v1/streams/{id}/events`` 200 to a FINAL with the mock's
text — and counts anything else as a failed task.

    async with LeanDrivers({"atp_http": url}, {"atp_http": key}) as d:
        ok = await d.run("atp_http")

Why not the router's own lean client (``atp_router.adapters.upstream.UpstreamClient``,
httptools on trio too): it is a production client — per-request head building, read
and write deadlines, a pool with slots, body caps — and as this driver it took 0.46–0.47
ms of CPU a task against 0.28–0.31 here (one SQLite router, closed loop of 32, two
rounds), CPU the routers under test would otherwise get.

A connection is dropped if the server asked to close it or if it sat idle for
``IDLE_S`` (the router closes idle keep-alive connections after 5 s: a request
written into that race would fail for the client's own reason).
"""

from __future__ import annotations

import json
import time
from typing import Self
from urllib.parse import urlsplit

import httptools
import trio

IDLE_S = 2.0
RECEIVE_BYTES = 65536
TIMEOUT_S = 60.0


class _Conn:
    __slots__ = ("body", "complete", "keep_alive", "parser", "status", "stream", "used")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.used = time.monotonic()
        self.body = bytearray()
        self.complete = False
        self.keep_alive = False
        self.status = 0
        self.parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_body(self, piece: bytes) -> None:
        self.body += piece

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Write one request, read its whole answer: (status, body). Raises
        EOFError (closed early), httptools.HttpParserError, trio errors."""
        self.body = bytearray()
        self.complete = False
        await self.stream.send_all(request)
        while not self.complete:
            data = await self.stream.receive_some(RECEIVE_BYTES)
            if not data:
                raise EOFError("the server closed the connection mid-answer")
            self.parser.feed_data(data)
        self.used = time.monotonic()
        return self.status, bytes(self.body)


class LeanDrivers:
    """``bench_gateway.Drivers``' ``run("atp_http")`` on raw kept-alive connections."""

    def __init__(self, urls: dict[str, str], keys: dict[str, str]) -> None:
        url = urlsplit(urls["atp_http"])
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        host = f"{self.host}:{self.port}"
        self.auth = f"authorization: Bearer {keys['atp_http']}\r\n"
        from bench_gateway import MESSAGES

        body = json.dumps({"task": {"task_type": "chat"}, "content": {"messages": MESSAGES}}).encode()
        self.post = (f"POST /v1/streams HTTP/1.1\r\nhost: {host}\r\n{self.auth}content-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n").encode() + body
        self.get_head = b"GET /v1/streams/"
        self.get_tail = f"/events HTTP/1.1\r\nhost: {host}\r\n{self.auth}\r\n".encode()
        self.idle: list[_Conn] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.idle:
            await trio.aclose_forcefully(c.stream)
        self.idle.clear()

    async def _take(self) -> _Conn:
        now = time.monotonic()
        while self.idle:
            c = self.idle.pop()
            if now - c.used < IDLE_S:
                return c
            await trio.aclose_forcefully(c.stream)
        return _Conn(await trio.open_tcp_stream(self.host, self.port))

    async def run(self, target: str) -> bool:
        """One task to its FINAL: True when it completed whole."""
        c = await self._take()
        ok = False
        try:
            with trio.fail_after(TIMEOUT_S):
                status, body = await c.exchange(self.post)
                if 200 <= status < 300:
                    sid = json.loads(body)["stream_id"]
                    if not c.keep_alive:
                        await trio.aclose_forcefully(c.stream)
                        c = _Conn(await trio.open_tcp_stream(self.host, self.port))
                    status, data = await c.exchange(self.get_head + sid.encode() + self.get_tail)
                    ok = status == 200 and b"event: FINAL" in data and b"tok5" in data
        except BaseException:
            await trio.aclose_forcefully(c.stream)
            raise
        if c.keep_alive:
            self.idle.append(c)
        else:
            await trio.aclose_forcefully(c.stream)
        return ok
