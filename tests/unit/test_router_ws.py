"""WebSocket ingress (spec §4.1, §4.4, §4.5, §8, §10, §11) of a real router on loopback.

The client side is the project's own sans-IO :class:`~atp_router.wire.session.Session`
(``Role.CLIENT``) with :class:`~atp_router.wire.codec.FrameCodec`, over a real
trio-websocket connection, in both subprotocols (``atp.v1.json`` text messages,
``atp.v1.cbor`` binary ones). Next-hops are the default RIB's real ruff and bandit.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import cbor2
import httpx
import msgspec
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from atp_router.consensus.types import FinalResult
from atp_router.security.signing import sign_outbound
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import (
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    Window,
)
from tests.conftest import start_router
from tests.helpers import golden

META = {"task_type": "code_review", "languages": ["py"]}
WINDOW = Window(max_parallel=4, max_tokens=100_000, max_usd_micros=1_000_000)
SUBPROTOCOL = {"json": "atp.v1.json", "cbor": "atp.v1.cbor"}


class Peer:
    """One ATP connection: a client Session fed by the frames the router sends.

    Every frame received is decoded (schema, checksums, and ``sig`` when the codec
    has a key) and kept in ``raw``; the session's events are kept per stream; the
    frames the session asks to send (ACKs) are sent back, as a real client would.
    """

    def __init__(self, ws: WebSocketConnection, codec: FrameCodec, session_id: str):
        self.ws = ws
        self.codec = codec
        self.session = S.Session(S.Role.CLIENT, session_id, now=trio.current_time())
        self.raw: list[Frame] = []
        self.events: dict[str, list] = defaultdict(list)

    async def send(self, frames: Frame | list[Frame], codec: FrameCodec | None = None) -> None:
        codec = codec or self.codec
        for f in frames if isinstance(frames, list) else [frames]:
            if codec.hmac_key is not None:
                # A signed frame carries a fresh nonce and its time (§11 replay window).
                f = sign_outbound(f, KeyRing.single(codec.hmac_key), int(time.time() * 1000))
                data = FrameCodec(codec.encoding).encode(f, seal_frame=False)
            else:
                data = codec.encode(f)
            await self.ws.send_message(data.decode() if codec.encoding == "json" else data)

    async def send_raw(self, message: str | bytes) -> None:
        await self.ws.send_message(message)

    async def pump_until(self, done: Callable[[], bool], timeout: float = 60) -> None:
        with trio.fail_after(timeout):
            while not done():
                message = await self.ws.get_message()
                if self.codec.encoding == "cbor":
                    assert isinstance(message, bytes), "a CBOR connection carries binary messages"
                frame = self.codec.decode(message)
                self.raw.append(frame)
                for ev in self.session.receive_frame(frame, trio.current_time()):
                    self.events[frame.stream_id].append(ev)
                    if isinstance(ev, S.SendFrames) and frame.stream_id != S.HB_STREAM_ID:
                        await self.send(ev.frames)

    async def open(self, stream_id: str) -> None:
        """SYN without a task, then wait for the SYN+ACK."""
        await self.send(self.session.open_stream(stream_id, META, WINDOW))
        await self.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in self.events[stream_id]))

    def closed(self, stream_id: str) -> bool:
        return any(isinstance(e, (S.StreamFinished, S.StreamReset)) for e in self.events[stream_id])

    def messages(self, stream_id: str) -> list[Payload]:
        return [e.payload for e in self.events[stream_id] if isinstance(e, S.MessageReceived)]

    def errors(self, stream_id: str) -> list[ErrorPayload]:
        return [e.control for e in self.events[stream_id]
                if isinstance(e, S.ControlReceived) and isinstance(e.control, ErrorPayload)]

    def raw_errors(self, stream_id: str) -> list[ErrorPayload]:
        """ERROR payloads of every frame received on ``stream_id``, in or out of sequence."""
        out = []
        for f in self.raw:
            if f.stream_id == stream_id and f.payload is not None and f.payload.type is PayloadType.CONTROL:
                c = f.payload.content
                if isinstance(c, dict) and c.get("kind") == "ERROR":
                    out.append(msgspec.convert(c, ErrorPayload))
        return out

    def final(self, stream_id: str) -> FinalResult:
        finals = [p for p in self.messages(stream_id) if p.type is PayloadType.FINAL]
        assert len(finals) == 1, [p.type for p in self.messages(stream_id)]
        return msgspec.convert(finals[0].content, FinalResult)


@asynccontextmanager
async def connect(url: str, encoding: str, session_id: str, *, hmac_key: bytes | None = None,
                  token: str | None = None, offer: list[str] | None = None) -> AsyncIterator[Peer]:
    headers = [("Authorization", f"Bearer {token}")] if token else None
    async with open_websocket_url(url, subprotocols=offer or [SUBPROTOCOL[encoding]], extra_headers=headers) as ws:
        yield Peer(ws, FrameCodec(encoding, hmac_key=hmac_key), session_id)


def task_payload() -> Payload:
    return Payload(type=PayloadType.TASK, content=golden())


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_task_runs_syn_to_fin(router_env, encoding):
    """§8: SYN with the task → SYN+ACK (window no wider than asked), PARTIALs,
    FINAL in the §7.3 shape, FIN; then the client's FIN frees both sides."""
    async with connect(router_env.ws_url, encoding, f"sess-{encoding}") as peer:
        assert peer.ws.subprotocol == SUBPROTOCOL[encoding]
        await peer.send(peer.session.open_stream("t1", META, WINDOW, payload=task_payload()))
        await peer.pump_until(lambda: peer.closed("t1"))
        evs = peer.events["t1"]
        accepted = [e for e in evs if isinstance(e, S.StreamAccepted)]
        assert len(accepted) == 1 and isinstance(evs[0], S.StreamAccepted)
        w = accepted[0].window
        assert (w.max_parallel, w.max_tokens, w.max_usd_micros) == (4, 100_000, 50_000)
        types = [p.type for p in peer.messages("t1")]
        assert types[-1] is PayloadType.FINAL and types.count(PayloadType.PARTIAL) >= 2
        assert [e for e in evs if isinstance(e, S.StreamFinished)] == [S.StreamFinished(stream_id="t1", complete=True)]
        assert not any(isinstance(e, (S.ProtocolViolation, S.FrameDropped)) for e in evs)
        assert peer.errors("t1") == []
        final = peer.final("t1")
        agents = {p.split("#")[0] for f in final.result.findings for p in f.provenance}
        assert agents == {"lint.ruff", "sec.bandit"}
        assert all(f.checksum and f.checksum.startswith("sha256:") for f in peer.raw)
        await peer.send(peer.session.finish("t1"))
        assert peer.session.stream_state("t1") is S.StreamState.IDLE  # freed
        with trio.fail_after(5):
            while router_env.router.streams.get_session("anonymous", f"sess-{encoding}").open_streams:
                await trio.sleep(0.01)


