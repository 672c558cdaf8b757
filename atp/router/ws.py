"""WebSocket ingress (spec §4.1): one ATP connection per WebSocket.

The encoding is chosen per connection at the WebSocket handshake by subprotocol:
``atp.v1.cbor`` (binary messages) when the client offers it, else ``atp.v1.json``
(text messages). One WebSocket message carries exactly one frame. Authentication
is the same bearer token as the control API (``Authorization`` header).

Inbound frames are decoded and verified by :class:`~atp.wire.codec.FrameCodec`; a
frame that fails is answered with an ERROR (``EPROTO``/``ESEC``) on the stream it
names (or stream ``"0"``, the connection itself, when it names none) and the
connection and every other stream carry on. Outbound frames of every stream the
connection opened are sent from the stream's event log.
"""

from __future__ import annotations

import hashlib
import logging

import msgspec
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from atp.router.core import Router
from atp.wire.codec import FrameCodec
from atp.wire.errors import LocalProtocolError
from atp.wire.frame import ErrorPayload, Flag, Frame, Payload, PayloadType

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
        chosen = next((p for p in request.proposed_subprotocols if p in SUBPROTOCOLS), None)
        if chosen is None and "atp.v1.cbor" in request.proposed_subprotocols:
            chosen = "atp.v1.cbor"
        ws = await request.accept(subprotocol=chosen)
        codec = FrameCodec(SUBPROTOCOLS.get(chosen or "", "json"), hmac_key=router.config.hmac_key)
        await _connection(router, ws, codec, client)

    await serve_websocket(handler, host, port, None, task_status=task_status)


async def _send(ws: WebSocketConnection, codec: FrameCodec, frame: Frame) -> None:
    data = codec.encode(frame)
    await ws.send_message(data.decode("utf-8") if codec.encoding == "json" else data)


async def _follow(router: Router, ws: WebSocketConnection, codec: FrameCodec, stream_id: str) -> None:
    ctx = router.streams.get(stream_id)
    if ctx is None:
        return
    try:
        async for ev in ctx.log.follow():
            await _send(ws, codec, ev.frame)
    except ConnectionClosed:
        pass


async def _connection(router: Router, ws: WebSocketConnection, codec: FrameCodec, client: str) -> None:
    followed: set[str] = set()
    async with trio.open_nursery() as nursery:
        try:
            while True:
                message = await ws.get_message()
                try:
                    frame = codec.decode(message if isinstance(message, bytes) else message.encode("utf-8"))
                except LocalProtocolError as e:
                    ids = _ids_of(message)
                    await _send(ws, codec, _error_frame(ids, e))
                    continue
                for f in router.receive_frame(frame, client=client, now=trio.current_time()):
                    await _send(ws, codec, f)
                if Flag.SYN in frame.flags and frame.stream_id not in followed and frame.stream_id in router.streams:
                    followed.add(frame.stream_id)
                    nursery.start_soon(_follow, router, ws, codec, frame.stream_id)
        except ConnectionClosed:
            pass
        # Streams outlive the connection (resumable over SSE); only stop writing.
        nursery.cancel_scope.cancel()


def _ids_of(message: bytes | str) -> tuple[str, str]:
    """Best-effort session/stream ids of an undecodable frame, for the ERROR reply."""
    try:
        obj = msgspec.json.decode(message) if isinstance(message, (str, bytes)) else {}
        if isinstance(obj, dict):
            s, t = obj.get("session_id"), obj.get("stream_id")
            if isinstance(s, str) and isinstance(t, str) and s and t:
                return s[:128], t[:128]
    except msgspec.DecodeError:
        pass
    return CONNECTION_STREAM, CONNECTION_STREAM


def _error_frame(ids: tuple[str, str], e: LocalProtocolError) -> Frame:
    return Frame(
        v=1, session_id=ids[0], stream_id=ids[1], msg_seq=0, flags=[Flag.CTRL],
        payload=Payload(type=PayloadType.CONTROL, content=ErrorPayload(code=e.code, reason=e.reason)),
    )
