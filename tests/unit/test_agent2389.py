"""The 2389 agent runtime (atp_router.agent2389) against a real mosquitto broker started by
the test, wrapping the real bandit (and ruff) adapters: every conformance point of
PEERS.md's 2389 section, the §7.4 algorithm, the tool interface, TLS, credentials
from the environment, the LWT after SIGKILL and the graceful shutdown.

Where the test plays the router it publishes task envelopes with a plain MQTT
client, in the shape of spec §6.1 (the adapter side is tests/unit/test_mqtt2389.py)."""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from atp_router.agent2389.cli import main as cli_main
from atp_router.agent2389.config import ConfigError, parse_config
from atp_router.agent2389.runtime import AgentRuntime, StartupError
from atp_router.agent2389.tools import (
    ParameterError,
    SchemaError,
    check_schema,
    validate,
)
from atp_router.mqtt import MQTTClient, open_mqtt_client
from atp_router.mqtt import agent_protocol as P
from atp_router.security.redact import REDACTED, register_secrets
from tests.peers import MOSQUITTO_TLS, make_test_pki, mosquitto_passwd, start_mosquitto

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = (ROOT / "examples" / "agent2389" / "agent.toml").read_text()

BEFORE = "import subprocess\n\n\ndef run(cmd):\n    return subprocess.call(cmd)\n"
AFTER = "import subprocess\n\n\ndef run(cmd):\n    return subprocess.call(cmd, shell=True)\n"
DIFF = "".join(difflib.unified_diff(BEFORE.splitlines(True), AFTER.splitlines(True), "a/app.py", "b/app.py"))
REVIEW = {"task_type": "code_review", "content": {"diff": DIFF, "files": {"app.py": AFTER}}}
RFC3339_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
# What must never be in an error message (RULE-002): stack traces, frames, absolute paths.
LEAKS = re.compile(r"Traceback|File \"|(?<![\w.])/(?:tmp|usr|home|root|work|var|etc)\b|atp-tool-")


@pytest.fixture(scope="module")
def broker():
    with start_mosquitto() as b:
        yield b


def config_text(port: int, agent_id: str, *, scheme: str = "mqtt", extra_agent: str = "", extra_mqtt: str = "",
                tail: str = "") -> str:
    text = EXAMPLE.replace("mqtt://127.0.0.1:1883", f"{scheme}://127.0.0.1:{port}")
    text = text.replace('id = "sec-bandit-2389"', f'id = "{agent_id}"')
    text = text.replace("[mqtt]\n", f"{extra_agent}\n[mqtt]\n{extra_mqtt}")
    return text + tail


def new_id() -> str:
    return "agent-" + uuid.uuid4().hex[:10]


def envelope(agent_id: str, input: Any = None, **fields: Any) -> dict[str, Any]:
    env = {"task_id": str(uuid.uuid4()), "conversation_id": "conv-" + uuid.uuid4().hex[:10],
           "topic": P.input_topic(agent_id), "instruction": None,
           "input": REVIEW if input is None else input, "next": None}
    env.update(fields)
    return env


def chain(depth: int, last_agent: str = "sink") -> dict[str, Any] | None:
    """A ``next`` chain of ``depth`` nested objects: the spec's pipeline depth (§2)."""
    nxt = None
    for _ in range(depth):
        nxt = {"topic": P.input_topic(last_agent), "instruction": None, "input": None, "next": nxt}
    return nxt


async def start_agent(nursery, broker, agent_id: str | None = None, **kw) -> AgentRuntime:
    rt = AgentRuntime(parse_config(config_text(broker.port, agent_id or new_id(), **kw)))
    await nursery.start(rt.run)
    return rt


async def replies(c: MQTTClient, n: int, timeout_s: float = 10.0) -> list[tuple[str, dict]]:
    out = []
    with trio.fail_after(timeout_s):
        async for m in c.messages:
            if m.topic.startswith("/conversations/"):
                out.append((m.topic, json.loads(m.payload)))
                if len(out) == n:
                    return out
    return out


async def quiet(c: MQTTClient, wait_s: float = 0.5) -> None:
    with trio.move_on_after(wait_s):
        async for m in c.messages:
            if m.topic.startswith("/conversations/"):
                pytest.fail(f"unexpected reply on {m.topic}: {m.payload[:200]!r}")


