"""A minimal black-box ATP client for conformance tests: raw frames over WebSocket.

It builds frames as plain dicts (spec §4.2) and seals them with the spec's integrity
rules (payload and whole-frame checksum, §4.5; HMAC ``sig`` when a key is given,
§11) through :mod:`atp_router.wire.codec`, which implements those definitions. It keeps no
protocol state of its own, so what the tests assert is the implementation's
behaviour, not this client's.

Every frame received is checked against the same rules before a test sees it: it
must decode as a v1 frame and its checksums (and signature, with a key) must
verify — spec §4.5 "whole-frame checksum MUST be recomputed after any payload
mutation" is thereby checked on every frame of every test.
"""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import trio
from trio_websocket import open_websocket_url

from atp_router.security.signing import sign_outbound
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.errors import LocalProtocolError
from atp_router.wire.frame import Frame

SUBPROTOCOL = {"json": "atp.v1.json", "cbor": "atp.v1.cbor"}
GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "dev.jsonl"
#: A generous client window (§5.1): tokens, USD micros well above any policy's.
WINDOW = {"max_parallel": 4, "max_tokens": 100_000, "max_usd_micros": 1_000_000}


def task(task_id: str = "bugsinpy-thefuck-23") -> dict[str, Any]:
    """The content of a golden code-review task: ``{"diff", "files"}``."""
    for line in GOLDEN.read_text().splitlines():
        t = json.loads(line)
        if t["id"] == task_id:
            return {"diff": t["diff"], "files": t["files"]}
    raise LookupError(task_id)


def syn(session_id: str, stream_id: str, task_type: str = "code_review", *, content: dict | None = None,
        window: dict | None = None, meta: dict | None = None, syn_flags: tuple[str, ...] = ("SYN",),
        **kw: Any) -> dict[str, Any]:
    """A SYN (§8 step 1) for a task of ``task_type`` (a policy of the conformance RIB),
    with the task body when ``content`` is given, else the task follows as message 1."""
    m = {"task_type": task_type, "languages": ["py"], **(meta or {})}
    extra = {"payload": {"type": "task", "content": content}} if content is not None else {}
    return frame(session_id, stream_id, 0, list(syn_flags), meta=m, window=window or WINDOW, **extra, **kw)


def frame(session_id: str, stream_id: str, msg_seq: int, flags: list[str], **kw: Any) -> dict[str, Any]:
    f = {"v": 1, "session_id": session_id, "stream_id": stream_id, "msg_seq": msg_seq, "flags": flags}
    f.update(kw)
    return f


def control(kind: str, **fields: Any) -> dict[str, Any]:
    """A control payload (spec §4.3): ``{"type": "control", "content": {"kind": kind, ...}}``."""
    return {"type": "control", "content": {"kind": kind, **fields}}


def sealed(f: dict[str, Any], hmac_key: bytes | None = None, encoding: str = "json") -> bytes:
    """``f`` encoded with payload checksum, whole-frame checksum (§4.2, §4.5) and,
    with ``hmac_key``, ``sig`` over a fresh ``meta.nonce`` and ``meta.ts`` (unix ms):
    what a router's replay window accepts once (§11)."""
    frame = msgspec.convert(f, Frame)
    if hmac_key is None:
        return FrameCodec(encoding).encode(frame)
    signed = sign_outbound(frame, KeyRing.single(hmac_key), int(time.time() * 1000))
    return FrameCodec(encoding).encode(signed, seal_frame=False)


