"""The WebSocket port before a connection is open (spec §4.1): the listener that
bounds sockets still in their opening handshake (TLS, then the HTTP upgrade) per
peer address and in time (:class:`HandshakeGate`, :class:`GatedListener`), and
the upgrade's acceptance with a permessage-deflate whose inflation is bounded
(:func:`accept_with_deflate`, :class:`BoundedPerMessageDeflate`). The connection
itself is :mod:`atp_router.runtime.ingress.ws`'s.
"""

from __future__ import annotations

import logging
import math
import zlib

import trio
from trio_websocket import WebSocketConnection, WebSocketRequest
from wsproto.events import AcceptConnection
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason

from atp_router.flow.peer_slots import PeerSlots

__all__ = [
    "Bound",
    "BoundedPerMessageDeflate",
    "GatedListener",
    "HandshakeGate",
    "PendingStream",
    "accept_with_deflate",
    "leave_gate",
]

log = logging.getLogger("atp_router.runtime.ingress.ws_gate")


class BoundedPerMessageDeflate(PerMessageDeflate):
    """permessage-deflate (RFC 7692; spec §4.1 "negotiated at handshake") whose
    inflation is bounded: a message may inflate to at most ``max_message_bytes``
    (the ingress's message limit) — beyond it the connection is closed with 1009
    (message too big) before the bytes exist, so a small compressed frame cannot
    make the router allocate a thousand times its size (a decompression bomb)."""

    def __init__(self, max_message_bytes: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_message_bytes = max_message_bytes
        self._inflated = 0

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        assert self._decompressor is not None
        room = self.max_message_bytes - self._inflated
        try:
            out = self._decompressor.decompress(data, room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(out)
        if self._inflated > self.max_message_bytes or self._decompressor.unconsumed_tail:
            return CloseReason.MESSAGE_TOO_BIG
        return out

    def frame_inbound_payload_data(self, proto, data: bytes) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        return self._inflate(bytes(data))

    def frame_inbound_complete(self, proto, fin: bool) -> bytes | CloseReason | None:
        if not fin:
            return None
        if not self._inbound_is_compressible or not self._inbound_compressed:
            self._inbound_compressed = None
            self._inflated = 0
            return None
        out = self._inflate(b"\x00\x00\xff\xff")
        if isinstance(out, CloseReason):
            return out
        no_context_takeover = self.server_no_context_takeover if proto.client else self.client_no_context_takeover
        if no_context_takeover:
            self._decompressor = None
        self._inbound_compressed = None
        self._inflated = 0
        return out


async def accept_with_deflate(request: WebSocketRequest, subprotocol: str | None, *, deflate: bool,
                  max_message_bytes: int) -> WebSocketConnection:
    """``request.accept`` with permessage-deflate offered to wsproto, which
    negotiates it only when the client proposed it (trio-websocket 0.12 has no
    parameter for extensions; this is its ``accept`` with one more argument)."""
    if not deflate:
        return await request.accept(subprotocol=subprotocol)
    conn = request._connection
    conn._subprotocol = subprotocol
    conn._path = request._event.target
    await conn._send(AcceptConnection(subprotocol=subprotocol, extensions=[
        BoundedPerMessageDeflate(max_message_bytes)]))
    conn._open_handshake.set()
    return conn


class HandshakeGate(PeerSlots):
    """Sockets on the WebSocket port that have not finished their opening
    handshake (TLS, then the HTTP upgrade), per peer address: at most
    ``per_peer`` at once (:class:`~atp_router.flow.peer_slots.PeerSlots`;
    :class:`GatedListener` acts on it). :attr:`refused` counts the sockets
    closed at accept for being over."""

    __slots__ = ()


class PendingStream(trio.abc.HalfCloseableStream):
    """An accepted socket (``trio.SocketStream``, which cannot be subclassed),
    counted in its peer's :class:`HandshakeGate` entry until
    :meth:`handshake_done` or close. Until then a receive past the deadline
    closes the socket and raises ``BrokenResourceError``: whatever reads it
    (the TLS handshake, trio-websocket's reader) gives up at once."""

    def __init__(self, inner: trio.SocketStream, gate: HandshakeGate, peer: str, deadline: float) -> None:
        self.inner = inner
        self._gate, self._peer = gate, peer
        self._deadline: float | None = deadline
        self._counted = True
        #: The deadline scope of a receive in progress (the reader waits in it).
        self._scope: trio.CancelScope | None = None

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    def handshake_done(self) -> None:
        self._deadline = None
        if self._scope is not None:
            self._scope.deadline = math.inf  # the receive waiting now has no deadline either
        self._uncount()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._gate.done(self._peer)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._deadline is None:
            return await self.inner.receive_some(max_bytes)
        with trio.move_on_at(self._deadline) as self._scope:
            return await self.inner.receive_some(max_bytes)
        if self._deadline is None:  # the handshake finished as the deadline came
            return await self.inner.receive_some(max_bytes)
        log.info("WebSocket peer %s did not finish its opening handshake in time: closed", self._peer)
        await self.aclose()
        raise trio.BrokenResourceError("WebSocket opening handshake not finished in time")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        self._uncount()
        await self.inner.aclose()


class GatedListener(trio.abc.Listener[trio.abc.HalfCloseableStream]):
    """The WebSocket port's listener: each accepted socket must finish its
    opening handshake by ``timeout_s`` after accept (:class:`PendingStream`),
    and a peer address over its :class:`HandshakeGate` bound has its new socket
    closed at once, unread."""

    def __init__(self, inner: trio.SocketListener, gate: HandshakeGate, timeout_s: float) -> None:
        self.inner, self.gate, self.timeout_s = inner, gate, timeout_s

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    async def accept(self) -> PendingStream:
        while True:
            stream = await self.inner.accept()
            try:
                peer = str(stream.socket.getpeername()[0])
            except (OSError, IndexError, TypeError):
                peer = "?"
            if self.gate.admit(peer):
                return PendingStream(stream, self.gate, peer, trio.current_time() + self.timeout_s)
            await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Bound:
    """What :func:`~atp_router.runtime.ingress.ws.serve_ws` passes to ``task_status.started``: ``port``, the
    bound port of its first listener."""

    def __init__(self, listeners: list[GatedListener]) -> None:
        self.listeners = listeners

    @property
    def port(self) -> int:
        return int(self.listeners[0].socket.getsockname()[1])


def leave_gate(request: WebSocketRequest) -> None:
    """The upgrade request arrived: its socket leaves the pre-handshake count."""
    stream = getattr(request._connection, "_stream", None)
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, PendingStream):
        stream.handshake_done()
