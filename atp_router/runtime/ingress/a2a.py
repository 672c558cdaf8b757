"""The router as an A2A server: any A2A client can send it tasks (A2A 0.3 and 1.0, JSON-RPC 2.0).

=========================================  ==================================================
``GET  /.well-known/agent-card.json``      the agent card: one skill per task type the
``GET  /.well-known/agent-card``           running FIB routes; 1.0 ``supportedInterfaces``
                                           and the v0.3 ``url`` / ``protocolVersion`` (the
                                           second path is JAF's)
``POST /a2a``                              JSON-RPC: ``message/send``, ``message/stream``,
                                           ``tasks/get``, ``tasks/cancel``,
                                           ``tasks/resubscribe`` (v0.3, JAF) and
                                           ``SendMessage``, ``SendStreamingMessage``,
                                           ``GetTask``, ``CancelTask``, ``SubscribeToTask``
                                           (1.0); the method name picks the dialect
=========================================  ==================================================

A message enters the router as an ATP stream (:meth:`Router.open_stream`, the same
SYN the HTTP control API synthesises); the A2A task id is the ATP ``stream_id`` and
the task is a view of the stream's :class:`~atp_router.runtime.dataplane.eventlog.EventLog`:

===============================  ===================================================
ATP event                         A2A
===============================  ===================================================
SYN_ACK                           Task, state ``submitted`` (first event of a stream)
PARTIAL ``{agent, delta}``        status-update ``working``, agent message = the delta
PARTIAL ``{agent, report}``       artifact-update ``agent:<name>``: data part (report,
                                  usage)
ERROR (one next-hop failed)       status-update ``working``, message ``<code>: <reason>``,
                                  metadata ``atp_error``
FINAL                             artifact-update ``result``: a text summary and a data
                                  part with the FINAL payload (spec §7.3)
FIN                               status-update ``completed`` (``final: true``); ``failed``
                                  (the first failure's code, naming them all) when the
                                  FINAL has no findings
                                  and a next-hop failed (its ``consensus.uncertainties``
                                  ``next-hop failed: …``): an incomplete review is never
                                  "no findings"
RST                               status-update ``failed`` (``final: true``), the reason
stream reset by ``tasks/cancel``  status-update ``canceled`` (``final: true``)
===============================  ===================================================

The task comes from the user message: a data part ``{"atp": {"task_type",
"content", "meta", "budget"}}`` (what :mod:`atp_router.adapters.a2a` sends, so routers
chain), else ``metadata.task_type`` (or ``skill``) with a data part as content or
the text (a unified diff → ``{"diff"}``, else ``{"text"}``); the task type defaults
to the card's first skill.

A text-only message (no data part) for a route with a next-hop that needs the
files (:attr:`~atp_router.adapters.base.ProviderAdapter.needs_files`: ruff, bandit, the
test runner) must be a unified diff; the after-diff text of each file it touches
is then read from the router's ``--repo`` checkout (:mod:`atp_router.review.repo`:
confined to the checkout — no ``..``, absolute paths, ``.git`` or symlinks leading
out — bounded, and checked against the diff's after side) into ``files``. When
the text is not a diff, the router has no ``--repo`` or a file cannot be read,
such a task is answered at once with a terminal task in state ``rejected``
(``TASK_STATE_REJECTED``) whose status message is ``EPROTO: <reason>`` (metadata
``atp_error``); no stream is opened. A route whose next-hops all work from a diff
alone reviews it without ``files`` instead. ``metadata.agent_context`` (an Agent Context Protocol
message) enters the stream's meta unchanged. The ``messageId`` is the stream's
idempotency key: a retried message reaches the same task.

``message/send`` waits for the stream to end unless ``configuration.blocking`` is
false (0.3) / ``returnImmediately`` true (1.0). ``tasks/cancel`` resets the stream
(a client RST, spec §4.4): its next-hop calls stop, what they used is committed.
An A2A task does not depend on a connection (A2A clients poll or resubscribe), so
its SSE requests are not stream followers: a dropped ``message/stream`` leaves the
task running to its end, its deadline or ``tasks/cancel``.

Authentication: ``POST /a2a`` is authenticated once per request
(:meth:`Router.authenticate <atp_router.runtime.router.Router.authenticate>`; HTTP 401 when
refused) and authorized (:meth:`Router.authorize
<atp_router.runtime.router.Router.authorize>`: ``stream_open`` to send, ``stream_access``
to get, cancel or subscribe; HTTP 403). Task ids are scoped by tenant like
stream ids (spec §11): another tenant's task id answers ``-32001`` exactly like
one that never existed. Errors:
``-32700`` bad JSON, ``-32600`` not a JSON-RPC request, ``-32601`` unknown method,
``-32602`` bad params or a task the router refuses as malformed (EPROTO),
``-32001`` unknown task, ``-32002`` cancel of a finished task, ``-32009`` an
``A2A-Version`` other than 0.3 / 1.0, ``-32603`` any other refusal (``data``:
``{code, reason}`` with the ATP code, e.g. EAGENTDOWN when no policy routes it).

Bodies (:mod:`atp_router.runtime.ingress.bodies`): after authentication and before the body is
read, the tenant's request bodies in flight are checked against
``tenant_body_bytes`` (over it: HTTP 429, ``Retry-After``, error ``-32000`` with
``data.code`` ``EWINDOW``, the body unread); a body over ``max_body_bytes`` is
HTTP 413 (``-32600``, ``EPROTO``); one over 256 KiB is parsed in a worker thread.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from atp_router.adapters.a2a import parts_of
from atp_router.runtime.dataplane.plan import parse_off_loop
from atp_router.runtime.ingress.a2a_message import RpcError, task_of
from atp_router.runtime.ingress.a2a_tasks import (
    A2ATask,
    Artifact,
    Render,
    Status,
    closing,
    final_of,
    fold,
    updates,
)
from atp_router.runtime.ingress.bodies import (
    BodyRefused,
    BodyTooLarge,
    decode_off_loop,
    open_body,
    read_body,
    release_body,
)
from atp_router.runtime.ingress.repo_files import complete_from_repo
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import (
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
)

__all__ = ["A2A_PATH", "CARD_PATHS", "a2a_routes", "agent_card"]

A2A_PATH = "/a2a"
CARD_PATHS = ("/.well-known/agent-card.json", "/.well-known/agent-card")

_V03 = {"message/send": "send", "message/stream": "stream", "tasks/get": "get", "tasks/cancel": "cancel",
        "tasks/resubscribe": "subscribe"}
_V10 = {"SendMessage": "send", "SendStreamingMessage": "stream", "GetTask": "get", "CancelTask": "cancel",
        "SubscribeToTask": "subscribe"}
_MODES = ["text/plain", "application/json"]
#: A2A task records kept per tenant (its oldest go first); pruned of streams the
#: router's table dropped once a tenant has _PRUNE_AT.
_MAX_TASKS = 10_000
_PRUNE_AT = 1024


def agent_card(router: Router, base_url: str) -> dict[str, Any]:
    """The router's agent card: one skill per task type the running FIB routes
    (``"*"`` for a policy that matches any), its next-hops in the description; the
    JSON-RPC endpoint ``base_url + /a2a`` for 1.0 and 0.3."""
    url = base_url.rstrip("/") + A2A_PATH
    skills: list[dict[str, Any]] = []
    seen: set[str] = set()
    for entry in router.gen.fib.routes():
        if entry.task_type in seen:
            continue
        seen.add(entry.task_type)
        skills.append({
            "id": entry.task_type,
            "name": "any task type" if entry.task_type == "*" else entry.task_type,
            "description": f"routed by ATP to {', '.join(entry.next_hops)}; findings merged by consensus",
            "tags": ["atp", entry.task_type, *entry.next_hops],
            "inputModes": _MODES,
            "outputModes": _MODES,
        })
    card: dict[str, Any] = {
        "name": "atp-router",
        "description": "ATP router: fans a task out to its routed agents under a budget and merges their findings",
        "version": f"rib-{router.gen.version}",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "0.3"},
        ],
        "protocolVersion": "0.3.0",
        "url": url,
        "preferredTransport": "JSONRPC",
        "capabilities": {"streaming": True, "pushNotifications": False, "stateTransitionHistory": False},
        "defaultInputModes": _MODES,
        "defaultOutputModes": _MODES,
        "skills": skills,
    }
    if _auth_required(router):
        card["securitySchemes"] = {"bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer"}}}
        card["securityRequirements"] = [{"schemes": {"bearer": {"list": []}}}]
    return card


def _auth_required(router: Router) -> bool:
    try:
        router.authenticate(None)
    except ATPError:
        return True
    return False


def a2a_routes(router: Router) -> list[Route]:
    """The A2A server of ``router`` as Starlette routes (see the module docstring),
    to mount beside :func:`atp_router.runtime.ingress.http_api.build_app`'s."""
    book = _TaskBook(router)

    async def card(request: Request) -> Response:
        return JSONResponse(agent_card(router, str(request.base_url)))

    async def rpc(request: Request) -> Response:
        return await _rpc(router, book, request)

    return [
        *(Route(path, card, methods=["GET"]) for path in CARD_PATHS),
        Route(A2A_PATH, rpc, methods=["POST"]),
    ]


