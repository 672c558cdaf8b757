"""A task on the embedded SQLite store in few write transactions (issue 25 item 2).

Real :class:`~atp_router.store.sqlite.SqliteStore` files, a real
:class:`~atp_router.flow.budget.BudgetLedger` journaled by
:class:`~atp_router.store.base.StoreJournal`, a real
:class:`~atp_router.runtime.dataplane.persistence.StreamPersistence` (its group
commit driven by hand: ``group_commit`` on, :meth:`flush` where the flusher
would run) and a real :class:`~atp_router.security.audit.AuditLog`; then a real
router on a state directory. Write transactions are counted as the SQLite
connection's ``COMMIT`` statements (its trace callback).

* a stream's end settlements (commit, close) wait for the group commit: until
  it runs the store still holds the reservation (a crash there: the restart
  commits it at its reserved amount, and no FINAL was sent — it is in the same
  group commit), after it the charge and nothing held;
* a deferred audit record is MACed only once stored;
* a one-call task through a real router (a scripted next-hop whose usage
  extends its reservation once) costs fewer than 7 write transactions — 7.0
  before this change by the same count (account, record, audit record,
  reservation, extension, commit and close each alone, then the events);
  5.0–5.1 measured after it: its account; its reservation; the extension; the
  group commits (one or two) of its record, events, close, commit, account
  close and audit records.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.runtime.dataplane.persistence import StreamPersistence
from atp_router.security.audit import AuditLog
from atp_router.store.base import StoreJournal
from atp_router.store.sqlite import SqliteStore
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import CLEAN, scripted_agent


def _commits(conn: sqlite3.Connection) -> list[int]:
    """A one-element list counting the ``COMMIT`` statements ``conn`` runs from now on."""
    n = [0]

    def trace(sql: str) -> None:
        if sql.strip().upper() == "COMMIT":
            n[0] += 1

    conn.set_trace_callback(trace)
    return n


@pytest.fixture
def parts(tmp_path):
    store = SqliteStore.open(tmp_path / "state")
    persistence = StreamPersistence(store)
    persistence.group_commit = True  # what run_flusher sets; flush() below is its pass
    journal = StoreJournal(store)
    journal.defer = persistence.defer
    ledger = BudgetLedger(journal=journal)
    ledger.open("tenant:a", Allowance(tokens=10_000, usd_micros=None))
    ledger.open("stream:a/s1", Allowance(tokens=5_000, usd_micros=None), parent="tenant:a")
    yield store, persistence, ledger
    store.close()


async def test_the_commit_and_close_wait_for_the_group_commit_and_are_one_transaction(parts):
    store, persistence, ledger = parts
    r = ledger.reserve("stream:a/s1", 300, 0)
    assert not hasattr(r, "reason"), r
    ledger.commit(r, 250, 0)
    ledger.close("stream:a/s1")
    held = store.load_ledger()
    # Not stored yet: a crash here leaves the reservation (committed at 300 by the restart).
    assert [x.id for x in held.reservations] == [r.id]
    commits = _commits(store._conn)
    assert persistence.flush()
    assert commits[0] == 1  # commit and close in one transaction (with the events queued with them)
    after = store.load_ledger()
    assert after.reservations == ()
    tenant = next(a for a in after.accounts if a.key == "tenant:a")
    assert tenant.committed_tokens == 250
    assert "stream:a/s1" not in [a.key for a in after.accounts]


async def test_a_deferred_audit_record_is_macced_only_once_stored(tmp_path):
    store = SqliteStore.open(tmp_path / "state")
    persistence = StreamPersistence(store)
    persistence.group_commit = True
    log = AuditLog(store, b"k" * 32, head_path=tmp_path / "audit.head", every=1)
    log.defer = persistence.defer
    log.record("session_open", "alice", "alice", {"stream_id": "s1"}, 1_000)
    assert store.audit_head() is None
    assert log.checkpoint() is None  # nothing stored: nothing to MAC
    assert store.audit_checkpoint() is None and not (tmp_path / "audit.head").exists()
    assert persistence.flush()
    head = store.audit_head()
    assert head is not None and head.seq == 1
    cp = store.audit_checkpoint()
    assert cp is not None and (cp.seq, cp.hash) == (1, head.hash)  # made once the record was stored
    store.close()


TOKENS = {"alice": "tok-alice-1111"}
RIB = {"agents": {"m.a": scripted_agent()},
       "policies": [{"name": "p", "match": {"task_type": "review"}, "fanout": ["m.a"]}],
       "clients": {"alice": {"budget": {"tokens": 10_000_000}}}}


async def test_a_one_call_task_costs_fewer_write_transactions(nursery, tmp_path, scripted):
    scripted["m.a"] = ScriptedAdapter.returning("m.a", partials=["part"], usage=Usage(in_tokens=20, out_tokens=20, usd_micros=80))
    env = await start_router_on(nursery, tmp_path, RIB, client_tokens=TOKENS, state_dir=tmp_path / "state")
    store = env.router.store
    assert isinstance(store, SqliteStore)
    async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {TOKENS['alice']}"},
                                 timeout=30) as h:
        async def task() -> None:
            r = await h.post("/v1/streams", json={"task": {"task_type": "review"}, "content": CLEAN})
            assert r.status_code == 201, r.text
            body = (await h.get(f"/v1/streams/{r.json()['stream_id']}/events")).content
            assert b"event: FINAL" in body, body

        await task()  # warm: the tenant's account opened
        commits = _commits(store._conn)
        n = 10
        for _ in range(n):
            await task()
        per_task = commits[0] / n
    assert per_task <= 6, per_task
    held = store.load_ledger()
    assert held.reservations == ()
    tenant = next(a for a in held.accounts if a.key.startswith("client:") or a.key.endswith("alice"))
    assert tenant.committed_tokens > 0


def test_an_account_reopened_while_its_close_is_deferred_has_the_close_stored_first(tmp_path) -> None:
    """A stream id reused at once (a client's next stream, another session): its
    account key is opened again while the old account's close waits in the group
    commit. The open must not meet the old account still open in the store
    ("already open"): the journal has the deferred close written first."""
    store = SqliteStore.open(tmp_path / "state")
    journal = StoreJournal(store)
    queued: list[tuple[object, object]] = []
    journal.defer = lambda write, done=None: queued.append((write, done)) or True

    def flush() -> bool:
        for write, done in queued:
            write()
            if done is not None:
                done()
        queued.clear()
        return True

    journal.flush_deferred = flush
    ledger = BudgetLedger(journal=journal)
    ledger.open("stream:bob:t1", Allowance(tokens=100))
    ledger.close("stream:bob:t1")
    assert queued  # the close is deferred, not yet in the store
    ledger.open("stream:bob:t1", Allowance(tokens=50))  # reused: the deferred close goes first
    assert not queued and journal._closing == set()
    ledger.close("stream:bob:t1")
    flush()
    store.close()
