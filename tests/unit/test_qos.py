"""QoS scheduler of next-hop call slots (spec §9 gold/silver/bronze, §5.3 bronze
preemption and gold minima, §10 EWINDOW/EPREEMPT)."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.flow.qos import Grant, Preempt, QosScheduler, Queued, Refused
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS

G, S, B = QoS.GOLD, QoS.SILVER, QoS.BRONZE


def fill(s: QosScheduler, qos: QoS, n: int, now: float = 0.0, prefix: str = "") -> list[Grant | Queued | Refused]:
    return [s.request(f"{prefix or qos}-{i}", qos, now) for i in range(n)]


def tickets(results, kind=Grant) -> list[int]:
    return [r.ticket for r in results if isinstance(r, kind)]


def check_invariants(s: QosScheduler) -> None:
    """Slots never over-committed, gold's reserve never taken, work-conserving."""
    st_ = s.statistics()
    per = {G: st_.gold, S: st_.silver, B: st_.bronze}
    assert st_.running == sum(c.running for c in per.values()) <= s.capacity
    assert st_.silver.running + st_.bronze.running <= s.capacity - s.gold_reserved
    assert st_.queued == sum(c.queued for c in per.values())
    # Nobody waits while a slot is free for their class.
    free = s.capacity - st_.running
    if free:
        assert st_.gold.queued == 0
        if st_.silver.running + st_.bronze.running < s.capacity - s.gold_reserved:
            assert st_.silver.queued == st_.bronze.queued == 0


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0, "gold_reserved": 0},
        {"capacity": 4, "gold_reserved": 4},
        {"capacity": 4, "gold_reserved": -1},
        {"capacity": 4, "gold_reserved": 1, "weights": {G: 4.0, S: 0.0, B: 1.0}},
        {"capacity": 4, "gold_reserved": 1, "weights": {G: 4.0, S: 2.0}},
        {"capacity": 4, "gold_reserved": 1, "weights": {G: math.inf, S: 2.0, B: 1.0}},
        {"capacity": 4, "gold_reserved": 1, "preempt_after_ms": 3000.0, "gold_sla_ms": 2000.0},
        {"capacity": 4, "gold_reserved": 1, "preempt_after_ms": -1.0},
        {"capacity": 4, "gold_reserved": 1, "max_queued": 0},
        {"capacity": 4, "gold_reserved": 1, "shed_after_ms": -5.0},
    ],
)
def test_invalid_configuration_is_refused(kwargs):
    cap = kwargs.pop("capacity")
    with pytest.raises(ValueError):
        QosScheduler(cap, **kwargs)


def test_weights_accept_plain_class_names():
    s = QosScheduler(2, gold_reserved=0, weights={"gold": 1, "silver": 1, "bronze": 1})
    assert dict(s.weights) == {G: 1.0, S: 1.0, B: 1.0}


# --- gold reserved minimum ---------------------------------------------------------------------


def test_gold_reserved_minimum_is_always_available():
    s = QosScheduler(4, gold_reserved=2)
    r = fill(s, S, 3) + fill(s, B, 3)
    assert [type(x) for x in r] == [Grant, Grant, Queued, Queued, Queued, Queued]
    g = fill(s, G, 3)
    assert [type(x) for x in g] == [Grant, Grant, Queued]  # both reserved slots, then the pool is full
    st_ = s.statistics()
    assert (st_.gold.running, st_.silver.running, st_.bronze.running) == (2, 2, 0)
    check_invariants(s)


def test_silver_and_bronze_never_take_reserved_slots_even_when_idle():
    s = QosScheduler(3, gold_reserved=2)
    first, second, _ = fill(s, B, 3)
    assert (type(first), type(second)) == (Grant, Queued)
    assert s.release(first.ticket, 1.0) == [Grant(ticket=second.ticket, stream_id="bronze-1", qos=B, waited_ms=1000.0)]
    assert s.statistics().bronze.running == 1  # two slots stay free for gold


def test_gold_may_use_the_shared_slots_too():
    s = QosScheduler(4, gold_reserved=1)
    assert all(isinstance(x, Grant) for x in fill(s, G, 4))
    assert isinstance(s.request("s", S, 0.0), Queued)


