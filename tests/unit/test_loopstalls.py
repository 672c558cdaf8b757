"""The router's own event-loop stalls (issue 20; atp_router.runtime.loopstalls): a
timeout that fired while the router's loop was not running is the router's fault
(atp_router.flow.breaker ``Fault.LOCAL``), not the next-hop's.

The end-to-end tests run a real router in this process with a real
OpenAI-compatible adapter to a model on loopback HTTP (tests.replay_server
``BillingModel``); the stall is provoked the way a router meets it on a loaded
machine: a blocking call on its event loop (``time.sleep``, as a store round
trip on a busy disk blocks it), and the test first checks the stall happened.
"""

from __future__ import annotations

import time

import atp
import pytest
import trio

from atp_router.flow.breaker import LOCAL_STALL_S, Fault, Origin, attribute
from atp_router.runtime.loopstalls import LoopStalls
from tests.helpers import start_router_on
from tests.replay_server import BillingModel, serve


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_long_batch_and_a_late_wait_are_stalls_and_short_ones_are_not():
    clock = FakeClock()
    s = LoopStalls(0.5, clock=clock)
    s.before_io_wait(0.0)
    s.after_io_wait(0.0)  # the first batch starts at 100
    clock.t += 0.3
    s.before_io_wait(10.0)  # a 0.3 s batch: no stall
    clock.t += 2.0
    s.after_io_wait(10.0)  # woken by I/O before its 10 s timeout: no stall
    assert (s.count, s.total_s) == (0, 0.0)
    clock.t += 3.0
    s.before_io_wait(0.5)  # a 3 s batch (a blocking call): a stall 102.3 .. 105.3
    clock.t += 1.5
    s.after_io_wait(0.5)  # back 1 s after its 0.5 s timeout: a stall 105.8 .. 106.8
    assert s.count == 2 and s.total_s == pytest.approx(4.0)
    assert s.recent_stall_s(1.0) == pytest.approx(1.0)  # the one that just ended
    assert s.recent_stall_s(2.0) == pytest.approx(3.0)  # both ended within 2 s: the longest
    assert s.stalled_s(since=104.3) == pytest.approx(2.0)  # 1 s of the first, 1 s of the second
    clock.t += 5.0
    assert s.recent_stall_s(1.0) == pytest.approx(5.0)  # the batch running now, 5 s long already
    clock.t = 106.8 + 1.2
    s.before_io_wait(10.0)  # that batch ended after 1.2 s: a stall; the loop waits for I/O
    clock.t += 2.0
    assert s.recent_stall_s(1.0) == 0.0  # nothing within the last second (an idle wait is no stall)
    s.after_io_wait(10.0)
    assert s.recent_stall_s(1.0) == 0.0 and s.count == 3
    with pytest.raises(ValueError):
        LoopStalls(0.0)


def test_a_timeout_right_after_a_stall_is_the_routers_own_and_nothing_else_is():
    assert attribute(Origin.ADAPTER, client_fault=False, tenant_bound=False, timed_out=True,
                     stall_s=LOCAL_STALL_S) is Fault.LOCAL
    assert attribute(Origin.DEADLINE, client_fault=False, tenant_bound=True, timed_out=True,
                     stall_s=LOCAL_STALL_S + 1) is Fault.LOCAL
    # Not a timeout (a refused connection, a 500): the peer's, stall or not.
    assert attribute(Origin.ADAPTER, client_fault=False, tenant_bound=False, timed_out=False,
                     stall_s=10.0) is Fault.PEER
    # A short stall leaves the verdict alone; the client's fault stays the client's.
    assert attribute(Origin.ADAPTER, client_fault=False, tenant_bound=False, timed_out=True,
                     stall_s=LOCAL_STALL_S - 0.1) is Fault.PEER
    assert attribute(Origin.ADAPTER, client_fault=True, tenant_bound=False, timed_out=True,
                     stall_s=10.0) is Fault.CLIENT


