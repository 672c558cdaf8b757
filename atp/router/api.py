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
``GET  /v1/routes``                    the running FIB (ROUTE_UPDATE shape)
``GET  /v1/metrics``                   Prometheus exposition
``GET  /v1/health``                    liveness and RIB generation
=====================================  =========================================

Errors are ``{"error": {"code": <spec §10 code>, "reason": ..., [file, key]}}``
with HTTP 400 (EPROTO), 401 (ESEC: missing or unknown bearer token, on every
endpoint when the router has tokens), 403 (ESEC: another client's stream or a
bad frame signature), 404 (unknown stream), 409 (EWINDOW), 422 (refused policy),
503 (EAGENTDOWN: no route).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from atp.router.a2a_server import a2a_routes
from atp.router.core import Router
from atp.router.metrics import CONTENT_TYPE_LATEST
from atp.wire.codec import FrameCodec
from atp.wire.errors import ATPError, ErrorCode, PolicyError
from atp.wire.frame import Budget, Frame, QoS, RouteUpdate, Window


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


class ReloadResponse(msgspec.Struct):
    version: int
    policies: int
    agents: list[str]


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    reason: str
    file: str | None = None
    key: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class Health(msgspec.Struct):
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
        body = ErrorBody(code=str(e.code), reason=e.detail, file=e.file, key=e.key)
        status = status or 422
    return _json(ErrorResponse(error=body), status or _STATUS.get(e.code, 400))


def build_app(router: Router) -> Starlette:
    """The control API of ``router`` as an ASGI app."""
    codec = FrameCodec("json", hmac_key=router.config.hmac_key, require_checksum=False)

    def client_of(request: Request) -> str:
        """Authenticate the bearer token: the client it names (see
        :meth:`Router.authenticate <atp.router.core.Router.authenticate>`)."""
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        client = router.authenticate(token if scheme.lower() == "bearer" else None)
        if client is None:
            raise ATPError(ErrorCode.ESEC, "missing or unknown bearer token")
        return client

    def authenticated(
        handler: Callable[[Request, str], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        """Every endpoint answers 401 ESEC before anything else without a valid token."""

        async def endpoint(request: Request) -> Response:
            try:
                client = client_of(request)
            except ATPError as e:
                return _error(e, 401)
            return await handler(request, client)

        return endpoint

    async def open_stream(request: Request, client: str) -> Response:
        try:
            try:
                req = msgspec.json.decode(await request.body(), type=StreamOpenRequest)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                raise ATPError(ErrorCode.EPROTO, f"bad request body: {e}") from None
            ctx = router.open_stream(
                task=req.task, content=req.content, budget=req.budget, qos=req.qos, window=req.window,
                idempotency_key=req.idempotency_key, client=client,
            )
        except ATPError as e:
            return _error(e)
        route = ctx.route
        return _json(StreamOpenResponse(
            session_id=ctx.session_id, stream_id=ctx.stream_id, window=ctx.window,
            route=RouteInfo(route.policy, [h.agent for h in route.next_hops], ctx.gen.version if ctx.gen else router.gen.version),
        ), 201)

    async def post_frame(request: Request, client: str) -> Response:
        sid = request.path_params["id"]
        try:
            ctx = router.streams.get(sid)
            if ctx is None:
                return _json(ErrorResponse(ErrorBody(code="EPROTO", reason=f"unknown stream {sid!r}")), 404)
            if ctx.client != client:
                raise ATPError(ErrorCode.ESEC, "stream belongs to another client")
            frame = codec.decode(await request.body())
            if frame.stream_id != sid or frame.session_id != ctx.session_id:
                raise ATPError(ErrorCode.EPROTO, "frame session_id/stream_id do not match the URL's stream")
            before = len(ctx.log.events)
            direct = router.receive_frame(frame, client=client, now=trio.current_time())
        except ATPError as e:
            return _error(e)
        replies = direct + [ev.frame for ev in ctx.log.events[before:]]
        return _json(FramesResponse(frames=replies))

    async def events(request: Request, client: str) -> Response:
        sid = request.path_params["id"]
        ctx = router.streams.get(sid)
        if ctx is None:
            return _json(ErrorResponse(ErrorBody(code="EPROTO", reason=f"unknown stream {sid!r}")), 404)
        if ctx.client != client:
            return _error(ATPError(ErrorCode.ESEC, "stream belongs to another client"))
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
                    yield b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.id, ev.type.encode(), _enc.encode(ev.frame))
            finally:
                ctx.detach()

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def reload(request: Request, client: str) -> Response:
        try:
            body = await request.body()
            text = body.decode("utf-8") if body.strip() else None
            return _json(msgspec.convert(router.reload(text), ReloadResponse))
        except UnicodeDecodeError:
            return _error(ATPError(ErrorCode.EPROTO, "policy body is not UTF-8"))
        except ATPError as e:
            return _error(e)

    async def routes(request: Request, client: str) -> Response:
        fib = router.gen.fib
        return _json(RouteUpdate(version=fib.version, routes=fib.routes()))

    async def metrics(request: Request, client: str) -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request, client: str) -> Response:
        return _json(Health(status="ok", rib_version=router.gen.version, open_streams=router.open_count))

    return Starlette(routes=[
        Route("/v1/streams", authenticated(open_stream), methods=["POST"]),
        Route("/v1/streams/{id}/frames", authenticated(post_frame), methods=["POST"]),
        Route("/v1/streams/{id}/events", authenticated(events), methods=["GET"]),
        Route("/v1/policies/reload", authenticated(reload), methods=["POST"]),
        Route("/v1/routes", authenticated(routes), methods=["GET"]),
        Route("/v1/metrics", authenticated(metrics), methods=["GET"]),
        Route("/v1/health", authenticated(health), methods=["GET"]),
        *a2a_routes(router),
    ])
