"""Data scope (spec §11): label grammar, detectors, redaction or refusal per agent,
and the one scrubber every adapter error path and log record goes through.

Sans-IO: no I/O and no clock; the detectors are pure CPU work, safe to run in a worker
thread (``trio.to_thread.run_sync(guard.inspect, content, labels)``) so that a large
task does not hold the event loop.

Label grammar (``meta.data_scope``: a string or a list; Agent Context ``policyContext``
labels join it, :func:`atp.adapters.context.with_context_scope`)::

    label    := category [":" mode]
    mode     := "redact" (default) | "forbidden"

A suffix that is not a mode belongs to the category (``acp.policy:P001`` is the
category ``acp.policy:P001``, mode ``redact``). Categories a detector covers
(:data:`SECRETS`, personal data) are normalised; every other label is *opaque*::

    secrets, no_secrets                    -> "secrets"   detect-secrets plugins
    pii, no_pii, personal_data             -> "pii"       personal data, phone numbers
                                                          in international form
    <cc>_personal_data (us_, de_, ...)     -> itself      personal data, phone numbers
                                                          also in <cc>'s national form
    <anything>_personal_data (eu_, ...)    -> itself      personal data, international form
    anything else                          -> itself      opaque: no detector

Clearance: an agent is cleared for a category when its ``agents.<name>.data_scope``
lists it (aliases and ``:mode`` suffixes are normalised the same way; ``pii`` clears
every personal-data category). An agent without ``data_scope`` (``clearance=None``)
is cleared for every *opaque* label (the RIB's historical "None: any", which the FIB
keeps) and for no detector-covered category: it gets redacted content.

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

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from atp.wire.errors import ATPError, ErrorCode

__all__ = [
    "FORBIDDEN",
    "MAX_KNOWN_SECRETS",
    "MAX_SCAN_CHARS",
    "MAX_SCRUB_CHARS",
    "MIN_SECRET_LEN",
    "PII",
    "REDACT",
    "REDACTED",
    "SECRETS",
    "DataScopeGuard",
    "Pass",
    "Redacted",
    "Redaction",
    "Refused",
    "ScopeDecision",
    "ScopeLabel",
    "ScopeScan",
    "clearance_of",
    "is_covered",
    "known_secrets",
    "parse_label",
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

REDACT = "redact"
FORBIDDEN = "forbidden"
Mode = Literal["redact", "forbidden"]
SECRETS = "secrets"
PII = "pii"
_PERSONAL_DATA = "personal_data"
_ALIASES = {"no_secrets": SECRETS, "no_pii": PII, "personal_data": PII}


# ---------------------------------------------------------------------- label grammar
@dataclass(frozen=True, slots=True)
class ScopeLabel:
    """One parsed data-scope label: ``category`` (normalised), ``mode``, and the
    ``detector`` family that covers it (``"secrets"``, ``"personal_data"``, or None
    for an opaque label); ``region`` is the ISO 3166 region whose national phone
    formats are also recognised (``us_personal_data`` → ``"US"``)."""

    label: str
    category: str
    mode: Mode = REDACT
    detector: Literal["secrets", "personal_data"] | None = None
    region: str | None = None


@functools.lru_cache(maxsize=4096)
def parse_label(label: str) -> ScopeLabel:
    """``label`` per the module's grammar. Never raises: any string is a label."""
    category, mode = label, REDACT
    head, sep, tail = label.rpartition(":")
    if sep and head and tail in (REDACT, FORBIDDEN):
        category, mode = head, tail
    category = _ALIASES.get(category, category)
    if category == SECRETS:
        return ScopeLabel(label, category, mode, "secrets")  # type: ignore[arg-type]
    if category == PII:
        return ScopeLabel(label, category, mode, "personal_data")  # type: ignore[arg-type]
    if category.endswith("_" + _PERSONAL_DATA) and len(category) > len(_PERSONAL_DATA) + 1:
        prefix = category[: -len(_PERSONAL_DATA) - 1].upper()
        return ScopeLabel(label, category, mode, "personal_data", prefix if _phone_region(prefix) else None)  # type: ignore[arg-type]
    return ScopeLabel(label, category, mode)  # type: ignore[arg-type]


