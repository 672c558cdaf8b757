"""What is Redis' own in the shared store (issue 12), on a real redis-server on
loopback: fast fail and recovery when Redis stops, hangs or restarts, the epoch
marker (a Redis that lost its data is never spent from), AOF keeping the ledger
across a kill -9 of Redis, namespaces and layout versions, URLs and masked
passwords, threads on one store object, the 2**53 amount bound, batches and
scripts Redis forgot. The Store interface itself runs on Redis in
tests/store/test_store.py and test_shared_ledger.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import redis

from atp_router.flow.budget import Allowance, Refusal, Reservation, SharedBudgetLedger
from atp_router.store import (
    Fenced,
    SchemaError,
    StoreError,
    StoreUnavailable,
    StreamRecord,
)
from atp_router.store.redis import RedisStore, mask_url
from tests.peers import RedisServer, start_redis


def ns() -> str:
    return "t" + uuid.uuid4().hex[:10]


def record(sid: str) -> StreamRecord:
    return StreamRecord(tenant="t", session_id="sess", stream_id=sid, idempotency_key=None, meta={}, qos=None,
                        budget=None, created_ms=1)


def until_available(store: RedisStore, timeout_s: float = 5.0) -> None:
    """Call the store until it answers (the back-off passes), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.get("probe")
            return
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_fast_fail_while_redis_is_down_and_recovery():
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace=ns(), socket_timeout_s=0.5, backoff_s=0.5)
        lg = SharedBudgetLedger(store, owner="r.a")
        lg.open("client:t", Allowance(tokens=1_000))
        lg.open("stream:1", Allowance(), parent="client:t")
        held = lg.reserve("stream:1", 100, 0)
        assert store.available
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unavailable"):
            lg.reserve("stream:1", 10, 0)
        first = time.monotonic() - t0
        assert not store.available
        # During the back-off: no I/O at all, every call refused at once.
        t0 = time.monotonic()
        for _ in range(100):
            with pytest.raises(StoreUnavailable):
                store.shared_totals("client:t")
        assert (time.monotonic() - t0) / 100 < 0.005
        assert first < 1.0  # refused connection: within one connect timeout
        # After the back-off one call probes again (Redis still down: refused again).
        time.sleep(0.6)
        with pytest.raises(StoreUnavailable):
            store.get("x")
        server.start()
        until_available(store)
        assert store.available
        # The ledger is as it was: the reservation still holds its tokens, and settles.
        assert store.shared_totals("client:t").totals[0].reserved_tokens == 100
        assert lg.commit(held, 80, 0).tokens == 80
        assert isinstance(lg.reserve("stream:1", 920, 0), Reservation)


def test_a_hung_redis_holds_a_call_one_socket_timeout_at_most():
    """SIGSTOP: the connection is accepted but never answered. The call gives up
    after socket_timeout_s and the next ones fail at once."""
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace=ns(), socket_timeout_s=0.3, connect_timeout_s=0.3,
                                backoff_s=0.5)
        store.put("k", b"v")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="[Tt]imeout|timed out"):
                store.get("k")
            assert time.monotonic() - t0 < 0.3 + 0.5  # one socket timeout (+ a loaded machine's slack)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.get("k")
            assert time.monotonic() - t0 < 0.2  # no I/O: well under the socket timeout
            time.sleep(0.55)  # the probe after the back-off times out too
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.get("k")
            assert time.monotonic() - t0 < 0.3 + 0.5
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        until_available(store)
        assert store.get("k") == b"v"


def test_the_url_sets_a_longer_call_timeout():
    """redis-py's URL options override the 0.5 s fast fail (a Redis over a slower
    link, or an fsync-always Redis on a busy machine): a hung Redis holds a call
    that long, and no longer."""
    with start_redis() as server:
        store = RedisStore.open(server.url + "?socket_timeout=1.5", namespace=ns())
        store.put("k", b"v")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="[Tt]imeout|timed out"):
                store.get("k")
            assert 1.4 <= time.monotonic() - t0 < 1.5 + 1.0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        until_available(store)
        assert store.get("k") == b"v"


