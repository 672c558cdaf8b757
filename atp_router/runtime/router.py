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
:mod:`atp_router.runtime.dataplane.plane`       the data plane's frame path: frames in, a SYN
                                                through the stages then opened or reset, a
                                                task's outcome acted on (emitted, signed,
                                                audited, learnt from), every close acted on
:mod:`atp_router.runtime.config`                :class:`RouterConfig` and the authenticator
                                                made from it
this module                                     the facade: identity (:meth:`Router.authenticate`,
                                                one call for every ingress), authorization
                                                (:meth:`Router.authorize`), the audit sink, hot
                                                reload and the policy watch, serving; the data
                                                plane's entry points (:meth:`Router.receive_frame`,
                                                :meth:`Router.open_stream`) delegate
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
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from atp_router.adapters.http import install_secret_resolver
from atp_router.adapters.tools.sandbox import forbid_paths
from atp_router.flow.body_budget import BodyBudget
from atp_router.flow.breaker import (
    BreakerState,
    BreakerTransition,
)
from atp_router.flow.budget import BudgetLedger
from atp_router.flow.qos import Preempt
from atp_router.observability.metrics import RouterMetrics
from atp_router.observability.tracing import RouterTracing
from atp_router.policy.rib import ClientSpec, RateSpec
from atp_router.runtime.config import RouterConfig, build_authenticator
from atp_router.runtime.controlplane.control import ControlPlane, Generation
from atp_router.runtime.controlplane.drain import DrainGate
from atp_router.runtime.controlplane.learning import Learning, LearnLimits, has_tenants
from atp_router.runtime.dataplane import memory
from atp_router.runtime.dataplane.cache import ResponseCache
from atp_router.runtime.dataplane.gates import flow_gates
from atp_router.runtime.dataplane.opening import (
    DEFAULT_STAGES,
    OpenParts,
    Stage,
    StageType,
)
from atp_router.runtime.dataplane.plan import LegOutcome
from atp_router.runtime.dataplane.plane import DataPlane
from atp_router.runtime.dataplane.stream import Closed, OpenStream, OpenStreamAsync, StreamCtx
from atp_router.runtime.dataplane.streams import (
    StreamTable,
)
from atp_router.runtime.deployment import Service, StateParts, SynGate
from atp_router.security.audit import AuditLog
from atp_router.security.authn import (
    Authenticator,
)
from atp_router.security.authz import (
    Action,
    Forbidden,
    StreamAdmission,
    authorize,
)
from atp_router.security.identity import Identity
from atp_router.security.policy_guard import egress_changes
from atp_router.security.redact import DataScopeGuard
from atp_router.security.redact import warm as redact_warm
from atp_router.security.signing import DurableReplayGuard, UsageSigner
from atp_router.store import Store, StoreUnavailable
from atp_router.store.threads import off_loop
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.errors import (
    ATPError,
    ErrorCode,
    LocalProtocolError,
    PolicyError,
)
from atp_router.wire.frame import (
    Frame,
)

__all__ = ["ACTIONS", "Router"]

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

