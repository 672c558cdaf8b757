"""``atp-router --workers N``: closed-loop tasks/s with 1 and 2 workers, and what the
shared budget ledger adds per task (issue 10 item 4).

Run: ``python bench/bench_workers.py [--seconds 6] [--repeats 3] [--in-flight 32]
[--tasks 3000]``. Plain script, ≈ 2 min on 2 cores. Two parts, each comparing in
the same run:

1. **Throughput.** bench_gateway.py's fast mock OpenAI upstream (its own process)
   and two routers started side by side on their own state directories and ports:
   ``atp-router --workers 1`` and ``atp-router --workers 2`` (a supervisor and two
   worker processes), the same RIB (bench_gateway.py's, plus the tenant
   ``bench`` with a token budget, so every call goes through the budget ledger:
   the in-memory one with 1 worker, the store's shared one with 2). One load
   generator (this process: trio + httpx, bench_gateway.py's ``Drivers``) keeps
   ``--in-flight`` tasks in flight over HTTP+SSE (``POST /v1/streams`` then
   ``GET /v1/streams/{id}/events`` to the FINAL) for ``--seconds`` s, against
   each router in turn, ``--repeats`` times interleaved; tasks/s best and median,
   and the routers' CPU ms per task (``/proc``, the supervisor and its workers
   together), the load generator's too: all of it shares the machine's cores.
   A task counts only when it completed whole (the FINAL with the mock's last
   token).

2. **Shared ledger cost.** In this process, on a fresh SQLite state directory
   each, what one task does to the ledger — open the stream's account under the
   tenant's, reserve the estimate, commit the usage, close the account — timed
   over ``--tasks`` tasks: (a) the single-process ledger (``BudgetLedger``
   journaled to the store, as one router does today), (b) the shared ledger
   (``SharedBudgetLedger``: each step one ``BEGIN IMMEDIATE`` transaction along
   the account chain, write lock shared across processes), (c) the same with a
   second process hammering the same tenant account at once (contention). The
   added latency per task is (b) − (a) and (c) − (a).

The last line is ``WORKERS tasks_per_s w1=<x> w2=<y> ledger_us_per_task
single=<a> shared=<b> contended=<c>``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import bench_gateway as gw  # its mock upstream, load driver, /proc helpers

TENANT_BUDGET = """\
clients:
  bench: {{budget: {{tokens: 1000000000000}}, max_streams: 100000, rate: {{per_s: 100000, burst: 100000}}}}
"""


# --- part 2: the ledger alone -------------------------------------------------------------

_LEDGER_TASKS = textwrap.dedent("""
    import sys, time
    from atp_router.flow.budget import Allowance, BudgetLedger, SharedBudgetLedger
    from atp_router.store import SqliteStore, StoreJournal

    def run(kind, state, n, name):
        if kind == "single":
            store = SqliteStore.open(state)
            ledger = BudgetLedger(journal=StoreJournal(store))
        else:
            store = SqliteStore.open(state, multiprocess=True)
            ledger = SharedBudgetLedger(store, owner=name)
        ledger.open("client:bench", Allowance(tokens=10**15, usd_micros=10**15))
        t0 = time.perf_counter()
        for i in range(n):
            key = f"stream:bench:{name}-{i}"
            ledger.open(key, Allowance(tokens=100_000), parent="client:bench")
            r = ledger.reserve(key, 120, 50)
            ledger.commit(r, 46, 20)
            ledger.close(key)
        return (time.perf_counter() - t0) / n * 1e6

    if __name__ == "__main__":
        print(run(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]), flush=True)
