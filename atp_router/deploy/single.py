"""``atp-router`` as one process on its own state directory: the embedded SQLite store.

:func:`build` assembles the :class:`~atp_router.runtime.router.Router` of this mode from
:func:`open_state` (:class:`~atp_router.runtime.deployment.StateParts`):

* the state directory ``config.state_dir`` locked for the life of the process
  (:func:`lock_state_dir`: two routers on one directory would interleave
  ledgers and the audit chain); None is a private temporary directory removed
  at shutdown (the same code path, nothing kept);
* the :class:`~atp_router.store.sqlite.SqliteStore` in it (``config.state_sync``),
  opened ``exclusive``: this process is the file's only user while it runs (no
  lock syscalls per transaction; another process opening it — ``sqlite3``, an
  ``atp-router`` command on the directory — is refused with one line), with its
  redo log (:mod:`atp_router.store.redo`): each write transaction durable by one
  record in ``state.db.redo``, SQLite committed in groups — one ``write`` a
  transaction instead of two ``pwrite`` a changed page;
* the budget ledger as the store has it (spec §5 across a crash,
  :func:`restore_ledger`): calls in flight at the crash committed at their
  reservation, stream accounts closed, every later mutation journaled;
* the audit chain (:class:`~atp_router.security.audit.AuditLog`);
* once the router is built, the streams that were running when it last stopped
  reported interrupted (:func:`mark_interrupted`, spec §8: never re-run) and a
  RIB hot-reloaded through the API put back (:func:`restore_rib`).

``atp-router --workers N`` runs this start-up once in its supervisor
(:mod:`atp_router.deploy.workers`, ``lock=False``: the supervisor holds the lock).

Faults of the store (:mod:`atp_router.store.sqlite`, Faults). Start-up refusals
(a damaged file, a directory that held state with its database gone, a
directory or file that cannot be written) are :class:`~atp_router.store.base.StoreError`
or ``RuntimeError`` with a one-line message, which ``atp-router`` prints
without a traceback. While the store cannot take writes
(:class:`~atp_router.store.base.StoreFull`: the disk is full), the router stays up:

* new spend is refused (:class:`EmbeddedLedger`): a new stream with ``EBUDGET``
  and ``retry_after_ms`` :data:`RETRY_AFTER_MS` (over HTTP 503 + ``Retry-After``)
  and a reason naming the file; a running stream's next call with ``EBUDGET``
  (an ERROR, not a hang);
* spend already made is kept (:class:`~atp_router.store.base.StoreJournal`) and
  written as soon as the store takes writes again (tried every
  :data:`SETTLE_RETRY_S`), the events of running streams are sent and their
  writes retried (``StreamPersistence.hold_unstored`` False); nothing waits for an
  operator: the first write that fits ends the fault;
* ``GET /v1/ready`` answers 503 naming the store (:func:`store_check`) and the
  audit records are spooled (:class:`~atp_router.security.audit.AuditSpool`) until
  it takes writes again.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio

from atp_router.flow.budget import Allowance, BudgetLedger, Refusal, Reservation
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.controlplane.control import BODY_SOURCE
from atp_router.runtime.deployment import StateParts, StoreCheck
from atp_router.runtime.router import Router
from atp_router.security.audit import AuditLog
from atp_router.store import (
    SqliteStore,
    Store,
    StoreError,
    StoreJournal,
    StoreUnavailable,
)
from atp_router.store.redo import COMMIT_EVERY_S
from atp_router.store.sqlite import sync_mode
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import ErrorPayload, Flag, Frame, Payload, PayloadType

__all__ = ["INTERRUPTED", "RETRY_AFTER_MS", "SETTLE_RETRY_S", "Deployed", "EmbeddedLedger", "build", "closing",
           "commit_store", "deploy",
           "end_interrupted", "lock_state_dir", "mark_interrupted", "open_state", "restore_ledger", "restore_rib",
           "settle_journal", "state_directory", "store_check", "store_fault_reason"]

log = logging.getLogger("atp_router.deploy.single")

#: The RST reason of a stream that was running when the router stopped (spec §8).
INTERRUPTED = ("interrupted: the router restarted while the stream ran; it was not re-run — "
               "open a new stream (new idempotency_key) to run it again")
#: ``retry_after_ms`` of new spend refused while the store cannot take writes (a full disk).
RETRY_AFTER_MS = 1000
#: How often the budget settlements the store could not take are tried again, s.
SETTLE_RETRY_S = 0.5
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
    (``authenticator``, ``syn_stages``; ``services`` run beside :func:`settle_journal`;
    ``store_refusal`` by default :data:`RETRY_AFTER_MS` ``EBUDGET`` naming the fault). Raises
    :class:`~atp_router.wire.errors.PolicyError` if the RIB is refused, ``RuntimeError``
    when another process holds the state directory or it cannot be written,
    :class:`~atp_router.store.base.StoreError` when the store is refused (module docstring)."""
    kw["services"] = (settle_journal, commit_store, *kw.get("services", ()))
    kw.setdefault("store_refusal", _refusal)
    state = open_state(config, lock=lock)
    try:
        router = Router(config, state, **kw)
    except BaseException:
        # Refused (a policy, a key): the state closed as at a stop — the redo log's transactions
        # committed to state.db, the audit chain checkpointed, the directory released.
        state.close()
        raise
    router.streams.persistence.hold_unstored = False  # one router on its own store: a full disk stalls no stream
    journal = router.ledger.journal
    if isinstance(journal, StoreJournal):
        # A stream's end settlements (commit, release, close) go in the group commit of its
        # events: the FINAL and its commit in one transaction (StoreJournal.defer).
        journal.defer = router.streams.persistence.defer
        journal.flush_deferred = router.streams.persistence.flush
    # A stream's record in the group commit of its first events (its SYN+ACK).
    router.streams.persistence.record_in_group_commit = True
    # Routine audit records (session open and close) in the same group commit, MACed once stored.
    router.audit_log.defer = router.streams.persistence.defer
    return router