def _errorstat(server: RedisServer, code: str) -> int:
    """How many error replies Redis gave with ``code`` (``INFO errorstats``)."""
    with redis.Redis.from_url(server.url) as r:
        return int(r.info("errorstats").get(f"errorstat_{code}", {}).get("count", 0))


def test_a_write_redis_runs_after_its_deadline_changes_nothing():
    """Issue 22: during a SIGSTOP of Redis a reserve and a commit time out on the
    router, stay in Redis' input buffer and are run when it resumes. Each carries
    its deadline on Redis' own clock (the socket timeout past the send): run
    late, it is refused by the script (``ATPLATE``) and nothing is held or
    charged, whatever the router does next (a router that died meanwhile cannot
    cancel anything)."""
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace=ns(), socket_timeout_s=0.3, connect_timeout_s=0.3,
                                backoff_s=0.3)
        reader = RedisStore.open(server.url, namespace=store.namespace, socket_timeout_s=10.0)
        assert store.deadline_ms == 1_000 and abs(store.clock_offset_ms) < 1000  # same host: about 0
        lg = SharedBudgetLedger(store, owner="r.a")
        lg.open("client:t", Allowance(tokens=10_000))
        lg.open("stream:1", Allowance(), parent="client:t")
        held = lg.reserve("stream:1", 100, 0)
        assert isinstance(held, Reservation)
        stored = Reservation(id=held.id, key=lg.store_key("stream:1"), tokens=100, usd_micros=0)
        late = [lambda: store.reserve_shared(lg.store_key("stream:1"), 1_000, 0, owner="r.a"),
                lambda: store.commit_shared(stored, 1_000, 0)]
        for n, write in enumerate(late, 1):
            until_available(store)  # on a connection made before the stop (a new one would not get through)
            late_before = _errorstat(server, "ATPLATE")
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(StoreUnavailable):
                    write()
                time.sleep(1.2)  # its deadline passes while Redis is stopped
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            # The condition: Redis ran it when it resumed, and refused it.
            deadline = time.monotonic() + 10
            while _errorstat(server, "ATPLATE") < late_before + 1:
                assert time.monotonic() < deadline, f"write {n} was not run late"
                time.sleep(0.05)
        t = reader.shared_totals(lg.store_key("client:t")).totals[0]
        assert (t.reserved_tokens, t.committed_tokens) == (100, 0)
        assert [r.id for r in reader.load_ledger().reservations] == [held.id]
        # A clock far off is refused the same way, and measured again it is right.
        until_available(store)
        store.clock_offset_ms -= 60_000
        with pytest.raises(StoreUnavailable, match="after its deadline"):
            store.reserve_shared(lg.store_key("stream:1"), 10, 0, owner="r.a")
        assert store.available  # Redis answered: no back-off
        assert store.shared_totals(lg.store_key("client:t")).totals[0].reserved_tokens == 100  # a read: no deadline
        assert abs(store.sync_clock()) < 1000
        assert isinstance(lg.reserve("stream:1", 10, 0), Reservation)


def test_a_router_fenced_by_another_cannot_write_until_it_adopts_the_new_epoch():
    """Fencing tokens (issue 22): router a's writes carry its lease epoch. Router
    b fences a (as before settling it): a's reserve, commit and stream writes
    are refused (``Fenced``, a ``NotFound`` to its callers) and change nothing;
    a's cancel and lease renewal are not; the renewal reports the new epoch,
    and writes carrying it are taken again."""
    with start_redis() as server:
        a = RedisStore.open(server.url, namespace=ns())
        b = RedisStore.open(server.url, namespace=a.namespace)
        assert a.heartbeat("r.a", ttl_ms=5_000, now_ms=0, info={}) == 0
        a.fence_as("r.a", 0)
        lg = SharedBudgetLedger(a, owner="r.a")
        lg.open("client:t", Allowance(tokens=10_000))
        lg.open("stream:1", Allowance(), parent="client:t")
        held = lg.reserve("stream:1", 100, 0)
        assert isinstance(held, Reservation)
        a.put_stream(record("s1"))
        assert b.fence_owner("r.a") == 1
        stored = Reservation(id=held.id, key=lg.store_key("stream:1"), tokens=100, usd_micros=0)
        with pytest.raises(Fenced, match="r.a was settled"):
            a.reserve_shared(lg.store_key("stream:1"), 10, 0, owner="r.a")
        with pytest.raises(Fenced):
            a.commit_shared(stored, 50, 0)
        with pytest.raises(Fenced):
            a.put_stream(record("s2"))
        with pytest.raises(Fenced):
            a.append_event("t", "sess", "s1", 1, "FINAL", b"x")
        assert a.cancel_reserve_shared("q-1") is False  # not fenced: a cancel is always taken
        assert b.get_stream("t", "sess", "s2") is None and b.events("t", "sess", "s1") == []
        t = b.shared_totals(lg.store_key("client:t")).totals[0]
        assert (t.reserved_tokens, t.committed_tokens) == (100, 0)
        assert a.heartbeat("r.a", ttl_ms=5_000, now_ms=0, info={}) == 1
        a.fence_as("r.a", 1)
        assert a.commit_shared(stored, 50, 0).charge.tokens == 50
        a.put_stream(record("s2"))
        assert b.get_stream("t", "sess", "s2") is not None


