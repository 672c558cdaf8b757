"""The hot path of a cluster router on Redis (issue 22 item 2: few store round trips
a task), on a real redis-server: the atomic OPEN
(:meth:`RedisStore.open_stream_shared <atp_router.store.redis.RedisStore.open_stream_shared>`)
— a SYN's entry in its tenant's shared quota and its stream's budget account in one
script, one round trip, or neither: a quota refusal (``streams``, ``rate``) opens no
account, a parent account that is not open takes no quota entry, and a write from
a fenced router or one Redis runs after its deadline changes nothing; the commits
of calls sent in the same pipeline as a group commit's events; the learning rate
taken in slices (budget leases), never past the shared bucket."""

from __future__ import annotations

import functools
import math
import time
import uuid

import pytest

from atp_router.flow.budget import (
    Allowance,
    Charge,
    Reservation,
    SharedBudgetLedger,
    SharedResult,
)
from atp_router.flow.quota import QuotaAsk
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.dataplane.quotas import LEARN_SLICE_S, SharedQuotas
from atp_router.store import (
    Fenced,
    NotFound,
    StoreError,
    StoreUnavailable,
    StreamRecord,
)
from atp_router.store.redis import RedisStore
from tests.peers import start_redis

TTL = 60_000


def _ask(stream: str, *, max_streams: int = 2, per_s: float = 1_000.0, burst: int = 1_000) -> QuotaAsk:
    return QuotaAsk("alice", stream, max_streams, per_s, burst)


def _open(store: RedisStore, stream: str, **kw: float) -> bool:
    grant, out = store.open_stream_shared(f"stream:{stream}@r.a", "client:alice", Allowance(tokens=500),
                                          owner="r.a", ask=_ask(stream, **kw), ttl_ms=TTL)  # type: ignore[arg-type]
    assert (out is not None) == grant.admitted
    return grant.admitted


def _accounts(store: RedisStore) -> set[str]:
    return {a.key for a in store.load_ledger().accounts if a.key.startswith("stream:")}


def _count(store: RedisStore) -> int:
    return store.quota_open_count("alice", now_ms=0)


def test_quota_and_account_are_opened_together_in_one_round_trip_or_not_at_all():
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        store.open_shared("client:alice", None, Allowance(tokens=1_000), owner=None)
        trips = store.round_trips
        grant, out = store.open_stream_shared("stream:s1@r.a", "client:alice", Allowance(tokens=500), owner="r.a",
                                              ask=_ask("s1"), ttl_ms=TTL)
        assert store.round_trips == trips + 1
        assert (grant.admitted, grant.open, grant.refused) == (True, 1, None)
        assert out is not None and [t.key for t in out.totals] == ["stream:s1@r.a", "client:alice"]
        assert _open(store, "s2")
        assert (_accounts(store), _count(store)) == ({"stream:s1@r.a", "stream:s2@r.a"}, 2)
        # max_streams reached: refused, and no account opened for it.
        grant, out = store.open_stream_shared("stream:s3@r.a", "client:alice", Allowance(tokens=500), owner="r.a",
                                              ask=_ask("s3"), ttl_ms=TTL)
        assert (grant.admitted, grant.refused, out) == (False, "streams", None)
        assert (_accounts(store), _count(store)) == ({"stream:s1@r.a", "stream:s2@r.a"}, 2)
        # The open rate spent: refused with a wait, no account, no entry.
        assert _open(store, "r1", max_streams=10, per_s=0.001, burst=3)  # a slow bucket (one per 1,000 s): taken
        # Burst 1 on that bucket: spent.
        grant, _ = store.open_stream_shared("stream:r9@r.a", "client:alice", Allowance(tokens=500), owner="r.a",
                                            ask=_ask("r9", max_streams=10, per_s=0.001, burst=1), ttl_ms=TTL)
        assert (grant.admitted, grant.refused) == (False, "rate") and (grant.retry_after_ms or 0) > 0
        assert "stream:r9@r.a" not in _accounts(store) and _count(store) == 3
        # A parent that is not open: refused before anything is taken.
        with pytest.raises(NotFound):
            store.open_stream_shared("stream:x@r.a", "client:bob", Allowance(tokens=5), owner="r.a",
                                     ask=_ask("x", max_streams=10), ttl_ms=TTL)
        assert "stream:x@r.a" not in _accounts(store) and _count(store) == 3
        # The account open already: refused, the quota entry not taken.
        with pytest.raises(Exception, match="already open"):
            store.open_stream_shared("stream:s1@r.a", "client:alice", Allowance(tokens=5), owner="r.a",
                                     ask=_ask("other", max_streams=10), ttl_ms=TTL)
        assert _count(store) == 3


