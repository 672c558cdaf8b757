"""bandit as a review next-hop: Python security issues with bandit's own severity,
confidence and CWE.

Runs ``bandit -f json -q --exit-zero -r [-s SKIPS] FILES`` in the task's work
directory (only ``.py`` files are written there, so no ``.bandit`` or
``pyproject.toml`` from a task can configure it); ``# nosec`` comments are not
honoured unless the operator allows them (``--ignore-nosec``, and
:data:`SUPPRESSIONS` neutralised; see :mod:`atp_router.adapters.tools.suppressions`).
Mapping: ``issue_severity``
LOW/MEDIUM/HIGH → low/medium/high, ``issue_confidence`` → 0.4/0.65/0.85,
``issue_cwe.id`` → ``"CWE-<id>"``, ``test_id`` → ``rule``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    ToolLimits,
    decode_items,
    relative,
)
from atp_router.adapters.tools.suppressions import SuppressionAwareAdapter
from atp_router.consensus.types import AgentFinding, Severity

__all__ = ["CONFIDENCE", "DEFAULT_SKIP", "SEVERITY", "SUPPRESSIONS", "BanditAdapter"]

SEVERITY = {"LOW": Severity.LOW, "MEDIUM": Severity.MEDIUM, "HIGH": Severity.HIGH}
CONFIDENCE = {"LOW": 0.4, "MEDIUM": 0.65, "HIGH": 0.85}

#: Noise in review: ``assert`` (B101), importing subprocess (B404), any subprocess
#: call without a shell (B603), a command found on PATH (B607).
DEFAULT_SKIP: tuple[str, ...] = ("B101", "B404", "B603", "B607")

#: bandit's suppression keyword in a comment (``# nosec``, ``# nosec B602``).
SUPPRESSIONS = re.compile(r"nosec", re.IGNORECASE)


class _Result(msgspec.Struct):
    """The fields of one bandit JSON result the adapter reads (others are skipped)."""

    filename: str
    line_number: int
    issue_severity: str
    issue_confidence: str
    issue_text: str
    test_id: str
    line_range: list[int] | None = None
    issue_cwe: Any = None


class _Report(msgspec.Struct):
    results: list[msgspec.Raw]
    errors: list[Any] | None = None


class BanditAdapter(SuppressionAwareAdapter):
    """bandit next-hop. ``skip`` lists bandit test ids not to run (default
    :data:`DEFAULT_SKIP`). Other arguments:
    :class:`~atp_router.adapters.tools.suppressions.SuppressionAwareAdapter`."""

    tool = "bandit"
    suppression_pattern = SUPPRESSIONS
    suppression_flags = ("--ignore-nosec",)
    default_strengths = ("security", "static_analysis", "cwe")

    def __init__(
        self,
        name: str = "bandit",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        skip: Iterable[str] = DEFAULT_SKIP,
        limits: ToolLimits = DEFAULT_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits,
                         allow_suppressions=allow_suppressions)
        self.skip = list(skip)
        for test_id in self.skip:
            if not isinstance(test_id, str) or not test_id.isalnum():
                raise ValueError(f"not a bandit test id: {test_id!r}")

    def argv(self, paths: list[str]) -> list[str]:
        args = ["-f", "json", "-q", "--exit-zero", "-r"]
        if self.skip:
            args += ["-s", ",".join(self.skip)]
        return [*args, *self.suppression_args(), *paths]

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """bandit's JSON report as findings (runs in a worker thread)."""
        report = msgspec.json.decode(stdout, type=_Report)
        findings: list[AgentFinding] = []
        paths: dict[str, str] = {}
        for r in decode_items(report.results, _Result):
            start = r.line_number
            lines = r.line_range or [start]
            cwe = r.issue_cwe or {}
            cwe_id = cwe.get("id") if isinstance(cwe, dict) else None
            path = paths.get(r.filename)
            if path is None:
                path = paths[r.filename] = relative(r.filename, root)
            findings.append(
                AgentFinding(
                    file=path,
                    start=start,
                    end=max(start, *lines),
                    severity=SEVERITY.get(r.issue_severity, Severity.INFO),
                    claim=f"{r.test_id}: {r.issue_text}",
                    confidence=CONFIDENCE.get(r.issue_confidence, 0.4),
                    rule=r.test_id,
                    cwe=f"CWE-{cwe_id}" if cwe_id else None,
                )
            )
        errors = report.errors or []
        notes = [f"{len(errors)} file(s) could not be parsed"] if errors else []
        return findings, notes
