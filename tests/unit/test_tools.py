"""ruff and bandit next-hops against real code with known defects, real git diffs,
and the golden review tasks. Every analyser run here is the real binary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.bandit import BanditAdapter
from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    LIMIT_OPTIONS,
    ToolLimits,
    find_executable,
)
from atp_router.adapters.tools.ruff import RuffAdapter, grade
from atp_router.consensus.types import AgentReport, Severity
from atp_router.policy.rib import AgentSpec, ModelSpec
from atp_router.task.diff import changed_lines, parse_diff
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import CostEstimate, PayloadType

H, M, L = Severity.HIGH, Severity.MEDIUM, Severity.LOW


@pytest.fixture(autouse=True)
def _private_tempdir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test's ``atp-tool-*`` work dirs in a directory of its own: the tests
    that count them (nothing left behind) must not see another process's — the
    other xdist workers run tool next-hops at the same time. Beside the system
    temporary directory and searchable by any user, as the sandbox requires of a
    work tree's parent (its run's unprivileged user must reach it)."""
    tmp_path_factory.getbasetemp()  # pytest's own base is fixed first, in the system's directory
    d = tempfile.mkdtemp(prefix="atp-tooltest-")
    os.chmod(d, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", d)
    yield
    shutil.rmtree(d, ignore_errors=True)

BUGGY = """\
import pickle
import subprocess

import yaml

PASSWORD = "hunter2"


def load_config(path):
    with open(path) as fh:
        return yaml.load(fh)


def run(cmd):
    try:
        subprocess.call(cmd, shell=True)
    except:
        pass
    return undefined_name


def restore(blob):
    return pickle.loads(blob)
"""

# The same module before a change that introduced the bugs in run() (lines 14-19).
BEFORE = BUGGY.replace(
    "    try:\n        subprocess.call(cmd, shell=True)\n    except:\n        pass\n    return undefined_name\n",
    "    return subprocess.call(cmd)\n",
)


async def _report(adapter, prompt: Prompt) -> tuple[AgentReport, list[Fragment]]:
    frags = [f async for f in adapter.stream(prompt)]
    assert [f.type for f in frags] == [PayloadType.FINAL]
    assert frags[0].usage is not None and frags[0].usage.tokens == 0 and frags[0].usage.usd_micros == 0
    assert isinstance(frags[0].content, AgentReport)
    return frags[0].content, frags


def _rows(report: AgentReport) -> set[tuple]:
    return {(f.file, f.start, f.rule, f.severity) for f in report.findings}


def _git_diff(tmp: Path, files_before: dict[str, str], files_after: dict[str, str]) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    for path, text in files_before.items():
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text)
    git("add", "-A")
    git("-c", "user.email=t@example.invalid", "-c", "user.name=t", "commit", "-q", "-m", "base")
    for path, text in files_after.items():
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp / path).write_text(text)
    return git("diff")


def test_binaries_come_from_the_venv() -> None:
    import sys

    for tool in ("ruff", "bandit"):
        assert find_executable(tool) == str(Path(sys.executable).parent / tool)


async def test_ruff_finds_the_known_defects() -> None:
    prompt = Prompt(task_type="code_review", content={"files": {"app/buggy.py": BUGGY}})
    report, _ = await _report(RuffAdapter("ruff", scope="file"), prompt)
    assert _rows(report) == {
        ("app/buggy.py", 6, "S105", M),  # hardcoded password
        ("app/buggy.py", 11, "S506", H),  # yaml.load
        ("app/buggy.py", 16, "S602", H),  # shell=True
        ("app/buggy.py", 17, "E722", M),  # bare except
        ("app/buggy.py", 17, "S110", L),  # try-except-pass
        ("app/buggy.py", 19, "F821", H),  # undefined name
        ("app/buggy.py", 23, "S301", M),  # pickle.loads
    }
    f821 = next(f for f in report.findings if f.rule == "F821")
    assert f821.claim == "F821: Undefined name `undefined_name`" and f821.confidence == 0.8
    assert [f.ref for f in report.findings] == [str(i) for i in range(1, 8)]
    assert report.summary == "ruff: 7 finding(s) in 1 file(s)"


