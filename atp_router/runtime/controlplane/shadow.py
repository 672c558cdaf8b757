"""The pieces of a shadow run (spec §6.2 exploration without the client
seeing it; :meth:`~atp_router.runtime.controlplane.learning.Learning.shadow`):
the stream sink its call writes to, and how well its findings agree with the
stream's own (the learning signal)."""

from __future__ import annotations

from typing import Any

from atp_router.wire.errors import ErrorCode

__all__ = ["ShadowIO", "agreement_quality"]


class ShadowIO:
    """The StreamIO of a shadow call: nothing reaches the client's stream."""

    def __init__(self, stream_id: str):
        self.stream_id = stream_id
        self.errors: list[str] = []

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None:
        pass

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None:
        self.errors.append(f"{code}: {reason}")

    def emit_window_update(self, update: Any) -> None:
        pass


def _spans_overlap(a: str, b: str) -> bool:
    def rng(s: str) -> tuple[int, int]:
        lo, _, hi = s.partition("-")
        try:
            return int(lo), int(hi or lo)
        except ValueError:
            return 0, 0
    (a0, a1), (b0, b1) = rng(a), rng(b)
    return a0 <= b1 and b0 <= a1


def agreement_quality(found: list[Any], reference: list[Any]) -> float:
    """F1 of ``found`` findings against ``reference`` (same file, overlapping
    span); 1.0 when both are empty."""
    if not found and not reference:
        return 1.0
    if not found or not reference:
        return 0.0
    hit_ref = sum(any(f.file == r.file and _spans_overlap(f.span, r.span) for f in found) for r in reference)
    hit_found = sum(any(f.file == r.file and _spans_overlap(f.span, r.span) for r in reference) for f in found)
    p, r = hit_found / len(found), hit_ref / len(reference)
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)