async def send(c: MQTTClient, agent_id: str, env: dict | bytes, *, retain: bool = False) -> None:
    payload = env if isinstance(env, bytes) else json.dumps(env).encode()
    await c.publish(P.input_topic(agent_id), payload, qos=1, retain=retain)


# ===================================================================== sans-IO protocol

def test_topic_canonicalization():
    assert P.canonicalize("//control//agents/x/") == "/control/agents/x"
    assert P.canonicalize("control/agents/x/input") == "/control/agents/x/input"
    assert P.canonicalize("///") == "/"
    assert P.agent_of_input_topic("//control//agents/a.b_c-1//input/") == "a.b_c-1"
    assert P.agent_of_input_topic("/control/agents/a b/input") is None
    assert P.agent_of_input_topic("/conversations/c/a") is None
    with pytest.raises(ValueError):
        P.input_topic("no/slash")
    with pytest.raises(ValueError):
        P.conversation_topic("a/b", "agent")


def test_rfc3339_with_z():
    assert P.rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert P.rfc3339(1756209600.5) == "2025-08-26T12:00:00.500Z"
    assert RFC3339_Z.match(json.loads(P.encode_status("a", "available", 1e9))["timestamp"])


def test_sanitize_strips_traces_paths_and_secrets():
    raw = ('Traceback (most recent call last):\n  File "/work/main/atp/x.py", line 3, in f\nValueError: boom')
    assert P.sanitize(raw) == "error"
    msg = P.sanitize("cannot open /tmp/atp-tool-x1/app.py: password=hunter2 token: abc " + "z" * 400)
    assert "/tmp" not in msg and "hunter2" not in msg and "abc" not in msg and len(msg) <= 300
    assert "<path>" in msg and "password=<redacted>" in msg


def test_idempotency_cache_evicts_the_oldest():
    cache = P.IdempotencyCache(2)
    assert not cache.seen("a") and not cache.seen("b") and cache.seen("a")
    assert not cache.seen("c")  # evicts b, the least recently seen
    assert cache.seen("a") and not cache.seen("b")


def screen(env: Any, *, topic: str = "/control/agents/me/input", retained: bool = False,
           cache: P.IdempotencyCache | None = None, raw: bytes | None = None):
    payload = raw if raw is not None else json.dumps(env).encode()
    return P.screen_task(payload, received_topic=topic, retained=retained,
                         cache=cache if cache is not None else P.IdempotencyCache())


def test_screen_task_steps_2_to_6():
    ok = envelope("me")
    assert isinstance(screen(ok), P.Accept)
    assert screen(ok, retained=True) == P.Ignore(2, "retained message on an input topic")
    assert screen(envelope("other")).step == 3  # topic mismatch: discarded, no reply
    assert isinstance(screen(envelope("me", topic="//control//agents/me//input/")), P.Accept)
    cache = P.IdempotencyCache()
    assert isinstance(screen(ok, cache=cache), P.Accept)
    dup = screen(ok, cache=cache)
    assert isinstance(dup, P.Ignore) and dup.step == 4 and dup.reason.startswith("duplicate")
    # Depth counts nested next objects (§2, §7.4 step 5): 16 pass, 17 are refused.
    assert P.pipeline_depth(envelope("me")) == 0 and P.pipeline_depth(envelope("me", next=chain(16))) == 16
    assert isinstance(screen(envelope("me", next=chain(16))), P.Accept)
    deep = screen(envelope("me", next=chain(17)))
    assert isinstance(deep, P.Reject) and deep.code == "pipeline_depth_exceeded" and deep.step == 5
    # A maximum of 0 allows no forwarding at all.
    assert isinstance(P.screen_task(json.dumps(envelope("me")).encode(), received_topic="/control/agents/me/input",
                                    retained=False, cache=P.IdempotencyCache(), max_depth=0), P.Accept)
    one = P.screen_task(json.dumps(envelope("me", next=chain(1))).encode(), received_topic="/control/agents/me/input",
                        retained=False, cache=P.IdempotencyCache(), max_depth=0)
    assert isinstance(one, P.Reject) and one.code == "pipeline_depth_exceeded"
    big = envelope("me", input={"task_type": "code_review", "content": {"x": "y" * 300_000}})
    r = screen(big)
    assert isinstance(r, P.Reject) and r.code == "invalid_input" and "262144" in r.message
    bad_id = screen(envelope("me", task_id="42"))
    assert isinstance(bad_id, P.Reject) and bad_id.code == "invalid_input"
    no_conv = screen({k: v for k, v in ok.items() if k != "conversation_id"} | {"task_id": str(uuid.uuid4())})
    assert isinstance(no_conv, P.Ignore)  # FR-011: nowhere to publish the error
    elsewhere = screen(envelope("me", next={"topic": "/control/agents/x/status", "input": None}))
    assert isinstance(elsewhere, P.Reject) and elsewhere.code == "invalid_input"
    typed = screen(envelope("me", instruction=42))
    assert isinstance(typed, P.Reject) and typed.code == "invalid_input" and "instruction" in typed.message
    # Unknown fields are ignored (FR-008), also inside next; v2 fields are kept.
    extra = envelope("me", surprise={"a": 1}, version="2.0", context={"taskContext": {}}, routing_trace=[],
                     next={"topic": "/control/agents/b/input", "instruction": None, "input": None, "next": None,
                           "hint": 1})
    acc = screen(extra)
    assert isinstance(acc, P.Accept) and acc.envelope.version == "2.0" and acc.envelope.next.topic.endswith("/b/input")
    assert screen(None, raw=b"\xff not json").step == 3


