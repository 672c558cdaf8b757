"""The ATP session state machine, sans-IO (spec §4.4, §4.5, §8, §10).

One :class:`Session` serves one connection: one ``session_id``, many streams. It
never does I/O and never reads the clock (h11, aioquic)::

    receive_frame(frame, now) -> list[Event]   frames in, events out
    open_stream / accept / send_message / send_control / send_error / ack /
    finish / reset / heartbeat                  -> Frame(s) to send
    get_timer() -> deadline | None;  handle_timer(now) -> list[Event]

Every legal move of a stream is in :data:`TRANSITIONS` and nowhere else. Anything
absent from it is a protocol error for *that stream only*: a received frame resets
the stream (RST with ERROR ``EPROTO``, event :class:`ProtocolViolation`); a send
raises :class:`IllegalSend` and changes nothing. Other streams are never touched.

Frame kinds (by flags; anything else is ``EPROTO``)::

    SYN      [SYN] (+CTRL)        msg_seq 0; task meta, initial window, payload
    SYN+ACK  [SYN, ACK] (+CTRL)   msg_seq 0; window (and a WINDOW_UPDATE payload)
    DATA     [], [MORE], [CTRL]   msg_seq 1, 2, … per direction; fragments frag_seq 0..K
    ACK      [ACK] (+CTRL)        msg_seq = highest msg_seq delivered in order;
                                  may carry a control payload: WINDOW_UPDATE, or an
                                  ERROR (a NACK: ESEQ_RETRY, EWINDOW, ttl expired …)
    FIN      [FIN]                msg_seq = last msg_seq sent; no payload
    RST      [RST] (+anything)    payload ERROR; never answered
    HB       [HB]                 on stream "0" for the session, or on an open stream

Conventions: ``CTRL`` is set exactly when ``payload.type == "control"`` (for DATA
frames; on SYN/SYN+ACK/ACK/RST the payload type decides). Control DATA frames are
never fragmented. Only one message may be open (streamed with ``MORE``) per stream
at a time. Stream id ``"0"`` is reserved for session heartbeats (:data:`HB_STREAM_ID`).
Frames produced are unsealed: the codec seals them on encode.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct

from atp_router.wire.errors import ATPError, ErrorCode, LocalProtocolError
from atp_router.wire.frame import (
    PROTOCOL_VERSION,
    Control,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
    WindowUpdate,
)
from atp_router.wire.reassembly import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_FRAGMENTS,
    DEFAULT_MAX_OUT_OF_ORDER,
    Dropped,
    MessageComplete,
    Reassembler,
    fragment,
)

HB_STREAM_ID = "0"
"""Stream id of session-level heartbeats; no stream may be opened with it."""

DEFAULT_TTL = 8
DEFAULT_MAX_STREAMS = 256


class Role(enum.Enum):
    """Which side of the handshake this session plays: the CLIENT sends SYN, the
    ROUTER answers SYN+ACK (a router talking to a downstream agent is its CLIENT)."""

    CLIENT = "client"
    ROUTER = "router"


class StreamState(enum.Enum):
    """Stream states (spec §8). CLOSED streams are freed: :meth:`Session.stream_state`
    reports unknown and freed streams as IDLE."""

    # Identity hash: Enum.__hash__ is Python-level and these key the per-frame table lookup.
    __hash__ = object.__hash__

    IDLE = "IDLE"
    SYN_SENT = "SYN_SENT"
    SYN_RCVD = "SYN_RCVD"
    ESTABLISHED = "ESTABLISHED"
    FIN_WAIT = "FIN_WAIT"  # we sent FIN; the peer may still send until its FIN
    CLOSE_WAIT = "CLOSE_WAIT"  # the peer sent FIN; we may still send until ours
    CLOSED = "CLOSED"


class Input(enum.Enum):
    """What moves a stream: a frame kind sent or received (spec §4.4)."""

    # Identity hash: Enum.__hash__ is Python-level and these key the per-frame table lookup.
    __hash__ = object.__hash__

    SEND_SYN = "send SYN"
    RECV_SYN = "recv SYN"
    SEND_SYN_ACK = "send SYN+ACK"
    RECV_SYN_ACK = "recv SYN+ACK"
    SEND_DATA = "send DATA"
    RECV_DATA = "recv DATA"
    SEND_ACK = "send ACK"
    RECV_ACK = "recv ACK"
    SEND_FIN = "send FIN"
    RECV_FIN = "recv FIN"
    SEND_RST = "send RST"
    RECV_RST = "recv RST"
    SEND_HB = "send HB"
    RECV_HB = "recv HB"


# Plain namespaces: an Enum member looked up on its class costs a descriptor call
# (~0.2 µs on 3.11), an attribute of a namespace instance does not. A namespace's
# attributes are untyped, so the type checker reads each as its Enum, whose members
# the namespace holds under the same names (``_I.RECV_DATA`` is ``Input.RECV_DATA``).
if TYPE_CHECKING:
    _S = StreamState
    _I = Input
    _F = Flag
else:
    _S = SimpleNamespace(**StreamState.__members__)
    _I = SimpleNamespace(**Input.__members__)
    _F = SimpleNamespace(**Flag.__members__)
_CONTROL = PayloadType.CONTROL

# Both roles after the handshake: half-close as in TCP (FIN_WAIT still receives,
# CLOSE_WAIT still sends); RST closes from anywhere.
_AFTER_HANDSHAKE: dict[tuple[StreamState, Input], StreamState] = {
    (_S.ESTABLISHED, _I.SEND_DATA): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.RECV_DATA): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.SEND_ACK): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.RECV_ACK): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.SEND_HB): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.RECV_HB): _S.ESTABLISHED,
    (_S.ESTABLISHED, _I.SEND_FIN): _S.FIN_WAIT,
    (_S.ESTABLISHED, _I.RECV_FIN): _S.CLOSE_WAIT,
    (_S.ESTABLISHED, _I.SEND_RST): _S.CLOSED,
    (_S.ESTABLISHED, _I.RECV_RST): _S.CLOSED,
    (_S.FIN_WAIT, _I.RECV_DATA): _S.FIN_WAIT,
    (_S.FIN_WAIT, _I.SEND_ACK): _S.FIN_WAIT,
    (_S.FIN_WAIT, _I.RECV_ACK): _S.FIN_WAIT,
    (_S.FIN_WAIT, _I.SEND_HB): _S.FIN_WAIT,
    (_S.FIN_WAIT, _I.RECV_HB): _S.FIN_WAIT,
    (_S.FIN_WAIT, _I.RECV_FIN): _S.CLOSED,
    (_S.FIN_WAIT, _I.SEND_RST): _S.CLOSED,
    (_S.FIN_WAIT, _I.RECV_RST): _S.CLOSED,
    (_S.CLOSE_WAIT, _I.SEND_DATA): _S.CLOSE_WAIT,
    (_S.CLOSE_WAIT, _I.SEND_ACK): _S.CLOSE_WAIT,
    (_S.CLOSE_WAIT, _I.RECV_ACK): _S.CLOSE_WAIT,
    (_S.CLOSE_WAIT, _I.SEND_HB): _S.CLOSE_WAIT,
    (_S.CLOSE_WAIT, _I.RECV_HB): _S.CLOSE_WAIT,
    (_S.CLOSE_WAIT, _I.SEND_FIN): _S.CLOSED,
    (_S.CLOSE_WAIT, _I.SEND_RST): _S.CLOSED,
    (_S.CLOSE_WAIT, _I.RECV_RST): _S.CLOSED,
}

TRANSITIONS: dict[tuple[Role, StreamState, Input], StreamState] = {
    # CLIENT: open (§8 step 1), wait for the handshake (step 2).
    (Role.CLIENT, _S.IDLE, _I.SEND_SYN): _S.SYN_SENT,
    (Role.CLIENT, _S.IDLE, _I.RECV_RST): _S.IDLE,  # stray RST: dropped, never answered
    (Role.CLIENT, _S.SYN_SENT, _I.RECV_SYN_ACK): _S.ESTABLISHED,
    (Role.CLIENT, _S.SYN_SENT, _I.SEND_HB): _S.SYN_SENT,
    (Role.CLIENT, _S.SYN_SENT, _I.RECV_HB): _S.SYN_SENT,
    (Role.CLIENT, _S.SYN_SENT, _I.SEND_RST): _S.CLOSED,
    (Role.CLIENT, _S.SYN_SENT, _I.RECV_RST): _S.CLOSED,  # refused
    # ROUTER: accept (step 2) or refuse with RST.
    (Role.ROUTER, _S.IDLE, _I.RECV_SYN): _S.SYN_RCVD,
    (Role.ROUTER, _S.IDLE, _I.RECV_RST): _S.IDLE,
    (Role.ROUTER, _S.SYN_RCVD, _I.SEND_SYN_ACK): _S.ESTABLISHED,
    (Role.ROUTER, _S.SYN_RCVD, _I.SEND_HB): _S.SYN_RCVD,
    (Role.ROUTER, _S.SYN_RCVD, _I.RECV_HB): _S.SYN_RCVD,
    (Role.ROUTER, _S.SYN_RCVD, _I.SEND_RST): _S.CLOSED,
    (Role.ROUTER, _S.SYN_RCVD, _I.RECV_RST): _S.CLOSED,
    **{(role, s, i): t for role in Role for (s, i), t in _AFTER_HANDSHAKE.items()},
}
"""Every legal (role, state, input) → next state. Everything absent is EPROTO."""

#: TRANSITIONS of each role, (state, input) → next state: one table per role,
#: shared by every session (each one its own copy cost ~2.7 KB a session).
_MOVES: dict[Role, dict[tuple[StreamState, Input], StreamState]] = {
    role: {(s, i): t for (r, s, i), t in TRANSITIONS.items() if r is role} for role in Role}

_RECV_INPUT: dict[frozenset[Flag], Input] = {
    frozenset(): _I.RECV_DATA,
    frozenset({_F.MORE}): _I.RECV_DATA,
    frozenset({_F.CTRL}): _I.RECV_DATA,
    frozenset({_F.SYN}): _I.RECV_SYN,
    frozenset({_F.SYN, _F.CTRL}): _I.RECV_SYN,
    frozenset({_F.SYN, _F.ACK}): _I.RECV_SYN_ACK,
    frozenset({_F.SYN, _F.ACK, _F.CTRL}): _I.RECV_SYN_ACK,
    frozenset({_F.ACK}): _I.RECV_ACK,
    frozenset({_F.ACK, _F.CTRL}): _I.RECV_ACK,
    frozenset({_F.FIN}): _I.RECV_FIN,
    frozenset({_F.HB}): _I.RECV_HB,
}


def classify(flags: list[Flag]) -> Input | None:
    """The receive :class:`Input` of a frame with these flags, or ``None`` for an
    illegal combination (duplicates included). Any frame with RST is an RST."""
    if not flags:
        return _I.RECV_DATA
    if _F.RST in flags:
        return _I.RECV_RST
    fs = frozenset(flags)
    if len(fs) != len(flags):
        return None
    return _RECV_INPUT.get(fs)


class IllegalSend(ATPError):
    """The caller asked for a send that :data:`TRANSITIONS` (or a session rule)
    forbids; code ``EPROTO``. Nothing changed and nothing is to be sent."""

    def __init__(self, reason: str):
        super().__init__(ErrorCode.EPROTO, reason)


# --- events --------------------------------------------------------------------------


class StreamOpened(Struct, frozen=True, kw_only=True):
    """ROUTER: the peer sent SYN (§8 step 1). Answer with :meth:`Session.accept` or
    :meth:`Session.reset`. ``control`` is the decoded payload when it is a control
    (CAPABILITIES); ``idempotency_key`` is ``meta["idempotency_key"]`` (§8 Resumption)."""

    stream_id: str
    meta: dict[str, Any]
    window: Window | None
    qos: QoS
    payload: Payload | None
    control: Control | None = None
    idempotency_key: str | None = None


class StreamAccepted(Struct, frozen=True, kw_only=True):
    """CLIENT: the router answered SYN+ACK with this window and QoS (§8 step 2)."""

    stream_id: str
    window: Window | None
    qos: QoS


class MessageReceived(Struct, frozen=True, kw_only=True):
    """A whole, in-order message (fragments joined, §4.5); ``meta`` of fragment 0."""

    stream_id: str
    msg_seq: int
    payload: Payload
    meta: dict[str, Any]


class ControlReceived(Struct, frozen=True, kw_only=True):
    """A control payload (§4.3) carried by a DATA+CTRL or an ACK frame."""

    stream_id: str
    control: Control


class AckReceived(Struct, frozen=True, kw_only=True):
    """The peer delivered our messages up to ``msg_seq`` (cumulative, §4.4);
    ``window`` is the frame's window, if any."""

    stream_id: str
    msg_seq: int
    window: Window | None


