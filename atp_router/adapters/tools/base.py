"""Static analysers as review next-hops (spec §14): the shared tool-adapter machinery.

A :class:`ToolAdapter` turns a ``code_review`` prompt (``content = {"diff": str,
"files": {path: after-diff text}}``) into one FINAL :class:`AgentReport`:

1. bound and validate the task, off the event loop (a worker thread): ``files``
   has relative, normalised paths and text values — anything that could escape
   the work directory is refused — and stays within :class:`ToolLimits` (below);
2. pick the Python files to analyse: with ``scope="changed"`` only the files the
   diff touched (``content["diff"]`` is then required; a diff changing Python
   files none of which ``files`` holds is refused — reviewing nothing is not "no
   findings" — and the ones missing beside others are named in the summary),
   with ``scope="file"`` all;
3. write them into a private temporary directory and run the analyser on them in
   a sandbox of its own (:mod:`atp_router.adapters.tools.sandbox`: bubblewrap user, PID,
   network, mount, IPC and UTS namespaces, no capabilities, a uid no other run
   shares, only the interpreter's and the tool's installation read-only and a
   size-bounded private copy of the files writable, an explicit minimal
   environment, a cgroup or rlimits; binary found next to ``sys.executable``
   first, then on ``PATH``) under the limits below, and parse its JSON off the
   event loop;
4. with ``scope="changed"``, keep only findings that touch a changed line
   (± ``context`` lines), number them (``ref`` 1, 2, …) and yield the report with
   zero usage: tools cost no tokens and no USD.

Limits (:class:`ToolLimits`; every field is a constructor default, so
``ToolLimits()`` is the documented default set, :data:`DEFAULT_LIMITS`):

==========================  ==========  =====================================================
field                       default     bounds
==========================  ==========  =====================================================
``max_file_bytes``          1 MiB       one analysed (``.py``/``.pyi``) file, UTF-8 bytes
``max_files_bytes``         8 MiB       all analysed files of the task together, UTF-8 bytes
``max_files``               2,000       entries in ``content.files`` (any suffix)
``max_diff_bytes``          8 MiB       ``content.diff``, UTF-8 bytes
``cpu_s``                   60 s        CPU time of the analyser process (``RLIMIT_CPU``;
                                        all its threads; SIGXCPU, then SIGKILL 1 s later)
``address_space_bytes``     2 GiB       virtual memory of the analyser (``RLIMIT_AS``)
``output_bytes``            16 MiB      stdout + stderr read from the analyser; past it the
                                        sandbox is killed
``timeout_s``               60 s        wall clock of one analyser run; then killed
``max_procs``               256         processes and threads of one run together (the run's
                                        ``pids`` cgroup, or ``RLIMIT_NPROC`` in its user
                                        namespace)
``max_write_bytes``         64 MiB      bytes one run may write beyond its copy of the files
                                        (its private ``/tmp`` tmpfs; ``RLIMIT_FSIZE``)
==========================  ==========  =====================================================

The defaults fit code review: real Python code is ~30 bytes a line, so 1 MiB is
~35,000 lines in one file and 8 MiB a very large change; ruff checks that in well
under a second and bandit in tens of seconds, in a few hundred MB; 16 MiB of
output is ~20,000 ruff findings, more than any review can use. Non-Python files
in ``files`` are never written nor analysed and only count toward ``max_files``.

Errors (spec §10). Failures the client's input caused are
:class:`~atp_router.wire.errors.ClientInputError` (``EPROTO``, ``client_fault``; never
counted against the next-hop): a refused path (also one deeper than
:data:`~atp_router.review.paths.MAX_PATH_DEPTH` components or longer than
:data:`~atp_router.review.paths.MAX_PATH_CHARS`) or
non-text file, content that is not a ``code_review`` body, a task over a limit,
an analyser run that hit its CPU, address-space, memory or output limit on that
input — the reason names the limit and its value — and any exception the task's
content raises in the adapter itself (``RecursionError``, ``MemoryError``).

**Faults are attributed.** A run past ``timeout_s`` or an abnormal exit (a crash,
a signal, an unexpected status) may be the task's doing or the analyser's: the
adapter then runs a **canary** — a small, well-formed file
(:attr:`ToolAdapter.canary_files`) through the same analyser in the same sandbox
under the same limits; its verdict is kept :data:`CANARY_TTL_S` seconds, and one
canary runs at a time. When the canary runs clean the failure is the task's:
``ClientInputError`` (``ETIMEOUT`` for the wall clock, else ``EPROTO``; no
breaker count, no retry, no reroute); only when the canary fails too is it the
next-hop's ``AgentError`` (``ETIMEOUT`` / ``EAGENTDOWN``). The analyser's own
failures otherwise: missing → ``EAGENTDOWN``; no sandbox here
(:class:`~atp_router.adapters.tools.sandbox.SandboxUnavailable`, which already refuses
the adapter at construction, i.e. the RIB at load) → ``EAGENTDOWN``; output that
is not the JSON the analyser documents → ``EPROTO``. Reasons quote the tail of
the analyser's stderr with the work directory's path masked. Cancellation (the
dispatcher's deadline, an RST) kills the sandbox at once; the work directory
(``atp-tool-*``) is removed on every way out.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec
import trio

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.adapters.openai_compat import CallStats
from atp_router.adapters.tools.sandbox import Sandbox, SandboxUnavailable
from atp_router.consensus.types import AgentFinding, AgentReport, Usage
from atp_router.policy.health import Health
from atp_router.review.paths import safe_relpath
from atp_router.task.body import CodeReview, TaskBody
from atp_router.task.change import ParsedChange, parse_change
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = [
    "CANARY_TTL_S",
    "DEFAULT_LIMITS",
    "LIMIT_OPTIONS",
    "InDoubt",
    "InThreadToolAdapter",
    "ToolAdapter",
    "ToolLimits",
    "confined_dir",
    "decode_items",
    "encode_files",
    "find_executable",
    "longest_prefix",
    "relative",
    "tenant_fault",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_STDERR_TAIL = 400
# What an analyser may keep of the router's environment (the locale); the sandbox
# gives it PATH, HOME and TMPDIR of its own, and API keys and other secrets
# never reach it.
_ENV_KEEP = ("LANG", "LC_ALL", "LC_CTYPE")
#: Seconds a canary's verdict on a next-hop is kept (module docstring).
CANARY_TTL_S = 30.0
# Items decoded between two releases of the GIL while parsing (a few hundred µs
# of work): the event loop thread waits at most that long for it.
_ITEMS_PER_YIELD = 64
# What an analyser prints when an allocation fails under RLIMIT_AS: Rust's abort
# message, Python's MemoryError, libc's ENOMEM text, C++'s bad_alloc.
_OOM_MARKERS = (b"memory allocation of", b"MemoryError", b"Cannot allocate memory", b"out of memory",
                b"std::bad_alloc")

T = TypeVar("T")


def _size(n: int) -> str:
    for unit, width in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= width and n % width == 0:
            return f"{n // width} {unit}"
    return f"{n:,} bytes"


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """Resource limits of one tool next-hop; the defaults (and what they bound) are
    the module docstring's table. Byte sizes are bytes, ``cpu_s`` whole CPU
    seconds, ``timeout_s`` wall-clock seconds. Raises ``ValueError`` naming the
    field when one is not positive."""

    max_file_bytes: int = 1 * MiB
    max_files_bytes: int = 8 * MiB
    max_files: int = 2_000
    max_diff_bytes: int = 8 * MiB
    cpu_s: int = 60
    address_space_bytes: int = 2 * GiB
    output_bytes: int = 16 * MiB
    timeout_s: float = 60.0
    max_procs: int = 256
    max_write_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name}: must be a positive number, got {value!r:.40}")
            if f.name != "timeout_s" and not isinstance(value, int):
                raise ValueError(f"{f.name}: must be a whole number, got {value!r:.40}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, base: ToolLimits | None = None) -> ToolLimits:
        """``base`` (default :data:`DEFAULT_LIMITS`) with the fields named in
        ``options`` (a RIB ``agents.<name>.options`` mapping; keys outside
        :data:`LIMIT_OPTIONS` are not read). Raises ``ValueError`` naming the
        option when a value is not a positive number of the field's kind."""
        chosen = {k: v for k, v in options.items() if k in LIMIT_OPTIONS}
        try:
            return dataclasses.replace(base or DEFAULT_LIMITS, **chosen)
        except ValueError as e:
            raise ValueError(f"options.{e}") from None