def test_replies_in_both_shapes():
    assert P.decode_reply(b'{"response": "ok", "task_id": "t", "extra": 1}') == P.Reply("t", "ok")
    err = P.decode_reply(b'{"error": {"code": "llm_error", "message": "m"}, "task_id": "t"}')
    assert err == P.ErrorReply("t", "llm_error", "m")
    assert P.decode_reply(b'{"response": {"findings": []}}') == P.Reply(None, '{"findings":[]}')
    with pytest.raises(ValueError):
        P.decode_reply(b'{"status": "x"}')


def test_schema_subset_is_strict():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["n"], "additionalProperties": False}
    check_schema(schema)
    validate(schema, {"n": 2, "tags": ["a"]})
    for bad, where in [({}, "$"), ({"n": 0}, "$.n"), ({"n": True}, "$.n"), ({"n": 1, "tags": [1]}, "$.tags[0]"),
                       ({"n": 1, "x": 1}, "$")]:
        with pytest.raises(ParameterError) as ei:
            validate(schema, bad)
        assert ei.value.path == where
    with pytest.raises(SchemaError, match="oneOf"):
        check_schema({"type": "object", "oneOf": []})  # not enforceable here: refused, not ignored
    with pytest.raises(SchemaError, match="type"):
        check_schema({"type": "decimal"})


# ===================================================================== config

def test_example_config_and_refusals():
    cfg = parse_config(EXAMPLE)
    assert cfg.agent.id == "sec-bandit-2389" and cfg.adapter.tool == "bandit" and cfg.probe is not None
    cases = [
        (EXAMPLE.replace('id = "sec-bandit-2389"', 'id = "bad id"'), "agent.id"),
        (EXAMPLE.replace("[mqtt]\n", "[mqtt]\npassword = \"hunter2\"\n"), "mqtt"),
        (EXAMPLE.replace("keepalive_s = 60", 'password_env = "sk-not-a-name"'), "mqtt.password_env"),
        (EXAMPLE.replace("keepalive_s = 60", 'ca_file = "/x.pem"'), "mqtt.broker_url"),
        (EXAMPLE.replace('allowed_tools = ["review"]', 'allowed_tools = ["shell"]'), "agent.allowed_tools[0]"),
        (EXAMPLE.replace("max_pipeline_depth = 16", "max_pipeline_depth = 17"), "agent.max_pipeline_depth"),
        (EXAMPLE.replace('tool = "bandit"', 'tool = "bandit"\nmodel = "m"'), "adapter"),
        (EXAMPLE + '\n[tools]\nreview = "atp.adapter"\n', "tools.review"),
        ("[agent\n", "$"),
    ]
    for text, key in cases:
        with pytest.raises(ConfigError) as ei:
            parse_config(text)
        assert ei.value.key == key, (key, str(ei.value))
    assert "hunter2" not in str(pytest.raises(ConfigError, parse_config, cases[1][0]).value)
    with pytest.raises(ConfigError, match="unknown tool implementation"):
        AgentRuntime(parse_config(EXAMPLE + '\n[tools]\nx = "no.such.impl"\n'))


