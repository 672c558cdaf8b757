"""How many router functions a task goes through, ``POST /v1/streams`` → FINAL (issue 21).

Run: ``python bench/taskpath_hops.py [--tasks N]``. Plain script, a few seconds.

A real router (``single.build`` on a RIB of one next-hop, served on loopback by the
same ``run`` the CLI uses) serves one warm-up task, then ``N`` tasks, one at a time,
each opened by ``POST /v1/streams`` and followed by ``GET /v1/streams/{id}/events``
to its FINAL with ``httpx``. The next-hop is a
:class:`~atp_router.adapters.testing.ScriptedAdapter` returning one finding: the
path measured is the router's own, not a tool's.

What is counted (issue 21 names no definition of a hop; these three are measured,
on the event loop's thread with ``sys.setprofile``, from the request's arrival to
the FINAL's SSE write; functions the router also runs while idle — timers,
tickers, over an idle period as long as the tasks took — are subtracted):

* ``task_path`` — **the hops**: the runtime functions (``atp_router.runtime`` and
  ``atp_router.deploy``: ingresses, data plane, control plane, composition roots;
  not the HTTP server the API runs on, :data:`TRANSPORT`, as hypercorn's were not)
  on the call stack at each point of the task's path — each SYN stage run, the
  task spawned, the next-hop called, each frame appended to the stream's log
  (SYN+ACK, PARTIAL, FINAL, FIN), each frame taken for the client or the store —
  the point itself included when it is the runtime's (a stage, the log). This
  is the chain a reader follows from ``POST /v1/streams`` to the FINAL, and what
  the issue's "goes through N hops" counts. A FINAL is sent only once durable,
  so the store writer's frames are on the path.
* ``functions`` — every distinct runtime function the task enters, helpers and
  properties included (a wider measure: 171 when this script was written).
* ``module_crossings`` — distinct calls from one runtime module into another.
* ``depth`` — the longest chain of runtime frames on one stack.

The sans-IO core a task is *worked* by (``wire``, ``flow``, ``policy``,
``consensus``, ``task``, ``security``, ``observability``, ``store``, the
adapters) is not counted; its functions are summed per package.

Prints the path's functions (``--all``: also every function entered and every
module crossing), then exactly one last line::

    HOPS task_path=<n> functions=<f> module_crossings=<c> depth=<d> core_functions=<k> tasks=<N>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atp_router.adapters.testing import ScriptedAdapter  # noqa: E402
from atp_router.consensus.types import AgentFinding, Severity, Usage  # noqa: E402
from tests.conftest import start_router  # noqa: E402
from tests.helpers import serve_scripted  # noqa: E402

RUNTIME = ("atp_router.runtime.", "atp_router.deploy.")
#: The HTTP server the API runs on (issue 25 item 4): a transport, as hypercorn was (a
#: library, never counted) — its per-connection frames are not the router's path; and the
#: app's dispatch of a static route (hot_routes: Starlette's routing, a library never
#: counted, without its route search).
TRANSPORT = frozenset({"atp_router.runtime.ingress.server", "atp_router.runtime.ingress.listen",
                       "atp_router.runtime.ingress.hot_routes", "atp_router.deploy.http_serve"})


def _runtime(module: str) -> bool:
    return module.startswith(RUNTIME) and module not in TRANSPORT
DIFF = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
RIB = """
agents:
  review.one: {layer: L2, tool: scripted, p95_ms: 300, timeout_ms: 30000, strengths: [code_review]}
policies:
  - {name: review, match: {task_type: code_review}, fanout: [review.one]}
