"""Golden code-review tasks through a real router: run, score, report.

The scoring and the client side live in :mod:`atp_router.review.eval` (``atp-router
eval``); this module keeps the dev set's path and the old entry point::

    .venv/bin/python -m tests.golden_tasks.harness                 # in-process router, policies/
    .venv/bin/python -m tests.golden_tasks.harness --router http://127.0.0.1:7070
"""

from __future__ import annotations

import sys
from pathlib import Path

from atp_router.adapters import local_model
from atp_router.deploy.cli import serve_private
from atp_router.review import eval as _eval
from atp_router.review.eval import (  # noqa: F401  (re-exported for the tests)
    DEFAULT_BUDGET,
    ESCALATED_PREFIX,
    PER_TASK_SOURCES,
    SLACK,
    Baseline,
    EvalReport,
    Expected,
    GoldenReport,
    GoldenTask,
    TaskRun,
    TaskScore,
    changed_line_baseline,
    check_final,
    format_report,
    is_escalated,
    matches,
    parse_span,
    percentile,
    review_task,
    run_tasks,
    score_task,
    summarize,
    task_meta,
)

ROOT = Path(__file__).resolve().parents[2]
#: The dev set (``shared/`` sits beside the repository).
GOLDEN_PATH = ROOT.parent / "shared" / "golden" / "dev.jsonl"
DEFAULT_POLICIES = ROOT / "policies"


def load_tasks(path: Path = GOLDEN_PATH) -> list[GoldenTask]:
    """Every task of a golden JSONL file (default: the dev set), in file order."""
    return _eval.load_tasks(path)


def main(argv: list[str] | None = None) -> int:
    """``atp-router eval`` on the dev set with the default RIB (``policies/``) unless told otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--router" in argv:
        argv[argv.index("--router")] = "--url"
    if "--golden" in argv:
        argv[argv.index("--golden")] = "--tasks"
    if "--tasks" not in argv:
        argv += ["--tasks", str(GOLDEN_PATH)]
    if "--policies" not in argv and "--url" not in argv:
        argv += ["--policies", str(DEFAULT_POLICIES)]
    return _eval.main(["--verbose", *argv], serve_router=serve_private, model_servers=local_model)


if __name__ == "__main__":
    sys.exit(main())
