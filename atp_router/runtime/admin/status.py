"""Live status of one router (issue 11 item 4; spec §5, §6.2, §9, §12): the
snapshot behind ``GET /v1/status``, ``GET /v1/status/events`` and the page at
``GET /status``.

Two layers, the project's usual split:

* :class:`StatusBuilder` — sans-IO (no I/O, no clock: ``now`` in trio seconds
  and ``wall_ms`` in Unix ms are arguments). It reads the router's own objects —
  the stream table and budget ledger, the flow gates (per-next-hop AIMD windows,
  circuit breakers, QoS slots), the control plane (RIB generation, next-hop
  health), the learning FIB (bandit arms, live figures) and the Prometheus
  registry — and returns a :class:`StatusSnapshot`. Between snapshots it keeps
  bounded history: one sample a second (open streams, tasks/s, cost/min,
  P50/P95 latency), the recent finished tasks (latency, cost, agreement) and
  the recent ERROR / RST frames.
* :class:`StatusFeed` — trio. Builds at most one snapshot per
  ``min_interval_s`` however many pages watch (they share it), scans the
  stream table in chunks with a checkpoint between them so thousands of
  streams never hold the event loop for long, and pushes a snapshot as
  Server-Sent Events every ``interval_s`` and as soon as something visible
  changed (open streams, RIB generation, a circuit opening).

Bounds (:class:`StatusLimits`): at most ``max_streams`` stream rows (the
longest-running first; ``streams.more`` counts the rest), ``max_errors``
errors, ``max_tasks`` finished tasks, ``max_samples`` samples, ``max_routes``
FIB rows; at most ``max_closed_per_scan`` newly closed streams are read per
scan (a compacted log is decoded for that: the newest are read, older ones are
counted in ``tasks.skipped``); and the encoded snapshot is at most
``max_bytes`` — history and rows are halved until it fits
(``truncated: true``).

History only grows while someone watches (the feed builds on demand): the
first snapshot back-fills from the closed streams the table still retains
(``retain_closed_s``), and the Prometheus totals are always complete.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from atp_router.flow.breaker import BreakerState
from atp_router.runtime.admin.fibview import FibBandit

if TYPE_CHECKING:
    from atp_router.runtime.dataplane.stream import StreamCtx
    from atp_router.runtime.router import Router

__all__ = [
    "PAGE_ASSETS",
    "StatusBuilder",
    "StatusFeed",
    "StatusLimits",
    "StatusSnapshot",
    "StreamScan",
    "histogram_quantile",
    "status_routes",
]

#: Key separator of the live view's per-policy entries (``policy|agent``; atp_router.policy.learn.KEY_SEP).
_SEP = "|"
#: Rolling window of the latency quantiles in the samples, s.
QUANTILE_WINDOW_S = 10.0
_REASON_MAX = 240


# ---------------------------------------------------------------------------- schema
class StatusLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Bounds of one snapshot and of the history kept between snapshots
    (module docstring). ``sample_every_s``: one history sample at most this
    often (s)."""

    max_streams: int = 50
    max_errors: int = 50
    max_tasks: int = 300
    max_samples: int = 300
    max_routes: int = 64
    max_closed_per_scan: int = 128
    max_bytes: int = 256 * 1024
    sample_every_s: float = 1.0


class RibStatus(msgspec.Struct):
    """The running RIB generation: ``version``, where it came from, how many
    policies and agents it has."""

    version: int
    source: str
    policies: int
    agents: int


class Totals(msgspec.Struct):
    """Router-wide counts since start (from the Prometheus registry; §12):
    ``completed`` are streams closed with a FINAL; ``closed`` by outcome
    (``final``, ``rst``, an error code); ``errors`` ERROR/RST frames sent by
    spec code; ``usd_micros`` and ``tokens`` spent at next-hops."""

    open_streams: int
    in_table: int
    opened: int
    completed: int
    closed: dict[str, int]
    errors: dict[str, int]
    agent_calls: int
    usd_micros: int
    tokens: int


class ClassSlots(msgspec.Struct):
    running: int
    queued: int
    preempted: int


class SlotStatus(msgspec.Struct):
    """The QoS slot scheduler (§9): next-hop calls in flight router-wide."""

    capacity: int
    gold_reserved: int
    running: int
    queued: int
    classes: dict[str, ClassSlots]


class WindowLimits(msgspec.Struct):
    """A window triplet: calls in flight, tokens, USD micros (§5.1)."""

    max_parallel: int
    max_tokens: int
    max_usd_micros: int


