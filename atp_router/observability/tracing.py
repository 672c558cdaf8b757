"""OpenTelemetry traces of the router (spec §12): one span per session, stream,
next-hop call (leg) and consensus / escalation step, W3C trace context in and out.

Off by default, at no cost. :func:`configure_from_env` installs an SDK
``TracerProvider`` only when an exporter is configured by the standard
``OTEL_*`` variables (nothing else configures it)::

    OTEL_SDK_DISABLED=true                  off, whatever else is set
    OTEL_TRACES_EXPORTER=otlp|console|none  comma-separated; "none": off
    (unset)                                 otlp when OTEL_EXPORTER_OTLP_ENDPOINT or
                                            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set,
                                            else off
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL    http/protobuf only (grpc, http/json: refused)
    OTEL_SERVICE_NAME                       default "atp-router"
    OTEL_EXPORTER_OTLP_[TRACES_]{ENDPOINT,HEADERS,TIMEOUT,COMPRESSION,CERTIFICATE},
    OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*,
    OTEL_PROPAGATORS                        as the OpenTelemetry SDK reads them

With no provider installed the router holds no :class:`RouterTracing`
(``Router.tracing is None``): the hot path makes no span, reads no header and
injects none; each hook is one ``is None`` test.

Spans (names, parents, attributes; the §12 names verbatim, the router's own
under ``atp.``)::

    atp.session    SERVER    parent: the client's context    session_id, atp.tenant
    └ atp.stream   INTERNAL  one per stream, SYN → FIN/RST   session_id, stream_id, msg_seq (last frame),
      │                                                      route_path, window_state, tokens_in/out, usd,
      │                                                      latency_ms, atp.policy, atp.qos, atp.outcome
      ├ atp.leg    CLIENT    one per next-hop attempt        session_id, stream_id, agent, model, msg_seq,
      │                                                      latency_ms, tokens_in/out, usd, confidence,
      │                                                      window_state, atp.error_code, atp.attempt
      │                                                      (a retry; an answer from the response cache
      │                                                      is no call: no leg)
      └ atp.consensus        the merge (§7.2), from the      session_id, stream_id, confidence, route_path,
        │                    last first-stage leg to FINAL   atp.consensus.{strategy,agreement,findings},
        │                                                    atp.escalation.triggers
        └ atp.escalation     when a trigger fired (§8.6)     agent, atp.escalation.triggers
          └ atp.leg          the escalation's calls

A session span covers the time its session has streams open (a WebSocket session
idle between streams starts a new one). ``usd`` is USD (float), ``latency_ms``
ms, ``tokens_*`` tokens; ``window_state`` is the window as compact JSON (the
next-hop's AIMD window on a leg, the stream's window on a stream);
``route_path`` lists the policy then every agent called, in order (reroutes and
the escalation included); ``confidence`` is the agent's own on a leg and the
mean confidence of the merged findings on the consensus.

Leg spans are made after the fact from the dispatcher's ``on_leg`` outcome
(explicit start and end times), except when the adapter sends a request: then
the span starts with the request, so that its id is the parent the agent sees.

Propagation in: the ``traceparent`` / ``tracestate`` headers of HTTP and
WebSocket-handshake requests (:class:`TraceContextMiddleware`,
:func:`attach_headers`), and in a SYN's ``meta.trace`` (wins over the headers)::

    meta.trace = {"trace_id": "<32 hex>", "parent_span": "<16 hex>"[, "sampled": bool]}
               | {"parent_span": "<W3C traceparent>"} | {"traceparent": "...", "tracestate": "..."}

(``parent_span`` may carry the spec's ``spn_`` prefix). A malformed value is
ignored, as if absent. Out: the SYN+ACK's ``meta.trace`` names
the stream span (``{"trace_id", "span_id"}``); next-hops get ``traceparent``
(HTTP headers of every adapter request, :func:`httpx_hooks`; A2A
``message.metadata.traceparent``; the 2389 task envelope's ``traceparent``;
:func:`outbound`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from atp_router.security.redact import scrub

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from atp_router.consensus.types import AgentReport, FinalResult, Usage
    from atp_router.wire.errors import ATPError

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "RouterTracing",
    "TraceContextMiddleware",
    "TracedLeg",
    "TracedPlan",
    "TracedStream",
    "TracingConfigError",
    "active",
    "attach_headers",
    "configure_from_env",
    "exporters_from_env",
    "httpx_hooks",
    "install",
    "outbound",
    "parent_from_meta",
    "provider",
    "uninstall",
]

log = logging.getLogger("atp_router.observability.tracing")


class TracedStream(Protocol):
    """What the spans read of one open stream (the router's
    :class:`~atp_router.runtime.dataplane.stream.StreamCtx`; named structurally here, as this
    package imports no router module)."""

    @property
    def tenant(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def stream_id(self) -> str: ...
    @property
    def account(self) -> str: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...
    @property
    def qos(self) -> Any: ...
    @property
    def route(self) -> Any: ...  # atp_router.policy.fib.Route
    @property
    def gen(self) -> Any: ...  # the RIB generation (``.fib``), or None
    @property
    def window(self) -> Any: ...  # atp_router.flow.window.Window
    @property
    def log(self) -> Any: ...  # its EventLog (``.events[-1].frame.msg_seq``)
    @property
    def started(self) -> float: ...
    @property
    def closed_at(self) -> float | None: ...


class TracedLeg(Protocol):
    """What a leg's span reads of one attempt of one next-hop call (the
    router's :class:`~atp_router.runtime.dataplane.plan.LegOutcome`)."""

    @property
    def agent(self) -> str: ...
    @property
    def report(self) -> AgentReport | None: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def error(self) -> ATPError | None: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def cancelled(self) -> bool: ...
    @property
    def attempt(self) -> int: ...


