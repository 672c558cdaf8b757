"""One stream's client state over WebSocket (sans-IO): its SYN, the router's
events it received, its own messages not yet ACKed, and how to resume it.

Event ids. The router logs every frame it sends on a stream (ids 1, 2, …; the
SSE ``id:``) and a WebSocket follower sends them in that order from a point:
event 1 (the SYN+ACK) after a SYN without ``meta.resume_after``, else the event
after the one :meth:`WsStream.resume_point` names — computed here exactly as
the router's ``EventLog.after_message`` does over the same frames. So each
logged frame's id is known on arrival (``cursor``): ids already held are
duplicates of a replay (checked against the held frame's checksum, then
dropped) and the others extend :attr:`WsStream.events` with no gap.

Frames the router sends outside the log (``connection_error``: a lone
``["CTRL"]`` frame at ``msg_seq`` 0; a refused SYN's RST) carry no event id:
before the SYN+ACK they refuse the SYN, after it they answer one of our frames.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from atp._frames import control_of, event_type, flags_of, public_frame
from atp._types import TERMINAL, ATPClientError, Event, StreamHandle

#: Flags that make a frame something other than a client message.
_NOT_MESSAGE = frozenset({"SYN", "ACK", "FIN", "RST", "HB"})


def stream_id_for(key: str) -> str:
    """The stream id the SDK gives the stream of idempotency ``key``: the same in
    every client, so a client re-opening the key is answered on ids it knows."""
    return "ik_" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def is_message(frame: dict[str, Any]) -> bool:
    """A client message (DATA or CTRL data, numbered by ``msg_seq``), which the router ACKs."""
    return not (flags_of(frame) & _NOT_MESSAGE) and isinstance(frame.get("msg_seq"), int)


def error_of(frame: dict[str, Any], default: str) -> ATPClientError:
    """The router's ERROR in ``frame`` as an exception (``default`` as the reason without one)."""
    c = control_of(frame) or {}
    if c.get("kind") == "ERROR":
        return ATPClientError(str(c.get("code", "EPROTO")), str(c.get("reason", "")), detail=c)
    return ATPClientError("EPROTO", default)


