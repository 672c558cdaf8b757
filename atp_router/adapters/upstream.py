"""A lean HTTP/1.1 client for the OpenAI-compatible next-hops' hot path (issue 25 item 3; spec §14).

httpx on trio costs ~1 ms of CPU a streamed call; this client does the same call on
trio streams with httptools (llhttp, C) parsing the answer, for a fraction of it.
It serves the one hot request, the streamed chat completion; httpx stays for
everything else (:mod:`atp_router.adapters.http`).

* :class:`UpstreamClient`: a connection pool per ``(scheme, host, port)``: at most
  ``max_connections`` requests in flight (a request beyond waits ``timeout_s``, then
  :class:`PoolTimeout`), at most ``max_idle`` idle keep-alive connections kept; TLS
  by ``trio.SSLStream`` with the ``ssl_context`` given (the adapter passes httpx's
  own default context or its ``use_tls`` one, so both paths trust the same CAs);
  a connect (TCP and TLS handshake) bounded by ``connect_timeout_s``
  (:class:`ConnectTimeout`), every read and write by ``timeout_s``
  (:class:`ReadTimeout`, :class:`WriteTimeout`). A connection goes back to its pool
  only when its answer was read to the end of its body and both sides keep it
  alive; one with an error, or left mid-body, is closed. An idle connection the
  server closed (readable while idle) is dropped, never reused.
* :class:`Response`: status, reason, raw headers, and the body as pieces
  (:meth:`Response.receive`, ``b""`` at its end), framed by ``content-length``,
  ``transfer-encoding: chunked`` or the end of the connection; at most
  ``max_body_bytes`` (:class:`TooLarge`), a header section of at most
  :data:`MAX_HEADER_BYTES`. Only the identity encoding is accepted (the request
  says ``accept-encoding: identity``): another is :class:`TooLarge`'s sibling
  :class:`UnsupportedEncoding`, never a silently undecoded body.
* :class:`SSEDecoder` / :func:`sse_data`: the ``data`` of each Server-Sent Event
  (WHATWG event-stream interpretation, as ``httpx_sse`` applies it: lines end at
  CR, LF or CRLF; an event is dispatched at a blank line once any field was
  seen), scanned in place in one reusable buffer: per event it allocates only
  the data it returns. A line over :data:`MAX_SSE_LINE_BYTES` is :class:`TooLarge`.
* :func:`open_upstream`: the streamed request with the same retries as
  :func:`atp_router.adapters.http.open_stream` (429/5xx under a
  :class:`~atp_router.adapters.http.RetryPolicy`, never sooner than Retry-After),
  an error answer read up to :data:`MAX_ERROR_BODY_BYTES` and handed to the same
  ``error_of`` as an ``httpx.Response`` (errors are off the hot path).
* :func:`transport_error`: the AgentError of a :class:`UpstreamError`, as
  :func:`atp_router.adapters.http.transport_error` maps httpx's: connect failures
  and broken answers EAGENTDOWN, timeouts ETIMEOUT, answers over a cap EPROTO.

A client belongs to the trio run that first uses it (its sockets do).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import select
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx
import msgspec
import trio

from atp_router.adapters.http import (
    NO_RETRY,
    ErrorOf,
    RetryPolicy,
    retry_wait_ms,
    status_error,
)
from atp_router.wire.errors import AgentError, ErrorCode

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_ERROR_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_SSE_LINE_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "PoolTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "SSEDecoder",
    "TooLarge",
    "UnsupportedEncoding",
    "UpstreamClient",
    "UpstreamError",
    "WriteTimeout",
    "open_upstream",
    "sse_data",
    "transport_error",
]

#: The header section of an answer, bytes.
MAX_HEADER_BYTES = 64 * 1024
#: The body of a streamed answer, bytes (a chat completion's stream is far below).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: How much of an error answer's body is read, bytes (a reason quotes 300 characters).
MAX_ERROR_BODY_BYTES = 64 * 1024
#: One line of an SSE stream, bytes.
MAX_SSE_LINE_BYTES = 1024 * 1024
#: Bytes asked of the socket per read.
_RECEIVE_BYTES = 65536

_BAD_HEADER = re.compile(r"[\r\n\x00]")
_USER_AGENT = b"atp-router"


class UpstreamError(Exception):
    """A failure of an upstream call without (or before the end of) an HTTP answer."""


class ConnectError(UpstreamError):
    """The TCP connection or the TLS handshake failed (refused, unresolvable, untrusted certificate)."""


class ConnectTimeout(UpstreamError):
    """The connect (TCP and TLS handshake) passed ``connect_timeout_s``."""


class ReadTimeout(UpstreamError):
    """A read waited ``timeout_s`` for the server."""


class WriteTimeout(UpstreamError):
    """Sending the request waited ``timeout_s``."""


class PoolTimeout(UpstreamError):
    """``max_connections`` requests were in flight for ``timeout_s``."""


class RemoteProtocolError(UpstreamError):
    """The server closed the connection early or answered malformed HTTP."""


class LocalProtocolError(UpstreamError):
    """The request itself cannot be sent (a header with CR, LF or NUL)."""


class TooLarge(UpstreamError):
    """The answer passed a size cap (header section, body, or one SSE line)."""


class UnsupportedEncoding(UpstreamError):
    """The answer has a content-encoding other than identity."""


def transport_error(e: UpstreamError, base_url: str, timeout_ms: int) -> AgentError:
    """The AgentError of ``e``, worded as :func:`atp_router.adapters.http.transport_error`
    words httpx's: connect failures EAGENTDOWN (a connect timeout ``timed_out``), other
    timeouts ETIMEOUT ``"<Kind> after <timeout_ms> ms"``, an answer over a cap or in an
    unsupported encoding EPROTO, anything else EAGENTDOWN ``"<Kind>: <detail>"``."""
    if isinstance(e, ConnectTimeout):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {base_url}: {e!r}", timed_out=True)
    if isinstance(e, (ReadTimeout, WriteTimeout, PoolTimeout)):
        return AgentError(ErrorCode.ETIMEOUT, f"{type(e).__name__} after {timeout_ms} ms")
    if isinstance(e, ConnectError):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {base_url}: {e}")
    if isinstance(e, (TooLarge, UnsupportedEncoding)):
        return AgentError(ErrorCode.EPROTO, f"answer from {base_url}: {e}")
    return AgentError(ErrorCode.EAGENTDOWN, f"{type(e).__name__}: {e}")


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    """``((scheme, host, port), request target, Host header value)`` of ``url``."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    default = 443 if scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    host_header = netloc if port == default else f"{netloc}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (scheme, host, port), path.encode("ascii"), host_header.encode("ascii")


