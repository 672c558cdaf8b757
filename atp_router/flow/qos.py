"""QoS scheduler of next-hop call slots: gold / silver / bronze (spec §9, §5.3, §10
EWINDOW / EPREEMPT). Sans-IO.

One :class:`QosScheduler` per router: ``capacity`` is the number of agent calls
the router runs at once, across all streams. Every call asks for a slot with
:meth:`~QosScheduler.request` and gives it back with
:meth:`~QosScheduler.release` (or :meth:`~QosScheduler.cancel` on RST). As h2's
windows do, the scheduler *returns decisions* — :class:`Grant`,
:class:`Queued`, :class:`Refused`, :class:`Preempt` — and the caller acts on
them (starts the call, sends RST ``EPREEMPT``).

The three classes of spec §9:

* **gold** has ``gold_reserved`` slots that silver and bronze never take; it
  also competes for the rest. While gold runs fewer than its reserved slots,
  a queued gold ticket is served first. When a gold ticket has waited
  ``preempt_after_ms`` (its ``gold_sla_ms`` is threatened),
  :meth:`~QosScheduler.preemptions` names the youngest running bronze calls to
  RST; the slots they free go to gold first.
* **silver** shares the slots by weighted fair queuing and is never starved:
  while it is backlogged it receives at least its weighted share of the grants.
* **bronze** shares by weight too, is preempted for gold, and may be dropped
  from the queue under congestion (:meth:`~QosScheduler.shed`).

A slot is the first gate of a call, not the last: a call holding one may still
wait for room at its next-hop (its per-agent window, spec §5.1). The caller says
so with :meth:`~QosScheduler.block` / :meth:`~QosScheduler.unblock` and names
the next-hop as the ticket's ``key``: a gold ticket blocked for
``preempt_after_ms`` counts as gold kept waiting, and
:meth:`~QosScheduler.preemptions` relieves it by preempting the youngest bronze
call *running at the same next-hop* (a bronze ticket that is itself blocked holds
no room there and is no such victim). A slot held by a blocked silver or bronze
call is idle, so gold does not queue behind it: :meth:`~QosScheduler.reclaim`
takes it back (:class:`Revoke` — no RST, nothing of the call had started; the
ticket goes back to the head of its class queue) and grants it to gold.

Weighted fair queuing by virtual finish times: each class ``c`` has a
virtual finish time ``F_c``; every grant to ``c`` adds ``1 / weight_c``, and a
freed slot goes to the eligible backlogged class with the smallest next
finish tag ``F_c + 1 / weight_c`` (ties: gold, silver, bronze). A class that
becomes backlogged starts at ``max(F_c, V)``, where the virtual time ``V`` is
the smallest ``F`` of the backlogged classes (while none is, the start tag of
the last grant): an idle class hoards no credit, and one that got slots
outside the fair competition (gold's reserve) cannot push ``V`` ahead of
classes still waiting, so a returning silver competes at once. Every grant is
charged, reserved and preemption grants included, so the weights hold over
all grants and the reserve is a floor, not an extra. Within a class tickets
are FIFO.

Every operation is O(1) amortised except :meth:`~QosScheduler.preemptions`,
:meth:`~QosScheduler.shed` and :meth:`~QosScheduler.get_timer`, which are
linear in the preemptions pending and returned. Memory is one record per live
ticket, and each class queue is capped by ``max_queued`` (beyond it a request
is :class:`Refused` with ``EWINDOW``). Time is an argument (``now``, seconds,
non-decreasing across calls); nothing here reads a clock.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from msgspec import Struct

from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS

_CLASSES = (QoS.GOLD, QoS.SILVER, QoS.BRONZE)  # also the tie-break order of WFQ
DEFAULT_WEIGHTS: Mapping[QoS, float] = MappingProxyType({QoS.GOLD: 4.0, QoS.SILVER: 2.0, QoS.BRONZE: 1.0})


class Grant(Struct, frozen=True):
    """A slot is granted: start the call for ``stream_id``, then hand ``ticket``
    back with :meth:`QosScheduler.release`. ``waited_ms``: time queued (0 when
    granted on request)."""

    ticket: int
    stream_id: str
    qos: QoS
    waited_ms: float


class Queued(Struct, frozen=True):
    """No slot for this class now; the ticket waits in its class queue and comes
    back as a :class:`Grant` from a later ``release``/``cancel``."""

    ticket: int
    stream_id: str
    qos: QoS


class Refused(Struct, frozen=True):
    """The class queue is full (``max_queued``): answer the send with NACK
    ``EWINDOW`` (spec §10). No ticket was created."""

    reason: str
    qos: QoS
    code: ErrorCode = ErrorCode.EWINDOW


class Preempt(Struct, frozen=True):
    """Bronze ``stream_id`` loses ``ticket``: send RST with ``code`` (``EPREEMPT``,
    spec §9) and ``reason``. ``running=True`` (from
    :meth:`QosScheduler.preemptions`): the call holds a slot until the caller
    stops it and calls :meth:`QosScheduler.cancel`. ``running=False`` (from
    :meth:`QosScheduler.shed`): the queued ticket is already withdrawn."""

    stream_id: str
    ticket: int
    reason: str
    running: bool
    code: ErrorCode = ErrorCode.EPREEMPT


class Revoke(Struct, frozen=True):
    """The slot of ``ticket`` — a silver or bronze call blocked at its next-hop,
    not started — was given to gold (:meth:`QosScheduler.reclaim`). Not a
    preemption: the ticket is queued again at the head of its class queue and
    comes back as a :class:`Grant`; the caller withdraws the call from its
    next-hop's queue and waits for that grant."""

    ticket: int
    stream_id: str
    qos: QoS


