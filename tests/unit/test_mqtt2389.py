"""The router's 2389 adapter (atp_router.adapters.mqtt2389) against our agent runtime
(atp_router.agent2389) wrapping the real bandit adapter, through a real mosquitto broker
started by the test: discovery from retained statuses, review tasks end to end,
error mapping, the LWT of a SIGKILLed agent process, a broker restart with
persistent sessions, pipelines, the Agent Context side channel, and a real router
fanning out to the MQTT agent and ruff.

The reference implementation (2389-research/2389-agent-rust) cannot run here
(PEERS.md); where a test needs a foreign agent it plays one with a plain MQTT
client that sends exactly the reference's wire shapes (retained "available" with
a 1-hour expiry and capabilities; ``{"response": "<free text>", "task_id": ...}``)."""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import subprocess
import sys
import uuid

import atp
import msgspec
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.mqtt2389 import Mqtt2389Adapter, Stage, from_spec, parse_report
from atp_router.adapters.registry import build_adapter
from atp_router.agent2389.config import parse_config
from atp_router.agent2389.runtime import AgentRuntime
from atp_router.consensus.types import AgentReport, Usage
from atp_router.mqtt import agent_protocol as P
from atp_router.mqtt import open_mqtt_client
from atp_router.policy.fib import compile_fib
from atp_router.policy.loader import load_rib_text
from atp_router.policy.rib import AgentSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.conftest import start_router
from tests.peers import free_port, start_mosquitto
from tests.unit.test_agent2389 import AFTER, BEFORE, DIFF, ROOT, config_text, new_id

CONTENT = {"diff": DIFF, "files": {"app.py": AFTER}}
REVIEW = Prompt(task_type="code_review", content=CONTENT, meta={"task_type": "code_review"})


@pytest.fixture(scope="module")
def broker():
    with start_mosquitto() as b:
        yield b


@pytest.fixture
def fresh_broker():
    with start_mosquitto() as b:
        yield b


def adapter(broker, agent_id: str, **kw) -> Mqtt2389Adapter:
    kw.setdefault("discovery_timeout_s", 3.0)
    return Mqtt2389Adapter("sec.mqtt", host=broker.host, port=broker.port, agent_id=agent_id, **kw)


async def start_agent(nursery, broker, agent_id: str, **kw) -> AgentRuntime:
    rt = AgentRuntime(parse_config(config_text(broker.port, agent_id, **kw)))
    await nursery.start(rt.run)
    return rt


async def final(ad: Mqtt2389Adapter, prompt: Prompt = REVIEW, timeout_s: float = 15.0):
    with trio.fail_after(timeout_s):
        frags = [f async for f in ad.stream(prompt)]
    assert [f.type for f in frags] == [PayloadType.FINAL]
    return frags[0]


def spec(**remote) -> AgentSpec:
    return msgspec.convert({"layer": "L1", "p95_ms": 1000, "remote": {"protocol": "mqtt2389", **remote}}, AgentSpec)


# ===================================================================== RIB → adapter (pure)

def test_from_spec_reads_the_rib_entry():
    ad = build_adapter("sec.mqtt", spec(url="mqtt://127.0.0.1:1999", agent_id="a-1", cost_usd_per_call=0.002,
                                        options={"pipeline": ["b", {"agent": "c", "instruction": "sum up"}],
                                                 "max_depth": 3, "instruction": "review"}))
    assert isinstance(ad, Mqtt2389Adapter)
    assert (ad.host, ad.port, ad.agent_id, ad.chain) == ("127.0.0.1", 1999, "a-1", ("a-1", "b", "c"))
    assert ad.pipeline[1] == Stage("c", "sum up") and ad.estimate(REVIEW).usd == 0.002
    assert from_spec("x.y", spec(url="mqtt://h")).agent_id == "x.y"  # default: the RIB name
    refusals = [
        (spec(url="http://h"), "remote.url"),
        (spec(url="mqtt://h", agent_id="a/b"), "remote.agent_id"),
        (spec(url="mqtt://h", options={"qos": 0}), "remote.options.qos: unknown option"),
        (spec(url="mqtt://h", options={"max_depth": 17}), "remote.options.max_depth"),
        (spec(url="mqtt://h", options={"pipeline": ["b", "c"], "max_depth": 1}), "exceeds max_depth 1"),
        (spec(url="mqtt://h", options={"max_depth": -1}), "remote.options.max_depth"),
        (spec(url="mqtt://h", options={"pipeline": [{"agent": "b", "next": "x"}]}), "remote.options.pipeline[0]"),
        (spec(url="mqtt://h", options={"ca_file": "/ca.pem"}), "not mqtts://"),
        (spec(url="mqtts://h", options={"ca_file": "/nonexistent/ca.pem"}), "TLS files cannot be loaded"),
    ]
    for entry, words in refusals:
        with pytest.raises(ValueError, match=re.escape(words)):
            from_spec("sec.mqtt", entry)
    with_options = msgspec.structs.replace(spec(url="mqtt://h"), options={"x": 1})
    with pytest.raises(ValueError, match="remote.options"):
        from_spec("sec.mqtt", with_options)