def test_an_open_from_a_fenced_router_or_after_its_deadline_changes_nothing():
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10], socket_timeout_s=0.5)
        other = RedisStore.open(server.url, namespace=store.namespace)
        store.open_shared("client:alice", None, Allowance(tokens=1_000), owner=None)
        assert store.heartbeat("r.a", ttl_ms=5_000, now_ms=0, info={}) == 0
        store.fence_as("r.a", 0)
        assert _open(store, "s1")
        # Late: Redis' clock is past the deadline the open carries (a write that waited in its buffer).
        store.clock_offset_ms -= 60_000
        with pytest.raises(StoreUnavailable, match="after its deadline"):
            _open(store, "late")
        store.sync_clock()
        assert other.fence_owner("r.a") == 1  # another router settles r.a
        with pytest.raises(Fenced):
            _open(store, "fenced")
        assert (_accounts(other), _count(other)) == ({"stream:s1@r.a"}, 1)
        store.fence_as("r.a", 1)
        assert _open(store, "s2") and _count(other) == 2


def test_learning_tokens_are_taken_in_slices_never_past_the_shared_rate():
    """Issue 22 item 2 (budget leases): a router takes a tenant's learning tokens
    from the shared bucket a slice at a time (:data:`LEARN_SLICE_S` of its rate,
    at most a quarter of its burst) and hands them out without a round trip;
    two routers together never get more than the bucket holds."""
    with start_redis() as server:
        a = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        b = RedisStore.open(server.url, namespace=a.namespace)
        # The store step itself: up to n, as many as the bucket holds, then a wait.
        assert a.rate_take_upto("k", 3, per_s=0.001, burst=5, now_ms=0) == (3, None)
        assert a.rate_take_upto("k", 3, per_s=0.001, burst=5, now_ms=0) == (2, None)
        taken, wait = a.rate_take_upto("k", 3, per_s=0.001, burst=5, now_ms=0)
        assert taken == 0 and wait is not None and wait > 900_000  # one in 1,000 s
        # 40 a second, burst 40: slices of min(40 * 0.25, 40 // 4) = 10.
        quotas = [SharedQuotas(s, owner=o, metrics=RouterMetrics()) for s, o in ((a, "r.a"), (b, "r.b"))]
        trips = a.round_trips
        assert all(quotas[0].may_learn("alice", 40.0, 40) for _ in range(10))
        assert a.round_trips == trips + 1  # one slice
        assert quotas[0].may_learn("alice", 40.0, 40) and a.round_trips == trips + 2
        t0 = time.monotonic()
        got = sum(bool(quotas[i % 2].may_learn("alice", 40.0, 40)) for i in range(200))
        elapsed = time.monotonic() - t0
        # Router a holds 9 of its second slice, the bucket 40 - 20 and it refills at 40 a second:
        # never more than that; at least what is left after each router's last slice runs out unused.
        assert 29 - 2 * 9 <= got <= 29 + math.ceil(40 * elapsed) + 1, (got, elapsed)
        assert elapsed < LEARN_SLICE_S  # the slices did not expire meanwhile (the bounds above assume it)
        # Refused, the store's wait is kept: no round trip until it passes.
        slow = SharedQuotas(a, owner="r.c", metrics=RouterMetrics())
        assert slow.may_learn("carol", 0.001, 1) is True
        trips = a.round_trips
        assert slow.may_learn("carol", 0.001, 1) is False and a.round_trips == trips + 1
        assert slow.may_learn("carol", 0.001, 1) is False and a.round_trips == trips + 1


