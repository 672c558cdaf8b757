"""pylint, mypy and semgrep next-hops against real code with known defects (and
clean code), configuration planted around the work directory, the limits, and
the RIB entries that build them. Every analyser run here is the real binary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

from atp_router.adapters.base import Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.base import DEFAULT_LIMITS, ToolLimits, find_executable
from atp_router.adapters.tools.mypy import MypyAdapter
from atp_router.adapters.tools.mypy import grade as mypy_grade
from atp_router.adapters.tools.pylint import PylintAdapter
from atp_router.adapters.tools.pylint import grade as pylint_grade
from atp_router.adapters.tools.semgrep import (
    DEFAULT_SEMGREP_LIMITS,
    RULE_PACKS,
    RULES_DIR,
    SemgrepAdapter,
    rule_ids,
)
from atp_router.consensus.types import AgentReport, Severity
from atp_router.policy.rib import AgentSpec
from atp_router.task.diff import changed_lines, parse_diff
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import CostEstimate, PayloadType

H, M, L = Severity.HIGH, Severity.MEDIUM, Severity.LOW
GIB = 1024**3

BUGGY = """\
import os


def collect(item, acc=[]):
    acc.append(item)
    return acc


def check(flag):
    assert (flag, "flag must be set")
    return undefined_name


class Box:
    size = 1


def area(box: Box) -> int:
    return box.width * 2


def parse(x: int) -> str:
    return x + 1


def search_path():
    return os.environ.get("PATH", "").split(":")
"""

CLEAN = """\
import os


def collect(item, acc=None):
    acc = [] if acc is None else acc
    acc.append(item)
    return acc


def search_path() -> list[str]:
    return os.environ.get("PATH", "").split(os.pathsep)
