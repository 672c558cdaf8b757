"""A code-review task's change, parsed once per task (issue 21 item 1).

Every part of the router that needs more of a diff than its ``diff_loc`` count —
the ``scope: changed`` filter of each tool next-hop, the suppression plan of the
analysers, the numbered diff a model next-hop is shown, the lines a model's finding
may cite, the consensus evidence scorer — reads the same :class:`ParsedChange`.
The dispatcher parses the task's diff with :func:`parse_change` once, before the
fan-out (a large diff in a worker thread), and hands it to every leg on its prompt
(:attr:`Prompt.change <atp_router.adapters.base.Prompt.change>`); an adapter called outside
a router parses the prompt's diff itself, once per call.

    >>> c = parse_change("--- a/x.py\\n+++ b/x.py\\n@@ -1,2 +1,2 @@\\n a = 1\\n-b = 2\\n+b = 3\\n")
    >>> dict(c.changed), c.diff_loc, [f.path for f in c.files]
    ({'x.py': frozenset({2})}, 2, ['x.py'])

Pure: no I/O, no clock. Blocking: ~0.5 s for a 5 MB diff (:func:`parse_diff`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from types import MappingProxyType

from msgspec import Struct

from atp_router.task.diff import FileDiff, changed_lines, diff_loc, parse_diff

__all__ = ["ParsedChange", "languages_of", "parse_change"]


class ParsedChange(Struct, frozen=True):
    """One unified diff, parsed (:func:`parse_change`).

    ``files``: one :class:`~atp_router.task.diff.FileDiff` per text file, in diff order;
    ``changed``: each surviving file's after-diff path → the 1-based lines the diff
    touched (added or changed lines, and where a deletion was;
    :func:`~atp_router.task.diff.changed_lines`), read-only; ``diff_loc``: added plus
    removed lines over all files (equal to the ``meta.diff_loc`` the router counts
    at SYN, :func:`~atp_router.task.diff.count_changed_lines`)."""

    files: tuple[FileDiff, ...]
    changed: Mapping[str, frozenset[int]]
    diff_loc: int


def parse_change(diff: str) -> ParsedChange:
    """``diff`` (unified diff text) parsed into a :class:`ParsedChange`. Never
    raises (like :func:`~atp_router.task.diff.parse_diff`: what cannot be placed is
    ignored)."""
    files = tuple(parse_diff(diff))
    changed = MappingProxyType({p: frozenset(ns) for p, ns in changed_lines(files).items()})
    return ParsedChange(files=files, changed=changed, diff_loc=diff_loc(files))


def languages_of(paths: Iterable[str]) -> list[str]:
    """The ``languages`` match key of a code-review task: the file suffixes of
    ``paths`` without their dot, sorted, once each (``["py", "ts"]``); a path
    without a suffix adds nothing.

        >>> languages_of(["a/x.py", "b.ts", "Makefile", "c/y.py"])
        ['py', 'ts']
    """
    return sorted({s.lstrip(".") for s in (PurePosixPath(p).suffix for p in paths) if s})