def test_flushall_makes_the_store_refuse_everything():
    """Redis lost its data: the epoch marker is gone, so an empty ledger is never
    spent as if it were the real one — every call refuses, until a new open."""
    with start_redis() as server:
        name = ns()
        store = RedisStore.open(server.url, namespace=name)
        lg = SharedBudgetLedger(store, owner="r.a")
        lg.open("client:t", Allowance(tokens=1_000))
        lg.open("stream:1", Allowance(), parent="client:t")
        lg.commit(lg.reserve("stream:1", 900, 0), 900, 0)
        redis.Redis.from_url(server.url).flushall()
        with pytest.raises(StoreUnavailable, match="lost its data"):
            lg.reserve("stream:1", 500, 0)
        assert not store.available
        for call in (lambda: store.get("x"), lambda: store.shared_totals("client:t"), lambda: store.put("x", b"1"),
                     lambda: store.live_owners(now_ms=0)):
            with pytest.raises(StoreUnavailable, match="lost its data"):
                call()
        with pytest.raises(StoreUnavailable), store.batch():  # a batch's buffered writes too
            store.put("y", b"1")
        # A restarted router opens a new epoch (an operator's decision: the data is gone).
        fresh = RedisStore.open(server.url, namespace=name)
        assert fresh.epoch != store.epoch and fresh.get("x") is None
        with pytest.raises(StoreUnavailable, match="lost its data"):
            store.get("x")


def test_restart_without_persistence_is_lost_data():
    """Every call after the restart refuses — first as unreachable (the old
    connection), then as lost data — and none reads the emptied namespace."""
    with start_redis(appendonly=False) as server:
        store = RedisStore.open(server.url, namespace=ns(), backoff_s=0.1)
        store.put("k", b"v")
        server.kill()
        server.start()
        deadline = time.monotonic() + 5
        while True:
            with pytest.raises(StoreUnavailable) as e:
                store.get("k")
            if "lost its data" in str(e.value):
                break
            assert time.monotonic() < deadline, e.value
            time.sleep(0.12)
        with pytest.raises(StoreUnavailable, match="lost its data"):
            store.get("k")


def test_aof_restart_after_kill9_keeps_the_ledger_and_the_epoch():
    with start_redis(appendonly=True) as server:
        name = ns()
        store = RedisStore.open(server.url, namespace=name, backoff_s=0.1)
        lg = SharedBudgetLedger(store, owner="r.a")
        lg.open("client:t", Allowance(tokens=10_000, usd_micros=10**6))
        lg.open("stream:1", Allowance(), parent="client:t")
        for _ in range(20):
            lg.commit(lg.reserve("stream:1", 100, 10), 90, 9)
        held = lg.reserve("stream:1", 500, 50)
        store.put_stream(record("s1"))
        store.append_event("t", "sess", "s1", 1, "FINAL", b"final")
        before = store.load_ledger()
        server.kill()  # SIGKILL: only what appendfsync always already wrote survives
        server.start()
        until_available(store)
        assert store.load_ledger() == before
        client = store.shared_totals("client:t").totals[0]
        assert (client.committed_tokens, client.reserved_tokens, client.committed_usd_micros) == (1_800, 500, 180)
        assert lg.commit(held, 400, 40).tokens == 400
        assert lg.reserve("stream:1", 1, 0).id == held.id + 1  # ids never reused
        assert store.events("t", "sess", "s1")[0].frame == b"final"
        assert RedisStore.open(server.url, namespace=name).epoch == store.epoch