async def test_bandit_finds_the_known_defects() -> None:
    prompt = Prompt(task_type="code_review", content={"files": {"app/buggy.py": BUGGY}})
    report, _ = await _report(BanditAdapter("bandit", scope="file"), prompt)
    got = {(f.start, f.rule, f.severity, f.cwe, f.confidence) for f in report.findings}
    assert got == {
        (1, "B403", L, "CWE-502", 0.85),  # import pickle
        (6, "B105", L, "CWE-259", 0.65),  # hardcoded password
        (11, "B506", M, "CWE-20", 0.85),  # yaml.load
        (16, "B602", H, "CWE-78", 0.85),  # shell=True
        (17, "B110", L, "CWE-703", 0.85),  # try-except-pass
        (23, "B301", M, "CWE-502", 0.85),  # pickle.loads
    }
    b602 = next(f for f in report.findings if f.rule == "B602")
    assert b602.claim == "B602: subprocess call with shell=True identified, security issue."
    assert all(f.file == "app/buggy.py" for f in report.findings)


@pytest.mark.parametrize("adapter_cls", [RuffAdapter, BanditAdapter])
async def test_scope_changed_keeps_only_changed_lines(tmp_path: Path, adapter_cls) -> None:
    diff = _git_diff(tmp_path, {"app/buggy.py": BEFORE}, {"app/buggy.py": BUGGY})
    assert changed_lines(parse_diff(diff)) == {"app/buggy.py": {15, 16, 17, 18, 19}}
    prompt = Prompt(task_type="code_review", content={"diff": diff, "files": {"app/buggy.py": BUGGY}})
    changed, _ = await _report(adapter_cls("t", scope="changed"), prompt)
    whole, _ = await _report(adapter_cls("t", scope="file"), prompt)
    assert {f.start for f in changed.findings} == {16, 17, 19} & {f.start for f in whole.findings}
    assert len(whole.findings) > len(changed.findings)
    # context widens the kept lines: the yaml.load on line 11 is 4 lines above line 15.
    wide, _ = await _report(adapter_cls("t", scope="changed", context=4), prompt)
    assert 11 in {f.start for f in wide.findings} and 6 not in {f.start for f in wide.findings}


async def test_scope_changed_skips_untouched_and_non_python_files(tmp_path: Path) -> None:
    other = "import os\nprint(undefined)\n"
    diff = _git_diff(
        tmp_path,
        {"a.py": BEFORE, "b.py": other, "README.md": "x\n"},
        {"a.py": BUGGY, "b.py": other, "README.md": "y = undefined\n"},
    )
    files = {"a.py": BUGGY, "b.py": other, "README.md": "y = undefined\n"}
    report, _ = await _report(
        RuffAdapter("ruff"), Prompt(task_type="code_review", content={"diff": diff, "files": files})
    )
    assert {f.file for f in report.findings} == {"a.py"}
    assert report.summary == "ruff: 4 finding(s) in 1 file(s); 1 non-Python file(s) skipped"


async def test_scope_changed_needs_a_diff() -> None:
    with pytest.raises(AgentError) as e:
        await _report(RuffAdapter("ruff"), Prompt(task_type="code_review", content={"files": {"a.py": BUGGY}}))
    assert e.value.code is ErrorCode.EPROTO and "content.diff" in e.value.reason and e.value.agent == "ruff"


@pytest.mark.parametrize(
    "path",
    ["../evil.py", "/etc/evil.py", "a/../../evil.py", "a/../b.py", "C:evil.py", "./a.py", "a//b.py", "a\\b.py", ""],
)
async def test_path_traversal_is_refused(path: str) -> None:
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("atp-tool-")}
    with pytest.raises(AgentError) as e:
        await _report(
            RuffAdapter("ruff", scope="file"), Prompt(task_type="code_review", content={"files": {path: "x = 1\n"}})
        )
    assert e.value.code is ErrorCode.EPROTO
    # Nothing written, not even the work dir.
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("atp-tool-")} == before
    assert not Path("/etc/evil.py").exists()


async def test_malformed_files_are_refused() -> None:
    for content in (
        {"files": ["a.py"]},
        {"files": {"a.py": b"x"}},
        {},
        {"files": {"a.py": "x", "a.py/b.py": "y"}},
        {"files": {"a.py/b.py": "y", "a.py": "x"}},
    ):
        with pytest.raises(AgentError) as e:
            await _report(BanditAdapter("b", scope="file"), Prompt(task_type="code_review", content=content))
        assert e.value.code is ErrorCode.EPROTO