class TracedPlan(Protocol):
    """What the consensus span reads of a task's plan (the router's
    :class:`~atp_router.runtime.dataplane.plan.TaskPlan`): its flow window."""

    @property
    def window(self) -> Any: ...

DEFAULT_SERVICE_NAME = "atp-router"
#: The instrumentation scope of the router's spans.
SCOPE = "atp_router.runtime"

_TRUE = {"true", "1", "yes", "on"}
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


class TracingConfigError(ValueError):
    """The ``OTEL_*`` variables ask for something the router cannot export with
    (an unknown exporter, the gRPC or JSON OTLP protocol); the message names the
    variable."""


# ------------------------------------------------------------------ configuration

_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def exporters_from_env(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the ``OTEL_*`` variables of ``environ`` ask for (module
    docstring): ``[]`` (tracing off), or some of ``"otlp"``, ``"console"``. Raises
    :class:`TracingConfigError` for an exporter or OTLP protocol the router has not."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ["otlp"] if endpoint else []
    else:
        names = [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]
    for n in names:
        if n not in ("otlp", "console"):
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: {n!r} is not an exporter of atp-router "
                                     "(otlp, console or none)")
    if "otlp" in names:
        proto = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                 or "http/protobuf").strip().lower()
        if proto != "http/protobuf":
            raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {proto!r} is not supported by atp-router "
                                     "(only http/protobuf)")
    return list(dict.fromkeys(names))