"""


def _milestone(module: str, qualname: str, caller: FrameType | None) -> bool:
    """A point of the task's path: a SYN stage run, the task spawned (a trio
    ``start_soon`` from the runtime), a next-hop's ``stream`` called, a frame
    appended to the stream's log (SYN+ACK, PARTIAL, FINAL, FIN), a frame
    written to the client (an event's JSON taken by the SSE generator)."""
    if module == "atp_router.runtime.dataplane.opening" and qualname.endswith("__call__"):
        return True
    if module.startswith("atp_router.adapters.") and qualname.endswith(".stream"):
        return True
    if module == "atp_router.runtime.dataplane.eventlog" and qualname in ("EventLog.append", "LoggedEvent.json_bytes"):
        return True
    return (module.startswith("trio.") and qualname.endswith("Nursery.start_soon") and caller is not None
            and _runtime(caller.f_globals.get("__name__", "")))


class Profile:
    """``sys.setprofile`` hook: the functions entered (by module and qualname) and
    the deepest chain of runtime frames on one stack."""

    def __init__(self) -> None:
        self.entered: Counter[tuple[str, str]] = Counter()
        self.crossings: set[tuple[str, str, str, str]] = set()
        self.spine: set[tuple[str, str]] = set()
        self.depth = 0
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if _milestone(module, frame.f_code.co_qualname, frame.f_back):
            f: FrameType | None = frame  # the point itself when it is the runtime's (a SYN stage, the log)
            while f is not None:
                m = f.f_globals.get("__name__", "")
                if _runtime(m) and "__create_fn__" not in f.f_code.co_qualname:
                    self.spine.add((m, f.f_code.co_qualname))
                f = f.f_back
        if not module.startswith("atp_router."):
            return
        self.entered[(module, frame.f_code.co_qualname)] += 1
        caller = frame.f_back
        cmod = caller.f_globals.get("__name__", "") if caller is not None else ""
        if caller is not None and _runtime(cmod) and _runtime(module) and cmod != module:
            self.crossings.add((cmod, caller.f_code.co_qualname, module, frame.f_code.co_qualname))
        if _runtime(module):
            depth, f = 0, frame
            while f is not None:
                if _runtime(f.f_globals.get("__name__", "")):
                    depth += 1
                f = f.f_back
            self.depth = max(self.depth, depth)


async def one_task(client: httpx.AsyncClient, url: str) -> None:
    r = await client.post(f"{url}/v1/streams", json={
        "task": {"task_type": "code_review", "languages": ["py"]},
        "content": {"diff": DIFF, "files": {"calc.py": "def add(a, b):\n    return a + b\n"}}})
    r.raise_for_status()
    sid = r.json()["stream_id"]
    async with client.stream("GET", f"{url}/v1/streams/{sid}/events") as events:
        async for line in events.aiter_lines():
            if line == "event: FIN":
                return
    raise RuntimeError(f"stream {sid} ended without FIN")


async def measure(tasks: int) -> tuple[Profile, Profile]:
    mp = pytest.MonkeyPatch()
    finding = AgentFinding(file="calc.py", start=2, end=2, severity=Severity.LOW, claim="a claim", confidence=0.9)
    serve_scripted(mp, {"review.one": ScriptedAdapter.returning("review.one", [finding], usage=Usage(10, 5, 1))})
    busy, idle = Profile(), Profile()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rib = Path(tmp) / "rib.yaml"
            rib.write_text(RIB)
            async with trio.open_nursery() as nursery:
                env = await start_router(nursery, rib, state_dir=Path(tmp) / "state")
                async with httpx.AsyncClient(timeout=30) as client:
                    await one_task(client, env.url)  # warm: imports, first-use caches
                    sys.setprofile(busy)
                    busy.on, t0 = True, time.monotonic()
                    for _ in range(tasks):
                        await one_task(client, env.url)
                    busy.on, took = False, time.monotonic() - t0
                    sys.setprofile(idle)
                    idle.on = True
                    await trio.sleep(max(took, 1.0))
                    idle.on = False
                    sys.setprofile(None)
                nursery.cancel_scope.cancel()
    finally:
        sys.setprofile(None)
        mp.undo()
    return busy, idle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=3, help="tasks measured after the warm-up one")
    ap.add_argument("--all", action="store_true",
                    help="also list every runtime function entered and every call between runtime modules")
    args = ap.parse_args(argv)
    busy, idle = trio.run(measure, args.tasks)
    entered = sorted(k for k in busy.entered if _runtime(k[0]) and k not in idle.entered)
    core = Counter(k[0].split(".")[1] for k in busy.entered
                   if not k[0].startswith(RUNTIME) and k not in idle.entered)
    edges = sorted(busy.crossings - idle.crossings)
    spine = sorted(busy.spine - idle.spine)
    if args.all:
        print(f"runtime functions entered ({len(entered)}):")
        print("".join(f"  {m.removeprefix('atp_router.')}.{n}\n" for m, n in entered), end="")
        print(f"calls from one runtime module into another ({len(edges)}):")
        print("".join(f"  {cm.removeprefix('atp_router.')}.{cf} -> {m.removeprefix('atp_router.')}.{f}\n"
                      for cm, cf, m, f in edges), end="")
    print("core functions by package (not counted): " + ", ".join(f"{p} {n}" for p, n in sorted(core.items())))
    print(f"the task's path: runtime functions on the stack at its points ({len(spine)}):")
    print("".join(f"  {m.removeprefix('atp_router.')}.{n}\n" for m, n in spine), end="")
    print(f"HOPS task_path={len(spine)} functions={len(entered)} module_crossings={len(edges)} depth={busy.depth} "
          f"core_functions={sum(core.values())} tasks={args.tasks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
