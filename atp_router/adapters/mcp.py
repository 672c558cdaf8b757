"""MCP next-hop: one tool of an MCP server as an agent (spec §14; the Model Context
Protocol over streamable HTTP, through the official ``mcp`` SDK 2.x).

RIB (``agents.<name>``)::

    remote:
      protocol: mcp
      url: https://tools.example/mcp      the server's streamable HTTP endpoint
      auth_env: MCP_TOKEN                 optional: the variable holding the credential
      cost_usd_per_call: 0.002            flat USD price of a call
      version: "2025-11-25"               optional: a handshake-era version forces the
                                          initialize handshake, a 2026-07-28+ one is
                                          adopted without a probe; default: probe
                                          server/discover, fall back to initialize
      options:
        tool: review_change               required: the MCP tool this agent is
        arguments: {profile: strict}      fixed arguments added to every call (they win)
        text_argument: task               where the task goes as text (see 3. below)
        auth: bearer | api_key            credential as ``Authorization: Bearer`` (default)
        header: X-API-Key                 or as this header (api_key)
        cost_in / cost_out                USD per 1M tokens of the usage the tool reports
        max_out_tokens: 1024              output tokens the estimate assumes

(``agents.<name>.options`` is read too; ``remote.options`` wins, as for A2A.
``remote.tls`` gives the CA and client certificate of an ``https://`` server.)

A call (:meth:`McpAdapter.stream`) opens one MCP connection and

1. negotiates the protocol (above) with an ``httpx2`` client that carries the
   credential, read from ``auth_env`` per call;
2. lists the tools (``tools/list``, at most :data:`MAX_LIST_PAGES` pages) until
   ``options.tool`` is found — the listing is the connection's; a tool not
   listed is ``EPROTO``;
3. maps the task onto the tool's ``inputSchema``
   (:func:`~atp_router.adapters.mcp_tool.tool_arguments`): the content fields the
   schema names go by name (``diff``, ``files``), else the task as text goes to
   ``options.text_argument`` or a text-like property; ``options.arguments`` are
   added; arguments missing, mistyped or not allowed by the schema are EPROTO
   and nothing is called;
4. calls it (``tools/call``) with the Agent Context Message unchanged in
   ``_meta.agent_context`` and, with tracing on, the leg's ``traceparent`` in
   ``_meta``;
5. turns the result into an :class:`AgentReport`
   (:func:`~atp_router.adapters.mcp_tool.tool_report`): structured findings,
   else the text parsed like a model's review, or the answer of another task.

Everything the server sends is bounded: each HTTP answer to
:data:`MAX_RESPONSE_BYTES` (an answer past it is EPROTO), the listing to
:data:`MAX_LIST_PAGES` pages, the text and findings kept to
:data:`~atp_router.adapters.mcp_tool.MAX_TEXT_CHARS` and
:data:`~atp_router.adapters.mcp_tool.MAX_FINDINGS`.

Errors (``AgentError``; reasons quote the server at most 300 characters, with
the credential and the Agent Context's secrets masked)::

    credential variable unset                    EAGENTDOWN
    connect failure, transport fault             EAGENTDOWN
    HTTP error answer                            per atp_router.adapters.http.code_of_status
                                                 (5xx, 429, 401/403/404: EAGENTDOWN with
                                                 retry_after_ms; 408: ETIMEOUT)
    no result within timeout_ms, read timeout    ETIMEOUT
    tool not listed, arguments not fitting       EPROTO (nothing is called)
    result isError: true                         EAGENTDOWN: the tool failed
    JSON-RPC -32700 -32600 -32601 -32602
             -32020 -32022                       EPROTO (parse, request, method, params,
                                                 header mismatch, protocol version)
    JSON-RPC -32001 (request timeout)            ETIMEOUT
    other JSON-RPC errors (-32603, -32000, ...)  EAGENTDOWN
    malformed result, an answer over
    MAX_RESPONSE_BYTES, structuredContent outside
    its outputSchema, a tool asking for input    EPROTO

The adapter's own deadline is ``timeout_ms`` less :data:`DEADLINE_MARGIN_MS`, so
it ends a slow call before the router's deadline does and can say what the call
cost.

Cost: usage is what the tool reports — the result's ``_meta.usage`` or
``structuredContent.usage`` (``input_tokens``/``output_tokens``,
``prompt_tokens``/``completion_tokens`` or ``in_tokens``/``out_tokens``) — else
chars/4 of the arguments sent and of the text received. With ``cost_in`` /
``cost_out`` a call costs that usage at those prices, else the flat
``cost_usd_per_call``; a USD amount the server states is not taken. A call is
charged once the tool ran — its result arrived (``isError`` too) or it reported
progress; one that fails after that yields one LOG fragment ``{"tool", "error"}``
with the charge before it raises. A call that never reached the tool (not
listed, arguments refused, a JSON-RPC error, the server down) costs nothing.

Fragments: the FINAL alone. The SDK holds a call inside its task groups, and an
async generator must not yield inside a task group (trio would deliver the
group's cancellation to the consumer), so nothing is streamed while the tool
runs; its progress notifications only tell the adapter the tool is running.
For the same reason each call has its own connection: a session kept between
calls needs a task of its own to live in, which a next-hop does not have.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import httpx2
import mcp
import mcp_types
import pydantic
import trio
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from atp_router.adapters.base import (
    Fragment,
    Prompt,
    ProviderAdapter,
    estimate_tokens,
    usd_micros,
    usd_micros_ceil,
)
from atp_router.adapters.context import forwarded_context
from atp_router.adapters.http import (
    DETAIL_CHARS,
    HTTPNextHop,
    code_of_status,
    env_secret,
    retry_after_ms,
)
from atp_router.adapters.mcp_tool import tool_arguments, tool_report
from atp_router.observability import tracing
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = ["DEADLINE_MARGIN_MS", "MAX_LIST_PAGES", "MAX_RESPONSE_BYTES", "OPTIONS", "RPC_CODES", "McpAdapter",
           "from_spec"]

#: Pages of ``tools/list`` read looking for the tool (a server that pages forever stops here).
MAX_LIST_PAGES = 20
#: Bytes of one HTTP answer of the server read at most (the SDK's own bound on one SSE event).
MAX_RESPONSE_BYTES = 1024 * 1024
#: How much earlier than ``timeout_ms`` the adapter ends a call itself (at most half of it), ms.
DEADLINE_MARGIN_MS = 100

#: JSON-RPC error code → ATP error (anything else: EAGENTDOWN).
RPC_CODES: dict[int, ErrorCode] = {
    mcp_types.PARSE_ERROR: ErrorCode.EPROTO,
    mcp_types.INVALID_REQUEST: ErrorCode.EPROTO,
    mcp_types.METHOD_NOT_FOUND: ErrorCode.EPROTO,
    mcp_types.INVALID_PARAMS: ErrorCode.EPROTO,
    mcp_types.HEADER_MISMATCH: ErrorCode.EPROTO,
    mcp_types.UNSUPPORTED_PROTOCOL_VERSION: ErrorCode.EPROTO,
    mcp_types.REQUEST_TIMEOUT: ErrorCode.ETIMEOUT,
}
#: What the SDK's transport answers in place of an HTTP error status (the status says more).
_HTTP_STANDINS = frozenset({"Server returned an error response", "Not Found", "Session terminated"})


@dataclass
class _Run:
    """What one call saw: HTTP error statuses (with their Retry-After, ms), an
    answer over :data:`MAX_RESPONSE_BYTES`, the argument characters sent, and
    whether the tool ran (a result or progress)."""

    statuses: list[tuple[int, int | None]] = field(default_factory=list)
    too_large: bool = False
    in_chars: int = 0
    ran: bool = False

    async def on_response(self, response: httpx2.Response) -> None:
        if response.status_code >= 400:
            self.statuses.append((response.status_code, retry_after_ms(dict(response.headers))))

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.ran = True


class McpAdapter(HTTPNextHop):
    """One tool of an MCP server as a next-hop (see the module docstring).

    ``url`` is the streamable HTTP endpoint; ``tool`` the tool's name;
    ``arguments`` fixed arguments sent with every call; ``text_argument`` the
    property that takes the task as text. ``version``: None probes
    ``server/discover`` and falls back to ``initialize``; a handshake-era version
    (``2025-11-25``) uses ``initialize``; a 2026-07-28+ version is adopted as is.
    ``auth_env`` names the credential's variable, sent as ``Authorization:
    Bearer`` (``auth="bearer"``) or as header ``header`` (``auth="api_key"``).
    ``cost_usd_per_call`` is the flat price (USD) unless ``cost_in``/``cost_out``
    (USD per 1M tokens) price the usage; ``max_out_tokens`` the output tokens the
    estimate assumes; ``timeout_ms`` bounds the whole call. Raises ``ValueError``
    ``<field>: <reason>`` for a value it cannot serve.
    """

    def __init__(
        self,
        name: str,
        *,
        url: str,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        text_argument: str | None = None,
        version: str | None = None,
        auth_env: str | None = None,
        auth: str = "bearer",
        header: str | None = None,
        cost_usd_per_call: float = 0.0,
        cost_in: float = 0.0,
        cost_out: float = 0.0,
        max_out_tokens: int = 1024,
        timeout_ms: int = 60_000,
        strengths: Iterable[str] = (),
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"remote.url: expected an http(s) URL, got {url!r}")
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS + MODERN_PROTOCOL_VERSIONS:
            known = ", ".join(HANDSHAKE_PROTOCOL_VERSIONS + MODERN_PROTOCOL_VERSIONS)
            raise ValueError(f"remote.version: expected an MCP protocol version ({known}), got {version!r}")
        if not tool:
            raise ValueError("options.tool: required (the name of the MCP tool to call)")
        if auth not in ("bearer", "api_key"):
            raise ValueError(f"options.auth: expected 'bearer' or 'api_key', got {auth!r}")
        if header is not None and auth != "api_key":
            raise ValueError("options.header: only meaningful with options.auth: api_key")
        for key, cost in (("remote.cost_usd_per_call", cost_usd_per_call), ("options.cost_in", cost_in),
                          ("options.cost_out", cost_out)):
            if cost < 0:
                raise ValueError(f"{key}: must be >= 0, got {cost}")
        if max_out_tokens <= 0:
            raise ValueError(f"options.max_out_tokens: must be > 0, got {max_out_tokens}")
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms: must be > 0, got {timeout_ms}")
        self.name = name
        self.url = url
        self.tool = tool
        self.fixed = dict(arguments or {})
        self.text_argument = text_argument
        self.mode = "auto" if version is None else "legacy" if version in HANDSHAKE_PROTOCOL_VERSIONS else version
        self.auth_env = auth_env
        self.auth = auth
        self.header = header or ("X-API-Key" if auth == "api_key" else "Authorization")
        self.cost_in = cost_in
        self.cost_out = cost_out
        self.max_out_tokens = max_out_tokens
        self.strengths = list(strengths)
        self._flat_micros = usd_micros_ceil(cost_usd_per_call)
        self._init_http(timeout_ms=timeout_ms, transport=None)

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=list(self.strengths), tools=[self.tool])

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight (spec §5.2): input tokens = chars/4 of the task (content and
        instruction; the tool's schema is not known before the call), output =
        ``max_out_tokens``; USD = that at ``cost_in``/``cost_out``, else the flat price."""
        chars = len(json.dumps(prompt.content, ensure_ascii=False)) + len(prompt.instruction)
        in_tokens = estimate_tokens(chars)
        micros = self._price(in_tokens, self.max_out_tokens)
        return CostEstimate(in_tokens=in_tokens, out_tokens=self.max_out_tokens, usd=micros / 1_000_000)

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """One FINAL :class:`AgentReport` with the call's usage (tokens, USD micros),
        or — when the call fails after the tool ran — one LOG fragment with the
        charge, then the ``AgentError`` of the module docstring's table."""
        t0 = trio.current_time()
        run = _Run()
        secrets: frozenset[str] = frozenset()
        error: AgentError | None = None
        try:
            context, secrets = forwarded_context(prompt.task)
            headers, credential = self._headers()
            secrets |= credential
            result = await self._call(prompt, context, headers, run)
            answer = tool_report(result, prompt, tool=self.tool, secrets=secrets)
        except AgentError as e:
            error = self._fail(e, t0, secrets)
        if error is not None:
            if run.ran:
                usage = self._usage(estimate_tokens(run.in_chars), 0)
                content = {"tool": self.tool, "error": error.code.value}
                yield Fragment(type=PayloadType.LOG, content=content, usage=usage)
            raise error
        self._succeeded(t0)
        usage = self._usage(estimate_tokens(run.in_chars), answer.out_chars, answer.reported)
        yield Fragment(type=PayloadType.FINAL, content=answer.report, usage=usage)

    # -- the call ------------------------------------------------------------------

    async def _call(self, prompt: Prompt, context: Any, headers: dict[str, str], run: _Run) -> mcp_types.CallToolResult:
        """The tool's result, or AgentError. Failures arrive from the SDK's task
        groups as (nested) exception groups: cancellation passes through as it
        came, anything else is mapped (:func:`_agent_error`)."""
        margin_ms = min(DEADLINE_MARGIN_MS, self.timeout_ms // 2)
        try:
            with trio.fail_after((self.timeout_ms - margin_ms) / 1000):
                return await self._exchange(prompt, context, headers, run)
        except trio.TooSlowError:
            reason = f"no result from tool {self.tool!r} within {self.timeout_ms} ms"
            raise AgentError(ErrorCode.ETIMEOUT, reason) from None
        except BaseException as e:
            error = _agent_error(e, run, self.url, self.timeout_ms)
            if error is None:
                raise
            raise error from None

    async def _exchange(self, prompt: Prompt, context: Any, headers: dict[str, str],
                        run: _Run) -> mcp_types.CallToolResult:  # fmt: skip
        t = self.timeout_ms / 1000
        network = httpx2.AsyncHTTPTransport(verify=self._tls if self._tls is not None else True)
        http = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(t, connect=min(t, 10.0)),
            transport=_Bounded(network, run),
            event_hooks={"response": [run.on_response]},
        )
        client = mcp.Client(streamable_http_client(self.url, http_client=http), mode=self.mode, cache=None,
                            client_info=mcp_types.Implementation(name="atp-router", version="1"))
        async with http, client:
            tool = await self._find_tool(client)
            arguments = self.arguments(prompt, tool)
            run.in_chars = len(json.dumps(arguments, ensure_ascii=False))
            meta: dict[str, Any] = dict(tracing.outbound(self.name))
            if context is not None:
                meta["agent_context"] = context
            result = await client.call_tool(self.tool, arguments, progress_callback=run.on_progress,
                                            meta=cast(mcp_types.RequestParamsMeta, meta) if meta else None)
            run.ran = True
            return result

    async def _find_tool(self, client: mcp.Client) -> mcp_types.Tool:
        """``self.tool`` from the server's listing; EPROTO when it is not listed."""
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                if tool.name == self.tool:
                    return tool
            cursor = page.next_cursor
            if cursor is None:
                break
        raise AgentError(ErrorCode.EPROTO, f"the MCP server at {self.url} lists no tool {self.tool!r}")

    # -- request -------------------------------------------------------------------

    def arguments(self, prompt: Prompt, tool: mcp_types.Tool) -> dict[str, Any]:
        """The ``tools/call`` arguments for ``prompt`` under ``tool``'s schema
        (:func:`~atp_router.adapters.mcp_tool.tool_arguments`, with this agent's
        fixed arguments and text argument). Raises AgentError(EPROTO) when the
        task does not fit."""
        return tool_arguments(prompt, tool, fixed=self.fixed, text_argument=self.text_argument)

    def _headers(self) -> tuple[dict[str, str], frozenset[str]]:
        """The credential header (read now: a rotated secret needs no reload) and
        the credential, to mask in reasons. Raises AgentError(EAGENTDOWN) when
        the variable is unset."""
        if self.auth_env is None:
            return {}, frozenset()
        secret = env_secret(self.auth_env)
        return {self.header: f"Bearer {secret}" if self.auth == "bearer" else secret}, frozenset({secret})

    # -- accounting ----------------------------------------------------------------

    def _price(self, in_tokens: int, out_tokens: int) -> int:
        if self.cost_in or self.cost_out:
            return usd_micros(in_tokens, out_tokens, self.cost_in, self.cost_out)
        return self._flat_micros