class BudgetStatus(msgspec.Struct):
    """A stream's budget account (§5): ``limit_*`` (None: unlimited),
    ``reserved_*`` held by calls in flight, ``spent_*`` committed."""

    limit_tokens: int | None
    limit_usd_micros: int | None
    reserved_tokens: int
    reserved_usd_micros: int
    spent_tokens: int
    spent_usd_micros: int


class StreamRow(msgspec.Struct):
    """One open stream: ``state`` is ``running`` (its task runs), ``waiting``
    (opened without a task yet) or ``detached`` (no follower: resumable for
    the grace period, §8); ``age_ms`` since its SYN."""

    tenant: str
    stream_id: str
    policy: str
    qos: str
    state: str
    age_ms: int
    next_hops: list[str]
    followers: int
    window: WindowLimits
    budget: BudgetStatus | None


class StreamList(msgspec.Struct):
    """``count`` open streams, the longest-running ``listed``, ``more`` not listed."""

    count: int
    listed: list[StreamRow]
    more: int


class AgentRow(msgspec.Struct):
    """One next-hop: health (``up``; the FIB excludes it when down), its
    circuit breaker, its AIMD window (``cwnd``, ``ssthresh``, calls
    ``in_flight`` and ``queued``; §5.1), Prometheus call counts and the live
    figures the FIB scores with (§6.2; None until observed). ``max_parallel``
    is the window's configured limit (``cwnd`` never exceeds it)."""

    name: str
    kind: str
    up: bool
    breaker: str
    trips: int
    retry_after_ms: int | None
    error_rate: float
    cwnd: float | None
    ssthresh: float | None
    max_parallel: int
    in_flight: int
    queued: int
    calls_ok: int
    calls_failed: int
    usd_micros: int
    p50_ms: float | None
    p95_ms: float | None
    quality: float | None


class RouteRow(msgspec.Struct):
    """A FIB entry (§4.3) with its live-scored ECMP weights."""

    policy: str
    task_type: str
    next_hops: list[str]
    weights: list[float]


class FibStatus(msgspec.Struct):
    """The learning FIB: its generation, up to ``max_routes`` entries
    (``more_routes`` not listed) and each bandit policy as ``GET /v1/fib``
    shows it (arm figures rounded)."""

    version: int
    routes: list[RouteRow]
    more_routes: int
    bandits: dict[str, FibBandit]


class PolicyAgentPoint(msgspec.Struct):
    """A next-hop within a policy: live USD micros per call vs quality."""

    agent: str
    usd_micros_per_call: float | None
    quality: float
    calls: float


class PolicyPoint(msgspec.Struct):
    """Cost vs quality of one policy: from its recent finished tasks
    (``tasks``, mean ``usd_micros_per_task``, ``p50_ms``, mean consensus
    ``agreement``) and the live quality of its next-hops (``quality``,
    weighted by calls; None until observed)."""

    policy: str
    tasks: int
    usd_micros_per_task: float | None
    p50_ms: float | None
    agreement: float | None
    quality: float | None
    agents: list[PolicyAgentPoint]


class ErrorRow(msgspec.Struct):
    """An ERROR or RST frame the router sent on a stream (§10), newest first."""

    t_ms: int
    kind: str
    code: str
    reason: str
    tenant: str
    stream_id: str
    policy: str


class ErrorList(msgspec.Struct):
    listed: list[ErrorRow]
    more: int


class Series(msgspec.Struct):
    """One sample a second, oldest first, as columns: Unix ``t_ms``, open
    streams, cumulative completed tasks, tasks/s and USD micros/min since the
    previous sample, P50/P95 stream latency (ms) over the last
    :data:`QUANTILE_WINDOW_S` (None: no task finished in it)."""

    t_ms: list[int] = []
    open: list[int] = []
    completed: list[int] = []
    tasks_per_s: list[float] = []
    usd_micros_per_min: list[float] = []
    p50_ms: list[float | None] = []
    p95_ms: list[float | None] = []


class TaskSeries(msgspec.Struct):
    """Recent finished streams, oldest first, as columns: Unix ``t_ms`` of the
    close, ``policy``, ``outcome`` (``final`` or the error code), latency
    (ms), cost (USD micros), tokens, consensus ``agreement`` (None without a
    FINAL). ``skipped``: closed streams not read (scan bound)."""

    t_ms: list[int] = []
    policy: list[str] = []
    outcome: list[str] = []
    latency_ms: list[float] = []
    usd_micros: list[int] = []
    tokens: list[int] = []
    agreement: list[float | None] = []
    skipped: int = 0


