"""permessage-deflate on the WebSocket ingress (spec §4.1 "negotiated at
handshake", RFC 7692; issue 10): negotiated when a client offers it, a whole
task's frames decode as usual and take fewer bytes on the wire, a client that
does not offer it is served uncompressed, and a decompression bomb is closed
with 1009 before it is inflated.

The client is wsproto (the sans-IO WebSocket library trio-websocket itself runs
on) over a plain trio TCP stream, because trio-websocket's client cannot offer
extensions."""

from __future__ import annotations

import zlib

import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec
from atp_router.wire.frame import Payload, PayloadType, Window
from tests.conftest import MECHANICS_RIB, start_router
from tests.helpers import golden

META = {"task_type": "code_review", "languages": ["py"]}
WINDOW = Window(max_parallel=4, max_tokens=100_000, max_usd_micros=1_000_000)


class RawClient:
    """A wsproto client counting the bytes the router sends on the wire."""

    def __init__(self, stream: trio.SocketStream, deflate: bool):
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.deflate = deflate
        self.wire_in = 0
        self.wire_out = 0
        self.accepted: AcceptConnection | None = None
        self.closed: CloseConnection | None = None
        self._text: list[str] = []
        self.messages: list[str] = []

    async def handshake(self, host: str) -> None:
        ext = [PerMessageDeflate()] if self.deflate else []
        await self.stream.send_all(self.ws.send(Request(host=host, target="/", subprotocols=["atp.v1.json"],
                                                        extensions=ext)))
        while self.accepted is None:
            await self._read()

    async def _read(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("the router closed the connection")
        self.wire_in += len(data)
        self.ws.receive_data(data)
        for ev in self.ws.events():
            if isinstance(ev, AcceptConnection):
                self.accepted = ev
            elif isinstance(ev, RejectConnection):
                raise AssertionError(f"rejected {ev.status_code}")
            elif isinstance(ev, TextMessage):
                self._text.append(ev.data)
                if ev.message_finished:
                    self.messages.append("".join(self._text))
                    self._text = []
            elif isinstance(ev, BytesMessage):
                raise AssertionError("binary message on a JSON connection")
            elif isinstance(ev, CloseConnection):
                self.closed = ev
                await self.stream.send_all(self.ws.send(ev.response()))

    async def send_text(self, text: str) -> None:
        data = self.ws.send(TextMessage(data=text))
        self.wire_out += len(data)
        await self.stream.send_all(data)

    async def next_message(self) -> str:
        while not self.messages:
            await self._read()
        return self.messages.pop(0)


async def _run_task(env, deflate: bool) -> tuple[RawClient, list]:
    host, port = env.ws_url.removeprefix("ws://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    client = RawClient(stream, deflate)
    await client.handshake(f"{host}:{port}")
    codec = FrameCodec("json")
    session = S.Session(S.Role.CLIENT, f"sess-deflate-{deflate}", now=trio.current_time())
    syn = session.open_stream("t1", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=golden()))
    for f in syn if isinstance(syn, list) else [syn]:
        await client.send_text(codec.encode(f).decode())
    events: list = []
    with trio.fail_after(60):
        while not any(isinstance(e, (S.StreamFinished, S.StreamReset)) for e in events):
            frame = codec.decode((await client.next_message()).encode())
            for ev in session.receive_frame(frame, trio.current_time()):
                if frame.stream_id == "t1":
                    events.append(ev)
                if isinstance(ev, S.SendFrames) and frame.stream_id != S.HB_STREAM_ID:
                    for reply in ev.frames:
                        await client.send_text(codec.encode(reply).decode())
    await stream.aclose()
    return client, events


async def test_deflate_is_negotiated_and_a_task_takes_fewer_bytes(nursery, tmp_path):
    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "s")
    plain, plain_events = await _run_task(env, deflate=False)
    packed, packed_events = await _run_task(env, deflate=True)
    assert plain.accepted.extensions == []
    assert [type(e).__name__ for e in packed.accepted.extensions] == ["PerMessageDeflate"]
    # The same task, the same outcome: a FINAL then the stream finished.
    for events in (plain_events, packed_events):
        assert any(isinstance(e, S.StreamFinished) for e in events)
    assert len(packed.messages) == 0 and packed.wire_in < plain.wire_in * 0.8, (packed.wire_in, plain.wire_in)


async def test_deflate_can_be_turned_off(nursery, tmp_path):
    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "s", ws_deflate=False)
    client, events = await _run_task(env, deflate=True)
    assert client.accepted.extensions == [] and any(isinstance(e, S.StreamFinished) for e in events)


async def test_a_decompression_bomb_is_closed_before_it_inflates(nursery, tmp_path):
    """64 KiB message limit; a 16 MiB run of zeros deflates to ~16 KB. The router
    ends the connection (close 1009, or a reset when the client is still sending)
    without ever holding the inflated message: the peak of Python allocations
    while it handles the bomb stays far below 16 MiB."""
    import tracemalloc

    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "s", max_ws_message_bytes=64 * 1024)
    host, port = env.ws_url.removeprefix("ws://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    client = RawClient(stream, deflate=True)
    await client.handshake(f"{host}:{port}")
    bomb = "0" * (16 * 2**20)
    wire = client.ws.send(TextMessage(data=bomb))  # compressed here, before measuring
    assert len(wire) < 40_000
    del bomb
    tracemalloc.start()
    try:
        ended = False
        with trio.fail_after(10):
            try:
                await stream.send_all(wire)
                while client.closed is None:
                    await client._read()
                ended = True
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                ended = True
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ended and (client.closed is None or client.closed.code == 1009), client.closed
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB while handling the bomb"
    # The router is still there for everyone else.
    _, events = await _run_task(env, deflate=True)
    assert any(isinstance(e, S.StreamFinished) for e in events)
