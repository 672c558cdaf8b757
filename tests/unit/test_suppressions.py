"""Suppression comments belong to the operator, not the change (issue 19 item 4):
the comment neutraliser (tokenize-based, strings untouched, lines and columns
kept), the plan of the two runs, the marks, their merge into the FINAL, the RIB
option, and each analyser next-hop (the real binary) on a change that silences
it — its findings still reported and marked, honoured with
``allow_suppressions``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgspec
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.bandit import SUPPRESSIONS as BANDIT
from atp_router.adapters.tools.bandit import BanditAdapter
from atp_router.adapters.tools.base import ToolAdapter, ToolLimits
from atp_router.adapters.tools.mypy import SUPPRESSIONS as MYPY
from atp_router.adapters.tools.mypy import MypyAdapter
from atp_router.adapters.tools.pylint import SUPPRESSIONS as PYLINT
from atp_router.adapters.tools.pylint import PylintAdapter
from atp_router.adapters.tools.ruff import SUPPRESSIONS as RUFF
from atp_router.adapters.tools.ruff import RuffAdapter
from atp_router.adapters.tools.semgrep import SUPPRESSIONS as SEMGREP
from atp_router.adapters.tools.semgrep import SemgrepAdapter
from atp_router.adapters.tools.suppressions import (
    mark_suppressed,
    neutralise,
    plan_suppressions,
)
from atp_router.consensus.strategies import merge
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import AgentError, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
#: Every analyser's keywords at once, for the neutraliser's own tests.
ALL = re.compile("|".join(p.pattern for p in (RUFF, BANDIT, SEMGREP, PYLINT, MYPY)), re.IGNORECASE)


def _n(text: str, pattern: re.Pattern[str] = ALL, **kw) -> str:
    return neutralise(text.encode(), pattern, **kw).data.decode()


def _same_shape(a: str, b: str) -> None:
    """Same lines, each of the same length: every column is where it was."""
    la, lb = a.split("\n"), b.split("\n")
    assert [len(x) for x in la] == [len(x) for x in lb]


# --- the neutraliser ------------------------------------------------------------------


def test_every_suppression_of_the_issue_is_neutralised_in_place() -> None:
    src = (
        "# ruff: noqa\n"
        "# mypy: ignore-errors\n"
        "# pylint: skip-file\n"
        "import os  # noqa: F401\n"
        "x = eval(os.environ['X'])  # nosec B307\n"
        "y = eval(x)  # nosemgrep: eval-of-dynamic-string\n"
        "z: int = 'a'  # type: ignore[assignment]\n"
        "w = os.nope  # pylint: disable=no-member\n"
        "#flake8: NOQA\n"
        "v = 1  # pylint:disable-next=all # NoSec\n"
    )
    out = _n(src)
    _same_shape(src, out)
    assert out.split("\n")[:4] == ["# ~~~~: ~~~~", "# ~~~~: ignore-errors", "# ~~~~~~: skip-file",
                                   "import os  # ~~~~: F401"]
    assert "y = eval(x)  # ~~~~~grep: eval-of-dynamic-string" in out
    assert "z: int = 'a'  # ~~~~: ignore[assignment]" in out
    assert "# ~~~~~~: disable=no-member" in out and "#flake8: ~~~~" in out
    assert out.endswith("v = 1  # ~~~~~~:disable-next=all # ~~~~~\n")
    for word in ("noqa", "nosec", "nosem", "pylint:", "mypy:", "type: ignore"):
        assert word not in out.lower()
    # Code is untouched: the same program.
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(src))


def test_strings_are_never_touched_and_type_comments_stay() -> None:
    src = (
        'A = "# noqa"  # the string keeps it\n'
        "B = '''\n# pylint: skip-file\n# mypy: ignore-errors\n'''\n"
        'C = f"{A}  # type: ignore"\n'
        "D = b'nosec'\n"
        "xs = []  # type: list[int]\n"
        "def f(a):  # type: (int) -> None\n"
        "    pass\n"
    )
    assert _n(src) == src  # no keyword in any comment
    assert neutralise(src.encode(), ALL).neutralised == frozenset()
    # A type comment is information for mypy, not a suppression: kept.
    assert _n("xs = []  # type: list[int]  # type: ignore\n", MYPY) == "xs = []  # type: list[int]  # ~~~~: ignore\n"


def test_the_tokenizer_decides_what_a_comment_is() -> None:
    src = 's = "a # noqa"  # noqa\nt = """\n  # nosec\n"""  # nosec\n'
    out = _n(src)
    assert out == 's = "a # noqa"  # ~~~~\nt = """\n  # nosec\n"""  # ~~~~~\n'
    assert neutralise(src.encode(), ALL).neutralised == frozenset({1, 4})