#: The default limits (the module docstring's table).
DEFAULT_LIMITS = ToolLimits()
#: Names of the :class:`ToolLimits` fields, as RIB ``options`` keys.
LIMIT_OPTIONS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ToolLimits))


def find_executable(name: str) -> str | None:
    """The analyser binary, first found of: beside the running interpreter (the
    venv's ``bin``), the analyser's own virtualenv under the router's prefix
    (``<sys.prefix>/tools/<name>/bin/<name>``: analysers whose dependencies must
    not mix with the router's, like semgrep, are installed there by
    ``scripts/setup.sh``), then ``PATH`` — so the router uses the version it
    was installed with. ``None`` when none has it."""
    for here in (Path(sys.executable).parent / name, Path(sys.prefix) / "tools" / name / "bin" / name):
        if here.is_file() and os.access(here, os.X_OK):
            return str(here)
    return shutil.which(name)


def confined_dir(value: object, *, field: str, default: str, roots: Iterable[str], who: str) -> str:
    """The directory a task names in ``content.<field>`` (resolved), or
    ``default`` when it names none. Raises ``ClientInputError`` for a value that
    is not an absolute path, lies outside every one of ``roots`` (resolved,
    symlinks followed) or is not a directory, and ``AgentError(EAGENTDOWN)`` when
    ``default`` is gone. ``who`` names the next-hop kind in the refusal."""
    if value is None:
        if not os.path.isdir(default):
            raise AgentError(ErrorCode.EAGENTDOWN, f"the {who}'s directory {default} is gone")
        return default
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ClientInputError(f"content.{field} must be a directory path")
    if not os.path.isabs(value):
        raise ClientInputError(f"content.{field} must be an absolute path, got {value!r:.200}")
    real = os.path.realpath(value)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ClientInputError(f"refused content.{field} {value!r:.200}: outside the {who}'s roots")
    if not os.path.isdir(real):
        raise ClientInputError(f"content.{field} {value!r:.200} is not a directory")
    return real