"""


def _prompt(files: dict[str, str], diff: str | None = None) -> Prompt:
    content: dict = {"files": files}
    if diff is not None:
        content["diff"] = diff
    return Prompt(task_type="code_review", content=content)


async def _report(adapter, prompt: Prompt) -> AgentReport:
    frags = [f async for f in adapter.stream(prompt)]
    assert [f.type for f in frags] == [PayloadType.FINAL]
    assert frags[0].usage is not None and frags[0].usage.tokens == 0 and frags[0].usage.usd_micros == 0
    assert isinstance(frags[0].content, AgentReport)
    return frags[0].content


def _rows(report: AgentReport) -> set[tuple]:
    return {(f.file, f.start, f.rule, f.severity) for f in report.findings}


def test_binaries_come_from_the_venv() -> None:
    for tool in ("pylint", "mypy"):
        assert find_executable(tool) == str(Path(sys.executable).parent / tool)
    # semgrep has its own virtualenv under the router's prefix (scripts/setup.sh):
    # its dependencies never mix with the router's.
    assert find_executable("semgrep") == str(Path(sys.prefix) / "tools" / "semgrep" / "bin" / "semgrep")
    assert not (Path(sys.executable).parent / "semgrep").exists()


# --- pylint --------------------------------------------------------------------------


async def test_pylint_finds_the_known_defects() -> None:
    report = await _report(PylintAdapter("pylint", scope="file"), _prompt({"app/buggy.py": BUGGY}))
    assert _rows(report) == {
        ("app/buggy.py", 4, "W0102", M),  # mutable default argument
        ("app/buggy.py", 10, "W0199", H),  # assert on a tuple never fails
        ("app/buggy.py", 11, "E0602", H),  # undefined name
    }
    e0602 = next(f for f in report.findings if f.rule == "E0602")
    assert e0602.claim == "E0602 undefined-variable: Undefined variable 'undefined_name'"
    assert e0602.confidence == 0.8 and e0602.end == 11
    assert [f.ref for f in report.findings] == ["1", "2", "3"]
    assert report.summary == "pylint: 3 finding(s) in 1 file(s)"


async def test_pylint_clean_code_and_syntax_errors() -> None:
    report = await _report(PylintAdapter("pylint", scope="file"), _prompt({"clean.py": CLEAN}))
    assert report.findings == [] and report.summary == "pylint: 0 finding(s) in 1 file(s)"
    report = await _report(PylintAdapter("pylint", scope="file"), _prompt({"bad.py": "def f(:\n    pass\n"}))
    assert [(f.start, f.rule, f.severity) for f in report.findings] == [(1, "E0001", H)]
    assert report.summary.endswith("1 file(s) do not parse")


async def test_pylint_enable_disable() -> None:
    adapter = PylintAdapter("pylint", scope="file", enable=["E"], disable=["undefined-variable"])
    report = await _report(adapter, _prompt({"app/buggy.py": BUGGY}))
    assert report.findings == []
    adapter = PylintAdapter("pylint", scope="file", enable=["dangerous-default-value"], disable=[])
    assert {f.rule for f in (await _report(adapter, _prompt({"app/buggy.py": BUGGY}))).findings} == {"W0102"}


# --- mypy ----------------------------------------------------------------------------


async def test_mypy_finds_the_known_defects() -> None:
    report = await _report(MypyAdapter("mypy", scope="file"), _prompt({"app/buggy.py": BUGGY}))
    assert _rows(report) == {
        ("app/buggy.py", 10, "misc", L),  # "Assertion is always true"
        ("app/buggy.py", 11, "name-defined", H),
        ("app/buggy.py", 19, "attr-defined", H),
        ("app/buggy.py", 23, "return-value", M),
    }
    attr = next(f for f in report.findings if f.rule == "attr-defined")
    assert attr.claim == 'attr-defined: "Box" has no attribute "width"' and attr.confidence == 0.65


async def test_mypy_clean_code_same_named_modules_and_syntax_errors() -> None:
    # Two utils.py in different directories are two modules, not a clash.
    files = {"a/utils.py": CLEAN, "b/utils.py": CLEAN, "my-pkg/x.py": "def f() -> int:\n    return 'x'\n"}
    report = await _report(MypyAdapter("mypy", scope="file"), _prompt(files))
    assert _rows(report) == {("my-pkg/x.py", 2, "return-value", M)}
    report = await _report(MypyAdapter("mypy", scope="file"), _prompt({"bad.py": "x: int = \n", "ok.py": CLEAN}))
    assert _rows(report) == {("bad.py", 1, "syntax", H)}
    assert report.summary.endswith("1 file(s) do not parse (mypy checks nothing past a syntax error)")


async def test_mypy_untyped_defs_and_disabled_codes() -> None:
    src = "def f(box):\n    n = None\n    return n.upper()\n"
    checked = await _report(MypyAdapter("mypy", scope="file"), _prompt({"u.py": src}))
    assert [(f.start, f.rule) for f in checked.findings] == [(3, "attr-defined")]
    unchecked = await _report(MypyAdapter("mypy", scope="file", check_untyped_defs=False), _prompt({"u.py": src}))
    assert unchecked.findings == []
    quiet = MypyAdapter("mypy", scope="file", disable_error_codes=["name-defined", "attr-defined", "return-value", "misc"])
    assert (await _report(quiet, _prompt({"app/buggy.py": BUGGY}))).findings == []


# --- semgrep -------------------------------------------------------------------------

#: Every shipped rule: a snippet it must flag (on the line marked ``# bad``) and a
#: close variant it must not flag.
RULE_CASES: dict[str, tuple[str, str]] = {
    "regex-nested-quantifier": (
        'import re\nWORDS = re.compile(r"^(\\w+\\s?)+$")  # bad\n',
        'import re\nWORDS = re.compile(r"^\\w+(?:\\s\\w+)*$")\n',
    ),
    "regex-quantified-alternation": (
        'QUOTED = r"\'(\'\'|\\\\\\\\|\\\\\'|[^\'])*\'"  # bad\n',
        'QUOTED = r"\'(?:[^\'\\\\]|\\\\.)*\'"\n',
    ),
    "regex-wildcard-in-optional-prefix": (
        'AUTH = r"^(?:(.*)@)?([^:]+)(?::(\\d+))?$"  # bad\n',
        'AUTH = r"^(?:([^@]*)@)?([^:]+)(?::(\\d+))?$"\n',
    ),
    "regex-flags-as-count": (
        'import re\ndef f(s):\n    return re.sub(r"a", "b", s, re.IGNORECASE)  # bad\n',
        'import re\ndef f(s):\n    return re.sub(r"a", "b", s, flags=re.IGNORECASE)\n',
    ),
    "subprocess-shell-with-dynamic-command": (
        'import subprocess\ndef f(name):\n    subprocess.call("ls " + name, shell=True)  # bad\n',
        'import subprocess\ndef f(name):\n    subprocess.call(["ls", name])\n    subprocess.call("ls -l", shell=True)\n',
    ),
    "os-shell-with-dynamic-command": (
        'import os\ndef f(name):\n    os.system("rm " + name)  # bad\n',
        'import os\ndef f():\n    os.system("true")\n',
    ),
    "tls-verification-disabled": (
        'import ssl\ndef f():\n    ctx = ssl.create_default_context()\n    ctx.check_hostname = False  # bad\n',
        'import ssl\ndef f():\n    ctx = ssl.create_default_context()\n    ctx.check_hostname = True\n',
    ),
    "yaml-unsafe-load": (
        'import yaml\ndef f(fh):\n    return yaml.load(fh)  # bad\n',
        'import yaml\ndef f(fh):\n    return yaml.load(fh, Loader=yaml.SafeLoader)\n',
    ),
    "unsafe-deserialisation": (
        'import shelve\ndef f(path):\n    with shelve.open(path) as db:  # bad\n        return db["k"]\n',
        'import json\ndef f(fh):\n    return json.load(fh)\n',
    ),
    "eval-of-dynamic-string": (
        'def f(expr):\n    return eval(expr)  # bad\n',
        'import ast\ndef f(expr):\n    return ast.literal_eval(expr)\n',
    ),
    "insecure-mktemp": (
        'import tempfile\nPATH = tempfile.mktemp()  # bad\n',
        'import tempfile\nFD, PATH = tempfile.mkstemp()\n',
    ),
    "sql-built-from-strings": (
        'def f(cur, name):\n    cur.execute("SELECT * FROM t WHERE n = \'%s\'" % name)  # bad\n',
        'def f(cur, name):\n    cur.execute("SELECT * FROM t WHERE n = ?", (name,))\n',
    ),
    "weak-random-for-secret": (
        'import random\ndef f():\n    reset_token = random.getrandbits(64)  # bad\n    return reset_token\n',
        'import secrets\ndef f():\n    reset_token = secrets.token_hex(8)\n    return reset_token\n',
    ),
    "timing-unsafe-secret-comparison": (
        'def f(signature, expected):\n    return signature == expected  # bad\n',
        'import hmac\ndef f(signature, expected):\n    return hmac.compare_digest(signature, expected)\n',
    ),
    "path-prefix-containment-check": (
        'import os\ndef f(base, p):\n    return os.path.realpath(p).startswith(base)  # bad\n',
        'import os\ndef f(base, p):\n    return os.path.commonpath([os.path.realpath(p), base]) == base\n',
    ),
    "path-list-split-on-hardcoded-separator": (
        'import os\nDIRS = os.environ.get("PATH", "").split(":")  # bad\n',
        'import os\nDIRS = os.environ.get("PATH", "").split(os.pathsep)\nTAGS = os.environ.get("TAGS", "").split(":")\n',
    ),
    "path-list-joined-on-hardcoded-separator": (
        'import os\ndef f(dirs):\n    os.environ["PYTHONPATH"] = ":".join(dirs)  # bad\n',
        'import os\ndef f(dirs):\n    os.environ["PYTHONPATH"] = os.pathsep.join(dirs)\n',
    ),
    "regex-findall-indexed": (
        'import re\ndef f(out):\n    return re.findall(r"error: (\\w+)", out)[0]  # bad\n',
        'import re\ndef f(out):\n    m = re.search(r"error: (\\w+)", out)\n    return m.group(1) if m else None\n',
    ),
    "regex-match-result-unchecked": (
        'import re\ndef f(s):\n    return re.match(r"(\\d+)", s).group(1)  # bad\n',
        'import re\ndef f(s):\n    m = re.match(r"(\\d+)", s)\n    return m and m.group(1)\n',
    ),
    "split-field-indexed-unchecked": (
        'def f(script):\n    return script.split()[1] == "stash"  # bad\n',
        'def f(script):\n    parts = script.split()\n    return len(parts) > 1 and parts[1] == "stash"\n',
    ),
    "split-on-single-space": (
        'def f(script):\n    return script.split(" ")  # bad\n',
        'def f(script):\n    return script.split()\n',
    ),
    "identity-comparison-with-literal": (
        'def f(i):\n    return i is not -1  # bad\n',
        'def f(i):\n    return i != -1 and i is not None\n',
    ),
    "exception-swallowed": (
        'def f(x):\n    try:  # bad\n        return int(x)\n    except ValueError:\n        pass\n',
        'def f(x):\n    try:\n        return int(x)\n    except ValueError:\n        return None\n',
    ),
    "path-join-absolute-component": (
        'import os\ndef f(base):\n    return os.path.join(base, "/etc/app.conf")  # bad\n',
        'import os\ndef f(base):\n    return os.path.join(base, "etc/app.conf")\n',
    ),
    "popen-pipe-read-without-reaping": (
        ('from subprocess import PIPE, Popen\ndef f():\n    proc = Popen(["fish", "-v"], stdout=PIPE)\n'
         '    return proc.stdout.read()  # bad\n'),
        ('from subprocess import PIPE, Popen\ndef f():\n    proc = Popen(["fish", "-v"], stdout=PIPE)\n'
         '    out, _ = proc.communicate()\n    return out\n'),
    ),
}


def test_every_shipped_rule_has_a_case_and_metadata() -> None:
    ids = rule_ids()
    assert set(RULE_CASES) == set(ids) and set(RULE_PACKS) == {"correctness", "regex", "security"}
    import yaml

    for pack in RULE_PACKS:
        for rule in yaml.safe_load((RULES_DIR / f"{pack}.yaml").read_text())["rules"]:
            assert rule["languages"] == ["python"] and rule["severity"] in ("ERROR", "WARNING", "INFO")
            assert len(rule["message"]) > 40 and rule["metadata"]["confidence"] in ("HIGH", "MEDIUM", "LOW")
            assert rule["metadata"].get("cwe", "CWE-").startswith("CWE-")


async def test_semgrep_rules_flag_their_defect_and_not_the_fix() -> None:
    bad = {f"bad/{rid.replace('-', '_')}.py": src for rid, (src, _) in RULE_CASES.items()}
    good = {f"good/{rid.replace('-', '_')}.py": src for rid, (_, src) in RULE_CASES.items()}
    report = await _report(SemgrepAdapter("semgrep", scope="file"), _prompt({**bad, **good}))
    got = {(f.file, f.start, f.rule) for f in report.findings}
    want = set()
    for rid, (src, _) in RULE_CASES.items():
        line = next(i for i, text in enumerate(src.splitlines(), 1) if text.endswith("# bad"))
        want.add((f"bad/{rid.replace('-', '_')}.py", line, rid))
    assert want <= got, sorted(want - got)
    # Nothing on the fixed variants, and nothing of another rule on the defects.
    assert got - want == set(), sorted(got - want)
    shell = next(f for f in report.findings if f.rule == "subprocess-shell-with-dynamic-command")
    assert (shell.severity, shell.confidence, shell.cwe) == (H, 0.85, "CWE-78")
    redos = next(f for f in report.findings if f.rule == "regex-quantified-alternation")
    assert (redos.severity, redos.confidence, redos.cwe) == (M, 0.4, "CWE-1333")
    assert redos.claim.startswith("regex-quantified-alternation: Regex repeats an alternation")


async def test_semgrep_known_defects_packs_and_exclusions() -> None:
    report = await _report(SemgrepAdapter("semgrep", scope="file"), _prompt({"app/buggy.py": BUGGY}))
    assert _rows(report) == {("app/buggy.py", 27, "path-list-split-on-hardcoded-separator", M)}
    clean = await _report(SemgrepAdapter("semgrep", scope="file"), _prompt({"clean.py": CLEAN}))
    assert clean.findings == [] and clean.summary == "semgrep: 0 finding(s) in 1 file(s)"
    only_security = SemgrepAdapter("semgrep", scope="file", rules=["security"])
    assert (await _report(only_security, _prompt({"app/buggy.py": BUGGY}))).findings == []
    excluded = SemgrepAdapter("semgrep", scope="file", exclude_rules=["path-list-split-on-hardcoded-separator"])
    assert (await _report(excluded, _prompt({"app/buggy.py": BUGGY}))).findings == []


# --- scope, golden tasks -------------------------------------------------------------

GOLDEN = {t["id"]: t for t in map(json.loads, Path("/work/shared/golden/dev.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("adapter_cls", [PylintAdapter, MypyAdapter, SemgrepAdapter])
async def test_scope_changed_keeps_only_changed_lines(adapter_cls) -> None:
    task = GOLDEN["bugsinpy-thefuck-2"]
    prompt = _prompt(task["files"], task["diff"])
    touched = changed_lines(parse_diff(task["diff"]))
    changed = await _report(adapter_cls("t", scope="changed"), prompt)
    whole = await _report(adapter_cls("t", scope="file"), prompt)
    for f in changed.findings:
        assert any(f.start <= n <= f.end for n in touched[f.file])
    assert {(f.file, f.start, f.rule) for f in changed.findings} <= {(f.file, f.start, f.rule) for f in whole.findings}
    if adapter_cls is SemgrepAdapter:
        # The defect of this task: PATH split on ':' instead of os.pathsep.
        assert ("thefuck/utils.py", 121, "path-list-split-on-hardcoded-separator") in {
            (f.file, f.start, f.rule) for f in changed.findings
        }


async def test_semgrep_catches_the_redos_literal_of_a_golden_advisory() -> None:
    task = GOLDEN["cve-intro-e75e35869473"]
    report = await _report(SemgrepAdapter("semgrep"), _prompt(task["files"], task["diff"]))
    assert ("sqlparse/lexer.py", 194, "regex-quantified-alternation") in {
        (f.file, f.start, f.rule) for f in report.findings
    }


# --- nothing around the work dir configures the analysers ----------------------------

def _planted(marker: Path) -> dict[str, str]:
    """Config files that would silence pylint and mypy, and make pylint run code
    (an ``init-hook`` writing ``marker``), if they were read."""
    hook = f'open({str(marker)!r}, "w").write("ran")'
    pylint_ini = f"[MAIN]\ninit-hook={hook}\nignore-patterns=.*\n[MESSAGES CONTROL]\ndisable=all\n"
    return {
        "pyproject.toml": (f"[tool.pylint.main]\ninit-hook = {json.dumps(hook)}\nignore-patterns = ['.*']\n"
                           "[tool.mypy]\nignore_errors = true\n"),
        ".pylintrc": pylint_ini,
        "pylintrc": pylint_ini,
        "setup.cfg": f"[pylint.main]\ninit-hook={hook}\n[mypy]\nignore_errors = True\n",
        "mypy.ini": "[mypy]\nignore_errors = True\n",
        ".mypy.ini": "[mypy]\nignore_errors = True\n",
        ".semgrepignore": "*.py\n",
        ".semgrep.yml": "rules: []\n",
    }


def _plant(where: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (where / name).write_text(text)
    (where / ".config" / "mypy").mkdir(parents=True, exist_ok=True)
    (where / ".config" / "mypy" / "config").write_text("[mypy]\nignore_errors = True\n")
    (where / ".config" / "pylintrc").write_text(files["pylintrc"])


def _control(probe: Path) -> tuple[bool, str]:
    """pylint and mypy run plainly in ``probe``: whether pylint ran the planted
    init-hook (the marker is removed again), and mypy's output."""
    bin_dir = Path(sys.executable).parent
    marker = probe.parent / "init-hook-ran"
    subprocess.run([bin_dir / "pylint", "--disable=all", "--enable=E", "m.py"], cwd=probe, capture_output=True,
                   check=False)
    ran = marker.exists() and marker.read_text() == "ran"
    marker.unlink(missing_ok=True)
    out = subprocess.run([bin_dir / "mypy", "--no-incremental", "--cache-dir=/dev/null", "m.py"], cwd=probe,
                         capture_output=True, text=True, check=True)
    return ran, out.stdout


