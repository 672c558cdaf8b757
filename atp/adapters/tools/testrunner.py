"""pytest as a review next-hop (RIB ``tool: pytest``, alias ``tests``): run the
task's tests in a sandbox and report each failing test as a finding.

The task (``content``):

==================  ===============================================================
``files``           ``{path: text}``: the code and its tests (``test_*.py`` /
                    ``*_test.py``), any suffix (data files, ``conftest.py``,
                    ``pyproject.toml``); written byte for byte into a private
                    temporary directory (paths checked by
                    :func:`~atp.adapters.tools.base.safe_relpath`)
``repo``            optional: a checkout path on the router host, allowed only
                    inside one of the operator's ``options.repos`` roots (RIB
                    ``agents.<x>.options``, never the client's choice); its regular
                    files (no ``.git``, no symlinks) are copied into the sandbox
                    first, then ``files`` overlay them
``tests``           optional: what to run — a list of pytest node ids
                    (``tests/test_a.py::test_x``), ``{node_ids: [...]}``, or
                    ``{command: ["pytest", *args]}`` (also ``["python", "-m",
                    "pytest", …]``) whose args may only be node ids and the flags in
                    :data:`ALLOWED_FLAGS`; default: pytest's own discovery
``diff``            ignored (the after-diff state is what ``files`` hold)
==================  ===============================================================

The run: ``python -E -s -B -m pytest -p no:cacheprovider --capture=no
-o junit_family=xunit1 --junitxml=<outside the tree> …`` with the router's
interpreter (so the tests see the packages installed beside the router, and no
others), plugin autoloading off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), cwd the
project tree, and an environment of ``PATH``, ``LANG`` and a private ``HOME`` and
``TMPDIR`` only — no secret of the router's reaches it. The child gets, before
``exec``: the :class:`~atp.adapters.tools.base.ToolLimits` rlimits (CPU,
address space, no core files), ``RLIMIT_FSIZE`` = ``max_write_bytes`` (default
64 MiB: the largest file it may write), its own process group (killed as a whole
on the wall-clock ``timeout_s``, past ``output_bytes`` of output, or on
cancellation), and **no network**: a new, empty network namespace
(``unshare(CLONE_NEWNET)``, or ``CLONE_NEWUSER | CLONE_NEWNET`` unprivileged), in
which even loopback is down. Where namespaces are unavailable the adapter
refuses to run the tests (``EAGENTDOWN``) unless the operator set
``options.allow_network: true``, which runs them with the host's network.

A router running as root runs the tests as ``nobody`` (after the namespace is
made), so they cannot read what root keeps to itself — the state directory,
keys, secrets — and ``RLIMIT_NPROC`` binds; where ``nobody`` cannot run the
router's interpreter (it lives under a directory only root may enter) they run
as root and the router logs a warning once. A router running as another user runs
them as that user: they can read what it can (give the router a user of its own). The JUnit report is the test
process's own account of itself: a test suite can forge it; the sandbox protects
the host, not the honesty of the result.

The report: pytest's JUnit XML (xunit1, read with :mod:`xml.etree`, at most
``output_bytes`` and without DTDs or entities). Each failed or erroring test is a
finding: rule ``test_fail`` (:data:`~atp.consensus.escalation.TEST_FAIL_RULE`, so
a policy escalating ``on: [test_fail]`` fires), severity high, confidence 0.95,
file the test's file, span from the test function's ``def`` line (JUnit ``line``,
made 1-based) to the failing line in that file (from the traceback), claim
``<node id>: <first line of the failure message>``. The summary is ``N passed, M
failed`` (then skipped and errors when any). Usage is zero.

Errors (spec §10): the client's input (:class:`~atp.wire.errors.ClientInputError`,
``EPROTO``): a refused path, a ``repo`` outside the allowed roots, a ``tests``
value or flag not allowed, no test files, a task over a size limit, a run that
collected no tests (pytest exit 5) or that pytest refused (exit 4), and a run
that hit the CPU, address-space, file-size or output limit. The runner's own
failures are ``AgentError``: no network isolation, or pytest not installed beside
the router (it is not a dependency of the router: install it into the router's
environment to serve this next-hop) → ``EAGENTDOWN``; pytest exiting
abnormally (status 3, a signal) → ``EAGENTDOWN``; past ``timeout_s`` (an endless
test) → ``ETIMEOUT``; no or malformed JUnit report → ``EPROTO``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import logging
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from atp.adapters.base import Prompt
from atp.adapters.tools.base import (
    DEFAULT_LIMITS,
    ToolAdapter,
    ToolLimits,
    _over,
    _rlimits,
    _tail,
    encode_files,
    safe_relpath,
)
from atp.consensus.escalation import TEST_FAIL_RULE
from atp.consensus.types import AgentFinding, AgentReport, Severity
from atp.wire.errors import AgentError, ClientInputError, ErrorCode

log = logging.getLogger("atp.adapters.tools.testrunner")

__all__ = ["ALLOWED_FLAGS", "DEFAULT_MAX_WRITE_BYTES", "TestRunnerAdapter", "network_isolation"]

MiB = 1024 * 1024
#: Default ``max_write_bytes`` (``RLIMIT_FSIZE``): the largest file a test may write.
DEFAULT_MAX_WRITE_BYTES = 64 * MiB

#: pytest flags a task's ``tests.command`` may carry (a flag taking a value takes
#: the next argument, or ``--flag=value``); everything else is refused.
ALLOWED_FLAGS: dict[str, bool] = {  # flag → takes a value
    "-x": False, "--exitfirst": False, "-q": False, "-v": False, "-vv": False, "-l": False,
    "--showlocals": False, "--runxfail": False, "--strict-markers": False, "-ra": False, "-rA": False,
    "-k": True, "-m": True, "--maxfail": True, "--tb": True,
}  # fmt: skip

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
_TB_LINE = re.compile(r"^(?P<file>[^\s:][^:\n]*\.py):(?P<line>\d+): ", re.MULTILINE)
_CLAIM_CHARS = 300
_FINDINGS_MAX = 500

_probe_lock = threading.Lock()
_probed: dict[bool, int | None] = {}


class _NoNetwork(OSError):
    pass


def _libc_unshare() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.unshare
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _child_setup(limits: list[tuple[int, tuple[int, int]]], unshare: Any, flags: int | None,
                 drop_to: int | None = None) -> None:
    """``preexec_fn``: rlimits, then a new network namespace (``flags``), then
    (``drop_to``) the unprivileged user; runs in the forked child before
    ``exec``. A failed ``unshare`` or user switch aborts the start."""
    for res, pair in limits:
        resource.setrlimit(res, pair)
    if flags is not None and unshare(flags) != 0:
        raise _NoNetwork(ctypes.get_errno(), "unshare failed")
    if drop_to is not None:
        os.setgroups([])
        os.setgid(drop_to)
        os.setuid(drop_to)


def _drop_user() -> int | None:
    """``nobody``'s uid/gid when the router runs as root: the tests then run as
    it, so they cannot read the router's state, keys or secrets (files root
    keeps to itself) and ``RLIMIT_NPROC`` binds. ``None`` when the router is not
    root (the tests run as its user), or when ``nobody`` cannot run the router's
    interpreter here (e.g. it lives under a directory only root may enter):
    then the tests run as root, and a warning says so once."""
    if os.geteuid() != 0:
        return None
    return _probe_unprivileged()


@functools.cache
def _probe_unprivileged() -> int | None:
    try:
        import pwd

        uid = pwd.getpwnam("nobody").pw_uid
    except (ImportError, KeyError):
        uid = 65534
    try:
        probe = subprocess.run([sys.executable, "-E", "-s", "-c", "import pytest"], cwd="/", timeout=60,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, capture_output=True,
                               preexec_fn=functools.partial(_child_setup, [], None, None, uid))
    except (OSError, subprocess.SubprocessError):
        probe = None
    if probe is None or probe.returncode != 0:
        log.warning("tool pytest: user nobody cannot run %s here: the tests run as root and can read what root "
                    "can; install the router where any user may run its Python to isolate them", sys.executable)
        return None
    return uid


def _chown_tree(base: str, uid: int) -> None:
    """Give the run's private directory (made by root) to the unprivileged user."""
    for root, dirs, files in os.walk(base):
        os.chown(root, uid, uid)
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)


