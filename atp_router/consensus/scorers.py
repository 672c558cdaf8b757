"""Consensus scorers (spec §7.1): evidence, agreement, cost.

Pure functions over :mod:`atp_router.consensus.types`; no I/O. File paths are compared
exactly (repo-relative POSIX paths, as in the task's ``files``); lines are
1-based and inclusive. A finding whose ``end < start`` is read as the span
``min..max``.

* **Evidence** — does the citation point at something real? A file absent from
  the task, or a start line past the file's end, is a hallucination.
* **Change** — a real citation outside the change that names no test counts
  half (:func:`change_evidence`).
* **Agreement** — how much the agents flagged the same places (Jaccard over
  clustered spans, see :func:`agreement`) and, per merged finding, how much
  their claims say the same thing (:func:`claim_similarity`).
* **Cost** — an expensive contributor counts less, unless its finding is high
  severity.

:func:`clusters` is the O(n log n) per-file sweep shared with the strategies.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from itertools import combinations
from typing import TypeVar

from atp_router.consensus.types import AgentFinding, AgentReport, Severity

T = TypeVar("T")

#: Evidence scores (spec §7.1). Exactly these three values are produced.
GROUNDED = 1.0
SPAN_OVERFLOW = 0.5
HALLUCINATED = 0.0

#: Evidence of a citation that is real but outside the change and names no test.
OFF_CHANGE = 0.5
#: Lines either side of a changed line a citation may fall on and count as in the change.
CHANGE_SLACK = 3

#: Share of the score an expensive contributor loses on a below-high finding.
COST_PENALTY = 0.5


def span_of(finding: AgentFinding) -> tuple[int, int]:
    """``(first, last)`` line of a finding, 1-based inclusive, ordered."""
    return (finding.start, finding.end) if finding.start <= finding.end else (finding.end, finding.start)


def count_lines(files: Mapping[str, str]) -> dict[str, int]:
    """Line count of each file's text (path → lines ≥ 1).

    Lines end at ``\\n`` (``\\r\\n`` included), as analysers count them, not at
    the extra separators of ``str.splitlines``. An empty file counts one line
    because analysers report file-level findings there (ruff D104: line 1).
    """
    return {
        path: max(1, text.count("\n") + (1 if text and not text.endswith("\n") else 0)) for path, text in files.items()
    }


def evidence_score(finding: AgentFinding, line_counts: Mapping[str, int] | None) -> float:
    """Evidence score of one citation (spec §7.1), one of three values:

    * ``GROUNDED`` (1.0): the file is in the task and the whole span lies inside it;
    * ``SPAN_OVERFLOW`` (0.5): the span starts inside the file but runs past its end;
    * ``HALLUCINATED`` (0.0): the file is not in the task, or the span starts past its end.

    ``line_counts`` comes from :func:`count_lines`; ``None`` means the task's
    files are unknown, so nothing can be checked and the score is ``GROUNDED``.
    """
    if line_counts is None:
        return GROUNDED
    n = line_counts.get(finding.file)
    first, last = span_of(finding)
    if n is None or first > n:
        return HALLUCINATED
    return GROUNDED if last <= n else SPAN_OVERFLOW


def change_evidence(finding: AgentFinding, changed: Mapping[str, Iterable[int]] | None,
                    *, slack: int = CHANGE_SLACK) -> float:
    """Evidence factor for where a citation points relative to the change (spec
    §7.1 "citation must point at changed code or a failing test"): 1.0 when the
    span touches a changed line of its file (± ``slack`` lines) or the finding
    names a test (``tests`` non-empty, or rule ``test_fail``); :data:`OFF_CHANGE`
    otherwise. ``changed`` (path → changed line numbers after the diff, from
    :func:`atp_router.task.diff.changed_lines`) ``None`` means no diff is known: 1.0."""
    if changed is None or finding.tests or finding.rule == "test_fail":
        return 1.0
    lines = changed.get(finding.file)
    if not lines:
        return OFF_CHANGE
    first, last = span_of(finding)
    return 1.0 if any(first - slack <= n <= last + slack for n in lines) else OFF_CHANGE


_WORD = re.compile(r"[a-z0-9_]+")
# A rule code prefix ("F821: ", "B301: ") says which analyser spoke, not what it claims.
_RULE_PREFIX = re.compile(r"^[A-Za-z]+[0-9]+[:]\s*")


def claim_similarity(a: str, b: str) -> float:
    """Word-set Jaccard of two claims, 0.0..1.0 (rule-code prefixes and case
    ignored; two empty claims are 1.0): how far two agents say the same thing
    about a place they both flagged."""
    wa = set(_WORD.findall(_RULE_PREFIX.sub("", a).lower()))
    wb = set(_WORD.findall(_RULE_PREFIX.sub("", b).lower()))
    if not wa and not wb:
        return 1.0
    return len(wa & wb) / len(wa | wb)


def clusters(items: Iterable[T], key: Callable[[T], tuple[str, int, int]], *, line_slack: int = 0) -> list[list[T]]:
    """Group items whose spans overlap in the same file.

    ``key(item)`` gives ``(file, first, last)``. Two spans join when the later
    one starts at most ``line_slack`` lines after the end of the cluster so far
    (``0``: they share a line; ``1``: adjacent lines join too). Joining is
    transitive along the sweep. Per file the items are sorted by
    ``(first, last, input order)`` and swept once: O(n log n).

    Returns the clusters ordered by file then first line, each cluster's items
    in sweep order. Raises ``ValueError`` if ``line_slack < 0``.
    """
    if line_slack < 0:
        raise ValueError(f"line_slack must be >= 0, got {line_slack}")
    by_file: dict[str, list[tuple[int, int, int, T]]] = {}
    for seq, item in enumerate(items):
        file, first, last = key(item)
        by_file.setdefault(file, []).append((first, last, seq, item))
    out: list[list[T]] = []
    for file in sorted(by_file):
        entries = by_file[file]
        entries.sort(key=lambda e: (e[0], e[1], e[2]))
        current: list[T] = []
        reach = 0
        for first, last, _, item in entries:
            if current and first <= reach + line_slack:
                current.append(item)
                reach = max(reach, last)
            else:
                if current:
                    out.append(current)
                current, reach = [item], last
        out.append(current)
    return out


def agreement(reports: Mapping[str, AgentReport], *, line_slack: int = 0) -> float:
    """Overall agreement of the agents, 0.0..1.0 (spec §7.1, §7.3 ``consensus.agreement``).

    For each unordered pair of agents, their findings are clustered together
    (:func:`clusters`: same file, overlapping spans within ``line_slack``); the
    pair's agreement is the Jaccard index over those clusters: clusters holding
    findings of *both* agents divided by all clusters of the pair. The overall
    value is the mean over all pairs, rounded to 4 decimals.

    * 1.0: every place either agent flagged was flagged by the other as well;
    * 0.0: no place was flagged by both (including one agent reporting
      findings while the other reports none).

    Degenerate cases: fewer than two agents → 1.0 (nobody dissents); a pair
    where neither agent reported findings → 1.0 (both say "clean"). Claims are
    not compared: different models word the same defect differently, the
    location is the signal that survives.
    """
    names = sorted(reports)
    if len(names) < 2:
        return 1.0
    total = 0.0
    for a, b in combinations(names, 2):
        tagged = [(a, f) for f in reports[a].findings] + [(b, f) for f in reports[b].findings]
        if not tagged:
            total += 1.0
            continue
        groups = clusters(tagged, lambda t: (t[1].file, *span_of(t[1])), line_slack=line_slack)
        both = sum(1 for g in groups if len({agent for agent, _ in g}) == 2)
        total += both / len(groups)
    return round(total / (len(names) * (len(names) - 1) // 2), 4)


def cost_score(cost_usd_micros: int, *, max_cost_usd_micros: int, severity: Severity) -> float:
    """Cost score of one contributor's finding (spec §7.1), 0.5..1.0.

    ``1.0 - COST_PENALTY * cost / max_cost``: a free contributor scores 1.0,
    the most expensive one 0.5. High and critical findings are never penalised
    (1.0): a severe defect is worth what it cost to find. ``max_cost_usd_micros``
    is the highest cost among the contributors being compared (USD micros);
    0 means all are free.
    """
    if severity.rank >= Severity.HIGH.rank or max_cost_usd_micros <= 0:
        return 1.0
    return 1.0 - COST_PENALTY * min(cost_usd_micros, max_cost_usd_micros) / max_cost_usd_micros