async def test_planted_configuration_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = 'import os\nDIRS = os.environ.get("PATH", "").split(":")\nprint(undefined_name)\n'
    marker = tmp_path / "init-hook-ran"
    planted = _planted(marker)
    # Control: run where the planted files are, without the adapters' isolation,
    # the analysers do read them: pylint runs the hook, mypy goes quiet.
    probe = tmp_path / "probe"
    probe.mkdir()
    _plant(probe, planted)
    (probe / "m.py").write_text(src)
    hook_ran, mypy_out = _control(probe)
    assert hook_ran and "undefined_name" not in mypy_out

    # The task's own config files (never written: not Python), the parent of the
    # work dir (pylint and mypy look upwards) and $HOME all carry the same config.
    # The parent is under /tmp (any user may search it: a root router's runs are
    # unprivileged users of their own; the router's own atp-* dirs are made searchable).
    parent, home = Path(tempfile.mkdtemp(prefix="atp-planted-", dir="/tmp")), tmp_path / "home"
    home.mkdir()
    _plant(parent, planted)
    _plant(home, planted)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("PYLINTRC", str(home / ".pylintrc"))  # not passed on: the environment is minimal
    files = {"m.py": src, **planted}
    expected = {
        PylintAdapter: ("m.py", 3, "E0602"),
        MypyAdapter: ("m.py", 3, "name-defined"),
        SemgrepAdapter: ("m.py", 2, "path-list-split-on-hardcoded-separator"),
    }
    for cls, row in expected.items():
        report = await _report(cls("t", scope="file"), _prompt(files))
        assert row in {(f.file, f.start, f.rule) for f in report.findings}, (cls.__name__, report)
        assert f"{len(planted)} non-Python file(s) skipped" in report.summary
    assert not marker.exists()  # no hook ran
    assert not (home / ".semgrep").exists() and not (home / ".cache").exists()  # semgrep wrote into its work dir
    assert not any(p.name.startswith("atp-tool-") for p in parent.iterdir())  # work dirs removed
    shutil.rmtree(parent)