async def test_a_learning_slice_is_refilled_in_the_group_commit_under_way():
    """The next learning slice rides the group commit the router makes anyway
    (a finished task's FINAL): taken when its last token is handed out, sent in
    that pipeline (no round trip of its own), its answer handed out after it —
    and refused until just now, the slice is asked for the same way (the
    asking task refused, the next one served). Never past the shared bucket."""
    import trio

    from atp_router.runtime.dataplane.persistence import StreamPersistence

    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        persistence = StreamPersistence(store)
        persistence.group_commit = True
        quotas = SharedQuotas(store, owner="r.a", metrics=RouterMetrics())
        quotas.defer = persistence.defer
        # Buffered in a batch, the take's answer comes with the batch's one round trip.
        got: list[tuple[int, int | None]] = []
        trips = store.round_trips
        with store.batch():
            store.put("k0", b"v")
            store.rate_take_upto_then("other", 3, got.append, per_s=0.001, burst=5, now_ms=0)
            assert got == []
        assert (got, store.round_trips) == ([(3, None)], trips + 1)
        # 40 a second, burst 40: slices of 10. The last token of the first one asks for the next.
        t0 = time.monotonic()
        trips = store.round_trips
        assert all(quotas.may_learn("alice", 40.0, 40) for _ in range(10))
        assert store.round_trips == trips + 1  # the first slice, at once
        persistence.defer(functools.partial(store.put, "k", b"v"))  # a write of the next group commit
        assert persistence.flush()
        assert store.round_trips == trips + 2 and store.get("k") == b"v"  # the write and the refill: one pipeline
        trips = store.round_trips
        assert all(quotas.may_learn("alice", 40.0, 40) for _ in range(10))  # the refilled slice
        assert store.round_trips == trips
        # The bucket gave 20 (and refills at 40 a second): what is left of it is the rest.
        left, _ = store.rate_take_upto("learn/alice", 40, per_s=40.0, burst=40, now_ms=0)
        assert 20 <= left <= 20 + math.ceil(40 * (time.monotonic() - t0)) + 1, left
        assert time.monotonic() - t0 < LEARN_SLICE_S  # the slices did not expire meanwhile
        # 20 a second, burst 4: slices of one. Spent, the store's wait is kept (no round trip) …
        while quotas.may_learn("bob", 20.0, 4):
            assert persistence.flush()
        trips = store.round_trips
        assert quotas.may_learn("bob", 20.0, 4) is False and store.round_trips == trips
        await trio.sleep(0.06)  # … until it passed (one in 50 ms); asked for just after it: refused here, and
        assert quotas.may_learn("bob", 20.0, 4) is False and store.round_trips == trips  # the slice rides the
        persistence.defer(functools.partial(store.put, "k", b"w"))  # next group commit
        assert persistence.flush() and store.round_trips == trips + 1
        assert quotas.may_learn("bob", 20.0, 4) is True and store.round_trips == trips + 1  # served from it


