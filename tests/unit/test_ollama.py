"""Ollama native next-hop (``/api/chat`` NDJSON) against a replay of Ollama's wire.

No Ollama server can run here (no model weights to pull), so the peer is a real
HTTP/1.1 server on a loopback socket that replays the shapes Ollama documents,
chunk by chunk (``transfer-encoding: chunked``, one NDJSON line per chunk):

* ``docs/api.md`` "Generate a chat completion", streaming: lines
  ``{"model","created_at","message":{"role":"assistant","content":"…"},"done":false}``
  then a final ``"done":true`` line with ``done_reason``, durations,
  ``prompt_eval_count`` and ``eval_count``; content type ``application/x-ndjson``;
* ``docs/api/errors.mdx``: HTTP errors as ``application/json`` ``{"error": "…"}``
  (400, 404, 429, 500, 502), and an error after the stream started as one more
  NDJSON line ``{"error":"an error was encountered while running the model"}``
  with the status still 200.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.http import RetryPolicy, retry_after_ms
from atp_router.adapters.ollama import OllamaAdapter
from atp_router.adapters.openai_compat import CONTEXT_PROMPT, SYSTEM_PROMPT
from atp_router.adapters.registry import build_adapter
from atp_router.consensus.types import AgentFinding, AgentReport, Severity, Usage
from atp_router.policy.rib import AgentSpec, ModelSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.replay_server import Replay, serve

EXAMPLE = json.loads(Path("/work/shared/specs/agent-context-message.example.json").read_text())
AFTER = "import os\n\n\ndef run(cmd):\n    return os.system(cmd)\n"
DIFF = """\
diff --git a/tool/run.py b/tool/run.py
--- a/tool/run.py
+++ b/tool/run.py
@@ -2,4 +2,4 @@ import os
 
 
 def run(cmd):
