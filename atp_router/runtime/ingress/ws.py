"""WebSocket ingress (spec §4.1): one ATP connection per WebSocket.

The encoding is chosen per connection at the WebSocket handshake by subprotocol:
``atp.v1.cbor`` (binary messages) when the client offers it, else ``atp.v1.json``
(text messages). One WebSocket message carries exactly one frame. The
handshake's ``Authorization`` header is authenticated once
(:meth:`Router.authenticate <atp_router.runtime.router.Router.authenticate>`: HTTP 401
when refused) and the identity must be allowed to open streams
(``stream_open``: HTTP 403); every frame of the connection then acts for that
identity's tenant. Sessions and streams are the tenant's (spec §11): a session
or stream id another tenant uses names another, unrelated stream here.

Token in a subprotocol: a browser's ``WebSocket`` cannot send an ``Authorization``
header, so the client may offer, besides its encoding, the subprotocol
``atp.bearer.<token as base64url, no padding>`` (the pattern of Kubernetes'
``base64url.bearer.authorization.k8s.io.<token>``). It is authenticated exactly as
``Authorization: Bearer <token>`` (same 401/403, same logged refusal) and never
selected: the response names the encoding subprotocol only. Refused with 401 ``ESEC``
(the reason never quotes the token): both an ``Authorization`` header and a bearer
subprotocol (ambiguous credentials), more than one bearer subprotocol, a token that
is not strict unpadded base64url of UTF-8 text without whitespace or control
characters, or one over :data:`MAX_BEARER_TOKEN_BYTES` (8 KiB decoded, the header's
bound ``MAX_TOKEN_BYTES``).

Inbound frames are decoded and verified by :class:`~atp_router.wire.codec.FrameCodec`; a
frame that fails is answered with an ERROR (``EPROTO``/``ESEC``) on the stream it
names — in that stream's sequence, as a NACK, when the stream was opened on this
connection, else as a lone ERROR frame — or on stream ``"0"`` (the connection
itself) when it names none; the connection and every other stream carry on.
Outbound frames of every stream whose SYN this connection got accepted (for its
tenant), or re-opened by idempotency key, are sent from the stream's event log;
a refused SYN attaches nothing. A reply about a stream the router has closed (a
late message, see :meth:`Router.receive_frame
<atp_router.runtime.router.Router.receive_frame>`) goes out only after that stream's own
last frames, so its RST/FIN arrives first.

ROUTE_UPDATE subscription (spec §4.3): a downstream router or agent whose
identity may read routes (``routes_read``: role admin; the WebSocket handshake
accepts it without ``stream_open``) sends a CTRL frame on stream ``"0"`` with
meta ``{"subscribe": "routes"}``, e.g. ``{"v": 1, "session_id": "s1",
"stream_id": "0", "msg_seq": 1, "flags": ["CTRL"], "meta": {"subscribe":
"routes"}}``. The router answers on stream ``"0"`` of that session with a
CTRL frame carrying a ``ROUTE_UPDATE`` control payload: the whole FIB (weights
scored with the live metrics), then one per new RIB generation (API or
file-watch reload) and one whenever live metrics move a weight by more than
20 % (checked every second), each with, for each task type whose entries
changed, all its current entries, and the task types ``withdrawn``
(:func:`~atp_router.policy.fib.fib_delta`). Updates are not queued: a slow subscriber
gets one delta covering every change it missed. Without
``routes_read`` the subscription is answered with ERROR ``ESEC``.

Liveness (spec §4.4 HB): a watchdog task drives the router sessions the connection
carries (``Session.get_timer`` / ``handle_timer``), sending their HB frames on
stream ``"0"`` every ``hb_interval_s``; a connection that sent no frame for
``hb_timeout_s`` is dead: it is closed (code 1001) and its streams are detached,
not reset — they keep running and stay resumable for ``resume_grace_s``.

Resumption (spec §8): a SYN with a known ``meta.idempotency_key`` of this tenant
(optionally ``meta.resume_after``: the last router ``msg_seq`` received) re-opens
the stream on this connection: its logged events are replayed from that point
and the stream continues live, with no second task and no second charge (see
:meth:`Router.resume_point <atp_router.runtime.router.Router.resume_point>`). Two client
kinds: one that lost its state sends a fresh SYN on the stream's ids and gets
everything from the SYN+ACK on (its task should ride on its first SYN, as over
the HTTP API, since the replay includes the router's ACKs of its earlier
messages); one that kept its session sends the SYN as a raw frame with
``resume_after`` and its session continues in sequence. A duplicate of a frame
already delivered (the task re-sent after a reconnect) is dropped by the
session's reassembler.

Before a connection is open, the port's listener bounds the sockets still in their
opening handshake (per peer address and in time) and the upgrade is accepted with
a permessage-deflate whose inflation is bounded: :mod:`atp_router.runtime.ingress.ws_gate`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import re
import socket
from dataclasses import dataclass, field

import cbor2
import msgspec
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from atp_router.observability import tracing
from atp_router.policy.fib import fib_delta
from atp_router.runtime.dataplane.stream import StreamCtx, connection_error
from atp_router.runtime.ingress.ws_gate import (
    Bound,
    GatedListener,
    HandshakeGate,
    accept_with_deflate,
    leave_gate,
)
from atp_router.runtime.router import Router
from atp_router.security.authn import MAX_TOKEN_BYTES, AuthError
from atp_router.security.identity import Identity
from atp_router.security.tls import serve_websocket_tls
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import (
    ATPError,
    ErrorCode,
    IdempotencyConflict,
    LocalProtocolError,
)
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType

log = logging.getLogger("atp_router.runtime.ingress.ws")

SUBPROTOCOLS = {"atp.v1.cbor": "cbor", "atp.v1.json": "json"}
CONNECTION_STREAM = "0"


#: The subprotocol that carries a bearer token (module doc): ``atp.bearer.<base64url>``.
BEARER_SUBPROTOCOL = "atp.bearer."
#: Longest token a bearer subprotocol may carry (bytes, decoded): the ``Authorization`` header's bound.
MAX_BEARER_TOKEN_BYTES = MAX_TOKEN_BYTES
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


def _authorization(request: WebSocketRequest) -> str | None:
    """The handshake's credential as an ``Authorization`` value: the header, or
    ``Bearer <token>`` of an ``atp.bearer.`` subprotocol (module doc), or None.
    Raises :class:`~atp_router.security.authn.AuthError` (401) for both at once,
    several bearer subprotocols or a malformed one; never quotes the token."""
    header = None
    for k, v in request.headers:
        if k.lower() == b"authorization":
            header = v.decode("latin-1")
            break
    offered = [p for p in request.proposed_subprotocols if p.startswith(BEARER_SUBPROTOCOL)]
    if not offered:
        return header
    if header is not None:
        raise AuthError("ambiguous credentials: both an Authorization header and an atp.bearer. subprotocol; "
                        "send one", invalid_token=False)
    if len(offered) > 1:
        raise AuthError(f"{len(offered)} atp.bearer. subprotocols: at most one")
    return "Bearer " + _bearer_token(offered[0][len(BEARER_SUBPROTOCOL):])


def _bearer_token(encoded: str) -> str:
    """The token of a bearer subprotocol's base64url text (unpadded, canonical).
    Raises AuthError naming what is wrong, never the token."""
    if len(encoded) > -(-MAX_BEARER_TOKEN_BYTES * 4 // 3):  # unpadded length of the longest token
        raise AuthError(f"atp.bearer. subprotocol token over {MAX_BEARER_TOKEN_BYTES} bytes")
    if not _BASE64URL.fullmatch(encoded) or len(encoded) % 4 == 1:
        raise AuthError("atp.bearer. subprotocol is not unpadded base64url ([A-Za-z0-9_-], no '=')")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        raise AuthError("atp.bearer. subprotocol is not unpadded base64url ([A-Za-z0-9_-], no '=')") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != encoded:
        raise AuthError("atp.bearer. subprotocol is not canonical base64url (stray bits in its last character)")
    try:
        token = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthError("atp.bearer. subprotocol token is not UTF-8 text") from None
    if not token or not token.isprintable() or " " in token:  # isprintable: no control nor other space
        raise AuthError("atp.bearer. subprotocol token is empty or has whitespace or control characters")
    return token


def _refusal(e: ATPError) -> bytes:
    return msgspec.json.encode({"error": {"code": str(e.code), "reason": e.reason}})


async def serve_ws(router: Router, host: str, port: int, *, sock: socket.socket | None = None,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the WebSocket ingress; ``task_status.started`` gets the WebSocketServer
    (its ``.port`` is the bound port when ``port`` is 0). ``sock``: serve on this
    listening socket instead of binding ``host:port`` (``atp-router --workers N``:
    every worker accepts on the supervisor's one socket)."""
    handler = functools.partial(_handle, router)
    cfg = router.config
    limit = cfg.max_ws_message_bytes
    tls = cfg.tls
    timeout_s = cfg.ws_handshake_timeout_s
    # Pre-handshake sockets: each finishes its opening handshake (TLS + upgrade)
    # within ws_handshake_timeout_s, at most ws_pending_per_peer per peer address.
    gate = router.ws_handshake_gate = HandshakeGate(cfg.ws_pending_per_peer)
    bound = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))] if sock is not None else \
        await trio.open_tcp_listeners(port, host=host)
    listeners = [GatedListener(lst, gate, timeout_s) for lst in bound]
    if tls is not None:
        # TLS 1.3 (§4.1); the verified client certificate feeds the mTLS identity map.
        await serve_websocket_tls(handler, host, port, tls, max_message_size=limit, listeners=listeners,
                                  handshake_timeout_s=timeout_s, task_status=task_status)
        return
    server = WebSocketServer(handler, listeners, max_message_size=limit, connect_timeout=timeout_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        task_status.started(Bound(listeners))


async def _handle(router: Router, request: WebSocketRequest, peer_cert: dict | None = None) -> None:
    """One upgrade request: authenticate and authorize it (401 / 403), accept it
    with the encoding subprotocol it offers (CBOR first; an ``atp.bearer.`` one is
    a credential, never selected) and serve the connection."""
    leave_gate(request)  # authenticated at once, below
    try:
        # The header or an atp.bearer. subprotocol (never both; never selected below).
        identity = router.authenticate(_authorization(request), peer_cert=peer_cert)
    except ATPError as e:
        router.authentication_refused(e, ingress="websocket")
        await request.reject(401, body=_refusal(e))
        return
    may_open, may_routes = _may(router, identity, "stream_open"), _may(router, identity, "routes_read")
    if not (may_open or may_routes):
        try:
            router.authorize(identity, "stream_open")
        except ATPError as e:
            await request.reject(403, body=_refusal(e))
            return
    offered = request.proposed_subprotocols
    chosen = next((p for p in SUBPROTOCOLS if p in offered), None)  # cbor first, as documented
    ws = await accept_with_deflate(request, chosen, deflate=router.config.ws_deflate,
                                   max_message_bytes=router.config.max_ws_message_bytes)
    codec = FrameCodec(SUBPROTOCOLS.get(chosen or "", "json"), keyring=router.keyring)
    if router.tracing is not None:
        # The handshake's W3C traceparent parents the streams of SYNs without meta.trace (§12).
        tracing.attach_headers(request.headers)
    try:
        await _connection(router, ws, codec, identity)
    except Exception:
        # trio-websocket lets a handler's exception end the whole server: one
        # connection's fault must only end that connection.
        log.exception("WebSocket connection of %s failed", identity.tenant)


def _may(router: Router, identity: Identity, action: str) -> bool:
    try:
        router.authorize(identity, action)
    except ATPError:
        return False
    return True


def is_route_subscribe(frame: Frame) -> bool:
    """A ROUTE_UPDATE subscription: a CTRL frame on stream ``"0"`` whose meta is
    ``{"subscribe": "routes"}`` (see the module doc)."""
    return frame.stream_id == CONNECTION_STREAM and Flag.CTRL in frame.flags and \
        frame.meta.get("subscribe") == "routes"


#: How often a subscriber's FIB weights are compared with the live ones (s), and
#: the relative weight change that makes a ROUTE_UPDATE (the §5.4 cadence rule).
ROUTE_CHECK_S = 1.0
ROUTE_DELTA = 0.2


async def _route_updates(router: Router, conn: _Conn, session_id: str) -> None:
    """Send the running FIB, then a delta whenever it changes: a new RIB
    generation at once, and live-metric weight moves (> :data:`ROUTE_DELTA`
    relative, checked every :data:`ROUTE_CHECK_S`). Never queued: the task sends
    the difference between what it last sent and the FIB now, so a slow
    subscriber coalesces changes and the router never waits for it."""
    sent: list | None = None
    sent_version = -1
    try:
        while True:
            changed = router.control.fib_changed
            fib = router.gen.fib
            current = fib.routes(live=router.learning.live_view())
            new_gen = fib.version != sent_version
            update = fib_delta(sent, current, version=fib.version, rel=0.0 if new_gen else ROUTE_DELTA)
            if new_gen or update.routes or update.withdrawn:
                await _send(conn.ws, conn.codec, Frame(
                    v=1, session_id=session_id, stream_id=CONNECTION_STREAM, msg_seq=0, flags=[Flag.CTRL],
                    payload=Payload(type=PayloadType.CONTROL, content=update)))
                if sent is None or new_gen:
                    sent = current
                else:  # the subscriber now has the changed task types' entries
                    moved = {e.task_type for e in update.routes}
                    sent = [e for e in sent if e.task_type not in moved] + list(update.routes)
                sent_version = fib.version
            with trio.move_on_after(ROUTE_CHECK_S):
                await changed.wait()
    except ConnectionClosed:
        pass


async def _send(ws: WebSocketConnection, codec: FrameCodec, frame: Frame) -> None:
    data = codec.encode(frame)
    await ws.send_message(data.decode("utf-8") if codec.encoding == "json" else data)


class _Follower:
    """This connection sending one stream's events, from event ``sent`` + 1 on.

    It runs as a task while the stream has one; a stream still waiting for its
    task (opened idle) that has nothing more to send *parks* its follower on the
    log (:meth:`~atp_router.runtime.dataplane.eventlog.EventLog.park`) and the log's next change
    starts it again: an idle stream costs no task (≈ 3.5 KB less, issue 10).
    :meth:`stop` ends it for good (the stream is detached when it was the last)."""

    __slots__ = ("_stopped_event", "conn", "ctx", "nursery", "parked", "scope", "sent", "stopped")

    def __init__(self, conn: _Conn, ctx: StreamCtx, nursery: trio.Nursery, after: int) -> None:
        self.conn, self.ctx, self.nursery, self.sent = conn, ctx, nursery, max(after, 0)
        self.scope: trio.CancelScope | None = None
        self.parked = self.stopped = False
        self._stopped_event: trio.Event | None = None
        ctx.attach()

    def start(self) -> None:
        self.parked = False
        self.scope = trio.CancelScope()
        self.nursery.start_soon(self._run)

    def wake(self) -> None:
        """The log changed (called by the log, synchronously): send on."""
        if self.parked and not self.stopped:
            self.start()

    async def _run(self) -> None:
        log_ = self.ctx.log
        parked = False
        try:
            with self.scope:
                while True:
                    events, finished = log_.take(self.sent)
                    for ev in events:
                        await _send(self.conn.ws, self.conn.codec, ev.frame)
                        self.sent = ev.id
                    if finished:
                        break
                    if not events:
                        if self.ctx.task_started:
                            await log_.wait_change()
                            continue
                        log_.park(self.wake)  # nothing to send until the task comes: no task meanwhile
                        parked = self.parked = True
                        self.scope = None
                        return
        except ConnectionClosed:
            pass
        finally:
            if not parked:
                self.stop()

    def stop(self) -> None:
        """Stop for good: stop sending, detach from the stream, and let the
        connection forget it (a long-lived connection would otherwise hold every
        stream it ever carried)."""
        if self.stopped:
            return
        self.stopped = True
        if self.parked:
            self.ctx.log.unpark(self.wake)
            self.parked = False
        if self.scope is not None:
            self.scope.cancel()
        if self._stopped_event is not None:
            self._stopped_event.set()
        self.ctx.detach()
        if self.conn.followed.get(key := (self.ctx.session_id, self.ctx.stream_id)) is self:
            del self.conn.followed[key]

    async def wait_stopped(self) -> None:
        if not self.stopped:
            if self._stopped_event is None:
                self._stopped_event = trio.Event()
            await self._stopped_event.wait()


@dataclass(eq=False)
class _Conn:
    """One WebSocket connection: who it is, what it carries, when it last spoke."""

    ws: WebSocketConnection
    codec: FrameCodec
    identity: Identity
    last_recv: float
    #: Session ids (of the identity's tenant) whose frames came on this connection
    #: (their HBs go out here).
    sessions: set[str] = field(default_factory=set)
    #: (session_id, stream_id) → this connection's follower of the stream.
    followed: dict[tuple[str, str], _Follower] = field(default_factory=dict)
    #: The watchdog declared the peer dead.
    dead: bool = False
    #: A ROUTE_UPDATE subscription runs on this connection.
    subscribed: bool = False


def _start_follow(conn: _Conn, nursery: trio.Nursery, ctx: StreamCtx, after: int) -> None:
    """Send ``ctx``'s events after event ``after`` on this connection (restarting
    a follower this connection already runs for it: a re-open replays)."""
    old = conn.followed.get((ctx.session_id, ctx.stream_id))
    fol = _Follower(conn, ctx, nursery, after)  # attached before the old one leaves: no detach between
    if old is not None:
        old.stop()
    conn.followed[(ctx.session_id, ctx.stream_id)] = fol
    fol.start()


async def _reply(conn: _Conn, frame: Frame) -> None:
    """Send a reply that is not part of a stream's log. About a stream this
    connection follows and the router closed, it waits until the follower sent
    the stream's last frames: its own RST/FIN must reach the client first."""
    fol = conn.followed.get((frame.session_id, frame.stream_id))
    if fol is not None and fol.ctx.log.closed:
        await fol.wait_stopped()
    await _send(conn.ws, conn.codec, frame)


async def _watchdog(router: Router, conn: _Conn, dead: trio.CancelScope) -> None:
    """HB every ``hb_interval_s`` from the sessions this connection carries; after
    ``hb_timeout_s`` without a frame from the peer, cancel ``dead`` (the
    connection's scope): followers stop, so its streams are detached. Ends
    quietly when the peer closes the connection under an HB (the receive loop
    sees the close too and ends the connection)."""
    cfg = router.config
    try:
        while True:
            tenant = conn.identity.tenant
            sessions = [s for sid in conn.sessions if (s := router.streams.get_session(tenant, sid)) is not None]
            timers = [t for s in sessions if (t := s.get_timer()) is not None]
            now = trio.current_time()
            # New sessions may join meanwhile: look again at least every hb_interval_s.
            wake = min([conn.last_recv + cfg.hb_timeout_s, now + cfg.hb_interval_s, *timers])
            await trio.sleep_until(wake)
            now = trio.current_time()
            if now >= conn.last_recv + cfg.hb_timeout_s:
                log.info("WebSocket peer %s silent for %.1f s (hb_timeout %g s): connection dead, streams detached",
                         conn.identity.tenant, now - conn.last_recv, cfg.hb_timeout_s)
                conn.dead = True
                dead.cancel()
                return
            for sess in sessions:
                t = sess.get_timer()
                if t is not None and now >= t:
                    for ev in sess.handle_timer(now):
                        if isinstance(ev, S.SendFrames):
                            for f in ev.frames:
                                await _send(conn.ws, conn.codec, f)
    except ConnectionClosed:
        pass


async def _connection(router: Router, ws: WebSocketConnection, codec: FrameCodec, identity: Identity) -> None:
    conn = _Conn(ws, codec, identity, trio.current_time())
    may_open = _may(router, identity, "stream_open")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watchdog, router, conn, nursery.cancel_scope)
        try:
            while True:
                message = await ws.get_message()
                conn.last_recv = trio.current_time()
                frame = await _decode(router, conn, message)
                if frame is not None:
                    await _on_frame(router, conn, nursery, frame, may_open=may_open)
        except ConnectionClosed:
            pass
        finally:
            # Streams outlive the connection (detached, resumable); only stop writing
            # (parked followers too: they have no task the cancellation would end).
            for fol in list(conn.followed.values()):
                fol.stop()
        nursery.cancel_scope.cancel()
    if conn.dead:
        # The watchdog declared the peer dead: close with "going away".
        with trio.move_on_after(1.0) as cleanup:
            cleanup.shield = True
            await ws.aclose(1001, "peer dead: heartbeat timeout")