def test_commits_inside_a_group_commit_share_its_round_trip():
    """The committer's settlements in the stream table's group commit
    (:meth:`RedisStore.settle_many <atp_router.store.redis.RedisStore.settle_many>`
    inside :meth:`~atp_router.store.redis.RedisStore.batch`): the events buffered
    before them and the commits go in one pipeline, each applied; a stream's
    account closed with its last events (buffered: closed already is no error)."""
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        lg = SharedBudgetLedger(store, owner="r.a")
        lg.open("client:t", Allowance(tokens=10_000))
        lg.open("stream:1", Allowance(), parent="client:t")
        held = [lg.reserve("stream:1", 100, 0) for _ in range(2)]
        assert all(isinstance(r, Reservation) for r in held)
        stored = [Reservation(id=r.id, key=lg.store_key("stream:1"), tokens=100, usd_micros=0)
                  for r in held if isinstance(r, Reservation)]
        store.put_stream(StreamRecord(tenant="t", session_id="s", stream_id="1", idempotency_key=None, meta={},
                                      qos=None, budget=None, created_ms=1))
        trips = store.round_trips
        with store.batch():
            store.append_event("t", "s", "1", 1, "PARTIAL", b"{}")
            out = store.settle_many([("commit", stored[0], 150, 0, "q1", None), ("release", stored[1], 0, 0, "", None)])
            store.append_event("t", "s", "1", 2, "FINAL", b"{}")
            store.close_shared_if_open(lg.store_key("stream:1"))  # the END: buffered with the FINAL
        assert store.round_trips == trips + 2  # the event and both settlements; the FINAL and the close at the end
        assert "stream:1@r.a" not in {a.key for a in store.load_ledger().accounts}
        store.close_shared_if_open(lg.store_key("stream:1"))  # closed already (by a settling router): no error
        assert [e.event_id for e in store.events("t", "s", "1")] == [1, 2]
        first = out[0]
        assert isinstance(first, SharedResult) and first.charge is not None and first.charge.tokens == 150
        t = store.shared_totals(lg.store_key("client:t")).totals[0]
        assert (t.committed_tokens, t.reserved_tokens) == (150, 0)


def test_a_lease_renewal_and_the_live_routers_are_one_round_trip():
    """A cluster router's renewal (:meth:`RedisStore.renew_lease
    <atp_router.store.redis.RedisStore.renew_lease>`): its lease epoch and the
    live routers, as :meth:`~atp_router.store.redis.RedisStore.heartbeat` and
    :meth:`~atp_router.store.redis.RedisStore.live_owners` answer them, in one
    script; an expired lease is not among them."""
    with start_redis() as server:
        a = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        b = RedisStore.open(server.url, namespace=a.namespace)
        b.heartbeat("r.b", ttl_ms=5_000, now_ms=0, info={"url": "http://b"})
        b.heartbeat("r.gone", ttl_ms=1, now_ms=0, info={})
        time.sleep(0.05)
        assert b.fence_owner("r.a") == 1
        trips = a.round_trips
        epoch, peers = a.renew_lease("r.a", ttl_ms=5_000, now_ms=0, info={"url": "http://a"})
        assert a.round_trips == trips + 1
        assert (epoch, peers) == (1, {"r.a": {"url": "http://a"}, "r.b": {"url": "http://b"}})
        assert peers == a.live_owners(now_ms=0)
        assert abs(a.clock_offset_ms) < 1000


# ------------------------------------------------------------------ budget leases
def _lease_store(server) -> RedisStore:
    store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
    store.open_shared("client:alice", None, Allowance(tokens=1_000), owner=None)
    return store


def _reserved(store: RedisStore) -> int:
    return store.shared_totals("client:alice").totals[0].reserved_tokens


def test_budget_leases_never_hold_more_than_the_limit_and_a_lost_routers_slice_is_released():
    with start_redis() as server:
        store = _lease_store(server)
        got = {o: store.lease_take("client:alice", None, 600, 0, owner=o) for o in ("r.a", "r.b", "r.c")}
        granted = {o: g[1] for o, g in got.items()}
        assert granted == {"r.a": 600, "r.b": 400, "r.c": 0}  # never past the limit, whoever asks
        assert _reserved(store) == 1_000
        # The tenant's budget is all in slices: a reserve in the store is refused (EBUDGET's refusal).
        store.open_shared("stream:s@r.c", "client:alice", Allowance(), owner="r.c")
        assert store.reserve_shared("stream:s@r.c", 1, 0, owner="r.c").refusal is not None
        # Refill and give back: r.a returns 100 of its slice, r.b grows by what is free.
        lid_a = got["r.a"][0]
        assert store.lease_take("client:alice", lid_a, -100, 0, owner="r.a")[1] == -100
        assert store.lease_take("client:alice", got["r.b"][0], 500, 0, owner="r.b")[1] == 100
        assert _reserved(store) == 1_000
        # r.a is lost: its settling releases its slice with its other reservations.
        store.fence_owner("r.a")
        assert [r.id for r in store.release_owned("r.a")] == [lid_a]
        assert _reserved(store) == 500


