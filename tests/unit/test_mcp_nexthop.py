"""MCP servers as next-hops (``remote.protocol: mcp``, :mod:`atp_router.adapters.mcp`).

The peer is a real MCP server built with the official SDK (``MCPServer``, its own
streamable HTTP app under uvicorn: ``tests/peer_servers/mcp_server.py``), started
in a subprocess on a free loopback port. Its ``--token`` and ``--fail-calls``
modes put a gateway in front of the same app (a 401 for a missing credential; an
overloaded ``tools/call`` answered 503). The argument mapping is also checked on
its own, against ``Tool`` listings built in the test (sans-IO).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import atp
import mcp_types
import msgspec
import pytest
import trio
from peers import (  # tests/peers.py (on sys.path via conftest)
    free_port,
    serve_http_peer,
)

from atp_router.adapters.base import Fragment, Prompt, estimate_tokens
from atp_router.adapters.mcp import MAX_RESPONSE_BYTES, McpAdapter, from_spec
from atp_router.adapters.mcp_tool import MAX_FINDINGS, MAX_TEXT_CHARS, render
from atp_router.adapters.registry import build_adapter
from atp_router.consensus.types import AgentReport, Severity
from atp_router.policy.rib import AgentSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType
from tests.helpers import start_router_on
from tests.unit.test_agent_api import AFTER, DIFF, EXAMPLE, REVIEW

SERVER = Path(__file__).resolve().parents[1] / "peer_servers" / "mcp_server.py"
TOKEN = "mcp-test-token-" + "9" * 24
#: What the peer's review finds in REVIEW: (file, line, severity).
EXPECTED = [("tool/run.py", 4, Severity.MEDIUM), ("tool/run.py", 6, Severity.HIGH)]


@contextlib.contextmanager
def serve_mcp(*flags: str) -> Iterator[str]:
    """The peer on a free port; yields its MCP endpoint URL."""
    port = free_port()
    argv = [sys.executable, str(SERVER), "--port", str(port), *flags]
    with serve_http_peer(argv, name="MCP server", base=f"http://127.0.0.1:{port}", ready_path="/health",
                         timeout_s=60) as base:  # fmt: skip
        yield base + "/mcp"


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    with serve_mcp() as url:
        yield url


@pytest.fixture(scope="module")
def guarded_url() -> Iterator[str]:
    """The same server behind a gateway that wants ``Bearer TOKEN``."""
    with serve_mcp("--token", TOKEN) as url:
        yield url


@pytest.fixture
def overloaded_url() -> Iterator[str]:
    """The same server behind a gateway that answers every tools/call 503."""
    with serve_mcp("--fail-calls", "503") as url:
        yield url


def agent(url: str, tool: str, *, remote: dict[str, Any] | None = None, **options: Any) -> AgentSpec:
    return msgspec.convert({"layer": "L2", "p95_ms": 1000, "timeout_ms": 20_000, "strengths": ["code_review"],
                            "remote": {"protocol": "mcp", "url": url, "options": {"tool": tool, **options},
                                       **(remote or {})}}, AgentSpec)  # fmt: skip


def adapter(url: str, tool: str, *, remote: dict[str, Any] | None = None, **options: Any) -> McpAdapter:
    built = build_adapter(f"mcp.{tool}", agent(url, tool, remote=remote, **options))
    assert isinstance(built, McpAdapter)
    return built


async def collect(hop: McpAdapter, prompt: Prompt = REVIEW) -> list[Fragment]:
    return [f async for f in hop.stream(prompt)]


async def failure(hop: McpAdapter, prompt: Prompt = REVIEW) -> tuple[AgentError, list[Fragment]]:
    got: list[Fragment] = []
    with pytest.raises(AgentError) as e:
        async for f in hop.stream(prompt):
            got.append(f)
    return e.value, got


# --- results ----------------------------------------------------------------------------


async def test_review_tool_structured_findings_and_reported_usage(mcp_url: str) -> None:
    hop = adapter(mcp_url, "review_change", remote={"cost_usd_per_call": 0.003})
    est = hop.estimate(REVIEW)
    [final] = await collect(hop)
    assert final.type is PayloadType.FINAL and isinstance(final.content, AgentReport)
    assert [(f.file, f.start, f.severity) for f in final.content.findings] == EXPECTED
    assert final.content.summary == "mcp-review: 2 finding(s) in 1 file(s)"
    # The peer reported its usage in _meta.usage (chars/4 of diff + files); the price is flat.
    assert final.usage.in_tokens == math.ceil((len(DIFF) + len(AFTER)) / 4) and final.usage.out_tokens > 0
    assert final.usage.usd_micros == 3000 and est.usd == 0.003
    assert hop.health().error_rate == 0.0 and hop.capabilities().tools == ["review_change"]


async def test_reported_usage_priced_at_cost_in_and_out(mcp_url: str) -> None:
    hop = adapter(mcp_url, "review_change", cost_in=2.5, cost_out=10)
    [final] = await collect(hop)
    assert final.usage.usd_micros == math.ceil(final.usage.in_tokens * 2.5 + final.usage.out_tokens * 10)


async def test_text_tool_answer_is_parsed_like_a_model_review(mcp_url: str) -> None:
    """lint_text takes ``task`` only: the task goes as the numbered diff a model
    would see, and its JSON text answer is parsed like a model's."""
    hop = adapter(mcp_url, "lint_text", remote={"cost_usd_per_call": 0.001})
    [final] = await collect(hop)
    assert [(f.file, f.start, f.severity) for f in final.content.findings] == EXPECTED
    # No usage reported: chars/4 of the arguments sent and of the text received.
    sent = json.dumps({"task": render(REVIEW)}, ensure_ascii=False)
    assert final.usage.in_tokens == estimate_tokens(len(sent)) and final.usage.usd_micros == 1000


