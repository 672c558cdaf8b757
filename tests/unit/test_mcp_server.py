"""The router as an MCP server (issue 24 item 1; ``atp_router/runtime/ingress/mcp.py``),
driven with the official MCP client (``mcp.Client`` over the SDK's streamable HTTP
transport) against a real router in process.

The code-review next-hop is the real ``bandit`` analyser in its sandbox; the chat
next-hop is a :class:`~atp_router.adapters.testing.ScriptedAdapter` (RIB ``tool:
scripted``) that streams prose as a model does. Every call is checked against what
the router itself recorded for the stream (the FINAL its events endpoint gives).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import httpx2
import mcp
import pytest
from mcp.client.streamable_http import streamable_http_client

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import scripted_agent

KEYS = {"alice": "alice-key", "bob": "bob-key"}
BANDIT = {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"]}
DIFF = """--- a/app.py
+++ b/app.py
@@ -1,1 +1,3 @@
 import subprocess
+def run(cmd):
+    return subprocess.call(cmd, shell=True)
"""
FILES = {"app.py": "import subprocess\ndef run(cmd):\n    return subprocess.call(cmd, shell=True)\n"}
RIB = {
    "agents": {"bandit": BANDIT, "writer": scripted_agent()},
    "policies": [
        {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["bandit"]},
        {"name": "chat", "match": {"task_type": "chat"}, "fanout": ["writer"]},
    ],
    "clients": {"alice": {}, "bob": {"task_types": ["chat"]}},
}


@pytest.fixture
async def env(nursery, tmp_path, scripted):
    scripted["writer"] = ScriptedAdapter.returning("writer", partials=["Hello", ", ", "world."],
                                                   summary="Hello, world.",
                                                   usage=Usage(in_tokens=30, out_tokens=12, usd_micros=420))
    return await start_router_on(nursery, tmp_path, RIB, client_tokens=KEYS, max_body_bytes=64 * 1024)


def session(env: Any, key: str = KEYS["alice"], mode: str = "auto") -> mcp.Client:
    """The official MCP client on the router's ``/mcp`` with ``key`` as its bearer
    token; ``mode`` "auto" negotiates the 2026-07-28 protocol, "legacy" the
    ``initialize`` handshake of 2025-11-25 (the SDK serves them on different paths)."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(60.0))
    return mcp.Client(streamable_http_client(env.url + "/mcp", http_client=http), mode=mode)


async def events_final(env: Any, stream_id: str) -> dict[str, Any]:
    """The stream's FINAL as the router's own events endpoint gives it."""
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as c:
        r = await c.get(f"/v1/streams/{stream_id}/events", headers={"Authorization": f"Bearer {KEYS['alice']}"})
    finals = [block for block in r.text.split("\n\n") if "\nevent: FINAL\n" in block]
    assert len(finals) == 1, r.text[:2000]
    return json.loads(finals[0].split("data: ", 1)[1])["payload"]["content"]


async def test_an_mcp_client_lists_the_tools_and_reviews_a_change_with_findings_and_cost(env):
    notes: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        notes.append((value, message))

    async with session(env) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"review_change", "route_task", "list_policies"}
        assert tools["review_change"].input_schema["required"] == ["diff"]
        assert tools["review_change"].output_schema is not None
        result = await client.call_tool("review_change", {"diff": DIFF, "files": FILES, "repo": "shop"},
                                        progress_callback=progress)
    assert not result.is_error, result.content
    out = result.structured_content
    assert out["policy"] == "review"
    findings = out["final"]["result"]["findings"]
    assert any(f["file"] == "app.py" and f["span"].startswith("3") and any(p.startswith("bandit") for p in f["provenance"])
               for f in findings), findings
    text = result.content[0].text
    assert "app.py:3" in text and "cost: $" in text and out["stream_id"] in text
    # What the client was told is what the router recorded for the stream.
    recorded = await events_final(env, out["stream_id"])
    assert recorded["result"]["findings"] == findings
    assert out["usd"] == recorded["telemetry"]["usd"] and out["tokens"] == recorded["telemetry"]["tokens"]
    # Progress: the route, then the analyser's report, in increasing order.
    assert [v for v, _ in notes] == sorted(v for v, _ in notes) and len(notes) >= 2, notes
    assert "policy review" in (notes[0][1] or "") and any("bandit reported" in (m or "") for _, m in notes)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_route_task_runs_any_task_type_the_tenant_may_use(env, mode):
    async with session(env, KEYS["bob"], mode) as client:
        chat = await client.call_tool("route_task", {"task": {"task_type": "chat"},
                                                     "content": {"messages": [{"role": "user", "content": "hi"}]}})
        review = await client.call_tool("review_change", {"diff": DIFF, "files": FILES})
        listed = await client.call_tool("list_policies", {})
    assert not chat.is_error, chat.content
    assert chat.structured_content["final"]["result"]["answers"][0]["text"] == "Hello, world."
    assert chat.structured_content["usd"] == pytest.approx(0.00042)
    # bob's key may open chat only: the review is refused by the router's own scope (spec §11).
    assert review.is_error and review.structured_content["code"] == "ESEC", review.content
    assert [p["name"] for p in listed.structured_content["policies"]] == ["chat"]


async def test_bad_arguments_and_unknown_tools_are_tool_errors_naming_the_field(env):
    async with session(env) as client:
        extra = await client.call_tool("review_change", {"diff": DIFF, "files": FILES, "shell": "rm -rf /"})
        wrong = await client.call_tool("review_change", {"diff": 42})
        not_diff = await client.call_tool("review_change", {"diff": "just words"})
        unknown = await client.call_tool("format_disk", {})
    for r in (extra, wrong, not_diff, unknown):
        assert r.is_error and r.structured_content["code"] == "EPROTO", r.content
    assert "shell" in extra.content[0].text
    assert "$.diff" in wrong.content[0].text
    assert "not a unified diff" in not_diff.content[0].text


async def test_mcp_is_authenticated_and_bounded_like_every_ingress(env):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as c:
        anonymous = await c.post("/mcp", json=body, headers=accept)
        wrong = await c.post("/mcp", json=body, headers={**accept, "Authorization": "Bearer nope"})
        large = await c.post("/mcp", content=b"x" * (65 * 1024),
                             headers={**accept, "Authorization": f"Bearer {KEYS['alice']}",
                                      "Content-Type": "application/json"})
        get = await c.get("/mcp", headers={**accept, "Authorization": f"Bearer {KEYS['alice']}"})
        ok = await c.post("/mcp", json=body, headers={**accept, "Authorization": f"Bearer {KEYS['alice']}"})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "ESEC"
    assert "Bearer" in anonymous.headers["www-authenticate"]
    assert wrong.status_code == 401
    assert large.status_code == 413
    assert get.status_code == 405  # stateless: no server-initiated stream, no session to delete
    assert ok.status_code == 200, ok.text
    with pytest.raises(Exception):
        async with session(env, "nope") as client:
            await client.list_tools()