def test_a_lease_take_sent_again_by_name_is_applied_once():
    """A take, a growth and a give-back whose answers were lost are sent again
    under their names: each returns what the first attempt granted, and the
    slice (one reservation) holds what was applied once."""
    with start_redis() as server:
        store = _lease_store(server)
        first = store.lease_take("client:alice", None, 300, 0, owner="r.a", request="t1")
        assert store.lease_take("client:alice", None, 300, 0, owner="r.a", request="t1")[:3] == first[:3]
        lid = first[0]
        assert first[1:3] == (300, 0) and _reserved(store) == 300
        for _ in range(2):
            assert store.lease_take("client:alice", lid, 200, 0, owner="r.a", request="t2")[:3] == (lid, 200, 0)
        assert _reserved(store) == 500
        for _ in range(2):
            assert store.lease_take("client:alice", lid, -100, 0, owner="r.a", request="t3")[:3] == (lid, -100, 0)
        assert _reserved(store) == 400
        assert [(r.id, r.tokens) for r in store.load_ledger().reservations] == [(lid, 400)]
        # A name another step used (a reserve's) is not taken for a lease's.
        store.open_shared("stream:s@r.a", "client:alice", Allowance(), owner="r.a")
        store.reserve_shared("stream:s@r.a", 10, 0, owner="r.a", request="q9")
        with pytest.raises(StoreError, match="not a lease take"):
            store.lease_take("client:alice", lid, 10, 0, owner="r.a", request="q9")
        assert _reserved(store) == 410


def test_a_commit_inside_a_lease_charges_once_by_name_and_a_fenced_one_is_refused():
    with start_redis() as server:
        store = _lease_store(server)
        store.fence_as("r.a", 0)
        lid, t, _, _ = store.lease_take("client:alice", None, 400, 0, owner="r.a")
        store.open_shared("stream:s@r.a", "client:alice", Allowance(tokens=300), owner="r.a")
        cap = Reservation(id=lid, key="stream:s@r.a", tokens=400, usd_micros=0)
        # Usage 350 on a stream whose own limit leaves 300: 300 charged, 50 overage; the lease's part leaves it.
        out = store.lease_settle(cap, (300, None), 350, 0, request="q1", buffered=False)
        assert out is not None and out.charge is not None
        assert (out.charge.tokens, out.charge.overage_tokens) == (300, 50)
        totals = store.shared_totals("client:alice").totals[0]
        assert (totals.committed_tokens, totals.reserved_tokens, totals.overage_tokens) == (300, 100, 50)
        # A retry by name (its answer lost) returns the first one's charge: nothing applied twice.
        again = store.lease_settle(cap, (300, None), 350, 0, request="q1", recommit=True, buffered=False)
        assert again is not None and again.charge == out.charge
        assert store.shared_totals("client:alice").totals[0].committed_tokens == 300
        # Inside a group commit it is buffered (one pipeline with the events).
        trips = store.round_trips
        with store.batch():
            assert store.lease_settle(Reservation(id=lid, key="stream:s@r.a", tokens=100, usd_micros=0),
                                      (0, None), 0, 0, request="q2") is None
        assert store.round_trips == trips + 1
        # Another router settled r.a: its lease commit and its lease's growth are refused.
        store.fence_owner("r.a")
        with pytest.raises(Fenced):
            store.lease_settle(cap, (None, None), 10, 0, request="q3", buffered=False)
        with pytest.raises(Fenced):
            store.lease_take("client:alice", lid, 10, 0, owner="r.a")
        assert store.shared_totals("client:alice").totals[0].committed_tokens == 300


