"""Consensus strategies (spec §7.2): merge agents' reports into one result (§7.3).

:func:`merge` is the entry point; ``strategy`` selects one of:

``union_tiebreak``
    Every place flagged by any agent becomes one merged finding (union); the
    claim is tie-broken by historical win-rate.
``two_phase_commit``
    A finding is committed only when agents of ``quorum`` (default 2) distinct
    sources flagged the same place (the second source's report is the ACK; two
    agents on one model are one source); the rest are listed as uncertainties.
``champion_challenger``
    The result is the report of the cheapest acceptable agent (the champion);
    the other agents' extra findings are listed as uncertainties.

How findings merge (all strategies): findings are clustered per file by
overlapping spans (:func:`atp_router.consensus.scorers.clusters`, ``line_slack``).
A cluster gives one :class:`~atp_router.consensus.types.Finding`:

* ``span``: ``"first-last"`` covering every contributor;
* ``severity``: the highest among contributors;
* ``claim`` (and ``patch``): from the contributor with the highest win-rate
  *among those reporting that severity*, so claim and severity always belong
  together; further ties go to the cheaper contributor (higher
  :func:`~atp_router.consensus.scorers.cost_score`), then the higher confidence, then
  agent name, then position;
* ``provenance``: ``"<agent>#<ref>"`` per contributing finding, ``ref`` being
  the finding's ``ref`` or else its 0-based index in the agent's report;
  ordered as the claim tie-break, so ``provenance[0]`` wrote the claim;
* ``confidence``: noisy-OR over independent *sources*, ``1 - Π(1 - c_s)``,
  where ``c_s`` is the best ``confidence × evidence score`` any agent of source
  ``s`` gave in the cluster (an agent repeating itself, or two agents on the
  same model, are not independent evidence: spec §19 consensus poisoning),
  rounded to 4 decimals. ``sources`` maps agents to their source (the router
  passes the RIB model, tool or remote endpoint behind each agent); an agent
  without one is its own source. Correlated analysers are one voter: sources
  that flagged the place with the same declared rule class (ruff, pylint and
  mypy all reporting an undefined name; ruff's ``S602`` and bandit's ``B602``)
  count once here, in the quorum and in the agreement score
  (:mod:`atp_router.consensus.equivalence`);
* ``tests``: the sorted union of contributors' tests;
* ``suppressed_by_change``: true when *any* contributor's finding is: the
  change's own suppression comment hid this place from at least one analyser
  (another reviewer still seeing it does not undo that the author silenced it).

A hallucinated citation (evidence 0.0: unknown file, or a start past the
file's end) never joins a finding: such findings are clustered apart and
listed in ``uncertainties`` as ``uncited``. Findings are ordered by
severity (critical first), file, first line, last line, claim, and numbered
``F-1``, ``F-2``, ... in that order; uncertainties follow the same order. Inputs are read in sorted agent order, so
the output does not depend on mapping order.

Flags (machine-readable entries of ``consensus.uncertainties``, always first):

* :data:`NO_QUORUM` — ``two_phase_commit`` left a high or critical finding
  without its second agent's ACK. This is the spec's ``ECONSENSUS`` (no
  quorum, router action: escalate); see :func:`atp_router.consensus.escalation.consensus_error`.
* :data:`NO_CHAMPION` — ``champion_challenger`` found no acceptable report;
  the result is the most confident report and must be escalated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from atp_router.consensus.equivalence import cluster_voters
from atp_router.consensus.scorers import (
    HALLUCINATED,
    agreement,
    change_evidence,
    claim_similarity,
    clusters,
    cost_score,
    count_lines,
    evidence_score,
    span_of,
)
from atp_router.consensus.types import (
    AgentFinding,
    AgentReport,
    ConsensusInfo,
    Finding,
    FindingScores,
    Result,
    Severity,
)

STRATEGIES = ("union_tiebreak", "two_phase_commit", "champion_challenger")
NO_QUORUM = "ECONSENSUS: a high-severity finding lacks a second agent's ACK"
NO_CHAMPION = "no report reached the confidence threshold"
DEFAULT_THRESHOLD = 0.6
_CLAIM_CHARS = 60


#: A contribution's claim/provenance order, lower first: severity, win-rate, cost
#: score and confidence (each negated: highest first), then agent and finding index.
_Rank = tuple[int, float, float, float, str, int]
#: A merged finding's place in the report: severity (negated), file, first line,
#: last line, claim.
_Order = tuple[int, str, int, int, str]


@dataclass(frozen=True, slots=True)
class _Contribution:
    agent: str
    ref: str
    finding: AgentFinding
    first: int
    last: int
    evidence: float  # evidence_score × change_evidence
    cost: float  # cost_score
    rank: _Rank  # claim/provenance order: lower sorts first


@dataclass(frozen=True, slots=True)
class _Cluster:
    finding: Finding  # id left empty until numbering
    agents: frozenset[str]
    sources: frozenset[str]  # independent sources behind ``agents``
    order: _Order
    disputed: tuple[Severity, Severity] | None


def merge(
    reports: Mapping[str, AgentReport],
    *,
    strategy: str = "union_tiebreak",
    win_rates: Mapping[str, float],
    costs_usd_micros: Mapping[str, int],
    files: Mapping[str, str] | None,
    min_severity: Severity | None = None,
    line_slack: int = 0,
    threshold: float = DEFAULT_THRESHOLD,
    quorum: int = 2,
    sources: Mapping[str, str] | None = None,
    changed: Mapping[str, Iterable[int]] | None = None,
    calibration: Mapping[str, Callable[[float], float]] | None = None,
) -> Result:
    """Merge agent reports into the §7.3 ``result`` (spec §7.2).

    ``reports``: agent name → its FINAL report. ``win_rates``: agent → historical
    win-rate 0..1 (missing agents rank as 0.0). ``costs_usd_micros``: agent →
    what its call cost, USD micros (missing: 0). ``files``: path → text of the
    task's files after the diff, for the evidence scorer; ``None`` skips the
    check. ``min_severity``: drop merged findings (and their uncertainties)
    below it; a cluster's severity is its highest contributor's, so a low
    report still corroborates a high one. ``line_slack``: lines allowed between
    spans that still merge. ``threshold``: confidence under which a lone
    finding is an uncertainty, and a report's mean confidence needed to be a
    champion. ``quorum``: distinct sources needed to commit (two_phase_commit).
    ``sources``: agent → the independent source behind it (a model, a tool, a
    remote endpoint); agents sharing one count once in confidence, quorum and
    the lone-finding rule (spec §19); missing agents are their own source.
    ``changed``: path → changed line numbers after the diff; a citation outside
    the change that names no test counts half as evidence
    (:func:`~atp_router.consensus.scorers.change_evidence`; ``None``: not checked).
    ``calibration``: agent → a function from a stated confidence to the
    measured one (RIB ``agents.<x>.calibration``, written by ``atp-router
    eval``); the agent's findings enter the merge with it. Every merged finding
    carries its ``scores`` (evidence, agreement, claims,
    cost: :class:`~atp_router.consensus.types.FindingScores`).

    Raises ``ValueError`` for an unknown strategy, ``line_slack < 0`` or
    ``quorum < 1``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown consensus strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    line_counts = count_lines(files) if files is not None else None
    if calibration:
        reports = {a: _calibrated(r, calibration[a]) if a in calibration else r for a, r in reports.items()}
    contributions = _contributions(reports, win_rates, costs_usd_micros, line_counts, changed)
    agreed = agreement(reports, line_slack=line_slack)
    kept, uncertainties = _decide(strategy, reports, contributions, costs_usd_micros, line_slack=line_slack,
                                  min_severity=min_severity, threshold=threshold, quorum=quorum, sources=sources)
    return Result(
        findings=[msgspec.structs.replace(c.finding, id=f"F-{i}") for i, c in enumerate(kept, 1)],
        consensus=ConsensusInfo(strategy=strategy, agreement=agreed, uncertainties=uncertainties),
    )