def test_gold_first_while_its_reserved_share_is_not_in_use():
    # Gold's weight is tiny, so WFQ alone would pick silver; the reserve overrides it.
    s = QosScheduler(3, gold_reserved=1, weights={G: 0.01, S: 100.0, B: 1.0})
    g0 = s.request("g0", G, 0.0)
    s1, _ = fill(s, S, 2)
    gq, sq = s.request("gq", G, 0.0), s.request("sq", S, 0.0)
    assert isinstance(gq, Queued) and isinstance(sq, Queued)
    granted = s.release(g0.ticket, 0.5)  # gold now runs 0 < 1 reserved
    assert [x.ticket for x in granted] == [gq.ticket]
    granted = s.release(s1.ticket, 0.6)  # a shared slot: WFQ, silver's tag is smaller
    assert [x.ticket for x in granted] == [sq.ticket]
    check_invariants(s)


# --- weighted fair queuing ---------------------------------------------------------------------


class Sim:
    """Event-driven load: each granted call lasts a duration drawn by ``duration``;
    the running call with the earliest end is released next."""

    def __init__(self, s: QosScheduler, duration, now: float = 0.0) -> None:
        self.s, self.duration, self.now = s, duration, now
        self.ends: list[tuple[float, int, int]] = []
        self.grants: list[Grant] = []
        self.releases = 0
        self.waits: dict[QoS, list[float]] = {G: [], S: [], B: []}

    def take(self, results) -> None:
        for r in results if isinstance(results, list) else [results]:
            if isinstance(r, Grant):
                self.grants.append(r)
                self.waits[r.qos].append(r.waited_ms)
                heapq.heappush(self.ends, (self.now + self.duration(r), r.ticket, r.ticket))

    def request(self, qos: QoS, stream: str = "x"):
        r = self.s.request(stream, qos, self.now)
        self.take(r)
        return r

    def keep_queued(self, qos: QoS, depth: int) -> None:
        while getattr(self.s.statistics(), qos.value).queued < depth:
            self.request(qos, f"{qos}-flood")

    def release_next(self) -> None:
        end, _, ticket = heapq.heappop(self.ends)
        self.now = max(self.now, end)
        self.releases += 1
        self.take(self.s.release(ticket, self.now))


@pytest.mark.parametrize(
    ("weights", "capacity", "reserved"),
    [
        ({G: 4.0, S: 2.0, B: 1.0}, 8, 1),
        ({G: 1.0, S: 1.0, B: 1.0}, 4, 0),
        ({G: 3.0, S: 5.0, B: 2.0}, 16, 2),
    ],
)
def test_wfq_shares_converge_to_weights_under_saturation(weights, capacity, reserved):
    s = QosScheduler(capacity, gold_reserved=reserved, weights=weights)
    rng = random.Random(1)
    sim = Sim(s, lambda g: rng.choice((1.0, 1.0, 2.0)))
    for _ in range(14_000):
        for c in (G, S, B):
            sim.keep_queued(c, 3)
        sim.release_next()
    counts = Counter(g.qos for g in sim.grants[capacity:])  # skip the first fill of the empty pool
    total = sum(counts.values())
    for c, w in weights.items():
        assert counts[c] / total == pytest.approx(w / sum(weights.values()), abs=0.01), counts


def test_fifo_within_a_class():
    s = QosScheduler(1, gold_reserved=0)
    first = s.request("a", S, 0.0)
    queued = fill(s, S, 5, prefix="q")
    order = []
    t = first.ticket
    for i in range(5):
        (g,) = s.release(t, float(i + 1))
        order.append(g.stream_id)
        t = g.ticket
    assert order == [f"q-{i}" for i in range(5)]
    assert [g for g in queued if isinstance(g, Grant)] == []


def test_an_idle_class_does_not_hoard_credit():
    # Bronze ran alone for a long time; when silver arrives it is not owed that history.
    s = QosScheduler(1, gold_reserved=0, weights={G: 1.0, S: 1.0, B: 1.0})
    sim = Sim(s, lambda g: 1.0)
    sim.request(B)
    for _ in range(1000):
        sim.keep_queued(B, 1)
        sim.release_next()
    for _ in range(100):
        sim.keep_queued(B, 1)
        sim.keep_queued(S, 1)
        sim.release_next()
    last = Counter(g.qos for g in sim.grants[-100:])
    assert abs(last[S] - last[B]) <= 2, last


