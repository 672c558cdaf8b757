"""A real MCP server over streamable HTTP (the MCP next-hop peer), built with the
official SDK's ``MCPServer`` and served by uvicorn — the SDK's own
``streamable_http_app``: ``POST /mcp`` answering JSON-RPC as SSE or JSON, the
2026-07-28 ``server/discover`` probe and the 2025-11-25 ``initialize`` handshake.

``tests/unit/test_mcp_nexthop.py`` starts it as ``python mcp_server.py --port P``
and waits for ``GET /health``. ``--token T``: every request must carry
``Authorization: Bearer T``, else 401. ``--fail-calls STATUS``: a gateway in front
answers every ``tools/call`` with that HTTP status and ``Retry-After: 2`` (the
server is overloaded; discovery and ``tools/list`` still work). Tools, all
deterministic:

``review_change(diff, files)``
    Structured output ``{"findings": [...], "summary"}`` (an ``outputSchema``
    derived from the return type): reads each file line by line and reports
    ``os.system(`` (high) and a mutable default argument (medium). Reports its
    usage in the result's ``_meta.usage`` (``input_tokens``/``output_tokens``:
    characters / 4) when the review finds anything.
``lint_text(task)``
    Plain text content only: the findings of ``review_change`` as a JSON text,
    as a model-backed tool would answer, for a task sent as text.
``describe(task)``
    Prose: the word count and first line of ``task``, and the SHA-256 of the
    ``_meta.agent_context`` it received (canonical JSON), if any.
``explode(task)``
    Raises a ``ToolError``; the SDK answers ``isError: true`` with its message,
    which echoes the request's ``Authorization`` header (as a careless tool would).
``slow(task, seconds)``
    Reports progress twice, then sleeps ``seconds`` (default 30).
``flood(task, kib)``
    Hostile: ``kib`` KiB of text content and 3000 structured findings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_MUTABLE_DEFAULT = re.compile(r"def \w+\(.*=\s*(\[\]|\{\}|set\(\))")


class Finding(BaseModel):
    file: str
    line: int
    severity: str
    claim: str
    confidence: float


class Review(BaseModel):
    findings: list[Finding]
    summary: str


def _review(files: dict[str, str]) -> Review:
    found: list[Finding] = []
    for path, text in sorted(files.items()):
        for n, line in enumerate(text.splitlines(), 1):
            if "os.system(" in line:
                found.append(Finding(file=path, line=n, severity="high", claim="os.system runs a shell command",
                                     confidence=0.9))
            if _MUTABLE_DEFAULT.search(line):
                found.append(Finding(file=path, line=n, severity="medium", claim="mutable default argument",
                                     confidence=0.8))
    return Review(findings=found, summary=f"mcp-review: {len(found)} finding(s) in {len(files)} file(s)")


server: MCPServer[Any] = MCPServer("atp-test-mcp")


@server.tool()
def review_change(diff: str, files: dict[str, str]) -> CallToolResult:
    """Review a change: structured findings."""
    review = _review(files)
    structured = review.model_dump(mode="json")
    meta = None
    if review.findings:
        chars_in = len(diff) + sum(len(t) for t in files.values())
        meta = {"usage": {"input_tokens": -(-chars_in // 4), "output_tokens": -(-len(review.model_dump_json()) // 4)}}
    return CallToolResult(content=[TextContent(text=review.summary)], structured_content=structured, _meta=meta)


@server.tool()
def lint_text(task: str) -> str:
    """Review a change given as text; answers JSON findings as text."""
    files: dict[str, str] = {}
    path = None
    for line in task.splitlines():
        m = re.match(r"^### (\S+) \(", line)
        if m:
            path = m.group(1)
            continue
        m = re.match(r"^ *(\d+) [+ ] (.*)$", line)
        if m and path is not None:
            lines = files.setdefault(path, "").splitlines()
            lines += [""] * (int(m.group(1)) - 1 - len(lines)) + [m.group(2)]
            files[path] = "\n".join(lines) + "\n"
    return _review(files).model_dump_json()


@server.tool()
def describe(task: str, ctx: Context) -> str:
    """Describe a text: words and first line."""
    first = task.strip().splitlines()[0] if task.strip() else ""
    out = f"{len(task.split())} words; first line: {first}"
    meta = ctx.request_context.meta or {}
    if "agent_context" in meta:
        canonical = json.dumps(meta["agent_context"], sort_keys=True, separators=(",", ":"))
        out += f"; agent_context sha256:{hashlib.sha256(canonical.encode()).hexdigest()}"
    return out


@server.tool()
def explode(task: str, ctx: Context) -> str:
    """Always fails."""
    raise ToolError(f"backend exploded; request carried {(ctx.headers or {}).get('authorization')}")


@server.tool()
async def slow(task: str, ctx: Context, seconds: float = 30.0) -> str:
    """Takes ``seconds``."""
    await ctx.report_progress(1, 3, "started")
    await ctx.report_progress(2, 3, "thinking")
    await anyio.sleep(seconds)
    return "done"


@server.tool(structured_output=False)
def flood(task: str, kib: int = 400) -> CallToolResult:
    """Answers far too much."""
    many = [{"file": "tool/run.py", "line": 1, "severity": "low", "claim": f"noise {i}", "confidence": 0.1}
            for i in range(3000)]
    return CallToolResult(content=[TextContent(text="x" * (kib * 1024))], structured_content={"findings": many})


class Gateway:
    """In front of the MCP app: 401 for a request without ``Authorization: Bearer
    <token>`` (with ``token``); ``fail_status`` for every ``tools/call`` (with it)."""

    def __init__(self, app: ASGIApp, token: str | None, fail_status: int | None) -> None:
        self.app = app
        self.token = token
        self.fail_status = fail_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        if self.token is not None and auth != f"Bearer {self.token}":
            await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.fail_status is not None and b'"tools/call"' in body:
            await PlainTextResponse("overloaded", status_code=self.fail_status,
                                    headers={"retry-after": "2"})(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token")
    ap.add_argument("--fail-calls", type=int)
    args = ap.parse_args()

    @server.custom_route("/health", methods=["GET"])
    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app: Starlette = server.streamable_http_app()
    uvicorn.run(Gateway(app, args.token, args.fail_calls), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
