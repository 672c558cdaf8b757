"""HTTP control API (spec §22), a Starlette app served by hypercorn's trio worker.

=====================================  =========================================
``POST /v1/streams``                   open a stream (SYN → SYN-ACK); body
                                       :class:`StreamOpenRequest`
``POST /v1/streams/{id}/frames``       send a frame on a stream (HTTP fallback to
                                       the WebSocket ingress), e.g. a
                                       BUDGET_UPDATE (spec §4.3) or an RST
``GET  /v1/streams/{id}/events``       the stream's frames as Server-Sent Events;
                                       ``Last-Event-ID`` resumes (with the same
                                       ``idempotency_key`` on ``POST /v1/streams``
                                       after a dropped client, spec §8)
``POST /v1/policies/reload``           hot-reload the RIB (from the policy path, or
                                       a YAML body); a refused RIB answers 422 and
                                       the running one stays
``GET  /v1/policies``                  the running RIB: version, source and the
                                       YAML it was loaded from (:class:`PolicyText`)
``POST /v1/streams/{id}/feedback``     the client's score of a finished stream
                                       ``{score: 0..1, labels}``, once per stream:
                                       the next-hops that served it learn it (§6.2)
``GET  /v1/routes``                    the running FIB (ROUTE_UPDATE shape; weights
                                       scored with the live metrics)
``GET  /v1/fib``                       bandit arms (estimate, uncertainty, count)
                                       and the live metrics the FIB scores with
``GET  /v1/metrics``                   Prometheus exposition
``GET  /v1/keys``                      the JWKS verifying FINAL usage signatures
``GET  /v1/audit``                     the hash-chained audit trail
``GET  /v1/health``                    liveness for any caller (``{"status"}``
                                       without a credential the router needs);
                                       with one, also the RIB generation and
                                       open streams
``GET  /v1/ready``                     readiness: 200, or 503 + ``Retry-After``
                                       while spend cannot be recorded (the store,
                                       the RIB, the state directory, the audit
                                       spool; :mod:`atp_router.runtime.admin.readiness`);
                                       the checks' reasons with a credential only
``POST /v1/chat/completions``          OpenAI-compatible chat completion (a
                                       stream opened like ``POST /v1/streams``;
                                       :mod:`atp_router.runtime.ingress.openai`)
``GET  /v1/models``                    the models (task types, policies) the
                                       caller's tenant may use
``GET  /v1/status``                    the live status snapshot (streams, windows,
                                       budgets, next-hops, FIB, errors, history;
                                       :mod:`atp_router.runtime.admin.status`)
``GET  /v1/status/events``             that snapshot as Server-Sent Events, every
                                       second and on change
``GET  /status``                       the status page (public HTML + JS; its data
                                       comes from ``/v1/status/events``)
=====================================  =========================================

The routes are one table, :data:`ROUTES` (:class:`~atp_router.runtime.ingress.http_types.ApiRoute`
entries: method, path, action, module-level handler ``handler(router, request,
identity)``, and what the OpenAPI document says of the route); :func:`build_app`
serves it and :func:`atp_router.runtime.admin.openapi.openapi_document` is generated
from it. The OpenAI-compatible, A2A and status routes are entries too, served by
their ingress's ``*_routes`` function: a route an ingress serves outside the table,
or for another action than its entry's, stops the app from being built.

Every request is authenticated once (:meth:`Router.authenticate
<atp_router.runtime.router.Router.authenticate>`, the ``Authorization`` header) and its
action authorized (:meth:`Router.authorize <atp_router.runtime.router.Router.authorize>`),
both by the one wrapper (:class:`~atp_router.runtime.ingress.authorized.Authorized`):

====================================  ==========================================
action                                endpoints
====================================  ==========================================
``stream_open`` (role client)         ``POST /v1/streams``, ``POST /v1/chat/completions``, ``GET /v1/models``
``stream_access`` (role client)       ``/v1/streams/{id}/frames``, ``/events``, ``/feedback``
``policy_reload`` (role admin)        ``POST /v1/policies/reload``
``policy_read`` (role admin)          ``GET /v1/policies``
``routes_read`` (role admin)          ``GET /v1/routes``, ``GET /v1/fib``
``audit_read`` (role admin)           ``GET /v1/audit``
``tenant_admin`` (role admin)         ``GET /v1/status``, ``GET /v1/status/events`` (every tenant's streams)
``metrics_read`` (operator, admin)    ``GET /v1/metrics``
``health_read`` (any authenticated)   ``GET /v1/keys``, ``GET /v1/health`` and ``GET /v1/ready`` with a credential
(none)                                ``GET /v1/health`` without ``Authorization``: liveness only;
                                      ``GET /v1/ready`` without it: the verdict and the checks' names
====================================  ==========================================

Streams are looked up within the caller's tenant only (spec §11): the id of
another tenant's stream answers exactly like an id that never existed (404, the
same body).

Errors are ``{"error": {"code": <spec §10 code>, "reason": ..., [file, key]}}``
with HTTP 400 (EPROTO), 401 (ESEC: missing or unknown bearer token, on every
endpoint but a credential-less ``GET /v1/health`` or ``/v1/ready`` when the router has tokens), 403 (ESEC: a role the action needs, or a
bad frame signature), 404 (unknown stream), 409 (EWINDOW: the router's stream
table is full; EPROTO: an ``idempotency_key`` re-used with another task), 413 (EPROTO: a body over ``max_body_bytes`` / ``max_policy_bytes``),
422 (refused policy), 429 (EWINDOW: the tenant's stream quota or open rate, or
its request bodies in flight over ``tenant_body_bytes`` — :mod:`atp_router.runtime.ingress.bodies`,
refused before the body is read —, with ``Retry-After`` in s), 503 (EAGENTDOWN: no route; EBUDGET with ``Retry-After``:
the budget store several routers share cannot be reached). The OpenAI-compatible
endpoints answer in OpenAI's error shape instead, ``{"error": {"message",
"type", "code", "param"}}`` with the same codes and statuses
(:mod:`atp_router.runtime.ingress.openai`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from atp_router.observability.metrics import CONTENT_TYPE_LATEST
from atp_router.observability.tracing import TraceContextMiddleware
from atp_router.runtime.admin.fibview import FibView
from atp_router.runtime.admin.readiness import Readiness
from atp_router.runtime.admin.ready_routes import readiness, ready
from atp_router.runtime.admin.snapshot import StatusSnapshot
from atp_router.runtime.admin.statuspage import status_routes
from atp_router.runtime.controlplane.learning import FeedbackRefused
from atp_router.runtime.ingress.a2a import A2A_PATH, CARD_PATHS, a2a_routes
from atp_router.runtime.ingress.authorized import (
    Authorized,
    Endpoint,
    json_response,
    render_error,
    router_level_error,
)
from atp_router.runtime.ingress.bodies import (
    BodyRefused,
    BodyTooLarge,
    decode_off_loop,
    read_body,
    release_body,
)
from atp_router.runtime.ingress.hot_routes import RoutedApp
from atp_router.runtime.ingress.http_types import (
    OBJECT,
    STRING,
    ApiRoute,
    ErrorBody,
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    FramesResponse,
    Health,
    Liveness,
    PolicyFile,
    PolicyText,
    ReloadResponse,
    Reply,
    RequestBody,
    RouteInfo,
    Sse,
    StreamOpenRequest,
    StreamOpenResponse,
)
from atp_router.runtime.ingress.mcp import MCP_PATH, McpIngress
from atp_router.runtime.ingress.openai import (
    CHAT_PATH,
    MODEL_PATH,
    MODELS_PATH,
    openai_routes,
)
from atp_router.runtime.ingress.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
)
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity
from atp_router.task.diff import count_changed_lines
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Frame, RouteUpdate

__all__ = ["ROUTES", "SSE_CHUNK_BYTES", "build_app", "served_routes"]

#: An SSE chunk of stored events is cut once it reaches this size (bytes): the events
#: stored together go out in one write, but a batch of large frames is not one buffer.
SSE_CHUNK_BYTES = 64 * 1024

def _unknown_stream(sid: str) -> Response:
    # One answer for an id that never existed and an id of another tenant.
    return json_response(ErrorResponse(ErrorBody(code="EPROTO", reason=f"unknown stream {sid!r}")), 404)


def _decode_open(body: bytes) -> StreamOpenRequest:
    """``POST /v1/streams``'s body decoded, with the task's ``diff_loc`` counted
    here when the client did not give it (the router would count it at SYN: ~15 ms
    for 5 MB of diff, on the event loop; here it runs off it with the decoding,
    :func:`~atp_router.runtime.ingress.bodies.decode_off_loop`)."""
    try:
        req = msgspec.json.decode(body, type=StreamOpenRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ATPError(ErrorCode.EPROTO, f"bad request body: {e}") from None
    content = req.content
    if isinstance(content, dict) and isinstance(content.get("diff"), str) and "diff_loc" not in req.task:
        req.task["diff_loc"] = count_changed_lines(content["diff"])
    return req


# ---------------------------------------------------------------------------- handlers
async def open_stream(router: Router, request: Request, identity: Identity) -> Response:
    """``POST /v1/streams``: the SYN from a :class:`StreamOpenRequest`; 201 and the SYN-ACK's stream."""
    try:
        req = await decode_off_loop(_decode_open, await read_body(request, router.config.max_body_bytes))
        release_body(request)  # decoded: the raw bytes are done with
        ctx = await router.open_stream_async(
            task=req.task, content=req.content, budget=req.budget, qos=req.qos, window=req.window,
            idempotency_key=req.idempotency_key, identity=identity,
        )
    except BodyTooLarge as e:
        return render_error(e, 413)
    except BodyRefused:
        raise  # the authorized wrapper answers 429 + Retry-After and closes
    except ATPError as e:
        return render_error(e)
    route = ctx.route
    resp = json_response(StreamOpenResponse(
        session_id=ctx.session_id, stream_id=ctx.stream_id, window=ctx.window,
        route=RouteInfo(route.policy, [h.agent for h in route.next_hops],
                        ctx.gen.version if ctx.gen else router.gen.version),
    ), 201)
    resp.headers.update(ctx.qos_headers())
    return resp


