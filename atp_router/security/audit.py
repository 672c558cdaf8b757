"""The audit trail (spec §11 "Audit: immutable event log"; issue 7 item 6,
issue 19 item 7): an append-only, hash-chained log whose head is MACed, with
copies of the MACs outside the state directory.

Each :class:`~atp_router.store.audit_records.AuditRecord` carries ``prev``, the previous record's ``hash`` (64
zeros for the first), and ``hash`` = SHA-256 over the canonical JSON (sorted
keys, no spaces, UTF-8) of every other field. Editing a record breaks its hash;
deleting or reordering records breaks ``seq`` continuity or a ``prev`` link;
rewriting the whole tail consistently is caught by the **checkpoints**
``{seq, hash, mac}``: HMAC-SHA256 of the head under the audit key, which the
writer makes every ``every`` records (default :data:`DEFAULT_EVERY`),
``interval_ms`` (default :data:`DEFAULT_INTERVAL_MS`) after the oldest unsigned
record, and at clean shutdown. Each checkpoint is written

* in the store (all of them kept, so a rewrite is narrowed to one interval)
  and, the newest, in ``<state-dir>/audit.head`` (atomic write + rename), so
  that truncating the table (checkpoint rows included) is detected;
* with ``--audit-anchor FILE`` (:class:`AuditOptions` ``anchor``), appended to
  FILE outside the state directory — opened ``O_APPEND``, one JSON line
  ``{"hash","mac","seq"}`` per checkpoint, fsync'd — and with
  ``--audit-syslog ADDR`` sent to syslog (:class:`logging.handlers.SysLogHandler`,
  facility ``authpriv``, message ``atp-audit checkpoint {json}``; ADDR a Unix
  socket path such as ``/dev/log``, or ``udp://host:port`` / ``tcp://host:port``).
  A configured sink that cannot be opened refuses the start (:class:`AuditError`).

**The key.** ``ATP_AUDIT_KEY`` (at least 16 characters) or ``--audit-key-file
PATH`` (a 0600 file, e.g. made by ``atp-router audit keygen PATH``) outside the
state directory is the production setting; without either the key is
``<state-dir>/audit.key`` (created 0600) — the development setting, logged once
as a warning, since whoever can rewrite the log can then re-sign it too.

**What verify catches** (:func:`verify`, ``atp-router audit verify``): an edited,
deleted, reordered or re-hashed record, a forged checkpoint (MAC), truncation
(a checkpoint beyond the last record), and **records no checkpoint covers**
beyond the tail a crash can leave: the writer keeps at most ``every`` records
after the newest checkpoint (with ``--workers`` too: a writer checkpoints when
the chain has grown ``every`` records past the newest checkpoint it knows), so
a log with more unsigned records — e.g. every checkpoint row and
``audit.head`` removed after a re-hash — is refused (``max_unsigned``); up to
that many are reported as the tail of a crash (``kill -9`` between
checkpoints). With ``--anchor FILE`` every anchored checkpoint must match the
chain: a delete + re-hash + drop-the-checkpoints rewrite, a truncation, a
replaced key or a deleted ``state.db`` are caught whatever is left in the
state directory. What is not caught: without an anchor, a rollback to an
earlier checkpoint (the newer records and checkpoints removed, ``audit.head``
replaced by an older one) plus at most ``every`` rewritten records after it —
indistinguishable from a crash; with an anchor, changes to the records after
the newest anchored checkpoint (at most ``every`` of them). The key in the
state directory lets whoever can write there re-sign the store's checkpoints;
only an anchor's earlier lines then catch a rewrite.

The core — :func:`chain_record`, :func:`record_hash`, :func:`make_checkpoint`,
:func:`verify`, :func:`scrub_detail`, :func:`parse_anchor` — is sans-IO (time
comes in as ``now_ms``). :class:`AuditLog` is the small writer on an
:class:`atp_router.store.Store`; :func:`audit_main` is ``atp-router audit
verify|show|keygen``.

Detail dicts never carry secrets: :func:`scrub_detail` drops every key named
like a secret (a word ``token``, ``key``, ``secret``, ``password``, ``passwd``,
``pwd``, ``passphrase``, ``authorization``, ``cookie``, ``credential(s)``,
``bearer``, ``jwt``, ``hmac``, ``signature``, ``apikey``, or a name containing
``secret``/``password``/``token``/``apikey``; except the non-secret names in
:data:`SAFE_DETAIL_KEYS` such as ``api_key_env``, the *name* of an environment
variable) at any depth, listing the dropped names under ``"_dropped"``; it
truncates strings to :data:`MAX_DETAIL_STR` characters, lists and dicts to
:data:`MAX_DETAIL_ITEMS` entries and nesting to :data:`MAX_DETAIL_DEPTH`.

Errors: :class:`AuditError` (a ``RuntimeError``: a missing or unsafe key, a
sink that cannot be opened or written, a log that no longer matches its
checkpoints when the writer opens).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import functools
import hashlib
import hmac
import json
import logging
import logging.handlers
import math
import os
import re
import secrets
import socket
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from atp_router import store as _stores
from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.store.audit_records import GENESIS, AuditCheckpoint, AuditRecord
from atp_router.store.base import Store, StoreError, StoreUnavailable
from atp_router.store.sqlite import SqliteStore

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_INTERVAL_MS",
    "DEFAULT_SPOOL_BYTES",
    "DEFAULT_SPOOL_RECORDS",
    "AnchorFile",
    "AuditError",
    "AuditKind",
    "AuditLog",
    "AuditOptions",
    "AuditSpool",
    "SyslogSink",
    "VerifyReport",
    "audit_main",
    "chain_record",
    "load_audit_key",
    "make_checkpoint",
    "parse_anchor",
    "read_anchor",
    "read_head_file",
    "record_hash",
    "resolve_audit_key",
    "scrub_detail",
    "verify",
]

#: The writer's checkpoint cadence: at most this many records after the newest
#: checkpoint (also :func:`audit_main`'s ``--max-unsigned``), …
DEFAULT_EVERY = 100
#: Records the writers of one log (``--workers``) may append between a checkpoint
#: falling due and its being stored: a crash in that window leaves up to
#: ``every + WRITER_RACE`` unsigned records, which the router's start and
#: ``audit verify``'s default accept (a legitimate kill -9 never blocks a restart).
WRITER_RACE = 16
#: … and a checkpoint this long (ms) after the oldest unsigned record.
DEFAULT_INTERVAL_MS = 5_000
#: The audit spool's default bounds (:class:`AuditSpool`): records, and bytes of their JSON.
DEFAULT_SPOOL_RECORDS = 10_000
DEFAULT_SPOOL_BYTES = 16 * 1024 * 1024
#: The text before a checkpoint's JSON in a syslog message.
SYSLOG_TAG = "atp-audit checkpoint "
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


log = logging.getLogger(__name__)


class AuditError(RuntimeError):
    """The audit log cannot be written safely (key missing or readable by others,
    a configured sink that cannot be opened or written, or the stored log no
    longer matches its checkpoints)."""


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


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` found: ``records`` read; ``first_bad_seq`` the first
    record that is wrong or missing (``None`` when ``ok``); ``reason`` in words;
    ``head`` the hash of the last record of the intact prefix; ``signed`` the
    ``seq`` of the newest checkpoint (store, ``audit.head`` or anchor) that
    matches the chain (0: none); ``unsigned`` the records after it (the tail a
    crash leaves, when ``ok``); ``anchored`` how many anchored checkpoints
    were checked."""

    ok: bool
    records: int
    first_bad_seq: int | None
    reason: str
    head: str = GENESIS
    signed: int = 0
    unsigned: int = 0
    anchored: int = 0


