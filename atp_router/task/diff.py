"""Unified-diff parsing for review tasks (pure: no I/O, no clock).

A code-review task carries ``content["diff"]`` (``git diff`` output) and
``content["files"]`` (path -> full text *after* the diff). Scoring, the policy's
``diff_loc`` match and the ``scope: changed`` filter of the tool agents all need
the same thing from the diff: which lines of which after-diff file it touched.
A task's diff is parsed once, into :class:`~atp_router.task.change.ParsedChange`, and
shared by all of them.

    >>> [d] = parse_diff("--- a/x.py\\n+++ b/x.py\\n@@ -1,2 +1,2 @@\\n a = 1\\n-b = 2\\n+b = 3\\n")
    >>> d.path, d.status, sorted(d.added), diff_loc([d])
    ('x.py', 'modified', [2], 2)

Accepted input: git diffs (extended headers, renames, copies, mode changes, C-quoted
paths, ``diff.mnemonicPrefix`` prefixes such as ``c/`` ``w/`` ``i/``, ``--no-prefix``)
and plain ``diff -u`` output (``/dev/null`` sides, tab-separated timestamps); LF or
CRLF line ends; ``\\ No newline at end of file`` markers. Binary files are skipped.
Combined (merge) diffs are not unified diffs and are ignored. The parser never
raises: a line it cannot place ends the current hunk and is otherwise ignored, so a
truncated diff yields what it did contain.

Line numbers are 1-based. ``DiffLine.text`` excludes the line terminator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from msgspec import Struct

__all__ = ["DiffLine", "FileDiff", "Hunk", "changed_lines", "count_changed_lines", "diff_loc", "parse_diff"]

Status = Literal["added", "modified", "deleted", "renamed"]

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")
# git's diff.mnemonicPrefix pairs (git-config(1)) plus the default a/ b/.
_PREFIX_PAIRS = {("a", "b"), ("i", "w"), ("c", "w"), ("c", "i"), ("o", "w"), ("1", "2")}
_OLD_SIDE = {old for old, _ in _PREFIX_PAIRS}
_NEW_SIDE = {new for _, new in _PREFIX_PAIRS}
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


class DiffLine(Struct, frozen=True):
    """One hunk body line: ``kind`` is ``" "`` (context), ``"+"`` or ``"-"``;
    ``old``/``new`` are its line numbers before/after (``None`` on the side it
    does not exist)."""

    kind: Literal[" ", "+", "-"]
    old: int | None
    new: int | None
    text: str


class Hunk(Struct, frozen=True):
    """One ``@@ -old_start,old_count +new_start,new_count @@ section`` block."""

    old_start: int
    old_count: int
    new_start: int
    new_count: int
    section: str
    lines: tuple[DiffLine, ...]

    @property
    def new_range(self) -> range:
        """The after-diff lines this hunk spans (context included)."""
        return range(self.new_start, self.new_start + self.new_count)


class FileDiff(Struct, frozen=True):
    """The diff of one (text) file.

    ``path`` is the path after the diff, or the old path for a deleted file;
    ``old_path`` is ``None`` for an added file. ``added`` holds the after-diff line
    numbers of added or changed lines; ``deleted_at`` the after-diff line nearest to
    each deletion that added nothing in its place (the line now in its position, or
    the previous one when the hunk has no context after it, as at end of file), so
    an omission can be cited.
    """

    path: str
    old_path: str | None
    status: Status
    hunks: tuple[Hunk, ...]
    added: frozenset[int]
    deleted_at: frozenset[int]
    removed: int

    @property
    def changed(self) -> frozenset[int]:
        """``added | deleted_at``: every after-diff line the diff touched."""
        return self.added | self.deleted_at


def changed_lines(diffs: Iterable[FileDiff]) -> dict[str, set[int]]:
    """Map each surviving file's after-diff path to the lines the diff touched
    (:attr:`FileDiff.changed`). Deleted files are left out: they have no lines."""
    out: dict[str, set[int]] = {}
    for d in diffs:
        if d.status != "deleted":
            out.setdefault(d.path, set()).update(d.changed)
    return out


def diff_loc(diffs: Iterable[FileDiff]) -> int:
    """Added plus removed lines over all files: the policy's ``diff_loc`` meta."""
    return sum(len(d.added) + d.removed for d in diffs)