class Conn:
    """One WebSocket to the target. ``log`` holds every frame received with its
    arrival time (``trio.current_time()``, s)."""

    def __init__(self, ws, encoding: str, hmac_key: bytes | None):
        self.ws = ws
        self.encoding = encoding
        self.hmac_key = hmac_key
        self._codec = FrameCodec(encoding, hmac_key=hmac_key)
        self.log: list[tuple[float, dict[str, Any]]] = []
        #: The session of the last frame sent: heartbeats go on it (stream "0").
        self.session_id: str | None = None

    async def heartbeat(self, interval: float) -> None:
        """Send HB on stream "0" of :attr:`session_id` every ``interval`` s, as a
        live client does (§4.4), so the router does not declare it dead."""
        while True:
            await trio.sleep(interval)
            if self.session_id is not None:
                await self.send(frame(self.session_id, "0", 0, ["HB"]))

    async def send(self, f: dict[str, Any] | str | bytes) -> None:
        """Send a frame dict (sealed here), or raw text/bytes exactly as given."""
        if isinstance(f, dict):
            self.session_id = f["session_id"]
            data = sealed(f, self.hmac_key, self.encoding)
            await self.ws.send_message(data.decode() if self.encoding == "json" else data)
        else:
            await self.ws.send_message(f)

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        with trio.fail_after(timeout):
            msg = await self.ws.get_message()
        if self.encoding == "json":
            assert isinstance(msg, str), "atp.v1.json frames travel as text messages (§4.1 UTF-8 JSON)"
        try:
            self._codec.decode(msg.encode() if isinstance(msg, str) else msg)
        except LocalProtocolError as e:  # pragma: no cover - reports a non-conforming target
            raise AssertionError(f"router sent a frame that fails §4.2/§4.5 integrity: {e.reason}: {msg!r:.300}") from e
        f = json.loads(msg) if isinstance(msg, str) else cbor2.loads(msg)
        self.log.append((trio.current_time(), f))
        return f

    async def recv_until(self, pred, *, stream_id: str | None = None, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Receive frames (of ``stream_id`` if given) until ``pred(frame)``; returns them all."""
        out = []
        with trio.fail_after(timeout):
            while True:
                f = await self.recv(timeout)
                if stream_id is None or f.get("stream_id") == stream_id:
                    out.append(f)
                    if pred(f):
                        return out

    async def quiet(self, seconds: float, *, stream_id: str | None = None) -> list[dict[str, Any]]:
        """Every frame (of ``stream_id`` if given) received within ``seconds``."""
        out = []
        with trio.move_on_after(seconds):
            while True:
                f = await self.recv(seconds + 1)
                if stream_id is None or f.get("stream_id") == stream_id:
                    out.append(f)
        return out


@asynccontextmanager
async def connect(url: str, token: str | None = None, *, encoding: str = "json", hmac_key: bytes | None = None,
                  subprotocols: list[str] | None = None, heartbeat: float | None = 0.5):
    """A WebSocket to ``url`` offering the subprotocol of ``encoding``; the client
    sends HB every ``heartbeat`` s (``None``: a silent client)."""
    headers = [("Authorization", f"Bearer {token}")] if token else None
    protos = subprotocols if subprotocols is not None else [SUBPROTOCOL[encoding]]
    async with open_websocket_url(url, subprotocols=protos, extra_headers=headers, message_queue_size=256) as ws:
        conn = Conn(ws, encoding, hmac_key)
        async with trio.open_nursery() as n:
            if heartbeat is not None:
                n.start_soon(conn.heartbeat, heartbeat)
            yield conn
            n.cancel_scope.cancel()


def flags(f: dict[str, Any]) -> set[str]:
    return set(f.get("flags", []))


def content_of(f: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The control payload content of ``kind`` (ERROR, WINDOW_UPDATE, …) carried by ``f``."""
    p = f.get("payload") or {}
    c = p.get("content")
    if p.get("type") == "control" and isinstance(c, dict) and c.get("kind") == kind:
        return c
    return None


def error_of(f: dict[str, Any]) -> dict[str, Any] | None:
    return content_of(f, "ERROR")


def window_update_of(f: dict[str, Any]) -> dict[str, Any] | None:
    return content_of(f, "WINDOW_UPDATE")


def errors(frames: list[dict[str, Any]], code: str | None = None) -> list[dict[str, Any]]:
    """The ERROR contents among ``frames`` (of ``code`` if given)."""
    out = [e for f in frames if (e := error_of(f)) is not None]
    return [e for e in out if code is None or e["code"] == code]


def is_final(f: dict[str, Any]) -> bool:
    return (f.get("payload") or {}).get("type") == "agent.result.final"


def is_partial(f: dict[str, Any]) -> bool:
    return (f.get("payload") or {}).get("type") == "agent.result.partial"


def closes(f: dict[str, Any]) -> bool:
    return bool({"FIN", "RST"} & flags(f))
