"""The call journal's read (atp_router.runtime.dataplane.journal, issue 22): a first run
of a key makes no store read before its calls; a run marked as the re-run of a lost
router's stream reads once per call. The store and ledger here are counting doubles of
RedisStore.call_record and ClusterLedger.attach (the real ones run in
tests/scale/test_cluster.py's kill-after-commit test)."""

from __future__ import annotations

from atp_router.runtime.dataplane.journal import CallJournal
from atp_router.runtime.dataplane.plan import LegOutcome


class _Store:
    def __init__(self) -> None:
        self.reads: list[str] = []

    def call_record(self, key: str) -> None:
        self.reads.append(key)


class _Ledger:
    def attach(self, reservation, record) -> None:  # pragma: no cover - not reached here
        raise AssertionError("no call answered")


def test_only_a_marked_rerun_reads_the_journal_and_the_mark_is_used_once():
    store = _Store()
    journal = CallJournal(store, _Ledger())
    assert journal.view("t", None) is None
    first = journal.view("t", "k1")
    assert first is not None and first.serve(None, "summarizer", LegOutcome(agent="summarizer")) is False
    assert store.reads == []  # a first run: no round trip before its calls
    journal.mark_rerun("t", "k1")
    rerun = journal.view("t", "k1")
    assert rerun.serve(None, "summarizer", LegOutcome(agent="summarizer")) is False
    assert store.reads == ['["t", "k1", "summarizer", 1]']
    assert journal.view("t", "k1").replay is False  # the mark was used by that open
    journal.mark_rerun("other", "k1")
    assert journal.view("t", "k1").replay is False  # another tenant's mark is not this one's
