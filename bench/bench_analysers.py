"""Analyser next-hops on the golden dev set: latency, CPU and catches per agent,
against ruff alone as the baseline of the same run.

Every task of ``shared/golden/dev.jsonl`` (26) goes through each adapter with
``scope="changed"`` (findings on changed lines only), one run at a time so the
CPU of the analyser's processes (``RUSAGE_CHILDREN`` before/after) belongs to
that run. Scoring is the golden harness's: a finding matches an expected defect
when the file is the same and the lines overlap within ±3
(:func:`tests.golden_tasks.harness.matches`); advisories count as one unit.

Run::

    .venv/bin/python bench/bench_analysers.py [--agents ruff,pylint,mypy,semgrep] [--repeat 1] [-v]

Columns: ``caught`` tasks with an expected defect matched (of 26); ``new``
those ruff did not catch; ``units`` caught scoring units; ``findings`` /
``matched`` / ``prec`` reported findings, those matching an expected defect,
their ratio; ``wall p50/p95`` per task in ms; ``cpu`` mean analyser CPU seconds
(user+sys) per task; ``err`` tasks that failed.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atp_router.adapters.base import Prompt
from atp_router.adapters.tools.bandit import BanditAdapter
from atp_router.adapters.tools.mypy import MypyAdapter
from atp_router.adapters.tools.pylint import PylintAdapter
from atp_router.adapters.tools.ruff import RuffAdapter
from atp_router.adapters.tools.semgrep import SemgrepAdapter
from atp_router.review.eval import score_spans
from atp_router.wire.errors import AgentError
from tests.golden_tasks.harness import GOLDEN_PATH, load_tasks, matches, percentile

ADAPTERS = {"ruff": RuffAdapter, "bandit": BanditAdapter, "pylint": PylintAdapter, "mypy": MypyAdapter,
            "semgrep": SemgrepAdapter}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


async def bench(agents: list[str], repeat: int, verbose: bool) -> dict[str, dict]:
    tasks = load_tasks(GOLDEN_PATH)
    out: dict[str, dict] = {}
    for name in agents:
        adapter = ADAPTERS[name](name, scope="changed")
        row = {"caught": set(), "units": 0, "units_caught": 0, "findings": 0, "matched": 0, "wall": [], "cpu": [],
               "err": 0}
        for task in tasks:
            prompt = Prompt(task_type="code_review", content={"diff": task.diff, "files": dict(task.files)})
            for i in range(repeat):
                cpu0, t0 = _children_cpu(), time.perf_counter()
                try:
                    report = await adapter.review(prompt)
                except AgentError as e:
                    row["err"] += i == 0
                    print(f"  {name} {task.id}: {e}", file=sys.stderr)
                    break
                row["wall"].append((time.perf_counter() - t0) * 1000)
                row["cpu"].append(_children_cpu() - cpu0)
            else:
                spans = [(f.file, f.start, f.end) for f in report.findings]
                caught, matched, units, units_caught = score_spans(task, spans)
                row["units"] += units
                row["units_caught"] += units_caught
                row["findings"] += len(spans)
                row["matched"] += sum(matched)
                if any(caught):
                    row["caught"].add(task.id)
                if verbose:
                    for f in report.findings:
                        hit = any(matches(f.file, f.start, f.end, e) for e in task.expected)
                        print(f"  {name} {task.id} {f.file}:{f.start} {f.rule} {f.claim[:90]}{' <- expected' if hit else ''}")
        out[name] = row
    return out


def table(rows: dict[str, dict], n_tasks: int) -> str:
    base = rows.get("ruff", {}).get("caught", set())
    head = (f"{'agent':<9}{'caught':>8}{'new':>5}{'units':>8}{'findings':>10}{'matched':>9}{'prec':>7}"
            f"{'wall p50':>10}{'wall p95':>10}{'cpu s':>8}{'err':>5}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        prec = f"{r['matched'] / r['findings']:.2f}" if r["findings"] else "-"
        wall50 = f"{percentile(r['wall'], 50):.0f}" if r["wall"] else "-"
        wall95 = f"{percentile(r['wall'], 95):.0f}" if r["wall"] else "-"
        cpu = f"{sum(r['cpu']) / len(r['cpu']):.2f}" if r["cpu"] else "-"
        new = len(r["caught"] - base) if name != "ruff" else 0
        lines.append(f"{name:<9}{len(r['caught']):>5}/{n_tasks:<2}{new:>5}{r['units_caught']:>4}/{r['units']:<3}"
                     f"{r['findings']:>10}{r['matched']:>9}{prec:>7}{wall50:>10}{wall95:>10}{cpu:>8}{r['err']:>5}")
    union = set().union(*(r["caught"] for r in rows.values()))
    lines.append(f"all agents together catch {len(union)}/{n_tasks} tasks; ruff alone {len(base)}/{n_tasks}")
    for name, r in rows.items():
        if name != "ruff" and r["caught"] - base:
            lines.append(f"  {name} beyond ruff: {', '.join(sorted(r['caught'] - base))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", default="ruff,bandit,pylint,mypy,semgrep",
                   help="comma-separated, from: " + ", ".join(ADAPTERS) + " (ruff is always run: the baseline)")
    p.add_argument("--repeat", type=int, default=1, help="runs per task (latency samples)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every finding")
    args = p.parse_args(argv)
    agents = [a for a in args.agents.split(",") if a]
    unknown = set(agents) - set(ADAPTERS)
    if unknown:
        p.error(f"unknown agents: {', '.join(sorted(unknown))}")
    agents = ["ruff", *[a for a in agents if a != "ruff"]]
    rows = trio.run(bench, agents, args.repeat, args.verbose)
    print(table(rows, len(load_tasks(GOLDEN_PATH))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
