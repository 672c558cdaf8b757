"""The router: RIB/FIB, adapters, sessions and streams, wired to trio.

:class:`Router` owns the control plane (the running RIB compiled into a FIB, hot
reload) and the data plane (sessions, streams, dispatch). Ingresses — the
WebSocket server (:mod:`atp.router.ws`) and the HTTP control API
(:mod:`atp.router.api`) — only move frames: both feed inbound frames to a sans-IO
:class:`~atp.wire.session.Session` and send what the stream's
:class:`~atp.router.streams.EventLog` holds, so a stream behaves the same whichever
way it was opened.

Flow control (spec §5, §9, §10) is router-wide state in :class:`FlowGates`: one
AIMD window per next-hop agent with its class-ordered queue, the QoS slot
scheduler (gold / silver / bronze, bronze preempted with RST ``EPREEMPT``; it
also sees calls held up at a next-hop's window), the circuit breakers (their health feeds
the FIB lookup: an open circuit is excluded) and the retry policy. The budget
ledger has one account per client (``client:<name>``, limit from the RIB's
``clients`` section) and, under it, one per stream (``stream:<stream_id>``), so a
client's streams together never spend more than the client's budget.

Connections and streams (spec §8 resumption): a stream belongs to its client, not
to the connection that opened it. When its last follower (a WebSocket connection
or an SSE request) goes away — closed, or declared dead by the heartbeat watchdog
— the stream is *detached*: its task goes on, its events are logged, and for
``resume_grace_s`` the client may re-open it with the same idempotency key (WS
SYN, or ``POST /v1/streams``) and get the events it missed. A stream still
detached after the grace period is reset with ``ETIMEOUT`` (what its calls
streamed so far is committed).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from atp.adapters.base import Health, Prompt, ProviderAdapter
from atp.adapters.context import with_context_scope
from atp.adapters.registry import build_adapter
from atp.consensus.types import FinalResult
from atp.flow.breaker import BreakerBoard, RetryPolicy
from atp.flow.budget import Allowance, BudgetLedger
from atp.flow.qos import Preempt, QosScheduler
from atp.flow.window import Window as FlowWindow
from atp.flow.window import WindowTable
from atp.policy.fib import Fib, compile_fib
from atp.policy.loader import load_rib, load_rib_text
from atp.policy.rib import ClientSpec, Rib
from atp.review.diff import diff_loc, parse_diff
from atp.router.dispatch import Dispatcher, FlowGates, LegOutcome, SlotGate, TaskPlan
from atp.router.metrics import RouterMetrics
from atp.router.streams import EventLog
from atp.wire import session as S
from atp.wire.errors import (
    AgentError,
    ATPError,
    ErrorCode,
    LocalProtocolError,
    PolicyError,
)
from atp.wire.frame import (
    Budget,
    BudgetUpdate,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
    WindowUpdate,
)

log = logging.getLogger("atp.router")
#: Security audit trail (spec §11 "audit"): ESEC refusals.
audit = logging.getLogger("atp.audit")

#: Window granted when neither the client nor the policy set one (spec §15.1 defaults).
DEFAULT_WINDOW = Window(max_parallel=4, max_tokens=120_000, max_usd_micros=1_250_000)
#: Per-next-hop window of an agent without ``agents.<name>.window`` in the RIB.
DEFAULT_AGENT_WINDOW = Window(max_parallel=16, max_tokens=2_000_000, max_usd_micros=20_000_000)

_CLIENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_QOS_RANK = {QoS.GOLD: 0, QoS.SILVER: 1, QoS.BRONZE: 2}
#: Refused SYNs remembered for dropping their late frames (bounded memory).
_REFUSED_KEPT = 4096
_NO_CLIENT_SPEC = ClientSpec()


def parse_tokens_env(value: str) -> tuple[frozenset[str], dict[str, str]]:
    """``ATP_ROUTER_TOKENS``: comma-separated entries, each ``name:token`` (the
    client ``name`` of the RIB's ``clients`` section) or a bare token (the client
    ``tok_<sha256 prefix>``). Returns ``(bare tokens, {name: token})``. Raises
    ``ValueError`` on an empty name or token, a bad name (letters, digits,
    ``._-``, at most 64) or a name or token given twice."""
    bare: set[str] = set()
    named: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, token = entry.partition(":")
        if not sep:
            bare.add(entry)
            continue
        if not _CLIENT_NAME.match(name) or not token:
            raise ValueError(f"ATP_ROUTER_TOKENS entry {name!r}: expected name:token with a name of "
                             "letters, digits and ._- (at most 64)")
        if name in named:
            raise ValueError(f"ATP_ROUTER_TOKENS: client {name!r} given twice")
        named[name] = token
    if len(set(named.values()) | bare) != len(named) + len(bare):
        raise ValueError("ATP_ROUTER_TOKENS: the same token is given twice")
    return frozenset(bare), named


@dataclass
class RouterConfig:
    """Static configuration of one router process.

    Authentication (spec §11): ``tokens`` are accepted bearer tokens whose client
    is ``tok_<sha256 prefix>``; ``client_tokens`` maps client names (the RIB's
    ``clients`` keys) to their token. Both empty: authentication off, every
    caller is the client ``anonymous`` (a local appliance only). ``hmac_key``
    makes signed frames mandatory on the WebSocket ingress.

    Flow control (spec §5, §9, §10): ``window_update_interval_ms`` /
    ``window_update_delta`` are the WINDOW_UPDATE cadence (every N ms, or when
    the window moved by that fraction); ``agent_window`` the per-next-hop triplet
    of agents without their own; ``slots`` the router-wide number of next-hop
    calls in flight, ``gold_reserved`` of them for gold only; gold waiting
    ``preempt_after_ms`` for a slot preempts a bronze call (RST ``EPREEMPT``),
    ``gold_sla_ms`` is gold's queueing SLA; ``retry`` bounds retries;
    ``breaker_*`` configure the per-agent circuit breakers (failures within
    ``breaker_window_s`` that open it, first backoff and its cap in s).

    Liveness and resumption (spec §4.4 HB, §8): the WebSocket ingress sends HB
    every ``hb_interval_s`` and declares a connection dead after
    ``hb_timeout_s`` without a frame from it; a stream left without a follower
    stays resumable for ``resume_grace_s``. ``seed`` seeds backoff jitter
    (reproducible tests).
    """

    policies: Path
    host: str = "127.0.0.1"
    http_port: int = 7070
    ws_port: int = 7071
    tokens: frozenset[str] = frozenset()
    client_tokens: Mapping[str, str] = field(default_factory=dict)
    hmac_key: bytes | None = None
    retain_closed_s: float = 300.0
    max_streams: int = 10_000
    window_update_interval_ms: int = 1000
    window_update_delta: float = 0.2
    agent_window: Window = DEFAULT_AGENT_WINDOW
    slots: int = 64
    gold_reserved: int = 8
    gold_sla_ms: float = 2000.0
    preempt_after_ms: float = 250.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker_failures: int = 5
    breaker_window_s: float = 30.0
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 60.0
    hb_interval_s: float = 10.0
    hb_timeout_s: float = 30.0
    resume_grace_s: float = 60.0
    seed: int | None = None


@dataclass(eq=False)
class StreamCtx:
    """One stream inside the router; implements the dispatcher's ``StreamIO``."""

    router: Router
    session: S.Session
    stream_id: str
    client: str
    meta: dict[str, Any]
    qos: QoS
    window: Window
    budget: Budget
    route: Any
    started: float
    log: EventLog = field(default_factory=EventLog)
    task_started: bool = False
    closed_at: float | None = None
    cancel_scope: trio.CancelScope | None = None
    #: The RIB generation the stream was routed by at SYN; its task runs on it even
    #: after a reload (spec §22 hot reload).
    gen: Generation | None = None
    #: ``ttl`` the stream's task carries to next-hops: the SYN's, less this hop
    #: (:func:`~atp.wire.session.forward_ttl`, §4.2).
    ttl: int = 7
    #: Ledger account of the stream (its parent is the client's).
    account: str = ""
    #: Connections / SSE requests sending this stream's events right now.
    followers: int = 0
    #: When the last follower went away (None while followed, or never followed).
    detached_at: float | None = None
    #: The stream counts among the users of ``gen`` (its adapters stay open).
    holds_gen: bool = False

    @property
    def session_id(self) -> str:
        return self.session.session_id

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
            self.router._on_detached(self)

    # --- outbound (every frame goes through the session machine, then the log) ---
    def push(self, frames: Frame | list[Frame]) -> None:
        for f in frames if isinstance(frames, list) else [frames]:
            ev = self.log.append(f)
            self.router.metrics.frames.labels("out", ev.type).inc()
            if ev.type in ("FIN", "RST"):
                self._mark_closed()

    def _mark_closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
            self.router.metrics.open_streams.dec()
            self.router.open_count -= 1
            if not self.task_started:
                self.router._release_gen(self)  # else the task releases it when it ends

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
        self.router.metrics.errors.labels(str(code)).inc()
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
        self.router.metrics.errors.labels(str(code)).inc()
        self.push(self.session.reset(self.stream_id, code, reason))


