"""The status snapshot's shape (issue 11 item 4): :class:`StatusSnapshot`, the
body of ``GET /v1/status`` and of each ``GET /v1/status/events`` event, and the
:class:`StatusLimits` bounding it. Built by
:class:`~atp_router.runtime.admin.status.StatusBuilder`; documented in the OpenAPI
document from these Structs (:mod:`atp_router.runtime.admin.openapi`).
"""

from __future__ import annotations

import msgspec

from atp_router.runtime.admin.fibview import FibBandit

__all__ = [
    "AgentRow", "BudgetStatus", "ClassSlots", "ErrorList", "ErrorRow", "FibStatus", "PolicyAgentPoint",
    "PolicyPoint", "RibStatus", "RouteRow", "Series", "SlotStatus", "StatusLimits", "StatusSnapshot",
    "StreamList", "StreamRow", "TaskSeries", "Totals", "WindowLimits",
]


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