def test_namespaces_are_separate_and_layout_versions_checked(redis_server: RedisServer):
    a, b = RedisStore.open(redis_server.url, namespace=ns()), RedisStore.open(redis_server.url, namespace=ns())
    a.open_account("client:t", None, Allowance(tokens=5))
    a.put("k", b"a")
    assert b.get("k") is None and b.load_ledger().accounts == ()
    b.open_account("client:t", None, Allowance(tokens=7))  # the same key in another namespace
    assert a.shared_totals("client:t").totals[0].limit.tokens == 5
    raw = redis.Redis.from_url(redis_server.url)
    newer, foreign = ns(), ns()
    raw.set(f"{newer}:layout", "atp-router/99")
    raw.set(f"{foreign}:layout", "something-else/1")
    with pytest.raises(SchemaError, match="layout version 99 is newer than this atp-router supports"):
        RedisStore.open(redis_server.url, namespace=newer)
    with pytest.raises(SchemaError, match="is not an atp-router store"):
        RedisStore.open(redis_server.url, namespace=foreign)
    assert raw.get(f"{newer}:epoch") is None  # nothing was written
    for bad in ("", "a b", "x{y}", "a*"):
        with pytest.raises(ValueError, match="namespace"):
            RedisStore.open(redis_server.url, namespace=bad)


def test_urls_passwords_and_unix_sockets():
    with start_redis(password="s3cret-pw") as server:
        store = RedisStore.open(server.url, namespace=ns())
        assert "s3cret-pw" not in repr(store) and "s3cret-pw" not in store.describe()
        assert ":***@127.0.0.1" in store.describe()
        store.put("k", b"v")
        via_unix = RedisStore.open(server.unix_url, namespace=store.namespace)
        assert via_unix.get("k") == b"v" and "s3cret-pw" not in repr(via_unix)
        wrong = f"redis://:nope@127.0.0.1:{server.port}/0"
        with pytest.raises(StoreError) as e:
            RedisStore.open(wrong, namespace=ns())
        assert not isinstance(e.value, StoreUnavailable) and "nope" not in str(e.value)
        with pytest.raises(StoreError) as e:
            RedisStore.open(f"redis://127.0.0.1:{server.port}/0", namespace=ns())
        assert "s3cret" not in str(e.value)
    with pytest.raises(ValueError, match="not a Redis URL"):
        RedisStore.open("http://:pw@127.0.0.1:1/0")
    with pytest.raises(StoreUnavailable, match="cannot be reached"):
        RedisStore.open("redis://127.0.0.1:1/0")
    assert mask_url("rediss://user:pw@h:6380/2") == "rediss://user:***@h:6380/2"
    assert mask_url("redis://h/0?password=pw&db=1") == "redis://h/0?password=%2A%2A%2A&db=1"
    assert mask_url("unix:///run/redis.sock?db=0") == "unix:///run/redis.sock?db=0"
    assert mask_url("unix://:pw@/run/redis.sock?db=0") == "unix://:***@/run/redis.sock?db=0"


def test_threads_on_one_store_object_never_overspend(redis_server: RedisServer):
    """Eight threads share one RedisStore (its connection pool), each with its own
    ledger owner, over-reporting usage against one 20,000-token tenant."""
    store = RedisStore.open(redis_server.url, namespace=ns())
    charged: list[int] = []

    def work(i: int) -> None:
        lg = SharedBudgetLedger(store, owner=f"r.{i}")
        lg.open("client:t", Allowance(tokens=20_000))
        got = 0
        for j in range(60):
            key = f"stream:{j}"
            lg.open(key, Allowance(), parent="client:t")
            r = lg.reserve(key, 50, 0)
            if not isinstance(r, Refusal):
                more = lg.extend(r, 100, 0)
                got += lg.commit(r if isinstance(more, Refusal) else more, 600, 0).tokens
            lg.close(key)
        charged.append(got)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client = store.shared_totals("client:t").totals[0]
    assert client.committed_tokens == sum(charged) == 20_000 and client.reserved_tokens == 0
    assert store.lost_owners(now_ms=0) == []  # every thread closed what it opened


