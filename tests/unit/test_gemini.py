"""Gemini next-hop (``streamGenerateContent?alt=sse``) against a replay of Google's wire.

No Gemini endpoint can be reached here, so the peer is a real HTTP/1.1 server on a
loopback socket that replays the shapes the Gemini API documents, event by event
(``transfer-encoding: chunked``, one SSE event per chunk):

* ``models.streamGenerateContent`` with ``alt=sse``: ``text/event-stream`` of
  ``data: <GenerateContentResponse>`` events — ``candidates[].content.parts[].text``
  (``"thought": true`` parts for thinking models), ``finishReason`` on the last
  candidate, ``usageMetadata`` (``promptTokenCount``, ``candidatesTokenCount``,
  ``thoughtsTokenCount``, ``totalTokenCount``), ``modelVersion``;
  ``promptFeedback.blockReason`` for a blocked prompt;
* errors (Google API error model, AIP-193): ``{"error": {"code", "message",
  "status", "details": [...]}}`` with ``google.rpc.RetryInfo`` (``retryDelay``
  "37s") on 429 ``RESOURCE_EXHAUSTED``, ``google.rpc.ErrorInfo`` reason
  ``API_KEY_INVALID`` on 400 ``INVALID_ARGUMENT``, 504 ``DEADLINE_EXCEEDED``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.gemini import GeminiAdapter
from atp_router.adapters.http import RetryPolicy
from atp_router.adapters.openai_compat import CONTEXT_PROMPT, SYSTEM_PROMPT
from atp_router.adapters.registry import build_adapter
from atp_router.consensus.types import Severity, Usage
from atp_router.policy.rib import AgentSpec, ModelSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.replay_server import Replay, serve

EXAMPLE = json.loads(Path("/work/shared/specs/agent-context-message.example.json").read_text())
AFTER = "def load(path):\n    return eval(open(path).read())\n"
DIFF = """\
diff --git a/cfg.py b/cfg.py
--- a/cfg.py
+++ b/cfg.py
@@ -1,2 +1,2 @@
 def load(path):
