"""Faults are attributed (issue 19, item 3; findings "a tenant's slow tests take the
runner down for everyone" and "one odd path knocks the analysers out"), over the
wire against a real router with two tenants (alice, bob) and an operator.

The next-hops are the real ones: the ``pytest`` runner, ruff and bandit (local,
tenant-bound: their run is the task's own), and an ``openai_compat`` model
endpoint that is really down (a closed port). What a hostile tenant's task does
to a tenant-bound next-hop — its tests sleep past the hop's ``timeout_ms``, its
path is 2,000 levels deep — is her error (``ETIMEOUT`` / ``EPROTO``), made once,
never retried at the router's expense and never counted by a breaker: Bob is
served by the same next-hops right after. A next-hop really down still opens its
breaker, and a FINAL the FIB routed without it says so.
"""

from __future__ import annotations

import json
import shutil

import atp
import trio

from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from tests.conftest import MECHANICS_RIB, start_router
from tests.helpers import golden, router_metric, start_router_on
from tests.peers import free_port

TOKENS = {"alice": "tok-alice-0000", "bob": "tok-bob-0000", "ops": "tok-ops-0000"}
ROLES = "alice:tok-alice-0000,bob:tok-bob-0000,ops:tok-ops-0000:admin+operator"
META = {"task_type": "code_review", "languages": ["py"]}

#: Alice's tests: they sleep far past the runner's timeout_ms (and its own wall clock).
SLEEPY = {"files": {"test_slow.py": "import time\n\n\ndef test_slow():\n    time.sleep(600)\n"}}
#: Bob's tests: one that passes.
PASSING = {"files": {"test_ok.py": "def test_ok():\n    assert 1 + 1 == 2\n"}}


