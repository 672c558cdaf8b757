"""One stream of the router (spec §4.4, §8): :class:`StreamCtx`, and
:class:`Closed`, what closing it returns; its key in the stream table and its
budget-ledger account (:func:`stream_account`); the fingerprint of the task
its idempotency key names (:func:`task_digest`); an ERROR outside any
session's sequence (:func:`connection_error`).

:class:`StreamCtx` holds a stream's session, tenant, route, budget account,
:class:`~atp_router.runtime.dataplane.eventlog.EventLog` and followers; it
implements the dispatcher's ``StreamIO``. It never calls back into the router:
the call that closes it (``finish``, ``reset``, ``stop``, ``peer_reset``, a
``push`` of a FIN or RST; the table's ``abandon`` and timers) returns a
:class:`Closed` — None when it was closed already — and its caller acts on it
(the router audits and traces it and ends its hold on its generation). The
table it lives in is :mod:`atp_router.runtime.dataplane.streams`.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from atp_router.consensus.types import FinalResult, SignedUsage
from atp_router.flow.budget import AccountState, usd_to_micros
from atp_router.runtime.dataplane.eventlog import EventLog
from atp_router.security.identity import Identity
from atp_router.security.signing import UsageSigner
from atp_router.task.change import ParsedChange
from atp_router.task.meta import TaskMeta, decode_meta
from atp_router.wire import session as S
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import (
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

if TYPE_CHECKING:
    from atp_router.runtime.controlplane.control import Generation
    from atp_router.runtime.dataplane.streams import StreamTable

__all__ = [
    "Closed",
    "OpenStream",
    "OpenStreamAsync",
    "StreamCtx",
    "StreamKey",
    "change_of_task",
    "error_of_frames",
    "frame_kind",
    "min_window",
    "signed_final",
    "stream_account",
    "synthesized_syn",
]

#: A stream's identity in the table: (tenant, session_id, stream_id).
StreamKey = tuple[str, str, str]


def stream_account(tenant: str, stream_id: str) -> str:
    """The budget-ledger account of ``tenant``'s stream ``stream_id`` (its parent
    is the tenant's ``client:<tenant>``): ``stream:<tenant>:<stream_id>``. A
    stream id is unique within its tenant while its stream is in the table, and
    a tenant name holds no ``:``, so no two streams share an account."""
    return f"stream:{tenant}:{stream_id}"


@dataclass(frozen=True, slots=True)
class Closed:
    """A stream just closed (it sent its FIN or RST, or its peer reset it): what
    closing returns to its caller, who acts on it (module docstring)."""

    ctx: StreamCtx
    #: The last frame the stream sent (its FIN or RST; when its peer reset it,
    #: whatever went out last), None if it sent none.
    last: Frame | None
    #: Its ledger account at close (what it committed), None when it has none
    #: (a stream read back from the store: its account closed at start-up).
    spent: AccountState | None
    #: No task was started on the stream: its hold on its generation is the
    #: caller's to end (a task ends it when it ends).
    release_gen: bool


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


def task_digest(meta: Mapping[str, Any], content: Any) -> str:
    """The fingerprint of a task an idempotency key names (spec §8): SHA-256
    (hex) of its ``meta.task_type`` and content, canonical JSON (sorted keys).
    Budget, QoS, trace ids and resumption fields are not part of it: a client
    re-opening its stream may change those; a different task it may not."""
    body = msgspec.json.encode([meta.get("task_type"), content], order="sorted")
    return hashlib.sha256(body).hexdigest()


@dataclass(eq=False)
class StreamCtx:
    """One stream inside the router; implements the dispatcher's ``StreamIO``.

    Every outbound frame goes through the stream's sans-IO session, then its
    :class:`EventLog`; a FIN or RST closes it (:meth:`StreamTable.closed`), and
    the call that sent it returns the stream's :class:`Closed` to its caller."""

    table: StreamTable
    session: S.Session
    stream_id: str
    identity: Identity
    meta: dict[str, Any]
    qos: QoS
    window: Window
    budget: Budget
    route: Any  # atp_router.policy.fib.Route
    started: float  # trio.current_time() at SYN, s
    log: EventLog = field(default_factory=EventLog)
    task_started: bool = False
    closed_at: float | None = None
    cancel_scope: trio.CancelScope | None = None
    #: The RIB generation the stream was routed by at SYN; its task runs on it even
    #: after a reload (spec §22 hot reload).
    gen: Generation | None = None
    #: ``ttl`` the stream's task carries to next-hops: the SYN's, less this hop
    #: (:func:`~atp_router.wire.session.forward_ttl`, §4.2).
    ttl: int = 7
    #: Ledger account of the stream (its parent is the tenant's): :func:`stream_account`.
    account: str = ""
    #: The SYN's ``meta.idempotency_key`` (resumption, §8), if any.
    idempotency_key: str | None = None
    #: The SYN meta's typed fields, decoded once at SYN (the ``task_meta`` stage,
    #: :class:`~atp_router.runtime.dataplane.opening.DecodeMeta`): what the stream's
    #: task and every next-hop's :attr:`Prompt.task <atp_router.adapters.base.Prompt.task>`
    #: read. Empty for a stream read back from the store (it runs no task).
    task: TaskMeta = field(default_factory=TaskMeta)
    #: Connections / SSE requests sending this stream's events right now.
    followers: int = 0
    #: When the last follower went away (None while followed, or never followed).
    detached_at: float | None = None
    #: The stream counts among the users of ``gen`` (its adapters stay open).
    holds_gen: bool = False
    #: Read back from the store after a restart (closed; its log is the stored one).
    restored: bool = False
    #: The bandit's choice for this stream (atp_router.policy.learn.Decision; its JSON
    #: dict when read back from the store), None for a policy without bandit.
    decision: Any = None
    #: When a closed stream leaves memory at the latest (trio time, s; its reads
    #: are then served from the store).
    retain_until: float = math.inf
    #: An event of the stream could not be stored: its whole log is only in
    #: memory, kept there for the full ``retain_closed_s`` whatever the bounds.
    unstored: bool = False
    #: :func:`task_digest` of the task its
    #: SYN carried under an idempotency key (None: no key, or no task on the SYN):
    #: a re-open by that key with another task is refused (IdempotencyConflict).
    task_digest: str | None = None
    #: The class the SYN asked for when the tenant's ``qos_max`` lowered it to
    #: :attr:`qos` (spec §9, §11; said in the SYN+ACK and the FINAL), else None.
    qos_asked: QoS | None = None

    @property
    def tenant(self) -> str:
        """The tenant (RIB client) the stream belongs to."""
        return self.identity.tenant

    def qos_headers(self) -> dict[str, str]:
        """The HTTP headers an ingress answers an open with: ``x-atp-qos``, the
        class the stream runs at, and ``x-atp-qos-asked`` when the tenant's
        ``qos_max`` lowered the class asked for (spec §9, §11)."""
        out = {"x-atp-qos": str(self.qos)}
        if self.qos_asked is not None:
            out["x-atp-qos-asked"] = str(self.qos_asked)
        return out

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def key(self) -> StreamKey:
        return (self.identity.tenant, self.session.session_id, self.stream_id)

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
            self.table.detached(self)
        elif self.followers == 0 and self.closed_at is not None:
            self.log.compact()
            self.table.bound_retention(self)  # smaller now, and free to leave memory

    # --- outbound (every frame goes through the session machine, then the log) ---
    def push(self, frames: Frame | list[Frame]) -> Closed | None:
        """Send ``frames`` (append them to the log, store them); a FIN or RST
        among them closes the stream: its :class:`Closed` is returned."""
        table = self.table
        closed = None
        for f in frames if isinstance(frames, list) else [frames]:
            ev = self.log.append(f, durable=not table.persistence.group_commit or self.restored)
            table.metrics.frames.labels("out", ev.type).inc()
            table.persistence.persist_event(self, ev)
            if ev.type in ("FIN", "RST"):
                closed = self._mark_closed() or closed
        return closed

    def _mark_closed(self) -> Closed | None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
            return self.table.closed(self)
        return None

    def peer_reset(self) -> Closed | None:
        """The client reset the stream: stop its task (spend is still committed) and
        end the log. Nothing is sent back: an RST is never answered (spec §4.4)."""
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()
        if not self.log.closed:
            self.log.close()
            return self._mark_closed()
        return None

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
        self.table.metrics.errors.labels(str(code)).inc()
        self.push(self.session.send_error(self.stream_id, code, reason, retry_after_ms=retry_after_ms))

    def emit_window_update(self, update: WindowUpdate) -> None:
        if not self.log.closed:
            self.push(self.session.send_control(self.stream_id, update))

    def finish(self, final: FinalResult | None) -> Closed | None:
        """FINAL (``final``, if any), then FIN: returns the stream's :class:`Closed`
        (None when it was closed already)."""
        if self.log.closed:
            return None
        if final is not None:
            self.push(self.session.send_message(
                self.stream_id,
                Payload(type=PayloadType.FINAL, content=msgspec.to_builtins(final)),
            ))
        return self.push(self.session.finish(self.stream_id))

    def reset(self, code: ErrorCode, reason: str) -> Closed | None:
        """RST ``code``: returns the stream's :class:`Closed` (None when it was closed already)."""
        if self.log.closed:
            return None
        self.table.metrics.errors.labels(str(code)).inc()
        return self.push(self.session.reset(self.stream_id, code, reason))

    def stop(self, code: ErrorCode, reason: str) -> Closed | None:
        """Reset the stream (RST ``code``) and stop its task; what its calls used
        so far is committed by the dispatcher. Returns what :meth:`reset` does."""
        closed = self.reset(code, reason)
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()
        return closed