async def test_the_instrument_sees_a_blocking_call_on_a_real_loop():
    s = LoopStalls(0.2)
    trio.lowlevel.add_instrument(s)
    try:
        await trio.sleep(0.01)
        time.sleep(0.4)  # noqa: ASYNC251  # a blocking call on the loop: what is measured
        await trio.sleep(0.01)
    finally:
        trio.lowlevel.remove_instrument(s)
    assert s.count >= 1 and s.total_s >= 0.4


class Delay:
    """A ``BillingModel.hold``: each call waits ``seconds[n]`` (the n-th call; the last for later ones)."""

    def __init__(self, *seconds: float) -> None:
        self.seconds = list(seconds)
        self.n = 0

    async def wait(self) -> None:
        s = self.seconds[min(self.n, len(self.seconds) - 1)]
        self.n += 1
        await trio.sleep(s)


async def _router(nursery, tmp_path, model: BillingModel):
    doc = {"models": {"m": {"provider": "openai_compat", "ctx": "8k", "cost": 1, "base_url": model.url, "model": "m",
                            "max_out_tokens": 64}},
           "agents": {"summarizer": {"layer": "L2", "p95_ms": 100, "model": "m", "timeout_ms": 1_000}},
           "policies": [{"name": "p", "match": {"task_type": "summarize"}, "fanout": ["summarizer"]}]}
    return await start_router_on(nursery, tmp_path, doc, breaker_failures=5)


async def _run(env, during=None) -> list[atp.Event]:
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "summarize"}, content={"text": "summarise this"})
        if during is not None:
            await during()
        with trio.fail_after(30):
            return [ev async for ev in c.events(st)]


def _errors(events: list[atp.Event]) -> list[tuple[str, str]]:
    return [(ev.payload["code"], ev.payload["reason"]) for ev in events if ev.type == "ERROR"]


async def test_a_call_that_timed_out_while_the_routers_loop_stalled_is_retried_and_not_counted(nursery, tmp_path):
    """The model answers in 0.2 s; while its first call is in flight the
    router's loop is blocked 3 s, past the hop's 1 s timeout: that timeout is
    reported with why, retried on the same next-hop (the second call answers),
    and the next-hop's breaker and window see nothing against it."""
    model = await serve(nursery, BillingModel(100))
    model.hold = Delay(0.2)  # type: ignore[assignment]  # duck-typed: wait()
    env = await _router(nursery, tmp_path, model)
    gates = env.router.gates
    cwnd = gates.agent_windows.window("summarizer").cwnd

    async def stall() -> None:
        with trio.fail_after(10):
            while not model.requests:
                await trio.sleep(0.01)
        time.sleep(LOCAL_STALL_S + 1)  # noqa: ASYNC251  # the stall provoked: the router's loop does not run

    events = await _run(env, stall)
    assert gates.stalls.count >= 1 and gates.stalls.total_s >= LOCAL_STALL_S + 1  # the stall happened
    (code, reason), = _errors(events)
    assert code == "ETIMEOUT" and "this router's event loop had stalled" in reason and "retry 2/" in reason, reason
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"] and len(model.requests) == 2
    stats = gates.breakers.statistics()["summarizer"]
    assert (stats.failures, stats.ignored) == (0, 1)
    assert gates.agent_windows.window("summarizer").cwnd >= cwnd
    async with atp.Client(env.url) as c:
        metrics = await c.metrics()
    assert "atp_local_timeouts_total 1.0" in metrics


async def test_a_call_that_timed_out_with_the_loop_running_counts_against_the_next_hop(nursery, tmp_path):
    """The same model slow (1.5 s) on its first call, the loop running: the
    timeout is the next-hop's — counted by its breaker and the window cut."""
    model = await serve(nursery, BillingModel(100))
    model.hold = Delay(1.5, 0.05)  # type: ignore[assignment]
    env = await _router(nursery, tmp_path, model)
    gates = env.router.gates
    events = await _run(env)
    (code, reason), = _errors(events)
    assert code == "ETIMEOUT" and "stalled" not in reason and "retry 2/" in reason, reason
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"]
    assert gates.breakers.statistics()["summarizer"].failures == 1
    assert gates.stalls.local_faults == 0
