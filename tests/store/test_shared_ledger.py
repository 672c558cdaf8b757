"""Budgets shared by several router processes (``atp-router --workers N``, issue 10;
several routers on Redis, issue 12): the store's ``*_shared`` ledger methods behind
:class:`SharedBudgetLedger`, on every backend (the ``backend`` fixture: a real
SQLite file opened by several connections and processes, a real redis-server).

* one ledger per "worker" on one store behaves exactly like one in-memory
  :class:`BudgetLedger` over the same operations (a differential state machine);
* real processes reserving and committing with over-reported usage on one tenant
  account never take it past its limit, seen from outside while they run, and
  the totals are exactly what they were charged;
* a dead owner's reservations, accounts and streams are settled by the crash rule
  and nobody else's; RIB versions and the audit chain stay single across writers;
  a version 1 state directory is migrated.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from atp_router.flow.budget import (
    Allowance,
    BudgetLedger,
    Refusal,
    Reservation,
    SharedBudgetLedger,
)
from atp_router.security.audit import AuditLog, verify
from atp_router.store import NotFound, SqliteStore, StoreJournal, StreamRecord
from atp_router.store.sqlite import SCHEMA_VERSION
from tests.store.conftest import STREAM_EVENT_V2, Backend

ROOT = Path(__file__).resolve().parents[2]


class SharedLedgerMachine(RuleBasedStateMachine):
    """Two worker ledgers on one store (two store objects: two connections)
    against one reference ledger: every reserve, extend, commit, release and
    limit change has the same outcome — reservation, refusal (key, remaining)
    or charge — and the store holds the reference's accounts. ``backend``
    (set before a run) gives each example a fresh store."""

    backend: Backend
    examples = itertools.count()

    @initialize(
        client=st.tuples(st.none() | st.integers(0, 5_000), st.none() | st.integers(0, 50_000)),
        streams=st.lists(st.tuples(st.none() | st.integers(0, 3_000), st.none() | st.integers(0, 30_000)),
                         min_size=1, max_size=6),
    )
    def setup(self, client, streams):
        state = self.backend.fresh(next(self.examples))
        self.stores = [state.open(multiprocess=True) for _ in range(2)]
        self.workers = [SharedBudgetLedger(s, owner=f"w{i}.1") for i, s in enumerate(self.stores)]
        self.ref = BudgetLedger()
        limit = Allowance(tokens=client[0], usd_micros=client[1])
        self.ref.open("client:t", limit)
        for w in self.workers:
            w.open("client:t", limit)  # the second adopts the first's account
        self.streams: dict[str, int] = {}
        for i, (t, u) in enumerate(streams):
            key, worker = f"stream:t:s{i}", i % 2
            self.ref.open(key, Allowance(tokens=t, usd_micros=u), parent="client:t")
            self.workers[worker].open(key, Allowance(tokens=t, usd_micros=u), parent="client:t")
            self.streams[key] = worker
        self.open: list[tuple[Reservation, Reservation]] = []  # (reference, shared)

    def teardown(self):
        for s in getattr(self, "stores", ()):
            s.close()

    @rule(data=st.data(), tokens=st.integers(0, 2_000), usd=st.integers(0, 20_000))
    def reserve(self, data, tokens, usd):
        key = data.draw(st.sampled_from(sorted(self.streams)))
        want = self.ref.reserve(key, tokens, usd)
        got = self.workers[self.streams[key]].reserve(key, tokens, usd)
        assert got == want
        if isinstance(want, Reservation):
            self.open.append((want, got))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), tokens=st.integers(0, 1_500), usd=st.integers(0, 15_000))
    def extend(self, data, tokens, usd):
        i = data.draw(st.integers(0, len(self.open) - 1))
        ref, got = self.open[i]
        want = self.ref.extend(ref, tokens, usd)
        grown = self.workers[self.streams[got.key]].extend(got, tokens, usd)
        assert grown == want
        if isinstance(want, Reservation):
            self.open[i] = (want, grown)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), scale=st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]))
    def commit(self, data, scale):
        ref, got = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        t, u = int(ref.tokens * scale) + (scale > 1), int(ref.usd_micros * scale)
        assert self.workers[self.streams[got.key]].commit(got, t, u) == self.ref.commit(ref, t, u)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def release(self, data):
        ref, got = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self.ref.release(ref)
        self.workers[self.streams[got.key]].release(got)

    @rule(data=st.data(), tokens=st.none() | st.integers(0, 6_000), clamp=st.booleans())
    def set_limit(self, data, tokens, clamp):
        key = data.draw(st.sampled_from(["client:t", *sorted(self.streams)]))
        worker = self.streams.get(key, data.draw(st.integers(0, 1)))
        limit = Allowance(tokens=tokens, usd_micros=self.ref.state(key).limit.usd_micros)
        assert self.workers[worker].set_limit(key, limit, clamp=clamp) == self.ref.set_limit(key, limit, clamp=clamp)

    @invariant()
    def store_holds_the_reference(self):
        for key in ["client:t", *self.streams]:
            s = self.ref.state(key)
            t = self.stores[1].shared_totals(self.workers[self.streams.get(key, 0)].store_key(key)).totals[0]
            assert (t.limit, t.committed_tokens, t.committed_usd_micros, t.reserved_tokens, t.reserved_usd_micros,
                    t.overage_tokens, t.overage_usd_micros) == (
                s.limit, s.committed_tokens, s.committed_usd_micros, s.reserved_tokens, s.reserved_usd_micros,
                s.overage_tokens, s.overage_usd_micros)
        # Each worker's mirror of its own streams is exact (only it spends on them).
        for key, worker in self.streams.items():
            assert self.workers[worker].state(key) == self.ref.state(key)


def test_shared_ledger_machine(backend: Backend):
    SharedLedgerMachine.backend = backend
    run_state_machine_as_test(SharedLedgerMachine,
                              settings=settings(max_examples=60, stateful_step_count=30, deadline=None))


def test_second_worker_sees_the_first_workers_hold(backend: Backend):
    a, b = backend.open(multiprocess=True), backend.open(multiprocess=True)
    wa, wb = SharedBudgetLedger(a, owner="w0.1"), SharedBudgetLedger(b, owner="w1.2")
    wa.open("client:t", Allowance(tokens=1_000))
    wb.open("client:t", Allowance(tokens=1_000))
    wa.open("stream:t:a", Allowance(), parent="client:t")
    wb.open("stream:t:b", Allowance(), parent="client:t")
    held = wa.reserve("stream:t:a", 700, 0)
    assert isinstance(held, Reservation)
    refused = wb.reserve("stream:t:b", 400, 0)
    assert isinstance(refused, Refusal) and refused.key == "client:t" and refused.remaining.tokens == 300
    assert wb.remaining("stream:t:b").tokens == 300  # the refusal refreshed b's mirror
    r = wb.reserve("stream:t:b", 300, 0)
    # a's call reports 2,000 tokens: charged only what the tenant can take with b's hold in place.
    charge = wa.commit(held, 2_000, 0)
    assert (charge.tokens, charge.overage_tokens) == (700, 1_300)
    assert wb.commit(r, 300, 0).tokens == 300
    assert a.shared_totals("client:t").totals[0].committed_tokens == 1_000
    # a's mirror is as of its own last operation (b spent since) until it reads again.
    assert wa.exhausted("stream:t:a") is None
    wa.refresh("stream:t:a")
    assert wa.exhausted("stream:t:a") == "'client:t' tokens 1000/1000"
    # A root is shared: closing it in one worker leaves it open for the other.
    wb.close("stream:t:b")
    wb.close("client:t")
    assert wa.has("client:t") and a.shared_totals("client:t").totals[0].key == "client:t"
    # The same stream account name in two workers (a stream id reused on two
    # connections) is two accounts.
    wa.open("stream:t:same", Allowance(tokens=10), parent="client:t")
    wb2 = SharedBudgetLedger(b, owner="w1.2")
    wb2.open("client:t", Allowance(tokens=1_000))
    wb2.open("stream:t:same", Allowance(tokens=20), parent="client:t")
    assert wa.store_key("stream:t:same") != wb2.store_key("stream:t:same")
    refused = wa.reserve("stream:t:same", 15, 0)
    assert isinstance(refused, Refusal) and refused.key == "stream:t:same" and "@" not in refused.reason
    with pytest.raises(ValueError, match="not restored"):
        SharedBudgetLedger(a, owner="w2.3").restore(wa.snapshot())


_HAMMER = textwrap.dedent("""
    import sys
    from atp_router.flow.budget import Allowance, Refusal, SharedBudgetLedger
    from tests.store.conftest import open_spec
    state, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_spec(state, multiprocess=True)
    ledger = SharedBudgetLedger(store, owner=name)
    ledger.open("client:t", Allowance(tokens=50_000, usd_micros=10**9))
    charged = refused = overage = usd = 0
    for i in range(n):
        key = f"stream:t:{name}-{i}"
        ledger.open(key, Allowance(), parent="client:t")
        r = ledger.reserve(key, 100, 100)
        if isinstance(r, Refusal):
            refused += 1
        else:
            more = ledger.extend(r, 150, 150)          # the call streams past its estimate
            r = r if isinstance(more, Refusal) else more
            c = ledger.commit(r, 700, 700)             # and bills far more (over-reporting)
            charged, overage, usd = charged + c.tokens, overage + c.overage_tokens, usd + c.usd_micros
        ledger.close(key)
    print(charged, refused, overage, usd, flush=True)
