"""The nonces of signed frames in the store (issue 19: replay protection that
survives restarts and spans workers and routers), on every backend (the
``backend`` fixture: SQLite in a state dir, Redis in a namespace of a real
redis-server): :meth:`~atp_router.store.base.Store.record_nonce` is fresh once per
``(tenant, kid, nonce)`` until its expiry, atomic across store handles
(processes), kept across a reopen, keyed so that ids holding ``:`` (or JSON
punctuation) never collide, bounded per tenant, and swept a bounded batch at a
time."""

from __future__ import annotations

import threading

import pytest
import redis

from atp_router.store import SqliteStore, Store, StoreLimitError, StoreUnavailable
from atp_router.store.base import NONCE_FIELD_MAX, NONCE_SWEEP
from atp_router.store.redis import RedisStore
from tests.store.conftest import Backend

NOW = 1_760_000_000_000  # unix ms
TTL = 270_000  # a nonce's life in the router: window 120 s, ts up to 120 s ahead, 30 s slack
N = "n" * 32


def rec(store: Store, tenant: str = "alice", kid: str = "k1", nonce: str = N, *, now: int = NOW,
        expires: int = NOW + TTL, cap: int = 100) -> bool:
    return store.record_nonce(tenant, kid, nonce, now_ms=now, expires_ms=expires, max_per_tenant=cap)


def stored(store: Store, tenant: str) -> int:
    """How many nonce records of ``tenant`` the backend holds, expired ones included."""
    if isinstance(store, SqliteStore):
        return store._conn.execute("SELECT COUNT(*) FROM nonce WHERE tenant = ?", (tenant,)).fetchone()[0]
    assert isinstance(store, RedisStore)
    return store._client.zcard(store._prefix + 'nz:["' + tenant + '"]')


def test_fresh_once_then_a_replay_per_tenant_and_key(backend: Backend):
    s = backend.open()
    assert rec(s) is True
    assert rec(s) is False  # the same (tenant, kid, nonce): a replay
    assert rec(s, nonce="m" * 32) is True
    assert rec(s, kid="k2") is True  # another key's nonce space
    assert rec(s, tenant="bob") is True  # another tenant's
    assert rec(s, tenant="bob") is False
    assert rec(s, kid="k2") is False


def test_kept_across_a_reopen_and_seen_by_another_handle(backend: Backend):
    """A router restarted on the state (a reopen), and another process on it at
    the same time (a second handle), both refuse the nonce the first recorded."""
    first = backend.open()
    assert rec(first)
    other = backend.open()
    assert rec(other) is False
    first.close()
    again = backend.open()
    assert rec(again) is False
    assert rec(again, nonce="z" * 32) is True
    assert rec(other, nonce="z" * 32) is False


def test_a_record_expires_at_its_expiry_and_is_then_fresh_again(backend: Backend):
    s = backend.open()
    assert rec(s, now=NOW, expires=NOW + 60_000)
    assert rec(s, now=NOW + 59_999, expires=NOW + 120_000) is False
    assert rec(s, now=NOW + 60_000, expires=NOW + 180_000) is True  # its record expired: fresh
    assert rec(s, now=NOW + 179_999, expires=NOW + 240_000) is False  # recorded again, to the new expiry
    assert stored(s, "alice") == 1


# Pairs of (tenant, kid, nonce) that one string built as "tenant:kid:nonce" (or
# with naive quoting) would make the same key.
COLLISIONS = [
    (("a:b", "c", N), ("a", "b:c", N)),
    (("a", "b:" + N, "x"), ("a:b", N, "x")),
    (("a", "k1", "n:" + N), ("a:k1:n", N[:1], N)),
    (('a","b', "k1", N), ("a", 'b","k1', N)),
    (('["a"]', "k1", N), ("a", "k1", N)),
    (("a\\", '"k1', N), ("a", "\\k1", N)),
]


@pytest.mark.parametrize(("one", "two"), COLLISIONS, ids=[f"{a[0]}|{b[0]}" for a, b in COLLISIONS])
def test_ids_with_separators_never_collide(backend: Backend, one: tuple[str, str, str], two: tuple[str, str, str]):
    s = backend.open()
    assert rec(s, *one) is True
    assert rec(s, *two) is True  # another key: fresh, not a "replay" of the first
    assert rec(s, *one) is False and rec(s, *two) is False


