"""WebSocket ingress (spec §4.1): one ATP connection per WebSocket.

The encoding is chosen per connection at the WebSocket handshake by subprotocol:
``atp.v1.cbor`` (binary messages) when the client offers it, else ``atp.v1.json``
(text messages). One WebSocket message carries exactly one frame. Authentication
is the same bearer token as the control API (``Authorization`` header).

Inbound frames are decoded and verified by :class:`~atp.wire.codec.FrameCodec`; a
frame that fails is answered with an ERROR (``EPROTO``/``ESEC``) on the stream it
names — in that stream's sequence, as a NACK, when the stream was opened on this
connection, else as a lone ERROR frame — or on stream ``"0"`` (the connection
itself) when it names none; the connection and every other stream carry on.
Outbound frames of every stream the connection opened are sent from the stream's
event log.
"""

from __future__ import annotations

import hashlib
import logging

import cbor2
import msgspec
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    serve_websocket,
)

from atp.router.core import Router, StreamCtx, connection_error
from atp.wire.codec import FrameCodec
from atp.wire.errors import ErrorCode, LocalProtocolError
from atp.wire.frame import Flag, Frame

log = logging.getLogger("atp.router.ws")

SUBPROTOCOLS = {"atp.v1.cbor": "cbor", "atp.v1.json": "json"}
CONNECTION_STREAM = "0"


def _token(request: WebSocketRequest) -> str | None:
    for k, v in request.headers:
        if k.lower() == b"authorization":
            scheme, _, tok = v.decode("latin-1").partition(" ")
            return tok if scheme.lower() == "bearer" else None
    return None


async def serve_ws(router: Router, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the WebSocket ingress; ``task_status.started`` gets the WebSocketServer
    (its ``.port`` is the bound port when ``port`` is 0)."""
    tokens = router.config.tokens

    async def handler(request: WebSocketRequest) -> None:
        client = "anonymous"
        if tokens:
            tok = _token(request)
            if tok not in tokens:
                await request.reject(401, body=b'{"error":{"code":"ESEC","reason":"missing or unknown bearer token"}}')
                return
            client = "tok_" + hashlib.sha256(tok.encode()).hexdigest()[:12]
        offered = request.proposed_subprotocols
        chosen = next((p for p in SUBPROTOCOLS if p in offered), None)  # cbor first, as documented
        ws = await request.accept(subprotocol=chosen)
        codec = FrameCodec(SUBPROTOCOLS.get(chosen or "", "json"), hmac_key=router.config.hmac_key)
        try:
            await _connection(router, ws, codec, client)
        except Exception:
            # trio-websocket lets a handler's exception end the whole server: one
            # connection's fault must only end that connection.
            log.exception("WebSocket connection of %s failed", client)

    await serve_websocket(handler, host, port, None, task_status=task_status)


async def _send(ws: WebSocketConnection, codec: FrameCodec, frame: Frame) -> None:
    data = codec.encode(frame)
    await ws.send_message(data.decode("utf-8") if codec.encoding == "json" else data)


async def _follow(ws: WebSocketConnection, codec: FrameCodec, ctx: StreamCtx) -> None:
    try:
        async for ev in ctx.log.follow():
            await _send(ws, codec, ev.frame)
    except ConnectionClosed:
        pass


async def _connection(router: Router, ws: WebSocketConnection, codec: FrameCodec, client: str) -> None:
    followed: dict[str, StreamCtx] = {}  # stream_id → the stream this connection opened
    async with trio.open_nursery() as nursery:
        try:
            while True:
                message = await ws.get_message()
                try:
                    frame = codec.decode(message)  # str only on JSON; CBOR refuses text messages
                except LocalProtocolError as e:
                    session_id, stream_id = _ids_of(message, codec)
                    ctx = followed.get(stream_id)
                    if ctx is not None and ctx.session_id == session_id and not ctx.log.closed:
                        ctx.emit_error(e.code, e.reason)  # sent by the stream's follower, in sequence
                    else:
                        await _send(ws, codec, connection_error(session_id, stream_id, e.code, e.reason))
                    continue
                try:
                    replies = router.receive_frame(frame, client=client, now=trio.current_time())
                except Exception:
                    # One frame must not take the ingress (and with it the router) down.
                    log.exception("frame on %s/%s could not be processed", frame.session_id, frame.stream_id)
                    replies = [connection_error(frame.session_id, frame.stream_id, ErrorCode.EPROTO,
                                                "the router could not process this frame")]
                for f in replies:
                    await _send(ws, codec, f)
                ctx = router.streams.get(frame.stream_id)
                if (Flag.SYN in frame.flags and ctx is not None and ctx.session_id == frame.session_id
                        and followed.get(frame.stream_id) is not ctx):
                    followed[frame.stream_id] = ctx
                    nursery.start_soon(_follow, ws, codec, ctx)
        except ConnectionClosed:
            pass
        # Streams outlive the connection (resumable over SSE); only stop writing.
        nursery.cancel_scope.cancel()


def _ids_of(message: bytes | str, codec: FrameCodec) -> tuple[str, str]:
    """Best-effort session/stream ids of an undecodable frame, for the ERROR reply."""
    try:
        if codec.encoding == "cbor" and isinstance(message, bytes):
            obj = cbor2.loads(message)
        else:
            obj = msgspec.json.decode(message)
    except (msgspec.DecodeError, cbor2.CBORError, ValueError, TypeError, RecursionError, OverflowError, MemoryError):
        obj = None  # undecodable in any way: answer on the connection stream
    if isinstance(obj, dict):
        s, t = obj.get("session_id"), obj.get("stream_id")
        if isinstance(s, str) and isinstance(t, str) and s and t:
            return s[:128], t[:128]
    return CONNECTION_STREAM, CONNECTION_STREAM
