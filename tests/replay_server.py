"""Loopback HTTP/1.1 peers for the HTTP adapter tests: real servers on real sockets.

They stand in where no real peer can run here (Ollama, Gemini) or where a real one
never produces the shape under test (429/5xx, stalls, cut or malformed streams);
each test module says which documented wire shape it replays.

* :class:`LoopbackHTTP` reads one request per connection (head, then a body of
  ``content-length`` bytes), records ``(head, JSON body)`` and its arrival time
  (``trio.current_time()``), and answers with ``behaviour(stream)``, a coroutine
  that writes the raw answer;
* :class:`Replay` answers each request with the next scripted answer ``(status,
  headers, chunks)``: chunk by chunk with ``transfer-encoding: chunked``, or in one
  piece with ``content-length`` (``chunked=False``);
* :class:`BillingModel` is an OpenAI-compatible model that bills every chat
  completion a fixed number of tokens (an agent over-reporting its usage) and
  can hold its calls in flight;
* :func:`serve` starts any of them on a free port in the test's nursery.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

__all__ = ["Behaviour", "BillingModel", "LoopbackHTTP", "Replay", "serve"]

#: Writes one raw HTTP answer on the connection.
Behaviour = Callable[[trio.SocketStream], Awaitable[None]]

_Peer = TypeVar("_Peer", bound="LoopbackHTTP")


class LoopbackHTTP:
    """A minimal HTTP/1.1 server: records each request in ``requests`` (head as
    text, JSON body; ``{}`` when there is none) and ``times``, then answers with
    :meth:`respond`, by default the current ``behaviour`` (the connection is closed
    after it). ``url`` is ``http://127.0.0.1:<port>`` followed by ``path``."""

    def __init__(self, behaviour: Behaviour | None = None, *, path: str = "") -> None:
        self.behaviour = behaviour
        self.path = path
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.times: list[float] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        m = re.search(rb"content-length:\s*(\d+)", head, re.IGNORECASE)
        while m and len(body) < int(m[1]):
            body += await stream.receive_some(65536)
        self.requests.append((head.decode("latin-1"), json.loads(body or b"{}")))
        self.times.append(trio.current_time())
        await self.respond(stream)

    async def respond(self, stream: trio.SocketStream) -> None:
        if self.behaviour is None:
            raise RuntimeError("LoopbackHTTP got a request but has no behaviour")
        try:
            await self.behaviour(stream)
        finally:
            await stream.aclose()


class Replay(LoopbackHTTP):
    """Answers each request with the next answer queued by :meth:`add`: status line,
    framing header, ``connection: close`` and the given headers, then the chunks
    (each one HTTP chunk when ``chunked``, else all as one ``content-length`` body);
    ``stall`` keeps the connection open after the chunks instead of ending it."""

    def __init__(self, *, path: str = "", chunked: bool = True) -> None:
        super().__init__(path=path)
        self.chunked = chunked
        self.answers: list[tuple[int, dict[str, str], Sequence[bytes], bool]] = []

    def add(self, status: int, headers: dict[str, str], chunks: Sequence[bytes], *, stall: bool = False) -> None:
        self.answers.append((status, headers, chunks, stall))

    async def respond(self, stream: trio.SocketStream) -> None:
        status, headers, chunks, stall = self.answers.pop(0)
        if self.chunked:
            framing, body = "transfer-encoding: chunked", b""
        else:
            body = b"".join(chunks)
            framing, chunks = f"content-length: {len(body)}", ()
        lines = [f"HTTP/1.1 {status} X", framing, "connection: close"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        # A client that gives up early (a refused content type) closes first: not a server fault.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            for c in chunks:
                await stream.send_all(b"%x\r\n%s\r\n" % (len(c), c))
            if stall:
                await trio.sleep_forever()
            if self.chunked:
                await stream.send_all(b"0\r\n\r\n")
            await stream.aclose()


class BillingModel(LoopbackHTTP):
    """An OpenAI-compatible model (``url`` ends in ``/v1``) answering every chat
    completion with a streamed text and a ``usage`` chunk of ``billed`` tokens
    (the streaming shape the OpenAI-compatible adapter reads): set ``billed``
    above the adapter's estimate and it over-reports, so concurrent calls
    contend for the last of a budget. While :attr:`hold` is set, calls wait in
    the model (calls in flight; :attr:`waiting` counts them). ``fail_every=n``
    (> 0): every n-th call (by arrival) is answered HTTP 500 instead, after the
    hold like the others, billing nothing (:attr:`failed` counts them)."""

    def __init__(self, billed: int = 1_000, *, fail_every: int = 0) -> None:
        super().__init__(path="/v1")
        self.billed = billed
        self.fail_every = fail_every
        self.hold: trio.Event | None = None
        self.waiting = 0
        self.failed = 0

    async def respond(self, stream: trio.SocketStream) -> None:
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "done"}, "finish_reason": None}]}
        usage = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                 "usage": {"prompt_tokens": self.billed // 2, "completion_tokens": self.billed - self.billed // 2,
                           "total_tokens": self.billed}}
        body = b"".join(f"data: {json.dumps(x)}\n\n".encode() for x in (chunk, usage)) + b"data: [DONE]\n\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream"
        fail = self.fail_every > 0 and len(self.requests) % self.fail_every == 0  # this call's number, from 1
        if fail:
            body = b'{"error": {"message": "overloaded"}}'
            head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            if self.hold is not None:
                self.waiting += 1
                await self.hold.wait()
            self.failed += fail
            await stream.send_all(head + b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await stream.aclose()


async def serve(nursery: trio.Nursery, peer: _Peer) -> _Peer:
    """Serve ``peer`` on a free loopback port until ``nursery`` ends; returns it
    with ``port`` set."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, peer.handle, 0, host="127.0.0.1"))
    peer.port = listeners[0].socket.getsockname()[1]
    return peer
