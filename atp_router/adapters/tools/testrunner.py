"""pytest as a review next-hop (RIB ``tool: pytest``, alias ``tests``): run the
task's tests in a sandbox and report each failing test as a finding.

The task (``content``):

==================  ===============================================================
``files``           ``{path: text}``: the code and its tests (``test_*.py`` /
                    ``*_test.py``), any suffix (data files, ``conftest.py``,
                    ``pyproject.toml``); written byte for byte into a private
                    temporary directory (paths checked by
                    :func:`~atp_router.review.paths.safe_relpath`)
``repo``            optional: a checkout path on the router host, allowed only
                    inside one of the operator's ``options.repos`` roots (RIB
                    ``agents.<x>.options``, never the client's choice); its regular
                    files (no ``.git``, no symlinks) are copied into the sandbox
                    first, then ``files`` overlay them
``tests``           optional: what to run — a list of pytest node ids
                    (``tests/test_a.py::test_x``), ``{node_ids: [...]}``, or
                    ``{command: ["pytest", *args]}`` (also ``["python", "-m",
                    "pytest", …]``) whose args may only be node ids and the flags in
                    :data:`ALLOWED_FLAGS`; default: the tests touching ``diff``
                    (below), else pytest's own discovery
``diff``            optional: the reviewed change (unified diff, at most
                    ``max_files_bytes``; the router's parse of it when the task
                    comes through one, :attr:`Prompt.change
                    <atp_router.adapters.base.Prompt.change>`): it chooses the
                    tests and places the failures (below); the after-diff state
                    is what ``files`` (over ``repo``) hold
==================  ===============================================================

**Tests as a reviewer** (issue 23 item 4; :mod:`~atp_router.adapters.tools.testselect`).
With a ``diff`` and no ``tests``, only the test files that touch the changed
files run: a changed test file, ``test_<module>.py`` / ``<module>_test.py`` of a
changed ``<module>.py``, and every test file importing a changed module directly
or through the tree's other modules (imports read statically with :mod:`ast`,
package-relative ones resolved; the tree's ``.py`` files, already within
``max_files`` and ``max_file_bytes``, parsed when together within
``max_files_bytes``). When none does, a changed ``conftest.py`` touches them
all, or the tree is over that bound, pytest's own discovery runs. The summary
says which: ``…; ran 2 test file(s) touching the changed files: tests/test_a.py,
tests/test_b.py`` or ``…; ran pytest's discovery: no test file touches the
changed files``. With a ``diff`` (whatever ran), a failing test is placed at the
changed line it exercises: the deepest traceback entry (pytest's ``path:line:``
lines in the JUnit failure text) on a line the diff changed; else the changed
line the test executed last (an ``assert`` on a wrong value fails in the test,
after the changed code returned: a plugin of the run, ``-p _atp_changed_lines``
written at the tree's root — a task file of that name is refused — traces the
changed lines each test's call executes and writes a failing test's last ones
as a JUnit property); else the deepest traceback entry inside a changed hunk
(context lines included). The finding's file is then the changed file and its
span that one line, the claim and ``tests`` as below; a failure that reaches no
changed line stays at the test. Paths in the failure text and the property are
compared as text and never opened; only the diff's changed lines are read from
them (the tests can forge them, as they can the report).

The run: ``python -E -s -B -m pytest -p no:cacheprovider --capture=no
-o junit_family=xunit1 --junitxml=<the report pipe> …`` with the router's
interpreter (so the tests see the packages installed beside the router, and no
others), plugin autoloading off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), in the
sandbox of :mod:`atp_router.adapters.tools.sandbox`, like every local next-hop: new
user, PID, network, mount, IPC and UTS namespaces, every capability dropped, a
uid no other run shares, only the interpreter's installation mounted (read-only)
besides the system directories, the project tree copied into a private tmpfs
(the working directory; ``/tmp`` and ``/dev/shm`` private too), an environment
of ``PATH``, ``LANG`` and ``HOME``/``TMPDIR`` ``/tmp`` only — no secret, key,
state file or process of the router's is visible, whoever the router runs as.
Limits: the :class:`~atp_router.adapters.tools.base.ToolLimits` (wall clock, CPU,
address space and memory, ``max_procs`` processes and threads, ``max_write_bytes``
written beyond the tree — 64 MiB by default — and ``output_bytes`` of output).
**No network**: an empty network namespace, in which even loopback is down,
unless the operator set ``options.allow_network: true`` (then the host's network,
and nothing else changes). When the run ends everything it started is gone (its
PID namespace dies, its cgroup is swept) and its directory (``atp-tests-*``) is
removed. Where no sandbox can be made the adapter is refused at construction
(the RIB naming it at load, with the reason): the tests never run unsandboxed.
The JUnit report is the test process's own account of itself: a test suite can
forge it; the sandbox protects the host and the other tenants, not the honesty
of the result.

The report: pytest's JUnit XML (xunit1, read with :mod:`xml.etree`, at most
``output_bytes`` and without DTDs or entities). Each failed or erroring test is a
finding: rule ``test_fail`` (:data:`~atp_router.consensus.escalation.TEST_FAIL_RULE`, so
a policy escalating ``on: [test_fail]`` fires), severity high, confidence 0.95,
``tests`` its node id, claim ``<node id> failed: <first line of the failure
message>`` (``error`` for an erroring test); at the changed line its traceback
reaches (above), else at the test: file the test's file, span from the test
function's ``def`` line (JUnit ``line``, made 1-based) to the failing line in
that file (from the traceback). The summary is ``N passed, M failed`` (then
skipped and errors when any; then the selection's note with a ``diff``). Usage
is zero.

Errors (spec §10): the client's input (:class:`~atp_router.wire.errors.ClientInputError`,
``EPROTO``): a refused path, a ``repo`` outside the allowed roots, a ``tests``
value or flag not allowed, a ``diff`` that is not text or is over
``max_files_bytes``, no test files, a task over a size limit, a run that
collected no tests (pytest exit 5) or that pytest refused (exit 4), and a run
that hit the CPU, address-space, memory or output limit. A run past ``timeout_s``
(an endless test) or ending abnormally (pytest status 3, a signal) is attributed
by a canary (:meth:`~atp_router.adapters.tools.base.ToolAdapter.attribute`: a passing
test file run the same way): the task's (``ClientInputError``, ``ETIMEOUT`` for
the wall clock) when the canary passes, the runner's ``AgentError``
(``ETIMEOUT``/``EAGENTDOWN``) when it fails too. The runner's own failures are
``AgentError``: pytest not installed beside the router (it is not a dependency of
the router: install it into the router's environment to serve this next-hop) →
``EAGENTDOWN``; no or malformed JUnit report → ``EPROTO`` (attributed by the
canary too: the tests can close or garble the report pipe).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    InDoubt,
    ToolAdapter,
    ToolLimits,
    _over,
    _tail,
    encode_files,
)
from atp_router.adapters.tools.sandbox import REPORT, SandboxUnavailable
from atp_router.adapters.tools.testselect import (
    TEST_FILE,
    TRACE_PLUGIN,
    TRACE_PROPERTY,
    changed_frame,
    frames,
    select_tests,
    trace_plugin,
    traced_lines,
)
from atp_router.consensus.escalation import TEST_FAIL_RULE
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.review.paths import safe_relpath
from atp_router.task.change import ParsedChange, parse_change
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode

__all__ = ["ALLOWED_FLAGS", "DEFAULT_MAX_WRITE_BYTES", "TestRunnerAdapter"]

MiB = 1024 * 1024
#: Default ``max_write_bytes``: what the tests may write beyond their tree.
DEFAULT_MAX_WRITE_BYTES = DEFAULT_LIMITS.max_write_bytes

#: pytest flags a task's ``tests.command`` may carry (a flag taking a value takes
#: the next argument, or ``--flag=value``); everything else is refused.
ALLOWED_FLAGS: dict[str, bool] = {  # flag → takes a value
    "-x": False, "--exitfirst": False, "-q": False, "-v": False, "-vv": False, "-l": False,
    "--showlocals": False, "--runxfail": False, "--strict-markers": False, "-ra": False, "-rA": False,
    "-k": True, "-m": True, "--maxfail": True, "--tb": True,
}  # fmt: skip

_TEST_FILE = TEST_FILE
_TB_LINE = re.compile(r"^(?P<file>[^\s:][^:\n]*\.py):(?P<line>\d+): ", re.MULTILINE)
_CLAIM_CHARS = 300
_FINDINGS_MAX = 500
_CANARY = {"test_atp_canary.py": b"def test_add():\n    assert 1 + 1 == 2\n"}


@dataclass(slots=True)
class _Run:
    """A bounded task: files to write (bytes), the repo to copy first, pytest
    args; the task's change (``None``: no diff), and whether to select the tests
    touching it (a diff and no ``tests``)."""

    files: dict[str, bytes]
    repo: str | None
    args: list[str]
    change: ParsedChange | None = None
    select: bool = False


class TestRunnerAdapter(ToolAdapter):
    """pytest next-hop (module docstring). ``repos``: checkout roots a task's
    ``repo`` may name (default none); ``allow_network``: the tests get the host's
    network (default: an empty network namespace); ``max_write_bytes``: what the
    tests may write beyond their tree (sets ``limits.max_write_bytes``);
    ``limits``: :class:`ToolLimits` — ``max_files``, ``max_file_bytes`` and
    ``max_files_bytes`` bound every file of the tree here (not only Python),
    ``timeout_s`` the whole pytest run. Raises ``ValueError`` on a bad argument
    and :class:`~atp_router.adapters.tools.sandbox.SandboxUnavailable` (a
    ``ValueError``) where no sandbox can be made."""

    __test__ = False  # not a pytest test class, whatever its name
    tool = "pytest"
    default_strengths = ("tests", "test_execution", "bug_detection")
    canary_files = _CANARY

    def __init__(
        self,
        name: str = "pytest",
        *,
        strengths: Iterable[str] | None = None,
        repos: Iterable[str | Path] = (),
        allow_network: bool = False,
        max_write_bytes: int | None = None,
        limits: ToolLimits = DEFAULT_LIMITS,
    ) -> None:
        if max_write_bytes is not None:
            if isinstance(max_write_bytes, bool) or not isinstance(max_write_bytes, int) or max_write_bytes <= 0:
                raise ValueError(f"max_write_bytes: must be a positive whole number, got {max_write_bytes!r:.40}")
            limits = dataclasses.replace(limits, max_write_bytes=max_write_bytes)
        self.allow_network = bool(allow_network)
        super().__init__(name, scope="file", strengths=strengths, limits=limits)
        roots = []
        for r in repos:
            p = Path(r)
            if not p.is_absolute():
                raise ValueError(f"repos: {str(r)!r} must be an absolute path")
            roots.append(os.path.realpath(p))
        self.repos = roots
        self.max_write_bytes = self.limits.max_write_bytes

    def argv(self, paths: list[str]) -> list[str]:  # pragma: no cover - review() is overridden
        return []

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:  # pragma: no cover
        return [], []

    def sandbox_options(self) -> dict[str, Any]:
        """The host's network with ``allow_network``; pytest's plugin autoloading off."""
        return {"allow_network": self.allow_network,
                "env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}}

    # -- the work ------------------------------------------------------------------

    async def review(self, prompt: Prompt) -> AgentReport:
        """Run the task's tests; the report of the module docstring. Raises
        ``ClientInputError`` / ``AgentError`` as it says."""
        run = await trio.to_thread.run_sync(self._bound_run, prompt.content, prompt.change)
        try:
            return await self._test(run)
        except InDoubt as e:
            raise await self.attribute(e) from None

    async def run_canary(self) -> None:
        """A passing test file, run as a task's are; raises AgentError unless it passes."""
        report = await self._test(_Run(files=dict(self.canary_files), repo=None, args=[]))
        if report.findings or not report.summary.startswith("1 passed"):
            raise AgentError(ErrorCode.EAGENTDOWN, f"the canary test did not pass: {report.summary}")

    async def _test(self, run: _Run) -> AgentReport:
        if importlib.util.find_spec("pytest") is None:
            raise AgentError(ErrorCode.EAGENTDOWN, "pytest is not installed in the router's environment")
        base = await trio.to_thread.run_sync(functools.partial(tempfile.mkdtemp, prefix="atp-tests-"))
        try:
            tree = os.path.join(base, "src")
            await trio.to_thread.run_sync(self._lay_out, tree, run)
            args, note = run.args, ""
            if run.select and run.change is not None:
                args, note = await trio.to_thread.run_sync(self._select, tree, run.change)
            if run.change is not None and await trio.to_thread.run_sync(_write_plugin, tree, run.change):
                args = ["-p", TRACE_PLUGIN, *args]
            argv = [sys.executable, "-E", "-s", "-B", "-m", "pytest", "-p", "no:cacheprovider", "--capture=no",
                    "-o", "junit_family=xunit1", f"--junitxml={REPORT}", f"--rootdir={tree}", *args]
            try:
                res = await self.sandbox(sys.executable).run(argv, tree=tree)
            except SandboxUnavailable as e:
                raise AgentError(ErrorCode.EAGENTDOWN, f"pytest cannot run: {e}") from None
            except OSError as e:
                raise AgentError(ErrorCode.EAGENTDOWN, f"pytest could not start: {e.strerror or e}") from None
            lim = self.limits
            if res.capped:
                raise ClientInputError(f"the tests wrote more than the output limit output_bytes={lim.output_bytes:,} "
                                       "for this task; killed")
            if res.timed_out:
                raise InDoubt(ErrorCode.ETIMEOUT,
                              f"pytest ran past its wall-clock limit timeout_s={lim.timeout_s:g} s; killed")
            if res.oom:
                raise ClientInputError(f"the tests ran out of the memory limit address_space_bytes="
                                       f"{lim.address_space_bytes:,}; killed")
            assert res.returncode is not None
            self._check_pytest_exit(res.returncode, res.stderr, tree)
            report = await trio.to_thread.run_sync(self._report, res.report or b"", tree, res.stderr, run.change)
            return msgspec.structs.replace(report, summary=report.summary + note) if note else report
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, base, True)

    def _bound_run(self, content: Any, change: ParsedChange | None = None) -> _Run:
        """Validate and bound the task (worker thread); ``change``: its diff as
        the router parsed it (else ``content.diff`` is parsed here). Raises
        ClientInputError."""
        lim = self.limits
        if not isinstance(content, Mapping):
            raise ClientInputError("content must be an object with 'files' (and optionally 'tests', 'repo')")
        files = content.get("files", {})
        if not isinstance(files, dict):
            raise ClientInputError("content.files must map paths to file text")
        if len(files) > lim.max_files:
            raise ClientInputError(f"content.files has {len(files):,} files, over the limit max_files={lim.max_files:,}")
        encoded = encode_files(files, lim, refuse_git=True)
        repo = self._allowed_repo(content.get("repo"))
        has_tests = any(_TEST_FILE.search(p) for p in encoded)
        if repo is not None and not has_tests:
            has_tests = _repo_has_tests(repo, lim.max_files)
        if not has_tests:
            raise ClientInputError("no test files (test_*.py or *_test.py) in the task: nothing to run")
        change = change if change is not None else self._change(content.get("diff"))
        tests = content.get("tests")
        return _Run(files=encoded, repo=repo, args=_pytest_args(tests), change=change,
                    select=change is not None and tests is None and bool(change.changed))

    def _change(self, diff: Any) -> ParsedChange | None:
        """``content.diff`` parsed (``None`` without one). Raises ClientInputError
        when it is not text or is over ``max_files_bytes``."""
        if diff is None:
            return None
        if not isinstance(diff, str):
            raise ClientInputError("content.diff must be unified diff text")
        lim = self.limits
        if len(diff) > lim.max_files_bytes or len(diff.encode("utf-8", "surrogatepass")) > lim.max_files_bytes:
            raise _over("content.diff", f"{len(diff.encode('utf-8', 'surrogatepass')):,} bytes", "max_files_bytes",
                        lim.max_files_bytes)
        return parse_change(diff)

    def _select(self, tree: str, change: ParsedChange) -> tuple[list[str], str]:
        """The pytest args running the test files of ``tree`` that touch
        ``change`` (:func:`~atp_router.adapters.tools.testselect.select_tests`) and
        the summary's note saying which ran; ``[]`` (pytest's discovery) when
        none does, a changed ``conftest.py`` touches them all, or the tree's
        Python files are over ``max_files_bytes`` together (worker thread)."""
        sources = _tree_sources(tree, self.limits.max_files_bytes)
        if sources is None:
            return [], (f"; ran pytest's discovery: the tree's Python files are over max_files_bytes="
                        f"{self.limits.max_files_bytes:,} for selecting tests")
        chosen = select_tests(sources, change.changed)
        if chosen is None:
            return [], "; ran pytest's discovery: a changed conftest.py touches every test"
        if not chosen.tests:
            return [], "; ran pytest's discovery: no test file touches the changed files"
        shown = ", ".join(chosen.tests[:5]) + (", …" if len(chosen.tests) > 5 else "")
        # "./": a path is never read as an option (pytest pre-parses some, e.g. --junitxml, even after "--").
        return [f"./{t}" for t in chosen.tests], (f"; ran {len(chosen.tests)} test file(s) touching the changed "
                                                   f"files: {shown}")

    def _allowed_repo(self, repo: Any) -> str | None:
        if repo is None:
            return None
        if not isinstance(repo, str) or not repo or "\x00" in repo:
            raise ClientInputError("content.repo must be a path string")
        real = os.path.realpath(repo)
        for root in self.repos:
            if os.path.commonpath([root, real]) == root and os.path.isdir(real):
                return real
        # The same answer for a path outside the roots and one that does not exist.
        raise ClientInputError(f"content.repo {repo!r:.200} is not a checkout this router's operator allowed")

    def _lay_out(self, tree: str, run: _Run) -> None:
        """The project tree: the repo's regular files (bounded), then ``files``."""
        lim = self.limits
        os.mkdir(tree)
        if run.repo is not None:
            _copy_repo(run.repo, tree, lim)
        for rel, data in run.files.items():
            dest = os.path.join(tree, rel)
            try:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if os.path.lexists(dest):
                    os.unlink(dest)  # overlays the repo's file (never follows a link)
                with open(dest, "xb") as fh:
                    fh.write(data)
            except OSError as e:
                raise ClientInputError(f"content.files cannot be laid out as a tree: {e.strerror}") from None

    def _check_pytest_exit(self, returncode: int, stderr: bytes, tree: str) -> None:
        """pytest's exits: 0 (all passed), 1 (failures) and 2 (interrupted, e.g.
        collection errors) carry a report; 5 (no tests collected) and 4 (usage)
        are the task's; the file-size limit is the task's; the rest as
        :meth:`ToolAdapter._check_exit`."""
        if returncode in (0, 1, 2):
            return
        if returncode == 5:
            raise ClientInputError("pytest collected no tests from the task: nothing ran")
        if returncode == 4:
            raise ClientInputError(f"pytest refused the task's arguments or configuration: {_tail(stderr, tree)}")
        if returncode == -signal.SIGXFSZ:
            raise ClientInputError(
                f"the tests wrote a file past the limit max_write_bytes={self.max_write_bytes:,}; killed")
        self._check_exit(returncode, stderr, tree)

    def _report(self, data: bytes, tree: str, stderr: bytes, change: ParsedChange | None = None) -> AgentReport:
        """The JUnit XML pytest wrote to the report pipe as the report (worker
        thread; its size is within ``output_bytes``, read by the sandbox). The
        tests can close or garble the pipe: a missing or malformed report is in
        doubt (:class:`~atp_router.adapters.tools.base.InDoubt`, settled by a canary)."""
        if not data:
            raise InDoubt(ErrorCode.EPROTO, f"pytest wrote no JUnit report: {_tail(stderr, tree)}")
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            raise InDoubt(ErrorCode.EPROTO, "the JUnit report carries a DTD or entities; refused")
        try:
            root = ET.fromstring(data)
        except ET.ParseError as e:
            raise InDoubt(ErrorCode.EPROTO, f"the JUnit report is not XML ({e})") from None
        return _junit_report(root, tree, change)