async def _decode(router: Router, conn: _Conn, message: bytes | str) -> Frame | None:
    """The frame of one WebSocket message, or None when it is dropped (over the
    tenant's bodies in flight: ERROR EWINDOW on the connection) or undecodable
    (answered with an ERROR, see the module doc)."""
    tenant = conn.identity.tenant
    # The tenant's bodies in flight, every ingress together (atp_router.flow.body_budget):
    # over it, the frame is dropped undecoded with ERROR EWINDOW on the connection.
    grant = router.body_budget.open(tenant, len(message))
    if grant is None:
        router.metrics.errors.labels(str(ErrorCode.EWINDOW)).inc()
        await _reply(conn, connection_error(
            CONNECTION_STREAM, CONNECTION_STREAM, ErrorCode.EWINDOW,
            f"tenant {tenant!r} has too many bytes of requests in flight (tenant_body_bytes="
            f"{router.body_budget.per_tenant:,}): this frame was dropped; resend it later"))
        return None
    try:
        # Signature, then the nonce + timestamp window when signed (§11); ESEC audited.
        # str only on JSON; CBOR refuses text messages.
        return router.decode_frame(conn.codec, message, conn.identity)
    except LocalProtocolError as e:
        session_id, stream_id = _ids_of(message, conn.codec)
        followed = conn.followed.get((session_id, stream_id))
        ctx = followed.ctx if followed is not None else None
        if ctx is not None and not ctx.log.closed:
            ctx.emit_error(e.code, e.reason)  # sent by the stream's follower, in sequence
        else:
            await _reply(conn, connection_error(session_id, stream_id, e.code, e.reason))
        return None
    finally:
        grant.release()


