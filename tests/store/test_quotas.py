"""Shared tenant quotas in the store (issue 22 item 3, :mod:`atp_router.flow.quota`), on
every backend (the ``backend`` fixture: SQLite in a state dir, Redis in a namespace of
a real redis-server): a tenant's open streams and open rate are counted across store
handles (router processes) in one atomic step, a close or the settling of an owner
frees its entries, an entry nobody renews expires, and a shared GCRA bucket
(:meth:`~atp_router.store.base.Store.rate_take`) passes ``burst`` then refuses with a wait.

Redis times quotas by its own clock (the ``now_ms`` arguments are the callers'
Unix ms, which SQLite uses): these tests pass the real time, and wait for real."""

from __future__ import annotations

import threading
import time

import pytest

from atp_router.flow.quota import QuotaAsk
from atp_router.store import Store
from tests.store.conftest import Backend

#: A rate no test refills (one open every 1,000 s), and a quota no rate test reaches.
SLOW, MANY = 0.001, 1_000
TTL = 60_000


def now_ms() -> int:
    return int(time.time() * 1000)


def ask(stream: str, *, tenant: str = "alice", max_streams: int = 4, per_s: float = 1_000.0,
        burst: int = 1_000) -> QuotaAsk:
    return QuotaAsk(tenant, stream, max_streams, per_s, burst)


def opened(store: Store, stream: str, owner: str, ttl: int = TTL, **kw: object) -> bool:
    return store.quota_open(ask(stream, **kw), owner=owner, now_ms=now_ms(), ttl_ms=ttl).admitted  # type: ignore[arg-type]


def test_max_streams_holds_across_handles_and_a_close_frees_a_slot(backend: Backend):
    a, b = backend.open(), backend.open()
    got = [opened((a, b)[i % 2], f"s{i}", ("r.a", "r.b")[i % 2]) for i in range(6)]
    assert got == [True] * 4 + [False] * 2
    refused = a.quota_open(ask("s9"), owner="r.a", now_ms=now_ms(), ttl_ms=TTL)
    assert (refused.admitted, refused.open, refused.refused, refused.retry_after_ms) == (False, 4, "streams", None)
    assert b.quota_open_count("alice", now_ms=now_ms()) == 4
    assert a.quota_open_count("bob", now_ms=now_ms()) == 0  # per tenant
    assert opened(b, "x", "r.b", tenant="bob")
    # Asked again for a stream it holds (a retried SYN): admitted, not counted twice.
    again = a.quota_open(ask("s0"), owner="r.a", now_ms=now_ms(), ttl_ms=TTL)
    assert (again.admitted, again.open) == (True, 4)
    # The same stream id under another owner is another stream.
    assert not opened(a, "s0", "r.b")
    assert b.quota_close("alice", "s1", owner="r.b") is True
    assert b.quota_close("alice", "s1", owner="r.b") is False  # once
    assert a.quota_close("alice", "s0", owner="r.b") is False  # not r.b's: r.a's entry stays
    assert a.quota_open_count("alice", now_ms=now_ms()) == 3
    assert opened(a, "s7", "r.a") and not opened(b, "s8", "r.b")


