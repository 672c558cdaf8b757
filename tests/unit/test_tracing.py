"""OpenTelemetry traces (spec §12, :mod:`atp_router.observability.tracing`), checked on the side
of a real OTLP/HTTP receiver built on the official ``opentelemetry-proto``
messages (:mod:`tests.otlp_receiver`; no Collector can be installed here):

* an ``atp-router`` process configured only by ``OTEL_*`` runs one code-review
  task on the mechanics RIB; the receiver gets the session, stream, each leg and
  the consensus span with the §12 attributes, linked parent to child, the
  client's ``traceparent`` the root's parent;
* in-process routers with the SDK exporting to the same receiver: a WebSocket
  SYN's ``meta.trace`` and the handshake's ``traceparent``; an escalation (its
  span under the consensus, the escalation's leg under it) to an HTTP next-hop
  that gets the leg's ``traceparent`` header;
* off by default: no ``OTEL_*`` exporter, no tracer, no header, no ``meta.trace``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import trio
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from trio_websocket import open_websocket_url

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.observability import tracing
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Flag
from tests.conftest import MECHANICS_RIB
from tests.helpers import ROUTER, golden, router_process, start_router_on
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.replay_server import LoopbackHTTP, serve
from tests.unit.test_openai_compat import chunk, sse
from tests.unit.test_router_dispatch import CLEAN, META, run_stream, scripted_agent
from tests.unit.test_router_ws import SUBPROTOCOL, WINDOW, Peer, task_payload

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [(s.name, s.attributes.get("agent")) for s in spans])
    return found[0]


# ------------------------------------------------------------------ a router process, OTEL_* only


@pytest.mark.slow
def test_a_code_review_trace_reaches_a_real_otlp_receiver(tmp_path, monkeypatch):
    """``atp-router`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and nothing else
    about tracing) exports over OTLP/HTTP the trace of one code-review task
    opened with a W3C ``traceparent``: session → stream → one leg per next-hop
    and the consensus, each with the §12 attributes; the SYN+ACK names the
    stream span."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "default.yaml").write_text((MECHANICS_RIB / "default.yaml").read_text())
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "atp-router-under-test")
        for var in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            monkeypatch.delenv(var, raising=False)
        with router_process(policies, tmp_path / "state") as url:
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            r = httpx.post(url + "/v1/streams", headers=headers, timeout=30,
                           json={"task": {"task_type": "code_review"}, "content": golden()})
            assert r.status_code == 201, r.text
            sid = r.json()["stream_id"]
            with httpx.stream("GET", f"{url}/v1/streams/{sid}/events", timeout=60) as ev:
                sse_text = b"".join(ev.iter_bytes()).decode()
            assert "event: FINAL" in sse_text
            spans = rx.wait_for(lambda got: any(s.name == "atp.session" for s in got))

    session, stream, consensus = one(spans, "atp.session"), one(spans, "atp.stream"), one(spans, "atp.consensus")
    legs = {s.attributes["agent"]: s for s in by_name(spans, "atp.leg")}
    assert sorted(legs) == ["lint.ruff", "sec.bandit"]
    # One trace, the client's; the session span's parent is the client's span.
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    assert session.parent_span_id == CLIENT_SPAN and session.kind == SERVER
    assert stream.parent_span_id == session.span_id
    assert consensus.parent_span_id == stream.span_id
    assert all(leg.parent_span_id == stream.span_id and leg.kind == CLIENT for leg in legs.values())
    assert session.resource["service.name"] == "atp-router-under-test" and session.scope == tracing.SCOPE

    # The §12 attributes.
    ids = {"session_id": r.json()["session_id"], "stream_id": sid}
    assert session.attributes["session_id"] == ids["session_id"]
    for s in (stream, consensus, *legs.values()):
        assert {k: s.attributes[k] for k in ids} == ids, s.name
    for agent, leg in legs.items():
        a = leg.attributes
        assert a["model"] == "tool:" + agent.split(".")[1]
        assert a["latency_ms"] > 0 and a["tokens_in"] == a["tokens_out"] == 0 and a["usd"] == 0.0
        assert a["msg_seq"] >= 1 and "atp.attempt" not in a and "atp.error_code" not in a  # a first attempt
        window = json.loads(a["window_state"])
        assert window["max_parallel"] >= 1 and window["in_flight"] >= 0
        # The leg lies within the stream, before the consensus.
        assert stream.start_ns <= leg.start_ns <= leg.end_ns <= consensus.start_ns
        # Its duration is the call's latency.
        assert abs((leg.end_ns - leg.start_ns) / 1e6 - a["latency_ms"]) < 1.0
    c = consensus.attributes
    assert c["route_path"] == ["code_review", *sorted(legs, key=lambda g: legs[g].end_ns)]
    assert c["atp.consensus.strategy"] == "union_tiebreak" and c["atp.consensus.findings"] >= 1
    assert 0.0 < c["confidence"] <= 1.0 and c["atp.escalated"] is False
    s = stream.attributes
    assert s["route_path"] == c["route_path"] and s["atp.outcome"] == "FIN" and s["atp.policy"] == "code_review"
    assert s["tokens_in"] == 0 and s["tokens_out"] == 0 and s["usd"] == 0.0 and s["latency_ms"] > 0
    assert s["msg_seq"] > max(leg.attributes["msg_seq"] for leg in legs.values())
    assert json.loads(s["window_state"])["max_parallel"] == 4  # the policy's window
    assert consensus.end_ns <= stream.end_ns <= session.end_ns
    # The SYN+ACK told the client which span is its stream's.
    synack = json.loads(re.search(r"event: SYN_ACK\ndata: (.*)\n", sse_text)[1])
    assert synack["meta"]["trace"] == {"trace_id": CLIENT_TRACE, "span_id": stream.span_id}


# ------------------------------------------------------------------ in-process routers, the SDK exporting


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    """The router's spans go over OTLP/HTTP to a receiver while the test runs."""
    with OtlpReceiver() as rx:
        prov = TracerProvider(resource=Resource.create({"service.name": "atp-test"}))
        prov.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.endpoint + "/v1/traces"),
                                                   schedule_delay_millis=50))
        tracing.install(prov)
        try:
            yield rx
        finally:
            tracing.uninstall()
            prov.shutdown()


async def spans_when(rx: OtlpReceiver, done) -> list[ReceivedSpan]:
    return await trio.to_thread.run_sync(rx.wait_for, done)


async def test_a_ws_syn_meta_trace_and_the_handshake_traceparent_parent_the_streams(nursery, tmp_path, scripted,
                                                                                    receiver):
    """Over one WebSocket: a SYN whose ``meta.trace`` names a parent (the spec's
    ``parent_span``, ``spn_`` prefix allowed, with ``trace_id``) starts its stream
    span in that trace; a later SYN without one is parented by the handshake's
    ``traceparent``, and so is one whose ``meta.trace`` is malformed (ignored,
    as if absent). Each SYN+ACK names its stream span."""
    scripted["lint.quick"] = ScriptedAdapter.returning("lint.quick")
    env = await start_router_on(nursery, tmp_path, {
        "agents": {"lint.quick": scripted_agent()},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["lint.quick"]}]})
    handshake_trace, handshake_span = secrets.token_hex(16), secrets.token_hex(8)
    syn_trace, syn_span = secrets.token_hex(16), secrets.token_hex(8)
    metas = {
        "t1": {**META, "trace": {"trace_id": syn_trace, "parent_span": f"spn_{syn_span}"}},
        "t2": META,
        "t3": {**META, "trace": {"trace_id": "nothex", "parent_span": "spn_zz"}},
    }
    headers = [("traceparent", f"00-{handshake_trace}-{handshake_span}-01")]
    async with open_websocket_url(env.ws_url, subprotocols=[SUBPROTOCOL["json"]], extra_headers=headers) as ws:
        peer = Peer(ws, FrameCodec("json"), "sess-traced")
        for sid, meta in metas.items():
            await peer.send(peer.session.open_stream(sid, meta, WINDOW, payload=task_payload()))
            await peer.pump_until(lambda sid=sid: peer.closed(sid))
    synacks = {f.stream_id: f.meta["trace"] for f in peer.raw if Flag.SYN in f.flags and Flag.ACK in f.flags}
    spans = await spans_when(receiver, lambda got: len(by_name(got, "atp.stream")) == 3
                             and len(by_name(got, "atp.session")) >= 1)
    streams = {s.attributes["stream_id"]: s for s in by_name(spans, "atp.stream")}
    assert {sid: (s.trace_id, s.span_id) for sid, s in streams.items()} == {
        sid: (t["trace_id"], t["span_id"]) for sid, t in synacks.items()}
    assert streams["t1"].trace_id == syn_trace
    assert streams["t2"].trace_id == handshake_trace
    assert streams["t3"].trace_id == handshake_trace
    sessions = {s.span_id: s for s in by_name(spans, "atp.session")}
    # Sequential streams: each opened its session's span; the SYN's own parent is
    # the session span's parent.
    assert sessions[streams["t1"].parent_span_id].parent_span_id == syn_span
    assert sessions[streams["t2"].parent_span_id].parent_span_id == handshake_span
    assert sessions[streams["t3"].parent_span_id].parent_span_id == handshake_span


async def test_an_escalation_is_traced_under_the_consensus_and_its_http_call_carries_the_legs_traceparent(
        nursery, tmp_path, scripted, receiver):
    """The first agent finds nothing, so the policy escalates to a model behind
    an OpenAI-compatible HTTP server: its request carries a ``traceparent``
    naming the escalation's leg span, which sits under ``atp.escalation`` under
    ``atp.consensus``; the consensus says it escalated and why."""
    scripted["lint.quick"] = ScriptedAdapter.returning("lint.quick")
    server = await serve(nursery, LoopbackHTTP(sse([chunk("looks fine"), chunk(usage={
        "prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127}), "[DONE]"]), path="/v1"))
    rib = {
        "models": {"m.small": {"provider": "openai_compat", "base_url": server.url, "model": "small", "ctx": "8k",
                               "cost_in": 1.0, "cost_out": 2.0, "max_out_tokens": 64}},
        "agents": {"lint.quick": scripted_agent(),
                   "reviewer.m": {"layer": "L2", "model": "m.small", "p95_ms": 500, "timeout_ms": 20_000}},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["lint.quick"],
                      "escalation": {"on": ["no_findings"], "to": "reviewer.m"}}],
    }
    env = await start_router_on(nursery, tmp_path, rib)
    events, sid = await run_stream(env, content=CLEAN)
    assert events[-1].type == "FIN"
    spans = await spans_when(receiver, lambda got: len(by_name(got, "atp.session")) == 1)
    stream, consensus, escalation = one(spans, "atp.stream"), one(spans, "atp.consensus"), one(spans, "atp.escalation")
    legs = {s.attributes["agent"]: s for s in by_name(spans, "atp.leg")}
    assert legs["lint.quick"].parent_span_id == stream.span_id
    assert consensus.parent_span_id == stream.span_id and escalation.parent_span_id == consensus.span_id
    esc_leg = legs["reviewer.m"]
    assert esc_leg.parent_span_id == escalation.span_id
    head, _ = server.requests[0]
    version, trace_id, parent_id, flags = re.search(r"(?im)^traceparent: (\S+)", head)[1].split("-")
    assert (version, trace_id, parent_id) == ("00", esc_leg.trace_id, esc_leg.span_id)
    assert int(flags, 16) & 1  # sampled
    a = esc_leg.attributes
    assert (a["model"], a["tokens_in"], a["tokens_out"]) == ("m.small", 120, 7)
    assert a["usd"] == pytest.approx((120 * 1.0 + 7 * 2.0) / 1e6)
    assert escalation.attributes["agent"] == "reviewer.m"
    assert escalation.attributes["atp.escalation.triggers"] == ["no_findings"]
    assert consensus.attributes["atp.escalated"] is True
    assert consensus.attributes["route_path"] == ["p", "lint.quick", "reviewer.m"]
    assert legs["lint.quick"].end_ns <= consensus.start_ns <= escalation.start_ns <= esc_leg.start_ns
    assert esc_leg.end_ns <= escalation.end_ns <= consensus.end_ns <= stream.end_ns
    assert stream.attributes["tokens_in"] == 120 and stream.attributes["stream_id"] == sid


async def test_an_a2a_next_hop_gets_the_legs_traceparent_in_its_headers_and_message_metadata(
        nursery, tmp_path, receiver):
    """An A2A agent (JSON-RPC over HTTP, served here by a loopback peer that
    records what it gets): the card request and ``message/send`` carry the leg
    span's ``traceparent`` header, and the message's ``metadata.traceparent``
    names the same span."""

    async def a2a(stream: trio.SocketStream) -> None:
        head, body = peer.requests[-1]
        if head.startswith("GET"):
            answer, status = b"{}", "404 Not Found"  # no agent card: message/send, no streaming
        else:
            answer, status = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": {
                "kind": "task", "id": "t-1", "contextId": "c-1", "status": {"state": "completed"},
                "artifacts": [{"artifactId": "a-1", "parts": [{"kind": "text", "text": "no issues"}]}]}}).encode(), \
                "200 OK"
        await stream.send_all(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
                              f"content-length: {len(answer)}\r\nconnection: close\r\n\r\n".encode() + answer)

    peer = await serve(nursery, LoopbackHTTP(a2a, path="/a2a"))
    env = await start_router_on(nursery, tmp_path, {
        "agents": {"remote.a2a": {"layer": "L3", "p95_ms": 500, "timeout_ms": 20_000,
                                  "remote": {"protocol": "a2a", "url": peer.url}}},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["remote.a2a"]}]})
    events, _ = await run_stream(env, content=CLEAN)
    assert events[-1].type == "FIN", [e.payload for e in events]
    spans = await spans_when(receiver, lambda got: len(by_name(got, "atp.session")) == 1)
    leg = one(spans, "atp.leg")
    assert leg.attributes["agent"] == "remote.a2a" and leg.parent_span_id == one(spans, "atp.stream").span_id
    sent = [re.search(r"(?im)^traceparent: (\S+)", head)[1] for head, _ in peer.requests]
    posts = [body for head, body in peer.requests if head.startswith("POST")]
    assert len(posts) == 1 and len(sent) == len(peer.requests) >= 2
    assert all(tp.split("-")[1:3] == [leg.trace_id, leg.span_id] for tp in sent)
    assert posts[0]["params"]["message"]["metadata"]["traceparent"] == sent[-1]


def test_the_2389_envelope_carries_the_callers_trace_context(receiver):
    """The 2389 task envelope gets ``traceparent`` from the current span (a
    leg's, in the router), kept by the wire encoding and forwarded as is; no
    field at all without tracing."""
    from opentelemetry import trace

    from atp_router.adapters.base import Prompt
    from atp_router.adapters.mqtt2389 import Mqtt2389Adapter
    from atp_router.mqtt import agent_protocol as P

    ad = Mqtt2389Adapter("a", host="h", port=1, agent_id="rev")
    prompt = Prompt(task_type="code_review", content=CLEAN, meta={})
    with tracing.provider().get_tracer("test").start_as_current_span("caller") as span:
        wire = json.loads(P.encode_task(ad.envelope(prompt, task_id="t", conversation_id="c")))
    sc = span.get_span_context()
    assert wire["traceparent"].split("-")[1:3] == [format(sc.trace_id, "032x"), format(sc.span_id, "016x")]
    decoded = msgspec.json.decode(json.dumps(wire), type=P.TaskEnvelope)
    assert decoded.traceparent == wire["traceparent"]
    tracing.uninstall()
    assert "traceparent" not in json.loads(P.encode_task(ad.envelope(prompt, task_id="t", conversation_id="c")))
    assert trace.get_current_span() is trace.INVALID_SPAN


async def test_a_failed_leg_is_an_error_span_and_the_reroute_follows_it_on_the_route_path(
        nursery, tmp_path, scripted, receiver):
    """A next-hop that fails (EAGENTDOWN) is rerouted to its fallback: its leg
    span has an error status and ``atp.error_code``, the fallback's leg follows
    it, and ``route_path`` names both in order."""
    scripted["a.down"] = ScriptedAdapter("a.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 503")
    scripted["b.ok"] = ScriptedAdapter.returning("b.ok")
    env = await start_router_on(nursery, tmp_path, {
        "agents": {"a.down": {**scripted_agent(), "fallback": "b.ok"}, "b.ok": scripted_agent()},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.down"]}]})
    events, _ = await run_stream(env, content=CLEAN)
    assert events[-1].type == "FIN"
    spans = await spans_when(receiver, lambda got: len(by_name(got, "atp.session")) == 1)
    legs = sorted(by_name(spans, "atp.leg"), key=lambda s: s.end_ns)
    assert [(s.attributes["agent"], s.status_code, s.attributes.get("atp.error_code")) for s in legs] == [
        ("a.down", 2, "EAGENTDOWN"), ("b.ok", 0, None)]
    assert legs[0].status_message == "EAGENTDOWN: HTTP 503"
    assert one(spans, "atp.stream").attributes["route_path"] == ["p", "a.down", "b.ok"]


# ------------------------------------------------------------------ off by default


async def test_without_an_otel_exporter_nothing_is_traced(nursery, tmp_path, scripted):
    """No provider installed (no ``OTEL_*`` exporter): the router holds no
    tracer, its SYN+ACK carries no ``meta.trace``, and next-hop HTTP clients get
    no hook (no header is added)."""
    assert not tracing.active()
    scripted["lint.quick"] = ScriptedAdapter.returning("lint.quick")
    env = await start_router_on(nursery, tmp_path, {
        "agents": {"lint.quick": scripted_agent()},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["lint.quick"]}]})
    assert env.router.tracing is None
    events, _ = await run_stream(env, content=CLEAN)
    assert events[0].type == "SYN_ACK" and "trace" not in events[0].frame.get("meta", {})
    assert tracing.httpx_hooks("any") == {} and tracing.outbound("any") == {}


@pytest.mark.parametrize(("env", "exporters"), [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_PROPAGATORS": "tracecontext"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
])
def test_exporters_come_from_the_standard_otel_variables(env, exporters):
    assert tracing.exporters_from_env(env) == exporters


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: 'zipkin'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc'"),
])
def test_an_exporter_the_router_has_not_is_refused_naming_the_variable(env, message):
    with pytest.raises(tracing.TracingConfigError, match=re.escape(message)):
        tracing.exporters_from_env(env)


@pytest.mark.slow
def test_atp_router_refuses_an_unsupported_otlp_protocol_at_start(tmp_path):
    """A misconfigured exporter is a clear start-up error (exit 2), not silence."""
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "HOME": str(tmp_path)}
    p = subprocess.run([*ROUTER, "--policies", str(MECHANICS_RIB), "--state-dir", str(tmp_path / "s"),
                        "--http-port", "0", "--ws-port", "0"], env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 2 and "OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc'" in p.stderr


@pytest.mark.parametrize(("meta", "parent"), [
    ({"trace_id": CLIENT_TRACE, "parent_span": CLIENT_SPAN}, (CLIENT_TRACE, CLIENT_SPAN, True)),
    ({"trace_id": CLIENT_TRACE.upper(), "parent_span": "spn_" + CLIENT_SPAN}, (CLIENT_TRACE, CLIENT_SPAN, True)),
    ({"trace_id": CLIENT_TRACE, "parent_span": CLIENT_SPAN, "sampled": False}, (CLIENT_TRACE, CLIENT_SPAN, False)),
    ({"parent_span": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, (CLIENT_TRACE, CLIENT_SPAN, True)),
    ({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", "tracestate": "v=1"}, (CLIENT_TRACE, CLIENT_SPAN, False)),
    ({"parent_span": CLIENT_SPAN}, None),  # no trace id: nothing to join
    ({"trace_id": "0" * 32, "parent_span": CLIENT_SPAN}, None),  # W3C: all-zero ids are invalid
    ({"traceparent": "garbage"}, None),
    ("not a mapping", None),
    (None, None),
])
def test_meta_trace_forms(meta, parent):
    from opentelemetry import trace

    ctx = tracing.parent_from_meta(meta)
    if parent is None:
        assert ctx is None
        return
    sc = trace.get_current_span(ctx).get_span_context()
    assert (format(sc.trace_id, "032x"), format(sc.span_id, "016x"), sc.trace_flags.sampled) == parent
    assert sc.is_remote