_HEADER_PAIR = re.compile(r"\n--- [^\n]*\n\+\+\+ ")


def count_changed_lines(text: str) -> int:
    """``diff_loc`` of a unified diff without parsing it: the lines starting with
    ``+`` or ``-`` less the ``---``/``+++`` file-header pairs, counted at C speed
    (``str.count`` and one regex scan: ≈ 20 ms for 5 MB, against ≈ 500 ms for
    :func:`parse_diff`), so the router routes on it at SYN without stalling its
    event loop. Equal to ``diff_loc(parse_diff(text))`` for git diffs of text
    files; a binary-file section adds nothing to either."""
    t = "\n" + text
    return t.count("\n+") + t.count("\n-") - 2 * len(_HEADER_PAIR.findall(t))


def parse_diff(text: str) -> list[FileDiff]:
    """Parse unified diff text into one :class:`FileDiff` per text file, in order.

    Binary files, and sections without any file header, are skipped. Never raises.
    """
    lines = [ln.removesuffix("\r") for ln in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    out: list[FileDiff] = []
    cur: _Builder | None = None
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            _flush(cur, out)
            cur = _Builder()
            cur.git_old, cur.git_new = _split_git_header(line[len("diff --git ") :])
            i += 1
        elif line.startswith("--- ") and i + 1 < n and lines[i + 1].startswith("+++ "):
            if cur is None or cur.saw_markers or cur.hunks:
                _flush(cur, out)
                cur = _Builder()
            cur.saw_markers = True
            cur.old_marker = _marker_path(line[4:])
            cur.new_marker = _marker_path(lines[i + 1][4:])
            i += 2
        elif line.startswith("@@ ") and cur is not None:
            m = _HUNK_RE.match(line)
            if m is None:
                i += 1
                continue
            i = _read_hunk(lines, i + 1, m, cur)
        elif cur is not None and not cur.hunks:
            _header_line(line, cur)
            i += 1
        else:
            # Between files or after a hunk: "\ No newline", "Only in", mail
            # trailers, "diff -u ..." lines of plain diffs. Nothing to place.
            i += 1
    _flush(cur, out)
    return out


class _Builder:
    """Mutable state of the file section being parsed."""

    __slots__ = (
        "binary", "copy", "deleted_file", "git_new", "git_old", "hunks", "new_file", "new_marker", "old_marker",
        "rename_from", "rename_to", "saw_markers",
    )  # fmt: skip

    def __init__(self) -> None:
        self.git_old: str | None = None
        self.git_new: str | None = None
        self.old_marker: str | None = None  # "/dev/null" kept literally until _flush
        self.new_marker: str | None = None
        self.saw_markers = False
        self.rename_from: str | None = None
        self.rename_to: str | None = None
        self.copy = False
        self.new_file = False
        self.deleted_file = False
        self.binary = False
        self.hunks: list[Hunk] = []


def _header_line(line: str, b: _Builder) -> None:
    if line.startswith("new file mode"):
        b.new_file = True
    elif line.startswith("deleted file mode"):
        b.deleted_file = True
    elif line.startswith(("rename from ", "copy from ")):
        b.rename_from = _unquote(line.split(" ", 2)[2])
        b.copy = line.startswith("copy")
    elif line.startswith(("rename to ", "copy to ")):
        b.rename_to = _unquote(line.split(" ", 2)[2])
    elif line.startswith("Binary files ") or line == "GIT binary patch":
        b.binary = True


def _read_hunk(lines: list[str], i: int, m: re.Match[str], b: _Builder) -> int:
    old_start, new_start = int(m[1]), int(m[3])
    old_count = 1 if m[2] is None else int(m[2])
    new_count = 1 if m[4] is None else int(m[4])
    old_rem, new_rem = old_count, new_count
    old_no, new_no = old_start, new_start
    body: list[DiffLine] = []
    n = len(lines)
    while i < n and (old_rem > 0 or new_rem > 0):
        line = lines[i]
        tag = line[:1]
        if tag == "\\":
            i += 1
            continue
        if tag == "+" and new_rem > 0:
            body.append(DiffLine("+", None, new_no, line[1:]))
            new_no += 1
            new_rem -= 1
        elif tag == "-" and old_rem > 0:
            body.append(DiffLine("-", old_no, None, line[1:]))
            old_no += 1
            old_rem -= 1
        elif (tag == " " or line == "") and old_rem > 0 and new_rem > 0:
            # An empty line is a context line whose leading space a mailer or
            # editor stripped.
            body.append(DiffLine(" ", old_no, new_no, line[1:]))
            old_no += 1
            new_no += 1
            old_rem -= 1
            new_rem -= 1
        else:
            break  # malformed or truncated hunk: keep what was read
        i += 1
    b.hunks.append(Hunk(old_start, old_count, new_start, new_count, m[5], tuple(body)))
    return i


def _flush(b: _Builder | None, out: list[FileDiff]) -> None:
    if b is None or b.binary:
        return
    old_pfx, new_pfx = _prefixes(b)
    old = _strip(b.old_marker, old_pfx) if b.saw_markers else _strip(b.git_old, old_pfx)
    new = _strip(b.new_marker, new_pfx) if b.saw_markers else _strip(b.git_new, new_pfx)
    if b.rename_from is not None:
        old = b.rename_from
    if b.rename_to is not None:
        new = b.rename_to
    if b.new_file:
        old = None
    if b.deleted_file:
        new = None
    if old is None and new is None:
        return
    if old is None:
        status: Status = "added"
    elif new is None:
        status = "deleted"
    elif b.copy:
        # A copy creates ``new``; the source is untouched. Its review surface is
        # that of an added file, and old_path keeps the provenance.
        status = "added"
    elif old != new:
        status = "renamed"
    else:
        status = "modified"
    added: set[int] = set()
    deleted_at: set[int] = set()
    removed = 0
    for h in b.hunks:
        removed += _scan_hunk(h, added, deleted_at)
    if status == "deleted":
        deleted_at.clear()
    out.append(
        FileDiff(
            path=new if new is not None else old,  # type: ignore[arg-type]
            old_path=old,
            status=status,
            hunks=tuple(b.hunks),
            added=frozenset(added),
            deleted_at=frozenset(deleted_at),
            removed=removed,
        )
    )


def _scan_hunk(h: Hunk, added: set[int], deleted_at: set[int]) -> int:
    """Collect added lines and anchors of deletion-only runs; return lines removed."""
    removed = 0
    run_minus = run_plus = 0
    # Last after-diff line before the current run; a hunk adding no lines names
    # the line *after which* its deletion sits (new_start), others their first line.
    prev_new = h.new_start if h.new_count == 0 else h.new_start - 1
    for dl in h.lines:
        if dl.kind == "+":
            added.add(dl.new)  # type: ignore[arg-type]
            run_plus += 1
            prev_new = dl.new  # type: ignore[assignment]
        elif dl.kind == "-":
            removed += 1
            run_minus += 1
        else:
            if run_minus and not run_plus:
                deleted_at.add(dl.new)  # type: ignore[arg-type]
            run_minus = run_plus = 0
            prev_new = dl.new  # type: ignore[assignment]
    if run_minus and not run_plus:
        # Deletion with no context after it (end of file, or a -U0 hunk): the
        # nearest known surviving line is the one before; line 1 if none precedes.
        deleted_at.add(max(prev_new, 1))
    return removed


def _prefixes(b: _Builder) -> tuple[str, str]:
    """The (old, new) path prefixes in use, e.g. ("a/", "b/"), or ("", "") for
    ``--no-prefix``. Decided from the ``diff --git`` line when there is one (it
    always names both sides), else from the ---/+++ markers."""
    if b.git_old is not None and b.git_new is not None:
        old, new = b.git_old[:2], b.git_new[:2]
    else:
        old, new = (b.old_marker or "")[:2], (b.new_marker or "")[:2]
        # Plain diff of an added/deleted file: only one side carries a prefix.
        if b.old_marker == "/dev/null":
            return ("", new) if new[1:] == "/" and new[:1] in _NEW_SIDE else ("", "")
        if b.new_marker == "/dev/null":
            return (old, "") if old[1:] == "/" and old[:1] in _OLD_SIDE else ("", "")
    if old[1:] == "/" and new[1:] == "/" and (old[:1], new[:1]) in _PREFIX_PAIRS:
        return old, new
    return "", ""


def _strip(path: str | None, prefix: str) -> str | None:
    if path is None or path == "/dev/null":
        return None
    if prefix and path.startswith(prefix):
        return path[len(prefix) :]
    return path


def _marker_path(rest: str) -> str:
    """The path of a ``---``/``+++`` line: C-quoted, or up to a tab (timestamps)."""
    if rest.startswith('"'):
        path, _ = _take_quoted(rest)
        return path
    return rest.split("\t", 1)[0].rstrip(" ") if "\t" in rest else rest


def _split_git_header(rest: str) -> tuple[str | None, str | None]:
    """Split ``a/x b/x`` of a ``diff --git`` line. Paths may contain spaces; when
    both sides name the same path (every change but a rename or copy) the split is
    the one that makes the two sides equal after their prefixes."""
    if rest.startswith('"'):
        old, tail = _take_quoted(rest)
        tail = tail.lstrip(" ")
        new = _take_quoted(tail)[0] if tail.startswith('"') else tail
        return old, new
    if rest.endswith('"') and ' "' in rest:
        cut = rest.index(' "')
        return rest[:cut], _take_quoted(rest[cut + 1 :])[0]
    if len(rest) % 2 == 1 and rest[len(rest) // 2] == " ":
        old, new = rest[: len(rest) // 2], rest[len(rest) // 2 + 1 :]
        if old == new or (old[1:2] == "/" and new[1:2] == "/" and old[2:] == new[2:]):
            return old, new
    # A rename with spaces in a path is ambiguous here; the rename/---/+++ lines
    # that follow decide, so this guess only matters for prefix detection.
    for sep in (" b/", " w/", " i/", " 2/"):
        if sep in rest:
            cut = rest.index(sep)
            return rest[:cut], rest[cut + 1 :]
    old, _, new = rest.partition(" ")
    return old, new or None


def _take_quoted(s: str) -> tuple[str, str]:
    """Decode a git C-quoted string at the start of ``s``; return (value, rest)."""
    buf = bytearray()
    i = 1
    while i < len(s):
        c = s[i]
        if c == '"':
            return buf.decode("utf-8", "replace"), s[i + 1 :]
        if c == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt in "01234567" and i + 3 < len(s) and all(ch in "01234567" for ch in s[i + 1 : i + 4]):
                buf.append(int(s[i + 1 : i + 4], 8) & 0xFF)
                i += 4
                continue
            buf.append(_ESCAPES.get(nxt, ord(nxt) if nxt.isascii() else 63))
            i += 2
            continue
        buf += c.encode("utf-8")
        i += 1
    return buf.decode("utf-8", "replace"), ""


def _unquote(s: str) -> str:
    return _take_quoted(s)[0] if s.startswith('"') else s
