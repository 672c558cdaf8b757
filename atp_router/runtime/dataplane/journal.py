"""Answers charged once across routers (issue 22, exactly-once charging): the
call journal of a stream re-run by its idempotency key.

A cluster router (:mod:`atp_router.deploy.cluster`) that is lost while a stream
runs has its stream re-run on another router when the client re-opens the same
``idempotency_key`` with its task (spec §8). A call whose commit reached the
store before the router died was charged; calling it again in the re-run would
charge the tenant twice for one answer. So every completed answer is stored
**in the same atomic step as its commit** (a :class:`~atp_router.flow.budget.CallRecord`
given to the ledger: :meth:`RecordLedger.attach`), named by (tenant,
idempotency key, agent, n: the agent's n-th answer of the key's run), and a
re-run (:meth:`CallJournal.mark_rerun`: the router that won the key's re-run
claim) asks the journal before each call (:meth:`JournalView.serve`; a first
run makes no read):

* **recorded** — the stored answer is the attempt's: replayed to the client as
  the agent's PARTIALs (marked ``"replayed": true``), with what its commit
  charged as the attempt's charge (``LegOutcome.charged_tokens`` /
  ``charged_usd_micros``, so the FINAL's signed usage reports it: the
  tenant's committed spend equals the sum of its FINALs). Nothing is
  estimated, reserved, called or charged again;
* **not recorded** — the call goes out as usual; when it answers, its record
  rides with its commit. A call that failed, was cancelled or whose commit
  the store did not take has no record: the re-run calls it (and that call is
  what is charged).

Records expire after :data:`JOURNAL_TTL_MS` (a re-run comes within a lease or
two of the router's loss; a finished stream's key answers its stored FINAL
without running at all). Sans-IO but for the store read, one round trip on the
calling thread like every store call of the stream's path.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any, Protocol

import msgspec

from atp_router.consensus.types import AgentReport, Usage
from atp_router.flow.budget import CallRecord, Reservation, StoredCall
from atp_router.store.base import StoreError

__all__ = ["JOURNAL_TTL_MS", "CallJournal", "JournalView", "RecordLedger", "RecordStore"]

log = logging.getLogger("atp_router.runtime.dataplane.journal")

#: How long a call record is kept, ms (1 h).
JOURNAL_TTL_MS = 3_600_000
#: Re-runs marked and not yet opened that a router keeps (the oldest forgotten first).
MAX_PENDING_RERUNS = 10_000


class RecordStore(Protocol):
    """Where call records are read (:meth:`RedisStore.call_record <atp_router.store.redis.RedisStore.call_record>`)."""

    def call_record(self, key: str) -> StoredCall | None: ...


class RecordLedger(Protocol):
    """The ledger that stores a record with its reservation's commit
    (:meth:`ClusterLedger.attach <atp_router.deploy.cluster.ClusterLedger.attach>`)."""

    def attach(self, reservation: Reservation, record: CallRecord) -> None: ...


class _Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A recorded answer: the agent's report, its text and what the call used."""

    report: AgentReport
    text: str = ""
    usage: Usage = msgspec.field(default_factory=Usage)


class CallJournal:
    """The journal of a router: ``store`` reads records, ``ledger`` stores them
    with commits. :meth:`view` gives a stream its :class:`JournalView`."""

    def __init__(self, store: RecordStore, ledger: RecordLedger, *, ttl_ms: int = JOURNAL_TTL_MS) -> None:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        self.store, self.ledger, self.ttl_ms = store, ledger, ttl_ms
        #: (tenant, idempotency key) of the re-runs this router is opening (insertion order: oldest first).
        self._reruns: dict[tuple[str, str], None] = {}

    def mark_rerun(self, tenant: str, idempotency_key: str) -> None:
        """The stream ``tenant`` opens next with ``idempotency_key`` re-runs one a
        lost router ran: its calls ask the journal (:meth:`view`)."""
        self._reruns[(tenant, idempotency_key)] = None
        if len(self._reruns) > MAX_PENDING_RERUNS:
            del self._reruns[next(iter(self._reruns))]

    def view(self, tenant: str, idempotency_key: str | None) -> JournalView | None:
        """The journal of ``tenant``'s stream opened with ``idempotency_key``
        (None without a key: such a stream is never re-run). Its answers are
        recorded with their commits; they are read back only when the stream
        was marked a re-run (:meth:`mark_rerun`)."""
        if idempotency_key is None:
            return None
        rerun = (tenant, idempotency_key) in self._reruns
        self._reruns.pop((tenant, idempotency_key), None)
        return JournalView(self, tenant, idempotency_key, replay=rerun)


class JournalView:
    """One stream's journal (module docstring): :meth:`serve` before an
    attempt, :meth:`attach` when its call answered, before it is released."""

    def __init__(self, journal: CallJournal, tenant: str, idempotency_key: str, *, replay: bool = True) -> None:
        self.journal, self.tenant, self.key = journal, tenant, idempotency_key
        #: Whether :meth:`serve` reads the store (a re-run); a first run has nothing to replay.
        self.replay = replay
        #: Answers of each agent used so far in this run (recorded or replayed).
        self._answers: Counter[str] = Counter()

    def _name(self, agent: str) -> str:
        return json.dumps([self.tenant, self.key, agent, self._answers[agent] + 1], ensure_ascii=False)

    def serve(self, io: Any, agent: str, out: Any) -> bool:
        """Answer ``agent``'s attempt ``out`` (a :class:`~atp_router.runtime.dataplane.plan.LegOutcome`)
        from the journal when a run of this key had its answer charged: emits it
        on ``io`` as the agent's PARTIALs, sets ``out.report``, ``out.text``,
        ``out.usage``, ``out.replayed`` and the charge, and returns True. False:
        call the agent. A store that fails the read is a miss (logged): the call
        is made — the store will refuse its spend if it is down."""
        if not self.replay:
            return False
        try:
            got = self.journal.store.call_record(self._name(agent))
        except StoreError:
            log.exception("call journal: reading %s's record failed (the call is made)", agent)
            return False
        if got is None:
            return False
        try:
            answer = msgspec.msgpack.decode(got.value, type=_Answer)
        except msgspec.DecodeError:
            log.warning("call journal: %s's record is not an answer: the call is made", agent)
            return False
        self._answers[agent] += 1
        out.report, out.text, out.usage = answer.report, answer.text, answer.usage
        out.charged_tokens, out.charged_usd_micros = got.tokens, got.usd_micros
        out.replayed = True
        if answer.text:
            io.emit_partial(agent, {"agent": agent, "delta": answer.text, "replayed": True})
        io.emit_partial(agent, {"agent": agent, "report": msgspec.to_builtins(answer.report),
                                "usage": msgspec.to_builtins(answer.usage), "replayed": True},
                        confidence=answer.report.confidence)
        log.info("call journal: %s's answer for key %r was charged in an earlier run: replayed, not called again",
                 agent, self.key)
        return True

    def attach(self, agent: str, reservation: Reservation | None, out: Any) -> None:
        """``agent``'s call (holding ``reservation``) answered ``out``: its
        answer rides with the commit (:meth:`RecordLedger.attach`) when it is
        complete — a report, no error, not cancelled."""
        if reservation is None or out.report is None or out.error is not None or out.cancelled:
            return
        value = msgspec.msgpack.encode(_Answer(report=out.report, text=out.text, usage=out.usage))
        self.journal.ledger.attach(reservation, CallRecord(key=self._name(agent), value=value,
                                                           ttl_ms=self.journal.ttl_ms))
        self._answers[agent] += 1