def test_amounts_up_to_2_to_the_53(redis_server: RedisServer):
    store = RedisStore.open(redis_server.url, namespace=ns())
    big = 2**53 - 1
    store.open_shared("client:t", None, Allowance(tokens=big, usd_micros=big), owner=None)
    r = store.reserve_shared("client:t", 2**52 + 1, 123_456_789_012_345, owner="w").reservation
    out = store.commit_shared(r, 2**52 + 3, 123_456_789_012_347)
    assert (out.charge.tokens, out.charge.usd_micros) == (2**52 + 3, 123_456_789_012_347)
    t = store.shared_totals("client:t").totals[0]
    assert (t.committed_tokens, t.committed_usd_micros) == (2**52 + 3, 123_456_789_012_347)
    with pytest.raises(ValueError, match="2\\*\\*53"):
        store.reserve_shared("client:t", 2**53, 0, owner="w")


def test_batch_is_sent_when_it_ends_and_forgotten_scripts_reload(redis_server: RedisServer):
    name = ns()
    s, other = RedisStore.open(redis_server.url, namespace=name), RedisStore.open(redis_server.url, namespace=name)
    trips = s.round_trips
    s.put_stream(record("a"))
    assert s.round_trips == trips + 1  # one script: one round trip (atp_store_round_trips_total)
    with s.batch():
        for i in range(1, 11):
            s.append_event("t", "sess", "a", i, "PARTIAL", b"%d" % i)
        s.close_stream("t", "sess", "a", reason="FIN", closed_ms=9)
        assert other.events("t", "sess", "a") == []  # buffered, not sent yet
        assert s.round_trips == trips + 1
    assert s.round_trips == trips + 2  # eleven writes in one pipeline: one round trip
    assert len(other.events("t", "sess", "a")) == 10 and other.get_stream("t", "sess", "a").state == "closed"
    raw = redis.Redis.from_url(redis_server.url)
    raw.script_flush()
    assert s.get_stream("t", "sess", "a").state == "closed"  # one call: loaded again
    raw.script_flush()
    s.put_stream(record("b"))
    with s.batch():
        for i in range(1, 4):
            s.append_event("t", "sess", "b", i, "PARTIAL", b"x")
    assert [e.event_id for e in other.events("t", "sess", "b")] == [1, 2, 3]


def test_a_run_of_events_is_one_script_call(redis_server: RedisServer):
    """A group commit's run of one stream's events (``append_events``) is one
    ``EVALSHA`` — one epoch, fence and deadline check — not one an event; stored as
    one by one (tests/store/test_store.py holds the outcomes)."""
    s, other = RedisStore.open(redis_server.url, namespace=ns()), RedisStore.open(redis_server.url, namespace=ns())
    raw = redis.Redis.from_url(redis_server.url)
    s.put_stream(record("a"))

    def evalsha() -> int:
        return raw.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    run = [(i, "PARTIAL", b"%d" % i) for i in range(1, 11)]
    calls, trips = evalsha(), s.round_trips
    with s.batch():
        s.append_events("t", "sess", "a", run)
        s.close_stream("t", "sess", "a", reason="FIN", closed_ms=9)
    assert (evalsha() - calls, s.round_trips - trips) == (2, 1)
    assert [(e.event_id, e.frame) for e in s.events("t", "sess", "a")] == [(i, f) for i, _, f in run]
    assert other.events("t", "sess", "a") == []  # another namespace


def test_a_chained_audit_append_is_one_round_trip_unless_another_writer_raced(redis_server: RedisServer):
    """Issue 22 item 2: a chained append guesses the head this store saw last —
    one round trip; when another writer appended meanwhile the script refuses it
    and answers the head, and the append is chained to that (one more round trip,
    no read). The chain stays whole either way."""
    from atp_router.security.audit import chain_record, verify

    name = ns()
    a, b = RedisStore.open(redis_server.url, namespace=name), RedisStore.open(redis_server.url, namespace=name)

    def build(actor: str):
        return lambda seq, head: chain_record(seq, head, kind="admin", actor=actor, tenant=None, detail={}, now_ms=1)

    a.append_audit_chained(build("a"))  # the first: the head read once (none known yet)
    trips = a.round_trips
    a.append_audit_chained(build("a"))
    assert a.round_trips == trips + 1  # its own head was the store's
    b.append_audit_chained(build("b"))  # another writer moves the head
    trips = a.round_trips
    r = a.append_audit_chained(build("a"))
    assert a.round_trips == trips + 2 and r.seq == 4  # refused with the head, chained to it
    records = a.audit_records()
    assert [x.actor for x in records] == ["a", "a", "b", "a"]
    assert verify(records, [], b"k", max_unsigned=10).ok