def change_of_task(content: Any, change: ParsedChange | None) -> ParsedChange | None:
    """``change`` (an ingress's parse of ``content["diff"]``, :meth:`DataPlane.open_stream <atp_router.runtime.dataplane.plane.DataPlane.open_stream>`)
    when the task ``content`` has a ``diff`` string, else None: a change never
    rides on a task without a diff."""
    if change is None or not isinstance(content, dict):
        return None
    return change if isinstance(content.get("diff"), str) else None


def frame_kind(frame: Frame) -> str:
    """The metrics label of ``frame``: its first flag of SYN, RST, FIN, HB, CTRL, ACK, else DATA."""
    for f in (Flag.SYN, Flag.RST, Flag.FIN, Flag.HB, Flag.CTRL, Flag.ACK):
        if f in frame.flags:
            return f.value
    return "DATA"


def error_of_frames(frames: list[Frame]) -> ErrorPayload | None:
    """The first ERROR among ``frames`` (typed, or as a dict), None without one."""
    for f in frames:
        if f.payload is not None and f.payload.type is PayloadType.CONTROL:
            c = f.payload.content
            if isinstance(c, ErrorPayload):
                return c
            if isinstance(c, dict) and c.get("kind") == "ERROR":
                return msgspec.convert(c, ErrorPayload)
    return None


