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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from atp_router.adapters.a2a import parts_of, restore_ints
from atp_router.review.repo import files_after
from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.runtime.dataplane.eventlog import LoggedEvent
from atp_router.runtime.ingress.bodies import (
    BodyRefused,
    BodyTooLarge,
    decode_off_loop,
    open_body,
    read_body,
    release_body,
)
from atp_router.runtime.router import Router, StreamCtx
from atp_router.security.identity import Identity
from atp_router.task.diff import parse_diff
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import (
    Budget,
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
_TERMINAL = frozenset({"completed", "failed", "canceled", "rejected"})
_MODES = ["text/plain", "application/json"]
#: A2A task records kept per tenant (its oldest go first); pruned of streams the
#: router's table dropped once a tenant has _PRUNE_AT.
_MAX_TASKS = 10_000
_PRUNE_AT = 1024


class _RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None, *, status: int = 200,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Status:
    state: str
    text: str = ""
    metadata: dict[str, Any] | None = None


@dataclass(slots=True)
class _Artifact:
    artifact_id: str
    name: str
    parts: list[tuple[str, Any]]


@dataclass(slots=True)
class _Task:
    """The A2A side of one stream: who sent it and the user message as received.
    A task refused before any stream opened (``rejected``) has no ``ctx``."""

    ctx: StreamCtx | None
    context_id: str
    message: dict[str, Any]
    rejected: _Status | None = None
    rejected_id: str = ""

    @property
    def id(self) -> str:
        return self.ctx.stream_id if self.ctx is not None else self.rejected_id

    @property
    def closed(self) -> bool:
        return self.ctx is None or self.ctx.log.closed


def _now() -> str:
    # A2A timestamps are wall-clock ISO 8601 (this is the trio edge, not the core).
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _to_plain(content: Any) -> Any:
    return content if isinstance(content, dict) else msgspec.to_builtins(content)


def _failures(final: Mapping[str, Any] | None) -> list[str]:
    """The next-hops that failed in a FINAL (``agent: CODE: reason``, from its
    ``consensus.uncertainties``; :data:`~atp_router.runtime.dataplane.dispatch.NEXT_HOP_FAILED`)."""
    consensus = ((final or {}).get("result") or {}).get("consensus") or {}
    return [u[len(NEXT_HOP_FAILED):] for u in consensus.get("uncertainties") or []
            if isinstance(u, str) and u.startswith(NEXT_HOP_FAILED)]


def _summary(final: Mapping[str, Any]) -> str:
    """One line per merged finding, the next-hops that failed, then the telemetry."""
    result = final.get("result") or {}
    lines = []
    for f in result.get("findings") or []:
        lines.append(f"{f.get('file')}:{f.get('span')} {f.get('severity')}: {f.get('claim')} "
                     f"[{', '.join(f.get('provenance') or [])}]"
                     + (" (silenced by the change)" if f.get("suppressed_by_change") else ""))
    failed = _failures(final)
    t = final.get("telemetry") or {}
    head = f"{len(lines)} finding(s)" if lines else "no findings"
    if failed:
        head += f" — incomplete: {len(failed)} next-hop(s) failed"
        lines += [f"failed: {f}" for f in failed]
    tail = f"telemetry: {t.get('tokens', 0)} tokens, {t.get('usd', 0)} USD, {t.get('latency_ms', 0)} ms"
    return "\n".join([head, *lines, tail])


def _updates(ev: LoggedEvent, final: Mapping[str, Any] | None = None) -> list[_Status | _Artifact]:
    """The A2A updates one stream event stands for (table in the module docstring);
    ``final`` is the stream's FINAL content seen before ``ev``, if any."""
    p = ev.frame.payload
    content = _to_plain(p.content) if p is not None and p.content is not None else None
    match ev.type:
        case "SYN_ACK":
            return [_Status("submitted")]
        case "PARTIAL" if isinstance(content, dict):
            agent = str(content.get("agent", ""))
            if isinstance(content.get("delta"), str):
                return [_Status("working", content["delta"], {"agent": agent})]
            if "report" in content:
                data = {"agent": agent, "report": content["report"], "usage": content.get("usage")}
                return [_Artifact(f"agent:{agent}", agent, [("data", data)])]
            return [_Status("working")]
        case "ERROR" if isinstance(content, dict):
            return [_Status("working", f"{content.get('code')}: {content.get('reason')}", {"atp_error": content})]
        case "FINAL" if isinstance(content, dict):
            return [_Artifact("result", "result", [("text", _summary(content)), ("data", content)])]
        case "FIN":
            failed = _failures(final)
            if failed and not ((final or {}).get("result") or {}).get("findings"):
                # Nothing found, but not everything looked: not a clean "no findings".
                # The code of the first failure (``agent: CODE: reason``).
                code = failed[0].split(": ", 2)[1] if failed[0].count(": ") >= 2 else "EAGENTDOWN"
                err = {"code": code, "reason": "no findings, and the review is incomplete: " + "; ".join(failed)}
                return [_Status("failed", f"{err['code']}: {err['reason']}", {"atp_error": err})]
            return [_Status("completed")]
        case "RST":
            err = content if isinstance(content, dict) else {}
            return [_Status("failed", f"{err.get('code')}: {err.get('reason')}", {"atp_error": err})]
    return []


def _final_of(ev: LoggedEvent) -> dict[str, Any] | None:
    p = ev.frame.payload
    if ev.type == "FINAL" and p is not None and p.content is not None:
        content = _to_plain(p.content)
        return content if isinstance(content, dict) else None
    return None


def _closing(task: _Task) -> _Status | None:
    """``canceled`` for a log closed without FIN/RST of ours (the client's RST)."""
    if task.ctx is None:
        return None
    log = task.ctx.log
    if log.closed and (not log.events or log.events[-1].type not in ("FIN", "RST")):
        return _Status("canceled", "canceled by the client (tasks/cancel → RST)")
    return None


def _fold(task: _Task) -> tuple[_Status, dict[str, _Artifact]]:
    """The task's current status and artifacts, from its stream's log so far."""
    if task.ctx is None:
        return task.rejected or _Status("rejected"), {}
    status = _Status("submitted")
    arts: dict[str, _Artifact] = {}
    final = None
    for ev in task.ctx.log.events:
        final = _final_of(ev) or final
        for up in _updates(ev, final):
            if isinstance(up, _Artifact):
                arts[up.artifact_id] = up
                if status.state == "submitted":
                    status = _Status("working")
            else:
                status = up
    return _closing(task) or status, arts


class _Render:
    """A2A objects in one dialect (``v1``: 1.0, else 0.3)."""

    def __init__(self, v1: bool):
        self.v1 = v1

    def part(self, kind: str, value: Any) -> dict[str, Any]:
        return {kind: value} if self.v1 else {"kind": kind, kind: value}

    def state(self, state: str) -> str:
        return "TASK_STATE_" + state.upper().replace("-", "_") if self.v1 else state

    def message(self, role: str, parts: list[tuple[str, Any]], task: _Task, *, message_id: str | None = None,
                metadata: Any = None) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "messageId": message_id or uuid.uuid4().hex,
            "contextId": task.context_id,
            "taskId": task.id,
            "role": ("ROLE_" + role.upper()) if self.v1 else role,
            "parts": [self.part(k, v) for k, v in parts],
        }
        if metadata:
            msg["metadata"] = metadata
        if not self.v1:
            msg["kind"] = "message"
        return msg

    def status(self, st: _Status, task: _Task) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state(st.state), "timestamp": _now()}
        if st.text:
            out["message"] = self.message("agent", [("text", st.text)], task, metadata=st.metadata)
        return out

    def artifact(self, art: _Artifact) -> dict[str, Any]:
        return {"artifactId": art.artifact_id, "name": art.name, "parts": [self.part(k, v) for k, v in art.parts]}

    def task(self, task: _Task, history_length: int | None = None) -> dict[str, Any]:
        """A snapshot of the task from its stream's log."""
        status, arts = _fold(task)
        history = [self.message("user", task.message["parts"], task, message_id=task.message["messageId"],
                                metadata=task.message.get("metadata"))]
        out: dict[str, Any] = {
            "id": task.id,
            "contextId": task.context_id,
            "status": self.status(status, task),
            "artifacts": [self.artifact(a) for a in arts.values()],
            "history": history if history_length != 0 else [],
            "metadata": {"atp": {"session_id": task.ctx.session_id, "stream_id": task.ctx.stream_id}
                         if task.ctx is not None else {"rejected": True}},
        }
        if not self.v1:
            out["kind"] = "task"
        return out

    def event(self, up: _Status | _Artifact, task: _Task) -> dict[str, Any]:
        """A stream result: status-update / artifact-update (0.3: ``kind`` and
        ``final``; 1.0: wrapped in ``statusUpdate`` / ``artifactUpdate``)."""
        base: dict[str, Any] = {"taskId": task.id, "contextId": task.context_id}
        if isinstance(up, _Artifact):
            base.update(artifact=self.artifact(up), append=False, lastChunk=True)
            return {"artifactUpdate": base} if self.v1 else {"kind": "artifact-update", **base}
        base["status"] = self.status(up, task)
        if self.v1:
            return {"statusUpdate": base}
        return {"kind": "status-update", **base, "final": up.state in _TERMINAL}

    def wrap_task(self, task_obj: dict[str, Any]) -> dict[str, Any]:
        """A Task as a send/stream result (1.0 wraps it in ``task``)."""
        return {"task": task_obj} if self.v1 else task_obj


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
    #: tenant → task id (the stream id) → the task: one tenant's tasks never
    #: displace another's.
    tasks: dict[str, dict[str, _Task]] = {}

    def identity_of(request: Request) -> Identity:
        # The same identities as the control API (Router.authenticate), so a token
        # sees its streams and spends its tenant's budget whichever way it came in.
        try:
            return router.authenticate(request.headers.get("authorization"))
        except ATPError as e:
            router.authentication_refused(e, ingress="a2a")
            raise _RpcError(-32600, f"authentication required: {e.reason}", {"code": "ESEC"}, status=401) from None

    def authorize(identity: Identity, action: str) -> None:
        try:
            router.authorize(identity, action)
        except ATPError as e:
            raise _RpcError(-32600, f"forbidden: {e.reason}", {"code": "ESEC"}, status=403) from None

    def current(task: _Task) -> bool:
        """The task's stream is still in the router's table (not reaped), or
        closed less than ``retain_closed_s`` ago: the table's memory bounds may
        have let it go sooner (its reads come from the store), its A2A record
        still answers for the retention age."""
        ctx = task.ctx
        if ctx is None:
            return True  # rejected: kept as long as the tenant's task records
        if router.streams.get(ctx.tenant, ctx.session_id, ctx.stream_id) is ctx:
            return True
        return ctx.closed_at is not None and trio.current_time() < ctx.closed_at + router.config.retain_closed_s

    async def card(request: Request) -> Response:
        return JSONResponse(agent_card(router, str(request.base_url)))

    def find(params: Mapping[str, Any], identity: Identity) -> _Task:
        tid = params.get("id")
        if not isinstance(tid, str):
            raise _RpcError(-32602, "params.id (the task id) is required")
        task = tasks.get(identity.tenant, {}).get(tid)
        if task is None or not current(task):
            raise _RpcError(-32001, f"task {tid!r} not found")
        return task

    def remember(identity: Identity, task: _Task) -> _Task:
        mine = tasks.setdefault(identity.tenant, {})
        if len(mine) >= _PRUNE_AT:
            # Streams the router's table dropped take their A2A task with them.
            for tid in [t for t, old in mine.items() if not current(old)]:
                del mine[tid]
            while len(mine) >= _MAX_TASKS:
                del mine[next(iter(mine))]
        mine[task.id] = task
        return task

    def stored_message(message: Mapping[str, Any], message_id: str) -> dict[str, Any]:
        stored = {"messageId": message_id, "parts": parts_of(message.get("parts"))}
        if isinstance(message.get("metadata"), dict):
            stored["metadata"] = message["metadata"]
        return stored

    async def open_task(params: Mapping[str, Any], identity: Identity) -> _Task:
        message = params.get("message")
        if not isinstance(message, dict):
            raise _RpcError(-32602, "params.message must be an object")
        if message.get("role") not in ("user", "ROLE_USER"):
            raise _RpcError(-32602, f"message.role must be user, got {message.get('role')!r}")
        meta, content, budget, text_only = _task_of(router, message, params.get("metadata"))
        message_id = message.get("messageId") if isinstance(message.get("messageId"), str) else uuid.uuid4().hex
        context = message.get("contextId") if isinstance(message.get("contextId"), str) else None
        if text_only:
            refusal = await _complete_from_repo(router, meta, content)
            if refusal is not None:
                # Refused before any stream opened: a terminal ``rejected`` task, the reason its message.
                err = {"code": str(ErrorCode.EPROTO), "reason": refusal}
                status = _Status("rejected", f"EPROTO: {refusal}", {"atp_error": err})
                rid = "rejected_" + uuid.uuid4().hex[:16]
                router.metrics.errors.labels(str(ErrorCode.EPROTO)).inc()
                router.audit_event("refusal", identity, {"ingress": "a2a", "task_id": rid, "code": "EPROTO",
                                                         "reason": refusal[:300]})
                return remember(identity, _Task(None, context or rid, stored_message(message, message_id),
                                                rejected=status, rejected_id=rid))
        try:
            ctx = router.open_stream(task=meta, content=content, budget=budget, qos=None, window=None,
                                     idempotency_key=f"a2a:{message_id}", identity=identity)
        except ATPError as e:
            code = -32602 if e.code is ErrorCode.EPROTO else -32603
            raise _RpcError(code, f"{e.code}: {e.reason}", {"code": str(e.code), "reason": e.reason}) from None
        task = tasks.get(identity.tenant, {}).get(ctx.stream_id)
        if task is None or task.ctx is not ctx:
            task = remember(identity, _Task(ctx, context or ctx.session_id, stored_message(message, message_id)))
        return task

    async def follow(task: _Task, render: _Render, *, after: int, first: dict[str, Any] | None,
                     rid: Any) -> AsyncIterator[bytes]:
        def sse(result: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode() + b"\n\n"

        if first is not None:
            yield sse(first)
        if task.ctx is None:
            yield sse(render.event(_fold(task)[0], task))  # rejected: the terminal status-update
            return
        working = _fold(task)[0].state != "submitted"
        final = next((f for f in map(_final_of, reversed(task.ctx.log.events[:after])) if f), None)
        async for ev in task.ctx.log.follow(after):
            final = _final_of(ev) or final
            for up in _updates(ev, final):
                if not working and (isinstance(up, _Artifact) or up.state == "working"):
                    working = True
                    if isinstance(up, _Artifact):
                        yield sse(render.event(_Status("working"), task))  # submitted → working first
                yield sse(render.event(up, task))
        closing = _closing(task)
        if closing is not None:
            yield sse(render.event(closing, task))

    async def rpc(request: Request) -> Response:
        rid: Any = None
        try:
            identity = identity_of(request)
            # The tenant is known: its bodies in flight are bounded before this one
            # is read, the body by max_body_bytes, and a large one is decoded off the
            # event loop (atp_router.runtime.ingress.bodies).
            try:
                open_body(router.body_budget, request, identity.tenant)
                raw = await read_body(request, router.config.max_body_bytes)
                body = await decode_off_loop(json.loads, raw)
            except BodyRefused as e:
                router.metrics.errors.labels(str(ErrorCode.EWINDOW)).inc()
                raise _RpcError(-32000, e.reason, {"code": "EWINDOW"}, status=429,
                                retry_after_s=max(1, -(-(e.retry_after_ms or 1000) // 1000))) from None
            except BodyTooLarge as e:
                raise _RpcError(-32600, f"Invalid Request: {e.reason}", {"code": "EPROTO"}, status=413) from None
            except ValueError as e:
                raise _RpcError(-32700, f"Parse error: {e}") from None
            finally:
                release_body(request)
            if not isinstance(body, dict):
                raise _RpcError(-32600, "Invalid Request: a single JSON-RPC object is expected (no batches)")
            rid = body.get("id")
            if isinstance(rid, bool) or not (rid is None or isinstance(rid, (str, int))):
                rid = None
                raise _RpcError(-32600, "Invalid Request: id must be a string, a number or null")
            method = body.get("method")
            if body.get("jsonrpc") != "2.0" or not isinstance(method, str):
                raise _RpcError(-32600, "Invalid Request: jsonrpc must be '2.0' and method a string")
            op = _V03.get(method) or _V10.get(method)
            if op is None:
                raise _RpcError(-32601, f"Method not found: {method}")
            version = request.headers.get("a2a-version", "")
            if version and ".".join(version.split(".")[:2]) not in ("0.3", "1.0"):
                raise _RpcError(-32009, f"A2A version {version!r} is not supported (0.3, 1.0)")
            render = _Render(method in _V10)
            params = body.get("params") if body.get("params") is not None else {}
            if not isinstance(params, dict):
                raise _RpcError(-32602, "params must be an object")
            authorize(identity, "stream_open" if op in ("send", "stream") else "stream_access")
            if op in ("stream", "subscribe"):
                task = await open_task(params, identity) if op == "stream" else find(params, identity)
                # The Task snapshot stands for what happened so far; the updates follow.
                first = render.wrap_task(render.task(task))
                after = len(task.ctx.log.events) if task.ctx is not None else 0
                gen = follow(task, render, after=after, first=first, rid=rid)
                return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            if op == "send":
                task = await open_task(params, identity)
                config = params.get("configuration") or {}
                blocking = not (config.get("returnImmediately") is True if render.v1 else config.get("blocking") is False)
                if blocking and task.ctx is not None:
                    async for _ in task.ctx.log.follow():
                        pass
                return _result(rid, render.wrap_task(render.task(task)))
            task = find(params, identity)
            if op == "cancel":
                if task.closed or task.ctx is None:
                    raise _RpcError(-32002, f"task {task.id!r} is finished and cannot be canceled")
                rst = Frame(
                    v=1, session_id=task.ctx.session_id, stream_id=task.ctx.stream_id, msg_seq=0,
                    flags=[Flag.RST, Flag.CTRL],
                    payload=Payload(type=PayloadType.CONTROL, content=ErrorPayload(
                        code=ErrorCode.EPREEMPT, reason="canceled by the A2A client (tasks/cancel)")),
                )
                router.receive_frame(rst, identity=identity, now=trio.current_time())
                return _result(rid, render.task(task))
            hl = params.get("historyLength")
            return _result(rid, render.task(task, hl if isinstance(hl, int) and not isinstance(hl, bool) else None))
        except _RpcError as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            if e.retry_after_s is not None:
                headers = {"Retry-After": str(e.retry_after_s), "Connection": "close"}
            error: dict[str, Any] = {"code": e.code, "message": e.message}
            if e.data is not None:
                error["data"] = e.data
            return JSONResponse({"jsonrpc": "2.0", "id": rid, "error": error}, status_code=e.status, headers=headers)

    return [
        *(Route(path, card, methods=["GET"]) for path in CARD_PATHS),
        Route(A2A_PATH, rpc, methods=["POST"]),
    ]


def _result(rid: Any, result: Any) -> Response:
    return JSONResponse({"jsonrpc": "2.0", "id": rid, "result": result})


def _looks_like_diff(text: str) -> bool:
    return text.startswith(("diff --git", "--- ")) or "\n+++ " in text or "\n@@ " in text


def _task_of(router: Router, message: Mapping[str, Any],
             params_meta: Any) -> tuple[dict[str, Any], dict[str, Any], Budget | None, bool]:
    """Task meta, task content and budget of a user message (module docstring),
    and whether the content came from the message's text alone (no data part)."""
    parts = [(k, restore_ints(v)) if k == "data" else (k, v) for k, v in parts_of(message.get("parts"))]
    if not parts:
        raise _RpcError(-32602, "message.parts must hold at least one text or data part")
    meta_in = message.get("metadata") if isinstance(message.get("metadata"), dict) else {}
    md = {**(params_meta if isinstance(params_meta, dict) else {}), **meta_in}
    atp = next((v["atp"] for k, v in parts if k == "data" and isinstance(v, dict) and isinstance(v.get("atp"), dict)),
               None)
    extra: Any = {}
    text_only = False
    budget_raw: Any = md.get("budget")
    if atp is not None:
        task_type = atp.get("task_type")
        content = atp.get("content")
        extra = atp.get("meta") or {}
        budget_raw = atp.get("budget", budget_raw)
    else:
        task_type = md.get("task_type") or md.get("skill")
        content = next((v for k, v in parts if k == "data" and isinstance(v, dict)), None)
        if content is None:
            text = "\n".join(v for k, v in parts if k == "text")
            content = {"diff": text} if _looks_like_diff(text) else {"text": text}
            text_only = True
    if not isinstance(content, dict):
        raise _RpcError(-32602, "the task content must be an object")
    if not isinstance(extra, dict):
        raise _RpcError(-32602, "atp.meta must be an object")
    if task_type is None:
        routes = router.gen.fib.routes()
        task_type = routes[0].task_type if routes else None
    if not isinstance(task_type, str) or not task_type:
        raise _RpcError(-32602, "no task type: set metadata.task_type (one of the card's skills)")
    meta = {**extra, "task_type": task_type}
    if "agent_context" in meta_in:
        meta["agent_context"] = message["metadata"]["agent_context"]  # unchanged, as received
    budget = None
    if budget_raw is not None:
        try:
            budget = msgspec.convert(budget_raw, Budget)
        except msgspec.ValidationError as e:
            raise _RpcError(-32602, f"budget: {e}") from None
    return meta, content, budget, text_only


def _agents_needing_files(router: Router, meta: Mapping[str, Any]) -> list[str]:
    """The next-hops the running FIB routes ``meta`` to that cannot review from
    a diff alone (:attr:`ProviderAdapter.needs_files
    <atp_router.adapters.base.ProviderAdapter.needs_files>`); ``[]`` when it routes
    nowhere (the SYN then refuses the task with the routing error)."""
    gen = router.gen
    try:
        route = gen.fib.lookup(meta)
    except ATPError:
        return []
    hops = [h.agent for h in route.next_hops]
    return [a for a in hops if getattr(gen.adapters.get(a), "needs_files", False)]


#: Problems quoted in a refusal (one line per unreadable file).
_MAX_PROBLEMS = 10


async def _complete_from_repo(router: Router, meta: Mapping[str, Any], content: dict[str, Any]) -> str | None:
    """Complete a text-only task (``{"diff"}`` or ``{"text"}``) in place: a diff
    gets ``files``, the after-diff text of each file it touches, read from the
    router's ``--repo`` (:func:`atp_router.review.repo.files_after`: bounded, confined to
    the checkout). Returns ``None`` when the task can be reviewed, else the
    reason to reject it: the text is not a unified diff, or the files cannot be
    had (no ``--repo``, a file missing, refused or not at the diff's after side)
    while a routed next-hop needs them. Next-hops that work from a diff alone
    review it without ``files`` when those cannot be read."""
    needs = _agents_needing_files(router, meta)
    who = ", ".join(needs)
    diff = content.get("diff")
    diffs = parse_diff(diff) if isinstance(diff, str) else []
    if not diffs:
        if needs:
            return (f"the message text is not a unified diff, and the agents of task type {meta.get('task_type')!r} "
                    f"({who}) review a code change: send `git diff` output as the text, or a data part "
                    "{\"diff\": ..., \"files\": {path: text}}")
        return None
    repo = router.config.repo
    if repo is None:
        if needs:
            return (f"{who} need the files the diff touches, and this router has no --repo to read them from: "
                    "send a data part {\"diff\": ..., \"files\": {path: text}}, or start atp-router with --repo")
        return None
    try:
        got = await trio.to_thread.run_sync(files_after, repo, diffs)
    except OSError as e:
        return f"the router's --repo cannot be read ({e.strerror or e})" if needs else None
    if got.problems:
        if needs:
            shown = "; ".join(got.problems[:_MAX_PROBLEMS])
            more = f" (and {len(got.problems) - _MAX_PROBLEMS} more)" if len(got.problems) > _MAX_PROBLEMS else ""
            return (f"{len(got.problems)} file(s) the diff touches cannot be read from the router's --repo, "
                    f"and {who} need them: {shown}{more}")
        return None  # reviewed on the diff alone
    content["files"] = got.files
    return None