def deep_path_task() -> dict:
    """A change to one file 2,000 directories deep (the finding's path)."""
    path = "/".join(["d"] * 2_000) + "/x.py"
    return {"diff": f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+import os\n", "files": {path: "import os\n"}}


async def follow(env, tenant: str, content: dict) -> list[atp.Event]:
    async with atp.Client(env.url, TOKENS[tenant], timeout=120) as c:
        _, st = await c.open_stream(task=META, content=content)
        with trio.fail_after(180):
            return [ev async for ev in c.events(st)]


def errors(events: list[atp.Event]) -> list[tuple[str, str]]:
    return [(ev.payload["code"], ev.payload["reason"]) for ev in events if ev.type == "ERROR"]


def final_of(events: list[atp.Event]) -> dict:
    [final] = [ev.payload for ev in events if ev.type == "FINAL"]
    return final


def reporters(events: list[atp.Event]) -> set[str]:
    return {ev.payload["agent"] for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}


async def no_canary_running(env, *agents: str) -> None:
    board = env.router.gates.breakers
    with trio.fail_after(120):
        while any(board.statistics()[a].canary_in_flight for a in agents if a in board.statistics()):
            await trio.sleep(0.05)


async def test_a_tenants_sleeping_tests_time_out_as_her_error_and_the_runner_serves_bob(nursery, tmp_path):
    """Three of Alice's tasks whose tests sleep past the runner's timeout_ms (the
    breaker opens at three peer failures): each is her ETIMEOUT with the reason,
    from one call (no retry: 3 calls in all), and the runner's breaker counts
    nothing of hers; Bob's next task is served by the runner (no 503 EAGENTDOWN)."""
    rib = {
        "agents": {"tests.pytest": {"layer": "L1", "tool": "pytest", "p95_ms": 3000, "timeout_ms": 8000,
                                    "strengths": ["code_review"]}},
        "policies": [{"name": "tests", "match": {"task_type": "code_review"}, "fanout": ["tests.pytest"],
                      "deadline_ms": 120_000}],
    }
    env = await start_router_on(nursery, tmp_path, rib, tokens_env=ROLES, breaker_failures=3)
    alice: list[list[atp.Event]] = []

    async def one() -> None:
        alice.append(await follow(env, "alice", SLEEPY))

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(one)
    for events in alice:
        assert errors(events) == [("ETIMEOUT", ("tests.pytest: no answer within 8000 ms; a local tool's run is the "
                                               "task's own: not retried, not counted against the next-hop"))]
        assert events[-1].type == "RST" and events[-1].payload["code"] == "ETIMEOUT"
        assert events[-1].payload["reason"].startswith("task timed out: tests.pytest: no answer within 8000 ms")
    calls = await router_metric(env.url, "atp_agent_calls_total", TOKENS["ops"])
    assert calls == {'agent="tests.pytest",outcome="ETIMEOUT"': 3.0}  # one call per task: never retried
    await no_canary_running(env, "tests.pytest")
    stats = env.router.gates.breakers.statistics()["tests.pytest"]
    print(f"\nrunner breaker after Alice: {stats}")
    # Her timeouts are not the runner's; only the router's own canary could count (it answered here).
    assert stats.state == "closed" and stats.doubts == 3 and stats.canaries >= 1
    assert stats.failures == stats.canary_failures

    events = await follow(env, "bob", PASSING)
    assert reporters(events) == {"tests.pytest"}
    assert [a["text"] for a in final_of(events)["result"]["answers"]] == ["1 passed, 0 failed"]


async def test_six_tasks_with_an_absurd_path_are_eproto_to_the_sender_and_bob_keeps_his_analysers(
        nursery, tmp_path):
    """Six of Alice's tasks at once, each a file 2,000 levels deep: EPROTO to her,
    no breaker counts it (the default opens at five); Bob's review right after
    still has ruff and bandit, and his FINAL names no next-hop as failed or skipped."""
    policies = tmp_path / "policies"
    shutil.copytree(MECHANICS_RIB, policies)
    env = await start_router(nursery, policies, tokens_env=ROLES)
    task = deep_path_task()
    alice: list[list[atp.Event]] = []

    async def one() -> None:
        alice.append(await follow(env, "alice", task))

    async with trio.open_nursery() as n:
        for _ in range(6):
            n.start_soon(one)
    for events in alice:
        assert events[-1].type == "RST" and events[-1].payload["code"] == "EPROTO", events[-1].payload
        assert {code for code, _ in errors(events)} == {"EPROTO"}
        assert {reason.split(":")[0] for _, reason in errors(events)} == {"lint.ruff", "sec.bandit"}
    await no_canary_running(env, "lint.ruff", "sec.bandit")
    stats = env.router.gates.breakers.statistics()
    assert {a: (stats[a].state, stats[a].failures) for a in ("lint.ruff", "sec.bandit")} == {
        "lint.ruff": ("closed", 0), "sec.bandit": ("closed", 0)}

    events = await follow(env, "bob", golden())
    assert reporters(events) == {"lint.ruff", "sec.bandit"}
    final = final_of(events)
    assert final["result"]["findings"]
    assert not [u for u in final["result"]["consensus"]["uncertainties"] if u.startswith(NEXT_HOP_FAILED)]


async def test_a_next_hop_skipped_for_its_open_circuit_is_named_in_the_final(nursery, tmp_path):
    """A model endpoint really down (nothing listens on its port): its failures are
    its own and open its breaker; Bob's next review is routed without it, and his
    FINAL says so (skipped at routing: circuit open) beside ruff's findings."""
    rib = {
        "models": {"gone": {"provider": "openai_compat", "base_url": f"http://127.0.0.1:{free_port()}/v1",
                            "ctx": "8k", "cost": 0, "strengths": ["code_review"]}},
        "agents": {
            "review.model": {"layer": "L2", "model": "gone", "p95_ms": 1000, "timeout_ms": 10_000},
            "lint.ruff": {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"]},
        },
        "policies": [{"name": "review", "match": {"task_type": "code_review"},
                      "fanout": ["review.model", "lint.ruff"], "budget": {"usd": 0.05, "tokens": 200_000}}],
    }
    env = await start_router_on(nursery, tmp_path, json.dumps(rib), tokens_env=ROLES, breaker_failures=2,
                                breaker_backoff_s=120.0, breaker_max_backoff_s=120.0)
    for _ in range(2):
        events = await follow(env, "alice", golden())
        assert "review.model" in {reason.split(":")[0] for code, reason in errors(events) if code == "EAGENTDOWN"}
        assert reporters(events) == {"lint.ruff"}
    assert env.router.gates.breakers.open_agents(trio.current_time()) == {"review.model"}

    async with atp.Client(env.url, TOKENS["bob"]) as c:
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route["next_hops"] == ["lint.ruff"]
        with trio.fail_after(120):
            events = [ev async for ev in c.events(st)]
    assert errors(events) == []  # not called: no error event, but...
    final = final_of(events)
    [note] = [u for u in final["result"]["consensus"]["uncertainties"] if "review.model" in u]
    print(f"\nBob's FINAL: {note}")
    assert note.startswith(f"{NEXT_HOP_FAILED}review.model: EAGENTDOWN: skipped at routing: circuit open "
                           "(next probe in ")
    assert final["result"]["findings"] and reporters(events) == {"lint.ruff"}