class ClassStatistics(Struct, frozen=True):
    """One class: slots held and tickets waiting now (``blocked``: holding a
    slot, waiting for their next-hop); counts since creation."""

    running: int
    queued: int
    granted: int
    refused: int
    cancelled: int
    preempted: int
    shed: int
    blocked: int = 0
    revoked: int = 0


class QosStatistics(Struct, frozen=True):
    """Snapshot of a :class:`QosScheduler`. ``preempting``: bronze calls told to
    stop whose slots are not back yet. ``gold_sla_misses``: gold grants that
    came after more than ``gold_sla_ms`` in the queue."""

    capacity: int
    gold_reserved: int
    running: int
    queued: int
    gold: ClassStatistics
    silver: ClassStatistics
    bronze: ClassStatistics
    preempting: int
    gold_sla_misses: int


@dataclass(slots=True)
class _Ticket:
    ticket: int
    stream_id: str
    qos: QoS
    since: float  # request time while queued, grant time once running
    running: bool = False
    key: str | None = None  # the next-hop the call goes to
    blocked_since: float | None = None  # running, waiting for room at the next-hop


@dataclass(slots=True)
class _Counts:
    granted: int = 0
    refused: int = 0
    cancelled: int = 0
    preempted: int = 0
    shed: int = 0
    revoked: int = 0


