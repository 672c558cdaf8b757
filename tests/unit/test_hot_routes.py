"""RoutedApp (``atp_router/runtime/ingress/hot_routes.py``): a static route served
without the route search answers exactly as Starlette does — the same messages
for the same requests, its errors (500, HTTP exceptions, 404/405) included — and
the search is skipped only where Starlette's router would pick that very route."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from atp_router.runtime.ingress.authorized import router_level_error
from atp_router.runtime.ingress.hot_routes import RoutedApp, static_routes


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"path": request.url.path, "method": request.method, "n": len(body),
                         "endpoint": request.scope["endpoint"].__name__, "params": request.path_params,
                         "route": request.scope["route"].path, "app": isinstance(request.scope["app"], Starlette),
                         "router": request.scope["router"] is request.app.router})


async def item(request: Request) -> Response:
    return PlainTextResponse(f"item {request.path_params['n']}")


async def teapot(request: Request) -> Response:
    raise HTTPException(418, "short and stout", headers={"x-pot": "1"})


async def gone(request: Request) -> Response:
    raise HTTPException(404)


async def boom(request: Request) -> Response:
    raise ValueError("boom")


async def shadowed(request: Request) -> Response:
    return PlainTextResponse("never")


def routes() -> list[Any]:
    return [
        Route("/v1/echo", echo, methods=["POST", "GET"]),
        Route("/v1/items/{n:int}", item),
        Route("/v1/teapot", teapot, methods=["POST"]),
        Route("/v1/gone", gone),
        Route("/v1/boom", boom, methods=["POST"]),
        Route("/v1/{name}", echo, methods=["PUT"]),  # a PUT /v1/shadow goes here, first
        Route("/v1/shadow", shadowed, methods=["PUT", "GET"]),
        Mount("/sub", routes=[Route("/x", echo)]),
    ]


def make(cls: type[Starlette], **kw: Any) -> Starlette:
    return cls(routes=routes(), exception_handlers={404: router_level_error, 405: router_level_error}, **kw)


async def call(app: ASGIApp, method: str, path: str, body: bytes = b"") -> tuple[list[Any], BaseException | None]:
    scope: Scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                    "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                    "query_string": b"", "root_path": "", "headers": [(b"host", b"test")],
                    "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    sent: list[Any] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if given:
            return {"type": "http.disconnect"}
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(dict(message, headers=sorted(message.get("headers", []))))

    try:
        await app(scope, receive, send)
    except ValueError as e:  # boom's, raised on to the server after the 500
        return sent, e
    return sent, None


REQUESTS = [("POST", "/v1/echo", b"12345"), ("GET", "/v1/echo", b""), ("HEAD", "/v1/echo", b""),
            ("DELETE", "/v1/echo", b""), ("GET", "/v1/items/7", b""), ("GET", "/v1/items/x", b""),
            ("POST", "/v1/teapot", b""), ("GET", "/v1/gone", b""), ("POST", "/v1/boom", b""),
            ("PUT", "/v1/shadow", b""), ("GET", "/v1/shadow", b""), ("GET", "/sub/x", b""),
            ("GET", "/nowhere", b""), ("GET", "/v1/echo/", b"")]


@pytest.mark.parametrize(("method", "path", "body"), REQUESTS)
async def test_the_same_answer_as_starlette(method: str, path: str, body: bytes) -> None:
    want, want_exc = await call(make(Starlette), method, path, body)
    got, got_exc = await call(make(RoutedApp), method, path, body)
    assert got == want
    assert repr(got_exc) == repr(want_exc)


def test_only_the_routes_the_router_would_pick_are_static() -> None:
    table = static_routes(make(Starlette).router.routes)
    assert set(table) == {("/v1/echo", "POST"), ("/v1/echo", "GET"), ("/v1/echo", "HEAD"), ("/v1/teapot", "POST"),
                          ("/v1/gone", "GET"), ("/v1/gone", "HEAD"), ("/v1/boom", "POST"), ("/v1/shadow", "GET"),
                          ("/v1/shadow", "HEAD")}
    assert ("/v1/shadow", "PUT") not in table  # /v1/{name} comes first for a PUT


async def test_a_static_route_skips_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    app = make(RoutedApp)
    searched = []
    real = app.router.app

    async def search(scope: Scope, receive: Receive, send: Send) -> None:
        searched.append(scope["path"])
        await real(scope, receive, send)

    monkeypatch.setattr(app.router, "app", search)
    app.router.middleware_stack = search
    await call(app, "POST", "/v1/echo", b"x")
    await call(app, "GET", "/v1/items/3")
    assert searched == ["/v1/items/3"]


class Tag:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (b"x-tag", b"1")])
            await send(message)
        await self.app(scope, receive, tagged)


async def test_middleware_of_the_app_takes_every_request_through_the_stack() -> None:
    got, _ = await call(make(RoutedApp, middleware=[Middleware(Tag)]), "POST", "/v1/echo", b"x")
    assert (b"x-tag", b"1") in got[0]["headers"]
