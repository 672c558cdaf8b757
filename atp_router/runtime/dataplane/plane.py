"""The data plane's frame path (spec §4, §8, §10): frames in, a SYN through the
stage list then opened or reset, a stream's task run to its FINAL, and every
stream's close acted on.

:class:`DataPlane` is built by the :class:`~atp_router.runtime.router.Router` facade
from the parts it composes — the stream table, the control plane, the flow gates,
the ledger, learning, the response cache, metrics, tracing, the usage signer, the
audit sink, the SYN stages and the deployment's SYN gates — and holds no
reference to the Router. Ingresses reach it through the Router
(:meth:`~atp_router.runtime.router.Router.receive_frame`,
:meth:`~atp_router.runtime.router.Router.open_stream`, ...).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.consensus.types import FinalResult
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.observability.metrics import RouterMetrics
from atp_router.observability.tracing import RouterTracing
from atp_router.policy.rib import ClientSpec
from atp_router.runtime.controlplane.control import ControlPlane, Generation
from atp_router.runtime.controlplane.learning import Learning
from atp_router.runtime.dataplane.cache import ResponseCache
from atp_router.runtime.dataplane.journal import CallJournal
from atp_router.runtime.dataplane.opening import (
    OpenCtx,
    Stage,
    holding,
    min_budget,
    open_ctx,
    run_inline,
    run_stages,
    syn_task,
    task_body,
)
from atp_router.runtime.dataplane.plan import TaskPlan
from atp_router.runtime.dataplane.runner import TaskOutcome, plan_task, run_task
from atp_router.runtime.dataplane.stream import (
    Closed,
    StreamCtx,
    change_of_task,
    connection_error,
    error_of_frames,
    frame_kind,
    min_window,
    signed_final,
    synthesized_syn,
    task_digest,
)
from atp_router.runtime.dataplane.streams import StreamTable
from atp_router.runtime.deployment import SynGate
from atp_router.security.authz import Refuse, clamp_qos
from atp_router.security.identity import Identity
from atp_router.security.redact import DataScopeGuard
from atp_router.security.signing import UsageSigner
from atp_router.store import StoreUnavailable
from atp_router.task.body import TaskBody
from atp_router.task.change import ParsedChange
from atp_router.task.meta import TaskMeta
from atp_router.wire import session as S
from atp_router.wire.errors import (
    ATPError,
    ErrorCode,
    IdempotencyConflict,
    LocalProtocolError,
)
from atp_router.wire.frame import (
    Budget,
    BudgetUpdate,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
)

__all__ = ["DEFAULT_WINDOW", "AuditSink", "DataPlane", "connection_error"]

log = logging.getLogger("atp_router.runtime")

#: Window granted when neither the client nor the policy set one (spec §15.1 defaults).
DEFAULT_WINDOW = Window(max_parallel=4, max_tokens=120_000, max_usd_micros=1_250_000)

#: ``(kind, identity, detail, *, level=None)``: one audit record
#: (:meth:`Router.audit_event <atp_router.runtime.router.Router.audit_event>`).
AuditSink = Callable[..., None]


class DataPlane:
    """Frames in, SYNs, tasks and closes for one router (module doc). ``nursery``
    is set while the router serves (tasks and shadow runs start in it);
    ``window_update_interval_ms`` / ``window_update_delta`` /
    ``window_update_keepalive_ms`` are the stream windows' WINDOW_UPDATE pacing (:class:`~atp_router.runtime.config.RouterConfig`)."""

    def __init__(self, *, streams: StreamTable, control: ControlPlane, ledger: BudgetLedger, learning: Learning,
                 cache: ResponseCache, metrics: RouterMetrics, tracing: RouterTracing | None,
                 scope_guard: DataScopeGuard, usage_signer: UsageSigner, audit_event: AuditSink,
                 syn_stages: Sequence[Stage], syn_gates: Sequence[SynGate],
                 store_refusal: Callable[[str, StoreUnavailable], ATPError] | None,
                 window_update_interval_ms: int, window_update_delta: float, window_update_keepalive_ms: int,
                 journal: CallJournal | None = None) -> None:
        self.streams, self.control, self.ledger, self.learning = streams, control, ledger, learning
        self.cache, self.metrics, self.tracing = cache, metrics, tracing
        self.scope_guard, self.usage_signer, self.audit_event = scope_guard, usage_signer, audit_event
        self.syn_stages, self.syn_gates, self.store_refusal = list(syn_stages), tuple(syn_gates), store_refusal
        #: The stages that hold something for each stream they admit, released as it closes.
        self.holding = holding(self.syn_stages)
        self.window_update_interval_ms, self.window_update_delta = window_update_interval_ms, window_update_delta
        self.window_update_keepalive_ms = window_update_keepalive_ms
        self.nursery: trio.Nursery | None = None
        #: Answers already charged in an earlier run of a stream's key (None: streams are never re-run).
        self.journal = journal

    @property
    def gen(self) -> Generation:
        """The running RIB generation."""
        return self.control.gen

    def client_spec(self, tenant: str) -> ClientSpec:
        """The RIB's ``clients.<tenant>`` entry (defaults when absent)."""
        return self.control.client_spec(tenant)

    def find_stream(self, identity: Identity, stream_id: str) -> StreamCtx | None:
        """``identity``'s tenant's stream ``stream_id``: in memory, else read back
        from the store (finished or interrupted before a restart); None for an id
        the tenant never had — also when another tenant has it (no oracle)."""
        return self.streams.find(identity.tenant, stream_id) or self.streams.restore(
            identity, stream_id=stream_id, now=trio.current_time())

    def resume_point(self, frame: Frame, *, identity: Identity,
                     task: TaskMeta | None = None) -> tuple[StreamCtx, int] | None:
        """Whether ``frame`` re-opens a stream (spec §8 Resumption), and from where.

        A SYN whose ``meta.idempotency_key`` names a stream ``identity``'s tenant
        opened before (over WS or HTTP, still running or closed but retained)
        re-opens it: returns the stream and the event id to replay *after*.
        Without ``meta.resume_after`` everything is replayed, the SYN+ACK first (a
        client that lost its state starts over on the stream's original ids);
        with ``resume_after = N`` (the last router ``msg_seq`` the client
        received) only what followed message N. ``None``: not a resumption (a
        new key, a ttl-expired SYN, a key of another tenant, a SYN a
        :attr:`syn_gates` gate does not let resume here). Raises
        :class:`~atp_router.wire.errors.IdempotencyConflict` when the SYN carries
        a task other than the one the key opened its stream with
        (:func:`task_digest`: its ``task_type`` and content). ``task``: the SYN's
        meta as its receiver decoded it (:func:`~atp_router.runtime.dataplane.opening.syn_task`),
        else decoded here; a malformed meta resumes nothing."""
        if Flag.SYN not in frame.flags or frame.ttl == 0:
            return None
        if task is None:
            task = syn_task(frame.meta)
        key = task.idempotency_key if task is not None else None
        if key is None:
            return None
        if not all(gate.resumes(frame, identity, key) for gate in self.syn_gates):
            return None
        ctx = self.streams.resumable(identity.tenant, key) or self.streams.restore(
            identity, idempotency_key=key, now=trio.current_time())
        if ctx is None:
            return None
        content = frame.payload.content if frame.payload is not None and frame.payload.type is PayloadType.TASK \
            else None
        if content is not None and ctx.task_digest is not None and task_digest(frame.meta, content) != ctx.task_digest:
            raise IdempotencyConflict(key)
        after = task.resume_after if task is not None else None
        return ctx, (ctx.log.after_message(after) if after is not None else 0)

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
        try:
            if Flag.SYN in frame.flags:
                return run_inline(self._receive_syn(frame, identity=identity, now=now, change=None,
                                                    task=syn_task(frame.meta), resume_checked=False, inline=True))
            return self._receive(frame, identity=identity, now=now)
        except IdempotencyConflict as e:  # a key re-used with another task: a lone ERROR, nothing opened
            self.metrics.errors.labels(str(e.code)).inc()
            return [connection_error(frame.session_id, frame.stream_id, e.code, e.reason)]

    def _receive(self, frame: Frame, *, identity: Identity, now: float) -> list[Frame]:
        """:meth:`receive_frame` of a frame other than a SYN (:meth:`_receive_syn`)."""
        self.metrics.frames.labels("in", frame_kind(frame)).inc()
        sess = self.streams.session(identity.tenant, frame.session_id, now=now)
        if self._closed_by_us(identity.tenant, sess, frame.stream_id):
            return self._late_frame(frame)
        direct: list[Frame] = []
        for ev in sess.receive_frame(frame, now):
            self._on_session_event(ev, sess, identity=identity, direct=direct)
        return direct

    async def _receive_syn(self, syn: Frame, *, identity: Identity, now: float, change: ParsedChange | None,
                           task: TaskMeta | None, resume_checked: bool, inline: bool) -> list[Frame]:
        """:meth:`receive_frame` of a SYN: the frames to answer with at once.
        ``change``: its task diff as the ingress that read it parsed it
        (:meth:`open_stream_async`), or None; ``task``: its meta decoded once
        (:func:`~atp_router.runtime.dataplane.opening.syn_task`; None: malformed)
        — what the gates, resumption and the stages read; ``resume_checked``: the
        caller asked :meth:`resume_point` already. A stage's store step runs off
        the trio loop — only for a SYN on a session of its own, which no other
        frame reaches meanwhile (:meth:`open_stream_async`) — else ``inline``
        (:func:`~atp_router.runtime.dataplane.opening.run_stages`).
        Raises :class:`~atp_router.wire.errors.IdempotencyConflict` (a SYN's key
        names another task: :meth:`resume_point`, or a gate such as the
        cluster's re-run)."""
        gated = self._syn_gates(syn, identity, task, resume_checked)
        if isinstance(gated, list):
            return gated
        syn, asked = gated
        sess = self.streams.session(identity.tenant, syn.session_id, now=now)
        direct: list[Frame] = []
        for ev in sess.receive_frame(syn, now):
            if type(ev) is not S.StreamOpened:
                self._on_session_event(ev, sess, identity=identity, direct=direct)
                continue
            # A SYN the session accepted goes through the SYN stages (opening.py); refused, it
            # is reset with the stage's code, else opened. The session dropped a SYN at ttl 0;
            # this hop takes one off the rest (§4.2).
            o = open_ctx(identity, sess.session_id, ev, change=change, task=task, qos_asked=asked)
            refused = await run_stages(self.syn_stages, o, None if inline else self.streams)
            if refused is not None:
                self._refuse_syn(sess, o, refused, direct)
            else:
                self._open(sess, ev, o, S.forward_ttl(syn).ttl)
        return direct

    def _syn_gates(self, syn: Frame, identity: Identity, task: TaskMeta | None,
                   resume_checked: bool) -> tuple[Frame, QoS | None] | list[Frame]:
        """A SYN before its session sees it: a deployment gate's refusal (a lone
        ERROR) or a resumed stream (nothing to answer: ``[]``) is the list of
        frames to answer with; else the SYN, its class clamped to the tenant's
        ``qos_max``, and the class asked when it was clamped (else None).
        ``resume_checked``: the caller asked :meth:`resume_point` already."""
        for gate in self.syn_gates:
            refused = gate.refuse(syn, identity, task)
            if refused is not None:
                self.metrics.errors.labels(str(refused.code)).inc()
                return [connection_error(syn.session_id, syn.stream_id, refused.code, refused.reason,
                                         refused.retry_after_ms)]
        self.metrics.frames.labels("in", frame_kind(syn)).inc()
        if not resume_checked and self.resume_point(syn, identity=identity, task=task) is not None:
            return []
        # The session confirms the SYN's class in its SYN+ACK (§8 step 2): it must
        # see the class StreamAdmission serves (authz.clamp_qos, the one rule).
        qos = clamp_qos(syn.qos, self.client_spec(identity.tenant).qos_max)
        if qos is syn.qos:
            return syn, None
        return msgspec.structs.replace(syn, qos=qos), syn.qos

    def _on_session_event(self, ev: Any, sess: S.Session, *, identity: Identity, direct: list[Frame]) -> None:
        """Act on one event ``sess`` made of an inbound frame other than a SYN it
        accepted (:meth:`_receive` opens those); frames for the sender outside
        any stream's log go to ``direct``."""

        def stream_of(stream_id: str) -> StreamCtx | None:
            return self.streams.get(identity.tenant, sess.session_id, stream_id)

        match ev:
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
        self.metrics.frames.labels("dropped", frame_kind(frame)).inc()
        p = frame.payload
        if p is None or p.type is PayloadType.CONTROL:
            return []
        return [connection_error(frame.session_id, frame.stream_id, ErrorCode.EPROTO,
                                 f"stream is closed: message msg_seq={frame.msg_seq} not delivered")]

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
        route, gen, budget, task = o.route, o.gen, o.budget, o.task
        assert route is not None and gen is not None and budget is not None and task is not None
        window = min_window(ev.window, route.window or DEFAULT_WINDOW)
        qos = o.admitted_qos if o.admitted_qos is not None else (route.qos or QoS.SILVER)
        ctx = StreamCtx(self.streams, sess, ev.stream_id, o.identity, o.meta, qos, window, budget, route,
                        o.now, gen=gen, ttl=ttl, account=o.account, idempotency_key=task.idempotency_key, task=task,
                        task_digest=task_digest(o.meta, o.content)
                        if task.idempotency_key and o.content is not None else None,
                        qos_asked=o.qos_asked if o.qos_asked is not qos else None)
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
        if ctx.qos_asked is not None:  # the class is in the frame; why it is not the one asked, here
            synack.meta["qos_clamped"] = {"asked": str(ctx.qos_asked), "served": str(qos),
                                          "reason": "the tenant's qos_max"}
        if self.tracing is not None:
            synack.meta["trace"] = self.tracing.stream_opened(ctx)
        ctx.push(synack)
        self.audit_event("session_open", o.identity, {
            "session_id": sess.session_id, "stream_id": ev.stream_id, "policy": route.policy,
            "next_hops": [h.agent for h in route.next_hops], "qos": str(qos),
            "budget": msgspec.to_builtins(budget)})
        if o.content is not None:
            self._on_message(ctx, ev.payload, change=o.change, body=o.body)

    def _on_message(self, ctx: StreamCtx, payload: Payload, *, change: ParsedChange | None = None,
                    body: TaskBody | None = None) -> None:
        """A task message on ``ctx`` (the SYN's, or the first one after it): its
        task started with the :class:`Prompt` every next-hop is asked; ``change``
        is its diff as already parsed (the SYN's :attr:`OpenCtx.change
        <atp_router.runtime.dataplane.opening.OpenCtx.change>`), else the
        dispatcher parses it once. ``body``: the content as the SYN's
        ``task_shape`` stage decoded it (:func:`task_body` runs once per task),
        else it is decoded here."""
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
            if body is None:
                body = task_body(ctx.task.task_type, content)
        except LocalProtocolError as e:
            self.stream_closed(ctx.reset(e.code, e.reason))
            return
        ctx.task_started = True
        # Next-hops get the stream's meta with the hop-decremented ttl (§4.2): an
        # agent that is itself an ATP router forwards with it, and drops at 0.
        prompt: Prompt[TaskBody] = Prompt(
            task_type=ctx.task.task_type, content=content, meta={**ctx.meta, "ttl": ctx.ttl},
            change=change_of_task(content, change), task=ctx.task).with_body(body)
        assert self.nursery is not None, "router is not serving"
        # The scope exists before the task runs, so an RST arriving first still stops it.
        ctx.cancel_scope = scope = trio.CancelScope()
        self.nursery.start_soon(self._run_task, ctx, prompt, ctx.gen or self.gen, scope)

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

    async def _run_task(self, ctx: StreamCtx, prompt: Prompt[TaskBody], gen: Generation, scope: trio.CancelScope) -> None:
        """Run ``ctx``'s task (:mod:`atp_router.runtime.dataplane.runner`) under ``scope``
        (traced) and act on its outcome; the generation's hold released after."""
        try:
            with self.tracing.running(ctx) if self.tracing is not None else contextlib.nullcontext():
                plan = plan_task(ctx, prompt, gen.fib, update_interval_ms=self.window_update_interval_ms,
                                 update_delta=self.window_update_delta,
                                 update_keepalive_ms=self.window_update_keepalive_ms,
                                 win_rates=self.learning.win_rates(ctx.route) or None,
                                 cache=self.cache.view(ctx.tenant, gen.cache, ctx.route.policy),
                                 journal=self.journal.view(ctx.tenant, ctx.idempotency_key) if self.journal else None)
                with scope:
                    outcome = await run_task(gen.dispatcher, ctx, plan, guard=self.scope_guard, audit=self.audit_event)
                    if outcome.final is None:
                        self._task_failed(ctx, plan, outcome)
                    else:
                        self.stream_closed(ctx.finish(self._final_sent(ctx, plan, outcome, outcome.final)))
                        self._learn_from(ctx, gen, plan, outcome, outcome.final)
                if scope.cancelled_caught:
                    self.metrics.streams_closed.labels("rst").inc()
        finally:
            self.control.release(ctx)

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
            # Spec §10: EBUDGET → FIN (the ERROR says why, the FIN ends it cleanly); with
            # retry_after_ms when nothing was decided (a store that did not answer).
            ctx.emit_error(e.code, e.reason, retry_after_ms=e.retry_after_ms)
            self.stream_closed(ctx.finish(None))
        else:
            self.stream_closed(ctx.reset(e.code, e.reason))

    def _final_sent(self, ctx: StreamCtx, plan: TaskPlan, outcome: TaskOutcome, final: FinalResult) -> FinalResult:
        """The task's FINAL as it is sent (signed, :func:`~atp_router.runtime.dataplane.stream.signed_final`), counted,
        traced and its escalation audited; the caller sends it and the FIN."""
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
        return signed_final(ctx, final, self.usage_signer, self.gen.version)

    def _learn_from(self, ctx: StreamCtx, gen: Generation, plan: TaskPlan, outcome: TaskOutcome,
                    final: FinalResult) -> None:
        """After the FINAL was sent: learn from it, and start its shadow run when one is due."""
        esc = ctx.route.escalation
        qualities = self.learning.task_done(ctx, plan, final, esc.to if esc is not None and outcome.escalated else None)
        hop = self.learning.shadow_due(ctx, gen, list(qualities))
        if hop is not None and self.nursery is not None:
            # After the FINAL: the client's result and budget are already settled.
            self.nursery.start_soon(self.learning.shadow, ctx, plan, final, gen, hop,
                                     max(qualities.values(), default=0.0))

    def stream_closed(self, closed: Closed | None) -> None:
        """Act on a stream's close (what the call that closed it returned; None:
        it was closed already): what the SYN stages hold for it released
        (:class:`~atp_router.runtime.dataplane.opening.Holding`: a shared quota
        entry), trace and audit it, and end its hold on its generation when no
        task did (a task ends it when it ends)."""
        if closed is None:
            return
        ctx, last, spent = closed.ctx, closed.last, closed.spent
        for stage in self.holding:
            stage.release(ctx.tenant, ctx.stream_id)
        err = error_of_frames([last]) if last is not None else None
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

    async def run_timers(self) -> None:
        """Drive the stream table's timers (grace, idle expiry, retention) until
        cancelled, acting on each stream they reset."""
        while True:
            for closed in await self.streams.next_timers():
                self.stream_closed(closed)

    def open_stream(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                    qos: QoS | None, window: Window | None, idempotency_key: str | None,
                    identity: Identity, change: ParsedChange | None = None) -> StreamCtx:
        """:meth:`open_stream_async` with a stage's store step run on this thread,
        for a caller that cannot await
        (:func:`~atp_router.runtime.dataplane.opening.run_inline`)."""
        return run_inline(self.open_stream_async(
            task=task, content=content, budget=budget, qos=qos, window=window, idempotency_key=idempotency_key,
            identity=identity, change=change, inline=True))

    async def open_stream_async(self, *, task: dict[str, Any], content: dict[str, Any] | None,
                                budget: Budget | None, qos: QoS | None, window: Window | None,
                                idempotency_key: str | None, identity: Identity,
                                change: ParsedChange | None = None, inline: bool = False) -> StreamCtx:
        """Open a stream for ``identity`` (HTTP API, OpenAI ingress, A2A server, MCP)
        by synthesising its SYN frame on a new session
        (:func:`~atp_router.runtime.dataplane.stream.synthesized_syn`). A SYN
        stage's store round trip (a cluster router's atomic OPEN on Redis,
        :class:`~atp_router.runtime.dataplane.opening.StoreStep`) runs on a worker
        thread while the loop serves every other stream (issue 22 item 2);
        ``inline``: on this thread (:meth:`open_stream`). ``change``:
        ``content``'s ``diff`` as the ingress already parsed it
        (:func:`~atp_router.runtime.dataplane.plan.parse_off_loop`): the SYN counts
        ``diff_loc`` from it and every next-hop gets it, so the diff is not parsed
        again (it must be the parse of ``content["diff"]``; :func:`change_of_task`).

        The same ``idempotency_key`` (per tenant) returns the stream it opened
        before — over HTTP or WebSocket — without a second task or charge (§8).
        Raises :class:`ATPError` with the code the SYN was reset with (or the
        deployment's ``store_refusal`` when the store could not be reached).
        """
        syn, typed = synthesized_syn(task, content, budget, qos, window, idempotency_key)
        try:
            if idempotency_key is not None and (resumed := self.resume_point(
                    syn, identity=identity, task=typed)) is not None:
                return resumed[0]
            direct = await self._receive_syn(syn, identity=identity, now=trio.current_time(), change=change,
                                             task=typed, resume_checked=idempotency_key is not None, inline=inline)
        except StoreUnavailable as e:
            if self.store_refusal is None:
                raise
            raise self.store_refusal("open", e) from None
        return self._opened(identity, syn, direct)

    def _opened(self, identity: Identity, syn: Frame, direct: list[Frame]) -> StreamCtx:
        """The stream ``syn`` opened, or the :class:`ATPError` it was refused with (``direct``'s ERROR)."""
        ctx = self.streams.get(identity.tenant, syn.session_id, syn.stream_id)
        if ctx is None:
            err = error_of_frames(direct)
            raise ATPError(err.code if err else ErrorCode.EPROTO, err.reason if err else "stream refused",
                           retry_after_ms=err.retry_after_ms if err else None)
        return ctx