async def post_frame(router: Router, request: Request, identity: Identity) -> Response:
    """``POST /v1/streams/{id}/frames``: one frame on the caller's stream; the frames answered."""
    sid = request.path_params["id"]
    codec = FrameCodec("json", keyring=router.keyring, require_checksum=False)
    try:
        ctx = router.find_stream(identity, sid)
        if ctx is None:
            return _unknown_stream(sid)
        # Signature, then the nonce + timestamp window when frames are signed (§11); ESEC audited.
        frame = router.decode_frame(codec, await read_body(request, router.config.max_body_bytes), identity)
        if frame.stream_id != sid or frame.session_id != ctx.session_id:
            raise ATPError(ErrorCode.EPROTO, "frame session_id/stream_id do not match the URL's stream")
        before = len(ctx.log.events)
        direct = router.receive_frame(frame, identity=identity, now=trio.current_time())
    except BodyTooLarge as e:
        return render_error(e, 413)
    except BodyRefused:
        raise  # the authorized wrapper answers 429 + Retry-After and closes
    except ATPError as e:
        return render_error(e)
    new = ctx.log.events[before:]
    if new:
        await ctx.log.wait_durable(new[-1].id)  # stored before sent (group commit)
    replies = direct + [ev.frame for ev in new]
    return json_response(FramesResponse(frames=replies))