def network_isolation() -> int | None:
    """The ``unshare`` flags that give a child process an empty network namespace
    here (``CLONE_NEWNET``, else ``CLONE_NEWUSER | CLONE_NEWNET``), or ``None``
    when neither works (no namespaces, no privilege). Probed once by starting a
    process with them (blocking: call from a worker thread); cached."""
    with _probe_lock:
        if True not in _probed:
            _probed[True] = _probe()
        return _probed[True]


def _probe() -> int | None:
    try:
        unshare = _libc_unshare()
    except (OSError, AttributeError):
        return None
    exe = shutil.which("true") or sys.executable
    for flags in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET):
        try:
            done = subprocess.run([exe] if exe != sys.executable else [exe, "-c", "pass"],
                                  preexec_fn=functools.partial(_child_setup, [], unshare, flags),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return flags
    return None


@dataclass(slots=True)
class _Run:
    """A bounded task: files to write (bytes), the repo to copy first, pytest args."""

    files: dict[str, bytes]
    repo: str | None
    args: list[str]


class TestRunnerAdapter(ToolAdapter):
    """pytest next-hop (module docstring). ``repos``: checkout roots a task's
    ``repo`` may name (default none); ``allow_network``: run with the host's
    network where namespaces are unavailable (default: refuse); ``max_write_bytes``:
    ``RLIMIT_FSIZE`` in bytes; ``limits``: :class:`ToolLimits` — ``max_files``,
    ``max_file_bytes`` and ``max_files_bytes`` bound every file of the tree here
    (not only Python), ``timeout_s`` the whole pytest run. Raises ``ValueError``
    on a bad argument."""

    __test__ = False  # not a pytest test class, whatever its name
    tool = "pytest"
    default_strengths = ("tests", "test_execution", "bug_detection")

    def __init__(
        self,
        name: str = "pytest",
        *,
        strengths: Iterable[str] | None = None,
        repos: Iterable[str | Path] = (),
        allow_network: bool = False,
        max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES,
        limits: ToolLimits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(name, scope="file", strengths=strengths, limits=limits)
        if isinstance(max_write_bytes, bool) or not isinstance(max_write_bytes, int) or max_write_bytes <= 0:
            raise ValueError(f"max_write_bytes: must be a positive whole number, got {max_write_bytes!r:.40}")
        roots = []
        for r in repos:
            p = Path(r)
            if not p.is_absolute():
                raise ValueError(f"repos: {str(r)!r} must be an absolute path")
            roots.append(os.path.realpath(p))
        self.repos = roots
        self.allow_network = bool(allow_network)
        self.max_write_bytes = max_write_bytes

    def argv(self, paths: list[str]) -> list[str]:  # pragma: no cover - review() is overridden
        return []

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:  # pragma: no cover
        return [], []

    # -- the work ------------------------------------------------------------------

    async def review(self, prompt: Prompt) -> AgentReport:
        """Run the task's tests; the report of the module docstring. Raises
        ``ClientInputError`` / ``AgentError`` as it says."""
        run = await trio.to_thread.run_sync(self._bound_run, prompt.content)
        if importlib.util.find_spec("pytest") is None:
            raise AgentError(ErrorCode.EAGENTDOWN, "pytest is not installed in the router's environment")
        flags = await trio.to_thread.run_sync(network_isolation)
        if flags is None and not self.allow_network:
            raise AgentError(
                ErrorCode.EAGENTDOWN,
                "cannot cut the tests off the network here (no network namespace: unshare(CLONE_NEWNET) is "
                "not permitted); refusing to run them — options.allow_network: true runs them with the network on",
            )
        drop_to = await trio.to_thread.run_sync(_drop_user)
        base = await trio.to_thread.run_sync(functools.partial(tempfile.mkdtemp, prefix="atp-tests-"))
        try:
            tree = os.path.join(base, "src")
            await trio.to_thread.run_sync(self._lay_out, tree, run)
            for d in ("home", "tmp"):
                os.mkdir(os.path.join(base, d))
            report = os.path.join(base, "report.xml")
            argv = [sys.executable, "-E", "-s", "-B", "-m", "pytest", "-p", "no:cacheprovider", "--capture=no",
                    "-o", "junit_family=xunit1", f"--junitxml={report}", f"--rootdir={tree}", *run.args]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                   "HOME": os.path.join(base, "home"), "TMPDIR": os.path.join(base, "tmp"),
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            limits = _rlimits(self.limits)
            limits.append((resource.RLIMIT_FSIZE, _capped(resource.RLIMIT_FSIZE, self.max_write_bytes)))
            if drop_to is not None:
                await trio.to_thread.run_sync(_chown_tree, base, drop_to)
            preexec = functools.partial(_child_setup, limits, _libc_unshare() if flags is not None else None, flags,
                                        drop_to)
            returncode, _out, err = await self._exec(argv, tree, env=env, preexec=preexec)
            self._check_pytest_exit(returncode, err, tree)
            return await trio.to_thread.run_sync(self._report, report, tree, err)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, base, True)

    def _bound_run(self, content: Any) -> _Run:
        """Validate and bound the task (worker thread). Raises ClientInputError."""
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
        return _Run(files=encoded, repo=repo, args=_pytest_args(content.get("tests")))

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

    def _report(self, path: str, tree: str, stderr: bytes) -> AgentReport:
        """The JUnit XML at ``path`` as the report (worker thread)."""
        try:
            with open(path, "rb") as fh:
                data = fh.read(self.limits.output_bytes + 1)
        except OSError:
            raise AgentError(ErrorCode.EPROTO, f"pytest wrote no JUnit report: {_tail(stderr, tree)}") from None
        if len(data) > self.limits.output_bytes:
            raise ClientInputError(
                f"pytest's JUnit report is over the output limit output_bytes={self.limits.output_bytes:,}")
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            raise AgentError(ErrorCode.EPROTO, "the JUnit report carries a DTD or entities; refused")
        try:
            root = ET.fromstring(data)
        except ET.ParseError as e:
            raise AgentError(ErrorCode.EPROTO, f"the JUnit report is not XML ({e})") from None
        return _junit_report(root, tree)


def _capped(res: int, want: int) -> tuple[int, int]:
    hard = resource.getrlimit(res)[1]
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    return want, want


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


def _junit_report(root: ET.Element, tree: str) -> AgentReport:
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
        if len(findings) >= _FINDINGS_MAX:
            continue
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
        findings.append(AgentFinding(
            file=_within(file, tree) or "<unknown>", start=start, end=end, severity=Severity.HIGH,
            claim=claim[:_CLAIM_CHARS], confidence=0.95, rule=TEST_FAIL_RULE, ref=str(len(findings) + 1),
            tests=[node[:_CLAIM_CHARS]],
        ))
    summary = f"{passed} passed, {failed} failed"
    if skipped:
        summary += f", {skipped} skipped"
    if errors:
        summary += f", {errors} error(s)"
    if not passed + failed + skipped + errors:
        raise ClientInputError("pytest ran no tests")
    return AgentReport(findings=findings, summary=summary)


def _within(file: str, tree: str) -> str | None:
    """``file`` as a path relative to the tree, or None if it is not inside it."""
    if not file:
        return None
    full = os.path.realpath(os.path.join(tree, file))
    real = os.path.realpath(tree)
    if os.path.commonpath([full, real]) != real:
        return None
    return Path(os.path.relpath(full, real)).as_posix()
