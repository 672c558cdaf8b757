"""Reassembly of one stream's messages in one direction (spec §4.5), sans-IO.

A message is the run of frames sharing a ``msg_seq``; its fragments are
``frag_seq = 0..K`` where every fragment but K carries ``MORE``.
:class:`Reassembler` takes frames in any order and returns what happened::

    MessageComplete    message msg_seq is whole; delivered strictly in msg_seq order
    RetransmitRequest  the first missing (msg_seq, frag_seq) once something behind it
                       arrived; the session sends it as ERROR ESEQ_RETRY (§10)
    Dropped            late (msg_seq already delivered) or duplicate fragment

Rules:

* ``msg_seq`` is strictly increasing: a frame whose message was already delivered
  is late and dropped; a frame ahead of the next expected message is buffered.
* A gap is requested once: the first missing position only moves forward, so the
  reassembler remembers the last one it asked for instead of a set of gaps.
* A fragment after the terminal one (frag_seq > K where K lacks ``MORE``), a second
  terminal fragment, a fragmented message whose content is not ``str``, a frame
  without payload, or a memory cap exceeded raises
  :class:`~atp_router.wire.errors.LocalProtocolError` (``EPROTO``) after releasing every
  buffer of this stream; the session then resets the stream (RST).

Memory caps (per stream): ``max_buffered_bytes`` (``len`` of ``str`` content, or the
JSON-encoded size of other content), ``max_out_of_order`` buffered messages and
``max_fragments`` per message. An in-order single-fragment message never touches
the buffers.
"""

from __future__ import annotations

from typing import Any, final

import msgspec
from msgspec import Struct

from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Flag, Frame, Payload

DEFAULT_MAX_BUFFERED_BYTES = 8 << 20
DEFAULT_MAX_OUT_OF_ORDER = 64
DEFAULT_MAX_FRAGMENTS = 4096

_json_encode = msgspec.json.encode
_MORE = Flag.MORE  # bound once: Enum member lookup on the class is slow on the per-frame path


@final
class MessageComplete(Struct, frozen=True, kw_only=True):
    """Message ``msg_seq`` reassembled from ``frames`` fragments.

    ``flags`` and ``meta`` are those of fragment 0 (``MORE`` removed). ``payload`` is
    the fragment's own payload for a single fragment, else the joined payload
    (see :func:`join`)."""

    msg_seq: int
    payload: Payload
    flags: tuple[Flag, ...]
    meta: dict[str, Any]
    frames: int


@final
class RetransmitRequest(Struct, frozen=True, kw_only=True):
    """Ask the peer to resend (msg_seq, frag_seq): ERROR ``ESEQ_RETRY`` (§4.5, §10)."""

    msg_seq: int
    frag_seq: int
    reason: str


@final
class Dropped(Struct, frozen=True, kw_only=True):
    """A late or duplicate fragment, discarded (§4.5)."""

    msg_seq: int
    frag_seq: int
    reason: str


# The three are final: the session dispatches on ``type(ev) is …``, so no subclass may stand in.
ReassemblyEvent = MessageComplete | RetransmitRequest | Dropped


class _Message:
    """Fragments of one buffered message."""

    __slots__ = ("contig", "flags", "frags", "high", "last", "meta", "size")

    def __init__(self) -> None:
        self.frags: dict[int, Payload] = {}
        self.contig = 0  # fragments 0..contig-1 are all present
        self.last: int | None = None  # frag_seq of the fragment without MORE
        self.high = -1  # highest frag_seq buffered
        self.flags: tuple[Flag, ...] = ()
        self.meta: dict[str, Any] = {}
        self.size = 0