class StatusSnapshot(msgspec.Struct):
    """Body of ``GET /v1/status`` and the ``data:`` of each ``status`` event of
    ``GET /v1/status/events``: the router at Unix time ``t_ms`` (module docstring)."""

    v: int
    seq: int
    t_ms: int
    rib: RibStatus
    totals: Totals
    slots: SlotStatus
    streams: StreamList
    agents: list[AgentRow]
    fib: FibStatus
    policies: list[PolicyPoint]
    errors: ErrorList
    series: Series
    tasks: TaskSeries
    truncated: bool = False


# ---------------------------------------------------------------------------- helpers
def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q`` quantile (0..1) of a Prometheus histogram as
    ``histogram_quantile`` computes it: ``bounds`` the finite bucket upper
    bounds in ascending order, ``counts`` the cumulative counts of those
    buckets then ``+Inf`` (``len(bounds) + 1`` values); linear within the
    bucket. None when the histogram is empty; the largest finite bound when
    the rank falls in ``+Inf``."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts):
        if cum >= rank:
            inside = cum - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, cum
    return bounds[-1] if bounds else None


class _Metrics:
    """The Prometheus samples a snapshot needs, read once (``registry.collect()``)."""

    def __init__(self, registry: Any) -> None:
        self.counters: dict[str, list[tuple[dict[str, str], float]]] = {}
        self.buckets: list[tuple[float, float]] = []
        for fam in registry.collect():
            if fam.name == "atp_stream_latency_seconds":
                self.buckets = sorted((float(s.labels["le"]), s.value) for s in fam.samples
                                      if s.name.endswith("_bucket"))
            elif fam.type == "counter":
                self.counters[fam.name] = [(s.labels, s.value) for s in fam.samples if s.name.endswith("_total")]

    def total(self, name: str, **match: str) -> int:
        return int(sum(v for labels, v in self.counters.get(name, ())
                       if all(labels.get(k) == x for k, x in match.items())))

    def by(self, name: str, label: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for labels, v in self.counters.get(name, ()):
            key = labels.get(label, "")
            out[key] = out.get(key, 0) + int(v)
        return {k: v for k, v in sorted(out.items()) if v}


def _content(frame: Any) -> Any:
    p = frame.payload
    return p.content if p is not None else None


def _error_fields(frame: Any) -> tuple[str, str]:
    c = _content(frame)
    if isinstance(c, Mapping):
        return str(c.get("code", "")), str(c.get("reason", ""))[:_REASON_MAX]
    code = getattr(c, "code", None)
    return (str(code) if code is not None else "", str(getattr(c, "reason", ""))[:_REASON_MAX])


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# ---------------------------------------------------------------------------- the scan
class StreamScan:
    """One pass over the stream table, fed in chunks (:meth:`feed`) so the
    caller may yield between them; :meth:`StatusBuilder.build` finishes it.
    Per stream it costs a few attribute reads, plus the new events of a
    stream that emitted since the last scan."""

    def __init__(self, builder: StatusBuilder, now: float, wall_ms: int) -> None:
        self.builder = builder
        self.now = now
        self.wall_ms = wall_ms
        self.open: list[StreamCtx] = []
        self.in_table = 0
        self.closed_new: list[tuple[float, int, StreamCtx]] = []
        self.cursor: dict[StreamCtx, int] = {}

    def feed(self, ctxs: Iterable[StreamCtx]) -> None:
        """Scan ``ctxs`` (streams of the table, each at most once per scan)."""
        old = self.builder._cursor
        done = _DONE
        for ctx in ctxs:
            self.in_table += 1
            seen = old.get(ctx, 0)
            if seen == done or ctx.restored:
                # Recorded already, or read back from the store after a restart
                # (its errors and result are not news of this run).
                self.cursor[ctx] = done
                continue
            log = ctx.log
            if not log.closed:
                self.open.append(ctx)
                n = len(log)  # an open log is never compacted: O(1)
                if n > seen:
                    self.builder._errors_from(ctx, log.events, seen, n, self.now, self.wall_ms)
                self.cursor[ctx] = n
            else:
                closed_at = ctx.closed_at if ctx.closed_at is not None else self.now
                self.closed_new.append((closed_at, seen, ctx))


_DONE = -1


# ---------------------------------------------------------------------------- builder
class StatusBuilder:
    """Builds :class:`StatusSnapshot` s of one router (sans-IO; module
    docstring). Not thread-safe: call it on the router's event loop."""

    def __init__(self, limits: StatusLimits | None = None) -> None:
        self.limits = lim = limits or StatusLimits()
        self.seq = 0
        #: Stream → events already read (``_DONE``: closed and recorded). Rebuilt
        #: by each scan from the table, so a stream gone from it is dropped.
        self._cursor: dict[StreamCtx, int] = {}
        self._errors: deque[ErrorRow] = deque(maxlen=lim.max_errors)
        self._errors_seen = 0
        # (t_ms, policy, outcome, latency_ms, usd_micros, tokens, agreement)
        self._tasks: deque[tuple[int, str, str, float, int, int, float | None]] = deque(maxlen=lim.max_tasks)
        self._tasks_skipped = 0
        # (now, t_ms, open, completed, usd_micros, cumulative latency buckets)
        self._samples: deque[tuple[float, int, int, int, int, tuple[float, ...]]] = deque(maxlen=lim.max_samples)
        self._series: deque[tuple[int, int, int, float, float, float | None, float | None]] = deque(
            maxlen=lim.max_samples)
        self._bounds: tuple[float, ...] = ()

    def scan(self, now: float, wall_ms: int) -> StreamScan:
        """A new scan at trio time ``now`` (s) and Unix time ``wall_ms``."""
        return StreamScan(self, now, wall_ms)

    def build(self, router: Router, scan: StreamScan) -> StatusSnapshot:
        """Finish ``scan`` (fed with the whole table) and return the snapshot of
        ``router`` at its time; takes one history sample when
        ``limits.sample_every_s`` has passed since the last."""
        now, wall_ms = scan.now, scan.wall_ms
        self._finish_scan(router, scan)
        m = _Metrics(router.metrics.registry)
        self._sample(router, m, now, wall_ms)
        self.seq += 1
        gen = router.gen
        completed = m.total("atp_streams_closed", outcome="final")
        calls = m.by("atp_agent_calls", "agent")
        return StatusSnapshot(
            v=1, seq=self.seq, t_ms=wall_ms,
            rib=RibStatus(version=gen.version, source=str(gen.source), policies=len(gen.rib.policies),
                          agents=len(gen.rib.agents)),
            totals=Totals(
                open_streams=router.open_count, in_table=scan.in_table, opened=m.total("atp_streams_opened"),
                completed=completed, closed=m.by("atp_streams_closed", "outcome"), errors=m.by("atp_errors", "code"),
                agent_calls=sum(calls.values()), usd_micros=m.total("atp_usd_micros"), tokens=m.total("atp_tokens")),
            slots=self._slots(router),
            streams=self._streams(router, scan),
            agents=self._agents(router, m, now),
            fib=self._fib(router),
            policies=self._policies(router),
            errors=ErrorList(listed=list(reversed(self._errors)), more=max(0, self._errors_seen - len(self._errors))),
            series=self._series_cols(),
            tasks=self._task_cols(),
        )

    def encode(self, snap: StatusSnapshot) -> bytes:
        """``snap`` as JSON, at most ``limits.max_bytes``: history, errors, stream
        and route rows are halved (oldest history first) until it fits, and
        ``truncated`` is set. A snapshot that still does not fit raises
        ``ValueError`` (a limit too small for the RIB itself)."""
        data = _enc.encode(snap)
        cap = self.limits.max_bytes
        if len(data) <= cap:
            return data
        for _ in range(24):
            snap = _halve(snap)
            data = _enc.encode(snap)
            if len(data) <= cap:
                return data
        raise ValueError(f"status snapshot of {len(data)} bytes does not fit max_bytes={cap}")

    # ------------------------------------------------------------------ scan results
    def _errors_from(self, ctx: StreamCtx, events: Sequence[Any], start: int, stop: int, now: float,
                     wall_ms: int) -> None:
        for ev in events[start:stop]:
            if ev.type in ("ERROR", "RST"):
                code, reason = _error_fields(ev.frame)
                t = ctx.closed_at if ev.type == "RST" and ctx.closed_at is not None else now
                self._errors.append(ErrorRow(
                    t_ms=wall_ms - int((now - t) * 1000), kind=ev.type, code=code, reason=reason,
                    tenant=ctx.tenant, stream_id=ctx.stream_id, policy=str(getattr(ctx.route, "policy", ""))))
                self._errors_seen += 1

    def _finish_scan(self, router: Router, scan: StreamScan) -> None:
        closed = scan.closed_new
        limit = self.limits.max_closed_per_scan
        if len(closed) > limit:
            closed.sort(key=lambda c: c[0])
            for _, _, ctx in closed[:-limit]:
                scan.cursor[ctx] = _DONE
            self._tasks_skipped += len(closed) - limit
            closed = closed[-limit:]
        else:
            closed.sort(key=lambda c: c[0])
        for closed_at, seen, ctx in closed:
            events = ctx.log.events  # decoded when compacted: hence the bound above
            self._errors_from(ctx, events, seen, len(events), scan.now, scan.wall_ms)
            self._task_from(router, ctx, events, closed_at, scan.now, scan.wall_ms)
            scan.cursor[ctx] = _DONE
        self._cursor = scan.cursor

    def _task_from(self, router: Router, ctx: StreamCtx, events: Sequence[Any], closed_at: float, now: float,
                   wall_ms: int) -> None:
        if not ctx.task_started:
            return  # closed before any task (idle expiry, client RST): nothing to plot
        final: Any = None
        outcome = "rst"
        for ev in reversed(events):
            if ev.type == "FINAL":
                final = _content(ev.frame)
                outcome = "final"
                break
            if ev.type in ("ERROR", "RST") and outcome == "rst":
                outcome = _error_fields(ev.frame)[0] or "rst"
        latency_ms = max(0.0, (closed_at - ctx.started) * 1000)
        usd_micros = tokens = 0
        agreement = None
        if isinstance(final, Mapping):
            tel = final.get("telemetry") or {}
            latency_ms = _num(tel.get("latency_ms")) or latency_ms
            usd_micros = round((_num(tel.get("usd")) or 0.0) * 1_000_000)
            tokens = int(_num(tel.get("tokens")) or 0)
            cons = (final.get("result") or {}).get("consensus") or {}
            agreement = _num(cons.get("agreement"))
        elif router.ledger.has(ctx.account):
            st = router.ledger.state(ctx.account)
            usd_micros, tokens = st.committed_usd_micros, st.committed_tokens
        self._tasks.append((wall_ms - int((now - closed_at) * 1000), str(getattr(ctx.route, "policy", "")),
                            outcome, round(latency_ms, 1), usd_micros, tokens, agreement))

    # ------------------------------------------------------------------ history
    def _sample(self, router: Router, m: _Metrics, now: float, wall_ms: int) -> None:
        if self._samples and now - self._samples[-1][0] < self.limits.sample_every_s:
            return
        bounds = tuple(b for b, _ in m.buckets if math.isfinite(b))
        cum = tuple(c for _, c in m.buckets)
        if bounds != self._bounds:  # first sample, or the buckets changed: no delta across
            self._bounds = bounds
            self._samples.clear()
        completed = m.total("atp_streams_closed", outcome="final")
        usd = m.total("atp_usd_micros")
        sample = (now, wall_ms, router.open_count, completed, usd, cum)
        rate = per_min = 0.0
        p50 = p95 = None
        if self._samples:
            prev = self._samples[-1]
            dt = max(now - prev[0], 1e-6)
            rate = round((completed - prev[3]) / dt, 3)
            per_min = round((usd - prev[4]) * 60 / dt, 1)
            base = next((s for s in self._samples if now - s[0] <= QUANTILE_WINDOW_S + 1e-9), prev)
            if base is not None and len(base[5]) == len(cum):
                delta = [c - b for c, b in zip(cum, base[5])]
                q50, q95 = histogram_quantile(0.5, bounds, delta), histogram_quantile(0.95, bounds, delta)
                p50 = round(q50 * 1000, 1) if q50 is not None else None
                p95 = round(q95 * 1000, 1) if q95 is not None else None
        self._samples.append(sample)
        self._series.append((wall_ms, router.open_count, completed, rate, per_min, p50, p95))

    def _series_cols(self) -> Series:
        s = Series()
        for t, o, c, r, u, p50, p95 in self._series:
            s.t_ms.append(t)
            s.open.append(o)
            s.completed.append(c)
            s.tasks_per_s.append(r)
            s.usd_micros_per_min.append(u)
            s.p50_ms.append(p50)
            s.p95_ms.append(p95)
        return s

    def _task_cols(self) -> TaskSeries:
        s = TaskSeries(skipped=self._tasks_skipped)
        for t, pol, out, lat, usd, tok, agr in self._tasks:
            s.t_ms.append(t)
            s.policy.append(pol)
            s.outcome.append(out)
            s.latency_ms.append(lat)
            s.usd_micros.append(usd)
            s.tokens.append(tok)
            s.agreement.append(agr)
        return s

    # ------------------------------------------------------------------ router state
    @staticmethod
    def _slots(router: Router) -> SlotStatus:
        st = router.gates.slots.scheduler.statistics()
        return SlotStatus(
            capacity=st.capacity, gold_reserved=st.gold_reserved, running=st.running, queued=st.queued,
            classes={name: ClassSlots(running=c.running, queued=c.queued, preempted=c.preempted)
                     for name, c in (("gold", st.gold), ("silver", st.silver), ("bronze", st.bronze))})

    def _streams(self, router: Router, scan: StreamScan) -> StreamList:
        listed = heapq.nsmallest(self.limits.max_streams, scan.open, key=lambda c: c.started)
        rows = []
        ledger = router.ledger
        for ctx in listed:
            budget = None
            if ledger.has(ctx.account):
                a = ledger.state(ctx.account)
                budget = BudgetStatus(limit_tokens=a.limit.tokens, limit_usd_micros=a.limit.usd_micros,
                                      reserved_tokens=a.reserved_tokens, reserved_usd_micros=a.reserved_usd_micros,
                                      spent_tokens=a.committed_tokens, spent_usd_micros=a.committed_usd_micros)
            w = ctx.window
            state = "running" if ctx.task_started else "waiting"
            if ctx.followers == 0 and ctx.detached_at is not None:
                state = "detached"
            route = ctx.route
            rows.append(StreamRow(
                tenant=ctx.tenant, stream_id=ctx.stream_id, policy=str(getattr(route, "policy", "")),
                qos=str(ctx.qos), state=state, age_ms=max(0, int((scan.now - ctx.started) * 1000)),
                next_hops=[h.agent for h in route.next_hops], followers=ctx.followers,
                window=WindowLimits(w.max_parallel, w.max_tokens, w.max_usd_micros), budget=budget))
        return StreamList(count=len(scan.open), listed=rows, more=len(scan.open) - len(rows))

    @staticmethod
    def _agents(router: Router, m: _Metrics, now: float) -> list[AgentRow]:
        gen = router.gen
        gates = router.gates
        windows = gates.agent_windows
        wstats = windows.statistics()
        bstats = gates.breakers.statistics(now)
        health = router.control.health(gen, now)
        live = router.learning.live_view()
        ok_calls = {labels.get("agent", ""): int(v) for labels, v in m.counters.get("atp_agent_calls", ())
                    if labels.get("outcome") == "ok"}
        all_calls = m.by("atp_agent_calls", "agent")
        usd = m.by("atp_usd_micros", "agent")
        rows = []
        for name in sorted(set(gen.rib.agents) | set(wstats)):
            spec = gen.rib.agents.get(name)
            kind = "gone"
            if spec is not None:
                kind = (f"tool {spec.tool}" if spec.tool else f"model {spec.model}" if spec.model
                        else f"remote {spec.remote.protocol}" if spec.remote is not None else "?")
            w = wstats.get(name)
            b = bstats.get(name)
            h = health.get(name)
            lv = live.get(name)
            queue = windows.queue(name) if w is not None else None
            limits = windows.limits_of(name)
            rows.append(AgentRow(
                name=name, kind=kind, up=h.up if h is not None else b is None or b.state is not BreakerState.OPEN,
                breaker=str(b.state) if b is not None else str(BreakerState.CLOSED),
                trips=b.trips if b is not None else 0,
                retry_after_ms=gates.breakers.retry_after_ms(name, now),
                error_rate=round(h.error_rate if h is not None else (b.error_rate if b is not None else 0.0), 4),
                cwnd=round(w.cwnd, 3) if w is not None else None,
                ssthresh=round(w.ssthresh, 3) if w is not None and math.isfinite(w.ssthresh) else None,
                max_parallel=limits.max_parallel,
                in_flight=w.in_flight if w is not None else 0,
                queued=len(queue) if queue is not None else 0,
                calls_ok=ok_calls.get(name, 0), calls_failed=all_calls.get(name, 0) - ok_calls.get(name, 0),
                usd_micros=usd.get(name, 0),
                p50_ms=lv.p50_ms if lv is not None else None, p95_ms=lv.p95_ms if lv is not None else None,
                quality=round(lv.quality, 4) if lv is not None and lv.quality_obs > 0 else None))
        return rows

    def _fib(self, router: Router) -> FibStatus:
        gen = router.gen
        router.learning.sync(gen)
        entries = gen.fib.routes(live=router.learning.live_view())
        cap = self.limits.max_routes
        view = router.learning.learner.fib_view()
        bandits = {
            name: msgspec.convert({**b, "arms": {
                a: {"mean": round(v["mean"], 4), "std": round(v["std"], 4), "count": round(v["count"], 2),
                    "cost": round(v["cost"], 4)} for a, v in b["arms"].items()}}, FibBandit)
            for name, b in view["bandits"].items()}
        return FibStatus(
            version=gen.version,
            routes=[RouteRow(policy=e.policy, task_type=e.task_type, next_hops=list(e.next_hops),
                             weights=[round(x, 4) for x in e.weights]) for e in entries[:cap]],
            more_routes=max(0, len(entries) - cap), bandits=bandits)

    def _policies(self, router: Router) -> list[PolicyPoint]:
        live = router.learning.live_view()
        by_policy: dict[str, list[tuple[int, str, float, int, float | None]]] = {}
        for t, pol, outcome, lat, usd, _tok, agr in self._tasks:
            by_policy.setdefault(pol, []).append((t, outcome, lat, usd, agr))
        names = [str(p.name) for p in router.gen.rib.policies]
        names += sorted(set(by_policy) - set(names))
        out: list[PolicyPoint] = []
        for name in names:
            tasks = by_policy.get(name, [])
            agents = []
            for key, v in live.items():
                pol, sep, agent = key.partition(_SEP)
                if sep and pol == name and v.quality_obs > 0:
                    agents.append(PolicyAgentPoint(agent=agent, usd_micros_per_call=v.usd_micros_per_call,
                                                   quality=round(v.quality, 4), calls=round(v.calls, 2)))
            agents.sort(key=lambda a: a.agent)
            weight = sum(a.calls for a in agents)
            quality = round(sum(a.quality * a.calls for a in agents) / weight, 4) if weight > 0 else None
            finals = [x for x in tasks if x[1] == "final"]
            lats = sorted(x[2] for x in tasks)
            agreements = [x[4] for x in finals if x[4] is not None]
            out.append(PolicyPoint(
                policy=name, tasks=len(tasks),
                usd_micros_per_task=round(sum(x[3] for x in tasks) / len(tasks), 1) if tasks else None,
                p50_ms=lats[len(lats) // 2] if lats else None,
                agreement=round(sum(agreements) / len(agreements), 4) if agreements else None,
                quality=quality, agents=agents))
        return out


_enc = msgspec.json.Encoder()


def _halve(snap: StatusSnapshot) -> StatusSnapshot:
    """``snap`` with the older half of its history and half its rows dropped."""
    def cols(s: Any) -> Any:
        fields = {f: getattr(s, f) for f in s.__struct_fields__}
        n = len(fields["t_ms"])
        keep = n // 2
        return type(s)(**{f: (v[n - keep:] if isinstance(v, list) else v) for f, v in fields.items()})

    streams = snap.streams
    keep_streams = len(streams.listed) // 2
    fib = snap.fib
    keep_routes = len(fib.routes) // 2
    return msgspec.structs.replace(
        snap, truncated=True, series=cols(snap.series), tasks=cols(snap.tasks),
        errors=ErrorList(listed=snap.errors.listed[: len(snap.errors.listed) // 2],
                         more=snap.errors.more + len(snap.errors.listed) - len(snap.errors.listed) // 2),
        streams=StreamList(count=streams.count, listed=streams.listed[:keep_streams],
                           more=streams.count - keep_streams),
        fib=msgspec.structs.replace(fib, routes=fib.routes[:keep_routes],
                                    more_routes=fib.more_routes + len(fib.routes) - keep_routes))


# ---------------------------------------------------------------------------- trio
class StatusFeed:
    """The trio side (module docstring): shared, rate-limited snapshots of
    ``router`` and their SSE stream. ``chunk``: streams scanned between two
    checkpoints; at most ``max_watchers`` event streams at once."""

    def __init__(self, router: Router, builder: StatusBuilder | None = None, *, interval_s: float = 1.0,
                 min_interval_s: float = 0.25, poll_s: float = 0.1, chunk: int = 2000,
                 max_watchers: int = 16) -> None:
        self.router = router
        self.builder = builder or StatusBuilder()
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self.poll_s = poll_s
        self.chunk = chunk
        self.max_watchers = max_watchers
        self.watchers = 0
        self._lock = trio.Lock()
        self._last: bytes | None = None
        self._last_at = -math.inf
        self._last_mark: tuple[Any, ...] | None = None

    def mark(self) -> tuple[Any, ...]:
        """What a watcher should see at once when it changes: open and retained
        streams, the RIB generation, the agents whose circuit is open."""
        r = self.router
        return (r.open_count, len(r.streams), r.gen.version,
                frozenset(r.gates.breakers.open_agents(trio.current_time())))

    async def snapshot(self) -> bytes:
        """The current snapshot as JSON: the last one if it is younger than
        ``min_interval_s``, else a new one (one build at a time)."""
        async with self._lock:
            now = trio.current_time()
            if self._last is not None and now - self._last_at < self.min_interval_s:
                return self._last
            mark = self.mark()
            scan = self.builder.scan(now, _wall_ms())
            ctxs = list(self.router.streams.values())
            for i in range(0, len(ctxs), self.chunk):
                if i:
                    await trio.lowlevel.checkpoint()
                scan.feed(ctxs[i:i + self.chunk])
            data = self.builder.encode(self.builder.build(self.router, scan))
            self._last, self._last_at, self._last_mark = data, trio.current_time(), mark
            return data

    def full(self) -> bool:
        """``max_watchers`` event streams are open: refuse another (HTTP 429)."""
        return self.watchers >= self.max_watchers

    async def events(self) -> AsyncIterator[bytes]:
        """SSE ``status`` events (``id:`` the snapshot's ``seq``): one now, then
        every ``interval_s``, or sooner (no sooner than ``min_interval_s``)
        when :meth:`mark` changes. A watcher over ``max_watchers`` (two
        requests that passed :meth:`full` together) gets one ``error`` event
        and the stream ends."""
        if self.full():
            yield b"event: error\ndata: {\"code\":\"EWINDOW\",\"reason\":\"too many status watchers\"}\n\n"
            return
        self.watchers += 1
        try:
            while True:
                data = await self.snapshot()
                sent_mark, sent_at = self._last_mark, trio.current_time()
                yield b"id: %d\nevent: status\ndata: %s\n\n" % (self.builder.seq, data)
                while True:
                    await trio.sleep(self.poll_s)
                    waited = trio.current_time() - sent_at
                    if waited >= self.interval_s or (waited >= self.min_interval_s and self.mark() != sent_mark):
                        break
        finally:
            self.watchers -= 1


def _wall_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------------------- HTTP
#: The page's files (atp_router/runtime/admin/static), served as they are: no CDN, no fetch
#: of anything else (the page works without internet).
PAGE_ASSETS = {"status.js": "text/javascript; charset=utf-8", "status.css": "text/css; charset=utf-8"}
#: The page runs only its own script and talks only to this router.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def status_routes(router: Router, authorized: Callable[..., Any], feed: StatusFeed | None = None) -> list[Any]:
    """The status routes of ``router`` (wired by :func:`atp_router.runtime.ingress.http_api.build_app`):

    ==============================  =============================================
    ``GET /status``                 the page (public HTML; it holds no data)
    ``GET /status/{asset}``         its script and style sheet
    ``GET /v1/status``              one :class:`StatusSnapshot` (JSON)
    ``GET /v1/status/events``       ``status`` Server-Sent Events of snapshots
    ==============================  =============================================

    The data endpoints need the ``tenant_admin`` action (role admin): they show
    every tenant's streams. ``authorized(action, handler)`` is the API's
    authentication and authorization wrapper (401 / 403 ESEC). A watcher over
    ``feed.max_watchers`` is answered 429 ``EWINDOW``."""
    from importlib.resources import files

    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    feed = feed or StatusFeed(router)
    static = files("atp_router.runtime.admin") / "static"
    page = (static / "status.html").read_bytes()
    assets = {name: (static / name).read_bytes() for name in PAGE_ASSETS}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["asset"]
        if name not in assets:
            return Response(b"not found", status_code=404, media_type="text/plain", headers=PAGE_HEADERS)
        return Response(assets[name], media_type=PAGE_ASSETS[name], headers=PAGE_HEADERS)

    async def snapshot(request: Request, identity: Any) -> Response:
        return Response(await feed.snapshot(), media_type="application/json", headers={"Cache-Control": "no-store"})

    async def events(request: Request, identity: Any) -> Response:
        if feed.full():
            body = _enc.encode({"error": {"code": "EWINDOW", "reason": f"at most {feed.max_watchers} status "
                                                                       "event streams at once"}})
            return Response(body, status_code=429, media_type="application/json", headers={"Retry-After": "5"})
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return [
        Route("/status", index, methods=["GET"]),
        Route("/status/{asset}", asset, methods=["GET"]),
        Route("/v1/status", authorized("tenant_admin", snapshot), methods=["GET"]),
        Route("/v1/status/events", authorized("tenant_admin", events), methods=["GET"]),
    ]
