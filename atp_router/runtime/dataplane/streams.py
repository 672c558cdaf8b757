"""The stream table (trio side): every stream the router carries, its outbound
event log, and its lifecycle (spec §4.4, §8).

:class:`EventLog` — every frame the router sends on a stream is appended once,
with an event type and an increasing id; the WebSocket writer and any number of
SSE followers read from it. A follower that connects late, or reconnects with
``Last-Event-ID``, replays what it missed (spec §8 resumption), so nothing
depends on who was listening when a frame was produced.

:class:`StreamCtx` — one stream: its session, tenant, route, budget account,
log, followers; it implements the dispatcher's ``StreamIO``.

:class:`StreamTable` — the streams and sessions of every tenant, keyed by
**(tenant, session_id, stream_id)** (spec §11 "streams are scoped to the
authenticated principal"). Ids are chosen by clients, so a session or stream id
another tenant uses is simply another session or stream: lookups never cross
tenants, and nothing tells a tenant whether an id exists elsewhere. Within a
tenant a stream id is unique (the HTTP API addresses a stream by its id alone).
The table owns:

==================  =============================================================
lifecycle           open count (router-wide ``max_streams``), closing, removal
idempotency         ``(tenant, idempotency_key)`` → the stream it opened (§8)
resumption          :meth:`StreamTable.resumable`
retention           a closed stream stays in memory for ``retain_closed_s``
                    (one that delivered no result — refused, reset or expired
                    before a PARTIAL or FINAL — for ``REFUSED_RETAIN_S`` at
                    most), at most ``retain_closed_max`` closed streams per
                    tenant and ``retain_closed_bytes`` of closed logs router-wide
                    (the oldest go first); then it leaves memory and a read of it
                    is served from the store (:meth:`StreamTable.restore`: the
                    same events, the same bytes)
grace               a stream left without a follower (*detached*) is reset with
                    ``ETIMEOUT`` after ``resume_grace_s``
idle expiry         a stream opened without a task (SYN without payload) that
                    gets none within ``idle_task_s`` is reset with ``ETIMEOUT``
refused SYNs        remembered (bounded) so their late frames are dropped;
                    nothing else of them stays (not even their session)
idle trim           with no stream open, once freed memory settled:
                    ``idle_trim()`` (:func:`atp_router.runtime.dataplane.memory.trim`: a full
                    collection and ``malloc_trim``), at most every 10 s
==================  =============================================================

Timed work follows aioquic's shape: :meth:`StreamTable.get_timer` is the next
deadline (trio seconds), :meth:`StreamTable.handle_timer` does what is due at
``now``; :meth:`StreamTable.run` drives both from the router's nursery.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from atp_router.runtime.dataplane.memory import TRIM_EVERY_S
from atp_router.security.identity import Identity
from atp_router.security.redact import redact_meta
from atp_router.store.base import (
    Store,
    StoredEvent,
    StoreError,
    StoreLimitError,
    StoreUnavailable,
    StreamRecord,
)
from atp_router.wire import session as S
from atp_router.wire.errors import ATPError, ErrorCode, LocalProtocolError
from atp_router.wire.frame import (
    Budget,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
    WindowUpdate,
)

if TYPE_CHECKING:
    from atp_router.consensus.types import FinalResult
    from atp_router.observability.metrics import RouterMetrics
    from atp_router.runtime.controlplane.control import Generation

__all__ = ["EventLog", "LoggedEvent", "StreamCtx", "StreamKey", "StreamTable", "event_type", "stream_account"]

log = logging.getLogger("atp_router.runtime")

#: A stream's identity in the table: (tenant, session_id, stream_id).
StreamKey = tuple[str, str, str]

#: Refused SYNs remembered for dropping their late frames (bounded memory).
_REFUSED_KEPT = 4096
#: A closed stream whose spend is still settling is tried again this much later, s.
_SETTLE_RETRY_S = 1.0
#: A closed stream that delivered no result (no PARTIAL or FINAL: refused at
#: dispatch, reset or expired first) stays in memory at most this long, s; later
#: reads and resumptions of it are served from the store.
REFUSED_RETAIN_S = 1.0
#: Default router-wide budget of retained closed logs, bytes (``retain_closed_bytes``).
DEFAULT_RETAIN_CLOSED_BYTES = 16 * 2**20
#: A group commit the store could not take (unreachable) is tried again this much later, s.
_FLUSH_RETRY_S = 0.25
#: The router trims its memory this long after it went idle, s (atp_router.runtime.dataplane.memory).
_IDLE_TRIM_AFTER_S = 2.0
#: Timers of removed streams are purged once more than this many streams left
#: the table (and their timers, up to ~3 each, may be half of them).
_TIMERS_PURGE_AT = 256


#: Key of the SYN+ACK route info kept with a stored stream's meta.
_ROUTE_KEY = "_atp_route"
_frame_enc = msgspec.json.Encoder()
_frame_dec = msgspec.json.Decoder(Frame)
# A compacted event log: [(event id, event type, frame), ...] as msgpack.
_log_enc = msgspec.msgpack.Encoder()
_log_dec = msgspec.msgpack.Decoder(list[tuple[int, str, Frame]])


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class _StoredHop:
    agent: str


@dataclass(frozen=True, slots=True)
class _StoredRoute:
    """The route a restored stream was opened on (what the API answers with)."""

    policy: str
    agents: list[str]

    @property
    def next_hops(self) -> list[_StoredHop]:
        return [_StoredHop(a) for a in self.agents]


def stream_account(tenant: str, stream_id: str) -> str:
    """The budget-ledger account of ``tenant``'s stream ``stream_id`` (its parent
    is the tenant's ``client:<tenant>``): ``stream:<tenant>:<stream_id>``. A
    stream id is unique within its tenant while its stream is in the table, and
    a tenant name holds no ``:``, so no two streams share an account."""
    return f"stream:{tenant}:{stream_id}"


def event_type(frame: Frame) -> str:
    """The SDK-visible event name of an outbound frame (see ``atp.Client.events``)."""
    flags = frame.flags
    if Flag.RST in flags:
        return "RST"
    if Flag.SYN in flags:
        return "SYN_ACK"
    p = frame.payload
    if p is not None:
        if p.type is PayloadType.FINAL:
            return "FINAL"
        if p.type is PayloadType.PARTIAL:
            return "PARTIAL"
        if p.type is PayloadType.CONTROL:
            c = p.content
            if isinstance(c, ErrorPayload) or (isinstance(c, dict) and c.get("kind") == "ERROR"):
                return "ERROR"
            if isinstance(c, WindowUpdate) or (isinstance(c, dict) and c.get("kind") == "WINDOW_UPDATE"):
                return "WINDOW_UPDATE"
            return "CONTROL"
        if p.type is PayloadType.LOG:
            return "LOG"
    if Flag.FIN in flags:
        return "FIN"
    if Flag.HB in flags:
        return "HB"
    if Flag.ACK in flags:
        return "ACK"
    return "DATA"


@dataclass(slots=True)
class LoggedEvent:
    id: int
    type: str
    frame: Frame
    #: The frame as JSON, encoded once (for the store) and reused by every SSE
    #: follower; None until then, and for events read back from a compacted log.
    json: bytes | None = None

    def json_bytes(self) -> bytes:
        """The frame as JSON bytes (encoded on first use, then kept)."""
        if self.json is None:
            self.json = _frame_enc.encode(self.frame)
        return self.json


@dataclass(slots=True)
class EventLog:
    """Append-only outbound log of one stream with wake-ups for followers.

    A closed log nobody follows is :meth:`compact`-ed into one zlib-compressed
    msgpack ``bytes`` (issue 10): a retained closed stream then costs the garbage collector one
    untracked object instead of a graph of frames, payloads and dicts, so gen-2
    pauses no longer grow with the number of retained streams. ``events`` reads
    it back (decoded on each access: closed logs are read rarely, for
    resumption and A2A ``tasks/get``)."""

    _events: list[LoggedEvent] = field(default_factory=list)
    closed: bool = False
    #: Set at the next change; made only when a follower waits (a trio.Event
    #: with its set of waiters is ~270 bytes: idle and retained logs hold none).
    _changed: trio.Event | None = None
    #: Called once at the next change: followers parked without a task (:meth:`park`).
    _wakers: list[Callable[[], None]] | None = None
    _packed: bytes | None = None
    #: How many events a compacted log holds (``_events`` is empty then).
    _packed_n: int = 0
    #: Events 1..durable are in the store (group commit, :meth:`StreamTable.flush`):
    #: followers send no further, so a client never holds an event a restarted
    #: router has lost.
    durable: int = 0

    @property
    def events(self) -> list[LoggedEvent]:
        """The events in order (a fresh list when the log is compacted)."""
        if self._packed is None:
            return self._events
        return [LoggedEvent(i, t, f) for i, t, f in _log_dec.decode(zlib.decompress(self._packed))]

    def __len__(self) -> int:
        return len(self._events) if self._packed is None else self._packed_n

    @property
    def nbytes(self) -> int:
        """Bytes the log's events hold as data: the packed log once compacted,
        else the JSON of its events (encoded once for the store, kept with each)."""
        if self._packed is not None:
            return len(self._packed)
        return sum(len(e.json_bytes()) for e in self._events)

    @property
    def delivered_result(self) -> bool:
        """Whether a PARTIAL or FINAL went out on the stream (its task produced something)."""
        return any(t == "PARTIAL" or t == "FINAL" for t in (e.type for e in self.events))

    def compact(self) -> None:
        """Pack a closed log into bytes (see the class docstring); no-op while open."""
        if self.closed and self._packed is None:
            # zlib level 1: ≈ 2.5× smaller (ids and keys repeat in every frame) for
            # ≈ 25 µs at close and 8 µs a read (bench_retention.py, issue 10).
            self._packed = zlib.compress(_log_enc.encode([(e.id, e.type, e.frame) for e in self._events]), 1)
            self._packed_n = len(self._events)
            self._events = []

    def append(self, frame: Frame, *, durable: bool = True) -> LoggedEvent:
        """Append ``frame``; ``durable=False``: followers wait for it until
        :meth:`mark_durable` (its store write is pending)."""
        if self._packed is not None:
            raise RuntimeError("append to a compacted (closed) event log")
        ev = LoggedEvent(len(self._events) + 1, event_type(frame), frame)
        self._events.append(ev)
        if ev.type in ("FIN", "RST"):
            self.closed = True
        if durable:
            self.mark_durable(ev.id)
        return ev

    async def wait_durable(self, upto: int) -> None:
        """Return once events up to id ``upto`` are stored."""
        while self.durable < upto:
            await self._change().wait()

    def mark_durable(self, upto: int) -> None:
        """Events up to id ``upto`` are stored: wake the followers."""
        if upto > self.durable:
            self.durable = upto
            self._notify()

    def _change(self) -> trio.Event:
        if self._changed is None:
            self._changed = trio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self._wakers:
            wakers, self._wakers = self._wakers, None
            for wake in wakers:
                wake()

    def take(self, after: int) -> tuple[list[LoggedEvent], bool]:
        """The events a follower that sent up to id ``after`` may send now (the
        stored ones), and whether it is then done (the log ended and all sent)."""
        events = self.events
        upto = min(self.durable, len(events))
        return events[after:upto], self.closed and upto >= len(events)

    async def wait_change(self) -> None:
        """Return at the log's next change (an event stored, or the log ended)."""
        await self._change().wait()

    def park(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once, at the log's next change (a follower that sent
        everything waits this way without a task of its own)."""
        if self._wakers is None:
            self._wakers = []
        self._wakers.append(wake)

    def unpark(self, wake: Callable[[], None]) -> None:
        """Forget a :meth:`park`-ed ``wake`` (its follower stopped)."""
        if self._wakers and wake in self._wakers:
            self._wakers.remove(wake)

    def after_message(self, msg_seq: int) -> int:
        """The event id to replay after for a client that received the router's
        messages up to ``msg_seq`` (spec §8 resumption): the event carrying the
        last fragment of the newest DATA message with ``msg_seq`` ≤ that (SYN+ACK
        at msg_seq 0 counts as message 0). ACK and NACK frames after it are
        replayed (their msg_seq counts the client's messages, not ours)."""
        for ev in reversed(self.events):
            f = ev.frame
            if Flag.ACK in f.flags and Flag.SYN not in f.flags:
                continue
            if Flag.MORE in f.flags or Flag.RST in f.flags or Flag.FIN in f.flags or Flag.HB in f.flags:
                continue
            if f.msg_seq <= msg_seq:
                return ev.id
        return 0

    def close(self) -> None:
        """End the log without a closing frame of ours: the peer reset the stream
        (an RST is never answered, spec §4.4). Followers drain and stop."""
        if not self.closed:
            self.closed = True
            self._notify()

    async def follow(self, after: int = 0) -> AsyncIterator[LoggedEvent]:
        """Yield events with id > ``after`` as they come; ends after FIN/RST."""
        i = max(after, 0)
        while True:
            events = self.events  # decoded once per wake-up when compacted
            # ``durable`` read afresh after each yield: it may move while the
            # consumer sends (a stale copy would sleep through that wake-up).
            while i < self.durable and i < len(events):
                ev = events[i]
                i += 1
                yield ev
            if self.closed and i >= len(events):
                return
            await self._change().wait()


@dataclass(eq=False)
class StreamCtx:
    """One stream inside the router; implements the dispatcher's ``StreamIO``.

    Every outbound frame goes through the stream's sans-IO session, then its
    :class:`EventLog`; a FIN or RST closes it (the table is told, see
    :meth:`StreamTable.closed`)."""

    table: StreamTable
    session: S.Session
    stream_id: str
    identity: Identity
    meta: dict[str, Any]
    qos: QoS
    window: Window
    budget: Budget
    route: Any  # atp_router.policy.fib.Route
    started: float  # trio.current_time() at SYN, s
    log: EventLog = field(default_factory=EventLog)
    task_started: bool = False
    closed_at: float | None = None
    cancel_scope: trio.CancelScope | None = None
    #: The RIB generation the stream was routed by at SYN; its task runs on it even
    #: after a reload (spec §22 hot reload).
    gen: Generation | None = None
    #: ``ttl`` the stream's task carries to next-hops: the SYN's, less this hop
    #: (:func:`~atp_router.wire.session.forward_ttl`, §4.2).
    ttl: int = 7
    #: Ledger account of the stream (its parent is the tenant's): :func:`stream_account`.
    account: str = ""
    #: The SYN's ``meta.idempotency_key`` (resumption, §8), if any.
    idempotency_key: str | None = None
    #: Connections / SSE requests sending this stream's events right now.
    followers: int = 0
    #: When the last follower went away (None while followed, or never followed).
    detached_at: float | None = None
    #: The stream counts among the users of ``gen`` (its adapters stay open).
    holds_gen: bool = False
    #: Read back from the store after a restart (closed; its log is the stored one).
    restored: bool = False
    #: The bandit's choice for this stream (atp_router.policy.learn.Decision; its JSON
    #: dict when read back from the store), None for a policy without bandit.
    decision: Any = None
    #: When a closed stream leaves memory at the latest (trio time, s; its reads
    #: are then served from the store).
    retain_until: float = math.inf
    #: An event of the stream could not be stored: its whole log is only in
    #: memory, kept there for the full ``retain_closed_s`` whatever the bounds.
    unstored: bool = False

    @property
    def tenant(self) -> str:
        """The tenant (RIB client) the stream belongs to."""
        return self.identity.tenant

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def key(self) -> StreamKey:
        return (self.identity.tenant, self.session.session_id, self.stream_id)

    # --- followers (spec §8 resumption) ---
    def attach(self) -> None:
        """A connection or SSE request starts sending this stream's events."""
        self.followers += 1
        self.detached_at = None

    def detach(self) -> None:
        """A follower went away; the last one leaves the stream detached (it stays
        resumable for ``resume_grace_s``, then is reset)."""
        self.followers -= 1
        if self.followers == 0 and not self.log.closed:
            self.detached_at = trio.current_time()
            self.table.detached(self)
        elif self.followers == 0 and self.closed_at is not None:
            self.log.compact()
            self.table.bound_retention(self)  # smaller now, and free to leave memory

    # --- outbound (every frame goes through the session machine, then the log) ---
    def push(self, frames: Frame | list[Frame]) -> None:
        table = self.table
        for f in frames if isinstance(frames, list) else [frames]:
            ev = self.log.append(f, durable=not table.group_commit or self.restored)
            table.metrics.frames.labels("out", ev.type).inc()
            table.persist_event(self, ev)
            if ev.type in ("FIN", "RST"):
                self._mark_closed()

    def _mark_closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
            self.table.closed(self)

    def peer_reset(self) -> None:
        """The client reset the stream: stop its task (spend is still committed) and
        end the log. Nothing is sent back: an RST is never answered (spec §4.4)."""
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()
        if not self.log.closed:
            self.log.close()
            self._mark_closed()

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None:
        if self.log.closed:
            return
        self.push(self.session.send_message(
            self.stream_id, Payload(type=PayloadType.PARTIAL, content=content, confidence=confidence)
        ))

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None:
        if self.log.closed:
            return
        self.table.metrics.errors.labels(str(code)).inc()
        self.push(self.session.send_error(self.stream_id, code, reason, retry_after_ms=retry_after_ms))

    def emit_window_update(self, update: WindowUpdate) -> None:
        if not self.log.closed:
            self.push(self.session.send_control(self.stream_id, update))

    def finish(self, final: FinalResult | None) -> None:
        if self.log.closed:
            return
        if final is not None:
            self.push(self.session.send_message(
                self.stream_id,
                Payload(type=PayloadType.FINAL, content=msgspec.to_builtins(final)),
            ))
        self.push(self.session.finish(self.stream_id))

    def reset(self, code: ErrorCode, reason: str) -> None:
        if self.log.closed:
            return
        self.table.metrics.errors.labels(str(code)).inc()
        self.push(self.session.reset(self.stream_id, code, reason))

    def stop(self, code: ErrorCode, reason: str) -> None:
        """Reset the stream (RST ``code``) and stop its task; what its calls used
        so far is committed by the dispatcher."""
        self.reset(code, reason)
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()


class StreamTable:
    """The streams and sessions of every tenant (module docstring).

    ``release(ctx)`` frees a closed stream's resources before it leaves the table
    (the router closes its ledger account) and returns False while that is not
    yet possible (a cancelled call has not committed its spend: tried again
    later). ``on_closed(ctx)`` is called once when a stream closes (FIN/RST sent
    or received). Durations are in seconds of trio time; ``retain_closed_bytes``
    bounds the bytes of the closed logs kept in memory (:attr:`EventLog.nbytes`),
    router-wide, the oldest closed going first.
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        max_streams: int,
        retain_closed_s: float,
        retain_closed_max: int,
        resume_grace_s: float,
        idle_task_s: float,
        hb_interval_s: float,
        release: Callable[[StreamCtx], bool],
        on_closed: Callable[[StreamCtx], None],
        store: Store | None = None,
        retain_closed_bytes: int = DEFAULT_RETAIN_CLOSED_BYTES,
        idle_trim: Callable[[], float] | None = None,
    ):
        self.metrics = metrics
        #: Durable copy of every stream, its events and its close (spec §8 across a
        #: restart): :mod:`atp_router.store`.
        self.store = store
        #: The router process the streams it opens are stored as running on
        #: (``atp-router --workers N``: a worker's owner name; None alone).
        self.owner: str | None = None
        self.max_streams = max_streams
        self.retain_closed_s = retain_closed_s
        self.retain_closed_max = retain_closed_max
        self.retain_closed_bytes = retain_closed_bytes
        #: Called when the router went idle (no open stream, streams left memory
        #: since the last call), at most every ``TRIM_EVERY_S``: atp_router.runtime.dataplane.memory.trim.
        self._idle_trim = idle_trim
        self._trim_due = False
        self._trim_at = self._trimmed_at = -math.inf
        self.resume_grace_s = resume_grace_s
        self.idle_task_s = idle_task_s
        self.hb_interval_s = hb_interval_s
        self._release = release
        self._on_closed = on_closed
        #: Streams not yet closed (the table also keeps closed ones for replay).
        self.open_count = 0
        #: Open streams per tenant (its ``max_streams`` quota, spec §11 AuthZ).
        self.tenant_open: Counter[str] = Counter()
        self._streams: dict[StreamKey, StreamCtx] = {}
        #: (tenant, stream_id) → stream: a stream id is unique within its tenant.
        self._by_id: dict[tuple[str, str], StreamCtx] = {}
        self._by_account: dict[str, StreamCtx] = {}
        self._sessions: dict[tuple[str, str], S.Session] = {}
        self._session_streams: Counter[tuple[str, str]] = Counter()
        self._idempotency: dict[tuple[str, str], StreamCtx] = {}
        self._refused: OrderedDict[StreamKey, None] = OrderedDict()
        #: tenant → its closed streams still in the table, oldest first.
        self._closed: dict[str, OrderedDict[StreamCtx, None]] = {}
        #: Every closed stream in the table, oldest first → its log's bytes as
        #: counted in :attr:`retained_bytes` (the router-wide byte budget).
        self._retained: dict[StreamCtx, int] = {}
        #: Bytes of the closed logs in the table (``retain_closed_bytes`` bounds it).
        self.retained_bytes = 0
        #: (deadline, seq, kind, stream key): timed work, checked again when due (lazy
        #: removal). Keys, not streams: a removed stream's log is not kept alive here.
        self._timers: list[tuple[float, int, str, StreamKey | None]] = []
        #: Streams removed since the timers were last purged (:meth:`_purge_timers`).
        self._gone = 0
        self._seq = itertools.count()
        self._sleeping_until = math.inf
        self._changed = trio.Event()
        self._sweeping = False
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
        #: When set, a flush writes only while it returns True (atp_router.deploy.cluster: not
        #: until the router checked, after an outage, which of its streams it still owns).
        self.flush_gate: Callable[[], bool] | None = None
        #: False: when the store cannot take a flush (StoreUnavailable) the events are sent
        #: anyway and their writes stay queued until it can (atp_router.deploy.single: no other
        #: router reads this store, and a full disk must not stall the running streams).
        self.hold_unstored = True

    # ------------------------------------------------------------------ lookups
    def get(self, tenant: str, session_id: str, stream_id: str) -> StreamCtx | None:
        """The stream ``stream_id`` of ``tenant``'s session ``session_id``, or None."""
        return self._streams.get((tenant, session_id, stream_id))

    def find(self, tenant: str, stream_id: str) -> StreamCtx | None:
        """``tenant``'s stream ``stream_id`` (in whichever of its sessions), or
        None — also when another tenant has a stream of that id."""
        return self._by_id.get((tenant, stream_id))

    def by_account(self, account: str) -> StreamCtx | None:
        """The stream whose ledger account (and QoS ticket name) is ``account``."""
        return self._by_account.get(account)

    def resumable(self, tenant: str, idempotency_key: str) -> StreamCtx | None:
        """The stream ``tenant`` opened with ``idempotency_key`` (open, or closed
        and retained), or None (spec §8 resumption)."""
        return self._idempotency.get((tenant, idempotency_key))

    def values(self) -> Iterator[StreamCtx]:
        """Every stream in the table, of every tenant (open and retained closed)."""
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def session_count(self) -> int:
        """Sessions in the table, of every tenant (one with no stream left goes at the next sweep)."""
        return len(self._sessions)

    # ------------------------------------------------------------------ sessions
    def session(self, tenant: str, session_id: str, *, now: float) -> S.Session:
        """``tenant``'s session ``session_id``, created on first use. Router
        sessions outlive connections (streams are resumable, §8), so the session
        machine never declares its peer dead (``hb_timeout`` infinite): liveness
        is per connection, in the WebSocket ingress."""
        key = (tenant, session_id)
        sess = self._sessions.get(key)
        if sess is None:
            sess = self._sessions[key] = S.Session(
                S.Role.ROUTER, session_id, now=now, hb_interval=self.hb_interval_s, hb_timeout=math.inf,
            )
            if not self._sweeping:
                self._sweeping = True
                self._schedule(now + self._sweep_s, "sweep", None)
        return sess

    def get_session(self, tenant: str, session_id: str) -> S.Session | None:
        """``tenant``'s session ``session_id`` if it exists."""
        return self._sessions.get((tenant, session_id))

    @property
    def _sweep_s(self) -> float:
        return max(min(self.retain_closed_s, 30.0), 1.0)

    # ------------------------------------------------------------------ lifecycle
    def admit(self, tenant: str, stream_id: str) -> None:
        """Check that ``tenant`` may open a stream ``stream_id`` now (at SYN,
        before anything is reserved for it). A closed stream of the tenant with
        that id is removed (its retained log is dropped). Raises
        :class:`ATPError` ``EWINDOW`` when the router holds ``max_streams`` open
        streams; :class:`LocalProtocolError` ``EPROTO`` when the tenant has an
        open stream of that id, or a closed one still settling its spend."""
        if self.open_count >= self.max_streams:
            raise ATPError(ErrorCode.EWINDOW, f"router is at its limit of {self.max_streams} open streams")
        old = self._by_id.get((tenant, stream_id))
        if old is None:
            return
        if old.closed_at is None:
            raise LocalProtocolError(ErrorCode.EPROTO, f"stream_id {stream_id!r} is already in use")
        if not self._remove(old):
            raise LocalProtocolError(ErrorCode.EPROTO, f"stream_id {stream_id!r} is still settling its spend; retry")

    def insert(self, ctx: StreamCtx) -> None:
        """Add a stream just accepted (after :meth:`admit`): it counts as open,
        its idempotency key (if any) now resumes it, and it is reset if it gets
        no task within ``idle_task_s``."""
        key = ctx.key
        self._streams[key] = ctx
        self._by_id[(key[0], key[2])] = ctx
        self._by_account[ctx.account] = ctx
        self._session_streams[key[:2]] += 1
        if ctx.idempotency_key is not None:
            self._idempotency[(key[0], ctx.idempotency_key)] = ctx
        self.open_count += 1
        self.tenant_open[key[0]] += 1
        self._persist_open(ctx)
        self.metrics.open_streams.inc()
        self._schedule(ctx.started + self.idle_task_s, "idle", key)

    def refused(self, tenant: str, session_id: str, stream_id: str) -> None:
        """A SYN was refused: its stream's late frames are dropped (bounded
        memory). Nothing else of it stays: a session the SYN created that holds
        no stream (an HTTP open makes one each) is dropped now, not at the next
        sweep; the same id makes a new one, as after a sweep."""
        self._refused[(tenant, session_id, stream_id)] = None
        if len(self._refused) > _REFUSED_KEPT:
            self._refused.popitem(last=False)
        skey = (tenant, session_id)
        sess = self._sessions.get(skey)
        if sess is not None and skey not in self._session_streams and not sess.open_streams:
            del self._sessions[skey]

    def was_refused(self, tenant: str, session_id: str, stream_id: str) -> bool:
        return (tenant, session_id, stream_id) in self._refused

    def closed(self, ctx: StreamCtx) -> None:
        """``ctx`` closed (FIN/RST): it stops counting as open and stays in
        memory for ``retain_closed_s`` (:data:`REFUSED_RETAIN_S` at most if it
        delivered no result) — unless its tenant holds ``retain_closed_max``
        closed streams or the router ``retain_closed_bytes`` of closed logs:
        then the oldest leave first. A stream leaves memory only once nobody
        reads it and its events and close are in the store (a read is then
        served from there); until then it stays, over the bounds if need be."""
        self._persist_close(ctx)
        self.open_count -= 1
        if not self.open_count:
            self._want_trim(ctx.closed_at)
        self.tenant_open[ctx.tenant] -= 1
        if not self.tenant_open[ctx.tenant]:
            del self.tenant_open[ctx.tenant]
        self.metrics.open_streams.dec()
        assert ctx.closed_at is not None
        self._keep(ctx, ctx.closed_at)
        self._on_closed(ctx)
        if ctx.followers == 0:
            ctx.log.compact()  # else when its last follower leaves (StreamCtx.detach)
        self.bound_retention(ctx)

    def _keep(self, ctx: StreamCtx, now: float) -> None:
        """Start retaining closed ``ctx`` (closed at, or read back at, ``now``)."""
        retained = self._closed.setdefault(ctx.tenant, OrderedDict())
        retained[ctx] = None
        age = self.retain_closed_s if ctx.log.delivered_result else min(self.retain_closed_s, REFUSED_RETAIN_S)
        ctx.retain_until = now + age
        self._schedule(ctx.retain_until, "retain", ctx.key)

    def bound_retention(self, ctx: StreamCtx) -> None:
        """Count closed ``ctx``'s log in the byte budget (again when it was
        compacted, or its last reader left), then let the oldest closed streams
        go while its tenant is over ``retain_closed_max`` or the router over
        ``retain_closed_bytes``."""
        if self._streams.get(ctx.key) is not ctx:
            return  # already gone (a follower compacted it after it left)
        # A log still being sent counts once its last reader left and it is
        # compacted (a fraction of its frames' size): the bound is on what is kept.
        size = ctx.log.nbytes if ctx.followers == 0 else 0
        self.retained_bytes += size - self._retained.get(ctx, 0)
        self._retained[ctx] = size
        tenant = self._closed.get(ctx.tenant)
        if tenant is not None and len(tenant) > self.retain_closed_max:
            self._evict(tenant, len(tenant) - self.retain_closed_max, math.inf)
        if self.retained_bytes > self.retain_closed_bytes:
            self._evict(self._retained, math.inf, self.retained_bytes - self.retain_closed_bytes)
        self.metrics.retained_bytes.set(self.retained_bytes)
        self.metrics.retained_streams.set(len(self._retained))

    def _evict(self, oldest_first: Any, count: float, nbytes: float) -> None:
        """Remove closed streams, oldest first, until ``count`` streams or
        ``nbytes`` bytes of logs left memory; skips those that may not leave yet
        (:meth:`_may_leave`)."""
        pending = self._unstored()
        gone: list[StreamCtx] = []
        for old in oldest_first:
            if count <= 0 or nbytes <= 0:
                break
            if old.closed_at is not None and self._may_leave(old, pending):
                gone.append(old)
                count -= 1
                nbytes -= self._retained.get(old, 0)
        for old in gone:
            self._remove(old)  # one still settling stays; its retention timer tries again

    def _want_trim(self, now: float | None) -> None:
        """Memory was freed with no stream open: trim once that settled
        (``_IDLE_TRIM_AFTER_S`` after the last such moment), at most every
        ``TRIM_EVERY_S``."""
        if self._idle_trim is None:
            return
        self._trim_at = (now if now is not None else trio.current_time()) + _IDLE_TRIM_AFTER_S
        if not self._trim_due:
            self._trim_due = True
            self._schedule(max(self._trim_at, self._trimmed_at + TRIM_EVERY_S), "trim", None)

    def _may_leave(self, ctx: StreamCtx, unstored: set[int], *, aged: bool = False) -> bool:
        """Whether closed ``ctx`` may leave memory: nobody is reading it, and
        what a read of it answers is in the store (every event and its close;
        ``unstored``: the ids of streams with writes still queued) — or, for a
        stream the store refused an event of, once it is ``aged`` (closed for
        ``retain_closed_s``)."""
        return (ctx.followers == 0 and (aged or not ctx.unstored) and ctx.log.durable >= len(ctx.log)
                and id(ctx) not in unstored)

    def _unstored(self) -> set[int]:
        """Ids of the streams whose events or close are queued for the store (group commit)."""
        return {id(c) for c, _ in self._pending} if self._pending else set()

    def abandon(self, ctx: StreamCtx, stored: list[StoredEvent]) -> None:
        """Stream ``ctx`` was settled by another router process while this one
        could not reach the shared store (atp_router.deploy.cluster): ``stored`` — its
        log in the store, ending with the RST the other router wrote — is its
        log from now on. Its task is cancelled and its queued writes dropped;
        followers send what they have not sent of ``stored`` and stop; it
        writes nothing more."""
        self._pending = [(c, e) for c, e in self._pending if c is not ctx]
        ctx.restored = True  # nothing more of it goes to the store
        if ctx.cancel_scope is not None:
            ctx.cancel_scope.cancel()
        log_ = ctx.log
        log_._events = [LoggedEvent(ev.event_id, ev.type, _frame_dec.decode(ev.frame), ev.frame) for ev in stored]
        log_._packed, log_._packed_n = None, 0
        log_.durable = len(log_._events)
        log_.closed = True
        log_._notify()
        ctx._mark_closed()

    def detached(self, ctx: StreamCtx) -> None:
        """``ctx`` lost its last follower: reset it unless one comes back within
        ``resume_grace_s``."""
        assert ctx.detached_at is not None
        self._schedule(ctx.detached_at + self.resume_grace_s, "grace", ctx.key)

    def _remove(self, ctx: StreamCtx) -> bool:
        """Drop closed ``ctx`` from the table once ``release`` frees it."""
        key = ctx.key
        if self._streams.get(key) is not ctx:
            return True
        if not self._release(ctx):
            return False
        del self._streams[key]
        del self._by_id[(key[0], key[2])]
        self._by_account.pop(ctx.account, None)
        if ctx.idempotency_key is not None and self._idempotency.get((key[0], ctx.idempotency_key)) is ctx:
            del self._idempotency[(key[0], ctx.idempotency_key)]
        retained = self._closed.get(key[0])
        if retained is not None:
            retained.pop(ctx, None)
            if not retained:
                del self._closed[key[0]]
        if not self.open_count:
            self._want_trim(trio.current_time())
        size = self._retained.pop(ctx, None)
        if size is not None:
            self.retained_bytes -= size
            self.metrics.retained_bytes.set(self.retained_bytes)
            self.metrics.retained_streams.set(len(self._retained))
        left = self._session_streams[key[:2]] = self._session_streams[key[:2]] - 1
        if left <= 0:
            del self._session_streams[key[:2]]
        self._gone += 1
        if self._gone > _TIMERS_PURGE_AT and self._gone * 4 > len(self._timers):  # amortised O(1) a removal
            self._purge_timers()
        return True

    def _purge_timers(self) -> None:
        """Drop the timers of streams no longer in the table. Due, they would
        be skipped; until then each holds a tuple and its stream's key (an idle
        timer for ``idle_task_s``), small objects scattered over the heap that keep
        the allocator from giving the freed pages back."""
        self._timers = [t for t in self._timers if t[3] is None or t[3] in self._streams]
        heapq.heapify(self._timers)
        self._gone = 0

    # ------------------------------------------------------------------ durable state
    def _persist_open(self, ctx: StreamCtx) -> None:
        if self.store is None:
            return
        route = {"policy": ctx.route.policy, "next_hops": [h.agent for h in ctx.route.next_hops],
                 "rib_version": ctx.gen.version if ctx.gen is not None else 0,
                 "window": msgspec.to_builtins(ctx.window)}
        if ctx.decision is not None and hasattr(ctx.decision, "to_json"):
            route["decision"] = ctx.decision.to_json()
        record = StreamRecord(
            tenant=ctx.tenant, session_id=ctx.session_id, stream_id=ctx.stream_id,
            # Stored meta has its secrets masked (spec §11, §19): the store is not cleared for them.
            idempotency_key=ctx.idempotency_key, meta={**redact_meta(ctx.meta), _ROUTE_KEY: route}, qos=ctx.qos,
            budget=ctx.budget, created_ms=_now_ms(), owner=self.owner)
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
        self._store_event(ctx, ev)

    def _store_event(self, ctx: StreamCtx, ev: LoggedEvent) -> None:
        assert self.store is not None
        try:
            self.store.append_event(ctx.tenant, ctx.session_id, ctx.stream_id, ev.id, ev.type, ev.json_bytes())
        except StoreUnavailable:
            if self._flushing:
                raise  # the whole batch waits for the store (flush)
            ctx.unstored = True
            log.exception("stream %s/%s: event %d not stored", ctx.tenant, ctx.stream_id, ev.id)
        except StoreLimitError as e:
            # The client still gets every frame live; after a restart the stream
            # reads as interrupted at the last stored event.
            ctx.unstored = True  # its whole log is only in memory: kept for its full age
            log.warning("stream %s/%s: event %d not stored: %s", ctx.tenant, ctx.stream_id, ev.id, e)
        except StoreError:
            ctx.unstored = True
            log.exception("stream %s/%s: event %d not stored", ctx.tenant, ctx.stream_id, ev.id)

    def _persist_close(self, ctx: StreamCtx) -> None:
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

    def _queue(self, ctx: StreamCtx, ev: LoggedEvent | None) -> None:
        if not self._pending:
            self._flush_wanted.set()
        self._pending.append((ctx, ev))

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
        if not self._pending:
            return True
        if self.flush_gate is not None and not self.flush_gate():
            return False  # the store is not confirmed back yet (atp_router.deploy.cluster): the writes wait
        pending, self._pending = self._pending, []
        assert self.store is not None
        for _, ev in pending:
            if isinstance(ev, LoggedEvent):
                ev.json_bytes()  # encoded before the store's write lock is taken
        self._flushing = True
        try:
            with self.store.batch():
                for ctx, ev in pending:
                    if ev is None:
                        self._store_close(ctx)
                    elif isinstance(ev, StreamRecord):
                        self.store.put_stream(ev)
                    else:
                        self._store_event(ctx, ev)
        except StoreUnavailable as e:
            self._pending[:0] = pending  # in order, before what came meanwhile
            if self.on_store_unavailable is not None:
                self.on_store_unavailable("events", e)
            if not self.hold_unstored:
                self._mark_sent(pending)
            return False
        except StoreError:
            log.exception("state store: a batch of %d writes failed", len(pending))
        finally:
            self._flushing = False
        self._mark_sent(pending)
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
                if not self.flush():
                    await trio.sleep(_FLUSH_RETRY_S)  # the store is unreachable: its writes wait
                    self._flush_wanted.set()
        finally:
            self.group_commit = False
            self.flush()

    def restore(self, identity: Identity, *, stream_id: str | None = None,
                idempotency_key: str | None = None, now: float) -> StreamCtx | None:
        """A stream of ``identity``'s tenant that is not in memory but in the store
        (finished before a restart, or interrupted by it): read back as a closed
        stream whose log is the stored events, so a client reads and resumes it
        exactly as before (spec §8). Looked up by ``stream_id`` or by
        ``idempotency_key``; None when the tenant has no such stream (another
        tenant's never matches)."""
        if self.store is None:
            return None
        tenant = identity.tenant
        if idempotency_key is not None:
            rec = self.store.find_idempotent(tenant, idempotency_key)
        elif stream_id is not None:
            rec = self.store.find_stream(tenant, stream_id)
        else:
            return None
        if rec is None or rec.state == "open" or (tenant, rec.stream_id) in self._by_id:
            return None
        meta = dict(rec.meta)
        route = meta.pop(_ROUTE_KEY, {})
        window = msgspec.convert(route.get("window") or {"max_parallel": 1, "max_tokens": 0, "max_usd_micros": 0},
                                 Window)
        sess = self.session(tenant, rec.session_id, now=now)
        ctx = StreamCtx(self, sess, rec.stream_id, identity, meta, rec.qos or QoS.SILVER, window,
                        rec.budget or Budget(), _StoredRoute(route.get("policy", ""), route.get("next_hops", [])),
                        now, task_started=True, closed_at=now, account=stream_account(tenant, rec.stream_id),
                        idempotency_key=rec.idempotency_key, restored=True, decision=route.get("decision"))
        for ev in self.store.events(tenant, rec.session_id, rec.stream_id):
            # The stored JSON is what followers sent before: kept, the answer is byte for byte the same.
            ctx.log._events.append(LoggedEvent(ev.event_id, ev.type, _frame_dec.decode(ev.frame), ev.frame))
        ctx.log.closed = True
        ctx.log.durable = len(ctx.log._events)  # read from the store
        key = ctx.key
        self._streams[key] = ctx
        self._by_id[(tenant, ctx.stream_id)] = ctx
        self._session_streams[key[:2]] += 1
        if ctx.idempotency_key is not None:
            self._idempotency[(tenant, ctx.idempotency_key)] = ctx
        self._keep(ctx, now)
        self.bound_retention(ctx)
        return ctx

    # ------------------------------------------------------------------ timers
    def _schedule(self, deadline: float, kind: str, key: StreamKey | None) -> None:
        heapq.heappush(self._timers, (deadline, next(self._seq), kind, key))
        if deadline < self._sleeping_until:
            self._changed.set()

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work (trio time, s), or None."""
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> None:
        """Do what is due at ``now``: reset streams without a task after
        ``idle_task_s`` and detached streams after ``resume_grace_s`` (RST
        ``ETIMEOUT``, their task stops, spend so far is committed); remove closed
        streams past ``retain_closed_s``; drop sessions left without streams."""
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(self._timers)
            if kind == "sweep":
                for skey in [k for k in self._sessions if k not in self._session_streams]:
                    del self._sessions[skey]
                self._sweeping = bool(self._sessions)
                if self._sweeping:
                    self._schedule(now + self._sweep_s, "sweep", None)
                continue
            if kind == "trim":
                if now < self._trim_at:  # memory was freed since: let it settle
                    self._schedule(self._trim_at, "trim", None)
                    continue
                self._trim_due = False
                if not self.open_count and self._idle_trim is not None:
                    self._trimmed_at = now
                    ms = self._idle_trim()
                    log.debug("router idle: memory trimmed in %.1f ms", ms)
                continue
            assert key is not None
            ctx = self._streams.get(key)
            if ctx is None:
                continue
            if kind == "retain":
                # The key may name a newer stream since: only one closed long enough goes.
                if ctx.closed_at is not None and ctx.retain_until <= now and not (
                        self._may_leave(ctx, self._unstored(), aged=now >= ctx.closed_at + self.retain_closed_s)
                        and self._remove(ctx)):
                    self._schedule(now + _SETTLE_RETRY_S, "retain", key)
            elif ctx.log.closed:
                continue
            elif kind == "idle" and not ctx.task_started and ctx.started + self.idle_task_s <= now:
                log.info("stream %s of %s: no task within %g s, reset", ctx.stream_id, ctx.tenant, self.idle_task_s)
                ctx.stop(ErrorCode.ETIMEOUT, f"no task within {self.idle_task_s:g} s")
            elif (kind == "grace" and ctx.detached_at is not None
                  and ctx.detached_at + self.resume_grace_s <= now):
                log.info("stream %s of %s: client gone for %g s, reset", ctx.stream_id, ctx.tenant,
                         now - ctx.detached_at)
                ctx.stop(ErrorCode.ETIMEOUT, f"client gone: stream not resumed within {self.resume_grace_s:g} s")

    async def run(self) -> None:
        """Drive :meth:`handle_timer` at :meth:`get_timer` until cancelled."""
        while True:
            due = self.get_timer()
            self._sleeping_until = math.inf if due is None else due
            with trio.move_on_at(self._sleeping_until):
                await self._changed.wait()
            self._changed = trio.Event()
            # Not sleeping: what is scheduled while handling is seen by the next get_timer.
            self._sleeping_until = -math.inf
            self.handle_timer(trio.current_time())