#: The ingresses' action names → :class:`~atp_router.security.authz.Action`.
ACTIONS: Mapping[str, Action] = {a.name.lower(): a for a in Action}




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
        #: Refuses new streams once the router drains before it stops (atp_router.runtime.controlplane.drain).
        self.drain = DrainGate(lambda tenant, key: self.streams.resumable(tenant, key) is not None)
        self.syn_gates = (self.drain, *syn_gates)
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
        # Audit records the store could not take are spooled; one that does not fit is counted (issue 22).
        self.audit_log.spool.on_drop = self.metrics.audit_dropped.inc
        self.metrics.audit_spooled.set_function(lambda: len(self.audit_log.spool))
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
        self.gates = flow_gates(config, on_preempt=self._on_preempt, on_breaker=self._on_breaker)
        stalls = self.gates.stalls
        self.metrics.loop_stalls.set_function(lambda: stalls.count)
        self.metrics.loop_stall_seconds.set_function(lambda: stalls.total_s)
        self.metrics.local_timeouts.set_function(lambda: stalls.local_faults)
        #: Spans of sessions, streams, legs and consensus (spec §12); None: tracing
        #: is off (no OTEL_* exporter configured, atp_router.observability.tracing) and costs nothing.
        self.tracing = RouterTracing.for_router(agent_windows=self.gates.agent_windows)
        self.control = ControlPlane(config.policies, ledger=self.ledger, gates=self.gates, metrics=self.metrics,
                                    on_leg=self._on_leg, secrets=config.policy_secrets)
        self._build_data_plane(config, state, syn_stages)

    def _build_data_plane(self, config: RouterConfig, state: StateParts, syn_stages: Sequence[StageType]) -> None:
        """The stream table (restored by the deployment's ``state.restore``),
        learning, the SYN stages and the :class:`DataPlane` built from them."""
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
        #: Frames in, SYNs, tasks and closes (atp_router.runtime.dataplane.plane).
        self.data = DataPlane(
            streams=self.streams, control=self.control, ledger=self.ledger, learning=self.learning, cache=self.cache,
            metrics=self.metrics, tracing=self.tracing, scope_guard=self.scope_guard, usage_signer=self.usage_signer,
            audit_event=self.audit_event, syn_stages=self.syn_stages, syn_gates=self.syn_gates,
            store_refusal=self.store_refusal, window_update_interval_ms=config.window_update_interval_ms,
            window_update_delta=config.window_update_delta,
            window_update_keepalive_ms=max(config.window_update_keepalive_ms, config.window_update_interval_ms),
            journal=state.journal)

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
        except Exception:
            # A store that cannot take it spools it (AuditLog.record); anything else must
            # never take the data plane down: logged and counted.
            log.exception("audit record %s not written", kind)
            self.metrics.errors.labels("audit").inc()

    # ------------------------------------------------------------------ data plane
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

    def _on_leg(self, out: LegOutcome) -> None:
        if self.tracing is not None:
            self.tracing.leg(out)
        m = self.metrics
        m.agent_calls.labels(out.agent, "ok" if out.error is None else str(out.error.code)).inc()
        m.agent_latency.labels(out.agent).observe(out.latency_ms / 1000)
        m.tokens.labels(out.agent).inc(out.usage.tokens)
        m.usd_micros.labels(out.agent).inc(out.usage.usd_micros)

    # ------------------------------------------------------------------ the data plane's entry points
    def find_stream(self, identity: Identity, stream_id: str) -> StreamCtx | None:
        """:meth:`DataPlane.find_stream <atp_router.runtime.dataplane.plane.DataPlane.find_stream>`."""
        return self.data.find_stream(identity, stream_id)

    def resume_point(self, frame: Frame, *, identity: Identity) -> tuple[StreamCtx, int] | None:
        """:meth:`DataPlane.resume_point <atp_router.runtime.dataplane.plane.DataPlane.resume_point>`."""
        return self.data.resume_point(frame, identity=identity)

    def receive_frame(self, frame: Frame, *, identity: Identity, now: float) -> list[Frame]:
        """:meth:`DataPlane.receive_frame <atp_router.runtime.dataplane.plane.DataPlane.receive_frame>`."""
        return self.data.receive_frame(frame, identity=identity, now=now)

    @property
    def open_stream(self) -> OpenStream:
        """:meth:`DataPlane.open_stream <atp_router.runtime.dataplane.plane.DataPlane.open_stream>` itself."""
        return self.data.open_stream

    @property
    def open_stream_async(self) -> OpenStreamAsync:
        """:meth:`DataPlane.open_stream_async <atp_router.runtime.dataplane.plane.DataPlane.open_stream_async>`
        itself (the data plane's bound method: an ingress's call goes straight to it)."""
        return self.data.open_stream_async

    def stream_closed(self, closed: Closed | None) -> None:
        """:meth:`DataPlane.stream_closed <atp_router.runtime.dataplane.plane.DataPlane.stream_closed>`."""
        self.data.stream_closed(closed)

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
        # The loop's stalls, watched while the router serves (a timeout during one is its own).
        trio.lowlevel.add_instrument(self.gates.stalls)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.control.serve)
                nursery.start_soon(self.gates.slots.run)
                nursery.start_soon(self.gates.run_canaries)  # a failure in doubt: a canary speaks (issue 19)
                nursery.start_soon(self.gates.ticks.run)  # every task's periodic WINDOW_UPDATE check (§5.4)
                nursery.start_soon(self.data.run_timers)
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
                self.data.nursery = nursery
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    self.data.nursery = None
                    nursery.cancel_scope.cancel()
        finally:
            # Also when cancelled from outside: the state directory's lock is
            # released, so a router can start on it again in this process.
            with contextlib.suppress(KeyError):
                trio.lowlevel.remove_instrument(self.gates.stalls)
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
        """Chain the audit records spooled while the store could not take them
        (:meth:`AuditLog.flush_spool <atp_router.security.audit.AuditLog.flush_spool>`),
        MAC the audit chain's head when its oldest unsigned record is due
        (every ``interval_ms``), and expire the store's closed streams past
        their retention (bounded disk)."""
        retain_ms = int(self.config.state_retain_s * 1000)
        while True:
            await trio.sleep(1.0)
            now_ms = int(time.time() * 1000)
            try:
                self.audit_log.flush_spool()  # records spooled while the store was away, in order
                self.audit_log.tick(now_ms)
                await off_loop(self.store, self.store.expire, now_ms - retain_ms)  # a store thread, when threaded
            except StoreUnavailable:
                continue  # a shared store that cannot be reached: done when it answers (atp_router.deploy.cluster)
            except Exception:
                log.exception("state: audit checkpoint or expiry failed")
