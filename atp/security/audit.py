"""The audit trail (spec §11 "Audit: immutable event log"; issue 7 item 6): an
append-only, hash-chained log whose head is MACed.

Each :class:`AuditRecord` carries ``prev``, the previous record's ``hash`` (64
zeros for the first), and ``hash`` = SHA-256 over the canonical JSON (sorted
keys, no spaces, UTF-8) of every other field. Editing a record breaks its hash;
deleting or reordering records breaks ``seq`` continuity or a ``prev`` link;
rewriting the whole tail consistently is caught by the **checkpoints**
``{seq, hash, mac}``: HMAC-SHA256 of the head under the audit key
(``ATP_AUDIT_KEY``, else ``<state-dir>/audit.key``, created 0600), which the
writer stores every ``every`` records, ``interval_ms`` after the oldest
unsigned record, and at clean shutdown — in the store (all of them kept, so a
rewrite is narrowed to one checkpoint interval) *and*, the newest, in the file
``<state-dir>/audit.head`` (atomic write + rename), so that truncating the
table (checkpoint rows included) is still detected. What is not caught:
deleting only records written after the newest checkpoint (at most ``every``
records or ``interval_ms`` of them) — indistinguishable from a crash just
before they were written.

The core — :func:`chain_record`, :func:`record_hash`, :func:`make_checkpoint`,
:func:`verify`, :func:`scrub_detail` — is sans-IO (time comes in as ``now_ms``).
:class:`AuditLog` is the small writer on an :class:`atp.store.Store`;
:func:`audit_main` is ``atp-router audit verify|show``.

Detail dicts never carry secrets: :func:`scrub_detail` drops every key named
like a secret (a word ``token``, ``key``, ``secret``, ``password``, ``passwd``,
``pwd``, ``passphrase``, ``authorization``, ``cookie``, ``credential(s)``,
``bearer``, ``jwt``, ``hmac``, ``signature``, ``apikey``, or a name containing
``secret``/``password``/``token``/``apikey``; except the non-secret names in
:data:`SAFE_DETAIL_KEYS` such as ``api_key_env``, the *name* of an environment
variable) at any depth, listing the dropped names under ``"_dropped"``; it
truncates strings to :data:`MAX_DETAIL_STR` characters, lists and dicts to
:data:`MAX_DETAIL_ITEMS` entries and nesting to :data:`MAX_DETAIL_DEPTH`.

Errors: :class:`AuditError` (a missing or unsafe key, a log that no longer
matches its checkpoint when the writer opens).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import Struct

if TYPE_CHECKING:
    from atp.store.base import Store

__all__ = [
    "GENESIS",
    "AuditCheckpoint",
    "AuditError",
    "AuditKind",
    "AuditLog",
    "AuditRecord",
    "VerifyReport",
    "audit_main",
    "chain_record",
    "load_audit_key",
    "make_checkpoint",
    "read_head_file",
    "record_hash",
    "scrub_detail",
    "verify",
]

#: ``prev`` of the first record.
GENESIS = "0" * 64
MAX_DETAIL_STR = 512
MAX_DETAIL_ITEMS = 64
MAX_DETAIL_DEPTH = 6
#: Detail keys kept although their name looks like a secret's: they name or count, never hold, one.
SAFE_DETAIL_KEYS = frozenset({"kid", "key_id", "idempotency_key", "api_key_env", "secret_refs", "tokens"})
_SECRET_WORDS = frozenset({
    "token", "key", "secret", "password", "passwd", "pwd", "passphrase", "authorization", "cookie",
    "credential", "credentials", "bearer", "jwt", "hmac", "signature", "apikey",
})
_SECRET_PARTS = ("secret", "password", "passwd", "apikey", "token")
_MIN_KEY_CHARS = 16


class AuditError(Exception):
    """The audit log cannot be written safely (key missing or readable by others,
    or the stored log no longer matches its checkpoint)."""


class AuditKind(StrEnum):
    """What an audit record is about (spec §11 Audit, issue 7)."""

    SESSION_OPEN = "session_open"
    SESSION_CLOSE = "session_close"
    WINDOW_CHANGE = "window_change"
    ESCALATION = "escalation"
    ERROR = "error"
    ESEC = "esec"
    POLICY_RELOAD = "policy_reload"
    ADMIN = "admin"
    REDACTION = "redaction"
    REFUSAL = "refusal"
    #: A client's score of its stream (spec §6.2 quality signal).
    FEEDBACK = "feedback"
    #: A shadow challenger's run (spec §18): agent, outcome, quality, regret.
    SHADOW = "shadow"


class AuditRecord(Struct, frozen=True, forbid_unknown_fields=True):
    """One audit record. ``seq`` counts from 1; ``ts_ms`` is Unix ms; ``actor``
    who caused it (an identity's subject, or ``"router"``); ``tenant`` whose data
    it concerns (``None``: router-wide); ``detail`` JSON-safe and scrubbed;
    ``prev`` / ``hash`` lowercase hex SHA-256 (see the module docstring)."""

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


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` found: ``records`` read; ``first_bad_seq`` the first
    record that is wrong or missing (``None`` when ``ok``); ``reason`` in words;
    ``head`` the hash of the last record of the intact prefix."""

    ok: bool
    records: int
    first_bad_seq: int | None
    reason: str
    head: str = GENESIS


# ---------------------------------------------------------------- sans-IO core
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def record_hash(seq: int, ts_ms: int, kind: str, actor: str, tenant: str | None, detail: Mapping[str, Any],
                prev: str) -> str:
    """Hex SHA-256 over the canonical JSON of a record's fields but ``hash``."""
    body = {"seq": seq, "ts_ms": ts_ms, "kind": kind, "actor": actor, "tenant": tenant, "detail": detail,
            "prev": prev}
    return hashlib.sha256(_canonical(body)).hexdigest()


def _hash_of(r: AuditRecord) -> str:
    return record_hash(r.seq, r.ts_ms, r.kind, r.actor, r.tenant, r.detail, r.prev)


def _secret_name(name: str) -> bool:
    if name.lower() in SAFE_DETAIL_KEYS:
        return False
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]
    for w in words:
        if w in _SECRET_WORDS:
            return True
        if any(p in w for p in _SECRET_PARTS) and not w.endswith("tokens"):
            return True
    return False


