"""Running one stream's task to what it came to (spec §7, §8 steps 3-7, §11 data scope).

:func:`plan_task` makes the :class:`~atp_router.runtime.dataplane.plan.TaskPlan` of a
stream's task from the stream (its route, window, class, budget account, SYN
time and bandit decision) and what the router knows of it (the live win rates,
the response cache as the stream's tenant sees it). :func:`run_task` runs that
plan: the data-scope check of the content (:func:`data_scope`), then the
generation's :class:`~atp_router.runtime.dataplane.dispatch.Dispatcher`, and returns a
frozen :class:`TaskOutcome` — the FINAL or why there is none, the escalation
triggers that fired *for this stream* and every attempt — which the router acts
on (emits, signs, audits, counts, learns from). Nothing here is shared between
streams: two tasks running at once never see each other's triggers or attempts.

Parts are passed in, not the router: the dispatcher, the
:class:`~atp_router.security.redact.DataScopeGuard` and the audit trail's
``audit(kind, identity, detail)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.consensus.types import FinalResult
from atp_router.flow.window import Window as FlowWindow
from atp_router.policy.fib import data_scope_labels
from atp_router.runtime.dataplane.cache import annotate
from atp_router.runtime.dataplane.dispatch import Dispatcher
from atp_router.runtime.dataplane.plan import LegOutcome, StreamIO, TaskPlan
from atp_router.security.identity import Identity
from atp_router.security.redact import DataScopeGuard, Redacted, Refused
from atp_router.task.body import TaskBody
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import QoS, Window

log = logging.getLogger("atp_router.runtime.dataplane.runner")

#: The audit trail (spec §11 audit): ``audit(kind, identity, detail)`` records one
#: event — here ``redaction`` and ``refusal`` of the data scope.
Audit = Callable[[str, Identity | None, Mapping[str, Any]], None]


class RunningStream(StreamIO, Protocol):
    """What running a task needs of its stream (the router's
    :class:`~atp_router.runtime.dataplane.streams.StreamCtx`), read-only."""

    @property
    def session_id(self) -> str: ...

    @property
    def identity(self) -> Identity: ...

    @property
    def meta(self) -> Mapping[str, Any]: ...

    @property
    def route(self) -> Any: ...  # atp_router.policy.fib.Route

    @property
    def window(self) -> Window: ...

    @property
    def qos(self) -> QoS: ...

    @property
    def qos_asked(self) -> QoS | None: ...  # the SYN's class when qos_max lowered it

    @property
    def account(self) -> str: ...

    @property
    def started(self) -> float: ...

    @property
    def decision(self) -> Any: ...  # the bandit's choice at SYN (atp_router.policy.learn)


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskOutcome:
    """What running one stream's task came to.

    ``final`` is the FINAL result (spec §7.3; what the cache served marked), or
    ``None`` with ``error`` saying why: an
    :class:`~atp_router.wire.errors.AgentError` from the dispatcher (``EBUDGET``: the
    stream ends with ERROR + FIN; any other code: RST), or, with ``internal``,
    a fault of the router's own while running it (logged here; RST
    ``EAGENTDOWN``). ``triggers`` are the escalation triggers that fired for
    this stream (``no_findings``, ``low_conf``, ``bandit``, …), ``escalated``
    whether the escalation next-hop was called, ``attempts`` every attempt in
    order."""

    final: FinalResult | None
    triggers: tuple[str, ...] = ()
    attempts: tuple[LegOutcome, ...] = ()
    escalated: bool = False
    error: AgentError | None = None
    internal: bool = False


def plan_task(stream: RunningStream, prompt: Prompt[TaskBody], fib: Any, *, update_interval_ms: int,
              update_delta: float, update_keepalive_ms: int | None = None, win_rates: Mapping[str, float] | None, cache: Any,
              journal: Any = None) -> TaskPlan:
    """The plan of ``stream``'s task ``prompt`` over ``fib`` (its generation's
    FIB): the stream's flow window (the one its SYN+ACK carried, so the next
    WINDOW_UPDATE is due only when it moves by ``update_delta``, at the
    ``update_interval_ms`` check when it changed, or every ``update_keepalive_ms``), its budget account (which also names it to the QoS
    tickets: unique across tenants), deadline (``route.deadline_ms`` after SYN)
    and bandit decision; ``win_rates`` for the consensus tie-break (None: the
    RIB's), the response-cache view ``cache`` (None: the policy does not cache)
    and the call-journal view ``journal`` (None: the stream is never re-run elsewhere)."""
    window = FlowWindow(stream.window, update_interval_ms=update_interval_ms, update_delta=update_delta,
                        update_keepalive_ms=update_keepalive_ms)
    window.update_due(trio.current_time())  # the SYN+ACK carried this window
    return TaskPlan(
        prompt=prompt,
        route=stream.route,
        window=window,
        ledger_key=stream.account,
        stream_id=stream.account,  # QoS tickets name the stream: unique across tenants
        qos=stream.qos,
        qos_asked=stream.qos_asked,
        started=stream.started,
        deadline=stream.started + stream.route.deadline_ms / 1000,
        fib=fib,
        escalate=bool(stream.decision is not None and getattr(stream.decision, "escalate", None)),
        win_rates=win_rates,
        cache=cache,
        journal=journal,
    )


async def run_task(dispatcher: Dispatcher, stream: RunningStream, plan: TaskPlan, *, guard: DataScopeGuard,
                   audit: Audit) -> TaskOutcome:
    """Run ``plan`` for ``stream``: the data scope of its content (:func:`data_scope`,
    with ``guard`` and ``audit``), then ``dispatcher`` (fan-out, merge, escalation,
    spec §8 steps 3-6). Returns the :class:`TaskOutcome`; raises only
    cancellation (an RST, a preemption, the router stopping)."""
    try:
        plan.prompt_for = await data_scope(stream, plan.prompt, plan.fib, guard, audit)
        final = annotate(await dispatcher.run(stream, plan), plan.attempts)
    except AgentError as e:
        return TaskOutcome(final=None, attempts=tuple(plan.attempts), escalated=plan.escalated, error=e)
    except Exception:
        # A fault in one stream's task must not take the appliance down.
        log.exception("stream %s: task failed", stream.stream_id)
        return TaskOutcome(final=None, attempts=tuple(plan.attempts), escalated=plan.escalated, internal=True,
                           error=AgentError(ErrorCode.EAGENTDOWN, "internal router error while running the task"))
    return TaskOutcome(final=final, triggers=tuple(plan.triggers), attempts=tuple(plan.attempts),
                       escalated=plan.escalated)


async def data_scope(stream: RunningStream, prompt: Prompt[TaskBody], fib: Any, guard: DataScopeGuard,
                     audit: Audit) -> Callable[[str], Prompt[TaskBody]] | None:
    """Spec §11 data scope at dispatch: the task's ``meta.data_scope`` labels
    (Agent Context ``policyContext`` labels included) are checked against the
    content once, off the event loop (``guard``,
    :class:`~atp_router.security.redact.DataScopeGuard`); returns what each next-hop
    may see given its clearance in ``fib`` — the prompt, a redacted copy
    (audited ``redaction``), or :class:`ClientInputError` ``ESEC`` (audited
    ``refusal``, the agent not called). ``None`` when the task carries no label."""
    labels = data_scope_labels(stream.meta)
    if not labels:
        return None
    scan = await trio.to_thread.run_sync(guard.inspect, prompt.content, labels)
    seen: dict[str, Prompt[TaskBody]] = {}

    def prompt_for(agent: str) -> Prompt[TaskBody]:
        if agent in seen:
            return seen[agent]
        d = guard.for_agent(scan, fib.clearance(agent))
        where = {"session_id": stream.session_id, "stream_id": stream.stream_id, "agent": agent}
        if isinstance(d, Refused):
            audit("refusal", stream.identity, {**where, "code": str(d.code), "label": d.label,
                                               "found": [msgspec.to_builtins(f) for f in d.findings]})
            raise ClientInputError(d.reason, code=d.code, agent=agent)
        if isinstance(d, Redacted):
            audit("redaction", stream.identity,
                  {**where, "redactions": [msgspec.to_builtins(r) for r in d.redactions]})
            seen[agent] = msgspec.structs.replace(prompt, content=d.content)
        else:
            seen[agent] = prompt
        return seen[agent]

    return prompt_for