def test_a_policy_expresses_the_pipeline_and_its_depth():
    rib = load_rib_text("""
agents:
  review.chain:
    layer: L2
    p95_ms: 5000
    remote:
      protocol: mqtt2389
      url: mqtt://127.0.0.1:1883
      agent_id: triage
      options: {pipeline: [bandit-2389, summarizer], max_depth: 3}
policies:
  - {match: {task_type: code_review}, fanout: [review.chain]}
""")
    ad = build_adapter("review.chain", rib.agents["review.chain"])
    env = ad.envelope(REVIEW, task_id=str(uuid.uuid4()), conversation_id="c1")
    assert env.topic == "/control/agents/triage/input"
    assert env.next.topic == "/control/agents/bandit-2389/input" and env.next.input is None
    assert env.next.next.topic == "/control/agents/summarizer/input" and env.next.next.next is None
    assert P.pipeline_depth(msgspec.json.decode(P.encode_task(env))) == 2  # nested next objects (§2)


def test_a_chain_of_16_nested_next_objects_is_allowed():
    """The spec's depth is the count of nested ``next`` objects: 16 of them (17
    agents) are within the default maximum, for the adapter as for the runtime."""
    stages = [Stage(f"s{i}") for i in range(16)]
    ad = Mqtt2389Adapter("a", host="h", port=1, agent_id="first", pipeline=stages)
    env = msgspec.json.decode(P.encode_task(ad.envelope(REVIEW, task_id=str(uuid.uuid4()), conversation_id="c")))
    assert P.pipeline_depth(env) == 16
    assert isinstance(P.screen_task(msgspec.json.encode(env), received_topic=P.input_topic("first"), retained=False,
                                    cache=P.IdempotencyCache()), P.Accept)
    with pytest.raises(ValueError, match="17 nested next objects exceeds max_depth 16"):
        Mqtt2389Adapter("a", host="h", port=1, agent_id="first", pipeline=[*stages, Stage("s16")])
    assert Mqtt2389Adapter("a", host="h", port=1, agent_id="solo", max_depth=0).chain == ("solo",)


def test_envelope_shape_and_agent_context_side_channel():
    ad = Mqtt2389Adapter("a", host="h", port=1, agent_id="rev", instruction="review this")
    task_id = str(uuid.uuid4())
    wire = json.loads(P.encode_task(ad.envelope(REVIEW, task_id=task_id, conversation_id="conv-1")))
    assert wire == {"task_id": task_id, "conversation_id": "conv-1", "topic": "/control/agents/rev/input",
                    "instruction": "review this", "input": {"task_type": "code_review", "content": CONTENT},
                    "next": None}
    acm = json.loads((ROOT.parent / "shared" / "specs" / "agent-context-message.example.json").read_text())
    with_ctx = Prompt(task_type="code_review", content=CONTENT, meta={"agent_context": acm},
                      task=TaskMeta(task_type="code_review", agent_context=acm))
    wire = json.loads(P.encode_task(ad.envelope(with_ctx, task_id=task_id, conversation_id="conv-1")))
    assert wire["version"] == "2.0" and wire["context"] == acm and wire["routing_trace"] == []