class QosScheduler:
    """Router-wide scheduler of next-hop call slots (see the module docstring).

    ``capacity``: slots (concurrent agent calls), ≥ 1. ``gold_reserved``: slots
    only gold may use, ``0 <= gold_reserved < capacity``. ``weights``: WFQ
    weight of each class (> 0). ``gold_sla_ms``: gold's queueing SLA (grants
    later than that are counted as misses). ``preempt_after_ms``: gold queue
    wait that triggers bronze preemption, ``<= gold_sla_ms``.
    ``max_queued``: cap of each class queue. ``shed_after_ms``: queued bronze
    older than this is dropped by :meth:`shed` while gold or silver wait
    (``None``: never). Raises ``ValueError`` on an invalid configuration.
    """

    def __init__(
        self,
        capacity: int,
        *,
        gold_reserved: int,
        weights: Mapping[QoS, float] = DEFAULT_WEIGHTS,
        gold_sla_ms: float = 2000.0,
        preempt_after_ms: float = 250.0,
        max_queued: int = 4096,
        shed_after_ms: float | None = 5000.0,
    ) -> None:
        if capacity < 1 or not 0 <= gold_reserved < capacity:
            raise ValueError(f"need capacity >= 1 and 0 <= gold_reserved < capacity, got {capacity}/{gold_reserved}")
        for c in _CLASSES:
            w = weights.get(c)
            if w is None or not math.isfinite(w) or w <= 0:
                raise ValueError(f"weight of {c} must be a finite number > 0, got {w!r}")
        if not 0 <= preempt_after_ms <= gold_sla_ms:
            raise ValueError(f"need 0 <= preempt_after_ms <= gold_sla_ms, got {preempt_after_ms}/{gold_sla_ms}")
        if max_queued < 1 or (shed_after_ms is not None and shed_after_ms < 0):
            raise ValueError("max_queued must be >= 1 and shed_after_ms >= 0 or None")
        self.capacity = capacity
        self.gold_reserved = gold_reserved
        self.weights = MappingProxyType({c: float(weights[c]) for c in _CLASSES})
        self.gold_sla_ms = gold_sla_ms
        self.preempt_after_ms = preempt_after_ms
        self.max_queued = max_queued
        self.shed_after_ms = shed_after_ms
        self._cost = {c: 1.0 / self.weights[c] for c in _CLASSES}
        self._finish = dict.fromkeys(_CLASSES, 0.0)  # F_c
        self._vtime = 0.0  # V; invariant: F_c >= V for every backlogged c
        # Insertion order is FIFO order for queues and grant order for running
        # tickets; OrderedDict pops and deletes anywhere in O(1).
        self._queues: dict[QoS, OrderedDict[int, _Ticket]] = {c: OrderedDict() for c in _CLASSES}
        self._running: dict[QoS, OrderedDict[int, _Ticket]] = {c: OrderedDict() for c in _CLASSES}
        self._tickets: dict[int, _Ticket] = {}
        self._preempting: set[int] = set()
        # Gold tickets blocked at their next-hop, in blocking order (FIFO), each with
        # its blocked_since (never None here: _clear_block drops the entry with it).
        self._blocked_gold: OrderedDict[int, tuple[_Ticket, float]] = OrderedDict()
        self._n_blocked = dict.fromkeys(_CLASSES, 0)
        self._n_running = 0
        self._counts = {c: _Counts() for c in _CLASSES}
        self._sla_misses = 0
        self._next_ticket = itertools.count(1)

    def request(self, stream_id: str, qos: QoS, now: float, *, key: str | None = None) -> Grant | Queued | Refused:
        """Ask for one call slot for ``stream_id`` in class ``qos`` at ``now`` (s);
        ``key`` names the next-hop the call goes to (see :meth:`block`).

        :class:`Grant` when a slot is free for the class and nobody of that
        class waits; else :class:`Queued` (FIFO in the class queue); else,
        with the class queue at ``max_queued``, :class:`Refused` (``EWINDOW``).
        """
        qos = QoS(qos)
        queue = self._queues[qos]
        if not queue and self._fits(qos):
            t = _Ticket(next(self._next_ticket), stream_id, qos, now, key=key)
            self._tickets[t.ticket] = t
            self._charge(qos)
            return self._start(t, now)
        if len(queue) >= self.max_queued:
            self._counts[qos].refused += 1
            return Refused(reason=f"{qos} queue full: {len(queue)} calls waiting (max_queued)", qos=qos)
        if not queue:
            # The class becomes backlogged: it starts no earlier than the
            # virtual time, so credit is not hoarded while idle.
            self._finish[qos] = max(self._finish[qos], self._vtime)
        t = _Ticket(next(self._next_ticket), stream_id, qos, now, key=key)
        self._tickets[t.ticket] = t
        queue[t.ticket] = t
        return Queued(ticket=t.ticket, stream_id=stream_id, qos=qos)

    def block(self, ticket: int, now: float) -> None:
        """The call holding running ``ticket`` waits for room at its next-hop
        (``key``) from ``now``: a blocked gold ticket is relieved by
        :meth:`preemptions` after ``preempt_after_ms``. No-op if it is blocked
        already, or not running: a preempted call's ticket may be cancelled
        before the call itself sees its RST."""
        t = self._tickets.get(ticket)
        if t is not None and t.running and t.blocked_since is None:
            t.blocked_since = now
            self._n_blocked[t.qos] += 1
            if t.qos is QoS.GOLD:
                self._blocked_gold[ticket] = (t, now)

    def unblock(self, ticket: int, now: float) -> None:
        """The call holding ``ticket`` got its room at the next-hop at ``now``
        (a gold ticket blocked longer than ``gold_sla_ms`` counts as an SLA
        miss). No-op when it is not blocked or not known."""
        t = self._tickets.get(ticket)
        if t is None or t.blocked_since is None:
            return
        if t.qos is QoS.GOLD and (now - t.blocked_since) * 1000.0 > self.gold_sla_ms:
            self._sla_misses += 1
        self._clear_block(t)

    def reclaim(self, now: float) -> tuple[list[Revoke], list[Grant]]:
        """Give gold the slots of blocked silver and bronze calls (see the module
        docstring): while gold waits for a slot and such a call exists, the
        youngest blocked bronze (else silver) ticket not being preempted is
        revoked — back at the head of its class queue, its WFQ charge refunded —
        and its slot granted to the head gold ticket. Returns both lists."""
        revoked: list[Revoke] = []
        grants: list[Grant] = []
        gold = self._queues[QoS.GOLD]
        while gold and self._n_running >= self.capacity:
            t = self._idle_victim()
            if t is None:
                break
            self._clear_block(t)
            del self._running[t.qos][t.ticket]
            self._n_running -= 1
            queue = self._queues[t.qos]
            self._finish[t.qos] -= self._cost[t.qos]
            if not queue:
                self._finish[t.qos] = max(self._finish[t.qos], self._vtime)
            t.running, t.since = False, now
            queue[t.ticket] = t
            queue.move_to_end(t.ticket, last=False)
            self._counts[t.qos].revoked += 1
            revoked.append(Revoke(ticket=t.ticket, stream_id=t.stream_id, qos=t.qos))
            g = gold.popitem(last=False)[1]
            self._finish[QoS.GOLD] += self._cost[QoS.GOLD]
            grants.append(self._start(g, now))
        self._advance_vtime()
        return revoked, grants

    def _idle_victim(self) -> _Ticket | None:
        for c in (QoS.BRONZE, QoS.SILVER):
            if self._n_blocked[c]:
                for t in reversed(self._running[c].values()):
                    if t.blocked_since is not None and t.ticket not in self._preempting:
                        return t
        return None

    def _clear_block(self, t: _Ticket) -> None:
        if t.blocked_since is not None:
            t.blocked_since = None
            self._n_blocked[t.qos] -= 1
            self._blocked_gold.pop(t.ticket, None)

    def release(self, ticket: int, now: float) -> list[Grant]:
        """The call holding ``ticket`` ended at ``now``: free its slot and return
        the queued tickets granted in its place (at most one; empty when
        nobody eligible waits). Raises ``ValueError`` if ``ticket`` is not
        running (never granted, already released, or cancelled)."""
        t = self._tickets.get(ticket)
        if t is None or not t.running:
            raise ValueError(f"ticket {ticket} is not running")
        return self._free(t, now)

    def cancel(self, ticket: int, now: float) -> list[Grant]:
        """Withdraw ``ticket`` (stream RST, client gone, or after a
        :class:`Preempt`): a queued ticket leaves its queue, a running one
        frees its slot. Returns the tickets granted in its place. An unknown
        or already settled ticket is a no-op (RST can race the call's end)."""
        t = self._tickets.get(ticket)
        if t is None:
            return []
        self._counts[t.qos].cancelled += 1
        self._clear_block(t)
        if t.running:
            return self._free(t, now)
        del self._queues[t.qos][ticket]
        del self._tickets[ticket]
        self._advance_vtime()
        return []

    def preemptions(self, now: float) -> list[Preempt]:
        """Bronze calls to preempt at ``now`` (spec §9: RST ``EPREEMPT`` when
        gold's SLA is threatened).

        For each gold ticket queued for ≥ ``preempt_after_ms`` and not already
        covered by an earlier, still running preemption, the youngest running
        bronze ticket not yet preempted; none when no gold has waited that
        long. The caller RSTs each stream and calls :meth:`cancel` (or
        :meth:`release`) for the ticket; that slot then goes to gold first.
        Then, for each gold ticket :meth:`block` ed at its next-hop for ≥
        ``preempt_after_ms`` (and not covered by a preemption on its way at
        that next-hop), the youngest bronze call running at that next-hop.
        """
        pending = len(self._preempting)
        available = len(self._running[QoS.BRONZE]) - pending
        limit = self.preempt_after_ms / 1000.0
        # The first ``pending`` queued gold tickets are covered by slots
        # already on their way back.
        candidates = itertools.islice(self._queues[QoS.GOLD].values(), pending, pending + max(available, 0))
        victims = (t for t in reversed(self._running[QoS.BRONZE].values()) if t.ticket not in self._preempting)
        out: list[Preempt] = []
        for gold in candidates:
            if now < gold.since + limit:  # same sum as get_timer(): firing at its deadline is exact
                break  # FIFO: everyone behind it waited less
            victim = next(victims)
            out.append(
                Preempt(
                    stream_id=victim.stream_id,
                    ticket=victim.ticket,
                    reason=(
                        f"preempted for gold stream {gold.stream_id!r}, queued {(now - gold.since) * 1000.0:.0f} ms "
                        f"(preempt after {self.preempt_after_ms:g} ms, SLA {self.gold_sla_ms:g} ms)"
                    ),
                    running=True,
                )
            )
        # Marked only now: the generator above skips members of _preempting.
        self._preempting.update(p.ticket for p in out)
        for gold, blocked_since, victim in self._relief():
            if now < blocked_since + limit:
                break  # FIFO: everyone behind it was blocked later
            out.append(
                Preempt(
                    stream_id=victim.stream_id,
                    ticket=victim.ticket,
                    reason=(
                        f"preempted for gold stream {gold.stream_id!r}, waiting {(now - blocked_since) * 1000.0:.0f}"
                        f" ms for next-hop {gold.key} (preempt after {self.preempt_after_ms:g} ms, "
                        f"SLA {self.gold_sla_ms:g} ms)"
                    ),
                    running=True,
                )
            )
            self._preempting.add(victim.ticket)
        self._counts[QoS.BRONZE].preempted += len(out)
        return out

    def _relief(self) -> Iterator[tuple[_Ticket, float, _Ticket]]:
        """``(blocked gold, its blocked_since, bronze victim)``, in blocking order: each gold
        ticket blocked at next-hop ``key`` and not covered by a preemption still
        on its way at that key, with the youngest bronze ticket running there
        (not blocked, not preempted, not paired already). Gold without such a
        victim is skipped: only silver or gold hold its next-hop."""
        if not self._blocked_gold:
            return
        covered: dict[str | None, int] = {}
        for ticket in self._preempting:
            t = self._tickets.get(ticket)
            if t is not None:
                covered[t.key] = covered.get(t.key, 0) + 1
        paired: set[int] = set()
        for gold, blocked_since in self._blocked_gold.values():
            if covered.get(gold.key, 0) > 0:
                covered[gold.key] -= 1
                continue
            victim = next(
                (t for t in reversed(self._running[QoS.BRONZE].values())
                 if t.key == gold.key and t.blocked_since is None and t.ticket not in self._preempting
                 and t.ticket not in paired),
                None,
            )
            if victim is not None:
                paired.add(victim.ticket)
                yield gold, blocked_since, victim

    def shed(self, now: float) -> list[Preempt]:
        """Drop queued bronze tickets that have waited ≥ ``shed_after_ms`` while
        gold or silver tickets wait too (spec §9: bronze "may be dropped during
        congestion"). They leave the queue here; the caller RSTs each stream
        with ``EPREEMPT``. Empty when shedding is off or nobody else waits."""
        if self.shed_after_ms is None or not (self._queues[QoS.GOLD] or self._queues[QoS.SILVER]):
            return []
        queue = self._queues[QoS.BRONZE]
        limit = self.shed_after_ms / 1000.0
        out: list[Preempt] = []
        while queue:
            t = next(iter(queue.values()))
            if now < t.since + limit:
                break  # FIFO: everyone behind it waited less
            del queue[t.ticket]
            del self._tickets[t.ticket]
            self._counts[QoS.BRONZE].shed += 1
            waited = (now - t.since) * 1000.0
            out.append(
                Preempt(
                    stream_id=t.stream_id,
                    ticket=t.ticket,
                    reason=f"bronze shed under congestion after {waited:.0f} ms queued (limit {self.shed_after_ms:g} ms)",
                    running=False,
                )
            )
        self._advance_vtime()
        return out

    def get_timer(self) -> float | None:
        """When (seconds, the clock of ``now``) :meth:`preemptions` or
        :meth:`shed` could next return something, or ``None`` if neither can
        until the next ``request``/``release``/``cancel``/``block``/``unblock``.
        May lie in the past: call them at once."""
        deadlines: list[float] = []
        if len(self._running[QoS.BRONZE]) > len(self._preempting):
            gold = next(itertools.islice(self._queues[QoS.GOLD].values(), len(self._preempting), None), None)
            if gold is not None:
                deadlines.append(gold.since + self.preempt_after_ms / 1000.0)
        bronze = self._queues[QoS.BRONZE]
        if self.shed_after_ms is not None and bronze and (self._queues[QoS.GOLD] or self._queues[QoS.SILVER]):
            deadlines.append(next(iter(bronze.values())).since + self.shed_after_ms / 1000.0)
        # Only a blocked gold ticket with a victim at its next-hop: one without
        # would be a deadline in the past that preemptions() never acts on.
        relief = next(self._relief(), None)
        if relief is not None:
            deadlines.append(relief[1] + self.preempt_after_ms / 1000.0)
        return min(deadlines, default=None)

    def statistics(self) -> QosStatistics:
        per = {
            c: ClassStatistics(
                running=len(self._running[c]),
                queued=len(self._queues[c]),
                granted=n.granted,
                refused=n.refused,
                cancelled=n.cancelled,
                preempted=n.preempted,
                shed=n.shed,
                blocked=self._n_blocked[c],
                revoked=n.revoked,
            )
            for c, n in self._counts.items()
        }
        return QosStatistics(
            capacity=self.capacity,
            gold_reserved=self.gold_reserved,
            running=self._n_running,
            queued=sum(len(q) for q in self._queues.values()),
            gold=per[QoS.GOLD],
            silver=per[QoS.SILVER],
            bronze=per[QoS.BRONZE],
            preempting=len(self._preempting),
            gold_sla_misses=self._sla_misses,
        )

    def _fits(self, qos: QoS) -> bool:
        """A slot is free for ``qos``: gold may take any free slot, silver and
        bronze must leave ``gold_reserved - gold running`` slots free."""
        if self._n_running >= self.capacity:
            return False
        if qos is QoS.GOLD:
            return True
        return self._n_running - len(self._running[QoS.GOLD]) < self.capacity - self.gold_reserved

    def _charge(self, qos: QoS) -> None:
        # An immediate grant: the class was idle, so it starts at V.
        start = max(self._finish[qos], self._vtime)
        self._finish[qos] = start + self._cost[qos]
        if not any(self._queues.values()):
            self._vtime = start

    def _advance_vtime(self) -> None:
        # V := min F of the backlogged classes; it never decreases because each
        # of them holds F >= V.
        self._vtime = min((self._finish[c] for c in _CLASSES if self._queues[c]), default=self._vtime)

    def _start(self, t: _Ticket, now: float) -> Grant:
        waited_ms = (now - t.since) * 1000.0
        if t.qos is QoS.GOLD and waited_ms > self.gold_sla_ms:
            self._sla_misses += 1
        t.running, t.since = True, now
        self._running[t.qos][t.ticket] = t
        self._n_running += 1
        self._counts[t.qos].granted += 1
        return Grant(ticket=t.ticket, stream_id=t.stream_id, qos=t.qos, waited_ms=waited_ms)

    def _free(self, t: _Ticket, now: float) -> list[Grant]:
        self._clear_block(t)
        del self._running[t.qos][t.ticket]
        del self._tickets[t.ticket]
        self._n_running -= 1
        preempted = t.ticket in self._preempting
        self._preempting.discard(t.ticket)
        grants: list[Grant] = []
        while (c := self._pick(for_gold=preempted)) is not None:
            preempted = False
            t_next = self._queues[c].popitem(last=False)[1]
            self._finish[c] += self._cost[c]
            grants.append(self._start(t_next, now))
        self._advance_vtime()
        return grants

    def _pick(self, *, for_gold: bool) -> QoS | None:
        """The class whose head ticket gets the free slot, or ``None``."""
        if self._n_running >= self.capacity:
            return None
        if self._queues[QoS.GOLD] and (for_gold or len(self._running[QoS.GOLD]) < self.gold_reserved):
            return QoS.GOLD
        best: QoS | None = None
        best_tag = math.inf
        for c in _CLASSES:
            if self._queues[c] and self._fits(c):
                tag = self._finish[c] + self._cost[c]
                if tag < best_tag:
                    best, best_tag = c, tag
        return best