class Signal:
    """Wakes every task waiting on it at each :meth:`notify`."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(eq=False)
class WsStream:
    """The client side of one stream (module doc). ``syn`` is the SYN as first
    built (unsealed: meta with the task keys, budget and idempotency key; window;
    qos; the task payload)."""

    key: str
    session_id: str
    stream_id: str
    syn: dict[str, Any]
    changed: Signal = field(default_factory=Signal)
    events: list[Event] = field(default_factory=list)
    checksums: list[Any] = field(default_factory=list)
    handle: StreamHandle | None = None
    #: The SYN was refused (before any SYN+ACK).
    refused: ATPClientError | None = None
    #: The stream can no longer be followed (a frame failed its checks, resumption failed).
    error: ATPClientError | None = None
    #: Connection generation the stream was last (re)opened on; the follower's position.
    gen: int = -1
    cursor: int = 0
    #: A resume SYN went out on this connection and nothing of the log came back yet.
    resuming: bool = False
    next_seq: int = 1
    acked: int = 0
    #: Our messages the router has not ACKed: msg_seq → frame (unsealed), re-sent on resume.
    unacked: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: msg_seq of messages whose sender waits for the answer → the answering frame.
    waiting: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    #: Lone ERROR frames about this stream (answers to our frames) since it opened.
    direct: list[dict[str, Any]] = field(default_factory=list)
    fin_sent: bool = False

    @property
    def accepted(self) -> bool:
        return self.handle is not None

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].type in TERMINAL

    def resume_point(self) -> tuple[int, int]:
        """``(event id, msg_seq)`` to resume after: the newest held event that is
        the last fragment of a router DATA message or the SYN+ACK (the router's
        ``EventLog.after_message`` of that ``msg_seq`` is that very event)."""
        for ev in reversed(self.events):
            flags = flags_of(ev.frame)
            if ("ACK" in flags and "SYN" not in flags) or flags & {"MORE", "RST", "FIN", "HB"}:
                continue
            return ev.id, int(ev.frame["msg_seq"])
        return 0, 0

    def reopen_frame(self) -> dict[str, Any]:
        """The SYN to send on a new connection: the original one until the SYN+ACK
        came; after it a SYN without the task, on the stream's ids, with
        ``meta.resume_after`` — which sets the position the replay starts from."""
        if not self.accepted:
            self.cursor = 0
            return self.syn
        self.cursor, msg_seq = self.resume_point()
        self.resuming = True
        meta = {**self.syn.get("meta", {}), "resume_after": msg_seq}
        frame = {k: v for k, v in self.syn.items() if k != "payload"}
        return {**frame, "session_id": self.session_id, "stream_id": self.stream_id, "meta": meta}

    def same_task(self, task: Mapping[str, Any], content: Mapping[str, Any]) -> bool:
        """Whether ``task``/``content`` is the task this stream's SYN carried (its
        ``task_type`` and content: what the router's idempotency check compares)."""
        payload = self.syn.get("payload")
        if not isinstance(payload, dict):
            return True  # opened without its task: the router takes the task then
        return (task.get("task_type"), dict(content)) == (self.syn["meta"].get("task_type"), payload["content"])

    def message_sent(self, frame: dict[str, Any]) -> int:
        """Track one of our messages until its ACK; returns its msg_seq."""
        seq = int(frame["msg_seq"])
        self.unacked[seq] = dict(frame)
        self.next_seq = max(self.next_seq, seq + 1)
        return seq

    def on_frame(self, frame: dict[str, Any]) -> list[dict[str, Any]]:
        """A checked router frame of this stream; returns the frames to send back
        (our FIN after the router's, an RST for a stream the router re-created)."""
        flags = flags_of(frame)
        if not self.accepted:
            if "SYN" in flags:
                self._accept(frame)
                self._log(frame)
            else:
                self.refused = error_of(frame, "the router refused the SYN")
            self.changed.notify()
            return []
        if flags == {"CTRL"} and frame.get("msg_seq") == 0:
            self._direct(frame)
            self.changed.notify()
            return []
        if "SYN" in flags and self.cursor > 0:
            # A resume SYN re-created a stream the router no longer had: its log is gone.
            self.error = ATPClientError("EPROTO", f"the router no longer has stream {self.stream_id!r}: its "
                                        f"events after id {len(self.events)} are lost; open it again")
            self.changed.notify()
            return [self._frame(["RST", "CTRL"], self.next_seq - 1, payload={"type": "control", "content": {
                "kind": "ERROR", "code": "EPROTO", "reason": "stream re-created by a resumption; not wanted"}})]
        out = self._log(frame)
        self.changed.notify()
        return out

    def _accept(self, frame: dict[str, Any]) -> None:
        # The router's ids win: a stream re-opened by key may live in another session.
        self.session_id, self.stream_id = str(frame["session_id"]), str(frame["stream_id"])
        meta, window = frame.get("meta"), frame.get("window")
        route = meta.get("route") if isinstance(meta, dict) else None
        self.handle = StreamHandle(self.session_id, self.stream_id, dict(window) if isinstance(window, dict) else {},
                                   dict(route) if isinstance(route, dict) else {})

    def _log(self, frame: dict[str, Any]) -> list[dict[str, Any]]:
        self.resuming = False
        self.cursor += 1
        if self.cursor <= len(self.events):  # a replay of what we hold
            held = self.checksums[self.cursor - 1]
            if held is not None and frame.get("checksum") != held:
                self.error = ATPClientError("EPROTO", f"resumption out of step on stream {self.stream_id!r}: "
                                            f"event {self.cursor} differs from the one received before")
            return []
        ev = Event(type=event_type(frame), payload=(frame.get("payload") or {}).get("content"),
                   frame=public_frame(frame), id=self.cursor)
        self.events.append(ev)
        self.checksums.append(frame.get("checksum"))
        flags = flags_of(frame)
        if "ACK" in flags and "SYN" not in flags and isinstance(frame.get("msg_seq"), int):
            self._acked(frame)
        if ev.type == "FIN" and not self.fin_sent:
            self.fin_sent = True
            return [self._frame(["FIN"], self.next_seq - 1)]
        return []

    def _acked(self, frame: dict[str, Any]) -> None:
        """A router ACK (or NACK) names the last of our messages it delivered (§4.4)."""
        m = int(frame["msg_seq"])
        self.acked = max(self.acked, m)
        self.next_seq = max(self.next_seq, m + 1)
        for seq in [s for s in self.unacked if s <= m]:
            del self.unacked[seq]
        for seq in self.waiting:
            if seq <= m and self.waiting[seq] is None:
                self.waiting[seq] = frame

    def _direct(self, frame: dict[str, Any]) -> None:
        """A lone ERROR about this stream: the refusal of a resumption (failing
        the stream unless the router says when to retry), else the answer to one
        of our frames (a message on a stream it closed)."""
        self.direct.append(frame)
        if self.resuming:
            err = error_of(frame, "the router refused the resumption")
            if not (isinstance(err.detail, dict) and isinstance(err.detail.get("retry_after_ms"), int)):
                self.error = err

    def retry_after_s(self) -> float | None:
        """Seconds to wait before re-sending a resumption the router refused with
        ``retry_after_ms`` (None: nothing to retry)."""
        if not self.resuming or self.error is not None or not self.direct:
            return None
        c = control_of(self.direct[-1]) or {}
        ms = c.get("retry_after_ms")
        return ms / 1000 if isinstance(ms, int) else None

    def _frame(self, flags: list[str], msg_seq: int, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        f: dict[str, Any] = {"v": 1, "session_id": self.session_id, "stream_id": self.stream_id,
                             "msg_seq": max(msg_seq, 0), "flags": flags}
        if payload is not None:
            f["payload"] = payload
        return f