def test_parse_report_shapes():
    report, usage = parse_report('{"findings": [{"file": "a.py", "start": 3, "end": 3, "severity": "high", '
                                 '"claim": "x", "ref": "1"}], "summary": "s", "confidence": 0.7, '
                                 '"usage": {"in_tokens": 5, "usd_micros": 9}, "extra": 1}')
    assert [f.file for f in report.findings] == ["a.py"] and report.summary == "s" and report.confidence == 0.7
    assert usage == Usage(in_tokens=5, usd_micros=9)
    prose, usage = parse_report("The change looks fine to me.")
    assert prose == AgentReport(summary="The change looks fine to me.") and usage is None
    with pytest.raises(AgentError) as ei:
        parse_report('{"findings": [{"file": "a.py"}]}')
    assert ei.value.code is ErrorCode.EPROTO
    assert "expected the ATP findings schema" in ei.value.reason and "line|start" in ei.value.reason


def test_parse_report_takes_findings_with_line_like_the_a2a_path():
    """A spec-only agent citing ``line`` (and ``message``, ``path``) instead of
    ``start``/``end``: read by the parser the A2A path uses, cited lines checked
    against the task's content, the agent's rule and cwe kept."""
    text = json.dumps({"findings": [
        {"file": "app.py", "line": 5, "severity": "high", "message": "shell=True", "rule": "B602", "cwe": "CWE-78"},
        {"path": "b/app.py", "line": "5", "severity": "warning", "claim": "again"},
        {"file": "app.py", "start": 5, "end": 5, "severity": "low", "claim": "strict", "ref": "x"},
    ]})
    report, _ = parse_report(text, CONTENT)
    assert [(f.file, f.start, f.end, f.severity.value, f.claim) for f in report.findings] == [
        ("app.py", 5, 5, "high", "shell=True"), ("app.py", 5, 5, "medium", "again"), ("app.py", 5, 5, "low", "strict")]
    assert (report.findings[0].rule, report.findings[0].cwe, report.findings[0].ref) == ("B602", "CWE-78", "1")
    assert report.findings[2].ref == "x"
    # A bare list is the findings.
    bare, _ = parse_report(json.dumps([{"file": "app.py", "line": 5, "severity": "high", "claim": "c"}]), CONTENT)
    assert [f.start for f in bare.findings] == [5]
    # A cited line outside the reviewed content fits no shape.
    with pytest.raises(AgentError, match=r"finding \[0\]"):
        parse_report(json.dumps([{"file": "app.py", "line": 99, "severity": "high", "claim": "c"}]), CONTENT)


def test_decode_reply_accepts_plausible_success_shapes():
    for payload, text in [
        ({"response": "ok", "task_id": "t"}, "ok"),
        ({"result": "ok"}, "ok"),
        ({"output": {"findings": []}}, '{"findings":[]}'),
        ({"content": "ok"}, "ok"),
        ({"text": "ok"}, "ok"),
        ({"answer": "ok"}, "ok"),
        ({"findings": [], "summary": "s"}, '{"findings":[],"summary":"s"}'),
        ([{"file": "a.py"}], '[{"file":"a.py"}]'),
    ]:
        reply = P.decode_reply(json.dumps(payload).encode())
        assert isinstance(reply, P.Reply) and reply.response == text, payload
    err = P.decode_reply(b'{"error": "model crashed", "task_id": "t"}')
    assert err == P.ErrorReply("t", "internal_error", "model crashed")
    with pytest.raises(ValueError) as ei:
        P.decode_reply(b'{"status": "done", "task_id": "t"}')
    assert "keys [status, task_id]" in str(ei.value) and 'expected {"response": ...}' in str(ei.value)
    with pytest.raises(ValueError, match="expected"):
        P.decode_reply(b"42")


# ===================================================================== router ↔ agent

async def test_review_through_the_2389_agent(broker, nursery):
    agent_id = new_id()
    await start_agent(nursery, broker, agent_id)
    ad = adapter(broker, agent_id, cost_usd_per_call=0.0015)
    try:
        frag = await final(ad)
        [f] = frag.content.findings
        assert (f.file, f.start, f.rule, f.cwe, f.ref) == ("app.py", 5, "B602", "CWE-78", "1")
        assert frag.usage == Usage(usd_micros=1500)  # the agent reported no cost: the flat price
        assert ad.health().up
        assert ad.agents()[agent_id].capabilities == ["code_review", "security"]
        assert ad.capabilities().skills == ["code_review", "security"]
    finally:
        await ad.aclose()


