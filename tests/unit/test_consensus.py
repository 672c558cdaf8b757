"""Consensus engine: scorers, strategies, escalation (spec §7, §10 ECONSENSUS)."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.consensus.equivalence import analyser_of, rule_class, voters
from atp_router.consensus.escalation import (
    TEST_FAIL_RULE,
    TRIGGERS,
    consensus_error,
    should_escalate,
)
from atp_router.consensus.scorers import (
    GROUNDED,
    HALLUCINATED,
    SPAN_OVERFLOW,
    agreement,
    clusters,
    cost_score,
    count_lines,
    evidence_score,
)
from atp_router.consensus.strategies import (
    NO_CHAMPION,
    NO_QUORUM,
    merge,
    report_confidence,
)
from atp_router.consensus.types import AgentFinding, AgentReport, Result, Severity
from atp_router.wire.errors import ErrorCode

H, M, L, C = Severity.HIGH, Severity.MEDIUM, Severity.LOW, Severity.CRITICAL
FILES = {"auth/jwt.py": "x\n" * 120, "db/q.py": "y\n" * 30, "empty.py": "", "tests/test_q.py": "t\n" * 20}
WIN = {"reviewer.gemini": 0.82, "summarizer.local": 0.61, "reviewer.gpt5": 0.86}


def f(file: str, start: int, end: int, sev: Severity = M, claim: str = "c", conf: float = 0.5, **kw) -> AgentFinding:
    return AgentFinding(file=file, start=start, end=end, severity=sev, claim=claim, confidence=conf, **kw)


def rep(*findings: AgentFinding, confidence: float | None = None) -> AgentReport:
    return AgentReport(findings=list(findings), confidence=confidence)


def run(reports, **kw) -> Result:
    kw.setdefault("win_rates", WIN)
    kw.setdefault("costs_usd_micros", {})
    kw.setdefault("files", FILES)
    return merge(reports, **kw)


# --- scorers -------------------------------------------------------------------------------------


def test_count_lines_counts_newlines_like_analysers():
    assert count_lines({"a": "", "b": "x", "c": "x\n", "d": "x\ny", "e": "x\r\ny\r\n", "f": "x\x0cy\n"}) == {
        "a": 1,
        "b": 1,
        "c": 1,
        "d": 2,
        "e": 2,
        "f": 1,
    }


@pytest.mark.parametrize(
    ("finding", "score"),
    [
        (f("auth/jwt.py", 45, 80), GROUNDED),
        (f("auth/jwt.py", 120, 120), GROUNDED),
        (f("auth/jwt.py", 110, 130), SPAN_OVERFLOW),
        (f("auth/jwt.py", 80, 45), GROUNDED),  # reversed span read as 45..80
        (f("auth/jwt.py", 121, 125), HALLUCINATED),
        (f("auth/nope.py", 1, 1), HALLUCINATED),
        (f("empty.py", 1, 1), GROUNDED),
        (f("empty.py", 2, 2), HALLUCINATED),
    ],
)
def test_evidence_score(finding, score):
    assert evidence_score(finding, count_lines(FILES)) == score


def test_evidence_without_files_is_unchecked():
    assert evidence_score(f("anything.py", 9999, 9999), None) == GROUNDED


def test_clusters_sweep_and_slack():
    spans = [("a", 10, 12), ("a", 13, 15), ("a", 1, 3), ("b", 11, 11), ("a", 3, 4)]
    assert clusters(spans, lambda s: s) == [
        [("a", 1, 3), ("a", 3, 4)],
        [("a", 10, 12)],
        [("a", 13, 15)],
        [("b", 11, 11)],
    ]
    assert clusters(spans, lambda s: s, line_slack=1) == [
        [("a", 1, 3), ("a", 3, 4)],
        [("a", 10, 12), ("a", 13, 15)],
        [("b", 11, 11)],
    ]
    # Transitive along the sweep: a long span keeps the cluster open past its neighbours.
    assert len(clusters([("a", 1, 100), ("a", 2, 3), ("a", 50, 51)], lambda s: s)) == 1
    with pytest.raises(ValueError):
        clusters(spans, lambda s: s, line_slack=-1)


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        ({}, 1.0),
        ({"a": rep(f("x", 1, 2))}, 1.0),  # one agent: nobody dissents
        ({"a": rep(), "b": rep()}, 1.0),  # both say clean
        ({"a": rep(f("x", 1, 2)), "b": rep()}, 0.0),  # one flags, one is clean
        ({"a": rep(f("x", 1, 5)), "b": rep(f("x", 5, 9))}, 1.0),  # overlap on line 5
        ({"a": rep(f("x", 1, 5)), "b": rep(f("x", 6, 9))}, 0.0),  # adjacent is not overlap
        ({"a": rep(f("x", 1, 5)), "b": rep(f("y", 1, 5))}, 0.0),  # other file
        ({"a": rep(f("x", 1, 5), f("x", 20, 20)), "b": rep(f("x", 3, 3))}, 0.5),
        ({"a": rep(f("x", 1, 5), f("x", 20, 20), f("x", 40, 41)), "b": rep(f("x", 3, 3))}, 0.3333),
        # three agents: pairs ab=1, ac=0, bc=0
        ({"a": rep(f("x", 1, 5)), "b": rep(f("x", 2, 2)), "c": rep(f("x", 50, 50))}, 0.3333),
    ],
)
def test_agreement_table(reports, expected):
    assert agreement(reports) == expected


def test_agreement_line_slack():
    r = {"a": rep(f("x", 1, 5)), "b": rep(f("x", 6, 9))}
    assert agreement(r, line_slack=1) == 1.0


def test_agreement_does_not_bridge_through_a_third_agent():
    # a and b do not overlap; c overlaps both. The a-b pair is judged on its own.
    r = {"a": rep(f("x", 1, 5)), "b": rep(f("x", 9, 12)), "c": rep(f("x", 4, 10))}
    assert agreement(r) == round((0 + 1 + 1) / 3, 4)


@pytest.mark.parametrize(
    ("cost", "max_cost", "sev", "score"),
    [
        (0, 1000, M, 1.0),
        (1000, 1000, M, 0.5),
        (500, 1000, L, 0.75),
        (1000, 1000, H, 1.0),
        (1000, 1000, C, 1.0),
        (1000, 0, M, 1.0),
    ],
)
def test_cost_score(cost, max_cost, sev, score):
    assert cost_score(cost, max_cost_usd_micros=max_cost, severity=sev) == score


# --- union_tiebreak ------------------------------------------------------------------------------


def test_union_tiebreak_spec_7_3_shape():
    reports = {
        "reviewer.gemini": rep(
            f("auth/jwt.py", 45, 80, H, "Missing audience check", 0.8, ref="12", tests=["test_jwt_aud"])
        ),
        "summarizer.local": rep(f("auth/jwt.py", 50, 60, H, "aud claim not verified", 0.3, ref="7", patch="p")),
    }
    result = run(reports)
    assert msgspec.to_builtins(result) == {
        "findings": [
            {
                "id": "F-1",
                "severity": "high",
                "file": "auth/jwt.py",
                "span": "45-80",
                "claim": "Missing audience check",
                "confidence": 0.86,  # 1 - (1 - 0.8)(1 - 0.3)
                "provenance": ["reviewer.gemini#12", "summarizer.local#7"],
                "patch": "p",
                "tests": ["test_jwt_aud"],
                # both sources flagged it; the claims share no word; both free.
                "scores": {"evidence": 1.0, "agreement": 1.0, "claims": 0.0, "cost": 1.0},
            }
        ],
        "consensus": {"strategy": "union_tiebreak", "agreement": 1.0, "uncertainties": []},
    }


def test_union_claim_comes_from_the_max_severity_contributor_then_win_rate():
    reports = {
        "reviewer.gpt5": rep(f("db/q.py", 3, 4, L, "style nit", 0.9)),
        "reviewer.gemini": rep(f("db/q.py", 4, 6, C, "SQL injection", 0.9)),
        "summarizer.local": rep(f("db/q.py", 5, 5, C, "injection via f-string", 0.9)),
    }
    (finding,) = run(reports).findings
    assert (finding.severity, finding.claim, finding.span) == (C, "SQL injection", "3-6")
    assert finding.provenance == ["reviewer.gemini#0", "summarizer.local#0", "reviewer.gpt5#0"]
    assert run(reports).consensus.uncertainties == ["db/q.py:3-6 severity disputed (critical vs low)"]


def test_union_win_rate_tie_goes_to_the_cheaper_agent():
    reports = {"a": rep(f("db/q.py", 1, 1, M, "from a")), "b": rep(f("db/q.py", 1, 1, M, "from b"))}
    res = run(reports, win_rates={"a": 0.7, "b": 0.7}, costs_usd_micros={"a": 900, "b": 100})
    assert res.findings[0].claim == "from b"


def test_union_ids_and_order_severity_then_file_then_line():
    reports = {
        "a": rep(
            f("db/q.py", 20, 21, L, "low db", 0.9),
            f("db/q.py", 2, 2, H, "high db 2", 0.9),
            f("auth/jwt.py", 90, 91, H, "high jwt 90", 0.9),
            f("auth/jwt.py", 7, 8, C, "critical jwt", 0.9),
            f("auth/jwt.py", 30, 30, H, "high jwt 30", 0.9),
        )
    }
    res = run(reports)
    assert [(x.id, x.claim) for x in res.findings] == [
        ("F-1", "critical jwt"),
        ("F-2", "high jwt 30"),
        ("F-3", "high jwt 90"),
        ("F-4", "high db 2"),
        ("F-5", "low db"),
    ]


def test_union_refs_default_to_index_and_same_agent_duplicates_are_not_independent():
    reports = {"a": rep(f("db/q.py", 1, 3, M, "x", 0.5), f("db/q.py", 2, 4, M, "x again", 0.6))}
    (finding,) = run(reports).findings
    assert finding.provenance == ["a#1", "a#0"]  # higher confidence first among equals
    assert finding.confidence == 0.6  # max per agent, not 1 - 0.5 * 0.4


def test_union_line_slack_parameter():
    reports = {"a": rep(f("db/q.py", 1, 3, H, "a")), "b": rep(f("db/q.py", 5, 6, H, "b"))}
    assert len(run(reports).findings) == 2
    assert len(run(reports, line_slack=1).findings) == 2
    merged = run(reports, line_slack=2).findings
    assert [(x.span, len(x.provenance)) for x in merged] == [("1-6", 2)]


def test_union_min_severity_keeps_clusters_by_their_max_severity():
    reports = {
        "a": rep(f("db/q.py", 1, 3, H, "high", 0.9), f("db/q.py", 10, 10, L, "lone low", 0.9)),
        "b": rep(f("db/q.py", 2, 2, L, "low corroboration", 0.9)),
    }
    res = run(reports, min_severity=H)
    assert [(x.claim, x.provenance) for x in res.findings] == [("high", ["a#0", "b#0"])]
    assert [x.claim for x in run(reports).findings] == ["high", "lone low"]


def test_union_evidence_scales_confidence_and_drops_uncited_clusters():
    reports = {
        "a": rep(
            f("auth/jwt.py", 110, 130, H, "overflowing span", 0.8),
            f("ghost.py", 1, 2, C, "made-up file", 0.99),
        )
    }
    res = run(reports)
    assert [(x.claim, x.confidence) for x in res.findings] == [("overflowing span", 0.4)]
    assert res.consensus.uncertainties == ["ghost.py:1-2 uncited: made-up file", "auth/jwt.py:110-130 overflowing span"]
    # Without the task's files nothing can be checked.
    assert len(run(reports, files=None).findings) == 2


def test_union_uncertainties_list_lone_low_confidence_findings_shortened():
    long = "a very long claim " * 10
    reports = {"a": rep(f("db/q.py", 1, 1, M, long, 0.3), f("db/q.py", 9, 9, M, "confident", 0.9))}
    (note,) = run(reports, threshold=0.5).consensus.uncertainties
    assert note.startswith("db/q.py:1-1 a very long claim")
    assert note.endswith("…") and len(note) == len("db/q.py:1-1 ") + 60


def test_empty_input():
    for strategy in ("union_tiebreak", "two_phase_commit"):
        res = run({}, strategy=strategy)
        assert res.findings == [] and res.consensus.agreement == 1.0 and res.consensus.uncertainties == []
    assert run({}, strategy="champion_challenger").consensus.uncertainties == [NO_CHAMPION]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown consensus strategy"):
        run({}, strategy="majority")
    with pytest.raises(ValueError):
        run({}, quorum=0)


# --- two_phase_commit ----------------------------------------------------------------------------


def test_two_phase_commit_commits_only_with_a_second_ack():
    reports = {
        "reviewer.gemini": rep(f("db/q.py", 1, 4, M, "agreed", 0.7), f("db/q.py", 20, 20, L, "alone", 0.7)),
        "summarizer.local": rep(f("db/q.py", 3, 3, M, "agreed too", 0.7)),
    }
    res = run(reports, strategy="two_phase_commit")
    assert [(x.id, x.claim, x.provenance) for x in res.findings] == [
        ("F-1", "agreed", ["reviewer.gemini#0", "summarizer.local#0"])
    ]
    assert res.consensus.uncertainties == ["db/q.py:20-20 unconfirmed: alone"]
    assert consensus_error(res) is None


def test_two_phase_commit_high_finding_without_quorum_is_econsensus():
    reports = {"a": rep(f("db/q.py", 1, 4, C, "rce", 0.9)), "b": rep(f("db/q.py", 9, 9, L, "nit", 0.9))}
    res = run(reports, strategy="two_phase_commit")
    assert res.findings == []
    assert res.consensus.uncertainties == [NO_QUORUM, "db/q.py:1-4 unconfirmed: rce", "db/q.py:9-9 unconfirmed: nit"]
    assert consensus_error(res) is ErrorCode.ECONSENSUS
    assert should_escalate(res, reports, [], threshold=0.6) == ["no_quorum"]


def test_two_phase_commit_same_agent_twice_is_not_a_quorum():
    reports = {"a": rep(f("db/q.py", 1, 4, H, "x", 0.9), f("db/q.py", 2, 2, H, "x", 0.9)), "b": rep()}
    res = run(reports, strategy="two_phase_commit")
    assert res.findings == [] and res.consensus.uncertainties[0] == NO_QUORUM


def test_two_phase_commit_quorum_parameter():
    reports = {n: rep(f("db/q.py", 1, 1, H, n, 0.9)) for n in ("a", "b", "c")}
    assert len(run(reports, strategy="two_phase_commit", quorum=3).findings) == 1
    assert run(reports, strategy="two_phase_commit", quorum=4).findings == []


# --- independent sources (spec §19 consensus poisoning) -----------------------------------------


def test_agents_on_one_model_are_one_source_for_quorum_and_confidence():
    """Two agents behind the same model (say, two prompts on one model) that agree
    on a critical finding are one source: no 2PC quorum (ECONSENSUS, escalate), and
    the noisy-OR confidence counts the model once. A second, independent source
    (a tool) makes the quorum and raises the confidence."""
    poison = {n: rep(f("auth/jwt.py", 10, 10, C, "drop the signature check", 0.8)) for n in ("rev.a", "rev.b")}
    same = {"rev.a": "model:openai_compat:m", "rev.b": "model:openai_compat:m", "lint": "tool:ruff"}
    res = run(poison, strategy="two_phase_commit", sources=same)
    assert res.findings == [] and res.consensus.uncertainties[0] == NO_QUORUM
    assert consensus_error(res) is ErrorCode.ECONSENSUS
    # Without the source map the two agents would have been taken as independent.
    assert len(run(poison, strategy="two_phase_commit").findings) == 1
    union = run(poison, sources=same).findings[0]
    assert union.confidence == 0.8 and union.provenance == ["rev.a#0", "rev.b#0"]
    assert run(poison).findings[0].confidence == 0.96
    independent = {**poison, "lint": rep(f("auth/jwt.py", 10, 10, H, "jwt decode without verify", 0.5))}
    res = run(independent, strategy="two_phase_commit", sources=same)
    assert [x.provenance for x in res.findings] == [["rev.a#0", "rev.b#0", "lint#0"]]
    assert res.findings[0].confidence == 0.9


def test_a_lone_source_under_threshold_stays_an_uncertainty_even_from_two_agents():
    reports = {n: rep(f("db/q.py", 3, 3, M, "maybe", 0.4)) for n in ("rev.a", "rev.b")}
    res = run(reports, sources={"rev.a": "model:x:m", "rev.b": "model:x:m"})
    assert res.consensus.uncertainties == ["db/q.py:3-3 maybe"]
    assert run(reports).consensus.uncertainties == []


# --- champion_challenger -------------------------------------------------------------------------


def test_champion_is_the_cheapest_acceptable_report():
    reports = {
        "summarizer.local": rep(f("db/q.py", 1, 1, M, "cheap view", 0.7)),
        "reviewer.gemini": rep(f("db/q.py", 1, 1, H, "costly view", 0.9), f("db/q.py", 9, 9, H, "missed", 0.9)),
        "tiny": rep(f("db/q.py", 5, 5, M, "unsure", 0.2)),
    }
    costs = {"summarizer.local": 0, "reviewer.gemini": 30_000, "tiny": 0}
    res = run(reports, strategy="champion_challenger", costs_usd_micros=costs, threshold=0.6)
    assert [(x.claim, x.provenance) for x in res.findings] == [("cheap view", ["summarizer.local#0"])]
    assert res.consensus.uncertainties == [
        "db/q.py:9-9 challenger reviewer.gemini: missed",  # severity first, as findings
        "db/q.py:5-5 challenger tiny: unsure",
    ]
    # Raise the bar: only gemini qualifies.
    res = run(reports, strategy="champion_challenger", costs_usd_micros=costs, threshold=0.8)
    assert [x.claim for x in res.findings] == ["costly view", "missed"]


def test_champion_none_acceptable_falls_back_to_most_confident_and_flags():
    reports = {"a": rep(f("db/q.py", 1, 1, M, "a", 0.3)), "b": rep(f("db/q.py", 2, 2, M, "b", 0.5))}
    res = run(reports, strategy="champion_challenger", threshold=0.6)
    assert [x.claim for x in res.findings] == ["b"]
    assert res.consensus.uncertainties[0] == NO_CHAMPION
    assert should_escalate(res, reports, [], threshold=0.6) == ["no_champion"]


def test_champion_hallucinations_do_not_make_a_report_acceptable():
    reports = {"liar": rep(f("ghost.py", 1, 1, H, "x", 1.0)), "honest": rep(f("db/q.py", 1, 1, H, "y", 0.7))}
    res = run(reports, strategy="champion_challenger", costs_usd_micros={"liar": 0, "honest": 10})
    assert [x.claim for x in res.findings] == ["y"]


def test_report_confidence():
    assert report_confidence(rep(f("x", 1, 1, conf=0.2), f("x", 2, 2, conf=0.6))) == pytest.approx(0.4)
    assert report_confidence(rep(f("x", 1, 1, conf=0.8)), [0.5]) == 0.4
    assert report_confidence(rep(confidence=0.9)) == 0.9
    assert report_confidence(rep()) == 0.0


# --- escalation ----------------------------------------------------------------------------------


def _esc(reports, triggers, threshold=0.6, strategy="union_tiebreak", files=FILES):
    return should_escalate(run(reports, strategy=strategy), reports, triggers, threshold=threshold, files=files)


ALL = ["low_conf", "disagree_high", "disagreement", "no_findings", "weak_citations", "test_fail"]


@pytest.mark.parametrize(
    ("reports", "fired"),
    [
        # confident, agreeing, grounded: nothing fires
        ({"a": rep(f("db/q.py", 1, 2, H, "x", 0.9)), "b": rep(f("db/q.py", 2, 3, H, "y", 0.9))}, []),
        # low mean confidence of merged findings
        ({"a": rep(f("db/q.py", 1, 2, H, "x", 0.3))}, ["low_conf"]),
        # a report states low confidence
        ({"a": rep(f("db/q.py", 1, 2, H, "x", 0.9)), "b": rep(confidence=0.2)}, ["low_conf"]),
        # two voices, disjoint: agreement 0
        (
            {"a": rep(f("db/q.py", 1, 2, H, "x", 0.9)), "b": rep(f("db/q.py", 9, 9, H, "y", 0.9))},
            ["disagree_high", "disagreement"],
        ),
        # one voice and one clean report: agreement 0, but not two voices
        ({"a": rep(f("db/q.py", 1, 2, H, "x", 0.9)), "b": rep(confidence=0.9)}, []),
        ({"a": rep(confidence=0.9)}, ["no_findings"]),
        # hallucinated citations
        ({"a": rep(f("ghost.py", 1, 2, H, "x", 0.9), f("db/q.py", 1, 1, H, "y", 0.9))}, ["weak_citations"]),
        ({"a": rep(f("tests/test_q.py", 3, 9, H, "test_q failed", 0.9, rule=TEST_FAIL_RULE))}, ["test_fail"]),
    ],
)
def test_should_escalate_table(reports, fired):
    assert _esc(reports, ALL) == fired


def test_should_escalate_only_reports_listed_triggers_in_policy_order():
    reports = {"a": rep(confidence=0.1)}
    assert _esc(reports, ["no_findings", "low_conf"]) == ["no_findings", "low_conf"]
    assert _esc(reports, ["test_fail"]) == []
    assert _esc(reports, ["low_conf", "low_conf"]) == ["low_conf"]


def test_should_escalate_threshold_on_agreement():
    # agreement 0.5: fires when 0.5 < 1 - threshold
    reports = {
        "a": rep(f("db/q.py", 1, 1, H, "x", 0.9), f("db/q.py", 9, 9, H, "z", 0.9)),
        "b": rep(f("db/q.py", 1, 1, H, "y", 0.9)),
    }
    assert _esc(reports, ["disagreement"], threshold=0.4) == ["disagreement"]
    assert _esc(reports, ["disagreement"], threshold=0.5) == []


def test_weak_citations_needs_files():
    reports = {"a": rep(f("ghost.py", 1, 2, H, "x", 0.9))}
    assert _esc(reports, ["weak_citations"], files=None) == []


def test_unknown_trigger_is_refused():
    with pytest.raises(ValueError, match="unknown escalation trigger"):
        should_escalate(run({}), {}, ["low_confidence"], threshold=0.5)
    assert set(ALL) == TRIGGERS


# --- properties ----------------------------------------------------------------------------------

AGENTS = ["a", "b", "c", "d"]
SEVS = list(Severity)


@st.composite
def findings_st(draw):
    file = draw(st.sampled_from(["auth/jwt.py", "db/q.py", "ghost.py"]))
    start = draw(st.integers(1, 40))
    return f(
        file,
        start,
        start + draw(st.integers(0, 6)),
        draw(st.sampled_from(SEVS)),
        draw(st.sampled_from(["x", "y", "z"])),
        draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0])),
        ref=draw(st.sampled_from(["", "r1", "r2"])),
        tests=draw(st.lists(st.sampled_from(["t1", "t2"]), max_size=2)),
    )


reports_st = st.dictionaries(
    st.sampled_from(AGENTS), st.builds(lambda fs: rep(*fs), st.lists(findings_st(), max_size=6))
)
merge_kw_st = st.fixed_dictionaries(
    {
        "strategy": st.sampled_from(["union_tiebreak", "two_phase_commit", "champion_challenger"]),
        "line_slack": st.integers(0, 3),
        "min_severity": st.none() | st.sampled_from(SEVS),
        "win_rates": st.fixed_dictionaries({a: st.sampled_from([0.5, 0.7]) for a in AGENTS}),
        "costs_usd_micros": st.fixed_dictionaries({a: st.sampled_from([0, 100]) for a in AGENTS}),
    }
)


@settings(max_examples=150, deadline=None)
@given(reports_st, merge_kw_st, st.randoms(use_true_random=False))
def test_merge_is_deterministic_in_any_mapping_order(reports, kw, rnd: random.Random):
    names = list(reports)
    rnd.shuffle(names)
    shuffled = {n: reports[n] for n in names}
    wr = dict(reversed(list(kw["win_rates"].items())))
    a = msgspec.json.encode(run(reports, **kw))
    b = msgspec.json.encode(run(shuffled, **{**kw, "win_rates": wr}))
    assert a == b


@settings(max_examples=300, deadline=None)
@given(reports_st, merge_kw_st)
def test_union_accounts_for_every_cited_finding_exactly_once(reports, kw):
    kw = {**kw, "strategy": "union_tiebreak", "min_severity": None}
    res = run(reports, **kw)
    lines = count_lines(FILES)
    expected = sorted(
        f"{agent}#{x.ref or i}"
        for agent, r in reports.items()
        for i, x in enumerate(r.findings)
        if x.file in lines and x.start <= lines[x.file]
    )
    assert sorted(p for x in res.findings for p in x.provenance) == expected
    assert [x.id for x in res.findings] == [f"F-{i}" for i in range(1, len(res.findings) + 1)]
    # Merged findings of one file never overlap (within the slack).
    by_file: dict[str, list[tuple[int, int]]] = {}
    for x in res.findings:
        lo, hi = map(int, x.span.split("-"))
        by_file.setdefault(x.file, []).append((lo, hi))
    for spans in by_file.values():
        spans.sort()
        assert all(b[0] > a[1] + kw["line_slack"] for a, b in itertools.pairwise(spans))
    assert all(0.0 <= x.confidence <= 1.0 for x in res.findings)
    assert 0.0 <= res.consensus.agreement <= 1.0
    msgspec.json.decode(msgspec.json.encode(res), type=Result)  # schema constraints hold


@settings(max_examples=200, deadline=None)
@given(reports_st, st.integers(0, 3))
def test_agreement_bounds_and_identical_reports(reports, slack):
    assert 0.0 <= agreement(reports, line_slack=slack) <= 1.0
    if reports:
        only = next(iter(reports.values()))
        assert agreement({"p": only, "q": only}, line_slack=slack) == 1.0


# --- change-scoped evidence, claim similarity, per-finding scores, K-of-N quorum (issue 9) ------


def test_change_evidence_inside_the_change_or_naming_a_test():
    from atp_router.consensus.scorers import CHANGE_SLACK, OFF_CHANGE, change_evidence

    changed = {"db/q.py": {10, 11}}
    assert change_evidence(f("db/q.py", 12, 12), changed) == 1.0
    assert change_evidence(f("db/q.py", 11 + CHANGE_SLACK, 20), changed) == 1.0
    assert change_evidence(f("db/q.py", 12 + CHANGE_SLACK, 20), changed) == OFF_CHANGE
    assert change_evidence(f("db/q.py", 1, 10 - CHANGE_SLACK - 1), changed) == OFF_CHANGE
    assert change_evidence(f("auth/jwt.py", 10, 10), changed) == OFF_CHANGE  # a file the diff did not touch
    assert change_evidence(f("auth/jwt.py", 10, 10, tests=["test_jwt"]), changed) == 1.0
    assert change_evidence(f("auth/jwt.py", 10, 10, rule=TEST_FAIL_RULE), changed) == 1.0
    assert change_evidence(f("auth/jwt.py", 10, 10), None) == 1.0  # no diff known: not checked


def test_off_change_citation_halves_its_weight_in_the_merge():
    reports = {"reviewer.gemini": rep(f("auth/jwt.py", 100, 100, H, "far away", 0.8))}
    inside = run(reports, changed={"auth/jwt.py": {100}}).findings[0]
    outside = run(reports, changed={"auth/jwt.py": {5}}).findings[0]
    assert inside.scores.evidence == 1.0 and inside.confidence == 0.8
    assert outside.scores.evidence == 0.5 and outside.confidence == 0.4


def test_claim_similarity():
    from atp_router.consensus.scorers import claim_similarity

    assert claim_similarity("S301: pickle loads untrusted data", "B301: Pickle loads untrusted data") == 1.0
    assert claim_similarity("missing audience check", "audience not checked") == pytest.approx(1 / 5)
    assert claim_similarity("", "") == 1.0
    assert claim_similarity("a b", "") == 0.0


def test_per_finding_scores_agreement_is_the_share_of_reporting_sources():
    reports = {
        "reviewer.gemini": rep(f("db/q.py", 4, 6, H, "SQL injection via f-string", 0.9)),
        "summarizer.local": rep(f("db/q.py", 5, 5, H, "f-string SQL injection", 0.6)),
        "reviewer.gpt5": rep(f("auth/jwt.py", 1, 1, L, "nit", 0.9)),
    }
    by_file = {x.file: x for x in run(reports, costs_usd_micros={"reviewer.gpt5": 1000}).findings}
    q, j = by_file["db/q.py"].scores, by_file["auth/jwt.py"].scores
    assert q.agreement == round(2 / 3, 4) and j.agreement == round(1 / 3, 4)
    assert q.claims == round(4 / 5, 4) and j.claims == 1.0  # {sql, injection, f, string} of {…, via}
    assert q.cost == 1.0 and j.cost == 0.5  # the dearest contributor, a low finding


def test_two_phase_commit_k_of_n_quorum():
    reports = {
        "a": rep(f("db/q.py", 4, 4, M, "x", 0.9)),
        "b": rep(f("db/q.py", 4, 4, M, "x", 0.9)),
        "c": rep(f("db/q.py", 4, 4, M, "x", 0.9), f("db/q.py", 20, 20, M, "y", 0.9)),
    }
    assert len(run(reports, strategy="two_phase_commit", quorum=3).findings) == 1  # only line 4 has 3 ACKs
    assert len(run(reports, strategy="two_phase_commit", quorum=2).findings) == 1
    assert len(run(reports, strategy="two_phase_commit", quorum=1).findings) == 2
    two = {"a": reports["a"], "c": reports["c"]}
    assert run(two, strategy="two_phase_commit", quorum=3).findings == []


def test_policy_quorum_is_bounded_by_its_agents():
    from atp_router.policy.rib import PolicySpec, SpecError

    ok = msgspec.convert({"match": {}, "fanout": ["a", "b"], "consensus": "two_phase_commit", "quorum": 2}, PolicySpec)
    assert ok.quorum == 2
    with pytest.raises((SpecError, msgspec.ValidationError), match="quorum 3 exceeds the 2 fanout"):
        msgspec.convert({"match": {}, "fanout": ["a", "b"], "quorum": 3}, PolicySpec)
    esc = msgspec.convert({"match": {}, "fanout": ["a", "b"], "quorum": 3,
                           "escalation": {"on": ["low_conf"], "to": "c"}}, PolicySpec)
    assert esc.quorum == 3


def test_calibration_replaces_stated_confidence_with_the_measured_one():
    from atp_router.policy.rib import CalibrationSpec, SpecError

    noisy = CalibrationSpec(findings=45, matched=0)  # measured: none of 45 findings was a defect
    sure = CalibrationSpec(findings=10, matched=9, weight=10)
    assert noisy.apply(0.7) == pytest.approx(5 * 0.7 / 50)
    assert sure.apply(0.5) == pytest.approx((9 + 5) / 20)
    with pytest.raises(SpecError, match="matched 3 exceeds findings 2"):
        CalibrationSpec(findings=2, matched=3)
    reports = {"lint.ruff": rep(f("db/q.py", 4, 4, M, "unused import", 0.7)),
               "sec.bandit": rep(f("db/q.py", 20, 20, M, "pickle", 0.5))}
    out = {x.file + x.span: x for x in run(reports, calibration={"lint.ruff": noisy.apply, "sec.bandit": sure.apply})
           .findings}
    assert out["db/q.py4-4"].confidence == 0.07 and out["db/q.py20-20"].confidence == 0.7
    # Below the threshold the union lists the calibrated-down finding as uncertain too.
    assert any("unused import" in u for u in run(reports, calibration={"lint.ruff": noisy.apply})
               .consensus.uncertainties)


# --- correlated analysers are one voter (issue 23 item 2) ---------------------------------------

TOOLS = {"lint.ruff": "tool:ruff", "lint.pylint": "tool:pylint", "types.mypy": "tool:mypy",
         "sec.bandit": "tool:bandit", "rules.semgrep": "tool:semgrep"}


@pytest.mark.parametrize(
    ("flags", "committed", "why"),
    [
        # ruff F821, pylint E0602 and mypy name-defined: one pyflakes check run three times.
        ({"lint.ruff": "F821", "lint.pylint": "E0602", "types.mypy": "name-defined"}, False, "one undefined name"),
        ({"lint.ruff": "F401", "lint.pylint": "W0611"}, False, "one unused import"),
        ({"lint.ruff": "F841", "lint.pylint": "unused-variable"}, False, "pylint's symbolic name too"),
        ({"lint.ruff": "F823", "types.mypy": "used-before-def"}, False, "one used-before-assignment"),
        ({"lint.ruff": "S602", "sec.bandit": "B602"}, False, "ruff's S602 is bandit's B602"),
        ({"lint.ruff": "PLE0604", "lint.pylint": "E0604"}, False, "ruff's PLE0604 is pylint's E0604"),
        # Different checks at one place are independent voters.
        ({"lint.ruff": "F821", "sec.bandit": "B602"}, True, "undefined name and shell=True"),
        ({"lint.ruff": "F821", "lint.pylint": "W0611"}, True, "two different pyflakes classes"),
        ({"lint.ruff": "B006", "lint.pylint": "W0102"}, True, "no declared equivalence"),
        ({"lint.ruff": "F821", "rules.semgrep": "regex-findall-indexed"}, True, "semgrep has no pyflakes twin"),
        ({"lint.ruff": "S602", "sec.bandit": "B604"}, True, "different bandit tests"),
    ],
)
def test_quorum_counts_correlated_analysers_once(flags, committed, why):
    reports = {a: rep(f("db/q.py", 5, 5, M, f"{a} says {r}", 0.9, rule=r)) for a, r in flags.items()}
    res = run(reports, strategy="two_phase_commit", quorum=2, sources=TOOLS)
    assert bool(res.findings) is committed, why
    if not committed:
        assert res.consensus.uncertainties[0].startswith("db/q.py:5-5 unconfirmed")


def test_correlated_analysers_count_once_in_confidence_and_agreement_too():
    reports = {"lint.ruff": rep(f("db/q.py", 5, 5, H, "F821 undefined name", 0.8, rule="F821")),
               "lint.pylint": rep(f("db/q.py", 5, 5, H, "E0602 undefined variable", 0.8, rule="E0602")),
               "sec.bandit": rep(f("db/q.py", 20, 20, M, "pickle", 0.5, rule="B301"))}
    [a, b] = run(reports, sources=TOOLS).findings  # union: both places kept
    # One voter of the three sources that reported (was 2/3), and its confidence 0.8, not 1 - 0.2 × 0.2.
    assert a.confidence == 0.8 and a.scores.agreement == round(1 / 3, 4)
    assert b.scores.agreement == round(1 / 3, 4)
    independent = run({**reports, "lint.pylint": rep(f("db/q.py", 5, 5, H, "other", 0.8, rule="W0101"))},
                      sources=TOOLS).findings[0]
    assert independent.confidence == 0.96  # 1 - 0.2 × 0.2: two voters


def test_an_analyser_repeating_itself_with_a_shared_class_is_still_one_voter():
    # ruff's F821 and its B006 at one place, pylint's E0602 there too: ruff and pylint
    # share undefined-name, so the three findings are one voter, not two.
    reports = {"lint.ruff": rep(f("db/q.py", 5, 5, M, "x", 0.9, rule="F821"),
                                f("db/q.py", 5, 5, M, "y", 0.9, rule="B006")),
               "lint.pylint": rep(f("db/q.py", 5, 5, M, "z", 0.9, rule="E0602"))}
    assert run(reports, strategy="two_phase_commit", sources=TOOLS).findings == []


@pytest.mark.parametrize(
    ("analyser", "rule", "cls"),
    [
        ("ruff", "F821", "pyflakes:undefined-name"),
        ("pylint", "undefined-variable", "pyflakes:undefined-name"),
        ("mypy", "name-defined", "pyflakes:undefined-name"),
        ("mypy", "arg-type", None),
        ("ruff", "S301", "bandit:B301"),
        ("bandit", "B301", "bandit:B301"),
        ("ruff", "PLW0120", "pylint:W0120"),
        ("pylint", "W0120", "pylint:W0120"),
        ("ruff", "E501", None),
        ("semgrep", "F821", None),  # the code alone is not the class: it is ruff's F821
        ("ruff", None, None),
    ],
)
def test_rule_class_table(analyser, rule, cls):
    assert rule_class(analyser, rule) == cls


def test_voters_are_transitive_and_named_by_their_sources():
    v = voters([("tool:ruff", "pyflakes:undefined-name"), ("tool:pylint", "pyflakes:undefined-name"),
                ("tool:pylint", "pylint:W0101"), ("tool:mypy", None), ("tool:bandit", "bandit:B602")])
    assert v == {"tool:ruff": "tool:pylint+tool:ruff", "tool:pylint": "tool:pylint+tool:ruff",
                 "tool:mypy": "tool:mypy", "tool:bandit": "tool:bandit"}
    assert analyser_of("lint.ruff", "tool:ruff") == "ruff" and analyser_of("ruff", None) == "ruff"
    assert analyser_of("rev", "model:openai_compat:m") == "rev"
