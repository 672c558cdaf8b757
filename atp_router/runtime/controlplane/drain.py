"""Draining a router before it stops (SIGTERM, a rolling restart): new streams
go to another router while the running ones finish.

:class:`DrainGate` is the router's first :class:`~atp_router.runtime.deployment.SynGate`
(sans-IO, no clock): once :meth:`DrainGate.begin` is called, a SYN that would open
a new stream is answered with a lone ``EAGENTDOWN`` ERROR (spec §10: this hop is
going away, fail over; HTTP 503 with ``Retry-After``), while a SYN resuming a
stream that runs here by its idempotency key still resumes it, and every running
stream — its calls, its events, its FINAL and their store writes — goes on.
``GET /v1/ready`` fails its ``drain`` check meanwhile, so a load balancer stops
sending work. The process stops when no stream is open or the deadline passes
(``--drain-s``; :func:`atp_router.deploy.cli` and the ``--workers`` worker), or at
once on a second signal; a stream still running then is interrupted as by any
stop, its reservation kept for recovery.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator

import trio

from atp_router.runtime.deployment import SynGate
from atp_router.security.authz import Refuse
from atp_router.security.identity import Identity
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Frame

__all__ = ["DRAIN_RETRY_AFTER_MS", "STOP_SIGNALS", "DrainGate", "drain", "stop_signal_receiver"]

log = logging.getLogger("atp_router.drain")
#: How often :func:`drain` looks at the open-stream count, s.
_POLL_S = 0.05

#: ``retry_after_ms`` of a SYN refused while draining: another router (or this one
#: restarted) can take it at once.
DRAIN_RETRY_AFTER_MS = 1000


class DrainGate(SynGate):
    """Refuses new streams once :meth:`begin` was called (module doc).
    ``running(tenant, idempotency_key)``: whether a stream of that key runs
    here (its SYN resumes it, so it is let through)."""

    __slots__ = ("draining", "requests", "running")

    def __init__(self, running: Callable[[str, str], bool]) -> None:
        self.running = running
        self.draining = False
        #: HTTP requests in progress (e.g. an event read forwarded to another
        #: ``--workers`` worker), counted by the server's app wrapper
        #: (:func:`atp_router.deploy.http_serve.track_requests`): the drain waits for them too.
        self.requests = 0

    def begin(self) -> None:
        """Stop taking new streams (idempotent)."""
        self.draining = True

    def refuse(self, frame: Frame, identity: Identity, task: TaskMeta | None) -> Refuse | None:
        if not self.draining:
            return None
        key = task.idempotency_key if task is not None else None
        if key and self.running(identity.tenant, key):
            return None
        return Refuse(ErrorCode.EAGENTDOWN, "this router is draining (shutting down): open the stream on "
                                            "another router", DRAIN_RETRY_AFTER_MS)


async def drain(gate: DrainGate, open_count: Callable[[], int], seconds: float,
                signals: AsyncIterator[int]) -> str:
    """Drain (module doc): :meth:`DrainGate.begin`, then return once no stream is
    open (``open_count()``) and no request the gate tracks is in progress, after
    ``seconds``, or at the next of ``signals`` (a
    second SIGTERM/SIGINT: stop now), whichever is first. Returns which, in
    words, for the stop's log line."""
    gate.begin()
    running = open_count()
    if seconds <= 0 or running + gate.requests == 0:
        return f"{running} streams running, no drain"
    log.warning("draining: %d streams running; stopping when they finish or after %g s (a second signal stops "
                "at once); new streams are refused", running, seconds)
    why = f"drain deadline ({seconds:g} s) passed"
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:

            async def second_signal() -> None:
                nonlocal why
                async for _ in signals:
                    why = "a second signal"
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(second_signal)
            while open_count() > 0 or gate.requests > 0:
                await trio.sleep(_POLL_S)
            why = "every stream finished"
            nursery.cancel_scope.cancel()
    return f"{why}; {open_count()} streams still running"


#: The signals that stop a router process: the first drains, a second stops at once.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signal_receiver() -> Iterator[AsyncIterator[int]]:
    """``trio.open_signal_receiver(SIGINT, SIGTERM)`` for a router process's stop
    (the single router, a ``--workers`` worker and their supervisor): the block
    receives the stop signal and, while :func:`drain` runs, a second one. Once the
    block is left — the stop under way: the store's last checkpoint, the workers'
    settlement, the interpreter's exit — a further SIGTERM or SIGINT is noted on
    stderr and ignored, so the process ends with its own status instead of being
    cut by the signal's default action (status -15). That covers a signal that
    came as the block was left (trio re-delivers it to the handler it restores:
    the noting one installed here before the block, not the default action) and
    one during the interpreter's finalization (Python resets a Python-level
    handler to the default action there: an ``atexit`` hook ignores both signals
    first). SIGKILL still stops at once. Main thread, inside ``trio.run``."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _noted)
    _ignore_at_exit()
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        yield signals


def _noted(signum: int, _frame: object) -> None:
    os.write(2, b"atp-router: already stopping; signal %d ignored (SIGKILL stops at once)\n" % signum)


def _ignore() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@functools.cache
def _ignore_at_exit() -> None:
    """Register (once) the ``atexit`` hook that ignores :data:`STOP_SIGNALS`:
    SIG_IGN, which the interpreter's finalization keeps (it resets handlers
    written in Python to the default action)."""
    atexit.register(_ignore)