def store_fault_reason(e: BaseException) -> str:
    """The one wording of new spend refused while the store cannot take writes."""
    return f"{e}: new spend is refused until the state store takes writes again; retry"


def _refusal(op: str, e: StoreUnavailable) -> ATPError:
    # The router's store_refusal: an open the store could not take (HTTP 503 + Retry-After).
    log.error("state store: %s refused: %s", op, e)
    return ATPError(ErrorCode.EBUDGET, store_fault_reason(e), retry_after_ms=RETRY_AFTER_MS)


class EmbeddedLedger(BudgetLedger):
    """The budget ledger of a router on its embedded store, journaled there by a
    :class:`~atp_router.store.base.StoreJournal`: new spend the store cannot
    take (:class:`~atp_router.store.base.StoreUnavailable`, a full disk) is
    refused and undone — :meth:`open` raises :class:`~atp_router.wire.errors.ATPError`
    ``EBUDGET`` with ``retry_after_ms`` :data:`RETRY_AFTER_MS` (the SYN is refused),
    :meth:`reserve` returns an ``EBUDGET`` :class:`~atp_router.flow.budget.Refusal`
    (the call is not made); settlements are kept by the journal, never refused."""

    def open(self, key: str, limit: Allowance, *, parent: str | None = None) -> None:
        try:
            super().open(key, limit, parent=parent)
        except StoreUnavailable as e:
            log.error("state store: budget account %s not opened: %s", key, e)
            raise ATPError(ErrorCode.EBUDGET, store_fault_reason(e), retry_after_ms=RETRY_AFTER_MS) from None

    def reserve(self, key: str, tokens: int, usd_micros: int) -> Reservation | Refusal:
        try:
            return super().reserve(key, tokens, usd_micros)
        except StoreUnavailable as e:
            log.error("state store: reservation on %s refused: %s", key, e)
            return Refusal(key=key, reason=store_fault_reason(e), remaining=Allowance(tokens=0, usd_micros=0))


