"""The audit spool (issue 22 item 4, :class:`atp_router.security.audit.AuditSpool`):
records the store cannot take are kept in order, chained when it can, bounded,
and a record that does not fit is counted and logged once."""

from __future__ import annotations

import logging

import pytest

from atp_router.security.audit import AuditLog, AuditSpool, verify
from atp_router.store import SqliteStore, StoreFull

KEY = b"k" * 32


class Flaky:
    """A store whose audit appends fail (a full disk) while ``down``."""

    def __init__(self, store: SqliteStore) -> None:
        self.store, self.down = store, False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def append_audit(self, record):
        if self.down:
            raise StoreFull("state store full: test: no space left on device")
        self.store.append_audit(record)

    def append_audit_chained(self, build):
        if self.down:
            raise StoreFull("state store full: test: no space left on device")
        return self.store.append_audit_chained(build)


@pytest.fixture(params=[False, True], ids=["single", "shared"])
def log_and_store(request, tmp_path):
    store = SqliteStore.open(tmp_path)
    flaky = Flaky(store)
    log = AuditLog(flaky, KEY, every=1000, interval_ms=10**9, shared=request.param,
                   spool=AuditSpool(max_records=3, max_bytes=10_000))
    yield log, flaky, store
    store.close()


def test_records_the_store_could_not_take_are_chained_in_order_when_it_can(log_and_store):
    log, flaky, store = log_and_store
    assert log.record("admin", "a", "t", {"n": 0}, 1000) is not None
    flaky.down = True
    for n in (1, 2):
        assert log.record("admin", "a", "t", {"n": n}, 1000 + n) is None
    assert len(log.spool) == 2
    assert not log.flush_spool()  # still down: kept
    flaky.down = False
    log.record("admin", "a", "t", {"n": 3}, 1003)  # behind the spooled ones, never before them
    assert len(log.spool) == 3
    assert log.flush_spool()
    recs = store.audit_records()
    assert [(r.detail["n"], r.ts_ms) for r in recs] == [(0, 1000), (1, 1001), (2, 1002), (3, 1003)]
    log.checkpoint()
    assert verify(recs, [store.audit_checkpoint()], KEY).ok


def test_a_spooled_record_the_store_ran_after_all_is_not_chained_twice(log_and_store):
    log, flaky, store = log_and_store
    log.record("admin", "a", "t", {"n": 0}, 1000)
    flaky.down = True
    log.record("admin", "a", "t", {"n": 1}, 1001)
    # The append timed out on the router but the store ran it (a Redis SIGSTOP): it is in the chain.
    head = store.audit_head()
    from atp_router.security.audit import chain_record
    store.append_audit(chain_record(head.seq, head.hash, kind="admin", actor="a", tenant="t", detail={"n": 1},
                                    now_ms=1001))
    flaky.down = False
    assert log.flush_spool()
    assert [r.detail["n"] for r in store.audit_records()] == [0, 1]