def test_cli_check_and_exit_codes(tmp_path, capsys):
    good = tmp_path / "agent.toml"
    good.write_text(EXAMPLE)
    assert cli_main(["--config", str(good), "--check"]) == 0
    assert "sec-bandit-2389" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.replace('id = "sec-bandit-2389"', 'id = "a/b"'))
    assert cli_main(["--config", str(bad)]) == 2
    assert "agent.id" in capsys.readouterr().err


# ===================================================================== lifecycle (§7.1-§7.3)

async def test_available_only_after_suback_tools_and_adapter_check(broker, nursery):
    agent_id = new_id()
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe(P.status_topic(agent_id), retain_as_published=True)
        await mon.subscribe("/conversations/#")
        rt = AgentRuntime(parse_config(config_text(broker.port, agent_id)))
        nursery.start_soon(rt.run)
        with trio.fail_after(10):
            status = await mon.messages.receive()
        # The agent published "available" after subscribing, initialising tools and
        # running the bandit probe, in that order.
        # (the "available" milestone itself is noted once the PUBACK is back)
        assert rt.startup[:4] == ["connected", "subscribed", "tools_initialized", "adapter_verified"]
        body = json.loads(status.payload)
        assert status.retain and status.qos == 1
        assert body["agent_id"] == agent_id and body["status"] == "available"
        assert RFC3339_Z.match(body["timestamp"]) and body["capabilities"] == ["code_review", "security"]
        # The input subscription was in place (SUBACK received) before "available":
        # a task sent the moment it is seen is processed.
        env = envelope(agent_id)
        await send(mon, agent_id, env)
        [(topic, reply)] = await replies(mon, 1)
        assert topic == f"/conversations/{env['conversation_id']}/{agent_id}"
        assert set(reply) == {"response", "task_id"} and reply["task_id"] == env["task_id"]
        report = json.loads(reply["response"])
        [finding] = report["findings"]
        assert (finding["file"], finding["start"], finding["rule"], finding["cwe"]) == ("app.py", 5, "B602", "CWE-78")
        assert report["usage"] == {} or report["usage"].get("usd_micros", 0) == 0
    async with open_mqtt_client(broker.host, broker.port) as late:
        await late.subscribe(P.status_topic(agent_id))
        m = (await late.messages.receive())
        assert m.retain and json.loads(m.payload)["status"] == "available"  # retained for discovery


async def test_failed_adapter_check_never_announces_available(broker):
    agent_id = new_id()
    text = config_text(broker.port, agent_id)
    # A probe bandit must refuse (a path escaping the work directory): the check fails.
    broken_probe = (text[:text.index("[probe]")]
                    + '[probe]\ncontent = { diff = "", files = { "../escape.py" = "x = 1" } }\n')
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe(P.status_topic(agent_id), retain_as_published=True)
        rt = AgentRuntime(parse_config(broken_probe))
        with pytest.raises(StartupError, match="verification"):
            await rt.run()
        assert rt.startup == ["connected", "subscribed", "tools_initialized"]
        await mon.round_trip()
        with trio.move_on_after(0.3):
            m = await mon.messages.receive()
            pytest.fail(f"a status was published: {m}")


async def test_graceful_shutdown_says_unavailable_then_disconnects(broker):
    agent_id = new_id()
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe(P.status_topic(agent_id), retain_as_published=True)
        async with trio.open_nursery() as nursery:
            rt = await start_agent(nursery, broker, agent_id)
            assert json.loads((await mon.messages.receive()).payload)["status"] == "available"
            rt.shutdown()
        with trio.fail_after(5):
            gone = await mon.messages.receive()
        # §7.2 FR-003: retained, so it replaces the retained "available".
        assert json.loads(gone.payload)["status"] == "unavailable" and gone.retain
        assert not rt.client.connected
        await mon.round_trip()
        with trio.move_on_after(0.3):
            m = await mon.messages.receive()
            pytest.fail(f"the LWT fired after a graceful DISCONNECT: {m}")


