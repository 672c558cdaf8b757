"""Gold keeps its latency when the next-hop windows, not the router's call slots,
are the bottleneck (spec §5.1 per-agent windows, §9 QoS, §10 EPREEMPT).

The load test (``bench/load_router.py``) showed gold queueing behind a bronze and
silver flood *at the per-agent windows*: AIMD had shrunk a failing next-hop's
window to a couple of calls, every completion woke every waiting call at once
in no class order, and the QoS scheduler — with its slots far from full — never
saw pressure, so it never preempted anything. Now the QoS slot comes first and
the next-hop window is a class-ordered queue (gold first, then WFQ) that hands
room to one waiter at a time; a gold call held up there is reported to the
scheduler, which preempts a bronze call running *at that next-hop*, and takes
back the slot of a silver or bronze call still waiting for its next-hop.

Sans-IO tests for :class:`~atp_router.flow.window.WindowQueue` and the scheduler's
``block`` / ``reclaim``; then the real :class:`~atp_router.runtime.router.Router` in
process under trio's autojump clock with :class:`~atp_router.adapters.testing.ScriptedAdapter`
next-hops (the shape of a model adapter answering after a fixed delay; no real
peer can be paced to the millisecond).
"""

from __future__ import annotations

import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.flow.qos import Grant, QosScheduler, Queued, Revoke
from atp_router.flow.window import Estimate, Window, WindowQueue
from atp_router.runtime.router import Router
from atp_router.wire.frame import QoS
from atp_router.wire.frame import Window as WireWindow
from tests.unit.test_router_flow import (
    BIG_WINDOW,
    agent,
    content_of,
    drain,
    errs,
    open_inproc,
    serving,
    types,
)

G, S, B = QoS.GOLD, QoS.SILVER, QoS.BRONZE
ONE = Estimate(tokens=10, usd_micros=10)


# ------------------------------------------------------------------ the next-hop queue (sans-IO)

def test_window_queue_serves_gold_first_then_silver_and_bronze_by_weight_handing_room_over():
    """One call completes → exactly one waiter is handed the room, already
    accounted on the window (a newcomer cannot take it first); gold before
    anyone, then silver and bronze 2:1 (WFQ weights), FIFO within a class."""
    w = Window(WireWindow(max_parallel=1, max_tokens=10_000, max_usd_micros=10_000))
    q = WindowQueue(w)
    running = w.on_send(ONE)
    for i in range(6):
        q.enqueue(f"b{i}", ONE, B)
        q.enqueue(f"s{i}", ONE, S)
    q.enqueue("g0", ONE, G)
    assert q.pump() == [] and len(q) == 13  # no room yet
    order = []
    for _ in range(9):
        w.on_complete(running, 10, 10, ok=True, timely=True)
        granted = q.pump()
        assert len(granted) == 1 and w.in_flight == 1  # handed over, accounted
        (key, running), = granted
        order.append(key)
    assert order == ["g0", "s0", "s1", "b0", "s2", "s3", "b1", "s4", "s5"]
    assert (q.waiting(G), q.waiting(S), q.waiting(B)) == (0, 0, 4)


def test_window_queue_head_that_does_not_fit_is_not_overtaken_and_cancel_withdraws():
    w = Window(WireWindow(max_parallel=4, max_tokens=100, max_usd_micros=10_000))
    q = WindowQueue(w)
    held = w.on_send(Estimate(tokens=60, usd_micros=0))
    q.enqueue("big", Estimate(tokens=80, usd_micros=0), S)
    q.enqueue("small", Estimate(tokens=10, usd_micros=0), S)
    assert q.pump() == []  # "small" fits but waits behind "big"
    assert q.cancel("big") and not q.cancel("big")
    assert [k for k, _ in q.pump()] == ["small"]
    w.on_cancel(held)
    q.enqueue("x", ONE, B)
    with pytest.raises(ValueError):
        q.enqueue("x", ONE, B)


# ------------------------------------------------------------------ the scheduler sees calls blocked at a next-hop