async def test_unknown_agent_is_down_after_discovery(broker):
    ad = adapter(broker, "nobody-" + uuid.uuid4().hex[:6])
    try:
        assert ad.health().up  # nothing known yet: the link starts
        with pytest.raises(AgentError) as ei:
            await final(ad)
        assert ei.value.code is ErrorCode.EAGENTDOWN and "has not announced itself" in ei.value.reason
        assert not ad.health().up
    finally:
        await ad.aclose()


async def test_broker_unreachable_is_eagentdown():
    ad = Mqtt2389Adapter("x", host="127.0.0.1", port=free_port(), agent_id="a", discovery_timeout_s=0.5)
    with pytest.raises(AgentError) as ei:
        await final(ad)
    assert ei.value.code is ErrorCode.EAGENTDOWN and "unreachable" in ei.value.reason
    await ad.aclose()


async def test_agent_errors_map_to_atp_codes(broker, nursery):
    agent_id = new_id()
    await start_agent(nursery, broker, agent_id)
    slow_id = new_id()
    slow = config_text(broker.port, slow_id).replace("task_timeout_s = 60", "task_timeout_s = 0.001")
    rt = AgentRuntime(parse_config(slow))
    await nursery.start(rt.run)
    ad, ad_slow = adapter(broker, agent_id), adapter(broker, slow_id)
    try:
        no_diff = Prompt(task_type="code_review", content={"files": {"app.py": AFTER}})
        with pytest.raises(AgentError) as ei:
            await final(ad, no_diff)
        assert ei.value.code is ErrorCode.EPROTO and "invalid_input" in ei.value.reason
        with pytest.raises(AgentError) as ei:
            await final(ad_slow)
        assert ei.value.code is ErrorCode.EAGENTDOWN and "tool_execution_failed" in ei.value.reason
    finally:
        await ad.aclose()
        await ad_slow.aclose()


async def test_sigkill_of_the_agent_process_is_seen_through_its_lwt(broker, tmp_path):
    agent_id = new_id()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(config_text(broker.port, agent_id))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "atp_router.agent2389", "--config", str(cfg), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ad = adapter(broker, agent_id, down_grace_s=0.5)
    rib = load_rib_text(f"""
agents:
  sec.mqtt: {{layer: L1, p95_ms: 900, remote: {{protocol: mqtt2389, url: "mqtt://127.0.0.1:{broker.port}",
                                                agent_id: {agent_id}}}}}
  lint.ruff: {{layer: L1, tool: ruff, p95_ms: 200}}
policies:
  - {{match: {{task_type: code_review}}, fanout: [sec.mqtt, lint.ruff]}}
""")
    fib = compile_fib(rib, version=1)
    meta = {"task_type": "code_review"}
    try:
        async with open_mqtt_client(broker.host, broker.port) as mon:
            await mon.subscribe(P.status_topic(agent_id))
            await mon.subscribe(P.input_topic(agent_id))
            with trio.fail_after(20):
                while json.loads((await mon.messages.receive()).payload).get("status") != "available":
                    pass
            assert (await final(ad)).content.findings  # the agent process works
            hops = {h.agent for h in fib.lookup(meta, health={"sec.mqtt": ad.health()}).next_hops}
            assert hops == {"sec.mqtt", "lint.ruff"}

            # A call in flight when the process dies: it fails with EAGENTDOWN soon
            # after the LWT, instead of waiting for the router's deadline.
            async def killer() -> None:
                async for m in mon.messages:
                    if m.topic == P.input_topic(agent_id):
                        proc.send_signal(signal.SIGKILL)
                        return

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(killer)
                with pytest.raises(AgentError) as ei:
                    await final(ad)
            assert ei.value.code is ErrorCode.EAGENTDOWN and "unavailable" in ei.value.reason
            assert trio.current_time() - t0 < 5
        health = ad.health()
        assert not health.up
        # The FIB leaves the dead next-hop out.
        hops = {h.agent for h in fib.lookup(meta, health={"sec.mqtt": health}).next_hops}
        assert hops == {"lint.ruff"}
        with pytest.raises(AgentError) as ei:
            await final(ad)
        assert ei.value.code is ErrorCode.EAGENTDOWN
    finally:
        await ad.aclose()
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_broker_restart_loses_no_task(fresh_broker, nursery):
    """A task in flight across a broker restart: the broker persists the sessions
    (clean_start off, session expiry); the agent, mid-review when the broker goes,
    publishes its reply after reconnecting; the router's persistent subscription
    receives it. The LWTs mosquitto publishes while stopping do not fail the call:
    the agent announces itself again within the grace period."""
    b = fresh_broker
    agent_id = new_id()
    rt = await start_agent(nursery, b, agent_id)
    ad = adapter(b, agent_id, client_id="router-" + uuid.uuid4().hex[:8])
    try:
        await final(ad)  # link up and agent known
        async with trio.open_nursery() as inner:

            async def restart_when_the_task_is_out() -> None:
                async with open_mqtt_client(b.host, b.port) as mon:
                    await mon.subscribe(P.input_topic(agent_id))
                    await mon.messages.receive()
                await trio.to_thread.run_sync(b.restart)

            inner.start_soon(restart_when_the_task_is_out)
            await trio.sleep(0.1)
            frag = await final(ad, timeout_s=30)
        assert [f.rule for f in frag.content.findings] == ["B602"]
        assert rt.client.statistics().connections >= 2 and rt.client.statistics().session_present
        assert ad.health().up  # the agent is available again after the restart
    finally:
        await ad.aclose()


