"""OpenAI-compatible next-hop: against the real llama-cpp-python server with
SmolLM2 (``-m model``), and against a raw-socket HTTP peer for the failure
shapes a healthy local server never produces (429, 5xx, stalls, bad SSE).

The raw peer reproduces the wire shapes of OpenAI's documented streaming API
(``text/event-stream`` chunks, a final usage chunk with ``choices: []`` when
``stream_options.include_usage`` is set, ``data: [DONE]``, in-band ``{"error": …}``):
llama-cpp-python does not send the usage chunk, so that path is exercised there.
Also here: the registry's model factories and the ScriptedAdapter test helper.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from peers import (  # tests/peers.py (tests/ is on sys.path via its conftest)
    MODEL_ALIAS,
    free_port,
    start_llama_server,
)

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.openai_compat import (
    CallStats,
    OpenAICompatAdapter,
    estimate_tokens,
    parse_review,
    render_diff,
    usd_micros,
)
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, AgentReport, Severity, Usage
from atp_router.policy.health import Health
from atp_router.policy.rib import AgentSpec, ModelSpec
from atp_router.task.diff import parse_diff
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import CostEstimate, PayloadType
from tests.replay_server import Behaviour, LoopbackHTTP, serve

AFTER = "import os\n\n\ndef run(cmd):\n    return os.system(cmd)\n\n\ndef main():\n    run(input())\n"
DIFF = """\
diff --git a/tool/run.py b/tool/run.py
--- a/tool/run.py
+++ b/tool/run.py
@@ -2,8 +2,8 @@ import os
 
 
 def run(cmd):
-    return subprocess.run(cmd.split(), check=True)
+    return os.system(cmd)
 
 
 def main():
     run(input())
