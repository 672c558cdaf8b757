"""``atp-router --workers N``: one router on every core (issue 10).

One router process saturates one core (its trio loop runs every stream's
frames, SSE and next-hop calls). With ``--workers N`` a **supervisor** process:

1. holds the state directory's lock (one router per ``--state-dir``, as ever)
   and runs crash recovery once — the reservations a previous run left open
   are committed at their reserved amount, its open streams reported
   interrupted, the audit chain checked, the RIB validated
   (:func:`atp_router.deploy.single.build`, the single-process code path);
2. binds the HTTP and WebSocket listening sockets once (the A2A server and the
   OpenAI ingress are routes of the HTTP app: no socket of their own);
3. starts N **worker** processes (``python -m atp_router.deploy.cli <the same
   arguments>`` plus a private ``--worker-spec``) that inherit both sockets and
   accept on them — the kernel spreads the connections — and prints one
   ``listening`` line (``workers=N``) once all are ready;
4. restarts a worker that dies (``kill -9`` included; a worker dying within
   seconds of its start is restarted with a growing backoff), after
   **settling** what it left (:func:`settle`): its open reservations are
   committed at their reserved amount and its stream accounts closed (the
   crash rule: a budget never comes back), its open streams end with an RST
   saying they were interrupted (spec §8) — the others keep serving;
5. on SIGINT/SIGTERM stops the workers (SIGTERM: each drains up to ``--drain-s``;
   SIGKILL after that plus :data:`STOP_GRACE_S`; a second signal is passed on: they stop at once),
   settles them and exits 0. Workers stop when it is gone (they watch their
   parent) and hold its inherited lock, so no second router starts on the
   directory while one of them lives.

Every worker is a whole router (:func:`build`, its :class:`Worker`) on the one SQLite store
(WAL, ``multiprocess``; :mod:`atp_router.store.sqlite`). What they share through it:

================  ==========================================================
budgets           exact: a :class:`~atp_router.flow.budget.SharedBudgetLedger` —
                  every reserve / extend / commit / release is one ``BEGIN
                  IMMEDIATE`` transaction along the account chain (stream →
                  ``client:<tenant>``), so ``committed + reserved <= limit``
                  holds across workers; reservation ids come from the store
streams           each stream is stored with its **owner** worker
                  (``w<slot>.<pid>``); events, idempotency keys and finished
                  streams are read from the store by any worker
audit             one hash chain: each record is chained to the store's head
                  atomically (``AuditLog(shared=True)``)
RIB               a reload (API, or the ``--policies`` watcher, which only
                  worker 0 runs) gets a store-wide version
                  (``Store.next_rib_version``) and is saved as the active
                  RIB; every worker polls the active version every
                  :data:`RIB_POLL_S` (one indexed row) and loads a new one —
                  from the saved text, or from ``--policies`` for a file
                  reload. A reload answered by one worker is in force on all
                  within about half a second. (A file edited while worker 0
                  restarts is loaded by the next edit or reload.)
================  ==========================================================

**Any request on any worker** (spec §8, §11): a request about a stream —
``/v1/streams/{id}/events``, ``/frames`` (a cancelling RST, a BUDGET_UPDATE),
``/feedback``; ``POST /v1/streams``, ``/v1/chat/completions`` and A2A
``message/send`` with an idempotency key; A2A ``tasks/get|cancel|resubscribe``
— that lands on a worker which does not hold the stream is forwarded by
:class:`ForwardingApp` to the worker that owns it, over that worker's private
unix socket (``<state-dir>/workers/w<slot>.sock``, in the 0700 state
directory) with the caller's own ``Authorization``: the owner authenticates and
scopes it exactly as if it had come straight in (another tenant's stream is
the same 404). Responses carry ``x-atp-worker`` (the worker that accepted the
connection) and, when forwarded, ``x-atp-served-by`` (the owner). A stream
whose owner is gone is served from the store by whoever gets the request
(finished or interrupted); while its owner is being settled, a request about
it answers 503 ``EAGENTDOWN`` with ``Retry-After: 1``.

Also shared (:mod:`atp_router.runtime.controlplane.shared_state`): the learned routing state — the
bandit arms and live FIB statistics are *merged* through the store every
second (each worker learns from every worker's traffic) — and circuit-breaker
openings (a breaker that opens on one worker is open on the others within
half a second and a store round trip; each then probes on its own).

Shared too (:mod:`atp_router.runtime.dataplane.quotas`): a tenant's ``max_streams``
quota, its stream-open rate and its learning rate, counted in the store in one
``BEGIN IMMEDIATE`` transaction per SYN — each stream's entry names its worker
and is removed when the stream closes or its worker is settled; while the store
cannot decide, each worker falls back to its own limits.

Per worker, not shared: the stream table's limit (``--max-streams``), the QoS slots, next-hop
windows, the breakers' failure counts (an agent failing a little on every
worker trips each worker's breaker only at its own threshold) and
``/v1/metrics``. A WebSocket
SYN that resumes (by idempotency key) a stream still running on another worker
is refused with ``EAGENTDOWN`` rather than run twice: reconnect (the kernel may
pick the owner) or follow it over HTTP, which forwards.

**Readiness** (``GET /v1/ready``, :mod:`atp_router.runtime.admin.readiness`): the
worker that accepted the connection answers; every worker checks the one store and
state directory they share (:func:`~atp_router.deploy.single.store_check`), so any
worker's verdict is the router's — what a load balancer in front of the one
listening port needs — and a worker being restarted accepts no connection.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from prometheus_client import Counter

from atp_router.deploy import single
from atp_router.deploy.http_serve import serve_http, settle_heap, track_requests
from atp_router.deploy.single import end_interrupted
from atp_router.flow.budget import SharedBudgetLedger
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.controlplane import shared_state
from atp_router.runtime.controlplane.control import BODY_SOURCE
from atp_router.runtime.controlplane.drain import drain, stop_signal_receiver
from atp_router.runtime.dataplane.opening import DEFAULT_STAGES
from atp_router.runtime.dataplane.quotas import SharedQuotas, with_shared_quotas
from atp_router.runtime.deployment import StateParts, SynGate
from atp_router.runtime.ingress.http_api import build_app
from atp_router.runtime.ingress.ws import serve_ws
from atp_router.runtime.router import Router
from atp_router.security.audit import AuditLog
from atp_router.security.authz import Refuse
from atp_router.security.identity import Identity
from atp_router.store import SqliteStore, Store, StoreError, StoreUnavailable
from atp_router.store.sqlite import sync_mode
from atp_router.store.threads import off_loop
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import ATPError, ErrorCode, PolicyError
from atp_router.wire.frame import Frame

__all__ = ["RETRY", "RIB_POLL_S", "ForwardingApp", "Peer", "SharedRib", "Worker", "WorkerSpec", "build",
           "open_worker_state", "settle", "supervise", "worker_main"]

log = logging.getLogger("atp_router.deploy.workers")

#: How often a worker polls the store for a RIB another worker loaded, s.
RIB_POLL_S = 0.5
#: A worker's open streams when it died: their RST reason (spec §8).
WORKER_INTERRUPTED = ("interrupted: the router worker running the stream stopped; it was not re-run — "
                      "open a new stream (new idempotency_key) to run it again")
#: How often the supervisor copies the workers' WAL back into the database, s.
CHECKPOINT_S = 0.5
#: SIGTERM → SIGKILL grace for a worker at shutdown beyond its drain (``drain_s``), s.
STOP_GRACE_S = 10.0
#: A worker that ran less than this before dying is restarted after a backoff, s.
_QUICK_DEATH_S = 5.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is told by its supervisor (``--worker-spec``, JSON):
    its ``slot`` (0..N-1), ``workers`` (N), the inherited listening socket fds
    (``http_fd``, ``ws_fd``), the supervisor's lock fd (kept open: the lock
    lives while any worker does), the pipe it reports readiness on
    (``ready_fd``) and the supervisor's pid (``parent``)."""

    slot: int
    workers: int
    http_fd: int
    ws_fd: int
    lock_fd: int
    ready_fd: int
    parent: int

    @property
    def owner(self) -> str:
        """This worker's owner name in the store: ``w<slot>.<pid>``."""
        return owner_name(self.slot, os.getpid())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


