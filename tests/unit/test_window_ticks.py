"""The router-wide WINDOW_UPDATE timer (atp_router/runtime/dataplane/ticks.py; spec
§5.4, issue 25 item 5): one heap and one loop for every running task's periodic
check, on trio's autojump clock (no sleeps). Real :class:`Window` objects: what is
sent is what ``update_due`` decides."""

from __future__ import annotations

import math

import trio

from atp_router.flow.window import Window
from atp_router.runtime.dataplane.ticks import WindowTicks
from atp_router.wire.frame import Window as W


def window(interval_ms: int, keepalive_ms: int) -> Window:
    w = Window(W(4, 1000, 10_000), update_interval_ms=interval_ms, update_keepalive_ms=keepalive_ms)
    assert w.update_due(trio.current_time()) is not None  # the SYN+ACK carried the first one
    return w


async def test_each_window_gets_its_keepalive_on_its_own_period(autojump_clock):
    ticks = WindowTicks()
    sent: dict[str, list[float]] = {"a": [], "b": []}
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        ticks.add(window(100, 300), lambda u: sent["a"].append(round(trio.current_time() - t0, 3)))
        ticks.add(window(250, 500), lambda u: sent["b"].append(round(trio.current_time() - t0, 3)))
        await trio.sleep(1.05)
        nursery.cancel_scope.cancel()
    assert sent == {"a": [0.3, 0.6, 0.9], "b": [0.5, 1.0]}


async def test_a_removed_entry_sends_nothing_more_and_leaves_the_heap(autojump_clock):
    ticks = WindowTicks()
    sent: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        entry = ticks.add(window(100, 200), lambda u: sent.append(trio.current_time()))
        await trio.sleep(0.45)
        ticks.remove(entry)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert len(sent) == 2 and len(ticks) == 0


async def test_an_earlier_entry_wakes_a_loop_sleeping_until_a_later_one(autojump_clock):
    ticks = WindowTicks()
    sent: list[tuple[str, float]] = []
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        ticks.add(window(5_000, 5_000), lambda u: sent.append(("slow", trio.current_time() - t0)))
        await trio.sleep(0.01)  # the loop now sleeps until 5 s
        ticks.add(window(100, 100), lambda u: sent.append(("fast", trio.current_time() - t0)))
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    assert [name for name, _ in sent][:1] == ["fast"]
    assert math.isclose(sent[0][1], 0.11, abs_tol=1e-6)


async def test_a_moved_window_is_sent_at_its_next_check_and_an_unmoved_one_only_at_its_keepalive(autojump_clock):
    ticks = WindowTicks()
    w = window(100, 1_000)
    sent: list[tuple[float, int]] = []
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks.run)
        ticks.add(w, lambda u: sent.append((round(trio.current_time() - t0, 3), u.window.max_parallel)))
        await trio.sleep(0.25)
        w.set_limits(W(3, 1000, 10_000))  # changed here, not by a call: sent at the next periodic check
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    assert sent == [(0.3, 3)]
