"""The file paths a review task names (``content.files`` keys, the paths a diff
touches, a test id's file): the one check that keeps each inside the directory it
is joined to, shared by the tool next-hops (:mod:`atp_router.adapters.tools.base`) and the
checkout reader (:mod:`atp_router.review.repo`).

Pure code (no I/O): :func:`safe_relpath` raises
:class:`~atp_router.wire.errors.ClientInputError` (``EPROTO``, the client's fault) for a
path that is not a normalised relative POSIX path, or is deeper than
:data:`MAX_PATH_DEPTH` components or longer than :data:`MAX_PATH_CHARS`.
"""

from __future__ import annotations

import posixpath
import re

from atp_router.wire.errors import ClientInputError

__all__ = ["MAX_PATH_CHARS", "MAX_PATH_DEPTH", "safe_relpath"]

#: A file path of a task has at most this many components …
MAX_PATH_DEPTH = 64
#: … and at most this many characters (each component at most 255 UTF-8 bytes).
MAX_PATH_CHARS = 1024
_NAME_MAX = 255
_DRIVE_RE = re.compile(r"^[A-Za-z]:")


def safe_relpath(path: object) -> str:
    """Return ``path`` if it is a normalised relative POSIX path that stays inside
    the directory it is joined to; raise ``ClientInputError(EPROTO)`` otherwise.

    Refused: non-strings, empty, absolute (``/x``, ``C:x``), any ``..`` component,
    backslashes (a Windows separator here would mean something else), NUL,
    non-normal forms (``./x``, ``a//b``) that would make the tool's paths differ
    from the diff's, and paths deeper than :data:`MAX_PATH_DEPTH` components,
    longer than :data:`MAX_PATH_CHARS` characters or with a component over 255
    UTF-8 bytes (checked first, before any other work on the path).
    """
    if not isinstance(path, str) or not path:
        raise ClientInputError(f"file path must be a non-empty string, got {path!r:.80}")
    if len(path) > MAX_PATH_CHARS:
        raise ClientInputError(f"refused file path {path[:80]!r}…: longer than {MAX_PATH_CHARS:,} characters")
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        raise ClientInputError(f"refused file path {path[:80]!r}…: deeper than {MAX_PATH_DEPTH} components")
    if any(len(p.encode("utf-8", "surrogatepass")) > _NAME_MAX for p in parts):
        raise ClientInputError(f"refused file path {path[:80]!r}…: a component is over {_NAME_MAX} bytes")
    if (
        path.startswith("/")
        or _DRIVE_RE.match(path)
        or "\\" in path
        or "\x00" in path
        or ".." in path.split("/")
        or posixpath.normpath(path) != path
    ):
        raise ClientInputError(f"refused file path {path!r:.200}: must be relative and inside the task")
    return path
