"""The WebSocket transport of :class:`atp.Client` (spec §4.1, §8, §11): one
connection to the router's WebSocket ingress, kept up and resumed.

* **Connection.** An HTTP upgrade (``httpx`` + ``httpx-ws``, on anyio: trio or
  asyncio) offering one subprotocol, ``atp.v1.json`` (text messages) or
  ``atp.v1.cbor`` (binary), with ``Authorization: Bearer <token>``; a refusal
  raises :class:`ATPClientError` with the router's code and the HTTP status
  (401, 403). One message is one frame; the SDK seals every frame it sends
  (checksums; with keys ``meta.nonce``, ``meta.ts`` and ``sig``) and checks
  every frame it gets (checksums; with keys the ``sig``).
* **Streams.** A SYN carries the task (meta: the task keys, ``budget``,
  ``idempotency_key``; ``window``; ``qos``; the task payload). Every stream gets an
  idempotency key (the caller's, else a random one) and the stream id
  :func:`~atp._wsstream.stream_id_for` derives from it, so it can always be
  resumed. The SDK numbers its messages (``msg_seq`` 1, 2, … after the SYN),
  keeps them until the router ACKs them, and answers only the router's FIN
  (with its own FIN); it ACKs nothing (the router does not retransmit).
  A key the caller gives may name a stream opened over HTTP, on ids the SDK
  cannot derive: such opens go one at a time, and a SYN+ACK on unknown ids
  answers the one waiting.
* **Liveness.** An HB on stream ``"0"`` every ``hb_interval_s`` (below the
  router's ``hb_timeout_s``, 30 s by default); a connection from which nothing
  came for ``hb_timeout_s`` is dead (above the router's ``hb_interval_s``, 10 s
  by default: the router's HBs keep an idle connection alive).
* **Reconnection.** A dead or dropped connection is reconnected (backoff 0.05 s
  doubling to 2 s) for up to ``reconnect_s``; on each new connection every
  stream still open is re-opened: before its SYN+ACK with its SYN again, after it
  with a SYN carrying ``meta.resume_after`` (the router's last complete message
  received), then the messages the router has not ACKed. The router replays
  from there; :class:`~atp._wsstream.WsStream` drops what it already holds, so
  :meth:`WsTransport.events` goes on with no duplicate and no gap. When
  reconnecting fails for ``reconnect_s`` every waiting call raises
  ``ATPClientError("ETRANSPORT")`` and so does every call after it: a new client
  re-opens the streams by idempotency key.

The connection's tasks run in a task group the client enters in ``async with``:
use the client in the task that entered it.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import httpx
import wsproto.events
from anyio.abc import TaskGroup, TaskStatus
from httpx_ws import AsyncWebSocketSession, HTTPXWSException

from atp._frames import CONNECTION_STREAM, SUBPROTOCOLS, Encoding, FrameKeys, budget_frame, decode, encode, \
    flags_of, seal, verify
from atp._types import ATPClientError, Event, StreamHandle
from atp._wsstream import WsStream, error_of, is_message, stream_id_for

log = logging.getLogger("atp.ws")

_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.05, 2.0
#: A connection that served this long (s) ends an outage: the next one starts afresh.
_STABLE_S = 1.0


def _refusal(status: int, body: bytes) -> ATPClientError:
    """The router's refusal of the upgrade (``{"error": {"code", "reason"}}``)."""
    try:
        err = json.loads(body)["error"]
        return ATPClientError(str(err["code"]), str(err["reason"]), status=status, detail=err)
    except (ValueError, KeyError, TypeError):
        return ATPClientError("ESEC" if status in (401, 403) else "EPROTO",
                              f"WebSocket upgrade refused: HTTP {status}: {body[:200]!r}", status=status)


