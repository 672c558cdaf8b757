"""Agent API protocol next-hop against a real agentscope-runtime server.

The peer is agentscope-runtime 1.1's own ``AgentApp`` (``POST /process``, SSE;
``/a2a``; agent card) with the deterministic review Runner of
``tests/peer_servers/agentscope_server.py``, started by ``tests/peers.py``.

Event sequences the real server never produces (numbering that does not start
at 0, a second terminal event, a status going backwards, completed text that
disagrees with its deltas, ``rejected``/``canceled`` runs, HTTP 429/503 before the
stream) are driven through the sans-IO :class:`AgentApiDecoder` directly, or, for
the HTTP layer, through a loopback socket server replaying agentscope's observed
wire shape (``text/event-stream`` with ``data:`` lines, see ../shared/PEERS.md)
with that one fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import atp
import httpx
import msgspec
import pytest
import trio
from peers import (  # tests/peers.py (on sys.path via conftest)
    free_port,
    start_agentscope_server,
)

from atp_router.adapters.agent_api import (
    DEFAULT_RETRY,
    AgentApiAdapter,
    AgentApiDecoder,
    TextDelta,
    from_spec,
)
from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.http import RetryPolicy
from atp_router.adapters.registry import build_adapter
from atp_router.consensus.types import AgentReport, Severity, Usage
from atp_router.policy.rib import AgentSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.conftest import start_router
from tests.replay_server import Replay, serve

EXAMPLE = json.loads(Path("/work/shared/specs/agent-context-message.example.json").read_text())
AFTER = "import os\n\n\ndef run(cmd, seen=[]):\n    seen.append(cmd)\n    return os.system(cmd)\n"
DIFF = """\
diff --git a/tool/run.py b/tool/run.py
--- a/tool/run.py
+++ b/tool/run.py
@@ -1,5 +1,6 @@
 import os
 
 
