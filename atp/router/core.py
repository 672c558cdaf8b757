"""The router: RIB/FIB, adapters, sessions and streams, wired to trio.

:class:`Router` owns the control plane (the running RIB compiled into a FIB, hot
reload) and the data plane (sessions, streams, dispatch). Ingresses — the
WebSocket server (:mod:`atp.router.ws`) and the HTTP control API
(:mod:`atp.router.api`) — only move frames: both feed inbound frames to a sans-IO
:class:`~atp.wire.session.Session` and send what the stream's
:class:`~atp.router.streams.EventLog` holds, so a stream behaves the same whichever
way it was opened.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from atp.adapters.base import Prompt, ProviderAdapter
from atp.adapters.registry import build_adapter
from atp.consensus.types import FinalResult
from atp.flow.budget import Allowance, BudgetLedger
from atp.flow.window import Window as FlowWindow
from atp.policy.fib import Fib, compile_fib
from atp.policy.loader import load_rib, load_rib_text
from atp.policy.rib import Rib
from atp.review.diff import diff_loc, parse_diff
from atp.router.dispatch import Dispatcher, LegOutcome, TaskPlan
from atp.router.metrics import RouterMetrics
from atp.router.streams import EventLog
from atp.wire.errors import AgentError, ATPError, ErrorCode, LocalProtocolError, PolicyError
from atp.wire.frame import (
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
from atp.wire import session as S

log = logging.getLogger("atp.router")

#: Window granted when neither the client nor the policy set one (spec §15.1 defaults).
DEFAULT_WINDOW = Window(max_parallel=4, max_tokens=120_000, max_usd_micros=1_250_000)


@dataclass
class RouterConfig:
    """Static configuration of one router process.

    ``tokens`` are the accepted bearer tokens (empty: authentication off, for a
    local appliance only); ``hmac_key`` makes signed frames mandatory on the
    WebSocket ingress (spec §11).
    """

    policies: Path
    host: str = "127.0.0.1"
    http_port: int = 7070
    ws_port: int = 7071
    tokens: frozenset[str] = frozenset()
    hmac_key: bytes | None = None
    retain_closed_s: float = 300.0
    max_streams: int = 10_000


@dataclass(eq=False)
class StreamCtx:
    """One stream inside the router; implements the dispatcher's ``StreamIO``."""

    router: "Router"
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

    @property
    def session_id(self) -> str:
        return self.session.session_id

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
        self.idempotency: dict[tuple[str, str], str] = {}
        self._nursery: trio.Nursery | None = None
        self._adapter_cache: dict[tuple[str, bytes], ProviderAdapter] = {}
        self.gen = self._compile(load_rib(config.policies), version=1, source=str(config.policies))
        self.metrics.rib_version.set(1)

    # ------------------------------------------------------------------ control plane
    def _compile(self, rib: Rib, *, version: int, source: str) -> Generation:
        """RIB → FIB + adapters. Raises PolicyError without touching the running state."""
        fib = compile_fib(rib, version=version)
        adapters: dict[str, ProviderAdapter] = {}
        for name, agent in rib.agents.items():
            model = rib.models.get(agent.model) if agent.model else None
            key = (name, msgspec.json.encode([agent, model]))
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
            self._adapter_cache[(name, msgspec.json.encode([rib.agents[name], rib.models.get(rib.agents[name].model) if rib.agents[name].model else None]))] = adapter
        dispatcher = Dispatcher(
            adapters, self.ledger, win_rates={n: a.win30d for n, a in rib.agents.items()}, on_leg=self._on_leg
        )
        return Generation(version, rib, fib, adapters, dispatcher, source)

    def reload(self, text: str | None = None) -> dict[str, Any]:
        """Hot-reload the RIB from the configured path or from YAML ``text`` (§22).

        Returns ``{"version", "policies", "agents"}``. Raises :class:`PolicyError`
        (file, key, reason) and keeps the running RIB when the new one is refused.
        Streams already running finish on the generation they started with.
        """
        try:
            rib = load_rib_text(text, file="<request body>") if text is not None else load_rib(self.config.policies)
            gen = self._compile(rib, version=self.gen.version + 1, source="<request body>" if text else str(self.config.policies))
        except PolicyError:
            self.metrics.policy_reloads.labels("refused").inc()
            raise
        self.gen = gen
        self.metrics.policy_reloads.labels("ok").inc()
        self.metrics.rib_version.set(gen.version)
        log.info("RIB generation %d loaded from %s", gen.version, gen.source)
        return self.rib_summary()

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
            sess = self.sessions[session_id] = S.Session(S.Role.ROUTER, session_id, now=trio.current_time())
        return sess

    def receive_frame(self, frame: Frame, *, client: str, now: float) -> list[StreamCtx | Frame]:
        """Feed one inbound frame (already decoded and verified) to its session.

        Returns frames that must be sent back immediately to this sender and are
        not part of any stream log (errors about unknown streams). Protocol errors
        reset only the stream concerned. A frame on a session another client
        opened is refused with an ERROR ``ESEC`` and touches nothing (spec §11).
        """
        self.metrics.frames.labels("in", _kind(frame)).inc()
        owner = self._owners.setdefault(frame.session_id, client)
        if owner != client:
            self.metrics.errors.labels(str(ErrorCode.ESEC)).inc()
            return [connection_error(frame.session_id, frame.stream_id, ErrorCode.ESEC,
                                     "session_id belongs to another client")]
        sess = self.session_for(frame.session_id)
        direct: list[Frame] = []

        def stream_of(stream_id: str) -> StreamCtx | None:
            # Stream ids are chosen by clients: only this session's stream is addressed.
            ctx = self.streams.get(stream_id)
            return ctx if ctx is not None and ctx.session is sess else None

        for ev in sess.receive_frame(frame, now):
            match ev:
                case S.StreamOpened():
                    self._on_syn(sess, ev, client=client, direct=direct)
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

    def _on_syn(self, sess: S.Session, ev: Any, *, client: str, direct: list[Frame]) -> None:
        meta = dict(ev.meta)
        content = None
        if ev.payload is not None and ev.payload.type is PayloadType.TASK:
            content = ev.payload.content
        try:
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
                    self.ledger.close(ev.stream_id)
                except ValueError:
                    raise LocalProtocolError(
                        ErrorCode.EPROTO, f"stream_id {ev.stream_id!r} is still settling its spend; retry"
                    ) from None
                del self.streams[ev.stream_id]
            client_budget = _client_budget(meta)
            gen = self.gen
            route = gen.fib.lookup(meta)
        except ATPError as e:
            self.metrics.errors.labels(str(e.code)).inc()
            direct.append(sess.reset(ev.stream_id, e.code, e.reason))
            return
        window = _min_window(ev.window, route.window or DEFAULT_WINDOW)
        budget = _min_budget(client_budget, route.budget)
        qos = ev.qos if ev.qos is not None else (route.qos or QoS.SILVER)
        ctx = StreamCtx(self, sess, ev.stream_id, client, meta, qos, window, budget, route, trio.current_time(), gen=gen)
        self.streams[ev.stream_id] = ctx
        self.open_count += 1
        self.ledger.open(ev.stream_id, Allowance.from_budget(budget))
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
        prompt = Prompt(task_type=str(ctx.meta.get("task_type", "")), content=content, meta=ctx.meta)
        assert self._nursery is not None, "router is not serving"
        # The scope exists before the task runs, so an RST arriving first still stops it.
        ctx.cancel_scope = scope = trio.CancelScope()
        self._nursery.start_soon(self._run_task, ctx, prompt, ctx.gen or self.gen, scope)

    def _on_control(self, ctx: StreamCtx, control: Any) -> None:
        from atp.wire.frame import BudgetUpdate

        if isinstance(control, BudgetUpdate):
            b = control.budget
            refusal = self.ledger.set_limit(ctx.stream_id, Allowance.from_budget(b))
            if refusal is not None:
                ctx.emit_error(refusal.code, refusal.reason)
            else:
                ctx.budget = b

    async def _run_task(self, ctx: StreamCtx, prompt: Prompt, gen: Generation, scope: trio.CancelScope) -> None:
        plan = TaskPlan(
            prompt=prompt,
            route=ctx.route,
            window=FlowWindow(ctx.window),
            ledger_key=ctx.stream_id,
            qos=ctx.qos,
            started=ctx.started,
            deadline=ctx.started + ctx.route.deadline_ms / 1000,
        )
        with scope:
            try:
                final = await gen.dispatcher.run(ctx, plan)
            except AgentError as e:
                self.metrics.streams_closed.labels(str(e.code)).inc()
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
            for t in getattr(gen.dispatcher, "last_triggers", []):
                self.metrics.escalations.labels(t).inc()
            self.metrics.streams_closed.labels("final").inc()
            ctx.finish(final)
        if scope.cancelled_caught:
            self.metrics.streams_closed.labels("rst").inc()

    # ------------------------------------------------------------------ HTTP helpers
    def open_stream(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                    qos: QoS | None, window: Window | None, idempotency_key: str | None, client: str) -> StreamCtx:
        """Open a stream for the HTTP API by synthesising the client's SYN frame.

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
        if idempotency_key is not None:
            self.idempotency[(client, idempotency_key)] = stream_id
        return ctx

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the router's background work (stream tasks, reaper) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._reaper)
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                with trio.CancelScope(shield=True):
                    for adapter in self._adapter_cache.values():
                        await adapter.aclose()

    async def _reaper(self) -> None:
        while True:
            await trio.sleep(min(self.config.retain_closed_s, 30.0))
            now = trio.current_time()
            for sid, ctx in list(self.streams.items()):
                if ctx.closed_at is not None and now - ctx.closed_at > self.config.retain_closed_s:
                    try:
                        self.ledger.close(sid)
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
    for f in (Flag.SYN, Flag.RST, Flag.FIN, Flag.HB, Flag.CTRL):
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