class StreamFinished(Struct, frozen=True, kw_only=True):
    """The peer sent FIN (§8 step 7). ``complete`` is false when messages the FIN
    covers were never delivered (their buffers are released)."""

    stream_id: str
    complete: bool = True


class StreamReset(Struct, frozen=True, kw_only=True):
    """The stream was aborted: the peer sent RST, or the peer is dead (``ETIMEOUT``)."""

    stream_id: str
    error: ErrorPayload


class HeartbeatReceived(Struct, frozen=True, kw_only=True):
    """HB from the peer, on :data:`HB_STREAM_ID` or on an open stream."""

    stream_id: str


class SendFrames(Struct, frozen=True, kw_only=True):
    """Frames the machine must send in reply: ACKs, NACKs (ERROR ESEQ_RETRY or ttl
    expired), RST with ERROR EPROTO, heartbeats."""

    frames: list[Frame]


class ProtocolViolation(Struct, frozen=True, kw_only=True):
    """The peer broke the protocol on ``stream_id``. Unless the frame was for
    another session (then it is only dropped), the stream is reset: its state is
    freed and a :class:`SendFrames` with the RST follows."""

    stream_id: str
    error: ErrorPayload


class FrameDropped(Struct, frozen=True, kw_only=True):
    """A frame discarded without harm to the stream: late or duplicate fragment,
    ttl expired, stray RST."""

    stream_id: str
    msg_seq: int
    frag_seq: int
    reason: str