""")


@pytest.mark.parametrize("n_procs", [2, 4])
def test_processes_never_overspend_a_shared_account(backend: Backend, n_procs: int):
    """``n_procs`` real processes, each believing in 500 calls of 700 tokens
    against a 50,000-token tenant: together they charge exactly its limit,
    never more — and a watcher reading the account while they run never sees
    committed + reserved above it; the totals are the sum of what each was
    charged, to the token."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    s = backend.open(multiprocess=True)
    SharedBudgetLedger(s, owner="setup").open("client:t", Allowance(tokens=50_000, usd_micros=10**9))
    procs = [subprocess.Popen([sys.executable, "-c", _HAMMER, backend.spec, f"w{i}.{i}", "500"],
                              stdout=subprocess.PIPE, text=True, env=env) for i in range(n_procs)]
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t = s.shared_totals("client:t").totals[0]
            seen.append((t.committed_tokens + t.reserved_tokens, t.committed_usd_micros + t.reserved_usd_micros))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = [p.communicate(timeout=180)[0].split() for p in procs]
    finally:
        done.set()
        watcher.join()
    assert all(p.returncode == 0 for p in procs)
    charged = sum(int(o[0]) for o in outs)
    client = s.shared_totals("client:t").totals[0]
    assert s.load_ledger().reservations == ()
    assert client.committed_tokens == charged == 50_000  # 0 overshoot, and the limit was reached
    assert client.overage_tokens == sum(int(o[2]) for o in outs) > 0 and client.reserved_tokens == 0
    assert client.committed_usd_micros == sum(int(o[3]) for o in outs)
    assert all(int(o[1]) > 0 for o in outs)  # every one was refused once the tenant was spent
    assert len(seen) > 10 and max(t for t, _ in seen) <= 50_000


