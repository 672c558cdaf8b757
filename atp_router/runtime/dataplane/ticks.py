"""One router-wide timer for the periodic WINDOW_UPDATE check of every running
task (spec §5.4; issue 25 item 5): instead of a trio task per stream sleeping
until its window's next check, every running task's window is an entry in one
heap ordered by :meth:`Window.next_update_at <atp_router.flow.window.Window.next_update_at>`,
and one router task (:meth:`WindowTicks.run`, started by the router beside its
other timers) wakes at the earliest, asks each due window for its
:meth:`~atp_router.flow.window.Window.update_due` and sends what it returns.

A window's next check only moves later (a check, or an update sent for a move,
sets it), so an entry whose key is early wakes the loop once for nothing and is
filed again under its window's real time: no check is ever late. An entry is
removed lazily (:meth:`WindowTicks.remove` marks it; the loop drops it when it
surfaces). Without :meth:`WindowTicks.run` running (a part tested alone), no
periodic check happens; the updates a window's moves trigger at once are sent by
the admission path, not here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from atp_router.flow.window import Window
from atp_router.wire.frame import WindowUpdate

__all__ = ["Ticking", "WindowTicks"]


@dataclass(slots=True, eq=False)
class Ticking:
    """One running task's window in :class:`WindowTicks`: ``emit`` sends the
    WINDOW_UPDATE the periodic check returns (the stream's
    :meth:`~atp_router.runtime.dataplane.plan.StreamIO.emit_window_update`)."""

    window: Window
    emit: Callable[[WindowUpdate], None]
    live: bool = True


class WindowTicks:
    """The heap of running tasks' windows and the one loop that checks them (module doc)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Ticking]] = []
        self._seq = itertools.count()
        self._wake = trio.Event()
        self._earliest = math.inf

    def __len__(self) -> int:
        """Entries in the heap, removed ones not yet dropped included."""
        return len(self._heap)

    def add(self, window: Window, emit: Callable[[WindowUpdate], None]) -> Ticking:
        """File ``window`` for its periodic checks until :meth:`remove`; returns its entry."""
        entry = Ticking(window, emit)
        self._file(entry)
        return entry

    def remove(self, entry: Ticking) -> None:
        """No more checks for ``entry`` (its task ended); dropped when it surfaces."""
        entry.live = False

    def _file(self, entry: Ticking) -> None:
        at = entry.window.next_update_at()
        heapq.heappush(self._heap, (at, next(self._seq), entry))
        if at < self._earliest:
            self._earliest = at
            self._wake.set()  # the loop sleeps until a later time: wake it to sleep less

    def tick(self, now: float) -> float:
        """Check every entry due at ``now`` (seconds, trio's clock), send what
        is due, file each again at its window's next check; returns when the
        next entry is due (``inf``: none)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if not entry.live:
                continue
            update = entry.window.update_due(now)
            if update is not None:
                entry.emit(update)
            # A check moves the next one to now + update_interval_ms; never file at or before
            # now, so an interval of 0 cannot spin here (the loop yields first).
            at = max(entry.window.next_update_at(), math.nextafter(now, math.inf))
            heapq.heappush(heap, (at, next(self._seq), entry))
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        self._earliest = heap[0][0] if heap else math.inf
        return self._earliest

    async def run(self) -> None:
        """Check the windows as they fall due, until cancelled (a router task)."""
        while True:
            wake_at = self.tick(trio.current_time())
            self._wake = trio.Event()
            with trio.move_on_at(wake_at):
                await self._wake.wait()