def longest_prefix(table: Mapping[str, T], code: str, default: T) -> T:
    """The entry of ``table`` under the longest prefix of ``code`` (``default``
    when no prefix is a key): how the analysers' rule codes are graded."""
    for n in range(len(code), 0, -1):
        hit = table.get(code[:n])
        if hit is not None:
            return hit
    return default


def encode_files(files: Mapping[str, Any], lim: ToolLimits, *, suffixes: tuple[str, ...] | None = None,
                 refuse_git: bool = False, total_what: str = "content.files") -> dict[str, bytes]:
    """``content.files`` checked and encoded: every path safe (:func:`~atp_router.review.paths.safe_relpath`;
    inside ``.git`` refused with ``refuse_git``), every value text; those ending in
    one of ``suffixes`` (all when None) as UTF-8 bytes, each within
    ``max_file_bytes`` and together within ``max_files_bytes`` (``total_what``
    names them in the refusal). Raises ``ClientInputError`` naming the file or
    the limit."""
    encoded: dict[str, bytes] = {}
    total = 0
    for path, text in files.items():
        safe_relpath(path)
        if refuse_git and ".git" in path.split("/"):
            raise ClientInputError(f"refused file path {path!r:.200}: inside .git")
        if not isinstance(text, str):
            raise ClientInputError(f"content.files[{path!r:.200}] must be text")
        if suffixes is not None and not path.endswith(suffixes):
            continue
        what = f"content.files[{path!r:.200}]"
        _check_len(what, text, "max_file_bytes", lim.max_file_bytes)
        try:
            # surrogateescape: text decoded that way round-trips byte for byte.
            data = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise ClientInputError(f"{what} is not encodable as UTF-8") from None
        if len(data) > lim.max_file_bytes:
            raise _over(what, f"{len(data):,} bytes", "max_file_bytes", lim.max_file_bytes)
        total += len(data)
        if total > lim.max_files_bytes:
            raise _over(total_what, f"more than {lim.max_files_bytes:,} bytes", "max_files_bytes",
                        lim.max_files_bytes)
        encoded[path] = data
    return encoded


