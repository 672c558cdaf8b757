"""Reassembler (spec §4.5): ordering, fragmentation, gaps, duplicates, caps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import CostEstimate, Flag, Frame, Payload, PayloadType
from atp_router.wire.reassembly import (
    Dropped,
    MessageComplete,
    Reassembler,
    RetransmitRequest,
    fragment,
    join,
)

P = PayloadType.PARTIAL


def fr(msg_seq: int, frag_seq: int = 0, content: object = "x", *, more: bool = False, **meta) -> Frame:
    return Frame(
        v=1,
        session_id="s",
        stream_id="t",
        msg_seq=msg_seq,
        frag_seq=frag_seq,
        flags=[Flag.MORE] if more else [],
        meta=meta,
        payload=Payload(type=P, content=content),
    )


def frames_of(msg_seq: int, text: str, chunk: int) -> list[Frame]:
    parts = fragment(Payload(type=P, content=text), chunk)
    return [
        Frame(
            v=1,
            session_id="s",
            stream_id="t",
            msg_seq=msg_seq,
            frag_seq=i,
            flags=[Flag.MORE] if i < len(parts) - 1 else [],
            payload=p,
        )
        for i, p in enumerate(parts)
    ]


def completes(events) -> list[MessageComplete]:
    return [e for e in events if isinstance(e, MessageComplete)]


def test_single_fragment_in_order_keeps_payload_object():
    r = Reassembler(1)
    f = fr(1, content={"k": [1, 2]}, lang="py")
    (ev,) = r.add(f)
    assert ev == MessageComplete(msg_seq=1, payload=f.payload, flags=(), meta={"lang": "py"}, frames=1)
    assert ev.payload is f.payload
    assert r.next_msg_seq == 2 and r.buffered_bytes == 0


def test_multi_fragment_join_rules():
    r = Reassembler(0)
    first = Frame(
        v=1,
        session_id="s",
        stream_id="t",
        msg_seq=0,
        flags=[Flag.MORE, Flag.CTRL],
        meta={"m": 1},
        payload=Payload(type=PayloadType.FINAL, content="ab", confidence=0.1, checksum="sha256:00"),
    )
    last = Frame(
        v=1,
        session_id="s",
        stream_id="t",
        msg_seq=0,
        frag_seq=1,
        meta={"m": 2},
        payload=Payload(type=P, content="cd", confidence=0.9, cost_est=CostEstimate(in_tokens=3)),
    )
    assert r.add(first) == []
    assert r.buffered_bytes == 2
    (ev,) = r.add(last)
    assert ev.payload == Payload(type=PayloadType.FINAL, content="abcd", confidence=0.9, cost_est=CostEstimate(in_tokens=3))
    assert ev.payload.checksum is None
    assert ev.flags == (Flag.CTRL,) and ev.meta == {"m": 1} and ev.frames == 2
    assert r.buffered_bytes == 0 and r.buffered_messages == 0


def test_frag_gap_requested_once_then_filled():
    r = Reassembler(1)
    assert r.add(fr(1, 0, "a", more=True)) == []
    assert r.add(fr(1, 2, "c", more=True)) == [RetransmitRequest(msg_seq=1, frag_seq=1, reason="missing msg_seq 1 frag_seq 1")]
    assert r.add(fr(1, 3, "d")) == []  # same gap: not asked again
    (ev,) = r.add(fr(1, 1, "b", more=True))
    assert ev.payload.content == "abcd" and ev.frames == 4


def test_msg_gap_buffers_and_requests_first_missing():
    r = Reassembler(1)
    assert r.add(fr(3, content="m3")) == [RetransmitRequest(msg_seq=1, frag_seq=0, reason="missing msg_seq 1 frag_seq 0")]
    assert r.add(fr(4, content="m4")) == []
    ev = r.add(fr(1, content="m1"))
    assert [e.msg_seq for e in completes(ev)] == [1]
    assert ev[-1] == RetransmitRequest(msg_seq=2, frag_seq=0, reason="missing msg_seq 2 frag_seq 0")
    ev = r.add(fr(2, content="m2"))
    assert [(e.msg_seq, e.payload.content) for e in completes(ev)] == [(2, "m2"), (3, "m3"), (4, "m4")]
    assert r.buffered_messages == 0 and r.buffered_bytes == 0 and r.next_msg_seq == 5


def test_tail_of_open_message_requested_when_next_message_arrives():
    r = Reassembler(1)
    assert r.add(fr(1, 0, "a", more=True)) == []  # still arriving in order: no request
    assert r.add(fr(2, 0, "z")) == [RetransmitRequest(msg_seq=1, frag_seq=1, reason="missing msg_seq 1 frag_seq 1")]


def test_late_and_duplicate_dropped():
    r = Reassembler(1)
    r.add(fr(1))
    assert r.add(fr(1)) == [Dropped(msg_seq=1, frag_seq=0, reason="late: msg_seq 1 already delivered (next 2)")]
    r.add(fr(2, 0, "a", more=True))
    assert r.add(fr(2, 0, "a", more=True)) == [Dropped(msg_seq=2, frag_seq=0, reason="duplicate fragment")]
    assert r.add(fr(0)) == [Dropped(msg_seq=0, frag_seq=0, reason="late: msg_seq 0 already delivered (next 2)")]
    # A fragment of a delivered single-fragment message is late, not "after the terminal one".
    assert r.add(fr(1, 1, "b")) == [Dropped(msg_seq=1, frag_seq=1, reason="late: msg_seq 1 already delivered (next 2)")]


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([fr(2, 0, "a"), fr(2, 1, "b")], "after the terminal fragment 0"),
        ([fr(1, 1, "b"), fr(1, 3, "d")], "fragment 3 after the terminal fragment 1"),
        ([fr(1, 3, "d"), fr(1, 1, "b")], "second terminal"),
        ([fr(1, 3, "d", more=True), fr(1, 2, "c")], "fragment 3 after the terminal fragment 2"),
        ([fr(1, 0, {"a": 1}, more=True)], "content is not a str"),
        ([fr(1, 1, 7)], "content is not a str"),
    ],
)
def test_protocol_errors_release_buffers(frames, needle):
    r = Reassembler(1)
    r.add(fr(5, content="buffered"))
    with pytest.raises(LocalProtocolError, match=needle) as ei:
        for f in frames:
            r.add(f)
    assert ei.value.code is ErrorCode.EPROTO
    assert r.buffered_bytes == 0 and r.buffered_messages == 0


def test_frame_without_payload_is_eproto():
    r = Reassembler(1)
    with pytest.raises(LocalProtocolError, match="no payload"):
        r.add(Frame(v=1, session_id="s", stream_id="t", msg_seq=1))


def test_caps():
    r = Reassembler(1, max_out_of_order=2)
    r.add(fr(2))
    r.add(fr(3))
    with pytest.raises(LocalProtocolError, match="more than 2 messages buffered"):
        r.add(fr(4))
    assert r.buffered_messages == 0

    r = Reassembler(1, max_fragments=4)
    r.add(fr(1, 3, "d", more=True))
    with pytest.raises(LocalProtocolError, match="cap of 4 fragments"):
        r.add(fr(1, 4, "e"))
    assert r.buffered_bytes == 0

    r = Reassembler(1, max_buffered_bytes=10)
    r.add(fr(2, content={"k": "v"}))  # JSON {"k":"v"} = 9 bytes
    assert r.buffered_bytes == 9
    with pytest.raises(LocalProtocolError, match="exceed 10 bytes"):
        r.add(fr(1, 0, "ab", more=True))
    assert r.buffered_bytes == 0 and r.buffered_messages == 0
    # The stream's delivery point is untouched: message 1 can still arrive whole.
    assert completes(r.add(fr(1, content="ok")))[0].msg_seq == 1


def test_fragment_helper():
    p = Payload(type=P, content="abcdefg", confidence=0.5, cost_est=CostEstimate(usd=0.1), checksum="sha256:00")
    parts = fragment(p, 3)
    assert [x.content for x in parts] == ["abc", "def", "g"]
    assert all(x.confidence is None and x.cost_est is None and x.checksum is None for x in parts[:-1])
    assert parts[-1].confidence == 0.5 and parts[-1].cost_est == CostEstimate(usd=0.1)
    assert join(parts) == Payload(type=P, content="abcdefg", confidence=0.5, cost_est=CostEstimate(usd=0.1))
    assert fragment(p, 7) == [p] and fragment(p, 7)[0] is p
    with pytest.raises(ValueError):
        fragment(p, 0)
    with pytest.raises(TypeError, match="JSON-encode"):
        fragment(Payload(type=P, content={"a": 1}), 5)
    with pytest.raises(LocalProtocolError):
        join([Payload(type=P, content="a"), Payload(type=P, content=1)])


@st.composite
def scrambled(draw):
    texts = draw(st.lists(st.text(min_size=0, max_size=30), min_size=1, max_size=5))
    chunk = draw(st.integers(1, 8))
    frames = [f for i, t in enumerate(texts) for f in frames_of(1 + i, t, chunk)]
    order = draw(st.permutations(frames))
    dups = draw(st.lists(st.sampled_from(frames), max_size=4))
    positions = draw(st.lists(st.integers(0, len(order)), min_size=len(dups), max_size=len(dups)))
    order = list(order)
    for f, pos in zip(dups, positions, strict=True):
        order.insert(pos, f)
    return texts, order


@settings(max_examples=300, deadline=None)
@given(scrambled())
def test_any_order_reassembles_each_message_exactly_once(case):
    texts, order = case
    r = Reassembler(1)
    got: list[tuple[int, str]] = []
    requests: list[tuple[int, int]] = []
    for f in order:
        for ev in r.add(f):
            if isinstance(ev, MessageComplete):
                got.append((ev.msg_seq, ev.payload.content))
            elif isinstance(ev, RetransmitRequest):
                requests.append((ev.msg_seq, ev.frag_seq))
            else:
                assert ev.reason == "duplicate fragment" or ev.reason.startswith("late")
    assert got == [(1 + i, t) for i, t in enumerate(texts)]
    assert requests == sorted(set(requests))  # each gap asked once, positions only move forward
    assert r.buffered_bytes == 0 and r.buffered_messages == 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6),
            st.integers(0, 5),
            st.booleans(),
            st.one_of(st.text(max_size=6), st.integers(), st.none(), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)),
        ),
        max_size=40,
    )
)
def test_random_frames_only_raise_eproto_and_caps_hold(items):
    r = Reassembler(1, max_buffered_bytes=20, max_out_of_order=3, max_fragments=4)
    delivered = 0
    for msg_seq, frag_seq, more, content in items:
        try:
            for ev in r.add(fr(msg_seq, frag_seq, content, more=more)):
                if isinstance(ev, MessageComplete):
                    assert ev.msg_seq == delivered + 1 or delivered == 0 and ev.msg_seq == 1
                    delivered = ev.msg_seq
        except LocalProtocolError as e:
            assert e.code is ErrorCode.EPROTO
            assert r.buffered_bytes == 0 and r.buffered_messages == 0
        assert r.buffered_bytes <= 20 and r.buffered_messages <= 3
        assert r.next_msg_seq == delivered + 1