async def test_odd_but_legal_names_and_crlf_text() -> None:
    # A file named like an option must not be read as one; CRLF text keeps its lines.
    files = {"-s.py": "import yaml\r\nyaml.load(open('f'))\r\n", "dir with space/é.py": "print(nope)\n"}
    report, _ = await _report(
        RuffAdapter("ruff", scope="file"), Prompt(task_type="code_review", content={"files": files})
    )
    assert _rows(report) == {("-s.py", 2, "S506", H), ("dir with space/é.py", 1, "F821", H)}


class _ScriptTool(RuffAdapter):
    """A real subprocess (the venv's python) standing in for an analyser that
    misbehaves: exits non-zero with its cwd on stderr, or prints non-JSON."""

    tool = "python"

    def __init__(self, code: str, limits: ToolLimits = DEFAULT_LIMITS) -> None:
        super().__init__("script", scope="file", limits=limits)
        self.code = code

    def argv(self, paths: list[str]) -> list[str]:
        return ["-c", self.code, *paths]


async def test_analyser_crash_is_agentdown_without_workdir_paths() -> None:
    tool = _ScriptTool("import os, sys; sys.stderr.write('boom in ' + os.getcwd() + '/x.py'); sys.exit(3)")
    with pytest.raises(AgentError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert e.value.code is ErrorCode.EAGENTDOWN
    assert e.value.reason.startswith("python exited with status 3: boom in ")
    assert "atp-tool-" not in e.value.reason and tempfile.gettempdir() not in e.value.reason
    assert tool.health().error_rate == 1.0 and not tool.health().up


async def test_analyser_bad_json_is_eproto() -> None:
    tool = _ScriptTool("print('not json')")
    with pytest.raises(AgentError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert e.value.code is ErrorCode.EPROTO


async def test_ruff_rejecting_its_arguments_is_agentdown() -> None:
    with pytest.raises(AgentError) as e:
        await _report(
            RuffAdapter("ruff", scope="file", select=["ZZZ999"]),
            Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}),
        )
    assert e.value.code is ErrorCode.EAGENTDOWN and "ZZZ999" in e.value.reason