def test_keep_leaves_the_comments_of_those_lines() -> None:
    src = "import os  # noqa\nimport re  # noqa\nimport sys  # noqa\n"
    n = neutralise(src.encode(), RUFF, keep={2})
    assert n.data.decode() == "import os  # ~~~~\nimport re  # noqa\nimport sys  # ~~~~\n"
    assert n.neutralised == {1, 3} and n.kept == {2}


def test_case_and_look_alike_letters_are_matched_columns_kept() -> None:
    # re.IGNORECASE also folds "ſ" (long s) to "s" and "K" (Kelvin) to "k": the
    # neutraliser covers at least what a case-insensitive tool could read.
    src = "x = 1  # NoQa\ny = 2  # noſec\nz = 3  # PyLint: disable=all\n"
    out = _n(src)
    _same_shape(src, out)
    assert out == "x = 1  # ~~~~\ny = 2  # ~~~~~\nz = 3  # ~~~~~~: disable=all\n"


def test_line_ends_stay_and_only_newlines_count_as_lines() -> None:
    src = "a = 1  # noqa\r\nb = '\x0c'  # nosec\r\n\x0cc = 2  # type: ignore\n"
    out = _n(src)
    assert out == "a = 1  # ~~~~\r\nb = '\x0c'  # ~~~~~\r\n\x0cc = 2  # ~~~~: ignore\n"


def test_the_file_is_read_in_the_encoding_python_reads_it() -> None:
    # latin-1: a non-ASCII comment before the pragma; bytes stay latin-1.
    data = "# -*- coding: latin-1 -*-\nx = 1  # \xe9t\xe9 # noqa\n".encode("latin-1")
    out = neutralise(data, RUFF).data
    assert out == "# -*- coding: latin-1 -*-\nx = 1  # \xe9t\xe9 # ~~~~\n".encode("latin-1")
    # UTF-7: "+ACM-" is "#" to Python (and to pylint, which then skipped the
    # whole file), not to a reader of the raw bytes.
    data = b"# coding: utf-7\nimport os\nx = 1 +ACM- pylint: skip-file\n"
    n = neutralise(data, PYLINT)
    assert n.neutralised == {3}
    assert n.data.decode("utf-7").split("\n")[2] == "x = 1 # ~~~~~~: skip-file"
    # A UTF-8 BOM stays.
    data = b"\xef\xbb\xbfx = 1  # noqa\n"
    assert neutralise(data, RUFF).data == b"\xef\xbb\xbfx = 1  # ~~~~\n"


def test_files_python_cannot_read_or_tokenize_never_raise() -> None:
    # Undecodable: unchanged (Python, hence pylint and mypy, cannot read it either).
    bad = b"x = 1  # noqa \xff\xfe\n"
    assert neutralise(bad, RUFF).data == bad
    assert neutralise(b"# coding: no-such-codec\nx = 1  # noqa\n", RUFF).data.endswith(b"# noqa\n")
    # Unterminated string at the end: what was tokenized before it is neutralised.
    src = "import os  # noqa\nx = '''\n# noqa\n"
    assert _n(src, RUFF) == "import os  # ~~~~\nx = '''\n# noqa\n"
    # Bad indentation and an unclosed bracket.
    assert _n("if x:\n    a = 1  # nosec\n  b = 2  # nosec\n", BANDIT).startswith("if x:\n    a = 1  # ~~~~~\n")
    assert _n("f(  # nosec\n", BANDIT) == "f(  # ~~~~~\n"