async def stream_events(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/streams/{id}/events``: the stream's frames as SSE, from ``Last-Event-ID``."""
    sid = request.path_params["id"]
    ctx = router.find_stream(identity, sid)
    if ctx is None:
        return _unknown_stream(sid)
    try:
        after = int(request.headers.get("last-event-id", "0"))
    except ValueError:
        after = 0

    async def gen() -> AsyncIterator[bytes]:
        # An SSE request is a follower: when the last one goes, the stream is
        # detached and stays resumable for the grace period (spec §8).
        ctx.attach()
        try:
            async for batch in ctx.log.follow_batches(after):
                # The frame's JSON is encoded once (the store write) and shared; the events
                # stored together go in one chunk (one socket write) of about SSE_CHUNK_BYTES at most.
                parts, size = [], 0
                for ev in batch:
                    parts.append(b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.id, ev.type.encode(), ev.json_bytes()))
                    size += len(parts[-1])
                    if size >= SSE_CHUNK_BYTES:
                        yield b"".join(parts)
                        parts, size = [], 0
                if parts:
                    yield b"".join(parts)
        finally:
            ctx.detach()

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def reload(router: Router, request: Request, identity: Identity) -> Response:
    """``POST /v1/policies/reload``: a new RIB generation from the policy path or the body."""
    try:
        body = await read_body(request, router.config.max_policy_bytes)
        text = body.decode("utf-8") if body.strip() else None
        return json_response(msgspec.convert(router.reload(text, identity=identity), ReloadResponse))
    except UnicodeDecodeError:
        return render_error(ATPError(ErrorCode.EPROTO, "policy body is not UTF-8"))
    except BodyTooLarge as e:
        return render_error(e, 413)
    except BodyRefused:
        raise  # the authorized wrapper answers 429 + Retry-After and closes
    except ATPError as e:
        return render_error(e)


