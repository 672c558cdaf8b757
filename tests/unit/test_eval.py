"""``atp-router eval`` (issue 9 item 8): the scoring rules on hand-made cases, the
task-file reader, the comparison and its exact last line, and real runs through
real routers — private ones per RIB variant, and a running one whose RIB the
command hot-swaps and puts back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from atp_router.adapters import local_model
from atp_router.deploy.cli import serve_private
from atp_router.review import eval as ev
from atp_router.review.eval import (
    Expected,
    GoldenTask,
    TaskRun,
    best_variant,
    calibration,
    eval_line,
    f1_score,
    load_tasks,
    score_task,
    summarize,
)
from atp_router.security.identity import Role
from tests.conftest import MECHANICS_RIB, ROOT, SHARED
from tests.helpers import start_router_on

GOLDEN = SHARED / "golden" / "dev.jsonl"
#: ``atp-router eval`` as the router's CLI runs it.
eval_main = partial(ev.main, serve_router=serve_private, model_servers=local_model)
VARIANTS = ROOT / "examples" / "eval" / "policies"
EVAL_LINE = re.compile(r"^EVAL tasks=\d+ caught=\d+ recall=\d\.\d{3} precision=\d\.\d{3} f1=\d\.\d{3} "
                       r"usd_per_task=\d+\.\d{6}$")


def _exp(file: str = "a.py", start: int = 10, end: int = 12) -> Expected:
    return Expected(file=file, start=start, end=end)


def _task(expected: list[Expected], source: str = "BugsInPy", tid: str = "t") -> GoldenTask:
    return GoldenTask(id=tid, source=source, diff="", files={"a.py": "x\n" * 50}, expected=expected)


def _final(findings: list[tuple[str, str, float]], *, usd: float = 0.0) -> dict[str, Any]:
    return {
        "result": {"findings": [{"id": f"F-{i}", "severity": "medium", "file": file, "span": span, "claim": "c",
                                 "confidence": conf, "provenance": [f"lint.ruff#{i}"]}
                                for i, (file, span, conf) in enumerate(findings, 1)],
                   "consensus": {"strategy": "union_tiebreak", "agreement": 1.0, "uncertainties": []}},
        "telemetry": {"tokens": 0, "usd": usd, "latency_ms": 5.0},
    }


def test_recall_at_n_counts_only_the_first_ranked_findings() -> None:
    task = _task([_exp(start=10, end=10), _exp(start=40, end=40)])
    # The hit on 40 is the least confident of three: recall@2 misses it, recall@3 has it.
    run = TaskRun(id="t", final=_final([("a.py", "10", 0.9), ("a.py", "25", 0.8), ("a.py", "40", 0.1)]),
                  events=["FINAL"])
    assert score_task(task, run, top=2).units_caught_top == 1
    assert score_task(task, run, top=3).units_caught_top == 2
    r = summarize([score_task(task, run, top=2)], top=2)
    assert (r.recall, r.recall_at_top, r.top) == (1.0, 0.5, 2)
    assert r.precision == pytest.approx(2 / 3) and r.f1 == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))


def test_f1_and_the_exact_eval_line() -> None:
    assert f1_score(0.5, None) == 0.0 and f1_score(0.0, 0.0) == 0.0 and f1_score(1.0, 1.0) == 1.0
    task = _task([_exp()])
    nothing = summarize([score_task(task, TaskRun(id="t", final=_final([]), events=["FINAL"]))])
    assert nothing.precision is None and nothing.f1 == 0.0
    assert eval_line(nothing) == "EVAL tasks=1 caught=0 recall=0.000 precision=0.000 f1=0.000 usd_per_task=0.000000"
    hit = summarize([score_task(task, TaskRun(id="t", final=_final([("a.py", "11", 0.5)], usd=0.0125),
                                              events=["FINAL"]))])
    assert eval_line(hit) == "EVAL tasks=1 caught=1 recall=1.000 precision=1.000 f1=1.000 usd_per_task=0.012500"


def test_best_variant_is_f1_then_cost_then_recall() -> None:
    task = _task([_exp(), _exp(start=30, end=30)])

    def rep(spans: list[str], usd: float) -> ev.EvalReport:
        run = TaskRun(id="t", final=_final([("a.py", s, 0.5) for s in spans], usd=usd), events=["FINAL"])
        return summarize([score_task(task, run)])

    reports = {"cheap-half": rep(["11"], 0.0), "dear-half": rep(["11"], 0.5), "all": rep(["11", "30"], 0.9),
               "noisy": rep(["11", "30", "45", "47"], 0.0)}
    assert best_variant(reports) == "all"  # F1 1.0 beats everything, whatever it costs
    del reports["all"]
    # cheap-half and dear-half tie on F1 (0.667) and noisy has 0.667 too (r 1, p .5): cost, then recall.
    assert best_variant(reports) == "noisy"
    del reports["noisy"]
    assert best_variant(reports) == "cheap-half"
    with pytest.raises(ValueError):
        best_variant({})


def test_task_files_ignore_unknown_fields_and_refuse_bad_lines(tmp_path: Path) -> None:
    line = {"id": "x1", "diff": "", "files": {}, "expected": [{"file": "a.py", "start": 1, "end": 2, "new": 1}],
            "something_else": {"k": 1}}  # no buggy_commit, no source, unknown fields
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(line) + "\n\n")
    [t] = load_tasks(p)
    assert (t.id, t.buggy_commit, t.expected[0].kind) == ("x1", "", "changed")
    p.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: task id 'x1' repeats"):
        load_tasks(p)
    p.write_text(json.dumps(line) + "\n" + json.dumps({"id": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not a task"):
        load_tasks(p)


def test_per_agent_calibration_pools_raw_reports() -> None:
    task = _task([_exp()])
    run = TaskRun(id="t", final=_final([("a.py", "11", 0.5)]), events=["FINAL"],
                  reports={"lint.ruff": {"findings": [{"file": "a.py", "start": 11, "end": 11},
                                                      {"file": "a.py", "start": 40, "end": 41}]},
                           "sec.bandit": {"findings": []}})
    r = summarize([score_task(task, run)])
    cal = calibration({"v1": r, "v2": r})
    assert cal["lint.ruff"] == {"tasks": 2, "findings": 4, "matched": 2, "precision": 0.5}
    assert cal["sec.bandit"] == {"tasks": 2, "findings": 0, "matched": 0, "precision": None}


def _small_task_file(tmp_path: Path, ids: set[str]) -> Path:
    out = tmp_path / "tasks.jsonl"
    lines = [ln for ln in GOLDEN.read_text().splitlines() if json.loads(ln)["id"] in ids]
    out.write_text("\n".join(lines) + "\n")
    return out


def test_eval_command_compares_variants_through_private_routers(tmp_path: Path) -> None:
    tasks = _small_task_file(tmp_path, {"bugsinpy-thefuck-23", "bugsinpy-thefuck-2", "bugsinpy-thefuck-3"})
    png, js, cal = tmp_path / "e.png", tmp_path / "e.json", tmp_path / "cal.json"
    proc = subprocess.run(
        [sys.executable, "-m", "atp_router.deploy.cli", "eval", "--tasks", str(tasks), "--png", str(png), "--json", str(js),
         "--calibration", str(cal), "--policies", str(VARIANTS / "ruff.yaml"), str(VARIANTS / "bandit.yaml")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert EVAL_LINE.match(lines[-1]), lines[-1]
    reports = json.loads(js.read_text())
    assert set(reports) == {"ruff", "bandit"}
    for r in reports.values():
        assert r["n_tasks"] == 3 and r["tasks_caught"] == 1  # thefuck-23's pickle line, by either tool
    best = lines[-2].removeprefix("best: ")
    assert lines[-1] == eval_line(msgspec.convert(reports[best], ev.EvalReport))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import yaml

    from atp_router.policy.rib import CalibrationSpec

    measured = yaml.safe_load(cal.read_text())
    assert set(measured) == {"lint.ruff", "sec.bandit"}
    for spec in measured.values():  # each entry loads as the RIB key it is meant for
        assert msgspec.convert(spec, CalibrationSpec).matched >= 1
    assert re.search(r"^ruff\s+3\s+1\s+0\.\d{3}", proc.stdout, re.M)


def test_eval_command_reports_a_refused_rib_precisely(tmp_path: Path) -> None:
    tasks = _small_task_file(tmp_path, {"bugsinpy-thefuck-23"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: {}\npolicies:\n  - match: {task_type: code_review}\n    fanout: [nobody]\n")
    proc = subprocess.run([sys.executable, "-m", "atp_router.deploy.cli", "eval", "--tasks", str(tasks),
                           "--policies", str(bad), "--png", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "bad: refused RIB" in proc.stderr and "nobody" in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "atp_router.deploy.cli", "eval", "--tasks", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert missing.returncode == 2 and "none" in missing.stderr and "Traceback" not in missing.stderr


async def test_eval_against_a_running_router_swaps_variants_and_restores_its_rib(nursery, tmp_path: Path) -> None:
    rib = (MECHANICS_RIB / "default.yaml").read_text()
    env = await start_router_on(nursery, tmp_path, rib, client_tokens={"root": "tok-root"},
                                client_roles={"root": frozenset({Role.ADMIN, Role.CLIENT})}, state_dir=tmp_path / "s")
    tasks = _small_task_file(tmp_path, {"bugsinpy-thefuck-23"})
    before = env.router.gen.version
    argv = ["--tasks", str(tasks), "--url", env.url, "--token", "tok-root", "--png", str(tmp_path / "u.png"),
            "--json", str(tmp_path / "u.json"), "--policies", str(VARIANTS / "ruff.yaml")]
    code = await trio.to_thread.run_sync(eval_main, argv)
    assert code == 0
    report = json.loads((tmp_path / "u.json").read_text())["ruff"]
    assert report["tasks_caught"] == 1 and {a["agent"] for a in report["agents"]} == {"lint.ruff"}
    # The variant was loaded, then the router's own RIB file again: two generations later, default policies back.
    assert env.router.gen.version == before + 2
    assert {p.name for p in env.router.gen.rib.policies} == {"code_review", "code_review.large"}
    # A token without the policy_reload role is refused before any task runs, and says why.
    code = await trio.to_thread.run_sync(eval_main, [*argv[:4], "--token", "nope", *argv[6:]])
    assert code == 2