def _decide(
    strategy: str,
    reports: Mapping[str, AgentReport],
    contributions: list[_Contribution],
    costs_usd_micros: Mapping[str, int],
    *,
    line_slack: int,
    min_severity: Severity | None,
    threshold: float,
    quorum: int,
    sources: Mapping[str, str] | None,
) -> tuple[list[_Cluster], list[str]]:
    """Cluster ``contributions`` and apply ``strategy`` (arguments as in
    :func:`merge`): the merged clusters kept, in finding order, and the
    uncertainties (flags first, then the notes in finding order)."""
    src = dict(sources or {})
    voices = len({src.get(a, "agent:" + a) for a, r in reports.items() if r.findings})

    def cluster(contributions: list[_Contribution]) -> list[_Cluster]:
        return _at_least(_cluster_all(contributions, line_slack, src, voices), min_severity)

    cited_in = [c for c in contributions if c.evidence > HALLUCINATED]
    cited = cluster(cited_in)
    uncited = cluster([c for c in contributions if c.evidence == HALLUCINATED])
    flags: list[str] = []
    notes: list[tuple[_Order, str]] = [(c.order, _note(c, "uncited: " + c.finding.claim)) for c in uncited]
    if strategy == "union_tiebreak":
        kept = _union_tiebreak(cited, threshold, notes)
    elif strategy == "two_phase_commit":
        kept = _two_phase_commit(cited, quorum, notes, flags)
    else:
        champion, acceptable = _champion(reports, contributions, costs_usd_micros, threshold)
        if not acceptable:
            flags.append(NO_CHAMPION)
        kept = cluster([c for c in cited_in if c.agent == champion])
        _challengers(cited, champion, notes)
    kept.sort(key=lambda c: c.order)
    notes.sort()
    return kept, flags + [n for _, n in notes]


