"""bandit as a review next-hop: Python security issues with bandit's own severity,
confidence and CWE.

Runs ``bandit -f json -q --exit-zero -r [-s SKIPS] FILES`` in the task's work
directory (only ``.py`` files are written there, so no ``.bandit`` or
``pyproject.toml`` from a task can configure it). Mapping: ``issue_severity``
LOW/MEDIUM/HIGH → low/medium/high, ``issue_confidence`` → 0.4/0.65/0.85,
``issue_cwe.id`` → ``"CWE-<id>"``, ``test_id`` → ``rule``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from atp.adapters.tools.base import ToolAdapter, relative
from atp.consensus.types import AgentFinding, Severity

__all__ = ["BanditAdapter", "CONFIDENCE", "DEFAULT_SKIP", "SEVERITY"]

SEVERITY = {"LOW": Severity.LOW, "MEDIUM": Severity.MEDIUM, "HIGH": Severity.HIGH}
CONFIDENCE = {"LOW": 0.4, "MEDIUM": 0.65, "HIGH": 0.85}

#: Noise in review: ``assert`` (B101), importing subprocess (B404), any subprocess
#: call without a shell (B603), a command found on PATH (B607).
DEFAULT_SKIP: tuple[str, ...] = ("B101", "B404", "B603", "B607")


class BanditAdapter(ToolAdapter):
    """bandit next-hop. ``skip`` lists bandit test ids not to run (default
    :data:`DEFAULT_SKIP`). Other arguments: :class:`ToolAdapter`."""

    tool = "bandit"
    default_strengths = ("security", "static_analysis", "cwe")

    def __init__(
        self,
        name: str = "bandit",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        skip: Iterable[str] = DEFAULT_SKIP,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths)
        self.skip = list(skip)
        for test_id in self.skip:
            if not isinstance(test_id, str) or not test_id.isalnum():
                raise ValueError(f"not a bandit test id: {test_id!r}")

    def argv(self, paths: list[str]) -> list[str]:
        args = ["-f", "json", "-q", "--exit-zero", "-r"]
        if self.skip:
            args += ["-s", ",".join(self.skip)]
        return [*args, *paths]

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        report = json.loads(stdout)
        if not isinstance(report, dict) or not isinstance(report.get("results"), list):
            raise ValueError("expected a JSON object with 'results'")
        findings: list[AgentFinding] = []
        for r in report["results"]:
            start = int(r["line_number"])
            lines = [int(n) for n in r.get("line_range") or [start]]
            cwe = r.get("issue_cwe") or {}
            cwe_id = cwe.get("id") if isinstance(cwe, dict) else None
            findings.append(
                AgentFinding(
                    file=relative(r["filename"], root),
                    start=start,
                    end=max(start, *lines),
                    severity=SEVERITY.get(r["issue_severity"], Severity.INFO),
                    claim=f"{r['test_id']}: {r['issue_text']}",
                    confidence=CONFIDENCE.get(r["issue_confidence"], 0.4),
                    rule=r["test_id"],
                    cwe=f"CWE-{cwe_id}" if cwe_id else None,
                )
            )
        errors = report.get("errors") or []
        notes = [f"{len(errors)} file(s) could not be parsed"] if errors else []
        return findings, notes
