"""Per-stream outbound event log (trio side).

Every frame the router sends on a stream is appended here once, with an event
type and an increasing id; the WebSocket writer and any number of SSE followers
read from it. A follower that connects late, or reconnects with ``Last-Event-ID``,
replays what it missed (spec §8 resumption), so nothing depends on who was
listening when a frame was produced.

The log of a closed stream is kept for ``retain_s`` so clients can still fetch the
FINAL, then dropped by the router's reaper (bounded memory).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from atp.wire.frame import ErrorPayload, Flag, Frame, PayloadType, WindowUpdate


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


@dataclass(slots=True)
class EventLog:
    """Append-only outbound log of one stream with wake-ups for followers."""

    events: list[LoggedEvent] = field(default_factory=list)
    closed: bool = False
    _changed: trio.Event = field(default_factory=trio.Event)

    def append(self, frame: Frame) -> LoggedEvent:
        ev = LoggedEvent(len(self.events) + 1, event_type(frame), frame)
        self.events.append(ev)
        if ev.type in ("FIN", "RST"):
            self.closed = True
        self._changed.set()
        self._changed = trio.Event()
        return ev

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
            self._changed.set()
            self._changed = trio.Event()

    async def follow(self, after: int = 0) -> AsyncIterator[LoggedEvent]:
        """Yield events with id > ``after`` as they come; ends after FIN/RST."""
        i = max(after, 0)
        while True:
            while i < len(self.events):
                ev = self.events[i]
                i += 1
                yield ev
            if self.closed:
                return
            await self._changed.wait()