# --- exit statuses, limits -------------------------------------------------------------


class _ScriptPylint(PylintAdapter):
    """The venv's python standing in for pylint: prints an empty json2 report and
    exits with ``status``."""

    tool = "python"

    def __init__(self, status: int) -> None:
        super().__init__("script", scope="file")
        self.status = status

    def argv(self, paths: list[str]) -> list[str]:
        return ["-c", f"import sys; print('{{\"messages\": []}}'); sys.stderr.write('oops'); sys.exit({self.status})"]


class _ScriptMypy(MypyAdapter):
    tool = "python"

    def __init__(self, status: int, stderr: str) -> None:
        super().__init__("script", scope="file")
        self.status, self.stderr = status, stderr

    def argv(self, paths: list[str]) -> list[str]:
        return ["-c", f"import sys; sys.stderr.write({self.stderr!r}); sys.exit({self.status})"]


@pytest.mark.parametrize("status", [2, 4, 8, 16, 2 | 4 | 8 | 16])
async def test_pylint_found_something_statuses_are_success(status: int) -> None:
    report = await _report(_ScriptPylint(status), _prompt({"a.py": "x = 1\n"}))
    assert report.findings == []


@pytest.mark.parametrize("status", [1, 32, 1 | 4, 32 | 2])
async def test_pylint_fatal_and_usage_statuses_are_agentdown(status: int) -> None:
    with pytest.raises(AgentError) as e:
        await _report(_ScriptPylint(status), _prompt({"a.py": "x = 1\n"}))
    # The canary (the same script) fails too: the next-hop's fault.
    assert e.value.code is ErrorCode.EAGENTDOWN and not e.value.client_fault
    assert e.value.reason == f"python exited with status {status}: oops; a canary task failed on python too"