class _Conn:
    """One connection and the parse state of the answer it is reading (httptools' callbacks)."""

    __slots__ = ("body", "body_bytes", "broken", "complete", "eof_framed", "expecting", "head_bytes",
                 "headers", "headers_done", "interim", "keep_alive", "key", "parser", "reason", "status", "stream")  # fmt: skip

    def __init__(self, stream: trio.abc.Stream, key: tuple[str, str, int]) -> None:
        self.stream = stream
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.broken = False
        self.expecting = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.interim = False
        self.complete = False
        self.eof_framed = False
        self.keep_alive = False
        self.head_bytes = 0
        self.body: collections.deque[bytes] = collections.deque()
        self.body_bytes = 0

    def start(self) -> None:
        """Ready for the answer to a request just sent."""
        self._reset()
        self.expecting = True

    # -- httptools callbacks --------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.expecting:
            self.broken = True  # bytes past the end of the answer: never reuse

    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self.interim = True  # 1xx: another head follows
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        framed = any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers)
        self.eof_framed = not framed and status not in (204, 304)

    def on_body(self, piece: bytes) -> None:
        if piece:
            self.body.append(piece)
            self.body_bytes += len(piece)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.keep_alive = self.parser.should_keep_alive() and not self.eof_framed
        self.complete = True
        self.expecting = False

    # -- I/O --------------------------------------------------------------------------

    async def fill(self, timeout_s: float, max_body: int) -> None:
        """Read once from the socket and parse it. Raises ReadTimeout,
        RemoteProtocolError (closed early, malformed), TooLarge."""
        with trio.move_on_after(timeout_s):
            try:
                data = await self.stream.receive_some(_RECEIVE_BYTES)
            except (trio.BrokenResourceError, OSError) as e:
                raise RemoteProtocolError(f"read failed: {e.__cause__ or e}") from None
            if not data:
                if self.headers_done and self.eof_framed:
                    self.complete = True
                    return
                what = "a complete message body" if self.headers_done else "a response"
                raise RemoteProtocolError(f"peer closed connection without sending {what}")
            if not self.headers_done:
                self.head_bytes += len(data)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as e:
                raise RemoteProtocolError(f"malformed answer: {e}") from None
            if not self.headers_done and self.head_bytes > MAX_HEADER_BYTES:
                raise TooLarge(f"header section over {MAX_HEADER_BYTES} bytes")
            if self.body_bytes > max_body:
                raise TooLarge(f"body over {max_body} bytes")
            return
        raise ReadTimeout()

    def stale(self) -> bool:
        """Whether the idle connection has something to read (the server closed it)."""
        stream = self.stream
        sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
        if sock is None:
            return True
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    async def close(self) -> None:
        self.broken = True
        await trio.aclose_forcefully(self.stream)


