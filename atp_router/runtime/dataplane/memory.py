"""Giving memory back when the router goes idle (issue 10).

After a load run the Python heap shrinks back (closed streams leave memory,
:mod:`atp_router.runtime.dataplane.streams`), but the process's RSS does not: CPython's small
object allocator frees an arena only when all of it is free, and glibc's
``malloc`` keeps freed chunks in its arenas instead of returning them to the
kernel. :func:`trim` runs a full garbage collection and then glibc's
``malloc_trim(0)``, which returns the free pages at the top of the heap *and*
the wholly free pages inside it (``madvise(MADV_DONTNEED)``). Elsewhere than
glibc it only collects.

It costs milliseconds (a full collection of the unfrozen heap, a walk of
malloc's free lists), so the router calls it only when no stream is open,
at most every :data:`TRIM_EVERY_S`; ``bench/bench_memory.py`` measures what it
gives back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TRIM_EVERY_S", "IdleTrim", "trim"]

#: At most one trim this often, s (the router trims when it went idle).
TRIM_EVERY_S = 10.0


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim  # glibc only (musl has no malloc_trim)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def trim() -> float:
    """Full garbage collection, then ``malloc_trim(0)`` where glibc has it.
    Returns the time it took, ms."""
    t0 = time.perf_counter()
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return (time.perf_counter() - t0) * 1000


@dataclass(slots=True)
class IdleTrim:
    """The stream table's idle trim (:mod:`atp_router.runtime.dataplane.streams`):
    ``trim()`` (:func:`trim`) is called when the router went idle (no open
    stream, streams left memory since the last call), at most every
    :data:`TRIM_EVERY_S`."""

    trim: Callable[[], float] | None
    #: A trim timer is scheduled.
    due: bool = False
    #: Not before then (memory freed since settles first), trio time, s.
    at: float = -math.inf
    #: When the last trim ran, trio time, s.
    trimmed_at: float = -math.inf