def test_a_group_commits_chained_audit_records_ride_in_its_pipeline_and_survive_a_race(redis_server: RedisServer):
    """Issue 22 item 2: the chained audit records of a group commit
    (:meth:`RedisStore.append_audit_chained_then` inside :meth:`RedisStore.batch`)
    are built one behind the other from the head this store saw last and sent in
    the batch's one pipeline, no round trip of their own. When another writer
    appended meanwhile, the first is refused with the head, and so is every one
    behind it — also the next, whose seq now matches the head but whose chained
    hash does not (the script checks both) — and they are chained again to the head
    and sent again together: one round trip more a race. The chain stays whole,
    each record handed to its ``then`` once."""
    from atp_router.security.audit import chain_record, verify

    name = ns()
    a, b = RedisStore.open(redis_server.url, namespace=name), RedisStore.open(redis_server.url, namespace=name)

    def build(actor: str):
        return lambda seq, head: chain_record(seq, head, kind="admin", actor=actor, tenant=None, detail={}, now_ms=1)

    a.append_audit_chained(build("a0"))  # a's head known
    got: list = []
    trips = dict(a.round_trips_by_op)
    with a.batch():
        a.put("k", b"v")
        for i in range(3):
            a.append_audit_chained_then(build(f"a{i + 1}"), got.append)
        assert got == []  # buffered
    assert [r.seq for r in got] == [2, 3, 4]
    ops = {op: n - trips.get(op, 0) for op, n in a.round_trips_by_op.items() if n != trips.get(op, 0)}
    assert ops == {"pipeline": 1}  # the kv write and three records: one round trip
    b.append_audit_chained(build("b"))  # another writer moves the head to 5
    got.clear()
    trips = dict(a.round_trips_by_op)
    with a.batch():
        for i in range(3):
            a.append_audit_chained_then(build(f"c{i}"), got.append)
    assert [(r.seq, r.actor) for r in got] == [(6, "c0"), (7, "c1"), (8, "c2")]
    ops = {op: n - trips.get(op, 0) for op, n in a.round_trips_by_op.items() if n != trips.get(op, 0)}
    assert ops == {"pipeline": 2}  # refused with the head, the three sent again together
    records = a.audit_records()
    assert [x.actor for x in records] == ["a0", "a1", "a2", "a3", "b", "c0", "c1", "c2"]
    assert [x.seq for x in records] == list(range(1, 9))
    assert verify(records, [], b"k", max_unsigned=10).ok


def test_a_thread_that_never_probes_waits_for_a_stopped_redis_once(redis_server: RedisServer):
    """Issue 22 item 2 (:meth:`RedisStore.probe_off`): the thread named (a
    cluster router's trio loop) waits for a stopped Redis one socket timeout,
    the first time; past the back-off its calls still fail at once while
    another thread probes, and they go through again once a probe answered."""
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace=ns(), socket_timeout_s=0.3, backoff_s=0.2)
        store.probe_off(threading.get_ident())
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.get("k")  # the call that finds it down: one socket timeout
            assert 0.25 < time.monotonic() - t0 < 2.0
            time.sleep(0.5)  # past the back-off
            t0 = time.monotonic()
            for _ in range(20):
                with pytest.raises(StoreUnavailable):
                    store.get("k")
            assert time.monotonic() - t0 < 0.1  # never a probe from this thread
            probe: list[BaseException | None] = []

            def other() -> None:
                try:
                    store.get("k")
                    probe.append(None)
                except StoreUnavailable as e:
                    probe.append(e)

            t = threading.Thread(target=other)
            t.start()
            t.join(5)
            assert isinstance(probe[0], StoreUnavailable)  # another thread probed (and waited) instead
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        time.sleep(0.3)
        with pytest.raises(StoreUnavailable):
            store.get("k")  # still no probe from here, Redis up or not
        t = threading.Thread(target=lambda: until_available(store))
        t.start()
        t.join(10)
        assert store.available and store.get("k") is None  # a probe answered: this thread's calls go through