def _size(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return len(_json_encode(content))


def join(parts: list[Payload]) -> Payload:
    """Join the payloads of fragments 0..K of one message (§4.5).

    One part is returned as is. Several parts must all have ``str`` content
    (``LocalProtocolError(EPROTO)`` otherwise): the result has the type of part 0,
    the concatenated content, ``confidence`` and ``cost_est`` of the last part and
    no checksum (the codec seals on encode).
    """
    if len(parts) == 1:
        return parts[0]
    for p in parts:
        if not isinstance(p.content, str):
            raise LocalProtocolError(ErrorCode.EPROTO, "a fragmented message must have str content in every fragment")
    last = parts[-1]
    return Payload(
        type=parts[0].type,
        content="".join([p.content for p in parts]),
        confidence=last.confidence,
        cost_est=last.cost_est,
    )


def fragment(payload: Payload, max_chunk_chars: int) -> list[Payload]:
    """Split ``payload`` into chunks of at most ``max_chunk_chars`` characters (§4.5).

    Content must be a ``str``; other content (dicts, lists) must be JSON-encoded by
    the caller first (``msgspec.json.encode(x).decode()``) and decoded by the
    receiver, since only strings are joined. Characters, not bytes: a chunk of N
    characters encodes to at most 4N bytes of UTF-8, so pick N under the codec's
    frame limit accordingly. ``confidence`` and ``cost_est`` ride on the last chunk
    only, which is where :func:`join` takes them from. A payload that fits is
    returned unchanged as the only element.

    Raises ``ValueError`` if ``max_chunk_chars < 1``, ``TypeError`` for non-str content.
    """
    if max_chunk_chars < 1:
        raise ValueError(f"max_chunk_chars must be >= 1, got {max_chunk_chars}")
    content = payload.content
    if not isinstance(content, str):
        raise TypeError(f"only str content can be fragmented, got {type(content).__name__}; JSON-encode it first")
    if len(content) <= max_chunk_chars:
        return [payload]
    ptype = payload.type
    out = [Payload(type=ptype, content=content[i : i + max_chunk_chars]) for i in range(0, len(content), max_chunk_chars)]
    out[-1] = Payload(type=ptype, content=out[-1].content, confidence=payload.confidence, cost_est=payload.cost_est)
    return out


class Reassembler:
    """Reassembles the DATA frames of ONE stream in ONE direction (spec §4.5).

    ``next_msg_seq`` is the first message expected (the session uses 1: ``msg_seq``
    0 is the SYN / SYN+ACK). :meth:`add` returns a list of
    :data:`ReassemblyEvent`; it raises ``LocalProtocolError(EPROTO)`` on a protocol
    violation or an exceeded cap, after releasing this stream's buffers.
    """

    __slots__ = (
        "_bytes",
        "_msgs",
        "_requested",
        "max_buffered_bytes",
        "max_fragments",
        "max_out_of_order",
        "next_msg_seq",
    )

    def __init__(
        self,
        next_msg_seq: int = 0,
        *,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        max_out_of_order: int = DEFAULT_MAX_OUT_OF_ORDER,
        max_fragments: int = DEFAULT_MAX_FRAGMENTS,
    ):
        self.next_msg_seq = next_msg_seq
        self.max_buffered_bytes = max_buffered_bytes
        self.max_out_of_order = max_out_of_order
        self.max_fragments = max_fragments
        self._msgs: dict[int, _Message] = {}
        self._bytes = 0
        self._requested: tuple[int, int] = (-1, -1)

    @property
    def buffered_bytes(self) -> int:
        """Content held in buffers: characters of str content, JSON bytes otherwise."""
        return self._bytes

    @property
    def buffered_messages(self) -> int:
        """Messages partly or wholly buffered (incomplete or out of order)."""
        return len(self._msgs)

    def clear(self) -> int:
        """Release every buffer (FIN, RST); returns how many messages were discarded."""
        n = len(self._msgs)
        self._msgs.clear()
        self._bytes = 0
        return n

    def _fail(self, reason: str) -> LocalProtocolError:
        self.clear()
        return LocalProtocolError(ErrorCode.EPROTO, reason)

    def add(self, frame: Frame) -> list[ReassemblyEvent]:
        """Take one DATA frame; return the messages now complete (in msg_seq order),
        a retransmit request for a newly evident gap, or a drop notice."""
        msg_seq = frame.msg_seq
        frag_seq = frame.frag_seq
        payload = frame.payload
        if payload is None:
            raise self._fail(f"DATA frame msg_seq={msg_seq} frag_seq={frag_seq} has no payload")
        if msg_seq < self.next_msg_seq:
            return [
                Dropped(
                    msg_seq=msg_seq,
                    frag_seq=frag_seq,
                    reason=f"late: msg_seq {msg_seq} already delivered (next {self.next_msg_seq})",
                )
            ]
        flags = frame.flags
        more = _MORE in flags
        msgs = self._msgs
        if not more and frag_seq == 0 and msg_seq == self.next_msg_seq and not msgs:
            # In-order single fragment with nothing buffered: the common case.
            self.next_msg_seq = msg_seq + 1
            return [MessageComplete(msg_seq=msg_seq, payload=payload, flags=tuple(flags), meta=frame.meta, frames=1)]
        if self._store(frame, payload, more):
            return [Dropped(msg_seq=msg_seq, frag_seq=frag_seq, reason="duplicate fragment")]
        events: list[ReassemblyEvent] = []
        self._deliver(events)
        if msgs:
            self._request_gap(events)
        return events

    def _store(self, frame: Frame, payload: Payload, more: bool) -> bool:
        """Buffer fragment ``frame`` (off the in-order single-fragment fast path of
        :meth:`add`): check it against the caps and the message's terminal fragment,
        hold its ``payload`` and advance the message's contiguous prefix. Returns
        ``True`` (holding nothing) for a duplicate fragment; raises like :meth:`add`."""
        msg_seq = frame.msg_seq
        frag_seq = frame.frag_seq
        msgs = self._msgs
        if frag_seq >= self.max_fragments:
            raise self._fail(f"frag_seq {frag_seq} exceeds the cap of {self.max_fragments} fragments per message")
        content = payload.content
        if (more or frag_seq) and not isinstance(content, str):
            raise self._fail(f"msg_seq {msg_seq} is fragmented but fragment {frag_seq} content is not a str")
        m = msgs.get(msg_seq)
        if m is None:
            if len(msgs) >= self.max_out_of_order:
                raise self._fail(f"more than {self.max_out_of_order} messages buffered out of order")
            m = msgs[msg_seq] = _Message()
        elif frag_seq in m.frags:
            return True
        if m.last is not None and frag_seq > m.last:
            raise self._fail(f"msg_seq {msg_seq}: fragment {frag_seq} after the terminal fragment {m.last}")
        if not more:
            if m.last is not None:
                raise self._fail(f"msg_seq {msg_seq}: second terminal fragment {frag_seq} (first {m.last})")
            if m.high > frag_seq:
                raise self._fail(f"msg_seq {msg_seq}: fragment {m.high} after the terminal fragment {frag_seq}")
            m.last = frag_seq
        size = _size(content)
        if self._bytes + size > self.max_buffered_bytes:
            raise self._fail(f"stream buffers would exceed {self.max_buffered_bytes} bytes")
        m.frags[frag_seq] = payload
        m.size += size
        self._bytes += size
        m.high = max(m.high, frag_seq)
        if frag_seq == 0:
            flags = frame.flags
            m.flags = tuple([f for f in flags if f is not _MORE]) if more else tuple(flags)
            m.meta = frame.meta
        frags = m.frags
        while m.contig in frags:
            m.contig += 1
        return False

    def _deliver(self, events: list[ReassemblyEvent]) -> None:
        msgs = self._msgs
        while True:
            n = self.next_msg_seq
            m = msgs.get(n)
            if m is None or m.last is None or m.contig <= m.last:
                return
            del msgs[n]
            self._bytes -= m.size
            frags = m.frags
            # add() already required str content for every fragment of a multi-fragment message.
            payload = join([frags[i] for i in range(m.contig)])
            events.append(MessageComplete(msg_seq=n, payload=payload, flags=m.flags, meta=m.meta, frames=m.contig))
            self.next_msg_seq = n + 1

    def _request_gap(self, events: list[ReassemblyEvent]) -> None:
        # Called with something buffered and message next_msg_seq not deliverable.
        msgs = self._msgs
        n = self.next_msg_seq
        m = msgs.get(n)
        if m is None:
            pos = (n, 0)
        elif len(msgs) == 1 and m.high < m.contig:
            return  # message n is still arriving in order: no evidence of loss
        else:
            pos = (n, m.contig)
        if pos != self._requested:
            self._requested = pos
            events.append(
                RetransmitRequest(
                    msg_seq=pos[0],
                    frag_seq=pos[1],
                    reason=f"missing msg_seq {pos[0]} frag_seq {pos[1]}",
                )
            )