def test_a_full_spool_drops_counts_and_logs_once(log_and_store, caplog):
    log, flaky, store = log_and_store
    dropped: list[int] = []
    log.spool.on_drop = lambda: dropped.append(1)
    flaky.down = True
    with caplog.at_level(logging.ERROR, logger="atp_router.security.audit"):
        for n in range(6):
            log.record("admin", "a", "t", {"n": n}, 1000 + n)
    assert len(log.spool) == 3 and log.spool.dropped == 3 and len(dropped) == 3
    full = [r for r in caplog.records if "audit spool full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in caplog.records]
    flaky.down = False
    assert log.flush_spool()
    assert [r.detail["n"] for r in store.audit_records()] == [0, 1, 2]


def test_the_byte_bound_holds_too(tmp_path):
    store = SqliteStore.open(tmp_path)
    flaky = Flaky(store)
    log = AuditLog(flaky, KEY, spool=AuditSpool(max_records=100, max_bytes=200))
    flaky.down = True
    for n in range(5):
        log.record("admin", "a", "t", {"text": "x" * 80, "n": n}, 1000 + n)
    assert 0 < len(log.spool) < 5
    assert log.spool.bytes <= 200
    assert log.spool.dropped == 5 - len(log.spool)
    store.close()


def _two_spooled(tmp_path):
    """``(state dir, store, flaky store, log)``: record 0 chained, then the store
    down and records 1 and 2 spooled to the state directory's file."""
    state = tmp_path / "state"
    state.mkdir()
    store = SqliteStore.open(tmp_path)
    flaky = Flaky(store)
    log = AuditLog(flaky, KEY, spool=AuditSpool(directory=state))
    log.record("admin", "a", "t", {"n": 0}, 1000)
    flaky.down = True
    for n in (1, 2):
        log.record("admin", "a", "t", {"n": n}, 1000 + n)
    return state, store, flaky, log


def test_spooled_records_survive_the_process_and_are_chained_by_the_next_one(tmp_path):
    """Issue 22 item 4: a spool on the state directory writes each record to
    ``audit.spool.<pid>`` (fsynced) before it returns. The process dies with
    records spooled (its file closed without draining: its lock released, as at
    kill -9); the next spool on the directory adopts them ahead of its own, the
    log chains them in order, each with its own time, and the files go."""
    state, store, flaky, first = _two_spooled(tmp_path)
    files = list(state.glob("audit.spool.*"))
    assert len(files) == 1 and len(files[0].read_bytes().splitlines()) == 2
    # Another live process's spool does not take a file still locked by its owner.
    assert len(AuditSpool(directory=state)) == 0
    first.spool._file.close()  # the process is gone: its lock with it, its file left
    with files[0].open("ab") as f:
        f.write(b'{"kind":"admin","actor":"a","ten')  # the torn last line of a crash
    flaky.down = False
    second = AuditLog(flaky, KEY, spool=AuditSpool(directory=state))
    assert len(second.spool) == 2
    second.record("admin", "a", "t", {"n": 3}, 1003)  # behind the adopted ones
    assert second.flush_spool()
    assert [(r.detail["n"], r.ts_ms) for r in store.audit_records()] == [(0, 1000), (1, 1001), (2, 1002), (3, 1003)]
    assert list(state.glob("audit.spool.*")) == []
    store.close()


def test_a_crash_in_the_middle_of_a_flush_chains_nothing_twice(tmp_path):
    """The process chained the first of its two spooled records, then died
    before its file went: the next one adopts both and chains only the second."""
    state, store, flaky, first = _two_spooled(tmp_path)
    from atp_router.security.audit import chain_record
    head = store.audit_head()
    store.append_audit(chain_record(head.seq, head.hash, kind="admin", actor="a", tenant="t", detail={"n": 1},
                                    now_ms=1001))
    first.spool._file.close()  # killed here
    flaky.down = False
    second = AuditLog(flaky, KEY, spool=AuditSpool(directory=state))
    assert len(second.spool) == 2 and second.flush_spool()
    assert [r.detail["n"] for r in store.audit_records()] == [0, 1, 2]
    store.close()


def test_a_spool_file_that_cannot_be_written_keeps_the_record_in_memory(tmp_path, caplog):
    store = SqliteStore.open(tmp_path)
    flaky = Flaky(store)
    gone = tmp_path / "no-such-dir"  # writing the file fails (as on a full disk)
    log = AuditLog(flaky, KEY, spool=AuditSpool(directory=tmp_path))
    log.spool.directory = gone
    flaky.down = True
    with caplog.at_level(logging.ERROR, logger="atp_router.security.audit"):
        log.record("admin", "a", "t", {"n": 1}, 1001)
        log.record("admin", "a", "t", {"n": 2}, 1002)
    assert len(log.spool) == 2 and log.spool.disk_failed
    assert sum("kept in memory only" in r.getMessage() for r in caplog.records) == 1
    flaky.down = False
    assert log.flush_spool() and [r.detail["n"] for r in store.audit_records()] == [1, 2]
    store.close()


def test_opening_the_log_on_a_state_directory_chains_what_a_dead_process_spooled(tmp_path):
    """AuditLog.open (every router, the --workers supervisor) chains the adopted
    records at once when the store takes them: they do not wait for a flush
    that process may never run."""
    store = SqliteStore.open(tmp_path)
    flaky = Flaky(store)
    dead = AuditLog(flaky, KEY, spool=AuditSpool(directory=tmp_path))
    flaky.down = True
    dead.record("admin", "a", "t", {"n": 1}, 1001)
    dead.spool._file.close()  # killed
    flaky.down = False
    AuditLog.open(flaky, tmp_path, env={"ATP_AUDIT_KEY": KEY.hex()}, warn=False)
    assert [r.detail["n"] for r in store.audit_records()] == [1]
    assert list(tmp_path.glob("audit.spool.*")) == []
    store.close()