# --- silver starvation-freedom -----------------------------------------------------------------


def silver_bound(wg: float, ws: float, wb: float, pos: int, *, ceil_each: bool = True) -> int:
    """WFQ decisions open to silver that a silver ticket with ``pos`` tickets ahead
    of it can lose before it is granted. Each silver grant advances silver's
    finish tag by 1/ws; in that span gold's tags (step 1/wg) and bronze's (step
    1/wb) fit at most ceil(w/ws) + 1 times each (ties go to gold). On top, once:
    a class returning from idle may start up to 1/min(w) ahead of the laggard."""
    extra = 1 if ceil_each else 0
    per_silver = 1 + math.ceil(wg / ws) + extra + math.ceil(wb / ws) + extra
    return (pos + 1) * per_silver + math.ceil((wg + wb) / min(wg, ws, wb)) + 2


def silver_under_flood(capacity, reserved, weights, max_duration, silver_p, seed, steps):
    """Gold and bronze queues are never empty; silver arrives now and then.
    Returns (releases waited, silver queue position on arrival) per silver ticket."""
    s = QosScheduler(capacity, gold_reserved=reserved, weights=weights)
    rng = random.Random(seed)
    sim = Sim(s, lambda g: float(rng.randint(1, max_duration)))
    waiting: dict[int, tuple[int, int]] = {}
    waits: list[tuple[int, int]] = []
    for _ in range(steps):
        sim.keep_queued(G, 4)
        sim.keep_queued(B, 4)
        if rng.random() < silver_p:
            pos = s.statistics().silver.queued
            r = sim.request(S, "silver")
            if isinstance(r, Queued):
                waiting[r.ticket] = (sim.releases, pos)
        n = len(sim.grants)
        sim.release_next()
        for g in sim.grants[n:]:
            if g.ticket in waiting:
                start, pos = waiting.pop(g.ticket)
                waits.append((sim.releases - start, pos))
        check_invariants(s)
    return waits, waiting, sim


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 8),
    reserved_frac=st.floats(0.0, 0.9),
    weights=st.tuples(st.sampled_from([1.0, 2.0, 4.0, 8.0]), st.sampled_from([1.0, 2.0]), st.sampled_from([1.0, 2.0])),
    max_duration=st.integers(1, 5),
    silver_p=st.floats(0.05, 0.6),
    seed=st.integers(0, 2**32 - 1),
)
def test_silver_is_starvation_free_under_gold_and_bronze_flood(
    capacity, reserved_frac, weights, max_duration, silver_p, seed
):
    reserved = min(capacity - 1, int(capacity * reserved_frac))
    wg, ws, wb = weights
    waits, _, sim = silver_under_flood(capacity, reserved, {G: wg, S: ws, B: wb}, max_duration, silver_p, seed, 600)
    # A decision open to silver comes at least once per span of max_duration
    # (every running call has ended by then), i.e. within capacity·max_duration releases.
    for waited, pos in waits:
        assert waited <= silver_bound(wg, ws, wb, pos) * capacity * max_duration, (waited, pos)
    assert sim.s.statistics().silver.granted > 0


def test_silver_wait_is_tight_with_unit_calls():
    # Equal call lengths: every release is a decision silver may win, and the
    # wait follows the steady rate of 1 + wg/ws + wb/ws releases per silver grant.
    for seed in range(5):
        waits, _, _ = silver_under_flood(4, 1, {G: 4.0, S: 2.0, B: 1.0}, 1, 0.25, seed, 4000)
        assert len(waits) > 500
        assert all(w <= silver_bound(4, 2, 1, p, ceil_each=False) for w, p in waits)


def test_silver_gets_its_weighted_share_when_saturated_under_flood():
    s = QosScheduler(6, gold_reserved=1)
    sim = Sim(s, lambda g: 1.0)
    for _ in range(7000):
        for c in (G, B, S):
            sim.keep_queued(c, 5)
        sim.release_next()
    counts = Counter(g.qos for g in sim.grants)
    assert counts[S] / sum(counts.values()) >= 2 / 7 - 0.01, counts