def decode_items(raws: Iterable[msgspec.Raw], type: type[T]) -> Iterator[T]:
    """Decode each JSON item of ``raws`` as ``type``, releasing the GIL every few
    dozen items: called in a worker thread, a large analyser report never holds
    the event loop's thread off for more than a fraction of a millisecond.
    Raises ``msgspec.DecodeError`` / ``ValidationError`` (both ``ValueError``)."""
    decoder = msgspec.json.Decoder(type)
    for i, raw in enumerate(raws, 1):
        yield decoder.decode(raw)
        if i % _ITEMS_PER_YIELD == 0:
            time.sleep(0)  # releases the GIL


class InDoubt(AgentError):
    """A run failed in a way the task or the next-hop may have caused (a timeout,
    an abnormal exit): :meth:`ToolAdapter.attribute` settles whose it is with a
    canary. Never leaves the adapter."""


def tenant_fault(e: BaseException) -> ClientInputError:
    """The client error for an exception the task's content raised in the
    adapter itself (``RecursionError`` on absurd nesting, ``MemoryError``)."""
    return ClientInputError(f"the task's content could not be processed ({type(e).__name__}: it is too deeply "
                            "nested or too large)")


@dataclass(slots=True)
class _Task:
    """A bounded, validated task: the files to analyse (UTF-8 bytes), the changed
    lines to keep (``None``: all), and how many files were not Python."""

    targets: dict[str, bytes]
    keep: dict[str, set[int]] | None
    skipped: int
    #: Python files the diff changes that ``content.files`` lacks.
    missing: list[str] = dataclasses.field(default_factory=list)