def _pytest_args(tests: Any) -> list[str]:
    """pytest arguments of ``content.tests`` (module docstring). Raises ClientInputError."""
    if tests is None:
        return []
    if isinstance(tests, Mapping):
        if "command" in tests:
            command = tests["command"]
            if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
                raise ClientInputError("content.tests.command must be a list of strings (argv)")
            args = _strip_launcher(command)
        elif "node_ids" in tests:
            args = _node_ids(tests["node_ids"])
        else:
            raise ClientInputError("content.tests must be node ids, {node_ids: [...]} or {command: [...]}")
    else:
        args = _node_ids(tests)
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flag, eq, _ = a.partition("=")
            takes = ALLOWED_FLAGS.get(flag)
            if takes is None:
                raise ClientInputError(f"pytest flag {flag!r:.80} is not allowed (allowed: {', '.join(ALLOWED_FLAGS)})")
            if takes and not eq:
                if i + 1 >= len(args):
                    raise ClientInputError(f"pytest flag {flag} needs a value")
                out += [flag, args[i + 1]]
                i += 2
                continue
            if eq and not takes:
                raise ClientInputError(f"pytest flag {flag} takes no value")
            out.append(a)
        else:
            out += _node_ids([a])
        i += 1
    return out


def _strip_launcher(command: list[str]) -> list[str]:
    names = [os.path.basename(a) for a in command[:3]]
    if names[:1] in (["pytest"], ["py.test"]):
        return command[1:]
    if len(names) >= 3 and re.fullmatch(r"python[0-9.]*", names[0]) and names[1:3] == ["-m", "pytest"]:
        return command[3:]
    raise ClientInputError("content.tests.command must run pytest (pytest … or python -m pytest …)")


