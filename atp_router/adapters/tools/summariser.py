"""A repository summariser next-hop (spec §15.2 "single local summarizer"): an
extractive, cited summary of a source tree, with a confidence that is low when
the repository is ambiguous.

A ``repo_summary`` task is ``content = {"repo": str (optional)}``: an absolute
directory on the router's host that must lie (symlinks resolved) inside one of
the adapter's ``roots``; without it the adapter's own ``repo`` is summarised.

The walk (bounded by :class:`SummariserLimits`): files in path order, hidden
entries and build/vendor folders (:data:`SKIP_DIRS`) skipped, symlinks never
followed; at most ``max_files`` files are looked at and ``max_bytes`` bytes read
(a file over ``max_file_bytes`` is not read). What it reads:

* ``README*`` at the root: the title, the first paragraph and every heading
  (with its line);
* ``pyproject.toml`` (``tomllib``): ``project.name``, ``description`` and the
  ``[project.scripts]`` entry points, each with its line;
* every ``*.py`` file: parsed with :mod:`ast` (never imported nor run): the
  module docstring's first sentence, public classes and functions (names not
  starting with ``_``) and whether it has an ``if __name__ == "__main__"`` block.

The report (``AgentReport``):

* ``summary``: markdown sections — the project (name, description), entry
  points, the documentation's outline (README headings), and the modules
  (package by package, each module's docstring sentence and public names) —
  every statement followed by its citation ``[file:start-end]``;
* ``findings``: the same citations, one per statement (``severity`` info,
  ``rule`` ``summary:<section>``, ``claim`` the statement), so consensus and
  clients see where each comes from;
* ``confidence`` (0..1): how well the repository explains itself — 0.35 for a
  README with a paragraph (0.2 with only a title), 0.15 for a project
  description, 0.1 for entry points, and up to 0.4 for the share of Python
  modules with a docstring. A tree without README, description or docstrings
  is ambiguous (below 0.5): the policy's ``low_conf`` escalation then asks a
  model.

Errors: a ``repo`` that is not an absolute directory inside ``roots`` →
``ClientInputError`` (``EPROTO``); the adapter's own ``repo`` gone →
``AgentError(EAGENTDOWN)``. A file that cannot be parsed — including one nested
so deep that the parser raises ``RecursionError`` or ``MemoryError`` — is listed
as unparsable, never a failure of the next-hop. Costs nothing (zero tokens and USD).

Why it runs in a worker thread of the router and not in the sandbox of
:mod:`atp_router.adapters.tools.sandbox` (issue 19): it executes nothing of the
tenant's. The tenant sends no files to it; it names at most a directory, which
must lie inside the operator's ``roots``; what it reads there it only parses —
``ast.parse`` (never compiled, imported or run), ``tomllib``, regular
expressions — within :class:`SummariserLimits` (files, bytes, one file's bytes),
and never follows a symlink. Parsing is not execution: the worst a hostile file
under ``roots`` can do is be slow within those bounds or fail to parse. An
operator who puts tenant-writable checkouts under ``roots`` should know that
their content is parsed in the router's process.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atp_router.adapters.base import CallStats
from atp_router.adapters.tools.base import InThreadToolAdapter, confined_dir
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.wire.errors import ClientInputError

__all__ = ["SKIP_DIRS", "RepoFacts", "SummariserAdapter", "SummariserLimits", "scan_repo", "summarise"]

KiB = 1024
MiB = 1024 * KiB

#: Folders never walked (besides hidden ones): environments, caches, builds, vendored code.
SKIP_DIRS = frozenset({"node_modules", "__pycache__", "venv", "env", "build", "dist", "site-packages",
                       "target", "vendor", "third_party"})
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.DOTALL)
#: Modules listed per package, and public names per module, in the summary.
MAX_MODULES = 60
MAX_NAMES = 6
#: README headings cited in the outline, at most.
MAX_OUTLINE = 24


@dataclass(frozen=True, slots=True)
class SummariserLimits:
    """Bounds of one walk: ``max_files`` files looked at, ``max_bytes`` bytes
    read in all, ``max_file_bytes`` bytes of one file (larger ones are not
    read). Raises ``ValueError`` naming the field when one is not a positive
    whole number."""

    max_files: int = 2_000
    max_bytes: int = 8 * MiB
    max_file_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"options.{f.name}: must be a positive whole number, got {value!r:.40}")


@dataclass(slots=True)
class Module:
    """One Python file: ``path`` (POSIX, relative), its docstring's first
    sentence and lines, public names with their lines, a ``__main__`` block."""

    path: str
    doc: str = ""
    doc_lines: tuple[int, int] = (1, 1)
    public: list[tuple[str, str, int, int]] = field(default_factory=list)  # (kind, name, start, end)
    main_line: int | None = None
    lines: int = 0


@dataclass(slots=True)
class RepoFacts:
    """What a walk found (see :func:`scan_repo`); ``skipped`` names files not
    read and why, ``truncated`` says a limit stopped the walk."""

    readme: str | None = None
    title: tuple[str, int] | None = None
    paragraph: tuple[str, int, int] | None = None
    headings: list[tuple[int, str, int]] = field(default_factory=list)  # (level, text, line)
    project: dict[str, tuple[str, int]] = field(default_factory=dict)  # name/description → (value, line)
    scripts: list[tuple[str, str, int]] = field(default_factory=list)  # (name, target, line)
    modules: list[Module] = field(default_factory=list)
    unparsable: list[str] = field(default_factory=list)
    files_seen: int = 0
    bytes_read: int = 0
    skipped: list[str] = field(default_factory=list)
    truncated: str | None = None


def _walk(root: str, limits: SummariserLimits, facts: RepoFacts) -> list[tuple[str, str]]:
    """``[(relative POSIX path, full path)]`` of the regular files, path order, at most ``max_files``."""
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            if len(out) >= limits.max_files:
                facts.truncated = f"stopped at max_files={limits.max_files:,}"
                return out
            out.append((Path(os.path.relpath(full, root)).as_posix(), full))
    return out


def _read(rel: str, full: str, limits: SummariserLimits, facts: RepoFacts) -> str | None:
    try:
        size = os.path.getsize(full)
    except OSError:
        return None
    if size > limits.max_file_bytes:
        facts.skipped.append(f"{rel}: {size:,} bytes, over max_file_bytes={limits.max_file_bytes:,}")
        return None
    if facts.bytes_read + size > limits.max_bytes:
        facts.truncated = f"stopped reading at max_bytes={limits.max_bytes:,}"
        return None
    try:
        with open(full, "rb") as fh:
            data = fh.read(limits.max_file_bytes + 1)
    except OSError:
        return None
    facts.bytes_read += len(data)
    return data.decode("utf-8", "replace")


def _first_sentence(text: str) -> str:
    para = text.strip().split("\n\n", 1)[0]
    para = " ".join(para.split())
    m = _SENTENCE.match(para)
    s = m.group(1) if m else para
    return s if len(s) <= 200 else s[:199].rsplit(" ", 1)[0] + "…"


def _readme(rel: str, text: str, facts: RepoFacts) -> None:
    facts.readme = rel
    lines = text.splitlines()
    in_fence = False
    para: list[tuple[int, str]] = []
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        m = _HEADING.match(line)
        if m:
            level, heading = len(m.group(1)), m.group(2).strip()
            facts.headings.append((level, heading, i))
            if facts.title is None and level == 1:
                facts.title = (heading, i)
            if para and facts.paragraph is None:
                facts.paragraph = (" ".join(t for _, t in para), para[0][0], para[-1][0])
            para = []
            continue
        if facts.paragraph is None:
            stripped = line.strip()
            if stripped and not stripped.startswith(("|", "<", "![", "[!", "---", "===")):
                para.append((i, stripped))
            elif para:
                facts.paragraph = (" ".join(t for _, t in para), para[0][0], para[-1][0])
                para = []
    if para and facts.paragraph is None:
        facts.paragraph = (" ".join(t for _, t in para), para[0][0], para[-1][0])


def _line_of(lines: list[str], pattern: re.Pattern[str], after: int = 0) -> int:
    for i, line in enumerate(lines[after:], after + 1):
        if pattern.match(line):
            return i
    return 1


def _pyproject(text: str, facts: RepoFacts) -> None:
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, MemoryError):  # e.g. arrays nested thousands deep
        facts.unparsable.append("pyproject.toml")
        return
    lines = text.splitlines()
    project = data.get("project") if isinstance(data.get("project"), dict) else {}
    sect = _line_of(lines, re.compile(r"^\s*\[project\]\s*$"))
    for key in ("name", "description"):
        value = project.get(key)
        if isinstance(value, str) and value.strip():
            facts.project[key] = (value.strip(), _line_of(lines, re.compile(rf"^\s*{key}\s*="), sect - 1))
    scripts = project.get("scripts")
    if isinstance(scripts, dict):
        at = _line_of(lines, re.compile(r"^\s*\[project\.scripts\]\s*$"))
        for name, target in scripts.items():
            if isinstance(target, str):
                line = _line_of(lines, re.compile(rf"^\s*[\"']?{re.escape(name)}[\"']?\s*="), at - 1)
                facts.scripts.append((name, target, line))


def _module(rel: str, text: str, facts: RepoFacts) -> None:
    try:
        tree = ast.parse(text, filename=rel)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # absurd nesting: unparsable, not a crash
        facts.unparsable.append(rel)
        return
    mod = Module(rel, lines=text.count("\n") + 1)
    doc = ast.get_docstring(tree, clean=True)
    if doc and tree.body:
        node = tree.body[0]
        mod.doc = _first_sentence(doc)
        mod.doc_lines = (node.lineno, node.end_lineno or node.lineno)
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            mod.public.append((kind, node.name, node.lineno, node.end_lineno or node.lineno))
        elif (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
              and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            mod.main_line = node.lineno
    facts.modules.append(mod)


def scan_repo(root: str, limits: SummariserLimits | None = None) -> RepoFacts:
    """Walk ``root`` (an existing directory) within ``limits`` and gather the
    facts the summary is made of (module docstring). Blocking; never runs or
    imports the repository's code."""
    limits = limits or SummariserLimits()
    facts = RepoFacts()
    files = _walk(root, limits, facts)
    facts.files_seen = len(files)
    top = [(rel, full) for rel, full in files if "/" not in rel]
    readme = next((f for f in top if f[0].lower().startswith("readme")), None)
    if readme is not None:
        text = _read(*readme, limits, facts)
        if text is not None:
            _readme(readme[0], text, facts)
    pyproject = next((f for f in top if f[0] == "pyproject.toml"), None)
    if pyproject is not None:
        text = _read(*pyproject, limits, facts)
        if text is not None:
            _pyproject(text, facts)
    for rel, full in files:
        if rel.endswith(".py") and facts.truncated is None:
            text = _read(rel, full, limits, facts)
            if text is not None:
                _module(rel, text, facts)
    return facts


