"""What the store keeps of the audit trail (spec §11 "Audit: immutable event
log"): the record and checkpoint Structs and the chain's genesis hash.

The chain's rules — how ``hash`` is computed, how a checkpoint is MACed and
verified, what a detail may hold — are :mod:`atp_router.security.audit`'s; the
:class:`~atp_router.store.base.Store` backends only persist and read these Structs
(``append_audit_chained`` links a new record to the stored head, ``(0,
GENESIS)`` when the log is empty). Defined here, below both, so that the store
does not import the security layer that writes through it.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

__all__ = ["GENESIS", "AuditCheckpoint", "AuditRecord"]

#: ``prev`` of the first record.
GENESIS = "0" * 64


class AuditRecord(Struct, frozen=True, forbid_unknown_fields=True):
    """One audit record. ``seq`` counts from 1; ``ts_ms`` is Unix ms; ``actor``
    who caused it (an identity's subject, or ``"router"``); ``tenant`` whose data
    it concerns (``None``: router-wide); ``detail`` JSON-safe and scrubbed;
    ``prev`` / ``hash`` lowercase hex SHA-256 (see :mod:`atp_router.security.audit`)."""

    seq: int
    ts_ms: int
    kind: str
    actor: str
    tenant: str | None
    detail: dict[str, Any]
    prev: str
    hash: str


class AuditCheckpoint(Struct, frozen=True, forbid_unknown_fields=True):
    """The chain head ``(seq, hash)`` and ``mac`` = hex HMAC-SHA256 of
    ``canonical_json({"seq", "hash"})`` under the audit key."""

    seq: int
    hash: str
    mac: str