def _node_ids(ids: Any) -> list[str]:
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(n, str) for n in ids):
        raise ClientInputError("test node ids must be a list of strings")
    for n in ids:
        if n.startswith("-"):
            raise ClientInputError(f"test node id {n!r:.80} looks like a flag")
        safe_relpath(n.split("::", 1)[0].rstrip("/") or ".")
    return list(ids)


def _repo_has_tests(repo: str, max_files: int) -> bool:
    seen = 0
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for f in filenames:
            seen += 1
            if seen > max_files:
                return False
            if _TEST_FILE.search(f):
                return True
    return False


def _copy_repo(repo: str, tree: str, lim: ToolLimits) -> None:
    """Copy ``repo``'s regular files (no ``.git``, no symlinks, bounded by ``lim``)
    into ``tree``. Raises ClientInputError over a limit."""
    count = total = 0
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not os.path.islink(os.path.join(dirpath, d)))
        rel_dir = os.path.relpath(dirpath, repo)
        for f in sorted(filenames):
            src = os.path.join(dirpath, f)
            try:
                st = os.lstat(src)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # symlinks, devices, sockets: never copied
            count += 1
            if count > lim.max_files:
                raise ClientInputError(f"content.repo has more than max_files={lim.max_files:,} files")
            if st.st_size > lim.max_file_bytes:
                raise _over(f"content.repo file {os.path.join(rel_dir, f)!r:.200}", f"{st.st_size:,} bytes",
                            "max_file_bytes", lim.max_file_bytes)
            total += st.st_size
            if total > lim.max_files_bytes:
                raise _over("content.repo", f"more than {lim.max_files_bytes:,} bytes", "max_files_bytes",
                            lim.max_files_bytes)
            dest_dir = os.path.normpath(os.path.join(tree, rel_dir))
            os.makedirs(dest_dir, exist_ok=True)
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                with os.fdopen(fd, "rb") as fin, open(os.path.join(dest_dir, f), "xb") as fout:
                    shutil.copyfileobj(fin, fout)
            except OSError as e:
                raise ClientInputError(f"content.repo cannot be copied: {e.strerror}") from None