def test_a_tenant_at_its_bound_is_refused_and_the_others_are_not(backend: Backend):
    s = backend.open()
    for i in range(3):
        assert rec(s, nonce=f"{i}" * 20, cap=3)
    with pytest.raises(StoreLimitError) as e:
        rec(s, nonce="x" * 20, cap=3)
    assert e.value.limit == "nonces_per_tenant" and "3 unexpired nonces" in str(e.value)
    assert rec(s, nonce="0" * 20, cap=3) is False  # a replay is still told as such at the bound
    assert stored(s, "alice") == 3  # nothing recorded by the refusal
    assert rec(s, tenant="bob", nonce="x" * 20, cap=3) is True
    # Once the tenant's nonces expired it is served again.
    assert rec(s, nonce="x" * 20, cap=3, now=NOW + TTL, expires=NOW + 2 * TTL) is True


def test_expired_records_are_swept_a_bounded_batch_per_call(backend: Backend):
    """200 expired records of a tenant are not dropped at once: each call sweeps
    at most NONCE_SWEEP of them (and adds its own), until none is left."""
    s = backend.open()
    for i in range(200):
        assert rec(s, nonce=f"old{i:020d}", expires=NOW + 60_000, cap=1_000)
    assert stored(s, "alice") == 200
    later = NOW + 60_000
    left = 200
    for i in range(1, 8):
        assert rec(s, nonce=f"new{i:020d}", now=later, cap=1_000)
        left = max(0, left - NONCE_SWEEP)
        assert stored(s, "alice") == left + i
    assert left == 0
    # The old nonces are gone, not replayable-as-refused: each is fresh at `later`.
    assert rec(s, nonce=f"old{0:020d}", now=later) is True


def test_the_per_tenant_bound_counts_unexpired_records_only(backend: Backend):
    """A tenant whose earlier nonces expired (not yet swept) is not refused for them."""
    s = backend.open()
    for i in range(2 * NONCE_SWEEP + 5):
        assert rec(s, nonce=f"old{i:020d}", expires=NOW + 60_000, cap=1_000)
    for i in range(3):
        assert rec(s, nonce=f"new{i:020d}", now=NOW + 60_000, cap=3)
    with pytest.raises(StoreLimitError):
        rec(s, nonce="x" * 20, now=NOW + 60_000, cap=3)


def test_concurrent_handles_record_a_nonce_once(backend: Backend):
    """Eight handles (as eight processes would) race to record the same 40 nonces:
    each is fresh for exactly one of them."""
    handles = [backend.open(multiprocess=True) for _ in range(8)]
    wins: list[list[str]] = [[] for _ in handles]
    barrier = threading.Barrier(len(handles))

    def race(i: int) -> None:
        barrier.wait()
        for k in range(40):
            if rec(handles[i], nonce=f"race{k:020d}"):
                wins[i].append(f"race{k:020d}")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = sorted(n for w in wins for n in w)
    assert won == [f"race{k:020d}" for k in range(40)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"tenant": ""}, "tenant must be a string"),
    ({"kid": ""}, "kid must be a string"),
    ({"nonce": "n" * (NONCE_FIELD_MAX + 1)}, "nonce must be a string"),
    ({"expires": NOW}, "expires_ms"),
    ({"cap": 0}, "max_per_tenant"),
])
def test_bad_arguments_are_refused_before_anything_is_stored(backend: Backend, kw: dict, match: str):
    s = backend.open()
    with pytest.raises(ValueError, match=match):
        rec(s, **kw)
    assert stored(s, "alice") == 0


@pytest.mark.peers
def test_redis_keeps_a_tenants_nonces_no_longer_than_the_last_expiry(redis_server):
    """The tenant's sorted set carries a TTL to its last expiry (a tenant gone
    quiet leaves nothing), and the store refuses to answer once Redis lost its
    data (an empty nonce set must never pass a replay)."""
    import uuid

    s = RedisStore.open(redis_server.url, namespace=f"t{uuid.uuid4().hex[:12]}")
    try:
        assert rec(s, expires=NOW + 5_000)
        assert rec(s, nonce="m" * 32, expires=NOW + 60_000)
        pttl = s._client.pttl(s._prefix + 'nz:["alice"]')
        assert 55_000 < pttl <= 60_000
        raw = redis.Redis.from_url(redis_server.url)
        raw.delete(s._prefix + "epoch")  # as after a restart without persistence
        raw.close()
        with pytest.raises(StoreUnavailable, match="lost its data"):
            rec(s, nonce="q" * 32)
    finally:
        s.close()
