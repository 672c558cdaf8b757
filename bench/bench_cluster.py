"""Several ``atp-router --store redis://…`` processes on one machine: closed-loop
tasks/s with one router on the embedded SQLite store and 1, 2 and 3 routers on the
shared Redis store, what the store adds to a task and the store round trips a task
makes (issues 12 and 22).

Run: ``python bench/bench_cluster.py [--seconds 6] [--repeats 3] [--in-flight 32]
[--latency-tasks 150] [--client lean|httpx] [--skip-store-ops]``. Plain script, ≈ 3 min on 2 cores; needs
Debian's redis-server (scripts/peers/redis.sh). Everything compared in the same run:

1. **Processes.** bench_gateway.py's fast mock OpenAI upstream (its own process,
   ``start_mock``) and its RIB plus bench_workers.py's tenant ``bench`` with a token
   budget (every call goes through the budget ledger); a private redis-server on
   loopback (tests/peers.py ``RedisServer``: AOF, ``appendfsync always`` — an fsync
   per write, what the ledger needs to survive a crash of Redis, README "Several
   routers") and a second one set to ``appendfsync everysec``; routers started with
   bench_gateway.py's ``start_router``: three on the first Redis (``--store
   redis://…``, each its own state directory and ports), one on the second, and one
   on the embedded SQLite store (``--store sqlite``, the default).
2. **Throughput.** One load generator (this process: ``lean_load.py``'s pre-built
   requests on kept-alive connections, ~0.3 ms of CPU a task, or with ``--client
   httpx`` bench_gateway.py's ``Drivers``, 3–4.5 ms a task — a core of this machine
   at ~230 tasks/s, which then bounds the SQLite router's figure; over HTTP+SSE:
   ``POST /v1/streams`` then ``GET /v1/streams/{id}/events`` to the FINAL) keeps
   ``--in-flight`` tasks in flight for ``--seconds`` s, spread
   round-robin over 1, 2 or 3 of the Redis routers, and over the SQLite router alone;
   configurations rotated per repeat: tasks/s best and median, CPU ms per task of
   the routers, of redis-server and of the load generator (``/proc``). On 2 cores the
   load generator, the mock and Redis compete with the routers: 3 routers cannot
   get 3 cores here.
3. **Store latency.** ``--latency-tasks`` tasks one at a time (nothing else in
   flight) through one router on each store, alternating: p50 / p90 ms SYN → FINAL
   as the client sees it; the store's added latency per task = p50 on Redis (AOF
   always) − p50 on SQLite. With them, the Redis commands one task makes (``INFO
   commandstats`` around the Redis run: Lua scripts run with ``EVALSHA``, and all
   commands including those inside the scripts) and the store **round trips** a
   task makes: router a's ``atp_store_round_trips_total`` (a request sent and
   waited for; a pipeline is one) around the same run, split by operation into
   the **background** — ``atp_store_background_round_trips_total``: the scripts
   only its periodic work runs, whatever its tasks (lease renewals, polls for
   lost routers, a new RIB and breaker states, expiry of closed streams, quota
   renewals, the shared learning's sync once a second — its ``kv_get`` and
   ``kv_cas`` — and the audit chain's checkpoint once an interval:
   ``BACKGROUND_OPS`` in atp_router/store/redis.py), per second of the
   run — and the rest, **the tasks'** (the atomic OPEN, the group commits of a
   stream's events with its commit, FINAL, END and audit records, budget-lease
   takes and returns, learning slices taken at once, any other script),
   divided by its tasks: 3 a task while the router is busy (the OPEN, the
   SYN+ACK's group commit, the commit with the FINAL and the END), more for a
   task after an idle spell (its budget lease given back: a reservation and a
   commit of its own and the lease taken again; a learning slice taken at
   once). Both printed, and the total per task (background included) beside
   them.
4. **Per operation** (unless ``--skip-store-ops``): bench_store.py (helper of the
   same issue) run as it is, its table printed here.

The last line is ``CLUSTER tasks_per_s sqlite1=<a> redis1=<b> redis2=<c> redis3=<d>
store_round_trips_per_task=<r>`` (median closed-loop tasks/s over the rotated
repeats of one router on SQLite and 1, 2, 3 routers on Redis; ``r``: the tasks'
round trips above, background not included); the line before it ``CLUSTER
store_added_ms_per_task=<d> store_background_round_trips_per_s=<g>
store_round_trips_per_task_with_background=<t>`` (the p50 difference above; the
background's round trips a second; all round trips over the tasks). Issue 22
asks for redis2 ≥ sqlite1 and r ≤ 3 ("on the hot path").
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import bench_gateway as gw  # its mock upstream, RIB, load driver, router start-up, /proc helpers
from bench_workers import TENANT_BUDGET  # the tenant with a token budget

ROUTER_ARGS = ["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"]


class RoundRobin:
    """Drivers of several routers as one (``lean_load.LeanDrivers`` or
    bench_gateway.py's ``Drivers``): each task goes to the next router in turn."""

    def __init__(self, drivers: list[Any]) -> None:
        self.drivers = drivers
        self.n = 0

    async def run(self, target: str) -> bool:
        self.n += 1
        return await self.drivers[self.n % len(self.drivers)].run(target)


async def measure(args: argparse.Namespace, urls: dict[str, str], key: str, pids: dict[str, int], redis_pid: int,
                  redis_url: str, ops_key: str) -> dict:
    import redis as redis_client
    import trio

    from lean_load import LeanDrivers

    driver = LeanDrivers if args.client == "lean" else gw.Drivers
    drivers = {}
    for name, url in urls.items():
        drivers[name] = await driver({"atp_http": url}, {"atp_http": key}).__aenter__()
    configs = {"r1": ["a"], "r2": ["a", "b"], "r3": ["a", "b", "c"], "sqlite": ["sqlite"]}
    out: dict = {c: {"tasks_s": [], "tasks": 0, "failed": 0, "cpu": 0.0, "redis_cpu": 0.0, "client_cpu": 0.0}
                 for c in configs}
    try:
        print("warm-up: 1.5 s closed loop on each router ...", flush=True)
        for name in urls:
            await gw.closed_loop(drivers[name], "atp_http", args.in_flight, 1.5)
        print(f"throughput: closed loop, {args.in_flight} in flight over HTTP+SSE ({args.client} client), {args.seconds:g} s x "
              f"{args.repeats}, configurations rotated", flush=True)
        order = list(configs)
        for rep in range(args.repeats):
            for c in order:
                rr = RoundRobin([drivers[n] for n in configs[c]])
                c0 = sum(gw.cpu_s(pids[n]) for n in configs[c])
                r0, s0 = gw.cpu_s(redis_pid), time.process_time()
                res = await gw.closed_loop(rr, "atp_http", args.in_flight, args.seconds)
                o = out[c]
                o["cpu"] += sum(gw.cpu_s(pids[n]) for n in configs[c]) - c0
                o["redis_cpu"] += gw.cpu_s(redis_pid) - r0
                o["client_cpu"] += time.process_time() - s0
                o["tasks_s"].append(res["tasks_s"])
                o["tasks"] += res["tasks"]
                o["failed"] += res["failed"]
                print(f"  repeat {rep + 1}/{args.repeats} {c:<7} {res['tasks_s']:7.1f} tasks/s "
                      f"({res['tasks']} tasks, {res['failed']} failed)", flush=True)
                await trio.sleep(0.5)
            order = order[1:] + order[:1]

        print(f"store latency: {args.latency_tasks} tasks one at a time on each store, alternating", flush=True)
        lat: dict[str, list[float]] = {n: [] for n in ("sqlite", "a", "everysec")}
        cli = redis_client.Redis.from_url(redis_url)
        stats0 = cli.info("commandstats")
        trips0, bg0, ops0 = await round_trips(urls["a"], ops_key)
        since = time.monotonic()
        redis_tasks = 0
        for _ in range(args.latency_tasks):
            for n, times in lat.items():
                t0 = time.perf_counter()
                ok = await drivers[n].run("atp_http")
                if ok:
                    times.append((time.perf_counter() - t0) * 1000)
                    redis_tasks += n == "a"
        stats1 = cli.info("commandstats")
        took_s = time.monotonic() - since
        trips1, bg1, ops1 = await round_trips(urls["a"], ops_key)
        cli.close()
    finally:
        for d in drivers.values():
            await d.__aexit__(None, None, None)

    def calls(stats: dict, name: str) -> int:
        return stats.get(name, {}).get("calls", 0)

    names = set(stats0) | set(stats1)
    # The everysec router's commands go to the other server: these are router a's.
    return {"routers": out, "lat": lat, "round_trips": (trips1 - trips0) / max(redis_tasks, 1),
            "task_round_trips": (trips1 - trips0 - (bg1 - bg0)) / max(redis_tasks, 1),
            "background_per_s": (bg1 - bg0) / took_s, "took_s": took_s, "tasks_a": redis_tasks,
            "by_op": {op: n - ops0.get(op, 0) for op, n in ops1.items() if n > ops0.get(op, 0)},
            "evalsha": (calls(stats1, "cmdstat_evalsha") - calls(stats0, "cmdstat_evalsha")) / max(redis_tasks, 1),
            "commands": (sum(calls(stats1, n) - calls(stats0, n) for n in names if n != "cmdstat_info")
                         / max(redis_tasks, 1))}


async def round_trips(url: str, key: str) -> tuple[float, float, dict[str, float]]:
    """A router's ``atp_store_round_trips_total``, ``atp_store_background_round_trips_total``
    and ``atp_store_round_trips_by_op_total`` by op (its ``/v1/metrics``, one scrape)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as h:
        text = (await h.get("/v1/metrics")).raise_for_status().text
    fams = {fam.name: fam.samples for fam in text_string_to_metric_families(text)}
    names = ("atp_store_round_trips", "atp_store_background_round_trips", "atp_store_round_trips_by_op")
    if any(n not in fams for n in names):
        raise RuntimeError(f"{url}/v1/metrics lacks one of {', '.join(n + '_total' for n in names)}")
    return (sum(s.value for s in fams[names[0]]), sum(s.value for s in fams[names[1]]),
            {s.labels["op"]: s.value for s in fams[names[2]]})


def store_ops() -> str:
    """bench_store.py's table (run as it is, quick settings)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_store.py"), "--n", "200", "--rounds", "3"],
                       capture_output=True, text=True, check=False, timeout=300)
    return r.stdout if r.returncode == 0 else f"bench_store.py failed (exit {r.returncode}):\n{r.stderr[-2000:]}"