def _running(marker: str) -> list[int]:
    """Host pids of the live (not zombie) processes whose command line holds
    ``marker``: how a test sees a sandboxed run's processes from outside."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and not _gone(int(pid)):
                out.append(int(pid))
        except OSError:
            continue
    return out


async def _until(cond, timeout: float = 20) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


async def test_cancellation_removes_the_work_dir() -> None:
    marker = f"atp-marker-{os.getpid()}-cancel"
    before = _workdirs()
    tool = _ScriptTool(f"import time; time.sleep(30)  # {marker}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_report, tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
        await _until(lambda: _running(marker))
        [workdir] = _workdirs() - before
        assert (Path(tempfile.gettempdir(), workdir) / "a.py").read_text() == "x = 1\n"
        nursery.cancel_scope.cancel()
    assert _workdirs() == before and not _running(marker)
    assert tool.health().error_rate == 0  # a cancelled run is the caller's deadline, not a tool failure


async def test_parallel_runs_do_not_share_state() -> None:
    ruff = RuffAdapter("ruff", scope="file")
    results: dict[int, AgentReport] = {}

    async def one(i: int) -> None:
        src = "x = 1\n" * i + "print(missing)\n"
        results[i], _ = await _report(ruff, Prompt(task_type="code_review", content={"files": {"m.py": src}}))

    async with trio.open_nursery() as nursery:
        for i in range(1, 7):
            nursery.start_soon(one, i)
    assert {i: [(f.start, f.rule) for f in r.findings] for i, r in results.items()} == {
        i: [(i + 1, "F821")] for i in range(1, 7)
    }
    assert ruff.health().error_rate == 0 and ruff.health().p95_ms > 0


def test_estimate_capabilities_and_grades() -> None:
    prompt = Prompt(task_type="code_review", content={"files": {"a.py": BUGGY * 100}})
    assert RuffAdapter().estimate(prompt) == CostEstimate() == BanditAdapter().estimate(prompt)
    caps = BanditAdapter("sec", strengths=["security"]).capabilities()
    assert (caps.agent, caps.skills, caps.tools) == ("sec", ["security"], ["bandit"])
    assert "bug_detection" in RuffAdapter().capabilities().skills
    assert grade("F821") == (H, 0.8) and grade("F401") == (L, 0.7) and grade("F999") == (M, 0.75)
    assert grade("S506")[0] is H and grade("S112")[0] is L and grade("XYZ1") == (L, 0.5)
    with pytest.raises(ValueError):
        RuffAdapter(scope="everything")
    with pytest.raises(ValueError):
        RuffAdapter(select=["E9; rm -rf /"])


def test_registry_builds_tools_from_rib_entries() -> None:
    agent = msgspec.convert(
        {"layer": "L1", "p95_ms": 200, "tool": "ruff", "scope": "file", "options": {"select": ["F"], "context": 2}},
        AgentSpec,
    )
    ruff = build_adapter("lint.ruff", agent)
    assert isinstance(ruff, RuffAdapter) and (ruff.name, ruff.scope, ruff.select, ruff.context) == (
        "lint.ruff",
        "file",
        ["F"],
        2,
    )
    bandit = build_adapter("sec.bandit", AgentSpec(layer="L1", p95_ms=900, tool="bandit", options={"skip": []}))
    assert isinstance(bandit, BanditAdapter) and bandit.skip == [] and bandit.scope == "changed"
    with pytest.raises(ValueError, match=r"options\.selekt: unknown option for tool ruff \(known: address_space_bytes, allow_suppressions, context, cpu_s, ignore"):
        build_adapter("x", AgentSpec(layer="L1", p95_ms=1, tool="ruff", options={"selekt": ["F"]}))
    with pytest.raises(ValueError, match=r"options\.context: expected int"):
        build_adapter("x", AgentSpec(layer="L1", p95_ms=1, tool="bandit", options={"context": True}))
    # Resource limits ride in the same options; the agent's timeout_ms is the tool's wall clock.
    limited = build_adapter("x", AgentSpec(layer="L1", p95_ms=1, tool="ruff", timeout_ms=5_000,
                                           options={"cpu_s": 5, "max_file_bytes": 4096}))
    assert (limited.limits.cpu_s, limited.limits.max_file_bytes, limited.limits.timeout_s) == (5, 4096, 5.0)
    with pytest.raises(ValueError, match=r"options\.cpu_s"):
        build_adapter("x", AgentSpec(layer="L1", p95_ms=1, tool="ruff", options={"cpu_s": 0}))
    google = ModelSpec(provider="google", ctx="2M", cost=3.0)
    gemini = build_adapter("reviewer.gemini", AgentSpec(layer="L3", p95_ms=1200, model="gemini-pro"), google)
    assert type(gemini).__name__ == "GeminiAdapter" and gemini.model == "gemini-pro"


# --- the golden review tasks ------------------------------------------------------

GOLDEN = [json.loads(line) for line in Path("/work/shared/golden/dev.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("scope", ["changed", "file"])
async def test_tools_run_cleanly_on_every_golden_task(scope: str) -> None:
    ruff, bandit = RuffAdapter("ruff", scope=scope), BanditAdapter("bandit", scope=scope)
    catches: list[str] = []

    async def review(task: dict) -> None:
        prompt = Prompt(task_type="code_review", content={"diff": task["diff"], "files": task["files"]})
        touched = changed_lines(parse_diff(task["diff"]))
        for adapter in (ruff, bandit):
            report, _ = await _report(adapter, prompt)
            for f in report.findings:
                n_lines = len(task["files"][f.file].splitlines())
                assert 1 <= f.start <= f.end <= n_lines
                if scope == "changed":
                    assert any(f.start <= n <= f.end for n in touched[f.file])
                hit = any(
                    e["file"] == f.file and e["start"] - 3 <= f.end and f.start <= e["end"] + 3
                    for e in task["expected"]
                )
                mark = " <- expected" if hit else ""
                catches.append(f"{task['id']} {adapter.name} {f.file}:{f.start} {f.severity} {f.claim}{mark}")

    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(4)

        async def limited(task: dict) -> None:
            async with limiter:
                await review(task)

        for task in GOLDEN:
            nursery.start_soon(limited, task)
    assert len(GOLDEN) == 26
    assert ruff.health().error_rate == 0 and bandit.health().error_rate == 0
    print(f"\n{scope}: {len(catches)} finding(s) on the golden tasks")
    print("\n".join(sorted(catches)))
    if scope == "changed":
        # thefuck-23 swaps a safe cache for pickle on a changed line: both tools see it.
        assert any(c.startswith("bugsinpy-thefuck-23 ruff thefuck/utils.py:183 medium S301") for c in catches)
        assert any(c.startswith("bugsinpy-thefuck-23 bandit thefuck/utils.py:183 medium B301") for c in catches)


# --- bounded resources (issue 7: one task must not stall the router) -----------------

KIB, MIB = 1024, 1024 * 1024


def dense(n_bytes: int) -> str:
    """Python text of about ``n_bytes`` (whole lines) on which ruff reports several
    findings per line: its JSON report is ~80 times the input."""
    out, size, i = [], 0, 0
    while size < n_bytes:
        line = f"def f{i}(a=[]):\n    eval(a); x == None; import os\n"
        out.append(line)
        size += len(line)
        i += 1
    return "".join(out)


def _workdirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("atp-tool-")}


def _gone(pid: int) -> bool:
    """The process exited (or is a zombie waiting for a reaper that is not us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] in "ZX"
    except FileNotFoundError:
        return True