async def test_mypy_statuses() -> None:
    assert (await _report(_ScriptMypy(1, ""), _prompt({"a.py": "x = 1\n"}))).findings == []
    assert (await _report(_ScriptMypy(2, ""), _prompt({"a.py": "x = 1\n"}))).findings == []
    with pytest.raises(AgentError) as e:
        await _report(_ScriptMypy(2, "mypy: error: unrecognized arguments"), _prompt({"a.py": "x = 1\n"}))
    assert e.value.code is ErrorCode.EAGENTDOWN and "unrecognized arguments" in e.value.reason
    with pytest.raises(AgentError) as e:
        await _report(MypyAdapter("mypy", scope="file", python_version="3.1"), _prompt({"a.py": "x = 1\n"}))
    assert e.value.code is ErrorCode.EAGENTDOWN and "--python-version: Python 3.1 is not supported" in e.value.reason


async def test_pylint_wall_clock_timeout() -> None:
    src = "".join(f"def f{i}(a=[]):\n    return undefined_{i} + a[0]\n" for i in range(3000))
    with pytest.raises(AgentError) as e:
        await _report(PylintAdapter("pylint", scope="file", limits=ToolLimits(timeout_s=1)), _prompt({"d.py": src}))
    # Whose the timeout is depends on the canary (pylint's start-up alone may take 1 s on a loaded host).
    assert e.value.code is ErrorCode.ETIMEOUT
    assert e.value.reason.startswith("pylint ran past its wall-clock limit timeout_s=1 s; killed")


