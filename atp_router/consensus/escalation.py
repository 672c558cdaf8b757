"""Escalation triggers (spec §6.1 ``escalation.on``, §7.2, §8 step 6, §10 ECONSENSUS).

A policy names the triggers it escalates on; :func:`should_escalate` returns
those that fired, and the router then calls the policy's ``to`` agent.

=================  ==========================================================
trigger            fires when
=================  ==========================================================
``low_conf``       the merged findings' mean confidence < ``threshold``, or
                   any report states a ``confidence`` < ``threshold``
``disagree_high``  ``consensus.agreement < 1 - threshold`` while at least two
``disagreement``   agents reported findings (both names, same rule: §6.1 and
                   §23.2 use one each)
``no_findings``    the merged result has no findings
``weak_citations`` the mean evidence score of all reported findings
                   < ``threshold`` (needs the task's ``files``); or, for
                   reports whose findings are citations (``rule`` is
                   :data:`CITATION_RULE`, a retriever's passages), the
                   strength (``confidence``) of each such report's best
                   citation, averaged over those reports, < ``threshold``
                   (a weak BM25 match; no ``files`` needed)
``test_fail``      a report holds a finding whose ``rule`` is
                   :data:`TEST_FAIL_RULE` (``"test_fail"``): the convention for
                   a test-running agent to report a failing test, with the
                   test's file and lines as the span
=================  ==========================================================

Two more fire whatever the policy lists, because the strategy itself demands
escalation (spec §7.2, §10):

* ``no_quorum`` — ``two_phase_commit`` flagged :data:`~atp_router.consensus.strategies.NO_QUORUM`.
  This is the spec's ``ECONSENSUS`` (no quorum → escalate);
  :func:`consensus_error` returns that code so that a router with no
  escalation target left reports ``ERROR{code: ECONSENSUS}`` to the client.
* ``no_champion`` — ``champion_challenger`` flagged
  :data:`~atp_router.consensus.strategies.NO_CHAMPION` (escalate upon low confidence).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from atp_router.consensus.scorers import count_lines, evidence_score
from atp_router.consensus.strategies import NO_CHAMPION, NO_QUORUM
from atp_router.consensus.types import AgentReport, Result
from atp_router.wire.errors import ErrorCode

TEST_FAIL_RULE = "test_fail"
#: The ``rule`` of a finding that is a citation of a document passage (a
#: retriever's answer, spec §15.3); its ``confidence`` is the citation's strength.
CITATION_RULE = "citation"

#: Trigger names a policy may list (validate RIB documents against this).
TRIGGERS = frozenset({"low_conf", "disagree_high", "disagreement", "no_findings", "weak_citations", "test_fail"})


def should_escalate(
    result: Result,
    reports: Mapping[str, AgentReport],
    triggers: Sequence[str],
    *,
    threshold: float,
    files: Mapping[str, str] | None = None,
) -> list[str]:
    """The triggers that fired, in the order of ``triggers``, followed by
    ``no_quorum`` / ``no_champion`` when the strategy flagged them.

    ``result`` is :func:`~atp_router.consensus.strategies.merge`'s output for
    ``reports``; ``threshold`` is a confidence 0..1 (see the module table);
    ``files`` (path → text) feeds the evidence scorer for ``weak_citations``,
    which without it fires only on citation findings (:data:`CITATION_RULE`). Raises ``ValueError`` on a trigger name not
    in :data:`TRIGGERS`.
    """
    unknown = [t for t in triggers if t not in TRIGGERS]
    if unknown:
        raise ValueError(f"unknown escalation trigger(s) {unknown}; expected some of {sorted(TRIGGERS)}")
    fired: list[str] = []
    for trigger in dict.fromkeys(triggers):
        if _fires(trigger, result, reports, threshold, files):
            fired.append(trigger)
    flags = result.consensus.uncertainties
    if NO_QUORUM in flags:
        fired.append("no_quorum")
    if NO_CHAMPION in flags:
        fired.append("no_champion")
    return fired


def consensus_error(result: Result) -> ErrorCode | None:
    """``ErrorCode.ECONSENSUS`` when the result lacks quorum (spec §10), else ``None``."""
    return ErrorCode.ECONSENSUS if NO_QUORUM in result.consensus.uncertainties else None


def _fires(
    trigger: str,
    result: Result,
    reports: Mapping[str, AgentReport],
    threshold: float,
    files: Mapping[str, str] | None,
) -> bool:
    match trigger:
        case "low_conf":
            findings = result.findings
            if findings and sum(f.confidence for f in findings) / len(findings) < threshold:
                return True
            return any(r.confidence is not None and r.confidence < threshold for r in reports.values())
        case "disagree_high" | "disagreement":
            voices = sum(1 for r in reports.values() if r.findings)
            return voices >= 2 and result.consensus.agreement < 1.0 - threshold
        case "no_findings":
            return not result.findings
        case "weak_citations":
            best = [max(cs) for r in reports.values()
                    if (cs := [f.confidence for f in r.findings if f.rule == CITATION_RULE])]
            if best and sum(best) / len(best) < threshold:
                return True
            if files is None:
                return False
            counts = count_lines(files)
            scores = [evidence_score(f, counts) for r in reports.values() for f in r.findings]
            return bool(scores) and sum(scores) / len(scores) < threshold
        case _:  # "test_fail"; names were validated by the caller
            return any(f.rule == TEST_FAIL_RULE for r in reports.values() for f in r.findings)
