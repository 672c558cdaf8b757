"""The lean HTTP/1.1 server of the HTTP ingress (issue 25 item 4): the router's
ASGI app on trio streams, parsed by httptools (llhttp, the C parser Node.js uses).

hypercorn on trio cost 1.0–1.3 ms of CPU a request (h11 in pure Python, a task
group and several cancel scopes per request); this server serves the same ASGI
app — every route, middleware, auth and body limit stays the app's — in one trio
task per connection, with one ``send_all`` per response head and first body
chunk. ``bench/bench_http_server.py`` measures the two side by side.

What it keeps of a production server, with :class:`ServerLimits`:

* **HTTP/1.1 with keep-alive and pipelining**: requests on a connection are
  answered in order; a request's callbacks go to its own :class:`_Request`, so a
  pipelined next request is parsed into a queue, never into the current one;
  while a response streams, reading stops once a next request has begun (at
  most one read, ``read_size`` bytes, is queued).
* **Bounds**: the request head (request line and headers) at most
  ``max_head_bytes`` (431) and ``max_headers`` fields (431); a body larger than
  ``max_body_bytes`` (declared or streamed) is 413 — the app's own, tighter
  limits apply first (``read_body``); the head must arrive whole within
  ``head_timeout_s`` of its first byte (slow-loris), an idle keep-alive
  connection is closed after ``keep_alive_s``, a body read waits at most
  ``body_timeout_s``; at most ``max_connections`` connections are served at
  once (the others wait in the listen backlog, ``backlog``), and at most
  ``max_connections_per_peer`` from one peer IP address: a connection over that
  is answered ``429`` ``EWINDOW`` in the control API's error shape (parallelism
  over its window, spec §10; ``Retry-After: 1``; over TLS closed without one) and
  closed at accept, so one client cannot hold the router-wide slots.
* **Streaming** (ASGI 2.4): a response without ``content-length`` is sent chunked
  (HTTP/1.1) or close-delimited (HTTP/1.0), each ``http.response.body`` written
  before ``send`` returns (backpressure); once the client has left, ``send`` raises
  ``ClientGone`` and ``receive`` returns ``http.disconnect``; a response not complete 50 ms
  after its start is watched, its app cancelled when the client leaves (``watches.py``).
* ``Expect: 100-continue`` answered when the app first reads the body; ``HEAD``
  answered without a body; 204/304 never carry one; ``Date`` on every response.
* **Errors**: a malformed request is 400, an upgrade (WebSocket, h2c) 501 — the
  HTTP API serves neither (the WebSocket ingress has its own port) — each then
  closed; an app that fails before its response starts gets a plain 500 (the
  traceback only in the log), after it the connection is closed.
* **TLS**: a :class:`ssl.SSLContext` (``ServerTls.context_for(("http/1.1",))``):
  the handshake per connection within ``head_timeout_s``; ALPN offers only
  ``http/1.1`` — this server does not speak HTTP/2 (``--http-server hypercorn``
  does). Like hypercorn, it does not put the client's certificate in the scope:
  HTTP callers authenticate with a key or JWT (mTLS identities: the WebSocket ingress).
* The ASGI **lifespan** (startup before the first accept, shutdown at exit). Out of scope: HTTP/2, WebSocket, trailers.
"""

from __future__ import annotations

import email.utils
import errno
import logging
import math
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools
import trio

from atp_router.flow.peer_slots import PeerSlots
from atp_router.runtime.ingress.listen import lifespan, listen_tcp, listen_unix
from atp_router.runtime.ingress.watches import ClientGone, DisconnectWatches

__all__ = ["ServerLimits", "listen_tcp", "listen_unix", "serve_lean"]

