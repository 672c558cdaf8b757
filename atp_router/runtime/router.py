"""The router: the control plane, the stream table and the data plane, composed.

:class:`Router` is thin; the parts it composes are split the agentgateway way:

==============================================  ==============================================
:mod:`atp_router.runtime.controlplane.control`  control plane: the running RIB compiled into a
                                                FIB, its generations, hot reload (§22), the
                                                next-hop adapters and their retirement
:mod:`atp_router.runtime.dataplane.streams`     stream table keyed by (tenant, session_id,
                                                stream_id): lifecycle, idempotency, resumption,
                                                retention, grace and idle expiry
:mod:`atp_router.runtime.dataplane.opening`     the SYN pipeline: a list of named stages
                                                (context scope, task shape, stream slot,
                                                client budget, tenant admission, route,
                                                bandit, budget open), each continuing or
                                                refusing; ``Router(syn_stages=...)``
:mod:`atp_router.runtime.deployment`            what a deployment mode (:mod:`atp_router.deploy`)
                                                gives the router it assembles: its durable
                                                state (store, audit chain, ledger),
                                                background services, gates on the SYN path
this module                                     identity (:meth:`Router.authenticate`, one call
                                                for every ingress), authorization
                                                (:meth:`Router.authorize`), and the data plane:
                                                frames in (:meth:`Router.receive_frame`), a SYN
                                                through the stages then opened or reset, a
                                                task's outcome acted on (emitted, signed,
                                                audited, learnt from)
:mod:`atp_router.runtime.dataplane.runner`      running a stream's task: its plan, the data
                                                scope, the dispatcher; returns a TaskOutcome
==============================================  ==============================================

Ingresses — the WebSocket server (:mod:`atp_router.runtime.ingress.ws`), the HTTP control API
(:mod:`atp_router.runtime.ingress.http_api`) and the A2A server (:mod:`atp_router.runtime.ingress.a2a`) —
authenticate once per connection or request, check the action with
:meth:`Router.authorize`, and only move frames: they feed inbound frames to the
sans-IO :class:`~atp_router.wire.session.Session` of the caller's tenant and send what
the stream's :class:`~atp_router.runtime.dataplane.eventlog.EventLog` holds, so a stream behaves the
same whichever way it was opened.

Tenants (spec §11): every :class:`~atp_router.security.identity.Identity` names a
tenant — the RIB's ``clients.<tenant>``, whose budget and ``qos_max`` apply.
Sessions and streams are the tenant's: the same client-chosen ids in two tenants
are two unrelated streams, and no lookup crosses tenants.

Flow control (spec §5, §9, §10) is router-wide state in :class:`FlowGates`: one
AIMD window per next-hop agent with its class-ordered queue, the QoS slot
scheduler (gold / silver / bronze, bronze preempted with RST ``EPREEMPT``; it
also sees calls held up at a next-hop's window), the circuit breakers (their health feeds
the FIB lookup: an open circuit is excluded) and the retry policy. The budget
ledger has one account per tenant (``client:<name>``, limit from the RIB's
``clients`` section) and, under it, one per stream
(:func:`~atp_router.runtime.dataplane.stream.stream_account`), so a tenant's streams together
never spend more than its budget.

Connections and streams (spec §8 resumption): a stream belongs to its tenant, not
to the connection that opened it. When its last follower (a WebSocket connection
or an SSE request) goes away — closed, or declared dead by the heartbeat watchdog
— the stream is *detached*: its task goes on, its events are logged, and for
``resume_grace_s`` the tenant may re-open it with the same idempotency key (WS
SYN, or ``POST /v1/streams``) and get the events it missed. A stream still
detached after the grace period is reset with ``ETIMEOUT`` (what its calls
streamed so far is committed), and so is a stream opened without a task that
gets none within ``idle_task_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.http import install_secret_resolver
from atp_router.adapters.tools.sandbox import forbid_paths
from atp_router.consensus.types import FinalResult, SignedUsage
from atp_router.flow.body_budget import BodyBudget
from atp_router.flow.breaker import (
    BreakerBoard,
    BreakerState,
    BreakerTransition,
    RetryPolicy,
)
from atp_router.flow.budget import Allowance, BudgetLedger, usd_to_micros
from atp_router.flow.qos import Preempt, QosScheduler
from atp_router.flow.window import WindowTable
from atp_router.observability.metrics import RouterMetrics
from atp_router.observability.tracing import RouterTracing
from atp_router.policy.rib import ClientSpec, RateSpec
from atp_router.runtime.controlplane.control import ControlPlane, Generation
from atp_router.runtime.controlplane.learning import Learning, LearnLimits, has_tenants
from atp_router.runtime.dataplane import memory
from atp_router.runtime.dataplane.cache import (
    DEFAULT_MAX_BYTES as DEFAULT_CACHE_MAX_BYTES,
)
from atp_router.runtime.dataplane.cache import ResponseCache
from atp_router.runtime.dataplane.gates import FlowGates, SlotGate
from atp_router.runtime.dataplane.opening import (
    DEFAULT_STAGES,
    OpenCtx,
    OpenParts,
    Stage,
    StageType,
    check_task,
    min_budget,
    run_stages,
)
from atp_router.runtime.dataplane.plan import LegOutcome, TaskPlan
from atp_router.runtime.dataplane.runner import TaskOutcome, plan_task, run_task
from atp_router.runtime.dataplane.stream import Closed, StreamCtx
from atp_router.runtime.dataplane.streams import (
    DEFAULT_RETAIN_CLOSED_BYTES,
    StreamTable,
)
from atp_router.runtime.deployment import Service, StateParts, SynGate
from atp_router.security.audit import AuditLog, AuditOptions
from atp_router.security.authn import (
    Authenticator,
    EnvToken,
    load_auth_config,
    parse_tokens_env,
)
from atp_router.security.authz import (
    Action,
    Forbidden,
    Refuse,
    StreamAdmission,
    authorize,
    clamp_qos,
)
from atp_router.security.identity import Identity, Role
from atp_router.security.policy_guard import PolicySecrets, egress_changes
from atp_router.security.redact import DataScopeGuard
from atp_router.security.redact import warm as redact_warm
from atp_router.security.signing import DurableReplayGuard, UsageSigner
from atp_router.security.tls import ServerTls
from atp_router.store import Store, StoreUnavailable
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.errors import (
    ATPError,
    ErrorCode,
    LocalProtocolError,
    PolicyError,
)
from atp_router.wire.frame import (
    Budget,
    BudgetUpdate,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
)

__all__ = [
    "ACTIONS",
    "Generation",
    "Router",
    "RouterConfig",
    "StreamCtx",
    "build_authenticator",
    "connection_error",
]

log = logging.getLogger("atp_router.runtime")
#: Security audit trail (spec §11 "audit"): ESEC refusals.
audit = logging.getLogger("atp.audit")
#: The log level of an audit record's log line. Every record is in the audit trail
#: (the store, ``atp-router audit show``); the routine ones — a stream opened or
#: closed, a window changed, an escalation, feedback, a shadow run: several a task —
#: are logged at DEBUG only, because each log line is scanned for secrets (~0.8 ms,
#: a fifth of a task's CPU at 140 tasks/s, issue 10). Security events stay WARNING.
_AUDIT_LOG_LEVEL = {"session_open": logging.DEBUG, "session_close": logging.DEBUG,
                    "window_change": logging.DEBUG, "escalation": logging.INFO, "feedback": logging.DEBUG,
                    "shadow": logging.DEBUG}

#: Window granted when neither the client nor the policy set one (spec §15.1 defaults).
DEFAULT_WINDOW = Window(max_parallel=4, max_tokens=120_000, max_usd_micros=1_250_000)
#: Per-next-hop window of an agent without ``agents.<name>.window`` in the RIB.
DEFAULT_AGENT_WINDOW = Window(max_parallel=16, max_tokens=2_000_000, max_usd_micros=20_000_000)

#: The ingresses' action names → :class:`~atp_router.security.authz.Action`.
ACTIONS: Mapping[str, Action] = {a.name.lower(): a for a in Action}


@dataclass
class RouterConfig:
    """Static configuration of one router process.

    Authentication (spec §11, :func:`build_authenticator`): ``auth_file`` is the
    ``--auth`` YAML (API-key hashes, JWT/JWKS, mTLS identities,
    :mod:`atp_router.security.authn`); ``tokens_env`` the value of ``ATP_ROUTER_TOKENS``;
    ``tokens`` are further bare bearer tokens (tenant ``tok_<sha256 prefix>``) and
    ``client_tokens`` maps tenant names (the RIB's ``clients`` keys) to a token,
    ``client_roles`` their roles (default ``client``). Nothing configured:
    authentication off, every caller is the tenant ``anonymous`` with every role
    (a local appliance only). ``keyring`` (or the legacy single ``hmac_key``)
    makes signed frames with a nonce and timestamp mandatory (§11;
    :class:`~atp_router.security.signing.DurableReplayGuard`: nonces kept in the store, so
    a replay after a restart, on another worker or router is refused too).

    Tenant scopes (spec §11 AuthZ): a tenant without ``clients.<tenant>.max_streams``
    / ``rate`` in the RIB may have ``tenant_max_streams`` streams open and open
    ``tenant_rate_per_s`` streams per second (bursts of ``tenant_rate_burst``).
    ``policy_secrets`` are the env vars a RIB may reference
    (:class:`~atp_router.security.policy_guard.PolicySecrets`; None: none). Bodies:
    ``max_body_bytes`` per HTTP request (streams, frames), ``max_policy_bytes`` per
    policy body, ``max_ws_message_bytes`` per WebSocket message (after
    inflation when ``ws_deflate`` negotiated permessage-deflate, RFC 7692: on
    by default, used only when the client offers it). ``tls`` serves
    both ingresses over TLS 1.3 (HTTPS, WSS; mTLS identities on WSS).

    Durable state (:mod:`atp_router.store`): ``state_dir`` holds the SQLite store (budget
    ledgers, streams and their events, the active RIB, the audit chain); None is a
    private temporary directory removed at shutdown (the same code path, nothing
    kept). ``state_sync`` ``"NORMAL"`` survives a process crash, ``"FULL"`` an OS
    crash too. Closed streams stay in the store ``state_retain_s`` (default 7 days).
    The response cache of the policies with a ``cache`` key (spec §13,
    :mod:`atp_router.runtime.dataplane.cache`) keeps at most ``cache_max_bytes`` bytes of answers
    there (0: no policy caches).

    Flow control (spec §5, §9, §10): ``window_update_interval_ms`` /
    ``window_update_delta`` are the WINDOW_UPDATE cadence (every N ms, or when
    the window moved by that fraction); ``agent_window`` the per-next-hop triplet
    of agents without their own; ``slots`` the router-wide number of next-hop
    calls in flight, ``gold_reserved`` of them for gold only; gold waiting
    ``preempt_after_ms`` for a slot preempts a bronze call (RST ``EPREEMPT``),
    ``gold_sla_ms`` is gold's queueing SLA; ``retry`` bounds retries;
    ``breaker_*`` configure the per-agent circuit breakers (failures within
    ``breaker_window_s`` that open it, first backoff and its cap in s).

    Stream table (spec §8): at most ``max_streams`` open streams router-wide; a
    closed stream stays in memory for ``retain_closed_s``, each tenant keeps at
    most ``retain_closed_max`` closed streams there and the router at most
    ``retain_closed_bytes`` bytes of closed logs (the oldest go first); reads of
    a stream no longer in memory are served from the state store. With
    ``idle_trim`` the router gives freed memory back to the OS when no stream is
    open (:func:`atp_router.runtime.dataplane.memory.trim`, at most every 10 s). A stream
    opened without a task that gets none within ``idle_task_s`` is reset with
    ``ETIMEOUT``.

    Liveness and resumption (spec §4.4 HB, §8): the WebSocket ingress sends HB
    every ``hb_interval_s`` and declares a connection dead after
    ``hb_timeout_s`` without a frame from it; a stream left without a follower
    stays resumable for ``resume_grace_s``. ``seed`` seeds backoff jitter
    and the bandits' draws (reproducible tests).

    Learning (spec §6.2): each tenant's tasks move the shared routing state
    (live quality and latency, bandit weights) at most ``learn_rate_per_s``
    tasks per second with bursts of ``learn_burst`` (a token bucket): one
    tenant's traffic cannot outvote the others'. Client feedback is scoped by
    the RIB (``clients.<t>.feedback``).

    Hot reload (spec §22): with ``watch_policies`` the ``policies`` path is
    watched (watchfiles) and every change of a ``*.yaml``/``*.yml`` file in it
    reloads the RIB as ``POST /v1/policies/reload`` does (a refused RIB is
    logged with every fault and audited; the running one stays), after
    ``watch_debounce_ms`` without further change.
    """

    policies: Path
    host: str = "127.0.0.1"
    http_port: int = 7070
    ws_port: int = 7071
    tokens: frozenset[str] = frozenset()
    client_tokens: Mapping[str, str] = field(default_factory=dict)
    client_roles: Mapping[str, frozenset[Role]] = field(default_factory=dict)
    auth_file: Path | None = None
    tokens_env: str | None = None
    hmac_key: bytes | None = None
    keyring: KeyRing | None = None
    tenant_max_streams: int = 1000
    tenant_rate_per_s: float = 50.0
    tenant_rate_burst: int = 100
    policy_secrets: PolicySecrets | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_policy_bytes: int = 1024 * 1024
    max_ws_message_bytes: int = 16 * 1024 * 1024
    ws_deflate: bool = True
    #: Bytes of request bodies a tenant may have in flight at once, every ingress
    #: together (atp_router.flow.body_budget; None: twice the larger body limit).
    tenant_body_bytes: int | None = None
    #: A WebSocket connection must finish its upgrade (and TLS) within this, s;
    #: at most ``ws_pending_per_peer`` such connections per peer address (atp_router.runtime.ingress.ws_gate).
    ws_handshake_timeout_s: float = 10.0
    ws_pending_per_peer: int = 32
    tls: ServerTls | None = None
    state_dir: Path | None = None
    state_sync: str = "NORMAL"
    state_retain_s: float = 7 * 24 * 3600.0
    retain_closed_s: float = 300.0
    retain_closed_max: int = 1000
    retain_closed_bytes: int = DEFAULT_RETAIN_CLOSED_BYTES
    #: Give freed memory back to the OS when no stream is open (atp_router.runtime.dataplane.memory).
    idle_trim: bool = True
    max_streams: int = 10_000
    idle_task_s: float = 30.0
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
    watch_policies: bool = False
    watch_debounce_ms: int = 300
    learn_rate_per_s: float = 10.0
    learn_burst: int = 200
    #: The most of a shared statistic's quality weight one tenant may hold
    #: (atp_router.policy.learn.TenantShares; 1.0: no cap).
    learn_share: float = 0.25
    #: A local checkout the router reads the after-diff files of a diff-only task
    #: from (``--repo``; the A2A server's plain-text diffs), confined to its root.
    repo: Path | None = None
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    #: Bytes of the response cache one tenant's answers may hold (None: a quarter of ``cache_max_bytes``).
    cache_tenant_max_bytes: int | None = None
    #: The store several routers share (issue 12, atp_router.deploy.cluster): ``"sqlite"``
    #: (the embedded one in ``state_dir``, this router alone) or a ``redis://``,
    #: ``rediss://`` or ``unix://`` URL; its keys live under ``store_namespace``.
    store: str = "sqlite"
    store_namespace: str = "atp"
    #: A cluster router's lease in the shared store, ms: it is settled by the others
    #: this long after its last heartbeat (every ``lease_ms / 5``).
    lease_ms: int = 5000
    #: The URL the other routers reach this one's HTTP API on (None: from the bound host and port).
    advertise_url: str | None = None
    #: The audit key's file, the anchor file and syslog sink of the checkpoints (atp_router.security.audit).
    audit: AuditOptions = field(default_factory=AuditOptions)


class Router:
    """One ATP router: the control plane (:attr:`control`), the stream table
    (:attr:`streams`) and the data plane (frames, SYNs, tasks, flow control).
    Built synchronously (raises :class:`~atp_router.wire.errors.PolicyError` if the RIB
    is refused); :meth:`serve` runs its background tasks. ``authenticator``
    replaces the one :func:`build_authenticator` makes from ``config``;
    ``syn_stages`` the SYN pipeline's stage types (default
    :data:`~atp_router.runtime.dataplane.opening.DEFAULT_STAGES`; a deployment mode or a test
    adds or replaces one with :func:`~atp_router.runtime.dataplane.opening.insert_stage` /
    :func:`~atp_router.runtime.dataplane.opening.replace_stage`), built into :attr:`syn_stages`.

    What is not the data plane's own comes from the deployment mode that
    assembles it (:mod:`atp_router.deploy`; :mod:`atp_router.runtime.deployment`): ``state``
    (:class:`~atp_router.runtime.deployment.StateParts`: the store, audit chain and
    budget ledger, how they are restored into the router and closed),
    ``services`` (:data:`~atp_router.runtime.deployment.Service`: more background
    loops, e.g. following a RIB another router process loaded),
    ``rib_version`` (the version a reload gets, e.g. a store-wide one; None:
    the next one of this router), ``syn_gates``
    (:class:`~atp_router.runtime.deployment.SynGate`: a SYN refused before its
    session sees it, a keyed SYN that must not resume here; called by
    :meth:`receive_frame` and :meth:`resume_point`), ``store_refusal`` (how
    :meth:`open_stream` refuses an open the store could not take:
    ``(operation, error) -> ATPError``; None: the error propagates) and
    ``metrics`` (its :class:`~atp_router.observability.metrics.RouterMetrics`, when
    its parts report there before the router exists; default: new ones)."""

    def __init__(self, config: RouterConfig, state: StateParts, *, authenticator: Authenticator | None = None,
                 syn_stages: Sequence[StageType] = DEFAULT_STAGES, services: Sequence[Service] = (),
                 rib_version: Callable[[], int] | None = None, syn_gates: Sequence[SynGate] = (),
                 store_refusal: Callable[[str, StoreUnavailable], ATPError] | None = None,
                 metrics: RouterMetrics | None = None):
        self.config = config
        self.services = tuple(services)
        self.rib_version = rib_version
        #: The deployment's hooks on the SYN path, in order (atp_router.runtime.deployment.SynGate).
        self.syn_gates = tuple(syn_gates)
        self.store_refusal = store_refusal
        self.metrics = metrics if metrics is not None else RouterMetrics()
        #: Data-scope redaction and refusal at dispatch (spec §11), one for every stream.
        self.scope_guard = DataScopeGuard()
        #: The durable state its deployment mode opened (atp_router.runtime.deployment, atp_router.deploy).
        self.state = state
        #: Where the durable state lives (spec §8, §11 audit; atp_router.store).
        self.state_dir = state.state_dir
        # No local next-hop's sandbox may mount it (atp_router.adapters.tools.sandbox).
        forbid_paths(self.state_dir)
        self.store: Store = state.store
        self.ledger: BudgetLedger = state.ledger
        #: Answers of the policies that cache them (spec §13), in the store.
        self.cache = ResponseCache(self.store, self.metrics, max_bytes=config.cache_max_bytes,
                                   tenant_max_bytes=config.cache_tenant_max_bytes)
        #: Bytes of request bodies in flight per tenant, every ingress (atp_router.flow.body_budget).
        self.body_budget = BodyBudget(config.tenant_body_bytes
                                      or 2 * max(config.max_body_bytes, config.max_ws_message_bytes))
        self.audit_log: AuditLog = state.audit_log
        #: Signs each FINAL's usage summary (Ed25519; public key at GET /v1/keys).
        self.usage_signer = UsageSigner.load_or_create(self.state_dir / "usage.pem")
        self.authenticator: Authenticator = authenticator or build_authenticator(config)
        #: The frame keys (§11): every inbound frame is verified and replay-checked.
        self.keyring: KeyRing | None = config.keyring or (
            KeyRing.single(config.hmac_key) if config.hmac_key is not None else None)
        self.replay = DurableReplayGuard(self.store, self.keyring) if self.keyring is not None else None
        self.admission = StreamAdmission(
            default_max_streams=config.tenant_max_streams,
            default_rate=RateSpec(per_s=config.tenant_rate_per_s, burst=config.tenant_rate_burst),
        )
        self._nursery: trio.Nursery | None = None
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
                on_transition=self._on_breaker,
            ),
            config.retry,
            rng=rng,
        )
        #: Spans of sessions, streams, legs and consensus (spec §12); None: tracing
        #: is off (no OTEL_* exporter configured, atp_router.observability.tracing) and costs nothing.
        self.tracing = RouterTracing.for_router(agent_windows=self.gates.agent_windows)
        self.control = ControlPlane(config.policies, ledger=self.ledger, gates=self.gates, metrics=self.metrics,
                                    on_leg=self._on_leg, secrets=config.policy_secrets)
        self.streams = StreamTable(
            self.metrics, max_streams=config.max_streams, retain_closed_s=config.retain_closed_s,
            retain_closed_max=config.retain_closed_max, resume_grace_s=config.resume_grace_s,
            idle_task_s=config.idle_task_s, hb_interval_s=config.hb_interval_s,
            accounts=self.ledger, store=self.store,
            retain_closed_bytes=config.retain_closed_bytes,
            idle_trim=memory.trim if config.idle_trim else None,
        )
        for restore in state.restore:
            restore(self)
        #: Live FIB metrics, the policies' bandits, feedback and shadow routing (§6.2, §18).
        self.learning = Learning(
            self.store, ledger=self.ledger, metrics=self.metrics, control=self.control, audit=self.audit_event,
            limits=LearnLimits(config.learn_rate_per_s, config.learn_burst, config.learn_share),
            tenants=has_tenants(self.authenticate), seed=config.seed)
        self.learning.sync(self.gen)
        #: What the SYN stages are built from (atp_router.runtime.dataplane.opening).
        self.open_parts = OpenParts(admission=self.admission, streams=self.streams, learning=self.learning,
                                    control=self.control, generation=lambda: self.gen, ledger=self.ledger,
                                    client_spec=self.client_spec, client_account=self.client_account)
        #: The SYN pipeline (atp_router.runtime.dataplane.opening), in order: each stage continues or refuses.
        self.syn_stages: list[Stage] = [t.of(self.open_parts) for t in syn_stages]

    def close_state(self) -> None:
        """Checkpoint the audit chain and close the store (clean shutdown):
        :attr:`StateParts.close <atp_router.runtime.deployment.StateParts.close>`."""
        self.state.close()

    # ------------------------------------------------------------------ control plane
    @property
    def gen(self) -> Generation:
        """The running RIB generation (:attr:`ControlPlane.gen <atp_router.runtime.controlplane.control.ControlPlane.gen>`)."""
        return self.control.gen

    @gen.setter
    def gen(self, gen: Generation) -> None:
        self.control.gen = gen

    @property
    def open_count(self) -> int:
        """Streams open now, all tenants."""
        return self.streams.open_count

    def reload(self, text: str | None = None, *, identity: Identity | None = None,
               version: int | None = None, cause: str | None = None) -> dict[str, Any]:
        """Hot-reload the RIB (:meth:`ControlPlane.reload <atp_router.runtime.controlplane.control.ControlPlane.reload>`, §22)
        as generation ``version`` (default: the deployment's ``rib_version()``, a
        store-wide one, else the next one),
        audited with who asked and every endpoint and secret reference it adds,
        removes or changes (:func:`~atp_router.security.policy_guard.egress_changes`);
        a refused reload is audited too, and logged once (ERROR, every fault with
        its file and line; ``cause`` says what triggered it, e.g. the policy
        watch). Returns :meth:`rib_summary` with ``changes`` (those egress
        changes) and ``by`` (the actor's subject). Raises :class:`PolicyError`."""
        if version is None and self.rib_version is not None:
            version = self.rib_version()
        old = self.gen.rib
        try:
            summary = self.control.reload(text, version=version)
        except PolicyError as e:
            faults = [x.where() for x in e.errors]
            # The audit record's own line is DEBUG: the ERROR line below is the one that says it.
            self.audit_event("policy_reload", identity, {"outcome": "refused", "file": e.file, "key": e.key,
                                                         "line": e.line, "reason": e.detail, "errors": faults},
                             level=logging.DEBUG)
            who = f"{identity.subject}@{identity.tenant}" if identity is not None else "router"
            log.error("%sRIB refused (reload by %s), generation %d stays:\n  %s", f"{cause}; " if cause else "",
                      who, self.gen.version, "\n  ".join(faults) or e.reason,
                      extra={"audit": "policy_reload", "outcome": "refused"})
            raise
        changes = egress_changes(old, self.gen.rib)
        actor = identity.subject if identity is not None else "router"
        self.audit_event("policy_reload", identity, {
            "outcome": "ok", "version": summary["version"], "source": self.gen.source, "changes": changes})
        self.store.save_rib(summary["version"], text or "", self.gen.source, actor)
        return {**summary, "changes": changes, "by": actor}

    def rib_summary(self) -> dict[str, Any]:
        return self.control.rib_summary()

    def client_spec(self, tenant: str) -> ClientSpec:
        """The RIB's ``clients.<tenant>`` entry (defaults when absent)."""
        return self.control.client_spec(tenant)

    def client_account(self, tenant: str) -> str:
        """The ledger account of ``tenant`` (opened with its RIB budget on first use)."""
        return self.control.client_account(tenant)

    # ------------------------------------------------------------------ identity
    def authenticate(self, authorization: str | None, *, peer_cert: dict | None = None) -> Identity:
        """Who is calling (spec §11): the :class:`~atp_router.security.identity.Identity`
        of an ``Authorization`` header value (and TLS client certificate), by
        :attr:`authenticator`. Every ingress calls it once per connection or
        request. Raises :class:`ATPError` ``ESEC`` when the caller is refused."""
        return self.authenticator.authenticate(authorization, now=time.time(), peer_cert=peer_cert)

    def authorize(self, identity: Identity, action: str) -> None:
        """May ``identity`` do ``action`` (an :class:`~atp_router.security.authz.Action`
        value: policy, routes, audit and tenant actions need ``admin``; metrics
        ``operator`` or ``admin``; stream actions ``client``; health and keys any
        caller)? Raises :class:`~atp_router.security.authz.Forbidden` (``ESEC``, 403;
        audited) when not, ``ValueError`` for an unknown action."""
        try:
            act = ACTIONS[action]
        except KeyError:
            raise ValueError(f"unknown action {action!r}") from None
        try:
            authorize(identity, act)
        except Forbidden as e:
            self.audit_event("esec", identity, {"action": action, "reason": e.reason,
                                                "roles": sorted(identity.roles)})
            self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
            raise

    def decode_frame(self, codec: FrameCodec, data: bytes | str, identity: Identity) -> Frame:
        """Decode and verify one inbound frame of ``identity`` (every ingress that
        takes frames): ``codec`` checks shape, checksums and the signature,
        :meth:`check_frame` the replay window. Raises ``LocalProtocolError``; an
        ``ESEC`` one (a missing or bad signature, a replay) is audited, once."""
        try:
            frame = codec.decode(data)
        except LocalProtocolError as e:
            if e.code is ErrorCode.ESEC:
                self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
                self.audit_event("esec", identity, {"reason": e.reason})
            raise
        self.check_frame(frame, identity)
        return frame

    def authentication_refused(self, error: ATPError, *, ingress: str) -> None:
        """An ingress refused a request or connection (401 ``ESEC``,
        :meth:`authenticate`): logged once (WARNING, ``atp.audit``), not written
        to the audit trail (an unauthenticated caller must not be able to make
        the router write)."""
        self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
        audit.warning("esec (authentication) at %s: %s", ingress, error.reason,
                      extra={"audit": "esec", "ingress": ingress})

    def check_frame(self, frame: Frame, identity: Identity) -> None:
        """The replay window of a signed inbound frame (§11): fresh ``meta.nonce``
        within ±120 s of ``meta.ts``, per (tenant, session) in memory, then per
        (tenant, key id) in the store (one write; refused while the store fails).
        No-op without a keyring. Raises ``LocalProtocolError(ESEC)``, audited."""
        if self.replay is None:
            return
        try:
            self.replay.check(identity.tenant, frame, int(time.time() * 1000))
        except LocalProtocolError as e:
            self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
            self.audit_event("esec", identity, {"session_id": frame.session_id, "stream_id": frame.stream_id,
                                                "msg_seq": frame.msg_seq, "reason": e.reason})
            raise

    # ------------------------------------------------------------------ audit
    def audit_event(self, kind: str, identity: Identity | None, detail: Mapping[str, Any], *,
                    level: int | None = None) -> None:
        """One record of the security audit trail (spec §11 audit): ``kind`` (e.g.
        ``esec``, ``redaction``, ``refusal``, ``policy_reload``), who caused it
        (``identity``: tenant and subject, never a credential) and ``detail``
        (no secrets: callers pass locations and codes, never content). Every audit
        record of the router goes through here, and is logged once at ``level``
        (default: its kind's, ``_AUDIT_LOG_LEVEL``, else WARNING; a caller that
        logs the event itself passes DEBUG)."""
        if level is None:
            level = _AUDIT_LOG_LEVEL.get(kind, logging.WARNING)
        if audit.isEnabledFor(level):
            who = f"{identity.subject}@{identity.tenant}" if identity is not None else "router"
            audit.log(level, "%s by %s: %s", kind, who, msgspec.json.encode(dict(detail)).decode(),
                      extra={"audit": kind})
        try:
            self.audit_log.record(kind, identity.subject if identity is not None else "router",
                                  identity.tenant if identity is not None else None, detail,
                                  int(time.time() * 1000))
        except StoreUnavailable as e:
            log.error("audit record %s not written: %s", kind, e)
            self.metrics.errors.labels("audit").inc()
        except Exception:
            # The audit trail must never take the data plane down: logged and counted.
            log.exception("audit record %s not written", kind)
            self.metrics.errors.labels("audit").inc()

    def find_stream(self, identity: Identity, stream_id: str) -> StreamCtx | None:
        """``identity``'s tenant's stream ``stream_id``: in memory, else read back
        from the store (finished or interrupted before a restart); None for an id
        the tenant never had — also when another tenant has it (no oracle)."""
        return self.streams.find(identity.tenant, stream_id) or self.streams.restore(
            identity, stream_id=stream_id, now=trio.current_time())

    # ------------------------------------------------------------------ data plane
    def resume_point(self, frame: Frame, *, identity: Identity) -> tuple[StreamCtx, int] | None:
        """Whether ``frame`` re-opens a stream (spec §8 Resumption), and from where.

        A SYN whose ``meta.idempotency_key`` names a stream ``identity``'s tenant
        opened before (over WS or HTTP, still running or closed but retained)
        re-opens it: returns the stream and the event id to replay *after*.
        Without ``meta.resume_after`` everything is replayed, the SYN+ACK first (a
        client that lost its state starts over on the stream's original ids);
        with ``resume_after = N`` (the last router ``msg_seq`` the client
        received) only what followed message N. ``None``: not a resumption (a
        new key, a ttl-expired SYN, a key of another tenant, a SYN a
        :attr:`syn_gates` gate does not let resume here)."""
        if Flag.SYN not in frame.flags or frame.ttl == 0:
            return None
        key = frame.meta.get("idempotency_key")
        if not isinstance(key, str):
            return None
        if not all(gate.resumes(frame, identity, key) for gate in self.syn_gates):
            return None
        ctx = self.streams.resumable(identity.tenant, key) or self.streams.restore(
            identity, idempotency_key=key, now=trio.current_time())
        if ctx is None:
            return None
        after = frame.meta.get("resume_after")
        if isinstance(after, int) and not isinstance(after, bool) and after >= 0:
            return ctx, ctx.log.after_message(after)
        return ctx, 0

    def receive_frame(self, frame: Frame, *, identity: Identity, now: float) -> list[Frame]:
        """Feed one inbound frame (already decoded and verified) from ``identity``
        to its session: the session ``frame.session_id`` *of identity's tenant*
        (another tenant's session of the same id is another session, §11).

        Returns frames that must be sent back immediately to this sender and are
        not part of any stream log (errors about unknown streams). Protocol errors
        reset only the stream concerned. A SYN re-opening a stream by idempotency
        key (:meth:`resume_point`) is not fed to the session: the stream and its
        session state are unchanged. A SYN above the tenant's ``qos_max`` is
        served at ``qos_max`` (the SYN+ACK confirms the class, §8 step 2).

        A frame other than SYN on a stream of this session that the router
        closed (RST/FIN sent, or refused at SYN) and has freed is *late* — an
        ACK, FIN or control frame the client sent before it saw the close: it
        is dropped silently (counted as ``atp_frames{direction="dropped"}``),
        never answered with an RST, which would overtake the stream's own
        closing frame with a wrong cause. A late message (task data) is
        answered with a lone ERROR ``EPROTO`` (no RST) saying the stream is
        closed; the WebSocket ingress sends it after the stream's own frames.

        A SYN a :attr:`syn_gates` gate refuses (e.g. one re-opening by key a
        stream that runs on another router process) is answered with a lone
        ERROR with the gate's code, reason and ``retry_after_ms`` (counted in
        ``atp_errors``), before its session sees it: no stream, no RST.
        """
        if Flag.SYN in frame.flags:
            for gate in self.syn_gates:
                refused = gate.refuse(frame, identity)
                if refused is not None:
                    self.metrics.errors.labels(str(refused.code)).inc()
                    return [connection_error(frame.session_id, frame.stream_id, refused.code, refused.reason,
                                             refused.retry_after_ms)]
        self.metrics.frames.labels("in", _kind(frame)).inc()
        tenant = identity.tenant
        if Flag.SYN in frame.flags:
            if self.resume_point(frame, identity=identity) is not None:
                return []
            # The session confirms the SYN's class in its SYN+ACK (§8 step 2): it must
            # see the class StreamAdmission serves (authz.clamp_qos, the one rule).
            qos = clamp_qos(frame.qos, self.client_spec(tenant).qos_max)
            if qos is not frame.qos:
                frame = msgspec.structs.replace(frame, qos=qos)
        sess = self.streams.session(tenant, frame.session_id, now=now)
        if Flag.SYN not in frame.flags and self._closed_by_us(tenant, sess, frame.stream_id):
            return self._late_frame(frame)
        direct: list[Frame] = []
        for ev in sess.receive_frame(frame, now):
            self._on_session_event(ev, sess, frame, identity=identity, direct=direct)
        return direct

    def _on_session_event(self, ev: Any, sess: S.Session, frame: Frame, *, identity: Identity,
                          direct: list[Frame]) -> None:
        """Act on one event ``sess`` made of inbound ``frame`` (:meth:`receive_frame`);
        frames for the sender outside any stream's log go to ``direct``."""

        def stream_of(stream_id: str) -> StreamCtx | None:
            return self.streams.get(identity.tenant, sess.session_id, stream_id)

        match ev:
            case S.StreamOpened():
                # The session dropped a SYN at ttl 0; this hop takes one off the rest (§4.2).
                self._on_syn(sess, ev, identity=identity, direct=direct, ttl=S.forward_ttl(frame).ttl)
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
                    self.stream_closed(ctx.finish(None))
            case S.StreamReset():
                ctx = stream_of(ev.stream_id)
                if ctx is not None:
                    self.stream_closed(ctx.peer_reset())
            case S.ProtocolViolation():
                # The session resets the stream (its RST follows in SendFrames):
                # stop the task so it spends nothing more.
                ctx = stream_of(ev.stream_id)
                if ctx is not None and ctx.cancel_scope is not None:
                    ctx.cancel_scope.cancel()
            case S.SendFrames():
                ctx = stream_of(ev.frames[0].stream_id) if ev.frames else None
                if ctx is not None and not ctx.log.closed:
                    self.stream_closed(ctx.push(ev.frames))
                else:
                    direct.extend(ev.frames)
            case _:
                pass

    def _closed_by_us(self, tenant: str, sess: S.Session, stream_id: str) -> bool:
        """``stream_id`` is a stream of ``tenant``'s ``sess`` the router closed
        and freed (retained for ``retain_closed_s``, or refused at SYN recently)."""
        if stream_id == S.HB_STREAM_ID or sess.stream_state(stream_id) is not S.StreamState.IDLE:
            return False
        ctx = self.streams.get(tenant, sess.session_id, stream_id)
        if ctx is not None:
            return ctx.log.closed
        return self.streams.was_refused(tenant, sess.session_id, stream_id)

    def _late_frame(self, frame: Frame) -> list[Frame]:
        self.metrics.frames.labels("dropped", _kind(frame)).inc()
        p = frame.payload
        if p is None or p.type is PayloadType.CONTROL:
            return []
        return [connection_error(frame.session_id, frame.stream_id, ErrorCode.EPROTO,
                                 f"stream is closed: message msg_seq={frame.msg_seq} not delivered")]

    def _on_syn(self, sess: S.Session, ev: Any, *, identity: Identity, direct: list[Frame], ttl: int) -> None:
        """A SYN the session accepted (``ev``: :class:`~atp_router.wire.session.StreamOpened`)
        goes through :attr:`syn_stages` (:mod:`atp_router.runtime.dataplane.opening`); refused, it
        is reset with the stage's code (:meth:`_refuse_syn`), else opened
        (:meth:`_open`)."""
        content = ev.payload.content if ev.payload is not None and ev.payload.type is PayloadType.TASK else None
        o = OpenCtx(identity, sess.session_id, ev.stream_id, dict(ev.meta), content, ev.qos, ev.window,
                    trio.current_time())
        refused = run_stages(self.syn_stages, o)
        if refused is not None:
            self._refuse_syn(sess, o, refused, direct)
        else:
            self._open(sess, ev, o, ttl)

    def _refuse_syn(self, sess: S.Session, o: OpenCtx, refused: Refuse, direct: list[Frame]) -> None:
        """Reset a refused SYN's stream (spec §10): counted, an ``ESEC`` audited,
        the RST's ERROR carrying ``retry_after_ms`` when the stage gave one."""
        self.metrics.errors.labels(str(refused.code)).inc()
        if refused.code is ErrorCode.ESEC:
            self.audit_event("esec", o.identity, {"session_id": sess.session_id, "stream_id": o.stream_id,
                                                  "reason": refused.reason})
        rst = sess.reset(o.stream_id, refused.code, refused.reason)
        if refused.retry_after_ms is not None and rst.payload is not None and isinstance(rst.payload.content, dict):
            # A quota or rate refusal says when to try again (spec §10 retry_after_ms).
            rst = msgspec.structs.replace(rst, payload=msgspec.structs.replace(
                rst.payload, content={**rst.payload.content, "retry_after_ms": refused.retry_after_ms}))
        direct.append(rst)
        self.streams.refused(o.tenant, sess.session_id, o.stream_id)
        if self.tracing is not None:
            self.tracing.refused(o.tenant, sess.session_id, o.stream_id, o.meta, refused.code, refused.reason)

    def _open(self, sess: S.Session, ev: Any, o: OpenCtx, ttl: int) -> None:
        """Open the stream every stage let through: its context on the routed
        generation (held), in the table, SYN+ACK with the route (and trace),
        audited, its task started when the SYN carried one."""
        route, gen, budget = o.route, o.gen, o.budget
        assert route is not None and gen is not None and budget is not None
        window = _min_window(ev.window, route.window or DEFAULT_WINDOW)
        qos = o.admitted_qos if o.admitted_qos is not None else (route.qos or QoS.SILVER)
        ctx = StreamCtx(self.streams, sess, ev.stream_id, o.identity, o.meta, qos, window, budget, route,
                        o.now, gen=gen, ttl=ttl, account=o.account, idempotency_key=ev.idempotency_key)
        ctx.decision = o.decision
        self.control.hold(ctx)
        self.streams.insert(ctx)
        self.metrics.streams_opened.labels(str(qos)).inc()
        synack = sess.accept(ev.stream_id, window)
        synack.meta["route"] = {
            "policy": route.policy,
            "next_hops": [h.agent for h in route.next_hops],
            "rib_version": gen.version,
        }
        if self.tracing is not None:
            synack.meta["trace"] = self.tracing.stream_opened(ctx)
        ctx.push(synack)
        self.audit_event("session_open", o.identity, {
            "session_id": sess.session_id, "stream_id": ev.stream_id, "policy": route.policy,
            "next_hops": [h.agent for h in route.next_hops], "qos": str(qos),
            "budget": msgspec.to_builtins(budget)})
        if o.content is not None:
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
                self.stream_closed(ctx.reset(ErrorCode.EPROTO, f"fragmented task body is not JSON: {e}"))
                return
        try:
            check_task(content)
        except LocalProtocolError as e:
            self.stream_closed(ctx.reset(e.code, e.reason))
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
            b = min_budget(control.budget, ctx.route.budget)
            self.ledger.set_limit(ctx.account, Allowance.from_budget(b), clamp=True)
            ctx.budget = b
            self.audit_event("window_change", ctx.identity, {
                "session_id": ctx.session_id, "stream_id": ctx.stream_id, "budget_update": msgspec.to_builtins(b)})

    async def _run_task(self, ctx: StreamCtx, prompt: Prompt, gen: Generation, scope: trio.CancelScope) -> None:
        try:
            with self.tracing.running(ctx) if self.tracing is not None else contextlib.nullcontext():
                await self._run_task_on(ctx, prompt, gen, scope)
        finally:
            self.control.release(ctx)

    async def _run_task_on(self, ctx: StreamCtx, prompt: Prompt, gen: Generation, scope: trio.CancelScope) -> None:
        """Run ``ctx``'s task (:mod:`atp_router.runtime.dataplane.runner`) under ``scope``
        and act on its outcome."""
        cfg = self.config
        plan = plan_task(ctx, prompt, gen.fib, update_interval_ms=cfg.window_update_interval_ms,
                         update_delta=cfg.window_update_delta, win_rates=self.learning.win_rates(ctx.route) or None,
                         cache=self.cache.view(ctx.tenant, gen.cache, ctx.route.policy))
        with scope:
            outcome = await run_task(gen.dispatcher, ctx, plan, guard=self.scope_guard, audit=self.audit_event)
            if outcome.final is None:
                self._task_failed(ctx, plan, outcome)
            else:
                self._task_final(ctx, gen, plan, outcome, outcome.final)
        if scope.cancelled_caught:
            self.metrics.streams_closed.labels("rst").inc()

    def _task_failed(self, ctx: StreamCtx, plan: TaskPlan, outcome: TaskOutcome) -> None:
        """End the stream of a task that produced no FINAL: ERROR ``EBUDGET`` + FIN
        (spec §10), else RST with the outcome's error."""
        e = outcome.error
        assert e is not None
        if outcome.internal:
            self.metrics.streams_closed.labels("internal").inc()
            self.stream_closed(ctx.reset(e.code, e.reason))
            return
        self.learning.task_done(ctx, plan, None, None)
        self.metrics.streams_closed.labels(str(e.code)).inc()
        if e.code is ErrorCode.EBUDGET:
            # Spec §10: EBUDGET → FIN (the ERROR says why, the FIN ends it cleanly).
            ctx.emit_error(e.code, e.reason)
            self.stream_closed(ctx.finish(None))
        else:
            self.stream_closed(ctx.reset(e.code, e.reason))

    def _task_final(self, ctx: StreamCtx, gen: Generation, plan: TaskPlan, outcome: TaskOutcome,
                    final: FinalResult) -> None:
        """Send the task's FINAL (signed) and FIN; count, audit and learn from it,
        and start its shadow run when one is due."""
        triggers = list(outcome.triggers)
        if self.tracing is not None:
            self.tracing.merged(ctx, plan, final, triggers)
        self.metrics.agreement.observe(final.result.consensus.agreement)
        self.metrics.stream_latency.observe(final.telemetry.latency_ms / 1000)
        for t in triggers:
            self.metrics.escalations.labels(t).inc()
        if triggers:
            self.audit_event("escalation", ctx.identity, {"session_id": ctx.session_id,
                                                          "stream_id": ctx.stream_id, "triggers": triggers})
        self.metrics.streams_closed.labels("final").inc()
        self.stream_closed(ctx.finish(self._signed(ctx, final)))
        esc = ctx.route.escalation
        qualities = self.learning.task_done(ctx, plan, final, esc.to if esc is not None and outcome.escalated else None)
        hop = self.learning.shadow_due(ctx, gen, list(qualities))
        if hop is not None and self._nursery is not None:
            # After the FINAL: the client's result and budget are already settled.
            self._nursery.start_soon(self.learning.shadow, ctx, plan, final, gen, hop,
                                     max(qualities.values(), default=0.0))

    def _signed(self, ctx: StreamCtx, final: FinalResult) -> FinalResult:
        """``final`` with its telemetry's signed usage summary (spec §19: a client
        can prove what it was charged; ``GET /v1/keys`` has the public key)."""
        t = final.telemetry
        reporters = {ev.frame.payload.content.get("agent") for ev in ctx.log.events
                     if ev.type == "PARTIAL" and isinstance(ev.frame.payload.content, dict)
                     and "report" in ev.frame.payload.content}
        summary = {"tenant": ctx.tenant, "session_id": ctx.session_id, "stream_id": ctx.stream_id,
                   "tokens": t.tokens, "usd_micros": usd_to_micros(t.usd), "calls": len(reporters),
                   "rib_version": ctx.gen.version if ctx.gen is not None else self.gen.version,
                   "closed_at_ms": int(time.time() * 1000)}
        usage = SignedUsage(summary=summary, jws=self.usage_signer.sign(summary))
        return msgspec.structs.replace(final, telemetry=msgspec.structs.replace(t, usage=usage))

    def _on_preempt(self, p: Preempt) -> None:
        """The QoS scheduler preempts a bronze call (spec §9): RST the stream with
        ``EPREEMPT`` and stop its task (its slot goes to the waiting gold call)."""
        ctx = self.streams.by_account(p.stream_id)
        if ctx is None or ctx.log.closed:
            if p.running:
                self.gates.slots.cancel(p.ticket)
            return
        # The one line of a preemption (its stream's RST close is logged at DEBUG).
        log.info("stream %s of %s preempted: %s", ctx.stream_id, ctx.tenant, p.reason,
                 extra={"stream_id": ctx.stream_id, "tenant": ctx.tenant, "code": str(p.code)})
        self.stream_closed(ctx.stop(p.code, p.reason))

    def _on_breaker(self, t: BreakerTransition) -> None:
        """Log each circuit-breaker transition once (spec §5.3): opening at
        WARNING (the next-hop leaves the FIB until its probe), half-open and
        closed again at INFO."""
        extra = {"agent": t.agent, "breaker": str(t.new), "breaker_event": str(t.event)}
        if t.new is BreakerState.OPEN:
            wait_ms = round(((t.reopen_at or t.at) - t.at) * 1000)
            log.warning("circuit breaker of %s: %s -> open (%s, opening %d); next probe in %d ms", t.agent, t.old,
                        t.event, t.openings, wait_ms, extra=extra)
        else:
            log.info("circuit breaker of %s: %s -> %s (%s)", t.agent, t.old, t.new, t.event, extra=extra)

    def stream_closed(self, closed: Closed | None) -> None:
        """Act on a stream's close (what the call that closed it returned; None:
        it was closed already): trace and audit it, and end its hold on its
        generation when no task did (a task ends it when it ends)."""
        if closed is None:
            return
        ctx, last, spent = closed.ctx, closed.last, closed.spent
        err = _error_of([last]) if last is not None else None
        code = err.code if err is not None else None
        if self.tracing is not None:
            self.tracing.stream_closed(
                ctx, outcome="RST" if last is not None and Flag.RST in last.flags else "FIN",
                code=str(code) if code is not None else None,
                usd_micros=spent.committed_usd_micros if spent else None)
        self.audit_event("session_close" if Flag.RST not in (last.flags if last else []) else "error", ctx.identity, {
            "session_id": ctx.session_id, "stream_id": ctx.stream_id,
            "outcome": "RST" if last is not None and Flag.RST in last.flags else "FIN",
            "code": str(code) if code is not None else None,
            "tokens": spent.committed_tokens if spent else None,
            "usd_micros": spent.committed_usd_micros if spent else None},
            # An ESEC or EPREEMPT reset was logged where it was decided (refusal, preemption).
            level=logging.DEBUG if code in (ErrorCode.ESEC, ErrorCode.EPREEMPT) else None)
        if closed.release_gen:
            self.control.release(ctx)  # else the task releases it when it ends

    async def _stream_timers(self) -> None:
        """Drive the stream table's timers (grace, idle expiry, retention) until
        cancelled, acting on each stream they reset."""
        while True:
            for closed in await self.streams.next_timers():
                self.stream_closed(closed)

    def _on_leg(self, out: LegOutcome) -> None:
        if self.tracing is not None:
            self.tracing.leg(out)
        m = self.metrics
        m.agent_calls.labels(out.agent, "ok" if out.error is None else str(out.error.code)).inc()
        m.agent_latency.labels(out.agent).observe(out.latency_ms / 1000)
        m.tokens.labels(out.agent).inc(out.usage.tokens)
        m.usd_micros.labels(out.agent).inc(out.usage.usd_micros)

    # ------------------------------------------------------------------ HTTP helpers
    def open_stream(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                    qos: QoS | None, window: Window | None, idempotency_key: str | None,
                    identity: Identity) -> StreamCtx:
        """Open a stream for ``identity`` (HTTP API, A2A server) by synthesising
        its SYN frame on a new session.

        The same ``idempotency_key`` (per tenant) returns the stream it opened
        before — over HTTP or WebSocket — without a second task or charge (§8).
        Raises :class:`ATPError` with the code the SYN was reset with (or the
        deployment's ``store_refusal`` when the store could not be reached).
        """
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
        try:
            if idempotency_key is not None and (resumed := self.resume_point(syn, identity=identity)) is not None:
                return resumed[0]
            direct = self.receive_frame(syn, identity=identity, now=trio.current_time())
        except StoreUnavailable as e:
            if self.store_refusal is None:
                raise
            raise self.store_refusal("open", e) from None
        ctx = self.streams.get(identity.tenant, session_id, stream_id)
        if ctx is None:
            err = _error_of(direct)
            raise ATPError(err.code if err else ErrorCode.EPROTO, err.reason if err else "stream refused",
                           retry_after_ms=err.retry_after_ms if err else None)
        return ctx

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the router's background work until cancelled: stream tasks, QoS
        preemption, the stream table's timers (grace, idle expiry, retention) and
        the control plane's adapter retirement (adapters closed when cancelled).
        While it runs, adapters read RIB-named secrets only through the declared
        set (``config.policy_secrets``; spec §11); the previous resolver is put back
        when it stops."""
        previous = None
        if self.config.policy_secrets is not None:
            previous = install_secret_resolver(self.config.policy_secrets.resolve)
        try:
            await self._serve(task_status)
        finally:
            if previous is not None:
                install_secret_resolver(previous)

    async def _serve(self, task_status) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.control.serve)
                nursery.start_soon(self.gates.slots.run)
                nursery.start_soon(self.gates.run_canaries)  # a failure in doubt: a canary speaks (issue 19)
                nursery.start_soon(self._stream_timers)
                nursery.start_soon(self.streams.persistence.run_flusher)
                nursery.start_soon(self._audit_checkpoints)
                nursery.start_soon(self.learning.run)
                # The secrets detectors' imports, off the event loop before the first task needs them.
                nursery.start_soon(partial(trio.to_thread.run_sync, redact_warm, abandon_on_cancel=True))
                if self.config.watch_policies:
                    nursery.start_soon(self._watch_policies)
                for service in self.services:
                    for task in service(self):
                        nursery.start_soon(task)
                self._nursery = nursery
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()
        finally:
            # Also when cancelled from outside: the state directory's lock is
            # released, so a router can start on it again in this process.
            self.close_state()

    async def _watch_policies(self) -> None:
        """Reload the RIB when a policy file changes (``watch_policies``)."""
        import watchfiles  # imported here: only routers that watch pay for it

        path = self.config.policies
        if not path.exists():
            log.warning("policy watch: %s does not exist; not watching", path)
            return

        def policy_file(change: watchfiles.Change, name: str) -> bool:
            p = Path(name)
            return p.suffix in (".yaml", ".yml") and not p.name.startswith(".")

        log.info("policy watch: reloading on changes to %s", path)
        async for changes in watchfiles.awatch(path, watch_filter=policy_file, debounce=self.config.watch_debounce_ms,
                                               step=50, recursive=False):
            files = sorted({Path(n).name for _, n in changes})
            try:
                summary = self.reload(None, cause=f"policy watch: {', '.join(files)} changed")
            except PolicyError:
                continue  # reload() logged it, once
            except Exception:
                log.exception("policy watch: reload failed; generation %d stays", self.gen.version)
                continue
            log.info("policy watch: %s changed; RIB generation %d", ", ".join(files), summary["version"])

    async def _audit_checkpoints(self) -> None:
        """MAC the audit chain's head when its oldest unsigned record is due
        (every ``interval_ms``), and expire the store's closed streams past
        their retention (bounded disk)."""
        retain_ms = int(self.config.state_retain_s * 1000)
        while True:
            await trio.sleep(1.0)
            now_ms = int(time.time() * 1000)
            try:
                self.audit_log.tick(now_ms)
                self.store.expire(now_ms - retain_ms)
            except StoreUnavailable:
                continue  # a shared store that cannot be reached: done when it answers (atp_router.deploy.cluster)
            except Exception:
                log.exception("state: audit checkpoint or expiry failed")


def connection_error(session_id: str, stream_id: str, code: ErrorCode, reason: str,
                     retry_after_ms: int | None = None) -> Frame:
    """An ERROR (spec §10) outside any session's sequence: for a frame the router
    could not attribute to an open stream of the sender (undecodable, a late
    message on a closed stream, a frame the ingress could not process, a SYN
    refused before it had a stream). ``stream_id`` ``"0"`` means the connection
    itself; ``retry_after_ms`` is the backoff hint (ms; over HTTP a 503 or 429
    with ``Retry-After``)."""
    return Frame(
        v=1, session_id=session_id, stream_id=stream_id, msg_seq=0, flags=[Flag.CTRL],
        payload=Payload(type=PayloadType.CONTROL,
                        content=ErrorPayload(code=code, reason=reason, retry_after_ms=retry_after_ms)),
    )


def build_authenticator(config: RouterConfig) -> Authenticator:
    """The router's one :class:`~atp_router.security.authn.Authenticator`: the ``--auth``
    file, ``ATP_ROUTER_TOKENS`` (``tokens_env``) and the tokens given in
    ``config`` directly. Raises ``ValueError`` naming the source of a fault."""
    doc = load_auth_config(config.auth_file) if config.auth_file is not None else None
    tokens = parse_tokens_env(config.tokens_env) if config.tokens_env else []
    for name, token in config.client_tokens.items():
        roles = config.client_roles.get(name, frozenset({Role.CLIENT}))
        tokens.append(EnvToken(Identity(name, roles, f"env:{name}", "api_key"), hashlib.sha256(token.encode()).digest()))
    for token in config.tokens:
        digest = hashlib.sha256(token.encode()).digest()
        tenant = "tok_" + digest.hex()[:12]
        tokens.append(EnvToken(Identity(tenant, frozenset({Role.CLIENT}), f"env:{tenant}", "api_key"), digest))
    base = config.auth_file.parent if config.auth_file is not None else Path(".")
    return Authenticator(doc, env_tokens=tokens, base_dir=base, file=str(config.auth_file or "ATP_ROUTER_TOKENS"),
                         required=config.auth_file is not None)


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
