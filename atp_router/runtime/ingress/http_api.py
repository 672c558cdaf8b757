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

Every request is authenticated once (:meth:`Router.authenticate
<atp_router.runtime.router.Router.authenticate>`, the ``Authorization`` header) and its
action authorized (:meth:`Router.authorize <atp_router.runtime.router.Router.authorize>`):

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
``health_read`` (any authenticated)   ``GET /v1/keys``, ``GET /v1/health`` with a credential
(none)                                ``GET /v1/health`` without ``Authorization``: liveness only
====================================  ==========================================

Streams are looked up within the caller's tenant only (spec §11): the id of
another tenant's stream answers exactly like an id that never existed (404, the
same body).

Errors are ``{"error": {"code": <spec §10 code>, "reason": ..., [file, key]}}``
with HTTP 400 (EPROTO), 401 (ESEC: missing or unknown bearer token, on every
endpoint but a credential-less ``GET /v1/health`` when the router has tokens), 403 (ESEC: a role the action needs, or a
bad frame signature), 404 (unknown stream), 409 (EWINDOW: the router's stream
table is full), 413 (EPROTO: a body over ``max_body_bytes`` / ``max_policy_bytes``),
422 (refused policy), 429 (EWINDOW: the tenant's stream quota or open rate, or
its request bodies in flight over ``tenant_body_bytes`` — :mod:`atp_router.runtime.ingress.bodies`,
refused before the body is read —, with ``Retry-After`` in s), 503 (EAGENTDOWN: no route; EBUDGET with ``Retry-After``:
the budget store several routers share cannot be reached). The OpenAI-compatible
endpoints answer in OpenAI's error shape instead, ``{"error": {"message",
"type", "code", "param"}}`` with the same codes and statuses
(:mod:`atp_router.runtime.ingress.openai`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from atp_router.observability.metrics import CONTENT_TYPE_LATEST
from atp_router.observability.tracing import TraceContextMiddleware
from atp_router.runtime.admin.fibview import FibView
from atp_router.runtime.admin.status import status_routes
from atp_router.runtime.controlplane.learning import FeedbackRefused
from atp_router.runtime.ingress.a2a import a2a_routes
from atp_router.runtime.ingress.bodies import (
    BodyRefused,
    BodyTooLarge,
    decode_off_loop,
    open_body,
    read_body,
    release_body,
)
from atp_router.runtime.ingress.openai import openai_routes
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity
from atp_router.task.diff import count_changed_lines
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ATPError, ErrorCode, PolicyError
from atp_router.wire.frame import Budget, Frame, QoS, RouteUpdate, Window


class StreamOpenRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Body of ``POST /v1/streams``. ``task`` is the task meta (``task_type`` and match
    keys); ``content`` the task body (``code_review``: ``{"diff", "files"}``);
    ``budget`` in float USD and tokens."""

    task: dict[str, Any]
    content: dict[str, Any] | None = None
    budget: Budget | None = None
    qos: QoS | None = None
    window: Window | None = None
    idempotency_key: str | None = None


class RouteInfo(msgspec.Struct):
    policy: str
    next_hops: list[str]
    rib_version: int


class StreamOpenResponse(msgspec.Struct):
    session_id: str
    stream_id: str
    window: Window
    route: RouteInfo


class FramesResponse(msgspec.Struct):
    """Frames the router answered a posted frame with (ACK, ERROR, RST, …)."""

    frames: list[Frame]


class EgressChange(msgspec.Struct):
    """An endpoint, secret reference or file a reload added, removed or changed
    (:func:`~atp_router.security.policy_guard.egress_changes`): names and URLs, never
    secret values."""

    kind: str
    key: str
    change: str
    old: str | None
    new: str | None


class ReloadResponse(msgspec.Struct):
    """Body of a successful reload: the new generation, what it changed towards
    the outside (``changes``, also in the audit record) and who reloaded (``by``,
    the caller's subject)."""

    version: int
    policies: int
    agents: list[str]
    changes: list[EgressChange] = []
    by: str = ""


class PolicyFault(msgspec.Struct, omit_defaults=True):
    """One fault of a refused RIB: file, 1-based line (when found), key, reason."""

    file: str
    key: str
    reason: str
    line: int | None = None


class ErrorBody(msgspec.Struct, omit_defaults=True):
    """``code`` and ``reason``; a refused RIB adds the first fault's ``file``,
    ``line`` and ``key`` (``reason`` is its bare reason) and ``errors``, every
    fault found."""

    code: str
    reason: str
    file: str | None = None
    key: str | None = None
    line: int | None = None
    errors: list[PolicyFault] | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class PolicyFile(msgspec.Struct):
    #: A ``--policies`` file, or ``"<request body>"`` for a RIB posted to reload.
    file: str
    text: str


class PolicyText(msgspec.Struct):
    """Body of ``GET /v1/policies``: the running RIB generation ``version``, where
    it came from (``source``) and its YAML as read at load, file by file."""

    version: int
    source: str
    files: list[PolicyFile]


class FeedbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/streams/{id}/feedback`` (spec §6.2 quality signal):
    ``score`` 0..1 (1: the result was right and useful), ``labels`` up to 16
    short tags (e.g. ``"false_positive"``, ``"missed_bug"``), kept with it."""

    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    labels: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]],
                      msgspec.Meta(max_length=16)] = []


class FeedbackResponse(msgspec.Struct):
    """The feedback taken: the next-hops it is about, whether the policy's
    bandit learned it (``bandit``), and its ``scope``: ``"tenant"`` (it trains
    this tenant's routing only) or ``"shared"`` (a trusted client: everyone's,
    and the next-hops' live quality)."""

    stream_id: str
    agents: list[str]
    score: float
    labels: list[str]
    bandit: bool
    scope: str


class Liveness(msgspec.Struct):
    """``GET /v1/health`` without a credential: ``{"status": "ok"}``, nothing more."""

    status: str


class Health(msgspec.Struct):
    """``GET /v1/health`` of an authenticated caller: liveness, the RIB
    generation and the router's open stream count."""

    status: str
    rib_version: int
    open_streams: int


_STATUS = {
    ErrorCode.EPROTO: 400,
    ErrorCode.ESEC: 403,
    ErrorCode.EWINDOW: 409,
    ErrorCode.EBUDGET: 402,
    ErrorCode.EAGENTDOWN: 503,
    ErrorCode.ETIMEOUT: 504,
}

_enc = msgspec.json.Encoder()


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def _error(e: ATPError, status: int | None = None) -> Response:
    body = ErrorBody(code=str(e.code), reason=e.reason)
    if isinstance(e, PolicyError):
        body = ErrorBody(code=str(e.code), reason=e.detail, file=e.file, key=e.key, line=e.line,
                         errors=[PolicyFault(file=x.file, key=x.key, reason=x.detail, line=x.line)
                                 for x in e.errors])
        status = status or 422
    if status is None and e.code in (ErrorCode.EWINDOW, ErrorCode.EBUDGET) and e.retry_after_ms is not None:
        # EWINDOW: the tenant's stream quota or open rate (spec §11); EBUDGET: the
        # shared budget store cannot be reached (atp_router.deploy.cluster). Try again later.
        resp = _json(ErrorResponse(error=body), 429 if e.code is ErrorCode.EWINDOW else 503)
        resp.headers["Retry-After"] = str(max(1, -(-e.retry_after_ms // 1000)))
        return resp
    return _json(ErrorResponse(error=body), status or _STATUS.get(e.code, 400))


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


def build_app(router: Router) -> Starlette:
    """The control API of ``router`` as an ASGI app."""
    codec = FrameCodec("json", keyring=router.keyring, require_checksum=False)
    max_body = router.config.max_body_bytes
    max_policy = router.config.max_policy_bytes

    def authorized(
        action: str, handler: Callable[[Request, Identity], Awaitable[Response]],
        render: Callable[[ATPError, int], Response] = _error,
    ) -> Callable[[Request], Awaitable[Response]]:
        """Every endpoint answers 401 ESEC before anything else without a valid
        identity, then 403 ESEC when the identity may not do ``action``; both
        in the body ``render(error, status)`` makes (default ``{"error": {code,
        reason}}``; the OpenAI ingress renders OpenAI's error shape)."""

        async def endpoint(request: Request) -> Response:
            try:
                identity = router.authenticate(request.headers.get("authorization"))
            except ATPError as e:
                router.authentication_refused(e, ingress="http")
                resp = render(e, 401)
                resp.headers["WWW-Authenticate"] = getattr(e, "www_authenticate", None) or 'Bearer realm="atp"'
                return resp
            try:
                router.authorize(identity, action)
            except ATPError as e:
                return render(e, 403)
            if request.method != "POST":
                return await handler(request, identity)
            # The tenant is known before a byte of the body is read: its bodies in
            # flight are bounded (atp_router.runtime.ingress.bodies; 429 EWINDOW, the body unread).
            try:
                open_body(router.body_budget, request, identity.tenant)
            except BodyRefused as e:
                return body_refused(e, render)
            try:
                return await handler(request, identity)
            except BodyRefused as e:
                return body_refused(e, render)
            finally:
                release_body(request)

        return endpoint

    def body_refused(e: BodyRefused, render: Callable[[ATPError, int], Response]) -> Response:
        router.metrics.errors.labels(str(ErrorCode.EWINDOW)).inc()
        resp = render(e, 429)
        resp.headers["Retry-After"] = str(max(1, -(-(e.retry_after_ms or 1000) // 1000)))
        resp.headers["Connection"] = "close"  # the rest of the body is not read
        return resp

    def unknown_stream(sid: str) -> Response:
        # One answer for an id that never existed and an id of another tenant.
        return _json(ErrorResponse(ErrorBody(code="EPROTO", reason=f"unknown stream {sid!r}")), 404)

    async def open_stream(request: Request, identity: Identity) -> Response:
        try:
            req = await decode_off_loop(_decode_open, await read_body(request, max_body))
            release_body(request)  # decoded: the raw bytes are done with
            ctx = router.open_stream(
                task=req.task, content=req.content, budget=req.budget, qos=req.qos, window=req.window,
                idempotency_key=req.idempotency_key, identity=identity,
            )
        except BodyTooLarge as e:
            return _error(e, 413)
        except BodyRefused:
            raise
        except ATPError as e:
            return _error(e)
        route = ctx.route
        return _json(StreamOpenResponse(
            session_id=ctx.session_id, stream_id=ctx.stream_id, window=ctx.window,
            route=RouteInfo(route.policy, [h.agent for h in route.next_hops], ctx.gen.version if ctx.gen else router.gen.version),
        ), 201)

    async def post_frame(request: Request, identity: Identity) -> Response:
        sid = request.path_params["id"]
        try:
            ctx = router.find_stream(identity, sid)
            if ctx is None:
                return unknown_stream(sid)
            # Signature, then the nonce + timestamp window when frames are signed (§11); ESEC audited.
            frame = router.decode_frame(codec, await read_body(request, max_body), identity)
            if frame.stream_id != sid or frame.session_id != ctx.session_id:
                raise ATPError(ErrorCode.EPROTO, "frame session_id/stream_id do not match the URL's stream")
            before = len(ctx.log.events)
            direct = router.receive_frame(frame, identity=identity, now=trio.current_time())
        except BodyTooLarge as e:
            return _error(e, 413)
        except BodyRefused:
            raise  # the authorized wrapper answers 429 + Retry-After and closes
        except ATPError as e:
            return _error(e)
        new = ctx.log.events[before:]
        if new:
            await ctx.log.wait_durable(new[-1].id)  # stored before sent (group commit)
        replies = direct + [ev.frame for ev in new]
        return _json(FramesResponse(frames=replies))

    async def events(request: Request, identity: Identity) -> Response:
        sid = request.path_params["id"]
        ctx = router.find_stream(identity, sid)
        if ctx is None:
            return unknown_stream(sid)
        try:
            after = int(request.headers.get("last-event-id", "0"))
        except ValueError:
            after = 0

        async def gen():
            # An SSE request is a follower: when the last one goes, the stream is
            # detached and stays resumable for the grace period (spec §8).
            ctx.attach()
            try:
                async for ev in ctx.log.follow(after):
                    # The frame's JSON is encoded once (the store write) and shared.
                    yield b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.id, ev.type.encode(), ev.json_bytes())
            finally:
                ctx.detach()

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def reload(request: Request, identity: Identity) -> Response:
        try:
            body = await read_body(request, max_policy)
            text = body.decode("utf-8") if body.strip() else None
            return _json(msgspec.convert(router.reload(text, identity=identity), ReloadResponse))
        except UnicodeDecodeError:
            return _error(ATPError(ErrorCode.EPROTO, "policy body is not UTF-8"))
        except BodyTooLarge as e:
            return _error(e, 413)
        except BodyRefused:
            raise  # the authorized wrapper answers 429 + Retry-After and closes
        except ATPError as e:
            return _error(e)

    async def policies(request: Request, identity: Identity) -> Response:
        gen = router.gen
        return _json(PolicyText(version=gen.version, source=gen.source,
                                files=[PolicyFile(file=f, text=t) for f, t in gen.texts]))

    async def feedback(request: Request, identity: Identity) -> Response:
        sid = request.path_params["id"]
        try:
            try:
                req = msgspec.json.decode(await read_body(request, 64 * 1024), type=FeedbackRequest)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                raise ATPError(ErrorCode.EPROTO, f"bad feedback body: {e}") from None
        except BodyTooLarge as e:
            return _error(e, 413)
        except BodyRefused:
            raise  # the authorized wrapper answers 429 + Retry-After and closes
        except ATPError as e:
            return _error(e)
        ctx = router.find_stream(identity, sid)
        if ctx is None:
            return unknown_stream(sid)
        try:
            out = router.learning.feedback(ctx, req.score, req.labels)
        except FeedbackRefused as e:
            return _json(ErrorResponse(ErrorBody(code="EPROTO", reason=e.reason)), e.status)
        router.audit_event("feedback", identity, {"session_id": ctx.session_id, "stream_id": sid,
                                                  "score": req.score, "labels": req.labels,
                                                  "agents": out["agents"]})
        return _json(msgspec.convert(out, FeedbackResponse))

    async def fib(request: Request, identity: Identity) -> Response:
        router.learning.sync(router.gen)
        view = router.learning.learner.fib_view()
        return _json(msgspec.convert({"version": router.gen.version, **view}, FibView))

    async def routes(request: Request, identity: Identity) -> Response:
        fib = router.gen.fib
        return _json(RouteUpdate(version=fib.version, routes=fib.routes(live=router.learning.live_view())))

    async def metrics(request: Request, identity: Identity) -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def keys(request: Request, identity: Identity) -> Response:
        return _json({"keys": [router.usage_signer.public_jwk()]})

    async def audit(request: Request, identity: Identity) -> Response:
        try:
            since = int(request.query_params.get("since", "0"))
            limit = int(request.query_params.get("limit", "100"))
            if since < 0 or not 1 <= limit <= 1000:
                raise ValueError
        except ValueError:
            return _error(ATPError(ErrorCode.EPROTO, "since must be >= 0 and limit 1..1000"))
        router.audit_event("admin", identity, {"action": "audit_read", "since": since, "limit": limit})
        records = router.store.audit_records(after=since, limit=limit)
        return _json({"records": [msgspec.to_builtins(r) for r in records]})

    async def health(request: Request, identity: Identity) -> Response:
        return _json(Health(status="ok", rib_version=router.gen.version, open_streams=router.open_count))

    detailed_health = authorized("health_read", health)

    async def public_health(request: Request) -> Response:
        # Liveness for any caller (a load balancer, a probe): a caller without an
        # Authorization header that the router does not let in as it is (it has
        # credentials configured) gets only {"status": "ok"}, nothing about tenants
        # or internals; any other caller is authenticated as everywhere (401 on a
        # bad credential) and gets the RIB generation and the open stream count.
        if request.headers.get("authorization") is None:
            try:
                router.authenticate(None)
            except ATPError:
                return _json(Liveness(status="ok"))
        return await detailed_health(request)

    # With tracing on (spec §12), a request's W3C traceparent is the parent of what it opens.
    middleware = [Middleware(TraceContextMiddleware)] if router.tracing is not None else []
    return Starlette(middleware=middleware, routes=[
        Route("/v1/streams", authorized("stream_open", open_stream), methods=["POST"]),
        Route("/v1/streams/{id}/frames", authorized("stream_access", post_frame), methods=["POST"]),
        Route("/v1/streams/{id}/events", authorized("stream_access", events), methods=["GET"]),
        Route("/v1/streams/{id}/feedback", authorized("stream_access", feedback), methods=["POST"]),
        Route("/v1/policies/reload", authorized("policy_reload", reload), methods=["POST"]),
        Route("/v1/policies", authorized("policy_read", policies), methods=["GET"]),
        Route("/v1/routes", authorized("routes_read", routes), methods=["GET"]),
        Route("/v1/fib", authorized("routes_read", fib), methods=["GET"]),
        Route("/v1/metrics", authorized("metrics_read", metrics), methods=["GET"]),
        Route("/v1/health", public_health, methods=["GET"]),
        Route("/v1/keys", authorized("health_read", keys), methods=["GET"]),
        Route("/v1/audit", authorized("audit_read", audit), methods=["GET"]),
        *a2a_routes(router),
        # The live status page and its admin-only data (atp_router.runtime.admin.status).
        *status_routes(router, authorized),
        # OpenAI-compatible ingress: the same authorized() and the same stream-open path.
        *openai_routes(router, authorized, read_body, BodyTooLarge),
    ])