-    return json.load(open(path))
+    return eval(open(path).read())
"""
REVIEW = Prompt(task_type="code_review", content={"diff": DIFF, "files": {"cfg.py": AFTER}})
ANSWER = json.dumps({"findings": [{"file": "cfg.py", "line": 2, "severity": "critical",
                                   "claim": "eval on file contents executes arbitrary code", "confidence": 0.95}]})  # fmt: skip
SSE = {"content-type": "text/event-stream"}
JSON = {"content-type": "application/json; charset=UTF-8"}


def event(text: str | None = None, *, finish: str | None = None, usage: dict[str, int] | None = None,
          thought: str | None = None) -> bytes:  # fmt: skip
    parts = []
    if thought is not None:
        parts.append({"text": thought, "thought": True})
    if text is not None:
        parts.append({"text": text})
    cand: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
    if finish is not None:
        cand["finishReason"] = finish
    obj: dict[str, Any] = {"candidates": [cand], "modelVersion": "gemini-2.5-flash", "responseId": "r1"}
    if usage is not None:
        obj["usageMetadata"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def error(code: int, status: str, message: str, *details: dict[str, Any]) -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "status": status, "details": list(details)}}).encode()


RETRY_INFO = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}
KEY_INVALID = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
               "domain": "googleapis.com", "metadata": {"service": "generativelanguage.googleapis.com"}}  # fmt: skip


@pytest.fixture
async def peer(nursery: trio.Nursery) -> Replay:
    return await serve(nursery, Replay(path="/v1beta"))


@pytest.fixture(autouse=True)
def no_ambient_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("GOOGLE_API_KEY", "GEMINI_API_KEY", "ATP_GEMINI_KEY"):
        monkeypatch.delenv(env, raising=False)


def adapter(peer: Replay, **kw: Any) -> GeminiAdapter:
    args: dict[str, Any] = {
        "base_url": peer.url, "model": "gemini-2.5-flash", "api_key": "k-test", "cost_in_per_mtok": 0.3,
        "cost_out_per_mtok": 2.5, "max_out_tokens": 512, "ctx_tokens": 8192, "timeout_ms": 2000,
        "retry": RetryPolicy(retries=2, base_ms=20, jitter=False),
    }  # fmt: skip
    args.update(kw)
    return GeminiAdapter("gemini", **args)


async def collect(a: GeminiAdapter, prompt: Prompt = REVIEW) -> list[Fragment]:
    return [f async for f in a.stream(prompt)]


def header(head: str, name: str) -> str | None:
    m = re.search(rf"(?im)^{name}: (.*?)\r?$", head)
    return m[1] if m else None


async def test_stream_request_shape_partials_thoughts_and_usage(peer: Replay) -> None:
    usage = {"promptTokenCount": 211, "candidatesTokenCount": 58, "thoughtsTokenCount": 40, "totalTokenCount": 309}
    peer.add(200, SSE, [
        event(thought="Looking at eval...", usage={"promptTokenCount": 211, "totalTokenCount": 211}),
        event(ANSWER[:40]),
        event(ANSWER[40:], finish="STOP", usage=usage),
    ])  # fmt: skip
    a = adapter(peer, json_mode=True, temperature=0.2)
    frags = await collect(a)
    await a.aclose()
    head, body = peer.requests[0]
    assert head.startswith("POST /v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse HTTP/1.1")
    assert header(head, "x-goog-api-key") == "k-test" and header(head, "authorization") is None
    assert body["systemInstruction"] == {"parts": [{"text": SYSTEM_PROMPT}]}
    assert body["contents"][0]["role"] == "user" and "    2 +     return eval" in body["contents"][0]["parts"][0]["text"]
    assert body["generationConfig"] == {"maxOutputTokens": 512, "temperature": 0.2,
                                        "responseMimeType": "application/json"}  # fmt: skip
    assert [f.type for f in frags] == [PayloadType.PARTIAL] * 2 + [PayloadType.FINAL]
    assert "".join(f.content for f in frags[:-1]) == ANSWER  # the thought part is not answer text
    final = frags[-1]
    assert final.usage == Usage(211, 98, math.ceil(211 * 0.3 + 98 * 2.5))  # thoughts billed as output
    [finding] = final.content.findings
    assert (finding.file, finding.start, finding.severity) == ("cfg.py", 2, Severity.CRITICAL)


async def test_key_from_the_environment_by_precedence(peer: Replay, monkeypatch: pytest.MonkeyPatch) -> None:
    a = adapter(peer, api_key=None)
    with pytest.raises(AgentError) as e:
        await collect(a)
    assert e.value.code is ErrorCode.EAGENTDOWN and "GOOGLE_API_KEY or GEMINI_API_KEY" in e.value.reason
    assert not peer.requests
    for _ in range(3):
        peer.add(200, SSE, [event('{"findings": []}', finish="STOP")])
    monkeypatch.setenv("GEMINI_API_KEY", "from-gemini")
    await collect(a)
    monkeypatch.setenv("GOOGLE_API_KEY", "from-google")
    await collect(a)
    named = adapter(peer, api_key=None, api_key_env="ATP_GEMINI_KEY")
    monkeypatch.setenv("ATP_GEMINI_KEY", "from-named")
    await collect(named)
    await a.aclose()
    await named.aclose()
    assert [header(h, "x-goog-api-key") for h, _ in peer.requests] == ["from-gemini", "from-google", "from-named"]


async def test_429_retry_info_is_honoured_then_success(peer: Replay) -> None:
    short = {**RETRY_INFO, "retryDelay": "0.3s"}
    peer.add(429, JSON, [error(429, "RESOURCE_EXHAUSTED", "Quota exceeded for metric", short)])
    peer.add(503, JSON, [error(503, "UNAVAILABLE", "The model is overloaded. Please try again later.")])
    peer.add(200, SSE, [event('{"findings": []}', finish="STOP")])
    a = adapter(peer)
    [*_, final] = await collect(a)
    await a.aclose()
    assert final.type is PayloadType.FINAL and len(peer.requests) == 3
    assert peer.times[1] - peer.times[0] >= 0.3  # retryDelay, not the 20 ms backoff


@pytest.mark.parametrize(
    "status, body, code, retry_ms, tries, text",
    [
        (429, error(429, "RESOURCE_EXHAUSTED", "Quota exceeded", RETRY_INFO), ErrorCode.EAGENTDOWN, 37_000, 1,
         "RESOURCE_EXHAUSTED: Quota exceeded"),
        (400, error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.", KEY_INVALID),
         ErrorCode.EAGENTDOWN, None, 1, "API key not valid"),
        (400, error(400, "INVALID_ARGUMENT", "Request contains an invalid argument."), ErrorCode.EPROTO, None, 1,
         "INVALID_ARGUMENT"),
        (400, error(400, "FAILED_PRECONDITION", "User location is not supported for the API use."),
         ErrorCode.EAGENTDOWN, None, 1, "location"),
        (404, error(404, "NOT_FOUND", "models/gemini-9 is not found for API version v1beta"), ErrorCode.EAGENTDOWN,
         None, 1, "NOT_FOUND"),
        (504, error(504, "DEADLINE_EXCEEDED", "The request timed out. Please try again."), ErrorCode.ETIMEOUT, None, 3,
         "DEADLINE_EXCEEDED"),
        (500, b"<html>Server Error</html>", ErrorCode.EAGENTDOWN, None, 3, "Server Error"),
    ],
    ids=["429-long-retry-info", "bad-key", "bad-argument", "precondition", "404", "504-after-retries", "500-html"],
)
async def test_error_answers_map_to_spec_codes(
    peer: Replay, status: int, body: bytes, code: ErrorCode, retry_ms: int | None, tries: int, text: str
) -> None:
    for _ in range(tries):
        peer.add(status, JSON, [body])
    a = adapter(peer)
    with pytest.raises(AgentError) as e:
        await collect(a)
    await a.aclose()
    assert (e.value.code, e.value.retry_after_ms, e.value.agent) == (code, retry_ms, "gemini")
    assert text in e.value.reason and len(peer.requests) == tries


@pytest.mark.parametrize(
    "chunks, code, text",
    [
        ([event("partial"), b"data: " + error(500, "INTERNAL", "An internal error has occurred.") + b"\r\n\r\n"],
         ErrorCode.EAGENTDOWN, "INTERNAL"),
        ([event("I can't", finish="SAFETY")], ErrorCode.EPROTO, "finishReason SAFETY"),
        ([b'data: {"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}}\r\n\r\n'], ErrorCode.EPROTO,
         "PROHIBITED_CONTENT"),
        ([event("half an answer")], ErrorCode.EPROTO, "without a finishReason"),
        ([b"data: {oops\r\n\r\n"], ErrorCode.EPROTO, "bad JSON"),
    ],
    ids=["error-in-stream", "safety", "prompt-blocked", "no-finish", "bad-json"],
)
async def test_stream_faults(peer: Replay, chunks: list[bytes], code: ErrorCode, text: str) -> None:
    peer.add(200, SSE, chunks)
    a = adapter(peer)
    with pytest.raises(AgentError) as e:
        await collect(a)
    await a.aclose()
    assert e.value.code is code and text in e.value.reason and len(peer.requests) == 1


async def test_not_sse_is_eproto(peer: Replay) -> None:
    peer.add(200, JSON, [b'[{"candidates": []}]'])  # alt=sse dropped by a proxy: a JSON array
    a = adapter(peer)
    with pytest.raises(AgentError, match="not an SSE stream") as e:
        await collect(a)
    await a.aclose()
    assert e.value.code is ErrorCode.EPROTO


async def test_agent_context_in_system_instruction_without_security(peer: Replay) -> None:
    peer.add(200, SSE, [event('{"findings": []}', finish="STOP")])
    a = adapter(peer, context_in_prompt=True)
    await collect(a, Prompt(task_type="code_review", content=REVIEW.content, meta={"agent_context": EXAMPLE},
                            task=TaskMeta(task_type="code_review", agent_context=EXAMPLE)))
    await a.aclose()
    system = peer.requests[0][1]["systemInstruction"]["parts"][0]["text"]
    shown = json.loads(system.removeprefix(SYSTEM_PROMPT + CONTEXT_PROMPT))
    assert "securityContext" not in shown["agentContext"] and shown["agentContext"]["policyContext"] == (
        EXAMPLE["agentContext"]["policyContext"]
    )
    assert "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9" not in json.dumps(peer.requests[0][1])


def test_registry_builds_the_gemini_adapter() -> None:
    agent = AgentSpec(layer="L3", p95_ms=1200, model="gemini-pro", options={"context_in_prompt": True})
    model = msgspec.convert({"provider": "google", "ctx": "1M", "cost_in": 1.25, "cost_out": 10,
                             "model": "models/gemini-2.5-pro", "api_key_env": "ATP_GEMINI_KEY"}, ModelSpec)  # fmt: skip
    a = build_adapter("reviewer.gemini", agent, model)
    assert isinstance(a, GeminiAdapter)
    assert (a.base_url, a.model, a.ctx_tokens, a.cost_out_per_mtok, a.context_in_prompt, a.retry.retries) == (
        "https://generativelanguage.googleapis.com/v1beta", "gemini-2.5-pro", 1024 * 1024, 10, True, 2
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"options\.stream: unknown option for provider google"):
        build_adapter("x", AgentSpec(layer="L3", p95_ms=1, model="g", options={"stream": True}), model)
