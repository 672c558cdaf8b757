"""Dispatcher faults and limits (spec §5, §7, §8 steps 3-6, §10) on a real router.

Streams are opened with the SDK on a router on loopback; real ruff and bandit
next-hops run beside the faulty ones. The faulty next-hops are
:class:`~atp_router.adapters.testing.ScriptedAdapter` s registered through the adapter
registry as RIB ``tool: scripted``: they reproduce what a provider adapter does
on failure (raise ``AgentError`` EAGENTDOWN with a Retry-After hint, hang past
its deadline, report usage above its estimate, answer with a FINAL that is not a
report), which no real local analyser can be made to do on demand.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import atp
import pytest
import trio

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, Severity, Usage
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import CostEstimate, PayloadType
from tests.conftest import RouterEnv
from tests.helpers import golden, start_router_on

META = {"task_type": "code_review", "languages": ["py"]}
RUFF = {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"]}
BANDIT = {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"]}

# A clean change: neither ruff nor bandit finds anything in it.
CLEAN = {
    "diff": "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n",
    "files": {"calc.py": "def add(a, b):\n    return a + b\n"},
}


def scripted_agent(timeout_ms: int = 30_000) -> dict:
    return {"layer": "L2", "tool": "scripted", "p95_ms": 300, "timeout_ms": timeout_ms, "strengths": ["code_review"]}


async def router_with(nursery, tmp_path, agents: dict, **policy) -> RouterEnv:
    """A router whose RIB has ``agents`` and one code_review policy (JSON is YAML)."""
    doc = {"agents": agents, "policies": [{"name": "p", "match": {"task_type": "code_review"}, **policy}]}
    return await start_router_on(nursery, tmp_path, doc)


async def run_stream(env: RouterEnv, content: dict | None = None, **open_kw) -> tuple[list[atp.Event], str]:
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=content or golden(), **open_kw)
        with trio.fail_after(60):
            return [ev async for ev in c.events(st)], st.stream_id


def errors(events: list[atp.Event]) -> list[dict]:
    return [ev.payload for ev in events if ev.type == "ERROR"]


def final_of(events: list[atp.Event]) -> dict:
    finals = [ev.payload for ev in events if ev.type == "FINAL"]
    assert len(finals) == 1, [ev.type for ev in events]
    assert events[-1].type == "FIN"
    return finals[0]


def reporters(events: list[atp.Event]) -> set[str]:
    """Next-hops whose FINAL report reached the client (as a PARTIAL event)."""
    return {ev.payload["agent"] for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}


def finding(file: str = "thefuck/utils.py", line: int = 183, claim: str = "scripted finding") -> AgentFinding:
    return AgentFinding(file=file, start=line, end=line, severity=Severity.HIGH, claim=claim, confidence=0.9)


async def test_agentdown_next_hop_is_an_error_and_the_others_make_the_final(nursery, tmp_path, scripted):
    scripted["review.down"] = ScriptedAdapter(
        "review.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 503 from upstream", retry_after_ms=500
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "sec.bandit": BANDIT,
                                                "review.down": scripted_agent()},
                            fanout=["lint.ruff", "sec.bandit", "review.down"])
    events, _ = await run_stream(env)
    errs = errors(events)
    # The failure halved the stream's window (AIMD): the retry may be NACKed and
    # queued until ruff or bandit leaves it.
    assert all(e["reason"].endswith("; queued until the window opens") for e in errs if e["code"] == "EWINDOW")
    errs = [e for e in errs if e["code"] != "EWINDOW"]
    # Nothing to reroute to and a short Retry-After: retried once (RetryPolicy), then given up.
    assert [(e["code"], e["reason"], e["retry_after_ms"]) for e in errs] == [
        ("EAGENTDOWN", "review.down: HTTP 503 from upstream; retry 2/2 in 500 ms", 500),
        ("EAGENTDOWN", "review.down: HTTP 503 from upstream", 500),
    ]
    final = final_of(events)
    assert {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]} == {"lint.ruff", "sec.bandit"}
    assert reporters(events) == {"lint.ruff", "sec.bandit"}
    assert len(scripted["review.down"].calls) == 2
    async with atp.Client(env.url) as c:
        metrics = await c.metrics()
    assert 'atp_agent_calls_total{agent="review.down",outcome="EAGENTDOWN"} 2.0' in metrics


async def test_all_next_hops_failing_resets_the_stream_with_eagentdown(nursery, tmp_path, scripted):
    scripted["a.down"] = ScriptedAdapter("a.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="connection refused")
    scripted["b.bad"] = ScriptedAdapter("b.bad", [Fragment(type=PayloadType.FINAL, content="not a report")])
    env = await router_with(nursery, tmp_path, {"a.down": scripted_agent(), "b.bad": scripted_agent()},
                            fanout=["a.down", "b.bad"])
    events, _ = await run_stream(env)
    types = [ev.type for ev in events]
    assert types[0] == "SYN_ACK" and types[-1] == "RST" and "FINAL" not in types
    codes = {e["reason"].split(":")[0]: e["code"] for e in errors(events)}
    assert codes == {"a.down": "EAGENTDOWN", "b.bad": "EPROTO"}
    rst = events[-1].payload
    assert rst["code"] == "EAGENTDOWN" and "a.down" in rst["reason"] and "b.bad" in rst["reason"]
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        with pytest.raises(atp.ATPClientError) as ei:
            await c.result(st)
    assert ei.value.code == "EAGENTDOWN"


async def test_hanging_next_hop_times_out_after_its_timeout_ms(nursery, tmp_path, scripted):
    hang = scripted["review.hang"] = ScriptedAdapter("review.hang", delay_s=math.inf)
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "sec.bandit": BANDIT,
                                                "review.hang": scripted_agent(timeout_ms=400)},
                            fanout=["lint.ruff", "sec.bandit", "review.hang"])
    t0 = trio.current_time()
    events, _ = await run_stream(env)
    elapsed = trio.current_time() - t0
    # The timeout halved the stream's window: the retry may be NACKed (EWINDOW,
    # queued) while ruff or bandit still run.
    errs = [e for e in errors(events) if e["code"] != "EWINDOW"]
    # ETIMEOUT → one retry after a backoff (spec §10: retries + AIMD decrease), then given up.
    assert [e["code"] for e in errs] == ["ETIMEOUT", "ETIMEOUT"]
    assert errs[0]["reason"].startswith("review.hang: no answer within 400 ms; retry 2/2 in ")
    assert errs[1]["reason"] == "review.hang: no answer within 400 ms"
    assert reporters(events) == {"lint.ruff", "sec.bandit"}
    final = final_of(events)
    assert final["telemetry"]["latency_ms"] >= 800
    assert 0.8 <= elapsed < 10
    assert len(hang.calls) == 2
    # Both timeouts halved the next-hop's window (cwnd 16 → 8 → 4; one decrease per window of calls).
    assert env.router.gates.agent_windows.window("review.hang").cwnd == 4


async def test_stream_deadline_cuts_running_and_queued_next_hops(nursery, tmp_path, scripted):
    """deadline_ms bounds the whole stream: a next-hop still running gets ETIMEOUT,
    and so does one still queued for a window slot."""
    scripted["review.hang"] = ScriptedAdapter("review.hang", delay_s=math.inf)
    # The deadline is a multiple of what ruff's sandboxed run takes here and now
    # (at least 500 ms): beside busy processes a fixed 500 ms cut ruff too in
    # every try (issue 20).
    probe = await router_with(nursery, tmp_path, {"lint.ruff": RUFF}, fanout=["lint.ruff"])
    t0 = trio.current_time()
    await run_stream(probe)
    deadline_s = max(0.5, 4 * (trio.current_time() - t0))
    agents = {"lint.ruff": RUFF, "review.hang": scripted_agent(timeout_ms=600_000)}
    env = await router_with(nursery, tmp_path, agents, fanout=["lint.ruff", "review.hang"],
                            deadline_ms=int(deadline_s * 1000))
    # The condition first: ruff answers within the deadline while review.hang runs.
    # If a slower moment makes the deadline cut it too (an ETIMEOUT of its own),
    # the stream is run again — the provocation is retried, never the assertion.
    cut = "lint.ruff: stream deadline reached before the next-hop answered"
    for _ in range(5):
        t0 = trio.current_time()
        events, _ = await run_stream(env)
        assert deadline_s <= trio.current_time() - t0 < deadline_s + 10
        if ("ETIMEOUT", cut) not in [(e["code"], e["reason"]) for e in errors(events)]:
            break
        assert reporters(events) == set() and events[-1].type == "RST"
    assert [(e["code"], e["reason"]) for e in errors(events)] == [
        ("ETIMEOUT", "review.hang: stream deadline reached before the next-hop answered")
    ], f"ruff never answered within the {deadline_s:.2f} s stream deadline in 5 streams"
    assert reporters(events) == {"lint.ruff"}
    final_of(events)

    # One window slot and two hanging next-hops: the second waits in the queue
    # (never called, never dropped) until the deadline ends the stream; neither
    # answered, so the stream resets.
    scripted["review.hang"] = ScriptedAdapter("review.hang", delay_s=math.inf)  # its calls counted anew
    scripted["review.hang2"] = ScriptedAdapter("review.hang2", delay_s=math.inf)
    agents = {"review.hang": scripted_agent(timeout_ms=600_000), "review.hang2": scripted_agent(timeout_ms=600_000)}
    env = await router_with(nursery, tmp_path, agents, fanout=["review.hang", "review.hang2"], deadline_ms=500,
                            window={"max_parallel": 1, "max_tokens": 100_000, "max_usd_micros": 100_000})
    events, _ = await run_stream(env)
    # The queued one is told so at once (spec §10 EWINDOW: NACK + WINDOW_UPDATE), never silently.
    assert sorted((e["code"], e["reason"].split(":")[0]) for e in errors(events)) == [
        ("ETIMEOUT", "review.hang"), ("ETIMEOUT", "review.hang2"), ("EWINDOW", "review.hang2")
    ]
    nack = next(e for e in errors(events) if e["code"] == "EWINDOW")
    assert nack["reason"] == "review.hang2: parallel: 2 would exceed window 1; queued until the window opens"
    assert events[-1].type == "RST" and events[-1].payload["code"] == "ETIMEOUT"  # every next-hop timed out
    # Admission follows the route order (equal weights: by name), so the first is the one called.
    assert (len(scripted["review.hang"].calls), len(scripted["review.hang2"].calls)) == (1, 0)


class _NurseryHang(ScriptedAdapter):
    """Hangs inside a nursery of its own, as a tool adapter's sandbox reads its
    pipes: a cancellation leaves it as a group of ``Cancelled``."""

    async def stream(self, prompt):
        self.calls.append(prompt)
        async with trio.open_nursery() as n:
            n.start_soon(trio.sleep_forever)
            await trio.sleep_forever()
        yield Fragment(type=PayloadType.FINAL, content={})  # pragma: no cover (never reached)


async def test_stream_deadline_cuts_a_next_hop_cancelled_inside_its_own_nursery(nursery, tmp_path, scripted):
    """The deadline's cancellation crossing a nursery in the adapter is still a
    cut: the next-hop gets its ETIMEOUT and the stream's window is not halved
    (a cancelled call leaves AIMD alone)."""
    scripted["review.hang"] = ScriptedAdapter("review.hang", delay_s=math.inf)
    scripted["review.nest"] = _NurseryHang("review.nest")
    agents = {"review.hang": scripted_agent(timeout_ms=600_000), "review.nest": scripted_agent(timeout_ms=600_000)}
    env = await router_with(nursery, tmp_path, agents, fanout=["review.hang", "review.nest"], deadline_ms=300)
    events, _ = await run_stream(env)
    assert sorted((e["code"], e["reason"]) for e in errors(events)) == [
        ("ETIMEOUT", "review.hang: stream deadline reached before the next-hop answered"),
        ("ETIMEOUT", "review.nest: stream deadline reached before the next-hop answered"),
    ]
    assert [ev.payload["window"]["max_parallel"] for ev in events if ev.type == "WINDOW_UPDATE"] == []
    assert events[-1].type == "RST" and "review.nest: ETIMEOUT" in events[-1].payload["reason"]
    assert len(scripted["review.nest"].calls) == 1


async def test_budget_too_small_for_an_estimate_skips_that_call(nursery, tmp_path, scripted):
    pricey = scripted["review.pricey"] = ScriptedAdapter.returning(
        "review.pricey", [finding()], estimate=CostEstimate(in_tokens=5_000, out_tokens=1_000, usd=0.002)
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "sec.bandit": BANDIT,
                                                "review.pricey": scripted_agent()},
                            fanout=["lint.ruff", "sec.bandit", "review.pricey"])
    events, sid = await run_stream(env, budget={"usd": 1.0, "tokens": 2_000})
    errs = errors(events)
    assert len(errs) == 1 and errs[0]["code"] == "EBUDGET"
    assert errs[0]["reason"].startswith("review.pricey not called: reserve 6000 tokens")
    assert pricey.calls == []
    assert reporters(events) == {"lint.ruff", "sec.bandit"}
    final_of(events)
    state = env.router.ledger.state(f"stream:anonymous:{sid}")
    assert state.committed_tokens == 0 and state.reserved_tokens == 0 and state.open_reservations == 0


def _spender(name: str, steps: list[int], estimate_tokens: int) -> ScriptedAdapter:
    """Streams PARTIALs whose cumulative usage climbs through ``steps`` tokens
    (as a model adapter reports usage while generating), then a FINAL."""
    frags = [Fragment(type=PayloadType.PARTIAL, content=f"chunk {i}", usage=Usage(in_tokens=t))
             for i, t in enumerate(steps)]
    frags.append(Fragment(type=PayloadType.FINAL, content={"findings": []}, usage=Usage(in_tokens=steps[-1])))
    return ScriptedAdapter(name, frags, delay_s=0.02, estimate=CostEstimate(in_tokens=estimate_tokens))


async def test_committed_spend_never_exceeds_the_budget(nursery, tmp_path, scripted):
    """Two next-hops reserve 400 tokens each of a 1000-token budget, then report
    usage far above their estimates: each is cut (EBUDGET) once its usage passes
    what the budget can still take, and the ledger never commits more than 1000,
    over several concurrent streams."""
    scripted["m.one"] = _spender("m.one", [300, 600, 900, 1200], 400)
    scripted["m.two"] = _spender("m.two", [300, 600, 900, 1200], 400)
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "m.one": scripted_agent(),
                                                "m.two": scripted_agent()},
                            fanout=["lint.ruff", "m.one", "m.two"], budget={"tokens": 1_000})
    results: list[tuple[list[atp.Event], str]] = []

    async def one() -> None:
        results.append(await run_stream(env))

    async with trio.open_nursery() as n:
        for _ in range(4):
            n.start_soon(one)
    for events, sid in results:
        cut = [e for e in errors(events) if e["code"] == "EBUDGET"]
        assert {e["reason"].split(":")[0] for e in cut} == {"m.one", "m.two"}, errors(events)
        assert all("passes what the budget can take" in e["reason"] for e in cut)
        assert reporters(events) == {"lint.ruff"}
        final_of(events)
        state = env.router.ledger.state(f"stream:anonymous:{sid}")
        assert state.limit.tokens == 1_000
        assert state.reserved_tokens == 0 and state.open_reservations == 0
        # Both calls were cut once past the budget: it is spent to the token and
        # what they generated beyond it is recorded as overage, never charged.
        assert state.committed_tokens == 1_000 and state.overage_tokens > 0
    assert len(scripted["m.one"].calls) == 4


async def test_escalation_calls_the_target_only_when_the_first_agents_found_nothing(nursery, tmp_path, scripted):
    big = scripted["review.big"] = ScriptedAdapter.returning(
        "review.big", [finding(file="calc.py", line=2, claim="escalated reviewer's finding")]
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "sec.bandit": BANDIT,
                                                "review.big": scripted_agent()},
                            fanout=["lint.ruff", "sec.bandit"],
                            escalation={"on": ["no_findings"], "to": "review.big"})
    # thefuck#23: the cheap agents find the pickle line, so no escalation.
    events, _ = await run_stream(env)
    final = final_of(events)
    assert big.calls == [] and final["result"]["findings"]
    assert not any("escalated" in u for u in final["result"]["consensus"]["uncertainties"])

    events, _ = await run_stream(env, content=CLEAN)
    final = final_of(events)
    assert len(big.calls) == 1 and big.calls[0].content["diff"] == CLEAN["diff"]
    assert reporters(events) == {"lint.ruff", "sec.bandit", "review.big"}
    assert [f["claim"] for f in final["result"]["findings"]] == ["escalated reviewer's finding"]
    assert "escalated on no_findings" in final["result"]["consensus"]["uncertainties"]
    async with atp.Client(env.url) as c:
        assert 'atp_escalations_total{trigger="no_findings"} 1.0' in await c.metrics()


async def test_each_stream_reports_its_own_escalation_triggers_when_many_finish_together(nursery, tmp_path, scripted):
    """The dispatcher is shared by every stream of a generation: a stream's
    escalation triggers are its own (``TaskOutcome.triggers``), not whatever stream
    finished last. Eight streams at once, four clean (the cheap agents find
    nothing: escalated on ``no_findings``) and four with the golden defect (not
    escalated): the metric counts four, and the audit's escalation records name
    exactly the four clean streams."""
    scripted["review.big"] = ScriptedAdapter.returning(
        "review.big", [finding(file="calc.py", line=2, claim="escalated reviewer's finding")]
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "sec.bandit": BANDIT,
                                                "review.big": scripted_agent()},
                            fanout=["lint.ruff", "sec.bandit"],
                            escalation={"on": ["no_findings"], "to": "review.big"})
    ran: dict[str, bool] = {}

    async def one(clean: bool) -> None:
        events, sid = await run_stream(env, content=CLEAN if clean else None)
        escalated = "escalated on no_findings" in final_of(events)["result"]["consensus"]["uncertainties"]
        assert escalated == clean, (sid, clean)
        ran[sid] = clean

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(one, i % 2 == 0)
    async with atp.Client(env.url) as c:
        assert 'atp_escalations_total{trigger="no_findings"} 4.0' in await c.metrics()
    want = sorted(sid for sid, clean in ran.items() if clean)
    def escalations() -> list[dict]:
        return [r.detail for r in env.router.store.audit_records() if r.kind == "escalation"]

    with trio.move_on_after(5):  # audit records are written behind, in the next group commit
        while sorted(d["stream_id"] for d in escalations()) != want:
            await trio.sleep(0.02)
    audited = escalations()
    assert sorted(d["stream_id"] for d in audited) == want
    assert all(d["triggers"] == ["no_findings"] for d in audited)


class _Probe(ScriptedAdapter):
    """A ScriptedAdapter that records how many calls of the group run at once."""

    def __init__(self, name: str, group: dict[str, int], **kw) -> None:
        super().__init__(name, **kw)
        self.group = group

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        g = self.group
        g["now"] += 1
        g["peak"] = max(g["peak"], g["now"])
        try:
            async for frag in super().stream(prompt):
                yield frag
        finally:
            g["now"] -= 1


async def test_fanout_wider_than_the_window_is_queued_not_dropped(nursery, tmp_path, scripted):
    """§5.1, §10: with a window of one call the router runs the three next-hops one
    after the other (never two at once) and every one of them reports; each
    queued call is announced with a NACK (EWINDOW "queued") followed by a
    WINDOW_UPDATE, never queued silently. With the policy's window of three
    they run together, without NACKs."""
    group = {"now": 0, "peak": 0}
    for name in ("q.a", "q.b", "q.c"):
        scripted[name] = _Probe(name, group, delay_s=0.1)
    env = await router_with(nursery, tmp_path, {n: scripted_agent() for n in ("q.a", "q.b", "q.c")},
                            fanout=["q.a", "q.b", "q.c"],
                            window={"max_parallel": 3, "max_tokens": 100_000, "max_usd_micros": 100_000})
    t0 = trio.current_time()
    events, _ = await run_stream(env, window={"max_parallel": 1, "max_tokens": 100_000, "max_usd_micros": 100_000})
    assert trio.current_time() - t0 >= 0.3
    assert [(e["code"], e["reason"]) for e in errors(events)] == [
        ("EWINDOW", f"{name}: parallel: 2 would exceed window 1; queued until the window opens")
        for name in ("q.b", "q.c")
    ]
    for i, ev in enumerate(events):
        if ev.type == "ERROR":
            assert events[i + 1].type == "WINDOW_UPDATE"
            assert events[i + 1].payload["window"]["max_parallel"] == 1
    assert reporters(events) == {"q.a", "q.b", "q.c"}
    assert group["peak"] == 1
    final_of(events)

    group["peak"] = 0
    events, _ = await run_stream(env)
    assert group["peak"] == 3
    assert errors(events) == [] and reporters(events) == {"q.a", "q.b", "q.c"}


async def test_estimate_larger_than_the_window_is_refused_with_ewindow(nursery, tmp_path, scripted):
    """A next-hop whose estimate alone exceeds the window can never fit: EWINDOW
    plus the WINDOW_UPDATE in force (spec §10: NACK + WINDOW_UPDATE), no call."""
    huge = scripted["review.huge"] = ScriptedAdapter.returning(
        "review.huge", [finding()], estimate=CostEstimate(in_tokens=9_000, out_tokens=2_000)
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "review.huge": scripted_agent()},
                            fanout=["lint.ruff", "review.huge"],
                            window={"max_parallel": 2, "max_tokens": 10_000, "max_usd_micros": 100_000})
    events, _ = await run_stream(env)
    errs = errors(events)
    assert len(errs) == 1 and errs[0]["code"] == "EWINDOW"
    assert errs[0]["reason"] == "review.huge: tokens: 11000 would exceed window 10000"
    i = next(i for i, ev in enumerate(events) if ev.type == "ERROR")
    assert events[i + 1].type == "WINDOW_UPDATE"
    assert events[i + 1].payload == {"kind": "WINDOW_UPDATE", "window": {"max_parallel": 2, "max_tokens": 10_000,
                                                                         "max_usd_micros": 100_000}}
    assert huge.calls == []
    assert reporters(events) == {"lint.ruff"}
    final_of(events)



# --- client faults (issue 7: one tenant's bad input must not take shared agents down)

# A task whose file path the tools refuse (it would escape their work directory).
REFUSED = {"diff": "--- /dev/null\n+++ b/../escape.py\n@@ -0,0 +1 @@\n+x = 1\n", "files": {"../escape.py": "x = 1\n"}}


async def test_refused_input_is_the_clients_error_and_never_opens_a_breaker(nursery, tmp_path, scripted):
    """Six tasks with a refused path (the default breaker opens at five failures):
    each stream is reset with EPROTO naming what was refused, no next-hop is
    retried, rerouted or escalated to, no breaker counts a failure, no window is
    halved, and both tools keep serving the next, valid task."""
    big = scripted["review.big"] = ScriptedAdapter.returning(
        "review.big", [finding(file="calc.py", line=2, claim="escalated reviewer's finding")]
    )
    env = await router_with(nursery, tmp_path, {"lint.ruff": {**RUFF, "fallback": "sec.bandit"},
                                                "sec.bandit": BANDIT, "review.big": scripted_agent()},
                            fanout=["lint.ruff", "sec.bandit"],
                            escalation={"on": ["no_findings"], "to": "review.big"})
    gates = env.router.gates
    tools = ("lint.ruff", "sec.bandit")
    cwnd = {a: gates.agent_windows.window(a).cwnd for a in tools}
    refusal = "refused file path '../escape.py': must be relative and inside the task"
    for _ in range(6):
        events, _ = await run_stream(env, content=REFUSED)
        types = [ev.type for ev in events]
        assert types[0] == "SYN_ACK" and types[-1] == "RST" and "FINAL" not in types
        assert sorted((e["code"], e["reason"]) for e in errors(events)) == [
            ("EPROTO", f"lint.ruff: {refusal}"), ("EPROTO", f"sec.bandit: {refusal}"),
        ]
        rst = events[-1].payload
        assert rst["code"] == "EPROTO" and rst["reason"].startswith("task refused: ")
        assert f"lint.ruff: {refusal}" in rst["reason"] and f"sec.bandit: {refusal}" in rst["reason"]
    stats = gates.breakers.statistics(trio.current_time())
    for agent in tools:
        assert (stats[agent].state, stats[agent].failures, stats[agent].ignored) == ("closed", 0, 6)
        assert gates.agent_windows.window(agent).cwnd == cwnd[agent]
    assert big.calls == []  # the same input is not sent on to the escalation target
    assert gates.breakers.open_agents(trio.current_time()) == set()
    events, _ = await run_stream(env)
    final = final_of(events)
    assert final["result"]["findings"] and reporters(events) == set(tools)


async def test_a_real_agent_fault_still_opens_the_breaker(nursery, tmp_path, scripted):
    scripted["review.down"] = ScriptedAdapter("review.down", fail_with=ErrorCode.EAGENTDOWN,
                                              fail_reason="connection refused")
    env = await router_with(nursery, tmp_path, {"lint.ruff": RUFF, "review.down": scripted_agent()},
                            fanout=["lint.ruff", "review.down"])
    gates = env.router.gates
    for _ in range(5):
        events, _ = await run_stream(env, content=REFUSED)
        rst = events[-1].payload
        # ruff refused the input (the stream's error: the client must fix it) and
        # review.down failed on its own (its ERROR event; its breaker counts it).
        assert rst["code"] == "EPROTO" and "lint.ruff: refused file path" in rst["reason"]
        assert ("EAGENTDOWN", "review.down: connection refused") in {(e["code"], e["reason"]) for e in errors(events)}
    assert gates.breakers.open_agents(trio.current_time()) == {"review.down"}
    stats = gates.breakers.statistics()
    assert (stats["review.down"].failures, stats["lint.ruff"].failures, stats["lint.ruff"].ignored) == (5, 0, 5)
