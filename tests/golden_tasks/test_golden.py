"""The golden code-review tasks through a real router with the default RIB, and
the harness's scoring rules on hand-made cases (golden README: same file, line
ranges overlapping within ±3; advisories scored per task)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from .harness import (
    Expected,
    GoldenTask,
    TaskRun,
    changed_line_baseline,
    check_final,
    format_report,
    is_escalated,
    load_tasks,
    matches,
    parse_span,
    percentile,
    run_tasks,
    score_task,
    summarize,
)

# Measured with the shipped default RIB (ruff, bandit, mypy, semgrep; scope changed):
# 10 tasks, 10 units (README "Applications"). Raise these when the default RIB
# catches more; never lower them.
FLOOR_TASKS_CAUGHT = 10
FLOOR_UNITS_CAUGHT = 10
#: Catches whose claim names the real defect (not just a line nearby).
MUST_CATCH = {"bugsinpy-thefuck-23", "bugsinpy-thefuck-2", "cve-intro-e75e35869473"}
DEFAULT_AGENTS = ["lint.ruff", "rules.semgrep", "sec.bandit", "types.mypy"]


def _exp(file: str = "a.py", start: int = 10, end: int = 12) -> Expected:
    return Expected(file=file, start=start, end=end, kind="changed", severity="medium", claim="c", provenance="p")


def _task(expected: list[Expected], source: str = "BugsInPy", diff: str = "") -> GoldenTask:
    return GoldenTask(id="t", source=source, repo="r", base_commit="b", buggy_commit="c", diff=diff,
                      files={"a.py": "x\n" * 50}, expected=expected)


def _final(spans: list[tuple[str, str]], *, tokens: int = 0, usd: float = 0.0, latency_ms: float = 1.0,
           agreement: float = 1.0, uncertainties: list[str] | None = None) -> dict[str, Any]:
    findings = [
        {"id": f"F-{i}", "severity": "medium", "file": file, "span": span, "claim": f"claim {i}",
         "confidence": 0.5, "provenance": [f"lint.ruff#{i}"]}
        for i, (file, span) in enumerate(spans, 1)
    ]
    return {
        "result": {"findings": findings,
                   "consensus": {"strategy": "union_tiebreak", "agreement": agreement,
                                 "uncertainties": uncertainties or []}},
        "telemetry": {"tokens": tokens, "usd": usd, "latency_ms": latency_ms},
    }


def _run(final: dict[str, Any] | None, **kw: Any) -> TaskRun:
    return TaskRun(id="t", final=final, events=["SYN_ACK", "FINAL", "FIN"], **kw)


# --- the match rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "hit"),
    [
        (10, 12, True),  # the expected lines themselves
        (15, 15, True),  # end + 3: last line inside the slack
        (16, 16, False),  # end + 4
        (7, 7, True),  # start - 3
        (6, 6, False),  # start - 4
        (1, 7, True),  # a range ending exactly at start - 3
        (1, 6, False),
        (15, 40, True),  # a range starting exactly at end + 3
        (16, 40, False),
        (1, 100, True),  # covering the expected lines
    ],
)
def test_match_rule_slack_edges(start: int, end: int, hit: bool) -> None:
    assert matches("a.py", start, end, _exp()) is hit
    assert matches("a.py", start, end, {"file": "a.py", "start": 10, "end": 12}) is hit


def test_match_needs_the_same_file() -> None:
    assert not matches("b.py", 10, 12, _exp())
    assert not matches("x/a.py", 10, 12, _exp())
    assert matches("a.py", 13, 13, _exp(), slack=1) and not matches("a.py", 14, 14, _exp(), slack=1)


def test_parse_span() -> None:
    assert parse_span("45-80") == (45, 80)
    assert parse_span("7") == (7, 7)
    for bad in ("0-3", "9-3", "x", "3-", "-3", ""):
        with pytest.raises(ValueError):
            parse_span(bad)


# --- per-task scores ---------------------------------------------------------------------


def test_score_per_expected_finding() -> None:
    task = _task([_exp(start=10, end=12), _exp(start=40, end=40)])
    # 14 and 11 hit the first defect; 30 matches nothing (and counts against precision).
    score = score_task(task, _run(_final([("a.py", "14-14"), ("a.py", "30-30"), ("a.py", "11-11")])))
    assert score.caught == [True, False]
    assert (score.units, score.units_caught, score.task_caught) == (2, 1, True)
    assert (score.findings, score.matched) == (3, 2)
    assert score.matched_claims == ["a.py:14-14 claim 1", "a.py:11-11 claim 3"]


def test_score_advisory_per_task() -> None:
    exp = [_exp(start=10, end=10), _exp(start=100, end=110), _exp(file="b.py", start=5, end=5)]
    hit = score_task(_task(exp, source="advisory-fix"), _run(_final([("a.py", "104-104")])))
    assert hit.caught == [False, True, False] and (hit.units, hit.units_caught) == (1, 1)
    miss = score_task(_task(exp, source="advisory-introducing-commit"), _run(_final([("a.py", "60-60")])))
    assert (miss.units, miss.units_caught, miss.task_caught, miss.matched) == (1, 0, False, 0)
    # The same expectations as a BugsInPy task are three units.
    per_finding = score_task(_task(exp), _run(_final([("a.py", "104-104")])))
    assert (per_finding.units, per_finding.units_caught) == (3, 1)


def test_score_refuses_a_run_without_final_or_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="no FINAL"):
        score_task(_task([_exp()]), _run(None))
    bad = _final([("a.py", "12-3")])
    with pytest.raises(ValueError, match="span"):
        score_task(_task([_exp()]), _run(bad))


def test_check_final_is_the_7_3_shape() -> None:
    good = _final([("a.py", "1-2"), ("a.py", "5")], tokens=10, usd=0.5)
    final = check_final(good)
    assert [f.span for f in final.result.findings] == ["1-2", "5"] and final.telemetry.tokens == 10
    no_telemetry = {k: v for k, v in good.items() if k != "telemetry"}
    extra_field = {**good, "debug": True}
    dup_ids = _final([("a.py", "1"), ("a.py", "2")])
    dup_ids["result"]["findings"][1]["id"] = "F-1"
    no_provenance = _final([("a.py", "1")])
    no_provenance["result"]["findings"][0]["provenance"] = []
    bad_severity = _final([("a.py", "1")])
    bad_severity["result"]["findings"][0]["severity"] = "moderate"
    for bad in (no_telemetry, extra_field, dup_ids, no_provenance, bad_severity, {"result": None}):
        with pytest.raises(ValueError):
            check_final(bad)


def test_escalation_is_the_marker_or_an_agent_outside_the_route() -> None:
    plain = check_final(_final([]))
    marked = check_final(_final([], uncertainties=["X509 flow", "escalated on low_conf"]))
    assert not is_escalated(plain, ["lint.ruff", "sec.bandit"], ["lint.ruff", "sec.bandit"])
    assert is_escalated(marked, ["lint.ruff"], ["lint.ruff"])
    assert is_escalated(plain, ["lint.ruff"], ["lint.ruff", "reviewer.local"])


# --- aggregates ---------------------------------------------------------------------------


def test_percentile_nearest_rank() -> None:
    assert percentile([40, 10, 30, 20], 50) == 20
    assert percentile([40, 10, 30, 20], 95) == 40
    assert percentile(list(range(1, 21)), 95) == 19
    assert percentile(list(range(1, 21)), 100) == 20
    assert percentile([5.0], 50) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 0)


def test_summarize() -> None:
    a = score_task(_task([_exp(), _exp(start=40, end=40)]),
                   _run(_final([("a.py", "12"), ("a.py", "30"), ("a.py", "41")], tokens=100, usd=0.25,
                               latency_ms=10, agreement=0.5)))
    b = score_task(_task([_exp()], source="advisory-fix"),
                   _run(_final([], tokens=50, usd=0.5, latency_ms=40, agreement=1.0,
                               uncertainties=["escalated on no_findings"]), wall_ms=45.0))
    c = score_task(_task([_exp()]), _run(_final([("a.py", "11")], latency_ms=20, agreement=0.0)))
    r = summarize([a, b, c])
    assert (r.n_tasks, r.tasks_caught) == (3, 2)
    assert (r.units, r.units_caught) == (2 + 1 + 1, 2 + 0 + 1)
    assert r.recall == pytest.approx(3 / 4)
    assert (r.findings, r.matched) == (4, 3) and r.precision == pytest.approx(3 / 4)
    assert (r.tokens, r.usd) == (150, pytest.approx(0.75))
    assert (r.latency_p50_ms, r.latency_p95_ms) == (20, 40)
    assert r.wall_p95_ms == 45.0
    assert r.escalation_rate == pytest.approx(1 / 3)
    assert r.agreement_mean == pytest.approx(0.5)
    # Nothing reported at all: precision is undefined, not 0 or 1.
    assert summarize([b]).precision is None
    with pytest.raises(ValueError):
        summarize([])
    assert "tasks caught      2/3" in format_report(r)


def test_changed_line_baseline() -> None:
    diff = "--- a/a.py\n+++ b/a.py\n@@ -20,3 +20,3 @@\n x\n-y\n+z\n x\n"  # changes line 21
    near = _task([_exp(start=24, end=24)], diff=diff)  # 21 is within 3 of 24
    far = _task([_exp(start=25, end=25)], diff=diff)
    b = changed_line_baseline([near, far])
    assert (b.tasks_caught, b.n_tasks, b.units_caught, b.units, b.findings, b.matched) == (1, 2, 1, 2, 2, 1)


# --- the real router, the default RIB, every golden task -----------------------------------


async def test_golden_tasks_through_the_default_rib(nursery, tmp_path) -> None:
    """The shipped ``policies/`` (not the mechanics tests' two-tool RIB)."""
    import shutil

    from tests.conftest import ROOT, start_router

    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    router_env = await start_router(nursery, tmp_path / "policies", state_dir=tmp_path / "state")
    tasks = load_tasks()
    assert len(tasks) == 26
    runs = await run_tasks(router_env.url, tasks, concurrency=2)
    assert [r.id for r in runs] == [t.id for t in tasks]
    for run in runs:
        # (a) every stream: SYN-ACK, one report per next-hop, one FINAL of the §7.3 shape, FIN.
        assert run.events[0] == "SYN_ACK" and run.events[-1] == "FIN", (run.id, run.events)
        assert run.events.count("FINAL") == 1 and "RST" not in run.events, (run.id, run.events)
        assert run.errors == [], (run.id, run.errors)
        assert sorted(run.reporters) == sorted(run.next_hops) == DEFAULT_AGENTS, run.id
        check_final(run.final)
    scores = [score_task(t, r) for t, r in zip(tasks, runs, strict=True)]
    report = summarize(scores)
    print("\n" + format_report(report, title="default RIB"))
    # (c) what the default RIB catches today is the floor.
    assert report.tasks_caught >= FLOOR_TASKS_CAUGHT
    assert report.units_caught >= FLOOR_UNITS_CAUGHT
    caught = {s.id for s in scores if s.task_caught}
    assert MUST_CATCH <= caught, caught
    [f23] = [msgspec.convert(r.final, dict) for r in runs if r.id == "bugsinpy-thefuck-23"]
    pickle = [f for f in f23["result"]["findings"] if f["file"] == "thefuck/utils.py" and f["span"] == "183-183"]
    assert len(pickle) == 1 and {"lint.ruff", "sec.bandit"} <= {p.split("#")[0] for p in pickle[0]["provenance"]}
    # Every merged finding carries its consensus scores (spec §7.1).
    assert all(f["scores"]["evidence"] == 1.0 for f in f23["result"]["findings"])
    assert report.escalation_rate == 0.0  # the default RIB has no escalation target
