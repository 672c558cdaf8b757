"""Tests as a reviewer (issue 23 item 4): the pytest next-hop runs the tests that
touch a task's changed files and places a failing test at the changed line it
exercises. The selection's import graph on its own (pure), then real pytest in
the real sandbox on small real projects whose diff plants a defect, alone and
through a real router."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

import atp
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.tools.base import DEFAULT_LIMITS
from atp_router.adapters.tools.testrunner import TestRunnerAdapter
from atp_router.adapters.tools.testselect import (
    changed_frame,
    frames,
    module_names,
    select_tests,
    traced_lines,
)
from atp_router.consensus.escalation import TEST_FAIL_RULE
from atp_router.task.change import parse_change
from atp_router.wire.errors import ClientInputError
from tests.helpers import start_router_on

# pkg/calc.py before and after the reviewed change: the change drops "b" from the
# dict (line 6), so line 7 raises KeyError for every call.
CALC_BEFORE = 'def norm(x):\n    return x\n\n\ndef add(a, b):\n    c = {"b": b}\n    return norm(a) + c["b"]\n'
CALC_AFTER = 'def norm(x):\n    return x\n\n\ndef add(a, b):\n    c = {}\n    return norm(a) + c["b"]\n'
# A project: the test reaches calc through the package's api module (a relative
# import), and an unrelated test file that fails whatever the change.
PROJECT = {
    "pkg/__init__.py": "",
    "pkg/calc.py": CALC_BEFORE,
    "pkg/api.py": "from .calc import add\n",
    "pkg/words.py": "def shout(s):\n    return s.upper()\n",
    "tests/test_api.py": "from pkg.api import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "tests/test_words.py": "from pkg.words import shout\n\n\ndef test_shout():\n    assert shout('a') == 'B'\n",
}


def diff_of(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


def src(files: dict[str, str]) -> dict[str, bytes]:
    return {p: t.encode() for p, t in files.items() if p.endswith(".py")}


def runner(**kw) -> TestRunnerAdapter:
    return TestRunnerAdapter("tests.pytest", limits=dataclasses.replace(DEFAULT_LIMITS, timeout_s=60), **kw)


async def review(adapter: TestRunnerAdapter, content: dict):
    with trio.fail_after(90):
        return await adapter.review(Prompt(task_type="code_review", content=content))


# --- the selection (pure) ---------------------------------------------------------


def test_module_names_are_every_importable_suffix():
    assert module_names("src/pkg/mod.py") == ["src.pkg.mod", "pkg.mod", "mod"]
    assert module_names("pkg/__init__.py") == ["pkg"]
    assert module_names("my-dir/mod.py") == ["mod"]
    assert module_names("README.md") == [] and module_names("a/b-c.py") == []


def test_a_test_is_selected_through_direct_relative_and_transitive_imports_and_by_name():
    files = {
        **src(PROJECT),
        "tests/test_direct.py": b"import pkg.calc\n",
        "tests/test_from.py": b"from pkg import calc\n",
        "tests/pkg_tests/__init__.py": b"",
        "tests/pkg_tests/helper.py": b"from ...pkg.calc import add\n",  # resolved to pkg.calc
        "tests/pkg_tests/test_rel.py": b"from . import helper\n",
        "tests/test_calc.py": b"x = 1\n",  # by name only
        "tests/test_late.py": b"def test_x():\n    import pkg.api\n",  # an import inside a function counts
        "tests/test_broken.py": b"def (:\n",  # does not parse: imports nothing
    }
    chosen = select_tests(files, ["pkg/calc.py"])
    assert chosen is not None
    assert chosen.tests == ("tests/pkg_tests/test_rel.py", "tests/test_api.py", "tests/test_calc.py",
                            "tests/test_direct.py", "tests/test_from.py", "tests/test_late.py")
    assert chosen.why["tests/test_calc.py"] == "named"
    assert chosen.why["tests/test_api.py"] == "imports pkg/calc.py"
    assert select_tests(files, ["pkg/words.py"]).tests == ("tests/test_words.py",)


def test_no_touching_test_is_an_empty_selection_and_a_changed_conftest_gives_up():
    files = {**src(PROJECT), "setup.py": b"import os\n"}
    assert select_tests(files, ["setup.py"]).tests == ()
    assert select_tests(files, ["docs/index.md"]).tests == ()
    assert select_tests({**files, "tests/conftest.py": b""}, ["tests/conftest.py"]) is None


def test_a_changed_test_file_is_selected_itself():
    assert select_tests(src(PROJECT), ["tests/test_words.py"]).tests == ("tests/test_words.py",)


def test_a_changed_line_in_the_traceback_wins_then_the_last_executed_then_a_changed_hunk():
    change = parse_change(diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER))  # line 6 changed, hunk 1-7
    text = ("tests/test_api.py:5: \n_ _ _\n/usr/lib/python3/x.py:9: in f\n"
            "/run/t/src/pkg/calc.py:6: in add\npkg/calc.py:7: KeyError\n")
    entries = frames(text, "/run/t/src")
    assert entries == [("tests/test_api.py", 5), ("pkg/calc.py", 6), ("pkg/calc.py", 7)]
    assert changed_frame(entries, change, [("pkg/calc.py", 6)]) == ("pkg/calc.py", 6)
    in_hunk = [("tests/test_api.py", 5), ("pkg/calc.py", 7)]
    assert changed_frame(in_hunk, change) == ("pkg/calc.py", 7)
    assert changed_frame(in_hunk, change, traced_lines("pkg/calc.py:6", change)) == ("pkg/calc.py", 6)
    assert changed_frame([("tests/test_api.py", 5), ("pkg/words.py", 2)], change) is None
    # Only changed lines of the change are read from the plugin's property, whatever the tests wrote there.
    assert traced_lines("pkg/calc.py:6 pkg/calc.py:7 ../x.py:6 /etc/passwd:1 junk pkg/calc.py:x", change) == [
        ("pkg/calc.py", 6)]
    assert frames("../etc/passwd.py:1: x\n/etc/x.py:2: y\n", "/run/t/src") == []


# --- real pytest in the sandbox -----------------------------------------------------


async def test_a_failing_test_lands_on_the_changed_line_and_only_touching_tests_run():
    """The diff breaks pkg/calc.py: only tests/test_api.py (which reaches calc
    through pkg.api's relative import) runs — tests/test_words.py, failing
    whatever the change, is not selected — and its KeyError, raised on line 7
    (unchanged), is placed at line 6, the changed line the test executed."""
    files = {**PROJECT, "pkg/calc.py": CALC_AFTER}
    report = await review(runner(), {"files": files, "diff": diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER)})
    assert report.summary == "0 passed, 1 failed; ran 1 test file(s) touching the changed files: tests/test_api.py"
    [f] = report.findings
    assert (f.file, f.start, f.end, f.rule) == ("pkg/calc.py", 6, 6, TEST_FAIL_RULE)
    assert f.claim == "tests/test_api.py::test_add failed: KeyError: 'b'"
    assert f.tests == ["tests/test_api.py::test_add"]


async def test_a_change_on_the_raising_line_is_cited_exactly():
    before = "def div(a, b):\n    if b == 0:\n        return 0\n    return a / b\n"
    after = "def div(a, b):\n    if b == 0:\n        return a / b\n    return a / b\n"
    files = {"calc.py": after,
             "test_calc.py": "from calc import div\n\n\ndef test_div_zero():\n    assert div(1, 0) == 0\n"}
    report = await review(runner(), {"files": files, "diff": diff_of("calc.py", before, after)})
    [f] = report.findings
    assert (f.file, f.start, f.end) == ("calc.py", 3, 3)
    assert f.claim.startswith("test_calc.py::test_div_zero failed: ZeroDivisionError")


async def test_a_wrong_value_is_placed_at_the_changed_line_that_computed_it():
    """An ``assert`` on a wrong return value fails in the test, after the changed
    code returned: the traceback never reaches it, the trace of the changed lines
    the test executed does (line 3, the loop that now skips the first item)."""
    before = ("def total(xs):\n    n = 0\n    for x in xs:\n        n += x\n    return n\n\n\n"
              "def mean(xs):\n    return total(xs) / len(xs)\n")
    after = before.replace("    for x in xs:", "    for x in xs[1:]:")
    files = {"stats.py": after, "helpers.py": "import stats\n", "test_helpers.py": (
        "from helpers import stats\n\n\ndef test_mean():\n    assert stats.mean([1, 2, 3]) == 2\n\n\n"
        "def test_mean_of_equals():\n    assert stats.mean([0, 0]) == 0\n")}
    report = await review(runner(), {"files": files, "diff": diff_of("stats.py", before, after)})
    assert report.summary == "1 passed, 1 failed; ran 1 test file(s) touching the changed files: test_helpers.py"
    [f] = report.findings
    assert (f.file, f.start, f.end, f.tests) == ("stats.py", 3, 3, ["test_helpers.py::test_mean"]), f
    assert f.claim.startswith("test_helpers.py::test_mean failed: assert")
    # Without the diff: the same failure, at the test.
    [f] = (await review(runner(), {"files": files})).findings
    assert (f.file, f.start, f.end) == ("test_helpers.py", 4, 5)


async def test_a_selected_path_is_never_read_as_an_option():
    """A test file under a directory named like a pytest option is selected and
    run as a path: the JUnit report still comes back through the runner's pipe."""
    files = {"calc.py": CALC_AFTER.replace("pkg", ""), "--junitxml=x/test_calc.py": (
        "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n")}
    report = await review(runner(), {"files": files, "diff": diff_of("calc.py", CALC_BEFORE, CALC_AFTER)})
    assert report.summary == ("0 passed, 1 failed; ran 1 test file(s) touching the changed files: "
                              "--junitxml=x/test_calc.py")
    assert (report.findings[0].file, report.findings[0].start) == ("calc.py", 6)


async def test_the_plugins_name_is_reserved():
    diff = diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER)
    with pytest.raises(ClientInputError, match="_atp_changed_lines.py is the pytest next-hop's own module"):
        await review(runner(), {"files": {**PROJECT, "_atp_changed_lines.py": ""}, "diff": diff})