@dataclass(frozen=True, slots=True)
class AuditOptions:
    """Where the audit key comes from and where checkpoints go besides the store
    (module docstring; the router's ``--audit-key-file``, ``--audit-anchor``,
    ``--audit-syslog``). ``key_file``: the MAC key's file (None:
    ``ATP_AUDIT_KEY``, else ``<state-dir>/audit.key``); ``anchor``: an
    append-only file of checkpoints outside the state directory; ``syslog``: a
    Unix socket path (``/dev/log``) or ``udp://host:port`` / ``tcp://host:port``;
    ``every`` / ``interval_ms`` the checkpoint cadence; ``spool_records`` /
    ``spool_bytes`` the bounds of the records kept while the store cannot take
    them (:class:`AuditSpool`; ``--audit-spool-records``, ``--audit-spool-bytes``)."""

    key_file: Path | None = None
    anchor: Path | None = None
    syslog: str | None = None
    every: int = DEFAULT_EVERY
    interval_ms: int = DEFAULT_INTERVAL_MS
    spool_records: int = DEFAULT_SPOOL_RECORDS
    spool_bytes: int = DEFAULT_SPOOL_BYTES


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


@functools.lru_cache(maxsize=4096)  # a pure function of a key name; records repeat a few dozen names
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


def verify(records: Iterable[AuditRecord], checkpoints: Iterable[AuditCheckpoint], key: bytes, *,
           anchored: Iterable[AuditCheckpoint] = (), max_unsigned: int | None = None,
           late: Iterable[AuditCheckpoint] = ()) -> VerifyReport:
    """Check ``records`` (as read, in ``seq`` order) against the chain rules and
    every checkpoint under ``key``: ``checkpoints`` (the store's and
    ``audit.head``'s, read before the records), ``anchored`` (read from an
    anchor outside the state directory, before the records) and ``late``
    (checkpoints read after the records: a live writer may have added some
    beyond them, which are ignored rather than called a truncation).

    Detected, naming the first bad ``seq``: an edited record (its hash), a
    deleted one (a ``seq`` gap or a ``prev`` mismatch), reordered records, a
    rewritten chain (a checkpoint's hash differs from its record), a forged
    checkpoint or another key (MAC), truncation (a checkpoint beyond the last
    record) and, with ``max_unsigned``, more than ``max_unsigned`` records
    after the newest matching checkpoint (checkpoints removed: a crash leaves
    at most the writer's ``every``; a log with records and no checkpoint at all
    counts every record). Never raises for a bad log; the earliest problem wins."""
    recs = list(records)
    problems: list[tuple[int, str]] = []
    prev, good = _walk_chain(recs, problems)
    last = recs[-1].seq if recs else 0
    anchors = list(anchored)
    cps = [(cp, "checkpoint") for cp in checkpoints] + [(cp, "anchored checkpoint") for cp in anchors]
    signed, beyond = _check_checkpoints(recs, good, key, cps, late, problems)
    if beyond is not None:
        seq, what = beyond
        article = "an" if what.startswith("a") else "a"
        problems.append((good + 1, f"truncated: {article} {what} covers record {seq} but the log ends at record {last}"))
    unsigned = last - signed
    if max_unsigned is not None and unsigned > max_unsigned and not problems:  # else the named problem explains it
        where = f"the last checkpoint (record {signed})" if signed else "any checkpoint"
        why = (f"records {signed + 1}-{last} ({unsigned}) are not covered by {where}; a crash leaves at most "
               f"{max_unsigned}: checkpoints were removed or the log rewritten")
        problems.append((signed + 1, why))
    n_anch = len(anchors)
    if problems:
        seq, reason = min(problems, key=lambda p: p[0])
        return VerifyReport(ok=False, records=len(recs), first_bad_seq=seq, reason=reason, head=prev, signed=signed,
                            unsigned=unsigned, anchored=n_anch)
    return VerifyReport(ok=True, records=len(recs), first_bad_seq=None, reason="intact", head=prev, signed=signed,
                        unsigned=unsigned, anchored=n_anch)


def _walk_chain(recs: list[AuditRecord], problems: list[tuple[int, str]]) -> tuple[str, int]:
    """Walk ``recs`` (as read) along the chain rules of :func:`verify`: the head
    hash and ``seq`` of the last good record (:data:`GENESIS`, 0 for none); the
    first break (a gap, reordering, a ``prev`` mismatch, an edit) is appended to
    ``problems`` as ``(seq, reason)`` and ends the walk."""
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
    return prev, good


def _check_checkpoints(recs: list[AuditRecord], good: int, key: bytes, cps: list[tuple[AuditCheckpoint, str]],
                       late: Iterable[AuditCheckpoint],
                       problems: list[tuple[int, str]]) -> tuple[int, tuple[int, str] | None]:
    """Check the checkpoints read before the records (``cps``: each with what it
    is, for messages) and the ``late`` ones against ``recs``, of which the first
    ``good`` passed :func:`_walk_chain`: a bad MAC, a checkpoint naming no record
    or differing from its record go to ``problems``. Returns the newest matching
    checkpoint's ``seq`` (0: none) and the newest early checkpoint beyond the
    last record, ``(seq, what)`` (a truncation; ``None``: none)."""
    last = recs[-1].seq if recs else 0
    n_early = len(cps)

    def matches(cp: AuditCheckpoint) -> bool:
        return 0 < cp.seq <= good and recs[cp.seq - 1].hash == cp.hash

    beyond: tuple[int, str] | None = None
    signed = 0
    for i, (cp, what) in enumerate([*cps, *((cp, "checkpoint") for cp in late)]):
        if not hmac.compare_digest(_mac(key, cp.seq, cp.hash), cp.mac):
            problems.append((max(cp.seq, 1), f"{what} at record {cp.seq} has a bad MAC (forged, or another audit key)"))
        elif cp.seq > last:
            if i < n_early and (beyond is None or cp.seq > beyond[0]):  # a late one may be newer than the read
                beyond = (cp.seq, what)
        elif cp.seq < 1:
            problems.append((1, f"{what} at record {cp.seq}: no such record"))
        elif cp.seq <= good and recs[cp.seq - 1].hash != cp.hash:
            since = max((c.seq for c, _ in cps if c.seq < cp.seq and matches(c)), default=0) + 1
            why = f"record {cp.seq} differs from its MACed {what} (records {since}-{cp.seq} rewritten)"
            problems.append((cp.seq, why))
        elif matches(cp):
            signed = max(signed, cp.seq)
    return signed, beyond