async def policies(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/policies``: the running RIB's text."""
    gen = router.gen
    return json_response(PolicyText(version=gen.version, source=gen.source,
                            files=[PolicyFile(file=f, text=t) for f, t in gen.texts]))


async def feedback(router: Router, request: Request, identity: Identity) -> Response:
    """``POST /v1/streams/{id}/feedback``: the client's score, learned once per stream."""
    sid = request.path_params["id"]
    try:
        try:
            req = msgspec.json.decode(await read_body(request, 64 * 1024), type=FeedbackRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ATPError(ErrorCode.EPROTO, f"bad feedback body: {e}") from None
    except BodyTooLarge as e:
        return render_error(e, 413)
    except BodyRefused:
        raise  # the authorized wrapper answers 429 + Retry-After and closes
    except ATPError as e:
        return render_error(e)
    ctx = router.find_stream(identity, sid)
    if ctx is None:
        return _unknown_stream(sid)
    try:
        out = router.learning.feedback(ctx, req.score, req.labels)
    except FeedbackRefused as e:
        return json_response(ErrorResponse(ErrorBody(code="EPROTO", reason=e.reason)), e.status)
    router.audit_event("feedback", identity, {"session_id": ctx.session_id, "stream_id": sid,
                                              "score": req.score, "labels": req.labels,
                                              "agents": out["agents"]})
    return json_response(msgspec.convert(out, FeedbackResponse))


async def fib(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/fib``: the bandits' arms and the live metrics the FIB scores with."""
    router.learning.sync(router.gen)
    view = router.learning.learner.fib_view()
    return json_response(msgspec.convert({"version": router.gen.version, **view}, FibView))


async def routes(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/routes``: the running FIB, scored with the live metrics."""
    table = router.gen.fib
    return json_response(RouteUpdate(version=table.version, routes=table.routes(live=router.learning.live_view())))


async def metrics(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/metrics``: the Prometheus exposition."""
    return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def keys(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/keys``: the JWKS verifying FINAL usage signatures."""
    return json_response({"keys": [router.usage_signer.public_jwk()]})


async def audit(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/audit``: audit records after ``since``, at most ``limit`` (the read is audited)."""
    try:
        since = int(request.query_params.get("since", "0"))
        limit = int(request.query_params.get("limit", "100"))
        if since < 0 or not 1 <= limit <= 1000:
            raise ValueError
    except ValueError:
        return render_error(ATPError(ErrorCode.EPROTO, "since must be >= 0 and limit 1..1000"))
    router.audit_event("admin", identity, {"action": "audit_read", "since": since, "limit": limit})
    records = router.store.audit_records(after=since, limit=limit)
    return json_response({"records": [msgspec.to_builtins(r) for r in records]})


async def health(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/health`` of an authenticated caller: the RIB generation and open streams."""
    return json_response(Health(status="ok", rib_version=router.gen.version, open_streams=router.open_count))


async def liveness(router: Router, request: Request) -> Response:
    """``GET /v1/health`` without a credential the router needs: ``{"status": "ok"}`` only."""
    return json_response(Liveness(status="ok"))


# ---------------------------------------------------------------------------- the route table
_JSON = "application/json"
_SSE = "text/event-stream"
_STREAM_ID: dict[str, Any] = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}


def _card(path: str) -> ApiRoute:
    return ApiRoute(
        "GET", path, None, None, "getAgentCard" + ("Json" if path.endswith(".json") else ""),
        "A2A agent card (one skill per routed task type); the router answers as an A2A server",
        Reply("A2A agent card (v0.3 shape; 1.0 fields included)", {_JSON: OBJECT}), public=True, by="a2a")


#: Every route of the control API, in the order served: the app (:func:`build_app`)
#: and the OpenAPI document (:func:`atp_router.runtime.admin.openapi.openapi_document`)
#: are both made from it. A route's ingress may serve it (``by``), never add one.
ROUTES: tuple[ApiRoute, ...] = (
    ApiRoute(
        "POST", "/v1/streams", "stream_open", open_stream, "openStream",
        "Open a stream (SYN → SYN-ACK, spec §8 steps 1-2); the task starts when `content` is given",
        Reply("stream opened", {_JSON: StreamOpenResponse}), status=201,
        request=RequestBody({_JSON: StreamOpenRequest}), errors=(400, 401, 403, 409, 413, 429, 503), task="opens"),
    ApiRoute(
        "POST", "/v1/streams/{id}/frames", "stream_access", post_frame, "postFrame",
        "Send one frame on a stream (HTTP fallback to the WebSocket ingress)",
        Reply("frames the router answered with", {_JSON: FramesResponse}), parameters=(_STREAM_ID,),
        request=RequestBody({_JSON: Frame}), errors=(400, 401, 403, 404, 413)),
    ApiRoute(
        "GET", "/v1/streams/{id}/events", "stream_access", stream_events, "streamEvents",
        "The stream's frames as Server-Sent Events (`event:` SYN_ACK, ACK, WINDOW_UPDATE, PARTIAL, "
        "ERROR, FINAL, FIN, RST; `data:` the frame as JSON; `id:` resumable with Last-Event-ID)",
        Reply("event stream", {_SSE: Sse(Frame)}),
        parameters=(_STREAM_ID, {"name": "Last-Event-ID", "in": "header", "required": False,
                                 "schema": {"type": "integer", "minimum": 0}}),
        errors=(401, 403, 404), task="follows"),
    ApiRoute(
        "POST", "/v1/streams/{id}/feedback", "stream_access", feedback, "postFeedback",
        "The client's score of its finished stream (0..1, once per stream): the next-hops that "
        "served it learn it, the policy's bandit too",
        Reply("the feedback taken", {_JSON: FeedbackResponse}), parameters=(_STREAM_ID,),
        request=RequestBody({_JSON: FeedbackRequest}), errors=(400, 401, 403, 404, 413),
        other={409: Reply("the stream is still running, feedback was already given, or no next-hop "
                          "answered it", {_JSON: ErrorResponse})}),
    ApiRoute(
        "POST", "/v1/policies/reload", "policy_reload", reload, "reloadPolicies",
        "Hot-reload the RIB from the router's policy path, or from a YAML/JSON body",
        Reply("the new RIB generation", {_JSON: ReloadResponse}),
        request=RequestBody({"application/yaml": STRING}, required=False), errors=(400, 401, 403, 413, 422)),
    ApiRoute(
        "GET", "/v1/policies", "policy_read", policies, "getPolicies",
        "The running RIB (admin): generation, source and its YAML as loaded",
        Reply("the running RIB's text", {_JSON: PolicyText}), errors=(401, 403)),
    ApiRoute(
        "GET", "/v1/routes", "routes_read", routes, "getRoutes", "The running FIB (ROUTE_UPDATE shape, spec §4.3)",
        Reply("routes", {_JSON: RouteUpdate}), errors=(401, 403)),
    ApiRoute(
        "GET", "/v1/fib", "routes_read", fib, "getFib",
        "Routing that learns (spec §6.2): each bandit policy's arms (estimate, uncertainty, count, "
        "cost, λ) and the live next-hop metrics the FIB scores with",
        Reply("bandits and live metrics", {_JSON: FibView}), errors=(401, 403)),
    ApiRoute(
        "GET", "/v1/metrics", "metrics_read", metrics, "getMetrics", "Prometheus metrics (spec §12)",
        Reply("Prometheus text exposition", {"text/plain": STRING}), errors=(401, 403)),
    ApiRoute(
        "GET", "/v1/health", "health_read", health, "getHealth", "Liveness and RIB generation",
        Reply("router health", {_JSON: Health}), errors=(401,), anonymous=liveness),
    ApiRoute(
        "GET", "/v1/ready", "health_read", ready, "getReady",
        "Readiness (for a load balancer): 200 when the state store records spend, a RIB with a policy is "
        "loaded, the state directory takes writes and no audit record waits for the store; else 503 with "
        "`Retry-After` naming each failing check. The checks' reasons only with a credential",
        Reply("ready: every check passed", {_JSON: Readiness}), errors=(401,), anonymous=readiness,
        other={503: Reply("not ready: the failing checks first (`Retry-After` in s)", {_JSON: Readiness})}),
    ApiRoute(
        "GET", "/v1/keys", "health_read", keys, "getKeys",
        "The router's public keys (JWKS): verify the `telemetry.usage.jws` of a FINAL (spec §19)",
        Reply("JWKS", {_JSON: OBJECT}), errors=(401,)),
    ApiRoute(
        "GET", "/v1/audit", "audit_read", audit, "getAudit",
        "The hash-chained audit trail (spec §11), admin only: records after `since`, at most `limit`",
        Reply("{records: [...]}", {_JSON: OBJECT}),
        parameters=({"name": "since", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0}},
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}),
        errors=(400, 401, 403)),
    *(_card(path) for path in CARD_PATHS),
    ApiRoute(
        "POST", A2A_PATH, None, None, "a2aRpc",
        "A2A JSON-RPC 2.0: message/send, message/stream (SSE), tasks/get, tasks/cancel, "
        "tasks/resubscribe, and the A2A 1.0 methods with header A2A-Version: 1.0; each message "
        "enters the router as an ATP stream",
        Reply("JSON-RPC response, or an SSE stream for message/stream", {_JSON: OBJECT, _SSE: STRING}),
        request=RequestBody({_JSON: OBJECT}), by="a2a", task="opens",
        other={401: Reply("ESEC: missing or unknown bearer token (JSON-RPC error)", {_JSON: OBJECT})}),
    ApiRoute(
        "POST", MCP_PATH, "stream_open", None, "mcp",
        "MCP (Model Context Protocol) streamable HTTP, stateless: JSON-RPC 2.0 `initialize`, `tools/list`, "
        "`tools/call` of `review_change`, `route_task` and `list_policies` (each call a stream, with "
        "`notifications/progress` while it runs when the request carries a progressToken)",
        Reply("JSON-RPC response, or an SSE stream of the call's notifications and response",
              {_JSON: OBJECT, _SSE: STRING}),
        request=RequestBody({_JSON: OBJECT}), by="mcp", task="opens", errors=(401, 403, 413, 429, 503)),
    ApiRoute(
        "GET", "/status", None, None, "statusPage",
        "The status page (HTML; it holds no data: it asks for an admin token and reads `/v1/status/events`)",
        Reply("the page", {"text/html": STRING}), public=True, by="status"),
    ApiRoute(
        "GET", "/status/{asset}", None, None, "statusAsset",
        "The status page's script and style sheet (`status.js`, `status.css`)",
        Reply("the file", {"text/javascript": STRING, "text/css": STRING}),
        parameters=({"name": "asset", "in": "path", "required": True, "schema": {"type": "string"}},),
        other={404: Reply("no such file")}, public=True, by="status"),
    ApiRoute(
        "GET", "/v1/status", "tenant_admin", None, "getStatus",
        "The router's live status (admin): open streams with their windows and budgets, next-hops "
        "with health, circuit breaker and AIMD cwnd, the FIB with bandit estimates, recent errors, "
        "and a bounded history (samples, finished tasks)",
        Reply("the status snapshot", {_JSON: StatusSnapshot}), errors=(401, 403), by="status"),
    ApiRoute(
        "GET", "/v1/status/events", "tenant_admin", None, "statusEvents",
        "The status snapshot as Server-Sent Events (admin): `event: status`, `data:` a "
        "StatusSnapshot, every second and as soon as open streams, the RIB or a circuit change",
        Reply("event stream", {_SSE: Sse(StatusSnapshot)}), errors=(401, 403), by="status",
        other={429: Reply("EWINDOW: too many status event streams are open", {_JSON: ErrorResponse})}),
    ApiRoute(
        "POST", CHAT_PATH, "stream_open", None, "createChatCompletion",
        "OpenAI-compatible chat completion: `model` names a task type or `policy:<name>`; the "
        "messages become the task of a stream opened as `POST /v1/streams` opens one (fan-out, "
        "escalation, consensus and budgets apply); `stream: true` answers with SSE chunks ending "
        "`data: [DONE]`; `atp` extension fields in the request and the answer",
        Reply("the completion, or (stream: true) its chunks as Server-Sent Events (`data:` a "
              "ChatCompletionChunk, then `data: [DONE]`)",
              {_JSON: ChatCompletion, _SSE: Sse(ChatCompletionChunk)}),
        request=RequestBody({_JSON: ChatCompletionRequest}), by="openai", error_shape="openai", task="opens",
        errors=(400, 401, 402, 403, 404, 409, 413, 429, 503, 504)),
    ApiRoute(
        "GET", MODELS_PATH, "stream_open", None, "listModels",
        "OpenAI-compatible model list: the task types and `policy:<name>` models the caller's "
        "tenant may use",
        Reply("the models", {_JSON: ModelList}), by="openai", error_shape="openai", errors=(401, 403)),
    ApiRoute(
        "GET", MODEL_PATH, "stream_open", None, "retrieveModel",
        "OpenAI-compatible model card: one model of the list above, by id (`client.models.retrieve`)",
        Reply("the model", {_JSON: ModelCard}), by="openai", error_shape="openai", errors=(401, 403, 404),
        parameters=({"name": "model", "in": "path", "required": True, "schema": {"type": "string"}},)),
)


# ---------------------------------------------------------------------------- the app
def _endpoint(router: Router, entry: ApiRoute, authorized: Authorized) -> Endpoint:
    """``entry``'s handler bound to ``router`` behind ``authorized(entry.action, …)``;
    with ``entry.anonymous``, a caller without ``Authorization`` whom the router
    would refuse gets that answer instead of a 401 (liveness for a load balancer or
    a probe: nothing about tenants or internals)."""
    if entry.handler is None or entry.action is None:
        raise ValueError(f"{entry.method} {entry.path}: a handler's route needs an action (a public "
                         "route is its ingress's)")
    guarded = authorized(entry.action, functools.partial(entry.handler, router))
    anonymous = entry.anonymous
    if anonymous is None:
        return guarded

    async def endpoint(request: Request) -> Response:
        if request.headers.get("authorization") is None:
            try:
                router.authenticate(None)
            except ATPError:
                return await anonymous(router, request)
        return await guarded(request)

    return endpoint


def served_routes(router: Router, table: Sequence[ApiRoute] = ROUTES,
                  mcp: McpIngress | None = None) -> list[BaseRoute]:
    """The Starlette routes of ``table``: a handler's entry behind the one
    :class:`Authorized`; an ingress's entry (``handler`` None) the route its
    ``*_routes`` function made (``mcp``: the MCP ingress whose lifespan the app
    runs; a new one by default). ValueError: an ingress serves a route the table
    lacks, lacks one the table names, or authorizes it for another action."""
    authorized = Authorized(router)
    mcp = mcp or McpIngress(router)
    offered: dict[tuple[str, str], Route] = {}
    for route in (*a2a_routes(router), *status_routes(router, authorized),
                  *openai_routes(router, authorized, read_body, BodyTooLarge), *mcp.routes(authorized)):
        assert isinstance(route, Route)
        offered.update({(m, route.path): route for m in route.methods or () if m != "HEAD"})
    out: list[BaseRoute] = []
    for entry in table:
        if entry.handler is not None:
            out.append(Route(entry.path, _endpoint(router, entry, authorized), methods=[entry.method]))
            continue
        route = offered.pop((entry.method, entry.path), None)
        if route is None:
            raise ValueError(f"{entry.by} serves no {entry.method} {entry.path} (route table)")
        if authorized.actions.get(route.endpoint) != entry.action:
            raise ValueError(f"{entry.by} authorizes {entry.method} {entry.path} otherwise than the route "
                             f"table ({entry.action!r})")
        out.append(route)
    if offered:
        raise ValueError(f"routes outside the route table: {sorted(offered)}")
    return out


def build_app(router: Router) -> Starlette:
    """The control API of ``router`` as an ASGI app (a :class:`RoutedApp`): the routes of :data:`ROUTES`;
    a route it does not have, or a method a route does not serve, is
    :func:`router_level_error`'s JSON 404 / 405."""
    # With tracing on (spec §12), a request's W3C traceparent is the parent of what it opens.
    middleware = [Middleware(TraceContextMiddleware)] if router.tracing is not None else []
    mcp = McpIngress(router)  # its SDK runs in the app's lifespan (atp_router.runtime.ingress.mcp)
    return RoutedApp(middleware=middleware, routes=served_routes(router, mcp=mcp), lifespan=mcp.lifespan,
                     exception_handlers={404: router_level_error, 405: router_level_error})