async def test_a_failure_outside_the_change_stays_at_the_test_and_discovery_is_said():
    """The change touches a file no test imports: pytest's discovery runs (the
    summary says so), and tests/test_words.py's failure, which reaches no changed
    line, is reported at the test as before."""
    files = {**PROJECT, "setup.py": "import os\n"}
    report = await review(runner(), {"files": files, "diff": diff_of("setup.py", "", "import os\n")})
    assert report.summary == ("1 passed, 1 failed; ran pytest's discovery: no test file touches the changed files")
    [f] = report.findings
    assert (f.file, f.start, f.end) == ("tests/test_words.py", 4, 5)


async def test_explicit_tests_are_run_as_given_and_a_diff_is_bounded():
    files = {**PROJECT, "pkg/calc.py": CALC_AFTER}
    diff = diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER)
    report = await review(runner(), {"files": files, "diff": diff, "tests": ["tests/test_words.py"]})
    assert report.summary == "0 passed, 1 failed" and report.findings[0].file == "tests/test_words.py"
    small = TestRunnerAdapter("t", limits=dataclasses.replace(DEFAULT_LIMITS, timeout_s=60, max_files_bytes=64))
    with pytest.raises(ClientInputError, match="content.diff.*max_files_bytes=64"):
        await review(small, {"files": {"test_x.py": "def test_x(): pass\n"}, "diff": diff})
    with pytest.raises(ClientInputError, match="content.diff must be unified diff text"):
        await review(runner(), {"files": files, "diff": ["not", "text"]})