def is_covered(label: str) -> bool:
    """Does a detector cover ``label``'s category (so an uncleared agent can get
    redacted content instead of being excluded)?"""
    return parse_label(label).detector is not None


def clearance_of(data_scope: Iterable[str] | None) -> frozenset[str] | None:
    """The categories an agent's ``agents.<name>.data_scope`` clears (normalised
    like task labels); None when the agent has no ``data_scope``."""
    if data_scope is None:
        return None
    return frozenset(parse_label(s).category for s in data_scope)


def _cleared(label: ScopeLabel, clearance: frozenset[str] | None) -> bool:
    if clearance is None:
        return label.detector is None
    if label.category in clearance:
        return True
    return label.detector == "personal_data" and PII in clearance


@functools.cache
def _phone_region(code: str) -> bool:
    import phonenumbers

    return code in phonenumbers.SUPPORTED_REGIONS


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

    def _noise(self, value: str, line: str, plugin: Any) -> bool:
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
                if p.calculate_shannon_entropy(v) > p.entropy_limit and not self._noise(v, line, p):
                    found.add((p.secret_type, v))
        low = line.lower()
        if any(k in low for k in self._KEYWORD_HINTS) and not self._h.is_indirect_reference(line):
            regexes = self._keyword_regex.get(self._filetype(filename or "x"), self._keyword_default)
            for v in self._keyword.analyze_string(line, denylist_regex_to_group=regexes):
                if not self._noise(v, line, self._keyword):
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


@functools.cache
def _personal() -> _PersonalData:
    return _PersonalData()


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
class DataScopeGuard:
    """Data-scope enforcement at dispatch (spec §11; see the module docstring).

    ``max_scan_chars`` bounds the characters of one task scanned (default
    :data:`MAX_SCAN_CHARS`); ``max_line_chars`` the length of one scanned line
    (longer lines are scanned in overlapping windows of that size). Thread-safe and
    stateless between tasks: one guard serves the whole router."""

    def __init__(self, *, max_scan_chars: int = MAX_SCAN_CHARS, max_line_chars: int = 4096):
        if max_scan_chars < 0 or max_line_chars < 256:
            raise ValueError("max_scan_chars must be >= 0 and max_line_chars >= 256")
        self.max_scan_chars = max_scan_chars
        self.max_line_chars = max_line_chars

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
            for n, line in enumerate(text.splitlines()):
                if is_diff:
                    m = _DIFF_FILE.match(line)
                    if m:
                        filename = m.group(1)
                body = line[1:] if is_diff and line[:1] in ("+", "-", " ") else line
                key = (body, filename)
                found = cache.get(key)
                if found is None:
                    found = cache[key] = self._line(body, filename, want_secrets, regions)
                for cat, kind, value in found:
                    hits.append(_Hit(cat, kind, path, n, value))
                if want_secrets:
                    pem = self._pem(body, path, n, pem, hits)
        return ScopeScan(content, parsed, complete, scanned, tuple(hits))

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


def _mask_line(line: str, values: Mapping[str, str]) -> str:
    """``line`` with each value replaced by its marker, in one pass (longest first,
    so a value inside another is masked with it)."""
    pattern = re.compile("|".join(re.escape(v) for v in sorted(values, key=lambda v: (-len(v), v))))
    return pattern.sub(lambda m: values[m.group(0)], line)


def _apply(content: Any, hits: list[_Hit]) -> Any:
    by_path: dict[tuple[str | int, ...], dict[int, dict[str, str]]] = {}
    for h in hits:
        by_path.setdefault(h.path, {}).setdefault(h.line, {}).setdefault(h.value, f"[REDACTED:{h.detector}]")

    def walk(value: Any, path: tuple[str | int, ...]) -> Any:
        if isinstance(value, str):
            lines_hit = by_path.get(path)
            if not lines_hit:
                return value
            lines = value.splitlines(keepends=True)
            for n, values in lines_hit.items():
                lines[n] = _mask_line(lines[n], values)
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