def test_concurrent_opens_on_several_handles_admit_exactly_max_streams(backend: Backend):
    stores = [backend.open(multiprocess=True) for _ in range(3)]
    admitted: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        for j in range(8):
            if opened(stores[i], f"s{i}-{j}", f"r.{i}"):
                with lock:
                    admitted.append(f"s{i}-{j}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 4, admitted
    assert stores[0].quota_open_count("alice", now_ms=now_ms()) == 4


def test_the_open_rate_is_shared_and_a_refused_open_takes_nothing(backend: Backend):
    a, b = backend.open(), backend.open()
    kw = {"max_streams": MANY, "per_s": SLOW, "burst": 3}
    assert [opened((a, b)[i % 2], f"s{i}", f"r.{i % 2}", **kw) for i in range(3)] == [True] * 3
    refused = b.quota_open(ask("s3", **kw), owner="r.1", now_ms=now_ms(), ttl_ms=TTL)  # type: ignore[arg-type]
    assert (refused.admitted, refused.refused, refused.open) == (False, "rate", 3)
    assert refused.retry_after_ms is not None and 990_000 <= refused.retry_after_ms <= 1_000_000
    assert a.quota_open_count("alice", now_ms=now_ms()) == 3  # the refused one holds no entry
    # A quota refusal takes no rate: a tenant at max_streams keeps its burst.
    full = {"max_streams": 1, "per_s": SLOW, "burst": 1}
    assert opened(a, "c0", "r.0", tenant="carol", **full)
    assert not opened(a, "c1", "r.0", tenant="carol", **full)
    a.quota_close("carol", "c0", owner="r.0")
    assert not opened(b, "c2", "r.1", tenant="carol", **full)  # the one token was taken by c0
    # A faster rate refills: one open every 500 ms. The second open is refused with the wait
    # left, unless the machine stalled the test a whole interval between the two (then the
    # bucket had refilled: admitted) — either way by the clock, never by a fixed sleep alone.
    fast = {"max_streams": MANY, "per_s": 2.0, "burst": 1}
    t0 = time.monotonic()
    assert opened(a, "d0", "r.0", tenant="dave", **fast)
    wait = b.quota_open(ask("d1", tenant="dave", **fast), owner="r.1", now_ms=now_ms(), ttl_ms=TTL)  # type: ignore[arg-type]
    if wait.admitted:
        assert time.monotonic() - t0 >= 0.45, "admitted within the interval"
        return
    assert wait.refused == "rate" and 1 <= (wait.retry_after_ms or 0) <= 500
    time.sleep((wait.retry_after_ms or 0) / 1000 + 0.05)
    assert opened(b, "d1", "r.1", tenant="dave", **fast)


def test_an_owner_settled_or_gone_frees_its_entries(backend: Backend):
    a, b = backend.open(), backend.open()
    for i in range(2):
        assert opened(a, f"a{i}", "r.lost")
    assert opened(b, "b0", "r.live")
    b.heartbeat("r.live", ttl_ms=60_000, now_ms=now_ms(), info={})
    # r.lost holds entries and no lease: the reaper finds it ...
    assert "r.lost" in b.lost_owners(now_ms=now_ms()) and "r.live" not in b.lost_owners(now_ms=now_ms())
    # ... and its settling frees them.
    assert b.quota_release_owned("r.lost") == 2
    assert b.quota_open_count("alice", now_ms=now_ms()) == 1
    assert "r.lost" not in b.lost_owners(now_ms=now_ms())
    assert b.quota_release_owned("r.lost") == 0
    with pytest.raises(ValueError):
        b.quota_release_owned("")


def test_an_entry_nobody_renews_expires_and_a_renewed_one_stays(backend: Backend):
    store = backend.open()
    assert opened(store, "kept", "r.kept", ttl=400) and opened(store, "gone", "r.gone", ttl=400)
    assert not opened(store, "x", "r.x", max_streams=2)
    for _ in range(3):
        time.sleep(0.2)
        assert store.quota_renew("r.kept", {("alice", "kept")}, now_ms=now_ms(), ttl_ms=400) == 1
    # 600 ms on: r.gone's entry expired (a kill -9 never settled), r.kept's was renewed.
    assert store.quota_open_count("alice", now_ms=now_ms()) == 1
    assert opened(store, "x", "r.x", max_streams=2)
    assert store.quota_renew("r.gone", {("alice", "gone")}, now_ms=now_ms(), ttl_ms=400) == 0


def test_a_renewal_drops_the_entries_its_owner_does_not_hold(backend: Backend):
    """An entry an open made after its router gave up on the call (timed out: the
    router fell back and holds no entry) goes at the owner's next renewal."""
    store = backend.open()
    for s in ("a", "b", "late"):
        assert opened(store, s, "r.1")
    assert opened(store, "c", "r.2", tenant="bob")
    assert store.quota_renew("r.1", [("alice", "a"), ("alice", "b"), ("bob", "c")], now_ms=now_ms(),
                             ttl_ms=TTL) == 2
    assert store.quota_open_count("alice", now_ms=now_ms()) == 2
    assert store.quota_open_count("bob", now_ms=now_ms()) == 1  # another owner's entry is not r.1's to drop
    assert store.quota_close("alice", "late", owner="r.1") is False
    assert store.quota_release_owned("r.1") == 2


def test_rate_take_is_a_shared_gcra_bucket(backend: Backend):
    a, b = backend.open(), backend.open()
    takes = [(a, b)[i % 2].rate_take("learn/alice", per_s=SLOW, burst=2, now_ms=now_ms()) for i in range(3)]
    assert takes[:2] == [None, None]
    assert takes[2] is not None and 990_000 <= takes[2] <= 1_000_000
    assert a.rate_take("learn/bob", per_s=SLOW, burst=2, now_ms=now_ms()) is None  # per key
    with pytest.raises(ValueError):
        a.rate_take("k", per_s=0, burst=1, now_ms=now_ms())
    with pytest.raises(ValueError):
        a.quota_open(ask("s", burst=0), owner="r", now_ms=now_ms(), ttl_ms=TTL)
