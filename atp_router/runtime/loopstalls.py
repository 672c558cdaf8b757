"""The router's own event-loop stalls (issue 20), seen by a trio
:class:`~trio.abc.Instrument`.

A trio loop alternates between running a batch of ready tasks and waiting for
I/O. A stall is a stretch in which it did not look at I/O for longer than
``threshold_s``: a batch that ran that long (a blocking call on the loop: a
store round trip on a busy disk, a large decode), or an I/O wait that returned
that much later than asked (the process was not scheduled: the machine's CPUs
were busy elsewhere).

Why it matters: a timeout that **fires during a stall** says nothing about the
next-hop. The peer's answer (or the loopback connect's completion) may be
sitting in the socket while the loop is not running; when it runs again, trio
sees the expired deadline together with the data, and the wait ends in a
timeout. Counting that against the next-hop's circuit breaker opens it for
every tenant because *this router* was slow: on a loaded machine it took both
next-hops of issue 12's load test out of the FIB (``cannot connect to
http://127.0.0.1:…: ConnectTimeout``). So the data plane asks
:meth:`LoopStalls.stalled_s` when a call times out, and
:func:`~atp_router.flow.breaker.attribute` makes such a failure the router's own
(:attr:`~atp_router.flow.breaker.Fault.LOCAL`): not counted, no AIMD decrease,
retried.

Cost: two calls of :func:`time.monotonic` per loop iteration. Times are
``time.monotonic()`` seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import trio

#: A batch or late I/O wait at least this long is a stall, s.
STALL_S = 0.5


class LoopStalls(trio.abc.Instrument):
    """Records the loop's stalls (module doc): the last ``keep`` as ``(start,
    end)`` pairs, plus totals for metrics. Install it with
    :func:`trio.lowlevel.add_instrument` in the run it watches (the router
    does, while it serves)."""

    def __init__(self, threshold_s: float = STALL_S, *, keep: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be > 0")
        self.threshold_s = threshold_s
        self._clock = clock
        self._stalls: deque[tuple[float, float]] = deque(maxlen=keep)
        #: When the current batch started (the last I/O wait ended); ``None`` before the first.
        self._ran_from: float | None = None
        self._wait_from = 0.0
        self._waiting = False
        #: Stalls seen, and their time summed (s).
        self.count = 0
        self.total_s = 0.0
        #: Failures attributed to a stall (:attr:`~atp_router.flow.breaker.Fault.LOCAL`), counted by the data plane.
        self.local_faults = 0

    def _stall(self, start: float, end: float) -> None:
        self._stalls.append((start, end))
        self.count += 1
        self.total_s += end - start

    def before_io_wait(self, timeout: float) -> None:
        now = self._clock()
        if self._ran_from is not None and now - self._ran_from >= self.threshold_s:
            self._stall(self._ran_from, now)  # a batch that ran this long
        self._wait_from = now + max(0.0, timeout)  # when the wait should end at the latest
        self._waiting = True

    def after_io_wait(self, timeout: float) -> None:
        now = self._clock()
        if now - self._wait_from >= self.threshold_s:
            self._stall(self._wait_from, now)  # the process was not scheduled for this long
        self._ran_from = now
        self._waiting = False

    def _running_s(self, now: float) -> float:
        """How long the batch running now has run, once ``threshold_s`` (else 0.0)."""
        if self._ran_from is None or self._waiting or now - self._ran_from < self.threshold_s:
            return 0.0
        return now - self._ran_from

    def stalled_s(self, since: float, now: float | None = None) -> float:
        """Seconds the loop stalled between ``since`` and ``now`` (default: the
        clock): recorded stalls overlapping that span, and the batch running
        now if it has run ``threshold_s`` already."""
        now = self._clock() if now is None else now
        spans = list(self._stalls)
        if self._running_s(now):
            spans.append((now - self._running_s(now), now))
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in spans)

    def recent_stall_s(self, within_s: float = 1.0, now: float | None = None) -> float:
        """The longest stall (s) that ended within the last ``within_s`` seconds
        or runs now (this batch, once ``threshold_s`` long); 0.0 if none. A
        timeout seen now fired during it if it is the one that just ended."""
        now = self._clock() if now is None else now
        longest = self._running_s(now)
        for start, end in reversed(self._stalls):
            if end < now - within_s:
                break
            longest = max(longest, end - start)
        return longest