async def test_lwt_after_sigkill_and_graceful_exit_on_sigterm(broker, tmp_path):
    agent_id = new_id()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(config_text(broker.port, agent_id))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "atp_router.agent2389", "--config", str(cfg)]
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe(P.status_topic(agent_id), retain_as_published=True)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            log_path = tmp_path / f"agent-{sig.name}.log"
            with open(log_path, "wb") as log:  # noqa: ASYNC230 (the child's log file, opened once)
                proc = await trio.lowlevel.open_process(argv, env=env, stdout=log, stderr=log)
            try:
                with trio.fail_after(20):
                    m = await mon.messages.receive()
                assert json.loads(m.payload)["status"] == "available" and m.retain
                proc.send_signal(sig)
                with trio.move_on_after(10) as timer:
                    m = await mon.messages.receive()
                assert not timer.cancelled_caught, f"no status after {sig.name}: {log_path.read_text()[-3000:]}"
                body = json.loads(m.payload)
                assert body["status"] == "unavailable" and body["agent_id"] == agent_id
                assert RFC3339_Z.match(body["timestamp"])
                # Retained either way: the LWT after SIGKILL (§7.3), the agent's own
                # on SIGTERM (§7.2) — a subscriber that comes later still finds it.
                assert m.retain
                async with open_mqtt_client(broker.host, broker.port) as late:
                    await late.subscribe(P.status_topic(agent_id))
                    with trio.fail_after(5):
                        assert json.loads((await late.messages.receive()).payload)["status"] == "unavailable"
                if sig == signal.SIGTERM:
                    with trio.fail_after(10):
                        assert await proc.wait() == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()


# ===================================================================== §7.4 conformance points

async def test_retained_input_is_ignored(broker, nursery):
    agent_id = new_id()
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        # One retained before the agent subscribes, one published retained while it runs.
        await send(mon, agent_id, envelope(agent_id), retain=True)
        rt = await start_agent(nursery, broker, agent_id)
        await send(mon, agent_id, envelope(agent_id), retain=True)
        marker = envelope(agent_id)
        await send(mon, agent_id, marker)
        [(_, reply)] = await replies(mon, 1)
        assert reply["task_id"] == marker["task_id"]
        await quiet(mon, 0.3)
        assert rt.stats.retained_ignored == 2 and rt.stats.processed == 1
        await mon.publish(P.input_topic(agent_id), b"", qos=1, retain=True)  # clear


async def test_duplicate_task_id_is_not_reprocessed(broker, nursery):
    agent_id = new_id()
    rt = await start_agent(nursery, broker, agent_id)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        env = envelope(agent_id)
        await send(mon, agent_id, env)
        await send(mon, agent_id, env)
        other = envelope(agent_id)
        await send(mon, agent_id, other)
        got = await replies(mon, 2)
        assert sorted(r["task_id"] for _, r in got) == sorted([env["task_id"], other["task_id"]])
        await quiet(mon, 0.5)
        assert rt.stats.duplicates == 1 and rt.stats.processed == 2


async def test_17_nested_next_are_refused_and_exactly_16_forward(broker, nursery):
    agent_id, sink = new_id(), new_id()
    rt = await start_agent(nursery, broker, agent_id)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        await mon.subscribe(P.input_topic(sink))
        deep = envelope(agent_id, next=chain(17, sink))
        await send(mon, agent_id, deep)
        [(topic, reply)] = await replies(mon, 1)
        assert topic == f"/conversations/{deep['conversation_id']}/{agent_id}"
        assert reply["task_id"] == deep["task_id"] and reply["error"]["code"] == "pipeline_depth_exceeded"
        assert not LEAKS.search(reply["error"]["message"]) and "16" in reply["error"]["message"]

        ok = envelope(agent_id, next=chain(16, sink))
        ok["next"]["instruction"] = "summarise"
        await send(mon, agent_id, ok)
        with trio.fail_after(10):
            fwd_msg = await mon.messages.receive()
        assert fwd_msg.topic == P.input_topic(sink) and not fwd_msg.retain and fwd_msg.qos == 1
        fwd = json.loads(fwd_msg.payload)
        # The reference's forwarding: a new UUID v4 task_id, the output as a JSON string.
        assert fwd["task_id"] != ok["task_id"] and uuid.UUID(fwd["task_id"]).version == 4
        assert fwd["conversation_id"] == ok["conversation_id"] and fwd["topic"] == P.input_topic(sink)
        assert fwd["instruction"] == "summarise" and P.pipeline_depth(fwd) == 15
        assert json.loads(fwd["input"])["findings"][0]["rule"] == "B602"
        await quiet(mon, 0.3)  # an agent that forwards does not reply on the conversation
        assert rt.stats.forwarded == 1


