"""The provider adapter interface (spec §14).

An adapter is one next-hop: a local tool, a model endpoint, a remote agent. The
router calls ``estimate`` before every send (spec §5.2 preflight) and admits the
call against the stream's window; it then iterates ``stream`` under an overall
deadline (``trio.fail_after``) and turns each :class:`Fragment` into a PARTIAL
frame (``MORE`` set) or, for the last one, the agent's FINAL.

Contract for ``stream``:

* yield zero or more ``Fragment(type=PARTIAL, ...)`` (text deltas, progress);
* yield exactly one ``Fragment(type=FINAL, content=AgentReport | Any, usage=...)``
  last; ``usage`` on any fragment is the *cumulative* usage so far, so a stream cut
  short still tells the budget governor what was spent;
* raise :class:`~atp.wire.errors.AgentError` with ``ETIMEOUT`` / ``EAGENTDOWN`` /
  ``EPROTO`` on failure (never a bare ``httpx`` or ``OSError``).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import Struct

from atp.consensus.types import Usage
from atp.wire.frame import Capabilities, CostEstimate, PayloadType


class Prompt(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a next-hop is asked to do.

    ``content`` for ``code_review``: ``{"diff": str, "files": {path: full text after
    the diff}}``. ``meta`` is the stream's frame meta (task_type, languages, risk,
    data_scope, trace, ...), passed through unchanged.
    """

    task_type: str
    content: dict[str, Any]
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    instruction: str = ""


class Fragment(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One piece of an adapter's output (spec §14): ``type`` is PARTIAL, FINAL or
    LOG; ``usage`` is cumulative (tokens, USD micros)."""

    type: PayloadType
    content: Any = None
    confidence: float | None = None
    usage: Usage | None = None


class Health(Struct, forbid_unknown_fields=True):
    """Live health of a next-hop: p95 latency (ms) and error rate (0..1) over the
    recent calls, and whether it is reachable right now."""

    p95_ms: float = 0.0
    error_rate: float = 0.0
    up: bool = True


class ProviderAdapter(abc.ABC):
    """Base class of every next-hop adapter (spec §14)."""

    name: str
    #: True when ``health().up`` follows the peer's own announcements and recovers by
    #: itself (a 2389 agent's retained status and LWT): the FIB then excludes the
    #: next-hop while it is down. Otherwise only the router's circuit breaker does,
    #: since nothing would call a self-declared-down adapter again to find it back.
    live_health: bool = False

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Skills, context size (tokens), tools."""

    @abc.abstractmethod
    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight: expected input/output tokens and USD for ``prompt`` (§5.2)."""

    @abc.abstractmethod
    def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        """Run the call, yielding fragments as described in the module docstring."""

    def health(self) -> Health:
        return Health()

    async def aclose(self) -> None:
        """Release connections; the router calls this when the RIB drops the agent."""