# --- preemption of bronze for gold -------------------------------------------------------------


def bronze_full(capacity=4, reserved=1, **kw) -> tuple[QosScheduler, list[Grant]]:
    s = QosScheduler(capacity, gold_reserved=reserved, **kw)
    grants = []
    for i in range(capacity - reserved):
        r = s.request(f"b{i}", B, float(i) * 0.01)
        assert isinstance(r, Grant)
        grants.append(r)
    for i in range(reserved):
        assert isinstance(s.request(f"g{i}", G, 0.05), Grant)
    return s, grants


def test_preemption_picks_the_youngest_bronze_only_after_the_threshold():
    s, bronze = bronze_full(capacity=5, reserved=1, preempt_after_ms=250.0)
    assert [g.stream_id for g in bronze] == ["b0", "b1", "b2", "b3"]
    gq = s.request("gold-late", G, 1.0)
    assert isinstance(gq, Queued)
    assert s.get_timer() == 1.25
    assert s.preemptions(1.0) == []
    assert s.preemptions(1.2499) == []  # waiting, but not past the threshold
    (p,) = s.preemptions(s.get_timer())  # exactly at the deadline it fires
    assert p == Preempt(stream_id="b3", ticket=bronze[3].ticket, reason=p.reason, running=True)
    assert p.code is ErrorCode.EPREEMPT and "gold-late" in p.reason and "250" in p.reason
    assert s.preemptions(2.0) == []  # already covered: the slot is on its way back
    assert s.get_timer() is None
    assert s.statistics().preempting == 1 and s.statistics().bronze.preempted == 1
    # The caller RSTs b3 and cancels its ticket: the freed slot goes to gold.
    assert s.cancel(p.ticket, 2.0) == [Grant(ticket=gq.ticket, stream_id="gold-late", qos=G, waited_ms=1000.0)]
    assert s.statistics().preempting == 0
    check_invariants(s)


def test_preempted_slot_goes_to_gold_even_when_wfq_prefers_silver():
    s, _ = bronze_full(capacity=3, reserved=1, weights={G: 0.01, S: 100.0, B: 1.0})
    sq = s.request("s", S, 0.1)
    gq = s.request("g", G, 0.1)
    (p,) = s.preemptions(0.5)
    (grant,) = s.release(p.ticket, 0.5)  # the call stopped on its own: same slot
    assert grant.ticket == gq.ticket
    assert isinstance(sq, Queued) and s.statistics().silver.queued == 1


def test_several_overdue_gold_preempt_the_youngest_bronze_in_order():
    s, _ = bronze_full(capacity=5, reserved=1)
    fill(s, G, 3, now=1.0, prefix="gq")
    got = s.preemptions(1.3)
    assert [p.stream_id for p in got] == ["b3", "b2", "b1"]
    assert len({p.ticket for p in got}) == 3


def test_pending_preemptions_cover_waiting_gold():
    s, _ = bronze_full(capacity=3, reserved=1)
    assert s.preemptions(10.0) == [] and s.get_timer() is None  # no gold waiting
    s.request("g", G, 1.0)
    s.request("g2", G, 1.0)
    (p1, p2) = s.preemptions(1.25)
    assert (p1.stream_id, p2.stream_id) == ("b1", "b0")
    s.cancel(p1.ticket, 1.3)
    assert s.preemptions(5.0) == []  # g2 is covered by p2, whose slot is not back yet


def test_no_preemption_without_running_bronze():
    s = QosScheduler(2, gold_reserved=1)
    fill(s, S, 1)
    s.request("g0", G, 0.0)
    s.request("gq", G, 0.0)
    assert s.get_timer() is None
    assert s.preemptions(100.0) == []
    assert s.statistics().silver.running == 1


