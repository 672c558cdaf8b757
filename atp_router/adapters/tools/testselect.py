"""Tests as a reviewer (issue 23 item 4): which of a project's tests touch a
change, and which changed line a failing test exercises. Used by the pytest
next-hop (:mod:`atp_router.adapters.tools.testrunner`); pure functions over
text the caller has already bounded, no I/O.

**Selection** (:func:`select_tests`): a test file (``test_*.py`` / ``*_test.py``)
touches the change when

* it is itself a changed file;
* its name is ``test_<module>.py`` or ``<module>_test.py`` for a changed
  ``<module>.py``; or
* it imports a changed module, directly or through other modules of the tree
  (the import graph of every Python file given, read statically with
  :mod:`ast`: ``import a.b``, ``from a.b import c`` — ``c`` may be a
  submodule — and package-relative imports resolved against the importing
  file's package; an import anywhere in the file counts, a dynamic import
  (``importlib``, ``__import__``) does not).

A file's module names are every dotted suffix of its path (``src/pkg/mod.py`` is
``src.pkg.mod``, ``pkg.mod`` and ``mod``; ``pkg/__init__.py`` is ``pkg``): the
directory pytest puts on ``sys.path`` is not known statically, so any level may
be the root. This can select a test that does not touch the change (an import
of a same-named module elsewhere), never drop one the static graph shows. A
changed ``conftest.py`` touches every test beside or below it: the selection
gives up (``None``: run pytest's own discovery), as it does when a file cannot
be read within the caller's bounds.

**Attribution** (:func:`changed_frame`): pytest's failure text (the JUnit
``failure``/``error`` element, ``--tb=auto``) names each traceback entry as a
``path:line: …`` line, outermost first (:func:`frames`); and the run's plugin
(:func:`trace_plugin`, loaded with ``-p``) records, while each test's call
phase runs, the changed lines it executes, and for a failing test writes the
last ones executed (in order, at most :data:`MAX_TRACED`) as the JUnit
property ``atp_changed_lines`` (:func:`traced_lines`). The failure is placed at

1. the deepest traceback entry on a line the diff changed
   (:attr:`~atp_router.task.change.ParsedChange.changed`): the changed line raised;
2. else the changed line the test executed last: an ``assert`` on a wrong
   value fails in the test, after the changed code that computed it returned,
   so its traceback never reaches that code;
3. else the deepest traceback entry inside a changed hunk's after-diff lines
   (context included);
4. else nowhere (the caller keeps the finding at the test).

Paths are compared as text, after making a path inside the run's tree relative
to it; nothing named by the failure text or the property is ever opened. Both
are the test process's own account (the tests can forge them, as they can the
JUnit report): they place a finding, never widen what the sandbox allows. The
trace is ``sys.settrace`` (and ``threading.settrace``) during each test's call
phase, local tracing only in frames of changed files: a call-heavy test runs
slower by the cost of one trace call per Python call.
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from atp_router.task.change import ParsedChange

__all__ = ["TEST_FILE", "TRACE_PLUGIN", "TRACE_PROPERTY", "Selection", "changed_frame", "frames", "module_names",
           "select_tests", "trace_plugin", "traced_lines"]

#: A test file's name, as pytest's default ``python_files``.
TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
_TB_LINE = re.compile(r"^(?P<file>[^\s:][^:\n]*\.py):(?P<line>\d+): ", re.MULTILINE)
#: Traceback entries read per failure (the last ones: the deepest).
MAX_FRAMES = 1_000
#: Changed lines a failing test's trace reports (the last executed).
MAX_TRACED = 50
#: The run's plugin module (``-p``), written at the root of the run's tree; a
#: task file of that name is refused.
TRACE_PLUGIN = "_atp_changed_lines"
#: The JUnit property the plugin writes a failing test's executed changed lines to.
TRACE_PROPERTY = "atp_changed_lines"
_PLUGIN = """\
# The pytest next-hop's trace of changed lines (atp_router.adapters.tools.testselect).
import json
import os
import sys
import threading

import pytest

CHANGED = {name: frozenset(lines) for name, lines in json.loads(%(changed)s).items()}
_ROOT = os.getcwd()
_files = {}


def _rel(filename):
    rel = _files.get(filename)
    if rel is None:
        path = filename if os.path.isabs(filename) else os.path.join(_ROOT, filename)
        path = os.path.normpath(os.path.relpath(path, _ROOT)).replace(os.sep, "/")
        rel = _files[filename] = path if path in CHANGED else ""
    return rel


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    hits = {}

    def tracer(frame, event, arg):
        rel = _rel(frame.f_code.co_filename)
        if not rel:
            return None
        lines = CHANGED[rel]

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno in lines:
                key = (rel, frame.f_lineno)
                hits.pop(key, None)
                hits[key] = None
            return local

        return local

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        outcome = yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
    if outcome.excinfo is not None and hits:
        last = list(hits)[-%(max)d:]
        item.user_properties.append((%(prop)r, " ".join("%%s:%%d" %% h for h in last)))
