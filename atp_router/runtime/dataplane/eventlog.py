"""A stream's outbound event log (spec §8 resumption): :class:`EventLog` and its
:class:`LoggedEvent` entries; :func:`event_type` names each frame as the SDK does.

Every frame the router sends on a stream is appended once, with an event type
(``SYN_ACK``, ``PARTIAL``, ``FINAL``, ``ERROR``, ``FIN``, ``RST``, …) and an
increasing id (1, 2, …); the WebSocket writer and any number of SSE followers
read from it. A follower that connects late, or reconnects with
``Last-Event-ID``, replays what it missed, so nothing depends on who was
listening when a frame was produced. Followers send an event only once it is
durable (in the store: :attr:`EventLog.durable`, moved by the stream table's
group commit, :mod:`atp_router.runtime.dataplane.persistence`). A closed log
nobody follows is compacted into one ``bytes`` (issue 10).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import trio

from atp_router.store.base import StoredEvent
from atp_router.wire.frame import ErrorPayload, Flag, Frame, PayloadType, WindowUpdate

__all__ = ["EventLog", "LoggedEvent", "event_type"]

_frame_enc = msgspec.json.Encoder()
_frame_dec = msgspec.json.Decoder(Frame)
# A compacted event log: [(event id, event type, frame JSON), ...] as msgpack.
_log_enc = msgspec.msgpack.Encoder()
_log_dec = msgspec.msgpack.Decoder(list[tuple[int, str, bytes]])


def event_type(frame: Frame) -> str:
    """The SDK-visible event name of an outbound frame (see ``atp.Client.events``)."""
    flags = frame.flags
    if Flag.RST in flags:
        return "RST"
    if Flag.SYN in flags:
        return "SYN_ACK"
    p = frame.payload
    if p is not None:
        if p.type is PayloadType.FINAL:
            return "FINAL"
        if p.type is PayloadType.PARTIAL:
            return "PARTIAL"
        if p.type is PayloadType.CONTROL:
            c = p.content
            if isinstance(c, ErrorPayload) or (isinstance(c, dict) and c.get("kind") == "ERROR"):
                return "ERROR"
            if isinstance(c, WindowUpdate) or (isinstance(c, dict) and c.get("kind") == "WINDOW_UPDATE"):
                return "WINDOW_UPDATE"
            return "CONTROL"
        if p.type is PayloadType.LOG:
            return "LOG"
    if Flag.FIN in flags:
        return "FIN"
    if Flag.HB in flags:
        return "HB"
    if Flag.ACK in flags:
        return "ACK"
    return "DATA"


@dataclass(slots=True)
class LoggedEvent:
    id: int
    type: str
    frame: Frame
    #: The frame as JSON, encoded once (for the store) and reused by every SSE
    #: follower; None until then, and for events read back from a compacted log.
    json: bytes | None = None

    def json_bytes(self) -> bytes:
        """The frame as JSON bytes (encoded on first use, then kept)."""
        if self.json is None:
            self.json = _frame_enc.encode(self.frame)
        return self.json


@dataclass(slots=True)
class EventLog:
    """Append-only outbound log of one stream with wake-ups for followers.

    A closed log nobody follows is :meth:`compact`-ed into one msgpack ``bytes``
    of its frames' JSON, as encoded for the store (issue 10): a retained closed
    stream then costs the garbage collector one untracked object instead of a
    graph of frames, payloads and dicts, so gen-2 pauses no longer grow with the
    number of retained streams. Not compressed (issue 25): zlib took ~40 µs of a
    task's ~1.5 ms of router CPU at every close for a 2.5× smaller log — the
    retained bytes' budget (``retain_closed_bytes``) holds fewer streams, and an
    older one is read back from the store. ``events`` reads it back (decoded on
    each access: closed logs are read rarely, for resumption and A2A ``tasks/get``)."""

    _events: list[LoggedEvent] = field(default_factory=list)
    closed: bool = False
    #: Set at the next change; made only when a follower waits (a trio.Event
    #: with its set of waiters is ~270 bytes: idle and retained logs hold none).
    _changed: trio.Event | None = None
    #: Called once at the next change: followers parked without a task (:meth:`park`).
    _wakers: list[Callable[[], None]] | None = None
    _packed: bytes | None = None
    #: How many events a compacted log holds (``_events`` is empty then).
    _packed_n: int = 0
    #: Events 1..durable are in the store (group commit:
    #: :meth:`~atp_router.runtime.dataplane.persistence.StreamPersistence.flush`):
    #: followers send no further, so a client never holds an event a restarted
    #: router has lost.
    durable: int = 0

    @property
    def events(self) -> list[LoggedEvent]:
        """The events in order (a fresh list when the log is compacted)."""
        if self._packed is None:
            return self._events
        return [LoggedEvent(i, t, _frame_dec.decode(js), js) for i, t, js in _log_dec.decode(self._packed)]

    def __len__(self) -> int:
        return len(self._events) if self._packed is None else self._packed_n

    @property
    def nbytes(self) -> int:
        """Bytes the log's events hold as data: the packed log once compacted,
        else the JSON of its events (encoded once for the store, kept with each)."""
        if self._packed is not None:
            return len(self._packed)
        return sum(len(e.json_bytes()) for e in self._events)

    @property
    def delivered_result(self) -> bool:
        """Whether a PARTIAL or FINAL went out on the stream (its task produced something)."""
        return any(t == "PARTIAL" or t == "FINAL" for t in (e.type for e in self.events))

    def compact(self) -> None:
        """Pack a closed log into bytes (see the class docstring); no-op while open."""
        if self.closed and self._packed is None:
            # The JSON each event was encoded to for the store and its followers, not encoded again.
            self._packed = _log_enc.encode([(e.id, e.type, e.json if e.json is not None else _frame_enc.encode(e.frame))
                                            for e in self._events])
            self._packed_n = len(self._events)
            self._events = []

    def append(self, frame: Frame, *, durable: bool = True) -> LoggedEvent:
        """Append ``frame``; ``durable=False``: followers wait for it until
        :meth:`mark_durable` (its store write is pending)."""
        if self._packed is not None:
            raise RuntimeError("append to a compacted (closed) event log")
        ev = LoggedEvent(len(self._events) + 1, event_type(frame), frame)
        self._events.append(ev)
        if ev.type in ("FIN", "RST"):
            self.closed = True
        if durable:
            self.mark_durable(ev.id)
        return ev

    async def wait_durable(self, upto: int) -> None:
        """Return once events up to id ``upto`` are stored."""
        while self.durable < upto:
            await self._change().wait()

    def mark_durable(self, upto: int) -> None:
        """Events up to id ``upto`` are stored: wake the followers."""
        if upto > self.durable:
            self.durable = upto
            self._notify()

    def _change(self) -> trio.Event:
        if self._changed is None:
            self._changed = trio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self._wakers:
            wakers, self._wakers = self._wakers, None
            for wake in wakers:
                wake()

    def take(self, after: int) -> tuple[list[LoggedEvent], bool]:
        """The events a follower that sent up to id ``after`` may send now (the
        stored ones), and whether it is then done (the log ended and all sent)."""
        events = self.events
        upto = min(self.durable, len(events))
        return events[after:upto], self.closed and upto >= len(events)

    async def wait_change(self) -> None:
        """Return at the log's next change (an event stored, or the log ended)."""
        await self._change().wait()

    def park(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once, at the log's next change (a follower that sent
        everything waits this way without a task of its own)."""
        if self._wakers is None:
            self._wakers = []
        self._wakers.append(wake)

    def unpark(self, wake: Callable[[], None]) -> None:
        """Forget a :meth:`park`-ed ``wake`` (its follower stopped)."""
        if self._wakers and wake in self._wakers:
            self._wakers.remove(wake)

    def after_message(self, msg_seq: int) -> int:
        """The event id to replay after for a client that received the router's
        messages up to ``msg_seq`` (spec §8 resumption): the event carrying the
        last fragment of the newest DATA message with ``msg_seq`` ≤ that (SYN+ACK
        at msg_seq 0 counts as message 0). ACK and NACK frames after it are
        replayed (their msg_seq counts the client's messages, not ours)."""
        for ev in reversed(self.events):
            f = ev.frame
            if Flag.ACK in f.flags and Flag.SYN not in f.flags:
                continue
            if Flag.MORE in f.flags or Flag.RST in f.flags or Flag.FIN in f.flags or Flag.HB in f.flags:
                continue
            if f.msg_seq <= msg_seq:
                return ev.id
        return 0

    def close(self) -> None:
        """End the log without a closing frame of ours: the peer reset the stream
        (an RST is never answered, spec §4.4). Followers drain and stop."""
        if not self.closed:
            self.closed = True
            self._notify()

    async def follow_batches(self, after: int = 0, *, most: int = 64) -> AsyncIterator[list[LoggedEvent]]:
        """Yield the events with id > ``after`` as they come, in batches: each
        batch is every event stored since the previous one (at most ``most``),
        so a follower sends it in one write (one SSE chunk, one socket send,
        instead of one an event); ends after FIN/RST."""
        i = max(after, 0)
        while True:
            events = self.events  # decoded once per wake-up when compacted
            upto = min(self.durable, len(events), i + most)
            if i < upto:
                batch = events[i:upto]
                i = upto
                yield batch
                continue  # ``durable`` may have moved while the consumer sent
            if self.closed and i >= len(events):
                return
            await self._change().wait()

    async def follow(self, after: int = 0) -> AsyncIterator[LoggedEvent]:
        """Yield events with id > ``after`` as they come; ends after FIN/RST."""
        i = max(after, 0)
        while True:
            events = self.events  # decoded once per wake-up when compacted
            # ``durable`` read afresh after each yield: it may move while the
            # consumer sends (a stale copy would sleep through that wake-up).
            while i < self.durable and i < len(events):
                ev = events[i]
                i += 1
                yield ev
            if self.closed and i >= len(events):
                return
            await self._change().wait()


    def replace(self, stored: list[StoredEvent]) -> None:
        """The log is ``stored`` from now on (a stream read back from the store,
        or settled in it by another router): closed, every event durable (the
        stored JSON kept, so a reader gets the same bytes as before); followers
        send what they have not sent of it and stop."""
        self._events = [LoggedEvent(ev.event_id, ev.type, _frame_dec.decode(ev.frame), ev.frame) for ev in stored]
        self._packed, self._packed_n = None, 0
        self.durable = len(self._events)
        self.closed = True
        self._notify()