async def test_cbor_is_chosen_when_offered(router_env):
    """ws.py: ``atp.v1.cbor`` when the client offers it, whatever the order."""
    async with connect(router_env.ws_url, "cbor", "sess-pick", offer=["atp.v1.json", "atp.v1.cbor"]) as peer:
        assert peer.ws.subprotocol == "atp.v1.cbor"
        await peer.open("t1")


def _bad_messages(encoding: str) -> dict[str, tuple[str | bytes, str, str]]:
    """name → (message, stream the ERROR comes on, word its reason names)."""
    codec = FrameCodec(encoding)
    ours = Frame(v=1, session_id="sess-bad", stream_id="t1", msg_seq=1,
                 payload=Payload(type=PayloadType.TASK, content=golden()))
    sealed = codec.encode(ours)
    if encoding == "json":
        tampered = sealed.replace(b'"msg_seq":1', b'"msg_seq":7', 1)
        wrong_type = json.dumps({"v": 1, "session_id": "sess-bad", "stream_id": "t1", "msg_seq": "one",
                                 "flags": [], "checksum": "sha256:00"})
        return {
            "bad_json": ('{"v": 1, "session_id": "sess-bad", "stream_id": "t1", ', "0", "malformed json"),
            "wrong_type": (wrong_type, "t1", "msg_seq"),
            "bad_checksum": (tampered.decode(), "t1", "checksum"),
            "wrong_version": (json.dumps({"v": 2, "session_id": "sess-bad", "stream_id": "t1", "msg_seq": 0,
                                          "flags": ["SYN"]}), "t1", "version"),
        }
    obj = cbor2.loads(sealed)
    obj["msg_seq"] = 7
    return {
        "bad_cbor": (b"\xa1\x61", "0", "malformed cbor"),
        "wrong_type": (cbor2.dumps({**obj, "msg_seq": "one"}), "t1", "msg_seq"),
        "bad_checksum": (cbor2.dumps(obj), "t1", "checksum"),
        "text_on_cbor": ("{}", "0", "text message"),
    }