def test_gold_keeps_its_latency_under_bronze_and_silver_flood():
    """Gold asks for more than its WFQ share while bronze and silver flood; with
    preemption (the caller RSTs at once) gold's queue wait stays near
    ``preempt_after_ms``; without it (threshold = SLA = ∞) it does not."""

    def run(preempt_after_ms, sla_ms):
        s = QosScheduler(8, gold_reserved=2, preempt_after_ms=preempt_after_ms, gold_sla_ms=sla_ms)
        sim = Sim(s, lambda g: 1.0)
        gold_next = 0.0
        while sim.now < 200.0:
            sim.keep_queued(B, 20)
            sim.keep_queued(S, 20)
            timer = s.get_timer()
            nxt = min(e[0] for e in sim.ends)
            if gold_next <= min(nxt, timer if timer is not None else math.inf):
                sim.now = max(sim.now, gold_next)
                sim.request(G, "gold")
                gold_next += 0.2  # 5 gold calls/s of 1 s each vs. a 4/7 share of 8 slots
            elif timer is not None and timer <= nxt:
                sim.now = max(sim.now, timer)
                for p in s.preemptions(sim.now) + s.shed(sim.now):
                    if p.running:
                        sim.ends = [e for e in sim.ends if e[2] != p.ticket]
                        heapq.heapify(sim.ends)
                        sim.take(s.cancel(p.ticket, sim.now))
            else:
                sim.release_next()
            check_invariants(s)
        gold = sorted(sim.waits[G])
        return gold[int(0.95 * (len(gold) - 1))], s.statistics()

    p95, stats = run(250.0, 2000.0)
    assert p95 <= 250.0 + 1e-6
    assert stats.bronze.preempted > 0 and stats.gold_sla_misses == 0
    # Silver keeps at least its weighted share of the pool meanwhile: 2/7 of 8 slots·s per s.
    assert stats.silver.granted >= 0.95 * (2 / 7) * 8 * 200
    p95_without, stats_without = run(1e12, 1e12)
    assert p95_without > 2000.0 and stats_without.bronze.preempted == 0


# --- shedding queued bronze --------------------------------------------------------------------


def test_shed_drops_old_queued_bronze_only_when_others_wait():
    s = QosScheduler(1, gold_reserved=0, shed_after_ms=1000.0)
    s.request("run", S, 0.0)
    b1, b2 = s.request("b1", B, 0.0), s.request("b2", B, 0.5)
    assert s.get_timer() is None  # nobody else waits: no congestion
    assert s.shed(10.0) == []
    s.request("s", S, 1.0)
    assert s.get_timer() == 1.0
    (p,) = s.shed(1.0)
    assert (p.stream_id, p.ticket, p.running, p.code) == ("b1", b1.ticket, False, ErrorCode.EPREEMPT)
    assert s.get_timer() == 1.5 and s.shed(1.4) == []
    assert [x.ticket for x in s.shed(1.5)] == [b2.ticket]
    st_ = s.statistics()
    assert (st_.bronze.queued, st_.bronze.shed) == (0, 2)
    assert s.cancel(b1.ticket, 2.0) == []  # already gone: a no-op


def test_shedding_can_be_switched_off():
    s = QosScheduler(1, gold_reserved=0, shed_after_ms=None)
    s.request("run", S, 0.0)
    s.request("b", B, 0.0)
    s.request("g", G, 0.0)
    assert s.shed(1e9) == [] and s.get_timer() is None


# --- refusal, cancel and release bookkeeping ---------------------------------------------------


def test_full_class_queue_is_refused_with_ewindow():
    s = QosScheduler(1, gold_reserved=0, max_queued=2)
    fill(s, S, 3)
    r = s.request("one-too-many", S, 0.0)
    assert isinstance(r, Refused) and r.code is ErrorCode.EWINDOW and r.qos is S and "max_queued" in r.reason
    assert isinstance(s.request("b", B, 0.0), Queued)  # per class
    st_ = s.statistics()
    assert (st_.silver.queued, st_.silver.refused, st_.bronze.queued) == (2, 1, 1)