# ------------------------------------------------------------------- key, files
def load_audit_key(state_dir: Path, env: Mapping[str, str] | None = None, *, create: bool = True,
                   key_file: Path | None = None) -> bytes:
    """The audit MAC key (:func:`resolve_audit_key` without its source)."""
    return resolve_audit_key(state_dir, env, create=create, key_file=key_file)[0]


def resolve_audit_key(state_dir: Path, env: Mapping[str, str] | None = None, *, create: bool = True,
                      key_file: Path | None = None) -> tuple[bytes, str]:
    """The audit MAC key and where it came from (``"ATP_AUDIT_KEY"``, the key
    file's path, or ``"state-dir"``): ``ATP_AUDIT_KEY`` from ``env`` (default
    ``os.environ``; at least 16 characters), else ``key_file`` (must exist),
    else ``<state_dir>/audit.key`` — created with 32 random bytes (hex) and
    mode 0600 when absent and ``create``. Raises :class:`AuditError` for both
    ``ATP_AUDIT_KEY`` and ``key_file`` (which one is meant?), a short key, a
    key file readable by group or others, or a missing one."""
    env = os.environ if env is None else env
    value = env.get("ATP_AUDIT_KEY")
    if value and key_file is not None:
        raise AuditError(f"both ATP_AUDIT_KEY and an audit key file ({key_file}) are given: keep one")
    if value:
        if len(value) < _MIN_KEY_CHARS:
            raise AuditError(f"ATP_AUDIT_KEY must have at least {_MIN_KEY_CHARS} characters")
        return value.encode(), "ATP_AUDIT_KEY"
    path = Path(key_file) if key_file is not None else Path(state_dir) / "audit.key"
    if create and key_file is None:
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
        if key_file is not None:
            raise AuditError(f"no audit key: {path} does not exist (make one: atp-router audit keygen {path})") from None
        raise AuditError(f"no audit key: set ATP_AUDIT_KEY or provide {path}") from None
    if mode & 0o077:
        raise AuditError(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 {path}")
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise AuditError(f"audit key {path} cannot be read: {e}") from None
    if len(key) < _MIN_KEY_CHARS:
        raise AuditError(f"{path} must hold at least {_MIN_KEY_CHARS} characters")
    return key.encode(), (str(path) if key_file is not None else "state-dir")


def write_new_key(path: Path) -> None:
    """A new audit key file: 32 random bytes as hex, mode 0600, fsync'd. Raises
    ``FileExistsError`` rather than replace one (a replaced key makes every
    earlier checkpoint unverifiable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _checkpoint_line(cp: AuditCheckpoint) -> bytes:
    return _canonical({"seq": cp.seq, "hash": cp.hash, "mac": cp.mac})


def _parse_checkpoint(text: str) -> AuditCheckpoint:
    """A checkpoint from the JSON object in ``text`` (from its first ``{`` to its
    last ``}``: a syslog line's prefix and trailing NUL are skipped)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object")
    obj = json.loads(text[start:end + 1])
    if not isinstance(obj, dict):
        raise TypeError("not a JSON object")
    seq, head, mac = obj["seq"], obj["hash"], obj["mac"]
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(head, str) or not isinstance(mac, str):
        raise TypeError("seq must be an integer, hash and mac strings")
    return AuditCheckpoint(seq=seq, hash=head, mac=mac)


def parse_anchor(data: bytes, name: str = "anchor") -> tuple[list[AuditCheckpoint], bool]:
    """The checkpoints in an anchor's bytes — one per line (or NUL-terminated
    message, as syslog over TCP sends them), each line's JSON object
    ``{"seq","hash","mac"}`` (a syslog line's prefix before it allowed, blank
    lines skipped) — and whether a torn last line (no newline: a crash
    in the middle of an append) was left out. Raises :class:`AuditError`
    naming the first line that is not a checkpoint."""
    lines = re.split(b"[\n\x00]", data)
    torn = False
    out: list[AuditCheckpoint] = []
    for n, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            continue
        try:
            out.append(_parse_checkpoint(text))
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines):  # no newline after it: an append cut short
                torn = True
                continue
            raise AuditError(f"{name} line {n} is not an audit checkpoint: {e}") from None
    return out, torn


def read_anchor(path: Path) -> tuple[list[AuditCheckpoint], bool]:
    """:func:`parse_anchor` of the file ``path``. Raises :class:`AuditError` when
    it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AuditError(f"audit anchor {path} cannot be read: {e.strerror or e}") from None
    return parse_anchor(data, str(path))


class AnchorFile:
    """An append-only file of checkpoints outside the state directory
    (``--audit-anchor``): opened ``O_WRONLY | O_APPEND | O_CREAT`` (0600) for
    the life of the writer — one ``write`` of one line per checkpoint, then
    ``fsync``, so several processes (``--workers``) append whole lines. Raises
    :class:`AuditError` when it cannot be opened for appending, is not a regular
    file, or lies inside ``state_dir`` (where whoever rewrites the log could
    rewrite it too)."""

    def __init__(self, path: Path, state_dir: Path | None = None) -> None:
        self.path = Path(path)
        if state_dir is not None:
            inside = self.path.resolve().is_relative_to(Path(state_dir).resolve())
            if inside:
                raise AuditError(f"--audit-anchor {path} is inside the state directory {state_dir}: an anchor must "
                                 "live where whoever can rewrite the log cannot (another disk, host or owner)")
        existed = self.path.exists()
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise AuditError(f"--audit-anchor {path} cannot be opened for appending: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise AuditError(f"--audit-anchor {path} is not a regular file")
        if not existed:
            _fsync_dir(self.path.parent)

    def append(self, cp: AuditCheckpoint) -> None:
        """Append ``cp`` as one line and fsync. Raises :class:`AuditError`."""
        line = _checkpoint_line(cp) + b"\n"
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError("short write")
            os.fsync(self.fd)
        except OSError as e:
            raise AuditError(f"audit anchor {self.path}: checkpoint {cp.seq} not written: {e}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: Seconds one checkpoint may take to reach a syslog server (``--audit-syslog``).
SYSLOG_TIMEOUT_S = 2.0


class SyslogSink:
    """Checkpoints sent to syslog (``--audit-syslog``) with the standard
    library's :class:`logging.handlers.SysLogHandler`, facility ``authpriv``,
    level INFO, message ``atp-router[PID]: atp-audit checkpoint {json}``.
    ``address``: a Unix socket path (``/dev/log``: rsyslog, journald) or
    ``udp://host:port`` / ``tcp://host:port``. Raises :class:`AuditError` when
    a Unix or TCP address cannot be connected to or a host not resolved (UDP is
    connectionless: a listener that is not there is not noticed)."""

    def __init__(self, address: str) -> None:
        self.address = address
        try:
            if address.startswith(("udp://", "tcp://")):
                host, _, port = address[6:].rpartition(":")
                if not host or not port.isdigit():
                    raise AuditError(f"--audit-syslog {address}: give udp://host:port or tcp://host:port")
                kind = socket.SOCK_DGRAM if address.startswith("udp") else socket.SOCK_STREAM
                handler = _RaisingSysLogHandler(address=(host.strip("[]"), int(port)),
                                                facility=logging.handlers.SysLogHandler.LOG_AUTHPRIV, socktype=kind)
                if kind == socket.SOCK_STREAM and handler.socket is None:
                    raise OSError("not connected")
            elif address.startswith("/"):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                try:
                    probe.connect(address)  # the handler would defer this error to the first message
                finally:
                    probe.close()
                handler = _RaisingSysLogHandler(address=address, facility=logging.handlers.SysLogHandler.LOG_AUTHPRIV,
                                                socktype=socket.SOCK_DGRAM)
            else:
                raise AuditError(f"--audit-syslog {address}: give a Unix socket path (/dev/log), udp://host:port "
                                 "or tcp://host:port")
        except OSError as e:
            raise AuditError(f"--audit-syslog {address} cannot be reached: {e.strerror or e}") from None
        handler.ident = f"atp-router[{os.getpid()}]: "
        if handler.socket is not None:
            # A syslog server that stops reading must not hold the router's event loop.
            handler.socket.settimeout(SYSLOG_TIMEOUT_S)
        self.handler = handler

    def append(self, cp: AuditCheckpoint) -> None:
        """Send ``cp`` (each send bounded by :data:`SYSLOG_TIMEOUT_S`; a broken TCP
        connection is made again once). Raises :class:`AuditError` when it cannot
        be sent."""
        rec = logging.LogRecord("atp.audit.anchor", logging.INFO, __file__, 0,
                                SYSLOG_TAG + _checkpoint_line(cp).decode(), None, None)
        try:
            try:
                self.handler.emit(rec)
            except OSError:
                if self.handler.socktype != socket.SOCK_STREAM:
                    raise
                # The server went away and came back: the stdlib handler never reconnects.
                self.handler.socket.close()
                self.handler.socket = None
                self.handler.createSocket()
                if self.handler.socket is None:
                    raise OSError("cannot reconnect") from None
                self.handler.socket.settimeout(SYSLOG_TIMEOUT_S)
                self.handler.emit(rec)
        except OSError as e:
            raise AuditError(f"--audit-syslog {self.address}: checkpoint {cp.seq} not anchored: {e}") from None

    def close(self) -> None:
        self.handler.close()


class _RaisingSysLogHandler(logging.handlers.SysLogHandler):
    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 (emit calls it inside its except: the send error goes to the caller)


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


def _write_head_file(path: Path, cp: AuditCheckpoint, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``cp``'s line, atomically (a rename); ``fsync``: durable
    across an OS crash too (the file and its directory fsynced), else across a
    process crash (the page cache), as the store's ``synchronous`` mode is."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: workers checkpoint at once
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(_checkpoint_line(cp) + b"\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------------- spool
@dataclass(frozen=True, slots=True)
class _Spooled:
    """A record not yet chained: what :meth:`AuditLog.record` was given
    (``detail`` scrubbed), when, and the chain head this writer knew then."""

    kind: str
    actor: str
    tenant: str | None
    detail: dict[str, Any]
    ts_ms: int
    size: int
    after_seq: int

    def same(self, rec: AuditRecord) -> bool:
        """Whether ``rec`` is this record, chained (an append that timed out but
        which the store ran later)."""
        return (rec.ts_ms, rec.kind, rec.actor, rec.tenant, rec.detail) == (
            self.ts_ms, self.kind, self.actor, self.tenant, self.detail)


class AuditSpool:
    """Audit records written while the store cannot take them
    (:class:`~atp_router.store.base.StoreUnavailable`: a shared store that cannot
    be reached, the embedded one's full disk), kept **in order**, and chained by
    :meth:`AuditLog.flush_spool` when the store answers again, each with its own
    time. Bounded: at most ``max_records`` records and ``max_bytes`` bytes (of
    their JSON); a record that does not fit is **dropped**, counted
    (:attr:`dropped`, ``on_drop`` — the router's ``atp_audit_dropped_total``)
    and logged once per outage (one ERROR line when the spool fills; again only
    after it has drained).

    With a ``directory`` (the router's state directory) every spooled record is
    also appended to ``<directory>/audit.spool.<pid>.<random>`` and fsynced before
    :meth:`add` returns, the file locked (``flock``) for this process's life, so
    a kill -9 loses none: a spool opened later on the same directory — by the
    restarted router, or another worker — adopts every such file whose process
    is gone (its lock released) ahead of its own records, and deletes them once
    all are chained (:meth:`AuditLog.flush_spool` does not chain twice a record
    the store already has). A file that cannot be written (a full disk) leaves
    the record in memory only, logged once."""

    def __init__(self, max_records: int = DEFAULT_SPOOL_RECORDS, max_bytes: int = DEFAULT_SPOOL_BYTES, *,
                 directory: Path | None = None) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError("the audit spool needs room for at least one record")
        self.max_records, self.max_bytes = max_records, max_bytes
        self.entries: collections.deque[_Spooled] = collections.deque()
        self.bytes = 0
        #: Records dropped since start: the spool was full.
        self.dropped = 0
        #: Called once per dropped record (the router counts it).
        self.on_drop: Callable[[], None] | None = None
        self._full_logged = False
        self.directory = directory
        self._file: Any = None  # this process's spool file, locked, while it holds records
        self._adopted: list[tuple[Path, Any]] = []  # dead processes' files (locked) whose records we hold
        self._disk_failed = False
        if directory is not None:
            self._adopt(directory)

    @property
    def disk_failed(self) -> bool:
        """Whether a spooled record could not be written to its file (kept in memory only)."""
        return self._disk_failed

    def _adopt(self, directory: Path) -> None:
        """Take the spool files of processes that are gone: their records first."""
        for path in sorted(directory.glob("audit.spool.*")):
            try:
                f = open(path, "rb")  # noqa: SIM115 (kept open, locked, until its records are chained)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()  # a live process's own spool
                continue
            if not path.exists():  # chained and removed by another process meanwhile
                f.close()
                continue
            for line in f.read().split(b"\n"):
                try:
                    entry = _Spooled(**json.loads(line))
                except (ValueError, TypeError):
                    continue  # the torn last line of a crash (written, never fsynced)
                self.entries.append(entry)
                self.bytes += entry.size
            self._adopted.append((path, f))
        if self.entries:
            log.error("audit: %d records spooled by a process that is gone are chained when the store takes them",
                      len(self.entries))

    def _persist(self, entry: _Spooled) -> None:
        if self.directory is None or self._disk_failed:
            return
        try:
            if self._file is None:
                # The pid and a random part: a restarted process may get its predecessor's pid (pid 1).
                path = self.directory / f"audit.spool.{os.getpid()}.{secrets.token_hex(4)}"
                self._file = open(path, "ab")  # noqa: SIM115 (open while it holds records)
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._file.write(json.dumps(dataclasses.asdict(entry), separators=(",", ":")).encode() + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            self._disk_failed = True
            log.error("audit: the spool file in %s cannot be written (%s): spooled records are kept in memory only",
                      self.directory, e)

    def _drained(self) -> None:
        """Every record is chained: the files go."""
        for path, f in self._adopted:
            path.unlink(missing_ok=True)
            f.close()
        self._adopted = []
        if self._file is not None:
            Path(self._file.name).unlink(missing_ok=True)
            self._file.close()
            self._file = None
        self._disk_failed = False

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: _Spooled, cause: BaseException) -> bool:
        """Keep ``entry`` at the end; False (dropped, counted) when it does not fit."""
        if len(self.entries) >= self.max_records or self.bytes + entry.size > self.max_bytes:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop()
            if not self._full_logged:
                self._full_logged = True
                log.error("audit spool full (%d records, %d bytes; bounds %d, %d): audit records are DROPPED until "
                          "the store takes them (%s); counted in atp_audit_dropped_total", len(self.entries),
                          self.bytes, self.max_records, self.max_bytes, cause)
            return False
        if not self.entries:
            log.error("audit records are spooled until the store takes them: %s", cause)
        self._persist(entry)
        self.entries.append(entry)
        self.bytes += entry.size
        return True

    def pop(self) -> None:
        """The oldest record is chained (or found chained): forget it."""
        self.bytes -= self.entries.popleft().size
        if not self.entries:
            self._full_logged = False
            self._drained()


# ----------------------------------------------------------------------- writer
_dev_key_warned = False


class AuditLog:
    """Appends chained records to ``store`` and writes MACed checkpoints (see the
    module docstring) to the store, ``head_path`` and each of ``sinks``
    (:class:`AnchorFile`, :class:`SyslogSink`). Opening checks the stored log
    against its checkpoints (the store's, ``head_path``'s and the newest in
    ``anchor``, an anchor file's checkpoints): a log that was cut or rewritten
    while the router was down — a checkpoint beyond its end or differing from
    its record, or more than ``every`` records after the newest checkpoint
    (checkpoints removed) — raises :class:`AuditError` instead of being
    extended (which would re-sign the rewrite); run ``atp-router audit
    verify`` then.

    ``every`` (records) and ``interval_ms`` bound how much of the tail is
    unsigned; call :meth:`tick` from a timer at :meth:`next_checkpoint_ms` and
    :meth:`close` at clean shutdown.

    ``shared``: other processes append to the same chain (``atp-router
    --workers N``, routers on one store): each record is chained to the store's
    head in one atomic step (:meth:`~atp_router.store.base.Store.append_audit_chained`),
    checkpoints MAC the last record this writer appended, made when the chain
    has grown ``every`` records past the newest checkpoint this writer knows
    (its own, or the store's when due) — so the chain's unsigned tail stays
    within ``every`` whatever the number of writers — and the checks at
    opening are left to the process that opened the log first (the
    supervisor's recovery)."""

    def __init__(self, store: Store, key: bytes, *, head_path: Path | None = None, every: int = DEFAULT_EVERY,
                 interval_ms: int = DEFAULT_INTERVAL_MS, shared: bool = False, sinks: Iterable[Any] = (),
                 anchor: Path | None = None, spool: AuditSpool | None = None, fsync_head: bool = True) -> None:
        if every < 1 or interval_ms < 0:
            raise ValueError("every must be >= 1 and interval_ms >= 0")
        self.store, self._key, self.head_path = store, key, head_path
        #: ``head_path`` fsynced at each checkpoint (file and directory): False when the store
        #: itself survives a process crash only (SQLite ``synchronous=NORMAL``, the default) —
        #: an fsynced head ahead of a store that lost its last commits in an OS crash would make
        #: the log look cut, and the two fsyncs held the event loop at every checkpoint.
        self.fsync_head = fsync_head
        #: Records the store could not take yet, chained in order when it can (:meth:`flush_spool`).
        self.spool = spool if spool is not None else AuditSpool()
        self._spool_cause: StoreUnavailable | None = None
        self.every, self.interval_ms = every, interval_ms
        self.shared = shared
        self.sinks = list(sinks)
        head = store.audit_head()
        self._seq, self._hash = (head.seq, head.hash) if head is not None else (0, GENESIS)
        #: ``defer(write, done) -> bool``: hand a record's store write to the router's group
        #: commit (:meth:`StreamPersistence.defer <atp_router.runtime.dataplane.persistence.StreamPersistence.defer>`,
        #: one transaction with the events queued with it; False: none runs, written at once).
        #: Not shared logs only. Checkpoints MAC only what is stored (:meth:`checkpoint`).
        self.defer: Callable[[Callable[[], object], Callable[[], None] | None], bool] | None = None
        #: ``(seq, hash)`` of the last record known stored (behind the head while deferred ones wait).
        self._stored = (self._seq, self._hash)
        if shared:
            latest = store.audit_checkpoint()
            self._signed = latest.seq if latest is not None else 0
            self._pending, self._first_pending_ms = 0, None
            return
        cps = [cp for cp in (store.audit_checkpoint(), read_head_file(head_path) if head_path else None) if cp]
        if anchor is not None:
            anchored, _torn = read_anchor(anchor)
            if anchored:
                cps.append(max(anchored, key=lambda c: c.seq))
        signed = 0
        for cp in cps:
            if not hmac.compare_digest(_mac(key, cp.seq, cp.hash), cp.mac):
                raise AuditError(f"audit checkpoint at record {cp.seq} has a bad MAC (forged, or another audit key)")
            if cp.seq > self._seq:
                raise AuditError(f"audit log truncated: checkpoint at record {cp.seq}, log ends at {self._seq}")
            at = store.audit_records(after=cp.seq - 1, limit=1) if cp.seq > 0 else []
            if not at or at[0].hash != cp.hash:
                raise AuditError(f"audit record {cp.seq} differs from its MACed checkpoint")
            signed = max(signed, cp.seq)
        if self._seq - signed > every + WRITER_RACE:
            raise AuditError(f"audit log: records {signed + 1}-{self._seq} are not covered by any checkpoint (a crash "
                             f"leaves at most {every + WRITER_RACE}): checkpoints were removed or the log rewritten; "
                             "run atp-router audit verify")
        self._signed = signed
        self._pending = self._seq - signed
        self._first_pending_ms: int | None = head.ts_ms if self._pending and head is not None else None

    @classmethod
    def open(cls, store: Store, state_dir: Path, *, env: Mapping[str, str] | None = None,
             every: int | None = None, interval_ms: int | None = None, shared: bool = False,
             options: AuditOptions | None = None, warn: bool = True, fsync_head: bool = True) -> AuditLog:
        """The writer for ``state_dir`` with ``options`` (:class:`AuditOptions`;
        ``every`` / ``interval_ms`` override its cadence; ``fsync_head`` as the
        constructor's, from the store's durability): the key from
        :func:`resolve_audit_key` (``<state_dir>/audit.key`` created if no other
        is given — logged once per process as the development setting, unless
        not ``warn``), checkpoints also in ``<state_dir>/audit.head``, the
        anchor file and syslog. Raises :class:`AuditError` (refusing rather than
        running without a configured sink)."""
        global _dev_key_warned
        opts = options or AuditOptions()
        key, source = resolve_audit_key(Path(state_dir), env, key_file=opts.key_file)
        if source == "state-dir" and warn and not _dev_key_warned:
            _dev_key_warned = True
            log.warning("audit: the MAC key is %s, in the state directory beside the log it signs: whoever can "
                        "rewrite the log can re-sign it (the development setting). In production set ATP_AUDIT_KEY "
                        "or --audit-key-file outside the state directory, and --audit-anchor",
                        Path(state_dir) / "audit.key")
        sinks: list[Any] = []
        try:
            if opts.anchor is not None:
                sinks.append(AnchorFile(opts.anchor, Path(state_dir)))
            if opts.syslog is not None:
                sinks.append(SyslogSink(opts.syslog))
            opened = cls(store, key, head_path=Path(state_dir) / "audit.head",
                         every=opts.every if every is None else every,
                         interval_ms=opts.interval_ms if interval_ms is None else interval_ms,
                         shared=shared, sinks=sinks, anchor=opts.anchor,
                         spool=AuditSpool(opts.spool_records, opts.spool_bytes, directory=Path(state_dir)),
                         fsync_head=fsync_head)
            # Records a process that is gone spooled on disk: chained now when the store takes
            # them (else by the router's periodic flush), whichever process opened the log first.
            opened.flush_spool()
            return opened
        except BaseException:
            for sink in sinks:
                sink.close()
            raise

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last record (``(0, GENESIS)`` when empty)."""
        return self._seq, self._hash

    def record(self, kind: str, actor: str, tenant: str | None, detail: Mapping[str, Any] | None,
               now_ms: int) -> AuditRecord | None:
        """Append a record (``detail`` scrubbed) and checkpoint when due; returns
        it. While the store cannot take it (:class:`~atp_router.store.base.StoreUnavailable`),
        or records spooled before it still wait (until :meth:`flush_spool` has
        chained them), it is spooled (:attr:`spool`, in order behind them) and
        None returned; a full spool drops it, counted
        and logged (:class:`AuditSpool`). Raises ``ValueError`` for an unknown
        ``kind``; other store errors propagate (the head then stays where it
        was), and :class:`AuditError` when a sink failed (the record and the
        local checkpoint are stored)."""
        kind = str(AuditKind(kind))
        if self.spool.entries:  # behind those (flush_spool chains them first; no store call here)
            self._spool(kind, actor, tenant, detail, now_ms, self._spool_cause)
            return None
        try:
            return self._append(kind, actor, tenant, detail, now_ms)
        except StoreUnavailable as e:
            self._spool(kind, actor, tenant, detail, now_ms, e)
            return None

    def _spool(self, kind: str, actor: str, tenant: str | None, detail: Mapping[str, Any] | None, now_ms: int,
               cause: BaseException | None) -> None:
        clean = scrub_detail(detail)
        size = len(_canonical({"kind": kind, "actor": actor, "tenant": tenant, "detail": clean})) + 16
        self.spool.add(_Spooled(kind, actor, tenant, clean, now_ms, size, self._seq),
                       cause if cause is not None else StoreUnavailable("the store is unavailable"))

    def flush_spool(self) -> bool:
        """Chain the spooled records in order, each with its own time (the
        router calls it every second); True when none is left, False while the
        store still cannot take them. A spooled record whose append timed out
        but which the store ran later (found in the chain after the head this
        writer knew when it spooled it) is not chained twice. Other store
        errors propagate; a sink's :class:`AuditError` is logged."""
        spool = self.spool
        if not spool.entries:
            return True
        try:
            first = spool.entries[0]
            applied = self.store.audit_records(after=first.after_seq, limit=len(spool.entries) + 1000)
            while spool.entries:
                e = spool.entries[0]
                found = next((i for i, r in enumerate(applied) if e.same(r)), None)
                if found is not None:
                    del applied[found]
                else:
                    try:
                        self._append(e.kind, e.actor, e.tenant, e.detail, e.ts_ms)
                    except AuditError as err:
                        log.error("audit: a checkpoint sink failed while the spool was written: %s", err)
                spool.pop()
        except StoreUnavailable as err:
            self._spool_cause = err
            return False
        log.warning("audit: the store takes records again: the spooled records are chained")
        return True

    def _append(self, kind: str, actor: str, tenant: str | None, detail: Mapping[str, Any] | None,
                now_ms: int) -> AuditRecord | None:
        """Chain one record now (:meth:`record` without the spool), or hand it to
        the group commit (:attr:`defer`: None returned, a shared log's record
        chained there). Store errors propagate."""
        if self.shared:
            def build(seq: int, head: str) -> AuditRecord:
                return chain_record(seq, head, kind=kind, actor=actor, tenant=tenant, detail=detail, now_ms=now_ms)

            # Only while the store answers: one found away spools the record (bounded, counted).
            if self.defer is not None and self.store.available:
                chained: list[AuditRecord] = []
                # Chained to the store's head in the group commit (a store thread); this
                # writer's head and checkpoints follow on the trio side once it is stored.
                if self.defer(lambda: self.store.append_audit_chained_then(build, chained.append),
                              lambda: self._chained(chained[-1], now_ms)):
                    return None
            rec = self.store.append_audit_chained(build)
        else:
            rec = chain_record(self._seq, self._hash, kind=kind, actor=actor, tenant=tenant, detail=detail,
                               now_ms=now_ms)
            if self.defer is not None and self.defer(functools.partial(self.store.append_audit, rec),
                                                     functools.partial(self._on_stored, rec)):
                self._seq, self._hash = rec.seq, rec.hash
                self._pending += 1
                if self._first_pending_ms is None:
                    self._first_pending_ms = now_ms
                return rec  # checkpointed once stored (_on_stored) or by tick
            self.store.append_audit(rec)
        return self._chained(rec, now_ms)

    def _chained(self, rec: AuditRecord, now_ms: int) -> AuditRecord:
        """``rec`` is stored: this writer's head, and a checkpoint when due."""
        self._stored = self._seq, self._hash = rec.seq, rec.hash
        self._pending += 1
        if self._first_pending_ms is None:
            self._first_pending_ms = now_ms
        if self._seq - self._signed >= self.every and self.shared:
            latest = self.store.audit_checkpoint()  # another writer's may already cover the chain
            if latest is not None and latest.seq > self._signed:
                self._signed = latest.seq
        if self._seq - self._signed >= self.every or now_ms - self._first_pending_ms >= self.interval_ms:
            self.checkpoint()
        return rec

    def _on_stored(self, rec: AuditRecord) -> None:
        """A deferred record is in the store (the group commit that carried it is
        durable): it may be MACed; a checkpoint when ``every`` are unsigned."""
        if rec.seq > self._stored[0]:
            self._stored = rec.seq, rec.hash
        if self._stored[0] - self._signed >= self.every:
            try:
                self.checkpoint()
            except (AuditError, StoreError) as e:  # tried again by the next record or tick
                log.error("audit: a checkpoint after a group commit failed: %s", e)

    def next_checkpoint_ms(self) -> int | None:
        """When the unsigned tail is due for a checkpoint (Unix ms), or ``None``."""
        return None if self._first_pending_ms is None else self._first_pending_ms + self.interval_ms

    def tick(self, now_ms: int) -> AuditCheckpoint | None:
        """Checkpoint if the oldest unsigned record is ``interval_ms`` old."""
        due = self.next_checkpoint_ms()
        return self.checkpoint() if due is not None and now_ms >= due else None

    def checkpoint(self) -> AuditCheckpoint | None:
        """MAC the head now and store it (``audit.head`` first, then the store,
        then each sink); ``None`` when the log is empty. Raises
        :class:`AuditError` when a sink failed (after trying every sink; the
        local checkpoint is written)."""
        # A shared log's head is stored when chained; a deferred record is MACed only
        # once stored (a crash never leaves a checkpoint past the stored chain).
        seq, head = (self._seq, self._hash) if self.shared else self._stored
        if seq == 0 or (seq <= self._signed and self._seq > seq):
            return None  # nothing stored since the last one: the deferred records are not MACed yet
        cp = make_checkpoint(seq, head, self._key)
        if self.head_path is not None:
            _write_head_file(self.head_path, cp, fsync=self.fsync_head)
        self.store.put_audit_checkpoint(cp)
        self._pending = self._seq - seq
        if not self._pending:
            self._first_pending_ms = None
        self._signed = max(self._signed, cp.seq)
        failed: list[str] = []
        for sink in self.sinks:
            try:
                sink.append(cp)
            except AuditError as e:
                failed.append(str(e))
        if failed:
            raise AuditError("; ".join(failed))
        return cp

    def close(self) -> None:
        """Clean shutdown: checkpoint the unsigned tail, close the sinks."""
        try:
            if self.spool.entries and not self.flush_spool():
                where = (f"kept in {self.spool.directory}/audit.spool.*, chained at the next start"
                         if self.spool.directory is not None and not self.spool.disk_failed else "lost")
                log.error("audit: %d spooled records not written at shutdown (the store cannot take them): %s",
                          len(self.spool), where)
            if self._pending:
                self.checkpoint()
        finally:
            for sink in self.sinks:
                sink.close()


# -------------------------------------------------------------------------- CLI
def _fmt_ts(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def audit_main(argv: list[str], *, default_state_dir: Path | None = None) -> int:
    """``atp-router audit verify|show|keygen``; ``--state-dir`` defaults to
    ``default_state_dir`` (the router's default, passed by
    :func:`atp_router.deploy.cli.main`; None: required).

    ``verify [--state-dir D] [--store URL] [--anchor FILE]… [--key-file PATH]
    [--max-unsigned N]`` checks the chain (read from ``D``'s SQLite store, or
    with ``--store redis://…`` from the store several routers share, ``D``
    then one router's state directory) against every checkpoint (the store's,
    ``audit.head``'s, each anchor's) with the key from ``ATP_AUDIT_KEY``, else
    ``--key-file``, else ``D/audit.key``; exit 0 ``audit: OK, N records, head
    <hash12>`` (then ``, K anchored checkpoints`` with ``--anchor``, and
    ``; U records after the last checkpoint …`` for the tail a crash left,
    at most ``--max-unsigned``, default :data:`DEFAULT_EVERY` + :data:`WRITER_RACE`); exit 1
    ``audit: BROKEN at record <seq>: <reason>`` (a record edited, deleted,
    reordered, rewritten or cut off, a forged checkpoint, more unsigned records
    than a crash leaves). ``show [--state-dir D] [--since SEQ] [--json]``
    prints records with ``seq`` >= SEQ (one JSON object per line with
    ``--json``). ``keygen PATH`` writes a new key file (0600; never over an
    existing one) for ``--audit-key-file``. Exit 2: no state, no key, an
    unreadable anchor, both ``ATP_AUDIT_KEY`` and ``--key-file``."""
    args = _audit_parser(default_state_dir).parse_args(argv)
    if args.cmd == "keygen":
        return _keygen(args.path)
    try:
        store = _open_store(args)
    except (StoreError, ValueError) as e:
        print(f"audit: {e}", file=sys.stderr)
        return 2
    with store:
        if args.cmd == "show":
            _show(store, since=args.since, as_json=args.json)
            return 0
        # Everything written outside the table first: a live writer appends a record before its checkpoints.
        try:
            key = load_audit_key(args.state_dir, create=False, key_file=args.key_file)
            anchored, torn = _read_anchors(args.anchor)
            head_file = read_head_file(args.state_dir / "audit.head")
        except AuditError as e:
            print(f"audit: {e}", file=sys.stderr)
            return 2
        table_cps = store.audit_checkpoints()
        records = store.audit_records()  # one read: one snapshot of the table
        seen = {(cp.seq, cp.hash, cp.mac) for cp in table_cps}
        late = [cp for cp in store.audit_checkpoints() if (cp.seq, cp.hash, cp.mac) not in seen]
    if table_cps and head_file is None:
        print(f"audit: BROKEN at record {table_cps[-1].seq}: audit.head is missing but the store has a checkpoint")
        return 1
    for path in torn:
        print(f"audit: note: the last line of {path} is cut short (a crash while appending): left out",
              file=sys.stderr)
    report = verify(records, [*table_cps, *([head_file] if head_file is not None else [])], key,
                    anchored=anchored, max_unsigned=args.max_unsigned, late=late)
    if not report.ok:
        print(f"audit: BROKEN at record {report.first_bad_seq}: {report.reason}")
        return 1
    print(_verified_line(report, anchors=bool(args.anchor), max_unsigned=args.max_unsigned))
    return 0


def _open_store(args: argparse.Namespace) -> Store:
    """The store ``audit`` reads: the state directory's SQLite store, or with
    ``--store URL`` the shared one several routers write (``--store-namespace``)."""
    if args.store in (None, "sqlite"):
        return SqliteStore.open(args.state_dir, create=False)
    if args.store.split("://", 1)[0].lower() not in ("redis", "rediss", "unix"):
        raise ValueError(f"--store {args.store!r}: give sqlite or a redis://, rediss:// or unix:// URL")
    return _stores.RedisStore.open(args.store, namespace=args.store_namespace)  # redis-py imported here


def _audit_parser(default_state_dir: Path | None) -> argparse.ArgumentParser:
    """:func:`audit_main`'s command line (``verify``, ``show``, ``keygen``)."""
    ap = argparse.ArgumentParser(prog="atp-router audit", description="Check or print the audit log (spec §11).",
                                 formatter_class=DefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    state_help = "the router's state directory" + (f" (default: {default_state_dir})" if default_state_dir else "")

    def state_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-dir", type=Path, required=default_state_dir is None, default=default_state_dir,
                       metavar="DIR", help=state_help)
        p.add_argument("--store", metavar="URL",
                       help="the shared store of routers run with --store (redis://…): its chain is read there, "
                            "audit.head and the key from DIR (one router's state directory)")
        p.add_argument("--store-namespace", default="atp", metavar="NS", help="the routers' --store-namespace")

    v = sub.add_parser("verify", help="check the hash chain and its MACed checkpoints",
                       formatter_class=DefaultsHelpFormatter)
    state_arg(v)
    v.add_argument("--anchor", type=Path, action="append", default=[], metavar="FILE",
                   help="a file of checkpoints written outside the state directory (the router's --audit-anchor, "
                        "or its --audit-syslog lines); every one must match the chain; repeatable")
    v.add_argument("--key-file", type=Path, metavar="PATH",
                   help="the MAC key's file (the router's --audit-key-file); default: ATP_AUDIT_KEY, else "
                        "DIR/audit.key")
    v.add_argument("--max-unsigned", type=int, default=DEFAULT_EVERY + WRITER_RACE, metavar="N",
                   help="records after the newest checkpoint accepted as the tail of a crash (the writer's "
                        "checkpoint cadence)")
    s = sub.add_parser("show", help="print audit records", formatter_class=DefaultsHelpFormatter)
    state_arg(s)
    s.add_argument("--since", type=int, default=1, metavar="SEQ", help="first record to print (default 1)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    k = sub.add_parser("keygen", help="write a new audit key file (0600) for --audit-key-file",
                       formatter_class=DefaultsHelpFormatter)
    k.add_argument("path", type=Path)
    return ap


def _read_anchors(paths: list[Path]) -> tuple[list[AuditCheckpoint], list[str]]:
    """Every checkpoint of the anchor files ``paths`` (:func:`read_anchor`, which
    raises AuditError), and the files whose last line was cut short."""
    anchored: list[AuditCheckpoint] = []
    torn: list[str] = []
    for path in paths:
        cps, cut = read_anchor(path)
        anchored += cps
        if cut:
            torn.append(str(path))
    return anchored, torn


def _keygen(path: Path) -> int:
    """``audit keygen PATH``: write a new key file; the exit status."""
    try:
        write_new_key(path)
    except OSError as e:
        print(f"audit: {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"audit: new key in {path} (mode 600): give it to the router with --audit-key-file {path}")
    return 0


def _show(store: Store, *, since: int, as_json: bool) -> None:
    """``audit show``: print ``store``'s records from ``seq`` ``since`` on, one
    line each (a JSON object with ``as_json``)."""
    for r in store.audit_records(after=max(since, 1) - 1):
        if as_json:
            print(json.dumps({"seq": r.seq, "ts_ms": r.ts_ms, "kind": r.kind, "actor": r.actor,
                              "tenant": r.tenant, "detail": r.detail, "prev": r.prev, "hash": r.hash},
                             ensure_ascii=False))
        else:
            print(f"{r.seq:>6} {_fmt_ts(r.ts_ms)} {r.kind:<14} actor={r.actor} tenant={r.tenant or '-'} "
                  f"{json.dumps(r.detail, ensure_ascii=False, sort_keys=True)}")


def _verified_line(report: VerifyReport, *, anchors: bool, max_unsigned: int) -> str:
    """``audit verify``'s line for an intact log (``anchors``: ``--anchor`` given)."""
    line = f"audit: OK, {report.records} records, head {report.head[:12]}"
    if anchors:
        line += f", {report.anchored} anchored checkpoints"
    if report.unsigned:
        line += (f"; {report.unsigned} records after the last checkpoint (record {report.signed}): the tail a crash "
                 f"leaves unsigned (at most {max_unsigned}); removed or rewritten records there cannot be "
                 "told apart")
    return line