def test_limits_defaults_validation_and_rib_options() -> None:
    assert DEFAULT_LIMITS == ToolLimits(
        max_file_bytes=MIB, max_files_bytes=8 * MIB, max_files=2000, max_diff_bytes=8 * MIB, cpu_s=60,
        address_space_bytes=2 * 1024 * MIB, output_bytes=16 * MIB, timeout_s=60.0, max_procs=256,
        max_write_bytes=64 * MIB,
    )
    assert RuffAdapter().limits is DEFAULT_LIMITS and BanditAdapter().limits is DEFAULT_LIMITS
    assert LIMIT_OPTIONS == {"max_file_bytes", "max_files_bytes", "max_files", "max_diff_bytes", "cpu_s",
                             "address_space_bytes", "output_bytes", "timeout_s", "max_procs", "max_write_bytes"}
    for bad in ({"cpu_s": 0}, {"max_files": -1}, {"output_bytes": 1.5}, {"timeout_s": 0.0}, {"max_file_bytes": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ToolLimits(**bad)
    got = ToolLimits.from_options({"max_file_bytes": 2 * MIB, "timeout_s": 5, "select": ["F"]})
    assert got == ToolLimits(max_file_bytes=2 * MIB, timeout_s=5)
    with pytest.raises(ValueError, match=r"^options\.cpu_s: must be a positive number"):
        ToolLimits.from_options({"cpu_s": -1})
    with pytest.raises(TypeError, match="limits must be ToolLimits"):
        RuffAdapter(limits={"cpu_s": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "limits", "named"),
    [
        # The attack of issue 7: a 5 MB file (refused before it is even encoded).
        ({"files": {"big.py": "x = 1\n" * 900_000}}, DEFAULT_LIMITS, "over the limit max_file_bytes=1,048,576 (1 MiB)"),
        # UTF-8 bytes count, not characters: 600 × "é" is 1,200 bytes.
        ({"files": {"é.py": "é" * 600}}, ToolLimits(max_file_bytes=1000),
         "is 1,200 bytes, over the limit max_file_bytes=1,000"),
        ({"files": {"a.py": "x" * 600, "b/c.py": "y" * 600}}, ToolLimits(max_files_bytes=1000),
         "over the limit max_files_bytes=1,000"),
        ({"files": {f"m{i}.txt": "" for i in range(11)}}, ToolLimits(max_files=10),
         "has 11 files, over the limit max_files=10"),
        ({"diff": "+" * 2000, "files": {"a.py": "x = 1\n"}}, ToolLimits(max_diff_bytes=1000),
         "content.diff is at least 2,000 bytes, over the limit max_diff_bytes=1,000"),
        ({"diff": "+" + "é" * 600, "files": {"a.py": "x = 1\n"}}, ToolLimits(max_diff_bytes=1000),
         "content.diff is 1,201 bytes, over the limit max_diff_bytes=1,000"),
    ],
)
async def test_task_over_a_limit_is_a_client_error_and_runs_nothing(content, limits, named) -> None:
    before = _workdirs()
    tool = _ScriptTool("raise SystemExit(9)", limits=limits)  # would be EAGENTDOWN if it ran
    with pytest.raises(ClientInputError) as e:
        await _report(tool, Prompt(task_type="code_review", content=content))
    assert e.value.code is ErrorCode.EPROTO and e.value.client_fault and e.value.agent == "script"
    assert named in e.value.reason
    assert _workdirs() == before  # nothing written, nothing run
    assert tool.health().error_rate == 0 and tool.health().up  # the client's fault, not the tool's


async def test_refused_paths_and_bad_content_are_client_faults() -> None:
    changed, whole = RuffAdapter("ruff", scope="changed"), RuffAdapter("ruff", scope="file")
    for adapter, content in (
        (changed, {"files": {"../x.py": "x = 1\n"}}),
        (changed, {"files": ["a.py"]}),
        (changed, {"files": {"a.py": "x = 1\n"}}),  # no diff
        (changed, {"diff": 7, "files": {}}),
        (whole, {"files": {"a.py": "x = 1\n"}, "diff": ["not", "a", "diff"]}),
        (whole, {"files": {"a.py": "x", "a.py/b.py": "y"}}),  # cannot be laid out as a tree
        (whole, {"files": {"a.py": "\ud800"}}),  # a lone surrogate: no UTF-8 for it
    ):
        with pytest.raises(ClientInputError) as e:
            await _report(adapter, Prompt(task_type="code_review", content=content))
        assert e.value.code is ErrorCode.EPROTO
    assert changed.health().error_rate == 0 and whole.health().error_rate == 0


async def test_big_non_python_files_are_skipped_not_refused() -> None:
    content = {"files": {"fixture.json": "[" + "0," * MIB + "0]", "a.py": "print(nope)\n"}}
    report, _ = await _report(RuffAdapter("ruff", scope="file"), Prompt(task_type="code_review", content=content))
    assert [(f.file, f.rule) for f in report.findings] == [("a.py", "F821")]
    assert report.summary.endswith("1 non-Python file(s) skipped")


async def test_address_space_limit_is_named() -> None:
    tool = _ScriptTool("bytearray(1024 * 2**20)", limits=ToolLimits(address_space_bytes=256 * MIB))
    with pytest.raises(ClientInputError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert "address_space_bytes=268,435,456 (256 MiB)" in e.value.reason and "MemoryError" in e.value.reason
    assert tool.health().error_rate == 0


async def test_cpu_limit_is_named() -> None:
    tool = _ScriptTool("while True: pass", limits=ToolLimits(cpu_s=1))
    t0 = trio.current_time()
    with pytest.raises(ClientInputError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert e.value.reason == "python used up its CPU limit cpu_s=1 s on this task; killed"
    assert trio.current_time() - t0 < 20  # ~1 s of CPU, however loaded the machine


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_output_cap_kills_the_analyser(stream: str) -> None:
    marker = f"atp-marker-{os.getpid()}-flood-{stream}"
    code = f"import sys, time; sys.{stream}.write('x' * (4 * 2**20)); sys.{stream}.flush(); time.sleep(60)  # {marker}"
    tool = _ScriptTool(code, limits=ToolLimits(output_bytes=MIB))
    t0 = trio.current_time()
    with pytest.raises(ClientInputError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert e.value.reason == "python wrote more than the output limit output_bytes=1,048,576 (1 MiB) for this task; killed"
    assert trio.current_time() - t0 < 30 and not _running(marker)


async def test_wall_clock_timeout_kills_the_whole_sandbox() -> None:
    """An analyser that hangs on every input (its canary too) is the next-hop's
    ETIMEOUT; it and the detached child it started are gone."""
    marker = f"atp-marker-{os.getpid()}-hang"
    code = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)  # {marker}'], start_new_session=True); time.sleep(60)  # {marker}")
    tool = _ScriptTool(code, limits=ToolLimits(timeout_s=2))
    t0 = trio.current_time()
    with pytest.raises(AgentError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "x = 1\n"}}))
    assert not isinstance(e.value, ClientInputError)  # the tool's own failure: its canary hangs too
    assert (e.value.code, e.value.reason) == (
        ErrorCode.ETIMEOUT,
        "python ran past its wall-clock limit timeout_s=2 s; killed; a canary task failed on python too")
    assert trio.current_time() - t0 < 40
    assert not _running(marker)


async def test_a_timeout_only_this_task_causes_is_the_tasks_fault() -> None:
    """The analyser hangs on one file only: its canary runs clean, so the timeout
    is the task's (ClientInputError ETIMEOUT: no breaker count, no retry)."""
    code = "import sys, time; src = open(sys.argv[-1]).read(); time.sleep(60 if 'HANG' in src else 0); print('[]')"
    tool = _ScriptTool(code, limits=ToolLimits(timeout_s=2))
    with pytest.raises(ClientInputError) as e:
        await _report(tool, Prompt(task_type="code_review", content={"files": {"a.py": "HANG = 1\n"}}))
    assert e.value.code is ErrorCode.ETIMEOUT and e.value.client_fault
    assert "caused by this task: a canary task ran clean" in e.value.reason
    assert tool.health().error_rate == 0


async def test_cancellation_kills_the_analyser() -> None:
    marker = f"atp-marker-{os.getpid()}-cancelled"
    tool = _ScriptTool(f"import time; time.sleep(60)  # {marker}")
    with trio.move_on_after(20) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_report, tool, Prompt(task_type="code_review", content={"files": {"a.py": "x\n"}}))
            await _until(lambda: _running(marker))
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught and not _running(marker)