def owner_name(slot: int, pid: int) -> str:
    """The owner name of worker ``slot`` running as ``pid``: ``w<slot>.<pid>``."""
    return f"w{slot}.{pid}"


_OWNER = re.compile(r"^w(\d+)\.(\d+)$")


def _owner_slot_pid(owner: str) -> tuple[int, int] | None:
    m = _OWNER.match(owner)
    return (int(m[1]), int(m[2])) if m else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie — dead, not yet reaped — does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sockets_dir(state_dir: Path) -> Path:
    """Where the workers' private unix sockets live: ``<state-dir>/workers``."""
    return Path(state_dir) / "workers"


def worker_socket(state_dir: Path, slot: int) -> Path:
    """Worker ``slot``'s private unix socket (forwarded requests only)."""
    return sockets_dir(state_dir) / f"w{slot}.sock"


# ------------------------------------------------------------------ shared RIB
class SharedRib:
    """The RIB of router processes that share one store (:class:`Worker`,
    :mod:`atp_router.deploy.cluster`), a part their routers are assembled with: a
    reload gets a store-wide version (:meth:`next_version`, the router's
    ``rib_version``; :meth:`Store.next_rib_version
    <atp_router.store.base.Store.next_rib_version>`) and is saved as the active RIB;
    the follower (:meth:`service`, one of the router's background services)
    polls the active version every :data:`RIB_POLL_S` and loads one another
    process set — its saved text, or ``--policies`` for a file reload. A RIB
    refused here is logged once and not retried until the next version."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: The version last refused here (not retried until the next one).
        self.refused: int | None = None

    def next_version(self) -> int:
        """The version of a reload on this router: the next store-wide one (the
        other processes load it from the store within :data:`RIB_POLL_S`)."""
        return self.store.next_rib_version()

    def adopt(self, router: Router) -> bool:
        """Load the store's active RIB into ``router`` if it is not the running one
        (a reload by another process): its saved text, or ``--policies`` for a
        file reload. Returns whether it changed. Raises PolicyError."""
        active = self.store.active_rib()
        if active is None or active[0] == router.gen.version or active[0] == self.refused:
            return False
        version, text, source = active
        try:
            router.control.reload(text if source == BODY_SOURCE and text else None, version=version)
        except PolicyError:
            self.refused = version
            raise
        return True

    def service(self, router: Router) -> list[Callable[[], Awaitable[None]]]:
        """The follower, as a background service of ``router``."""
        return [functools.partial(self.follow, router)]

    async def follow(self, router: Router) -> None:
        """Adopt the RIB another process loaded, every :data:`RIB_POLL_S`."""
        while True:
            await trio.sleep(RIB_POLL_S)
            try:
                if await off_loop(self.store, self.store.active_rib_version) in (router.gen.version, self.refused,
                                                                                None):
                    continue
                if self.adopt(router):
                    log.info("RIB generation %d loaded (reloaded by another router process)", router.gen.version)
            except PolicyError as e:
                log.error("RIB generation %s refused here (kept generation %d): %s", self.refused,
                          router.gen.version, "; ".join(x.where() for x in e.errors))
            except StoreUnavailable:
                continue  # a shared store that cannot be reached: the router says so, once (atp_router.deploy.cluster)
            except Exception:
                log.exception("RIB follower: store read failed")


# ---------------------------------------------------------------------------- worker
def open_worker_state(config: RouterConfig, owner: str) -> tuple[StateParts, SharedRib]:
    """The state of worker ``owner`` on the directory its supervisor holds: no
    lock of its own, no crash recovery (the supervisor's), the store opened
    ``multiprocess`` without checkpoints (the supervisor runs them aside: a
    worker's commit never holds the write lock through a checkpoint's copy and
    fsync), budgets in a :class:`~atp_router.flow.budget.SharedBudgetLedger`, the
    audit chain shared; restored by adopting the store's active RIB (the
    :class:`SharedRib` returned with it)."""
    state_dir = config.state_dir
    assert state_dir is not None, "--workers needs a --state-dir"
    sync = sync_mode(config.state_sync)
    store = SqliteStore.open(state_dir, synchronous=sync, multiprocess=True, autocheckpoint=False)
    ledger = SharedBudgetLedger(store, owner=owner)
    audit_log = AuditLog.open(store, state_dir, shared=True, options=config.audit, fsync_head=sync == "FULL")
    rib = SharedRib(store)
    return StateParts(state_dir=state_dir, store=store, audit_log=audit_log, ledger=ledger,
                      close=single.closing(audit_log, store), store_check=single.store_check(store, ledger),
                      restore=(rib.adopt,)), rib


def build(config: RouterConfig, spec: WorkerSpec, **kw: Any) -> tuple[Router, Worker]:
    """The router of worker ``spec.slot`` (module docstring), assembled from
    the state its supervisor holds (:func:`open_worker_state`), with RIB
    versions from the store and a follower adopting the RIB other workers load
    (:class:`SharedRib`), learning and breakers shared
    (:mod:`atp_router.runtime.controlplane.shared_state`), its streams stored with its
    owner name and the :class:`Worker` gate on its SYNs; only worker 0 watches
    ``--policies`` (its reload reaches the others through the store). Returns
    it with its :class:`Worker` (where requests about others' streams go).
    ``kw`` as for :class:`~atp_router.runtime.router.Router` (``syn_stages``)."""
    worker = Worker(spec, config.state_dir)
    state, rib = open_worker_state(config, worker.owner)
    metrics = kw.pop("metrics", None) or RouterMetrics()
    # A tenant's quotas counted across the workers in the store (atp_router.runtime.dataplane.quotas).
    quotas = SharedQuotas(state.store, owner=worker.owner, metrics=metrics)
    # Learning merged and breaker openings followed across workers (atp_router.runtime.controlplane.shared_state).
    router = Router(replace(config, watch_policies=config.watch_policies and spec.slot == 0), state,
                    services=(rib.service, lambda r: shared_state.background_tasks(r, worker.owner), quotas.service),
                    rib_version=rib.next_version, syn_gates=(worker,), metrics=metrics,
                    syn_stages=with_shared_quotas(kw.pop("syn_stages", DEFAULT_STAGES), quotas), **kw)
    router.streams.persistence.owner = worker.owner
    router.learning.shared_rate = quotas.may_learn
    worker.router = router
    return router, worker


class Worker(SynGate):
    """What makes a router one of N workers (:func:`build`): its owner name
    ``w<slot>.<pid>``, where a request about a stream another worker owns goes
    (:meth:`forward_target`, for :class:`ForwardingApp`), the ``x-atp-worker``
    tag of its answers, and the gate on its SYNs: one re-opening (by
    idempotency key) a stream that runs on another worker is refused with
    ``EAGENTDOWN`` instead of running its task a second time (:meth:`refuse`)."""

    def __init__(self, spec: WorkerSpec, state_dir: Path | None) -> None:
        assert state_dir is not None, "--workers needs a --state-dir"
        self.spec = spec
        self.owner = spec.owner
        self.state_dir = state_dir
        self.router: Router | None = None

    def refuse(self, frame: Frame, identity: Identity, task: TaskMeta | None) -> Refuse | None:
        router = self.router
        assert router is not None
        if task is not None and (key := task.idempotency_key) is not None \
                and router.streams.resumable(identity.tenant, key) is None:
            rec = router.store.find_idempotent(identity.tenant, key)
            if rec is not None and rec.state == "open" and rec.owner not in (None, self.owner):
                return Refuse(ErrorCode.EAGENTDOWN,
                              f"stream {rec.stream_id!r} of this idempotency_key runs on another router "
                              "worker: follow it over HTTP (GET /v1/streams/{id}/events) or reconnect "
                              "and resume again")
        return None

    def forward_target(self, rec: Any) -> Any:
        """Where :class:`ForwardingApp` sends a request about stored stream
        ``rec``: the :class:`Peer` of its owner when that is another live worker
        (its private unix socket); :data:`RETRY` when its owner died with the
        stream open (being settled); None: served here."""
        if rec is None or rec.owner is None or rec.owner == self.owner:
            return None
        sp = _owner_slot_pid(rec.owner)
        if sp is None:
            return None
        slot, pid = sp
        if _alive(pid):
            return Peer(str(slot), "http://atp-worker", uds=str(worker_socket(self.state_dir, slot)))
        return RETRY if rec.state == "open" else None

    @property
    def instance_tag(self) -> tuple[bytes, bytes]:
        """The header every response of this worker carries: ``x-atp-worker: <slot>``."""
        return (b"x-atp-worker", str(self.spec.slot).encode())


# ---------------------------------------------------------------------- forwarding
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_STREAM_PATH = re.compile(r"^/v1/streams/([^/]+)/(?:events|frames|feedback)$")
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", b"content-length"})
#: :meth:`Worker.forward_target` of a stream whose owner stopped with the
#: stream open and is being settled: answered 503, retry.
RETRY: Any = object()
#: The header a forwarded request carries (the forwarding process's tag): served where it lands.
_FORWARDED_BY = b"x-atp-forwarded-by"


class _Keyed(msgspec.Struct):
    idempotency_key: str | None = None


class _OpenAIBody(msgspec.Struct):
    atp: _Keyed | None = None


class _RpcMessage(msgspec.Struct):
    messageId: str | None = None  # A2A names it so


class _RpcParams(msgspec.Struct):
    id: Any = None
    message: _RpcMessage | None = None


class _Rpc(msgspec.Struct):
    method: str | None = None
    params: _RpcParams | None = None


_A2A_BY_ID = {"tasks/get", "tasks/cancel", "tasks/resubscribe", "GetTask", "CancelTask", "SubscribeToTask"}
_A2A_SEND = {"message/send", "message/stream", "SendMessage", "SendStreamingMessage"}


def _body_key(path: str, body: bytes) -> tuple[str, str] | None:
    """What a POST body names: ``("key", idempotency key)`` or ``("stream",
    stream id)``; None when nothing (or it does not parse: the app answers)."""
    try:
        if path == "/v1/streams":
            key = msgspec.json.decode(body, type=_Keyed).idempotency_key
            return ("key", key) if key else None
        if path == "/v1/chat/completions":
            atp = msgspec.json.decode(body, type=_OpenAIBody).atp
            return ("key", atp.idempotency_key) if atp is not None and atp.idempotency_key else None
        rpc = msgspec.json.decode(body, type=_Rpc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    p = rpc.params
    if p is None:
        return None
    if rpc.method in _A2A_BY_ID and isinstance(p.id, str):
        return ("stream", p.id)
    if rpc.method in _A2A_SEND and p.message is not None and p.message.messageId:
        return ("key", f"a2a:{p.message.messageId}")
    return None


async def _read_body(receive: Receive, limit: int) -> tuple[bytes | None, Receive]:
    """Read a request body of at most ``limit`` bytes: ``(body, receive)`` where
    the new ``receive`` gives the app the same body again; ``body`` is None when
    it passed the limit or the client left (the app then answers as without us)."""
    chunks: list[bytes] = []
    size, more = 0, True
    other: MutableMapping[str, Any] | None = None
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            other = msg
            break
        chunk = msg.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        more = msg.get("more_body", False)
        if size > limit:
            break
    body = b"".join(chunks)
    pending: list[MutableMapping[str, Any]] = [{"type": "http.request", "body": body, "more_body": more}]
    if other is not None:
        pending.append(other)

    async def replay() -> MutableMapping[str, Any]:
        return pending.pop(0) if pending else await receive()

    return (body if not more and other is None else None), replay


@dataclass(frozen=True)
class Peer:
    """Another router process a request is forwarded to: its ``name`` (the
    ``x-atp-served-by`` value when its answer carries no tag), its HTTP
    ``base_url`` and, for a worker, the private unix socket (``uds``) it is
    reached on. ``or_here``: when it cannot be reached, the request is served
    here instead (a finished stream: the store has all of it)."""

    name: str
    base_url: str
    uds: str | None = None
    or_here: bool = field(default=False, compare=False)


class ForwardingApp:
    """ASGI middleware of a router process's HTTP app (module docstring): a
    request about a stream another live router process owns is forwarded to it
    with the caller's own ``Authorization``; everything else goes to ``app``.

    Where to is the ``placement``'s (the process's :class:`Worker`, or a
    cluster router's :class:`~atp_router.deploy.cluster.ClusterNode`):
    ``placement.forward_target(record)`` gives the
    :class:`Peer` owning a stored stream, :data:`RETRY` (its owner is being
    settled: 503 ``EAGENTDOWN``, ``Retry-After: 1``) or None (served here);
    a string: 503 ``EAGENTDOWN`` with that reason (the process cannot tell now);
    ``placement.instance_tag`` is the header added to every response (a worker's
    ``x-atp-worker``, a cluster router's ``x-atp-router``); an answer forwarded
    from a peer carries the peer's tag as ``x-atp-served-by``. ``private``: the
    app behind a worker's own unix socket (forwarded requests: never forwarded
    again); a request carrying ``x-atp-forwarded-by`` (set on every forwarded
    request) is never forwarded again either."""

    #: The reason of the 503 answered while a stream's owner is being settled.
    settling_reason = "the router worker running this stream stopped and is being restarted; retry"
    #: The reason of the 503 answered when the owner cannot be reached.
    unreachable_reason = "the router worker running this stream is restarting; retry"

    def __init__(self, app: ASGIApp, router: Router, placement: Any, *, private: bool = False,
                 metric: str = "atp_worker_forwarded") -> None:
        self.app = app
        self.router = router
        self.placement = placement
        self.private = private
        self._tag = placement.instance_tag
        self._clients: dict[Peer, httpx.AsyncClient] = {}
        self._limit = router.config.max_body_bytes
        name = metric + "_private" if private else metric
        self.forwarded: Counter | None
        try:
            self.forwarded = Counter(name, "Requests forwarded to the router process owning the stream, by outcome",
                                     ["outcome"], registry=router.metrics.registry)
        except ValueError:  # registered by another instance on the same router
            self.forwarded = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tag = self._tag

        async def tagged(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), tag]}
            await send(msg)

        if self.private or any(k == _FORWARDED_BY for k, _ in scope["headers"]):
            await self.app(scope, receive, tagged)
            return
        target, receive, body = await self._target(scope, receive)
        if target is None:
            await self.app(scope, receive, tagged)
        elif target is RETRY or isinstance(target, str):
            reason = self.settling_reason if target is RETRY else target
            await _send_json(tagged, 503, {"error": {"code": str(ErrorCode.EAGENTDOWN), "reason": reason}},
                             [(b"retry-after", b"1")])
        else:
            await self._forward(target, scope, receive, body, tagged)

    async def _target(self, scope: Scope, receive: Receive) -> tuple[Any, Receive, bytes | None]:
        """``(Peer | None | RETRY | reason, receive, body)`` for a request."""
        path, method = scope["path"], scope["method"]
        m = _STREAM_PATH.match(path)
        body: bytes | None = None
        if m is not None:
            identity = self._identity(scope)
            if identity is None or self.router.streams.find(identity.tenant, m[1]) is not None:
                return None, receive, None
            target = self.placement.forward_target(self.router.store.find_stream(identity.tenant, m[1]))
            if target is not None and target is not RETRY and method != "GET":
                body, receive = await _read_body(receive, self._limit)
                if body is None:
                    return None, receive, None  # over the limit: the app answers 413 as ever
            return target, receive, body
        if method != "POST" or path not in ("/v1/streams", "/v1/chat/completions", "/a2a"):
            return None, receive, None
        body, receive = await _read_body(receive, self._limit)
        named = _body_key(path, body) if body is not None else None
        if named is None or body is None:  # no body: no key either
            return None, receive, body
        identity = self._identity(scope)
        if identity is None:
            return None, receive, body
        kind, value = named
        if kind == "key":
            return await self._keyed(identity, value, body, path), receive, body
        if self.router.streams.find(identity.tenant, value) is not None:
            return None, receive, body
        return self.placement.forward_target(self.router.store.find_stream(identity.tenant, value)), receive, body

    async def _keyed(self, identity: Identity, key: str, body: bytes, path: str) -> Any:
        """Where a request opening a stream with idempotency key ``key`` goes
        (``body`` and ``path`` are the request's): here when this process holds
        the stream, else to the owner of the stream the key opened."""
        if self.router.streams.resumable(identity.tenant, key) is not None:
            return None
        return self.placement.forward_target(self.router.store.find_idempotent(identity.tenant, key))

    def _identity(self, scope: Scope) -> Identity | None:
        auth = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v.decode("latin-1")
                break
        try:
            return self.router.authenticate(auth)
        except ATPError:
            return None  # the app answers 401 itself

    def _client(self, peer: Peer) -> httpx.AsyncClient:
        client = self._clients.get(peer)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=peer.uds) if peer.uds is not None else None
            client = self._clients[peer] = httpx.AsyncClient(
                transport=transport, base_url=peer.base_url, timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        return client

    async def _forward(self, peer: Peer, scope: Scope, receive: Receive, body: bytes | None, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP and k.lower() != b"host"]
        headers.append((_FORWARDED_BY, self._tag[1]))
        url = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        client = self._client(peer)
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            upstream = await client.send(request, stream=True)
        except httpx.TransportError as e:
            # Its socket is gone: the owner is dying or restarting.
            log.info("forward to %s failed: %s", peer.name, e)
            self._count("unreachable")
            if peer.or_here:
                await self.app(scope, receive, send)
                return
            await _send_json(send, 503, {"error": {"code": str(ErrorCode.EAGENTDOWN),
                                                   "reason": self.unreachable_reason}}, [(b"retry-after", b"1")])
            return
        self._count("ok")
        tag_name = self._tag[0]
        try:
            out = [(k.lower(), v) for k, v in upstream.headers.raw if k.lower() not in _HOP_BY_HOP]
            out = [(b"x-atp-served-by", v) if k == tag_name else (k, v) for k, v in out]
            if "content-length" in upstream.headers and "transfer-encoding" not in upstream.headers:
                out.append((b"content-length", upstream.headers["content-length"].encode()))
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
            async with trio.open_nursery() as nursery:

                async def watch_disconnect() -> None:
                    # The client left (an SSE follower): stop, so the owner detaches it.
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect)
                async for chunk in upstream.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await upstream.aclose()

    def _count(self, outcome: str) -> None:
        if self.forwarded is not None:
            self.forwarded.labels(outcome).inc()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


async def _send_json(send: Send, status: int, body: Mapping[str, object],
                     extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data})


async def _watch_parent(parent: int, stop: trio.CancelScope) -> None:
    """Stop when the supervisor is gone (this worker was re-parented). Not
    ``PR_SET_PDEATHSIG``: it fires when the *thread* that forked exits, and
    trio starts processes from its thread cache."""
    while os.getppid() == parent:
        await trio.sleep(0.5)
    log.warning("the supervisor (pid %d) is gone: stopping", parent)
    stop.cancel()


def worker_main(config: RouterConfig, spec: WorkerSpec) -> int:
    """Run worker ``spec.slot`` until SIGINT/SIGTERM (the supervisor's): the
    router, the HTTP app on the inherited socket and on its private unix socket,
    the WebSocket ingress on the inherited one. Reports ``ready`` (or
    ``error: <why>``) on ``spec.ready_fd``. Returns the exit status (2: the
    configuration or RIB was refused)."""
    refused: Exception | None = None

    def report(line: str) -> None:
        try:
            os.write(spec.ready_fd, (line + "\n").encode())
            os.close(spec.ready_fd)
        except OSError:
            pass

    async def main_async() -> None:
        nonlocal refused
        try:
            router, worker = build(config, spec)
        except (PolicyError, RuntimeError, StoreError) as e:
            refused = e
            return
        await _serve_worker(config, spec, router, worker, report)

    trio.run(main_async)
    if refused is not None:
        what = f"policy refused: {refused.reason}" if isinstance(refused, PolicyError) else str(refused)
        report(f"error: {what}")
        print(f"atp-router worker {spec.slot}: {what}", file=sys.stderr)
        return 2
    return 0


async def _serve_worker(config: RouterConfig, spec: WorkerSpec, router: Router, worker: Worker,
                        report: Callable[[str], None]) -> None:
    """Serve worker ``spec.slot``'s ``router`` (:func:`worker_main`) until
    SIGINT/SIGTERM or the supervisor's exit; ``report("ready")`` once every
    ingress listens."""
    app = build_app(router)
    forwarding = ForwardingApp(app, router, worker, private=False)
    # Requests in progress (an event read forwarded to another worker too) are waited for by the drain.
    public = track_requests(forwarding, router.drain)
    private = track_requests(ForwardingApp(app, router, worker, private=True), router.drain)
    sock_path = worker_socket(router.state_dir, spec.slot)
    ws_sock = socket.socket(fileno=spec.ws_fd)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_parent, spec.parent, nursery.cancel_scope)
            await nursery.start(router.serve)
            await nursery.start(router.authenticator.run)
            if config.tls is not None:
                nursery.start_soon(config.tls.watch, 30.0)
            # The public port (inherited from the supervisor) and this worker's private socket, served
            # by the lean server or hypercorn as --http-server says (atp_router.deploy.http_serve).
            await nursery.start(lambda task_status: serve_http(
                public, config, [f"fd://{spec.http_fd}"], task_status=task_status))
            await nursery.start(lambda task_status: serve_http(
                private, config, [f"unix:{sock_path}"], tls=False, task_status=task_status))
            await nursery.start(lambda task_status: serve_ws(router, config.host, 0, sock=ws_sock,
                                                             task_status=task_status))
            settle_heap()  # the SSE backend imported, start-up objects frozen, the GC's thresholds raised
            with stop_signal_receiver() as signals:  # a later signal: ignored, the shutdown not cut by it
                report("ready")  # after the handler: a SIGTERM right after "ready" is a clean stop
                async for _ in signals:
                    break
                # Running streams finish first (--drain-s; the supervisor's second SIGTERM stops at once),
                # every worker's: a worker keeps serving (forwarding event reads) until the router's last
                # stream ends, as one router process would, instead of resetting the connections it accepts.
                store = router.store
                assert isinstance(store, SqliteStore)
                why = await drain(router.drain, lambda: router.open_count + store.open_stream_count(),
                                  config.drain_s, signals)
                log.warning("worker %d stopping: %s", spec.slot, why)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await forwarding.aclose()


# ---------------------------------------------------------------------- supervisor
def settle(store: Store, audit: AuditLog, owner: str, *, reason: str = WORKER_INTERRUPTED,
           release: bool = False, who: str = "worker") -> dict[str, int]:
    """Settle what router process ``owner`` left when it stopped (spec §5, §8):
    its open reservations committed at their reserved amount (the crash rule:
    a worker's calls may have been billed) — or, with ``release``, given back
    uncharged (:meth:`Store.release_owned <atp_router.store.base.Store.release_owned>`,
    issue 12: a cluster router's stream is re-run elsewhere and that run is
    what is charged) —, its accounts closed, its shared quota entries removed
    (:meth:`Store.quota_release_owned <atp_router.store.base.Store.quota_release_owned>`:
    its streams no longer count against their tenants), its open streams interrupted
    (their stored log ends with an RST giving ``reason``; audited with
    ``{who: owner}``). Returns the counts. Store errors propagate."""
    reservations = store.release_owned(owner) if release else store.recover(owner)
    accounts = store.close_owned_accounts(owner)
    quotas = store.quota_release_owned(owner)
    records = store.interrupt_open_streams(reason, now_ms=int(time.time() * 1000), owner=owner)
    for rec in records:
        try:
            end_interrupted(store, rec, reason)
        except StoreError:
            log.exception("stream %s/%s: RST not stored", rec.tenant, rec.stream_id)
        audit.record("session_close", "router", rec.tenant, {
            "session_id": rec.session_id, "stream_id": rec.stream_id, "outcome": "interrupted", who: owner},
            int(time.time() * 1000))
    return {"reservations": len(reservations), "accounts": accounts, "streams": len(records), "quotas": quotas}


def _listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), inherited by
    the workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


@dataclass
class _Slot:
    slot: int
    proc: trio.Process | None = None
    owner: str | None = None
    started: float = 0.0
    restarts: int = 0


def supervise(config: RouterConfig, workers: int, argv: list[str]) -> int:
    """Run ``atp-router --workers N`` (module docstring): recovery, sockets, N
    workers started as ``python -m atp_router.deploy.cli <argv> --worker-spec …``,
    restarts, shutdown. Prints the ``listening`` line; returns the exit status
    (2: the configuration, RIB or state was refused)."""
    state_dir = config.state_dir
    assert state_dir is not None, "--workers needs a --state-dir"
    try:
        lock = single.lock_state_dir(state_dir)
    except RuntimeError as e:
        print(f"atp-router: {e}", file=sys.stderr)
        return 2
    try:
        # A previous multi-worker run's leftovers: reservations committed at their
        # reserved amount, its workers' accounts closed; then the single-process
        # start-up (streams interrupted, audit checked, RIB validated and restored).
        with SqliteStore.open(state_dir, synchronous=sync_mode(config.state_sync)) as store:
            left = store.recover()
            store.close_owned_accounts()
        if left:
            log.warning("state: %d calls in flight at the last stop committed at their reserved amount", len(left))
        summary = trio.run(_recover, config)
    except (PolicyError, RuntimeError, StoreError, OSError, ValueError) as e:  # every start-up refusal: one line
        what = f"policy refused: {e.reason}" if isinstance(e, PolicyError) else str(e)
        print(f"atp-router: {what}", file=sys.stderr)
        lock.close()
        return 2
    sockets_dir(state_dir).mkdir(mode=0o700, exist_ok=True)
    try:
        http = _listen(config.host, config.http_port)
        ws = _listen(config.host, config.ws_port)
    except OSError as e:
        print(f"atp-router: cannot listen on {config.host}: {e}", file=sys.stderr)
        lock.close()
        return 2
    try:
        sup = _Supervisor(config, workers, argv, http, ws, lock.fileno())
        return trio.run(sup.run, summary)
    finally:
        http.close()
        ws.close()
        lock.close()


async def _recover(config: RouterConfig) -> dict[str, Any]:
    router = single.build(config, lock=False)  # the supervisor holds the lock
    async with trio.open_nursery() as nursery:
        await nursery.start(router.serve)  # and stop at once: adapters and state closed cleanly
        summary = {"version": router.store.active_rib_version() or router.gen.version,
                   "agents": router.rib_summary()["agents"]}
        nursery.cancel_scope.cancel()
    return summary


class _Supervisor:
    """The supervisor's trio side: N slots, each a worker process started,
    awaited, settled and restarted; the WAL checkpoints; the shutdown."""

    def __init__(self, config: RouterConfig, n: int, argv: list[str], http: socket.socket, ws: socket.socket,
                 lock_fd: int) -> None:
        assert config.state_dir is not None
        self.config, self.n, self.argv, self.http, self.ws, self.lock_fd = config, n, argv, http, ws, lock_fd
        self.state_dir = config.state_dir
        self.slots = [_Slot(i) for i in range(n)]
        self.stopping = False
        self.failed: list[str] = []
        self.store: SqliteStore | None = None
        self.audit: AuditLog | None = None

    async def run(self, summary: dict[str, Any]) -> int:
        sync = sync_mode(self.config.state_sync)
        self.store = SqliteStore.open(self.state_dir, synchronous=sync, multiprocess=True)
        self.audit = AuditLog.open(self.store, self.state_dir, shared=True, options=self.config.audit,
                                   fsync_head=sync == "FULL")
        try:
            async with trio.open_nursery() as outer:
                checkpointing = await outer.start(self._checkpoints)
                await self._serve(summary)
                checkpointing.cancel()
        finally:
            self.audit.close()
            self.store.close()
        return 2 if self.failed else 0

    async def _serve(self, summary: dict[str, Any]) -> None:
        """Start every slot, print the ``listening`` line, wait for SIGINT or
        SIGTERM, stop the workers (SIGTERM: each drains up to ``drain_s``; SIGKILL
        :data:`STOP_GRACE_S` after that; a second signal is passed on);
        returns once every slot settled its worker."""
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as starting:  # all at once; each reports ready
                for s in self.slots:
                    starting.start_soon(nursery.start, self._run_slot, s)
            if self.failed:
                self._stop()
                print(f"atp-router: {'; '.join(self.failed)}", file=sys.stderr)
                await self._await_workers(STOP_GRACE_S, None)
            else:
                c = self.config
                http_scheme, ws_scheme = ("https", "wss") if c.tls is not None else ("http", "ws")
                host = c.host if ":" not in c.host else f"[{c.host}]"
                # After the block, a later signal is ignored: settling the workers and closing the store are not cut.
                with stop_signal_receiver() as signals:
                    print(f"atp-router listening {http_scheme}://{host}:{self.http.getsockname()[1]} "
                          f"{ws_scheme}://{host}:{self.ws.getsockname()[1]} (RIB generation {summary['version']}: "
                          f"{', '.join(summary['agents'])}) workers={self.n}", flush=True)
                    async for _ in signals:
                        break
                    self._stop()  # the workers drain (--drain-s); a second signal is passed on: they stop at once
                    await self._await_workers(c.drain_s + STOP_GRACE_S, signals)
            _signal_all(self.slots, signal.SIGKILL)

    async def _await_workers(self, seconds: float, signals: AsyncIterator[int] | None) -> None:
        """Wait up to ``seconds`` for every worker to exit; each of ``signals`` meanwhile
        is passed on to them (SIGTERM)."""
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                if signals is not None:
                    async def forward() -> None:
                        async for _ in signals:
                            _signal_all(self.slots, signal.SIGTERM)
                    nursery.start_soon(forward)
                while any(s.proc is not None and s.proc.returncode is None for s in self.slots):
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()

    def _stop(self) -> None:
        self.stopping = True
        _signal_all(self.slots, signal.SIGTERM)

    async def _checkpoints(self, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        """The workers' WAL copied back into the database (they never do it)."""
        with trio.CancelScope() as scope, \
                SqliteStore.open(self.state_dir, synchronous=sync_mode(self.config.state_sync)) as cp:
            task_status.started(scope)
            while True:
                await trio.sleep(CHECKPOINT_S)
                try:
                    await trio.to_thread.run_sync(cp.checkpoint)
                except Exception:
                    log.exception("state: WAL checkpoint failed")

    async def _spawn(self, s: _Slot) -> str | None:
        """Start worker ``s``; None once it reported ready, else why not."""
        r, w = os.pipe()
        http, ws = self.http.fileno(), self.ws.fileno()
        spec = WorkerSpec(slot=s.slot, workers=self.n, http_fd=http, ws_fd=ws, lock_fd=self.lock_fd, ready_fd=w,
                          parent=os.getpid())
        cmd = [sys.executable, "-m", "atp_router.deploy.cli", *self.argv, "--worker-spec", spec.to_json()]
        try:
            s.proc = await trio.lowlevel.open_process(cmd, pass_fds=(http, ws, self.lock_fd, w),
                                                      stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
        s.owner = owner_name(s.slot, s.proc.pid)
        s.started = trio.current_time()
        line = b""
        async with trio.lowlevel.FdStream(r) as pipe:
            while b"\n" not in line:
                chunk = await pipe.receive_some(4096)
                if not chunk:
                    break
                line += chunk
        text = line.decode(errors="replace").strip()
        return None if text == "ready" else (text.removeprefix("error: ") or "the worker exited before it was ready")

    async def _reap(self, s: _Slot) -> None:
        """Wait for worker ``s`` to end, then settle what it left."""
        assert s.proc is not None and s.owner is not None and self.store is not None and self.audit is not None
        code = await s.proc.wait()
        done = settle(self.store, self.audit, s.owner)
        if not self.stopping:
            log.warning("worker %d (pid %d) exited with status %s; settled %s; restarting", s.slot, s.proc.pid,
                        code, done)
        elif any(done.values()):
            log.info("worker %d stopped; settled %s", s.slot, done)

    async def _run_slot(self, s: _Slot, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            why = await self._spawn(s)
            if why is not None and first:
                self.failed.append(f"worker {s.slot}: {why}")
                task_status.started()
                await self._reap(s)
                return
            if first:
                task_status.started()
                first = False
            await self._reap(s)
            if self.stopping:
                return
            quick = trio.current_time() - s.started < _QUICK_DEATH_S
            s.restarts = s.restarts + 1 if quick else 0
            if s.restarts:
                await trio.sleep(min(0.1 * 2 ** s.restarts, 10.0))


def _signal_all(slots: list[_Slot], sig: int) -> None:
    for s in slots:
        if s.proc is not None and s.proc.returncode is None:
            try:
                s.proc.send_signal(sig)
            except ProcessLookupError:
                pass