async def test_pipeline_to_a_reference_shaped_agent(broker, nursery):
    """Our agent reviews, forwards to a foreign agent (playing the Rust reference's
    wire shapes), whose free-text answer becomes the FINAL summary."""
    first, ref = new_id(), "ref-" + uuid.uuid4().hex[:8]
    await start_agent(nursery, broker, first)
    async with open_mqtt_client(broker.host, broker.port) as foreign:
        await foreign.subscribe(P.input_topic(ref))
        status = {"agent_id": ref, "status": "available", "timestamp": P.rfc3339(1.0e9),
                  "capabilities": ["summarize"], "description": "reference-shaped"}
        await foreign.publish(P.status_topic(ref), json.dumps(status).encode(), qos=1, retain=True,
                              message_expiry_s=3600)
        ad = adapter(broker, first, pipeline=[Stage(ref, "summarise the findings")], instruction="review")
        try:
            async with trio.open_nursery() as inner:
                seen: dict = {}

                async def play_reference() -> None:
                    msg = await foreign.messages.receive()
                    task = seen["task"] = json.loads(msg.payload)
                    reply = {"response": "One high-severity finding: shell=True (CWE-78).",
                             "task_id": task["task_id"]}
                    await foreign.publish(P.conversation_topic(task["conversation_id"], ref),
                                          json.dumps(reply).encode(), qos=1)

                inner.start_soon(play_reference)
                frag = await final(ad)
            task = seen["task"]
            assert task["topic"] == P.input_topic(ref) and task["instruction"] == "summarise the findings"
            assert uuid.UUID(task["task_id"]).version == 4 and task["next"] is None
            assert json.loads(task["input"])["findings"][0]["rule"] == "B602"
            assert frag.content == AgentReport(summary="One high-severity finding: shell=True (CWE-78).")
            # An error from a later stage ends the call with its mapped code.
            async with trio.open_nursery() as inner:

                async def fail_as_reference() -> None:
                    task = json.loads((await foreign.messages.receive()).payload)
                    err = {"error": {"code": "llm_error", "message": "model unavailable"}, "task_id": task["task_id"]}
                    await foreign.publish(P.conversation_topic(task["conversation_id"], ref),
                                          json.dumps(err).encode(), qos=1)

                inner.start_soon(fail_as_reference)
                with pytest.raises(AgentError) as ei:
                    await final(ad)
            assert ei.value.code is ErrorCode.EAGENTDOWN and f"{ref!r}: llm_error" in ei.value.reason
            # A stage that is not available fails the call before anything is sent.
            await foreign.publish(P.status_topic(ref), b"", qos=1, retain=True)
            with trio.fail_after(5):
                while ad.health().up:
                    await trio.sleep(0.02)
            with pytest.raises(AgentError, match="has left"):
                await final(ad)
        finally:
            await ad.aclose()


