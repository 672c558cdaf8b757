"""A minimal black-box ATP client for conformance tests: raw frames over WebSocket.

It builds frames as plain dicts (spec §4.2) and seals them with the spec's integrity
rules; it keeps no protocol state of its own, so what the tests assert is the
implementation's behaviour, not this client's.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio
from trio_websocket import open_websocket_url

from atp.wire.codec import FrameCodec
from atp.wire.frame import Frame

_codec = FrameCodec("json")


def frame(session_id: str, stream_id: str, msg_seq: int, flags: list[str], **kw: Any) -> dict[str, Any]:
    f = {"v": 1, "session_id": session_id, "stream_id": stream_id, "msg_seq": msg_seq, "flags": flags}
    f.update(kw)
    return f


def sealed(f: dict[str, Any]) -> str:
    """JSON text of ``f`` with payload checksum and whole-frame checksum (§4.2, §4.5)."""
    return _codec.encode(msgspec.convert(f, Frame)).decode()


class Conn:
    def __init__(self, ws):
        self.ws = ws

    async def send(self, f: dict[str, Any] | str) -> None:
        await self.ws.send_message(f if isinstance(f, str) else sealed(f))

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        with trio.fail_after(timeout):
            msg = await self.ws.get_message()
        return json.loads(msg)

    async def recv_until(self, pred, *, stream_id: str | None = None, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Receive frames (of ``stream_id`` if given) until ``pred(frame)``; returns them all."""
        out = []
        with trio.fail_after(timeout):
            while True:
                f = await self.recv(timeout)
                if stream_id is None or f.get("stream_id") == stream_id:
                    out.append(f)
                    if pred(f):
                        return out


@asynccontextmanager
async def connect(url: str, token: str | None = None, subprotocol: str = "atp.v1.json"):
    headers = [("Authorization", f"Bearer {token}")] if token else None
    async with open_websocket_url(url, subprotocols=[subprotocol], extra_headers=headers) as ws:
        yield Conn(ws)


def error_of(f: dict[str, Any]) -> dict[str, Any] | None:
    p = f.get("payload") or {}
    c = p.get("content")
    if p.get("type") == "control" and isinstance(c, dict) and c.get("kind") == "ERROR":
        return c
    return None


def is_final(f: dict[str, Any]) -> bool:
    return (f.get("payload") or {}).get("type") == "agent.result.final"


def closes(f: dict[str, Any]) -> bool:
    return bool({"FIN", "RST"} & set(f.get("flags", [])))
