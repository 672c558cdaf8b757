"""Bounded resources (issue 7, "one task stalls everyone"; spec §10, §11): a tenant's
oversized or pathological task ends with an error naming the limit it hit, and
another tenant's ``GET /v1/health`` keeps answering meanwhile: its worst latency
stays within :data:`HEALTH_FACTOR` times the worst of the same probe against the
idle router just before, at least :data:`HEALTH_FLOOR_S` (issue 20: no absolute
bound that machine load can break). :func:`health_beside`, which the tenant-share
test of ``tests/security/test_tenant_shares.py`` uses too, takes that baseline
afresh for each run of the provocation, which asserts its own condition (the
refusal, the limits hit); a run over the bound is run again, up to
:data:`HEALTH_ATTEMPTS` in all, and the test fails when every run is over: a stall
of the router is there on every run, a burst of load on the machine is not.
``tests/security/test_health_beside.py`` shows it fails a router whose loop stalls.

A real router on loopback (``tests.conftest.start_router``) with the default RIB
(real ruff and bandit next-hops) or a RIB of real ruff next-hops under small
limits. The other tenant is a separate process (:data:`POLLER`) that sends
``GET /v1/health`` every 20 ms on its own clock and reports each answer's latency:
a stall of the router's event loop shows up there whatever this test's own tasks
were doing. The test's clients are created, and the oversized bodies encoded,
before the polling starts, so the test itself does no large work on the event
loop it measures.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import atp
import httpx
import pytest
import trio

from atp_router.adapters.registry import TOOL_FACTORIES
from atp_router.adapters.tools.base import ToolLimits
from atp_router.adapters.tools.ruff import RuffAdapter
from atp_router.policy.rib import AgentSpec
from tests.conftest import RouterEnv, start_router
from tests.helpers import golden, start_router_on

META = {"task_type": "code_review", "languages": ["py"]}
#: Health under a tenant's big task may be this many times slower than idle...
HEALTH_FACTOR = 10.0
#: ...and in any case this slow (s: the idle probe's own scheduling noise).
HEALTH_FLOOR_S = 0.100
#: Provocations run (each after its own idle baseline) before health over its bound fails a test.
HEALTH_ATTEMPTS = 3
#: How long each attempt's idle baseline polls (s, ~50 polls): long enough that its
#: worst is the machine's current noise, not one lucky second.
IDLE_S = 1.0
POLL_S = 0.020
WARM_UP_POLLS = 3  # the first requests open the connection

#: The other tenant: GET /v1/health every PERIOD s (keep-alive) until a byte
#: arrives on stdin, then prints the latencies (s) as a JSON list.
POLLER = r"""
import http.client, json, select, sys, time
host, port, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = http.client.HTTPConnection(host, port, timeout=60)
latencies = []
tick = time.perf_counter()
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    conn.request("GET", "/v1/health")
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        sys.exit(f"health answered {answer.status}")
    latencies.append(time.perf_counter() - t0)
    if len(latencies) == 3:
        print("warm", flush=True)
    tick += period
    time.sleep(max(0.0, tick - time.perf_counter()))