def test_journaled_ledgers_in_two_processes_would_overspend(backend: Backend):
    """The baseline the shared ledger exists for: two single-process ledgers
    (each its own view of the tenant, journaled to the same store) both spend
    its whole budget."""
    a, b = backend.open(), backend.open()
    la = BudgetLedger(journal=StoreJournal(a))
    la.open("client:t", Allowance(tokens=1_000))
    lb = BudgetLedger()
    lb.restore(b.load_ledger())
    lb.journal = StoreJournal(b)
    for i, lg in enumerate((la, lb)):
        lg.open(f"stream:t:{i}", Allowance(), parent="client:t")
        lg.commit(lg.reserve(f"stream:t:{i}", 900, 0), 900, 0)
    assert a.shared_totals("client:t").totals[0].committed_tokens == 1_800  # overshoot: why workers share


def test_a_dead_owner_is_settled_and_nobody_else(backend: Backend):
    s = backend.open(multiprocess=True)
    dead, live = SharedBudgetLedger(s, owner="w0.10"), SharedBudgetLedger(s, owner="w1.11")
    for lg in (dead, live):
        lg.open("client:t", Allowance(tokens=10_000))
    dead.open("stream:t:d", Allowance(), parent="client:t")
    live.open("stream:t:l", Allowance(), parent="client:t")
    dead.reserve("stream:t:d", 400, 40)
    kept = live.reserve("stream:t:l", 300, 30)
    for sid, owner in (("d", "w0.10"), ("l", "w1.11")):
        s.put_stream(StreamRecord(tenant="t", session_id="sess", stream_id=sid, idempotency_key=f"k{sid}", meta={},
                                  qos=None, budget=None, created_ms=1, owner=owner))
    assert [r.tokens for r in s.recover("w0.10")] == [400]  # committed at its reserved amount
    assert s.close_owned_accounts("w0.10") == 1
    gone = s.interrupt_open_streams("worker stopped", now_ms=5, owner="w0.10")
    assert [(r.stream_id, r.state, r.owner) for r in gone] == [("d", "interrupted", "w0.10")]
    client = s.shared_totals("client:t").totals[0]
    assert (client.committed_tokens, client.reserved_tokens) == (400, 300)
    assert s.get_stream("t", "sess", "l").state == "open" and s.find_idempotent("t", "kl").owner == "w1.11"
    assert live.commit(kept, 300, 30).tokens == 300  # the live worker's call settles as usual
    assert live.store_key("stream:t:l") == "stream:t:l@w1.11"
    assert s.shared_totals(live.store_key("stream:t:l")).totals[0].committed_tokens == 300
    with pytest.raises(NotFound):  # the dead worker's stream account is closed
        s.shared_totals(dead.store_key("stream:t:d"))