class _TaskBook:
    """The A2A task records of one router: tenant → task id (the stream id) →
    the task, so one tenant's tasks never displace another's; at most
    ``_MAX_TASKS`` a tenant, pruned of dropped streams from ``_PRUNE_AT`` on."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.tasks: dict[str, dict[str, A2ATask]] = {}

    def current(self, task: A2ATask) -> bool:
        """The task's stream is still in the router's table (not reaped), or
        closed less than ``retain_closed_s`` ago: the table's memory bounds may
        have let it go sooner (its reads come from the store), its A2A record
        still answers for the retention age."""
        ctx, router = task.ctx, self.router
        if ctx is None:
            return True  # rejected: kept as long as the tenant's task records
        if router.streams.get(ctx.tenant, ctx.session_id, ctx.stream_id) is ctx:
            return True
        return ctx.closed_at is not None and trio.current_time() < ctx.closed_at + router.config.retain_closed_s

    def get(self, identity: Identity, task_id: str) -> A2ATask | None:
        return self.tasks.get(identity.tenant, {}).get(task_id)

    def find(self, params: Mapping[str, Any], identity: Identity) -> A2ATask:
        """The task ``params.id`` names, of the caller's tenant. Raises
        :class:`RpcError` ``-32602`` without an id, ``-32001`` for a task this
        tenant does not have (any more)."""
        tid = params.get("id")
        if not isinstance(tid, str):
            raise RpcError(-32602, "params.id (the task id) is required")
        task = self.get(identity, tid)
        if task is None or not self.current(task):
            raise RpcError(-32001, f"task {tid!r} not found")
        return task

    def remember(self, identity: Identity, task: A2ATask) -> A2ATask:
        mine = self.tasks.setdefault(identity.tenant, {})
        if len(mine) >= _PRUNE_AT:
            # Streams the router's table dropped take their A2A task with them.
            for tid in [t for t, old in mine.items() if not self.current(old)]:
                del mine[tid]
            while len(mine) >= _MAX_TASKS:
                del mine[next(iter(mine))]
        mine[task.id] = task
        return task


def _identity_of(router: Router, request: Request) -> Identity:
    # The same identities as the control API (Router.authenticate), so a token
    # sees its streams and spends its tenant's budget whichever way it came in.
    try:
        return router.authenticate(request.headers.get("authorization"))
    except ATPError as e:
        router.authentication_refused(e, ingress="a2a")
        raise RpcError(-32600, f"authentication required: {e.reason}", {"code": "ESEC"}, status=401) from None


def _authorize(router: Router, identity: Identity, action: str) -> None:
    try:
        router.authorize(identity, action)
    except ATPError as e:
        raise RpcError(-32600, f"forbidden: {e.reason}", {"code": "ESEC"}, status=403) from None


def _stored_message(message: Mapping[str, Any], message_id: str) -> dict[str, Any]:
    stored = {"messageId": message_id, "parts": parts_of(message.get("parts"))}
    if isinstance(message.get("metadata"), dict):
        stored["metadata"] = message["metadata"]
    return stored


async def _open_task(router: Router, book: _TaskBook, params: Mapping[str, Any], identity: Identity) -> A2ATask:
    """The task of a send/stream call: a stream opened for the user message
    (the same task again for a retried ``messageId``), or a terminal
    ``rejected`` task when a text-only message cannot be completed from the repo."""
    message = params.get("message")
    if not isinstance(message, dict):
        raise RpcError(-32602, "params.message must be an object")
    if message.get("role") not in ("user", "ROLE_USER"):
        raise RpcError(-32602, f"message.role must be user, got {message.get('role')!r}")
    meta, content, budget, text_only = task_of(router, message, params.get("metadata"))
    message_id = message.get("messageId") if isinstance(message.get("messageId"), str) else uuid.uuid4().hex
    context = message.get("contextId") if isinstance(message.get("contextId"), str) else None
    stored = _stored_message(message, message_id)
    change = None
    if text_only:
        # A text diff is parsed once, here: its files are read from it, and every next-hop gets it.
        diff = content.get("diff")
        change = await parse_off_loop(diff) if isinstance(diff, str) else None
        refusal = await complete_from_repo(router, meta, content, change)
        if refusal is not None:
            return book.remember(identity, _rejected(router, identity, stored, context, refusal))
    try:
        ctx = await router.open_stream_async(task=meta, content=content, budget=budget, qos=None, window=None,
                                             idempotency_key=f"a2a:{message_id}", identity=identity, change=change)
    except ATPError as e:
        code = -32602 if e.code is ErrorCode.EPROTO else -32603
        raise RpcError(code, f"{e.code}: {e.reason}", {"code": str(e.code), "reason": e.reason}) from None
    task = book.get(identity, ctx.stream_id)
    if task is None or task.ctx is not ctx:
        task = book.remember(identity, A2ATask(ctx, context or ctx.session_id, stored))
    return task


def _rejected(router: Router, identity: Identity, stored: dict[str, Any], context: str | None,
              refusal: str) -> A2ATask:
    """Refused before any stream opened: a terminal ``rejected`` task, the reason its message."""
    err = {"code": str(ErrorCode.EPROTO), "reason": refusal}
    status = Status("rejected", f"EPROTO: {refusal}", {"atp_error": err})
    rid = "rejected_" + uuid.uuid4().hex[:16]
    router.metrics.errors.labels(str(ErrorCode.EPROTO)).inc()
    router.audit_event("refusal", identity, {"ingress": "a2a", "task_id": rid, "code": "EPROTO",
                                             "reason": refusal[:300]})
    return A2ATask(None, context or rid, stored, rejected=status, rejected_id=rid)


async def _follow(task: A2ATask, render: Render, *, after: int, first: dict[str, Any] | None,
                  rid: Any) -> AsyncIterator[bytes]:
    """The SSE body of a stream/subscribe call: ``first`` (the Task snapshot),
    then the updates of the task's events after event ``after``."""
    def sse(result: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode() + b"\n\n"

    if first is not None:
        yield sse(first)
    if task.ctx is None:
        yield sse(render.event(fold(task)[0], task))  # rejected: the terminal status-update
        return
    working = fold(task)[0].state != "submitted"
    final = next((f for f in map(final_of, reversed(task.ctx.log.events[:after])) if f), None)
    async for ev in task.ctx.log.follow(after):
        final = final_of(ev) or final
        for up in updates(ev, final):
            if not working and (isinstance(up, Artifact) or up.state == "working"):
                working = True
                if isinstance(up, Artifact):
                    yield sse(render.event(Status("working"), task))  # submitted → working first
            yield sse(render.event(up, task))
    last = closing(task)
    if last is not None:
        yield sse(render.event(last, task))


async def _rpc(router: Router, book: _TaskBook, request: Request) -> Response:
    """``POST /a2a``: one JSON-RPC request, answered as the module docstring says."""
    rid: Any = None
    try:
        identity = _identity_of(router, request)
        body = await _read_json(router, request, identity)
        rid = _request_id(body)
        op, render, params = _call_of(body, request)
        _authorize(router, identity, "stream_open" if op in ("send", "stream") else "stream_access")
        return await _perform(router, book, op, params, identity, render, rid)
    except RpcError as e:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.retry_after_s is not None:
            headers = {"Retry-After": str(e.retry_after_s), "Connection": "close"}
        error: dict[str, Any] = {"code": e.code, "message": e.message}
        if e.data is not None:
            error["data"] = e.data
        return JSONResponse({"jsonrpc": "2.0", "id": rid, "error": error}, status_code=e.status, headers=headers)


async def _read_json(router: Router, request: Request, identity: Identity) -> Any:
    # The tenant is known: its bodies in flight are bounded before this one
    # is read, the body by max_body_bytes, and a large one is decoded off the
    # event loop (atp_router.runtime.ingress.bodies).
    try:
        open_body(router.body_budget, request, identity.tenant)
        raw = await read_body(request, router.config.max_body_bytes)
        return await decode_off_loop(json.loads, raw)
    except BodyRefused as e:
        router.metrics.errors.labels(str(ErrorCode.EWINDOW)).inc()
        raise RpcError(-32000, e.reason, {"code": "EWINDOW"}, status=429,
                       retry_after_s=max(1, -(-(e.retry_after_ms or 1000) // 1000))) from None
    except BodyTooLarge as e:
        raise RpcError(-32600, f"Invalid Request: {e.reason}", {"code": "EPROTO"}, status=413) from None
    except ValueError as e:
        raise RpcError(-32700, f"Parse error: {e}") from None
    finally:
        release_body(request)


def _request_id(body: Any) -> Any:
    """The request's ``id`` (a string, a number or null)."""
    if not isinstance(body, dict):
        raise RpcError(-32600, "Invalid Request: a single JSON-RPC object is expected (no batches)")
    rid = body.get("id")
    if isinstance(rid, bool) or not (rid is None or isinstance(rid, (str, int))):
        raise RpcError(-32600, "Invalid Request: id must be a string, a number or null")
    return rid


def _call_of(body: dict[str, Any], request: Request) -> tuple[str, Render, dict[str, Any]]:
    """The operation a request asks for, the dialect to answer in and its params."""
    method = body.get("method")
    if body.get("jsonrpc") != "2.0" or not isinstance(method, str):
        raise RpcError(-32600, "Invalid Request: jsonrpc must be '2.0' and method a string")
    op = _V03.get(method) or _V10.get(method)
    if op is None:
        raise RpcError(-32601, f"Method not found: {method}")
    version = request.headers.get("a2a-version", "")
    if version and ".".join(version.split(".")[:2]) not in ("0.3", "1.0"):
        raise RpcError(-32009, f"A2A version {version!r} is not supported (0.3, 1.0)")
    params = body.get("params") if body.get("params") is not None else {}
    if not isinstance(params, dict):
        raise RpcError(-32602, "params must be an object")
    return op, Render(method in _V10), params


async def _perform(router: Router, book: _TaskBook, op: str, params: dict[str, Any], identity: Identity,
                   render: Render, rid: Any) -> Response:
    """Run an authorized call: ``send``, ``stream``, ``subscribe``, ``cancel`` or ``get``."""
    if op in ("stream", "subscribe"):
        task = await _open_task(router, book, params, identity) if op == "stream" else book.find(params, identity)
        # The Task snapshot stands for what happened so far; the updates follow.
        first = render.wrap_task(render.task(task))
        after = len(task.ctx.log.events) if task.ctx is not None else 0
        gen = _follow(task, render, after=after, first=first, rid=rid)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if op == "send":
        task = await _open_task(router, book, params, identity)
        config = params.get("configuration") or {}
        blocking = not (config.get("returnImmediately") is True if render.v1 else config.get("blocking") is False)
        if blocking and task.ctx is not None:
            async for _ in task.ctx.log.follow():
                pass
        return _result(rid, render.wrap_task(render.task(task)))
    task = book.find(params, identity)
    if op == "cancel":
        _cancel(router, task, identity)
        return _result(rid, render.task(task))
    hl = params.get("historyLength")
    return _result(rid, render.task(task, hl if isinstance(hl, int) and not isinstance(hl, bool) else None))


def _cancel(router: Router, task: A2ATask, identity: Identity) -> None:
    """``tasks/cancel``: the client's RST on the task's stream (spec §4.4)."""
    if task.closed or task.ctx is None:
        raise RpcError(-32002, f"task {task.id!r} is finished and cannot be canceled")
    rst = Frame(
        v=1, session_id=task.ctx.session_id, stream_id=task.ctx.stream_id, msg_seq=0,
        flags=[Flag.RST, Flag.CTRL],
        payload=Payload(type=PayloadType.CONTROL, content=ErrorPayload(
            code=ErrorCode.EPREEMPT, reason="canceled by the A2A client (tasks/cancel)")),
    )
    router.receive_frame(rst, identity=identity, now=trio.current_time())


def _result(rid: Any, result: Any) -> Response:
    return JSONResponse({"jsonrpc": "2.0", "id": rid, "result": result})
