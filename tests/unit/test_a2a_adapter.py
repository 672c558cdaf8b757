"""A2A next-hop (atp_router.adapters.a2a) against real A2A servers: jaf-py 2.6 (JAF A2A
v0.3.0) and a2a-sdk 1.3 in its A2A 1.0 and v0.3-compatibility dialects, each in its
own venv (scripts/peers/a2a.sh) and started on a free port (tests/peers.py).

Both peers review for real (see tests/peer_servers/): jaf's agent flags risky
patterns in the numbered diff it is sent, a2a-sdk's compiles the files of the data
part. Markers in the reviewed file (``# atp-test: slow|fail|plain|message``) make
them run long, fail, answer prose or answer a bare Message.

Where no real peer produces a shape on demand — HTTP 5xx/429/408, a read timeout,
agentscope-runtime's Message answer, the JAF document's ``completion`` results, a
peer checking an API key — an ``httpx.MockTransport`` answers with that exact shape,
and each such test names the real shape it reproduces.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import atp
import httpx
import pytest
import trio
from peers import free_port, start_a2a_sdk_server, start_jaf_server

from atp_router.adapters.a2a import (
    A2AAdapter,
    decode_response,
    from_spec,
    map_rpc_error,
    normalize_state,
    report_of,
)
from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.consensus.types import Severity
from atp_router.policy.loader import load_rib_text
from atp_router.policy.rib import AgentSpec, RemoteSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.conftest import start_router

CONTEXT_EXAMPLE = Path(__file__).resolve().parents[3] / "shared" / "specs" / "agent-context-message.example.json"


def review_task(marker: str | None = None) -> dict[str, Any]:
    """A one-file diff adding ``eval`` (line 2) and ``os.system`` (line 3), plus a
    marker line (4) when given."""
    lines = ["import os", "x = eval(input())", "os.system(x)"]
    if marker is not None:
        lines.append(f"y = 1  # atp-test: {marker}")
    diff = f"--- a/app.py\n+++ b/app.py\n@@ -1,2 +1,{len(lines)} @@\n import os\n-x = 1\n"
    diff += "".join(f"+{line}\n" for line in lines[1:])
    return {"diff": diff, "files": {"app.py": "\n".join(lines) + "\n"}}


def prompt(marker: str | None = None, **meta: Any) -> Prompt:
    return Prompt(task_type="code_review", content=review_task(marker), meta=meta,
                  task=TaskMeta(task_type="code_review", agent_context=meta.get("agent_context")))


async def collect(adapter: A2AAdapter, p: Prompt) -> list[Fragment]:
    with trio.fail_after(20):
        return [f async for f in adapter.stream(p)]


def findings_of(frags: list[Fragment]) -> set[tuple[str, int, Severity]]:
    assert frags[-1].type is PayloadType.FINAL
    return {(f.file, f.start, f.severity) for f in frags[-1].content.findings}


async def error_of(adapter: A2AAdapter, p: Prompt) -> AgentError:
    with pytest.raises(AgentError) as info:
        await collect(adapter, p)
    return info.value


@pytest.fixture(scope="module")
def jaf() -> Iterator[str]:
    with start_jaf_server() as base:
        yield base


@pytest.fixture(scope="module")
def sdk() -> Iterator[str]:
    with start_a2a_sdk_server() as base:
        yield base


# ------------------------------------------------------------------ jaf-py (JAF v0.3.0)

JAF_FINDINGS = {("app.py", 2, Severity.HIGH), ("app.py", 3, Severity.HIGH)}


async def test_jaf_card_discovery_and_message_send_task(jaf):
    """jaf-py serves its card at /.well-known/agent-card (no .json) and answers
    message/send with a Task whose artifacts (twice the same text) hold the answer."""
    adapter = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=False, cost_usd_per_call=0.002)
    frags = await collect(adapter, prompt())
    assert adapter.card is not None and adapter.card.card_url == jaf + "/.well-known/agent-card"
    assert adapter.card.name == "jaf-reviewer" and adapter.card.streaming is True
    assert [f.type for f in frags] == [PayloadType.FINAL]
    assert findings_of(frags) == JAF_FINDINGS
    assert frags[-1].content.summary == "pattern review: 2 finding(s)"
    assert frags[-1].usage.usd_micros == 2000 and frags[-1].usage.tokens == 0  # flat: jaf reports no usage
    assert "reviewer-main" in adapter.capabilities().skills
    assert adapter.health().up and adapter.health().error_rate == 0
    await adapter.aclose()


async def test_jaf_message_stream_partials_and_task_status(jaf):
    """message/stream: only data: lines, status-updates submitted → working (with
    progress messages) → artifact-update → completed final; the artifact text is
    the PARTIAL, the status updates are LOG fragments naming the remote task."""
    adapter = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", agent_id="reviewer", cost_usd_per_call=0.001)
    frags = await collect(adapter, prompt())
    assert adapter.card.card_url == jaf + "/a2a/agents/reviewer/card"  # agent_id picks jaf's per-agent card
    logs = [f.content for f in frags if f.type is PayloadType.LOG]
    assert [entry["state"] for entry in logs][:2] == ["submitted", "working"] and logs[-1]["state"] == "completed"
    assert len({entry["task_id"] for entry in logs}) == 1 and logs[0]["task_id"].startswith("task_")
    assert "Executing agent logic" in [entry["text"] for entry in logs]
    partials = [f.content for f in frags if f.type is PayloadType.PARTIAL]
    assert len(partials) == 1 and json.loads(partials[0])["summary"] == "pattern review: 2 finding(s)"
    assert all(f.usage is not None and f.usage.usd_micros == 1000 for f in frags)
    assert findings_of(frags) == JAF_FINDINGS
    await adapter.aclose()


async def test_jaf_plain_text_answer_is_a_summary_without_findings(jaf):
    adapter = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf")
    frags = await collect(adapter, prompt("plain"))
    report = frags[-1].content
    assert report.findings == [] and report.summary.startswith("Looked at the diff: 2 risky line(s)")
    await adapter.aclose()


async def test_jaf_failures_map_to_atp_errors(jaf):
    """A crashing agent: message/send answers JSON-RPC -32603, message/stream a
    failed status-update; an unknown agent path is HTTP 404; all EAGENTDOWN."""
    send = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=False)
    e = await error_of(send, prompt("fail"))
    assert e.code is ErrorCode.EAGENTDOWN and "-32603" in e.reason and e.agent == "jaf"
    stream = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=True)
    e = await error_of(stream, prompt("fail"))
    assert e.code is ErrorCode.EAGENTDOWN and e.reason.startswith("remote task failed: ")
    assert "reviewer crashed on request" in e.reason
    nobody = A2AAdapter("jaf", url=jaf + "/a2a/agents/nobody", dialect="jaf", stream=False)
    e = await error_of(nobody, prompt())
    assert e.code is ErrorCode.EAGENTDOWN and "HTTP 404" in e.reason
    assert not nobody.health().up and send.health().error_rate == 1.0
    for a in (send, stream, nobody):
        await a.aclose()


async def test_jaf_protocol_errors_are_eproto(jaf):
    """jaf-py's real answers to a role it refuses (-32602), an unknown method
    (-32601) and bad JSON (-32700) decode to EPROTO; tasks/get, even for a task
    just finished, is -32001 (jaf keeps no task past its request): EAGENTDOWN."""
    adapter = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=False)
    params = adapter.message_params(prompt())
    params["message"]["role"] = "system"
    async with httpx.AsyncClient() as http:
        answers = [
            await http.post(jaf + "/a2a", json={"jsonrpc": "2.0", "id": "1", "method": "message/send", "params": params}),
            await http.post(jaf + "/a2a", json={"jsonrpc": "2.0", "id": "2", "method": "tasks/list", "params": {}}),
            await http.post(jaf + "/a2a", content=b"{not json"),
        ]
    codes = []
    for answer in answers:
        with pytest.raises(AgentError) as info:
            decode_response(answer.content, "jaf")
        assert info.value.code is ErrorCode.EPROTO
        codes.append(int(info.value.reason.split()[2]))
    assert codes == [-32602, -32601, -32700]
    frags = await collect(adapter, prompt())  # a finished task, made with message/send ...
    streamed = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=True)
    frags = await collect(streamed, prompt())  # ... and one whose id the stream named
    task_id = next(f.content["task_id"] for f in frags if f.type is PayloadType.LOG)
    await streamed.aclose()
    with pytest.raises(AgentError) as info:
        await adapter.get_task(task_id)
    assert info.value.code is ErrorCode.EAGENTDOWN and "-32001" in info.value.reason
    await adapter.aclose()


async def test_jaf_cancel_of_a_running_call_sends_tasks_cancel(jaf, caplog):
    """Cancelling the call (the ATP stream's RST) while jaf works stops it at once
    and sends tasks/cancel for the remote task; jaf answers -32001 (it has no task
    store), which the adapter logs and swallows."""
    caplog.set_level(logging.INFO, logger="atp_router.adapters.a2a")
    adapter = A2AAdapter("jaf", url=jaf + "/a2a", dialect="jaf", stream=True)
    seen: list[Fragment] = []
    t0 = trio.current_time()
    with trio.move_on_after(10) as scope:
        async for frag in adapter.stream(prompt("slow")):
            seen.append(frag)
            if frag.type is PayloadType.LOG and frag.content["state"] == "working":
                scope.cancel()
    assert scope.cancelled_caught and trio.current_time() - t0 < 5  # the agent itself sleeps 30 s
    task_id = seen[0].content["task_id"]
    assert f"tasks/cancel for remote task {task_id} failed" in caplog.text and "-32001" in caplog.text
    await adapter.aclose()


# ------------------------------------------------------------ a2a-sdk (A2A 0.3 and 1.0)

SDK_FINDINGS = {("app.py", 2, Severity.HIGH)}


@pytest.mark.parametrize("dialect", ["0.3", "1.0"])
@pytest.mark.parametrize("streaming", [False, True], ids=["send", "stream"])
async def test_a2a_sdk_send_and_stream(sdk, dialect, streaming):
    """a2a-sdk's card is the 1.0 shape at /.well-known/agent-card.json and advertises
    http://agent.invalid/: the configured URL is used all the same. Findings come
    from a data part (lines arrive as doubles: 2.0), usage from artifact metadata."""
    adapter = A2AAdapter("sdk", url=sdk + "/", dialect=dialect, stream=streaming, cost_usd_per_call=0.001)
    frags = await collect(adapter, prompt())
    assert adapter.card.advertised_urls == ("http://agent.invalid/",)
    assert adapter.card.card_url == sdk + "/.well-known/agent-card.json"
    assert findings_of(frags) == SDK_FINDINGS
    # Text parts: the progress artifact, then the findings artifact's plain summary line.
    assert frags[-1].content.summary == "checked app.py\ncompile review of 1 file(s): 1 finding(s)"
    usage = frags[-1].usage
    assert (usage.in_tokens, usage.usd_micros) == (-(-len(review_task()["files"]["app.py"]) // 4), 1000)
    assert usage.out_tokens > 0
    kinds = [f.type for f in frags]
    if streaming:
        partials = [f.content for f in frags if f.type is PayloadType.PARTIAL]
        assert partials[0] == "checked app.py\n" and partials[1].startswith("compile review of 1 file(s)")
        states = [f.content["state"] for f in frags if f.type is PayloadType.LOG]
        assert states == ["submitted", "working", "completed"]
    else:
        assert kinds == [PayloadType.FINAL]
    await adapter.aclose()


async def test_a2a_sdk_1_0_needs_the_version_header(sdk):
    """Without ``A2A-Version: 1.0`` a2a-sdk refuses 1.0 methods with -32009: EPROTO."""
    adapter = A2AAdapter("sdk", url=sdk + "/", dialect="1.0")
    body = {"jsonrpc": "2.0", "id": "1", "method": "SendMessage", "params": adapter.message_params(prompt())}
    async with httpx.AsyncClient() as http:
        answer = await http.post(sdk + "/", json=body)
    with pytest.raises(AgentError) as info:
        decode_response(answer.content, "1.0")
    assert info.value.code is ErrorCode.EPROTO and "-32009" in info.value.reason


@pytest.mark.parametrize("dialect", ["0.3", "1.0"])
async def test_a2a_sdk_message_result_shape(sdk, dialect):
    """An agent that answers with a single Message (no task), as a2a-sdk allows."""
    for streaming in (False, True):
        adapter = A2AAdapter("sdk", url=sdk + "/", dialect=dialect, stream=streaming)
        frags = await collect(adapter, prompt("message"))
        assert findings_of(frags) == SDK_FINDINGS
        assert frags[-1].content.summary == "compile review of 1 file(s): 1 finding(s)"
        await adapter.aclose()


@pytest.mark.parametrize("dialect", ["0.3", "1.0"])
async def test_a2a_sdk_failed_task(sdk, dialect):
    adapter = A2AAdapter("sdk", url=sdk + "/", dialect=dialect, stream=dialect == "1.0")
    e = await error_of(adapter, prompt("fail"))
    assert e.code is ErrorCode.EAGENTDOWN and e.reason == "remote task failed: reviewer failed: # atp-test: fail"


@pytest.mark.parametrize("dialect", ["0.3", "1.0"])
async def test_a2a_sdk_cancel_stops_the_remote_task(sdk, dialect):
    """The call is cancelled mid-stream: the adapter sends tasks/cancel (CancelTask)
    and a2a-sdk's task ends ``canceled``; cancelling it again is -32002: EPROTO."""
    adapter = A2AAdapter("sdk", url=sdk + "/", dialect=dialect)
    task_id = None
    with trio.move_on_after(10) as scope:
        async for frag in adapter.stream(prompt("slow")):
            if frag.type is PayloadType.LOG:
                task_id = frag.content["task_id"]
            if frag.type is PayloadType.PARTIAL:
                scope.cancel()
    assert scope.cancelled_caught and task_id is not None
    snap = await adapter.get_task(task_id)
    assert snap.state == "canceled" and snap.text.startswith("checked step 0")
    with pytest.raises(AgentError) as info:
        await adapter.cancel_task(task_id)
    assert info.value.code is ErrorCode.EPROTO and "-32002" in info.value.reason
    await adapter.aclose()


async def test_agent_context_travels_unchanged(sdk):
    """prompt.meta["agent_context"] arrives as message.metadata.agent_context: the
    peer's summary names the SHA-256 of the canonical JSON it received."""
    ctx = json.loads(CONTEXT_EXAMPLE.read_text())
    digest = hashlib.sha256(json.dumps(ctx, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    for dialect in ("0.3", "1.0"):
        adapter = A2AAdapter("sdk", url=sdk + "/", dialect=dialect, stream=dialect == "1.0")
        assert adapter.message_params(prompt(), ctx)["message"]["metadata"] == {"agent_context": ctx}
        frags = await collect(adapter, prompt(agent_context=ctx))
        assert frags[-1].content.summary.endswith(f"agent_context sha256={digest}")
        assert findings_of(frags) == SDK_FINDINGS
        await adapter.aclose()


@pytest.mark.parametrize("pad", [0, 280], ids=["whole", "cut"])
async def test_agent_context_secrets_never_reach_errors(pad):
    """A peer that echoes the request's securityContext in its error (jaf-py's -32602
    shape; no real peer echoes on demand): the token is masked in the AgentError,
    also when the quote is shortened right inside it."""
    ctx = json.loads(CONTEXT_EXAMPLE.read_text())
    token = ctx["agentContext"]["securityContext"]["authenticationInfo"]["token"]

    def echo(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(404)
        body = json.loads(request.content)
        sec = body["params"]["message"]["metadata"]["agent_context"]["agentContext"]["securityContext"]
        return httpx.Response(200, json={"jsonrpc": "2.0", "id": body["id"], "error": {
            "code": -32602, "message": "x" * pad + f"bad authenticationInfo {sec['authenticationInfo']}"}})

    adapter = A2AAdapter("echo", url="http://peer.test/a2a", dialect="jaf", transport=httpx.MockTransport(echo))
    e = await error_of(adapter, prompt(agent_context=ctx))
    assert e.code is ErrorCode.EPROTO and token[:12] not in str(e) and "-32602" in e.reason
    assert pad or "[REDACTED]" in e.reason


# ------------------------------------------------- result shapes without a real peer here


def scripted(answers: dict[str, Callable[[dict[str, Any]], Any]], card: dict[str, Any] | None = None,
             seen: list[httpx.Request] | None = None) -> httpx.MockTransport:
    """A JSON-RPC peer: ``answers`` maps a method to a function of the request body
    returning the ``result`` (or an ``httpx.Response``); GET serves ``card`` or 404."""

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        if request.method == "GET":
            return httpx.Response(200, json=card) if card is not None else httpx.Response(404)
        body = json.loads(request.content)
        out = answers[body["method"]](body)
        if isinstance(out, httpx.Response):
            return out
        return httpx.Response(200, json={"jsonrpc": "2.0", "id": body["id"], "result": out})

    return httpx.MockTransport(handler)


AGENTSCOPE_ANSWER = json.dumps({"findings": [{"file": "app.py", "line": 3, "severity": "high",
                                              "claim": "shell command", "confidence": 0.7}]})


async def test_agentscope_message_shape():
    """agentscope-runtime's /a2a (a2a-sdk 0.3.x under it) answers message/send with
    a bare Message — ``{"kind": "message", "messageId", "role": "agent", "parts":
    [{"kind": "text", "text"}]}``, no taskId or contextId — and its card advertises
    an address it does not listen on (here http://0.0.0.0:8080/a2a)."""
    card = {"name": "agentscope", "url": "http://0.0.0.0:8080/a2a", "protocolVersion": "0.3.0",
            "capabilities": {"streaming": False}, "skills": []}
    message = {"kind": "message", "messageId": "msg_1", "role": "agent",
               "parts": [{"kind": "text", "text": AGENTSCOPE_ANSWER}]}
    seen: list[httpx.Request] = []
    adapter = A2AAdapter("as", url="http://127.0.0.1:9/a2a", cost_usd_per_call=0.01,
                         transport=scripted({"message/send": lambda b: message}, card, seen))
    frags = await collect(adapter, prompt())
    assert findings_of(frags) == {("app.py", 3, Severity.HIGH)}
    assert frags[-1].usage.usd_micros == 10_000
    assert [str(r.url) for r in seen] == ["http://127.0.0.1:9/.well-known/agent-card.json", "http://127.0.0.1:9/a2a"]
    sent = json.loads(seen[1].content)
    assert sent["method"] == "message/send" and sent["params"]["message"]["role"] == "user"
    assert [p["kind"] for p in sent["params"]["message"]["parts"]] == ["text", "data"]
    assert "Review this diff" in sent["params"]["message"]["parts"][0]["text"]


async def test_jaf_spec_completion_shapes():
    """The JAF v0.3.0 document's own results: message/send → ``{"kind":
    "completion", "message", "final": true}``; message/stream → status-update,
    partial-completion, completion (with ``event:`` lines); tasks/cancel →
    ``{"id", "cancelled": true}``."""
    text = AGENTSCOPE_ANSWER
    completion = {"kind": "completion", "taskId": "t1", "contextId": "c1", "final": True,
                  "message": {"role": "agent", "kind": "message", "messageId": "m", "contextId": "c1",
                              "parts": [{"kind": "text", "text": text}]}}
    partial = {**completion, "kind": "partial-completion", "final": False,
               "message": {**completion["message"], "parts": [{"kind": "text", "text": text[:20]}]}}
    status = {"kind": "status-update", "taskId": "t1", "status": {"state": "working"}, "final": False}

    def stream(body: dict[str, Any]) -> httpx.Response:
        events = [("status-update", status), ("partial-completion", partial), ("completion", completion)]
        sse = "".join(f"event: {name}\ndata: {json.dumps({'jsonrpc': '2.0', 'id': body['id'], 'result': r})}\n\n"
                      for name, r in events)
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    transport = scripted({"message/send": lambda b: completion, "message/stream": stream,
                          "tasks/cancel": lambda b: {"id": b["params"]["id"], "cancelled": True}})
    for streaming in (False, True):
        adapter = A2AAdapter("jafspec", url="http://peer.test/a2a", dialect="jaf", stream=streaming,
                             transport=transport)
        frags = await collect(adapter, prompt())
        assert findings_of(frags) == {("app.py", 3, Severity.HIGH)}
        if streaming:
            assert [f.content for f in frags if f.type is PayloadType.PARTIAL] == [text[:20]]
    assert (await adapter.cancel_task("t1")).state == "canceled"


async def test_non_final_task_is_polled_with_tasks_get():
    """message/send may return a Task still ``working`` (A2A 1.0 ``returnImmediately``
    peers): the adapter polls GetTask until it is terminal."""
    polls = []

    def get(body: dict[str, Any]) -> Any:
        polls.append(body["params"]["id"])
        state = "TASK_STATE_COMPLETED" if len(polls) == 2 else "TASK_STATE_WORKING"
        arts = [{"artifactId": "a", "parts": [{"text": AGENTSCOPE_ANSWER}]}] if len(polls) == 2 else []
        return {"id": "t9", "status": {"state": state}, "artifacts": arts}

    transport = scripted({"SendMessage": lambda b: {"task": {"id": "t9", "status": {"state": "TASK_STATE_SUBMITTED"}}},
                          "GetTask": get})
    adapter = A2AAdapter("poll", url="http://peer.test/", dialect="1.0", poll_ms=1, transport=transport)
    frags = await collect(adapter, prompt())
    assert polls == ["t9", "t9"] and findings_of(frags) == {("app.py", 3, Severity.HIGH)}


async def test_input_required_is_eproto_and_the_task_is_cancelled():
    cancelled = []
    transport = scripted({
        "message/send": lambda b: {"kind": "task", "id": "t2", "status": {
            "state": "input-required", "message": {"role": "agent", "parts": [{"kind": "text", "text": "which repo?"}]}}},
        "tasks/cancel": lambda b: cancelled.append(b["params"]["id"]) or {"kind": "task", "id": "t2",
                                                                          "status": {"state": "canceled"}},
    })
    adapter = A2AAdapter("ask", url="http://peer.test/a2a", stream=False, transport=transport)
    e = await error_of(adapter, prompt())
    assert e.code is ErrorCode.EPROTO and e.reason.endswith("which repo?") and cancelled == ["t2"]


@pytest.mark.parametrize(
    ("response", "code", "retry_after_ms"),
    [
        (httpx.Response(503, text="overloaded"), ErrorCode.EAGENTDOWN, 1000),
        (httpx.Response(502, headers={"Retry-After": "3"}), ErrorCode.EAGENTDOWN, 3000),
        (httpx.Response(429, headers={"retry-after-ms": "250"}), ErrorCode.EAGENTDOWN, 250),
        (httpx.Response(404), ErrorCode.EAGENTDOWN, None),
        (httpx.Response(401), ErrorCode.ESEC, None),
        (httpx.Response(403), ErrorCode.ESEC, None),
        (httpx.Response(408), ErrorCode.ETIMEOUT, None),
        (httpx.Response(400, text="bad"), ErrorCode.EPROTO, None),
        (httpx.Response(200, text="<html>"), ErrorCode.EPROTO, None),
        (httpx.Response(200, json={"jsonrpc": "2.0", "id": None}), ErrorCode.EPROTO, None),
        (httpx.Response(200, json={"jsonrpc": "2.0", "id": "other", "result": {}}), ErrorCode.EPROTO, None),
    ],
)
async def test_http_answers_map_to_atp_errors(response, code, retry_after_ms):
    """The HTTP-level answers of a proxy or a sick server in front of an agent."""
    adapter = A2AAdapter("h", url="http://peer.test/a2a", stream=False,
                         transport=scripted({"message/send": lambda b: response}))
    e = await error_of(adapter, prompt())
    assert e.code is code and e.retry_after_ms == retry_after_ms


async def test_timeouts_and_refused_connections():
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    adapter = A2AAdapter("t", url="http://peer.test/a2a", timeout_ms=50, transport=httpx.MockTransport(slow))
    e = await error_of(adapter, prompt())
    assert e.code is ErrorCode.ETIMEOUT
    closed = A2AAdapter("down", url=f"http://127.0.0.1:{free_port()}/a2a")  # a real refused connection
    e = await error_of(closed, prompt())
    assert e.code is ErrorCode.EAGENTDOWN and e.retry_after_ms == 1000 and not closed.health().up
    await closed.aclose()


@pytest.mark.parametrize(
    ("dialect", "rpc_code", "atp_code"),
    [
        ("0.3", -32700, ErrorCode.EPROTO), ("0.3", -32600, ErrorCode.EPROTO), ("0.3", -32601, ErrorCode.EPROTO),
        ("0.3", -32602, ErrorCode.EPROTO), ("0.3", -32603, ErrorCode.EAGENTDOWN),
        ("0.3", -32001, ErrorCode.EAGENTDOWN), ("0.3", -32002, ErrorCode.EPROTO), ("0.3", -32004, ErrorCode.EPROTO),
        ("0.3", -32006, ErrorCode.EAGENTDOWN), ("1.0", -32009, ErrorCode.EPROTO), ("1.0", -32008, ErrorCode.EPROTO),
        ("jaf", -32000, ErrorCode.EAGENTDOWN), ("jaf", -32001, ErrorCode.EAGENTDOWN),
        ("jaf", -32005, ErrorCode.EPROTO), ("jaf", -32099, ErrorCode.EAGENTDOWN),
    ],
)
def test_rpc_error_table(dialect, rpc_code, atp_code):
    e = map_rpc_error({"code": rpc_code, "message": "m"}, dialect)
    assert e.code is atp_code and str(rpc_code) in e.reason


def test_states_and_report_shapes():
    assert [normalize_state(s) for s in ("TASK_STATE_INPUT_REQUIRED", "cancelled", "working", None)] == [
        "input-required", "canceled", "working", ""]
    content = review_task()
    # Another ATP router behind A2A: only its merged findings (span "start-end") count.
    final = {"result": {"findings": [{"id": "F-1", "file": "app.py", "span": "2-3", "severity": "high",
                                      "claim": "eval then shell", "confidence": 0.9, "provenance": ["a#1"]}],
                        "consensus": {"strategy": "union", "agreement": 1.0}},
             "telemetry": {"tokens": 0, "usd": 0.0, "latency_ms": 1.0}}
    per_agent = {"agent": "a", "report": {"findings": [{"file": "app.py", "start": 2, "end": 2,
                                                        "severity": "low", "claim": "x"}]}}
    report = report_of([("data", per_agent), ("text", "1 finding(s)"), ("data", final)], content)
    assert [(f.start, f.end, f.severity) for f in report.findings] == [(2, 3, Severity.HIGH)]
    assert report.summary == "1 finding(s)"
    assert report_of([("text", "nothing to say")], content).summary == "nothing to say"


async def test_auth_headers_read_from_env_at_call_time(monkeypatch):
    """Bearer and API-key credentials come from the named variable at each call
    (rotation needs no reload); a missing variable is EAGENTDOWN before any request.
    Reproduces jaf's card schemes (bearerAuth, apiKey in X-API-Key)."""
    seen: list[httpx.Request] = []
    answer = {"kind": "message", "messageId": "m", "role": "agent", "parts": [{"kind": "text", "text": "ok"}]}
    bearer = A2AAdapter("b", url="http://peer.test/a2a", auth_env="PEER_TOKEN", stream=False,
                        transport=scripted({"message/send": lambda b: answer}, seen=seen))
    key = A2AAdapter("k", url="http://peer.test/a2a", auth_env="PEER_KEY", auth="api_key", header="X-Agent-Key",
                     dialect="1.0", stream=False, transport=scripted({"SendMessage": lambda b: {"message": {
                         "messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "ok"}]}}}, seen=seen))
    monkeypatch.delenv("PEER_TOKEN", raising=False)
    e = await error_of(bearer, prompt())
    assert e.code is ErrorCode.EAGENTDOWN and "PEER_TOKEN" in e.reason and seen == []
    monkeypatch.setenv("PEER_TOKEN", "t-1")
    await collect(bearer, prompt())
    monkeypatch.setenv("PEER_TOKEN", "t-2")
    await collect(bearer, prompt())
    monkeypatch.setenv("PEER_KEY", "k-1")
    await collect(key, prompt())
    posts = [r for r in seen if r.method == "POST"]
    assert [r.headers.get("authorization") for r in posts] == ["Bearer t-1", "Bearer t-2", None]
    assert posts[2].headers["x-agent-key"] == "k-1" and posts[2].headers["a2a-version"] == "1.0"
    assert "a2a-version" not in posts[0].headers


# ------------------------------------------------------------ through a real router


async def test_router_fans_out_to_a2a_agents(nursery, tmp_path, jaf, sdk):
    """A RIB with ruff and two remote A2A agents (jaf-py over its dialect, a2a-sdk
    over 1.0): one code-review stream reaches all three, and the FINAL's merged
    findings carry the A2A agents' provenance; their flat prices are the spend."""
    rib = tmp_path / "rib.yaml"
    rib.write_text(f"""
agents:
  lint.ruff: {{layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}}
  remote.jaf:
    layer: L3
    p95_ms: 2000
    remote: {{protocol: a2a, url: "{jaf}/a2a", version: jaf, cost_usd_per_call: 0.001}}
  remote.sdk:
    layer: L3
    p95_ms: 2000
    remote: {{protocol: a2a, url: "{sdk}/", version: "1.0", cost_usd_per_call: 0.002}}
policies:
  - match: {{task_type: code_review}}
    fanout: [lint.ruff, remote.jaf, remote.sdk]
    budget: {{usd: 0.05}}
""")
    env = await start_router(nursery, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=review_task())
        with trio.fail_after(30):
            final = await c.result(st)
    provenance = {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]}
    assert provenance == {"lint.ruff", "remote.jaf", "remote.sdk"}
    eval_line = next(f for f in final["result"]["findings"] if f["span"] == "2-2")
    assert {p.split("#")[0] for p in eval_line["provenance"]} == {"lint.ruff", "remote.jaf", "remote.sdk"}
    assert final["telemetry"]["usd"] == pytest.approx(0.003)


# ------------------------------------------------------------------------ registry


def test_from_spec_and_the_registry():
    rib = load_rib_text("""
agents:
  remote.jaf:
    layer: L3
    p95_ms: 2000
    timeout_ms: 30000
    strengths: [code_review]
    remote: {protocol: a2a, url: "http://127.0.0.1:8000/a2a", version: jaf, agent_id: reviewer,
             auth_env: JAF_TOKEN, cost_usd_per_call: 0.003, options: {stream: false}}
policies:
  - match: {task_type: code_review}
    fanout: [remote.jaf]
""", file="rib.yaml")
    adapter = build_adapter("remote.jaf", rib.agents["remote.jaf"])
    assert isinstance(adapter, A2AAdapter)
    assert (adapter.dialect, adapter.agent_id, adapter.auth_env, adapter.flat_micros, adapter.force_stream,
            adapter.timeout_ms) == ("jaf", "reviewer", "JAF_TOKEN", 3000, False, 30000)
    assert adapter.estimate(prompt()).usd == 0.003

    def spec(**remote: Any) -> AgentSpec:
        return AgentSpec(layer="L3", p95_ms=1, remote=RemoteSpec(protocol="a2a", **remote))

    assert from_spec("a", spec(url="http://h/")).dialect == "0.3"
    bad = [
        ({"url": "http://h/", "version": "2.0"}, "remote.version"),
        ({"url": "ftp://h/"}, "remote.url"),
        ({"url": "http://h/", "options": {"verbose": True}}, "options.verbose"),
        ({"url": "http://h/", "options": {"stream": "yes"}}, "options.stream"),
        ({"url": "http://h/", "options": {"poll_ms": True}}, "options.poll_ms"),
        ({"url": "http://h/", "options": {"auth": "basic"}}, "options.auth"),
        ({"url": "http://h/", "options": {"header": "X-Key"}}, "options.header"),
        ({"url": "http://h/", "options": {"card_path": "card.json"}}, "options.card_path"),
    ]
    for remote, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            from_spec("a", spec(**remote))