def _scrub(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        if len(value) > MAX_DETAIL_STR:
            return value[:MAX_DETAIL_STR] + f"…[+{len(value) - MAX_DETAIL_STR} chars]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    if depth >= MAX_DETAIL_DEPTH:
        return "<nested too deep>"
    if isinstance(value, Mapping):
        return _scrub_map(value, depth + 1)
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        out = [_scrub(v, depth + 1) for v in items[:MAX_DETAIL_ITEMS]]
        if len(items) > MAX_DETAIL_ITEMS:
            out.append(f"…[+{len(items) - MAX_DETAIL_ITEMS} items]")
        return out
    return _scrub(str(value), depth)


def _scrub_map(detail: Mapping[Any, Any], depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for i, (k, v) in enumerate(detail.items()):
        name = str(k)
        if _secret_name(name):
            dropped.append(_scrub(name, depth))
            continue
        if i >= MAX_DETAIL_ITEMS:
            out["_truncated"] = f"+{len(detail) - MAX_DETAIL_ITEMS} keys"
            break
        out[_scrub(name, depth)] = _scrub(v, depth)
    if dropped:
        out["_dropped"] = sorted(dropped)
    return out


def scrub_detail(detail: Mapping[Any, Any] | None) -> dict[str, Any]:
    """``detail`` made safe and JSON-exact for the audit log (rules in the module
    docstring): secret-named keys dropped (named under ``"_dropped"``), long
    strings and collections truncated, bytes summarised, tuples as lists,
    non-finite floats and other objects as strings."""
    return _scrub_map(detail or {}, 0)


def chain_record(prev_seq: int, prev_hash: str, *, kind: str, actor: str, tenant: str | None,
                 detail: Mapping[str, Any] | None, now_ms: int) -> AuditRecord:
    """The record following head ``(prev_seq, prev_hash)`` (``(0, GENESIS)`` for
    the first), ``detail`` scrubbed. Raises ``ValueError`` for an unknown
    ``kind`` (see :class:`AuditKind`)."""
    kind = str(AuditKind(kind))
    clean = scrub_detail(detail)
    seq = prev_seq + 1
    h = record_hash(seq, now_ms, kind, actor, tenant, clean, prev_hash)
    return AuditRecord(seq=seq, ts_ms=now_ms, kind=kind, actor=actor, tenant=tenant, detail=clean, prev=prev_hash,
                       hash=h)


def _mac(key: bytes, seq: int, head: str) -> str:
    return hmac.new(key, _canonical({"seq": seq, "hash": head}), hashlib.sha256).hexdigest()


def make_checkpoint(seq: int, head: str, key: bytes) -> AuditCheckpoint:
    """The MACed checkpoint of chain head ``(seq, head)`` under ``key``."""
    return AuditCheckpoint(seq=seq, hash=head, mac=_mac(key, seq, head))


def verify(records: Iterable[AuditRecord], checkpoints: Iterable[AuditCheckpoint], key: bytes) -> VerifyReport:
    """Check ``records`` (as read, in ``seq`` order) against the chain rules and
    every checkpoint (the store's and ``audit.head``'s) under ``key``.

    Detected, naming the first bad ``seq``: an edited record (its hash), a
    deleted one (a ``seq`` gap or a ``prev`` mismatch), reordered records, a
    rewritten chain (a checkpoint's hash differs from its record), a forged
    checkpoint (MAC), and truncation (a checkpoint beyond the last record).
    Never raises for a bad log; the earliest problem wins."""
    recs = list(records)
    problems: list[tuple[int, str]] = []
    prev, good = GENESIS, 0
    present = {r.seq for r in recs}
    for i, r in enumerate(recs):
        want = i + 1
        if r.seq != want:
            if r.seq > want and want not in present:
                problems.append((want, f"record {want} is missing (record {r.seq} follows record {want - 1})"))
            else:
                problems.append((want, f"out of order: record {r.seq} found where record {want} belongs"))
            break
        if r.prev != prev:
            why = f"prev does not match the hash of record {want - 1} (deleted, reordered or rewritten records)"
            problems.append((want, why))
            break
        if _hash_of(r) != r.hash:
            problems.append((want, "hash does not match the record's content (edited)"))
            break
        prev, good = r.hash, want
    last = recs[-1].seq if recs else 0
    cps = list(checkpoints)
    beyond = 0
    for cp in cps:
        if not hmac.compare_digest(_mac(key, cp.seq, cp.hash), cp.mac):
            problems.append((cp.seq, f"checkpoint at record {cp.seq} has a bad MAC (forged, or another audit key)"))
        elif cp.seq > last:
            beyond = max(beyond, cp.seq)
        elif cp.seq <= good and recs[cp.seq - 1].hash != cp.hash:
            since = max((c.seq for c in cps if c.seq < cp.seq and c.seq <= good and recs[c.seq - 1].hash == c.hash),
                        default=0) + 1
            why = f"record {cp.seq} differs from its MACed checkpoint (records {since}-{cp.seq} rewritten)"
            problems.append((cp.seq, why))
    if beyond:
        problems.append((good + 1, f"truncated: a checkpoint covers record {beyond} but the log ends at record {last}"))
    if problems:
        seq, reason = min(problems, key=lambda p: p[0])
        return VerifyReport(ok=False, records=len(recs), first_bad_seq=seq, reason=reason, head=prev)
    return VerifyReport(ok=True, records=len(recs), first_bad_seq=None, reason="intact", head=prev)


# ------------------------------------------------------------------- key, files
def load_audit_key(state_dir: Path, env: Mapping[str, str] | None = None, *, create: bool = True) -> bytes:
    """The audit MAC key: ``ATP_AUDIT_KEY`` from ``env`` (default ``os.environ``;
    at least 16 characters), else ``<state_dir>/audit.key`` — created with 32
    random bytes (hex) and mode 0600 when absent and ``create``. Raises
    :class:`AuditError` for a short key, a key file readable by group or others,
    or a missing one when not ``create``."""
    env = os.environ if env is None else env
    value = env.get("ATP_AUDIT_KEY")
    if value:
        if len(value) < _MIN_KEY_CHARS:
            raise AuditError(f"ATP_AUDIT_KEY must have at least {_MIN_KEY_CHARS} characters")
        return value.encode()
    path = Path(state_dir) / "audit.key"
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise AuditError(f"no audit key: set ATP_AUDIT_KEY or provide {path}") from None
    if mode & 0o077:
        raise AuditError(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 {path}")
    key = path.read_text().strip()
    if len(key) < _MIN_KEY_CHARS:
        raise AuditError(f"{path} must hold at least {_MIN_KEY_CHARS} characters")
    return key.encode()


def read_head_file(path: Path) -> AuditCheckpoint | None:
    """The checkpoint in ``audit.head``, or ``None`` when the file is absent.
    Raises :class:`AuditError` when it is unreadable."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(data)
        return AuditCheckpoint(seq=int(obj["seq"]), hash=str(obj["hash"]), mac=str(obj["mac"]))
    except (ValueError, KeyError, TypeError) as e:
        raise AuditError(f"{path} is not an audit checkpoint: {e}") from None


def _write_head_file(path: Path, cp: AuditCheckpoint) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: workers checkpoint at once
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(_canonical({"seq": cp.seq, "hash": cp.hash, "mac": cp.mac}) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------------- writer
class AuditLog:
    """Appends chained records to ``store`` and writes MACed checkpoints (see the
    module docstring). Opening checks the stored log against its checkpoints
    (the store's and ``head_path``'s): a log that was cut or rewritten while
    the router was down raises :class:`AuditError` instead of being extended
    (which would overwrite the evidence in ``audit.head``); run
    ``atp-router audit verify`` then.

    ``every`` (records) and ``interval_ms`` bound how much of the tail is
    unsigned; call :meth:`tick` from a timer at :meth:`next_checkpoint_ms` and
    :meth:`close` at clean shutdown.

    ``shared``: other processes append to the same chain (``atp-router
    --workers N``): each record is chained to the store's head in one atomic
    step (:meth:`~atp.store.base.Store.append_audit_chained`), checkpoints MAC
    the last record this writer appended, and the checks at opening are left
    to the process that opened the log first (the supervisor)."""

    def __init__(self, store: Store, key: bytes, *, head_path: Path | None = None, every: int = 100,
                 interval_ms: int = 5_000, shared: bool = False) -> None:
        if every < 1 or interval_ms < 0:
            raise ValueError("every must be >= 1 and interval_ms >= 0")
        self.store, self._key, self.head_path = store, key, head_path
        self.every, self.interval_ms = every, interval_ms
        self.shared = shared
        head = store.audit_head()
        self._seq, self._hash = (head.seq, head.hash) if head is not None else (0, GENESIS)
        if shared:
            self._pending, self._first_pending_ms = 0, None
            return
        cps = [cp for cp in (store.audit_checkpoint(), read_head_file(head_path) if head_path else None) if cp]
        signed = 0
        for cp in cps:
            if not hmac.compare_digest(_mac(key, cp.seq, cp.hash), cp.mac):
                raise AuditError(f"audit checkpoint at record {cp.seq} has a bad MAC (forged, or another audit key)")
            if cp.seq > self._seq:
                raise AuditError(f"audit log truncated: checkpoint at record {cp.seq}, log ends at {self._seq}")
            at = store.audit_records(after=cp.seq - 1, limit=1) if cp.seq else []
            if cp.seq and (not at or at[0].hash != cp.hash):
                raise AuditError(f"audit record {cp.seq} differs from its MACed checkpoint")
            signed = max(signed, cp.seq)
        self._pending = self._seq - signed
        self._first_pending_ms: int | None = head.ts_ms if self._pending and head is not None else None

    @classmethod
    def open(cls, store: Store, state_dir: Path, *, env: Mapping[str, str] | None = None, every: int = 100,
             interval_ms: int = 5_000, shared: bool = False) -> AuditLog:
        """The writer for ``state_dir``: key from :func:`load_audit_key` (created
        if absent), checkpoints also in ``<state_dir>/audit.head``."""
        key = load_audit_key(Path(state_dir), env)
        return cls(store, key, head_path=Path(state_dir) / "audit.head", every=every, interval_ms=interval_ms,
                   shared=shared)

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last record (``(0, GENESIS)`` when empty)."""
        return self._seq, self._hash

    def record(self, kind: str, actor: str, tenant: str | None, detail: Mapping[str, Any] | None,
               now_ms: int) -> AuditRecord:
        """Append a record (``detail`` scrubbed) and checkpoint when due; returns
        it. Raises ``ValueError`` for an unknown ``kind``; store errors propagate
        (the head then stays where it was)."""
        if self.shared:
            rec = self.store.append_audit_chained(lambda seq, head: chain_record(
                seq, head, kind=kind, actor=actor, tenant=tenant, detail=detail, now_ms=now_ms))
        else:
            rec = chain_record(self._seq, self._hash, kind=kind, actor=actor, tenant=tenant, detail=detail,
                               now_ms=now_ms)
            self.store.append_audit(rec)
        self._seq, self._hash = rec.seq, rec.hash
        self._pending += 1
        if self._first_pending_ms is None:
            self._first_pending_ms = now_ms
        if self._pending >= self.every or now_ms - self._first_pending_ms >= self.interval_ms:
            self.checkpoint()
        return rec

    def next_checkpoint_ms(self) -> int | None:
        """When the unsigned tail is due for a checkpoint (Unix ms), or ``None``."""
        return None if self._first_pending_ms is None else self._first_pending_ms + self.interval_ms

    def tick(self, now_ms: int) -> AuditCheckpoint | None:
        """Checkpoint if the oldest unsigned record is ``interval_ms`` old."""
        due = self.next_checkpoint_ms()
        return self.checkpoint() if due is not None and now_ms >= due else None

    def checkpoint(self) -> AuditCheckpoint | None:
        """MAC the head now and store it (``audit.head`` first, then the store);
        ``None`` when the log is empty."""
        if self._seq == 0:
            return None
        cp = make_checkpoint(self._seq, self._hash, self._key)
        if self.head_path is not None:
            _write_head_file(self.head_path, cp)
        self.store.put_audit_checkpoint(cp)
        self._pending, self._first_pending_ms = 0, None
        return cp

    def close(self) -> None:
        """Clean shutdown: checkpoint the unsigned tail."""
        if self._pending:
            self.checkpoint()


# -------------------------------------------------------------------------- CLI
def _fmt_ts(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def audit_main(argv: list[str]) -> int:
    """``atp-router audit verify --state-dir D`` (exit 0 ``audit: OK, N records,
    head <hash12>``; exit 1 ``audit: BROKEN at record <seq>: <reason>``) and
    ``atp-router audit show --state-dir D [--since SEQ] [--json]`` (records with
    ``seq`` >= SEQ; one JSON object per line with ``--json``). Exit 2: no state,
    no key, unreadable state."""
    from atp.store.base import StoreError
    from atp.store.sqlite import SqliteStore

    from atp.router.helpfmt import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(prog="atp-router audit", description="Check or print the audit log (spec §11).",
                                 formatter_class=DefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check the hash chain and its MACed checkpoints",
                       formatter_class=DefaultsHelpFormatter)
    v.add_argument("--state-dir", type=Path, required=True)
    s = sub.add_parser("show", help="print audit records", formatter_class=DefaultsHelpFormatter)
    s.add_argument("--state-dir", type=Path, required=True)
    s.add_argument("--since", type=int, default=1, metavar="SEQ", help="first record to print (default 1)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    try:
        store = SqliteStore.open(args.state_dir, create=False)
    except StoreError as e:
        print(f"audit: {e}", file=sys.stderr)
        return 2
    with store:
        if args.cmd == "show":
            for r in store.audit_records(after=max(args.since, 1) - 1):
                if args.json:
                    print(json.dumps({"seq": r.seq, "ts_ms": r.ts_ms, "kind": r.kind, "actor": r.actor,
                                      "tenant": r.tenant, "detail": r.detail, "prev": r.prev, "hash": r.hash},
                                     ensure_ascii=False))
                else:
                    print(f"{r.seq:>6} {_fmt_ts(r.ts_ms)} {r.kind:<14} actor={r.actor} tenant={r.tenant or '-'} "
                          f"{json.dumps(r.detail, ensure_ascii=False, sort_keys=True)}")
            return 0
        try:
            key = load_audit_key(args.state_dir, create=False)
            head_file = read_head_file(args.state_dir / "audit.head")
        except AuditError as e:
            print(f"audit: {e}", file=sys.stderr)
            return 2
        table_cps = store.audit_checkpoints()
        records = store.audit_records()
    if table_cps and head_file is None:
        print(f"audit: BROKEN at record {table_cps[-1].seq}: audit.head is missing but the store has a checkpoint")
        return 1
    report = verify(records, [*table_cps, *([head_file] if head_file is not None else [])], key)
    if report.ok:
        print(f"audit: OK, {report.records} records, head {report.head[:12]}")
        return 0
    print(f"audit: BROKEN at record {report.first_bad_seq}: {report.reason}")
    return 1
