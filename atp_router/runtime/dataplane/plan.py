"""What one stream's task run is made of: the :class:`TaskPlan` the dispatcher works
from, the :class:`LegOutcome` of each next-hop attempt, the :class:`StreamIO` it
reports through, and the helpers that shape what each next-hop sees (spec §7, §11,
§15.3).

A code-review task's diff is parsed once, before the fan-out
(:func:`parse_task_change`, a large one in a worker thread): the
:class:`~atp_router.task.change.ParsedChange` rides on every leg's prompt
(:func:`leg_prompt`; a leg whose data-scoped diff was rewritten parses its own)
and gives the merge's evidence scorer its changed lines. An escalation that asks
for evidence gets the first stage's reports (:func:`hand_evidence`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.consensus.types import AgentReport, Usage
from atp_router.flow.admission import StreamFlow
from atp_router.flow.window import Window as FlowWindow
from atp_router.security.redact import scrub
from atp_router.task.body import CodeReview, TaskBody
from atp_router.task.change import ParsedChange, parse_change
from atp_router.wire.errors import AgentError, ATPError, ErrorCode
from atp_router.wire.frame import QoS, WindowUpdate


class StreamIO(Protocol):
    """What the dispatcher needs from the stream it serves (implemented by the router)."""

    stream_id: str

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None: ...

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None: ...

    def emit_window_update(self, update: WindowUpdate) -> None: ...


@dataclass(slots=True)
class LegOutcome:
    """What one attempt of one next-hop call produced."""

    agent: str
    report: AgentReport | None = None
    text: str = ""
    usage: Usage = field(default_factory=Usage)
    error: ATPError | None = None
    latency_ms: float = 0.0
    #: Cancelled (stream deadline, RST, preemption) before it answered; no ERROR emitted yet.
    cancelled: bool = False
    #: 1-based attempt on this agent (a retry is attempt 2).
    attempt: int = 1
    #: The call reached the adapter (admitted through breaker, windows, QoS and budget).
    called: bool = False
    #: The WINDOW_UPDATE to send after this attempt's EWINDOW NACK.
    window_update: WindowUpdate | None = None
    #: What the ledger charged for it (``usage`` less any overage the budget could not take).
    charged_tokens: int = 0
    charged_usd_micros: int = 0
    #: Answered from the response cache (spec §13): not called, nothing charged;
    #: ``usage`` is then the stored call's, which consensus ranks its cost by.
    cached: bool = False
    #: Answered from the call journal: charged in an earlier run of the stream's key (on a
    #: router that was lost), replayed with that charge, not called or charged again.
    replayed: bool = False
    #: It failed in doubt (:mod:`~atp_router.runtime.dataplane.dispatch` doc, 3): ``error`` is then the tenant's
    #: ``ClientInputError`` and a canary may speak for the next-hop.
    doubt: bool = False
    #: It timed out while the router's own loop stalled (:attr:`~atp_router.flow.breaker.Fault.LOCAL`):
    #: not counted against the next-hop, retried on it as an ``ETIMEOUT`` is.
    local: bool = False


@dataclass(slots=True)
class TaskPlan:
    """Everything the dispatcher needs to run one stream's task."""

    prompt: Prompt[TaskBody]
    route: Any  # atp_router.policy.fib.Route
    window: FlowWindow
    ledger_key: str
    qos: QoS
    started: float  # trio.current_time() at SYN
    deadline: float  # absolute trio time
    #: The class the SYN asked for when the tenant's ``qos_max`` lowered it to ``qos`` (else None).
    qos_asked: QoS | None = None
    #: The stream's id (QoS tickets name it; ``ledger_key`` is its budget account).
    stream_id: str = ""
    #: The FIB of the stream's RIB generation: fallbacks and data-scope clearance.
    fib: Any = None  # atp_router.policy.fib.Fib
    #: The prompt a given next-hop may see (spec §11 data scope): ``prompt``
    #: itself, or a copy with what the agent is not cleared for redacted. Raises
    #: :class:`~atp_router.wire.errors.ClientInputError` (``ESEC``) when the content
    #: carries a ``forbidden`` category the agent is not cleared for: that
    #: next-hop is not called. ``None``: every next-hop sees ``prompt``.
    prompt_for: Callable[[str], Prompt[TaskBody]] | None = None
    #: Every attempt, in order (telemetry sums their usage).
    attempts: list[LegOutcome] = field(default_factory=list)
    #: Agents called or chosen for this stream: a reroute never goes back to one.
    tried: set[str] = field(default_factory=set)
    #: Changed lines of the task's diff (path → after-diff lines) for the
    #: evidence scorer: ``prompt.change.changed``, parsed once before the fan-out.
    changed: Mapping[str, frozenset[int]] | None = None
    #: The policy's champion/challenger bandit chose "cheap then escalate": escalate
    #: (trigger ``bandit``) even when no policy trigger fires.
    escalate: bool = False
    #: The escalation target was called for this task.
    escalated: bool = False
    #: The escalation triggers that fired for this stream (``no_findings``,
    #: ``low_conf``, ``bandit``, …), set when its FINAL is made: the stream's
    #: own, never another's (the dispatcher is shared by a generation's streams).
    triggers: list[str] = field(default_factory=list)
    #: Win rates for the consensus tie-break (§7.2): the router's live quality
    #: per agent (atp_router.policy.learn); None: the RIB's ``win30d``.
    win_rates: Mapping[str, float] | None = None
    #: The stream as the flow gates see it (window, class, budget account, route-order
    #: turns): made by :meth:`Dispatcher.run` unless given.
    flow: StreamFlow | None = None
    #: The response cache as this stream's tenant and policy see it
    #: (:class:`~atp_router.runtime.dataplane.cache.CacheView`; None: the policy does not cache).
    cache: Any = None
    #: Answers charged in an earlier run of the stream's key, replayed instead of called again
    #: (:class:`~atp_router.runtime.dataplane.journal.JournalView`; None: never re-run elsewhere).
    journal: Any = None

    @property
    def exhausted(self) -> str | None:
        """Why the budget is exhausted (spec §10 EBUDGET), once it is."""
        return self.flow.exhausted if self.flow is not None else None



