"""The router as an MCP server (issue 24 item 1): the Model Context Protocol's
streamable HTTP transport at ``POST /mcp``, served by the official ``mcp`` SDK
(:mod:`atp_router.runtime.ingress.mcp_tools` has the tools).

An MCP client (an editor, an agent) calls the router's governed work as tools:

=====================  ==========================================================
``review_change``      a code review of a unified diff (``files``: path → the
                       after-diff text; without them, read from the router's
                       ``--repo`` when a next-hop needs them): the merged
                       findings with file:line, the cost and the stream id
``route_task``         any task type the tenant may use, as ``POST /v1/streams``
                       opens it (``task``, ``content``, ``budget``, ``qos``,
                       ``idempotency_key``): the FINAL
``list_policies``      the RIB policies the tenant's task types reach
=====================  ==========================================================

Each tool call is a stream opened with :meth:`Router.open_stream
<atp_router.runtime.router.Router.open_stream>` — nothing here is a second data
plane: the tenant's scopes, quotas, budgets and QoS, the policy's fan-out,
escalation and consensus, the audit trail all apply. While the stream runs, a
client that asked for progress (a ``progressToken``) gets a
``notifications/progress`` at the route and at each next-hop's report or error.
A call the router refuses or that ends without a FINAL is a tool result with
``isError: true`` whose text names the spec §10 code.

**Authentication** is the control API's own (:class:`~atp_router.runtime.ingress.authorized.Authorized`):
``Authorization: Bearer <key>``, action ``stream_open``; 401/403 before the MCP SDK
sees a byte. The body is read here, within the tenant's bodies in flight and the
router's ``max_body_bytes`` (413), then handed to the SDK. The SDK runs
**stateless** (no ``Mcp-Session-Id``): every POST carries its own identity, so no
MCP session outlives or crosses a credential, and the router keeps no per-client
MCP state (a GET or DELETE on ``/mcp`` is the router's 405).

**Cost of the SDK.** Importing ``mcp`` takes 0.7–2.5 s of CPU, so a router imports it
on the first ``/mcp`` request, in a worker thread, never at start; that request
waits for it. The SDK's session manager runs in a nursery the app's ASGI lifespan
opens (hypercorn's, under ``atp-router`` and each ``--workers`` process); an app
served without a lifespan answers ``/mcp`` with 503 ``EAGENTDOWN``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from atp_router.runtime.ingress.authorized import Authorized, render_error
from atp_router.runtime.ingress.bodies import BodyTooLarge, read_body, release_body
from atp_router.security.identity import Identity
from atp_router.wire.errors import ATPError, ErrorCode

if TYPE_CHECKING:
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from atp_router.runtime.router import Router

__all__ = ["MCP_PATH", "McpIngress", "caller"]

MCP_PATH = "/mcp"

#: The identity of the ``/mcp`` request being served: set around the SDK's handling of
#: it, read by the tools (the SDK's per-request tasks are spawned from the request's
#: task, so they inherit it; trio copies the spawner's context).
_CALLER: ContextVar[Identity] = ContextVar("atp_mcp_caller")

#: The module that imports the SDK (imported on first use: module docstring).
_TOOLS_MODULE = "atp_router.runtime.ingress.mcp_tools"


def caller() -> Identity:
    """The identity of the ``/mcp`` request whose tool runs. Raises
    :class:`ATPError` ``ESEC`` outside one (never serve a tool without a caller)."""
    try:
        return _CALLER.get()
    except LookupError:
        raise ATPError(ErrorCode.ESEC, "an MCP tool ran outside an authenticated /mcp request") from None


class McpIngress:
    """The ``/mcp`` route of one router's app (module docstring): :meth:`routes`
    for the app's route table, :meth:`lifespan` for its ASGI lifespan."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._nurseries: list[trio.Nursery] = []
        self._manager: StreamableHTTPSessionManager | None = None
        self._starting = trio.Lock()

    def routes(self, authorized: Authorized) -> list[Route]:
        return [Route(MCP_PATH, authorized("stream_open", self.post), methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's ASGI lifespan: a nursery the SDK's session manager is started
        in on first use (an app served twice, as a ``--workers`` process serves its
        public and private sockets, lends two; either serves)."""
        async with trio.open_nursery() as nursery:
            self._nurseries.append(nursery)
            try:
                yield
            finally:
                self._nurseries.remove(nursery)
                nursery.cancel_scope.cancel()

    async def post(self, request: Request, identity: Identity) -> Response:
        """``POST /mcp``: the body read within the tenant's limits, then the SDK's answer."""
        try:
            body = await read_body(request, self.router.config.max_body_bytes)
            release_body(request)
            manager = await self._running()
        except BodyTooLarge as e:
            return render_error(e, 413)
        except ATPError as e:
            if e.code is ErrorCode.EWINDOW:
                raise  # BodyRefused: the authorized wrapper answers 429 + Retry-After
            return render_error(e, 503)
        return _SdkReply(manager, identity, body)

    async def _running(self) -> StreamableHTTPSessionManager:
        """The SDK's session manager, imported and started on first use."""
        if self._manager is not None:
            return self._manager
        async with self._starting:
            if self._manager is None:
                if not self._nurseries:
                    raise ATPError(ErrorCode.EAGENTDOWN, "the MCP ingress is not running (the app is served "
                                   "without an ASGI lifespan)")
                tools = await trio.to_thread.run_sync(importlib.import_module, _TOOLS_MODULE)
                manager = tools.session_manager(self.router, caller)
                await self._nurseries[0].start(self._run, manager)
        assert self._manager is not None
        return self._manager

    async def _run(self, manager: StreamableHTTPSessionManager,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with manager.run():
                self._manager = manager
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._manager = None  # its lifespan ended: the next request starts another


class _SdkReply(Response):
    """The SDK's answer to one ``/mcp`` request: the body already read is replayed to
    it, and the caller's identity is set for its tools (:func:`caller`)."""

    def __init__(self, manager: StreamableHTTPSessionManager, identity: Identity, body: bytes) -> None:
        super().__init__()
        self.manager, self.identity, self.payload = manager, identity, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": self.payload, "more_body": False}
            return await receive()  # then the client's disconnect

        token = _CALLER.set(self.identity)
        try:
            await self.manager.handle_request(scope, replay, send)
        finally:
            _CALLER.reset(token)
