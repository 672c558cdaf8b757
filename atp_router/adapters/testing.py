"""Testing helpers for users of the router (in the spirit of ``trio.testing``).

:class:`ScriptedAdapter` is a next-hop that plays a script instead of calling a
model: the fragments to yield, a delay before each, an error to end with, the
preflight estimate to report. With it a test drives a router or a policy through
success, partial output, timeouts (a delay longer than the agent's ``timeout_ms``
— instant under ``trio.testing.MockClock(autojump_threshold=0)``), ``EAGENTDOWN``
with a backoff hint, window refusals (a large estimate) or a FINAL that is not a
review report, and then inspects the prompts the adapter received::

    from atp_router.adapters.testing import ScriptedAdapter
    from atp_router.wire.errors import ErrorCode

    cheap = ScriptedAdapter.returning("lint", [finding], usage=Usage(0, 0, 0))
    flaky = ScriptedAdapter("reviewer", fail_with=ErrorCode.EAGENTDOWN, retry_after_ms=500)
    slow = ScriptedAdapter("big", delay_s=30)
    ...
    assert cheap.calls[0].content["diff"] == diff

The script is not checked for protocol sense: a script without a FINAL, or with
fragments after it, tests how the caller copes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Sequence

import trio

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.consensus.types import AgentFinding, AgentReport, Usage
from atp_router.policy.health import Health
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = ["ScriptedAdapter"]

_ZERO = CostEstimate()


class ScriptedAdapter(ProviderAdapter):
    """A next-hop that yields ``fragments`` in order, each after ``delay_s``
    seconds (``math.inf`` hangs until cancelled), then raises
    ``AgentError(fail_with, fail_reason, retry_after_ms=…)`` if ``fail_with`` is set.

    ``fragments`` defaults to one FINAL with an empty :class:`AgentReport` and zero
    usage, or to nothing when ``fail_with`` is set. ``estimate`` is the
    :class:`CostEstimate` returned by :meth:`estimate` (or a function of the
    prompt). ``calls`` records every prompt :meth:`stream` was given, in order.
    """

    def __init__(
        self,
        name: str,
        fragments: Sequence[Fragment] | None = None,
        *,
        delay_s: float = 0.0,
        fail_with: ErrorCode | None = None,
        fail_reason: str = "scripted failure",
        retry_after_ms: int | None = None,
        estimate: CostEstimate | Callable[[Prompt], CostEstimate] = _ZERO,
        skills: Iterable[str] = (),
        health: Health | None = None,
    ) -> None:
        if delay_s < 0:
            raise ValueError("delay_s must be >= 0 seconds")
        if fragments is None:
            fragments = (
                []
                if fail_with is not None
                else [Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=Usage())]
            )
        self.name = name
        self.fragments = list(fragments)
        self.delay_s = delay_s
        self.fail_with = ErrorCode(fail_with) if fail_with is not None else None
        self.fail_reason = fail_reason
        self.retry_after_ms = retry_after_ms
        self._estimate = estimate
        self._skills = list(skills)
        self._health = health or Health()
        self.calls: list[Prompt] = []

    @classmethod
    def returning(
        cls,
        name: str,
        findings: Iterable[AgentFinding] = (),
        *,
        usage: Usage | None = None,
        partials: Iterable[str] = (),
        summary: str = "",
        confidence: float | None = None,
        **kwargs: object,
    ) -> ScriptedAdapter:
        """A script of text ``partials`` (PARTIAL fragments carrying ``usage`` so
        far) then a FINAL :class:`AgentReport` of ``findings`` with ``usage``
        (zero by default). Other keyword arguments go to the constructor."""
        used = usage or Usage()
        frags = [Fragment(type=PayloadType.PARTIAL, content=text, usage=used) for text in partials]
        report = AgentReport(findings=list(findings), summary=summary, confidence=confidence)
        frags.append(Fragment(type=PayloadType.FINAL, content=report, confidence=confidence, usage=used))
        return cls(name, frags, **kwargs)  # type: ignore[arg-type]

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=self._skills)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        return self._estimate(prompt) if callable(self._estimate) else self._estimate

    def health(self) -> Health:
        return self._health

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        self.calls.append(prompt)
        for fragment in self.fragments:
            if self.delay_s:
                await trio.sleep(self.delay_s)
            yield fragment
        if self.fail_with is not None:
            if self.delay_s:
                await trio.sleep(self.delay_s)
            raise AgentError(self.fail_with, self.fail_reason, agent=self.name, retry_after_ms=self.retry_after_ms)