def _confidence(facts: RepoFacts) -> float:
    c = 0.0
    if facts.readme is not None:
        c += 0.35 if facts.paragraph is not None else 0.2 if facts.title is not None else 0.1
    if "description" in facts.project:
        c += 0.15
    if facts.scripts:
        c += 0.1
    if facts.modules:
        c += 0.4 * sum(1 for m in facts.modules if m.doc) / len(facts.modules)
    return round(min(c, 1.0), 4)


#: ``cite(section, file, start, end, text)``: record a finding citing lines
#: ``start``-``end`` of ``file`` for ``text``; returns ``text`` with the citation.
_Cite = Callable[[str, str, int, int, str], str]


def summarise(facts: RepoFacts) -> AgentReport:
    """The cited summary of ``facts`` (module docstring: sections, citations, confidence)."""
    findings: list[AgentFinding] = []

    def cite(section: str, file: str, start: int, end: int, text: str) -> str:
        findings.append(AgentFinding(file=file, start=max(start, 1), end=max(end, start, 1), severity=Severity.INFO,
                                     claim=text[:500], confidence=1.0, ref=str(len(findings) + 1),
                                     rule=f"summary:{section}"))
        return f"{text} [{file}:{start}-{max(end, start)}]"

    out = _project_section(facts, cite)
    out += _entry_point_sections(facts, cite)
    out += _outline_section(facts, cite)
    out += _modules_section(facts, cite)
    notes = _notes(facts)
    if notes:
        out.append("\n" + "\n".join(notes))
    return AgentReport(findings=findings, summary="\n".join(out), confidence=_confidence(facts))


