"""Listening sockets and the ASGI lifespan of the lean HTTP server
(:mod:`atp_router.runtime.ingress.server`): the parts that run once per server,
not per connection."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from starlette.types import ASGIApp, Message

__all__ = ["lifespan", "listen_tcp", "listen_unix"]

log = logging.getLogger("atp_router.ingress.server")


def listen_tcp(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``SO_REUSEADDR``; IPv6 when ``host`` is one)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def listen_unix(path: str, backlog: int = 1024) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale file there is replaced), mode 0600."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


@asynccontextmanager
async def lifespan(app: ASGIApp, state: dict[str, Any]) -> AsyncIterator[None]:
    """The app's ASGI lifespan around the block: startup before, shutdown after
    (also when the block is cancelled: the app's lifespan task is shielded until
    it answered ``lifespan.shutdown``, at most 5 s). An app that refuses the
    lifespan scope (raises at once) runs without one; a failed startup raises
    :class:`RuntimeError` with the app's message."""
    send_in, recv_in = trio.open_memory_channel[Message](2)
    started, stopped, shield = trio.Event(), trio.Event(), trio.CancelScope(shield=True)
    failure: list[str] = []

    async def send(m: Message) -> None:
        kind = m["type"]
        if kind in ("lifespan.startup.failed", "lifespan.shutdown.failed"):
            failure.append(str(m.get("message", "")))
        (started if kind.startswith("lifespan.startup") else stopped).set()

    async def run() -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}
        with shield:
            try:
                await app(scope, recv_in.receive, send)
            except Exception:
                log.debug("the app has no ASGI lifespan", exc_info=True)
        started.set()
        stopped.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        try:
            await send_in.send({"type": "lifespan.startup"})
            await started.wait()
            if failure:
                raise RuntimeError(f"the app's startup failed: {failure[0]}")
            yield
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                if started.is_set() and not failure:
                    await send_in.send({"type": "lifespan.shutdown"})
                    await stopped.wait()
            shield.cancel()