async def test_agent_context_travels_unchanged_in_the_envelope(broker, nursery):
    agent_id = new_id()
    await start_agent(nursery, broker, agent_id)
    acm = json.loads((ROOT.parent / "shared" / "specs" / "agent-context-message.example.json").read_text())
    ad = adapter(broker, agent_id)
    try:
        async with open_mqtt_client(broker.host, broker.port) as mon:
            await mon.subscribe(P.input_topic(agent_id))
            frag = await final(ad, Prompt(task_type="code_review", content=CONTENT, meta={"agent_context": acm},
                                          task=TaskMeta(task_type="code_review", agent_context=acm)))
            wire = json.loads((await mon.messages.receive()).payload)
        assert wire["version"] == "2.0" and wire["context"] == acm
        assert frag.content.findings[0].rule == "B602"  # the agent accepts the v2 envelope
    finally:
        await ad.aclose()


# ===================================================================== a real router

async def test_router_fans_out_to_the_mqtt_agent_and_ruff(broker, nursery, tmp_path):
    agent_id = new_id()
    rt = await start_agent(nursery, broker, agent_id)
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "mqtt.yaml").write_text(f"""
agents:
  lint.ruff: {{layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}}
  sec.mqtt:
    layer: L1
    p95_ms: 1500
    strengths: [code_review, security]
    remote: {{protocol: mqtt2389, url: "mqtt://127.0.0.1:{broker.port}", agent_id: {agent_id},
              cost_usd_per_call: 0.001}}
policies:
  - name: code_review
    match: {{task_type: code_review}}
    fanout: [lint.ruff, sec.mqtt]
    budget: {{usd: 0.05}}
""")
    env = await start_router(nursery, policies)
    ruff_after = AFTER + "\n\ndef f():\n    return undefined_name\n"
    diff = "".join(difflib.unified_diff(BEFORE.splitlines(True), ruff_after.splitlines(True), "a/app.py", "b/app.py"))
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content={"diff": diff,
                                                                                "files": {"app.py": ruff_after}})
        assert set(st.route["next_hops"]) == {"lint.ruff", "sec.mqtt"}
        with trio.fail_after(30):
            result = await c.result(st)
        provenance = {p.split("#")[0] for f in result["result"]["findings"] for p in f["provenance"]}
        assert provenance == {"lint.ruff", "sec.mqtt"}
        assert result["telemetry"]["usd"] == pytest.approx(0.001)  # the MQTT agent's flat price
        # The agent leaves: the adapter knows at once (its health is down, and it is
        # live_health), so the FIB routes new streams around it: ruff alone.
        rt.shutdown()
        with trio.fail_after(5):
            while env.router.gen.adapters["sec.mqtt"].health().up:
                await trio.sleep(0.02)
        _, st = await c.open_stream(task={"task_type": "code_review"}, content={"diff": diff,
                                                                                "files": {"app.py": ruff_after}})
        assert st.route["next_hops"] == ["lint.ruff"]
        with trio.fail_after(30):
            events = [ev async for ev in c.events(st)]
        assert not [ev.payload for ev in events if ev.type == "ERROR"]
        [result] = [ev.payload for ev in events if ev.type == "FINAL"]
        assert {p.split("#")[0] for f in result["result"]["findings"] for p in f["provenance"]} == {"lint.ruff"}


# ===================================================================== spec-only agents (issue 7, item 11)

async def _announce(c, agent_id: str) -> None:
    await c.subscribe(P.input_topic(agent_id))
    status = {"agent_id": agent_id, "status": "available", "timestamp": P.rfc3339(1.0e9)}
    await c.publish(P.status_topic(agent_id), json.dumps(status).encode(), qos=1, retain=True)


async def _answer(c, agent_id: str, reply) -> dict:
    """Read one task from the agent's input topic and answer it with ``reply(task)``."""
    task = json.loads((await c.messages.receive()).payload)
    await c.publish(P.conversation_topic(task["conversation_id"], agent_id), json.dumps(reply(task)).encode(), qos=1)
    return task


def _context_with(token: str) -> dict:
    acm = json.loads((ROOT.parent / "shared" / "specs" / "agent-context-message.example.json").read_text())
    acm["agentContext"]["securityContext"]["authenticationInfo"]["token"] = token
    return acm