def _project_section(facts: RepoFacts, cite: _Cite) -> list[str]:
    """``## Project``: name, title, description and the README's first sentence."""
    out = ["## Project"]
    name = facts.project.get("name")
    title = facts.title
    if name:
        out.append("- " + cite("project", "pyproject.toml", name[1], name[1], f"Name: {name[0]}."))
    if title and facts.readme:
        out.append("- " + cite("project", facts.readme, title[1], title[1], f"Title: {title[0]}."))
    if "description" in facts.project:
        d = facts.project["description"]
        out.append("- " + cite("project", "pyproject.toml", d[1], d[1], f"Description: {d[0]}."))
    if facts.paragraph and facts.readme:
        p = facts.paragraph
        out.append("- " + cite("project", facts.readme, p[1], p[2], f"README says: {_first_sentence(p[0])}"))
    if len(out) == 1:
        out.append("- No README, project description or title found: what this repository is for is unclear.")
    return out


def _entry_point_sections(facts: RepoFacts, cite: _Cite) -> list[str]:
    """``## Entry points`` (the project's scripts) and ``## Runnable modules``
    (``__main__`` blocks), each only when there is one."""
    out: list[str] = []
    if facts.scripts:
        out.append("\n## Entry points")
        for script, target, line in facts.scripts:
            out.append("- " + cite("entry_points", "pyproject.toml", line, line, f"`{script}` runs `{target}`."))
    mains = [m for m in facts.modules if m.main_line is not None]
    if mains:
        out.append("\n## Runnable modules")
        for m in mains[:MAX_NAMES * 2]:
            out.append("- " + cite("entry_points", m.path, m.main_line or 1, m.main_line or 1,
                                   f"`{m.path}` has a `__main__` block."))
    return out