def test_rib_versions_and_audit_chain_across_writers(backend: Backend):
    a, b = backend.open(multiprocess=True), backend.open(multiprocess=True)
    a.save_rib(1, "", "policies", "router")
    versions = [x.next_rib_version() for x in (a, b, a, b)]
    assert versions == [2, 3, 4, 5]
    b.save_rib(5, "x: 1", "<request body>", "ops")
    assert a.active_rib_version() == 5 and a.next_rib_version() == 6
    key = b"k" * 32
    la, lb = AuditLog(a, key, shared=True), AuditLog(b, key, shared=True)
    for i in range(6):
        (la if i % 2 else lb).record("admin", "ops", None, {"i": i}, 1_000 + i)
    la.checkpoint()
    assert verify(a.audit_records(), a.audit_checkpoints(), key).ok
    assert [r.detail["i"] for r in a.audit_records()] == list(range(6))


def test_schema_1_is_migrated(tmp_path: Path):
    with SqliteStore.open(tmp_path) as s:
        lg = BudgetLedger(journal=StoreJournal(s))
        lg.open("client:t", Allowance(tokens=5_000))
        lg.open("stream:t:x", Allowance(), parent="client:t")
        lg.reserve("stream:t:x", 120, 7)
    with sqlite3.connect(tmp_path / "state.db") as c:  # back to what schema 1 was
        c.executescript(STREAM_EVENT_V2)  # schema 2's streams and events (stream.owner dropped below)
        c.execute("DROP INDEX reservation_owner")
        c.execute("DROP INDEX account_owner")
        for table, col in (("account", "reserved_tokens"), ("account", "reserved_usd"), ("account", "owner"),
                           ("reservation", "owner"), ("stream", "owner")):
            c.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
        c.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    with SqliteStore.open(tmp_path, multiprocess=True) as s:
        assert s._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        totals = {t.key: t for t in s.shared_totals("stream:t:x").totals}
        assert totals["client:t"].reserved_tokens == totals["stream:t:x"].reserved_tokens == 120
        assert totals["client:t"].reserved_usd_micros == 7


def test_audit_chain_from_threads_stays_one_chain(backend: Backend):
    """Four writers (threads, each its own store object) appending at once:
    one chain, no seq twice, and it verifies."""
    key = b"k" * 32
    stores = [backend.open(multiprocess=True) for _ in range(4)]
    logs = [AuditLog(s, key, shared=True) for s in stores]

    def write(i: int) -> None:
        for j in range(25):
            logs[i].record("admin", f"w{i}", None, {"i": i, "j": j}, 1_000 + j)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logs[0].checkpoint()
    records = stores[1].audit_records()
    assert [r.seq for r in records] == list(range(1, 101))
    assert verify(records, stores[2].audit_checkpoints(), key).ok