async def test_real_ruff_past_its_output_and_memory_limits() -> None:
    prompt = Prompt(task_type="code_review", content={"files": {"d.py": dense(64 * KIB)}})
    with pytest.raises(ClientInputError) as e:
        await _report(RuffAdapter("ruff", scope="file", limits=ToolLimits(output_bytes=256 * KIB)), prompt)
    assert "output limit output_bytes=262,144 (256 KiB)" in e.value.reason
    prompt = Prompt(task_type="code_review", content={"files": {"d.py": dense(600 * KIB)}})
    with pytest.raises(ClientInputError) as e:
        await _report(RuffAdapter("ruff", scope="file", limits=ToolLimits(address_space_bytes=64 * MIB)), prompt)
    assert "address-space limit address_space_bytes=67,108,864 (64 MiB)" in e.value.reason


async def test_large_report_is_parsed_off_the_event_loop() -> None:
    """~12 MB of ruff JSON (under the 16 MiB cap) becomes ~19,000 findings in a
    worker thread, not on the event loop's, while a ticker on the loop keeps
    beating. The ticker's longest gap is printed, not asserted: beside busy
    processes the GIL hand-offs between the parsing thread and the loop can
    stretch a gap past the parse's own duration (1.35 s against 1.18 s at load
    ~12), so the bound is the thread the parse ran on (issue 20)."""
    gaps: list[float] = []
    report: list[AgentReport] = []
    ruff = RuffAdapter("ruff", scope="file")  # built first, as at RIB load (the sandbox probe runs once there)
    parsed: list[tuple[bool, float]] = []  # (on the event loop's thread, seconds)
    parse, loop_thread = ruff.parse, threading.get_ident()

    def timed_parse(*args):
        t0 = time.perf_counter()
        try:
            return parse(*args)
        finally:
            parsed.append((threading.get_ident() == loop_thread, time.perf_counter() - t0))

    ruff.parse = timed_parse

    async def run() -> None:
        r, _ = await _report(ruff,
                             Prompt(task_type="code_review", content={"files": {"d.py": dense(160 * KIB)}}))
        report.append(r)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        last = trio.current_time()
        while not report:
            await trio.sleep(0.005)
            now = trio.current_time()
            gaps.append(now - last)
            last = now
    findings = report[0].findings
    assert len(findings) > 10_000 and {f.file for f in findings} == {"d.py"}
    assert {"B006", "S307", "E711", "F401"} <= {f.rule for f in findings}
    [(on_loop, parse_s)] = parsed
    print(f"\n{len(findings)} findings parsed in {parse_s * 1000:.0f} ms; event-loop gaps: max "
          f"{max(gaps) * 1000:.1f} ms over {len(gaps)} ticks")
    assert not on_loop  # a parse on the loop would stall the ticker for all of parse_s