def _outline_section(facts: RepoFacts, cite: _Cite) -> list[str]:
    """``## Documentation outline``: the README's top headings, bounded."""
    out: list[str] = []
    if facts.headings and facts.readme:
        out.append("\n## Documentation outline")
        # Its top levels, bounded: a long README must not use up the citations
        # (the next-hop's findings cap) that the module list needs.
        outline = [h for h in facts.headings if h[0] <= 3]
        if len(outline) > MAX_OUTLINE:
            outline = [h for h in outline if h[0] <= 2]
        for level, heading, line in outline[:MAX_OUTLINE]:
            out.append("  " * max(level - 1, 0) + "- " + cite("readme", facts.readme, line, line, heading))
        if len(outline) > MAX_OUTLINE:
            out.append(f"- (+{len(outline) - MAX_OUTLINE} more sections)")
    return out


def _modules_section(facts: RepoFacts, cite: _Cite) -> list[str]:
    """``## Modules``: per package, its documented or public modules (a fair share
    of :data:`MAX_MODULES`), then the docstring coverage line."""
    out: list[str] = []
    if not facts.modules:
        return out
    out.append("\n## Modules")
    packages: dict[str, list[Module]] = {}
    for m in facts.modules:
        packages.setdefault(m.path.rsplit("/", 1)[0] if "/" in m.path else ".", []).append(m)
    shown = {pkg: [m for m in mods if m.doc or m.public] for pkg, mods in packages.items()}
    shown = {pkg: mods for pkg, mods in shown.items() if mods}
    # MAX_MODULES shared fairly between the packages (a big package cannot crowd
    # out the ones after it); within one, its largest modules, in path order.
    share = _fair_shares({pkg: len(mods) for pkg, mods in shown.items()}, MAX_MODULES,
                         weights={pkg: sum(m.lines for m in mods) for pkg, mods in shown.items()})
    for pkg, documented in shown.items():
        out.append(f"- `{pkg}/` ({len(packages[pkg])} module(s))")
        keep = {id(m) for m in sorted(documented, key=lambda m: -m.lines)[:share[pkg]]}
        for m in documented:
            if id(m) not in keep:
                continue
            names = ", ".join(f"{n}" for _, n, _, _ in m.public[:MAX_NAMES])
            more = f" (+{len(m.public) - MAX_NAMES})" if len(m.public) > MAX_NAMES else ""
            if m.doc:
                text = f"`{m.path}`: {m.doc}" + (f" Public: {names}{more}." if names else "")
                out.append("  - " + cite("modules", m.path, m.doc_lines[0], m.doc_lines[1], text))
            else:
                _, _, s, _ = m.public[0]
                out.append("  - " + cite("modules", m.path, s, s, f"`{m.path}` (no docstring): public {names}{more}."))
    documented_share = sum(1 for m in facts.modules if m.doc) / len(facts.modules)
    out.append(f"\n{len(facts.modules)} Python module(s), {documented_share:.0%} with a docstring.")
    return out