def _node_id(case: ET.Element) -> tuple[str, str]:
    """(file, node id) of a JUnit xunit1 testcase."""
    file = case.get("file") or ""
    classname = case.get("classname") or ""
    name = case.get("name") or "?"
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        return file, "::".join([file, *(c for c in rest.split(".") if c), name])
    return file, f"{classname}::{name}" if classname else name


def _junit_report(root: ET.Element, tree: str, change: ParsedChange | None = None) -> AgentReport:
    passed = failed = skipped = errors = 0
    findings: list[AgentFinding] = []
    for case in root.iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            passed += 1
            continue
        if outcome.tag == "skipped":
            skipped += 1
            continue
        if outcome.tag == "failure":
            failed += 1
        else:
            errors += 1
        if len(findings) < _FINDINGS_MAX:
            findings.append(_case_finding(case, outcome, tree, change, ref=str(len(findings) + 1)))
    summary = f"{passed} passed, {failed} failed"
    if skipped:
        summary += f", {skipped} skipped"
    if errors:
        summary += f", {errors} error(s)"
    if not passed + failed + skipped + errors:
        raise ClientInputError("pytest ran no tests")
    return AgentReport(findings=findings, summary=summary)


def _case_finding(case: ET.Element, outcome: ET.Element, tree: str, change: ParsedChange | None,
                  ref: str) -> AgentFinding:
    """The finding of one failed or erroring testcase: at the changed line its
    traceback reaches (:func:`~atp_router.adapters.tools.testselect.changed_frame`)
    when there is one, else at the test (module docstring)."""
    file, node = _node_id(case)
    try:
        start = int(case.get("line") or "-1") + 1  # pytest's locations are 0-based
    except ValueError:
        start = 0
    text = outcome.text or ""
    tb_lines = [int(m["line"]) for m in _TB_LINE.finditer(text) if m["file"] == file]
    if start < 1:
        start = tb_lines[0] if tb_lines else 1
    end = max([start, *(n for n in tb_lines if n >= start)])
    message = (outcome.get("message") or text.strip() or outcome.tag).strip().splitlines()
    first = message[0] if message else outcome.tag
    kind = "error" if outcome.tag == "error" else "failed"
    claim = f"{node} {kind}: {first}"
    where = _within(file, tree) or "<unknown>"
    hit = changed_frame(frames(text, tree), change, _traced(case, change)) if change is not None else None
    if hit is not None:
        where, start = hit
        end = start
    return AgentFinding(
        file=where, start=start, end=end, severity=Severity.HIGH, claim=claim[:_CLAIM_CHARS], confidence=0.95,
        rule=TEST_FAIL_RULE, ref=ref, tests=[node[:_CLAIM_CHARS]],
    )