def bench(args: argparse.Namespace) -> int:
    import redis as redis_client
    import trio

    from tests.peers import RedisServer, find_redis_server

    print(f"bench_cluster: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    exe = find_redis_server()
    if exe is None:
        print("redis-server is not installed (scripts/peers/redis.sh)")
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_cluster_"))
    procs: list[subprocess.Popen] = []
    servers: list[RedisServer] = []
    key, ops_key = "atp-" + secrets.token_hex(32), "ops-" + secrets.token_hex(32)
    try:
        for fsync in ("always", "everysec"):
            work = tmp / f"redis-{fsync}"
            work.mkdir()
            server = RedisServer(exe, work, gw.free_port())  # AOF, appendfsync always
            server.start()
            servers.append(server)
            if fsync != "always":
                redis_client.Redis.from_url(server.url).config_set("appendfsync", fsync)
        print(f"starting: redis-server on {servers[0].url} (AOF appendfsync always) and {servers[1].url} "
              "(everysec)", flush=True)
        started = gw.start_mock(tmp, procs, announce="starting")
        if started is None:
            return 1
        rib = gw.RIB.format(port=started[0]) + TENANT_BUDGET.format()
        stores = {"a": servers[0].url, "b": servers[0].url, "c": servers[0].url, "everysec": servers[1].url,
                  "sqlite": "sqlite"}
        urls, pids = {}, {}
        for name, store in stores.items():
            # An operator's token reads /v1/metrics (atp_store_round_trips_total).
            r = gw.start_router(tmp / name, rib, procs, key=key, more_tokens=f",ops:{ops_key}:operator",
                                args=[*ROUTER_ARGS, "--store", store],
                                announce="starting", timeout_s=90)
            if r is None:
                return 1
            urls[name], pids[name] = r.url, r.proc.pid
        res = trio.run(measure, args, urls, key, pids, servers[0].proc.pid, servers[0].url, ops_key)
        table = None if args.skip_store_ops else store_ops()
    finally:
        gw.stop_procs(procs, 20)
        for s in servers:
            s.stop()

    labels = {"r1": "1 router, Redis", "r2": "2 routers, Redis", "r3": "3 routers, Redis",
              "sqlite": "1 router, SQLite"}
    print()
    print(f"{'closed loop, ' + str(args.in_flight) + ' in flight':<26}{'tasks/s best':>13}{'median':>9}"
          f"{'routers CPU ms/task':>21}{'redis CPU ms/task':>19}{'client CPU ms/task':>20}{'failed':>8}")
    best = {}
    for c, r in res["routers"].items():
        best[c] = max(r["tasks_s"])
        n = max(r["tasks"], 1)
        redis_cpu = "-" if c == "sqlite" else f"{r['redis_cpu'] / n * 1000:.2f}"
        print(f"{labels[c]:<26}{best[c]:>13.1f}{statistics.median(r['tasks_s']):>9.1f}{r['cpu'] / n * 1000:>21.2f}"
              f"{redis_cpu:>19}{r['client_cpu'] / n * 1000:>20.2f}{r['failed']:>8}")
    print("(2 cores: the routers share them with the load generator, the mock upstream and redis-server)")
    print()
    lat = res["lat"]
    p50 = {n: gw.pct(v, 50) for n, v in lat.items()}
    print(f"one task at a time, SYN -> FINAL at the client, ms ({args.latency_tasks} each):")
    for n, label in (("sqlite", "SQLite (embedded)"), ("a", "Redis, AOF always"), ("everysec", "Redis, AOF everysec")):
        print(f"  {label:<22} p50 {p50[n]:7.2f}  p90 {gw.pct(lat[n], 90):7.2f}  ({p50[n] - p50['sqlite']:+.2f} p50 "
              "against SQLite)")
    print(f"  Redis commands a task: {res['evalsha']:.1f} EVALSHA (Lua scripts), {res['commands']:.1f} in all "
          "(those inside the scripts counted)")
    print(f"  store round trips a task: {res['task_round_trips']:.2f} the task's; the background's (lease renewals, "
          f"polls, learning sync, audit checkpoints, expiry) {res['background_per_s']:.1f} a second; "
          f"{res['round_trips']:.2f} a task with it (router a's atp_store_round_trips_total and "
          "atp_store_background_round_trips_total)")
    print_by_op(res)
    if table is not None:
        print()
        print("bench_store.py, per operation:")
        print(table.rstrip())
    added = p50["a"] - p50["sqlite"]
    med = {c: statistics.median(r["tasks_s"]) for c, r in res["routers"].items()}
    print(f"CLUSTER store_added_ms_per_task={added:.2f} store_background_round_trips_per_s="
          f"{res['background_per_s']:.1f} store_round_trips_per_task_with_background={res['round_trips']:.2f}")
    print(f"CLUSTER tasks_per_s sqlite1={med['sqlite']:.1f} redis1={med['r1']:.1f} redis2={med['r2']:.1f} "
          f"redis3={med['r3']:.1f} store_round_trips_per_task={res['task_round_trips']:.1f}")
    return 0


def print_by_op(res: dict) -> None:
    """Router a's round trips in the latency run by operation: a task's, or a second's
    for the background's (``BACKGROUND_OPS``)."""
    from atp_router.store.redis import BACKGROUND_OPS

    tasks, took_s = max(res["tasks_a"], 1), res["took_s"]
    print(f"  router a's round trips by operation ({res['tasks_a']} tasks in {took_s:.1f} s; pipeline: a group commit):")
    for op, n in sorted(res["by_op"].items(), key=lambda x: -x[1]):
        background = op in BACKGROUND_OPS or op == "time"
        print(f"    {op:<24}{n:>7.0f}  " + (f"{n / took_s:6.2f} a second (background)" if background
                                             else f"{n / tasks:6.2f} a task"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="closed-loop seconds per configuration and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="rotated repeats per configuration")
    ap.add_argument("--in-flight", type=int, default=32, help="tasks in flight in the closed loop (all routers)")
    ap.add_argument("--latency-tasks", type=int, default=150, help="sequential tasks per store for the latency")
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="load generator: lean_load.py's raw HTTP/1.1 (default) or bench_gateway.py's httpx Drivers")
    ap.add_argument("--skip-store-ops", action="store_true", help="do not run bench_store.py")
    return bench(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