log = logging.getLogger("atp_router.ingress.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The server's bounds (module docstring): bytes, counts and seconds."""

    max_head_bytes: int = 16 * 1024  # hypercorn's (h11_max_incomplete_size)
    max_headers: int = 128
    max_body_bytes: int = 64 * 1024 * 1024
    head_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    max_connections_per_peer: int = 1024
    backlog: int = 1024
    read_size: int = 64 * 1024


class _Refuse(Exception):
    """A request refused before the app sees it: ``status`` and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class _Request:
    """One request as httptools parses it (its callbacks)."""

    url: bytearray = field(default_factory=bytearray)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    head_bytes: int = 0
    head_done: bool = False
    body: deque[bytes] = field(default_factory=deque)
    body_bytes: int = 0
    complete: bool = False
    method: bytes = b""
    version: str = "1.1"
    keep_alive: bool = True
    upgrade: bool = False


class _Parser:
    """The httptools callbacks: each request's parts into its own :class:`_Request`."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.requests: deque[_Request] = deque()
        self.http = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.requests.append(_Request())

    def on_url(self, url: bytes) -> None:
        r = self.requests[-1]
        r.url += url
        self._grow(r, len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.requests[-1]
        r.headers.append((name.lower(), value))
        self._grow(r, len(name) + len(value) + 4)
        if len(r.headers) > self.limits.max_headers:
            raise _Refuse(431, f"more than {self.limits.max_headers} header fields")

    def on_headers_complete(self) -> None:
        r = self.requests[-1]
        r.head_done = True
        r.method = self.http.get_method()
        r.version = self.http.get_http_version()
        r.keep_alive = self.http.should_keep_alive()
        r.upgrade = self.http.should_upgrade()

    def on_body(self, body: bytes) -> None:
        r = self.requests[-1]
        r.body_bytes += len(body)
        if r.body_bytes > self.limits.max_body_bytes:
            raise _Refuse(413, f"body larger than {self.limits.max_body_bytes} bytes")
        r.body.append(body)

    def on_message_complete(self) -> None:
        self.requests[-1].complete = True

    def _grow(self, r: _Request, n: int) -> None:
        r.head_bytes += n
        if r.head_bytes > self.limits.max_head_bytes:
            raise _Refuse(431, f"request head larger than {self.limits.max_head_bytes} bytes")


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Content Too Large",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 501: b"Not Implemented"}
_NO_BODY = frozenset({204, 304})


class _Date:
    """The ``Date`` header value, formatted once a second."""

    sec = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        t = int(time.time())
        if t != cls.sec:
            cls.sec, cls.value = t, email.utils.formatdate(t, usegmt=True).encode()
        return cls.value


def _status_line(status: int) -> bytes:
    try:
        reason = _REASONS.get(status) or HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


_STATUS: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n`` (cached per status)."""
    line = _STATUS.get(status)
    if line is None:
        line = _STATUS[status] = _status_line(status)
    return line


class _Exchange:
    """One request's ASGI ``receive`` and ``send`` (module docstring, Streaming)."""

    def __init__(self, conn: _Conn, req: _Request) -> None:
        self.conn, self.req = conn, req
        self.started = self.head_sent = self.complete = self.chunked = False
        self.status = 0
        self.headers: Sequence[tuple[bytes, bytes]] = ()
        self.body_done = False  # the last http.request message was given
        self.continued = False
        self.no_body = req.method == b"HEAD"
        self.done = trio.Event()  # the response is complete, or the client left
        # The app's call (cancelled when the client leaves mid-stream), the watch's read and end (watches.py).
        self.app_scope, self.watch_scope, self.watched = trio.CancelScope(), trio.CancelScope(), None

    async def receive(self) -> Message:
        req, conn = self.req, self.conn
        while True:
            if self.complete or conn.eof:
                return {"type": "http.disconnect"}
            if req.body:
                chunk = b"".join(req.body)
                req.body.clear()
                self.body_done = req.complete
                return {"type": "http.request", "body": chunk, "more_body": not req.complete}
            if req.complete:
                if not self.body_done:
                    self.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                await conn.wait_disconnect(self)
                continue
            if not self.continued and (b"expect", b"100-continue") in req.headers:
                self.continued = True
                await conn.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            conn.timer.deadline = trio.current_time() + conn.limits.body_timeout_s
            try:
                await conn.read()
            except _REFUSED as e:
                conn.error = e  # answered once the app returns (413, 400); the app sees the client gone
                conn.eof = True
            conn.timer.deadline = math.inf

    async def send(self, message: Message) -> None:
        if self.conn.error is not None and not self.head_sent:
            return  # the request was refused while the app read it: the refusal is the answer
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            self.started = True
            self.status = int(message["status"])
            self.headers = message.get("headers") or ()
            self.no_body = self.no_body or self.status in _NO_BODY or self.status < 200
            if self.conn.watches is not None:  # watched for the client leaving, if it lasts (watches.py)
                self.conn.watches.add(self)
            return
        if kind != "http.response.body" or not self.started or self.complete:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: {self.started}, "
                               f"complete: {self.complete})")
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        out = b"" if self.head_sent else self._head(more, len(body))
        self.head_sent = True
        if self.no_body:
            body = b""
        elif self.chunked:
            body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        self.complete = not more
        try:
            if out or body:
                await self.conn.stream.send_all(out + body if out else body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.conn.eof = True  # the client left: receive() says http.disconnect, as a read would
        if self.complete or self.conn.eof:
            self.done.set()
            self.watch_scope.cancel()
            if self.conn.eof and not self.complete:
                raise ClientGone("the client closed the connection")  # ASGI 2.4: the app stops sending

    def _head(self, more: bool, n: int) -> bytes:
        """The response head; decides the framing (length, chunked, or close)."""
        parts = [status_line(self.status)]
        framed = False
        for k, v in self.headers:
            if b"\r" in k or b"\n" in k or b"\r" in v or b"\n" in v:
                raise RuntimeError("a response header holds CR or LF")
            name = k.lower()
            if name == b"content-length" or name == b"transfer-encoding":
                framed = True
            elif name == b"connection" and v.lower() == b"close":
                self.req.keep_alive = False
            parts += (k, b": ", v, b"\r\n")
        if not framed and not (self.no_body and self.status in _NO_BODY):
            if not more:
                parts.append(b"content-length: %d\r\n" % n)
            elif self.req.version == "1.1":
                parts.append(b"transfer-encoding: chunked\r\n")
                self.chunked = True
            else:
                self.req.keep_alive = False  # HTTP/1.0: close-delimited
        if not self.req.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"date: ", _Date.now(), b"\r\n\r\n")
        return b"".join(parts)


class _Conn:
    """One client connection: its requests in order (module docstring)."""

    def __init__(self, stream: trio.abc.Stream, app: ASGIApp, limits: ServerLimits, base: Scope,
                 watches: DisconnectWatches | None = None) -> None:
        self.stream, self.app, self.limits, self.base = stream, app, limits, base
        self.parser = _Parser(limits)
        self.eof = False
        self.error: BaseException | None = None  # a pipelined request refused while the app ran
        self.timer = trio.CancelScope()
        # Streaming responses' disconnect watches (None: none); a read under way; the watch reads.
        self.watches, self.reading, self.watching = watches, False, False

    async def read(self) -> None:
        """One read fed to the parser (its callbacks fill the requests); sets
        :attr:`eof` when the client closed — or reset the connection, which a
        handler waiting on ``receive`` sees as ``http.disconnect``, not an error."""
        self.reading = True
        try:
            data = await self.stream.receive_some(self.limits.read_size)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        finally:
            self.reading = False
        if not data:
            self.eof = True
            return
        self.parser.http.feed_data(data)

    async def wait_disconnect(self, ex: _Exchange) -> None:
        """Wait until the client goes away (``eof``) or the response completes;
        bytes of a pipelined next request are parsed into its own request, and
        once one has begun nothing more is read until this response is complete
        (the queue of requests is bounded; the client's sending blocks)."""
        if ex.complete or self.error is not None:
            self.eof = self.eof or self.error is not None
            return
        if len(self.parser.requests) > 1 or self.watching:
            await ex.done.wait()  # (while watched, the watch is the one reader: it sets done)
            return
        try:
            await self.read()
        except _REFUSED as e:
            self.error = e

    async def run(self) -> None:
        with self.timer:
            try:
                while await self._next_head():
                    req = self.parser.requests[0]
                    if req.upgrade:
                        raise _Refuse(501, _NO_UPGRADE)
                    if not await self._cycle(req):
                        if not req.complete and not self.eof:  # answered before its body was read
                            await self.linger()
                        return
                    self.parser.requests.popleft()
                    if self.error is not None:
                        raise self.error
            except _REFUSED as e:
                await self._refuse(*_refusal(e))

    async def _next_head(self) -> bool:
        """Read until the next request's head is whole (False: the client
        closed); the keep-alive and head timeouts (module docstring) apply."""
        reqs = self.parser.requests
        started: float | None = None
        while not (reqs and reqs[0].head_done):
            if self.eof:
                return False
            now = trio.current_time()
            if reqs and started is None:
                started = now
            self.timer.deadline = now + self.limits.keep_alive_s if started is None \
                else started + self.limits.head_timeout_s
            await self.read()
        self.timer.deadline = math.inf
        return True

    async def _cycle(self, req: _Request) -> bool:
        """Run the app for ``req``; True when the connection serves the next one."""
        ex = _Exchange(self, req)
        scope = self._scope(req)  # raises _Refuse (400) before the app runs
        try:
            with ex.app_scope:
                await self.app(scope, ex.receive, ex.send)
        except Exception:
            if self.error is None and not self.eof:  # (the client gone: the app's sending was stopped)
                log.exception("HTTP %s %s: the app failed", req.method.decode("latin-1"), bytes(req.url[:200]))
        finally:
            if self.watches is not None:
                self.watches.discard(ex)
            if ex.watched is not None:
                ex.watch_scope.cancel()
                with trio.CancelScope(shield=True):
                    await ex.watched.wait()  # the watch's read is over before the next one
        if self.error is not None:  # the request broke a bound or the protocol while the app read it
            if not ex.head_sent:
                await self._refuse(*_refusal(self.error))
            return False
        if not ex.complete:
            if not ex.head_sent and not self.eof:  # (the client gone, the app cancelled: nobody to answer)
                log.error("HTTP %s: the app returned without a complete response", bytes(req.url[:200]))
                await self._refuse(500, "internal server error")
            return False
        return req.keep_alive and req.complete and not self.eof

    def _scope(self, req: _Request) -> Scope:
        raw = bytes(req.url)
        if not raw.startswith(b"/"):
            parsed = httptools.parse_url(raw)
            raw = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        path, _, query = raw.partition(b"?")
        try:
            text = unquote(path.decode("ascii"))
        except UnicodeDecodeError:
            raise _Refuse(400, "the request target is not ASCII") from None
        scope = dict(self.base)
        scope.update(http_version=req.version, method=req.method.decode("ascii"), path=text, raw_path=path,
                     query_string=query, headers=req.headers, state=dict(self.base["state"]))
        return scope

    async def _refuse(self, status: int, reason: str) -> None:
        body = reason.encode("utf-8", "replace") + b"\n"
        head = status_line(status) + (b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                                      b"connection: close\r\ndate: %s\r\n\r\n" % (len(body), _Date.now()))
        self.timer.deadline = trio.current_time() + _LINGER_S  # a client that does not read does not hold us
        try:
            await self.stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        await self.linger()

    async def linger(self) -> None:
        """Lingering close: a client still sending its request would get a reset
        that discards the answer; read (and drop) what it sends, at most
        :data:`_LINGER_BYTES` within :data:`_LINGER_S`."""
        self.timer.deadline = min(self.timer.deadline, trio.current_time() + _LINGER_S)
        try:
            if isinstance(self.stream, trio.SocketStream):
                await self.stream.send_eof()
            dropped = 0
            while dropped < _LINGER_BYTES and (chunk := await self.stream.receive_some(self.limits.read_size)):
                dropped += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


#: A refused connection is closed after at most this long (s) or this many bytes read and dropped.
_LINGER_S = 1.0
_LINGER_BYTES = 4 * 1024 * 1024
#: What a read may raise for a request refused: the parser's errors and the bounds'.
_REFUSED = (httptools.HttpParserError, httptools.HttpParserUpgrade, _Refuse)
_NO_UPGRADE = "upgrade is not served here (HTTP/1.1 only; the WebSocket ingress has its own port)"


def _refusal(e: BaseException) -> tuple[int, str]:
    """The status and reason for a request the parser or a bound refused."""
    if isinstance(e, _Refuse):
        return e.status, str(e)
    if isinstance(e, httptools.HttpParserUpgrade):
        return 501, _NO_UPGRADE
    if isinstance(e, httptools.HttpParserCallbackError) and isinstance(e.__context__, _Refuse):
        return e.__context__.status, str(e.__context__)
    return 400, f"malformed request: {e}"


# ------------------------------------------------------------------ the server
_ACCEPT_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


async def serve_lean(app: ASGIApp, sockets: Sequence[socket.socket], *, ssl_context: ssl.SSLContext | None = None,
                     limits: ServerLimits = ServerLimits(),
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``sockets`` (listening stdlib sockets: :func:`listen_tcp`,
    :func:`listen_unix`, an inherited ``fd``) until cancelled, over TLS with
    ``ssl_context`` (TCP sockets only). Runs the app's lifespan around it.
    ``task_status.started`` receives each socket's bound address as
    ``host:port`` (TCP) or ``unix:<path>``. Raises :class:`RuntimeError` when
    the app's startup fails; the sockets are closed on exit."""
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in sockets]
    bound = [_address(s) for s in sockets]
    state: dict[str, Any] = {}
    slots = _Slots(trio.Semaphore(limits.max_connections), PeerSlots(limits.max_connections_per_peer))
    try:
        async with lifespan(app, state), trio.open_nursery() as nursery:
            watches = DisconnectWatches(nursery, _REFUSED)
            nursery.start_soon(watches.run, name="disconnect watches")
            for listener, addr, sock in zip(listeners, bound, sockets, strict=True):
                tls = ssl_context if sock.family != socket.AF_UNIX else None
                base = _base_scope(sock, tls is not None, state)
                nursery.start_soon(_accept, listener, nursery, slots, app, limits, tls, base, watches,
                                   name=f"accept {addr}")
            task_status.started(bound)
    finally:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    return f"unix:{name}" if sock.family == socket.AF_UNIX else f"{name[0]}:{name[1]}"


def _base_scope(sock: socket.socket, tls: bool, state: dict[str, Any]) -> Scope:
    server = None if sock.family == socket.AF_UNIX else tuple(sock.getsockname()[:2])
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "scheme": "https" if tls else "http",
            "root_path": "", "server": server, "client": None, "state": state, "extensions": {}}