@dataclass(frozen=True)
class Generation:
    """One compiled RIB with its adapters and dispatcher (swapped atomically on reload)."""

    version: int
    rib: Rib
    fib: Fib
    adapters: dict[str, ProviderAdapter]
    dispatcher: Dispatcher
    source: str


class Router:
    """One ATP router: control plane (RIB → FIB, reload) and data plane (sessions,
    streams, dispatch, flow control). Built synchronously; :meth:`serve` runs its
    background tasks."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        self.ledger = BudgetLedger()
        self.sessions: dict[str, S.Session] = {}
        self.streams: dict[str, StreamCtx] = {}
        #: Streams not yet closed (``streams`` also keeps closed ones for replay).
        self.open_count = 0
        #: session_id → the client that opened it: nobody else may send on it.
        self._owners: dict[str, str] = {}
        #: (client, idempotency key) → stream_id (spec §8 resumption).
        self.idempotency: dict[tuple[str, str], str] = {}
        self._nursery: trio.Nursery | None = None
        self._adapter_cache: dict[tuple[str, bytes], ProviderAdapter] = {}
        self._token_clients = {tok: name for name, tok in config.client_tokens.items()}
        self._clients: set[str] = set()
        self._detached: set[StreamCtx] = set()
        self._detached_changed = trio.Event()
        #: (session_id, stream_id) of SYNs refused lately: their late frames are dropped.
        self._refused: OrderedDict[tuple[str, str], None] = OrderedDict()
        rng = random.Random(config.seed)  # backoff jitter only
        self.gates = FlowGates(
            WindowTable(
                config.agent_window,
                update_interval_ms=config.window_update_interval_ms,
                update_delta=config.window_update_delta,
            ),
            SlotGate(
                QosScheduler(
                    config.slots,
                    gold_reserved=config.gold_reserved,
                    gold_sla_ms=config.gold_sla_ms,
                    preempt_after_ms=config.preempt_after_ms,
                ),
                self._on_preempt,
            ),
            BreakerBoard(
                failure_threshold=config.breaker_failures,
                window_s=config.breaker_window_s,
                base_backoff_s=config.breaker_backoff_s,
                max_backoff_s=config.breaker_max_backoff_s,
                rng=rng,
            ),
            config.retry,
            rng=rng,
        )
        #: Generations not yet retired (the running one and older ones streams still
        #: run on), and how many streams use each: adapters are closed when the
        #: last generation using them is retired (spec §22 hot reload).
        self._gens: dict[int, Generation] = {}
        self._gen_users: dict[int, int] = {}
        self._unclosed: list[tuple[str, ProviderAdapter]] = []  # dropped while not serving
        self.gen = self._compile(load_rib(config.policies), version=1, source=str(config.policies))
        self._gens[1] = self.gen
        self._activate(self.gen)
        self.metrics.rib_version.set(1)

    # ------------------------------------------------------------------ identity
    def authenticate(self, token: str | None) -> str | None:
        """The client a bearer token belongs to (spec §11): its RIB name
        (``ATP_ROUTER_TOKENS=name:token``), ``tok_<sha256 prefix>`` for a bare
        token, ``anonymous`` when authentication is off; ``None`` when refused."""
        if not self.config.tokens and not self._token_clients:
            return "anonymous"
        if token is None:
            return None
        name = self._token_clients.get(token)
        if name is not None:
            return name
        if token in self.config.tokens:
            return "tok_" + hashlib.sha256(token.encode()).hexdigest()[:12]
        return None

    def client_spec(self, client: str) -> ClientSpec:
        """The RIB's ``clients.<client>`` entry (defaults when absent)."""
        return self.gen.rib.clients.get(client, _NO_CLIENT_SPEC)

    def client_account(self, client: str) -> str:
        """The ledger account of ``client`` (opened with its RIB budget on first use)."""
        key = "client:" + client
        if client not in self._clients:
            budget = self.client_spec(client).budget
            self.ledger.open(key, Allowance.from_budget(budget) if budget is not None else Allowance())
            self._clients.add(client)
        return key

    # ------------------------------------------------------------------ control plane
    def _compile(self, rib: Rib, *, version: int, source: str) -> Generation:
        """RIB → FIB + adapters. Raises PolicyError without touching the running state."""
        fib = compile_fib(rib, version=version)
        adapters: dict[str, ProviderAdapter] = {}
        keys: dict[str, tuple[str, bytes]] = {}
        for name, agent in rib.agents.items():
            model = rib.models.get(agent.model) if agent.model else None
            # The window and fallback are the router's, not the adapter's: an edit
            # of them keeps the live adapter (and its connections).
            adapter_spec = msgspec.structs.replace(agent, window=None, fallback=None, data_scope=None)
            key = keys[name] = (name, msgspec.json.encode([adapter_spec, model]))
            adapter = self._adapter_cache.get(key)
            if adapter is None:
                try:
                    adapter = build_adapter(name, agent, model)
                except (ValueError, KeyError) as e:
                    raise PolicyError(source, f"agents.{name}", str(e)) from None
            adapters[name] = adapter
        for key, adapter in list(self._adapter_cache.items()):
            if adapters.get(key[0]) is not adapter:
                del self._adapter_cache[key]
        for name, adapter in adapters.items():
            self._adapter_cache[keys[name]] = adapter
        dispatcher = Dispatcher(
            adapters, self.ledger, win_rates={n: a.win30d for n, a in rib.agents.items()},
            gates=self.gates, on_leg=self._on_leg,
        )
        return Generation(version, rib, fib, adapters, dispatcher, source)

    def _activate(self, gen: Generation) -> None:
        """Adopt ``gen``'s per-agent windows, client budgets and agent set."""
        self.gates.agent_windows.configure({n: a.window for n, a in gen.rib.agents.items()})
        self.gates.wake_all()  # wider limits may admit calls waiting at a next-hop
        for client in self._clients:
            budget = gen.rib.clients.get(client, _NO_CLIENT_SPEC).budget
            # clamp: a budget lowered below what the client already spent stops it, never fails.
            self.ledger.set_limit("client:" + client, Allowance.from_budget(budget) if budget else Allowance(),
                                  clamp=True)
        for agent in self.gates.breakers.statistics():
            if agent not in gen.rib.agents:
                self.gates.breakers.forget(agent)

    def reload(self, text: str | None = None) -> dict[str, Any]:
        """Hot-reload the RIB from the configured path or from YAML ``text`` (§22).

        Returns ``{"version", "policies", "agents"}``. Raises :class:`PolicyError`
        (file, key, reason) and keeps the running RIB when the new one is refused.
        Streams already running finish on the generation they started with; an
        adapter the new RIB dropped (or rebuilt) is closed once no stream runs
        on a generation that uses it.
        """
        try:
            rib = load_rib_text(text, file="<request body>") if text is not None else load_rib(self.config.policies)
            gen = self._compile(rib, version=self.gen.version + 1, source="<request body>" if text else str(self.config.policies))
        except PolicyError:
            self.metrics.policy_reloads.labels("refused").inc()
            raise
        self.gen = gen
        self._gens[gen.version] = gen
        self._activate(gen)
        for version in [v for v in self._gens if v != gen.version and not self._gen_users.get(v)]:
            self._retire(version)
        self.metrics.policy_reloads.labels("ok").inc()
        self.metrics.rib_version.set(gen.version)
        log.info("RIB generation %d loaded from %s", gen.version, gen.source)
        return self.rib_summary()

    def _hold_gen(self, ctx: StreamCtx) -> None:
        if ctx.gen is not None and not ctx.holds_gen:
            ctx.holds_gen = True
            self._gen_users[ctx.gen.version] = self._gen_users.get(ctx.gen.version, 0) + 1

    def _release_gen(self, ctx: StreamCtx) -> None:
        """``ctx`` no longer uses its generation (its task ended, or it closed
        without one); the last user of a replaced generation retires it."""
        if not ctx.holds_gen or ctx.gen is None:
            return
        ctx.holds_gen = False
        v = ctx.gen.version
        left = self._gen_users[v] = self._gen_users[v] - 1
        if left == 0:
            del self._gen_users[v]
            if v != self.gen.version:
                self._retire(v)

    def _retire(self, version: int) -> None:
        """Forget a replaced generation nobody runs on and close its adapters
        that no live generation uses (a removed 2389 agent drops its broker
        connection, a changed model its HTTP pool)."""
        gen = self._gens.pop(version, None)
        if gen is None:
            return
        live = {id(a) for g in self._gens.values() for a in g.adapters.values()}
        for name, adapter in gen.adapters.items():
            if id(adapter) in live:
                continue
            live.add(id(adapter))  # close once, even if two names shared it
            log.info("agent %s dropped by RIB generation %d: adapter closed", name, self.gen.version)
            if self._nursery is not None:
                self._nursery.start_soon(self._close_adapter, name, adapter)
            else:
                self._unclosed.append((name, adapter))

    @staticmethod
    async def _close_adapter(name: str, adapter: ProviderAdapter) -> None:
        try:
            await adapter.aclose()
        except Exception:
            # A failing close must not take the router down; the adapter is gone anyway.
            log.exception("agent %s: closing its adapter failed", name)

    def rib_summary(self) -> dict[str, Any]:
        g = self.gen
        return {"version": g.version, "policies": len(g.rib.policies), "agents": sorted(g.rib.agents)}

    def _on_leg(self, out: LegOutcome) -> None:
        m = self.metrics
        m.agent_calls.labels(out.agent, "ok" if out.error is None else str(out.error.code)).inc()
        m.agent_latency.labels(out.agent).observe(out.latency_ms / 1000)
        m.tokens.labels(out.agent).inc(out.usage.tokens)
        m.usd_micros.labels(out.agent).inc(out.usage.usd_micros)

    # ------------------------------------------------------------------ data plane
    def session_for(self, session_id: str) -> S.Session:
        sess = self.sessions.get(session_id)
        if sess is None:
            # The router's sessions outlive connections (streams are resumable, §8),
            # so the session machine never declares its peer dead (hb_timeout
            # infinite): liveness is per connection, in the WebSocket ingress.
            sess = self.sessions[session_id] = S.Session(
                S.Role.ROUTER, session_id, now=trio.current_time(),
                hb_interval=self.config.hb_interval_s, hb_timeout=math.inf,
            )
        return sess

    def resume_point(self, frame: Frame, *, client: str) -> tuple[StreamCtx, int] | None:
        """Whether ``frame`` re-opens a stream (spec §8 Resumption), and from where.

        A SYN whose ``meta.idempotency_key`` names a stream ``client`` opened
        before (over WS or HTTP, still running or closed but retained) re-opens
        it: returns the stream and the event id to replay *after*. Without
        ``meta.resume_after`` everything is replayed, the SYN+ACK first (a client
        that lost its state starts over on the stream's original ids); with
        ``resume_after = N`` (the last router ``msg_seq`` the client received)
        only what followed message N. ``None``: not a resumption (a new key, a
        ttl-expired SYN, another client's key)."""
        if Flag.SYN not in frame.flags or frame.ttl == 0:
            return None
        key = frame.meta.get("idempotency_key")
        if not isinstance(key, str):
            return None
        sid = self.idempotency.get((client, key))
        ctx = self.streams.get(sid) if sid is not None else None
        if ctx is None or ctx.client != client:
            return None
        after = frame.meta.get("resume_after")
        if isinstance(after, int) and not isinstance(after, bool) and after >= 0:
            return ctx, ctx.log.after_message(after)
        return ctx, 0

    def receive_frame(self, frame: Frame, *, client: str, now: float) -> list[Frame]:
        """Feed one inbound frame (already decoded and verified) to its session.

        Returns frames that must be sent back immediately to this sender and are
        not part of any stream log (errors about unknown streams). Protocol errors
        reset only the stream concerned. A frame on a session another client
        opened is refused with an ERROR ``ESEC`` and touches nothing (spec §11).
        A SYN re-opening a stream by idempotency key (:meth:`resume_point`) is
        not fed to the session: the stream and its session state are unchanged.
        A SYN above the client's ``qos_max`` is served at ``qos_max`` (the
        SYN+ACK confirms the class, §8 step 2).

        A frame other than SYN on a stream of this session that the router
        closed (RST/FIN sent, or refused at SYN) and has freed is *late* — an
        ACK, FIN or control frame the client sent before it saw the close: it
        is dropped silently (counted as ``atp_frames{direction="dropped"}``),
        never answered with an RST, which would overtake the stream's own
        closing frame with a wrong cause. A late message (task data) is
        answered with a lone ERROR ``EPROTO`` (no RST) saying the stream is
        closed; the WebSocket ingress sends it after the stream's own frames.
        """
        self.metrics.frames.labels("in", _kind(frame)).inc()
        owner = self._owners.setdefault(frame.session_id, client)
        if owner != client:
            self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
            return [connection_error(frame.session_id, frame.stream_id, ErrorCode.ESEC,
                                     "session_id belongs to another client")]
        if Flag.SYN in frame.flags:
            if self.resume_point(frame, client=client) is not None:
                return []
            qos_max = self.client_spec(client).qos_max
            if _QOS_RANK[frame.qos] < _QOS_RANK[qos_max]:
                frame = msgspec.structs.replace(frame, qos=qos_max)
        sess = self.session_for(frame.session_id)
        if Flag.SYN not in frame.flags and self._closed_by_us(sess, frame.stream_id):
            return self._late_frame(frame)
        direct: list[Frame] = []

        def stream_of(stream_id: str) -> StreamCtx | None:
            # Stream ids are chosen by clients: only this session's stream is addressed.
            ctx = self.streams.get(stream_id)
            return ctx if ctx is not None and ctx.session is sess else None

        for ev in sess.receive_frame(frame, now):
            match ev:
                case S.StreamOpened():
                    # The session dropped a SYN at ttl 0; this hop takes one off the rest (§4.2).
                    self._on_syn(sess, ev, client=client, direct=direct, ttl=S.forward_ttl(frame).ttl)
                case S.MessageReceived():
                    ctx = stream_of(ev.stream_id)
                    if ctx is not None:
                        self._on_message(ctx, ev.payload)
                case S.ControlReceived():
                    ctx = stream_of(ev.stream_id)
                    if ctx is not None:
                        self._on_control(ctx, ev.control)
                case S.StreamFinished():
                    ctx = stream_of(ev.stream_id)
                    if ctx is not None and not ctx.task_started:
                        ctx.finish(None)
                case S.StreamReset():
                    ctx = stream_of(ev.stream_id)
                    if ctx is not None:
                        ctx.peer_reset()
                case S.ProtocolViolation():
                    # The session resets the stream (its RST follows in SendFrames):
                    # stop the task so it spends nothing more.
                    ctx = stream_of(ev.stream_id)
                    if ctx is not None and ctx.cancel_scope is not None:
                        ctx.cancel_scope.cancel()
                case S.SendFrames():
                    ctx = stream_of(ev.frames[0].stream_id) if ev.frames else None
                    if ctx is not None and not ctx.log.closed:
                        ctx.push(ev.frames)
                    else:
                        direct.extend(ev.frames)
                case _:
                    pass
        return direct

    def _closed_by_us(self, sess: S.Session, stream_id: str) -> bool:
        """``stream_id`` is a stream of ``sess`` the router closed and freed
        (retained for ``retain_closed_s``, or refused at SYN recently)."""
        if stream_id == S.HB_STREAM_ID or sess.stream_state(stream_id) is not S.StreamState.IDLE:
            return False
        ctx = self.streams.get(stream_id)
        if ctx is not None and ctx.session is sess:
            return ctx.log.closed
        return (sess.session_id, stream_id) in self._refused

    def _late_frame(self, frame: Frame) -> list[Frame]:
        self.metrics.frames.labels("dropped", _kind(frame)).inc()
        p = frame.payload
        if p is None or p.type is PayloadType.CONTROL:
            return []
        return [connection_error(frame.session_id, frame.stream_id, ErrorCode.EPROTO,
                                 f"stream is closed: message msg_seq={frame.msg_seq} not delivered")]

    def _health(self, gen: Generation) -> dict[str, Health]:
        """Live next-hop health for the FIB (spec §5.3, §6.2): the adapter's p95 and
        the worse of its and the breaker's error rate score the next-hop; the
        circuit breaker decides that it is down (open), and so does the adapter's
        own flag when it is ``live_health`` (it recovers by itself, e.g. a 2389
        agent re-announcing); other adapters' "unreachable" flags are not used:
        nothing would ever call them again to find them back, whereas an open
        breaker half-opens for a probe."""
        now = trio.current_time()
        out: dict[str, Health] = {}
        for name, adapter in gen.adapters.items():
            h = adapter.health()
            b = self.gates.breakers.health(name, now)
            up = b.up and (h.up or not adapter.live_health)
            out[name] = Health(p95_ms=h.p95_ms, error_rate=max(h.error_rate, b.error_rate), up=up)
        return out

    def _on_syn(self, sess: S.Session, ev: Any, *, client: str, direct: list[Frame], ttl: int) -> None:
        meta = dict(ev.meta)
        content = None
        if ev.payload is not None and ev.payload.type is PayloadType.TASK:
            content = ev.payload.content
        try:
            # Agent Context Protocol (atp.adapters.context): a bad meta.agent_context
            # is EPROTO naming the field; its secrets are registered for the log
            # filter; its policyContext labels join meta.data_scope for the FIB.
            meta = with_context_scope(meta)
            if isinstance(content, dict):
                _check_task(content)
                if "diff" in content and "diff_loc" not in meta:
                    meta["diff_loc"] = diff_loc(parse_diff(content["diff"]))
            if self.open_count >= self.config.max_streams:
                raise ATPError(ErrorCode.EWINDOW, f"router is at its limit of {self.config.max_streams} open streams")
            old = self.streams.get(ev.stream_id)
            if old is not None:
                if old.closed_at is None:
                    raise LocalProtocolError(ErrorCode.EPROTO, f"stream_id {ev.stream_id!r} is already in use")
                # A closed stream's id may be reused; its retained log is dropped.
                try:
                    self.ledger.close(old.account)
                except ValueError:
                    raise LocalProtocolError(
                        ErrorCode.EPROTO, f"stream_id {ev.stream_id!r} is still settling its spend; retry"
                    ) from None
                del self.streams[ev.stream_id]
            client_budget = _client_budget(meta)
            gen = self.gen
            route = gen.fib.lookup(meta, health=self._health(gen))
        except ATPError as e:
            self.metrics.errors.labels(str(e.code)).inc()
            if e.code is ErrorCode.ESEC:
                audit.warning("ESEC stream %s/%s of client %s refused: %s", sess.session_id, ev.stream_id, client,
                              e.reason)
            direct.append(sess.reset(ev.stream_id, e.code, e.reason))
            self._refused[(sess.session_id, ev.stream_id)] = None
            if len(self._refused) > _REFUSED_KEPT:
                self._refused.popitem(last=False)
            return
        window = _min_window(ev.window, route.window or DEFAULT_WINDOW)
        budget = _min_budget(client_budget, route.budget)
        qos = ev.qos if ev.qos is not None else (route.qos or QoS.SILVER)
        ctx = StreamCtx(self, sess, ev.stream_id, client, meta, qos, window, budget, route, trio.current_time(),
                        gen=gen, ttl=ttl, account="stream:" + ev.stream_id)
        self._hold_gen(ctx)
        self.streams[ev.stream_id] = ctx
        self.open_count += 1
        self.ledger.open(ctx.account, Allowance.from_budget(budget), parent=self.client_account(client))
        if ev.idempotency_key is not None:
            self.idempotency[(client, ev.idempotency_key)] = ev.stream_id
        self.metrics.streams_opened.labels(str(qos)).inc()
        self.metrics.open_streams.inc()
        synack = sess.accept(ev.stream_id, window)
        synack.meta["route"] = {
            "policy": route.policy,
            "next_hops": [h.agent for h in route.next_hops],
            "rib_version": gen.version,
        }
        ctx.push(synack)
        if content is not None:
            self._on_message(ctx, ev.payload)

    def _on_message(self, ctx: StreamCtx, payload: Payload) -> None:
        if payload.type is not PayloadType.TASK:
            ctx.emit_error(ErrorCode.EPROTO, f"router expects a task payload, got {payload.type}")
            return
        if ctx.task_started:
            ctx.emit_error(ErrorCode.EPROTO, "this stream already carries a task")
            return
        content = payload.content
        if isinstance(content, str):
            try:
                content = msgspec.json.decode(content)
            except msgspec.DecodeError as e:
                ctx.reset(ErrorCode.EPROTO, f"fragmented task body is not JSON: {e}")
                return
        try:
            _check_task(content)
        except LocalProtocolError as e:
            ctx.reset(e.code, e.reason)
            return
        ctx.task_started = True
        # Next-hops get the stream's meta with the hop-decremented ttl (§4.2): an
        # agent that is itself an ATP router forwards with it, and drops at 0.
        prompt = Prompt(task_type=str(ctx.meta.get("task_type", "")), content=content,
                        meta={**ctx.meta, "ttl": ctx.ttl})
        assert self._nursery is not None, "router is not serving"
        # The scope exists before the task runs, so an RST arriving first still stops it.
        ctx.cancel_scope = scope = trio.CancelScope()
        self._nursery.start_soon(self._run_task, ctx, prompt, ctx.gen or self.gen, scope)

    def _on_control(self, ctx: StreamCtx, control: Any) -> None:
        """BUDGET_UPDATE (spec §4.3) raises or lowers the stream's budget live, up to
        the policy's budget on each axis; a limit below what the stream already
        spent and holds is clamped to it (no further call is admitted)."""
        if isinstance(control, BudgetUpdate):
            b = _min_budget(control.budget, ctx.route.budget)
            self.ledger.set_limit(ctx.account, Allowance.from_budget(b), clamp=True)
            ctx.budget = b

    async def _run_task(self, ctx: StreamCtx, prompt: Prompt, gen: Generation, scope: trio.CancelScope) -> None:
        try:
            await self._run_task_on(ctx, prompt, gen, scope)
        finally:
            self._release_gen(ctx)

    async def _run_task_on(self, ctx: StreamCtx, prompt: Prompt, gen: Generation, scope: trio.CancelScope) -> None:
        cfg = self.config
        window = FlowWindow(ctx.window, update_interval_ms=cfg.window_update_interval_ms,
                            update_delta=cfg.window_update_delta)
        window.update_due(trio.current_time())  # the SYN+ACK carried this window
        plan = TaskPlan(
            prompt=prompt,
            route=ctx.route,
            window=window,
            ledger_key=ctx.account,
            stream_id=ctx.stream_id,
            qos=ctx.qos,
            started=ctx.started,
            deadline=ctx.started + ctx.route.deadline_ms / 1000,
            fib=gen.fib,
        )
        with scope:
            try:
                final = await gen.dispatcher.run(ctx, plan)
            except AgentError as e:
                self.metrics.streams_closed.labels(str(e.code)).inc()
                if e.code is ErrorCode.EBUDGET:
                    # Spec §10: EBUDGET → FIN (the ERROR says why, the FIN ends it cleanly).
                    ctx.emit_error(e.code, e.reason)
                    ctx.finish(None)
                else:
                    ctx.reset(e.code, e.reason)
                return
            except Exception:
                # A fault in one stream's task must not take the appliance down.
                log.exception("stream %s: task failed", ctx.stream_id)
                self.metrics.streams_closed.labels("internal").inc()
                ctx.reset(ErrorCode.EAGENTDOWN, "internal router error while running the task")
                return
            self.metrics.agreement.observe(final.result.consensus.agreement)
            self.metrics.stream_latency.observe(final.telemetry.latency_ms / 1000)
            for t in gen.dispatcher.last_triggers:
                self.metrics.escalations.labels(t).inc()
            self.metrics.streams_closed.labels("final").inc()
            ctx.finish(final)
        if scope.cancelled_caught:
            self.metrics.streams_closed.labels("rst").inc()

    def _on_preempt(self, p: Preempt) -> None:
        """The QoS scheduler preempts a bronze call (spec §9): RST the stream with
        ``EPREEMPT`` and stop its task (its slot goes to the waiting gold call)."""
        ctx = self.streams.get(p.stream_id)
        if ctx is None or ctx.log.closed:
            if p.running:
                self.gates.slots.cancel(p.ticket)
            return
        log.info("stream %s preempted: %s", p.stream_id, p.reason)
        ctx.reset(p.code, p.reason)
        if ctx.cancel_scope is not None:
            ctx.cancel_scope.cancel()

    def _on_detached(self, ctx: StreamCtx) -> None:
        self._detached.add(ctx)
        self._detached_changed.set()

    # ------------------------------------------------------------------ HTTP helpers
    def open_stream(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                    qos: QoS | None, window: Window | None, idempotency_key: str | None, client: str) -> StreamCtx:
        """Open a stream for the HTTP API by synthesising the client's SYN frame.

        The same ``idempotency_key`` (per client) returns the stream it opened
        before — over HTTP or WebSocket — without a second task or charge (§8).
        Raises :class:`ATPError` with the code the SYN was reset with.
        """
        if idempotency_key is not None:
            sid = self.idempotency.get((client, idempotency_key))
            if sid is not None and sid in self.streams:
                return self.streams[sid]
        session_id = "sess_" + secrets.token_hex(8)
        stream_id = "task_" + secrets.token_hex(8)
        meta = dict(task)
        if budget is not None:
            meta["budget"] = msgspec.to_builtins(budget)
        if idempotency_key is not None:
            meta["idempotency_key"] = idempotency_key
        syn = Frame(
            v=1, session_id=session_id, stream_id=stream_id, msg_seq=0, flags=[Flag.SYN],
            qos=qos or QoS.SILVER, window=window, meta=meta,
            payload=Payload(type=PayloadType.TASK, content=content) if content is not None else None,
        )
        direct = self.receive_frame(syn, client=client, now=trio.current_time())
        ctx = self.streams.get(stream_id)
        if ctx is None:
            err = _error_of(direct)
            raise ATPError(err.code if err else ErrorCode.EPROTO, err.reason if err else "stream refused")
        return ctx

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the router's background work (stream tasks, QoS preemption, the
        resumption grace period, the reaper) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._reaper)
            nursery.start_soon(self.gates.slots.run)
            nursery.start_soon(self._grace_reaper)
            for name, adapter in self._unclosed:
                nursery.start_soon(self._close_adapter, name, adapter)
            self._unclosed.clear()
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                with trio.CancelScope(shield=True):
                    live = {id(a): (n, a) for g in self._gens.values() for n, a in g.adapters.items()}
                    for name, adapter in live.values():
                        await self._close_adapter(name, adapter)

    async def _grace_reaper(self) -> None:
        """Reset streams left detached for ``resume_grace_s`` (spec §8: the client
        did not come back), with ``ETIMEOUT``; their task stops, spend so far
        is committed."""
        grace = self.config.resume_grace_s
        while True:
            now = trio.current_time()
            due = math.inf
            for ctx in list(self._detached):
                if ctx.log.closed or ctx.detached_at is None:
                    self._detached.discard(ctx)
                elif now >= ctx.detached_at + grace:
                    self._detached.discard(ctx)
                    log.info("stream %s: client gone for %g s, reset", ctx.stream_id, now - ctx.detached_at)
                    ctx.reset(ErrorCode.ETIMEOUT, f"client gone: stream not resumed within {grace:g} s")
                    if ctx.cancel_scope is not None:
                        ctx.cancel_scope.cancel()
                else:
                    due = min(due, ctx.detached_at + grace)
            with trio.move_on_at(due):
                await self._detached_changed.wait()
            self._detached_changed = trio.Event()

    async def _reaper(self) -> None:
        while True:
            await trio.sleep(min(self.config.retain_closed_s, 30.0))
            now = trio.current_time()
            for sid, ctx in list(self.streams.items()):
                if ctx.closed_at is not None and now - ctx.closed_at > self.config.retain_closed_s:
                    try:
                        self.ledger.close(ctx.account)
                    except ValueError:
                        continue  # a cancelled leg has not committed yet: next round
                    del self.streams[sid]
            for key, sid in list(self.idempotency.items()):
                if sid not in self.streams:
                    del self.idempotency[key]
            live = {ctx.session_id for ctx in self.streams.values()}
            for session_id in [s for s in self.sessions if s not in live]:
                del self.sessions[session_id]
                self._owners.pop(session_id, None)