class PeerDead(Struct, frozen=True, kw_only=True):
    """No frame from the peer for ``hb_timeout`` seconds; ``streams`` were reset and
    the session is dead (close the connection)."""

    last_seen: float
    streams: tuple[str, ...]


Event = (
    StreamOpened
    | StreamAccepted
    | MessageReceived
    | ControlReceived
    | AckReceived
    | StreamFinished
    | StreamReset
    | HeartbeatReceived
    | SendFrames
    | ProtocolViolation
    | FrameDropped
    | PeerDead
)


def forward_ttl(frame: Frame) -> Frame:
    """The frame as a router forwards it: ``ttl`` decremented, stale ``checksum`` and
    ``sig`` cleared (the codec re-seals, §4.5). Raises ``LocalProtocolError(EPROTO)``
    when ``ttl`` is already 0."""
    if frame.ttl <= 0:
        raise LocalProtocolError(ErrorCode.EPROTO, "ttl expired")
    return msgspec.structs.replace(frame, ttl=frame.ttl - 1, sig=None, checksum=None)


def _decode_control(content: Any) -> Control:
    if isinstance(content, Struct):
        content = msgspec.to_builtins(content)
    try:
        control: Control = msgspec.convert(content, Control)  # a union: msgspec's stub types it Any
    except msgspec.ValidationError as e:
        raise LocalProtocolError(ErrorCode.EPROTO, f"invalid control payload: {e}") from None
    return control