def test_a_retry_by_name_that_ran_but_whose_answer_was_lost_is_not_applied_again():
    """The first attempt of a named commit never reached Redis, its retry (a
    recommit) ran but its answer was lost too (a Redis killed mid-pipeline),
    and the group commit is sent once more: the second retry returns the
    charge the first applied — on a call's own reservation and on a call inside
    a budget lease (where the slice would otherwise pay for it twice)."""
    with start_redis() as server:
        store = _lease_store(server)
        store.open_shared("stream:s@r.a", "client:alice", Allowance(), owner="r.a")
        own = store.reserve_shared("stream:s@r.a", 100, 0, owner="r.a").reservation
        assert own is not None
        charges = [store.recommit_shared(own, 150, 0, request="c1").charge for _ in range(3)]
        assert charges == [Charge(150, 0, 0, 0)] * 3
        lid = store.lease_take("client:alice", None, 400, 0, owner="r.a")[0]
        cap = Reservation(id=lid, key="stream:s@r.a", tokens=300, usd_micros=0)
        settled = [store.lease_settle(cap, (None, None), 200, 0, request="c2", recommit=True, buffered=False)
                   for _ in range(3)]
        assert {s.charge for s in settled if s is not None} == {Charge(200, 0, 0, 0)}
        totals = store.shared_totals("client:alice").totals[0]
        assert (totals.committed_tokens, totals.reserved_tokens) == (350, 200)  # the slice: 400 - 200
        # The first attempt, arriving late, is refused: its name was settled.
        with pytest.raises(StoreError, match="settled again"):
            store.lease_settle(cap, (None, None), 200, 0, request="c2", buffered=False)
        assert store.shared_totals("client:alice").totals[0].committed_tokens == 350


def test_a_charge_is_never_negative_and_a_commit_never_grows_a_slice():
    """Defence in depth in the store's rule: a commit on an account already past
    its limit (an operator lowered it under what is held) charges 0 and counts
    the usage as overage — never a negative charge —, and a lease commit whose
    cap is below 0 (a router's books gone wrong) gives the call nothing and
    leaves the slice as it was, instead of growing it past the limit."""
    with start_redis() as server:
        store = _lease_store(server)
        store.open_shared("stream:s@r.a", "client:alice", Allowance(), owner="r.a")
        r1, r2 = (store.reserve_shared("stream:s@r.a", 100, 0, owner="r.a").reservation for _ in range(2))
        assert r1 is not None and r2 is not None
        store.set_limit("client:alice", Allowance(tokens=50))  # 200 held under a limit of 50
        assert store.commit_shared(r1, 80, 0, request="n1").charge == Charge(0, 0, 80, 0)
        store.set_limit("client:alice", Allowance(tokens=1_000))
        lid = store.lease_take("client:alice", None, 300, 0, owner="r.a")[0]
        before = store.shared_totals("client:alice").totals[0]
        bad = Reservation(id=lid, key="stream:s@r.a", tokens=-490, usd_micros=0)
        out = store.lease_settle(bad, (None, None), 0, 0, request="n2", buffered=False)
        assert out is not None and out.charge == Charge(0, 0, 0, 0)
        assert store.shared_totals("client:alice").totals[0] == before
        assert [(r.id, r.tokens) for r in store.load_ledger().reservations if r.id == lid] == [(lid, 300)]