def connection_error(session_id: str, stream_id: str, code: ErrorCode, reason: str) -> Frame:
    """An ERROR (spec §10) outside any session's sequence: for a frame the router
    could not attribute to a stream of the sender (undecodable, or another
    client's session). ``stream_id`` ``"0"`` means the connection itself."""
    return Frame(
        v=1, session_id=session_id, stream_id=stream_id, msg_seq=0, flags=[Flag.CTRL],
        payload=Payload(type=PayloadType.CONTROL, content=ErrorPayload(code=code, reason=reason)),
    )


def _check_task(content: Any) -> None:
    """The task body fields the router itself reads (``diff`` for ``diff_loc``,
    ``files`` for consensus evidence) must have their documented shapes:
    ``{"diff": str, "files": {path: text}}``. Raises LocalProtocolError(EPROTO)."""
    if not isinstance(content, dict):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content must be an object")
    diff = content.get("diff")
    if diff is not None and not isinstance(diff, str):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content.diff must be a string (a unified diff)")
    files = content.get("files")
    if files is not None and not (
        isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content.files must map paths to file text")


def _kind(frame: Frame) -> str:
    for f in (Flag.SYN, Flag.RST, Flag.FIN, Flag.HB, Flag.CTRL, Flag.ACK):
        if f in frame.flags:
            return f.value
    return "DATA"


def _error_of(frames: list[Frame]) -> ErrorPayload | None:
    for f in frames:
        if f.payload is not None and f.payload.type is PayloadType.CONTROL:
            c = f.payload.content
            if isinstance(c, ErrorPayload):
                return c
            if isinstance(c, dict) and c.get("kind") == "ERROR":
                return msgspec.convert(c, ErrorPayload)
    return None


def _min_window(a: Window | None, b: Window) -> Window:
    if a is None:
        return b
    return Window(
        max_parallel=min(a.max_parallel, b.max_parallel),
        max_tokens=min(a.max_tokens, b.max_tokens),
        max_usd_micros=min(a.max_usd_micros, b.max_usd_micros),
    )


def _client_budget(meta: dict[str, Any]) -> Budget | None:
    b = meta.get("budget")
    if b is None:
        return None
    try:
        return msgspec.convert(b, Budget)
    except msgspec.ValidationError as e:
        raise LocalProtocolError(ErrorCode.EPROTO, f"meta.budget: {e}") from None


def _min_budget(client: Budget | None, policy: Any) -> Budget:
    """The tighter of the client's and the policy's budget on each axis."""
    pu = getattr(policy, "usd", None) if policy is not None else None
    pt = getattr(policy, "tokens", None) if policy is not None else None
    cu = client.usd if client is not None else None
    ct = client.tokens if client is not None else None
    usd = min((x for x in (pu, cu) if x is not None), default=None)
    tokens = min((x for x in (pt, ct) if x is not None), default=None)
    return Budget(usd=usd, tokens=tokens)
