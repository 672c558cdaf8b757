"""What the live status snapshot costs the router's event loop (issue 11 item 4).

Run: ``python bench/bench_status.py [--open N ...] [--closed M]``. Plain script,
seconds. A real in-process router (scripted next-hop, nothing served over the
network) gets N open streams (opened without a task: they wait, as many
clients' streams do) and M closed, compacted code-review streams, then, in
the same run:

* **baseline**: rendering ``GET /v1/metrics`` (what a Prometheus scrape costs
  now), and copying the stream table (``list(streams.values())``);
* **status**: one :class:`~atp_router.runtime.admin.status.StatusBuilder` snapshot (scan +
  build + JSON encode), first (it reads up to ``max_closed_per_scan`` closed
  logs) and steady (nothing new), its size, and the longest stretch the event
  loop is held: the largest of :class:`~atp_router.runtime.admin.statuspage.StatusFeed`'s chunks
  (2,000 streams, a checkpoint between them) and the build after them.

Times are CPU ms of the event loop's thread (``time.thread_time``), best of
5, on this machine; compare columns, not machines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio
import trio.lowlevel

import atp_router.policy.rib
from atp_router.adapters.registry import TOOL_FACTORIES
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from atp_router.deploy.cli import run
from atp_router.runtime.admin.status import StatusBuilder
from atp_router.runtime.config import RouterConfig
from atp_router.security.identity import ANONYMOUS

AGENT = {"layer": "L2", "tool": "scripted", "p95_ms": 300, "timeout_ms": 30_000, "strengths": ["code_review"]}
RIB = {"agents": {"fast": AGENT}, "policies": [{"name": "review", "match": {"task_type": "code_review"},
                                                "fanout": ["fast"]}]}
CHUNK = 2000


def best(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times) * 1000


def snapshot_ms(router, builder: StatusBuilder) -> tuple[float, float, int]:
    """(whole snapshot ms, longest loop hold ms, bytes) of one snapshot."""
    t0 = time.thread_time()
    scan = builder.scan(trio.current_time(), int(time.time() * 1000))
    ctxs = list(router.streams.values())
    held = 0.0
    for i in range(0, len(ctxs), CHUNK):
        c0 = time.thread_time()
        scan.feed(ctxs[i:i + CHUNK])
        held = max(held, time.thread_time() - c0)
    b0 = time.thread_time()
    data = builder.encode(builder.build(router, scan))
    held = max(held, time.thread_time() - b0)
    return (time.thread_time() - t0) * 1000, held * 1000, len(data)


async def main(opens: list[int], closed: int) -> None:
    atp_router.policy.rib.TOOLS = atp_router.policy.rib.TOOLS | {"scripted"}
    fast = ScriptedAdapter.returning("fast", usage=Usage(100, 20, 250))
    TOOL_FACTORIES["scripted"] = lambda name, agent: fast
    tmp = Path(tempfile.mkdtemp(prefix="atp-bench-status-"))
    (tmp / "rib.yaml").write_text(json.dumps(RIB))
    cfg = RouterConfig(policies=tmp / "rib.yaml", http_port=0, ws_port=0, max_streams=max(opens) + closed + 10,
                       tenant_max_streams=max(opens) + closed + 10, tenant_rate_per_s=1e9, tenant_rate_burst=10**9,
                       retain_closed_max=closed + 10, idle_task_s=3600)
    task = {"diff": "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n", "files": {"x.py": "a = 2\n"}}
    async with trio.open_nursery() as nursery:
        router, _, _ = await nursery.start(run, cfg)
        for _ in range(closed):
            ctx = router.open_stream(task={"task_type": "code_review"}, content=task, budget=None, qos=None,
                                     window=None, idempotency_key=None, identity=ANONYMOUS)
            while not ctx.log.closed:
                await trio.lowlevel.checkpoint()
            ctx.log.compact()
        print(f"{closed} closed streams retained (compacted logs)\n")
        print(f"{'open':>7} {'metrics':>9} {'table copy':>11} {'first snap':>11} {'steady':>8} {'max hold':>9} "
              f"{'bytes':>8}")
        opened = 0
        for n in sorted(opens):
            while opened < n:
                router.open_stream(task={"task_type": "code_review"}, content=None, budget=None, qos=None,
                                   window=None, idempotency_key=None, identity=ANONYMOUS)
                opened += 1
            metrics = best(router.metrics.render)
            copy = best(lambda: list(router.streams.values()))
            builder = StatusBuilder()
            first, _, _ = snapshot_ms(router, builder)
            runs = [snapshot_ms(router, builder) for _ in range(5)]
            steady = min(r[0] for r in runs)
            hold = min(r[1] for r in runs)
            size = runs[-1][2]
            print(f"{n:>7} {metrics:>8.2f}ms {copy:>10.2f}ms {first:>10.2f}ms {steady:>7.2f}ms {hold:>8.2f}ms "
                  f"{size:>8}")
        nursery.cancel_scope.cancel()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open", type=int, nargs="+", default=[100, 1000, 5000, 10000])
    ap.add_argument("--closed", type=int, default=1000)
    args = ap.parse_args()
    trio.run(main, args.open, args.closed)