async def test_topic_mismatch_is_discarded_and_canonical_topics_match(broker, nursery, caplog):
    """A mismatch is discarded without a reply (§7.4 step 3) and logged with both
    topics readable, so it can be diagnosed; only a secret in them is masked."""
    caplog.set_level(logging.INFO, logger="atp_router.agent2389")
    agent_id = new_id()
    token = "tok-" + uuid.uuid4().hex
    register_secrets([token])
    rt = await start_agent(nursery, broker, agent_id)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        await send(mon, agent_id, envelope(agent_id, topic=P.input_topic("someone-else")))
        await send(mon, agent_id, envelope(agent_id, topic=P.input_topic(token)))
        sloppy = envelope(agent_id, topic=f"//control//agents/{agent_id}//input/")
        await send(mon, agent_id, sloppy)
        [(_, reply)] = await replies(mon, 1)
        assert reply["task_id"] == sloppy["task_id"] and "response" in reply
        await quiet(mon, 0.3)
        assert rt.stats.mismatched == 2
    lines = [r.getMessage() for r in caplog.records if "topic mismatch" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "'/control/agents/someone-else/input'" in lines[0]
    assert all(f"received on '/control/agents/{agent_id}/input'" in line for line in lines)
    assert token not in lines[1] and f"'/control/agents/{REDACTED}/input'" in lines[1]


async def test_unknown_fields_are_ignored(broker, nursery):
    agent_id = new_id()
    await start_agent(nursery, broker, agent_id)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        env = envelope(agent_id, priority="high", trace={"id": 1}, version="2.0", routing_trace=None,
                       context={"taskContext": {"taskId": "t-1"}})
        await send(mon, agent_id, env)
        [(_, reply)] = await replies(mon, 1)
        assert json.loads(reply["response"])["findings"][0]["rule"] == "B602"


async def test_message_size_limit(broker, nursery):
    agent_id = new_id()
    rt = await start_agent(nursery, broker, agent_id)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        big = envelope(agent_id, input={"task_type": "code_review",
                                        "content": {"diff": DIFF, "files": {"app.py": AFTER + "#" * 300_000}}})
        await send(mon, agent_id, big)
        [(_, reply)] = await replies(mon, 1)
        assert reply["error"]["code"] == "invalid_input" and "262144" in reply["error"]["message"]
        # The agent goes on with the next task (FR-011).
        ok = envelope(agent_id)
        await send(mon, agent_id, ok)
        [(_, reply)] = await replies(mon, 1)
        assert reply["task_id"] == ok["task_id"] and "response" in reply
        assert rt.stats.errors == 1


async def test_errors_carry_spec_codes_without_internals(broker, nursery):
    agent_id = new_id()
    rt = await start_agent(nursery, broker, agent_id)
    cases = {
        "input is text": ("not an object", "invalid_input"),
        "schema: content missing": ({"task_type": "code_review"}, "invalid_input"),
        "schema: wrong type": ({"content": {"diff": DIFF, "files": {}}, "task_type": 7}, "invalid_input"),
        "tool not on the allow-list": ({"tool": "shell", "parameters": {"cmd": "id"}}, "invalid_input"),
        "adapter refuses the input": ({"content": {"diff": DIFF, "files": {"/etc/passwd.py": "x"}}}, "invalid_input"),
        "adapter refuses a non-diff": ({"content": {"files": {"a.py": "x"}}}, "invalid_input"),
    }
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        sent = {}
        for name, (inp, code) in cases.items():
            env = envelope(agent_id, input=inp)
            sent[env["task_id"]] = (name, code)
            await send(mon, agent_id, env)
        for _, reply in await replies(mon, len(cases)):
            name, code = sent[reply["task_id"]]
            assert set(reply) == {"error", "task_id"}
            assert reply["error"]["code"] == code, name
            assert reply["error"]["message"] and not LEAKS.search(reply["error"]["message"]), (name, reply)
        # After all that, a good task still works.
        ok = envelope(agent_id)
        await send(mon, agent_id, ok)
        [(_, reply)] = await replies(mon, 1)
        assert "response" in reply
    assert rt.stats.errors == len(cases)


async def test_task_timeout_is_tool_execution_failed(broker, nursery):
    agent_id = new_id()
    text = config_text(broker.port, agent_id).replace("task_timeout_s = 60", "task_timeout_s = 0.001")
    rt = AgentRuntime(parse_config(text))
    await nursery.start(rt.run)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        await send(mon, agent_id, envelope(agent_id))
        [(_, reply)] = await replies(mon, 1)
        assert reply["error"] == {"code": "tool_execution_failed", "message": "the task did not finish within 0.001 s"}


async def test_tool_calls_use_the_allow_list_and_schemas(broker, nursery):
    agent_id = new_id()
    lint = '\n[tools]\nlint = { impl = "atp.adapter", config = { tool = "ruff", layer = "L1", p95_ms = 200 } }\n'
    allow_both = config_text(broker.port, agent_id, tail=lint).replace('allowed_tools = ["review"]',
                                                                        'allowed_tools = ["review", "lint"]')
    rt = AgentRuntime(parse_config(allow_both))
    assert rt.tools["lint"].describe()["parameters"]["required"] == ["content"]
    await nursery.start(rt.run)
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        ruff_after = AFTER + "\n\ndef bad():\n    return undefined_name\n"
        ruff_diff = "".join(difflib.unified_diff(BEFORE.splitlines(True), ruff_after.splitlines(True),
                                                 "a/app.py", "b/app.py"))
        call = {"tool": "lint", "parameters": {"content": {"diff": ruff_diff, "files": {"app.py": ruff_after}}}}
        await send(mon, agent_id, envelope(agent_id, input=call))
        [(_, reply)] = await replies(mon, 1)
        rules = {f["rule"] for f in json.loads(reply["response"])["findings"]}
        assert "F821" in rules  # ruff's undefined name, not bandit's
        bad = {"tool": "lint", "parameters": {"content": {}, "stray": 1}}
        await send(mon, agent_id, envelope(agent_id, input=bad))
        [(_, reply)] = await replies(mon, 1)
        assert reply["error"]["code"] == "invalid_input" and "stray" in reply["error"]["message"]
    # The same tool configured but left off the allow-list is refused.
    only_review = AgentRuntime(parse_config(config_text(broker.port, new_id(), tail=lint)))
    assert only_review.allowed == {"review"}


# ===================================================================== security (§11)

async def test_tls_and_credentials_from_the_environment(tmp_path, monkeypatch):
    files = make_test_pki(tmp_path)
    extra = MOSQUITTO_TLS + "allow_anonymous false\npassword_file {dir}/passwd\n"
    with start_mosquitto(extra_config=extra, files={**files, "passwd": b""}) as b:
        b.stop()
        mosquitto_passwd(b.workdir / "passwd", "agent", "pw-from-env-123")
        b.start()
        agent_id = new_id()
        text = config_text(b.port, agent_id, scheme="mqtts", extra_mqtt=(
            f'ca_file = "{tmp_path / "ca.pem"}"\nusername_env = "ATP_T_MQTT_USER"\npassword_env = "ATP_T_MQTT_PW"\n'))
        cfg = parse_config(text)
        with pytest.raises(StartupError, match="ATP_T_MQTT_USER is not set"):
            await AgentRuntime(cfg, env={}).run()
        monkeypatch.setenv("ATP_T_MQTT_USER", "agent")
        monkeypatch.setenv("ATP_T_MQTT_PW", "pw-from-env-123")
        async with trio.open_nursery() as nursery:
            rt = AgentRuntime(cfg)
            await nursery.start(rt.run)
            assert rt.startup[-1] == "available"
            rt.shutdown()
        monkeypatch.setenv("ATP_T_MQTT_PW", "wrong-pw-456")
        with pytest.raises(StartupError) as ei:
            fast = msgspec.structs.replace(cfg, mqtt=msgspec.structs.replace(cfg.mqtt, connect_timeout_s=0.5))
            await AgentRuntime(fast).run()
        assert "wrong-pw" not in str(ei.value)


# ===================================================================== persistence

async def test_tasks_sent_while_the_agent_is_away_are_processed_when_it_returns(broker):
    agent_id = new_id()
    async with open_mqtt_client(broker.host, broker.port) as mon:
        await mon.subscribe("/conversations/#")
        async with trio.open_nursery() as nursery:
            rt = await start_agent(nursery, broker, agent_id)
            rt.shutdown()
        # The agent's session (clean_start = false) keeps its subscription: a task sent
        # now waits in the broker.
        env = envelope(agent_id)
        await send(mon, agent_id, env)
        await quiet(mon, 0.2)
        async with trio.open_nursery() as nursery:
            rt = await start_agent(nursery, broker, agent_id)
            [(_, reply)] = await replies(mon, 1)
            assert reply["task_id"] == env["task_id"] and "response" in reply
            assert rt.client.statistics().session_present
            rt.shutdown()
