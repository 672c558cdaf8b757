"""``atp-router`` as one process on its own state directory: the embedded SQLite store.

:func:`build` assembles the :class:`~atp_router.runtime.router.Router` of this mode from
:func:`open_state` (:class:`~atp_router.runtime.deployment.StateParts`):

* the state directory ``config.state_dir`` locked for the life of the process
  (:func:`lock_state_dir`: two routers on one directory would interleave
  ledgers and the audit chain); None is a private temporary directory removed
  at shutdown (the same code path, nothing kept);
* the :class:`~atp_router.store.sqlite.SqliteStore` in it (``config.state_sync``);
* the budget ledger as the store has it (spec §5 across a crash,
  :func:`restore_ledger`): calls in flight at the crash committed at their
  reservation, stream accounts closed, every later mutation journaled;
* the audit chain (:class:`~atp_router.security.audit.AuditLog`);
* once the router is built, the streams that were running when it last stopped
  reported interrupted (:func:`mark_interrupted`, spec §8: never re-run) and a
  RIB hot-reloaded through the API put back (:func:`restore_rib`).

``atp-router --workers N`` runs this start-up once in its supervisor
(:mod:`atp_router.deploy.workers`, ``lock=False``: the supervisor holds the lock).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from atp_router.flow.budget import BudgetLedger
from atp_router.runtime.controlplane.control import BODY_SOURCE
from atp_router.runtime.deployment import StateParts
from atp_router.runtime.router import Router, RouterConfig
from atp_router.security.audit import AuditLog
from atp_router.store import SqliteStore, Store, StoreJournal
from atp_router.store.sqlite import sync_mode
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import ErrorPayload, Flag, Frame, Payload, PayloadType

__all__ = ["INTERRUPTED", "Deployed", "build", "closing", "deploy", "end_interrupted", "lock_state_dir", "mark_interrupted", "open_state",
           "restore_ledger", "restore_rib", "state_directory"]

log = logging.getLogger("atp_router.deploy.single")

#: The RST reason of a stream that was running when the router stopped (spec §8).
INTERRUPTED = ("interrupted: the router restarted while the stream ran; it was not re-run — "
               "open a new stream (new idempotency_key) to run it again")
_stored_decoder = msgspec.json.Decoder(Frame)


class ClosingApp(Protocol):
    """What a deployment's ``http_middleware`` makes of the HTTP API app: an ASGI
    app with clients of its own, closed by :meth:`aclose` at shutdown."""

    async def aclose(self) -> None: ...


@dataclass
class Deployed:
    """A router a deployment mode assembled (:func:`deploy`,
    :func:`atp_router.deploy.cluster.deploy`) and what its process wraps around it:
    ``http_middleware`` (the HTTP API app → the app served, e.g. a cluster
    router's forwarding, :class:`~atp_router.deploy.cluster.ClusterForwardingApp`; it
    has an async ``aclose()`` for its clients, called at shutdown; None: the app
    as it is) and ``advertise`` (told the URL the HTTP API is reached on once
    it listens; None: nobody needs it)."""

    router: Router
    http_middleware: Callable[[Any], ClosingApp] | None = None
    advertise: Callable[[str], None] | None = None


def deploy(config: RouterConfig, **kw: Any) -> Deployed:
    """``atp-router`` on the embedded store (:func:`build`): no middleware, nothing advertised."""
    return Deployed(build(config, **kw))


def build(config: RouterConfig, *, lock: bool = True, **kw: Any) -> Router:
    """The router of one process on ``config.state_dir`` (module docstring);
    ``lock`` False when the caller holds the directory's lock already (the
    ``--workers`` supervisor). ``kw`` as for :class:`~atp_router.runtime.router.Router`
    (``authenticator``, ``syn_stages``). Raises
    :class:`~atp_router.wire.errors.PolicyError` if the RIB is refused, ``RuntimeError``
    when another process holds the state directory."""
    return Router(config, open_state(config, lock=lock), **kw)


def open_state(config: RouterConfig, *, lock: bool = True) -> StateParts:
    """The state of a single router (module docstring): lock, SQLite store,
    restored ledger, audit chain; restored into the router by
    :func:`mark_interrupted` and :func:`restore_rib`."""
    state_dir, tmp, held = state_directory(config, lock=lock)
    store = SqliteStore.open(state_dir, synchronous=sync_mode(config.state_sync))
    ledger = restore_ledger(store)
    audit_log = AuditLog.open(store, state_dir, options=config.audit, warn=tmp is None)
    return StateParts(state_dir=state_dir, store=store, audit_log=audit_log, ledger=ledger,
                      close=closing(audit_log, store, lock=held, tmp=tmp), restore=(mark_interrupted, restore_rib))


def state_directory(config: RouterConfig, *, lock: bool = True) -> tuple[Path, Path | None, Any]:
    """``(state_dir, temporary, lock)``: ``config.state_dir``, or a private
    temporary directory (``temporary``, removed by :func:`closing`) when it is
    None; locked for the life of the process (:func:`lock_state_dir`) unless
    not ``lock`` (``lock`` is then None)."""
    tmp = Path(tempfile.mkdtemp(prefix="atp-state-")) if config.state_dir is None else None
    state_dir = config.state_dir or tmp
    assert state_dir is not None
    return state_dir, tmp, lock_state_dir(state_dir) if lock else None


def closing(audit_log: AuditLog, store: Store, *, lock: Any = None, tmp: Path | None = None) -> Callable[[], None]:
    """The close of a router's state (:attr:`StateParts.close
    <atp_router.runtime.deployment.StateParts.close>`): the audit chain checkpointed and
    closed, then the store; the state directory's ``lock`` released, a
    temporary directory ``tmp`` removed."""
    def close() -> None:
        try:
            audit_log.close()
        finally:
            store.close()
            if lock is not None:
                lock.close()
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    return close


def restore_ledger(store: Store) -> BudgetLedger:
    """The budget ledger as ``store`` has it (spec §5 across a crash): calls in
    flight at the crash are committed at their reservation (their outcome is
    unknown: a budget never comes back), stream accounts are closed (their
    spend stays in their tenant's), every later mutation is journaled."""
    recovered = store.recover()
    if recovered:
        log.warning("state: %d calls in flight at the last stop committed at their reserved amount", len(recovered))
    ledger = BudgetLedger()
    snapshot = store.load_ledger()
    ledger.restore(snapshot)
    ledger.journal = StoreJournal(store)
    for acct in reversed(snapshot.accounts):  # children before parents
        if acct.key.startswith("stream:"):
            ledger.close(acct.key)
    return ledger


def mark_interrupted(router: Router) -> None:
    """Streams that were running when the router stopped are not re-run: each
    is marked interrupted and its stored log ends with an RST saying so."""
    now_ms = int(time.time() * 1000)
    records = router.store.interrupt_open_streams(INTERRUPTED, now_ms=now_ms)
    for rec in records:
        end_interrupted(router.store, rec, INTERRUPTED)
        router.audit_event("session_close", None, {"tenant": rec.tenant, "session_id": rec.session_id,
                                                    "stream_id": rec.stream_id, "outcome": "interrupted"})
    if records:
        log.warning("state: %d streams were running at the last stop: reported as interrupted", len(records))


def restore_rib(router: Router) -> None:
    """A RIB hot-reloaded through the API survives a restart; one loaded from
    ``--policies`` is read from the files again."""
    active = router.store.active_rib()
    if active is not None and active[2] == BODY_SOURCE and active[1]:
        router.control.reload(active[1])
        log.info("RIB restored from the state directory (hot-reloaded as generation %d before the restart)",
                 active[0])
    else:
        router.store.save_rib(router.gen.version, "", router.gen.source, "router")


def end_interrupted(store: Store, rec: Any, reason: str) -> None:
    """End the stored log of stream ``rec`` (a :class:`~atp_router.store.base.StreamRecord`
    just marked interrupted) with an RST ``EAGENTDOWN`` giving ``reason`` (spec
    §8: a client reading or resuming it learns it was not finished)."""
    events = store.events(rec.tenant, rec.session_id, rec.stream_id)
    last = _stored_decoder.decode(events[-1].frame) if events else None
    rst = Frame(v=1, session_id=rec.session_id, stream_id=rec.stream_id,
                msg_seq=(last.msg_seq + 1) if last is not None else 0, flags=[Flag.RST],
                payload=Payload(type=PayloadType.CONTROL,
                                content=ErrorPayload(code=ErrorCode.EAGENTDOWN, reason=reason)))
    store.append_event(rec.tenant, rec.session_id, rec.stream_id, len(events) + 1, "RST", msgspec.json.encode(rst))


def lock_state_dir(state_dir: Path) -> Any:
    """Hold ``<state_dir>/router.lock`` for the life of the process: two routers on
    one state directory would interleave ledgers and the audit chain. Raises
    ``RuntimeError`` naming the directory when another process holds it."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    f = open(state_dir / "router.lock", "a+")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"state directory {state_dir} is in use by another atp-router "
                           "(give each router its own --state-dir)") from None
    return f
