"""ruff as a review next-hop: pyflakes errors, bugbear, flake8-bandit and pylint
errors, with the style rules left out (a reviewer flags bugs, not formatting).

Runs ``ruff check --output-format json --no-cache --isolated --exit-zero
--select … --ignore …`` over the task's Python files. ``--isolated`` ignores any
configuration, so a task cannot switch rules off (or on) through a
``pyproject.toml``; only ``.py`` files are written anyway. Suppression comments
in the code (``# noqa``, file-level ``# ruff: noqa`` / ``# flake8: noqa``,
``# ruff: disable[…]``) are not honoured unless the operator allows them
(``--ignore-noqa``, and :data:`SUPPRESSIONS` neutralised; see
:mod:`atp_router.adapters.tools.suppressions`).

ruff has no per-finding confidence, so :data:`GRADES` assigns a severity and a
confidence per rule class: how often that class is a real defect in review.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    ToolLimits,
    decode_items,
    longest_prefix,
    relative,
)
from atp_router.adapters.tools.suppressions import SuppressionAwareAdapter
from atp_router.consensus.types import AgentFinding, Severity

__all__ = ["DEFAULT_IGNORE", "DEFAULT_SELECT", "GRADES", "SUPPRESSIONS", "RuffAdapter", "grade"]

#: Rules that find defects: syntax errors (E9), pyflakes (F), None/bool/type
#: comparisons and bare except (E711 E712 E721 E722), bugbear (B), flake8-bandit
#: (S), blind except (BLE), pylint errors and warnings (PLE PLW), sys.version
#: misuse (YTT), leftover debuggers (T10), implicit concatenation on one line — a
#: missing comma (ISC001), no-op mock assertions (PGH005), dropped asyncio tasks
#: (RUF006).
DEFAULT_SELECT: tuple[str, ...] = (
    "E9", "F", "E711", "E712", "E721", "E722", "B", "S", "BLE", "PLE", "PLW", "YTT", "T10", "ISC001",
    "PGH005", "RUF006",
)  # fmt: skip

#: Noise in review: asserts (S101), every subprocess call (S603, S607), non-crypto
#: random (S311), zip() without strict= (B905), ``global`` (PLW0603), loop-variable
#: reuse (PLW2901).
DEFAULT_IGNORE: tuple[str, ...] = ("S101", "S603", "S607", "S311", "B905", "PLW0603", "PLW2901")

H, M, L = Severity.HIGH, Severity.MEDIUM, Severity.LOW

#: Rule-code prefix → (severity, confidence); the longest matching prefix wins.
#: Confidence is how sure the class is to be a real defect, not ruff's precision
#: at detecting the pattern (which is ~1 for all of them).
GRADES: dict[str, tuple[Severity, float]] = {
    "invalid-syntax": (H, 0.95),  # the file does not parse
    "E9": (H, 0.9),  # syntax / IO errors
    "F": (M, 0.75),  # pyflakes: real errors unless listed below
    "F401": (L, 0.7),  # unused import: real, rarely harmful
    "F841": (L, 0.7),  # unused variable: often a typo'd use
    "F5": (M, 0.8),  # %-/format() call mismatches raise at run time
    "F63": (H, 0.85),  # `is` with a literal, assert on a tuple: always wrong
    "F7": (H, 0.85),  # break/return/yield outside their block: SyntaxError at import
    "F811": (M, 0.75),  # redefinition shadows an unused definition
    "F821": (H, 0.8),  # undefined name: NameError when reached
    "F822": (H, 0.8),
    "F823": (H, 0.8),  # local used before assignment: UnboundLocalError
    "E711": (L, 0.5),
    "E712": (L, 0.5),
    "E721": (L, 0.5),
    "E722": (M, 0.6),  # bare except swallows KeyboardInterrupt/SystemExit
    "B": (M, 0.6),  # bugbear: likely bugs
    "B006": (M, 0.7),  # mutable default argument shared across calls
    "B028": (L, 0.4),  # warnings.warn without stacklevel: points at the wrong caller
    "B904": (L, 0.45),  # raise without from: context lost, not a bug
    "S": (M, 0.5),  # flake8-bandit: security smells
    "S1": (L, 0.45),  # try-except-pass, hardcoded tmp, binding all interfaces
    "S105": (M, 0.45),  # hardcoded passwords: often false positives
    "S106": (M, 0.45),
    "S107": (M, 0.45),
    "S301": (M, 0.6),  # pickle / marshal of untrusted data
    "S307": (M, 0.6),  # eval
    "S501": (H, 0.8),  # TLS verification disabled
    "S506": (H, 0.8),  # yaml.load without a safe loader
    "S602": (H, 0.7),  # shell=True
    "S605": (H, 0.65),  # os.system & co with a shell
    "S608": (M, 0.5),  # SQL built from strings
    "BLE": (L, 0.45),
    "PLE": (H, 0.75),  # pylint errors
    "PLW": (M, 0.55),
    "PLW0711": (H, 0.8),  # `except A or B` catches only A
    "YTT": (M, 0.7),
    "T10": (M, 0.9),  # debugger left in
    "ISC001": (M, 0.55),  # implicit concatenation: a missing comma in a list
    "PGH005": (H, 0.8),  # misspelt mock assertion never fails
    "RUF006": (M, 0.6),  # un-referenced asyncio task may be collected
}
_DEFAULT_GRADE = (L, 0.5)

#: ruff's suppression keywords in a comment: ``noqa`` (inline, and file-level
#: after ``ruff:`` or ``flake8:``) and every ``ruff:`` directive.
SUPPRESSIONS = re.compile(r"noqa|ruff(?=\s*:)", re.IGNORECASE)


def grade(code: str) -> tuple[Severity, float]:
    """(severity, confidence) of a ruff rule code by the longest prefix in GRADES."""
    return longest_prefix(GRADES, code, _DEFAULT_GRADE)


class _Location(msgspec.Struct):
    row: int


class _Diagnostic(msgspec.Struct):
    """The fields of one ruff JSON diagnostic the adapter reads (others are skipped)."""

    filename: str
    location: _Location
    message: str
    code: str | None = None
    name: str | None = None
    end_location: _Location | None = None


class RuffAdapter(SuppressionAwareAdapter):
    """ruff next-hop. ``select``/``ignore`` are ruff rule selectors (default
    :data:`DEFAULT_SELECT` / :data:`DEFAULT_IGNORE`); ``target_version`` (``"py39"``
    …) sets the Python the code targets. Other arguments:
    :class:`~atp_router.adapters.tools.suppressions.SuppressionAwareAdapter`."""

    tool = "ruff"
    suppression_pattern = SUPPRESSIONS
    suppression_flags = ("--ignore-noqa",)
    default_strengths = ("static_analysis", "bug_detection", "security", "quick_review")

    def __init__(
        self,
        name: str = "ruff",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        select: Iterable[str] = DEFAULT_SELECT,
        ignore: Iterable[str] = DEFAULT_IGNORE,
        target_version: str | None = None,
        limits: ToolLimits = DEFAULT_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits,
                         allow_suppressions=allow_suppressions)
        self.select = list(select)
        self.ignore = list(ignore)
        if not self.select:
            raise ValueError("ruff select must name at least one rule")
        for rule in (*self.select, *self.ignore):
            if not isinstance(rule, str) or not rule.isalnum():
                raise ValueError(f"not a ruff rule selector: {rule!r}")
        self.target_version = target_version

    def argv(self, paths: list[str]) -> list[str]:
        args = ["check", "--output-format", "json", "--no-cache", "--isolated", "--exit-zero", "--quiet"]
        args += ["--select", ",".join(self.select)]
        if self.ignore:
            args += ["--ignore", ",".join(self.ignore)]
        if self.target_version:
            args += ["--target-version", self.target_version]
        return [*args, *self.suppression_args(), *paths]

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """ruff's JSON list of diagnostics as findings (runs in a worker thread)."""
        items = msgspec.json.decode(stdout or b"[]", type=list[msgspec.Raw])
        findings: list[AgentFinding] = []
        syntax_seen: set[str] = set()
        paths: dict[str, str] = {}
        for d in decode_items(items, _Diagnostic):
            path = paths.get(d.filename)
            if path is None:
                path = paths[d.filename] = relative(d.filename, root)
            code = d.code or d.name or "invalid-syntax"
            if code == "invalid-syntax":
                # One parse error cascades into several; the first is the finding.
                if path in syntax_seen:
                    continue
                syntax_seen.add(path)
            start = d.location.row
            end = max(start, (d.end_location or d.location).row)
            severity, confidence = grade(code)
            findings.append(
                AgentFinding(
                    file=path,
                    start=max(start, 1),
                    end=max(end, 1),
                    severity=severity,
                    claim=f"{code}: {d.message}",
                    confidence=confidence,
                    rule=code,
                )
            )
        notes = [f"{len(syntax_seen)} file(s) do not parse"] if syntax_seen else []
        return findings, notes
