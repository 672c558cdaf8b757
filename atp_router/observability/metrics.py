"""Prometheus metrics of one router (spec §12), on a private registry.

Label values are bounded: ``agent`` only takes names from the running RIB,
``outcome`` / ``code`` only the fixed sets below, so cardinality cannot grow with
traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

class FunctionCounter(Collector):
    """A counter whose value a callable reads at scrape time (a total kept
    elsewhere, e.g. by the store's client): nothing is exported until
    :meth:`set_function` names it."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._fn: Callable[[], float] | None = None
        registry.register(self)

    def set_function(self, fn: Callable[[], float]) -> None:
        self._fn = fn

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self._fn is not None:
            yield CounterMetricFamily(self.name, self.documentation, value=self._fn())


class LabeledFunctionCounter(Collector):
    """A :class:`FunctionCounter` by one label: the callable returns ``{label
    value: total}`` at scrape time."""

    def __init__(self, name: str, documentation: str, label: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self._fn: Callable[[], dict[str, int]] | None = None
        registry.register(self)

    def set_function(self, fn: Callable[[], dict[str, int]]) -> None:
        self._fn = fn

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=[self.label])

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self._fn is not None:
            fam = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
            for value, total in sorted(self._fn().items()):
                fam.add_metric([value], total)
            yield fam


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.streams_opened = Counter("atp_streams_opened", "Streams opened (SYN accepted)", ["qos"], registry=r)
        self.streams_closed = Counter(
            "atp_streams_closed", "Streams closed, by outcome (final, rst, error code)", ["outcome"], registry=r
        )
        self.open_streams = Gauge("atp_open_streams", "Streams currently open", registry=r)
        self.retained_streams = Gauge("atp_retained_streams", "Closed streams kept in memory (reads of the others "
                                      "are served from the store)", registry=r)
        self.retained_bytes = Gauge("atp_retained_bytes", "Bytes of the closed stream logs kept in memory "
                                    "(bounded by retain_closed_bytes)", registry=r)
        self.stream_latency = Histogram(
            "atp_stream_latency_seconds", "SYN to FINAL wall time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._add_call_metrics(r)
        self._add_policy_metrics(r)
        self._add_cache_metrics(r)
        self._add_store_metrics(r)

    def _add_call_metrics(self, r: CollectorRegistry) -> None:
        """Frames, errors, next-hop calls and their spend, escalations, agreement."""
        self.frames = Counter("atp_frames", "Frames by direction and kind", ["direction", "kind"], registry=r)
        self.errors = Counter("atp_errors", "ERROR frames sent, by spec code", ["code"], registry=r)
        self.agent_calls = Counter("atp_agent_calls", "Next-hop calls by outcome", ["agent", "outcome"], registry=r)
        self.agent_latency = Histogram(
            "atp_agent_latency_seconds", "Next-hop call wall time", ["agent"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("atp_tokens", "Tokens consumed (in+out) by next-hop", ["agent"], registry=r)
        self.usd_micros = Counter("atp_usd_micros", "USD micros spent by next-hop", ["agent"], registry=r)
        self.escalations = Counter("atp_escalations", "Escalations by trigger", ["trigger"], registry=r)
        self.agreement = Histogram(
            "atp_consensus_agreement", "Consensus agreement of FINAL results",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r,
        )

    def _add_policy_metrics(self, r: CollectorRegistry) -> None:
        """RIB reloads and generation, the bandit, feedback, learning, shadow runs."""
        self.policy_reloads = Counter("atp_policy_reloads", "RIB reloads by result", ["result"], registry=r)
        self.bandit_choices = Counter(
            "atp_bandit_choices", "Next-hops a policy's contextual bandit chose", ["policy", "agent"], registry=r)
        self.feedback = Counter("atp_feedback", "Client feedback taken (POST /v1/streams/{id}/feedback)", ["policy"],
                                registry=r)
        self.learning_skipped = Counter(
            "atp_learning_skipped", "Finished tasks not learned from: their tenant was over its learning rate",
            ["policy"], registry=r)
        self.shadow_runs = Counter("atp_shadow_runs", "Shadow challenger runs by outcome (ok, error code, budget)",
                                   ["policy", "agent", "outcome"], registry=r)
        self.shadow_regret = Histogram(
            "atp_shadow_regret", "Shadow challenger quality minus the served quality (> 0: the challenger was better)",
            ["policy", "agent"], buckets=(-1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.rib_version = Gauge("atp_rib_version", "Generation of the running RIB", registry=r)

    def _add_cache_metrics(self, r: CollectorRegistry) -> None:
        """The response cache."""
        # The response cache (spec §13, atp_router.runtime.dataplane.cache); hit rate = hit / (hit + miss).
        self.cache_lookups = Counter("atp_cache_lookups", "Response cache lookups by next-hop and result (hit, miss)",
                                     ["agent", "result"], registry=r)
        self.cache_stores = Counter("atp_cache_stores", "Answers offered to the response cache, by result "
                                    "(stored, too_large, error)", ["result"], registry=r)
        self.cache_evictions = Counter("atp_cache_evictions", "Response cache entries dropped, by reason "
                                       "(expired, size)", ["reason"], registry=r)
        self.cache_entries = Gauge("atp_cache_entries", "Entries in the response cache", registry=r)
        self.cache_bytes = Gauge("atp_cache_bytes", "Bytes of the response cache's stored values "
                                 "(bounded by --cache-max-bytes)", registry=r)
        self.cache_saved_tokens = Counter("atp_cache_saved_tokens", "Tokens the response cache's hits did not spend "
                                          "(what the stored calls used)", ["agent"], registry=r)
        self.cache_saved_usd_micros = Counter("atp_cache_saved_usd_micros", "USD micros the response cache's hits "
                                              "did not spend", ["agent"], registry=r)

    def _add_store_metrics(self, r: CollectorRegistry) -> None:
        """The state store."""
        # The state store (issue 12): a shared store that cannot be reached refuses spend.
        self.store_up = Gauge("atp_store_up", "1 while the state store answers, 0 while it cannot be reached "
                              "(new spend is refused)", registry=r)
        self.store_up.set(1)
        # The router's own event loop (issue 20, atp_router.runtime.loopstalls).
        self.loop_stalls = FunctionCounter(
            "atp_loop_stalls", "Stretches of 0.5 s or more in which this router's event loop did not look at I/O "
            "(a blocking call on it, or the process not scheduled)", r)
        self.loop_stall_seconds = FunctionCounter(
            "atp_loop_stall_seconds", "Time this router's event loop spent in those stalls", r)
        self.local_timeouts = FunctionCounter(
            "atp_local_timeouts", "Next-hop calls that timed out right after such a stall: the router's own "
            "fault, retried and not counted against the next-hop's breaker", r)
        self.store_round_trips = FunctionCounter(
            "atp_store_round_trips", "Requests sent to a shared state store (Redis) and waited for: a script or a "
            "pipeline of them is one (lease renewals included)", r)
        self.store_background_round_trips = FunctionCounter(
            "atp_store_background_round_trips", "Of atp_store_round_trips_total, those of the router's periodic "
            "work, whatever its tasks: lease renewals, polls for lost routers, a new RIB and breaker states, "
            "expiry, quota renewals (a group commit is never one)", r)
        self.store_round_trips_by_op = LabeledFunctionCounter(
            "atp_store_round_trips_by_op", "atp_store_round_trips_total by operation: a script's name, pipeline "
            "(a group commit: several scripts in one round trip), time, script_load", "op", r)
        self.store_unavailable = Counter(
            "atp_store_unavailable", "Store operations that found the store unreachable, by operation (open, "
            "reserve, extend, set_limit, commit, release, close, events, lease, reap, read)", ["op"], registry=r)
        # Tenant quotas shared through the store (issue 22 item 3, atp_router.runtime.dataplane.quotas).
        self.quota_refused = Counter(
            "atp_quota_refused", "Stream opens refused by a tenant's quota shared across routers, by limit "
            "(streams, rate)", ["limit"], registry=r)
        self.quota_fallback = Counter(
            "atp_quota_fallback", "Decisions of a shared tenant quota made by this router's own limits because the "
            "store could not be reached, by quota (streams: an open, learn: the learning rate)", ["quota"], registry=r)
        # The audit spool (issue 22 item 4, atp_router.security.audit.AuditSpool).
        self.audit_spooled = Gauge("atp_audit_spooled", "Audit records kept in memory until the state store takes "
                                   "them (chained in order when it does)", registry=r)
        self.audit_dropped = Counter("atp_audit_dropped", "Audit records dropped: the store could not take them "
                                     "and the audit spool was full (--audit-spool-records, --audit-spool-bytes)",
                                     registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