def test_after_hash_reaches_what_mypy_reads_in_strings() -> None:
    # mypy's native parser reads a Python 3.12 comment inside an f-string's
    # replacement field; its old parser takes any line starting "# mypy:" as
    # configuration. Python 3.11's tokenizer sees strings in both.
    src = 'def f(n: int) -> str:\n    return f"""{\n        n.missing  # type: ignore\n    }"""\n'
    assert _n(src, MYPY) == src
    out = _n(src, MYPY, after_hash=True)
    assert out == src.replace("# type: ignore", "# ~~~~: ignore")
    doc = 'X = """\n# mypy: ignore-errors\n"""\n'
    assert _n(doc, MYPY, after_hash=True) == 'X = """\n# ~~~~: ignore-errors\n"""\n'
    assert _n("x = 'type: ignore'\n", MYPY, after_hash=True) == "x = 'type: ignore'\n"  # no '#' before it


def test_the_neutraliser_keeps_every_program_of_this_repository_the_same() -> None:
    """Over the router's own sources (which carry real ``# noqa`` and
    ``# type: ignore`` comments): the same AST (code and strings), every line
    of the same length, and no keyword left in a comment."""
    import io
    import tokenize

    files = sorted((ROOT / "atp_router").rglob("*.py")) + sorted((ROOT / "tests" / "unit").rglob("*.py"))
    touched = 0
    for path in files:
        src = path.read_text("utf-8")
        if not ALL.search(src):  # nothing to neutralise: returned as is (tested above)
            assert neutralise(src.encode(), ALL).data == src.encode()
            continue
        n = neutralise(src.encode(), ALL)
        out = n.data.decode()
        touched += bool(n.neutralised)
        _same_shape(src, out)
        assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(src)), path
        for tok in tokenize.generate_tokens(io.StringIO(out).readline):
            if tok.type == tokenize.COMMENT:
                assert not ALL.search(tok.string), (path, tok)
        if not n.neutralised:
            assert out == src
    assert touched >= 10


# --- the plan and the marks ---------------------------------------------------------------


def test_the_plan_runs_twice_only_when_the_change_adds_a_suppression() -> None:
    old = "import os  # noqa\nimport re\n"
    targets = {"a.py": old.encode(), "b.py": b"import sys\n"}
    # The change touches line 2 only: the noqa of line 1 is not the change's.
    plan = plan_suppressions(targets, RUFF, {"a.py": {2}})
    assert plan.honour is None and plan.found == 1 and plan.added == 0
    assert plan.off["a.py"] == b"import os  # ~~~~\nimport re\n" and plan.off["b.py"] == b"import sys\n"
    # It adds one on line 2: the second run keeps line 2's and neutralises line 1's.
    new = "import os  # noqa\nimport re  # noqa: F401\n"
    plan = plan_suppressions({"a.py": new.encode()}, RUFF, {"a.py": {2}})
    assert plan.honour == {"a.py": b"import os  # ~~~~\nimport re  # noqa: F401\n"}
    assert plan.found == 2 and plan.added == 1
    # No diff: the whole task is the change.
    plan = plan_suppressions({"a.py": new.encode()}, RUFF, None)
    assert plan.honour == {"a.py": new.encode()} and plan.added == 2
    # A keyword outside a comment on a changed line (semgrep reads it there) asks for the second run too.
    plan = plan_suppressions({"a.py": b'x = " nosemgrep"\n'}, SEMGREP, {"a.py": {1}})
    assert plan.honour is not None and plan.found == 0


def test_marks_are_what_the_second_run_does_not_repeat() -> None:
    def f(line: int, rule: str) -> AgentFinding:
        return AgentFinding(file="a.py", start=line, end=line, severity=Severity.LOW, claim=rule, rule=rule)

    findings = [f(1, "F401"), f(2, "F401"), f(2, "F401"), f(3, "S307")]
    quiet = [f(1, "F401"), f(2, "F401"), f(9, "X")]
    assert mark_suppressed(findings, quiet) == 2
    assert [x.suppressed_by_change for x in findings] == [False, False, True, True]
    # The wire form: absent when false.
    assert b"suppressed_by_change" not in msgspec.json.encode(findings[0])
    assert b'"suppressed_by_change":true' in msgspec.json.encode(findings[3])


