"""Data scope (spec §11): detectors, redaction or refusal per agent,
and the one scrubber every adapter error path and log record goes through.

Sans-IO: no I/O and no clock; the detectors are pure CPU work, safe to run in a worker
thread (``trio.to_thread.run_sync(guard.inspect, content, labels)``) so that a large
task does not hold the event loop.

Labels: their grammar (``category[:redact|forbidden]``, the detector-covered
categories ``secrets`` and personal data, every other label *opaque*) and an
agent's clearance are :mod:`atp_router.policy.labels`' (:func:`~atp_router.policy.labels.parse_label`,
:func:`~atp_router.policy.labels.clearance_of`).

Decisions (:meth:`DataScopeGuard.for_agent`), for a task's labels and one agent:

* every label cleared → :class:`Pass` (content unchanged);
* an opaque label not cleared → :class:`Refused` ``ESEC`` (the FIB normally
  excluded such an agent already; this is the fail-closed backstop);
* the content was larger than the scan bound and a covered label is not cleared
  → :class:`Refused` ``ESEC`` (unchecked content never reaches it);
* a ``forbidden`` category not cleared *and detected* → :class:`Refused` ``ESEC``;
* ``redact`` categories not cleared and detected → :class:`Redacted`: each value is
  replaced by ``[REDACTED:<detector type>]``, the rest of its line kept, line count
  and content shape unchanged (a diff still parses); else :class:`Pass`.

Detectors: secrets with Yelp's detect-secrets plugins called in-process (every
plugin but the public-IP one: AWS keys, private keys — the whole PEM/PGP block is
masked, not just its BEGIN line —, JWTs, GitHub/GitLab/Slack/Stripe/... tokens, basic
auth in URLs, ``password = "..."`` keywords, quoted high-entropy strings above
detect-secrets' own limits, base64 4.5 and hex 3.0 bits per char, with its heuristic
filters for UUIDs, sequences, templates and ids). Personal data: phone numbers with
``phonenumbers`` (Google's libphonenumber metadata, leniency VALID) and e-mail
addresses validated with ``email-validator`` (syntax only, no DNS). Names, postal
addresses, national ids and card numbers are not detected.

Scrubbing (:func:`scrub`): registered Agent Context secrets and given secrets become
:data:`REDACTED`, detect-secrets hits ``[REDACTED:<type>]``, and the text is cut to a
bound (:data:`MAX_SCRUB_CHARS` for error reasons).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from atp_router.policy.labels import (
    FORBIDDEN,
    PII,
    REDACT,
    SECRETS,
    Mode,
    ScopeLabel,
    clearance_of,
    parse_label,
)
from atp_router.security import normalise
from atp_router.wire.errors import ATPError, ErrorCode

__all__ = [
    "CONTEXT_PUBLIC",
    "MAX_KNOWN_SECRETS",
    "MAX_META_SCAN_CHARS",
    "MAX_SCAN_CHARS",
    "MAX_SCRUB_CHARS",
    "MIN_SECRET_LEN",
    "REDACTED",
    "UNSCANNED",
    "DataScopeGuard",
    "Pass",
    "Redacted",
    "Redaction",
    "Refused",
    "ScopeDecision",
    "ScopeScan",
    "known_secrets",
    "redact_context_message",
    "redact_meta",
    "register_secrets",
    "scrub",
    "scrub_error",
]

#: What a registered or given secret is replaced with (a detected one: ``[REDACTED:<type>]``).
REDACTED = "[REDACTED]"
#: Shortest value treated as a registered secret (characters).
MIN_SECRET_LEN = 4
#: How many distinct secrets the process-wide set remembers (oldest dropped first).
MAX_KNOWN_SECRETS = 4096
#: Default bound of :func:`scrub` (characters; error reasons sent to clients).
MAX_SCRUB_CHARS = 2048
#: Default bound of :meth:`DataScopeGuard.inspect` (characters of all strings of a task;
#: detect-secrets costs about 1 µs per character of code on one core).
MAX_SCAN_CHARS = 4 * 1024 * 1024

def _cleared(label: ScopeLabel, clearance: frozenset[str] | None) -> bool:
    if clearance is None:
        return label.detector is None
    if label.category in clearance:
        return True
    return label.detector == "personal_data" and PII in clearance


# ---------------------------------------------------------------------- decisions
@dataclass(frozen=True, slots=True)
class Redaction:
    """One masked value, for the audit log: its ``category``, the ``detector`` type
    (detect-secrets' ``secret_type`` such as ``"AWS Access Key"``, or ``"Phone
    Number"`` / ``"Email Address"``), the string's ``path`` in the content
    (``diff``, ``files["a.py"]``, ``notes[2]``) and the 1-based ``line`` in it.
    Never the value itself."""

    category: str
    detector: str
    path: str
    line: int


@dataclass(frozen=True, slots=True)
class Pass:
    """Send ``content`` (the task's own object) as it is."""

    content: Any


@dataclass(frozen=True, slots=True)
class Redacted:
    """Send ``content`` (a copy of the task's, same shape) in place of the task's;
    ``redactions`` lists what was masked, in content order."""

    content: Any
    redactions: list[Redaction]


@dataclass(frozen=True, slots=True)
class Refused:
    """Do not send: answer ``code`` (ESEC, spec §10: RST, audit) with ``reason``
    (no secret in it); ``label`` is the label refused, ``findings`` where its data
    was found (empty when nothing was detected: an opaque label or unchecked
    content)."""

    reason: str
    label: str
    findings: list[Redaction] = field(default_factory=list)
    code: ErrorCode = ErrorCode.ESEC


ScopeDecision = Pass | Redacted | Refused


@dataclass(frozen=True, slots=True)
class _Hit:
    category: str  # "secrets" or a personal-data category
    detector: str
    path: tuple[str | int, ...]
    line: int  # 0-based
    value: str = field(repr=False)
    #: ``[start, end)`` columns in the line (a detection in a normalised view,
    #: mapped back); None: every occurrence of ``value`` in the line.
    span: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ScopeScan:
    """What :meth:`DataScopeGuard.inspect` found in one task: the ``content`` it
    scanned, its parsed ``labels``, and whether the scan was ``complete`` (False
    when the task's strings exceeded the guard's ``max_scan_chars``:
    ``scanned_chars`` of them were read). Holds the detected values: never log it."""

    content: Any = field(repr=False)
    labels: tuple[ScopeLabel, ...]
    complete: bool
    scanned_chars: int
    hits: tuple[_Hit, ...] = field(repr=False, default=())

    def categories(self) -> frozenset[str]:
        """The categories detected in the content."""
        return frozenset(h.category for h in self.hits)


# ---------------------------------------------------------------------- detectors
class _Secrets:
    """detect-secrets' plugins, called through their pure ``analyze_string`` (no
    global settings, no verification requests), with the entropy limits and the
    heuristic filters detect-secrets applies itself."""

    _SKIP = frozenset({"IPPublicDetector"})  # public IPs are not secrets
    _KEYWORD_HINTS = ("key", "pass", "pwd", "secret", "contrase")
    _PEM_BODY = re.compile(r"[A-Za-z0-9+/=]{16,}")

    def __init__(self) -> None:
        from detect_secrets.core.plugins.util import (
            get_mapping_from_secret_type_to_class,
        )
        from detect_secrets.filters import heuristic
        from detect_secrets.plugins import keyword
        from detect_secrets.plugins.high_entropy_strings import HighEntropyStringsPlugin
        from detect_secrets.util.filetype import determine_file_type

        classes = sorted(get_mapping_from_secret_type_to_class().values(), key=lambda c: c.__name__)
        plugins = [c() for c in classes if c.__name__ not in self._SKIP]
        self._entropy = [p for p in plugins if isinstance(p, HighEntropyStringsPlugin)]
        self._keyword = next(p for p in plugins if isinstance(p, keyword.KeywordDetector))
        self._regex = [p for p in plugins if p is not self._keyword and p not in self._entropy]
        self._keyword_regex = keyword.REGEX_BY_FILETYPE
        self._keyword_default = keyword.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP
        self._filetype = determine_file_type
        self._h = heuristic
        #: detect-secrets' base64 entropy plugin (its limit, 4.5 bits a character,
        #: also judges bare tokens in comments and prose).
        self.base64_plugin = next(p for p in self._entropy if "Base64" in p.secret_type)

    def noise(self, value: str, line: str, plugin: Any) -> bool:
        """detect-secrets' heuristic filters: ``value`` is not a secret (a UUID,
        a sequence, a template, an id, ``$VAR``, punctuation)."""
        h = self._h
        return (not value or h.is_sequential_string(value) or h.is_potential_uuid(value)
                or h.is_likely_id_string(value, line, plugin) or h.is_templated_secret(value)
                or h.is_prefixed_with_dollar_sign(value) or h.is_not_alphanumeric_string(value))  # fmt: skip

    def line(self, line: str, filename: str = "") -> list[tuple[str, str]]:
        """``(type, value)`` of every secret in one line, deduplicated, sorted."""
        found: set[tuple[str, str]] = set()
        for p in self._regex:
            for v in p.analyze_string(line):
                if v:
                    found.add((p.secret_type, self._extend(p.secret_type, v, line)))
        for p in self._entropy:
            for v in p.analyze_string(line):
                if p.calculate_shannon_entropy(v) > p.entropy_limit and not self.noise(v, line, p):
                    found.add((p.secret_type, v))
        low = line.lower()
        if any(k in low for k in self._KEYWORD_HINTS) and not self._h.is_indirect_reference(line):
            regexes = self._keyword_regex.get(self._filetype(filename or "x"), self._keyword_default)
            for v in self._keyword.analyze_string(line, denylist_regex_to_group=regexes):
                if not self.noise(v, line, self._keyword):
                    found.add((self._keyword.secret_type, v))
        return sorted(found)

    @staticmethod
    def _extend(kind: str, value: str, line: str) -> str:
        # detect-secrets' JWT pattern stops before the signature: mask the whole token.
        if kind == "JSON Web Token" and value.endswith("."):
            i = line.find(value)
            if i >= 0:
                m = re.match(r"[A-Za-z0-9_-]*", line[i + len(value):])
                return value + (m.group(0) if m else "")
        return value

    def pem_body(self, line: str) -> list[str]:
        """The base64 runs of a line inside a private-key block."""
        return self._PEM_BODY.findall(line)


_PEM_BEGIN = re.compile(r"BEGIN [A-Z0-9 ]*PRIVATE KEY|PuTTY-User-Key-File-\d")
_PEM_END = re.compile(r"END [A-Z0-9 ]*PRIVATE KEY")
_MAX_PEM_LINES = 200


class _PersonalData:
    """Phone numbers (phonenumbers, leniency VALID) and e-mail addresses
    (email-validator, syntax only)."""

    _DIGITS = re.compile(r"(?:\d[^\d\n]{0,3}){6}\d")  # ≥ 7 digits close together: maybe a phone
    _EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")

    def __init__(self) -> None:
        import email_validator
        import phonenumbers

        self._pn = phonenumbers
        self._email = email_validator

    def line(self, line: str, region: str | None) -> list[tuple[str, str]]:
        found: set[tuple[str, str]] = set()
        if self._DIGITS.search(line):
            for m in self._pn.PhoneNumberMatcher(line, region, leniency=self._pn.Leniency.VALID):
                found.add(("Phone Number", m.raw_string))
        if "@" in line:
            for m in self._EMAIL.finditer(line):
                try:
                    self._email.validate_email(m.group(0), check_deliverability=False)
                except self._email.EmailNotValidError:
                    continue
                found.add(("Email Address", m.group(0)))
        return sorted(found)


@functools.cache
def _secrets() -> _Secrets:
    return _Secrets()


def warm() -> None:
    """Build the detectors (detect-secrets' plugins and what they import, the
    personal-data validators) now: blocking, for a worker thread at start-up, so
    the first task that needs them — often a refusal whose reason is scrubbed on
    the event loop — does not pay for the imports there (issue 20: a 1.3 s step)."""
    _secrets().line("warm = 'up'")
    _personal()
    scrub("warm-up")


@functools.cache
def _personal() -> _PersonalData:
    return _PersonalData()


# ---------------------------------------------------------------------- detectors of the normalised pass
#: Files whose every line is prose (scanned for bare high-entropy tokens, as the
#: comments of code are).
_PROSE_EXT = (".md", ".markdown", ".txt", ".rst", ".adoc", ".log", ".env")
#: Where a comment starts: a line that opens with a comment marker, or a marker
#: after code with blanks around it.
_COMMENT = re.compile(r"^\s*(?:#|//|/\*|\*|--|;|%|<!--|REM\s)|[ \t](?:#|//|--)(?:[ \t]|$)")
_BARE = re.compile(r"[A-Za-z0-9+/=_-]{20,}")
_B64_RUN = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")
_HEX = re.compile(r"[0-9A-Fa-f]+")
_ESCAPED_BREAK = re.compile(r"\\[nrt]")
_CHAIN_GAP = re.compile(r"""[\s"'`,;+#*()\[\]<>|.]*""")
_WRAPPED = re.compile(r"[A-Za-z0-9+/_-]{20,}={0,2}")
_PRINTABLE = re.compile(r"[\x20-\x7e\t\r\n]+")
_AUTH = re.compile(r"\b(Basic|Bearer)[ \t]+([A-Za-z0-9._~+/-]{16,}=*)")
_JWK_PRIVATE = re.compile(r'"(?:d|p|q|dp|dq|qi|k)"\s*:\s*"([A-Za-z0-9_-]{16,}={0,2})"')
#: Characters of a key block (base64 or hex) decoded to recognise it: enough for
#: an RSA 8192 key; a longer run is judged by its start.
_MAX_BLOCK_CHARS = 16384
#: Longest base64 token decoded to look for a wrapped secret.
_MAX_WRAPPED_CHARS = 8192
_CHAIN_MAX_GAP = 24
#: Shortest run of base64 (or hex) characters recognised as a key body: an
#: Ed25519 PKCS #8 key is 64 base64 characters.
_MIN_BLOCK_CHARS = 60
#: DER object identifiers that open an EncryptedPrivateKeyInfo (PBES2, PKCS #12 PBE).
_ENCRYPTED_KEY_OIDS = (bytes.fromhex("06092a864886f70d01050d"), bytes.fromhex("060a2a864886f70d010c01"))
_PGP_ALGORITHMS = frozenset({1, 2, 3, 16, 17, 18, 19, 22, 25, 27})


def _der_body(data: bytes) -> int | None:
    """Offset of the first element inside a DER SEQUENCE at ``data[0]``."""
    if len(data) < 4 or data[0] != 0x30:
        return None
    n = data[1]
    if n < 0x80:
        return 2
    return 2 + (n & 0x7F) if 0x81 <= n <= 0x83 else None


def _pgp_secret_key(data: bytes) -> bool:
    """An OpenPGP secret-key packet (tag 5, RFC 4880 §5.5.3), version 4–6, with
    a known public-key algorithm."""
    if len(data) < 12:
        return False
    tag = data[0]
    if tag in (0x94, 0x95, 0x96):  # old format, tag 5, 1-, 2- or 4-octet length
        i = 1 + (1, 2, 4)[tag - 0x94]
    elif tag == 0xC5:  # new format
        i = 2 if data[1] < 192 else 3 if data[1] < 224 else 6 if data[1] == 255 else 0
        if not i:
            return False
    else:
        return False
    return len(data) > i + 5 and data[i] in (4, 5, 6) and data[i + 5] in _PGP_ALGORITHMS


def _private_key_bytes(data: bytes) -> bool:
    """Do ``data`` hold a private key? A whole DER key that ``cryptography``
    loads (an encrypted one included); else the start of one: a DER SEQUENCE
    whose first element is the version INTEGER 0 or 1 followed by an INTEGER,
    SEQUENCE or OCTET STRING (PKCS #1 RSA, DSA, PKCS #8, SEC 1 EC), an
    EncryptedPrivateKeyInfo, an OpenSSH private key, an OpenPGP secret key.
    Certificates and public keys have none of these shapes."""
    if data.startswith(b"openssh-key-v1\0") or _pgp_secret_key(data):
        return True
    i = _der_body(data)
    if i is None:
        return False
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_der_private_key

    try:
        load_der_private_key(data, password=None)
        return True
    except TypeError:  # encrypted: a private key all the same
        return True
    except (ValueError, UnsupportedAlgorithm):
        pass
    if data[i:i + 3] in (b"\x02\x01\x00", b"\x02\x01\x01") and len(data) > i + 3 and data[i + 3] in (0x02, 0x30, 0x04):
        return True
    head = data[i:i + 24]
    return any(oid in head for oid in _ENCRYPTED_KEY_OIDS)


def _decode_block(text: str) -> bytes | None:
    text = text[:_MAX_BLOCK_CHARS]
    if len(text) % 2 == 0 and _HEX.fullmatch(text):
        return bytes.fromhex(text)
    raw = text.replace("=", "")
    raw = raw[: len(raw) // 4 * 4]
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return None


def _key_blocks(text: str) -> list[tuple[int, int]]:
    """Spans of the base64 or hex runs of ``text`` that together are a private
    key body without its armour (no BEGIN/END lines): runs joined across line
    breaks, ``\\n`` escapes, quotes, commas, ``+`` and comment markers, decoded
    and recognised by :func:`_private_key_bytes`."""
    flat = _ESCAPED_BREAK.sub("  ", text)  # same length: offsets hold
    out: list[tuple[int, int]] = []
    chain: list[tuple[int, int]] = []

    def close() -> None:
        for k in range(min(3, len(chain))):  # the first runs may be a name before the key
            runs = chain[k:]
            if sum(e - s for s, e in runs) < _MIN_BLOCK_CHARS:
                break
            joined, size = [], 0
            for s, e in runs:
                joined.append(flat[s:e])
                size += e - s
                if size >= _MAX_BLOCK_CHARS:
                    break
            data = _decode_block("".join(joined))
            if data is not None and _private_key_bytes(data):
                out.extend(runs)
                return

    for m in _B64_RUN.finditer(flat):
        s, e = m.span()
        if chain and (s - chain[-1][1] > _CHAIN_MAX_GAP or not _CHAIN_GAP.fullmatch(flat, chain[-1][1], s)):
            close()
            chain = []
        chain.append((s, e))
    close()
    return out


_UPPER, _LOWER, _DIGIT = re.compile("[A-Z]"), re.compile("[a-z]"), re.compile("[0-9]")


def _classes(token: str) -> int:
    """How many of upper case, lower case and digits ``token`` mixes."""
    return (_UPPER.search(token) is not None) + (_LOWER.search(token) is not None) + (_DIGIT.search(token) is not None)


def _bare_tokens(line: str, start: int) -> list[tuple[str, int, int]]:
    """High-entropy tokens of ``line[start:]`` (comments, prose) that are not
    quoted: upper case, lower case and digits mixed, above detect-secrets'
    base64 entropy limit (4.5 bits a character), not filtered by its
    heuristics (UUIDs, sequences, templates, ids)."""
    sec = _secrets()
    plugin = sec.base64_plugin
    out = []
    for m in _BARE.finditer(line, start):
        tok = m.group(0)
        lead = len(tok) - len(tok.lstrip("=_-/+"))
        tok = tok.strip("=_-/+")
        if len(tok) < 20 or _classes(tok) < 3:
            continue
        if plugin.calculate_shannon_entropy(tok) <= plugin.entropy_limit or sec.noise(tok, line, plugin):
            continue
        out.append(("High Entropy String", m.start() + lead, m.start() + lead + len(tok)))
    return out


def _wrapped_secrets(text: str) -> list[tuple[str, int, int]]:
    """Base64 (standard or URL-safe) tokens that decode to printable text in
    which the detectors find a secret."""
    sec = _secrets()
    out = []
    for m in _WRAPPED.finditer(text):
        tok = m.group(0)
        raw = tok.rstrip("=")
        if len(raw) > _MAX_WRAPPED_CHARS or len(raw) % 4 == 1:
            continue
        url_safe = "-" in raw or "_" in raw
        if url_safe and ("+" in raw or "/" in raw):
            continue
        try:
            data = base64.b64decode(raw + "=" * (-len(raw) % 4), altchars=b"-_" if url_safe else None, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(data) < 15 or not data.isascii():
            continue
        plain = data.decode("ascii")
        if not _PRINTABLE.fullmatch(plain):
            continue
        kinds = sorted({k for ln in plain.splitlines()[:64] for k, _ in sec.line(ln)})
        if not kinds and _COMMENT.search(plain) is None and "\n" not in plain:
            kinds = sorted({k for k, _, _ in _bare_tokens(plain, 0)})
        if kinds:
            out.append((f"Base64-encoded {kinds[0]}", m.start(), m.end()))
    return out


def _auth_headers(text: str) -> list[tuple[str, int, int]]:
    """HTTP credentials (RFC 7617 Basic: base64 of ``user:password``; RFC 6750
    Bearer tokens of mixed characters)."""
    sec = _secrets()
    out = []
    for m in _AUTH.finditer(text):
        scheme, tok = m.group(1), m.group(2)
        if scheme == "Basic":
            data = _decode_block(tok.rstrip("=")) if len(tok) % 4 != 1 else None
            if data is not None and data.isascii() and b":" in data and _PRINTABLE.fullmatch(data.decode("ascii")):
                out.append(("Basic Auth Credentials", m.start(2), m.end(2)))
        elif len(tok) >= 20 and _classes(tok) >= 2 and not sec.noise(tok, "", None):
            out.append(("Bearer Token", m.start(2), m.end(2)))
    return out


def _jwk_private(text: str) -> list[tuple[str, int, int]]:
    """The private members of a JSON Web Key (RFC 7518 §6: ``d``, ``p``, ``q``,
    ``dp``, ``dq``, ``qi``; ``k`` of a symmetric key)."""
    if '"kty"' not in text:
        return []
    return [("JSON Web Key", m.start(1), m.end(1)) for m in _JWK_PRIVATE.finditer(text)]


def _line_spans(text: str) -> tuple[list[int], list[int]]:
    """Start offset and length without its line break of each line of
    ``text``, as ``str.splitlines`` cuts them."""
    starts, lengths, pos = [], [], 0
    for line in text.splitlines(keepends=True):
        starts.append(pos)
        body = line.splitlines()
        lengths.append(len(body[0]) if body else 0)
        pos += len(line)
    return starts, lengths


_PIECE_GAP = re.compile(r"""[\s"'`\\+.,;&|~<>()\[\]{}]""")


_DIFF_FILE = re.compile(r"^\+\+\+ (?:b/)?(\S+)")


def _strings(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string leaf of a content object with its path (mapping keys are not
    scanned: they are file paths and field names)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, (*path, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, (*path, i))


def _render(path: tuple[str | int, ...]) -> str:
    """``("files", "a.py")`` → ``files["a.py"]``; ``("notes", 2)`` → ``notes[2]``."""
    if not path:
        return "content"
    head, *rest = path
    out = str(head) if isinstance(head, str) else f"content[{head}]"
    for p in rest:
        out += f"[{p}]" if isinstance(p, int) else f"[{json.dumps(p, ensure_ascii=False)}]"
    return out


# ---------------------------------------------------------------------- the guard
def _span_hits(text: str, found: list[tuple[str, normalise.View, int, int]], starts: list[int], lengths: list[int],
               is_diff: bool, path: tuple[str | int, ...], hits: list[_Hit]) -> None:
    """Map each detection in ``found`` (kind, the view it was found in, its start
    and end in that view's text) back onto ``text``, whose lines start at
    ``starts`` with ``lengths``: pieces separated only by invisible characters
    join into one span, and each line the span crosses gets a :data:`SECRETS`
    hit in ``hits`` (a diff line's ``+``/``-``/space prefix left out)."""
    for kind, view, s, e in found:
        pieces = view.pieces(s, e)
        merged = [pieces[0]]
        for ps, pe in pieces[1:]:
            gap = text[merged[-1][1]:ps]
            if _PIECE_GAP.search(gap) is None:  # only invisible characters between: one span
                merged[-1] = (merged[-1][0], pe)
            else:
                merged.append((ps, pe))
        for ps, pe in merged:
            n = bisect.bisect_right(starts, ps) - 1
            while n < len(starts) and starts[n] < pe:
                lo = starts[n] + (1 if is_diff and text[starts[n]:starts[n] + 1] in ("+", "-", " ") else 0)
                cs, ce = max(ps, lo), min(pe, starts[n] + lengths[n])
                if ce > cs:
                    hits.append(_Hit(SECRETS, kind, path, n, text[cs:ce], (cs - starts[n], ce - starts[n])))
                n += 1


class DataScopeGuard:
    """Data-scope enforcement at dispatch (spec §11; see the module docstring).

    ``max_scan_chars`` bounds the characters of one task scanned (default
    :data:`MAX_SCAN_CHARS`); ``max_line_chars`` the length of one scanned line
    (longer lines are scanned in overlapping windows of that size). Thread-safe and
    stateless between tasks: one guard serves the whole router.

    ``normalise`` (default True) adds the normalised pass for secrets (issue 19):
    the detectors also run over :mod:`atp_router.security.normalise`'s views of each
    string (escapes decoded, NFKC, invisible characters dropped, confusables
    folded, adjacent literals joined), and four detectors run over the last
    view: private-key bodies without their armour (:func:`_key_blocks`), bare
    high-entropy tokens in comments and prose (:func:`_bare_tokens`; prose: a
    task string outside ``diff``/``files`` or a ``.md``/``.txt``/``.rst``/
    ``.log``/``.env`` file), base64-wrapped secrets and HTTP Basic/Bearer
    credentials, JSON Web Key private members. Each detection is mapped back to
    the characters that produced it (:meth:`atp_router.security.normalise.View.pieces`)
    and those are masked. False: the detectors on the text as written only (the
    scan before issue 19, which ``bench/bench_redact.py`` compares against)."""

    def __init__(self, *, max_scan_chars: int = MAX_SCAN_CHARS, max_line_chars: int = 4096,
                 normalise: bool = True) -> None:  # fmt: skip
        if max_scan_chars < 0 or max_line_chars < 256:
            raise ValueError("max_scan_chars must be >= 0 and max_line_chars >= 256")
        self.max_scan_chars = max_scan_chars
        self.max_line_chars = max_line_chars
        self.normalise = normalise

    def inspect(self, content: Any, labels: frozenset[str]) -> ScopeScan:
        """Run the detectors the ``labels`` call for, once, over every string of the
        task ``content`` (``{"diff": str, "files": {path: text}, ...}``); labels of
        no detector (opaque) cost nothing. Raises nothing for any JSON-like content.
        CPU-bound (about 1 µs per character when secrets are asked for): call it
        off the event loop for large tasks."""
        parsed = tuple(sorted((parse_label(s) for s in labels), key=lambda lb: lb.label))
        want_secrets = any(lb.detector == "secrets" for lb in parsed)
        regions = {lb.category: lb.region for lb in parsed if lb.detector == "personal_data"}
        if not want_secrets and not regions:
            return ScopeScan(content, parsed, True, 0)
        budget = self.max_scan_chars
        hits: list[_Hit] = []
        cache: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
        scanned, complete = 0, True
        for path, text in _strings(content):
            if scanned + len(text) > budget:
                complete = False
                break
            scanned += len(text)
            filename = path[-1] if len(path) >= 2 and path[0] == "files" and isinstance(path[-1], str) else ""
            is_diff = path == ("diff",)
            pem = 0  # lines left in an open private-key block
            file_lines: list[int] = [0]  # where each file of a diff starts (line numbers)
            file_names = [filename]
            for n, line in enumerate(text.splitlines()):
                if is_diff:
                    m = _DIFF_FILE.match(line)
                    if m:
                        filename = m.group(1)
                        file_lines.append(n)
                        file_names.append(filename)
                body = line[1:] if is_diff and line[:1] in ("+", "-", " ") else line
                key = (body, filename)
                found = cache.get(key)
                if found is None:
                    found = cache[key] = self._line(body, filename, want_secrets, regions)
                for cat, kind, value in found:
                    hits.append(_Hit(cat, kind, path, n, value))
                if want_secrets:
                    pem = self._pem(body, path, n, pem, hits)
            if want_secrets and self.normalise and text:
                self._normalised(text, path, is_diff, file_lines, file_names, cache, regions, hits)
        return ScopeScan(content, parsed, complete, scanned, tuple(hits))

    def _normalised(self, text: str, path: tuple[str | int, ...], is_diff: bool, file_lines: list[int],
                    file_names: list[str], cache: dict[tuple[str, str], list[tuple[str, str, str]]],
                    regions: Mapping[str, str | None], hits: list[_Hit]) -> None:  # fmt: skip
        """The normalised pass over one string (see the class docstring): adds a
        span hit for every piece of ``text`` that produced a detection in a view."""
        starts, lengths = _line_spans(text)

        def name_at(offset: int) -> str:
            n = bisect.bisect_right(starts, offset) - 1
            return file_names[bisect.bisect_right(file_lines, n) - 1]

        python = not is_diff and file_names[0].endswith((".py", ".pyi"))
        views = normalise.views(text, diff=is_diff, python=python)
        found: list[tuple[str, normalise.View, int, int]] = []
        for view in views:  # the detect-secrets plugins over each changed view, line by line
            vtext, pos, pem = view.text, 0, 0
            for line in vtext.splitlines(keepends=True):
                body = line.rstrip("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
                if body.strip():
                    filename = name_at(view.pieces(pos, pos + 1)[0][0]) if is_diff else file_names[0]
                    key = (body, filename)
                    got = cache.get(key)
                    if got is None:
                        got = cache[key] = self._line(body, filename, True, regions)
                    values = {(kind, v) for cat, kind, v in got if cat == SECRETS}
                    pem_hits: list[_Hit] = []
                    pem = self._pem(body, (), 0, pem, pem_hits)
                    values.update(("Private Key", h.value) for h in pem_hits)
                    for kind, v in values:
                        i = body.find(v)
                        while i >= 0 and v:
                            found.append((kind, view, pos + i, pos + i + len(v)))
                            i = body.find(v, i + len(v))
                pos += len(line)
        last = views[-1] if views else normalise.View(text)
        if not views and is_diff:
            last = normalise.diff_bodies(last)
        vtext = last.text
        prose = path[:1] not in (("diff",), ("files",)) or file_names[0].lower().endswith(_PROSE_EXT)
        for s, e in _key_blocks(vtext):
            found.append(("Private Key", last, s, e))
        for kind, s, e in (*_wrapped_secrets(vtext), *_auth_headers(vtext), *_jwk_private(vtext)):
            found.append((kind, last, s, e))
        pos = 0
        for line in vtext.splitlines(keepends=True):
            if prose or (is_diff and name_at(last.pieces(pos, pos + 1)[0][0]).lower().endswith(_PROSE_EXT)):
                at = 0
            else:
                c = _COMMENT.search(line)
                at = c.end() if c is not None else -1
            if at >= 0:
                for kind, s, e in _bare_tokens(line, at):
                    found.append((kind, last, pos + s, pos + e))
            pos += len(line)
        _span_hits(text, found, starts, lengths, is_diff, path, hits)

    def _line(self, line: str, filename: str, want_secrets: bool,
              regions: Mapping[str, str | None]) -> list[tuple[str, str, str]]:  # fmt: skip
        out: list[tuple[str, str, str]] = []
        windows = [line]
        if len(line) > self.max_line_chars:
            step = self.max_line_chars - 256
            windows = [line[i : i + self.max_line_chars] for i in range(0, len(line), step)]
        for w in windows:
            if want_secrets:
                out.extend((SECRETS, kind, v) for kind, v in _secrets().line(w, filename))
            for category, region in regions.items():
                out.extend((category, kind, v) for kind, v in _personal().line(w, region))
        return sorted(set(out))

    @staticmethod
    def _pem(body: str, path: tuple[str | int, ...], n: int, open_lines: int, hits: list[_Hit]) -> int:
        """Mask the body of a private-key block (detect-secrets flags its BEGIN line
        only); returns how many lines the block may still run."""
        begin = _PEM_BEGIN.search(body)
        if begin is not None:
            tail = body[begin.end():]
            end = _PEM_END.search(tail)
            for v in _secrets().pem_body(tail[: end.start()] if end else tail):
                hits.append(_Hit(SECRETS, "Private Key", path, n, v))
            return 0 if end else _MAX_PEM_LINES
        if open_lines:
            end = _PEM_END.search(body)
            for v in _secrets().pem_body(body[: end.start()] if end else body):
                hits.append(_Hit(SECRETS, "Private Key", path, n, v))
            return 0 if end else open_lines - 1
        return 0

    def for_agent(self, scan: ScopeScan, clearance: frozenset[str] | None) -> ScopeDecision:
        """The content one agent may receive (see the module docstring).
        ``clearance`` is :func:`clearance_of` the agent's RIB ``data_scope`` (None:
        the agent has none; raw labels are normalised too). Pure: call it once per
        next-hop with the same scan."""
        clearance = clearance_of(clearance)
        uncleared = [lb for lb in scan.labels if not _cleared(lb, clearance)]
        if not uncleared:
            return Pass(scan.content)
        for lb in uncleared:
            if lb.detector is None:
                return Refused(f"data_scope label {lb.label!r} has no detector and the agent is not cleared for it",
                               lb.label)
        if not scan.complete:
            lb = uncleared[0]
            return Refused(f"the task's text exceeds the data-scope scan limit of {self.max_scan_chars} characters: "
                           f"it cannot be checked for {lb.category!r}", lb.label)
        modes: dict[str, Mode] = {}
        for lb in uncleared:
            modes[lb.category] = FORBIDDEN if FORBIDDEN in (lb.mode, modes.get(lb.category)) else REDACT
        for lb in uncleared:
            if modes[lb.category] != FORBIDDEN:
                continue
            found = _redactions(h for h in scan.hits if h.category == lb.category)
            if found:
                kinds = ", ".join(sorted({r.detector for r in found}))
                places = list(dict.fromkeys(f"{r.path} line {r.line}" for r in found))
                where = ", ".join(places[:5]) + (", ..." if len(places) > 5 else "")
                return Refused(f"the task holds {lb.category} data ({kinds}: {where}) "
                               f"and data_scope says {lb.category}:forbidden for an agent not cleared for it",
                               lb.label, found)
        hits = [h for h in scan.hits if h.category in modes]
        if not hits:
            return Pass(scan.content)
        return Redacted(_apply(scan.content, hits), _redactions(hits))


def _redactions(hits: Iterable[_Hit]) -> list[Redaction]:
    seen: dict[tuple[str, str, str, int], None] = {}
    for h in hits:
        seen.setdefault((h.category, h.detector, _render(h.path), h.line + 1), None)
    return [Redaction(*k) for k in seen]


def _mask_line(line: str, values: Mapping[str, str], spans: Iterable[tuple[int, int, str]] = ()) -> str:
    """``line`` with each occurrence of a value and each ``(start, end, marker)``
    span replaced by its marker; overlapping ones are masked as one, with the
    marker of the first (longest first at one start)."""
    cuts = list(spans)
    if values:
        pattern = re.compile("|".join(re.escape(v) for v in sorted(values, key=lambda v: (-len(v), v))))
        cuts.extend((m.start(), m.end(), values[m.group(0)]) for m in pattern.finditer(line))
    if not cuts:
        return line
    cuts.sort(key=lambda c: (c[0], -c[1]))
    out, pos, end, marker = [], 0, -1, ""
    for s, e, mk in cuts:
        if s < end:
            end = max(end, e)
            continue
        if end >= 0:
            out.append(marker)
            pos = end
        out.append(line[pos:s])
        end, marker = e, mk
    out.append(marker)
    out.append(line[end:])
    return "".join(out)


def _apply(content: Any, hits: list[_Hit]) -> Any:
    by_path: dict[tuple[str | int, ...], dict[int, tuple[dict[str, str], list[tuple[int, int, str]]]]] = {}
    for h in hits:
        values, spans = by_path.setdefault(h.path, {}).setdefault(h.line, ({}, []))
        if h.span is None:
            values.setdefault(h.value, f"[REDACTED:{h.detector}]")
        else:
            spans.append((*h.span, f"[REDACTED:{h.detector}]"))

    def walk(value: Any, path: tuple[str | int, ...]) -> Any:
        if isinstance(value, str):
            lines_hit = by_path.get(path)
            if not lines_hit:
                return value
            lines = value.splitlines(keepends=True)
            for n, (values, spans) in lines_hit.items():
                lines[n] = _mask_line(lines[n], values, spans)
            return "".join(lines)
        if isinstance(value, Mapping):
            if not any(p[: len(path)] == path for p in by_path):
                return value
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if not any(p[: len(path)] == path for p in by_path):
                return value
            return [walk(v, (*path, i)) for i, v in enumerate(value)]
        return value

    return walk(content, ())


# ---------------------------------------------------------------------- Agent Context messages
#: The members of an Agent Context ``securityContext`` that are authorisation facts,
#: not secrets, and their non-secret keys (every other member is a secret).
CONTEXT_PUBLIC = {"accessControl": ("role", "permissions"),
                  "dataProtection": ("encryptionEnabled", "encryptionAlgorithm")}


def redact_context_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a raw Agent Context message (``{"agentContext": {…}}``, or the
    inner object itself) with every secret of its ``securityContext`` replaced by
    :data:`REDACTED`, keys kept; members outside :data:`CONTEXT_PUBLIC` are masked
    whole. The message's schema and its parsed Structs are
    :mod:`atp_router.adapters.context`'s (:func:`~atp_router.adapters.context.redact_context`
    takes either); this is the shape-only part that the stored meta
    (:func:`redact_meta`) and the logs need."""
    out = dict(message)
    inner = out.get("agentContext", None)
    target = out
    if isinstance(inner, Mapping):
        target = out["agentContext"] = dict(inner)
    sec = target.get("securityContext")
    if sec is None:
        return out
    if not isinstance(sec, Mapping):
        target["securityContext"] = REDACTED
        return out
    masked: dict[str, Any] = {}
    for key, value in sec.items():
        public = CONTEXT_PUBLIC.get(key)
        if public is not None and isinstance(value, Mapping):
            masked[key] = {k: (v if k in public else _mask(v)) for k, v in value.items()}
        else:
            masked[key] = _mask(value)
    target["securityContext"] = masked
    return out


def _mask(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _mask(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(v) for v in value]
    return REDACTED


# ---------------------------------------------------------------------- task meta
#: Characters of one task meta scanned by :func:`redact_meta`; strings past the
#: bound are stored as :data:`UNSCANNED`.
MAX_META_SCAN_CHARS = 4 * 1024  # labels and ids: a few hundred bytes; scanned on the event loop, so bounded
#: What :func:`redact_meta` stores in place of a string it did not scan.
UNSCANNED = "[REDACTED:unscanned]"
_META_KEY_CONTEXT = "agent_context"


#: A meta string that may hold a secret: a token of 16 or more key characters, a
#: word a keyword detector looks for, credentials in a URL, an escape, a character
#: outside ASCII. Any other string is clean without a scan (``code_review``).
_MAY_HOLD_SECRET = re.compile(r"[A-Za-z0-9+/=_.~-]{16,}|(?i:key|pass|pwd|secret|token|auth|contrase|private|bearer|basic)"
                              r"|[:@\\&%]|[^\x00-\x7f]")
#: Meta strings found clean, most recent last (task types and labels repeat).
_CLEAN_META: OrderedDict[str, None] = OrderedDict()
_CLEAN_META_SIZE, _CLEAN_META_MAX_LEN = 4096, 256
_CLEAN_META_LOCK = threading.Lock()


@functools.cache
def _meta_guard() -> DataScopeGuard:
    return DataScopeGuard(max_scan_chars=MAX_META_SCAN_CHARS)


#: W3C trace context ids (spec §12): their format leaves no room for a secret's.
_TRACE_ID = re.compile(r"(?:[0-9a-f]{2}-)?[0-9a-f]{32}(?:-[0-9a-f]{16}-[0-9a-f]{2})?|[0-9a-f]{16}")
#: Meta keys stored verbatim elsewhere: the idempotency key is the stream
#: record's own lookup column (spec §8).
_META_VERBATIM = frozenset({"idempotency_key"})


def _meta_to_scan(value: Any, top: bool = True) -> Any:
    """``value`` with the strings that need no scan blanked (same shape)."""
    if isinstance(value, str):
        if _MAY_HOLD_SECRET.search(value) is None or _TRACE_ID.fullmatch(value):
            return ""
        with _CLEAN_META_LOCK:
            if value in _CLEAN_META:
                _CLEAN_META.move_to_end(value)
                return ""
        return value
    if isinstance(value, Mapping):
        return {k: "" if top and k in _META_VERBATIM else _meta_to_scan(v, False) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_meta_to_scan(v, False) for v in value]
    return value


def _remember_clean(value: Any, hit_paths: set[tuple[str | int, ...]], path: tuple[str | int, ...] = ()) -> None:
    if isinstance(value, str):
        if value and path not in hit_paths and len(value) <= _CLEAN_META_MAX_LEN:
            with _CLEAN_META_LOCK:
                _CLEAN_META[value] = None
                if len(_CLEAN_META) > _CLEAN_META_SIZE:
                    _CLEAN_META.popitem(last=False)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _remember_clean(v, hit_paths, (*path, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _remember_clean(v, hit_paths, (*path, i))


def redact_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a task's ``meta`` fit to be stored (spec §11, §19): the
    ``securityContext`` secrets of an Agent Context (``meta.agent_context``)
    masked (:func:`redact_context_message`), and every string leaf
    scanned for secrets as prose (the detectors and the normalised pass of
    :class:`DataScopeGuard`), detected values replaced by ``[REDACTED:<type>]``;
    strings past :data:`MAX_META_SCAN_CHARS` replaced by :data:`UNSCANNED`.
    Mapping keys are kept, and so is ``idempotency_key`` (stored as the
    record's lookup key in any case). ``meta`` itself is not changed; returned as a new
    dict even when nothing was masked. A string that cannot hold a secret (no
    long token, keyword, URL credentials, escape or non-ASCII character) or that
    was found clean recently (the 4,096 most recent up to 256 characters) is not
    scanned; any other costs about 20–40 µs of CPU."""
    out = dict(meta)
    context = out.get(_META_KEY_CONTEXT)
    if isinstance(context, Mapping):
        out[_META_KEY_CONTEXT] = redact_context_message(context)
    guard = _meta_guard()
    to_scan = _meta_to_scan(out)
    scan = guard.inspect(to_scan, frozenset({SECRETS}))
    if scan.complete:
        _remember_clean(to_scan, {h.path for h in scan.hits})
    if scan.hits:
        out = _apply(out, list(scan.hits))
    if not scan.complete:
        budget = [guard.max_scan_chars]

        def cut(value: Any) -> Any:
            if isinstance(value, str):
                budget[0] -= len(value)
                return value if budget[0] >= 0 else UNSCANNED
            if isinstance(value, Mapping):
                return {k: cut(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [cut(v) for v in value]
            return value

        out = cut(out)
    return out


# ---------------------------------------------------------------------- registered secrets
class _SecretSet:
    """Bounded, thread-safe set of secrets seen by this process, with one compiled
    pattern matching any of them (longest first, so a secret containing another
    is masked whole)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._pattern: re.Pattern[str] | None = None

    def add(self, secrets: Iterable[str]) -> None:
        with self._lock:
            changed = False
            for s in secrets:
                if len(s) < MIN_SECRET_LEN:
                    continue
                if s in self._items:
                    self._items.move_to_end(s)
                    continue
                self._items[s] = None
                changed = True
                if len(self._items) > self._size:
                    self._items.popitem(last=False)
            if changed:
                self._pattern = None

    def snapshot(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._items)

    def pattern(self) -> re.Pattern[str] | None:
        with self._lock:
            if self._pattern is None and self._items:
                alts = sorted(self._items, key=len, reverse=True)
                self._pattern = re.compile("|".join(map(re.escape, alts)))
            return self._pattern


_KNOWN = _SecretSet(MAX_KNOWN_SECRETS)


def register_secrets(secrets: Iterable[str]) -> None:
    """Remember ``secrets`` (Agent Context ``securityContext`` values, at least
    :data:`MIN_SECRET_LEN` characters) so that :func:`scrub` masks them everywhere
    (the :data:`MAX_KNOWN_SECRETS` most recent)."""
    _KNOWN.add(secrets)


def known_secrets() -> frozenset[str]:
    """The secrets currently remembered by the process."""
    return _KNOWN.snapshot()


# ---------------------------------------------------------------------- the scrubber
def scrub(text: str, *, secrets: Iterable[str] = (), max_chars: int | None = MAX_SCRUB_CHARS) -> str:
    """``text`` fit for an error reason or a log line: every occurrence of
    ``secrets`` and of the registered secrets (:func:`register_secrets`) replaced by
    :data:`REDACTED`, then cut to ``max_chars`` characters (None: no cut; a cut
    ends in ``…`` and drops the token it split), then every value detect-secrets
    flags replaced by ``[REDACTED:<type>]``. Pure and thread-safe."""
    if max_chars is not None and len(text) > 4 * max_chars + 1024:
        text = text[: 4 * max_chars + 1024]  # bound the work; the exact cut follows
    extra = sorted((s for s in secrets if len(s) >= MIN_SECRET_LEN), key=len, reverse=True)
    if extra:
        text = re.sub("|".join(map(re.escape, extra)), REDACTED, text)
    pattern = _KNOWN.pattern()
    if pattern is not None:
        text = pattern.sub(REDACTED, text)
    if max_chars is not None and len(text) > max_chars:
        cut = text[: max(max_chars - 1, 0)]
        space = max(cut.rfind(" "), cut.rfind("\n"))
        if space >= len(cut) - 128:
            cut = cut[: space + 1]  # a token split by the cut may be a secret's prefix
        text = cut + "…"
    if not text:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        found = _secrets().line(line)
        if found:
            lines[i] = _mask_line(line, {v: f"[REDACTED:{kind}]" for kind, v in found})
    return "\n".join(lines)


def scrub_error(e: ATPError, secrets: Iterable[str] = ()) -> ATPError:
    """Pass ``e``'s reason (and so ``str(e)``) through :func:`scrub`, in place;
    returns ``e``."""
    reason = scrub(e.reason, secrets=secrets)
    if reason != e.reason:
        e.reason = reason
        e.args = (f"{e.code}: {reason}",)
    return e
