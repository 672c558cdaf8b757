"""The control API's app with its static routes served without a route search
(:class:`RoutedApp`, made by :func:`atp_router.runtime.ingress.http_api.build_app`).

Starlette serves a request through five layers — the app, its error middleware,
its exception middleware, the router (each route's path pattern tried in order)
and the route — before the endpoint's own ``request_response`` wrapper. On the
OpenAI-compatible ingress's hot path (``POST /v1/chat/completions``: 24 routes,
the chat route the 22nd) the search and the layers were ~2 % of a py-spy profile of
the router under ``bench/bench_gateway.py``'s load; the app's dispatch of a request
to a trivial endpoint took 10.1 us, 2.4 us here (2026-11-29). :class:`RoutedApp`
keeps every layer that does something for such a request and skips the search:

* a request whose path (no ``root_path``) and method Starlette's router would give
  to a route without path parameters — the first route in the table matching them
  fully (method included) is that route: computed once, with the routes' own
  ``matches`` — goes to that route's ASGI app (``request_response``: its
  ``Request``, the endpoint, and the HTTP exceptions it raises rendered by the app's
  handlers, the 404/405 ones included) under the app's error middleware (an
  exception before the response starts is its 500, then raised to the server);
  the scope gets what the router and the app put there (``app``, ``router``,
  ``route``, ``endpoint``, ``path_params``, ``starlette.exception_handlers``);
* everything else — a path with parameters, a method the route does not serve
  (405), no route (404), the lifespan, and every request when the app has
  middleware of its own (tracing) — goes through Starlette as before.
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["RoutedApp", "static_routes"]


def static_routes(routes: list[BaseRoute]) -> dict[tuple[str, str], Route]:
    """``(path, method) -> route`` for each route of ``routes`` without path
    parameters and each of its methods, when Starlette's router (the first route
    whose ``matches`` is FULL) gives that request to that very route."""
    out: dict[tuple[str, str], Route] = {}
    for route in routes:
        if not isinstance(route, Route) or route.param_convertors or not route.methods:
            continue
        for method in route.methods:
            scope = {"type": "http", "path": route.path, "root_path": "", "method": method}
            first = next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)
            if first is route:
                out.setdefault((route.path, method), route)
    return out


class RoutedApp(Starlette):
    """A :class:`~starlette.applications.Starlette` whose static routes are served
    without the route search (module docstring)."""

    #: ``(path, method) -> (route, its app under the error middleware)``; built at the first request.
    _static: dict[tuple[str, str], tuple[Route, ASGIApp]] | None = None
    #: What the exception middleware puts in the scope (its handlers, by class and by status).
    _handlers: tuple[Any, Any] = ({}, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hit = None
        if scope["type"] == "http" and not scope.get("root_path"):
            static = self._static
            if static is None:
                static = self._static = self._static_apps()
            hit = static.get((scope["path"], scope["method"]))
        if hit is None:
            await super().__call__(scope, receive, send)
            return
        route, app = hit
        scope["app"] = self
        scope["starlette.exception_handlers"] = self._handlers
        if "router" not in scope:
            scope["router"] = self.router
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = dict(scope.get("path_params", {}))
        await app(scope, receive, send)

    def _static_apps(self) -> dict[tuple[str, str], tuple[Route, ASGIApp]]:
        """Each static route's app under the app's error middleware (the exception
        middleware's handlers kept for the scope); none when the app has middleware
        of its own (every request then takes the whole stack)."""
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        outer = self.middleware_stack
        if self.user_middleware or not isinstance(outer, ServerErrorMiddleware) \
                or not isinstance(outer.app, ExceptionMiddleware) or outer.app.app is not self.router \
                or self.router.middleware_stack != self.router.app:
            return {}
        self._handlers = (outer.app._exception_handlers, outer.app._status_handlers)
        return {key: (route, ServerErrorMiddleware(route.app, handler=outer.handler, debug=outer.debug))
                for key, route in static_routes(self.router.routes).items()}