def test_a_merged_finding_is_marked_when_any_contributor_is() -> None:
    def report(*marks: bool) -> AgentReport:
        return AgentReport(findings=[
            AgentFinding(file="a.py", start=3, end=3, severity=Severity.HIGH, claim=f"c{i}", confidence=0.8,
                         suppressed_by_change=m) for i, m in enumerate(marks)])

    files = {"a.py": "a\nb\nc\nd\n"}
    result = merge({"ruff": report(True), "bandit": report(False), "llm": AgentReport()},
                   win_rates={}, costs_usd_micros={}, files=files)
    [finding] = result.findings
    assert finding.suppressed_by_change and sorted(p.split("#")[0] for p in finding.provenance) == ["bandit", "ruff"]
    result = merge({"ruff": report(False), "bandit": report(False)}, win_rates={}, costs_usd_micros={}, files=files)
    assert not result.findings[0].suppressed_by_change
    assert b"suppressed_by_change" not in msgspec.json.encode(result)
    both = {"ruff": report(True), "bandit": report(False)}
    result = merge(both, strategy="two_phase_commit", win_rates={}, costs_usd_micros={}, files=files)
    assert [f.suppressed_by_change for f in result.findings] == [True]
    # champion_challenger keeps the champion's own findings (bandit: the name
    # breaks the tie of equal cost and confidence), so its mark.
    result = merge(both, strategy="champion_challenger", win_rates={}, costs_usd_micros={}, files=files)
    assert [f.suppressed_by_change for f in result.findings] == [False]
    result = merge(both, strategy="champion_challenger", win_rates={}, costs_usd_micros={"bandit": 5}, files=files)
    assert [f.suppressed_by_change for f in result.findings] == [True]


# --- the RIB option -------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["ruff", "bandit", "semgrep", "pylint", "mypy"])
def test_allow_suppressions_is_an_agent_option(tool: str) -> None:
    def build(options: dict):
        return build_adapter("a", AgentSpec(layer="L1", tool=tool, p95_ms=100, options=options))

    assert build({}).allow_suppressions is False
    assert build({"allow_suppressions": True}).allow_suppressions is True
    with pytest.raises(ValueError, match="options.allow_suppressions: expected bool"):
        build({"allow_suppressions": "yes"})


# --- each analyser, for real -----------------------------------------------------------------


def _diff(path: str, old: str, new: str) -> str:
    """A unified diff of one hunk covering the whole file (every differing line)."""
    import difflib

    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}", n=3))


def _prompt(path: str, old: str, new: str) -> Prompt:
    return Prompt(task_type="code_review", content={"diff": _diff(path, old, new), "files": {path: new}})


#: tool → (adapter class, code before, code after: the change adds the tool's
#: suppressions, inline and file-level, beside the same code without them).
CASES = {
    "ruff": (RuffAdapter, "import os\n\n\ndef f(x):\n    return os\n",
             "# ruff: noqa: S307\nimport os\nimport re  # noqa\n\n\ndef f(x):\n    eval(x)\n    return os\n"),
    "bandit": (BanditAdapter, "import subprocess\n\n\ndef f(x):\n    return x\n",
               ("import subprocess\n\n\ndef f(x):\n    subprocess.call(x, shell=True)  # nosec\n    eval(x)  # nosec B307\n"
               "    return x\n")),
    "semgrep": (SemgrepAdapter, "import yaml\n\n\ndef f(x):\n    return x\n",
                "import yaml\n\n\ndef f(x):\n    # nosemgrep\n    eval(x)\n    return yaml.load(x)  # nosem\n"),
    "pylint": (PylintAdapter, "def f(x):\n    return x\n",
               ("def f(x, acc=[]):  # pylint: disable=dangerous-default-value\n    # pylint: disable-next=eval-used\n"
               "    eval(x)\n    return acc\n")),
    "mypy": (MypyAdapter, "def f(n: int) -> int:\n    return n\n",
             ("# mypy: disable-error-code=\"return-value\"\ndef f(n: int) -> int:\n    n.missing  # type: ignore\n"
             "    return 'x'\n")),
}