def test_cancel_queued_and_running_and_release_errors():
    s = QosScheduler(1, gold_reserved=0)
    run = s.request("a", S, 0.0)
    q1, q2 = s.request("b", S, 0.0), s.request("c", S, 0.0)
    assert s.cancel(q1.ticket, 0.1) == []
    assert s.statistics().silver.queued == 1
    (g,) = s.cancel(run.ticket, 0.2)
    assert g.ticket == q2.ticket
    with pytest.raises(ValueError, match="not running"):
        s.release(run.ticket, 0.3)  # cancelled already
    with pytest.raises(ValueError, match="not running"):
        s.release(q1.ticket, 0.3)
    assert s.cancel(run.ticket, 0.3) == [] and s.cancel(12345, 0.3) == []
    assert s.release(q2.ticket, 0.4) == []
    st_ = s.statistics()
    assert (st_.running, st_.queued, st_.silver.granted, st_.silver.cancelled) == (0, 0, 2, 2)


def test_release_of_a_queued_ticket_is_an_error():
    s = QosScheduler(1, gold_reserved=0)
    s.request("a", S, 0.0)
    q = s.request("b", S, 0.0)
    with pytest.raises(ValueError):
        s.release(q.ticket, 1.0)
    assert s.statistics().silver.queued == 1


def test_gold_sla_misses_are_counted():
    s = QosScheduler(1, gold_reserved=0, gold_sla_ms=500.0, preempt_after_ms=100.0)
    g = s.request("a", G, 0.0)
    s.request("b", G, 0.0)
    s.release(g.ticket, 0.6)
    assert s.statistics().gold_sla_misses == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["request", "release", "cancel", "preempt", "shed", "tick"]),
        st.sampled_from([G, S, B]),
        st.integers(0, 10_000),
    ),
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 6), reserved_frac=st.floats(0.0, 0.99), max_queued=st.integers(1, 6), ops=ops)
def test_no_leaked_slots_under_random_schedules(capacity, reserved_frac, max_queued, ops):
    reserved = min(capacity - 1, int(capacity * reserved_frac))
    s = QosScheduler(capacity, gold_reserved=reserved, max_queued=max_queued, shed_after_ms=300.0)
    now = 0.0
    running: dict[int, QoS] = {}  # the model: granted and not yet released/cancelled
    queued: dict[int, QoS] = {}
    preempting: set[int] = set()

    def granted(results):
        for g in results:
            assert isinstance(g, Grant)
            assert queued.pop(g.ticket) is g.qos
            running[g.ticket] = g.qos

    for op, qos, pick in ops:
        if op == "request":
            r = s.request(f"s{pick}", qos, now)
            if isinstance(r, Grant):
                running[r.ticket] = qos
            elif isinstance(r, Queued):
                queued[r.ticket] = qos
            else:
                assert sum(1 for q in queued.values() if q is qos) == max_queued
        elif op == "release" and running:
            t = sorted(running)[pick % len(running)]
            del running[t]
            preempting.discard(t)
            granted(s.release(t, now))
        elif op == "cancel" and (running or queued):
            pool = sorted(running) + sorted(queued)
            t = pool[pick % len(pool)]
            if running.pop(t, None) is None:
                queued.pop(t)
            preempting.discard(t)
            granted(s.cancel(t, now))
        elif op == "preempt":
            for p in s.preemptions(now):
                assert running[p.ticket] is B and p.ticket not in preempting and p.running
                preempting.add(p.ticket)
        elif op == "shed":
            for p in s.shed(now):
                assert queued.pop(p.ticket) is B and not p.running
        elif op == "tick":
            now += pick / 10_000
        st_ = s.statistics()
        per = {G: st_.gold, S: st_.silver, B: st_.bronze}
        for c in (G, S, B):
            assert per[c].running == sum(1 for q in running.values() if q is c)
            assert per[c].queued == sum(1 for q in queued.values() if q is c)
        assert st_.preempting == len(preempting)
        check_invariants(s)
        # get_timer() is exact: something is due iff its deadline has come.
        timer = s.get_timer()
        due = s.preemptions(now) + s.shed(now)
        assert bool(due) == (timer is not None and timer <= now), (timer, now, due)
        for p in due:
            if p.running:
                preempting.add(p.ticket)
            else:
                del queued[p.ticket]
    # Drain: every slot comes back and every queued ticket is served.
    while running:
        t = min(running)
        del running[t]
        granted(s.release(t, now))
    assert not queued
    st_ = s.statistics()
    assert (st_.running, st_.queued, st_.preempting) == (0, 0, 0)
