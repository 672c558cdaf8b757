"""The control API's one authentication and authorization wrapper (spec §11, §22),
:class:`Authorized`, and its error rendering (:func:`render_error`: ``{"error":
{code, reason, …}}`` with the HTTP status of the spec §10 code; the router's own
404/405, :func:`router_level_error`).

:func:`atp_router.runtime.ingress.http_api.build_app` makes one per app and puts
every authenticated route behind it, the OpenAI-compatible ingress's and the
status page's data included (they are handed it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from atp_router.runtime.ingress.bodies import BodyRefused, open_body, release_body
from atp_router.runtime.ingress.http_types import ErrorBody, ErrorResponse, PolicyFault
from atp_router.security.identity import Identity
from atp_router.wire.errors import ATPError, ErrorCode, PolicyError

if TYPE_CHECKING:
    from atp_router.runtime.router import Router

__all__ = ["Authorized", "Bound", "Endpoint", "Render", "json_response", "render_error", "router_level_error"]

_STATUS = {
    ErrorCode.EPROTO: 400,
    ErrorCode.ESEC: 403,
    ErrorCode.EWINDOW: 409,
    ErrorCode.EBUDGET: 402,
    ErrorCode.EAGENTDOWN: 503,
    ErrorCode.ETIMEOUT: 504,
}

_enc = msgspec.json.Encoder()

#: An error rendered as a response with an HTTP status (the control API's shape, or OpenAI's).
Render = Callable[[ATPError, int], Response]
#: A handler once its router is bound: ``handler(request, identity)``.
Bound = Callable[[Request, Identity], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def render_error(e: ATPError, status: int | None = None) -> Response:
    body = ErrorBody(code=str(e.code), reason=e.reason)
    if isinstance(e, PolicyError):
        body = ErrorBody(code=str(e.code), reason=e.detail, file=e.file, key=e.key, line=e.line,
                         errors=[PolicyFault(file=x.file, key=x.key, reason=x.detail, line=x.line)
                                 for x in e.errors])
        status = status or 422
    status = status or getattr(e, "status", None)  # e.g. IdempotencyConflict: 409
    if status is None and e.code in (ErrorCode.EWINDOW, ErrorCode.EBUDGET, ErrorCode.EAGENTDOWN) \
            and e.retry_after_ms is not None:
        # EWINDOW: the tenant's stream quota or open rate (spec §11); EBUDGET: the
        # shared budget store cannot be reached (atp_router.deploy.cluster); EAGENTDOWN:
        # this router drains before it stops (atp_router.runtime.controlplane.drain). Try again later.
        resp = json_response(ErrorResponse(error=body), 429 if e.code is ErrorCode.EWINDOW else 503)
        resp.headers["Retry-After"] = str(max(1, -(-e.retry_after_ms // 1000)))
        return resp
    return json_response(ErrorResponse(error=body), status or _STATUS.get(e.code, 400))



async def router_level_error(request: Request, exc: Exception) -> Response:
    """A 404 (no such route) or 405 (a method the route does not serve; its
    ``Allow`` header kept) of the router itself, as one JSON error object both
    client kinds read: OpenAI's (``message``, ``type``, ``param``, ``code``: the
    ``openai`` SDK's NotFoundError) and the control API's (``code``, ``reason``)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    path = request.url.path[:200]
    if status == 405:
        allowed = (exc.headers or {}).get("Allow", "") if isinstance(exc, HTTPException) else ""
        msg, kind = f"{request.method} is not served on {path} (allowed: {allowed})", "invalid_request_error"
    else:
        msg, kind = f"no route {request.method} {path} on this router", "not_found_error"
    body = {"error": {"message": msg, "type": kind, "param": None, "code": "EPROTO", "reason": msg}}
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


class Authorized:
    """The control API's authentication and authorization, one per app, handed to
    the ingresses that add routes (``authorized(action, handler, render)``).

    Every endpoint answers 401 ESEC before anything else without a valid identity,
    then 403 ESEC when the identity may not do ``action``; both in the body
    ``render(error, status)`` makes (default ``{"error": {code, reason}}``; the
    OpenAI ingress renders OpenAI's error shape). A POST's body is then admitted
    against its tenant's bodies in flight (429 EWINDOW, the body unread;
    :mod:`atp_router.runtime.ingress.bodies`). ``actions`` records the action of
    each endpoint made, which ``build_app`` checks against the route table."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.actions: dict[Endpoint, str] = {}

    def __call__(self, action: str, handler: Bound, render: Render = render_error) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            router = self.router
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
                return self._body_refused(e, render)
            try:
                return await handler(request, identity)
            except BodyRefused as e:
                return self._body_refused(e, render)
            finally:
                release_body(request)

        self.actions[endpoint] = action
        return endpoint

    def _body_refused(self, e: BodyRefused, render: Render) -> Response:
        self.router.metrics.errors.labels(str(ErrorCode.EWINDOW)).inc()
        resp = render(e, 429)
        resp.headers["Retry-After"] = str(max(1, -(-(e.retry_after_ms or 1000) // 1000)))
        resp.headers["Connection"] = "close"  # the rest of the body is not read
        return resp