class _Pool:
    """The connections to one origin."""

    __slots__ = ("idle", "slots")

    def __init__(self, max_connections: int) -> None:
        self.idle: list[_Conn] = []
        self.slots = trio.Semaphore(max_connections)


class Response:
    """An answer being read: ``status``, ``reason``, ``headers`` (``(lower-case name,
    value)`` bytes pairs, in order), the body by :meth:`receive`. Close it (``async
    with`` or :meth:`aclose`): the connection returns to the pool only if the body
    was read to its end."""

    __slots__ = ("_client", "_conn", "_max_body", "_pool", "headers", "method", "reason", "status", "url")

    def __init__(self, client: UpstreamClient, pool: _Pool, conn: _Conn, method: str, url: str) -> None:
        self._client = client
        self._pool = pool
        self._conn: _Conn | None = conn
        self._max_body = client.max_body_bytes
        self.method = method
        self.url = url
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        for n, v in self.headers:
            if n == name:
                return v
        return None

    async def receive(self) -> bytes:
        """The next piece of the body; ``b""`` at its end. Raises ReadTimeout,
        RemoteProtocolError, TooLarge (the connection is then closed)."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            if conn.body:
                return conn.body.popleft()
            if conn.complete:
                return b""
            try:
                await conn.fill(self._client.timeout_s, self._max_body)
            except BaseException:
                conn.broken = True  # an error (a cap, a cancel) closes the connection
                await self.aclose()
                raise

    async def read(self, limit: int) -> bytes:
        """The rest of the body, at most ``limit`` bytes (a longer body is cut and its
        connection closed)."""
        parts: list[bytes] = []
        size = 0
        while size < limit:
            piece = await self.receive()
            if not piece:
                break
            parts.append(piece)
            size += len(piece)
        return b"".join(parts)[:limit]

    def as_httpx(self, body: bytes) -> httpx.Response:
        """This answer as an ``httpx.Response`` with ``body`` (for an ``error_of``)."""
        return httpx.Response(self.status, headers=self.headers, content=body,
                              request=httpx.Request(self.method, self.url),
                              extensions={"reason_phrase": self.reason})  # fmt: skip

    async def aclose(self) -> None:
        """Give the connection back (body read to its end, keep-alive) or close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if conn.complete and conn.keep_alive and not conn.broken and len(self._pool.idle) < self._client.max_idle:
                self._pool.idle.append(conn)
            else:
                await conn.close()
        finally:
            self._pool.slots.release()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class UpstreamClient:
    """HTTP/1.1 requests with a keep-alive pool per origin (see the module docstring).

    ``timeout_s`` bounds each read and write and the wait for a pool slot (s);
    ``connect_timeout_s`` the TCP connect and TLS handshake; ``ssl_context`` verifies
    ``https`` origins (None: :func:`ssl.create_default_context`); ``max_connections``
    requests in flight per origin, ``max_idle`` idle connections kept per origin;
    ``max_body_bytes`` caps an answer's body.
    """

    def __init__(self, *, timeout_s: float, connect_timeout_s: float | None = None,
                 ssl_context: ssl.SSLContext | None = None, max_connections: int = 1024, max_idle: int = 100,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:  # fmt: skip
        if timeout_s <= 0 or max_connections < 1 or max_idle < 0 or max_body_bytes < 1:
            raise ValueError("timeout_s and max_body_bytes must be > 0, max_connections >= 1, max_idle >= 0")
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(timeout_s, 10.0) if connect_timeout_s is None else connect_timeout_s
        self.max_connections = max_connections
        self.max_idle = max_idle
        self.max_body_bytes = max_body_bytes
        self._ssl = ssl_context
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        #: Connections opened so far (all origins), for the bench and the tests.
        self.opened = 0

    def idle(self, url: str) -> int:
        """Idle keep-alive connections kept for the origin of ``url``."""
        pool = self._pools.get(_target(url)[0])
        return len(pool.idle) if pool is not None else 0

    async def send(self, method: str, url: str, headers: Mapping[str, str] | None = None, body: bytes = b"",
                   content_type: str | None = None) -> Response:  # fmt: skip
        """Send a request and return its answer once its head arrived (the body
        unread). Raises the :class:`UpstreamError` kinds; ``ValueError`` for a URL
        that is not http(s)."""
        key, target, host = _target(url)
        head = self._head(method, target, host, headers, body, content_type)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self.max_connections)
        await self._slot(pool)
        try:
            conn = await self._connection(pool, key)
        except BaseException:
            pool.slots.release()
            raise
        response = Response(self, pool, conn, method, url)
        try:
            conn.start()
            with trio.move_on_after(self.timeout_s) as scope:
                try:
                    await conn.stream.send_all(head + body if body else head)
                except (trio.BrokenResourceError, OSError) as e:
                    raise RemoteProtocolError(f"send failed: {e.__cause__ or e}") from None
            if scope.cancelled_caught:
                raise WriteTimeout()
            while not conn.headers_done:
                await conn.fill(self.timeout_s, self.max_body_bytes)
            response.status, response.reason, response.headers = conn.status, conn.reason, conn.headers
            encoding = response.header(b"content-encoding")
            if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
                raise UnsupportedEncoding(f"content-encoding {encoding.decode('latin-1')!r} (identity was asked)")
        except BaseException:
            conn.broken = True
            await response.aclose()
            raise
        return response

    @staticmethod
    def _head(method: str, target: bytes, host: bytes, headers: Mapping[str, str] | None, body: bytes,
              content_type: str | None) -> bytes:  # fmt: skip
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\nuser-agent: %s\r\naccept: */*\r\n"
                 b"accept-encoding: identity\r\nconnection: keep-alive\r\n" % (method.encode("ascii"), target, host,
                                                                               _USER_AGENT)]  # fmt: skip
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: %d\r\n" % len(body))
        if content_type is not None:
            lines.append(b"content-type: %s\r\n" % content_type.encode("latin-1"))
        for name, value in (headers or {}).items():
            if _BAD_HEADER.search(name) or _BAD_HEADER.search(value):
                raise LocalProtocolError(f"header {name!r} has CR, LF or NUL")
            try:
                lines.append(b"%s: %s\r\n" % (name.encode("ascii"), value.encode("latin-1")))
            except UnicodeEncodeError:
                raise LocalProtocolError(f"header {name!r} is not latin-1") from None
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _slot(self, pool: _Pool) -> None:
        try:
            pool.slots.acquire_nowait()
            return
        except trio.WouldBlock:
            pass
        with trio.move_on_after(self.timeout_s):
            await pool.slots.acquire()
            return
        raise PoolTimeout()

    async def _connection(self, pool: _Pool, key: tuple[str, str, int]) -> _Conn:
        while pool.idle:
            conn = pool.idle.pop()
            if not conn.stale():
                return conn
            await conn.close()
        return await self._connect(key)

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        scheme, host, port = key
        with trio.move_on_after(self.connect_timeout_s):
            try:
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            except OSError as e:
                raise ConnectError(str(e)) from None
            if scheme == "https":
                stream = await self._handshake(stream, host)
            self.opened += 1
            return _Conn(stream, key)
        raise ConnectTimeout(f"{host}:{port} after {self.connect_timeout_s:g} s")

    async def _handshake(self, tcp: trio.abc.Stream, host: str) -> trio.SSLStream[trio.abc.Stream]:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        self._ssl.set_alpn_protocols(["http/1.1"])
        tls = trio.SSLStream(tcp, self._ssl, server_hostname=host, https_compatible=True)
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, OSError) as e:
            await trio.aclose_forcefully(tcp)
            raise ConnectError(str(e.__cause__ or e)) from None
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return tls

    async def aclose(self) -> None:
        """Close every idle connection."""
        for pool in self._pools.values():
            while pool.idle:
                await pool.idle.pop().close()


# -- Server-Sent Events ------------------------------------------------------------------

_LF, _CR, _COLON, _SPACE = 10, 13, 58, 32


class SSEDecoder:
    """Incremental Server-Sent Events parser over bytes (see the module docstring).

    :meth:`feed` a piece of the body, then call :meth:`next` until it returns
    ``None``: each call returns one event's ``data`` (its ``data`` lines joined by
    LF; a bytearray, the only allocation of the event). Raises :class:`TooLarge`
    when a line passes ``max_line`` bytes.
    """

    __slots__ = ("_buf", "_data", "_event", "_has_id", "_pos", "_retry", "_skip_lf", "max_line")

    def __init__(self, max_line: int = MAX_SSE_LINE_BYTES) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._pos = 0
        self._skip_lf = False
        self._data: bytearray | None = None
        self._event = False
        self._has_id = False  # the last event id persists across events (the spec)
        self._retry = False

    def feed(self, piece: bytes) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += piece

    def next(self) -> bytearray | None:
        """The next complete event's data, or None until more is fed."""
        buf = self._buf
        pos = self._pos
        size = len(buf)
        while pos < size:
            if self._skip_lf:
                self._skip_lf = False
                if buf[pos] == _LF:
                    pos += 1
                    continue
            nl = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos, size if nl < 0 else nl)
            if cr >= 0:
                end, after = cr, cr + 1
                self._skip_lf = True  # CRLF: its LF, maybe in the next piece
            elif nl >= 0:
                end, after = nl, nl + 1
            else:
                if size - pos > self.max_line:
                    raise TooLarge(f"SSE line over {self.max_line} bytes")
                break
            if end - pos > self.max_line:
                raise TooLarge(f"SSE line over {self.max_line} bytes")
            data = self._line(buf, pos, end)
            pos = after
            if data is not None:
                self._pos = pos
                return data
        self._pos = pos
        return None

    def _line(self, buf: bytearray, start: int, end: int) -> bytearray | None:
        """Interpret one line; the event's data when it is the blank line that dispatches one."""
        if start == end:
            if self._data is None and not self._event and not self._has_id and not self._retry:
                return None
            data = self._data if self._data is not None else bytearray()
            self._data = None
            self._event = self._retry = False
            return data
        if buf[start] == _COLON:
            return None
        colon = buf.find(b":", start, end)
        name_end = end if colon < 0 else colon
        value = end if colon < 0 else colon + 1
        if value < end and buf[value] == _SPACE:
            value += 1
        name_len = name_end - start
        if name_len == 4 and buf.startswith(b"data", start):
            if self._data is None:
                self._data = buf[value:end]
            else:
                self._data += b"\n"
                self._data += buf[value:end]
        elif name_len == 5 and buf.startswith(b"event", start):
            self._event = value < end
        elif name_len == 2 and buf.startswith(b"id", start):
            if buf.find(b"\0", value, end) < 0:
                self._has_id = value < end
        elif name_len == 5 and buf.startswith(b"retry", start):
            with contextlib.suppress(ValueError):
                int(buf[value:end])
                self._retry = True
        return None


async def sse_data(response: Response, max_line: int = MAX_SSE_LINE_BYTES) -> AsyncIterator[bytearray]:
    """The ``data`` of each Server-Sent Event of ``response`` as UTF-8 bytes, in order.
    Raises AgentError(EPROTO) ``"not an SSE stream: …"`` when the answer is not one
    (worded as ``httpx_sse``), and the :class:`UpstreamError` kinds of the body."""
    ctype = (response.header(b"content-type") or b"").decode("latin-1").partition(";")[0]
    if "text/event-stream" not in ctype:
        raise AgentError(ErrorCode.EPROTO, "not an SSE stream: Expected response header Content-Type to contain "
                                           f"'text/event-stream', got {ctype!r}")  # fmt: skip
    decoder = SSEDecoder(max_line)
    while True:
        piece = await response.receive()
        if not piece:
            return
        decoder.feed(piece)
        while (data := decoder.next()) is not None:
            yield data


# -- the streamed request with retries ---------------------------------------------------


@contextlib.asynccontextmanager
async def open_upstream(
    client: UpstreamClient,
    method: str,
    url: str,
    *,
    json: Any,
    headers: Mapping[str, str] | None = None,
    retry: RetryPolicy = NO_RETRY,
    error_of: ErrorOf = status_error,
) -> AsyncIterator[Response]:
    """Send ``json`` (encoded by msgspec) and yield the successful (< 400) answer,
    open; as :func:`atp_router.adapters.http.open_stream` does with httpx: an answer
    ≥ 400 is read (up to :data:`MAX_ERROR_BODY_BYTES`) and turned into an AgentError
    by ``error_of`` (given it as an ``httpx.Response``); a retryable status is sent
    again after the policy's wait, else the error is raised. Raises the
    :class:`UpstreamError` kinds (see :func:`transport_error`)."""
    body = msgspec.json.encode(json)
    attempt = 0
    while True:
        response = await client.send(method, url, headers, body, "application/json")
        try:
            if response.status < 400:
                yield response
                return
            raw = await response.read(MAX_ERROR_BODY_BYTES)
        finally:
            await response.aclose()
        error = error_of(response.as_httpx(raw), raw)
        wait = retry_wait_ms(retry, response.status, error, attempt)
        if wait is None:
            raise error
        await trio.sleep(wait / 1000)
        attempt += 1