@pytest.mark.parametrize("encoding,case", [(e, c) for e in ("json", "cbor") for c in sorted(_bad_messages(e))])
async def test_malformed_frame_is_an_eproto_error_and_other_streams_complete(router_env, encoding, case):
    """§10 EPROTO: the bad frame is answered with an ERROR naming what was wrong,
    on the stream it names (in that stream's sequence, so the client session
    delivers it) or on the connection stream "0"; the stream running meanwhile
    completes, and the named stream still takes its task afterwards."""
    message, on_stream, word = _bad_messages(encoding)[case]
    async with connect(router_env.ws_url, encoding, "sess-bad") as peer:
        await peer.send(peer.session.open_stream("t1", META, WINDOW))
        await peer.send(peer.session.open_stream("t2", META, WINDOW, payload=task_payload()))
        await peer.send_raw(message)
        await peer.pump_until(lambda: bool(peer.raw_errors(on_stream)) and peer.closed("t2"))
        err = peer.raw_errors(on_stream)[0]
        assert err.code is ErrorCode.EPROTO and word in err.reason, err
        if on_stream == "t1":
            assert peer.errors("t1") == [err]  # a NACK in t1's sequence, surfaced by the session
        peer.final("t2")
        assert peer.errors("t2") == []
        await peer.send(peer.session.send_message("t1", task_payload()))
        await peer.pump_until(lambda: peer.closed("t1"))
        peer.final("t1")
        assert not any(isinstance(e, S.StreamReset) for e in peer.events["t1"])


async def test_frame_for_an_unknown_stream_is_refused_and_nothing_else_moves(router_env):
    async with connect(router_env.ws_url, "json", "sess-ghost") as peer:
        await peer.send(peer.session.open_stream("t1", META, WINDOW, payload=task_payload()))
        ghost = Frame(v=1, session_id="sess-ghost", stream_id="ghost", msg_seq=1,
                      payload=Payload(type=PayloadType.TASK, content=golden()))
        await peer.send(ghost)
        await peer.pump_until(lambda: bool(peer.raw_errors("ghost")) and peer.closed("t1"))
        err = peer.raw_errors("ghost")[0]
        assert err.code is ErrorCode.EPROTO and "IDLE" in err.reason
        assert [f.flags for f in peer.raw if f.stream_id == "ghost"] == [[Flag.RST, Flag.CTRL]]
        peer.final("t1")
        assert peer.errors("t1") == []
    assert router_env.router.streams.find("anonymous", "ghost") is None


async def test_fragmented_task_body_is_reassembled(router_env):
    """§4.5: the task's JSON text split over frames with MORE (frag_seq 0..N)."""
    async with connect(router_env.ws_url, "cbor", "sess-frag") as peer:
        await peer.open("t1")
        body = Payload(type=PayloadType.TASK, content=json.dumps(golden()))
        frames = peer.session.send_message("t1", body, max_chunk_chars=400)
        assert len(frames) >= 3 and all(Flag.MORE in f.flags for f in frames[:-1]) and frames[-1].flags == []
        await peer.send(frames)
        await peer.pump_until(lambda: peer.closed("t1"))
        assert {p.split("#")[0] for f in peer.final("t1").result.findings for p in f.provenance} == {
            "lint.ruff", "sec.bandit"
        }
        assert peer.errors("t1") == []


async def test_fragmented_body_that_is_not_json_resets_the_stream(router_env):
    async with connect(router_env.ws_url, "json", "sess-frag-bad") as peer:
        await peer.open("t1")
        await peer.send(peer.session.send_message("t1", Payload(type=PayloadType.TASK, content="{not json" * 50),
                                                  max_chunk_chars=100))
        await peer.pump_until(lambda: peer.closed("t1"))
        reset = [e for e in peer.events["t1"] if isinstance(e, S.StreamReset)]
        assert reset[0].error.code is ErrorCode.EPROTO and "not JSON" in reset[0].error.reason


# ---------------------------------------------------------------------- security

KEY = b"k" * 32


@pytest.fixture
async def hmac_env(nursery, policies_dir):
    return await start_router(nursery, policies_dir, hmac_key=KEY)


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_signed_frames_run_and_router_frames_are_signed(hmac_env, encoding):
    async with connect(hmac_env.ws_url, encoding, "sess-signed", hmac_key=KEY) as peer:
        await peer.send(peer.session.open_stream("t1", META, WINDOW, payload=task_payload()))
        await peer.pump_until(lambda: peer.closed("t1"))  # decode() verified every sig
        peer.final("t1")
        assert all(f.sig for f in peer.raw)


@pytest.mark.parametrize("sender_key", [None, b"wrong key"], ids=["unsigned", "wrong_key"])
async def test_hmac_required_when_configured(hmac_env, sender_key):
    """§11: with RouterConfig(hmac_key=...) a frame without a valid sig is refused
    with ESEC and changes nothing; signed frames on the same connection run."""
    async with connect(hmac_env.ws_url, "json", "sess-hmac", hmac_key=KEY) as peer:
        syn = peer.session.open_stream("t1", META, WINDOW, payload=task_payload())
        await peer.send(syn, codec=FrameCodec("json", hmac_key=sender_key))
        await peer.pump_until(lambda: bool(peer.raw_errors("t1")))
        err = peer.raw_errors("t1")[0]
        assert err.code is ErrorCode.ESEC and "sig" in err.reason
        assert hmac_env.router.streams.find("anonymous", "t1") is None
        await peer.send(peer.session.open_stream("t2", META, WINDOW, payload=task_payload()))
        await peer.pump_until(lambda: peer.closed("t2"))
        peer.final("t2")