def _notes(facts: RepoFacts) -> list[str]:
    """What the walk left out: truncation, unread and unparsable files."""
    notes = []
    if facts.truncated:
        notes.append(f"Walk {facts.truncated}: the summary covers part of the repository.")
    if facts.skipped:
        notes.append(f"Not read: {'; '.join(facts.skipped[:3])}" + (" …" if len(facts.skipped) > 3 else ""))
    if facts.unparsable:
        notes.append(f"Not parsable: {', '.join(facts.unparsable[:5])}" + (" …" if len(facts.unparsable) > 5 else ""))
    return notes


class SummariserAdapter(InThreadToolAdapter):
    """The summariser next-hop (module docstring).

    ``repo``: the default repository directory (must exist); ``roots``: the
    directories a task may name its repository under with ``content.repo``
    (default: ``repo`` alone; relative paths are the router's working
    directory's); ``limits``: :class:`SummariserLimits`. Raises ``ValueError``
    naming the option when ``repo`` is not a directory."""

    tool = "summariser"

    def __init__(self, name: str = "summariser", *, repo: str, roots: Iterable[str] | None = None,
                 strengths: Iterable[str] | None = None, limits: SummariserLimits | None = None) -> None:
        self.repo = os.path.realpath(repo)
        if not os.path.isdir(self.repo):
            raise ValueError(f"options.repo: not a directory: {repo}")
        self.roots = [os.path.realpath(r) for r in (roots if roots is not None else [repo])]
        self.name = name
        self.strengths = list(strengths) if strengths else ["repo_summary", "summarize"]
        self.limits = limits or SummariserLimits()
        self._stats = CallStats()

    def repo_root(self, content: Mapping[str, Any]) -> str:
        """The directory a task asks for (resolved). Raises ``ClientInputError``
        for a ``repo`` that is not an absolute directory inside ``roots``."""
        return confined_dir(content.get("repo"), field="repo", default=self.repo, roots=self.roots, who="summariser")

    def report(self, content: Any) -> AgentReport:
        """The report for one task's ``content``. Blocking."""
        if not isinstance(content, Mapping):
            raise ClientInputError("content must be an object (optionally with 'repo')")
        return summarise(scan_repo(self.repo_root(content), self.limits))

    def work(self, content: Any) -> AgentReport:
        """:meth:`report` (the :class:`InThreadToolAdapter` hook)."""
        return self.report(content)


def _fair_shares(sizes: dict[str, int], total: int, *, weights: dict[str, int]) -> dict[str, int]:
    """Split ``total`` slots between groups of ``sizes`` items: one each first
    (while slots last, in order), the rest in proportion to ``weights`` (lines of
    code: the big packages say most about a repository), never more than a
    group has; what a group cannot take goes to the others."""
    share = dict.fromkeys(sizes, 0)
    left = total
    for k, n in sizes.items():
        if left and n:
            share[k], left = 1, left - 1
    while left > 0:
        open_ = [k for k in sizes if share[k] < sizes[k]]
        if not open_:
            break
        weight = sum(max(weights.get(k, 0), 1) for k in open_)
        given = 0
        for k in sorted(open_, key=lambda k: -weights.get(k, 0)):
            want = max(int(left * max(weights.get(k, 0), 1) / weight), 1 if given < left else 0)
            give = min(want, sizes[k] - share[k], left - given)
            share[k] += give
            given += give
        if given == 0:
            break
        left -= given
    return share