async def test_semgrep_needs_more_than_2_gib_of_address_space() -> None:
    """Why DEFAULT_SEMGREP_LIMITS has 4 GiB: under the shared 2 GiB semgrep-core
    cannot start; the default runs."""
    assert DEFAULT_SEMGREP_LIMITS.address_space_bytes == 4 * GIB and SemgrepAdapter().limits is DEFAULT_SEMGREP_LIMITS
    with pytest.raises(AgentError) as e:
        await _report(SemgrepAdapter("semgrep", scope="file", limits=ToolLimits(address_space_bytes=2 * GIB)),
                      _prompt({"a.py": CLEAN}))
    assert e.value.code in (ErrorCode.EAGENTDOWN, ErrorCode.EPROTO) or isinstance(e.value, ClientInputError)
    assert (await _report(SemgrepAdapter("semgrep", scope="file"), _prompt({"a.py": CLEAN}))).findings == []


# --- construction, registry ------------------------------------------------------------


def test_grades_estimates_and_validation() -> None:
    assert pylint_grade("E0602") == (H, 0.8) and pylint_grade("E1121") == (H, 0.75) and pylint_grade("E9999") == (H, 0.7)
    assert pylint_grade("W0611") == (L, 0.6) and pylint_grade("W0404") == (L, 0.45) and pylint_grade("C0114") == (L, 0.45)
    assert mypy_grade("name-defined") == (H, 0.8) and mypy_grade(None) == (L, 0.4) and mypy_grade("nope") == (L, 0.4)
    prompt = _prompt({"a.py": BUGGY})
    for cls in (PylintAdapter, MypyAdapter, SemgrepAdapter):
        assert cls().estimate(prompt) == CostEstimate() and cls().capabilities().tools == [cls.tool]
    assert PylintAdapter().limits is DEFAULT_LIMITS and MypyAdapter().limits is DEFAULT_LIMITS
    for bad in (
        lambda: PylintAdapter(enable=[]),
        lambda: PylintAdapter(disable=["W0102,--load-plugins=evil"]),
        lambda: MypyAdapter(disable_error_codes=["--strict"]),
        lambda: MypyAdapter(python_version="3.11; rm"),
        lambda: SemgrepAdapter(rules=[]),
        lambda: SemgrepAdapter(rules=["../../etc/passwd"]),
        lambda: SemgrepAdapter(rules=["regex"], exclude_rules=["exception-swallowed"]),
    ):
        with pytest.raises(ValueError):
            bad()