@dataclass(frozen=True, slots=True)
class _Slots:
    """The server's connection bounds: router-wide and per peer IP address."""

    total: trio.Semaphore
    per_peer: PeerSlots


_OVER_PEER_BODY = b'{"error": {"code": "EWINDOW", "reason": "too many connections from this address"}}'
_OVER_PEER = (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\nconnection: close\r\n"
              b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_OVER_PEER_BODY), _OVER_PEER_BODY))


def _peer_ip(stream: trio.SocketStream) -> tuple[Any, str | None]:
    """The socket's peer address and its IP (None: a Unix socket, not bounded per peer).
    Raises OSError when the peer is already gone."""
    peer = stream.socket.getpeername()
    return peer, (str(peer[0]) if isinstance(peer, tuple) else None)


async def _refuse_peer(stream: trio.SocketStream, plain: bool) -> None:
    """A connection over its peer's bound: the 429 (plain HTTP only) and close, within 100 ms."""
    with trio.move_on_after(0.1):
        if plain:
            await stream.send_all(_OVER_PEER)
        await stream.aclose()
    await trio.aclose_forcefully(stream)


async def _accept(listener: trio.SocketListener, nursery: trio.Nursery, slots: _Slots, app: ASGIApp,
                  limits: ServerLimits, tls: ssl.SSLContext | None, base: Scope, watches: DisconnectWatches) -> None:
    """Accept connections while a slot is free (``max_connections``, and
    ``max_connections_per_peer`` of the peer's IP); each runs in its own task."""
    while True:
        await slots.total.acquire()
        try:
            stream = await listener.accept()
        except OSError as e:
            slots.total.release()
            if e.errno not in _ACCEPT_ERRORS:
                raise
            log.error("accept: %s; retrying in 100 ms", os.strerror(e.errno))
            await trio.sleep(0.1)
            continue
        except BaseException:
            slots.total.release()
            raise
        try:
            peer, ip = _peer_ip(stream)
        except OSError:
            slots.total.release()
            await trio.aclose_forcefully(stream)
            continue
        if ip is not None and not slots.per_peer.admit(ip):
            slots.total.release()
            await _refuse_peer(stream, tls is None)
            continue
        nursery.start_soon(_connection, stream, peer, ip, slots, app, limits, tls, base, watches)


async def _connection(stream: trio.SocketStream, peer: Any, ip: str | None, slots: _Slots, app: ASGIApp,
                      limits: ServerLimits, tls: ssl.SSLContext | None, base: Scope, watches: DisconnectWatches) -> None:
    s: trio.abc.Stream = stream
    try:
        scope = dict(base, client=tuple(peer[:2]) if isinstance(peer, tuple) else None)
        if tls is not None:
            s = trio.SSLStream(stream, tls, server_side=True, https_compatible=True)
            with trio.move_on_after(limits.head_timeout_s) as handshake:
                await s.do_handshake()
            if handshake.cancelled_caught:
                return
        await _Conn(s, app, limits, scope, watches).run()
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
        pass  # the client went away or broke the protocol below HTTP: only this connection ends
    finally:
        if ip is not None:
            slots.per_peer.done(ip)
        slots.total.release()
        await trio.aclose_forcefully(s)
