"""Static analysers as review next-hops (spec §14): the shared tool-adapter machinery.

A :class:`ToolAdapter` turns a ``code_review`` prompt (``content = {"diff": str,
"files": {path: after-diff text}}``) into one FINAL :class:`AgentReport`:

1. validate ``files`` (relative, normalised paths; text values) — anything that
   could escape the work directory is refused with ``AgentError(EPROTO)``;
2. pick the Python files to analyse: with ``scope="changed"`` only the files the
   diff touched (``content["diff"]`` is then required), with ``scope="file"`` all;
3. write them into a private temporary directory, run the analyser there as a
   subprocess (no shell, a minimal environment; binary found next to
   ``sys.executable`` first, then on ``PATH``), parse its JSON;
4. with ``scope="changed"``, keep only findings that touch a changed line
   (± ``context`` lines), number them (``ref`` 1, 2, …) and yield the report with
   zero usage: tools cost no tokens and no USD.

Errors: analyser missing or exiting abnormally → ``AgentError(EAGENTDOWN)``; output
that is not the JSON the analyser documents → ``AgentError(EPROTO)``. Reasons quote
the tail of the analyser's stderr with the work directory's path masked.
"""

from __future__ import annotations

import abc
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio

from atp.adapters.base import Fragment, Health, Prompt, ProviderAdapter
from atp.adapters.openai_compat import CallStats
from atp.consensus.types import AgentFinding, AgentReport, Usage
from atp.review.diff import changed_lines, parse_diff
from atp.wire.errors import AgentError, ErrorCode
from atp.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = ["ToolAdapter", "find_executable", "relative", "safe_relpath"]

_STDERR_TAIL = 400
# What an analyser needs from the router's environment; API keys and other
# secrets stay out of the subprocess.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")


