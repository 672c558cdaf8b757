"""Faults are attributed (issue 19; atp_router.runtime.dataplane.dispatch module doc 3 and 4,
atp_router.flow.breaker "Faults are attributed") on a real router on loopback.

The next-hops are :class:`TaskTool` s: tenant-bound adapters (``tenant_bound =
True``, as every local tool) that do on demand what a tool does on a hostile
task — run past the hop's ``timeout_ms``, crash with an exception the adapter
did not classify — or, broken, also on the router's own canary. Real ruff and
bandit next-hops and the same faults through them: tests/security/test_fault_attribution.py.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import atp
import msgspec
import trio

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentReport, Usage
from atp_router.policy.fib import compile_fib
from atp_router.policy.health import Health
from atp_router.policy.loader import load_rib_text
from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.runtime.dataplane.gates import CANARY
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType
from tests.conftest import RouterEnv
from tests.helpers import start_router_on

META = {"task_type": "code_review", "languages": ["py"]}
FAST = {"files": {"calc.py": "x = 1\n"}}
HANG = {"files": {"calc.py": "x = 1\n"}, "hang": True}
CRASH = {"files": {"calc.py": "x = 1\n"}, "crash": True}
#: The tool's own wall clock ran out and the adapter judged whose: the task's (ClientInputError) or its own (AgentError).
CLIENT_TIMEOUT = {"files": {"calc.py": "x = 1\n"}, "client_timeout": True}
OWN_TIMEOUT = {"files": {"calc.py": "x = 1\n"}, "own_timeout": True}


class TaskTool(ProviderAdapter):
    """A tenant-bound next-hop: hangs on a task with ``"hang"``, raises
    ``RecursionError`` on one with ``"crash"``, the tool's own timeout on one with
    ``"client_timeout"`` (judged the task's, ``ClientInputError``) or ``"own_timeout"``
    (judged its own, ``AgentError``), answers anything else — and,
    ``broken``, hangs on everything, the router's canary included. ``calls``:
    every prompt, canaries among them (``meta["canary"]``)."""

    tenant_bound = True

    def __init__(self, name: str, *, broken: bool = False) -> None:
        self.name = name
        self.broken = broken
        self.calls: list[Prompt] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=["code_review"])

    def estimate(self, prompt: Prompt) -> CostEstimate:
        return CostEstimate()

    def health(self) -> Health:
        return Health()

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        self.calls.append(prompt)
        if self.broken or prompt.content.get("hang"):
            await trio.sleep(math.inf)
        if prompt.content.get("crash"):
            raise RecursionError("maximum recursion depth exceeded")
        if prompt.content.get("client_timeout"):
            raise ClientInputError("the task's tests ran past timeout_s=1 s; killed", code=ErrorCode.ETIMEOUT,
                                   agent=self.name)
        if prompt.content.get("own_timeout"):
            raise AgentError(ErrorCode.ETIMEOUT, "ran past its wall-clock limit timeout_s=1 s; killed", agent=self.name)
        yield Fragment(type=PayloadType.FINAL, content=AgentReport(summary="ok"), usage=Usage())

    def tenant_calls(self) -> list[Prompt]:
        return [p for p in self.calls if not p.meta.get("canary")]

    def canaries(self) -> list[Prompt]:
        return [p for p in self.calls if p.meta.get("canary")]


def tool_agent(timeout_ms: int) -> dict:
    return {"layer": "L1", "tool": "scripted", "p95_ms": 100, "timeout_ms": timeout_ms, "strengths": ["code_review"]}


async def router_on(nursery, tmp_path, agents: dict, fanout: list[str], **config) -> RouterEnv:
    doc = {"agents": agents, "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": fanout}]}
    return await start_router_on(nursery, tmp_path, doc, **config)


async def run(env: RouterEnv, content: dict) -> list[atp.Event]:
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=content)
        with trio.fail_after(30):
            return [ev async for ev in c.events(st)]


def errors(events: list[atp.Event]) -> list[tuple[str, str]]:
    return [(ev.payload["code"], ev.payload["reason"]) for ev in events if ev.type == "ERROR"]


async def settled(env: RouterEnv, agent: str) -> None:
    """Wait until no canary runs on ``agent``."""
    with trio.fail_after(20):
        while env.router.gates.breakers.statistics()[agent].canary_in_flight:
            await trio.sleep(0.01)


async def test_a_tools_timeout_on_the_tasks_input_is_the_tenants_once_and_never_opens_its_breaker(
        nursery, tmp_path, scripted):
    """Three tasks that run a tenant-bound next-hop past its timeout_ms (breaker
    threshold 2): each is the tenant's ETIMEOUT — one call, no retry, no reroute
    to the fallback — no breaker failure, no AIMD decrease; a canary of the
    router's own answered, so the next task is served."""
    tool = scripted["tool.tests"] = TaskTool("tool.tests")
    spare = scripted["tool.spare"] = ScriptedAdapter.returning("tool.spare")
    env = await router_on(nursery, tmp_path, {"tool.tests": {**tool_agent(300), "fallback": "tool.spare"},
                                              "tool.spare": tool_agent(300)},
                          ["tool.tests"], breaker_failures=2)
    gates = env.router.gates
    cwnd = gates.agent_windows.window("tool.tests").cwnd
    for _ in range(3):
        events = await run(env, HANG)
        assert errors(events) == [("ETIMEOUT", ("tool.tests: no answer within 300 ms; a local tool's run is the "
                                               "task's own: not retried, not counted against the next-hop"))]
        rst = events[-1]
        assert rst.type == "RST" and rst.payload["code"] == "ETIMEOUT"
        assert rst.payload["reason"].startswith("task timed out: tool.tests: no answer within 300 ms")
    await settled(env, "tool.tests")
    assert len(tool.tenant_calls()) == 3 and spare.calls == []
    assert [p.content for p in tool.canaries()] == [CANARY.content]  # one per canary_interval_s
    stats = gates.breakers.statistics()["tool.tests"]
    assert (stats.state, stats.failures, stats.doubts, stats.canaries, stats.canary_failures) == ("closed", 0, 3, 1, 0)
    assert gates.agent_windows.window("tool.tests").cwnd == cwnd
    events = await run(env, FAST)
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"]
    async with atp.Client(env.url) as c:
        metrics = await c.metrics()
    assert 'atp_agent_calls_total{agent="tool.tests",outcome="ETIMEOUT"} 3.0' in metrics


async def test_a_tools_own_verdict_on_its_timeout_stands(nursery, tmp_path, scripted):
    """The tool's own wall clock ran out and the adapter judged it. The task's
    (``ClientInputError`` ETIMEOUT): the tenant's ETIMEOUT with the tool's reason,
    one call, no reroute to the fallback, no count and no canary of the router's.
    The tool's (``AgentError`` ETIMEOUT: the adapter's canary failed too): the
    next-hop's — counted, retried, rerouted to the fallback."""
    tool = scripted["tool.tests"] = TaskTool("tool.tests")
    spare = scripted["tool.spare"] = ScriptedAdapter.returning("tool.spare")
    env = await router_on(nursery, tmp_path, {"tool.tests": {**tool_agent(5_000), "fallback": "tool.spare"},
                                              "tool.spare": tool_agent(5_000)},
                          ["tool.tests"], breaker_failures=5)
    board = env.router.gates.breakers
    for _ in range(3):
        events = await run(env, CLIENT_TIMEOUT)
        assert errors(events) == [("ETIMEOUT", "tool.tests: the task's tests ran past timeout_s=1 s; killed")]
        assert events[-1].type == "RST" and events[-1].payload == {
            "kind": "ERROR", "code": "ETIMEOUT",
            "reason": "task timed out: tool.tests: the task's tests ran past timeout_s=1 s; killed"}
    stats = board.statistics()["tool.tests"]
    assert (stats.failures, stats.ignored, stats.doubts, stats.canaries) == (0, 3, 0, 0)
    assert len(tool.tenant_calls()) == 3 and spare.calls == []

    events = await run(env, OWN_TIMEOUT)
    timeouts = [reason for code, reason in errors(events) if code == "ETIMEOUT"]
    assert timeouts[0].startswith("tool.tests: ran past its wall-clock limit timeout_s=1 s; killed; retry 2/2 in ")
    assert timeouts[1] == "tool.tests: ran past its wall-clock limit timeout_s=1 s; killed; rerouted to tool.spare"
    assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"] and len(spare.calls) == 1
    stats = board.statistics()["tool.tests"]
    assert (stats.failures, stats.doubts, stats.canaries) == (2, 0, 0)


async def test_a_tools_crash_on_the_tasks_input_is_eproto_to_the_tenant(nursery, tmp_path, scripted):
    """An exception a tenant-bound adapter did not classify (a RecursionError on an
    absurd path): EPROTO to the tenant, not counted; the same crash of a next-hop
    that is not tenant-bound stays the peer's EAGENTDOWN."""
    tool = scripted["tool.lint"] = TaskTool("tool.lint")
    env = await router_on(nursery, tmp_path, {"tool.lint": tool_agent(5_000)}, ["tool.lint"], breaker_failures=2)
    for _ in range(4):
        events = await run(env, CRASH)
        assert errors(events) == [("EPROTO", ("tool.lint: failed on this task (RecursionError); a local tool's run "
                                             "is the task's own: not retried, not counted against the next-hop"))]
        assert events[-1].type == "RST" and events[-1].payload["code"] == "EPROTO"
    await settled(env, "tool.lint")
    stats = env.router.gates.breakers.statistics()["tool.lint"]
    assert (stats.state, stats.failures, stats.canaries) == ("closed", 0, 1)
    assert len(tool.tenant_calls()) == 4
    assert [ev.type for ev in await run(env, FAST)][-2:] == ["FINAL", "FIN"]


async def test_a_broken_tool_fails_its_canaries_and_is_skipped_by_name(nursery, tmp_path, scripted):
    """A tenant-bound next-hop that hangs on everything: the tenant's timeout asks
    for a canary, the canary fails, a second confirms, the breaker opens; the next
    task's FINAL names the next-hop the FIB skipped."""
    broken = scripted["tool.broken"] = TaskTool("tool.broken", broken=True)
    scripted["review.ok"] = ScriptedAdapter.returning("review.ok")
    env = await router_on(nursery, tmp_path, {"tool.broken": tool_agent(200), "review.ok": tool_agent(5_000)},
                          ["tool.broken", "review.ok"], breaker_backoff_s=60.0, breaker_max_backoff_s=60.0)
    events = await run(env, FAST)
    final = next(ev.payload for ev in events if ev.type == "FINAL")
    assert any(u.startswith(f"{NEXT_HOP_FAILED}tool.broken: ETIMEOUT: no answer within 200 ms")
               for u in final["result"]["consensus"]["uncertainties"])
    board = env.router.gates.breakers
    with trio.fail_after(20):
        while "tool.broken" not in board.open_agents(trio.current_time()):
            await trio.sleep(0.01)
    stats = board.statistics()["tool.broken"]
    assert (stats.canaries, stats.canary_failures, stats.failures, stats.trips) == (2, 2, 2, 1)
    events = await run(env, FAST)
    assert events[0].payload is None or "tool.broken" not in events[0].frame["meta"]["route"]["next_hops"]
    [note] = [u for u in next(ev.payload for ev in events if ev.type == "FINAL")["result"]["consensus"]["uncertainties"]
              if "tool.broken" in u]
    assert note.startswith(f"{NEXT_HOP_FAILED}tool.broken: EAGENTDOWN: skipped at routing: circuit open (next probe in ")
    assert len(broken.tenant_calls()) == 1


RIB = """
agents:
  a.one: { layer: L1, tool: ruff, p95_ms: 100 }
  b.two: { layer: L1, tool: bandit, p95_ms: 200 }
  c.three: { layer: L1, tool: ruff, p95_ms: 300 }
policies:
  - { name: top2, match: { task_type: code_review }, fanout: [a.one, b.two, c.three], fanout_k: 2 }
"""


def test_the_fib_names_the_next_hops_it_left_out_as_down():
    fib = compile_fib(load_rib_text(RIB), version=1)
    meta = {"task_type": "code_review"}
    assert fib.lookup(meta).skipped == []
    route = fib.lookup(meta, health={"a.one": Health(up=False), "c.three": Health(up=False)})
    assert [h.agent for h in route.next_hops] == ["b.two"] and route.skipped == ["a.one", "c.three"]
    # The field survives what the router does with a route (bandit re-ordering replaces fields).
    assert msgspec.structs.replace(route, next_hops=[]).skipped == ["a.one", "c.three"]
