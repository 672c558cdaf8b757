"""Running a stream's task outside the Router (atp_router.runtime.dataplane.runner):
:func:`run_task` returns a frozen :class:`TaskOutcome` of the stream's own
FINAL, triggers and attempts — nothing shared between streams run at once on one
dispatcher — or why there is no FINAL."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from atp_router.adapters.base import Prompt, ProviderAdapter
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, FinalResult, Severity
from atp_router.flow.breaker import BreakerBoard, RetryPolicy
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.flow.qos import QosScheduler
from atp_router.flow.window import WindowTable
from atp_router.policy.fib import NextHop, Route
from atp_router.policy.rib import EscalationSpec
from atp_router.runtime.dataplane.dispatch import Dispatcher
from atp_router.runtime.dataplane.gates import FlowGates, SlotGate
from atp_router.runtime.dataplane.plan import StreamIO, TaskPlan
from atp_router.runtime.dataplane.runner import TaskOutcome, plan_task, run_task
from atp_router.security.redact import DataScopeGuard
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS, Window, WindowUpdate

ROOMY = Window(max_parallel=8, max_tokens=1_000_000, max_usd_micros=10_000_000)
CONTENT = {"diff": "", "files": {"calc.py": "def add(a, b):\n    return a + b\n"}}


@dataclass
class Stream:
    """A stream as run_task reads it, recording what it is sent."""

    stream_id: str
    route: Route
    session_id: str = "s1"
    identity: Any = None
    meta: dict[str, Any] = field(default_factory=lambda: {"task_type": "code_review"})
    window: Window = ROOMY
    qos: QoS = QoS.SILVER
    qos_asked: QoS | None = None
    started: float = 0.0
    decision: Any = None
    errors: list[tuple[ErrorCode, str]] = field(default_factory=list)

    @property
    def account(self) -> str:
        return f"stream:{self.stream_id}"

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None:
        pass

    def emit_error(self, code: ErrorCode, reason: str, *, agent: str | None = None,
                   retry_after_ms: int | None = None) -> None:
        self.errors.append((code, reason))

    def emit_window_update(self, update: WindowUpdate) -> None:
        pass


def hop(agent: str) -> NextHop:
    return NextHop(agent=agent, weight=1.0, qos=QoS.SILVER, timeout_ms=10_000)


def route(agent: str, escalate_to: str) -> Route:
    return Route(policy="p", next_hops=[hop(agent)], escalation=EscalationSpec(on=["no_findings"], to=escalate_to),
                 escalation_hop=hop(escalate_to), budget=None, window=None, consensus="union_tiebreak",
                 qos=QoS.SILVER, deadline_ms=60_000)


def dispatcher(adapters: dict[str, ProviderAdapter], ledger: BudgetLedger,
               cls: type[Dispatcher] = Dispatcher) -> Dispatcher:
    gates = FlowGates(WindowTable(ROOMY), SlotGate(QosScheduler(8, gold_reserved=1), lambda p: None),
                      BreakerBoard(), RetryPolicy())
    return cls(adapters, ledger, win_rates={}, gates=gates)


async def run(d: Dispatcher, ledger: BudgetLedger, stream: Stream) -> tuple[TaskOutcome, TaskPlan]:
    ledger.open(stream.account, Allowance(), parent="client")
    stream.started = trio.current_time()
    plan = plan_task(stream, Prompt(task_type="code_review", content=CONTENT, meta=stream.meta), None,
                     update_interval_ms=1000, update_delta=0.2, win_rates=None, cache=None)
    return await run_task(d, stream, plan, guard=DataScopeGuard(), audit=lambda *a: None), plan


def client_ledger() -> BudgetLedger:
    ledger = BudgetLedger()
    ledger.open("client", Allowance())
    return ledger


async def test_streams_run_at_once_on_one_dispatcher_get_their_own_outcomes() -> None:
    """One stream's cheap agent finds nothing (escalated on ``no_findings``), the
    other's finds the defect (not escalated); both finish together, neither
    outcome carries the other's triggers or attempts."""
    defect = AgentFinding(file="calc.py", start=2, end=2, severity=Severity.HIGH, claim="wrong operator")
    ledger = client_ledger()
    d = dispatcher({"quiet": ScriptedAdapter("quiet", delay_s=0.01),
                    "finder": ScriptedAdapter.returning("finder", [defect], delay_s=0.01),
                    "big": ScriptedAdapter.returning("big", [defect])}, ledger)
    streams = {"clean": Stream("clean", route("quiet", "big")), "defect": Stream("defect", route("finder", "big"))}
    outcomes: dict[str, TaskOutcome] = {}

    async def one(name: str) -> None:
        outcomes[name], _ = await run(d, ledger, streams[name])

    async with trio.open_nursery() as n:
        for name in streams:
            n.start_soon(one, name)
    clean, found = outcomes["clean"], outcomes["defect"]
    assert clean.triggers == ("no_findings",) and clean.escalated
    assert [o.agent for o in clean.attempts] == ["quiet", "big"]
    assert found.triggers == () and not found.escalated
    assert [o.agent for o in found.attempts] == ["finder"]
    assert isinstance(clean.final, FinalResult) and isinstance(found.final, FinalResult)
    assert clean.error is None and found.error is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        clean.triggers = ()  # type: ignore[misc]


async def test_a_stream_without_a_report_gets_the_dispatchers_error() -> None:
    ledger = client_ledger()
    d = dispatcher({"down": ScriptedAdapter("down", fail_with=ErrorCode.EPROTO, fail_reason="garbled")}, ledger)
    outcome, plan = await run(d, ledger, Stream("s", route("down", "nobody")))
    assert outcome.final is None and not outcome.internal
    assert outcome.error is not None and outcome.error.code is ErrorCode.EAGENTDOWN
    assert "down: EPROTO garbled" in outcome.error.reason
    # No finding escalates (no_findings) to an agent without an adapter: failed too.
    assert "nobody: EAGENTDOWN next-hop has no adapter" in outcome.error.reason
    assert outcome.attempts == tuple(plan.attempts) and [o.agent for o in outcome.attempts] == ["down", "nobody"]


class _Broken(Dispatcher):
    async def run(self, io: StreamIO, plan: TaskPlan) -> FinalResult:
        raise RuntimeError("a bug in the router")


async def test_a_fault_of_the_routers_own_is_an_internal_outcome_not_a_crash(caplog) -> None:
    ledger = client_ledger()
    outcome, _ = await run(dispatcher({}, ledger, _Broken), ledger, Stream("s", route("a", "b")))
    assert outcome.final is None and outcome.internal
    assert outcome.error is not None and outcome.error.code is ErrorCode.EAGENTDOWN
    assert outcome.error.reason == "internal router error while running the task"
    assert "stream s: task failed" in caplog.text and "a bug in the router" in caplog.text