def configure_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install the SDK ``TracerProvider`` (resource, sampler and batch processor
    from the ``OTEL_*`` variables; service name ``atp-router`` unless
    ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` name one) when an
    exporter is configured, and return it; ``None`` (nothing installed, tracing
    off) otherwise. Called once per process, before any router is built. Raises
    :class:`TracingConfigError`."""
    import os

    env = os.environ if environ is None else environ
    names = exporters_from_env(env)
    if not names:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": DEFAULT_SERVICE_NAME})
    prov = TracerProvider(resource=resource)
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            prov.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            prov.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(prov)
    install(prov)
    log.info("tracing on: %s exporter%s", ", ".join(names), "s" if len(names) > 1 else "")
    return prov


def install(prov: TracerProvider) -> None:
    """Make the router's spans go to ``prov`` (routers built from now on trace).
    :func:`configure_from_env` calls it; tests and benches may call it with
    their own provider (the global OpenTelemetry provider is left alone)."""
    global _provider, _tracer
    _provider = prov
    _tracer = prov.get_tracer(SCOPE)


def uninstall() -> None:
    """Routers built from now on do not trace (their spans are not made)."""
    global _provider, _tracer
    _provider = _tracer = None


def provider() -> TracerProvider | None:
    """The provider the router's spans go to, ``None`` when tracing is off."""
    return _provider


def active() -> bool:
    """Is tracing on in this process?"""
    return _tracer is not None


# ------------------------------------------------------------------ propagation


def parent_from_meta(trace_meta: Any) -> otel_context.Context | None:
    """The remote parent a SYN's ``meta.trace`` names (module docstring), or
    ``None`` when it is absent or malformed."""
    if not isinstance(trace_meta, Mapping):
        return None
    carrier: dict[str, str] = {}
    tp = trace_meta.get("traceparent")
    parent = trace_meta.get("parent_span")
    if isinstance(tp, str):
        carrier["traceparent"] = tp
    elif isinstance(parent, str) and parent.count("-") == 3:
        carrier["traceparent"] = parent
    elif isinstance(parent, str):
        span_id = parent.removeprefix("spn_").lower()
        trace_id = trace_meta.get("trace_id")
        if not (isinstance(trace_id, str) and _HEX32.fullmatch(trace_id.lower()) and _HEX16.fullmatch(span_id)):
            return None
        flags = "00" if trace_meta.get("sampled") is False else "01"
        carrier["traceparent"] = f"00-{trace_id.lower()}-{span_id}-{flags}"
    else:
        return None
    state = trace_meta.get("tracestate")
    if isinstance(state, str):
        carrier["tracestate"] = state
    ctx = propagate.extract(carrier, context=otel_context.Context())
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def attach_headers(headers: Any) -> object | None:
    """Attach the trace context of request ``headers`` (name → value pairs, str
    or bytes, or a mapping) to the current task: what a stream opened from here
    takes as its parent when its SYN names none. Returns the token for
    ``opentelemetry.context.detach``; ``None`` when tracing is off or the
    headers carry no context."""
    if _tracer is None:
        return None
    items = headers.items() if isinstance(headers, Mapping) else headers
    carrier: dict[str, str] = {}
    for k, v in items:
        name = (k.decode("latin-1") if isinstance(k, bytes) else str(k)).lower()
        if name in ("traceparent", "tracestate"):
            carrier[name] = v.decode("latin-1") if isinstance(v, bytes) else str(v)
    if "traceparent" not in carrier:
        return None
    ctx = propagate.extract(carrier, context=otel_context.Context())
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return otel_context.attach(ctx)


class TraceContextMiddleware:
    """ASGI middleware: each HTTP request (the control API, the OpenAI ingress,
    the A2A server) runs with the trace context of its ``traceparent`` header
    attached, so a stream it opens is a child of the caller's span. Add it only
    when :func:`active` (it reads headers)."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        token = attach_headers(scope.get("headers") or ()) if scope.get("type") in ("http", "websocket") else None
        try:
            await self.app(scope, receive, send)
        finally:
            if token is not None:
                otel_context.detach(token)


#: The stream whose task runs in this trio task and its children (set by
#: :meth:`RouterTracing.running`).
_STREAM: contextvars.ContextVar[_StreamTrace | None] = contextvars.ContextVar("atp_stream_trace", default=None)


def outbound(agent: str) -> dict[str, str]:
    """The trace context headers (``traceparent``, ``tracestate``) to send with a
    request of next-hop ``agent``: its leg span's when called from a stream's
    task (the span starts now, with the request), else the current context's;
    ``{}`` when tracing is off."""
    if _tracer is None:
        return {}
    st = _STREAM.get()
    ctx = st.leg_context(agent) if st is not None else None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def httpx_hooks(agent: str) -> dict[str, list[Callable[..., Any]]]:
    """``event_hooks`` for an ``httpx.AsyncClient`` of next-hop ``agent``: every
    request carries :func:`outbound`'s headers. ``{}`` when tracing is off (no
    hook at all)."""
    if _tracer is None:
        return {}

    async def add_trace_headers(request: Any) -> None:
        request.headers.update(outbound(agent))

    return {"request": [add_trace_headers]}


# ------------------------------------------------------------------ the router's spans


def _ns() -> int:
    """Now, in ns since the epoch (OpenTelemetry's span times)."""
    return time.time_ns()


def _window_json(stats: Any) -> str:
    eff = stats.effective
    return msgspec.json.encode({
        "cwnd": round(stats.cwnd, 3), "ssthresh": round(stats.ssthresh, 3), "in_flight": stats.in_flight,
        "max_parallel": eff.max_parallel, "max_tokens": eff.max_tokens, "max_usd_micros": eff.max_usd_micros,
        "used_tokens": stats.used_tokens, "used_usd_micros": stats.used_usd_micros,
    }).decode()


@dataclass(slots=True)
class _Session:
    span: trace.Span
    context: otel_context.Context
    streams: int = 0


@dataclass(slots=True)
class _StreamTrace:
    """The spans of one stream (module docstring)."""

    owner: RouterTracing
    span: trace.Span
    context: otel_context.Context
    session_key: tuple[str, str]
    attrs: dict[str, Any]
    route: Any
    fib: Any = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    msg_seq: Callable[[], int] = lambda: 0
    #: Live leg spans (a request was sent), by agent.
    pending: dict[str, trace.Span] = field(default_factory=dict)
    #: Agents called, in order (route_path after the policy).
    called: list[str] = field(default_factory=list)
    first_stage_end: int = 0
    consensus: trace.Span | None = None
    escalation: trace.Span | None = None
    escalation_ctx: otel_context.Context | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    usd_micros: int = 0
    #: The stream's flow window when its task ended (compact JSON).
    window_state: str | None = None

    def _hop(self, agent: str) -> Any:
        route = self.route
        for hop in (*route.next_hops, *getattr(route, "alternates", ()), route.escalation_hop):
            if hop is not None and hop.agent == agent:
                return hop
        return self.fib.next_hop(agent, self.meta) if self.fib is not None else None

    def _is_escalation(self, agent: str) -> bool:
        if self.escalation is not None:
            return True  # once escalated, every later call is the escalation's (its retries, reroutes)
        hop = self.route.escalation_hop
        return hop is not None and hop.agent == agent and agent not in {h.agent for h in self.route.next_hops}

    def _escalate(self, start_ns: int) -> otel_context.Context:
        if self.escalation_ctx is None:
            tracer = self.owner.tracer
            begin = min(self.first_stage_end or start_ns, start_ns)
            self.consensus = tracer.start_span("atp.consensus", context=self.context, start_time=begin,
                                               attributes=self.attrs)
            esc = self.route.escalation
            self.escalation = tracer.start_span(
                "atp.escalation", context=trace.set_span_in_context(self.consensus), start_time=start_ns,
                attributes={**self.attrs, "agent": esc.to if esc is not None else ""})
            self.escalation_ctx = trace.set_span_in_context(self.escalation)
        return self.escalation_ctx

    def _leg_parent(self, agent: str, start_ns: int) -> otel_context.Context:
        return self._escalate(start_ns) if self._is_escalation(agent) else self.context

    def leg_context(self, agent: str) -> otel_context.Context:
        span = self.pending.get(agent)
        if span is None:
            now = _ns()
            span = self.pending[agent] = self.owner.tracer.start_span(
                "atp.leg", context=self._leg_parent(agent, now), kind=trace.SpanKind.CLIENT, start_time=now,
                attributes={**self.attrs, "agent": agent})
        return trace.set_span_in_context(span)

    def leg_done(self, out: TracedLeg) -> None:
        end = _ns()
        start = end - int(out.latency_ms * 1e6)
        span = self.pending.pop(out.agent, None)
        if span is None:
            span = self.owner.tracer.start_span("atp.leg", context=self._leg_parent(out.agent, start),
                                                kind=trace.SpanKind.CLIENT, start_time=start)
        if self.escalation is None:
            self.first_stage_end = max(self.first_stage_end, end)
        self.called.append(out.agent)
        u = out.usage
        self.tokens_in += u.in_tokens
        self.tokens_out += u.out_tokens
        self.usd_micros += u.usd_micros
        hop = self._hop(out.agent)
        attrs: dict[str, Any] = {
            **self.attrs, "agent": out.agent, "msg_seq": self.msg_seq(), "latency_ms": round(out.latency_ms, 3),
            "tokens_in": u.in_tokens, "tokens_out": u.out_tokens, "usd": u.usd_micros / 1e6,
            "atp.usd_micros": u.usd_micros,
        }
        # Each attribute costs CPU (built, then encoded): the usual values are left out.
        if out.attempt > 1:
            attrs["atp.attempt"] = out.attempt
        if hop is not None:
            attrs["model"] = hop.model or (f"tool:{hop.tool}" if hop.tool else "")
        if out.report is not None:
            if out.report.confidence is not None:
                attrs["confidence"] = out.report.confidence
            attrs["atp.findings"] = len(out.report.findings)
        ws = self.owner.agent_window(out.agent)
        if ws is not None:
            attrs["window_state"] = ws
        if out.cancelled:
            attrs["atp.cancelled"] = True
        if out.error is not None:
            attrs["atp.error_code"] = str(out.error.code)
            # A peer may echo what it was sent: the one scrubber, as for the ERROR frame.
            span.set_status(trace.Status(trace.StatusCode.ERROR, scrub(f"{out.error.code}: {out.error.reason}",
                                                                       max_chars=300)))
        span.set_attributes(attrs)
        span.end(end_time=end)

    def route_path(self) -> list[str]:
        return [self.route.policy, *self.called]

    def merged(self, final: FinalResult, triggers: list[str], window: Any) -> None:
        self.window_state = _window_json(window.statistics())
        result = final.result
        attrs: dict[str, Any] = {
            **self.attrs, "route_path": self.route_path(), "atp.consensus.strategy": result.consensus.strategy,
            "atp.consensus.agreement": result.consensus.agreement, "atp.consensus.findings": len(result.findings),
            "atp.escalated": self.escalation is not None,
        }
        if result.findings:
            attrs["confidence"] = round(sum(f.confidence for f in result.findings) / len(result.findings), 4)
        if triggers:
            attrs["atp.escalation.triggers"] = list(triggers)
        end = _ns()
        if self.escalation is not None:
            self.escalation.set_attributes({"atp.escalation.triggers": list(triggers)})
            self.escalation.end(end_time=end)
        if self.consensus is None:
            self.consensus = self.owner.tracer.start_span("atp.consensus", context=self.context,
                                                          start_time=self.first_stage_end or end)
        self.consensus.set_attributes(attrs)
        self.consensus.end(end_time=end)


class RouterTracing:
    """The spans of one :class:`~atp_router.runtime.router.Router` (module docstring). The
    router calls :meth:`stream_opened` at SYN, runs each task inside
    :meth:`running`, reports every leg (:meth:`leg`), the merge
    (:meth:`merged`) and the close (:meth:`stream_closed`). Memory: one entry
    per open stream and per session with open streams."""

    def __init__(self, tracer: trace.Tracer, *, agent_windows: Any = None):
        self.tracer = tracer
        self.agent_windows = agent_windows
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._streams: dict[str, _StreamTrace] = {}

    @classmethod
    def for_router(cls, *, agent_windows: Any = None) -> RouterTracing | None:
        """A :class:`RouterTracing` on the installed provider; ``None`` when
        tracing is off (:func:`active`)."""
        return cls(_tracer, agent_windows=agent_windows) if _tracer is not None else None

    def agent_window(self, agent: str) -> str | None:
        table = self.agent_windows
        if table is None or agent not in table.agents():
            return None
        return _window_json(table.window(agent).statistics())

    def stream_opened(self, ctx: TracedStream) -> dict[str, str]:
        """Start the stream's span (and its session's, when it is the session's
        first open stream) under the SYN's ``meta.trace``, else the ingress
        request's context. Returns the SYN+ACK's ``meta.trace``."""
        parent = parent_from_meta(ctx.meta.get("trace"))
        if parent is None:
            parent = otel_context.get_current()
        key = (ctx.tenant, ctx.session_id)
        sess = self._sessions.get(key)
        if sess is None:
            span = self.tracer.start_span("atp.session", context=parent, kind=trace.SpanKind.SERVER,
                                          attributes={"session_id": ctx.session_id, "atp.tenant": ctx.tenant})
            sess = self._sessions[key] = _Session(span, trace.set_span_in_context(span))
        sess.streams += 1
        links = []
        own = trace.get_current_span(parent).get_span_context()
        if own.is_valid and own.trace_id != sess.span.get_span_context().trace_id:
            links.append(trace.Link(own))  # a later stream of the session, from another client trace
        attrs = {"session_id": ctx.session_id, "stream_id": ctx.stream_id}
        route = ctx.route
        span = self.tracer.start_span("atp.stream", context=sess.context, links=links, attributes={
            **attrs, "atp.policy": route.policy, "atp.qos": str(ctx.qos)})
        st = _StreamTrace(self, span, trace.set_span_in_context(span), key, attrs, route,
                          fib=ctx.gen.fib if ctx.gen is not None else None, meta=ctx.meta,
                          msg_seq=lambda: _last_seq(ctx))
        self._streams[ctx.account] = st
        sc = span.get_span_context()
        return {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}

    def refused(self, tenant: str, session_id: str, stream_id: str, meta: Mapping[str, Any], code: Any,
                reason: str) -> None:
        """A SYN refused before its stream opened (authz, quota, bad meta, ESEC):
        one ``atp.stream`` span with an error status, under the client's context."""
        parent = parent_from_meta(meta.get("trace")) or otel_context.get_current()
        span = self.tracer.start_span("atp.stream", context=parent, kind=trace.SpanKind.SERVER, attributes={
            "session_id": session_id, "stream_id": stream_id, "atp.tenant": tenant, "atp.outcome": "refused",
            "atp.error_code": str(code)})
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {reason}"[:300]))
        span.end()

    @contextlib.contextmanager
    def running(self, ctx: TracedStream) -> Iterator[None]:
        """Run the stream's task with its span current: its legs, their requests
        and the log lines it writes carry the stream's trace."""
        st = self._streams.get(ctx.account)
        if st is None:
            yield
            return
        reset = _STREAM.set(st)
        token = otel_context.attach(st.context)
        try:
            yield
        finally:
            otel_context.detach(token)
            _STREAM.reset(reset)

    def leg(self, out: TracedLeg) -> None:
        """One attempt of one next-hop ended (the dispatcher's ``on_leg``)."""
        st = _STREAM.get()
        if st is not None and st.owner is self:
            st.leg_done(out)

    def merged(self, ctx: TracedStream, plan: TracedPlan, final: FinalResult, triggers: list[str]) -> None:
        """The FINAL is merged: the consensus span (and the escalation's) end."""
        st = self._streams.get(ctx.account)
        if st is not None:
            st.merged(final, triggers, plan.window)

    def stream_closed(self, ctx: TracedStream, *, outcome: str, code: str | None, usd_micros: int | None) -> None:
        """The stream ended (FIN or RST): its span ends, and its session's when no
        other stream of the session is open."""
        st = self._streams.pop(ctx.account, None)
        if st is None:
            return
        for span in st.pending.values():  # a call cut before the dispatcher saw its end
            span.end()
        if st.escalation is not None and st.escalation.is_recording():
            st.escalation.end()
        if st.consensus is not None and st.consensus.is_recording():
            st.consensus.end()
        attrs: dict[str, Any] = {
            "msg_seq": _last_seq(ctx), "route_path": st.route_path(), "tokens_in": st.tokens_in,
            "tokens_out": st.tokens_out, "usd": (usd_micros if usd_micros is not None else st.usd_micros) / 1e6,
            "atp.outcome": outcome, "latency_ms": round(((ctx.closed_at or ctx.started) - ctx.started) * 1000, 3),
        }
        attrs["window_state"] = st.window_state or msgspec.json.encode(ctx.window).decode()
        if code is not None:
            attrs["atp.error_code"] = code
        if outcome == "RST":
            st.span.set_status(trace.Status(trace.StatusCode.ERROR, code or "RST"))
        st.span.set_attributes(attrs)
        st.span.end()
        sess = self._sessions.get(st.session_key)
        if sess is not None:
            sess.streams -= 1
            if sess.streams <= 0:
                del self._sessions[st.session_key]
                sess.span.end()


def _last_seq(ctx: TracedStream) -> int:
    events = ctx.log.events
    return events[-1].frame.msg_seq if events else 0