"""


@dataclass(frozen=True, slots=True)
class Selection:
    """The test files touching a change (sorted), and why each was chosen
    (``path → "changed" | "named" | "imports <module path>"``)."""

    tests: tuple[str, ...]
    why: Mapping[str, str]


def module_names(path: str) -> list[str]:
    """The dotted module names a ``.py`` path may be imported as: every suffix of
    its dotted path made of identifiers (``a/b/c.py`` → ``a.b.c``, ``b.c``,
    ``c``; ``a/__init__.py`` → ``a``; ``my-dir/c.py`` → ``c``), longest first;
    ``[]`` for a path that is no module name."""
    if not path.endswith(".py"):
        return []
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    names = []
    for i in range(len(parts) - 1, -1, -1):  # the trailing run of identifiers only
        if not parts[i].isidentifier():
            break
        names.append(".".join(parts[i:]))
    return names[::-1]


def imported_modules(source: ast.Module, path: str) -> set[str]:
    """Every module name an import of ``source`` (the file at ``path``) may load:
    the imported name and its parent packages, and ``from m import x``'s
    ``m.x`` (``x`` may be a submodule); relative imports resolved against
    ``path``'s package."""
    out: set[str] = set()
    for node in ast.walk(source):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module.split(".") if node.module else []
            if node.level:
                pkg = path.split("/")[:-1]
                if node.level - 1 > len(pkg):
                    continue
                base = pkg[: len(pkg) - (node.level - 1)] + base
            if not base:
                names = [a.name for a in node.names if a.name != "*"]
            else:
                names = [".".join(base)] + [".".join([*base, a.name]) for a in node.names if a.name != "*"]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def _parse(text: bytes, path: str) -> ast.Module | None:
    try:
        return ast.parse(text, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # pytest reports it; it imports nothing we can see


def select_tests(sources: Mapping[str, bytes], changed: Iterable[str]) -> Selection | None:
    """The test files of ``sources`` (every Python file of the tree: relative
    POSIX path → its bytes, bounded by the caller) that touch the ``changed``
    paths (module docstring); ``None`` when a changed ``conftest.py`` makes
    every test a candidate. An empty selection is the caller's to fall back from."""
    changed_py = {p for p in changed if p.endswith(".py")}
    if any(posixpath.basename(p) == "conftest.py" for p in changed_py):
        return None
    by_name: dict[str, set[str]] = {}
    for p in sources:
        for n in module_names(p):
            by_name.setdefault(n, set()).add(p)
    importers: dict[str, set[str]] = {}  # file → the files that import it
    for p, text in sources.items():
        tree = _parse(text, p)
        if tree is None:
            continue
        for name in imported_modules(tree, p):
            for target in by_name.get(name, ()):
                if target != p:
                    importers.setdefault(target, set()).add(p)
    why = _touching(changed_py, importers)
    stems = {posixpath.basename(p)[:-3] for p in changed_py} - {"__init__"}
    chosen: dict[str, str] = {}
    for p in sources:
        if not TEST_FILE.search(p):
            continue
        base = posixpath.basename(p)[:-3]
        if p in changed_py:
            chosen[p] = "changed"
        elif base.removeprefix("test_") in stems or base.removesuffix("_test") in stems:
            chosen[p] = "named"
        elif p in why:
            chosen[p] = why[p]
    return Selection(tests=tuple(sorted(chosen)), why=chosen)


def _touching(changed: set[str], importers: Mapping[str, set[str]]) -> dict[str, str]:
    """Every file importing a changed file, directly or transitively → ``imports
    <the changed file>`` (breadth first: the nearest changed file)."""
    why: dict[str, str] = {}
    frontier = [(c, c) for c in sorted(changed)]
    seen = set(changed)
    while frontier:
        nxt: list[tuple[str, str]] = []
        for file, root in frontier:
            for imp in sorted(importers.get(file, ())):
                if imp not in seen:
                    seen.add(imp)
                    why[imp] = f"imports {root}"
                    nxt.append((imp, root))
        frontier = nxt
    return why


def frames(text: str, tree: str) -> list[tuple[str, int]]:
    """The ``(path, line)`` traceback entries of pytest's failure ``text``,
    outermost first (at most the last :data:`MAX_FRAMES`); a path inside
    ``tree`` (absolute) is made relative to it, every path normalised as text."""
    prefix = tree.rstrip("/") + "/"
    out: list[tuple[str, int]] = []
    for m in _TB_LINE.finditer(text):
        file = m["file"]
        if file.startswith(prefix):
            file = file[len(prefix):]
        elif file.startswith("/"):
            continue  # outside the tree: an installed package
        file = posixpath.normpath(file)
        if file.startswith("../") or file == "..":
            continue
        out.append((file, int(m["line"])))
    return out[-MAX_FRAMES:]


def trace_plugin(change: ParsedChange) -> str | None:
    """The source of the run's plugin module (:data:`TRACE_PLUGIN`) tracing
    ``change``'s changed ``.py`` lines (module docstring); ``None`` when no
    Python file changed."""
    changed = {p: sorted(ns) for p, ns in change.changed.items() if p.endswith(".py") and ns}
    if not changed:
        return None
    return _PLUGIN % {"changed": repr(json.dumps(changed)), "max": MAX_TRACED, "prop": TRACE_PROPERTY}


def traced_lines(value: str, change: ParsedChange) -> list[tuple[str, int]]:
    """The ``path:line`` items of the plugin's property ``value`` that are changed
    lines of ``change``, in execution order (at most :data:`MAX_TRACED`)."""
    out: list[tuple[str, int]] = []
    for item in value.split()[-MAX_TRACED:]:
        path, _, line = item.rpartition(":")
        if line.isdigit() and int(line) in change.changed.get(path, ()):
            out.append((path, int(line)))
    return out


def changed_frame(entries: list[tuple[str, int]], change: ParsedChange,
                  traced: list[tuple[str, int]] | None = None) -> tuple[str, int] | None:
    """Where a failure is placed (module docstring): the deepest of ``entries``
    (:func:`frames`) on a changed line, else the last of ``traced``
    (:func:`traced_lines`), else the deepest entry inside a changed hunk, else
    ``None``."""
    for file, line in reversed(entries):
        if line in change.changed.get(file, ()):
            return file, line
    if traced:
        return traced[-1]
    hunks = {d.path: d.hunks for d in change.files if d.status != "deleted"}
    for file, line in reversed(entries):
        if any(line in h.new_range for h in hunks.get(file, ())):
            return file, line
    return None
