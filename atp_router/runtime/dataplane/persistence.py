"""The durable half of the stream table (spec §8 across a restart):
:class:`StreamPersistence` writes every stream the router opens, each of its
outbound events and its close to the :class:`~atp_router.store.base.Store`, and
reads a stream that left memory back from it (:class:`StoredStream`).

Writes are synchronous, or — while :meth:`StreamPersistence.run_flusher` runs —
queued and written in one store transaction per scheduler pass (group commit,
issue 10): an event's followers send it only once it is stored
(:attr:`EventLog.durable <atp_router.runtime.dataplane.eventlog.EventLog.durable>`),
so a client never holds an event a restarted router (or another router on a
shared store) has not got. A store that cannot be reached keeps the queued
writes, in order, until it answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from atp_router.runtime.dataplane.eventlog import LoggedEvent
from atp_router.security.redact import redact_meta
from atp_router.store.base import (
    Fenced,
    Store,
    StoredEvent,
    StoreError,
    StoreLimitError,
    StoreUnavailable,
    StreamRecord,
)
from atp_router.store.threads import off_loop
from atp_router.wire.frame import Window

if TYPE_CHECKING:
    from atp_router.runtime.dataplane.stream import StreamCtx

__all__ = ["StoredRoute", "StoredStream", "StreamPersistence", "stored_task_digest"]

log = logging.getLogger("atp_router.runtime")

#: A group commit the store could not take (unreachable) is tried again this much later, s.
_FLUSH_RETRY_S = 0.25
#: Key of the SYN+ACK route info kept with a stored stream's meta.
_ROUTE_KEY = "_atp_route"
#: A write another part deferred to the group commit (:meth:`StreamPersistence.defer`), what
#: to tell once it is stored and once its group commit is over (None: nothing), and whether it
#: goes before the events (``first``).
_Deferred = tuple[Callable[[], object], Callable[[], None] | None, Callable[[], None] | None, bool]


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class _StoredHop:
    agent: str


def stored_task_digest(rec: StreamRecord) -> str | None:
    """The task digest (:func:`~atp_router.runtime.dataplane.stream.task_digest`)
    stored with stream ``rec``: None when it was opened without an idempotency
    key or without its task on the SYN."""
    route = rec.meta.get(_ROUTE_KEY)
    digest = route.get("task_digest") if isinstance(route, dict) else None
    return digest if isinstance(digest, str) else None


@dataclass(frozen=True, slots=True)
class StoredRoute:
    """The route a restored stream was opened on (what the API answers with)."""

    policy: str
    agents: list[str]

    @property
    def next_hops(self) -> list[_StoredHop]:
        return [_StoredHop(a) for a in self.agents]


@dataclass(frozen=True, slots=True)
class StoredStream:
    """A closed stream as the store has it (:meth:`StreamPersistence.read_back`):
    its record, its meta without the route kept with it, the route and window
    its SYN+ACK carried, the bandit's choice (its JSON dict) and its events."""

    record: StreamRecord
    meta: dict[str, Any]
    route: StoredRoute
    window: Window
    decision: Any
    events: list[StoredEvent]
    task_digest: str | None = None