""")


def ledger_cost(tasks: int, tmp: Path) -> dict[str, float]:
    """µs per task of the ledger steps (see the module docstring, part 2): best of
    3 alternating rounds for (a) and (b); (c) the median of the two contenders."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = tmp / "ledger_tasks.py"
    script.write_text(_LEDGER_TASKS)

    def one(kind: str, n: int) -> float:
        state = Path(tempfile.mkdtemp(dir=tmp))
        out = subprocess.run([sys.executable, str(script), kind, str(state), str(n), "w0.1"], env=env,
                             capture_output=True, text=True, check=True)
        return float(out.stdout)

    res: dict[str, list[float]] = {"single": [], "shared": []}
    for _ in range(3):
        for kind, times in res.items():
            times.append(one(kind, tasks))
    state = Path(tempfile.mkdtemp(dir=tmp))
    procs = [subprocess.Popen([sys.executable, str(script), "shared", str(state), str(tasks), f"w{i}.{i}"], env=env,
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    contended = [float(p.communicate()[0]) for p in procs]
    return {"single": min(res["single"]), "shared": min(res["shared"]), "contended": statistics.median(contended)}


# --- part 1: the routers ------------------------------------------------------------------


async def throughput(args: argparse.Namespace, urls: dict[str, str], key: str, pids: dict[str, int]) -> dict:
    import trio

    out: dict[str, dict] = {n: {"tasks_s": [], "tasks": 0, "failed": 0, "cpu": 0.0} for n in urls}
    client_cpu = 0.0
    drivers = {}
    for name, url in urls.items():
        drivers[name] = await gw.Drivers({"atp_http": url}, {"atp_http": key}).__aenter__()
    try:
        for name in urls:  # warm-up: connections, imports, the tenant's account
            await gw.closed_loop(drivers[name], "atp_http", args.in_flight, 1.5)
        for r in range(args.repeats):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                c0, s0 = gw.cpu_s(pids[name]), time.process_time()
                res = await gw.closed_loop(drivers[name], "atp_http", args.in_flight, args.seconds)
                out[name]["cpu"] += gw.cpu_s(pids[name]) - c0
                client_cpu += time.process_time() - s0
                out[name]["tasks_s"].append(res["tasks_s"])
                out[name]["tasks"] += res["tasks"]
                out[name]["failed"] += res["failed"]
                print(f"  run {r + 1}/{args.repeats} {name}: {res['tasks_s']:.1f} tasks/s "
                      f"({res['tasks']} tasks, {res['failed']} failed)", flush=True)
                await trio.sleep(0.5)
    finally:
        for d in drivers.values():
            await d.__aexit__(None, None, None)
    total = sum(v["tasks"] for v in out.values())
    return {"routers": out, "client_cpu_ms": client_cpu / max(total, 1) * 1000}


def bench(args: argparse.Namespace) -> int:
    import trio

    print(f"bench_workers: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_workers_"))
    procs: list[subprocess.Popen] = []
    key = "atp-" + secrets.token_hex(32)
    try:
        print(f"part 2: ledger steps per task, {args.tasks} tasks ...", flush=True)
        ledger = ledger_cost(args.tasks, tmp)
        started = gw.start_mock(tmp, procs)
        if started is None:
            return 1
        mock_port, mock = started
        urls, pids = {}, {}
        exe = None
        if args.pin_client is not None:
            others = sorted(os.sched_getaffinity(0) - {args.pin_client})
            if args.pin_client not in os.sched_getaffinity(0) or not others:
                print(f"bench_workers: --pin-client {args.pin_client} needs that CPU and at least one other "
                      f"(this process may use {sorted(os.sched_getaffinity(0))})", file=sys.stderr)
                return 2
            # The routers (their workers inherit it) on every other CPU; the load generator alone on its own.
            exe = ["taskset", "-c", ",".join(map(str, others)), str(Path(sys.executable).parent / "atp-router")]
            os.sched_setaffinity(mock.pid, others)
            print(f"routers and the mock on CPUs {others}, the load generator on CPU {args.pin_client}", flush=True)
        for n in (1, 2):
            name = f"w{n}"
            print(f"starting: atp-router --workers {n}", flush=True)
            r = gw.start_router(tmp / name, gw.RIB.format(port=mock_port) + TENANT_BUDGET.format(), procs, key=key,
                                args=["--workers", str(n)], timeout_s=90, exe=exe)
            if r is None:
                return 1
            urls[name], pids[name] = r.url, r.proc.pid
        print(f"part 1: closed loop, {args.in_flight} in flight over HTTP+SSE, {args.seconds:g} s x "
              f"{args.repeats} per router, interleaved", flush=True)
        if args.pin_client is not None:
            os.sched_setaffinity(0, {args.pin_client})
        res = trio.run(throughput, args, urls, key, pids)
    finally:
        gw.stop_procs(procs, 20)

    print()
    print(f"{'router':<22}{'tasks/s best':>14}{'median':>10}{'router CPU ms/task':>20}{'failed':>8}")
    best = {}
    for name, r in res["routers"].items():
        best[name] = max(r["tasks_s"])
        cpu = r["cpu"] / max(r["tasks"], 1) * 1000
        print(f"{'--workers ' + name[1:]:<22}{best[name]:>14.1f}{statistics.median(r['tasks_s']):>10.1f}"
              f"{cpu:>20.2f}{r['failed']:>8}")
    where = f"CPU {args.pin_client} alone" if args.pin_client is not None else "same cores"
    print(f"load generator CPU {res['client_cpu_ms']:.2f} ms a task ({where})")
    print(f"speed-up 2 workers / 1: {best['w2'] / best['w1']:.2f}x")
    print()
    print(f"ledger per task (open account, reserve, commit, close), µs: single-process {ledger['single']:.0f}, "
          f"shared {ledger['shared']:.0f} (+{ledger['shared'] - ledger['single']:.0f}), "
          f"shared with a second process contending {ledger['contended']:.0f} "
          f"(+{ledger['contended'] - ledger['single']:.0f})")
    print(f"WORKERS tasks_per_s w1={best['w1']:.1f} w2={best['w2']:.1f} ledger_us_per_task "
          f"single={ledger['single']:.0f} shared={ledger['shared']:.0f} contended={ledger['contended']:.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="closed-loop seconds per router and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per router")
    ap.add_argument("--in-flight", type=int, default=32, help="tasks in flight in the closed loop")
    ap.add_argument("--tasks", type=int, default=3000, help="ledger tasks timed in part 2")
    ap.add_argument("--pin-client", type=int, default=None, metavar="CPU",
                    help="part 1's load generator alone on this CPU, the routers (taskset) and mock on the others")
    return bench(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