class ToolAdapter(ProviderAdapter):
    """Base of the static-analyser next-hops.

    Subclasses set :attr:`tool` (executable name) and :attr:`default_strengths`,
    and implement :meth:`argv` and :meth:`parse`.

    ``scope`` is ``"changed"`` (findings on changed lines only; the prompt must
    carry ``content["diff"]``) or ``"file"`` (whole files); ``context`` widens the
    changed lines by that many lines each side; ``limits`` bounds the task and
    the analyser process (default :data:`DEFAULT_LIMITS`, see the module docstring).
    Raises :class:`~atp_router.adapters.tools.sandbox.SandboxUnavailable` (a
    ``ValueError``: the RIB naming it is refused at load) when no sandbox can be
    made on this host.
    """

    tool: ClassVar[str]
    needs_files = True
    tenant_bound = True  # its run time and crashes may be the task's (atp_router.flow.breaker.attribute)
    default_strengths: ClassVar[tuple[str, ...]] = ()
    #: Files these analysers understand; others in ``files`` are skipped.
    suffixes: ClassVar[tuple[str, ...]] = (".py", ".pyi")

    def __init__(
        self,
        name: str,
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        limits: ToolLimits = DEFAULT_LIMITS,
    ) -> None:
        if scope not in ("changed", "file"):
            raise ValueError(f"scope must be 'changed' or 'file', got {scope!r}")
        if context < 0:
            raise ValueError(f"context must be >= 0 lines, got {context}")
        if not isinstance(limits, ToolLimits):
            raise TypeError(f"limits must be ToolLimits, got {type(limits).__name__}")
        self.name = name
        self.scope = scope
        self.context = context
        self.strengths = list(strengths) if strengths else list(self.default_strengths)
        self.limits = limits
        self._stats = CallStats()
        self._sandboxes: dict[str, Sandbox] = {}
        self._canary: tuple[float, bool] | None = None  # (when, ok)
        self._canary_lock = trio.Lock()
        self.sandbox(find_executable(self.tool)).check()

    def sandbox(self, exe: str | None) -> Sandbox:
        """The sandbox policy runs of executable ``exe`` get (its installation
        mounted read-only; :meth:`sandbox_options` for the rest). Cached per
        executable."""
        key = exe or ""
        box = self._sandboxes.get(key)
        if box is None:
            box = self._sandboxes[key] = Sandbox(tool=self.tool, limits=self.limits,
                                                 executables=[exe] if exe else [], **self.sandbox_options())
        return box

    def sandbox_options(self) -> dict[str, Any]:
        """More :class:`~atp_router.adapters.tools.sandbox.Sandbox` arguments
        (``allow_network``, ``env``); none for the analysers."""
        return {}

    #: The canary's files (module docstring, "Faults are attributed"): small,
    #: well-formed, in every limit.
    canary_files: ClassVar[dict[str, bytes]] = {"atp_canary.py": b"def add(a, b):\n    return a + b\n"}

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Skills (strengths), the tool's name; no context limit (``max_ctx=0``)."""
        return Capabilities(agent=self.name, skills=list(self.strengths), tools=[self.tool])

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Zero tokens and USD: a local analyser spends neither (spec §5.2)."""
        return CostEstimate()

    def health(self) -> Health:
        """p95 latency (ms) and error rate over the last ~100 runs (runs refused
        for the client's input are not counted)."""
        return self._stats.health()

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """Run the analyser and yield one FINAL fragment (content ``AgentReport``,
        usage zero). Raises ``ClientInputError`` / ``AgentError`` as the module
        docstring describes."""
        t0 = trio.current_time()
        try:
            try:
                report = await self.review(prompt)
            except (RecursionError, MemoryError) as e:
                raise tenant_fault(e) from None
        except AgentError as e:
            e.agent = e.agent or self.name
            if not e.client_fault:
                self._stats.record((trio.current_time() - t0) * 1000, ok=False, down=e.code is ErrorCode.EAGENTDOWN)
            raise
        self._stats.record((trio.current_time() - t0) * 1000, ok=True)
        yield Fragment(type=PayloadType.FINAL, content=report, usage=Usage())

    # -- the work ------------------------------------------------------------------

    async def review(self, prompt: Prompt) -> AgentReport:
        """The report :meth:`stream` yields, for callers that want it directly."""
        task = await trio.to_thread.run_sync(self._bound, prompt.body, prompt.change)
        findings: list[AgentFinding] = []
        notes: list[str] = []
        if task.targets:
            findings, notes = await self._run(task.targets)
        return await trio.to_thread.run_sync(self._conclude, task, findings, notes)

    def _bound(self, body: TaskBody, change: ParsedChange | None = None) -> _Task:
        """Validate and bound the task (module docstring, step 1-2); runs in a
        worker thread. ``body``: the prompt's typed body (a review's
        :class:`~atp_router.task.body.CodeReview`: its ``files`` and ``diff``
        already typed); ``change`` is the diff already parsed (the task's, from the
        dispatcher), else it is parsed here when ``scope`` is ``"changed"``.
        Raises ClientInputError naming the limit or the field."""
        lim = self.limits
        files = body.files if isinstance(body, CodeReview) else None
        if files is None:
            raise ClientInputError("content must be an object with 'files' (and 'diff'): "
                                   "path → the file's text after the change")
        if len(files) > lim.max_files:
            raise ClientInputError(f"content.files has {len(files):,} files, over the limit max_files={lim.max_files:,}")
        diff = body.diff if isinstance(body, CodeReview) else None
        if diff is not None:
            _check_len("content.diff", diff, "max_diff_bytes", lim.max_diff_bytes)
            size = len(diff.encode("utf-8", "surrogatepass"))
            if size > lim.max_diff_bytes:
                raise _over("content.diff", f"{size:,} bytes", "max_diff_bytes", lim.max_diff_bytes)
        encoded = encode_files(files, lim, suffixes=self.suffixes, total_what="the Python in content.files")
        keep: dict[str, Iterable[int]] | None = None
        if self.scope == "changed":
            if not isinstance(diff, str):
                raise ClientInputError("scope 'changed' needs content.diff (a unified diff string)")
            keep = _widen((change if change is not None else parse_change(diff)).changed, self.context)
        targets = {p: data for p, data in encoded.items() if keep is None or keep.get(p)}
        missing = sorted(p for p in keep or () if p.endswith(self.suffixes) and p not in files)
        if missing and not targets:
            # Reviewing nothing of what changed is not "no findings".
            shown = ", ".join(repr(p)[:200] for p in missing[:5]) + (", …" if len(missing) > 5 else "")
            raise ClientInputError(
                f"content.files lacks the {len(missing)} Python file(s) the diff changes ({shown}): nothing to review"
            )
        return _Task(targets=targets, keep=keep, skipped=len(files) - len(encoded), missing=missing)

    def _conclude(self, task: _Task, findings: list[AgentFinding], notes: list[str]) -> AgentReport:
        """Filter, order and number the findings (module docstring, step 4); runs
        in a worker thread."""
        keep = task.keep
        if keep is not None:
            findings = [f for f in findings if _touches(f, keep.get(f.file, ()))]
        findings = [f for f in findings if f.file in task.targets]
        findings.sort(key=lambda f: (f.file, f.start, f.rule or "", f.claim))
        for i, f in enumerate(findings, 1):
            f.ref = str(i)
        summary = f"{self.tool}: {len(findings)} finding(s) in {len(task.targets)} file(s)"
        if task.skipped:
            summary += f"; {task.skipped} non-Python file(s) skipped"
        if task.missing:
            summary += f"; {len(task.missing)} changed Python file(s) not in content.files, not reviewed"
        if notes:
            summary += "; " + "; ".join(notes)
        return AgentReport(findings=findings, summary=summary)

    async def _run(self, targets: Mapping[str, bytes]) -> tuple[list[AgentFinding], list[str]]:
        """Run the analyser on ``targets``; a failure in doubt is attributed by
        a canary (module docstring)."""
        try:
            return await self._run_once(targets)
        except InDoubt as e:
            raise await self.attribute(e) from None

    async def attribute(self, doubt: InDoubt) -> AgentError:
        """The error a run that failed in doubt ends in: the task's
        (``ClientInputError``: ``ETIMEOUT`` for the wall clock, else ``EPROTO``)
        when a canary runs clean on this next-hop, else the next-hop's
        (``AgentError``, the doubt's code)."""
        if await self.canary_ok():
            code = ErrorCode.ETIMEOUT if doubt.code == ErrorCode.ETIMEOUT else ErrorCode.EPROTO
            return ClientInputError(f"{doubt.reason} — caused by this task: a canary task ran clean on "
                                    f"{self.tool} in the same sandbox", code=code)
        return AgentError(doubt.code, f"{doubt.reason}; a canary task failed on {self.tool} too")

    async def canary_ok(self) -> bool:
        """Whether :attr:`canary_files` run clean on this next-hop now (the
        verdict kept :data:`CANARY_TTL_S` s; one canary at a time)."""
        async with self._canary_lock:
            if self._canary is not None and trio.current_time() - self._canary[0] < CANARY_TTL_S:
                return self._canary[1]
            try:
                await self.run_canary()
                ok = True
            except AgentError:
                ok = False
            self._canary = (trio.current_time(), ok)
            return ok

    async def run_canary(self) -> None:
        """Run the canary task; raises AgentError when it fails (no attribution)."""
        await self._run_once(self.canary_files)

    async def _run_once(self, targets: Mapping[str, bytes]) -> tuple[list[AgentFinding], list[str]]:
        exe = find_executable(self.tool)
        if exe is None:
            raise AgentError(
                ErrorCode.EAGENTDOWN, f"{self.tool} is not installed (neither in the router's environment nor on PATH)"
            )
        root = await trio.to_thread.run_sync(_write_tree, targets)
        try:
            # "./" keeps a file named like an option ("-x.py") from being read as one.
            argv = [exe, *self.argv(["./" + p for p in sorted(targets)])]
            returncode, stdout, stderr = await self._exec(argv, root)
            self._check_exit(returncode, stderr, root)
            try:
                return await trio.to_thread.run_sync(self.parse, stdout, root)
            except (ValueError, KeyError, TypeError) as e:
                raise AgentError(
                    ErrorCode.EPROTO,
                    f"{self.tool} output is not its JSON report ({_mask(str(e), root)[:200]}): "
                    f"{_tail(stderr, root)}",
                ) from None
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, root, True)

    async def _exec(
        self,
        argv: list[str],
        root: str,
        *,
        env: Mapping[str, str] | None = None,
        preexec: Any = None,
    ) -> tuple[int, bytes, bytes]:
        """Run ``argv`` on a copy of ``root`` in a sandbox of its own under
        :attr:`limits` (:meth:`Sandbox.run <atp_router.adapters.tools.sandbox.Sandbox.run>`):
        stdout and stderr read together up to ``output_bytes``, the whole run
        under ``timeout_s``; every process of the run is gone when this returns
        (limit, timeout, cancellation). ``env`` is added to the sandbox's minimal
        environment; ``preexec`` must be ``None`` (the sandbox sets the child
        up). Returns (exit status, stdout, stderr); raises ClientInputError
        (output or memory limit), :class:`InDoubt` (``ETIMEOUT``) or AgentError
        (``EAGENTDOWN`` when it cannot start)."""
        if preexec is not None:
            raise TypeError("preexec: the sandbox sets the child up")
        lim = self.limits
        box = self.sandbox(argv[0])
        try:
            res = await box.run(argv, tree=root, env=env, ro_paths=_named_paths(argv[1:], root))
        except SandboxUnavailable as e:
            raise AgentError(ErrorCode.EAGENTDOWN, f"{self.tool} cannot run: {e}") from None
        except (OSError, subprocess.SubprocessError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise AgentError(ErrorCode.EAGENTDOWN, f"{self.tool} could not start: {reason}") from None
        if res.capped:
            raise ClientInputError(
                f"{self.tool} wrote more than the output limit output_bytes={lim.output_bytes:,} "
                f"({_size(lim.output_bytes)}) for this task; killed"
            )
        if res.timed_out:
            raise InDoubt(ErrorCode.ETIMEOUT,
                          f"{self.tool} ran past its wall-clock limit timeout_s={lim.timeout_s:g} s; killed")
        if res.oom:
            raise ClientInputError(
                f"{self.tool} ran out of its memory limit address_space_bytes={lim.address_space_bytes:,} "
                f"({_size(lim.address_space_bytes)}) on this task; killed"
            )
        assert res.returncode is not None
        return res.returncode, res.stdout, res.stderr

    def _check_exit(self, returncode: int, stderr: bytes, root: str) -> None:
        """Raise for an abnormal exit: the CPU or address-space limit hit →
        ClientInputError naming it; any other → :class:`InDoubt`
        (``EAGENTDOWN``, attributed by a canary)."""
        if returncode == 0:
            return
        lim = self.limits
        if returncode == -signal.SIGXCPU:
            raise ClientInputError(f"{self.tool} used up its CPU limit cpu_s={lim.cpu_s} s on this task; killed")
        if any(m in stderr for m in _OOM_MARKERS):
            raise ClientInputError(
                f"{self.tool} ran out of its address-space limit address_space_bytes={lim.address_space_bytes:,} "
                f"({_size(lim.address_space_bytes)}) on this task: {_tail(stderr, root)}"
            )
        status = f"signal {_signame(-returncode)}" if returncode < 0 else f"status {returncode}"
        raise InDoubt(ErrorCode.EAGENTDOWN, f"{self.tool} exited with {status}: {_tail(stderr, root)}")

    @abc.abstractmethod
    def argv(self, paths: list[str]) -> list[str]:
        """Arguments after the executable, for ``paths`` relative to the work dir.
        The analyser must exit 0 whether or not it found anything."""

    @abc.abstractmethod
    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """Findings (``file`` relative to ``root``, POSIX) and short notes for the
        summary. Runs in a worker thread (use :func:`decode_items` for long
        lists). Raise ValueError/KeyError/TypeError on malformed output."""


class InThreadToolAdapter(ProviderAdapter):
    """Base of the local next-hops that run in a worker thread of the router, not
    in a subprocess (the retriever, the summariser): they only read files under
    the operator's ``roots``, bounded by limits of their own. Subclasses set
    :attr:`tool`, ``name``, ``strengths`` and ``_stats`` (a
    :class:`~atp_router.adapters.openai_compat.CallStats`) and implement :meth:`work`."""

    tool: ClassVar[str]
    tenant_bound = True  # its run time and crashes may be the task's (atp_router.flow.breaker.attribute)
    name: str
    strengths: list[str]
    _stats: CallStats

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=list(self.strengths), tools=[self.tool])

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Zero tokens and USD: local work spends neither."""
        return CostEstimate()

    def health(self) -> Health:
        return self._stats.health()

    @abc.abstractmethod
    def work(self, content: Any) -> AgentReport:
        """The report for one task's ``content``. Blocking (runs in a worker thread)."""

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """One FINAL fragment (``AgentReport``, zero usage). Raises what
        :meth:`work` raises (``ClientInputError`` for the task's fault,
        ``AgentError`` otherwise)."""
        t0 = trio.current_time()
        try:
            try:
                report = await trio.to_thread.run_sync(self.work, prompt.content)
            except (RecursionError, MemoryError) as e:
                raise tenant_fault(e) from None
        except AgentError as e:
            e.agent = e.agent or self.name
            if not e.client_fault:
                self._stats.record((trio.current_time() - t0) * 1000, ok=False, down=True)
            raise
        self._stats.record((trio.current_time() - t0) * 1000, ok=True)
        yield Fragment(type=PayloadType.FINAL, content=report, confidence=report.confidence, usage=Usage())


