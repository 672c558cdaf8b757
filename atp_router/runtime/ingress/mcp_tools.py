"""The router's MCP tools (:mod:`atp_router.runtime.ingress.mcp` has the route and
its rules): a low-level :class:`mcp.server.lowlevel.Server` whose tool arguments and
results are msgspec Structs (their JSON Schemas are the tools' ``inputSchema`` and
``outputSchema``), behind the SDK's stateless streamable HTTP session manager.

Arguments are decoded strictly (an unknown or mistyped field is an ``EPROTO``
tool error naming it). Every result carries the text a model reads
(``content``) and the same data structured (``structuredContent``):

* ``review_change``, ``route_task`` → :class:`StreamAnswer`: ``stream_id``,
  ``session_id``, ``policy``, ``usd`` (float USD), ``tokens``, ``latency_ms`` and
  ``final`` (the FINAL's content, spec §7.3: findings with provenance, consensus,
  answers, telemetry with the signed usage); the text is the findings as
  ``- <file>:<span> <severity>: <claim> [<provenance>]`` lines (as the OpenAI
  ingress answers) and a cost line;
* ``list_policies`` → :class:`PolicyList`;
* a refusal or a stream without a FINAL → ``isError: true``, the text
  ``<code>: <reason>`` (and ``retry after <n> ms`` when the router gave a hint),
  ``structuredContent`` :class:`ToolError`.

This module imports the MCP SDK: :mod:`atp_router.runtime.ingress.mcp` imports it on
first use, in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import mcp_types as types
import msgspec
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from msgspec import Meta, Struct

from atp_router.consensus.types import FinalResult
from atp_router.runtime.dataplane.plan import parse_off_loop
from atp_router.runtime.dataplane.stream import StreamCtx
from atp_router.runtime.ingress.openai import (
    CODE_REVIEW,
    StreamOutcome,
    completion_text,
    error_of,
)
from atp_router.runtime.ingress.openai_models import RibView, visible_policies
from atp_router.runtime.ingress.repo_files import complete_from_repo
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity
from atp_router.task.change import languages_of
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, QoS

__all__ = ["TOOLS", "PolicyList", "ReviewChange", "RouteTask", "StreamAnswer", "ToolError", "session_manager"]

T = TypeVar("T")
S = TypeVar("S")

#: Characters of a ``repo`` label (a match key of the task meta).
_REPO_CHARS = 200


class ReviewChange(Struct, forbid_unknown_fields=True, kw_only=True):
    """``review_change``'s arguments: ``diff`` a unified diff (``git diff``);
    ``files`` path → after-diff text of the files it touches (omitted: read from
    the router's ``--repo`` for the next-hops that need them); ``repo`` the
    repository's name, a match key policies may route on; ``budget`` this
    review's limit (float USD, tokens; the tenant's own still applies);
    ``idempotency_key`` re-opens the same review instead of paying twice."""

    diff: Annotated[str, Meta(min_length=1)]
    files: dict[str, str] | None = None
    repo: Annotated[str, Meta(max_length=_REPO_CHARS)] | None = None
    budget: Budget | None = None
    idempotency_key: str | None = None


class RouteTask(Struct, forbid_unknown_fields=True, kw_only=True):
    """``route_task``'s arguments, those of ``POST /v1/streams`` (spec §22): ``task``
    the task meta (``task_type`` and the policies' match keys), ``content`` the task
    body (:mod:`atp_router.task.body`), ``budget``, ``qos``, ``idempotency_key``."""

    task: dict[str, Any]
    content: dict[str, Any]
    budget: Budget | None = None
    qos: QoS | None = None
    idempotency_key: str | None = None


class StreamAnswer(Struct, kw_only=True):
    """A finished stream (module docstring); ``usd`` float USD, ``latency_ms`` SYN → FINAL."""

    stream_id: str
    session_id: str
    policy: str
    usd: float
    tokens: int
    latency_ms: float
    final: FinalResult


class PolicyInfo(Struct, kw_only=True):
    """One RIB policy a tenant's tasks can reach: its ``name``, the task types its
    match pins that the tenant may use (``[]``: it pins none) and its ``match`` as written."""

    name: str
    task_types: list[str]
    match: str


class PolicyList(Struct, kw_only=True):
    """``list_policies``: the running RIB's ``generation`` and the policies the caller's
    task types reach (as ``GET /v1/models`` lists them), in RIB order."""

    generation: int
    policies: list[PolicyInfo]


class ToolError(Struct, kw_only=True, omit_defaults=True):
    """A tool call the router refused or that ended without a FINAL: the spec §10
    ``code``, its ``reason``, ``retry_after_ms`` when retrying later may succeed,
    and the ``stream_id`` when a stream was opened."""

    code: str
    reason: str
    retry_after_ms: int | None = None
    stream_id: str | None = None


def _schema(t: type) -> dict[str, Any]:
    """``t``'s JSON Schema with the object at its root (MCP wants ``type: object``
    there), its ``$defs`` kept for the references inside."""
    (ref,), defs = msgspec.json.schema_components([t], ref_template="#/$defs/{name}")
    root = dict(defs.pop(t.__name__)) if "$ref" in ref else dict(ref)
    if defs:
        root["$defs"] = defs
    return root


#: The tools ``tools/list`` answers (``proto/mcp-tools.json``).
TOOLS: list[types.Tool] = [
    types.Tool(name="review_change", title="Review a code change",
               description="Review a unified diff through the router's code-review policy (cheap analysers "
                           "first, reviewers on escalation, under the budget): merged findings with "
                           "file:line, severity and provenance, the cost and the stream id.",
               input_schema=_schema(ReviewChange), output_schema=_schema(StreamAnswer)),
    types.Tool(name="route_task", title="Route a task",
               description="Route any task type this key may use through the router's policies, as "
                           "POST /v1/streams opens it: the merged result (FINAL), the cost and the stream id.",
               input_schema=_schema(RouteTask), output_schema=_schema(StreamAnswer)),
    types.Tool(name="list_policies", title="List the routing policies",
               description="The routing policies this key's task types reach, with the task types each pins.",
               input_schema={"type": "object", "properties": {}, "additionalProperties": False},
               output_schema=_schema(PolicyList)),
]


class _Tools:
    """The tool handlers of one router; ``caller()`` gives the request's identity."""

    def __init__(self, router: Router, caller: Callable[[], Identity]) -> None:
        self.router, self.caller = router, caller
        self.view = RibView()

    async def list_tools(self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def call_tool(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        identity = self.caller()
        try:
            if params.name == "review_change":
                return await self._review(ctx, identity, _args(ReviewChange, params.arguments))
            if params.name == "route_task":
                return await self._route(ctx, identity, _args(RouteTask, params.arguments))
            if params.name == "list_policies":
                _args(_NoArgs, params.arguments)
                return _structured(self._policies(identity), _policies_text)
            raise ATPError(ErrorCode.EPROTO, f"unknown tool {params.name[:100]!r} (tools/list names them)")
        except ATPError as e:
            return _error(e)

    async def _review(self, ctx: ServerRequestContext[Any], identity: Identity,
                      args: ReviewChange) -> types.CallToolResult:
        change = await parse_off_loop(args.diff)
        if not change.files:
            raise ATPError(ErrorCode.EPROTO, "diff: not a unified diff (git diff output)")
        meta: dict[str, Any] = {"task_type": CODE_REVIEW, "languages": languages_of(f.path for f in change.files),
                                "diff_loc": change.diff_loc}
        if args.repo is not None:
            meta["repo"] = args.repo
        content: dict[str, Any] = {"diff": args.diff}
        if args.files is not None:
            content["files"] = args.files
        else:
            refused = await complete_from_repo(self.router, meta, content, change)
            if refused is not None:
                raise ATPError(ErrorCode.EPROTO, refused)
        sctx = await self.router.open_stream_async(task=meta, content=content, budget=args.budget, qos=None,
                                                   window=None, idempotency_key=args.idempotency_key,
                                                   identity=identity, change=change)
        return await self._follow(ctx, sctx)

    async def _route(self, ctx: ServerRequestContext[Any], identity: Identity,
                     args: RouteTask) -> types.CallToolResult:
        sctx = await self.router.open_stream_async(task=args.task, content=args.content, budget=args.budget,
                                                   qos=args.qos, window=None, idempotency_key=args.idempotency_key,
                                                   identity=identity)
        return await self._follow(ctx, sctx)

    async def _follow(self, ctx: ServerRequestContext[Any], sctx: StreamCtx) -> types.CallToolResult:
        """The stream's events to its end, with progress notifications on the way."""
        out, progress = StreamOutcome(), _Progress(ctx)
        hops = ", ".join(h.agent for h in sctx.route.next_hops)
        await progress.note(f"stream {sctx.stream_id} opened: policy {sctx.route.policy} → {hops}")
        sctx.attach()
        try:
            async for ev in sctx.log.follow():
                out.see(ev)
                note = _progress_note(ev)
                if note is not None:
                    await progress.note(note)
        finally:
            sctx.detach()
            if not sctx.log.closed and sctx.idempotency_key is None:
                # The MCP client went away (cancelled): a stream nobody can resume spends nothing more.
                self.router.stream_closed(sctx.stop(ErrorCode.EPREEMPT, "canceled: the MCP client went away"))
        if out.final is None:
            e = out.failure()
            return _error(e, stream_id=sctx.stream_id)
        t = out.final.telemetry
        answer = StreamAnswer(stream_id=sctx.stream_id, session_id=sctx.session_id, policy=str(sctx.route.policy),
                              usd=t.usd, tokens=t.tokens, latency_ms=t.latency_ms, final=out.final)
        return _structured(answer, _answer_text)

    def _policies(self, identity: Identity) -> PolicyList:
        spec = self.router.client_spec(identity.tenant)
        allowed = None if spec.task_types is None else list(spec.task_types)
        visible = visible_policies(self.view.refresh(self.router.gen.fib), allowed)
        return PolicyList(generation=self.router.gen.version, policies=[
            PolicyInfo(name=name, task_types=may, match=str(cm.source)) for name, cm, may in visible])


class _NoArgs(Struct, forbid_unknown_fields=True):
    pass


def _args(t: type[T], arguments: dict[str, Any] | None) -> T:
    """The tool's ``arguments`` as ``t``, strictly; :class:`ATPError` ``EPROTO`` naming the field."""
    try:
        return msgspec.convert(arguments or {}, t, strict=True)
    except msgspec.ValidationError as e:
        raise ATPError(ErrorCode.EPROTO, f"bad arguments: {e}") from None


class _Progress:
    """``notifications/progress`` for the call (nothing when the client gave no token)."""

    def __init__(self, ctx: ServerRequestContext[Any]) -> None:
        self.ctx, self.n = ctx, 0

    async def note(self, message: str) -> None:
        self.n += 1
        await self.ctx.session.report_progress(self.n, None, message)


def _progress_note(ev: Any) -> str | None:
    """What an event says worth a progress notification: a next-hop's report, an ERROR."""
    content = ev.frame.payload.content if ev.frame.payload is not None else None
    if ev.type == "PARTIAL" and isinstance(content, dict) and "report" in content:
        report = content.get("report")
        n = len(report.get("findings") or []) if isinstance(report, dict) else 0
        return f"{str(content.get('agent'))[:100]} reported {n} finding(s)"
    err = error_of(ev.frame) if ev.type == "ERROR" else None
    return f"ERROR {err[0]}: {err[1][:300]}" if err is not None else None


def _answer_text(a: StreamAnswer) -> str:
    return (f"{completion_text(a.final.result)}\n\ncost: ${a.usd:.6f}, {a.tokens} tokens, "
            f"{a.latency_ms:.0f} ms (stream {a.stream_id}, policy {a.policy})")


def _policies_text(p: PolicyList) -> str:
    lines = [f"- {x.name}: task types {', '.join(x.task_types) or '(any)'}; match {x.match}" for x in p.policies]
    return f"RIB generation {p.generation}, {len(p.policies)} policies:\n" + "\n".join(lines)


def _structured(data: S, text: Callable[[S], str]) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text(data))],
                                structured_content=msgspec.to_builtins(data))


def _error(e: ATPError, stream_id: str | None = None) -> types.CallToolResult:
    err = ToolError(code=str(e.code), reason=e.reason, retry_after_ms=e.retry_after_ms, stream_id=stream_id)
    hint = f" (retry after {e.retry_after_ms} ms)" if e.retry_after_ms is not None else ""
    return types.CallToolResult(content=[types.TextContent(text=f"{e.code}: {e.reason}{hint}")],
                                structured_content=msgspec.to_builtins(err), is_error=True)


def session_manager(router: Router, caller: Callable[[], Identity]) -> StreamableHTTPSessionManager:
    """The SDK's stateless streamable HTTP session manager serving ``router``'s tools;
    ``caller()`` gives the identity of the request a tool runs for."""
    tools = _Tools(router, caller)
    server: Server[Any] = Server("atp-router", version="0.1.0", title="ATP router",
                                 instructions="Governed code review and task routing: review_change reviews "
                                              "a diff under a budget; route_task runs any task type; "
                                              "list_policies lists the routing policies.",
                                 on_list_tools=tools.list_tools, on_call_tool=tools.call_tool)
    return StreamableHTTPSessionManager(server, stateless=True,
                                        max_request_body_size=router.config.max_body_bytes)
