"""The after-diff text of the files a diff touches, read from a local checkout.

The router's operator may give it a repository (``atp-router --repo PATH``); a
client that sends only a diff (an A2A text message) then gets the files the
diff's review needs read from there. Everything read is bounded and confined
to the repository's root:

* a path must be relative and normal (:func:`~atp_router.review.paths.safe_relpath`:
  no ``..``, no absolute path, no backslash, NUL or ``./``), and none of its
  components may be ``.git``;
* its real path (symlinks resolved) must stay inside the root's real path — a
  symlink pointing outside the repository is refused, one inside it is followed;
* it must be a regular file of at most ``max_file_bytes`` bytes, all files
  together at most ``max_total_bytes`` and at most ``max_files`` of them; the
  text must be UTF-8;
* its lines must be the diff's after side (every ``+`` and context line of every
  hunk at its line number): a checkout at another revision would put the
  findings on the wrong lines, so it is refused, not reviewed.

Deleted files are not read (they have no after side). :func:`files_after` never
raises for one file: it returns what it read and one problem line per file it
could not, so the caller decides (the A2A server refuses the task when its
agents need the files).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from atp_router.review.paths import safe_relpath
from atp_router.task.diff import FileDiff
from atp_router.wire.errors import ClientInputError

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "RepoFiles", "files_after"]

#: Default bounds (the tool next-hops' own: :class:`~atp_router.adapters.tools.base.ToolLimits`).
MAX_FILE_BYTES = 1024 * 1024
MAX_TOTAL_BYTES = 8 * 1024 * 1024
MAX_FILES = 2_000


@dataclass(slots=True)
class RepoFiles:
    """``files``: path → after-diff text of each file read; ``problems``: one line
    per touched file that could not be read (path first)."""

    files: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def files_after(
    repo: Path,
    diffs: Iterable[FileDiff],
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_total_bytes: int = MAX_TOTAL_BYTES,
    max_files: int = MAX_FILES,
) -> RepoFiles:
    """Read the after-diff text of every non-deleted file of ``diffs`` from the
    working tree at ``repo`` (module docstring for the rules; sizes in bytes).
    Blocking file I/O: call it from a worker thread. Raises ``OSError`` only when
    ``repo`` itself is not a readable directory."""
    root = os.path.realpath(repo)
    if not os.path.isdir(root):
        raise NotADirectoryError(f"--repo {repo} is not a directory")
    out = RepoFiles()
    total = 0
    wanted = [d for d in diffs if d.status != "deleted"]
    if len(wanted) > max_files:
        out.problems.append(f"the diff touches {len(wanted):,} files, over the limit of {max_files:,}")
        return out
    for d in wanted:
        try:
            text = _read_one(root, d.path, max_file_bytes, max_total_bytes - total)
            _check_after_side(d, text)
        except _Refused as e:
            out.problems.append(f"{d.path}: {e}")
            continue
        total += len(text.encode("utf-8"))
        out.files[d.path] = text
    return out


class _Refused(Exception):
    pass


def _read_one(root: str, rel: str, max_file_bytes: int, room: int) -> str:
    try:
        safe_relpath(rel)
    except ClientInputError:
        raise _Refused("refused path: must be relative, normal and inside the repository") from None
    if ".git" in rel.split("/"):
        raise _Refused("refused path: inside .git")
    full = os.path.join(root, rel)
    real = os.path.realpath(full)
    if os.path.commonpath([root, real]) != root:
        raise _Refused("refused path: a symlink leads outside the repository")
    try:
        # O_NOFOLLOW: the resolved path has no symlink left; one swapped in since is refused.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _Refused("not in the repository (is --repo the checkout the diff is from?)") from None
    except OSError as e:
        raise _Refused(f"cannot be read: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("not a regular file")
        limit = min(max_file_bytes, room)
        if st.st_size > limit:
            what = "the per-file limit" if limit == max_file_bytes else "what is left of the total limit"
            raise _Refused(f"{st.st_size:,} bytes, over {what} ({limit:,} bytes)")
        chunks = []
        size = 0
        while chunk := os.read(fd, 64 * 1024):
            size += len(chunk)
            if size > limit:
                raise _Refused(f"grew past the limit of {limit:,} bytes while read")
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise _Refused("not UTF-8 text") from None


def _check_after_side(d: FileDiff, text: str) -> None:
    lines = [ln.removesuffix("\r") for ln in text.split("\n")]
    for h in d.hunks:
        for dl in h.lines:
            if dl.new is None:
                continue
            have = lines[dl.new - 1] if dl.new <= len(lines) else None
            if have != dl.text:
                raise _Refused(
                    f"line {dl.new} in the repository is not the diff's after side "
                    "(is the --repo checkout at the diff's new revision?)"
                )