-    return subprocess.run(cmd.split(), check=True)
+    return os.system(cmd)
"""
REVIEW = Prompt(task_type="code_review", content={"diff": DIFF, "files": {"tool/run.py": AFTER}})
ANSWER = json.dumps({"findings": [{"file": "tool/run.py", "line": 5, "severity": "high",
                                   "claim": "os.system runs a shell on its argument", "confidence": 0.9}]})  # fmt: skip
NDJSON = {"content-type": "application/x-ndjson"}
JSON = {"content-type": "application/json; charset=utf-8"}


def line(content: str) -> bytes:
    return json.dumps({"model": "qwen2.5:7b", "created_at": "2023-08-04T08:52:19.385406455-07:00",
                       "message": {"role": "assistant", "content": content}, "done": False}).encode() + b"\n"  # fmt: skip


def done(prompt_eval_count: int | None = 26, eval_count: int = 282) -> bytes:
    obj: dict[str, Any] = {
        "model": "qwen2.5:7b", "created_at": "2023-08-04T19:22:45.499127Z",
        "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop",
        "total_duration": 4883583458, "load_duration": 1334875, "prompt_eval_duration": 342546000,
        "eval_count": eval_count, "eval_duration": 4535599000,
    }  # fmt: skip
    if prompt_eval_count is not None:
        obj["prompt_eval_count"] = prompt_eval_count
    return json.dumps(obj).encode() + b"\n"


@pytest.fixture
async def peer(nursery: trio.Nursery) -> Replay:
    return await serve(nursery, Replay())


def adapter(peer: Replay, **kw: Any) -> OllamaAdapter:
    args: dict[str, Any] = {
        "base_url": peer.url, "model": "qwen2.5:7b", "cost_in_per_mtok": 0.2, "cost_out_per_mtok": 0.8,
        "max_out_tokens": 256, "ctx_tokens": 4096, "timeout_ms": 2000,
        "retry": RetryPolicy(retries=2, base_ms=20, jitter=False),
    }  # fmt: skip
    args.update(kw)
    return OllamaAdapter("ollama", **args)


async def collect(a: OllamaAdapter, prompt: Prompt = REVIEW) -> list[Fragment]:
    return [f async for f in a.stream(prompt)]


async def test_chat_stream_request_shape_partials_and_usage(peer: Replay) -> None:
    peer.add(200, NDJSON, [line(ANSWER[:30]), line(ANSWER[30:70]), line(ANSWER[70:]), done()])
    a = adapter(peer, json_mode=True, temperature=0.1)
    frags = await collect(a)
    await a.aclose()
    head, body = peer.requests[0]
    assert head.startswith("POST /api/chat HTTP/1.1") and "authorization" not in head.lower()
    assert body["model"] == "qwen2.5:7b" and body["stream"] is True and body["format"] == "json"
    assert body["options"] == {"num_predict": 256, "num_ctx": 4096, "temperature": 0.1}
    assert [m["role"] for m in body["messages"]] == ["system", "user"] and body["messages"][0]["content"] == SYSTEM_PROMPT
    assert "    5 +     return os.system(cmd)" in body["messages"][1]["content"]
    assert [f.type for f in frags] == [PayloadType.PARTIAL] * 3 + [PayloadType.FINAL]
    assert "".join(f.content for f in frags[:-1]) == ANSWER
    assert frags[0].usage.in_tokens == a.estimate(REVIEW).in_tokens  # estimated until the done line
    final = frags[-1]
    assert final.usage == Usage(26, 282, math.ceil(26 * 0.2 + 282 * 0.8))
    assert final.content == AgentReport(findings=[AgentFinding(
        file="tool/run.py", start=5, end=5, severity=Severity.HIGH, claim="os.system runs a shell on its argument",
        confidence=0.9, ref="1")])  # fmt: skip
    assert a.health().error_rate == 0.0


async def test_cached_prompt_without_prompt_eval_count_keeps_the_estimate(peer: Replay) -> None:
    peer.add(200, NDJSON, [line('{"findings": []}'), done(prompt_eval_count=None, eval_count=5)])
    a = adapter(peer)
    [_, final] = await collect(a)
    await a.aclose()
    assert final.usage.in_tokens == a.estimate(REVIEW).in_tokens and final.usage.out_tokens == 5


async def test_error_line_mid_stream_is_agentdown(peer: Replay) -> None:
    peer.add(200, NDJSON, [line("Yes"), line("."), b'{"error":"an error was encountered while running the model"}\n'])
    a = adapter(peer)
    got: list[Fragment] = []
    with pytest.raises(AgentError) as e:
        async for f in a.stream(REVIEW):
            got.append(f)
    await a.aclose()
    assert e.value.code is ErrorCode.EAGENTDOWN and "an error was encountered while running the model" in e.value.reason
    assert [f.type for f in got] == [PayloadType.PARTIAL] * 2 and got[-1].usage.tokens > 0
    assert len(peer.requests) == 1  # never retried once the stream started


@pytest.mark.parametrize(
    "status, body, headers, code, retry_ms, text",
    [
        (404, b'{"error":"model \'qwen2.5:7b\' not found"}', {}, ErrorCode.EAGENTDOWN, None, "not found"),
        (400, b'{"error":"invalid character \'}\' looking for beginning of value"}', {}, ErrorCode.EPROTO, None,
         "invalid character"),
        (429, b'{"error":"too many requests"}', {"retry-after": "60"}, ErrorCode.EAGENTDOWN, 60_000, "too many"),
        (502, b'{"error":"cloud model unreachable"}', {}, ErrorCode.EAGENTDOWN, None, "unreachable"),
    ],
    ids=["404", "400", "429-long-retry-after", "502-after-retries"],
)
async def test_http_errors_map_to_spec_codes(
    peer: Replay, status: int, body: bytes, headers: dict[str, str], code: ErrorCode, retry_ms: int | None, text: str
) -> None:
    for _ in range(3):
        peer.add(status, {**JSON, **headers}, [body])
    a = adapter(peer)
    with pytest.raises(AgentError) as e:
        await collect(a)
    await a.aclose()
    assert (e.value.code, e.value.retry_after_ms, e.value.agent) == (code, retry_ms, "ollama")
    assert text in e.value.reason and "{" not in e.value.reason.split(": ", 1)[1]  # the error string, not the body
    # 5xx is retried (2 retries), 4xx never; a Retry-After past the cap is passed up, not slept.
    assert len(peer.requests) == (3 if status == 502 else 1)


async def test_429_then_success_honours_retry_after(peer: Replay) -> None:
    peer.add(429, {**JSON, "retry-after": "0.25"}, [b'{"error":"rate limited"}'])
    peer.add(500, JSON, [b'{"error":"the model failed to generate a response"}'])
    peer.add(200, NDJSON, [line('{"findings": []}'), done()])
    a = adapter(peer)
    [_, final] = await collect(a)
    await a.aclose()
    assert len(peer.requests) == 3 and final.type is PayloadType.FINAL
    assert peer.times[1] - peer.times[0] >= 0.25  # Retry-After, not the 20 ms backoff
    assert peer.times[2] - peer.times[1] >= 0.04  # second backoff step: 20 ms * 2


@pytest.mark.parametrize(
    "headers, chunks, text",
    [
        (NDJSON, [line("half an answer")], "without a done: true line"),
        (NDJSON, [b"{not json\n"], "bad JSON line"),
        (NDJSON, [b"[1, 2]\n"], "not a JSON object"),
        ({"content-type": "text/html"}, [b"<html>proxy login</html>"], "not an NDJSON stream"),
    ],
    ids=["no-done", "bad-json", "not-object", "html"],
)
async def test_malformed_streams_are_eproto(peer: Replay, headers: dict[str, str], chunks: list[bytes],
                                            text: str) -> None:  # fmt: skip
    peer.add(200, headers, chunks)
    a = adapter(peer)
    with pytest.raises(AgentError, match=text) as e:
        await collect(a)
    await a.aclose()
    assert e.value.code is ErrorCode.EPROTO


async def test_stalled_stream_is_etimeout(peer: Replay) -> None:
    peer.add(200, NDJSON, [line("thinking")], stall=True)
    a = adapter(peer, timeout_ms=300)
    with pytest.raises(AgentError) as e:
        await collect(a)
    await a.aclose()
    assert e.value.code is ErrorCode.ETIMEOUT and a.health().up


async def test_agent_context_goes_into_the_system_prompt_only_when_asked(peer: Replay) -> None:
    meta = {"agent_context": EXAMPLE}
    prompt = Prompt(task_type="code_review", content=REVIEW.content, meta=meta,
                    task=TaskMeta(task_type="code_review", agent_context=EXAMPLE))
    for _ in range(2):
        peer.add(200, NDJSON, [line('{"findings": []}'), done()])
    plain, with_ctx = adapter(peer), adapter(peer, context_in_prompt=True)
    await collect(plain, prompt)
    await collect(with_ctx, prompt)
    await plain.aclose()
    await with_ctx.aclose()
    assert peer.requests[0][1]["messages"][0]["content"] == SYSTEM_PROMPT
    system = peer.requests[1][1]["messages"][0]["content"]
    assert system.startswith(SYSTEM_PROMPT + CONTEXT_PROMPT)
    shown = json.loads(system[len(SYSTEM_PROMPT + CONTEXT_PROMPT):])
    expected = {k: v for k, v in EXAMPLE["agentContext"].items() if k != "securityContext"}
    assert shown == {"agentContext": expected}
    token = EXAMPLE["agentContext"]["securityContext"]["authenticationInfo"]["token"]
    assert all(token not in json.dumps(body) for _, body in peer.requests)
    # The estimate counts the longer prompt.
    assert with_ctx.estimate(prompt).in_tokens > plain.estimate(prompt).in_tokens


async def test_invalid_agent_context_is_eproto_without_a_request(peer: Replay) -> None:
    bad = {"agentContext": {"securityContex": {"authenticationInfo": {"token": "s3cr3t-value"}}}}
    a = adapter(peer)
    with pytest.raises(AgentError) as e:
        await collect(a, Prompt(task_type="code_review", content=REVIEW.content, meta={"agent_context": bad},
                                task=TaskMeta(task_type="code_review", agent_context=bad)))
    assert e.value.code is ErrorCode.EPROTO and "securityContex" in e.value.reason and not peer.requests
    assert "s3cr3t-value" not in str(e.value)


def test_registry_builds_the_native_ollama_adapter() -> None:
    def build(model: dict[str, Any], **options: Any) -> Any:
        agent = AgentSpec(layer="L2", p95_ms=900, model="m", timeout_ms=30_000, options=options)
        return build_adapter("local", agent, msgspec.convert({"provider": "ollama", "ctx": "32k", "cost": 0, **model},
                                                             ModelSpec))  # fmt: skip

    a = build({"model": "qwen2.5:7b"}, json_mode=True, context_in_prompt=True, retries=1)
    assert isinstance(a, OllamaAdapter)
    assert (a.base_url, a.model, a.ctx_tokens, a.json_mode, a.context_in_prompt, a.retry.retries) == (
        "http://127.0.0.1:11434", "qwen2.5:7b", 32768, True, True, 1
    )  # fmt: skip
    # A RIB written for Ollama's OpenAI-compatible root keeps working natively.
    assert build({"base_url": "http://gpu-box:11434/v1"}).base_url == "http://gpu-box:11434"
    with pytest.raises(ValueError, match=r"options\.temperature: unknown option for provider ollama"):
        build({}, temperature=1)
    with pytest.raises(ValueError, match=r"options\.retries: must be >= 0"):
        build({}, retries=-1)
    # The OpenAI-compatible route to an Ollama server stays available as provider openai_compat.
    compat = build_adapter(
        "local", AgentSpec(layer="L2", p95_ms=900, model="m"),
        ModelSpec(provider="openai_compat", ctx="32k", cost=0, base_url="http://127.0.0.1:11434/v1"),
    )  # fmt: skip
    assert type(compat).__name__ == "OpenAICompatAdapter" and compat.base_url == "http://127.0.0.1:11434/v1"


# --- the shared retry arithmetic (atp_router.adapters.http) ------------------------------------------


def test_retry_policy_backoff_jitter_cap_and_retry_after() -> None:
    p = RetryPolicy(retries=3, base_ms=100, cap_ms=1000, jitter=False)
    assert [p.delay_ms(n, None) for n in range(4)] == [100, 200, 400, None]  # exponential, then exhausted
    assert p.delay_ms(0, 750) == 750 and p.delay_ms(2, 50) == 400  # never sooner than Retry-After
    assert p.delay_ms(0, 1001) is None  # a longer wait is passed up, not slept
    jittered = RetryPolicy(retries=1, base_ms=100)
    assert jittered.delay_ms(0, None, 0.0) == 50 and jittered.delay_ms(0, None, 0.999) == 99
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


def test_retry_after_forms() -> None:
    assert retry_after_ms({"retry-after-ms": "250"}) == 250
    assert retry_after_ms({"retry-after": "2"}) == 2000 and retry_after_ms({"retry-after": "0.5"}) == 500
    assert retry_after_ms({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0  # a date in the past
    assert retry_after_ms({"retry-after": "soon"}) is None and retry_after_ms({}) is None