def test_registry_builds_the_analysers_from_rib_entries() -> None:
    def agent(tool: str, **options) -> AgentSpec:
        return msgspec.convert({"layer": "L1", "p95_ms": 900, "tool": tool, "scope": "file", "options": options},
                               AgentSpec)

    pylint = build_adapter("lint.pylint", agent("pylint", enable=["E"], disable=[], context=2, cpu_s=5))
    assert isinstance(pylint, PylintAdapter)
    assert (pylint.name, pylint.scope, pylint.enable, pylint.disable, pylint.context, pylint.limits.cpu_s) == (
        "lint.pylint", "file", ["E"], [], 2, 5)
    mypy = build_adapter("types.mypy", agent("mypy", check_untyped_defs=False, python_version="3.11"))
    assert isinstance(mypy, MypyAdapter) and (mypy.check_untyped_defs, mypy.python_version) == (False, "3.11")
    semgrep = build_adapter("sec.semgrep", agent("semgrep", rules=["security", "regex"]))
    assert isinstance(semgrep, SemgrepAdapter) and semgrep.rules == ["security", "regex"]
    assert semgrep.limits.address_space_bytes == 4 * GIB
    assert build_adapter("s", agent("semgrep", address_space_bytes=8 * GIB)).limits.address_space_bytes == 8 * GIB
    for tool, options, match in (
        ("pylint", {"enabled": ["E"]}, r"options\.enabled: unknown option for tool pylint \(known: address_space_bytes"),
        ("pylint", {"disable": ["W0102,evil"]}, r"^options\.disable: not a pylint message"),
        ("pylint", {"enable": "E"}, r"^options\.enable: expected list of strings"),
        ("mypy", {"check_untyped_defs": 1}, r"^options\.check_untyped_defs: expected bool"),
        ("mypy", {"python_version": "2"}, r"^options\.python_version: must look like"),
        ("mypy", {"disable_error_codes": ["A B"]}, r"^options\.disable_error_codes: not a mypy error code"),
        ("semgrep", {"rules": ["registry"]}, r"^options\.rules: not a semgrep rule pack: 'registry'"),
        ("semgrep", {"exclude_rules": ["nope"]}, r"^options\.exclude_rules: not a rule id"),
        ("semgrep", {"config": "p/python"}, r"^options\.config: unknown option for tool semgrep"),
        ("semgrep", {"cpu_s": 0}, r"^options\.cpu_s: must be a positive number"),
    ):
        with pytest.raises(ValueError, match=match):
            build_adapter("x", agent(tool, **options))
