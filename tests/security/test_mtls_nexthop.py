"""mTLS from the router to its next-hops (spec §4.1, §11 AuthN: "mTLS or OIDC between
router and agents").

A RIB model (or A2A / Agent API remote) with ``tls: {ca_file, cert_file, key_file}``
verifies the peer against that CA and presents the router's client certificate. The
peer here is a real TLS 1.3 server on loopback (trio's SSL listener, a trustme
PKI) that *requires* a client certificate from the same CA, answering with the
OpenAI streaming shape (``data:`` chunks then ``[DONE]``; the shape the
OpenAI-compatible adapter's own tests replay) — so the test is about the
handshake the adapter really performs.
"""

from __future__ import annotations

import functools
import json
import ssl

import pytest
import trio
import trustme

from atp_router.adapters.base import Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.policy.rib import AgentSpec, ModelSpec, TlsClientSpec
from atp_router.wire.errors import AgentError
from tests.replay_server import LoopbackHTTP

PROMPT = Prompt(task_type="summarize", content={"text": "hello"})


def _chunk(content: str) -> str:
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                       "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]})


async def _answer(stream: trio.abc.Stream) -> None:
    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    for data in (_chunk("all "), _chunk("good"), "[DONE]"):
        await stream.send_all(f"data: {data}\n\n".encode())


async def _serve_mtls(nursery: trio.Nursery, ca: trustme.CA) -> tuple[LoopbackHTTP, list[str]]:
    """An HTTPS peer on 127.0.0.1 requiring a client certificate signed by ``ca``;
    returns it and the list of handshake failures it saw."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
    ca.configure_trust(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    peer = LoopbackHTTP(_answer)
    failures: list[str] = []

    async def handle(stream: trio.SSLStream) -> None:
        try:
            await stream.do_handshake()
        except (trio.BrokenResourceError, ssl.SSLError) as e:
            failures.append(type(e).__name__)
            return
        await peer.handle(stream)

    listeners = await nursery.start(functools.partial(trio.serve_ssl_over_tcp, handle, 0, ctx, host="127.0.0.1"))
    peer.port = listeners[0].transport_listener.socket.getsockname()[1]
    return peer, failures


def _model(port: int, tls: TlsClientSpec | None) -> tuple[str, AgentSpec, ModelSpec]:
    model = ModelSpec(provider="openai_compat", ctx="8k", cost=1.0, base_url=f"https://127.0.0.1:{port}/v1",
                      model="m", tls=tls)
    return "reviewer.tls", AgentSpec(layer="L2", p95_ms=500, model="m", timeout_ms=5_000), model


async def _text(adapter) -> str:
    out = ""
    async for frag in adapter.stream(PROMPT):
        if isinstance(frag.content, dict) and "text" in frag.content:
            out = frag.content["text"]
        elif isinstance(frag.content, str):
            out += frag.content
    await adapter.aclose()
    return out


async def test_model_next_hop_over_mtls_presents_the_router_certificate(nursery, tls_ca, tls_leaf):
    peer, failures = await _serve_mtls(nursery, tls_ca)
    client = tls_leaf(tls_ca, "router", "router.internal")
    name, agent, model = _model(peer.port, TlsClientSpec(ca_file=str(client.ca), cert_file=str(client.cert),
                                                          key_file=str(client.key)))
    with trio.fail_after(10):
        text = await _text(build_adapter(name, agent, model))
    assert "all good" in text
    assert len(peer.requests) == 1 and not failures
    assert peer.requests[0][0].startswith("POST /v1/chat/completions")


async def test_without_the_client_certificate_the_peer_refuses_and_the_call_fails(nursery, tls_ca, tmp_path):
    peer, _ = await _serve_mtls(nursery, tls_ca)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(tls_ca.cert_pem.bytes())
    name, agent, model = _model(peer.port, TlsClientSpec(ca_file=str(ca_file)))
    with pytest.raises(AgentError), trio.fail_after(10):
        await _text(build_adapter(name, agent, model))
    assert not peer.requests  # nothing reached the peer's HTTP layer


async def test_a_peer_outside_the_configured_ca_is_refused(nursery, tls_ca, tls_other_ca, tls_leaf):
    peer, _ = await _serve_mtls(nursery, tls_other_ca)  # the peer's certificate is from another CA
    client = tls_leaf(tls_ca, "router", "router.internal")
    name, agent, model = _model(peer.port, TlsClientSpec(ca_file=str(client.ca), cert_file=str(client.cert),
                                                          key_file=str(client.key)))
    with pytest.raises(AgentError), trio.fail_after(10):
        await _text(build_adapter(name, agent, model))
    assert not peer.requests


def test_bad_tls_files_refuse_the_rib_entry(tmp_path):
    name, agent, model = _model(1, TlsClientSpec(ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError, match=r"^model\.tls: TLS files cannot be loaded"):
        build_adapter(name, agent, model)