def test_settle_many_is_one_round_trip_and_each_settlement_its_own(redis_server: RedisServer):
    """Issue 22 item 2 (``RedisStore.settle_many``, the cluster's committer): commits,
    a re-commit by name and a release in one pipeline — one round trip —, each
    atomic on its own: a re-commit of a commit that ran returns its charge (not
    charged twice), an unknown reservation is that item's own NotFound."""
    from atp_router.store import NotFound

    store = RedisStore.open(redis_server.url, namespace=ns())
    store.open_shared("client:t", None, Allowance(tokens=10_000), owner=None)
    r1 = store.reserve_shared("client:t", 100, 0, owner="r.a").reservation
    r2 = store.reserve_shared("client:t", 100, 0, owner="r.a").reservation
    r3 = store.reserve_shared("client:t", 100, 0, owner="r.a").reservation
    gone = Reservation(id=999_999, key="client:t", tokens=5, usd_micros=0)
    trips = store.round_trips
    out = store.settle_many([("commit", r1, 80, 0, "q1", None), ("commit", r2, 300, 0, "q2", None),
                             ("release", r3, 0, 0, "", None), ("commit", gone, 5, 0, "q4", None)])
    assert store.round_trips == trips + 1
    assert [o.charge.tokens if not isinstance(o, Exception) and o.charge else o.__class__.__name__ for o in out] \
        == [80, 300, "SharedResult", "NotFound"]
    assert isinstance(out[3], NotFound)
    again = store.settle_many([("recommit", r1, 80, 0, "q1", None)])[0]
    assert again.charge.tokens == 80  # the first ran: its charge, not a second one
    t = store.shared_totals("client:t").totals[0]
    assert (t.committed_tokens, t.reserved_tokens) == (380, 0)


async def test_audit_records_of_a_shared_chain_go_in_the_group_commit_with_the_events(redis_server: RedisServer):
    """Issue 22 item 2: with ``AuditLog.defer`` (the router's group commit) a
    record of the shared chain is not a round trip of its own on the trio loop:
    nothing reaches Redis when it is recorded, and the group commit (one
    pipeline in a store thread, with the events queued beside it) chains it;
    this writer's head follows once it is stored. A record asked from a thread
    outside trio (a reaper settling a lost router) is written at once."""
    import trio

    from atp_router.runtime.dataplane.persistence import StreamPersistence
    from atp_router.security.audit import AuditLog, verify

    store = RedisStore.open(redis_server.url, namespace=ns())
    log = AuditLog(store, b"k" * 32, shared=True, every=1000)
    persistence = StreamPersistence(store)
    persistence.group_commit = True
    log.defer = persistence.defer
    trips = store.round_trips
    assert log.record("session_open", "alice", "alice", {"stream_id": "s1"}, 1) is None
    assert persistence.defer(lambda: store.put("beside", b"1"))
    assert store.round_trips == trips and store.audit_records() == []
    assert persistence.flush()  # the first: the head read once (none known yet)
    assert [r.kind for r in store.audit_records()] == ["session_open"] and store.get("beside") == b"1"
    assert log.head[0] == 1
    assert persistence.defer(lambda: store.put("beside", b"2"))  # buffered: sent with the record
    assert log.record("session_close", "alice", "alice", {"stream_id": "s1"}, 2) is None
    trips = store.round_trips
    assert persistence.flush()
    assert store.round_trips - trips == 1  # the write before it and the record: one pipeline
    assert log.head[0] == 2 and store.get("beside") == b"2"
    rec = await trio.to_thread.run_sync(lambda: log.record("admin", "reaper", None, {}, 3))
    assert rec is not None and rec.seq == 3  # off the trio loop: at once
    records = store.audit_records()
    assert [r.seq for r in records] == [1, 2, 3] and verify(records, [], b"k" * 32, max_unsigned=10).ok
    store.close()
