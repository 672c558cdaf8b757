"""What serves the HTTP API (issue 25 item 4): the lean HTTP/1.1 server
(:mod:`atp_router.runtime.ingress.server`) or hypercorn, as
:attr:`RouterConfig.http_server <atp_router.runtime.config.RouterConfig>` says
(``auto``: lean for plain HTTP, hypercorn with TLS, where it adds HTTP/2).

:func:`serve_http` takes binds as hypercorn spells them — ``host:port``,
``fd://N`` (a listening socket inherited from the ``--workers`` supervisor),
``unix:PATH`` — so both deployment modes choose the server in one place; :func:`track_requests`
counts the requests in progress that a drain before a stop waits for.
"""

from __future__ import annotations

import gc
import importlib
import logging
import socket
from collections.abc import Sequence
from typing import Any, Literal

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve
from starlette.types import ASGIApp, Receive, Scope, Send

from atp_router.runtime.config import RouterConfig
from atp_router.runtime.controlplane.drain import DrainGate
from atp_router.runtime.ingress.listen import listen_tcp, listen_unix
from atp_router.runtime.ingress.server import ServerLimits, serve_lean
from atp_router.security.tls import hypercorn_ssl

__all__ = ["GC_THRESHOLDS", "serve_http", "server_of", "settle_heap", "track_requests"]

#: The listen backlog: a burst of clients' SYNs is queued, not dropped (hypercorn's default is 100).
BACKLOG = 1024
#: The cyclic GC's thresholds while serving (CPython's default: 700, 10, 10). A task allocates
#: thousands of short-lived containers, nearly all freed by their reference counts; at 700 a
#: young collection ran every ~0.6 tasks and the full ones (28-49 ms each) every ~1.5 s — 4.6 %
#: of the router's CPU in the GC (bench/bench_gateway.py's closed loop, 16 in flight). At
#: 5,000 young objects: 1.4 %, young collections at most ~5 ms, middle ones ~15 ms, no full
#: one in 15 s (measured 2026-11-29, /proc CPU and gc.callbacks).
GC_THRESHOLDS = (5000, 10, 10)


def server_of(config: RouterConfig) -> Literal["lean", "hypercorn"]:
    """The server ``config`` asks for, ``auto`` resolved (module docstring)."""
    if config.http_server == "auto":
        return "hypercorn" if config.tls is not None else "lean"
    return config.http_server


async def serve_http(app: Any, config: RouterConfig, binds: Sequence[str], *, tls: bool = True,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``binds`` until cancelled, over ``config.tls`` when
    ``tls`` (and the config has it). ``task_status.started`` receives the bound
    addresses (``…host:port`` or ``unix:…``). Raises :class:`OSError` when a bind
    fails; :class:`RuntimeError` when the app's startup fails."""
    if server_of(config) == "hypercorn":
        hc = HyperConfig()
        hc.bind = list(binds)
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = 1.0
        hc.backlog = BACKLOG
        if tls and config.tls is not None:
            hypercorn_ssl(hc, config.tls)  # HTTPS, TLS 1.3, h2 and http/1.1, the same reloadable context as WSS
        await hyper_serve(app, hc, task_status=task_status)
        return
    ctx = config.tls.context_for(("http/1.1",)) if tls and config.tls is not None else None
    # The server's body bound is a backstop above the app's own (read_body: the JSON 413 a client gets).
    limits = ServerLimits(max_body_bytes=2 * max(config.max_body_bytes, config.max_policy_bytes), backlog=BACKLOG,
                          max_connections_per_peer=config.http_conns_per_peer)
    sockets = [_socket(b) for b in binds]
    await serve_lean(app, sockets, ssl_context=ctx, limits=limits, task_status=task_status)


def _socket(bind: str) -> socket.socket:
    """The listening socket of one hypercorn-style bind."""
    if bind.startswith("fd://"):
        return socket.socket(fileno=int(bind.removeprefix("fd://")))
    if bind.startswith("unix:"):
        return listen_unix(bind.removeprefix("unix:"), BACKLOG)
    host, _, port = bind.rpartition(":")
    return listen_tcp(host.strip("[]"), int(port), BACKLOG)


def settle_heap() -> None:
    """Once every listener is up: the SSE backend imported, the start-up objects
    out of the GC's generations (both stalled the event loop 20-70 ms mid-traffic)
    and the GC's thresholds raised to :data:`GC_THRESHOLDS`."""
    importlib.import_module("anyio._backends._trio")
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def track_requests(app: ASGIApp, gate: DrainGate) -> ASGIApp:
    """``app`` counting its HTTP requests in progress in ``gate.requests``, which a
    drain before a stop waits for (:mod:`atp_router.runtime.controlplane.drain`)."""
    async def tracked(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        gate.requests += 1
        try:
            await app(scope, receive, send)
        finally:
            gate.requests -= 1
    return tracked
