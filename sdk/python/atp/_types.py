"""The SDK's public value types, shared by both transports (HTTP + SSE, WebSocket)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Event types a stream yields, in the order they usually come.
EVENT_TYPES = ("SYN_ACK", "ACK", "WINDOW_UPDATE", "PARTIAL", "ERROR", "FINAL", "FIN", "RST")
#: The event types that end a stream's events.
TERMINAL = frozenset({"FIN", "RST"})


class ATPClientError(Exception):
    """An error reported by the router (``code`` is a spec §10 code: ``EPROTO``,
    ``ESEC``, ``EBUDGET``, ``EAGENTDOWN``, …) or by the transport
    (``ETRANSPORT``). ``status`` is the HTTP status when there was one (the
    WebSocket handshake's too); ``detail`` the router's error body (a dict)."""

    def __init__(self, code: str, reason: str, *, status: int | None = None, detail: Any = None):
        self.code = code
        self.reason = reason
        self.status = status
        self.detail = detail
        super().__init__(f"{code}: {reason}")


@dataclass(frozen=True, slots=True)
class StreamHandle:
    """An open stream: ids, the window the router granted at SYN-ACK
    (``{"max_parallel", "max_tokens", "max_usd_micros"}``) and its route
    (``{"policy", "next_hops", "rib_version"}``)."""

    session_id: str
    stream_id: str
    window: dict[str, int] = field(default_factory=dict)
    route: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.stream_id


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a stream. ``type`` is one of :data:`EVENT_TYPES`; ``payload`` is
    the frame's ``payload.content`` (the §7.3 result for FINAL, the ERROR body for
    ERROR/RST); ``frame`` is the whole frame as a dict (over WebSocket without its
    integrity fields ``checksum``, ``sig`` and ``payload.checksum``, which the SDK
    checked); ``id`` is the router's event id of the stream (1, 2, …, the same
    over both transports): it orders events and is what
    ``events(..., last_event_id=)`` resumes after."""

    type: str
    payload: Any
    frame: dict[str, Any]
    id: int