def min_window(a: Window | None, b: Window) -> Window:
    """The tighter of two windows on each axis (``a`` None: ``b``)."""
    if a is None:
        return b
    return Window(
        max_parallel=min(a.max_parallel, b.max_parallel),
        max_tokens=min(a.max_tokens, b.max_tokens),
        max_usd_micros=min(a.max_usd_micros, b.max_usd_micros),
    )


class OpenStream(Protocol):
    """:meth:`DataPlane.open_stream`'s signature, as the router facade hands it to the ingresses."""

    def __call__(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                 qos: QoS | None, window: Window | None, idempotency_key: str | None,
                 identity: Identity, change: ParsedChange | None = None) -> StreamCtx: ...


class OpenStreamAsync(Protocol):
    """:meth:`DataPlane.open_stream_async`'s signature, as the router facade hands it to the ingresses."""

    async def __call__(self, *, task: dict[str, Any], content: dict[str, Any] | None, budget: Budget | None,
                       qos: QoS | None, window: Window | None, idempotency_key: str | None,
                       identity: Identity, change: ParsedChange | None = None) -> StreamCtx: ...


def signed_final(ctx: StreamCtx, final: FinalResult, signer: UsageSigner, rib_version: int) -> FinalResult:
    """``final`` with its telemetry's signed usage summary (spec §19: a client
    can prove what it was charged; ``GET /v1/keys`` has the public key):
    tenant, stream, tokens, USD micros, the next-hops that reported, the RIB
    version (the stream's generation, else ``rib_version``), the close time (ms)."""
    t = final.telemetry
    contents = (ev.frame.payload.content for ev in ctx.log.events
                if ev.type == "PARTIAL" and ev.frame.payload is not None)
    reporters = {c.get("agent") for c in contents if isinstance(c, dict) and "report" in c}
    summary = {"tenant": ctx.tenant, "session_id": ctx.session_id, "stream_id": ctx.stream_id,
               "tokens": t.tokens, "usd_micros": usd_to_micros(t.usd), "calls": len(reporters),
               "rib_version": ctx.gen.version if ctx.gen is not None else rib_version,
               "closed_at_ms": int(time.time() * 1000)}
    usage = SignedUsage(summary=summary, jws=signer.sign(summary))
    return msgspec.structs.replace(final, telemetry=msgspec.structs.replace(t, usage=usage))


def synthesized_syn(task: dict[str, Any], content: Any, budget: Budget | None, qos: QoS | None,
                    window: Window | None, idempotency_key: str | None) -> tuple[Frame, TaskMeta | None]:
    """The SYN an ingress opens a stream with, on a new session and stream id,
    and its typed meta (:func:`~atp_router.task.meta.decode_meta`, None when
    malformed), the budget and key from the typed arguments, not decoded back
    from the frame's meta that records them."""
    meta = dict(task)
    if budget is not None:
        meta["budget"] = msgspec.to_builtins(budget)
    if idempotency_key is not None:
        meta["idempotency_key"] = idempotency_key
    syn = Frame(v=1, session_id="sess_" + secrets.token_hex(8), stream_id="task_" + secrets.token_hex(8),
                msg_seq=0, flags=[Flag.SYN], qos=qos or QoS.SILVER, window=window, meta=meta,
                payload=Payload(type=PayloadType.TASK, content=content) if content is not None else None)
    try:
        typed: TaskMeta | None = decode_meta(task)
    except msgspec.ValidationError:
        typed = None  # the task_meta stage refuses it, EPROTO naming the field
    if typed is not None and (budget is not None or idempotency_key is not None):
        typed = msgspec.structs.replace(
            typed, budget=budget if budget is not None else typed.budget,
            idempotency_key=idempotency_key if idempotency_key is not None else typed.idempotency_key)
    return syn, typed