print(json.dumps(latencies), flush=True)
"""


class HealthProbe:
    """What the poller saw: latencies (s) of ``GET /v1/health`` after its warm-up."""

    def __init__(self) -> None:
        self.latencies: list[float] = []


@dataclass(frozen=True)
class HealthAttempt:
    """One attempt of :func:`health_beside`: health's worst latency (s) of
    ``polls`` polls beside the provocation, the same probe's worst against the
    idle router just before, and the bound the worst had to stay under."""

    polls: int
    worst: float
    median: float
    idle_worst: float
    bound: float

    @property
    def within(self) -> bool:
        return self.worst < self.bound

    def __str__(self) -> str:
        return (f"worst {self.worst * 1000:.1f} ms (median {self.median * 1000:.1f} ms, {self.polls} polls) / "
                f"idle worst {self.idle_worst * 1000:.1f} ms / bound {self.bound * 1000:.0f} ms")


async def health_beside(url: str, provoke: Callable[[], Awaitable[None]], *, floor_s: float = HEALTH_FLOOR_S,
                        at_least: int = 3, attempts: int = HEALTH_ATTEMPTS) -> list[HealthAttempt]:
    """Health answers another tenant while ``provoke`` runs (issue 20: the bound
    is relative, and the provocation is retried, never the assertion).

    Each attempt measures health against the idle router for :data:`IDLE_S`
    (:func:`idle_probe`: its worst is this machine's noise right now), then runs
    ``provoke()`` with :data:`POLLER` polling beside it (and a few polls after);
    the attempt holds when health's worst of at least ``at_least`` polls is
    under ``max(HEALTH_FACTOR × idle worst, floor_s)``. ``provoke`` asserts
    itself that its condition happened (the refusal, the limits hit, the 429s):
    its AssertionError fails the test at once. A stall the router causes is
    there on every attempt and a burst of machine load is not: when an attempt
    is over its bound the provocation runs again, up to ``attempts`` in all,
    and only when every one is over does this raise AssertionError listing each
    attempt's worst / idle worst / bound. Each attempt's figures are printed.

    Returns the attempts made (the last one held): a caller whose provocation
    leaves counts behind (breakers' ignored failures) reads how many ran."""
    seen: list[HealthAttempt] = []
    for n in range(1, attempts + 1):
        idle = await idle_probe(url)
        async with health_probe(url) as probe:
            await provoke()
            await trio.sleep(5 * POLL_S)  # a few polls after the provocation too
        assert len(probe.latencies) >= at_least, f"health answered {len(probe.latencies)} polls, not {at_least}"
        idle_worst = max(idle.latencies)
        attempt = HealthAttempt(polls=len(probe.latencies), worst=max(probe.latencies),
                                median=sorted(probe.latencies)[len(probe.latencies) // 2], idle_worst=idle_worst,
                                bound=max(HEALTH_FACTOR * idle_worst, floor_s))
        seen.append(attempt)
        print(f"\nGET /v1/health from another process, attempt {n}/{attempts}: {attempt}"
              f"{'' if attempt.within else ' — over'}")
        if attempt.within:
            return seen
    raise AssertionError(f"health over its bound on all {attempts} attempts: "
                         + "; ".join(f"#{i} {a}" for i, a in enumerate(seen, 1)))


async def idle_probe(url: str, seconds: float = IDLE_S) -> HealthProbe:
    """The same poller against the idle router for ``seconds`` after its warm-up:
    the baseline of :func:`health_beside`. Call it after one ordinary task has run
    (the first task's one-time imports of the tool adapters are not what is measured)."""
    async with health_probe(url) as probe:
        await trio.sleep(seconds + WARM_UP_POLLS * POLL_S)
    assert probe.latencies, "the idle health probe saw no answer"
    return probe


@asynccontextmanager
async def health_probe(url: str) -> AsyncIterator[HealthProbe]:
    """Run :data:`POLLER` against ``url`` for the body of the ``async with`` (it
    starts measuring once warm); the latencies are in the probe on exit."""
    where = urlsplit(url)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", POLLER, where.hostname, str(where.port), str(POLL_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    probe = HealthProbe()
    out = b""
    try:
        with trio.fail_after(30):
            while b"warm\n" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the health poller exited before it was warm"
                out += chunk
        yield probe
        await proc.stdin.send_all(b"stop")
        with trio.fail_after(60):
            while chunk := await proc.stdout.receive_some():
                out += chunk
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
    probe.latencies = json.loads(out.splitlines()[-1])[WARM_UP_POLLS:]


def new_file_diff(path: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join("+" + ln for ln in lines)


def dense(n_bytes: int) -> str:
    """~``n_bytes`` of Python (whole lines) on which ruff reports several findings
    per line: its JSON report is ~80 times the input."""
    line = "def f{i}(a=[]):\n    eval(a); x == None; import os\n"
    return "".join(line.format(i=i) for i in range(math.ceil(n_bytes / len(line.format(i=0)))))


async def open_raw(h: httpx.AsyncClient, body: bytes) -> str:
    """POST /v1/streams with an already encoded body; the new stream's id."""
    r = await h.post("/v1/streams", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    return r.json()["stream_id"]


async def follow(c: atp.Client, stream_id: str) -> list[atp.Event]:
    with trio.fail_after(60):
        return [ev async for ev in c.events(stream_id)]


async def big_task_refused_beside_health(env: RouterEnv, meta: dict) -> list[HealthAttempt]:
    """The 5 MB attack of issue 7 while another tenant polls health
    (:func:`health_beside`, default floor): each run of it asserts that the task
    reached the router and was refused for its size, within 10 s. The body is
    encoded and the clients opened before any polling."""
    text = "".join(f"value_{i} = compute({i}, key='k{i}')\n" for i in range(150_000))
    assert len(text) > 5_000_000
    body = json.dumps({"task": meta, "content": {"diff": new_file_diff("big.py", text), "files": {"big.py": text}}})
    body_bytes = body.encode()
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as h, atp.Client(env.url) as c:

        async def provoke() -> None:
            t0 = trio.current_time()
            events = await follow(c, await open_raw(h, body_bytes))
            took = trio.current_time() - t0
            # The condition happened: the 5 MB task reached the router and was refused for its size.
            assert_refused_for_size(events)
            print(f"\n5 MB task refused in {took * 1000:.0f} ms")
            assert took < 10

        return await health_beside(env.url, provoke)


def assert_refused_for_size(events: list[atp.Event]) -> None:
    rst = events[-1]
    assert rst.type == "RST" and "FINAL" not in [ev.type for ev in events]
    assert rst.payload["code"] == "EPROTO"
    for agent in ("lint.ruff", "sec.bandit"):
        assert f"{agent}: content.files['big.py'] is at least" in rst.payload["reason"]
    assert "over the limit max_file_bytes=1,048,576 (1 MiB)" in rst.payload["reason"]


async def assert_tools_still_serve(env: RouterEnv) -> None:
    """Nothing was counted against the shared tools: the next tenant's task runs on both."""
    assert env.router.gates.breakers.open_agents(trio.current_time()) == set()
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        with trio.fail_after(60):
            final = await c.result(st)
    assert {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]} == {"lint.ruff",
                                                                                              "sec.bandit"}


async def test_5mb_file_is_refused_without_delaying_another_tenants_health(nursery, policies_dir: Path):
    """Issue 7: a 2 MB file froze the router ~31 s, 5 MB ~75 s. The 5 MB file must
    be refused (RST EPROTO naming ``max_file_bytes``) with health answering
    throughout within a factor of its idle latency (:func:`health_beside`).

    Guards that freeze (tens of seconds: over any bound here, on every attempt)
    and issue 20's on-loop step: the 13 MB body decoded and its diff counted on
    the event loop, ~120 ms in one step (592 ms at worst at load ~2, where idle
    health was 25–41 ms: over 10× that); now both run in a worker thread. The
    ~120 ms step itself fails only against a quiet machine (idle worst under 12 ms)."""
    env = await start_router(nursery, policies_dir)
    await assert_tools_still_serve(env)  # warm: one ordinary task first
    await big_task_refused_beside_health(env, META)
    await assert_tools_still_serve(env)


async def test_5mb_file_past_the_syn_is_refused_by_the_tools_off_the_event_loop(nursery, policies_dir: Path):
    """The same 5 MB task with ``diff_loc`` given in the meta, so nothing counts
    the diff: reading and decoding the body, routing, and both tools refusing
    the file (in worker threads, before anything is written or run) keep health
    within a factor of its idle latency (:func:`health_beside`).

    Guards issue 7's freeze past the SYN (the tools writing and analysing the
    5 MB file: ~75 s) and the on-loop decode of the body (592 ms at load ~2):
    both stay over the bound on every attempt."""
    env = await start_router(nursery, policies_dir)
    await assert_tools_still_serve(env)  # warm: one ordinary task first
    await big_task_refused_beside_health(env, {**META, "diff_loc": 150_000})
    await assert_tools_still_serve(env)


class _Spinner(RuffAdapter):
    """Stands in for an analyser stuck on a pathological input: a real subprocess
    (the venv's python) that burns CPU until its RLIMIT_CPU stops it. No real
    analyser can be made to spin on demand."""

    tool = "python"

    def argv(self, paths: list[str]) -> list[str]:
        return ["-c", "while True: pass", *paths]


#: RIB: one next-hop per limit, each a real ruff under a small limit (the spinner
#: under a 1 s CPU limit), and an ordinary ruff next-hop for the other tenants.
LIMITS_RIB = {
    "agents": {
        "lint.mem": {"layer": "L1", "tool": "ruff", "p95_ms": 200, "scope": "file",
                     "options": {"address_space_bytes": 64 * 2**20}},
        "lint.out": {"layer": "L1", "tool": "ruff", "p95_ms": 200, "scope": "file",
                     "options": {"output_bytes": 2**20}},
        "lint.spin": {"layer": "L1", "tool": "ruff", "p95_ms": 200, "scope": "file", "options": {"cpu_s": 1}},
        "lint.ruff": {"layer": "L1", "tool": "ruff", "p95_ms": 200},
    },
    "policies": [
        {"name": "mem", "match": {"task_type": "lim_mem"}, "fanout": ["lint.mem"]},
        {"name": "out", "match": {"task_type": "lim_out"}, "fanout": ["lint.out"]},
        {"name": "spin", "match": {"task_type": "lim_spin"}, "fanout": ["lint.spin"]},
        {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["lint.ruff"]},
    ],
}


def _limited_ruff(name: str, agent: AgentSpec):
    """``tool: ruff`` with :class:`ToolLimits` read from ``agent.options`` (what
    the registry's ruff factory does once it takes limit options)."""
    cls = _Spinner if name == "lint.spin" else RuffAdapter
    return cls(name, scope=agent.scope, limits=ToolLimits.from_options(agent.options))


#: Health's floor while the three limited tools run: three analysers, one burning a
#: whole core for 1 s, share a 2-core machine with the router. Beside eight busy
#: processes health measured 220–433 ms against an idle worst of 20–25 ms (all three
#: attempts over 10× idle), from CPU contention alone; the stall guarded against — the
#: spinner's 1 s, or a freeze — is well over it.
TOOLS_HEALTH_FLOOR_S = 0.6


async def test_tools_past_their_limits_fail_cleanly_and_the_router_keeps_serving(nursery, tmp_path, monkeypatch):
    """Three tasks at once, each past one limit of its tool (address space, output,
    CPU: the spinner burns its 1 s): each ends RST EPROTO naming its limit, no
    breaker counts it against the tool, and health stays within a factor of its
    idle latency (:func:`health_beside`, floor :data:`TOOLS_HEALTH_FLOOR_S`)
    while the three run.

    Guards a tool run or its output read on the event loop: the spinner's 1 s of
    CPU, or ruff's report of ~80× its input decoded there, is a stall over the
    bound on every attempt."""
    monkeypatch.setitem(TOOL_FACTORIES, "ruff", _limited_ruff)
    env = await start_router_on(nursery, tmp_path, LIMITS_RIB)
    tasks = {
        "lim_mem": ({"files": {"d.py": dense(600 * 1024)}},
                    "lint.mem: ruff ran out of its address-space limit address_space_bytes=67,108,864 (64 MiB)"),
        "lim_out": ({"files": {"d.py": dense(64 * 1024)}},
                    "lint.out: ruff wrote more than the output limit output_bytes=1,048,576 (1 MiB) for this task"),
        "lim_spin": ({"files": {"a.py": "x = 1\n"}},
                     "lint.spin: python used up its CPU limit cpu_s=1 s on this task; killed"),
    }
    bodies = {t: json.dumps({"task": {"task_type": t}, "content": content}).encode() for t, (content, _) in tasks.items()}
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as h, atp.Client(env.url) as c:

        async def provoke() -> None:
            results: dict[str, list[atp.Event]] = {}

            async def one(task_type: str) -> None:
                results[task_type] = await follow(c, await open_raw(h, bodies[task_type]))

            async with trio.open_nursery() as tenants:
                for t in tasks:
                    tenants.start_soon(one, t)
            # The condition happened: each task hit its limit (three RSTs naming it).
            for task_type, (_, reason) in tasks.items():
                rst = results[task_type][-1]
                assert rst.type == "RST" and rst.payload["code"] == "EPROTO", (task_type, rst)
                assert reason in rst.payload["reason"], (task_type, rst.payload["reason"])

        runs = len(await health_beside(env.url, provoke, floor_s=TOOLS_HEALTH_FLOOR_S))
    # The limits were the tasks', not the tools': every breaker closed, nothing counted
    # (one ignored failure per run of the three tasks).
    stats = env.router.gates.breakers.statistics(trio.current_time())
    assert {a: (s.state, s.failures, s.ignored) for a, s in stats.items()} == {
        "lint.mem": ("closed", 0, runs), "lint.out": ("closed", 0, runs), "lint.spin": ("closed", 0, runs),
    }
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        with trio.fail_after(60):
            final = await c.result(st)
    assert final["result"]["findings"]


@pytest.mark.parametrize("limit", ["max_files", "max_diff_bytes"])
async def test_other_task_limits_are_client_errors(nursery, policies_dir: Path, limit: str):
    """Too many files or too big a diff: RST EPROTO naming the limit, from both tools."""
    env = await start_router(nursery, policies_dir)
    if limit == "max_files":
        content = {"diff": "", "files": {f"pkg/m{i}.py": "x = 1\n" for i in range(2001)}}
        named = "content.files has 2,001 files, over the limit max_files=2,000"
    else:
        text = "y = 2\n" * 1_500_000  # 9 MB of diff
        content = {"diff": new_file_diff("gen.py", text), "files": {"gen.py": "x = 1\n"}}
        named = "over the limit max_diff_bytes=8,388,608 (8 MiB)"
    meta = {**META, "diff_loc": 1_500_000}  # see test_5mb_file_is_refused_without_delaying_another_tenants_health
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as h, atp.Client(env.url) as c:
        rst = (await follow(c, await open_raw(h, json.dumps({"task": meta, "content": content}).encode())))[-1]
    assert rst.type == "RST" and rst.payload["code"] == "EPROTO"
    assert rst.payload["reason"].count(named) == 2, rst.payload["reason"]