class StreamPersistence:
    """Writes of the stream table to ``store`` (None: nothing is stored, a
    restart forgets every stream) and reads back from it (module docstring)."""

    def __init__(self, store: Store | None) -> None:
        #: Durable copy of every stream, its events and its close (spec §8 across a
        #: restart): :mod:`atp_router.store`.
        self.store = store
        #: The router process the streams it opens are stored as running on
        #: (``atp-router --workers N``: a worker's owner name; None alone).
        self.owner: str | None = None
        #: Group commit (issue 10): while :meth:`run_flusher` runs, outbound events
        #: and closes are queued and written in one store transaction per
        #: scheduler pass; followers send an event only once it is stored.
        self.group_commit = False
        #: Queued writes: an event, a close (None), or a stream's record the store
        #: could not take at open (written first when it answers again).
        self._pending: list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]] = []
        self._flush_wanted = trio.Event()
        self._flushing = False
        #: Told ``(op, error)`` when a flush found the store unreachable (metrics, atp_router.deploy.cluster).
        self.on_store_unavailable: Callable[[str, StoreError], None] | None = None
        #: Told when a flush was refused with :class:`~atp_router.store.base.Fenced`
        #: (a cluster router settled by another: its fence runs before the next flush).
        self.on_fenced: Callable[[], None] | None = None
        #: When set, a flush writes only while it returns True (atp_router.deploy.cluster: not
        #: until the router checked, after an outage, which of its streams it still owns).
        self.flush_gate: Callable[[], bool] | None = None
        #: False: when the store cannot take a flush (StoreUnavailable) the events are sent
        #: anyway and their writes stay queued until it can (atp_router.deploy.single: no other
        #: router reads this store, and a full disk must not stall the running streams).
        self.hold_unstored = True
        #: True: a stream's record is written in the group commit of its first events, not
        #: alone at open (atp_router.deploy.single: no other router looks it up meanwhile).
        self.record_in_group_commit = False
        #: The writes of the group commit being written off the loop (still "unstored").
        self._inflight: list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]] = []
        #: Streams dropped (:meth:`drop`) while a group commit was in flight: none of their
        #: writes are queued again if it fails.
        self._dropped: set[int] = set()
        #: Other parts' store writes for the next group commit, after its events (:meth:`defer`).
        self._writes: list[_Deferred] = []

    def persist_open(self, ctx: StreamCtx) -> None:
        """Store the record of a stream just opened (its meta with secrets masked,
        its route and window): at once, or — under group commit with
        :attr:`record_in_group_commit`, or the store unreachable — in the next
        flush, before its events (its SYN+ACK is sent once that transaction is
        durable)."""
        if self.store is None:
            return
        route = {"policy": ctx.route.policy, "next_hops": [h.agent for h in ctx.route.next_hops],
                 "rib_version": ctx.gen.version if ctx.gen is not None else 0,
                 "window": msgspec.to_builtins(ctx.window)}
        if ctx.decision is not None and hasattr(ctx.decision, "to_json"):
            route["decision"] = ctx.decision.to_json()
        if ctx.task_digest is not None:
            route["task_digest"] = ctx.task_digest
        record = StreamRecord(
            tenant=ctx.tenant, session_id=ctx.session_id, stream_id=ctx.stream_id,
            # Stored meta has its secrets masked (spec §11, §19): the store is not cleared for them.
            idempotency_key=ctx.idempotency_key, meta={**redact_meta(ctx.meta), _ROUTE_KEY: route}, qos=ctx.qos,
            budget=ctx.budget, created_ms=_now_ms(), owner=self.owner)
        if self.group_commit and self.record_in_group_commit:
            self._queue(ctx, record)  # one transaction with its first events (issue 25 item 2)
            return
        try:
            self.store.put_stream(record)
        except StoreUnavailable as e:
            if not self.group_commit:
                log.error("state store: stream %s/%s not stored: %s", ctx.tenant, ctx.stream_id, e)
                return
            # Written by the next flush that reaches the store, before its events.
            self._pending.insert(0, (ctx, record))
            self._flush_wanted.set()
        except StoreError:
            log.exception("state store: put_stream failed")

    def persist_event(self, ctx: StreamCtx, ev: LoggedEvent) -> None:
        """Write one outbound event of ``ctx`` to the store before any follower
        sends it on (the log is what a client reads after a restart): at once,
        or — with :attr:`group_commit` — queued for the next :meth:`flush`."""
        if self.store is None or ctx.restored:
            return  # appended durable
        if self.group_commit:
            self._queue(ctx, ev)
            return
        self._store_event(ctx, ev, ev.json_bytes())

    def _store_event(self, ctx: StreamCtx, ev: LoggedEvent, data: bytes) -> None:
        """Append ``ev`` (``data``: its frame as JSON) to ``ctx``'s stored events;
        a failure marks the stream unstored (or, in a group commit, stops it)."""
        assert self.store is not None
        try:
            self.store.append_event(ctx.tenant, ctx.session_id, ctx.stream_id, ev.id, ev.type, data)
        except StoreError as e:
            self._not_stored(ctx, f"event {ev.id}", e)

    def _store_events(self, ctx: StreamCtx, run: list[tuple[int, str, bytes]]) -> None:
        """:meth:`_store_event` for a group commit's run of ``ctx``'s consecutive
        events ``(id, type, frame JSON)`` at once (:meth:`~atp_router.store.base.Store.append_events`)."""
        assert self.store is not None
        try:
            if len(run) == 1:  # the common case, straight to the one-event write
                self.store.append_event(ctx.tenant, ctx.session_id, ctx.stream_id, *run[0])
            else:
                self.store.append_events(ctx.tenant, ctx.session_id, ctx.stream_id, run)
        except StoreError as e:
            # A run: those before the failing one are stored (the error names it).
            self._not_stored(ctx, f"event {run[0][0]}" if len(run) == 1
                             else f"events {run[0][0]}..{run[-1][0]} (not all)", e)

    def _not_stored(self, ctx: StreamCtx, what: str, e: StoreError) -> None:
        """A store error appending ``ctx``'s events (``what``): an unreachable store
        stops a group commit (raised: the whole batch waits for the store, flush);
        else the stream is marked unstored — the client still gets every frame
        live; after a restart the stream reads as interrupted at the last stored
        event, and its log, only in memory, is kept for its full age."""
        if isinstance(e, StoreUnavailable) and self._flushing:
            raise e
        ctx.unstored = True
        if isinstance(e, StoreLimitError):
            log.warning("stream %s/%s: %s not stored: %s", ctx.tenant, ctx.stream_id, what, e)
        else:
            log.error("stream %s/%s: %s not stored", ctx.tenant, ctx.stream_id, what, exc_info=e)

    def persist_close(self, ctx: StreamCtx) -> None:
        """Store that ``ctx`` closed (after its events): at once, or queued for the next :meth:`flush`."""
        if self.store is None or ctx.restored:
            return
        if self.group_commit:
            self._queue(ctx, None)  # after its events, in the same transaction
            return
        self._store_close(ctx)

    def _store_close(self, ctx: StreamCtx) -> None:
        assert self.store is not None
        last = ctx.log.events[-1].type if ctx.log.events else "RST"
        try:
            self.store.close_stream(ctx.tenant, ctx.session_id, ctx.stream_id, reason=last, closed_ms=_now_ms())
        except StoreUnavailable:
            if self._flushing:
                raise
            log.exception("state store: close_stream failed")
        except StoreError:
            log.exception("state store: close_stream failed")

    def _queue(self, ctx: StreamCtx, ev: LoggedEvent | StreamRecord | None) -> None:
        if not self._pending:
            self._flush_wanted.set()
        self._pending.append((ctx, ev))

    def defer(self, write: Callable[[], object], done: Callable[[], None] | None = None, *,
              over: Callable[[], None] | None = None, first: bool = False) -> bool:
        """Queue ``write`` — a store write of another part of the router: a
        shared quota's close, a ledger settlement at a stream's end
        (:class:`~atp_router.store.base.StoreJournal`), an audit record — for
        the next group commit, after its events: one store transaction (one
        round trip) with them, off the trio loop, retried with them while the
        store cannot be reached; ``done()`` is called on the trio side once it
        is stored. A write that raises a store error other than unreachable or
        fenced is logged and dropped alone (the group commit's other writes
        stand). ``over()`` is called on the trio side once the group commit
        that ran it is over and not kept for a retry, stored or not (a write
        that keeps its own outcome: the cluster's commits). ``first``: it goes
        before the events in the group commit (a call's commit before the
        FINAL that reports it: the FINAL is never stored without it). False when no
        group commit runs, or when called off the trio loop (a store thread):
        the caller writes at once."""
        if not self.group_commit:
            return False
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return False
        if not self._pending and not self._writes:
            self._flush_wanted.set()
        self._writes.append((write, done, over, first))
        return True

    def flush(self) -> bool:
        """Write every queued event and close in one store transaction (group
        commit), then let the followers send them. A store failure loses no
        frame for the live client: the events are sent anyway (as without group
        commit), only a restart reads the stream as interrupted — except when
        the store cannot be reached (:class:`~atp_router.store.base.StoreUnavailable`,
        a shared store): then nothing is sent, the writes stay queued and
        :meth:`run_flusher` tries them again until the store answers (another
        router may serve the stream from the store: a client must never hold
        an event the store has not; with :attr:`hold_unstored` False the events
        are sent and only their writes wait). Returns False in that case."""
        taken = self._take()
        if taken is None:
            return not self._pending and not self._writes
        return self._written(*taken, self._write(*taken))

    def _take(self) -> tuple[list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]],
                             list[_Deferred]] | None:
        """The queued writes, taken for one group commit (their events encoded),
        and the deferred ones (:meth:`defer`); None when there are none or the
        flush gate holds them."""
        if not self._pending and not self._writes:
            return None
        if self.flush_gate is not None and not self.flush_gate():
            return None  # the store is not confirmed back yet (atp_router.deploy.cluster): the writes wait
        pending, self._pending = self._pending, []
        writes, self._writes = self._writes, []
        for _, ev in pending:
            if isinstance(ev, LoggedEvent):
                ev.json_bytes()  # encoded before the store's write lock is taken
        self._inflight = pending
        return pending, writes

    def _write(self, pending: list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]],
               writes: list[_Deferred]) -> BaseException | None:
        """The store's side of a group commit (any thread: it reads only what
        :meth:`_take` froze): None, or the store error that stopped it."""
        assert self.store is not None
        self._flushing = True
        try:
            with self.store.batch():
                for write, _, _, first in writes:
                    if first:
                        self._deferred(write)
                run: list[tuple[int, str, bytes]] = []  # consecutive events of one stream: one append_events
                for i, (ctx, ev) in enumerate(pending):
                    if isinstance(ev, LoggedEvent):
                        run.append((ev.id, ev.type, ev.json_bytes()))
                        nxt = pending[i + 1] if i + 1 < len(pending) else None
                        if nxt is None or nxt[0] is not ctx or not isinstance(nxt[1], LoggedEvent):
                            self._store_events(ctx, run)
                            run = []
                    elif ev is None:
                        self._store_close(ctx)
                    else:
                        self.store.put_stream(ev)
                for write, _, _, first in writes:
                    if not first:
                        self._deferred(write)
        except StoreError as e:
            return e
        finally:
            self._flushing = False
        return None

    @staticmethod
    def _deferred(write: Callable[[], object]) -> None:
        """One deferred write inside the group commit (:meth:`defer`)."""
        try:
            write()
        except (StoreUnavailable, Fenced):
            raise  # the whole group commit is kept and tried again (or waits for the fence)
        except StoreError:
            log.exception("state store: a deferred write was refused; dropped")

    def _written(self, pending: list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]],
                 writes: list[_Deferred], error: BaseException | None) -> bool:
        """On the trio side, after :meth:`_write`: mark the events sent, or queue
        the writes again (in order, before what came meanwhile) when the store
        could not take them or fenced this router."""
        self._inflight = []
        dropped, self._dropped = self._dropped, set()
        if isinstance(error, StoreUnavailable | Fenced):
            self._pending[:0] = [(c, e) for c, e in pending if id(c) not in dropped]
            self._writes[:0] = writes
            if isinstance(error, Fenced):
                # Another router settled this one: nothing is sent until the streams it
                # settled are dropped here (on_fenced: the cluster's fence) and the writes
                # carry the new lease epoch; the rest go then, in order.
                log.warning("state store: a batch of %d writes was refused: %s", len(pending), error)
                if self.on_fenced is not None:
                    self.on_fenced()
                return False
            if self.on_store_unavailable is not None:
                self.on_store_unavailable("events", error)
            if not self.hold_unstored:
                self._mark_sent(pending)
            return False
        if error is not None:
            log.error("state store: a batch of %d writes failed", len(pending), exc_info=error)
        self._mark_sent(pending)
        for _, done, over, _ in writes:
            for told in (done if error is None else None, over):
                if told is not None:
                    try:
                        told()
                    except Exception:  # the writes are stored; what follows them must not stop the flusher
                        log.exception("state store: acting on a stored write failed")
        return True

    @staticmethod
    def _mark_sent(pending: list[tuple[StreamCtx, LoggedEvent | StreamRecord | None]]) -> None:
        """The followers of ``pending``'s events may send them."""
        for ctx, ev in pending:
            if isinstance(ev, LoggedEvent):
                ctx.log.mark_durable(ev.id)

    async def run_flusher(self) -> None:
        """Group commit until cancelled: each scheduler pass's events go to the
        store in one transaction (≈ 4 µs an event instead of ≈ 30 µs alone,
        issue 10). Whatever is queued at cancellation is written synchronously,
        and writes are synchronous again afterwards."""
        self.group_commit = self.store is not None
        try:
            while True:
                await self._flush_wanted.wait()
                self._flush_wanted = trio.Event()
                # One scheduler pass: the tasks already runnable add their events first.
                await trio.lowlevel.cancel_shielded_checkpoint()
                # The writes in a store thread when the store is threaded (off_loop: a shared
                # store that stalls holds that thread, not the trio loop); events queued
                # meanwhile wait for the next group commit. Cancelled, it still waits for the
                # thread (the writes may apply) and accounts for them.
                taken = self._take()
                if taken is None:
                    done = not self._pending and not self._writes
                else:
                    done = self._written(*taken, await off_loop(self.store, self._write, *taken))
                    # Not kept alive by this frame while it waits: the batch's streams and events.
                    taken = None
                if not done:
                    await trio.sleep(_FLUSH_RETRY_S)  # the store is unreachable or not confirmed back: the writes wait
                    self._flush_wanted.set()
        finally:
            self.group_commit = False
            self.flush()

    def unstored(self) -> set[int]:
        """Ids of the streams whose events or close are queued for the store, or
        being written off the loop (group commit)."""
        if not self._pending and not self._inflight:
            return set()
        return {id(c) for c, _ in self._pending} | {id(c) for c, _ in self._inflight}

    def drop(self, ctx: StreamCtx) -> None:
        """Forget the queued writes of ``ctx`` (settled in the store by another
        router), and those of the group commit in flight if it fails."""
        self._pending = [(c, e) for c, e in self._pending if c is not ctx]
        if self._inflight:
            self._dropped.add(id(ctx))

    def find(self, tenant: str, *, stream_id: str | None = None,
             idempotency_key: str | None = None) -> StreamRecord | None:
        """``tenant``'s stored stream opened with ``idempotency_key``, else the one
        named ``stream_id``; None without a store, or when the tenant has no such
        stream (another tenant's never matches)."""
        if self.store is None:
            return None
        if idempotency_key is not None:
            return self.store.find_idempotent(tenant, idempotency_key)
        if stream_id is not None:
            return self.store.find_stream(tenant, stream_id)
        return None

    def read_back(self, rec: StreamRecord) -> StoredStream:
        """What the store has of the stream ``rec`` (found by :meth:`find`)."""
        assert self.store is not None
        meta = dict(rec.meta)
        route = meta.pop(_ROUTE_KEY, {})
        window = msgspec.convert(route.get("window") or {"max_parallel": 1, "max_tokens": 0, "max_usd_micros": 0},
                                 Window)
        return StoredStream(rec, meta, StoredRoute(route.get("policy", ""), route.get("next_hops", [])), window,
                            route.get("decision"), self.store.events(rec.tenant, rec.session_id, rec.stream_id),
                            stored_task_digest(rec))