def test_gold_blocked_at_a_next_hop_preempts_the_youngest_bronze_running_there():
    """A gold call holding a slot but blocked at next-hop ``a`` for
    ``preempt_after_ms`` preempts the youngest bronze call running at ``a`` —
    not one at ``b``, not a bronze call itself blocked at ``a`` (it holds no
    room there) — once; the timer says when."""
    s = QosScheduler(8, gold_reserved=1, preempt_after_ms=250, gold_sla_ms=1000)
    _, young_a = (s.request(f"b{i}", B, 0.0, key="a").ticket for i in range(2))
    s.request("b-at-b", B, 0.1, key="b")
    waiting_a = s.request("b-waiting", B, 0.2, key="a").ticket
    s.block(waiting_a, 0.2)
    gold = s.request("g", G, 1.0, key="a").ticket
    s.block(gold, 1.0)
    assert s.preemptions(1.2) == [] and s.get_timer() == pytest.approx(1.25)
    p, = s.preemptions(1.25)
    assert (p.ticket, p.running) == (young_a, True) and "waiting 250 ms for next-hop a" in p.reason
    assert s.preemptions(2.0) == []  # covered while that slot is on its way back
    s.cancel(young_a, 2.0)
    s.unblock(gold, 2.0)
    st = s.statistics()
    assert (st.bronze.preempted, st.bronze.running, st.bronze.blocked, st.gold.blocked) == (1, 3, 1, 0)
    assert st.gold_sla_misses == 0 and s.get_timer() is None


def test_gold_takes_back_the_slot_of_a_silver_call_still_waiting_for_its_next_hop():
    """All slots held, one by a silver call blocked at its next-hop: gold does
    not queue behind it. ``reclaim`` revokes that slot (no RST: the call had
    not started) and grants it to gold; the silver ticket is first in line again."""
    s = QosScheduler(2, gold_reserved=0)
    first = s.request("s1", S, 0.0, key="a").ticket
    idle = s.request("s2", S, 0.0, key="a").ticket
    s.block(idle, 0.1)
    later = s.request("s3", S, 0.2, key="a")
    gold = s.request("g", G, 0.3, key="b")
    assert isinstance(later, Queued) and isinstance(gold, Queued)
    revoked, grants = s.reclaim(0.3)
    assert revoked == [Revoke(ticket=idle, stream_id="s2", qos=S)]
    assert [(g.ticket, g.qos) for g in grants] == [(gold.ticket, G)]
    assert s.reclaim(0.4) == ([], [])  # nothing blocked any more
    assert s.release(first, 0.5) == [Grant(ticket=idle, stream_id="s2", qos=S, waited_ms=pytest.approx(200))]
    assert s.statistics().silver.revoked == 1 and s.statistics().gold.granted == 1


# ------------------------------------------------------------------ through the router

HOP = {"max_parallel": 2, "max_tokens": 10_000_000, "max_usd_micros": 100_000_000}
DOC = {
    "agents": {"m.shared": agent(window=HOP)},
    "policies": [{"name": c, "match": {"task_type": f"{c}_task"}, "fanout": ["m.shared"], "window": BIG_WINDOW}
                 for c in ("gold", "silver", "bronze")],
}
# Slots to spare: the next-hop's window (2 calls) is the bottleneck, as in the load test.
CONFIG = {"slots": 64, "gold_reserved": 8, "preempt_after_ms": 250, "gold_sla_ms": 3000}