async def _on_frame(router: Router, conn: _Conn, nursery: trio.Nursery, frame: Frame, *, may_open: bool) -> None:
    """One decoded frame: a ROUTE_UPDATE subscription, or a frame for the router
    (its replies sent, the stream it opened or re-opened followed)."""
    identity, tenant = conn.identity, conn.identity.tenant
    if is_route_subscribe(frame):
        await _subscribe(router, conn, nursery, frame)
        return
    if not may_open:
        await _reply(conn, connection_error(frame.session_id, frame.stream_id, ErrorCode.ESEC,
                                            "this identity may not open streams (stream_open)"))
        return
    conn.sessions.add(frame.session_id)
    try:
        resumed = router.resume_point(frame, identity=identity)
    except IdempotencyConflict:
        resumed = None  # receive_frame answers the SYN with the conflict's ERROR
    syn = Flag.SYN in frame.flags
    before = router.streams.get(tenant, frame.session_id, frame.stream_id) if syn else None
    try:
        replies = router.receive_frame(frame, identity=identity, now=conn.last_recv)
    except Exception:
        # One frame must not take the ingress (and with it the router) down.
        log.exception("frame on %s/%s could not be processed", frame.session_id, frame.stream_id)
        replies = [connection_error(frame.session_id, frame.stream_id, ErrorCode.EPROTO,
                                    "the router could not process this frame")]
    for f in replies:
        await _reply(conn, f)
    if resumed is not None:
        _start_follow(conn, nursery, *resumed)
        return
    # Only a stream this very SYN opened, in this connection's tenant: a
    # refused SYN (or one naming a stream already open) attaches nothing.
    ctx = router.streams.get(tenant, frame.session_id, frame.stream_id) if syn else None
    if ctx is not None and ctx is not before:
        _start_follow(conn, nursery, ctx, 0)


async def _subscribe(router: Router, conn: _Conn, nursery: trio.Nursery, frame: Frame) -> None:
    """A ROUTE_UPDATE subscription: ERROR ESEC without ``routes_read``, else the
    updates start (once a connection)."""
    if not _may(router, conn.identity, "routes_read"):
        await _reply(conn, connection_error(frame.session_id, CONNECTION_STREAM, ErrorCode.ESEC,
                                            "ROUTE_UPDATE subscription needs a role with routes_read"))
    elif not conn.subscribed:
        conn.subscribed = True
        nursery.start_soon(_route_updates, router, conn, frame.session_id)


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