"""
REVIEW = Prompt(task_type="code_review", content={"diff": DIFF, "files": {"tool/run.py": AFTER}})
COST_IN, COST_OUT = 0.15, 0.6  # USD per 1M tokens


async def _collect(adapter: OpenAICompatAdapter, prompt: Prompt = REVIEW) -> list[Fragment]:
    return [f async for f in adapter.stream(prompt)]


# --- the real model server ------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_url() -> Iterator[str]:
    with start_llama_server() as url:
        yield url


def _smol(url: str, **kw: Any) -> OpenAICompatAdapter:
    args: dict[str, Any] = {
        "base_url": url,
        "model": MODEL_ALIAS,
        "cost_in_per_mtok": COST_IN,
        "cost_out_per_mtok": COST_OUT,
        "max_out_tokens": 96,
        "temperature": 0.0,
        "timeout_ms": 60_000,
        "ctx_tokens": 2048,
    }
    args.update(kw)
    return OpenAICompatAdapter("reviewer.smol", **args)


@pytest.mark.model
async def test_streams_partials_then_a_priced_final(llama_url: str) -> None:
    adapter = _smol(llama_url)
    try:
        frags = await _collect(adapter)
    finally:
        await adapter.aclose()
    *partials, final = frags
    assert len(partials) >= 2 and all(f.type is PayloadType.PARTIAL for f in partials)
    assert final.type is PayloadType.FINAL and isinstance(final.content, AgentReport)
    assert "".join(f.content for f in partials).strip()
    # usage is cumulative: never shrinks, and the FINAL carries the total.
    outs = [f.usage.out_tokens for f in frags]
    assert outs == sorted(outs)
    u = final.usage
    assert u.in_tokens > 0 and u.out_tokens > 0
    assert u.usd_micros == usd_micros(u.in_tokens, u.out_tokens, COST_IN, COST_OUT) > 0
    h = adapter.health()
    assert h.up and h.error_rate == 0 and h.p95_ms > 0


@pytest.mark.model
async def test_estimate_is_sane_for_the_real_prompt(llama_url: str) -> None:
    adapter = _smol(llama_url, max_out_tokens=64)
    est = adapter.estimate(REVIEW)
    assert est.out_tokens == 64
    assert 100 < est.in_tokens < 2048 - 64  # system prompt + numbered diff, well inside ctx
    assert est.usd == usd_micros(est.in_tokens, 64, COST_IN, COST_OUT) / 1_000_000
    try:
        [*_, final] = await _collect(adapter)
    finally:
        await adapter.aclose()
    # llama-cpp-python reports no usage in streams: the adapter charges its own
    # estimate for the prompt and chars/4 for the answer.
    assert final.usage.in_tokens == est.in_tokens


@pytest.mark.model
@pytest.mark.parametrize("json_mode", [False, True])
async def test_model_review_returns_a_report(llama_url: str, json_mode: bool) -> None:
    adapter = _smol(llama_url, json_mode=json_mode, max_out_tokens=160)
    try:
        frags = await _collect(adapter)
    finally:
        await adapter.aclose()
    report = frags[-1].content
    assert isinstance(report, AgentReport)
    msgspec.convert(msgspec.to_builtins(report), AgentReport)  # strict schema round-trip
    text = "".join(f.content for f in frags[:-1])
    for f in report.findings:  # SmolLM2 is weak: shape, not quality
        assert f.file == "tool/run.py" and 1 <= f.start <= f.end <= 9 and f.claim
    if not report.findings:
        assert report.summary == text.strip()[:2000] or (report.summary == "" and "findings" in text)
    print(f"\njson_mode={json_mode}: {len(report.findings)} finding(s); answer: {text[:300]!r}")


@pytest.mark.model
async def test_sequential_calls_reuse_one_keep_alive_connection(llama_url: str) -> None:
    """Issue 10: the adapter reads each streamed response to the end of its body
    (past ``data: [DONE]``), so the keep-alive connection goes back to httpx's
    pool and the next call reuses it instead of opening a new TCP connection."""
    adapter = _smol(llama_url, max_out_tokens=8)
    try:
        for _ in range(3):
            [*_, final] = await _collect(adapter)
            assert final.type is PayloadType.FINAL
        if adapter.lean:  # the lean client's pool (atp_router.adapters.upstream, issue 25)
            client = adapter._lean_client()
            assert client.opened == 1 and client.idle(llama_url) == 1, (client.opened, client.idle(llama_url))
        else:
            pool = adapter._http()._transport._pool  # httpx's connection pool (httpcore)
            assert len(pool.connections) == 1, pool.connections
            assert pool.connections[0].is_idle()
    finally:
        await adapter.aclose()


@pytest.mark.model
async def test_cancel_mid_stream_then_reuse(llama_url: str) -> None:
    adapter = _smol(llama_url, max_out_tokens=400)
    seen = 0
    try:
        with trio.move_on_after(30) as scope:
            async for _frag in adapter.stream(REVIEW):
                seen += 1
                if seen == 3:
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # the cancel point
        assert scope.cancelled_caught and seen == 3
        assert adapter.health().error_rate == 0  # the router's deadline, not the agent's failure
        [*_, final] = await _collect(_smol(llama_url, max_out_tokens=16))
        assert final.type is PayloadType.FINAL
    finally:
        await adapter.aclose()


async def test_connect_error_is_agentdown() -> None:
    adapter = OpenAICompatAdapter("gone", base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_ms=2000)
    with pytest.raises(AgentError) as e:
        await _collect(adapter)
    await adapter.aclose()
    assert e.value.code is ErrorCode.EAGENTDOWN and e.value.agent == "gone"
    assert "cannot connect" in e.value.reason
    assert adapter.health() == Health(p95_ms=adapter.health().p95_ms, error_rate=1.0, up=False)


# --- a raw HTTP peer for failure shapes -------------------------------------------------

def sse(events: list[str], *, close: bool = True) -> Behaviour:
    async def behaviour(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        for data in events:
            await stream.send_all(f"data: {data}\n\n".encode())
        if not close:
            await trio.sleep_forever()

    return behaviour


def status(code: int, body: str = "", headers: str = "") -> Behaviour:
    async def behaviour(stream: trio.SocketStream) -> None:
        raw = body.encode()
        await stream.send_all(
            f"HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n"
            f"connection: close\r\n{headers}\r\n".encode()
            + raw
        )

    return behaviour


def chunk(content: str | None = None, usage: dict | None = None) -> str:
    obj: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": "m"}
    obj["choices"] = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj)


@pytest.fixture
async def peer(nursery: trio.Nursery) -> LoopbackHTTP:
    """A raw HTTP/1.1 peer: records each request and answers with ``peer.behaviour``."""
    return await serve(nursery, LoopbackHTTP(sse([]), path="/v1"))


def _adapter(peer: LoopbackHTTP, **kw: Any) -> OpenAICompatAdapter:
    args: dict[str, Any] = {
        "base_url": peer.url, "model": "m", "cost_in_per_mtok": 2.5, "cost_out_per_mtok": 10.0, "max_out_tokens": 256,
        "timeout_ms": 2000, "ctx_tokens": 4096,
    }  # fmt: skip
    args.update(kw)
    return OpenAICompatAdapter("peer", **args)


async def test_request_shape_and_reported_usage(peer: LoopbackHTTP) -> None:
    answer = json.dumps(
        {
            "findings": [
                {
                    "file": "tool/run.py",
                    "line": 5,
                    "severity": "high",
                    "claim": "os.system runs a shell on user input",
                    "confidence": 0.9,
                }
            ]
        }
    )
    peer.behaviour = sse(
        [
            chunk(answer[:20]),
            chunk(answer[20:]),
            chunk(usage={"prompt_tokens": 321, "completion_tokens": 45, "total_tokens": 366}),
            "[DONE]",
        ]
    )
    adapter = _adapter(peer, api_key="sk-test", json_mode=True, temperature=0.2)
    frags = await _collect(adapter)
    await adapter.aclose()
    head, body = peer.requests[0]
    assert head.startswith("POST /v1/chat/completions HTTP/1.1")
    assert re.search(r"(?im)^authorization: Bearer sk-test\r?$", head)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 256 and body["temperature"] == 0.2 and body["model"] == "m"
    assert body["response_format"] == {"type": "json_object"}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert "    5 +     return os.system(cmd)" in body["messages"][1]["content"]
    assert [f.type for f in frags] == [PayloadType.PARTIAL, PayloadType.PARTIAL, PayloadType.FINAL]
    assert frags[0].usage.out_tokens == estimate_tokens(20)  # estimated until the server reports
    final = frags[-1]
    assert final.usage == Usage(321, 45, math.ceil(321 * 2.5 + 45 * 10))
    assert final.content == AgentReport(
        findings=[
            AgentFinding(
                file="tool/run.py",
                start=5,
                end=5,
                severity=Severity.HIGH,
                claim="os.system runs a shell on user input",
                confidence=0.9,
                ref="1",
            )
        ]
    )


@pytest.mark.parametrize(
    "behaviour, code, retry_ms",
    [
        (status(429, '{"error":{"message":"slow down"}}', "retry-after: 2\r\n"), ErrorCode.EAGENTDOWN, 2000),
        (status(429, "", "retry-after-ms: 750\r\n"), ErrorCode.EAGENTDOWN, 750),
        (status(503, "overloaded"), ErrorCode.EAGENTDOWN, None),
        (status(401, '{"error":"bad key"}'), ErrorCode.EAGENTDOWN, None),
        (status(408), ErrorCode.ETIMEOUT, None),
        (status(400, '{"error":"context length exceeded"}'), ErrorCode.EPROTO, None),
        (status(200, '{"choices":[]}'), ErrorCode.EPROTO, None),  # ignored stream: true
        (sse([chunk("ok"), "{not json"]), ErrorCode.EPROTO, None),
        (sse(['{"error": {"message": "model crashed"}}']), ErrorCode.EAGENTDOWN, None),
        (sse([chunk("partial answer")], close=False), ErrorCode.ETIMEOUT, None),  # stalls: read timeout
    ],
    ids=["429-s", "429-ms", "503", "401", "408", "400", "not-sse", "bad-json", "in-band-error", "stall"],
)
async def test_failures_map_to_spec_codes(
    peer: LoopbackHTTP, behaviour: Behaviour, code: ErrorCode, retry_ms: int | None
) -> None:
    peer.behaviour = behaviour
    adapter = _adapter(peer, timeout_ms=500)
    with pytest.raises(AgentError) as e:
        await _collect(adapter)
    await adapter.aclose()
    assert (e.value.code, e.value.retry_after_ms, e.value.agent) == (code, retry_ms, "peer")
    assert adapter.health().error_rate == 1.0 and adapter.health().up is (code is not ErrorCode.EAGENTDOWN)


async def test_a_body_left_open_after_done_does_not_hold_the_call(peer: LoopbackHTTP) -> None:
    """After ``[DONE]`` the adapter reads on to the end of the body only briefly: a
    server that never ends it costs at most ~1 s, and the FINAL comes."""
    peer.behaviour = sse([chunk("hello"), chunk(usage={"prompt_tokens": 3, "completion_tokens": 1}), "[DONE]"],
                         close=False)
    adapter = _adapter(peer, timeout_ms=30_000)
    try:
        t0 = trio.current_time()
        *_, final = await _collect(adapter)
        assert final.type is PayloadType.FINAL and trio.current_time() - t0 < 5
    finally:
        await adapter.aclose()


async def test_dropped_connection_mid_stream_is_agentdown(peer: LoopbackHTTP) -> None:
    async def drop(stream: trio.SocketStream) -> None:
        # Chunked encoding cut before its terminating chunk: the peer died mid-answer.
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        data = f"data: {chunk('half')}\n\n".encode()
        await stream.send_all(b"%x\r\n%s\r\n" % (len(data), data))

    peer.behaviour = drop
    adapter = _adapter(peer)
    got: list[Fragment] = []
    with pytest.raises(AgentError) as e:
        async for f in adapter.stream(REVIEW):
            got.append(f)
    await adapter.aclose()
    assert e.value.code is ErrorCode.EAGENTDOWN
    # The PARTIAL before the drop carried the usage so far, for the budget governor.
    assert [f.type for f in got] == [PayloadType.PARTIAL] and got[0].usage.tokens > 0


async def test_missing_api_key_variable_is_agentdown_at_call_time(
    peer: LoopbackHTTP, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ATP_TEST_KEY", raising=False)
    adapter = _adapter(peer, api_key_env="ATP_TEST_KEY")
    with pytest.raises(AgentError) as e:
        await _collect(adapter)
    assert e.value.code is ErrorCode.EAGENTDOWN and "ATP_TEST_KEY" in e.value.reason and not peer.requests
    monkeypatch.setenv("ATP_TEST_KEY", "rotated")
    peer.behaviour = sse([chunk('{"findings": []}'), "[DONE]"])
    [*_, final] = await _collect(adapter)
    await adapter.aclose()
    assert re.search(r"(?im)^authorization: Bearer rotated\r?$", peer.requests[0][0])
    assert final.content == AgentReport() and final.usage.in_tokens == adapter.estimate(REVIEW).in_tokens


# --- pure parts -------------------------------------------------------------------------


def test_usd_micros_is_exact_integer_math() -> None:
    assert usd_micros(1_000_000, 0, 0.15, 0) == 150_000  # 0.15 USD
    assert usd_micros(3, 0, 0.1, 0) == 1  # 0.3 micros rounds up: never under-charge
    assert usd_micros(7, 3, 2.5, 10.0) == 48  # 17.5 + 30 → 48
    assert usd_micros(10, 10, 0.0, 0.0) == 0
    assert usd_micros(1_234_567, 89_012, 3.0, 15.0) == 1_234_567 * 3 + 89_012 * 15


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 10**9),
       st.decimals(0, 1000, places=6, allow_nan=False), st.decimals(0, 1000, places=6, allow_nan=False))
def test_usd_micros_integer_path_equals_the_exact_fraction(i: int, o: int, a, b) -> None:
    """The integer arithmetic of the hot path (issue 10) is the exact decimal price
    rounded up, as ``Fraction(str(cost))`` computes it."""
    import math
    from fractions import Fraction

    ca, cb = float(a), float(b)
    assert usd_micros(i, o, ca, cb) == math.ceil(i * Fraction(str(ca)) + o * Fraction(str(cb)))


def test_estimate_and_prompt_fit_the_context() -> None:
    big = "".join(f"line {i}\n" for i in range(5000))
    diff = "--- a/big.py\n+++ b/big.py\n@@ -0,0 +1,5000 @@\n" + "".join(f"+line {i}\n" for i in range(5000))
    prompt = Prompt(task_type="code_review", content={"diff": diff, "files": {"big.py": big}})
    adapter = OpenAICompatAdapter(
        "a",
        base_url="http://x",
        model="m",
        max_out_tokens=200,
        ctx_tokens=1000,
        cost_in_per_mtok=1,
        cost_out_per_mtok=2,
    )
    msgs = adapter.messages(prompt)
    assert sum(len(m["content"]) for m in msgs) <= (1000 - 200) * 4
    assert re.search(r"\[diff truncated: \d+ more lines\]$", msgs[1]["content"])
    est = adapter.estimate(prompt)
    assert est == CostEstimate(in_tokens=est.in_tokens, out_tokens=200, usd=(est.in_tokens * 1 + 200 * 2) / 1e6)
    assert 700 < est.in_tokens <= 800
    small = adapter.estimate(REVIEW)
    assert 0 < small.in_tokens < est.in_tokens
    other = adapter.messages(Prompt(task_type="summarize_repo", content={"readme": "hi"}, instruction="Summarize."))
    assert other[1]["content"].startswith("Summarize.\n\n") and '"readme": "hi"' in other[1]["content"]
    with pytest.raises(ValueError):
        OpenAICompatAdapter("a", base_url="http://x", model="m", max_out_tokens=1000, ctx_tokens=1000)


def test_render_diff_numbers_after_lines() -> None:
    text = render_diff(parse_diff(DIFF))
    assert text.splitlines()[:5] == [
        "### tool/run.py (modified)",
        "@@ import os",
        "    2   ",
        "    3   ",
        "    4   def run(cmd):",
    ]
    assert "      -     return subprocess.run(cmd.split(), check=True)" in text


CONTENT = {"diff": DIFF, "files": {"tool/run.py": AFTER}}


def test_parse_review_tolerates_fences_prose_and_truncation() -> None:
    fenced = (
        'Sure!\n```json\n{"findings": [{"file": "b/tool/run.py", "line": "5", "severity": "Error", '
        '"claim": "shell injection", "confidence": 85}], "summary": "one issue"}\n```\nHope this helps.'
    )
    findings, summary = parse_review(fenced, CONTENT)
    assert summary == "one issue"
    assert [(f.file, f.start, f.severity, f.confidence, f.ref) for f in findings] == [
        ("tool/run.py", 5, Severity.HIGH, 0.85, "1")
    ]
    prose = 'I found: [{"file": "tool/run.py", "line": "4-5", "claim": "unsafe"}] and nothing else'
    [f], _ = parse_review(prose, CONTENT)
    assert (f.start, f.end, f.severity, f.confidence) == (4, 5, Severity.MEDIUM, 0.5)
    cut = (
        '{"findings": [{"file": "tool/run.py", "line": 5, "claim": "a"}, '
        '{"file": "tool/run.py", "line": 9, "claim": "b"}, {"file": "tool/ru'
    )
    assert [f.claim for f in parse_review(cut, CONTENT)[0]] == ["a", "b"]


def test_parse_review_drops_invalid_entries() -> None:
    answer = json.dumps(
        {
            "findings": [
                {"file": "tool/run.py", "line": 99, "claim": "past the end"},
                {"file": "other.py", "line": 1, "claim": "unknown file"},
                {"file": "tool/run.py", "line": 5},
                {"file": "tool/run.py", "line": True, "claim": "bool line"},
                {"file": "tool/run.py", "line": 0, "claim": "line zero"},
                "not an object",
                {"file": "tool/run.py", "line": 5, "severity": "weird", "claim": "kept", "confidence": -3},
                {"file": "tool/run.py", "line": 5, "severity": "weird", "claim": "kept", "confidence": -3},
            ]
        }
    )
    [f], _ = parse_review(answer, CONTENT)
    assert (f.claim, f.severity, f.confidence) == ("kept", Severity.MEDIUM, 0.5)
    # Without files, lines must fall inside a hunk of the diff (2..9 here).
    [g], _ = parse_review('{"findings": [{"line": 5, "claim": "x"}, {"line": 1, "claim": "y"}]}', {"diff": DIFF})
    assert (g.file, g.start) == ("tool/run.py", 5)
    nothing, summary = parse_review("  This code looks fine to me.  ", CONTENT)
    assert nothing == [] and summary == "This code looks fine to me."


def test_call_stats_p95_and_error_rate() -> None:
    stats = CallStats(size=100)
    assert stats.health() == Health()
    for i in range(1, 201):
        stats.record(float(i), ok=i % 10 != 0)
    h = stats.health()
    assert h.p95_ms == 195.0 and h.error_rate == 0.1 and h.up  # only the last 100 calls count
    stats.record(5.0, ok=False, down=True)
    assert not stats.health().up


def test_call_stats_incremental_window_matches_a_sort_of_the_last_calls() -> None:
    """The window kept sorted as calls come and go gives what sorting the last
    ``size`` calls gives (ties, evictions of equal latencies, errors leaving)."""
    import math
    import random

    rng = random.Random(7)
    for size in (1, 3, 100):
        stats, calls = CallStats(size=size), []
        for _ in range(700):
            ms, ok = float(rng.choice([rng.randint(1, 20), rng.random() * 50])), rng.random() > 0.2
            stats.record(ms, ok=ok)
            calls = (calls + [(ms, ok)])[-size:]
            lat = sorted(m for m, _ in calls)
            want = Health(p95_ms=lat[max(0, math.ceil(0.95 * len(lat)) - 1)],
                          error_rate=sum(not o for _, o in calls) / len(calls))
            assert stats.health() == want
    stats = CallStats(size=2)
    stats.record(float("nan"), ok=True)  # counted as 0 ms, the order kept
    stats.record(3.0, ok=True)
    assert stats.health().p95_ms == 3.0


# --- registry: model providers ------------------------------------------------------------


def _agent(**kw: Any) -> AgentSpec:
    return AgentSpec(layer="L3", p95_ms=1000, model="m1", timeout_ms=45_000, **kw)


def test_registry_builds_chat_adapters() -> None:
    local = build_adapter(
        "reviewer.local",
        _agent(strengths=["quick_review"], options={"json_mode": True}),
        ModelSpec(provider="openai_compat", ctx="2k", cost=0, base_url="http://127.0.0.1:8080/v1", model="smollm2"),
    )
    assert isinstance(local, OpenAICompatAdapter)
    assert (local.base_url, local.model, local.ctx_tokens, local.timeout_ms, local.json_mode) == (
        "http://127.0.0.1:8080/v1", "smollm2", 2048, 45_000, True
    )  # fmt: skip
    assert local.capabilities().skills == ["quick_review"] and local.capabilities().max_ctx == 2048
    gpt = build_adapter(
        "reviewer.gpt5",
        _agent(),
        ModelSpec(
            provider="openai", ctx="1M", cost_in=1.25, cost_out=10, api_key_env="OPENAI_API_KEY", max_out_tokens=2000
        ),
    )
    assert (gpt.base_url, gpt.model, gpt.cost_in_per_mtok, gpt.cost_out_per_mtok, gpt.max_out_tokens) == (
        "https://api.openai.com/v1", "m1", 1.25, 10, 2000
    )  # fmt: skip
    qwen = build_adapter(
        "summarizer.local", _agent(), ModelSpec(provider="ollama", ctx="32k", cost=0, model="qwen2.5:7b")
    )
    assert (qwen.base_url, qwen.model, qwen.cost_in_per_mtok) == ("http://127.0.0.1:11434", "qwen2.5:7b", 0)
    with pytest.raises(ValueError, match=r"options\.temperature: unknown option for provider ollama"):
        build_adapter("x", _agent(options={"temperature": 1}), ModelSpec(provider="ollama", ctx="32k", cost=0))
    with pytest.raises(ValueError, match="max_out_tokens"):
        build_adapter("x", _agent(), ModelSpec(provider="ollama", ctx=512, cost=0, max_out_tokens=512))
    with pytest.raises(ValueError, match=r"model: agent names model 'm1' but no model entry"):
        build_adapter("x", _agent(), None)


# --- the ScriptedAdapter testing helper -----------------------------------------------------


async def test_scripted_adapter_plays_its_script() -> None:
    finding = AgentFinding(file="a.py", start=1, end=1, severity=Severity.LOW, claim="c")
    adapter = ScriptedAdapter.returning(
        "s",
        [finding],
        partials=["thinking"],
        usage=Usage(10, 5, 7),
        estimate=CostEstimate(in_tokens=10, out_tokens=5, usd=7e-6),
    )
    frags = [f async for f in adapter.stream(REVIEW)]
    assert [f.type for f in frags] == [PayloadType.PARTIAL, PayloadType.FINAL]
    assert frags[1].content.findings == [finding] and frags[1].usage == Usage(10, 5, 7)
    assert adapter.calls == [REVIEW] and adapter.estimate(REVIEW).in_tokens == 10
    default = [f async for f in ScriptedAdapter("d").stream(REVIEW)]
    assert default == [Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=Usage())]
    sized = ScriptedAdapter("e", estimate=lambda p: CostEstimate(in_tokens=len(p.content["diff"])))
    assert sized.estimate(REVIEW).in_tokens == len(DIFF)


async def test_scripted_adapter_faults(autojump_clock: trio.testing.MockClock) -> None:
    down = ScriptedAdapter("down", fail_with=ErrorCode.EAGENTDOWN, retry_after_ms=500, fail_reason="503")
    with pytest.raises(AgentError) as e:
        [f async for f in down.stream(REVIEW)]
    assert (e.value.code, e.value.retry_after_ms, e.value.agent, e.value.reason) == (
        ErrorCode.EAGENTDOWN,
        500,
        "down",
        "503",
    )
    slow = ScriptedAdapter("slow", delay_s=30)
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(5):
            [f async for f in slow.stream(REVIEW)]
    assert trio.current_time() - start == pytest.approx(5)
    hang = ScriptedAdapter("hang", [Fragment(type=PayloadType.PARTIAL, content="x")], delay_s=math.inf)
    with trio.move_on_after(60) as scope:
        [f async for f in hang.stream(REVIEW)]
    assert scope.cancelled_caught
    cut = ScriptedAdapter(
        "cut", [Fragment(type=PayloadType.PARTIAL, content="x", usage=Usage(3, 1, 2))], fail_with=ErrorCode.ETIMEOUT
    )
    got: list[Fragment] = []
    with pytest.raises(AgentError):
        async for f in cut.stream(REVIEW):
            got.append(f)
    assert got[0].usage == Usage(3, 1, 2)


def test_completion_text_marks_a_finding_the_change_silenced():
    """A plain-text client sees what a JSON client sees in ``suppressed_by_change``."""
    from atp_router.consensus.types import ConsensusInfo, Finding, Result
    from atp_router.runtime.ingress.openai import SILENCED, completion_text

    def finding(i: int, silenced: bool) -> Finding:
        return Finding(id=f"F-{i}", severity="high", file="a.py", span=f"{i}-{i}", claim="eval of input",
                       confidence=0.9, provenance=["lint.ruff#1"], suppressed_by_change=silenced)

    text = completion_text(Result(findings=[finding(1, True), finding(2, False)],
                                  consensus=ConsensusInfo(strategy="union_tiebreak", agreement=1.0)))
    lines = text.splitlines()
    assert lines[1].endswith("[lint.ruff#1]" + SILENCED) and lines[2].endswith("[lint.ruff#1]"), text


# --- a chat body (the OpenAI ingress's messages) --------------------------------------


def _chat(*turns: tuple[str, str], **kw: Any) -> Prompt:
    return Prompt(task_type="chat", content={"messages": [{"role": r, "content": c} for r, c in turns]}, **kw)


def test_a_chat_body_reaches_the_model_as_its_own_conversation() -> None:
    adapter = OpenAICompatAdapter("a", base_url="http://x", model="m", max_out_tokens=200, ctx_tokens=4000)
    prompt = Prompt(task_type="chat", content={"messages": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello", "name": "ann"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "How are\nyou?"},
    ]}, instruction="Policy says: be polite.")
    msgs = adapter.messages(prompt)
    assert msgs == [
        {"role": "system", "content": "Policy says: be polite.\n\nYou answer in French.\n\nBe brief."},
        {"role": "user", "content": "Hello", "name": "ann"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "How are\nyou?"},
    ]
    # no JSON rendering of the body, no generic system prompt
    assert not any("precise assistant" in m["content"] or '"role"' in m["content"] for m in msgs)
    est = adapter.estimate(prompt)
    assert est.in_tokens == adapter._count(msgs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=3000)), min_size=1,
                max_size=30), st.integers(min_value=400, max_value=3000))  # rooms of 800+ characters
def test_a_chat_conversation_is_fitted_newest_first(turns: list[tuple[str, str]], ctx: int) -> None:
    adapter = OpenAICompatAdapter("a", base_url="http://x", model="m", max_out_tokens=200, ctx_tokens=ctx)
    msgs = adapter.messages(_chat(*turns))
    room = (ctx - 200) * 4
    # the contents fit the room left by each message's framing (all empty when not even the framing fits)
    assert sum(len(m["content"]) for m in msgs) <= max(room - 16 * len(msgs), 0)
    rest = [c for r, c in turns if r != "system"]
    shown = [m["content"] for m in msgs if m["role"] != "system"]
    if rest:  # the newest turns, in order, each whole or its head (marked when there was room for the marker)
        assert shown and len(shown) <= len(rest)
        for got, sent in zip(shown, rest[len(rest) - len(shown):], strict=True):
            head = got.split("\n[truncated: ")[0]
            assert sent.startswith(head) and (got == sent or len(got) < len(sent) or "[truncated: " in got)
    omitted = [m for m in msgs if m["content"].endswith("earlier messages omitted]")]
    assert len(omitted) <= 1