@pytest.mark.parametrize("tool", sorted(CASES))
async def test_an_analyser_reports_what_the_change_silenced_and_marks_it(tool: str) -> None:
    cls, old, new = CASES[tool]
    off = await cls(tool).review(_prompt("m.py", old, new))
    assert len(off.findings) >= 2, off
    assert all(f.suppressed_by_change for f in off.findings), off
    assert "findings the change's own suppression comments silence are reported" in off.summary
    # The operator allows suppressions: the analyser's own behaviour.
    allowed = await cls(tool, allow_suppressions=True).review(_prompt("m.py", old, new))
    assert allowed.findings == [] and "suppression" not in allowed.summary
    # The same code without the comments gives the same findings, unmarked.
    plain = "\n".join(line.split("#")[0].rstrip() if "#" in line else line for line in new.split("\n"))
    bare = await cls(tool).review(_prompt("m.py", old, plain))
    assert [(f.start, f.rule) for f in bare.findings] == [(f.start, f.rule) for f in off.findings]
    assert not any(f.suppressed_by_change for f in bare.findings)


async def test_a_suppression_the_change_did_not_add_is_not_honoured_nor_marked() -> None:
    """bandit: ``# nosec`` on a line the change does not touch still hides
    nothing (the diff is the tenant's too); the finding is reported unmarked.
    The change's own ``# nosec`` marks only what it covers."""
    old = "import subprocess\n\n\ndef f(x):\n    subprocess.call(x, shell=True)  # nosec\n    return x\n"
    new = old.replace("    return x\n", "    eval(x)  # nosec B307\n    exec(x)\n    return x\n")
    report = await BanditAdapter("bandit", scope="file").review(_prompt("m.py", old, new))
    rows = {(f.start, f.rule, f.suppressed_by_change) for f in report.findings}
    assert rows == {(5, "B602", False), (6, "B307", True), (7, "B102", False)}
    report = await BanditAdapter("bandit", scope="file", allow_suppressions=True).review(_prompt("m.py", old, new))
    assert {(f.start, f.rule) for f in report.findings} == {(7, "B102")}


async def test_a_change_without_suppressions_runs_the_analyser_once(monkeypatch) -> None:
    runs: list[dict[str, bytes]] = []
    real = ToolAdapter._run  # beneath the suppression layer: one analyser run

    async def counting(self, targets):
        runs.append(dict(targets))
        return await real(self, targets)

    monkeypatch.setattr(ToolAdapter, "_run", counting)
    old = "import os  # noqa\n"
    new = old + "import re\n"
    report = await RuffAdapter("ruff").review(_prompt("m.py", old, new))
    assert len(runs) == 1 and [(f.start, f.suppressed_by_change) for f in report.findings] == [(2, False)]
    assert runs[0]["m.py"] == b"import os  # ~~~~\nimport re\n"
    runs.clear()
    report = await RuffAdapter("ruff").review(_prompt("m.py", old, new.replace("re\n", "re  # noqa\n")))
    assert len(runs) == 2 and [(f.start, f.suppressed_by_change) for f in report.findings] == [(2, True)]
    assert runs[1]["m.py"] == b"import os  # ~~~~\nimport re  # noqa\n"


@pytest.mark.parametrize("failure", ["error", "slow"])
async def test_a_failing_second_run_loses_the_marks_never_the_findings(monkeypatch, failure: str) -> None:
    """The second run (the change's suppressions honoured) only marks: when it
    fails, or would outlast what is left of ``timeout_s``, the first run's
    findings stand, unmarked, and the summary says the marks are unknown."""
    real = ToolAdapter._run
    calls = 0

    async def second_fails(self, targets):
        nonlocal calls
        calls += 1
        if calls == 1:
            return await real(self, targets)
        if failure == "error":
            raise AgentError(ErrorCode.EAGENTDOWN, "ruff exited with signal SIGSEGV")
        await trio.sleep_forever()

    monkeypatch.setattr(ToolAdapter, "_run", second_fails)
    adapter = RuffAdapter("ruff", limits=ToolLimits(timeout_s=3.0))
    old = "import os\n"
    with trio.fail_after(60):  # the budget stops the second run, not this
        report = await adapter.review(_prompt("m.py", old, old + "import re  # noqa\n"))
    assert calls == 2 and [(f.start, f.rule, f.suppressed_by_change) for f in report.findings] == [(2, "F401", False)]
    assert "which findings the change's suppression comments hide is unknown" in report.summary
    if failure == "error":
        assert "SIGSEGV" in report.summary
    else:
        assert "the second run would pass timeout_s=3 s" in report.summary
