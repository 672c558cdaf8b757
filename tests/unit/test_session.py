"""Session state machine (spec §4.4, §4.5, §8, §10): every table entry, every absent
pair, a real client/router pair through the codec, timers, and Hypothesis runs."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.wire.codec import FrameCodec
from atp_router.wire.diagram import render_markdown
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import (
    Budget,
    BudgetUpdate,
    Capabilities,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
    WindowUpdate,
)
from atp_router.wire.session import (
    HB_STREAM_ID,
    TRANSITIONS,
    AckReceived,
    ControlReceived,
    FrameDropped,
    HeartbeatReceived,
    IllegalSend,
    Input,
    MessageReceived,
    PeerDead,
    ProtocolViolation,
    Role,
    SendFrames,
    Session,
    StreamAccepted,
    StreamFinished,
    StreamOpened,
    StreamReset,
    StreamState,
    classify,
    forward_ttl,
)

SID = "sess_1"
WIN = Window(max_parallel=4, max_tokens=80_000, max_usd_micros=500_000)
S = StreamState
I = Input
ROOT = Path(__file__).resolve().parents[2]


def text(s: str) -> Payload:
    return Payload(type=PayloadType.PARTIAL, content=s)


def ctl(c) -> Payload:
    return Payload(type=PayloadType.CONTROL, content=msgspec.to_builtins(c))


def mk(flags, msg_seq=0, *, stream="s", frag_seq=0, payload=None, ttl=8, session=SID, window=None, meta=None) -> Frame:
    return Frame(
        v=1,
        session_id=session,
        stream_id=stream,
        msg_seq=msg_seq,
        frag_seq=frag_seq,
        flags=list(flags),
        ttl=ttl,
        window=window,
        meta=meta or {},
        payload=payload,
    )


def of(events, cls):
    return [e for e in events if isinstance(e, cls)]


def sent(events) -> list[Frame]:
    return [f for e in events if isinstance(e, SendFrames) for f in e.frames]


def norm(state: StreamState) -> StreamState:
    return S.IDLE if state is S.CLOSED else state


# --- a session with stream "s" in a given state ----------------------------------------

RECV_FRAME = {
    I.RECV_SYN: lambda: mk([Flag.SYN], payload=text("task"), window=WIN),
    I.RECV_SYN_ACK: lambda: mk([Flag.SYN, Flag.ACK, Flag.CTRL], window=WIN, payload=ctl(WindowUpdate(window=WIN, ack=0))),
    I.RECV_DATA: lambda: mk([], 1, payload=text("hello")),
    I.RECV_ACK: lambda: mk([Flag.ACK], 0),
    I.RECV_FIN: lambda: mk([Flag.FIN], 0),
    I.RECV_RST: lambda: mk([Flag.RST], payload=ctl(ErrorPayload(code=ErrorCode.EPREEMPT, reason="gold needs it"))),
    I.RECV_HB: lambda: mk([Flag.HB]),
}

SEND = {
    I.SEND_SYN: lambda s, sid: s.open_stream(sid, {"task_type": "code_review"}, WIN, QoS.GOLD, text("diff")),
    I.SEND_SYN_ACK: lambda s, sid: s.accept(sid, WIN),
    I.SEND_DATA: lambda s, sid: s.send_message(sid, text("data")),
    I.SEND_ACK: lambda s, sid: s.ack(sid),
    I.SEND_FIN: lambda s, sid: s.finish(sid),
    I.SEND_RST: lambda s, sid: s.reset(sid, ErrorCode.EPREEMPT, "preempted"),
    I.SEND_HB: lambda s, sid: s.heartbeat(1.0, sid),
}

PATHS = {
    (Role.CLIENT, S.IDLE): [],
    (Role.CLIENT, S.SYN_SENT): [I.SEND_SYN],
    (Role.CLIENT, S.ESTABLISHED): [I.SEND_SYN, I.RECV_SYN_ACK],
    (Role.CLIENT, S.FIN_WAIT): [I.SEND_SYN, I.RECV_SYN_ACK, I.SEND_FIN],
    (Role.CLIENT, S.CLOSE_WAIT): [I.SEND_SYN, I.RECV_SYN_ACK, I.RECV_FIN],
    (Role.ROUTER, S.IDLE): [],
    (Role.ROUTER, S.SYN_RCVD): [I.RECV_SYN],
    (Role.ROUTER, S.ESTABLISHED): [I.RECV_SYN, I.SEND_SYN_ACK],
    (Role.ROUTER, S.FIN_WAIT): [I.RECV_SYN, I.SEND_SYN_ACK, I.SEND_FIN],
    (Role.ROUTER, S.CLOSE_WAIT): [I.RECV_SYN, I.SEND_SYN_ACK, I.RECV_FIN],
}


def apply(sess: Session, inp: Input, sid: str = "s") -> list:
    if inp.name.startswith("RECV"):
        return sess.receive_frame(msgspec.structs.replace(RECV_FRAME[inp](), stream_id=sid), 1.0)
    SEND[inp](sess, sid)
    return []


def session_in(role: Role, state: StreamState, sid: str = "s", sess: Session | None = None) -> Session:
    sess = sess or Session(role, SID, now=0.0)
    for inp in PATHS[(role, state)]:
        evs = apply(sess, inp, sid)
        assert not of(evs, ProtocolViolation), evs
    assert sess.stream_state(sid) is state
    return sess


def test_paths_cover_every_source_state():
    sources = {(r, s) for (r, s, _) in TRANSITIONS}
    assert sources == set(PATHS)
    assert set(RECV_FRAME) | set(SEND) == set(Input)


@pytest.mark.parametrize(("role", "state", "inp"), list(TRANSITIONS), ids=lambda x: getattr(x, "name", x))
def test_every_transition(role, state, inp):
    sess = session_in(role, state)
    other = session_in(role, S.ESTABLISHED, "t", sess) if state is not S.IDLE or role is Role.ROUTER else None
    evs = apply(sess, inp)
    assert not of(evs, ProtocolViolation), evs
    assert sess.stream_state("s") is norm(TRANSITIONS[(role, state, inp)])
    if other is not None:
        assert sess.stream_state("t") is S.ESTABLISHED


ABSENT = [
    (r, s, i)
    for r, s, i in itertools.product(Role, StreamState, Input)
    if (r, s) in PATHS and (r, s, i) not in TRANSITIONS
]


@pytest.mark.parametrize(("role", "state", "inp"), ABSENT, ids=lambda x: getattr(x, "name", x))
def test_every_absent_pair_is_eproto_for_that_stream_only(role, state, inp):
    sess = session_in(role, state)
    sess = session_in(role, S.ESTABLISHED, "t", sess)
    if inp.name.startswith("RECV"):
        evs = apply(sess, inp)
        (pv,) = of(evs, ProtocolViolation)
        assert pv.stream_id == "s" and pv.error.code is ErrorCode.EPROTO
        (rst,) = sent(evs)
        assert rst.flags == [Flag.RST, Flag.CTRL] and rst.stream_id == "s"
        assert msgspec.convert(rst.payload.content, ErrorPayload).code is ErrorCode.EPROTO
        assert sess.stream_state("s") is S.IDLE
    else:
        with pytest.raises(IllegalSend) as ei:
            apply(sess, inp)
        assert ei.value.code is ErrorCode.EPROTO
        assert sess.stream_state("s") is state
    assert sess.stream_state("t") is S.ESTABLISHED


def test_state_diagram_matches_table():
    assert (ROOT / "proto" / "session-states.md").read_text() == render_markdown()


# --- a real client/router pair through the codec ----------------------------------------


class Pair:
    """A CLIENT and a ROUTER session; every frame crosses a real FrameCodec."""

    def __init__(self, encoding="json", **kw):
        self.client = Session(Role.CLIENT, SID, now=0.0, **kw)
        self.router = Session(Role.ROUTER, SID, now=0.0, **kw)
        self.codec = FrameCodec(encoding, hmac_key=b"k")
        self.now = 0.0

    def to(self, dst: Session, frames, *, replies=True) -> list:
        """Deliver frames to ``dst``; its SendFrames go back to the other side."""
        src = self.router if dst is self.client else self.client
        if isinstance(frames, Frame):
            frames = [frames]
        out = []
        for f in frames:
            evs = dst.receive_frame(self.codec.decode(self.codec.encode(f)), self.now)
            out += evs
            if replies:
                for back in sent(evs):
                    src.receive_frame(self.codec.decode(self.codec.encode(back)), self.now)
        return out


@pytest.mark.parametrize("encoding", ["json", "cbor"])
def test_pair_full_lifecycle(encoding):
    p = Pair(encoding)
    syn = p.client.open_stream("t1", {"task_type": "code_review", "idempotency_key": "k1"}, WIN, QoS.GOLD, text("diff"))
    assert syn.msg_seq == 0 and syn.flags == [Flag.SYN] and syn.qos is QoS.GOLD and syn.sig is None
    (opened,) = p.to(p.router, syn)
    assert opened == StreamOpened(
        stream_id="t1",
        meta={"task_type": "code_review", "idempotency_key": "k1"},
        window=WIN,
        qos=QoS.GOLD,
        payload=opened.payload,
        idempotency_key="k1",
    )
    assert opened.payload.content == "diff"
    assert p.client.stream_state("t1") is S.SYN_SENT and p.router.stream_state("t1") is S.SYN_RCVD

    (acc,) = p.to(p.client, p.router.accept("t1", WIN))
    assert acc == StreamAccepted(stream_id="t1", window=WIN, qos=QoS.GOLD)

    long = "x" * 25 + "é" * 10
    frames = p.client.send_message("t1", text(long), max_chunk_chars=10)
    assert [(f.msg_seq, f.frag_seq, f.flags) for f in frames] == [
        (1, 0, [Flag.MORE]),
        (1, 1, [Flag.MORE]),
        (1, 2, [Flag.MORE]),
        (1, 3, []),
    ]
    evs = p.to(p.router, frames, replies=False)
    (msg,) = of(evs, MessageReceived)
    assert msg.msg_seq == 1 and msg.payload.content == long
    (ackf,) = sent(evs)
    assert ackf.flags == [Flag.ACK] and ackf.msg_seq == 1
    assert p.to(p.client, ackf) == [AckReceived(stream_id="t1", msg_seq=1, window=None)]

    # Router streams a PARTIAL across calls with more=True, then a control.
    part = p.router.send_message("t1", text("ab"), more=True)
    part += p.router.send_message("t1", text("cd"), max_chunk_chars=1)
    assert [(f.msg_seq, f.frag_seq, Flag.MORE in f.flags) for f in part] == [(1, 0, True), (1, 1, True), (1, 2, False)]
    evs = p.to(p.client, part)
    assert [e.payload.content for e in of(evs, MessageReceived)] == ["abcd"]
    evs = p.to(p.client, p.router.send_control("t1", BudgetUpdate(budget=Budget(usd=0.5))))
    assert of(evs, ControlReceived) == [ControlReceived(stream_id="t1", control=BudgetUpdate(budget=Budget(usd=0.5)))]

    # A NACK-style ERROR and a WINDOW_UPDATE piggybacked on an ACK.
    evs = p.to(p.client, p.router.send_error("t1", ErrorCode.EWINDOW, "too many tokens", retry_after_ms=200))
    assert of(evs, ControlReceived)[0].control == ErrorPayload(
        code=ErrorCode.EWINDOW, reason="too many tokens", retry_after_ms=200
    )
    small = Window(max_parallel=1, max_tokens=1000, max_usd_micros=10)
    evs = p.to(p.client, p.router.ack("t1", small))
    assert evs == [
        AckReceived(stream_id="t1", msg_seq=1, window=small),
        ControlReceived(stream_id="t1", control=WindowUpdate(window=small, ack=1)),
    ]

    # Half-close both ways; state freed on CLOSED.
    assert p.to(p.router, p.client.finish("t1")) == [StreamFinished(stream_id="t1", complete=True)]
    assert p.client.stream_state("t1") is S.FIN_WAIT and p.router.stream_state("t1") is S.CLOSE_WAIT
    evs = p.to(p.client, p.router.send_message("t1", Payload(type=PayloadType.FINAL, content={"findings": []})))
    assert of(evs, MessageReceived)[0].payload.content == {"findings": []}
    assert p.to(p.client, p.router.finish("t1")) == [StreamFinished(stream_id="t1", complete=True)]
    assert p.client.open_streams == () and p.router.open_streams == ()


def test_syn_with_capabilities_and_reset():
    p = Pair()
    caps = Capabilities(agent="ruff", skills=["lint"])
    (opened,) = p.to(p.router, p.client.open_stream("a", {}, None, payload=Payload(type=PayloadType.CONTROL, content=caps)))
    assert opened.control == caps and opened.window is None
    evs = p.to(p.client, p.router.reset("a", ErrorCode.ESEC, "data scope"))
    assert evs == [StreamReset(stream_id="a", error=ErrorPayload(code=ErrorCode.ESEC, reason="data scope"))]
    assert p.client.open_streams == () and p.router.open_streams == ()


def established(**kw) -> Pair:
    p = Pair(**kw)
    p.to(p.router, p.client.open_stream("a", {}, WIN))
    p.to(p.client, p.router.accept("a", WIN))
    return p


def test_gap_answered_with_eseq_retry_nack():
    p = established(auto_ack=False)
    frames = p.client.send_message("a", text("abcdef"), max_chunk_chars=2)
    evs = p.router.receive_frame(frames[2], 1.0)
    (nack,) = sent(evs)
    assert nack.flags == [Flag.ACK, Flag.CTRL] and nack.msg_seq == 0
    err = msgspec.convert(nack.payload.content, ErrorPayload)
    assert (err.code, err.msg_seq, err.frag_seq) == (ErrorCode.ESEQ_RETRY, 1, 0)
    assert of(p.to(p.client, nack), ControlReceived)[0].control.code is ErrorCode.ESEQ_RETRY
    assert p.router.receive_frame(frames[1], 1.0) == []  # the same gap is not asked twice
    (msg,) = of(p.router.receive_frame(frames[0], 1.0), MessageReceived)
    assert msg.payload.content == "abcdef"
    dup = p.router.receive_frame(frames[0], 1.0)
    assert dup == [FrameDropped(stream_id="a", msg_seq=1, frag_seq=0, reason="late: msg_seq 1 already delivered (next 2)")]


def test_fin_with_missing_messages_is_incomplete_and_releases_buffers():
    p = established()
    p.client.send_message("a", text("m1"))
    m2 = p.client.send_message("a", text("m2"))
    p.router.receive_frame(m2[0], 1.0)
    assert p.router.buffered_bytes == 2
    evs = p.router.receive_frame(p.client.finish("a"), 1.0)
    assert evs == [StreamFinished(stream_id="a", complete=False)]
    assert p.router.buffered_bytes == 0


def test_violation_on_one_stream_leaves_others_alone():
    p = established()
    p.to(p.router, p.client.open_stream("b", {}, WIN))
    p.to(p.client, p.router.accept("b", WIN))
    p.client.send_message("b", text("in flight"))
    bad = [
        mk([Flag.SYN, Flag.FIN], stream="a"),
        mk([Flag.CTRL, Flag.MORE], 1, stream="a", payload=ctl(ErrorPayload(code="EPROTO", reason="x"))),
        mk([Flag.CTRL], 1, stream="a", payload=Payload(type=PayloadType.CONTROL, content={"kind": "NOPE"})),
        mk([], 1, stream="a", payload=Payload(type=PayloadType.CONTROL, content={})),
        mk([], 1, stream="a"),
        mk([Flag.ACK], 9, stream="a"),
        mk([Flag.ACK], 0, stream="a", payload=text("no")),
        mk([Flag.FIN], 0, stream="a", payload=text("no")),
        mk([Flag.HB, Flag.HB], stream="a"),
    ]
    for frame in bad:
        q = established()
        q.to(q.router, q.client.open_stream("b", {}, WIN))
        q.to(q.client, q.router.accept("b", WIN))
        evs = q.router.receive_frame(frame, 1.0)
        assert of(evs, ProtocolViolation), frame
        assert q.router.stream_state("a") is S.IDLE and q.router.stream_state("b") is S.ESTABLISHED


def test_wrong_session_and_reserved_stream():
    p = established()
    evs = p.router.receive_frame(mk([], 1, stream="a", session="other", payload=text("x")), 1.0)
    assert [type(e) for e in evs] == [ProtocolViolation] and p.router.stream_state("a") is S.ESTABLISHED
    assert p.router.receive_frame(mk([Flag.HB], stream=HB_STREAM_ID), 1.0) == [HeartbeatReceived(stream_id="0")]
    evs = p.router.receive_frame(mk([Flag.SYN], stream=HB_STREAM_ID), 1.0)
    assert of(evs, ProtocolViolation) and p.router.open_streams == ("a",)
    with pytest.raises(IllegalSend, match="reserved"):
        p.client.open_stream(HB_STREAM_ID, {}, None)
    assert of(p.router.receive_frame(msgspec.structs.replace(mk([Flag.HB], stream="a"), v=2), 1.0), ProtocolViolation)


def test_ttl():
    p = established()
    f = p.client.send_message("a", text("x"))[0]
    assert forward_ttl(f).ttl == f.ttl - 1
    sealed = p.codec.decode(p.codec.encode(f))
    fwd = forward_ttl(sealed)
    assert fwd.checksum is None and fwd.sig is None
    dead = msgspec.structs.replace(f, ttl=0)
    with pytest.raises(LocalProtocolError, match="ttl expired"):
        forward_ttl(dead)
    evs = p.router.receive_frame(dead, 1.0)
    assert evs[0] == FrameDropped(stream_id="a", msg_seq=1, frag_seq=0, reason="ttl expired")
    (nack,) = sent(evs)
    assert nack.flags == [Flag.ACK, Flag.CTRL]
    assert msgspec.convert(nack.payload.content, ErrorPayload) == ErrorPayload(
        code=ErrorCode.EPROTO, reason="ttl expired", msg_seq=1, frag_seq=0
    )
    assert p.router.stream_state("a") is S.ESTABLISHED
    # The real frame still arrives afterwards: nothing was consumed.
    assert of(p.router.receive_frame(f, 1.0), MessageReceived)
    # An expired SYN is refused with RST and leaves no state.
    evs = p.router.receive_frame(mk([Flag.SYN], stream="n", ttl=0), 1.0)
    (rst,) = sent(evs)
    assert rst.flags[0] is Flag.RST and p.router.stream_state("n") is S.IDLE


def test_stream_cap():
    p = Pair(max_streams=2)
    for sid in ("a", "b"):
        p.to(p.router, p.client.open_stream(sid, {}, WIN))
    with pytest.raises(IllegalSend, match="too many"):
        p.client.open_stream("c", {}, WIN)
    evs = p.router.receive_frame(mk([Flag.SYN], stream="c"), 1.0)
    assert of(evs, ProtocolViolation)[0].error.reason == "too many concurrent streams (max 2)"
    assert set(p.router.open_streams) == {"a", "b"}


def test_illegal_sends_change_nothing():
    p = established()
    assert p.to(p.router, p.client.send_message("a", text("ab"), more=True)) == []
    for call in (
        lambda: p.client.finish("a"),
        lambda: p.client.send_control("a", BudgetUpdate(budget=Budget(tokens=5))),
        lambda: p.client.send_message("a", Payload(type=PayloadType.FINAL, content={"a": 1})),
        lambda: p.client.send_message("a", ctl(BudgetUpdate(budget=Budget()))),
        lambda: p.router.open_stream("z", {}, None),
        lambda: p.client.accept("a", WIN),
        lambda: p.client.send_message("a", Payload(type=PayloadType.FINAL, content=1), max_chunk_chars=3),
    ):
        with pytest.raises(IllegalSend):
            call()
    assert p.client.stream_state("a") is S.ESTABLISHED
    # The open message can still be finished and arrives whole.
    evs = p.to(p.router, p.client.send_message("a", text("c")), replies=False)
    assert [e.payload.content for e in of(evs, MessageReceived)] == ["abc"]


def test_heartbeat_and_dead_peer_with_explicit_now():
    c = Session(Role.CLIENT, SID, now=100.0, hb_interval=5.0, hb_timeout=12.0)
    c.open_stream("a", {}, WIN)
    c.receive_frame(mk([Flag.SYN, Flag.ACK], stream="a", window=WIN), 101.0)
    assert c.get_timer() == 105.0
    assert c.handle_timer(104.9) == []
    (hb_ev,) = c.handle_timer(105.0)
    (hb,) = hb_ev.frames
    assert hb.flags == [Flag.HB] and hb.stream_id == HB_STREAM_ID
    assert c.get_timer() == 110.0
    c.handle_timer(110.0)
    assert c.get_timer() == 113.0  # dead-peer deadline: last frame at 101 + 12
    c.receive_frame(mk([Flag.HB], stream=HB_STREAM_ID), 112.0)
    assert c.get_timer() == 115.0
    c.handle_timer(115.0)
    assert c.get_timer() == 120.0
    c.handle_timer(120.0)
    evs = c.handle_timer(124.0)
    assert evs[0] == PeerDead(last_seen=112.0, streams=("a",))
    (reset,) = of(evs, StreamReset)
    assert reset.error.code is ErrorCode.ETIMEOUT
    (rst,) = sent(evs)
    assert rst.flags[0] is Flag.RST and rst.stream_id == "a"
    assert c.open_streams == () and c.get_timer() is None and c.handle_timer(200.0) == []
    assert c.receive_frame(mk([Flag.HB], stream=HB_STREAM_ID), 201.0) == []
    with pytest.raises(IllegalSend, match="dead"):
        c.heartbeat(201.0)
    with pytest.raises(IllegalSend, match="dead"):
        c.open_stream("b", {}, WIN)


def test_classify():
    assert classify([]) is I.RECV_DATA
    assert classify([Flag.RST, Flag.SYN]) is I.RECV_RST
    assert classify([Flag.ACK, Flag.SYN]) is I.RECV_SYN_ACK
    assert classify([Flag.SYN, Flag.SYN]) is None
    assert classify([Flag.FIN, Flag.ACK]) is None


# --- Hypothesis: random frames and sends against one session ------------------------------

STREAMS = ["a", "b", HB_STREAM_ID]
CAPS = {"max_streams": 2, "max_buffered_bytes": 16, "max_out_of_order": 3, "max_fragments": 4}

payloads = st.one_of(
    st.none(),
    st.text(max_size=6).map(text),
    st.just(Payload(type=PayloadType.FINAL, content={"k": 1})),
    st.just(ctl(ErrorPayload(code=ErrorCode.EPREEMPT, reason="r"))),
    st.just(ctl(WindowUpdate(window=WIN))),
    st.just(Payload(type=PayloadType.CONTROL, content={"kind": "NOPE"})),
)
frames = st.builds(
    mk,
    st.lists(st.sampled_from(list(Flag)), max_size=3),
    st.integers(0, 4),
    stream=st.sampled_from(STREAMS),
    frag_seq=st.integers(0, 4),
    payload=payloads,
    ttl=st.sampled_from([0, 1, 8]),
    session=st.sampled_from([SID, SID, "other"]),
    window=st.sampled_from([None, WIN]),
    meta=st.sampled_from([None, {"idempotency_key": "k"}, {"idempotency_key": 5}]),
)
ops = st.one_of(
    st.tuples(st.just("recv"), frames),
    st.tuples(st.just("send"), st.sampled_from(sorted(SEND, key=lambda i: i.value)), st.sampled_from(STREAMS)),
    st.tuples(st.just("msg"), st.sampled_from(STREAMS), st.text(max_size=9), st.booleans(), st.sampled_from([None, 1, 3])),
    st.tuples(st.just("time"), st.floats(0.0, 3.0)),
)

@settings(max_examples=400, deadline=None)
@given(st.sampled_from(list(Role)), st.lists(ops, max_size=40))
def test_random_sequences_keep_invariants(role, script):
    sess = Session(role, SID, now=0.0, hb_interval=2.0, hb_timeout=5.0, **CAPS)
    now = 0.0
    for op in script:
        before = {sid: sess.stream_state(sid) for sid in STREAMS}
        if op[0] == "time":
            now += op[1]
            evs = sess.handle_timer(now)
            if of(evs, PeerDead):
                assert sess.open_streams == () and sess.get_timer() is None
            else:
                assert {sid: sess.stream_state(sid) for sid in STREAMS} == before
            continue
        if op[0] == "recv":
            frame = op[1]
            evs = sess.receive_frame(frame, now)
            sid, inp = frame.stream_id, classify(frame.flags)
            after = sess.stream_state(sid)
            if sess.dead:
                assert evs == []
            elif of(evs, ProtocolViolation) and sent(evs):
                assert after is S.IDLE
                assert before[sid] is S.IDLE or (role, before[sid], I.SEND_RST) in TRANSITIONS
                assert all(f.flags[0] is Flag.RST for f in sent(evs))
            elif inp is not None and sid != HB_STREAM_ID:
                allowed = {before[sid]}
                if (role, before[sid], inp) in TRANSITIONS:
                    allowed.add(norm(TRANSITIONS[(role, before[sid], inp)]))
                assert after in allowed
        else:
            inp, sid = (op[1], op[2]) if op[0] == "send" else (I.SEND_DATA, op[1])
            try:
                if op[0] == "send":
                    out = SEND[inp](sess, sid)
                else:
                    out = sess.send_message(sid, text(op[2]), more=op[3], max_chunk_chars=op[4])
            except IllegalSend:
                assert {s: sess.stream_state(s) for s in STREAMS} == before
                continue
            for f in out if isinstance(out, list) else [out]:
                assert f.v == 1 and f.session_id == SID and f.sig is None and f.checksum is None
            if sid != HB_STREAM_ID:
                assert sess.stream_state(sid) is norm(TRANSITIONS[(role, before[sid], inp)])
            before.pop(sid)
            assert all(sess.stream_state(s) is b for s, b in before.items())
            continue
        # A received frame never changes another stream.
        assert all(sess.stream_state(s) is b for s, b in before.items() if s != frame.stream_id)
        assert len(sess.open_streams) <= CAPS["max_streams"]
        assert sess.buffered_bytes <= CAPS["max_streams"] * CAPS["max_buffered_bytes"]


# --- Hypothesis: two correct peers never see a violation ----------------------------------

pair_ops = st.lists(
    st.tuples(
        st.sampled_from(["client", "router"]),
        st.sampled_from(["open", "accept", "msg", "ctrl", "ack", "error", "finish", "reset", "hb"]),
        st.sampled_from(["a", "b"]),
        st.text(max_size=12),
        st.booleans(),
        st.sampled_from([None, 1, 4]),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(pair_ops)
def test_correct_peers_never_violate_and_messages_arrive_intact(script):
    p = Pair()
    expected: dict[tuple[str, str], list[str]] = {}  # (receiver side, stream) -> message texts
    got: dict[tuple[str, str], list[str]] = {}
    partial: dict[tuple[str, str], str] = {}
    for side, action, sid, body, more, chunk in script:
        me, peer = (p.client, p.router) if side == "client" else (p.router, p.client)
        other = "router" if side == "client" else "client"
        try:
            match action:
                case "open":
                    out = me.open_stream(sid, {}, WIN)
                case "accept":
                    out = me.accept(sid, WIN)
                case "msg":
                    out = me.send_message(sid, text(body), more=more, max_chunk_chars=chunk)
                    key = (other, sid)
                    partial[key] = partial.get(key, "") + body
                    if not more:
                        expected.setdefault(key, []).append(partial.pop(key))
                case "ctrl":
                    out = me.send_control(sid, BudgetUpdate(budget=Budget(tokens=len(body))))
                case "ack":
                    out = me.ack(sid, WIN if more else None)
                case "error":
                    out = me.send_error(sid, ErrorCode.EWINDOW, body or "w")
                case "finish":
                    out = me.finish(sid)
                case "reset":
                    out = me.reset(sid, ErrorCode.EPREEMPT, "p")
                case _:
                    out = me.heartbeat(p.now, sid)
        except IllegalSend:
            continue
        if action in ("open", "reset") or (action == "finish" and me.stream_state(sid) is S.IDLE):
            partial.pop((side, sid), None)
            partial.pop((other, sid), None)
        evs = p.to(peer, out)
        assert not of(evs, ProtocolViolation), evs
        for e in of(evs, MessageReceived):
            got.setdefault((other, e.stream_id), []).append(e.payload.content)
        for s in ("a", "b"):
            # Both ends agree on whether the stream exists.
            assert (p.client.stream_state(s) is S.IDLE) == (p.router.stream_state(s) is S.IDLE)
        p.now += 0.5
    # Delivery is immediate and in order: every completed message arrived, exactly once.
    assert got == {k: v for k, v in expected.items() if v}