def settle_journal(router: Router) -> Sequence[Callable[[], Awaitable[None]]]:
    """The router's service (:data:`~atp_router.runtime.deployment.Service`) writing
    the budget settlements its store could not take (a full disk) once it can,
    tried every :data:`SETTLE_RETRY_S`."""
    journal = router.ledger.journal
    if not isinstance(journal, StoreJournal):
        return ()

    async def settle() -> None:
        while True:
            await trio.sleep(SETTLE_RETRY_S)
            kept = journal.pending
            if kept and journal.flush():
                log.warning("state store takes writes again: %d kept budget settlements written", kept)

    return (settle,)


def commit_store(router: Router) -> Sequence[Callable[[], Awaitable[None]]]:
    """The router's service committing its store's redo log to SQLite once due even
    when no write comes to do it (:meth:`SqliteStore.commit_due
    <atp_router.store.sqlite.SqliteStore.commit_due>`): an idle router's ``state.db``
    lags its acknowledged writes by at most about two commit intervals (a file copy
    of the directory, a ``sqlite3`` look after a stop, see what was done)."""
    store = router.store
    if not isinstance(store, SqliteStore):
        return ()

    async def commit() -> None:
        while True:
            await trio.sleep(COMMIT_EVERY_S)
            store.commit_due()

    return (commit,)


def open_state(config: RouterConfig, *, lock: bool = True) -> StateParts:
    """The state of a single router (module docstring): lock, SQLite store,
    restored ledger, audit chain; restored into the router by
    :func:`mark_interrupted` and :func:`restore_rib`."""
    state_dir, tmp, held = state_directory(config, lock=lock)
    store: SqliteStore | None = None
    try:
        # The process holds the state directory (its lock, or the --workers supervisor's before any
        # worker starts): the store is its alone — no lock syscalls per transaction, no -shm.
        sync = sync_mode(config.state_sync)
        store = SqliteStore.open(state_dir, synchronous=sync, exclusive=True, redo=True)
        ledger = restore_ledger(store)
        # audit.head as durable as the store: fsynced only when the store survives an OS crash too.
        audit_log = AuditLog.open(store, state_dir, options=config.audit, warn=tmp is None, fsync_head=sync == "FULL")
    except BaseException:
        # Refused: nothing stays open (the directory can be opened again, in this process too).
        if store is not None:
            store.close()
        if held is not None:
            held.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    close = closing(audit_log, store, lock=held, tmp=tmp)

    def settle_and_close() -> None:
        journal = ledger.journal
        if isinstance(journal, StoreJournal) and journal.pending and not journal.flush():
            log.error("state: %d budget settlements not written at shutdown (the store takes no writes); the next "
                      "start commits their reservations at the reserved amount", journal.pending)
        close()

    return StateParts(state_dir=state_dir, store=store, audit_log=audit_log, ledger=ledger,
                      close=settle_and_close, store_check=store_check(store, ledger),
                      restore=(mark_interrupted, restore_rib))


def store_check(store: SqliteStore, ledger: BudgetLedger) -> StoreCheck:
    """The readiness of the embedded store (:attr:`StateParts.store_check
    <atp_router.runtime.deployment.StateParts.store_check>`; ``--workers`` too):
    it takes a write and has room for more (:meth:`SqliteStore.writable
    <atp_router.store.sqlite.SqliteStore.writable>`: not a full disk), and no
    budget settlement waits for it (:class:`~atp_router.store.base.StoreJournal`)."""
    def check() -> str | None:
        fault = store.writable()
        if fault is not None:
            return str(fault)
        journal = ledger.journal
        if isinstance(journal, StoreJournal) and journal.pending:
            return f"{journal.pending} budget settlements wait for the state store {store.path}"
        return None

    return check


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
        except (OSError, StoreError) as e:  # a full disk: the records stored so far are verified at the next start
            log.error("state: the audit chain's last checkpoint not written at shutdown: %s", e)
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
    ledger = EmbeddedLedger()
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
    ``RuntimeError`` naming the directory when another process holds it or it
    cannot be created or written."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        f = open(state_dir / "router.lock", "a+")  # noqa: SIM115 (held until the process exits)
    except OSError as e:
        raise RuntimeError(f"state directory {state_dir} cannot be used: {e.strerror or e} "
                           f"({e.filename or state_dir}); the router needs it readable and writable") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"state directory {state_dir} is in use by another atp-router "
                           "(give each router its own --state-dir)") from None
    return f