def _union_tiebreak(cited: list[_Cluster], threshold: float, notes: list[tuple[_Order, str]]) -> list[_Cluster]:
    """``union_tiebreak``: keep every cited cluster; a lone source's finding under
    ``threshold`` confidence, and a disputed severity, also go to ``notes``."""
    for c in cited:
        if len(c.sources) == 1 and c.finding.confidence < threshold:
            notes.append((c.order, _note(c, c.finding.claim)))
        elif c.disputed is not None:
            hi, lo = c.disputed
            notes.append((c.order, _note(c, f"severity disputed ({hi} vs {lo})")))
    return cited


def _two_phase_commit(
    cited: list[_Cluster], quorum: int, notes: list[tuple[_Order, str]], flags: list[str]
) -> list[_Cluster]:
    """``two_phase_commit``: keep the clusters ``quorum`` sources flagged; the rest
    go to ``notes`` as unconfirmed, and a high one among them adds :data:`NO_QUORUM`
    to ``flags``."""
    kept = [c for c in cited if len(c.sources) >= quorum]
    pending = [c for c in cited if len(c.sources) < quorum]
    notes.extend((c.order, _note(c, "unconfirmed: " + c.finding.claim)) for c in pending)
    # Spec §7.2: it is the critical changes that need the second ACK; a low
    # finding without one is merely uncertain.
    if any(c.finding.severity.rank >= Severity.HIGH.rank for c in pending):
        flags.append(NO_QUORUM)
    return kept


def _challengers(cited: list[_Cluster], champion: str | None, notes: list[tuple[_Order, str]]) -> None:
    """``champion_challenger``: every cited cluster the champion is not among goes
    to ``notes`` as the challengers' finding."""
    for c in cited:
        if champion not in c.agents:
            others = ",".join(sorted(c.agents))
            notes.append((c.order, _note(c, f"challenger {others}: {c.finding.claim}")))


def _calibrated(report: AgentReport, fn: Callable[[float], float]) -> AgentReport:
    findings = [msgspec.structs.replace(f, confidence=round(min(max(fn(f.confidence), 0.0), 1.0), 4))
                for f in report.findings]
    return msgspec.structs.replace(report, findings=findings)


def report_confidence(report: AgentReport, evidence: list[float] | None = None) -> float:
    """A report's confidence, 0..1: the mean of its findings' confidences, each
    multiplied by its evidence score (``evidence``, same order; ``None``: all
    1.0), so hallucinated citations cannot make a report acceptable. A report
    without findings has its stated ``confidence``, or 0.0 if it states none
    (silence is not evidence of having looked)."""
    if not report.findings:
        return report.confidence if report.confidence is not None else 0.0
    ev = evidence if evidence is not None else [1.0] * len(report.findings)
    return sum(f.confidence * e for f, e in zip(report.findings, ev, strict=True)) / len(report.findings)


def _contributions(
    reports: Mapping[str, AgentReport],
    win_rates: Mapping[str, float],
    costs: Mapping[str, int],
    line_counts: Mapping[str, int] | None,
    changed: Mapping[str, Iterable[int]] | None = None,
) -> list[_Contribution]:
    max_cost = max((costs.get(a, 0) for a in reports), default=0)
    out: list[_Contribution] = []
    for agent in sorted(reports):
        win = win_rates.get(agent, 0.0)
        for i, f in enumerate(reports[agent].findings):
            first, last = span_of(f)
            cs = cost_score(costs.get(agent, 0), max_cost_usd_micros=max_cost, severity=f.severity)
            rank: _Rank = (-f.severity.rank, -win, -cs, -f.confidence, agent, i)
            ev = evidence_score(f, line_counts)
            if ev > HALLUCINATED:
                ev *= change_evidence(f, changed)
            out.append(_Contribution(agent, f.ref or str(i), f, first, last, ev, cs, rank))
    return out