async def test_another_tenants_session_id_is_another_session(nursery, policies_dir):
    """§11: sessions are the tenant's. A client naming the session and stream
    ids another tenant's token opened reaches a session of its own: its RST
    touches nothing of the owner's, its SYN opens its own stream, and it never
    gets one frame of the owner's stream; the owner's stream carries on."""
    env = await start_router(nursery, policies_dir, tokens=frozenset({"tok-a", "tok-b"}))
    async with connect(env.ws_url, "json", "sess-owned", token="tok-a") as a, \
            connect(env.ws_url, "json", "sess-owned", token="tok-b") as b:
        await a.open("t1")
        b.session.open_stream("t1", META, WINDOW)
        await b.send(b.session.reset("t1", ErrorCode.EPREEMPT, "hijack"))
        await b.send(b.session.open_stream("t2", META, WINDOW, payload=task_payload()))
        await a.send(a.session.send_message("t1", task_payload()))
        await a.pump_until(lambda: a.closed("t1"))
        a.final("t1")
        await b.pump_until(lambda: b.closed("t2"))
        b.final("t2")
    assert not [f for f in b.raw if f.stream_id == "t1"]


async def test_an_idempotency_key_reused_with_another_task_is_refused_over_http_and_ws(router_env):
    """Issue 24: a key names one task (§8). Re-opened with the same task it resumes
    its stream; with another one it is refused — HTTP 409 naming the key, over a
    WebSocket a lone ERROR EPROTO — and the stream the key opened is untouched:
    nothing else is run. Budget and QoS are not the task: changing them resumes."""
    first_task, other_task = golden("bugsinpy-thefuck-23"), {"diff": golden()["diff"] + "\n", "files": {}}
    async with httpx.AsyncClient(base_url=router_env.url, timeout=30) as h:
        body = {"task": META, "content": first_task, "idempotency_key": "k-conflict"}
        first = await h.post("/v1/streams", json=body)
        assert first.status_code == 201, first.text
        sid = first.json()["stream_id"]
        again = await h.post("/v1/streams", json={**body, "qos": "bronze", "budget": {"tokens": 90_000}})
        assert (again.status_code, again.json()["stream_id"]) == (201, sid)
        refused = await h.post("/v1/streams", json={**body, "content": other_task})
        assert refused.status_code == 409, refused.text
        err = refused.json()["error"]
        assert err["code"] == "EPROTO" and "'k-conflict'" in err["reason"] and "different task" in err["reason"]
        other_type = await h.post("/v1/streams", json={**body, "task": {**META, "task_type": "summarize"}})
        assert other_type.status_code == 409, other_type.text
    async with connect(router_env.ws_url, "json", "sess-conflict") as peer:
        await peer.send(peer.session.open_stream("t-conflict", {**META, "idempotency_key": "k-conflict"}, WINDOW,
                                                 payload=Payload(type=PayloadType.TASK, content=other_task)))
        await peer.pump_until(lambda: bool(peer.raw_errors("t-conflict")))
        err = peer.raw_errors("t-conflict")[0]
        assert err.code is ErrorCode.EPROTO and "'k-conflict'" in err.reason
    streams = [c for c in router_env.router.streams.values() if c.idempotency_key == "k-conflict"]
    assert [c.stream_id for c in streams] == [sid]  # one stream, the first task's


async def test_a_key_opened_without_its_task_on_the_syn_resumes_by_key_with_the_task(router_env):
    """The task digest is taken only from a SYN that carries the task: a stream
    whose SYN came without it (the task as message 1) is resumed by its key with
    the task, not refused as another task."""
    async with connect(router_env.ws_url, "json", "sess-late") as peer:
        await peer.send(peer.session.open_stream("t-late", {**META, "idempotency_key": "k-late"}, WINDOW))
        await peer.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in peer.events["t-late"]))
        await peer.send(peer.session.send_message("t-late", task_payload()))
        await peer.pump_until(lambda: peer.closed("t-late"))
        peer.final("t-late")
    async with httpx.AsyncClient(base_url=router_env.url, timeout=30) as h:
        again = await h.post("/v1/streams", json={"task": META, "content": golden(), "idempotency_key": "k-late"})
    assert again.status_code == 201 and again.json()["stream_id"] == "t-late", again.text