class _TooLarge(Exception):
    """An answer of the server passed :data:`MAX_RESPONSE_BYTES`."""


class _Bounded(httpx2.AsyncBaseTransport):
    """``inner`` with every answer's body cut off (:class:`_TooLarge`, noted in
    ``run``) past :data:`MAX_RESPONSE_BYTES`: the SDK reads a JSON answer whole."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, run: _Run) -> None:
        self._inner = inner
        self._run = run

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        stream = response.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        response.stream = _BoundedStream(stream, self._run)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, run: _Run) -> None:
        self._inner = inner
        self._run = run

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self._inner:
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                self._run.too_large = True
                raise _TooLarge(f"answer over {MAX_RESPONSE_BYTES} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _agent_error(exc: BaseException, run: _Run, url: str, timeout_ms: int) -> AgentError | None:
    """The AgentError for a failed exchange (module docstring's table), or None
    for what is not the next-hop's to answer for: a cancellation (any leaf that is
    not an ``Exception``) or an exception the SDK does not raise (a bug: it goes
    up as it is)."""
    leaves = _leaves(exc)
    if any(not isinstance(x, Exception) for x in leaves):
        return None
    for x in leaves:
        if isinstance(x, AgentError):
            return x
    if run.too_large:  # whatever the SDK made of the cut (a parse error, a closed stream)
        return AgentError(ErrorCode.EPROTO, f"{url} answered more than {MAX_RESPONSE_BYTES} bytes")
    x = leaves[0]
    if isinstance(x, MCPError) and x.message in _HTTP_STANDINS and run.statuses:
        status, hint = run.statuses[-1]
        code = code_of_status(status)
        return AgentError(code, f"HTTP {status} from {url}",
                          retry_after_ms=hint if code is ErrorCode.EAGENTDOWN else None)
    if isinstance(x, MCPError):
        return AgentError(RPC_CODES.get(x.code, ErrorCode.EAGENTDOWN),
                          f"MCP error {x.code}: {x.message[:DETAIL_CHARS]}")
    if isinstance(x, httpx2.ConnectTimeout | httpx2.ConnectError):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {url}: {x}",
                          timed_out=isinstance(x, httpx2.ConnectTimeout))
    if isinstance(x, httpx2.TimeoutException | TimeoutError):
        return AgentError(ErrorCode.ETIMEOUT, f"{type(x).__name__} after {timeout_ms} ms waiting for {url}")
    if isinstance(x, httpx2.HTTPError | OSError):
        return AgentError(ErrorCode.EAGENTDOWN, f"{type(x).__name__} talking to {url}: {str(x)[:DETAIL_CHARS]}")
    if isinstance(x, pydantic.ValidationError | RuntimeError):
        # A result outside the protocol or the tool's outputSchema, or a tool
        # that asks the router for input it cannot give.
        return AgentError(ErrorCode.EPROTO, f"unusable answer from {url}: {str(x)[:DETAIL_CHARS]}")
    return None


#: ``options`` an mcp agent accepts (``agent.options`` and ``remote.options`` merged).
OPTIONS: dict[str, tuple[type, ...]] = {
    "tool": (str,), "arguments": (dict,), "text_argument": (str,), "auth": (str,), "header": (str,),
    "cost_in": (int, float), "cost_out": (int, float), "max_out_tokens": (int,),
}  # fmt: skip


def from_spec(agent_name: str, agent: AgentSpec) -> ProviderAdapter:
    """The registry's factory for ``agents.<x>.remote.protocol: mcp`` (shape in
    the module docstring): ``remote.url``, ``version``, ``auth_env`` and
    ``cost_usd_per_call``; ``options`` (``agent.options`` and ``remote.options``,
    the latter winning) as in :data:`OPTIONS`, ``tool`` required; ``timeout_ms`` and
    ``strengths`` from the agent. Raises ``ValueError("<field>: <reason>")``: a
    wrong protocol, a non-http URL, ``remote.agent_id`` (an MCP server is
    addressed by URL, its agent by ``options.tool``), an unknown protocol version,
    an unknown, mistyped or missing option."""
    remote = agent.remote
    if remote is None or remote.protocol != "mcp":
        raise ValueError("remote.protocol: the MCP adapter serves remote.protocol mcp")
    if remote.agent_id is not None:
        raise ValueError("remote.agent_id: not used by MCP (options.tool names the tool the agent is)")
    opts: dict[str, Any] = {}
    for key, value in {**agent.options, **remote.options}.items():
        types = OPTIONS.get(key)
        if types is None:
            raise ValueError(f"options.{key}: unknown option for remote mcp (known: {', '.join(sorted(OPTIONS))})")
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join("mapping" if t is dict else t.__name__ for t in types)
            # The registry reports every RIB fault as a ValueError.
            raise ValueError(f"options.{key}: expected {names}, got {value!r:.80}")  # noqa: TRY004
        opts[key] = value
    if not opts.get("tool"):
        raise ValueError("options.tool: required (the name of the MCP tool this agent calls)")
    if any(not isinstance(k, str) for k in opts.get("arguments", {})):
        raise ValueError("options.arguments: argument names must be strings")
    return McpAdapter(agent_name, url=remote.url, version=remote.version, auth_env=remote.auth_env,
                      cost_usd_per_call=remote.cost_usd_per_call, timeout_ms=agent.timeout_ms,
                      strengths=agent.strengths, **opts)