-def run(cmd):
-    return subprocess.run(cmd.split(), check=True)
+def run(cmd, seen=[]):
+    seen.append(cmd)
+    return os.system(cmd)
"""
REVIEW = Prompt(task_type="code_review", content={"diff": DIFF, "files": {"tool/run.py": AFTER}})


def crash_prompt(meta: dict[str, Any] | None = None) -> Prompt:
    files = {"tool/run.py": AFTER.replace("os.system(cmd)", "os.system(cmd)  # atp-test: crash")}
    return Prompt(task_type="code_review", content={"diff": DIFF, "files": files}, meta=meta or {},
                  task=TaskMeta(task_type="code_review", agent_context=(meta or {}).get("agent_context")))


async def collect(adapter: AgentApiAdapter, prompt: Prompt = REVIEW) -> list[Fragment]:
    return [f async for f in adapter.stream(prompt)]


@pytest.fixture(scope="module")
def agentscope() -> Iterator[str]:
    with start_agentscope_server() as base:
        yield base


# --- the real agentscope-runtime server ---------------------------------------------------


async def test_wire_shape_of_the_real_peer(agentscope: str) -> None:
    """What PEERS.md says to assert, on agentscope's raw answer; the decoder accepts it."""
    body = AgentApiAdapter("as", url=agentscope).request(REVIEW)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(agentscope + "/process", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    terminal = [e for e in events if e["object"] == "response" and e["status"] in ("completed", "failed")]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    joined: dict[tuple[str, int], str] = {}
    for e in events:
        if e["object"] == "content" and e.get("delta") is True:
            key = (e["msg_id"], e["index"])
            joined[key] = joined.get(key, "") + e["text"]
    completed = {
        (m["id"], c["index"]): c["text"]
        for m in terminal[0]["output"]
        for c in m["content"]
        if c["type"] == "text"
    }
    assert joined == completed and len(joined) == 1
    decoder = AgentApiDecoder()
    deltas = [d for e in events for d in decoder.receive(e)]
    answer = decoder.finish()
    assert "".join(d.text for d in deltas) == answer.text == next(iter(completed.values()))
    assert answer.usage == (terminal[0]["usage"]["input_tokens"], terminal[0]["usage"]["output_tokens"])


async def test_review_streams_partials_then_a_report_priced_by_usage(agentscope: str) -> None:
    adapter = AgentApiAdapter("as", url=agentscope, cost_in=2.5, cost_out=10.0)
    frags = await collect(adapter)
    await adapter.aclose()
    partials, final = frags[:-1], frags[-1]
    assert len(partials) > 3 and all(f.type is PayloadType.PARTIAL for f in partials)
    assert final.type is PayloadType.FINAL
    text = "".join(f.content for f in partials)
    assert json.loads(text)["findings"]  # the joined deltas are the agent's whole JSON answer
    report: AgentReport = final.content
    assert [(f.file, f.start, f.severity) for f in report.findings] == [
        ("tool/run.py", 4, Severity.MEDIUM),  # mutable default argument
        ("tool/run.py", 6, Severity.HIGH),  # os.system
    ]
    # Usage is what agentscope reported on the terminal response (chars/4 of its input and output).
    assert final.usage.out_tokens == math.ceil(len(text) / 4)
    assert final.usage.usd_micros == math.ceil(final.usage.in_tokens * 2.5 + final.usage.out_tokens * 10)
    assert partials[0].usage.in_tokens == adapter.estimate(REVIEW).in_tokens  # estimated until reported
    assert adapter.health().error_rate == 0.0


async def test_flat_price_per_call_and_agent_context_unchanged(agentscope: str) -> None:
    adapter = AgentApiAdapter("as", url=agentscope, cost_usd_per_call=0.0042)
    prompt = Prompt(task_type="code_review", content=REVIEW.content, meta={"agent_context": EXAMPLE},
                    task=TaskMeta(task_type="code_review", agent_context=EXAMPLE))
    est = adapter.estimate(prompt)
    [*partials, final] = await collect(adapter, prompt)
    await adapter.aclose()
    assert est.usd == 0.0042 and final.usage.usd_micros == 4200
    assert all(f.usage.usd_micros == 4200 for f in partials)  # owed from the first byte
    # The server hashes the context message it received: byte-for-byte the one sent.
    digest = hashlib.sha256(json.dumps(EXAMPLE, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert f"agent_context sha256:{digest}" in final.content.summary
    system = adapter.request(prompt)["input"][0]
    assert system == {"role": "system", "type": "message", "content": [{"type": "data", "data": EXAMPLE}]}


async def test_in_band_failure_is_mapped_and_never_echoes_the_secret(agentscope: str) -> None:
    token = "tok-" + "7" * 24
    ctx = json.loads(json.dumps(EXAMPLE))
    ctx["agentContext"]["securityContext"]["authenticationInfo"]["token"] = token
    adapter = AgentApiAdapter("as", url=agentscope)
    got: list[Fragment] = []
    with pytest.raises(AgentError) as e:
        async for f in adapter.stream(crash_prompt({"agent_context": ctx})):
            got.append(f)
    await adapter.aclose()
    # agentscope put the token into its error message; the ATP error carries none of it.
    assert e.value.code is ErrorCode.EAGENTDOWN and e.value.agent == "as"
    assert "AGENT_UNKNOWN_ERROR" in e.value.reason and "[REDACTED]" in e.value.reason
    assert token not in str(e.value) and token not in e.value.reason and token not in repr(e.value)
    assert [f.type for f in got] == [PayloadType.PARTIAL] and got[0].usage.tokens > 0
    assert adapter.health().error_rate == 1.0 and not adapter.health().up


async def test_in_band_refusal_is_eproto(agentscope: str) -> None:
    adapter = AgentApiAdapter("as", url=agentscope, model="gpt-9")
    with pytest.raises(AgentError) as e:
        await collect(adapter)
    await adapter.aclose()
    assert e.value.code is ErrorCode.EPROTO and "unknown model 'gpt-9'" in e.value.reason


async def test_unreachable_agent_is_agentdown() -> None:
    adapter = AgentApiAdapter("as", url=f"http://127.0.0.1:{free_port()}", retry=RetryPolicy(retries=0))
    with pytest.raises(AgentError) as e:
        await collect(adapter)
    assert e.value.code is ErrorCode.EAGENTDOWN and not adapter.health().up


async def test_agentscope_a2a_endpoint_through_the_a2a_adapter(agentscope: str) -> None:
    """agentscope's built-in /a2a answers message/send with a Message, and its card
    advertises a URL it does not listen on: the A2A adapter must use the configured one."""
    a2a = pytest.importorskip("atp_router.adapters.a2a")
    async with httpx.AsyncClient(timeout=10) as client:
        card = (await client.get(agentscope + "/.well-known/agent-card.json")).json()
    assert card["url"] != agentscope + "/a2a"
    agent = msgspec.convert(
        {"layer": "L2", "p95_ms": 1000, "remote": {"protocol": "a2a", "url": agentscope + "/a2a", "version": "0.3"}},
        AgentSpec,
    )
    adapter = a2a.from_spec("as.a2a", agent)
    frags = await collect(adapter)
    await adapter.aclose()
    final = frags[-1]
    assert final.type is PayloadType.FINAL
    assert [(f.file, f.start) for f in final.content.findings] == [("tool/run.py", 4), ("tool/run.py", 6)]


# --- the decoder on sequences the real peer never sends ------------------------------------


def resp(seq: int | None, status: str, **kw: Any) -> dict[str, Any]:
    e = {"object": "response", "id": "response_1", "status": status, **kw}
    if seq is not None:
        e["sequence_number"] = seq
    return e


def delta(seq: int | None, text: str, msg_id: str = "msg_1", index: int = 0) -> dict[str, Any]:
    e = {"object": "content", "type": "text", "status": "in_progress", "delta": True, "index": index,
         "msg_id": msg_id, "text": text}  # fmt: skip
    if seq is not None:
        e["sequence_number"] = seq
    return e


def message(seq: int | None, status: str, text: str | None = None, *, msg_type: str = "message",
            msg_id: str = "msg_1") -> dict[str, Any]:  # fmt: skip
    e: dict[str, Any] = {"object": "message", "id": msg_id, "type": msg_type, "role": "assistant", "status": status}
    if text is not None:
        e["content"] = [{"object": "content", "type": "text", "index": 0, "delta": None, "msg_id": msg_id,
                         "status": "completed", "text": text}]  # fmt: skip
    if seq is not None:
        e["sequence_number"] = seq
    return e


def run(events: list[dict[str, Any]]) -> tuple[list[TextDelta], Any]:
    d = AgentApiDecoder()
    out = [x for e in events for x in d.receive(e)]
    return out, d.finish()


GOOD = [resp(0, "created"), resp(1, "in_progress"), delta(2, "Hel"), delta(3, "lo"),
        message(4, "completed", "Hello"), resp(5, "completed", usage={"prompt_tokens": 7, "completion_tokens": 2})]  # fmt: skip


def test_decoder_joins_deltas_and_reads_usage() -> None:
    deltas, answer = run(GOOD)
    assert [d.text for d in deltas] == ["Hel", "lo"] and answer.text == "Hello" and answer.usage == (7, 2)


def test_decoder_spec_text_shape_without_numbers_or_deltas() -> None:
    """The spec's own example: no sequence_number; a content completed without deltas."""
    events = [
        {"id": "response_123", "object": "response", "status": "created"},
        {"id": "msg_abc", "object": "message", "type": "message", "status": "created"},
        {"status": "completed", "type": "text", "index": 0, "delta": False, "text": "This image shows...",
         "object": "content", "msg_id": "msg_abc"},
        {"id": "msg_abc", "status": "completed", "object": "message"},
        {"id": "response_123", "status": "completed", "object": "response"},
    ]  # fmt: skip
    deltas, answer = run(events)
    assert [d.text for d in deltas] == ["This image shows..."] and answer.text == "This image shows..."
    assert answer.usage is None


def test_decoder_keeps_reasoning_out_of_the_answer_and_orders_slots() -> None:
    events = [
        resp(0, "created"),
        message(1, "in_progress", msg_type="reasoning", msg_id="msg_r"),
        delta(2, "thinking", msg_id="msg_r"),
        delta(3, "B", index=1),
        delta(4, "A", index=0),
        resp(5, "completed"),
    ]
    deltas, answer = run(events)
    assert [d.text for d in deltas] == ["B", "A"] and answer.text == "A\nB"


@pytest.mark.parametrize(
    "events, fault",
    [
        ([resp(1, "created")], "starts at 1, not 0"),
        ([resp(0, "created"), resp(2, "in_progress"), resp(2, "in_progress")], "2 after 2"),
        ([resp(0, "created"), resp(None, "in_progress")], "lacks a sequence_number"),
        ([resp(None, "created"), resp(1, "in_progress")], "has a sequence_number"),
        ([resp(0, "created"), resp(1, "in_progress"), resp(2, "created")], "status created after in_progress"),
        ([*GOOD, resp(6, "completed")], "after the terminal response"),
        ([resp(0, "created"), delta(1, "Hel"), message(2, "completed", "Help")], "other text|differs"),
        ([resp(0, "created"), message(1, "completed", "x"), delta(2, "late")], "after it ended"),
        ([resp(0, "created"), resp(1, "in_progress", id="response_2")], "a second response id"),
        ([resp(0, "created"), {"object": "content", "delta": True, "text": "x", "sequence_number": 1}], "msg_id"),
        ([resp(0, "created"), resp(1, "paused")], "unknown status"),
        (["not an object"], "not a JSON object"),
    ],
    ids=[
        "seq-start", "seq-repeat", "seq-dropped", "seq-appears", "status-back", "two-terminals", "delta-mismatch",
        "content-after-message", "two-responses", "no-msg-id", "unknown-status", "not-object",
    ],
)
def test_decoder_protocol_faults_are_eproto(events: list[Any], fault: str) -> None:
    with pytest.raises(AgentError) as e:
        run(events)
    assert e.value.code is ErrorCode.EPROTO and re.search(fault, e.value.reason)


def test_decoder_needs_a_terminal_response() -> None:
    with pytest.raises(AgentError, match="without a terminal response") as e:
        run(GOOD[:-1])
    assert e.value.code is ErrorCode.EPROTO


@pytest.mark.parametrize(
    "terminal, code, text",
    [
        (resp(2, "failed", error={"code": "AGENT_UNKNOWN_ERROR", "message": "boom"}), ErrorCode.EAGENTDOWN, "boom"),
        (resp(2, "failed", error={"code": "MODEL_TIMEOUT", "message": "slow"}), ErrorCode.ETIMEOUT, "MODEL_TIMEOUT"),
        (resp(2, "failed", error={"code": "PARAMETER_VALIDATION", "message": "n"}), ErrorCode.EPROTO, "PARAMETER"),
        (resp(2, "failed", error={"code": "TOKEN_EXPIRED", "message": "re-login"}), ErrorCode.ESEC, "TOKEN_EXPIRED"),
        (resp(2, "rejected", error={"code": "POLICY", "message": "no"}), ErrorCode.ESEC, "rejected"),
        (resp(2, "canceled"), ErrorCode.EAGENTDOWN, "canceled"),
        ({"error": "1 validation error for AgentRequest"}, ErrorCode.EAGENTDOWN, "validation error"),
    ],
    ids=["unknown", "timeout", "validation", "auth", "rejected", "canceled", "bare-error-mid-stream"],
)
def test_decoder_in_band_errors(terminal: dict[str, Any], code: ErrorCode, text: str) -> None:
    with pytest.raises(AgentError) as e:
        run([resp(0, "created"), resp(1, "in_progress"), terminal])
    assert e.value.code is code and text in e.value.reason


def test_decoder_bare_error_first_is_a_refused_request() -> None:
    with pytest.raises(AgentError) as e:
        run([{"error": "Input should be a valid list"}])
    assert e.value.code is ErrorCode.EPROTO


# --- HTTP layer: retries and answers that are not SSE (loopback replay) --------------------


def sse_body(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)


@pytest.fixture
async def replay(nursery: trio.Nursery) -> Replay:
    """Replays agentscope's wire shape: each answer one ``content-length`` body."""
    return await serve(nursery, Replay(chunked=False))


async def test_503_is_retried_with_backoff_then_succeeds(replay: Replay) -> None:
    replay.add(503, {"retry-after": "0.3"}, [b"busy"])
    replay.add(200, {"content-type": "text/event-stream"}, [sse_body(GOOD)])
    adapter = AgentApiAdapter("r", url=f"http://127.0.0.1:{replay.port}",
                              retry=RetryPolicy(retries=2, base_ms=10, jitter=False))  # fmt: skip
    [*_, final] = await collect(adapter)
    await adapter.aclose()
    assert len(replay.requests) == 2 and replay.times[1] - replay.times[0] >= 0.3  # Retry-After honoured
    assert final.usage == Usage(7, 2, 0)


async def test_long_retry_after_is_passed_up_not_slept(replay: Replay) -> None:
    replay.add(429, {"retry-after": "30"}, [b'{"detail":"slow down"}'])
    adapter = AgentApiAdapter("r", url=f"http://127.0.0.1:{replay.port}")
    with trio.fail_after(5):
        with pytest.raises(AgentError) as e:
            await collect(adapter)
    await adapter.aclose()
    assert (e.value.code, e.value.retry_after_ms, len(replay.requests)) == (ErrorCode.EAGENTDOWN, 30_000, 1)


async def test_500_is_not_retried_and_json_answers_are_events(replay: Replay) -> None:
    replay.add(500, {}, [b"run crashed"])
    adapter = AgentApiAdapter(
        "r", url=f"http://127.0.0.1:{replay.port}", retry=RetryPolicy(base_ms=1, statuses=DEFAULT_RETRY.statuses)
    )
    with pytest.raises(AgentError) as e:
        await collect(adapter)
    assert e.value.code is ErrorCode.EAGENTDOWN and len(replay.requests) == 1  # the run may have happened
    # A non-streamed answer (one JSON AgentResponse) is decoded as a single event.
    done = resp(None, "completed", output=[message(None, "completed", '{"findings": []}')])
    replay.add(200, {"content-type": "application/json"}, [json.dumps(done).encode()])
    [final] = await collect(adapter)
    await adapter.aclose()
    assert final.type is PayloadType.FINAL and final.content == AgentReport()


# --- RIB → adapter ------------------------------------------------------------------------


def agent(remote: dict[str, Any], **kw: Any) -> AgentSpec:
    return msgspec.convert({"layer": "L2", "p95_ms": 800, "remote": {"protocol": "agent_api", **remote}, **kw},
                           AgentSpec)  # fmt: skip


def test_registry_builds_the_agent_api_adapter() -> None:
    a = build_adapter("review.as", agent({"url": "http://127.0.0.1:8090/", "auth_env": "AS_TOKEN",
                                           "cost_usd_per_call": 0.01, "options": {"model": "ast-review",
                                           "cost_in": 1, "retries": 0}}, timeout_ms=9000, strengths=["code_review"]))  # fmt: skip
    assert isinstance(a, AgentApiAdapter)
    assert (a.url, a.endpoint, a.auth_env, a.model, a.cost_in, a.timeout_ms, a.retry.retries) == (
        "http://127.0.0.1:8090", "/process", "AS_TOKEN", "ast-review", 1, 9000, 0
    )  # fmt: skip
    assert a.retry.statuses == DEFAULT_RETRY.statuses and a.capabilities().skills == ["code_review"]
    with pytest.raises(ValueError, match=r"remote\.options\.temperature: unknown option for agent_api"):
        from_spec("x", agent({"url": "http://h", "options": {"temperature": 1}}))
    with pytest.raises(ValueError, match=r"remote\.options\.retries: expected int"):
        from_spec("x", agent({"url": "http://h", "options": {"retries": True}}))
    with pytest.raises(ValueError, match=r"remote\.url: expected an http\(s\) URL"):
        from_spec("x", agent({"url": "mqtt://h"}))
    with pytest.raises(ValueError, match=r"remote\.version: not used"):
        from_spec("x", agent({"url": "http://h", "version": "2"}))


async def test_missing_credential_variable_is_agentdown(monkeypatch: pytest.MonkeyPatch, replay: Replay) -> None:
    monkeypatch.delenv("ATP_AS_TOKEN", raising=False)
    adapter = AgentApiAdapter("r", url=f"http://127.0.0.1:{replay.port}", auth_env="ATP_AS_TOKEN")
    with pytest.raises(AgentError) as e:
        await collect(adapter)
    assert e.value.code is ErrorCode.EAGENTDOWN and "ATP_AS_TOKEN" in e.value.reason and not replay.requests


# --- through the router ---------------------------------------------------------------------


async def test_agent_api_next_hop_through_the_router(nursery: trio.Nursery, tmp_path: Path, agentscope: str) -> None:
    rib = tmp_path / "rib.yaml"
    rib.write_text(json.dumps({
        "agents": {"review.as": {"layer": "L2", "p95_ms": 2000, "timeout_ms": 30_000, "strengths": ["code_review"],
                                 "remote": {"protocol": "agent_api", "url": agentscope, "cost_usd_per_call": 0.002}}},
        "policies": [{"match": {"task_type": "code_review"}, "fanout": ["review.as"],
                      "budget": {"usd": 0.01, "tokens": 100_000}}],
    }))  # fmt: skip
    env = await start_router(nursery, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=REVIEW.content)
        with trio.fail_after(60):
            events = [ev async for ev in c.events(st)]
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"], [ev.payload for ev in events if ev.type == "ERROR"]
    deltas = [ev.payload["delta"] for ev in events if ev.type == "PARTIAL" and "delta" in ev.payload]
    assert len(deltas) > 3 and json.loads("".join(deltas))["findings"]
    final = events[-2].payload
    assert {(f["file"], f["span"]) for f in final["result"]["findings"]} == {("tool/run.py", "4-4"), ("tool/run.py", "6-6")}
    assert all(p.startswith("review.as#") for f in final["result"]["findings"] for p in f["provenance"])
    assert final["telemetry"]["usd"] == 0.002