def relative(filename: str, root: str) -> str:
    """A path the analyser printed (absolute or ``./x``) as the task's relative path."""
    full = filename if os.path.isabs(filename) else os.path.join(root, filename)
    return Path(os.path.relpath(os.path.realpath(full), os.path.realpath(root))).as_posix()


def _over(what: str, size: str, name: str, limit: int) -> ClientInputError:
    """The refusal of a task over limit ``name`` (spec §10 EPROTO, a client fault)."""
    return ClientInputError(f"{what} is {size}, over the limit {name}={limit:,} ({_size(limit)})")


def _check_len(what: str, text: str, name: str, limit: int) -> None:
    # Every character is at least one UTF-8 byte: a text longer than the limit is
    # refused before anything is encoded.
    if len(text) > limit:
        raise _over(what, f"at least {len(text):,} bytes", name, limit)


def _named_paths(args: Iterable[str], root: str) -> list[str]:
    """Absolute host paths the adapter's own arguments name (``/x``, ``--opt=/x``;
    e.g. semgrep's rule files), outside the work dir: mounted read-only in the
    sandbox. The task's files are always ``./``-relative, never among them."""
    out = []
    for a in args:
        value = a.partition("=")[2] if a.startswith("-") else a
        if value.startswith("/") and not (value == root or value.startswith(root + "/")) and os.path.exists(value):
            out.append(value)
    return out


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _widen(lines: Mapping[str, Iterable[int]], context: int) -> dict[str, Iterable[int]]:
    if context == 0:
        return dict(lines)
    return {p: {n + k for n in ns for k in range(-context, context + 1) if n + k >= 1} for p, ns in lines.items()}


def _touches(f: AgentFinding, lines: Iterable[int]) -> bool:
    return any(f.start <= n <= f.end for n in lines)


def _write_tree(files: Mapping[str, bytes]) -> str:
    """A new ``atp-tool-*`` directory holding ``files``; removed again on any
    failure (never leaked)."""
    root = tempfile.mkdtemp(prefix="atp-tool-")
    try:
        for rel, data in files.items():
            dest = os.path.join(root, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            # Bytes as given: CRLF files keep their line ends.
            with open(dest, "xb") as fh:
                fh.write(data)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        # e.g. "a" given both as a file and as a directory of "a/b.py".
        raise ClientInputError(f"content.files cannot be laid out as a tree: {e.strerror}") from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _mask(text: str, root: str) -> str:
    for form in {root, os.path.realpath(root)}:
        text = text.replace(form + os.sep, "").replace(form, "<workdir>")
    return text


def _tail(stderr: bytes | None, root: str) -> str:
    text = _mask((stderr or b"").decode("utf-8", "replace"), root).strip()
    return ("…" + text[-_STDERR_TAIL:]) if len(text) > _STDERR_TAIL else (text or "(no stderr)")