async def test_spec_only_agent_shapes_over_the_broker(broker):
    """A spec-only agent (a plain MQTT client: the spec defines no success shape)
    answering with ``result`` and findings citing ``line``; then with a shape of no
    kind (EPROTO naming what was expected); then with an error that echoes the
    task's securityContext token, which never reaches the AgentError."""
    agent_id = "spec-only-" + uuid.uuid4().hex[:8]
    token = "eyJ" + uuid.uuid4().hex + uuid.uuid4().hex
    ctx = _context_with(token)
    prompt = Prompt(task_type="code_review", content=CONTENT, meta={"agent_context": ctx},
                    task=TaskMeta(task_type="code_review", agent_context=ctx))
    async with open_mqtt_client(broker.host, broker.port) as foreign:
        await _announce(foreign, agent_id)
        ad = adapter(broker, agent_id)
        try:
            findings = [{"file": "app.py", "line": 5, "severity": "high", "message": "shell=True (CWE-78)"}]
            async with trio.open_nursery() as n:
                n.start_soon(_answer, foreign, agent_id, lambda t: {"result": {"findings": findings}})
                frag = await final(ad, prompt)
            assert [(f.file, f.start, f.claim) for f in frag.content.findings] == [("app.py", 5, "shell=True (CWE-78)")]

            async with trio.open_nursery() as n:
                n.start_soon(_answer, foreign, agent_id, lambda t: {"status": "done", "task_id": t["task_id"]})
                with pytest.raises(AgentError) as ei:
                    await final(ad, prompt)
            assert ei.value.code is ErrorCode.EPROTO
            assert "keys [status, task_id]" in ei.value.reason and '{"response": ...}' in ei.value.reason

            def echo(task: dict) -> dict:
                assert task["context"]["agentContext"]["securityContext"]["authenticationInfo"]["token"] == token
                return {"error": {"code": "llm_error", "message": f"upstream refused the bearer {token} twice"},
                        "task_id": task["task_id"]}

            async with trio.open_nursery() as n:
                n.start_soon(_answer, foreign, agent_id, echo)
                with pytest.raises(AgentError) as ei:
                    await final(ad, prompt)
            assert ei.value.code is ErrorCode.EAGENTDOWN and "llm_error" in ei.value.reason
            assert token not in ei.value.reason and token not in str(ei.value)
            assert "upstream refused the bearer [REDACTED] twice" in ei.value.reason
        finally:
            await ad.aclose()
            await foreign.publish(P.status_topic(agent_id), b"", qos=1, retain=True)


async def test_a_2389_error_echoing_the_context_token_never_reaches_the_client(broker, nursery, tmp_path):
    """The issue's attack through a real router: a 2389 agent whose error text
    echoes the Agent Context ``securityContext`` token. The client's ERROR names
    the agent's failure with the token masked; no frame carries it."""
    agent_id = "echo-" + uuid.uuid4().hex[:8]
    token = "eyJ" + uuid.uuid4().hex + uuid.uuid4().hex
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "mqtt.yaml").write_text(f"""
agents:
  sec.mqtt:
    layer: L1
    p95_ms: 1500
    strengths: [code_review]
    remote: {{protocol: mqtt2389, url: "mqtt://127.0.0.1:{broker.port}", agent_id: {agent_id}}}
policies:
  - {{name: code_review, match: {{task_type: code_review}}, fanout: [sec.mqtt]}}
""")
    async with open_mqtt_client(broker.host, broker.port) as foreign:
        await _announce(foreign, agent_id)

        async def echo_every_task() -> None:
            async for m in foreign.messages:
                task = json.loads(m.payload)
                err = {"error": {"code": "tool_execution_failed", "message": f"auth failed for {token}"},
                       "task_id": task["task_id"]}
                await foreign.publish(P.conversation_topic(task["conversation_id"], agent_id),
                                      json.dumps(err).encode(), qos=1)

        nursery.start_soon(echo_every_task)
        env = await start_router(nursery, policies)
        async with atp.Client(env.url) as c:
            _, st = await c.open_stream(task={"task_type": "code_review", "agent_context": _context_with(token)},
                                        content=CONTENT)
            with trio.fail_after(30):
                events = [ev async for ev in c.events(st)]
        errors = [ev.payload for ev in events if ev.type == "ERROR"]
        assert errors and any("tool_execution_failed" in json.dumps(p) and "[REDACTED]" in json.dumps(p)
                              for p in errors), errors
        assert token not in json.dumps([ev.frame for ev in events])
        await foreign.publish(P.status_topic(agent_id), b"", qos=1, retain=True)