class _LegSteps(trio.abc.Instrument):
    """Counts how often the dispatcher's next-hop tasks are resumed."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("Dispatcher._leg"):
            self.steps += 1


async def _gold(router: Router, n: int) -> list[float]:
    out: list[float] = []

    async def one() -> None:
        events = await drain(open_inproc(router, task={"task_type": "gold_task"}, qos=G))
        assert types(events)[-2:] == ["FINAL", "FIN"], errs(events)
        out.append(content_of(events[-2])["telemetry"]["latency_ms"])

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return out


async def test_gold_keeps_its_latency_when_a_flood_fills_a_shared_next_hop_window(tmp_path, scripted, autojump_clock):
    """A next-hop with a window of 2 calls (1 s each), shared by every class;
    call slots to spare. Baseline: 5 gold streams alone take 1, 1, 2, 2, 3 s.
    Flood: 10 bronze and 10 silver streams are queued at that next-hop when 5
    gold streams arrive. Gold goes first in the next-hop's queue, and the two
    bronze calls holding the window are preempted (RST EPREEMPT, "waiting … for
    next-hop m.shared") after ``preempt_after_ms``: gold's worst latency is its
    baseline's plus 250 ms — not the 10 s of the flood ahead of it. Every silver
    stream still completes; every wake-up hands room to one call (the next-hop
    tasks are resumed a few times per call, not once per completion of any)."""
    scripted["m.shared"] = ScriptedAdapter.returning("m.shared", delay_s=1.0)
    async with serving(tmp_path, DOC, **CONFIG) as router:
        baseline = await _gold(router, 5)
    assert sorted(baseline) == [1000.0, 1000.0, 2000.0, 2000.0, 3000.0]

    async with serving(tmp_path, DOC, **CONFIG) as router:
        flood: dict[str, list] = {"bronze": [], "silver": []}
        legs = _LegSteps()

        async def background(kind: str) -> None:
            flood[kind].append(await drain(open_inproc(router, task={"task_type": f"{kind}_task"}, qos=QoS(kind))))

        trio.lowlevel.add_instrument(legs)
        try:
            async with trio.open_nursery() as nursery:
                for kind in ("bronze", "silver"):  # bronze first: it holds the window when gold comes
                    for _ in range(10):
                        nursery.start_soon(background, kind)
                    await trio.sleep(0.05)
                await trio.sleep(0.4)
                flooded = await _gold(router, 5)
        finally:
            trio.lowlevel.remove_instrument(legs)
        stats = router.gates.slots.scheduler.statistics()

    assert max(flooded) <= max(baseline) + 250, sorted(flooded)
    assert stats.bronze.preempted == 2 and stats.gold_sla_misses == 0
    preempted = [e for evs in flood["bronze"] for e in errs(evs) if e["code"] == "EPREEMPT"]
    assert len(preempted) == 2 and all("for next-hop m.shared" in e["reason"] for e in preempted)
    assert all(types(evs)[-2:] == ["FINAL", "FIN"] for evs in flood["silver"]) and len(flood["silver"]) == 10
    assert sum(types(evs)[-2:] == ["FINAL", "FIN"] for evs in flood["bronze"]) == 8
    # 25 calls, about 3 resumptions each (73 here); waking every waiter on every
    # completion took 194 with this small flood, and grows with its square.
    assert legs.steps <= 4 * 25, legs.steps


async def test_gold_does_not_queue_behind_a_slot_held_by_a_call_waiting_for_its_next_hop(
        tmp_path, scripted, autojump_clock):
    """3 call slots, 1 for gold only. Two silver streams hold the other two: one
    calls ``m.one`` (a window of one call, 1 s), the other waits for that window.
    Two gold streams (to ``m.fast``, 100 ms) arrive: one takes the reserved slot,
    the other the slot of the waiting silver call — revoked, not reset: that
    call gets its slot back and completes. Neither gold waits for the 1 s call."""
    scripted["m.one"] = ScriptedAdapter.returning("m.one", delay_s=1.0)
    scripted["m.fast"] = ScriptedAdapter.returning("m.fast", delay_s=0.1)
    doc = {"agents": {"m.one": agent(window={**HOP, "max_parallel": 1}), "m.fast": agent()},
           "policies": [{"name": "silver", "match": {"task_type": "silver_task"}, "fanout": ["m.one"],
                         "window": BIG_WINDOW},
                        {"name": "gold", "match": {"task_type": "gold_task"}, "fanout": ["m.fast"],
                         "window": BIG_WINDOW}]}
    async with serving(tmp_path, doc, slots=3, gold_reserved=1) as router:
        silver: list = []

        async def one_silver() -> None:
            silver.append(await drain(open_inproc(router, task={"task_type": "silver_task"}, qos=S)))

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(one_silver)
            await trio.sleep(0.1)
            gold = await _gold(router, 2)
        stats = router.gates.slots.scheduler.statistics()
    assert gold == [100.0, 100.0]
    assert stats.silver.revoked == 1 and stats.silver.preempted == 0 and stats.silver.granted == 3
    assert [types(evs)[-2:] for evs in silver] == [["FINAL", "FIN"]] * 2
    assert [e["code"] for evs in silver for e in errs(evs)] == ["EWINDOW"]  # the NACK of the one that waited
