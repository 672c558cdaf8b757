"""Live status of one router (issue 11 item 4; spec §5, §6.2, §9, §12): the
snapshot behind ``GET /v1/status``, ``GET /v1/status/events`` and the page at
``GET /status``.

Two layers, the project's usual split:

* :class:`StatusBuilder` — sans-IO (no I/O, no clock: ``now`` in trio seconds
  and ``wall_ms`` in Unix ms are arguments). It reads the router's own objects —
  the stream table and budget ledger, the flow gates (per-next-hop AIMD windows,
  circuit breakers, QoS slots), the control plane (RIB generation, next-hop
  health), the learning FIB (bandit arms, live figures) and the Prometheus
  registry — and returns a :class:`~atp_router.runtime.admin.snapshot.StatusSnapshot`
  (its shape in :mod:`~atp_router.runtime.admin.snapshot`). Between snapshots it keeps
  bounded history: one sample a second (open streams, tasks/s, cost/min,
  P50/P95 latency), the recent finished tasks (latency, cost, agreement) and
  the recent ERROR / RST frames.
* :class:`~atp_router.runtime.admin.statuspage.StatusFeed` — trio
  (:mod:`~atp_router.runtime.admin.statuspage`, with the HTTP routes). Builds at most one snapshot per
  ``min_interval_s`` however many pages watch (they share it), scans the
  stream table in chunks with a checkpoint between them so thousands of
  streams never hold the event loop for long, and pushes a snapshot as
  Server-Sent Events every ``interval_s`` and as soon as something visible
  changed (open streams, RIB generation, a circuit opening).

Bounds (:class:`~atp_router.runtime.admin.snapshot.StatusLimits`): at most ``max_streams`` stream rows (the
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
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from atp_router.flow.breaker import BreakerState
from atp_router.runtime.admin.fibview import FibBandit
from atp_router.runtime.admin.snapshot import (
    AgentRow,
    BudgetStatus,
    ClassSlots,
    ErrorList,
    ErrorRow,
    FibStatus,
    PolicyAgentPoint,
    PolicyPoint,
    RibStatus,
    RouteRow,
    Series,
    SlotStatus,
    StatusLimits,
    StatusSnapshot,
    StreamList,
    StreamRow,
    TaskSeries,
    Totals,
    WindowLimits,
)

if TYPE_CHECKING:
    from atp_router.runtime.dataplane.stream import StreamCtx
    from atp_router.runtime.router import Router

__all__ = [
    "StatusBuilder",
    "StreamScan",
    "histogram_quantile",
]

#: Key separator of the live view's per-policy entries (``policy|agent``; atp_router.policy.learn.KEY_SEP).
_SEP = "|"
#: Rolling window of the latency quantiles in the samples, s.
QUANTILE_WINDOW_S = 10.0
_REASON_MAX = 240


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