def client_fault(err: ATPError | None) -> bool:
    """Did the client's input cause ``err`` (:class:`~atp_router.wire.errors.ClientInputError`)?"""
    return isinstance(err, AgentError) and err.client_fault


#: Diffs up to this many characters are parsed on the event loop (~100 µs).
_INLINE_DIFF_CHARS = 32 * 1024


def _diff_of(prompt: Prompt[TaskBody]) -> str | None:
    body = prompt.body
    return body.diff if isinstance(body, CodeReview) else None


def review_files(prompt: Prompt[TaskBody]) -> dict[str, str] | None:
    """A review's ``files`` (path → text after the change) from ``prompt``'s typed
    body: what the consensus checks citations against; None for another body."""
    body = prompt.body
    return body.files if isinstance(body, CodeReview) else None


async def parse_off_loop(diff: str) -> ParsedChange:
    """``diff`` parsed (:func:`~atp_router.task.change.parse_change`): on the event
    loop up to :data:`_INLINE_DIFF_CHARS` characters, in a worker thread beyond
    (~0.5 s for 5 MB). What an ingress that reads a task's diff parses it with, and
    hands on with the task (:meth:`DataPlane.open_stream
    <atp_router.runtime.dataplane.plane.DataPlane.open_stream>` ``change``)."""
    if len(diff) > _INLINE_DIFF_CHARS:
        return await trio.to_thread.run_sync(parse_change, diff)
    return parse_change(diff)


async def parse_task_change(plan: TaskPlan) -> None:
    """Parse the task's diff once (:func:`parse_off_loop`) onto
    ``plan.prompt.change``, which every leg gets (:func:`leg_prompt`), and set
    ``plan.changed`` for the evidence scorer (``None`` when the task has no diff
    or an empty one). A prompt that already carries its change (parsed by the
    ingress that read the diff, or a shadow run of a task) is not parsed again."""
    diff = _diff_of(plan.prompt)
    if diff is None:
        return
    if plan.prompt.change is None:
        plan.prompt = msgspec.structs.replace(plan.prompt, change=await parse_off_loop(diff))
    assert plan.prompt.change is not None
    plan.changed = plan.prompt.change.changed if diff else None


def leg_prompt(plan: TaskPlan, agent: str) -> Prompt[TaskBody]:
    """The prompt ``agent`` may see (``plan.prompt_for``, spec §11) carrying the
    task's parsed diff (``plan.prompt.change``) when its diff is the task's; a
    data-scope redaction that rewrote the diff leaves that leg to parse its own."""
    prompt = plan.prompt if plan.prompt_for is None else plan.prompt_for(agent)
    change = plan.prompt.change
    if change is None:
        return prompt
    diff, task_diff = _diff_of(prompt), _diff_of(plan.prompt)
    if diff is not None and (diff is task_diff or diff == task_diff):
        return prompt if prompt.change is change else msgspec.structs.replace(prompt, change=change)
    return msgspec.structs.replace(prompt, change=None) if prompt.change is not None else prompt



#: Citations per report and characters per text handed to an escalation as evidence.
EVIDENCE_FINDINGS = 20
EVIDENCE_CHARS = 2_000


def hand_evidence(plan: TaskPlan, reports: Mapping[str, AgentReport]) -> None:
    """The escalation ``evidence: true`` of a policy (spec §15.3): from now on
    the stream's next-hops (the escalation, its retries and reroutes) get the
    first stage's reports as ``content["evidence"]``: a list, per agent in name
    order, of ``{"agent", "summary", "confidence", "findings": [{"file",
    "start", "end", "claim", "confidence"}]}`` (at most
    :data:`EVIDENCE_FINDINGS` findings, texts cut to :data:`EVIDENCE_CHARS`
    characters and passed through :func:`~atp_router.security.redact.scrub`: the
    evidence never carries a secret a detector recognises). Added to what the
    next-hop may see (the data-scoped prompt)."""
    evidence = [
        {
            "agent": agent,
            "summary": scrub(r.summary, max_chars=EVIDENCE_CHARS),
            "confidence": r.confidence,
            "findings": [
                {"file": f.file, "start": f.start, "end": f.end, "claim": scrub(f.claim, max_chars=EVIDENCE_CHARS),
                 "confidence": f.confidence}
                for f in r.findings[:EVIDENCE_FINDINGS]
            ],
        }
        for agent, r in sorted(reports.items())
    ]
    base = plan.prompt_for

    def prompt_for(agent: str) -> Prompt[TaskBody]:
        p = plan.prompt if base is None else base(agent)
        return msgspec.structs.replace(p, content={**p.content, "evidence": evidence})

    plan.prompt_for = prompt_for