async def test_through_a_router_the_finding_is_on_the_changed_line(nursery, tmp_path: Path):
    """End to end: an operator's checkout (allowed by the RIB's ``options.repos``)
    holds the project and its tests; a client sends the change (the diff and the
    file after it) naming the checkout; the FINAL's finding is at the changed
    file's line, from the pytest next-hop."""
    checkout = tmp_path / "checkouts" / "proj"
    for rel, text in PROJECT.items():
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(text)
    rib = {
        "agents": {"tests.pytest": {"layer": "L1", "tool": "pytest", "p95_ms": 3000, "timeout_ms": 60_000,
                                    "strengths": ["code_review"],
                                    "options": {"repos": [str(tmp_path / "checkouts")]}}},
        "policies": [{"name": "tests", "match": {"task_type": "code_review"}, "fanout": ["tests.pytest"],
                      "deadline_ms": 120_000}],
    }
    env = await start_router_on(nursery, tmp_path, json.dumps(rib))
    content = {"diff": diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER), "files": {"pkg/calc.py": CALC_AFTER},
               "repo": str(checkout)}
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=content)
        with trio.fail_after(120):
            events = [ev async for ev in c.events(st)]
    [final] = [ev.payload for ev in events if ev.type == "FINAL"]
    [f] = final["result"]["findings"]
    assert (f["file"], f["span"]) == ("pkg/calc.py", "6-6"), f
    assert "tests/test_api.py::test_add failed: KeyError" in f["claim"]
    assert f["provenance"] == ["tests.pytest#1"]
    assert (checkout / "pkg/calc.py").read_text() == CALC_BEFORE