def find_executable(name: str) -> str | None:
    """The analyser binary: the one installed beside the running interpreter (the
    venv's ``bin``) wins over ``PATH``, so the router uses the version it was
    installed with. ``None`` when neither has it."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def safe_relpath(path: object) -> str:
    """Return ``path`` if it is a normalised relative POSIX path that stays inside
    the directory it is joined to; raise ``AgentError(EPROTO)`` otherwise.

    Refused: non-strings, empty, absolute (``/x``, ``C:x``), any ``..`` component,
    backslashes (a Windows separator here would mean something else), NUL, and
    non-normal forms (``./x``, ``a//b``) that would make the tool's paths differ
    from the diff's.
    """
    if not isinstance(path, str) or not path:
        raise AgentError(ErrorCode.EPROTO, f"file path must be a non-empty string, got {path!r:.80}")
    if (
        path.startswith("/")
        or _DRIVE_RE.match(path)
        or "\\" in path
        or "\x00" in path
        or ".." in path.split("/")
        or posixpath.normpath(path) != path
    ):
        raise AgentError(ErrorCode.EPROTO, f"refused file path {path!r:.200}: must be relative and inside the task")
    return path


class ToolAdapter(ProviderAdapter):
    """Base of the static-analyser next-hops.

    Subclasses set :attr:`tool` (executable name) and :attr:`default_strengths`,
    and implement :meth:`argv` and :meth:`parse`.

    ``scope`` is ``"changed"`` (findings on changed lines only; the prompt must
    carry ``content["diff"]``) or ``"file"`` (whole files); ``context`` widens the
    changed lines by that many lines each side.
    """

    tool: ClassVar[str]
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
    ) -> None:
        if scope not in ("changed", "file"):
            raise ValueError(f"scope must be 'changed' or 'file', got {scope!r}")
        if context < 0:
            raise ValueError(f"context must be >= 0 lines, got {context}")
        self.name = name
        self.scope = scope
        self.context = context
        self.strengths = list(strengths) if strengths else list(self.default_strengths)
        self._stats = CallStats()

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """Skills (strengths), the tool's name; no context limit (``max_ctx=0``)."""
        return Capabilities(agent=self.name, skills=list(self.strengths), tools=[self.tool])

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Zero tokens and USD: a local analyser spends neither (spec §5.2)."""
        return CostEstimate()

    def health(self) -> Health:
        """p95 latency (ms) and error rate over the last ~100 runs."""
        return self._stats.health()

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        """Run the analyser and yield one FINAL fragment (content ``AgentReport``,
        usage zero). Raises ``AgentError`` (EPROTO / EAGENTDOWN) as the module
        docstring describes."""
        t0 = trio.current_time()
        try:
            report = await self.review(prompt)
        except AgentError as e:
            e.agent = e.agent or self.name
            self._stats.record((trio.current_time() - t0) * 1000, ok=False, down=e.code is ErrorCode.EAGENTDOWN)
            raise
        self._stats.record((trio.current_time() - t0) * 1000, ok=True)
        yield Fragment(type=PayloadType.FINAL, content=report, usage=Usage())

    # -- the work ------------------------------------------------------------------

    async def review(self, prompt: Prompt) -> AgentReport:
        """The report :meth:`stream` yields, for callers that want it directly."""
        files = _task_files(prompt.content)
        keep: dict[str, set[int]] | None = None
        if self.scope == "changed":
            diff = prompt.content.get("diff")
            if not isinstance(diff, str):
                raise AgentError(ErrorCode.EPROTO, "scope 'changed' needs content.diff (a unified diff string)")
            keep = _widen(changed_lines(parse_diff(diff)), self.context)
        targets = {p: text for p, text in files.items() if p.endswith(self.suffixes) and (keep is None or keep.get(p))}
        skipped = sum(1 for p in files if not p.endswith(self.suffixes))
        notes: list[str] = []
        findings: list[AgentFinding] = []
        if targets:
            findings, notes = await self._run(targets)
        if keep is not None:
            findings = [f for f in findings if _touches(f, keep.get(f.file, ()))]
        findings = [f for f in findings if f.file in targets]
        findings.sort(key=lambda f: (f.file, f.start, f.rule or "", f.claim))
        for i, f in enumerate(findings, 1):
            f.ref = str(i)
        summary = f"{self.tool}: {len(findings)} finding(s) in {len(targets)} file(s)"
        if skipped:
            summary += f"; {skipped} non-Python file(s) skipped"
        if notes:
            summary += "; " + "; ".join(notes)
        return AgentReport(findings=findings, summary=summary)

    async def _run(self, targets: Mapping[str, str]) -> tuple[list[AgentFinding], list[str]]:
        exe = find_executable(self.tool)
        if exe is None:
            raise AgentError(
                ErrorCode.EAGENTDOWN, f"{self.tool} is not installed (neither in the router's environment nor on PATH)"
            )
        root = await trio.to_thread.run_sync(_write_tree, targets)
        try:
            # "./" keeps a file named like an option ("-x.py") from being read as one.
            argv = [exe, *self.argv(["./" + p for p in sorted(targets)])]
            try:
                proc = await trio.run_process(
                    argv,
                    cwd=root,
                    env={k: os.environ[k] for k in _ENV_KEEP if k in os.environ},
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            except OSError as e:
                raise AgentError(ErrorCode.EAGENTDOWN, f"{self.tool} could not start: {e.strerror}") from None
            if proc.returncode != 0:
                raise AgentError(
                    ErrorCode.EAGENTDOWN,
                    f"{self.tool} exited with status {proc.returncode}: {_tail(proc.stderr, root)}",
                )
            try:
                return self.parse(proc.stdout, root)
            except (ValueError, KeyError, TypeError) as e:
                raise AgentError(
                    ErrorCode.EPROTO,
                    f"{self.tool} output is not its JSON report ({_mask(str(e), root)[:200]}): "
                    f"{_tail(proc.stderr, root)}",
                ) from None
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, root, True)

    @abc.abstractmethod
    def argv(self, paths: list[str]) -> list[str]:
        """Arguments after the executable, for ``paths`` relative to the work dir.
        The analyser must exit 0 whether or not it found anything."""

    @abc.abstractmethod
    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """Findings (``file`` relative to ``root``, POSIX) and short notes for the
        summary. Raise ValueError/KeyError/TypeError on malformed output."""


def relative(filename: str, root: str) -> str:
    """A path the analyser printed (absolute or ``./x``) as the task's relative path."""
    full = filename if os.path.isabs(filename) else os.path.join(root, filename)
    return Path(os.path.relpath(os.path.realpath(full), os.path.realpath(root))).as_posix()


def _task_files(content: Mapping[str, Any]) -> dict[str, str]:
    files = content.get("files")
    if not isinstance(files, dict):
        raise AgentError(ErrorCode.EPROTO, "content.files must map paths to file text")
    for path, text in files.items():
        safe_relpath(path)
        if not isinstance(text, str):
            raise AgentError(ErrorCode.EPROTO, f"content.files[{path!r}] must be text")
    return files


def _widen(lines: Mapping[str, set[int]], context: int) -> dict[str, set[int]]:
    if context == 0:
        return dict(lines)
    return {p: {n + k for n in ns for k in range(-context, context + 1) if n + k >= 1} for p, ns in lines.items()}


def _touches(f: AgentFinding, lines: Iterable[int]) -> bool:
    return any(f.start <= n <= f.end for n in lines)


def _write_tree(files: Mapping[str, str]) -> str:
    root = tempfile.mkdtemp(prefix="atp-tool-")
    try:
        for rel, text in files.items():
            dest = os.path.join(root, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            # newline="" writes the text byte-for-byte (CRLF files keep their ends).
            with open(dest, "x", encoding="utf-8", errors="surrogateescape", newline="") as fh:
                fh.write(text)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        # e.g. "a" given both as a file and as a directory of "a/b.py".
        raise AgentError(ErrorCode.EPROTO, f"content.files cannot be laid out as a tree: {e.strerror}") from None
    return root


def _mask(text: str, root: str) -> str:
    for form in {root, os.path.realpath(root)}:
        text = text.replace(form + os.sep, "").replace(form, "<workdir>")
    return text


def _tail(stderr: bytes | None, root: str) -> str:
    text = _mask((stderr or b"").decode("utf-8", "replace"), root).strip()
    return ("…" + text[-_STDERR_TAIL:]) if len(text) > _STDERR_TAIL else (text or "(no stderr)")
