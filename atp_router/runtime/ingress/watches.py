"""The disconnect watch of the lean HTTP server's streaming responses (issue 25 item 4).

The server (:mod:`atp_router.runtime.ingress.server`) speaks ASGI 2.4: ``send`` raises
:class:`ClientGone` (an ``OSError``) once the client has left, so Starlette's streaming
responses keep no disconnect watch of their own — before 2.4 each kept an anyio task
group of two tasks a response, ~10 % of the router's CPU a task (``bench/bench_gateway.py``).
What that watch gave is kept here, cheaper: a response started :data:`WATCH_AFTER_S`
ago and not complete (streaming, or its head held back until its first chunk: an SSE
stream waiting for its first event) gets one task (:func:`watch`) reading its connection; when the
client leaves, the app's call is cancelled at once — an SSE stream waiting on a silent
model stops spending then, not at its next chunk. A response that completes sooner —
most — never costs a task or a read. One timer task a server (:class:`DisconnectWatches`)
starts the watches; a client that leaves is noticed within twice :data:`WATCH_AFTER_S`.
An app that reads ``receive`` itself while it streams (its own watch: the MCP ingress's
library) is left to it: the connection has one reader at a time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from atp_router.runtime.ingress.server import _Conn, _Exchange

__all__ = ["WATCH_AFTER_S", "ClientGone", "DisconnectWatches", "watch"]

log = logging.getLogger("atp_router.ingress.server")

#: A response not complete this long after its start is watched for its client leaving, s.
WATCH_AFTER_S = 0.05


class ClientGone(OSError):
    """Raised by ``send`` once the client has closed the connection (ASGI 2.4:
    a server-specific ``OSError``; Starlette's streaming responses stop on it)."""


class DisconnectWatches:
    """The responses of one server waiting for their watch (module docstring):
    :meth:`add` at a response's start, :meth:`discard` at its end, :meth:`run`
    (a task of the server's nursery) starts the watches due."""

    def __init__(self, nursery: trio.Nursery, refused: tuple[type[Exception], ...]) -> None:
        self.nursery = nursery
        #: What a read raises for a request the server refuses (a pipelined one, while the response streams).
        self.refused = refused
        self.pending: dict[_Exchange, float] = {}
        self._wake = trio.Event()  # set when a response is added: an idle server's timer sleeps

    def add(self, ex: _Exchange) -> None:
        self.pending[ex] = trio.current_time()
        self._wake.set()

    def discard(self, ex: _Exchange) -> None:
        self.pending.pop(ex, None)

    async def run(self) -> None:
        while True:
            if not self.pending:
                await self._wake.wait()
                self._wake = trio.Event()
            await trio.sleep(WATCH_AFTER_S)
            since = trio.current_time() - WATCH_AFTER_S
            for ex in [ex for ex, t in self.pending.items() if t <= since]:
                del self.pending[ex]
                ex.watched = trio.Event()
                self.nursery.start_soon(watch, ex.conn, ex, self.refused)


async def watch(conn: _Conn, ex: _Exchange, refused: tuple[type[Exception], ...]) -> None:
    """While ``ex``'s response streams, read ``conn`` (then its one reader): when the
    client leaves — or breaks the protocol in a pipelined request — the app's call
    is cancelled. Ends when the response completes (its last ``send`` cancels the
    read); at once when the app is reading itself."""
    assert ex.watched is not None
    if conn.reading or not ex.req.complete or ex.complete:
        # The app waits on receive (it sees the client leave itself), or has not read the whole
        # request (its body is the app's to read, at its pace), or the response is over.
        ex.watched.set()
        return
    conn.watching = True
    try:
        with ex.watch_scope:
            while not ex.complete and not conn.eof:
                if len(conn.parser.requests) > 1:
                    await ex.done.wait()  # a pipelined request has begun: nothing more is read
                    break
                try:
                    await conn.read()
                except refused as e:
                    conn.error = e
                    conn.eof = True
                except Exception:  # runs in the server's nursery: only this connection may end
                    log.exception("HTTP: the disconnect watch of a streaming response failed")
                    conn.eof = True
        if conn.eof and not ex.complete:
            ex.done.set()
            ex.app_scope.cancel()
    finally:
        conn.watching = False
        ex.watched.set()