# --- the eval's figure ----------------------------------------------------------------


def test_no_shipped_golden_task_ships_tests():
    """The golden format carries the touched source files only (a BugsInPy task's
    ``oracle`` names its test, which is not in ``files``): the eval's figure on
    the dev set is 0 tasks ship tests, and nothing here makes one up."""
    from atp_router.review import eval as ev
    from tests.conftest import SHARED

    tasks = ev.load_tasks(SHARED / "golden" / "dev.jsonl")
    assert len(tasks) == 26 and sum(ev.ships_tests(t) for t in tasks) == 0
    assert ev.ships_tests(ev.GoldenTask(id="x", diff="", files={"a/b_test.py": ""}, expected=[]))


def _eval(tmp_path: Path, task: dict, options: dict, *extra: str) -> tuple[list[str], dict]:
    """``atp-router eval`` (a process, as a user runs it) on a task file of
    ``task`` with a RIB of the pytest next-hop (``options``): its output lines
    and its JSON report of the variant."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    rib = tmp_path / "tests.yaml"
    rib.write_text(json.dumps({
        "agents": {"tests.pytest": {"layer": "L1", "tool": "pytest", "p95_ms": 3000, "timeout_ms": 60_000,
                                    "strengths": ["code_review"], "options": options}},
        "policies": [{"name": "tests", "match": {"task_type": "code_review"}, "fanout": ["tests.pytest"],
                      "deadline_ms": 120_000}],
    }))
    js = tmp_path / "e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "atp_router.deploy.cli", "eval", "--tasks", str(tasks), "--png", str(tmp_path / "e.png"),
         "--json", str(js), "--policies", str(rib), *extra], check=False, capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines(), json.loads(js.read_text())["tests"]


FIXTURE_TASK = {"id": "fixture-calc", "source": "fixture", "diff": diff_of("pkg/calc.py", CALC_BEFORE, CALC_AFTER),
                "expected": [{"file": "pkg/calc.py", "start": 6, "end": 6, "kind": "changed",
                              "claim": "add returns the wrong value without b"}]}
CAUGHT = ("tests tests: 1/1 tasks ship tests (test files in files or a checkout); a pytest next-hop reported on 1, "
          "caught 1 by line, 1 for the right reason")


def test_the_eval_counts_what_the_pytest_next_hop_caught_on_tasks_shipping_tests(tmp_path: Path):
    """``atp-router eval`` on a task file of one fixture task (made here, not a
    golden task) whose files ship a test: a RIB with the pytest next-hop catches
    it at the changed line, by line and for the right reason (a failing test is
    a ``logic`` finding; the defect's claim says "wrong"), and the eval says so
    on its own line."""
    after = {**PROJECT, "pkg/calc.py": CALC_AFTER}
    del after["tests/test_words.py"]
    lines, report = _eval(tmp_path, {**FIXTURE_TASK, "files": after}, {})
    assert CAUGHT in lines, lines
    assert lines[-1].startswith("EVAL tasks=1 caught=1 ") and lines[-1].endswith(" right=1")
    [t] = report["tasks"]
    assert (t["ships_tests"], t["tests_ran"], t["tests_caught"], t["tests_right"]) == (True, True, True, True)


def test_the_eval_sends_an_operators_checkout_as_the_tasks_repo(tmp_path: Path):
    """The task's files hold only the changed source file (as a golden task's
    do); ``--checkouts DIR`` finds the operator's checkout ``DIR/<task id>``,
    which holds the tests: the task ships tests, its checkout is sent as
    ``repo`` and the pytest next-hop (``options.repos: [DIR]``) catches it."""
    checkouts = tmp_path / "checkouts"
    for rel, text in PROJECT.items():
        (checkouts / "fixture-calc" / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkouts / "fixture-calc" / rel).write_text(text)
    task = {**FIXTURE_TASK, "files": {"pkg/calc.py": CALC_AFTER}}
    lines, report = _eval(tmp_path, task, {"repos": [str(checkouts)]}, "--checkouts", str(checkouts))
    assert CAUGHT in lines, lines
    [t] = report["tasks"]
    assert t["matched_claims"] == ["pkg/calc.py:6-6 tests/test_api.py::test_add failed: KeyError: 'b'"]