def _control_payload(control: Struct) -> Payload:
    # Builtins, as the peer decodes them: the frame is the same before and after the wire.
    return Payload(type=_CONTROL, content=msgspec.to_builtins(control))


class _Stream:
    __slots__ = ("qos", "rx", "state", "tx_next", "tx_open")

    def __init__(self, state: StreamState, qos: QoS, rx: Reassembler):
        self.state = state
        self.qos = qos
        self.tx_next = 1  # msg_seq of our next new message; 0 was our SYN / SYN+ACK
        self.tx_open: tuple[int, int] | None = None  # (msg_seq, next frag_seq) of a message sent with more=True
        self.rx = rx


class Session:
    """Sans-IO ATP session for one connection (spec §4.4, §4.5, §8, §10).

    ``role``: :class:`Role`. ``now``: the clock at creation (seconds), starting the
    heartbeat timers. ``hb_interval`` / ``hb_timeout`` in seconds. ``max_streams``
    caps concurrent streams (a SYN beyond it is refused with RST ``EPROTO``).
    ``max_buffered_bytes`` / ``max_out_of_order`` / ``max_fragments`` are the
    per-stream :class:`~atp_router.wire.reassembly.Reassembler` caps. With ``auto_ack``
    every :meth:`receive_frame` that delivered messages replies with one cumulative
    ACK. ``ttl`` is set on every frame produced.

    ``receive_frame`` never raises for anything the peer sends; the send methods
    raise :class:`IllegalSend` when the table forbids them.
    """

    def __init__(
        self,
        role: Role,
        session_id: str,
        *,
        now: float,
        hb_interval: float = 10.0,
        hb_timeout: float = 30.0,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        max_out_of_order: int = DEFAULT_MAX_OUT_OF_ORDER,
        max_fragments: int = DEFAULT_MAX_FRAGMENTS,
        auto_ack: bool = True,
        ttl: int = DEFAULT_TTL,
    ):
        if hb_interval <= 0 or hb_timeout <= 0:
            raise ValueError("hb_interval and hb_timeout must be > 0 seconds")
        self.role = role
        self.session_id = session_id
        self.hb_interval = hb_interval
        self.hb_timeout = hb_timeout
        self.max_streams = max_streams
        self.max_buffered_bytes = max_buffered_bytes
        self.max_out_of_order = max_out_of_order
        self.max_fragments = max_fragments
        self.auto_ack = auto_ack
        self.ttl = ttl
        self.dead = False
        self._streams: dict[str, _Stream] = {}
        self._moves = _MOVES[role]
        self._last_recv = now
        self._next_hb = now + hb_interval

    # --- queries ---------------------------------------------------------------------

    def stream_state(self, stream_id: str) -> StreamState:
        """State of a stream; IDLE when unknown or already closed and freed."""
        st = self._streams.get(stream_id)
        return st.state if st is not None else StreamState.IDLE

    @property
    def open_streams(self) -> tuple[str, ...]:
        """Ids of every stream not yet CLOSED."""
        return tuple(self._streams)

    @property
    def buffered_bytes(self) -> int:
        """Reassembly buffers held across all streams (see :class:`Reassembler`)."""
        return sum(st.rx.buffered_bytes for st in self._streams.values())

    # --- timers ------------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """Next deadline (seconds, same clock as ``now``): a heartbeat is due or the
        peer is declared dead. ``None`` once the session is dead."""
        if self.dead:
            return None
        return min(self._next_hb, self._last_recv + self.hb_timeout)

    def handle_timer(self, now: float) -> list[Event]:
        """Run the timers at ``now``. After ``hb_timeout`` without any frame from the
        peer: :class:`PeerDead`, a :class:`StreamReset` (``ETIMEOUT``) per open stream,
        their RSTs to send, and the session is dead. Otherwise an HB to send every
        ``hb_interval``."""
        if self.dead:
            return []
        if now >= self._last_recv + self.hb_timeout:
            self.dead = True
            err = ErrorPayload(
                code=ErrorCode.ETIMEOUT,
                reason=f"peer dead: no frame for {now - self._last_recv:g} s (hb_timeout {self.hb_timeout:g} s)",
            )
            ids = tuple(self._streams)
            events: list[Event] = [PeerDead(last_seen=self._last_recv, streams=ids)]
            rsts = []
            for sid, st in self._streams.items():
                events.append(StreamReset(stream_id=sid, error=err))
                rsts.append(self._rst_frame(sid, st.tx_next - 1, st.qos, err))
            self._streams.clear()
            if rsts:
                events.append(SendFrames(frames=rsts))
            return events
        if now >= self._next_hb:
            return [SendFrames(frames=[self.heartbeat(now)])]
        return []

    # --- receiving ---------------------------------------------------------------------

    def receive_frame(self, frame: Frame, now: float) -> list[Event]:
        """Process one decoded (and verified) frame received at ``now`` (seconds).

        Returns the events it caused, in order. Peer errors become events
        (:class:`ProtocolViolation` + RST in :class:`SendFrames`,
        :class:`FrameDropped`); nothing is raised. A dead session ignores frames.
        """
        if self.dead:
            return []
        self._last_recv = now
        sid = frame.stream_id
        if frame.session_id != self.session_id:
            # Not ours: there is no stream of this session to reset or answer on.
            reason = f"session_id {frame.session_id!r} is not this session's; frame dropped"
            return [ProtocolViolation(stream_id=sid, error=ErrorPayload(code=ErrorCode.EPROTO, reason=reason))]
        inp = classify(frame.flags)
        if inp is None:
            return self._violation(sid, f"illegal flag combination {[str(f) for f in frame.flags]}", frame.qos)
        if frame.v != PROTOCOL_VERSION:
            return self._violation(sid, f"unsupported version {frame.v}", frame.qos)
        if sid == HB_STREAM_ID:
            if inp is _I.RECV_HB:
                return [HeartbeatReceived(stream_id=sid)]
            if inp is _I.RECV_RST:
                return [FrameDropped(stream_id=sid, msg_seq=frame.msg_seq, frag_seq=frame.frag_seq, reason="RST on the heartbeat stream")]
            return self._violation(sid, f"stream_id {HB_STREAM_ID!r} is reserved for session heartbeats", frame.qos)
        st = self._streams.get(sid)
        state = st.state if st is not None else _S.IDLE
        if frame.ttl == 0 and inp is not _I.RECV_RST:
            return self._ttl_expired(frame, st, inp)
        target = self._moves.get((state, inp))
        if target is None:
            return self._violation(sid, f"{inp.value} not allowed in state {state.name} ({self.role.value})", frame.qos)
        try:
            if st is None:
                # The table allows only SYN (router) and a stray RST on an unknown stream.
                if inp is _I.RECV_SYN:
                    return self._on_syn(sid, frame, target)
                return [FrameDropped(stream_id=sid, msg_seq=frame.msg_seq, frag_seq=frame.frag_seq, reason="RST for an unknown stream")]
            if inp is _I.RECV_DATA:
                events = self._on_data(sid, st, frame)
            elif inp is _I.RECV_ACK:
                events = self._on_ack(sid, st, frame)
            elif inp is _I.RECV_HB:
                events = [HeartbeatReceived(stream_id=sid)]
            elif inp is _I.RECV_SYN_ACK:
                events = self._on_syn_ack(sid, st, frame)
            elif inp is _I.RECV_FIN:
                events = self._on_fin(sid, st, frame)
            else:
                events = self._on_rst(sid, st, frame)
        except LocalProtocolError as e:
            return self._violation(sid, e.reason, frame.qos)
        if target is _S.CLOSED:
            del self._streams[sid]
        else:
            st.state = target
        return events

    def _on_data(self, sid: str, st: _Stream, frame: Frame) -> list[Event]:
        p = frame.payload
        if p is None:
            raise LocalProtocolError(ErrorCode.EPROTO, f"DATA frame msg_seq={frame.msg_seq} without payload")
        is_ctrl = p.type == _CONTROL
        if is_ctrl != (_F.CTRL in frame.flags):
            raise LocalProtocolError(ErrorCode.EPROTO, "the CTRL flag must be set exactly on control payloads")
        if is_ctrl:
            if frame.frag_seq:
                raise LocalProtocolError(ErrorCode.EPROTO, "control messages are never fragmented")
            # Validate now (a bad control resets before anything is buffered) and carry
            # the decoded Struct through the reassembler.
            p = msgspec.structs.replace(p, content=_decode_control(p.content))
            frame = msgspec.structs.replace(frame, payload=p)
        events: list[Event] = []
        frames: list[Frame] | None = None
        delivered = False
        for ev in st.rx.add(frame):
            if type(ev) is MessageComplete:
                delivered = True
                if _F.CTRL in ev.flags:
                    events.append(ControlReceived(stream_id=sid, control=ev.payload.content))
                else:
                    events.append(MessageReceived(stream_id=sid, msg_seq=ev.msg_seq, payload=ev.payload, meta=ev.meta))
            elif type(ev) is Dropped:
                events.append(FrameDropped(stream_id=sid, msg_seq=ev.msg_seq, frag_seq=ev.frag_seq, reason=ev.reason))
            else:
                err = ErrorPayload(
                    code=ErrorCode.ESEQ_RETRY, reason=ev.reason, msg_seq=ev.msg_seq, frag_seq=ev.frag_seq
                )
                frames = frames or []
                frames.append(self._ack_frame(sid, st, err))
        if delivered and self.auto_ack:
            frames = frames or []
            frames.append(self._ack_frame(sid, st, None))
        if frames:
            events.append(SendFrames(frames=frames))
        return events

    def _on_ack(self, sid: str, st: _Stream, frame: Frame) -> list[Event]:
        if frame.msg_seq >= st.tx_next:
            raise LocalProtocolError(
                ErrorCode.EPROTO, f"ACK of msg_seq {frame.msg_seq}, never sent (last {st.tx_next - 1})"
            )
        events: list[Event] = [AckReceived(stream_id=sid, msg_seq=frame.msg_seq, window=frame.window)]
        control = self._frame_control(frame, control_only=True)
        if control is not None:
            events.append(ControlReceived(stream_id=sid, control=control))
        return events

    def _on_syn(self, sid: str, frame: Frame, target: StreamState) -> list[Event]:
        if len(self._streams) >= self.max_streams:
            raise LocalProtocolError(ErrorCode.EPROTO, f"too many concurrent streams (max {self.max_streams})")
        if frame.msg_seq != 0 or frame.frag_seq != 0:
            raise LocalProtocolError(ErrorCode.EPROTO, "SYN must have msg_seq 0 and frag_seq 0")
        control = self._frame_control(frame, control_only=False)
        key = frame.meta.get("idempotency_key")
        if key is not None and not isinstance(key, str):
            raise LocalProtocolError(ErrorCode.EPROTO, "meta.idempotency_key must be a string")
        self._streams[sid] = _Stream(target, frame.qos, self._reassembler())
        return [
            StreamOpened(
                stream_id=sid,
                meta=frame.meta,
                window=frame.window,
                qos=frame.qos,
                payload=frame.payload,
                control=control,
                idempotency_key=key,
            )
        ]

    def _on_syn_ack(self, sid: str, st: _Stream, frame: Frame) -> list[Event]:
        if frame.msg_seq != 0 or frame.frag_seq != 0:
            raise LocalProtocolError(ErrorCode.EPROTO, "SYN+ACK must have msg_seq 0 and frag_seq 0")
        control = self._frame_control(frame, control_only=True)
        window = frame.window
        if window is None and type(control) is WindowUpdate:
            window = control.window
        st.qos = frame.qos  # the router confirms (or lowers) the QoS (§8 step 2)
        return [StreamAccepted(stream_id=sid, window=window, qos=frame.qos)]

    def _on_fin(self, sid: str, st: _Stream, frame: Frame) -> list[Event]:
        if frame.payload is not None:
            raise LocalProtocolError(ErrorCode.EPROTO, "FIN carries no payload; send the last message first")
        rx = st.rx
        complete = frame.msg_seq == rx.next_msg_seq - 1 and rx.buffered_messages == 0
        rx.clear()
        return [StreamFinished(stream_id=sid, complete=complete)]

    def _on_rst(self, sid: str, st: _Stream, frame: Frame) -> list[Event]:
        # An RST is honoured even when malformed: aborting must always work.
        err: ErrorPayload | None = None
        p = frame.payload
        if p is not None and p.type == _CONTROL:
            try:
                control = _decode_control(p.content)
            except LocalProtocolError:
                control = None
            if type(control) is ErrorPayload:
                err = control
        if err is None:
            err = ErrorPayload(code=ErrorCode.EPROTO, reason="RST without an ERROR payload")
        st.rx.clear()
        return [StreamReset(stream_id=sid, error=err)]

    @staticmethod
    def _frame_control(frame: Frame, *, control_only: bool) -> Control | None:
        """The decoded control payload of a SYN, SYN+ACK or ACK frame; ``None`` when it
        has none. ``control_only``: any other payload is EPROTO (SYN may carry a task)."""
        p = frame.payload
        if p is None or p.type != _CONTROL:
            if _F.CTRL in frame.flags:
                raise LocalProtocolError(ErrorCode.EPROTO, "CTRL flag without a control payload")
            if p is not None and control_only:
                raise LocalProtocolError(ErrorCode.EPROTO, f"{[str(f) for f in frame.flags]} frame may carry only a control payload")
            return None
        return _decode_control(p.content)

    def _ttl_expired(self, frame: Frame, st: _Stream | None, inp: Input) -> list[Event]:
        sid = frame.stream_id
        err = ErrorPayload(code=ErrorCode.EPROTO, reason="ttl expired", msg_seq=frame.msg_seq, frag_seq=frame.frag_seq)
        events: list[Event] = [
            FrameDropped(stream_id=sid, msg_seq=frame.msg_seq, frag_seq=frame.frag_seq, reason="ttl expired")
        ]
        if st is not None and (st.state, _I.SEND_ACK) in self._moves:
            events.append(SendFrames(frames=[self._ack_frame(sid, st, err)]))
        elif st is None and inp is _I.RECV_SYN:
            events.append(SendFrames(frames=[self._rst_frame(sid, 0, frame.qos, err)]))
        return events

    def _violation(self, sid: str, reason: str, qos: QoS) -> list[Event]:
        err = ErrorPayload(code=ErrorCode.EPROTO, reason=reason)
        st = self._streams.pop(sid, None)
        if st is not None:
            rst = self._rst_frame(sid, st.tx_next - 1, st.qos, err)
        else:
            rst = self._rst_frame(sid, 0, qos, err)
        return [ProtocolViolation(stream_id=sid, error=err), SendFrames(frames=[rst])]

    def _reassembler(self) -> Reassembler:
        return Reassembler(
            1,
            max_buffered_bytes=self.max_buffered_bytes,
            max_out_of_order=self.max_out_of_order,
            max_fragments=self.max_fragments,
        )

    # --- frame construction -------------------------------------------------------------

    def _frame(
        self,
        sid: str,
        msg_seq: int,
        qos: QoS,
        flags: list[Flag],
        *,
        frag_seq: int = 0,
        window: Window | None = None,
        meta: dict[str, Any] | None = None,
        payload: Payload | None = None,
    ) -> Frame:
        return Frame(
            v=PROTOCOL_VERSION,
            session_id=self.session_id,
            stream_id=sid,
            msg_seq=msg_seq,
            frag_seq=frag_seq,
            flags=flags,
            qos=qos,
            ttl=self.ttl,
            window=window,
            meta=meta if meta is not None else {},
            payload=payload,
        )

    def _ack_frame(self, sid: str, st: _Stream, control: Control | None, window: Window | None = None) -> Frame:
        if control is None:
            return self._frame(sid, st.rx.next_msg_seq - 1, st.qos, [_F.ACK], window=window)
        return self._frame(
            sid, st.rx.next_msg_seq - 1, st.qos, [_F.ACK, _F.CTRL], window=window, payload=_control_payload(control)
        )

    def _rst_frame(self, sid: str, msg_seq: int, qos: QoS, err: ErrorPayload) -> Frame:
        return self._frame(sid, msg_seq, qos, [_F.RST, _F.CTRL], payload=_control_payload(err))

    # --- sending ---------------------------------------------------------------------

    def _target(self, sid: str, st: _Stream | None, inp: Input) -> StreamState:
        if self.dead:
            raise IllegalSend("the session is dead (peer timed out)")
        state = st.state if st is not None else _S.IDLE
        target = self._moves.get((state, inp))
        if target is None:
            raise IllegalSend(f"cannot {inp.value} on stream {sid!r} in state {state.name} ({self.role.value})")
        return target

    def _check_send(self, sid: str, inp: Input) -> tuple[_Stream, StreamState]:
        # For every input but SEND_SYN: the table has no such move from IDLE.
        st = self._streams.get(sid)
        target = self._target(sid, st, inp)
        if st is None:
            raise IllegalSend(f"cannot {inp.value} on unknown stream {sid!r}")
        return st, target

    def _move(self, sid: str, st: _Stream, target: StreamState) -> None:
        if target is _S.CLOSED:
            del self._streams[sid]
        else:
            st.state = target

    def open_stream(
        self,
        stream_id: str,
        meta: dict[str, Any],
        window: Window | None,
        qos: QoS = QoS.SILVER,
        payload: Payload | None = None,
    ) -> Frame:
        """CLIENT: SYN opening ``stream_id`` with task ``meta`` (put an
        ``idempotency_key`` there for resumption), the initial ``window`` and an
        optional payload (the task, or a CAPABILITIES control). Spec §8 step 1.
        Raises :class:`IllegalSend` (role, state, reserved id, stream cap)."""
        if stream_id == HB_STREAM_ID:
            raise IllegalSend(f"stream_id {HB_STREAM_ID!r} is reserved for session heartbeats")
        target = self._target(stream_id, self._streams.get(stream_id), _I.SEND_SYN)
        if len(self._streams) >= self.max_streams:
            raise IllegalSend(f"too many concurrent streams (max {self.max_streams})")
        flags = [_F.SYN]
        if payload is not None and payload.type == _CONTROL:
            flags.append(_F.CTRL)
            if isinstance(payload.content, Struct):
                payload = _control_payload(payload.content)
        self._streams[stream_id] = _Stream(target, qos, self._reassembler())
        return self._frame(stream_id, 0, qos, flags, window=window, meta=meta, payload=payload)

    def accept(self, stream_id: str, window: Window) -> Frame:
        """ROUTER: SYN+ACK confirming ``window`` (also as a WINDOW_UPDATE payload) and
        the stream's QoS. Spec §8 step 2. Raises :class:`IllegalSend`."""
        st, target = self._check_send(stream_id, _I.SEND_SYN_ACK)
        st.state = target
        return self._frame(
            stream_id,
            0,
            st.qos,
            [_F.SYN, _F.ACK, _F.CTRL],
            window=window,
            payload=_control_payload(WindowUpdate(window=window, ack=0)),
        )

    def send_message(
        self,
        stream_id: str,
        payload: Payload,
        *,
        more: bool = False,
        max_chunk_chars: int | None = None,
    ) -> list[Frame]:
        """DATA frames carrying ``payload`` as one message (spec §4.5).

        Assigns ``msg_seq`` and ``frag_seq``; with ``max_chunk_chars`` str content is
        split (:func:`~atp_router.wire.reassembly.fragment`); ``MORE`` is set on every
        fragment but the last. With ``more=True`` the last one keeps ``MORE`` too and
        the next call continues the same message (streamed PARTIALs, §8 step 4).
        A fragmented or streamed message needs str content. Raises
        :class:`IllegalSend` (state, control payload, non-str content of a
        multi-fragment message); ``ValueError`` for ``max_chunk_chars < 1``.
        """
        st, target = self._check_send(stream_id, _I.SEND_DATA)
        if payload.type == _CONTROL:
            raise IllegalSend("control payloads go through send_control()")
        if max_chunk_chars is not None:
            if not isinstance(payload.content, str):
                raise IllegalSend("only str content can be fragmented; JSON-encode it first")
            parts = fragment(payload, max_chunk_chars)
        else:
            parts = [payload]
        if st.tx_open is not None:
            msg_seq, base = st.tx_open
        else:
            msg_seq, base = st.tx_next, 0
        if (more or base or len(parts) > 1) and not isinstance(payload.content, str):
            raise IllegalSend("a fragmented or streamed message needs str content")
        last = len(parts) - 1
        qos = st.qos
        frames = [
            self._frame(
                stream_id,
                msg_seq,
                qos,
                [_F.MORE] if (i < last or more) else [],
                frag_seq=base + i,
                payload=p,
            )
            for i, p in enumerate(parts)
        ]
        if st.tx_open is None:
            st.tx_next = msg_seq + 1
        st.tx_open = (msg_seq, base + len(parts)) if more else None
        st.state = target
        return frames

    def send_control(self, stream_id: str, control: Control) -> Frame:
        """A DATA+CTRL frame carrying ``control`` (§4.3) in msg_seq order.
        Raises :class:`IllegalSend` (state, or a streamed message still open)."""
        st, target = self._check_send(stream_id, _I.SEND_DATA)
        if st.tx_open is not None:
            raise IllegalSend(f"message {st.tx_open[0]} is still open (sent with more=True); finish it first")
        msg_seq = st.tx_next
        st.tx_next = msg_seq + 1
        st.state = target
        return self._frame(stream_id, msg_seq, st.qos, [_F.CTRL], payload=_control_payload(control))

    def send_error(
        self,
        stream_id: str,
        code: ErrorCode | str,
        reason: str,
        *,
        retry_after_ms: int | None = None,
        msg_seq: int | None = None,
        frag_seq: int | None = None,
    ) -> Frame:
        """An ERROR (§10) that does not end the stream, sent as a NACK: an ACK frame
        (cumulative msg_seq) with the ERROR payload, e.g. EWINDOW or ESEQ_RETRY.
        ``msg_seq``/``frag_seq`` name the frame concerned; ``retry_after_ms`` the
        backoff hint. To end the stream use :meth:`reset` or :meth:`finish`.
        Raises :class:`IllegalSend`."""
        st, target = self._check_send(stream_id, _I.SEND_ACK)
        err = ErrorPayload(
            code=ErrorCode(code), reason=reason, retry_after_ms=retry_after_ms, msg_seq=msg_seq, frag_seq=frag_seq
        )
        st.state = target
        return self._ack_frame(stream_id, st, err)

    def ack(self, stream_id: str, window: Window | None = None) -> Frame:
        """A cumulative ACK of what was delivered (§4.4); with ``window`` it
        piggybacks a WINDOW_UPDATE (§5.4). Raises :class:`IllegalSend`."""
        st, target = self._check_send(stream_id, _I.SEND_ACK)
        st.state = target
        if window is None:
            return self._ack_frame(stream_id, st, None)
        return self._ack_frame(stream_id, st, WindowUpdate(window=window, ack=st.rx.next_msg_seq - 1), window)

    def finish(self, stream_id: str) -> Frame:
        """FIN: no more messages from us (§8 step 7); the stream is freed once both
        sides sent FIN. Raises :class:`IllegalSend` (state, or a message still open)."""
        st, target = self._check_send(stream_id, _I.SEND_FIN)
        if st.tx_open is not None:
            raise IllegalSend(f"message {st.tx_open[0]} is still open (sent with more=True); finish it first")
        self._move(stream_id, st, target)
        return self._frame(stream_id, st.tx_next - 1, st.qos, [_F.FIN])

    def reset(self, stream_id: str, code: ErrorCode | str, reason: str) -> Frame:
        """RST with an ERROR payload (§4.4, §10: EPROTO, ESEC, EPREEMPT …); the
        stream is freed at once. Raises :class:`IllegalSend` for an unknown stream."""
        st, target = self._check_send(stream_id, _I.SEND_RST)
        self._move(stream_id, st, target)
        return self._rst_frame(stream_id, st.tx_next - 1, st.qos, ErrorPayload(code=ErrorCode(code), reason=reason))

    def heartbeat(self, now: float, stream_id: str = HB_STREAM_ID) -> Frame:
        """An HB frame (§4.4): on :data:`HB_STREAM_ID` for the session (and the next
        one is due ``hb_interval`` after ``now``), or on an open stream.
        Raises :class:`IllegalSend`."""
        if stream_id == HB_STREAM_ID:
            if self.dead:
                raise IllegalSend("the session is dead (peer timed out)")
            self._next_hb = now + self.hb_interval
            return self._frame(stream_id, 0, QoS.GOLD, [_F.HB])
        st, target = self._check_send(stream_id, _I.SEND_HB)
        st.state = target
        return self._frame(stream_id, st.tx_next - 1, st.qos, [_F.HB])