class WsTransport:
    """Streams over one WebSocket connection, reconnected and resumed (module
    doc). Runs inside ``async with`` (:meth:`start` / :meth:`aclose`)."""

    def __init__(self, url: str, token: str | None, *, encoding: Encoding, keys: FrameKeys | None,
                 timeout: float, hb_interval_s: float, hb_timeout_s: float, reconnect_s: float):
        if encoding not in SUBPROTOCOLS:
            raise ValueError(f"encoding must be 'json' or 'cbor', not {encoding!r}")
        if min(timeout, hb_interval_s, hb_timeout_s) <= 0 or reconnect_s < 0:
            raise ValueError("timeout, hb_interval_s and hb_timeout_s must be > 0 s and reconnect_s >= 0 s")
        self.url, self.encoding, self.keys = url, encoding, keys
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout, self._hb_interval_s, self._hb_timeout_s = timeout, hb_interval_s, hb_timeout_s
        self._reconnect_s = reconnect_s
        #: This client's own session (its SYNs and HBs); streams re-opened by key keep theirs.
        self.session_id = "sess_" + secrets.token_hex(8)
        #: stream id → state (a stream adopted under the router's ids is also under its first id).
        self._streams: dict[str, WsStream] = {}
        self._ws: AsyncWebSocketSession | None = None
        self._gen = 0
        self._broken: ATPClientError | None = None
        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._conn_tg: TaskGroup | None = None
        self._lock: anyio.Lock | None = None
        #: Held by an open with the caller's key from its SYN to the answer: a SYN+ACK
        #: on ids we do not know (a stream the key opened over HTTP) is that open's.
        self._foreign_lock: anyio.Lock | None = None
        self._adoptable: WsStream | None = None
        self._http: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect (raises :class:`ATPClientError`: the router's refusal with its
        HTTP status, or ``ETRANSPORT``) and keep the connection up in the background."""
        self._lock, self._foreign_lock = anyio.Lock(), anyio.Lock()
        self._stack = AsyncExitStack()
        self._http = await self._stack.enter_async_context(httpx.AsyncClient(timeout=self._timeout))
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        try:
            await self._tg.start(self._supervise)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close the connection. Streams still running go on on the router
        (detached, resumable by idempotency key for its ``resume_grace_s``)."""
        if self._stack is None:
            return
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        stack, self._stack = self._stack, None
        await stack.aclose()
        self._broken = self._broken or ATPClientError("ETRANSPORT", "the client is closed")

    def _running(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._stack is None:
            raise ATPClientError("ETRANSPORT", "a WebSocket client runs inside `async with atp.Client(...)`")

    # ------------------------------------------------------------------ connection
    async def _supervise(self, *, task_status: TaskStatus[None]) -> None:
        """Keep a connection up: the first attempt's failure is :meth:`start`'s;
        later ones are retried with backoff for ``reconnect_s`` from the end of
        the last connection that served at least :data:`_STABLE_S`."""
        started = False
        down_since: float | None = None
        delay = _BACKOFF_FIRST_S
        while True:
            up_at: float | None = None
            try:
                async with self._connect() as ws:
                    up_at = anyio.current_time()
                    await self._on_connected(ws)
                    if not started:
                        started = True
                        task_status.started()
                    await self._serve(ws)
            except ATPClientError as e:
                if not started:
                    raise
                if e.status in (401, 403):
                    return self._break(e)
                log.info("WebSocket reconnect to %s failed: %s", self.url, e)
            except Exception as e:  # network errors of every layer (httpx, httpx-ws, anyio, OS) alike
                if not started:
                    raise ATPClientError("ETRANSPORT", f"{type(e).__name__}: {e}") from e
                log.info("WebSocket connection to %s failed: %s: %s", self.url, type(e).__name__, e)
            finally:
                self._ws = None
            now = anyio.current_time()
            if up_at is not None and now - up_at >= _STABLE_S:
                down_since, delay = now, _BACKOFF_FIRST_S  # it served: a new outage starts now
            elif down_since is None:
                down_since = now
            if now - down_since >= self._reconnect_s:
                return self._break(ATPClientError(
                    "ETRANSPORT", f"connection to {self.url} lost and not re-established within {self._reconnect_s:g} s"))
            await anyio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncWebSocketSession]:
        assert self._http is not None
        headers = {**self._headers, "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": base64.b64encode(secrets.token_bytes(16)).decode("ascii"),
                   "Sec-WebSocket-Protocol": SUBPROTOCOLS[self.encoding]}
        async with self._http.stream("GET", self.url, headers=headers) as resp:
            if resp.status_code != 101:
                raise _refusal(resp.status_code, await resp.aread())
            chosen = resp.headers.get("sec-websocket-protocol")
            if chosen != SUBPROTOCOLS[self.encoding]:
                raise ATPClientError("EPROTO", f"the router answered subprotocol {chosen!r}, not "
                                     f"{SUBPROTOCOLS[self.encoding]!r}", status=101)
            session = AsyncWebSocketSession(resp.extensions["network_stream"], response=resp,
                                            keepalive_ping_interval_seconds=None, keepalive_ping_timeout_seconds=None)
            async with session:
                yield session

    async def _on_connected(self, ws: AsyncWebSocketSession) -> None:
        """A new connection: every stream still open is re-opened on it (module doc)."""
        assert self._lock is not None
        async with self._lock:
            self._ws, self._gen = ws, self._gen + 1
            await self._send(self._hb())
            for s in self._unique_streams():
                if s.refused is None and s.error is None and not s.ended:
                    await self._reopen(s)

    async def _reopen(self, s: WsStream) -> None:
        """(Re)send ``s``'s SYN on the current connection, then its messages not ACKed. Lock held."""
        s.gen = self._gen
        await self._send(s.reopen_frame())
        if s.accepted:
            for seq in sorted(s.unacked):
                await self._send(s.unacked[seq])

    async def _serve(self, ws: AsyncWebSocketSession) -> None:
        """Read frames until the connection drops or goes silent for ``hb_timeout_s``."""
        async with anyio.create_task_group() as tg:
            self._conn_tg = tg
            tg.start_soon(self._heartbeats)
            try:
                while True:
                    try:
                        event = await ws.receive(timeout=self._hb_timeout_s)
                    except TimeoutError:
                        log.info("nothing from %s for %g s: connection dead", self.url, self._hb_timeout_s)
                        return
                    except HTTPXWSException as e:
                        log.info("WebSocket connection to %s ended: %s", self.url, type(e).__name__)
                        return
                    if isinstance(event, wsproto.events.TextMessage):
                        await self._on_message(event.data)
                    elif isinstance(event, wsproto.events.BytesMessage):
                        await self._on_message(bytes(event.data))
            finally:
                self._conn_tg = None
                tg.cancel_scope.cancel()

    async def _heartbeats(self) -> None:
        while True:
            await anyio.sleep(self._hb_interval_s)
            await self._send(self._hb())

    def _hb(self) -> dict[str, Any]:
        return {"v": 1, "session_id": self.session_id, "stream_id": CONNECTION_STREAM, "msg_seq": 0,
                "flags": ["HB"], "qos": "gold"}

    async def _send(self, frame: Mapping[str, Any]) -> bool:
        """Seal (and sign) ``frame`` and send it; False when there is no connection
        (the frame goes again with the stream's resumption)."""
        ws = self._ws
        if ws is None:
            return False
        message = encode(seal(frame, self.keys), self.encoding)
        try:
            if isinstance(message, str):
                await ws.send_text(message)
            else:
                await ws.send_bytes(message)
        except Exception as e:  # a connection going down fails writes in many ways; the reader sees it too
            log.debug("send on %s failed: %s: %s", self.url, type(e).__name__, e)
            return False
        return True

    def _break(self, error: ATPClientError) -> None:
        self._broken = error
        for s in self._unique_streams():
            s.changed.notify()

    def _unique_streams(self) -> list[WsStream]:
        return list({id(s): s for s in self._streams.values()}.values())

    # ------------------------------------------------------------------ receiving
    async def _on_message(self, message: str | bytes) -> None:
        try:
            frame = decode(message, self.encoding)
        except ATPClientError as e:
            log.warning("dropped a message from %s: %s", self.url, e.reason)
            return
        try:
            verify(frame, self.keys)
        except ATPClientError as e:
            return self._unverified(frame, self._streams.get(frame["stream_id"]), e)
        if frame["stream_id"] == CONNECTION_STREAM:
            if "HB" not in flags_of(frame):
                log.warning("error from %s on the connection: %s", self.url, error_of(frame, "?"))
            return
        s = self._stream_for(frame)
        if s is None:
            return  # a stream we discarded, or never had
        try:
            replies = s.on_frame(frame)
        except (KeyError, TypeError, ValueError) as e:  # a frame of the wrong shape: not acted on
            log.warning("dropped a malformed frame from %s on stream %r: %r", self.url, s.stream_id, e)
            return
        for reply in replies:
            await self._send(reply)
        delay = s.retry_after_s()
        if delay is not None and self._conn_tg is not None:
            self._conn_tg.start_soon(self._resume_later, s, self._gen, delay)

    def _stream_for(self, frame: dict[str, Any]) -> WsStream | None:
        s = self._streams.get(frame["stream_id"])
        if s is None and self._adoptable is not None and "SYN" in flags_of(frame):
            # The SYN+ACK of a stream our key opened elsewhere (over HTTP): the one open waiting for it.
            s, self._adoptable = self._adoptable, None
            self._streams[frame["stream_id"]] = s
        return s

    def _unverified(self, frame: dict[str, Any], s: WsStream | None, e: ATPClientError) -> None:
        """A frame that failed its checks is not acted on: the stream it names
        fails with the reason (and what the frame said, unverified)."""
        said = error_of(frame, "")
        told = f"; the router's unverified answer: {said.code}: {said.reason}" if said.reason else ""
        err = ATPClientError(e.code, e.reason + told, detail=said.detail)
        if s is None:
            log.warning("frame from %s on stream %r failed its checks: %s", self.url, frame["stream_id"], err)
        elif not s.accepted:
            s.refused = err
            s.changed.notify()
        else:
            s.error = err
            s.changed.notify()

    async def _resume_later(self, s: WsStream, gen: int, delay: float) -> None:
        """Re-send a resumption the router refused with ``retry_after_ms``."""
        await anyio.sleep(delay)
        assert self._lock is not None
        async with self._lock:
            if self._gen == gen and s.error is None and not s.ended:
                await self._reopen(s)

    # ------------------------------------------------------------------ streams
    def _get(self, stream: StreamHandle | str) -> WsStream:
        self._running()
        s = self._streams.get(str(stream))
        if s is None:
            raise ATPClientError("EPROTO", f"stream {str(stream)!r} was not opened by this client "
                                 "(re-open it with its idempotency_key)")
        return s

    async def _wait(self, s: WsStream, done: Any, what: str) -> None:
        """Wait until ``done()``; raises the client's break, the stream's error,
        or ``ETRANSPORT`` after ``timeout``."""
        with anyio.move_on_after(self._timeout):
            while not done():
                if self._broken is not None:
                    raise self._broken
                if s.error is not None:
                    raise s.error
                await s.changed.wait()
            return
        raise ATPClientError("ETRANSPORT", f"no {what} from the router within {self._timeout:g} s")

    async def open_stream(self, task: Mapping[str, Any], budget: Mapping[str, Any] | None, *,
                          content: Mapping[str, Any] | None, qos: str | None, window: Mapping[str, int] | None,
                          idempotency_key: str | None) -> StreamHandle:
        """SYN with the task, and the SYN+ACK's handle (see ``atp.Client.open_stream``)."""
        self._running()
        key = idempotency_key if idempotency_key is not None else "sdk_" + secrets.token_urlsafe(18)
        sid = stream_id_for(key)
        s = self._streams.get(sid)
        if s is not None and s.key == key and s.refused is None and s.error is None:
            if content is not None and not s.same_task(task, content):
                raise ATPClientError("EPROTO", f"idempotency_key {key!r} names a different task: this "
                                     "client opened its stream with another task_type or content")
            await self._wait(s, lambda: s.accepted or s.refused is not None, "SYN-ACK")
        else:
            s = self._new_stream(key, sid, task, budget, content, qos, window)
            if idempotency_key is None:
                await self._open(s)
            else:
                assert self._foreign_lock is not None
                async with self._foreign_lock:
                    self._adoptable = s
                    try:
                        await self._open(s)
                    finally:
                        self._adoptable = None
        if s.refused is not None:
            raise s.refused
        assert s.handle is not None
        return s.handle

    def _new_stream(self, key: str, sid: str, task: Mapping[str, Any], budget: Mapping[str, Any] | None,
                    content: Mapping[str, Any] | None, qos: str | None,
                    window: Mapping[str, int] | None) -> WsStream:
        meta: dict[str, Any] = {**task, "idempotency_key": key}
        if budget is not None:
            meta["budget"] = dict(budget)
        syn: dict[str, Any] = {"v": 1, "session_id": self.session_id, "stream_id": sid, "msg_seq": 0,
                               "flags": ["SYN"], "meta": meta}
        if qos is not None:
            syn["qos"] = qos
        if window is not None:
            syn["window"] = dict(window)
        if content is not None:
            syn["payload"] = {"type": "task", "content": dict(content)}
        seal(syn)  # a task JSON cannot carry fails here, in the caller
        s = WsStream(key, self.session_id, sid, syn)
        self._streams[sid] = s
        return s

    async def _open(self, s: WsStream) -> None:
        assert self._lock is not None
        async with self._lock:
            if self._ws is not None and s.gen != self._gen:
                await self._reopen(s)
        try:
            await self._wait(s, lambda: s.accepted or s.refused is not None, "SYN-ACK")
        except ATPClientError:
            self._forget(s)  # not resumed later: the caller re-opens by key
            raise
        if s.refused is not None:
            self._forget(s)

    def _forget(self, s: WsStream) -> None:
        for k in [k for k, v in self._streams.items() if v is s]:
            del self._streams[k]

    def discard(self, stream: StreamHandle | str) -> None:
        """Forget a stream's events and state here (it is not resumed any more)."""
        s = self._streams.get(str(stream))
        if s is not None:
            self._forget(s)

    async def events(self, stream: StreamHandle | str, *, last_event_id: int | None = None) -> AsyncIterator[Event]:
        """The stream's events from the first after ``last_event_id``, until FIN or RST."""
        s = self._get(stream)
        i = max(last_event_id or 0, 0)
        while True:
            while i < len(s.events):
                ev = s.events[i]
                i += 1
                yield ev
                if ev.type in ("FIN", "RST"):
                    return
            if s.ended:
                return
            if s.error is not None:
                raise s.error
            if self._broken is not None:
                raise self._broken
            await s.changed.wait()

    async def send_frame(self, stream: StreamHandle | str, frame: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Send one frame on a stream; for a message, wait for the router's answer
        (its ACK or NACK, or a lone ERROR): ``[frame]``; ``[]`` for other frames
        and when the stream ended first. Raises ``ETRANSPORT`` after ``timeout``."""
        s = self._get(stream)
        frame = dict(frame)
        seal(frame)  # fails in the caller for a frame JSON cannot carry
        if not is_message(frame):
            await self._send(frame)
            return []
        if s.ended:
            return []
        seq, mark = s.message_sent(frame), len(s.direct)
        s.waiting[seq] = None
        try:
            assert self._lock is not None
            async with self._lock:
                if s.gen == self._gen:
                    await self._send(frame)
            await self._wait(s, lambda: s.waiting[seq] is not None or len(s.direct) > mark or s.ended, "answer")
        finally:
            answer = s.waiting.pop(seq)
        return [answer] if answer is not None else s.direct[mark:]

    async def budget_update(self, stream: StreamHandle, *, usd: float | None, tokens: int | None,
                            msg_seq: int | None) -> list[dict[str, Any]]:
        """BUDGET_UPDATE as our next message (see ``atp.Client.budget_update``)."""
        s = self._get(stream)
        seq = msg_seq if msg_seq is not None else s.next_seq
        return await self.send_frame(stream, budget_frame(s.session_id, s.stream_id, seq, usd, tokens))
