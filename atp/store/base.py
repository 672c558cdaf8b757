"""The durable-state interface (issue 7): what the router keeps across a crash.

Callers hold a :class:`Store` and never learn its backend: the embedded SQLite
default (:mod:`atp.store.sqlite`) or, later, a backend shared by several routers.
Every mutating method is durable when it returns (for the SQLite default: across
a process kill -9, see there). It holds

* **budget ledgers** (spec §5.1): accounts ``(key, parent, limit, committed,
  overage, open)`` and open reservations ``(id, account, tokens, usd_micros)``,
  in tokens and integer USD micros. :class:`StoreJournal` feeds them from a
  :class:`~atp.flow.budget.BudgetLedger`; :meth:`Store.load_ledger` gives the
  :class:`~atp.flow.budget.LedgerSnapshot` to rebuild it;
* **streams** (spec §8 resumption) keyed by ``(tenant, session_id, stream_id)``:
  a :class:`StreamRecord`, its idempotency key, and its outbound event log;
* **RIB versions** (the active policy and who set it);
* the **audit** chain (:mod:`atp.security.audit`) and its MACed checkpoint;
* a small **kv** for the router's own keys.

Recovery after a crash (:meth:`Store.recover`, :meth:`Store.interrupt_open_streams`):
a reservation still open belonged to a call whose outcome is unknown — it may
have run and been billed by its provider. It is committed at its reserved amount
(what the caller allowed the call to spend: it cuts calls before they pass their
reservation), never released: **a budget never resurrects**. The cost is that an
unknown call is charged its estimate rather than its actual usage. A stream open
at the crash becomes ``"interrupted"``; the router reports it with an RST naming
the crash and never runs it again.

Errors: :class:`StoreError` and its subclasses :class:`SchemaError` (a state
directory this version cannot read), :class:`StoreLimitError` (a bound was hit:
frame size, events per stream) and :class:`NotFound` (an unknown reservation,
account or stream; also a ``KeyError``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, Self

from msgspec import Struct

from atp.flow.budget import Allowance, Charge, LedgerSnapshot, Reservation
from atp.security.audit import AuditCheckpoint, AuditRecord
from atp.wire.frame import Budget, QoS

__all__ = [
    "NotFound",
    "SchemaError",
    "Store",
    "StoreError",
    "StoreJournal",
    "StoreLimitError",
    "StoredEvent",
    "StreamRecord",
    "StreamState",
]

StreamState = Literal["open", "closed", "interrupted"]


class StoreError(Exception):
    """A durable-state operation failed."""


class SchemaError(StoreError):
    """The state directory holds a schema this router cannot use (newer, or not ours)."""


class StoreLimitError(StoreError):
    """A bound was hit: ``limit`` names it (``"event_bytes"``, ``"events_per_stream"``)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class NotFound(StoreError, KeyError):
    """No such reservation, account or stream."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StreamRecord(Struct, frozen=True, forbid_unknown_fields=True):
    """A stream as the router opened it (spec §8). ``tenant`` is the RIB client
    that owns it; ``meta`` the SYN's meta; ``created_ms`` / ``closed_ms`` are
    Unix ms; ``state`` ends ``"closed"`` (FIN or RST sent) or ``"interrupted"``
    (open when the router crashed), with ``close_reason``."""

    tenant: str
    session_id: str
    stream_id: str
    idempotency_key: str | None
    meta: dict[str, Any]
    qos: QoS | None
    budget: Budget | None
    created_ms: int
    state: StreamState = "open"
    close_reason: str | None = None
    closed_ms: int | None = None


class StoredEvent(Struct, frozen=True, forbid_unknown_fields=True):
    """One outbound event of a stream's log: its id (1, 2, … per stream), SDK
    event type (``"SYN_ACK"``, ``"FINAL"``, …) and the encoded frame bytes."""

    event_id: int
    type: str
    frame: bytes


class Store(ABC):
    """Durable router state (see the module docstring). Every mutating method is
    its own atomic, durable transaction; methods are synchronous and small.
    Tenant data is keyed by tenant: streams, idempotency keys and event logs by
    ``(tenant, session_id, stream_id)`` or ``(tenant, key)``."""

    # ------------------------------------------------------------ budget ledgers
    @abstractmethod
    def open_account(self, key: str, parent: str | None, limit: Allowance) -> None:
        """Create account ``key`` (or re-create a closed one, from zero) under
        ``parent`` with ``limit``. Raises :class:`StoreError` if an open account
        ``key`` exists, :class:`NotFound` if ``parent`` is not open."""

    @abstractmethod
    def close_account(self, key: str) -> None:
        """Mark account ``key`` closed (its spend stays in its ancestors; it is
        no longer part of :meth:`load_ledger`). Raises :class:`NotFound`."""

    @abstractmethod
    def reserve(self, reservation: Reservation) -> None:
        """Record open ``reservation`` (tokens, USD micros on ``reservation.key``);
        the same id again records an extend (the new totals). Raises
        :class:`NotFound` if the account is not open."""

    @abstractmethod
    def release(self, reservation_id: int) -> None:
        """Remove an open reservation with no charge. Raises :class:`NotFound`."""

    @abstractmethod
    def commit(self, reservation_id: int, charge: Charge) -> None:
        """In one transaction: add ``charge`` (committed tokens / USD micros and
        overage) to the reservation's account and every ancestor, and remove
        the reservation. Raises :class:`NotFound`."""

    @abstractmethod
    def set_limit(self, key: str, limit: Allowance) -> None:
        """Set account ``key``'s own limit. Raises :class:`NotFound`."""

    @abstractmethod
    def load_ledger(self) -> LedgerSnapshot:
        """The open accounts and reservations as a
        :class:`~atp.flow.budget.LedgerSnapshot` for
        :meth:`~atp.flow.budget.BudgetLedger.restore`."""

    @abstractmethod
    def recover(self) -> list[Reservation]:
        """Commit every open reservation at its reserved amount (the crash rule
        of the module docstring) and return them, in id order."""

    # ------------------------------------------------------------------ streams
    @abstractmethod
    def put_stream(self, record: StreamRecord) -> None:
        """Store ``record``; a record with the same ``(tenant, session_id,
        stream_id)`` is replaced and its events dropped (a finished stream's
        id reused)."""

    @abstractmethod
    def close_stream(self, tenant: str, session_id: str, stream_id: str, *, reason: str, closed_ms: int) -> None:
        """Mark the stream ``"closed"`` with ``reason`` at ``closed_ms`` (Unix ms).
        Raises :class:`NotFound`."""

    @abstractmethod
    def get_stream(self, tenant: str, session_id: str, stream_id: str) -> StreamRecord | None:
        """The stream's record, or ``None`` (also for another tenant's stream)."""

    @abstractmethod
    def find_idempotent(self, tenant: str, idempotency_key: str) -> StreamRecord | None:
        """The newest stream ``tenant`` opened with ``idempotency_key``, or ``None``."""

    @abstractmethod
    def find_stream(self, tenant: str, stream_id: str) -> StreamRecord | None:
        """``tenant``'s newest stream ``stream_id`` (any session), or None; another
        tenant's stream of that id is never returned (no oracle)."""

    @abstractmethod
    def append_event(self, tenant: str, session_id: str, stream_id: str, event_id: int, type: str,
                     frame: bytes) -> None:
        """Append event ``event_id`` (the next id of the stream's log, from 1) of
        ``type`` with the encoded ``frame``; allowed in every state (the RST of
        an interrupted stream is appended after :meth:`interrupt_open_streams`).
        Raises :class:`NotFound` for an unknown stream, :class:`StoreLimitError`
        when the frame or the stream's event count passes the store's bounds,
        :class:`StoreError` when ``event_id`` is already stored."""

    @abstractmethod
    def events(self, tenant: str, session_id: str, stream_id: str, after: int = 0) -> list[StoredEvent]:
        """The stream's events with id > ``after``, in id order (empty if unknown)."""

    @abstractmethod
    def interrupt_open_streams(self, reason: str, *, now_ms: int) -> list[StreamRecord]:
        """At start-up: every ``"open"`` stream becomes ``"interrupted"`` with
        ``reason`` at ``now_ms``; returns the updated records."""

    @abstractmethod
    def expire(self, before_ms: int) -> int:
        """Drop streams closed or interrupted before ``before_ms`` (Unix ms) with
        their events, and closed ledger accounts without open children;
        returns how many streams were dropped."""

    # --------------------------------------------------------------------- RIB
    @abstractmethod
    def save_rib(self, version: int, text: str, source: str, actor: str) -> None:
        """Make RIB ``version`` (its YAML ``text``, where it came from, who set
        it) the active one. Older versions may be pruned."""

    @abstractmethod
    def active_rib(self) -> tuple[int, str, str] | None:
        """``(version, text, source)`` of the active RIB, or ``None``."""

    # ------------------------------------------------------------------- audit
    @abstractmethod
    def append_audit(self, record: AuditRecord) -> None:
        """Append ``record`` (append-only; its ``seq`` must be new, else
        :class:`StoreError`)."""

    @abstractmethod
    def audit_records(self, after: int = 0, limit: int | None = None) -> list[AuditRecord]:
        """Audit records with ``seq`` > ``after``, in ``seq`` order, at most
        ``limit`` of them (``None``: all)."""

    @abstractmethod
    def audit_head(self) -> AuditRecord | None:
        """The audit record with the highest ``seq``, or ``None``."""

    @abstractmethod
    def audit_checkpoint(self) -> AuditCheckpoint | None:
        """The latest MACed audit checkpoint, or ``None``."""

    @abstractmethod
    def audit_checkpoints(self) -> list[AuditCheckpoint]:
        """Every stored audit checkpoint, in ``seq`` order (each narrows where a
        rewritten chain went wrong)."""

    @abstractmethod
    def put_audit_checkpoint(self, checkpoint: AuditCheckpoint) -> None:
        """Store a new audit checkpoint (the latest is the one with the highest
        ``seq``)."""

    # ---------------------------------------------------------------------- kv
    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The router's value under ``key``, or ``None``."""

    @abstractmethod
    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` of the key-value area whose key starts with ``prefix``."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Set the router's value under ``key``."""

    # -------------------------------------------------------------- lifecycle
    @abstractmethod
    def close(self) -> None:
        """Release the backend (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreJournal:
    """A :class:`~atp.flow.budget.LedgerJournal` writing every ledger mutation to
    ``store``: ``BudgetLedger(journal=StoreJournal(store))``. Store errors
    propagate to the ledger's caller."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def on_open(self, key: str, parent: str | None, limit: Allowance) -> None:
        self.store.open_account(key, parent, limit)

    def on_close(self, key: str) -> None:
        self.store.close_account(key)

    def on_reserve(self, reservation: Reservation) -> None:
        self.store.reserve(reservation)

    def on_extend(self, reservation: Reservation) -> None:
        self.store.reserve(reservation)

    def on_commit(self, reservation: Reservation, charge: Charge) -> None:
        self.store.commit(reservation.id, charge)

    def on_release(self, reservation: Reservation) -> None:
        self.store.release(reservation.id)

    def on_set_limit(self, key: str, limit: Allowance) -> None:
        self.store.set_limit(key, limit)