async def test_text_tool_answers_a_non_review_task_with_the_context_forwarded(mcp_url: str) -> None:
    hop = adapter(mcp_url, "describe")
    prompt = Prompt(task_type="summarise", content={"text": "Three little words\nand more"},
                    task=TaskMeta(task_type="summarise", agent_context=EXAMPLE))  # fmt: skip
    [final] = await collect(hop, prompt)
    digest = hashlib.sha256(json.dumps(EXAMPLE, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert final.content == AgentReport(
        summary=f"5 words; first line: Three little words; agent_context sha256:{digest}")


async def test_the_handshake_era_protocol_when_the_rib_pins_it(mcp_url: str) -> None:
    hop = adapter(mcp_url, "review_change", remote={"version": "2025-11-25"})
    assert hop.mode == "legacy"
    [final] = await collect(hop)
    assert [(f.file, f.start) for f in final.content.findings] == [(f, s) for f, s, _ in EXPECTED]


async def test_hostile_sizes_are_bounded(mcp_url: str) -> None:
    """flood answers 400 KiB of text and 3000 findings: the adapter keeps
    MAX_FINDINGS findings and MAX_TEXT_CHARS of text; an answer over
    MAX_RESPONSE_BYTES is refused, whether it comes as one JSON body (2026-07-28)
    or as an SSE event (the handshake era)."""
    [final] = await collect(adapter(mcp_url, "flood", arguments={"kib": 400}))
    assert len(final.content.findings) == MAX_FINDINGS and len(final.content.summary) <= MAX_TEXT_CHARS
    assert final.usage.out_tokens == estimate_tokens(MAX_TEXT_CHARS)
    for version in ("2026-07-28", "2025-11-25"):
        err, _ = await failure(adapter(mcp_url, "flood", arguments={"kib": 2048}, remote={"version": version}))
        assert err.code is ErrorCode.EPROTO and f"more than {MAX_RESPONSE_BYTES} bytes" in err.reason


# --- failures ---------------------------------------------------------------------------


async def test_unknown_tool_is_eproto_and_costs_nothing(mcp_url: str) -> None:
    hop = adapter(mcp_url, "no_such_tool", remote={"cost_usd_per_call": 0.5})
    err, got = await failure(hop)
    assert err.code is ErrorCode.EPROTO and "lists no tool 'no_such_tool'" in err.reason and err.agent == hop.name
    assert got == [] and hop.health().error_rate == 1.0 and hop.health().up


async def test_task_that_does_not_fit_the_schema_is_eproto_before_any_call(mcp_url: str) -> None:
    no_files = Prompt(task_type="code_review", content={"diff": DIFF})
    err, got = await failure(adapter(mcp_url, "review_change", remote={"cost_usd_per_call": 0.5}), no_files)
    assert err.code is ErrorCode.EPROTO and "requires files" in err.reason and got == []
    chat = Prompt(task_type="chat", content={"messages": [{"role": "user", "content": "hi"}]})
    err, _ = await failure(adapter(mcp_url, "review_change"), chat)
    assert err.code is ErrorCode.EPROTO and "set options.text_argument" in err.reason


async def test_a_tool_that_raises_is_agentdown_and_never_echoes_the_credential(
    guarded_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATP_MCP_TOKEN", TOKEN)
    hop = adapter(guarded_url, "explode", remote={"auth_env": "ATP_MCP_TOKEN", "cost_usd_per_call": 0.002})
    err, got = await failure(hop)
    assert err.code is ErrorCode.EAGENTDOWN and "backend exploded" in err.reason
    assert "[REDACTED]" in err.reason and TOKEN not in err.reason and TOKEN not in str(err)
    # The tool ran (it answered isError): the call is charged before the error.
    assert [(f.type, f.content, f.usage.usd_micros) for f in got] == [
        (PayloadType.LOG, {"tool": "explode", "error": "EAGENTDOWN"}, 2000)]
    assert not hop.health().up


async def test_credentials_401_and_an_unset_variable(guarded_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATP_MCP_TOKEN", "wrong-token-0123456789")
    err, _ = await failure(adapter(guarded_url, "describe", remote={"auth_env": "ATP_MCP_TOKEN"}))
    assert err.code is ErrorCode.EAGENTDOWN and err.reason.startswith("HTTP 401 from")
    monkeypatch.delenv("ATP_MCP_TOKEN")
    err, _ = await failure(adapter(guarded_url, "describe", remote={"auth_env": "ATP_MCP_TOKEN"}))
    assert err.code is ErrorCode.EAGENTDOWN and "ATP_MCP_TOKEN is not set" in err.reason


async def test_server_down_is_agentdown() -> None:
    hop = adapter(f"http://127.0.0.1:{free_port()}/mcp", "review_change")
    err, got = await failure(hop)
    assert err.code is ErrorCode.EAGENTDOWN and "cannot connect" in err.reason and got == []
    assert not hop.health().up


async def test_http_503_on_the_call_is_agentdown_with_retry_after(overloaded_url: str) -> None:
    err, got = await failure(adapter(overloaded_url, "review_change"))
    assert err.code is ErrorCode.EAGENTDOWN and err.reason.startswith("HTTP 503 from")
    assert err.retry_after_ms == 2000 and got == []


async def test_slow_tool_past_timeout_ms_is_etimeout_and_charged(mcp_url: str) -> None:
    spec = agent(mcp_url, "slow", arguments={"seconds": 4}, remote={"cost_usd_per_call": 0.004})
    spec.timeout_ms = 1500
    hop = from_spec("mcp.slow", spec)
    assert isinstance(hop, McpAdapter)
    t0 = time.monotonic()
    with trio.fail_after(10):
        err, got = await failure(hop, Prompt(task_type="text", content={"text": "take your time"}))
    elapsed = time.monotonic() - t0
    assert err.code is ErrorCode.ETIMEOUT and "1500 ms" in err.reason and 1.2 < elapsed < 5
    # The tool reported progress before the deadline: it ran, so the call is charged.
    assert [(f.type, f.usage.usd_micros) for f in got] == [(PayloadType.LOG, 4000)]


async def test_a_cancelled_call_passes_the_cancellation_through(mcp_url: str) -> None:
    """The router's deadline or the stream's RST cancels a call in flight: the
    cancellation crosses the SDK's task groups as such (no error, nothing yielded),
    in both protocol eras, and the adapter stays usable."""
    for version in ("2026-07-28", "2025-11-25"):
        hop = adapter(mcp_url, "slow", arguments={"seconds": 4}, remote={"version": version})
        got: list[Fragment] = []
        with trio.move_on_after(0.5) as scope:
            async for f in hop.stream(Prompt(task_type="text", content={"text": "x"})):
                got.append(f)
        assert scope.cancelled_caught and got == [] and hop.health().error_rate == 0.0
        [final] = await collect(adapter(mcp_url, "describe", remote={"version": version}),
                                Prompt(task_type="text", content={"text": "still here"}))  # fmt: skip
        assert final.content.summary == "2 words; first line: still here"


# --- RIB → adapter ----------------------------------------------------------------------


def test_registry_builds_the_adapter_from_the_rib() -> None:
    spec = agent("https://tools.example/mcp", "review_change", remote={"auth_env": "T", "version": "2026-07-28"},
                 arguments={"profile": "strict"}, text_argument="query", auth="api_key", header="X-Key",
                 max_out_tokens=64)  # fmt: skip
    hop = build_adapter("mcp.r", spec)
    assert isinstance(hop, McpAdapter)
    assert (hop.url, hop.tool, hop.fixed, hop.text_argument, hop.mode, hop.header, hop.max_out_tokens) == (
        "https://tools.example/mcp", "review_change", {"profile": "strict"}, "query", "2026-07-28", "X-Key", 64)
    assert hop.timeout_ms == 20_000 and hop.capabilities().skills == ["code_review"]


@pytest.mark.parametrize(
    ("remote", "options", "message"),
    [
        ({}, {"tool": "t", "temperature": 1}, r"options\.temperature: unknown option for remote mcp"),
        ({}, {"tool": 3}, r"options\.tool: expected str"),
        ({}, {"tool": "t", "arguments": ["x"]}, r"options\.arguments: expected mapping"),
        ({}, {"tool": "t", "max_out_tokens": True}, r"options\.max_out_tokens: expected int"),
        ({}, {"tool": "t", "max_out_tokens": 0}, r"options\.max_out_tokens: must be > 0"),
        ({}, {"tool": "t", "auth": "basic"}, r"options\.auth: expected 'bearer' or 'api_key'"),
        ({}, {"tool": "t", "header": "X-Key"}, r"options\.header: only meaningful with options\.auth: api_key"),
        ({}, {"tool": "t", "cost_in": -1}, r"options\.cost_in: must be >= 0"),
        ({}, {}, r"options\.tool: required"),
        ({"version": "1999-01-01"}, {"tool": "t"}, r"remote\.version: expected an MCP protocol version"),
        ({"agent_id": "x"}, {"tool": "t"}, r"remote\.agent_id: not used by MCP"),
        ({"url": "mqtt://h/mcp"}, {"tool": "t"}, r"remote\.url: expected an http\(s\) URL"),
    ],
)
def test_bad_rib_entries_are_refused_naming_the_field(remote: dict[str, Any], options: dict[str, Any],
                                                      message: str) -> None:  # fmt: skip
    spec = msgspec.convert({"layer": "L2", "p95_ms": 1000, "remote": {
        "protocol": "mcp", "url": "http://127.0.0.1:1/mcp", "options": options, **remote}}, AgentSpec)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        build_adapter("mcp.bad", spec)


# --- the argument mapping (sans-IO) -------------------------------------------------------


def tool(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> mcp_types.Tool:
    schema = {"type": "object", "properties": properties, **({"required": required} if required else {}), **extra}
    return mcp_types.Tool(name="t", input_schema=schema)


def test_content_fields_go_by_name_and_fixed_arguments_win() -> None:
    hop = McpAdapter("m", url="http://h/mcp", tool="t", arguments={"files": {}, "profile": "strict"})
    t = tool({"diff": {"type": "string"}, "files": {"type": "object"}, "task_type": {"type": "string"},
              "profile": {"type": "string"}}, ["diff"])  # fmt: skip
    assert hop.arguments(REVIEW, t) == {"diff": DIFF, "files": {}, "task_type": "code_review", "profile": "strict"}


def test_text_argument_choice() -> None:
    hop = McpAdapter("m", url="http://h/mcp", tool="t")
    text = Prompt(task_type="text", content={"text": "hello"}, instruction="Be brief.")
    assert hop.arguments(text, tool({"query": {"type": "string"}, "prompt": {}})) == {"prompt": "Be brief.\n\nhello"}
    assert hop.arguments(text, tool({"body": {"type": "string"}}, ["body"])) == {"body": "Be brief.\n\nhello"}
    explicit = McpAdapter("m", url="http://h/mcp", tool="t", text_argument="body")
    assert explicit.arguments(text, tool({"body": {"type": "string"}, "task": {"type": "string"}})) == {
        "body": "Be brief.\n\nhello"}
    review_text = hop.arguments(REVIEW, tool({"task": {"type": "string"}}))["task"]
    assert "Review this diff:" in review_text and "    6 +     return os.system(cmd)" in review_text


@pytest.mark.parametrize(
    ("schema_tool", "fixed", "message"),
    [
        (tool({"diff": {"type": "integer"}}), {}, "argument 'diff' must be integer, the task gives str"),
        (tool({"diff": {"type": "string"}}), {"n": True}, None),
        (tool({"diff": {"type": "string"}}, additionalProperties=False), {"n": True}, "takes no argument 'n'"),
        (tool({"diff": {"type": "string"}, "n": {"type": "integer"}}), {"n": 1.5}, "argument 'n' must be integer"),
        (tool({"n": {"type": "number"}, "m": {"type": "string"}}, ["n", "m"]), {}, "takes none of the task's fields"),
    ],
)
def test_arguments_checked_against_the_schema(schema_tool: mcp_types.Tool, fixed: dict[str, Any],
                                              message: str | None) -> None:  # fmt: skip
    hop = McpAdapter("m", url="http://h/mcp", tool="t", arguments=fixed)
    if message is None:
        assert hop.arguments(REVIEW, schema_tool) == {"diff": DIFF, **fixed}
        return
    with pytest.raises(AgentError) as e:
        hop.arguments(REVIEW, schema_tool)
    assert e.value.code is ErrorCode.EPROTO and message in e.value.reason


# --- through the router -------------------------------------------------------------------


async def test_mcp_next_hop_through_the_router(nursery: trio.Nursery, tmp_path: Path, mcp_url: str) -> None:
    rib = {
        "agents": {"review.mcp": {"layer": "L2", "p95_ms": 2000, "timeout_ms": 30_000, "strengths": ["code_review"],
                                  "remote": {"protocol": "mcp", "url": mcp_url, "cost_usd_per_call": 0.002,
                                             "options": {"tool": "review_change"}}}},
        "policies": [{"match": {"task_type": "code_review"}, "fanout": ["review.mcp"],
                      "budget": {"usd": 0.01, "tokens": 100_000}}],
    }  # fmt: skip
    env = await start_router_on(nursery, tmp_path, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=REVIEW.content)
        with trio.fail_after(60):
            events = [ev async for ev in c.events(st)]
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"], [ev.payload for ev in events if ev.type == "ERROR"]
    final = events[-2].payload
    assert {(f["file"], f["span"]) for f in final["result"]["findings"]} == {("tool/run.py", "4-4"),
                                                                             ("tool/run.py", "6-6")}
    assert all(p.startswith("review.mcp#") for f in final["result"]["findings"] for p in f["provenance"])
    assert final["telemetry"]["usd"] == 0.002
    assert final["telemetry"]["tokens"] > math.ceil((len(DIFF) + len(AFTER)) / 4)  # the tool's reported usage