async def test_a_cluster_ledger_reserves_inside_its_lease_and_exhaustion_refuses_with_ebudget():
    import trio

    from atp_router.deploy.cluster import ClusterLedger
    from atp_router.flow.budget import Refusal
    from atp_router.wire.errors import ErrorCode

    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        ledger = ClusterLedger(store, owner="r.a")
        ledger.open("client:alice", Allowance(tokens=100_000))
        ledger.open("s1", Allowance(), parent="client:alice")
        async with trio.open_nursery() as n:
            n.start_soon(ledger.run_committer)
            n.start_soon(ledger.run_leases)
            await trio.sleep(0.01)
            first = ledger.reserve("s1", 100, 0)  # in the store; a slice is asked for
            assert isinstance(first, Reservation) and first.id > 0
            with trio.fail_after(5):
                while (lease := ledger._leases.get("client:alice")) is None or lease.id is None:
                    await trio.sleep(0.01)
            assert lease.hold_t == 100_000 // 4  # a quarter of what was free (as seen), one router
            trips = store.round_trips
            inside = ledger.reserve("s1", 100, 0)
            assert isinstance(inside, Reservation) and inside.id < 0 and store.round_trips == trips  # no round trip
            charge = ledger.commit(inside, 150, 0)  # covered by the slice: known at once
            assert (charge.tokens, charge.overage_tokens) == (150, 0) and ledger.pending_charge(inside.id) is None
            ledger.release(first)
            with trio.fail_after(5):
                while store.shared_totals("client:alice").totals[0].committed_tokens != 150:
                    await trio.sleep(0.01)
            # More than the tenant has left: refused with EBUDGET, like a store reserve.
            big = ledger.reserve("s1", 200_000, 0)
            assert isinstance(big, Refusal) and big.code is ErrorCode.EBUDGET
            # Idle, the slice goes back to the tenant: nothing stays reserved.
            with trio.fail_after(10):
                while store.shared_totals("client:alice").totals[0].reserved_tokens:
                    await trio.sleep(0.1)
            n.cancel_scope.cancel()
        assert store.shared_totals("client:alice").totals[0].committed_tokens == 150


async def test_a_slice_goes_back_as_soon_as_the_tenant_nears_its_limit_not_once_idle(monkeypatch):
    """Near the tenant's limit a slice's free part is budget another router's
    calls need: the router gives it back as soon as it sees the tenant there
    (from any store answer), what its calls still hold included once they are
    released — not once the slice is idle (disabled here: LEASE_IDLE_S an hour).
    A fresh-clone run found 2,488 tokens left unspent in idle slices while 3
    streams were refused EBUDGET on the other routers."""
    import trio

    import atp_router.flow.lease
    from atp_router.deploy.cluster import ClusterLedger

    monkeypatch.setattr(atp_router.flow.lease, "LEASE_IDLE_S", 3600.0)
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="t" + uuid.uuid4().hex[:10])
        ledger = ClusterLedger(store, owner="r.a")
        ledger.open("client:alice", Allowance(tokens=10_000))
        ledger.open("s1", Allowance(), parent="client:alice")

        def reserved() -> int:
            return store.shared_totals("client:alice").totals[0].reserved_tokens

        async with trio.open_nursery() as n:
            n.start_soon(ledger.run_committer)
            n.start_soon(ledger.run_leases)
            await trio.sleep(0.01)
            first = ledger.reserve("s1", 100, 0)  # in the store; a slice is asked for
            assert isinstance(first, Reservation)
            with trio.fail_after(10):
                while (lease := ledger._leases.get("client:alice")) is None or lease.id is None:
                    await trio.sleep(0.01)
            assert lease.hold_t == 10_000 // 4
            inside = ledger.reserve("s1", 100, 0)
            assert isinstance(inside, Reservation) and inside.id < 0
            # Another router's calls hold most of the rest; this router sees it in its next answer.
            store.open_shared("stream:s9@r.b", "client:alice", Allowance(), owner="r.b")
            assert store.reserve_shared("stream:s9@r.b", 7_000, 0, owner="r.b").reservation is not None
            ledger.release(first)
            with trio.fail_after(10):  # the slice shrunk to what its call holds
                while reserved() != 7_000 + 100:
                    await trio.sleep(0.05)
            assert lease.retired
            ledger.release(inside)
            with trio.fail_after(10):  # and returned once that call is over
                while reserved() != 7_000:
                    await trio.sleep(0.05)
            n.cancel_scope.cancel()