def _write_plugin(tree: str, change: ParsedChange) -> bool:
    """Write the trace plugin (:func:`~atp_router.adapters.tools.testselect.trace_plugin`)
    at the tree's root; False when no Python file changed. Raises
    ClientInputError when the task holds a file of its name."""
    source = trace_plugin(change)
    if source is None:
        return False
    try:
        with open(os.path.join(tree, TRACE_PLUGIN + ".py"), "x", encoding="utf-8") as fh:
            fh.write(source)
    except FileExistsError:
        raise ClientInputError(f"{TRACE_PLUGIN}.py is the pytest next-hop's own module: the task may not hold "
                               "a file of that name") from None
    return True


def _traced(case: ET.Element, change: ParsedChange) -> list[tuple[str, int]]:
    """The changed lines the plugin says the failing test executed, last last."""
    for prop in case.iter("property"):
        if prop.get("name") == TRACE_PROPERTY:
            return traced_lines(prop.get("value") or "", change)
    return []


def _tree_sources(tree: str, max_bytes: int) -> dict[str, bytes] | None:
    """Every ``.py`` file of the laid-out ``tree`` (the adapter's own copy:
    regular files, already bounded by ``max_files`` and ``max_file_bytes``) →
    its bytes; ``None`` when they are over ``max_bytes`` together."""
    out: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, tree)
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            full = os.path.join(dirpath, f)
            try:
                st = os.lstat(full)
                if not stat.S_ISREG(st.st_mode):
                    continue
                total += st.st_size
                if total > max_bytes:
                    return None
                with open(full, "rb") as fh:
                    data = fh.read(st.st_size + 1)
            except OSError:
                continue
            out[Path(os.path.normpath(os.path.join(rel_dir, f))).as_posix()] = data
    return out


def _within(file: str, tree: str) -> str | None:
    """``file`` as a path relative to the tree, or None if it is not inside it."""
    if not file:
        return None
    full = os.path.realpath(os.path.join(tree, file))
    real = os.path.realpath(tree)
    if os.path.commonpath([full, real]) != real:
        return None
    return Path(os.path.relpath(full, real)).as_posix()