def _cluster_all(contributions: list[_Contribution], line_slack: int,
                 sources: Mapping[str, str], voices: int) -> list[_Cluster]:
    groups = clusters(contributions, lambda c: (c.finding.file, c.first, c.last), line_slack=line_slack)
    return [_merge_cluster(g, sources, voices) for g in groups]


def _merge_cluster(group: list[_Contribution], sources: Mapping[str, str], voices: int) -> _Cluster:
    """One merged finding from a cluster; ``voices`` is the number of
    independent sources that reported anything (for the agreement score)."""
    ranked = sorted(group, key=lambda c: c.rank)
    lead = ranked[0]  # rank sorts by severity first: lead holds the max severity
    first = min(c.first for c in group)
    last = max(c.last for c in group)
    best: dict[str, float] = {}  # per independent voter (correlated analysers are one)
    vote = cluster_voters([(c.agent, sources.get(c.agent, "agent:" + c.agent), c.finding.rule) for c in ranked],
                          sources)
    for c in ranked:
        s = vote[sources.get(c.agent, "agent:" + c.agent)]
        best[s] = max(best.get(s, 0.0), c.finding.confidence * c.evidence)
    miss = 1.0
    for s in sorted(best):
        miss *= 1.0 - best[s]
    severities = sorted({c.finding.severity for c in group}, key=lambda s: s.rank)
    disputed = (severities[-1], severities[0]) if severities[-1].rank - severities[0].rank >= 2 else None
    patch = next((c.finding.patch for c in ranked if c.finding.patch), None)
    claims = [c.finding.claim for c in ranked]
    pairs = [(a, b) for i, a in enumerate(claims) for b in claims[i + 1:]]
    voices = max(voices, len(best), 1)
    scores = FindingScores(
        evidence=round(max(c.evidence for c in group), 4),
        agreement=round(len(best) / voices, 4),
        claims=round(sum(claim_similarity(a, b) for a, b in pairs) / len(pairs), 4) if pairs else 1.0,
        cost=round(max(c.cost for c in group), 4),
    )
    finding = Finding(
        id="",
        severity=lead.finding.severity,
        file=lead.finding.file,
        span=f"{first}-{last}",
        claim=lead.finding.claim,
        confidence=round(1.0 - miss, 4),
        provenance=[f"{c.agent}#{c.ref}" for c in ranked],
        patch=patch,
        tests=sorted({t for c in group for t in c.finding.tests}),
        scores=scores,
        suppressed_by_change=any(c.finding.suppressed_by_change for c in group),
    )
    order: _Order = (-lead.finding.severity.rank, lead.finding.file, first, last, lead.finding.claim)
    return _Cluster(finding, frozenset(c.agent for c in group), frozenset(best), order, disputed)


def _at_least(merged: list[_Cluster], min_severity: Severity | None) -> list[_Cluster]:
    if min_severity is None:
        return merged
    return [c for c in merged if c.finding.severity.rank >= min_severity.rank]


def _champion(
    reports: Mapping[str, AgentReport],
    contributions: list[_Contribution],
    costs: Mapping[str, int],
    threshold: float,
) -> tuple[str | None, bool]:
    """(champion agent, acceptable?) — the cheapest agent whose report confidence
    reaches ``threshold``; failing that, the most confident report."""
    evidence: dict[str, list[float]] = {a: [] for a in reports}
    for c in contributions:
        evidence[c.agent].append(c.evidence)
    conf = {a: report_confidence(reports[a], evidence[a]) for a in reports}
    acceptable = sorted((costs.get(a, 0), -conf[a], a) for a in reports if conf[a] >= threshold)
    if acceptable:
        return acceptable[0][2], True
    fallback = sorted((-conf[a], costs.get(a, 0), a) for a in reports)
    return (fallback[0][2] if fallback else None), False


def _note(c: _Cluster, text: str) -> str:
    if len(text) > _CLAIM_CHARS:
        text = text[: _CLAIM_CHARS - 1] + "…"
    return f"{c.finding.file}:{c.finding.span} {text}"
