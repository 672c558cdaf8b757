"""The trio and HTTP side of the live status (issue 11 item 4): :class:`StatusFeed`
builds shared, rate-limited snapshots with :class:`~atp_router.runtime.admin.status.StatusBuilder`
(scanning the stream table in chunks, a checkpoint between them) and streams
them as Server-Sent Events; :func:`status_routes` serves them and the page
(``GET /status``, its files in ``static/``) in the control API
(:mod:`atp_router.runtime.ingress.http_api`, whose route table names these routes).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from atp_router.runtime.admin.status import StatusBuilder

if TYPE_CHECKING:
    from atp_router.runtime.router import Router

__all__ = ["PAGE_ASSETS", "PAGE_HEADERS", "StatusFeed", "status_routes"]

_enc = msgspec.json.Encoder()



# ---------------------------------------------------------------------------- trio
class StatusFeed:
    """The trio side (module docstring): shared, rate-limited snapshots of
    ``router`` and their SSE stream. ``chunk``: streams scanned between two
    checkpoints; at most ``max_watchers`` event streams at once."""

    def __init__(self, router: Router, builder: StatusBuilder | None = None, *, interval_s: float = 1.0,
                 min_interval_s: float = 0.25, poll_s: float = 0.1, chunk: int = 2000,
                 max_watchers: int = 16) -> None:
        self.router = router
        self.builder = builder or StatusBuilder()
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self.poll_s = poll_s
        self.chunk = chunk
        self.max_watchers = max_watchers
        self.watchers = 0
        self._lock = trio.Lock()
        self._last: bytes | None = None
        self._last_at = -math.inf
        self._last_mark: tuple[Any, ...] | None = None

    def mark(self) -> tuple[Any, ...]:
        """What a watcher should see at once when it changes: open and retained
        streams, the RIB generation, the agents whose circuit is open."""
        r = self.router
        return (r.open_count, len(r.streams), r.gen.version,
                frozenset(r.gates.breakers.open_agents(trio.current_time())))

    async def snapshot(self) -> bytes:
        """The current snapshot as JSON: the last one if it is younger than
        ``min_interval_s``, else a new one (one build at a time)."""
        async with self._lock:
            now = trio.current_time()
            if self._last is not None and now - self._last_at < self.min_interval_s:
                return self._last
            mark = self.mark()
            scan = self.builder.scan(now, _wall_ms())
            ctxs = list(self.router.streams.values())
            for i in range(0, len(ctxs), self.chunk):
                if i:
                    await trio.lowlevel.checkpoint()
                scan.feed(ctxs[i:i + self.chunk])
            data = self.builder.encode(self.builder.build(self.router, scan))
            self._last, self._last_at, self._last_mark = data, trio.current_time(), mark
            return data

    def full(self) -> bool:
        """``max_watchers`` event streams are open: refuse another (HTTP 429)."""
        return self.watchers >= self.max_watchers

    async def events(self) -> AsyncIterator[bytes]:
        """SSE ``status`` events (``id:`` the snapshot's ``seq``): one now, then
        every ``interval_s``, or sooner (no sooner than ``min_interval_s``)
        when :meth:`mark` changes. A watcher over ``max_watchers`` (two
        requests that passed :meth:`full` together) gets one ``error`` event
        and the stream ends."""
        if self.full():
            yield b"event: error\ndata: {\"code\":\"EWINDOW\",\"reason\":\"too many status watchers\"}\n\n"
            return
        self.watchers += 1
        try:
            while True:
                data = await self.snapshot()
                sent_mark, sent_at = self._last_mark, trio.current_time()
                yield b"id: %d\nevent: status\ndata: %s\n\n" % (self.builder.seq, data)
                while True:
                    await trio.sleep(self.poll_s)
                    waited = trio.current_time() - sent_at
                    if waited >= self.interval_s or (waited >= self.min_interval_s and self.mark() != sent_mark):
                        break
        finally:
            self.watchers -= 1


def _wall_ms() -> int:
    return int(time.time() * 1000)



# ---------------------------------------------------------------------------- HTTP
#: The page's files (atp_router/runtime/admin/static), served as they are: no CDN, no fetch
#: of anything else (the page works without internet).
PAGE_ASSETS = {"status.js": "text/javascript; charset=utf-8", "status.css": "text/css; charset=utf-8"}
#: The page runs only its own script and talks only to this router.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def status_routes(router: Router, authorized: Callable[..., Any], feed: StatusFeed | None = None) -> list[Any]:
    """The status routes of ``router`` (wired by :func:`atp_router.runtime.ingress.http_api.build_app`,
    whose route table, :data:`~atp_router.runtime.ingress.http_api.ROUTES`, documents them):

    ==============================  =============================================
    ``GET /status``                 the page (public HTML; it holds no data)
    ``GET /status/{asset}``         its script and style sheet
    ``GET /v1/status``              one :class:`StatusSnapshot` (JSON)
    ``GET /v1/status/events``       ``status`` Server-Sent Events of snapshots
    ==============================  =============================================

    The data endpoints need the ``tenant_admin`` action (role admin): they show
    every tenant's streams. ``authorized(action, handler)`` is the API's
    authentication and authorization wrapper (401 / 403 ESEC). A watcher over
    ``feed.max_watchers`` is answered 429 ``EWINDOW``."""
    from importlib.resources import files

    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    feed = feed or StatusFeed(router)
    static = files("atp_router.runtime.admin") / "static"
    page = (static / "status.html").read_bytes()
    assets = {name: (static / name).read_bytes() for name in PAGE_ASSETS}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["asset"]
        if name not in assets:
            return Response(b"not found", status_code=404, media_type="text/plain", headers=PAGE_HEADERS)
        return Response(assets[name], media_type=PAGE_ASSETS[name], headers=PAGE_HEADERS)

    async def snapshot(request: Request, identity: Any) -> Response:
        return Response(await feed.snapshot(), media_type="application/json", headers={"Cache-Control": "no-store"})

    async def events(request: Request, identity: Any) -> Response:
        if feed.full():
            body = _enc.encode({"error": {"code": "EWINDOW", "reason": f"at most {feed.max_watchers} status "
                                                                       "event streams at once"}})
            return Response(body, status_code=429, media_type="application/json", headers={"Retry-After": "5"})
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return [
        Route("/status", index, methods=["GET"]),
        Route("/status/{asset}", asset, methods=["GET"]),
        Route("/v1/status", authorized("tenant_admin", snapshot), methods=["GET"]),
        Route("/v1/status/events", authorized("tenant_admin", events), methods=["GET"]),
    ]
