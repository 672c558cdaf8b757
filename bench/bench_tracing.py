"""What tracing costs the router (spec §12, :mod:`atp_router.observability.tracing`): CPU per
task with tracing off and on, in the same run.

Run: ``python bench/bench_tracing.py [--seconds 6] [--repeats 3] [--k 16]
[--baseline-src DIR]``. Plain script, ≈ 1–2 min on 2 cores. It starts, on free
loopback ports:

* bench_gateway.py's **mock OpenAI upstream** (its own process; ~0.1 ms of CPU a
  call) and bench_gateway.py's RIB: one ``openai_compat`` model agent at the mock,
  policy ``chat``; so every task makes one real HTTP next-hop call (the
  adapter's request hook, the leg span, the ``traceparent`` header);
* an **OTLP/HTTP receiver** in this process (``tests/otlp_receiver.py``: the
  official ``opentelemetry-proto`` messages; its decoding CPU is this process's,
  not the router's);
* ``atp-router`` processes, one per configuration, each with its own state
  directory, started together and measured in turn:

  ``off``       no ``OTEL_*`` variable: no SDK provider, ``Router.tracing is None``
  ``on``        ``OTEL_EXPORTER_OTLP_ENDPOINT`` at the receiver (batch processor,
                default OTEL_BSP_* settings): every task exports its spans
  ``baseline``  with ``--baseline-src DIR``: the router of another source tree
                (``PYTHONPATH=DIR``, e.g. a copy of ``atp_router/`` before a change), no
                ``OTEL_*``

The load generator (this process, bench_gateway.py's drivers) runs a **closed
loop**: ``--k`` tasks in flight for ``--seconds`` through ``POST /v1/streams`` +
SSE until FINAL, one configuration at a time, the configurations rotated in
each of ``--repeats`` rounds. The router process's CPU (utime + stime,
``/proc``) is read around each run: **µs CPU per completed task** (the median of
the rounds; min–max beside it) and tasks/s. For ``on`` the spans that reached
the receiver per task are printed too (4 expected: session, stream, leg,
consensus).

The last line is ``TRACING cpu_us_per_task off=<a> on=<b>[ baseline=<c>]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import bench_gateway as gw  # a sibling script, found through sys.path above

TARGET = "atp_http"


async def measure(args: argparse.Namespace, routers: dict[str, tuple[int, str]], rx) -> dict[str, list[dict]]:
    import trio

    runs: dict[str, list[dict]] = {name: [] for name in routers}
    drivers = {}
    async with trio.open_nursery():
        for name, (_, url) in routers.items():
            d = gw.Drivers({TARGET: url}, {TARGET: "none"})
            drivers[name] = await d.__aenter__()
        try:
            names = list(routers)
            for name in names:  # warm-up: imports, connections, first spans
                await gw.closed_loop(drivers[name], TARGET, args.k, 1.5)
            for rnd in range(args.repeats):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for name in order:
                    pid = routers[name][0]
                    spans0 = len(rx.spans())
                    cpu0 = gw.cpu_s(pid)
                    r = await gw.closed_loop(drivers[name], TARGET, args.k, args.seconds)
                    await trio.sleep(0.2)  # the last tasks' CPU lands
                    r["cpu_s"] = gw.cpu_s(pid) - cpu0
                    if name == "on":
                        await trio.sleep(6.0)  # the batch processor's 5 s schedule delay
                        r["spans"] = len(rx.spans()) - spans0
                    runs[name].append(r)
                    print(f"  round {rnd + 1} {name:>8}: {r['tasks']:5d} tasks {r['tasks_s']:7.1f}/s "
                          f"{r['cpu_s'] / max(r['tasks'], 1) * 1e6:8.0f} µs CPU/task"
                          + (f", {r['spans'] / max(r['tasks'], 1):.2f} spans/task" if "spans" in r else "")
                          + (f", {r['failed']} failed" if r["failed"] else ""), flush=True)
        finally:
            for d in drivers.values():
                await d.__aexit__(None, None, None)
    return runs


def cli_module(src: Path) -> str | None:
    """The module that the ``atp-router`` console script of the checkout ``src``
    runs (its pyproject.toml's ``[project.scripts]``), so a baseline from before or
    after a move of the CLI starts the same way; None when it names none that is there."""
    try:
        target = tomllib.loads((src / "pyproject.toml").read_text())["project"]["scripts"]["atp-router"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    module = target.partition(":")[0]
    return module if (src / Path(*module.split("."))).with_suffix(".py").is_file() else None


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"\nclosed loop, {args.k} in flight, {args.seconds:g} s × {args.repeats} rounds, ATP HTTP+SSE, "
          "one openai_compat next-hop call a task")
    print(f"{'config':>9} {'µs CPU/task (median)':>22} {'min–max':>14} {'tasks/s':>9}")
    med: dict[str, float] = {}
    for name, rs in runs.items():
        per = [r["cpu_s"] / max(r["tasks"], 1) * 1e6 for r in rs]
        med[name] = statistics.median(per)
        print(f"{name:>9} {med[name]:22.0f} {min(per):6.0f}–{max(per):<7.0f} "
              f"{statistics.median(r['tasks_s'] for r in rs):9.1f}")
    if "off" in med and "on" in med:
        print(f"tracing on costs {med['on'] - med['off']:+.0f} µs CPU/task ({(med['on'] / med['off'] - 1) * 100:+.1f} %)")
    if "baseline" in med and "off" in med:
        print(f"off vs baseline: {med['off'] - med['baseline']:+.0f} µs CPU/task "
              f"({(med['off'] / med['baseline'] - 1) * 100:+.1f} %)")
    print("TRACING cpu_us_per_task " + " ".join(f"{k}={v:.0f}" for k, v in med.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0, help="closed-loop seconds per configuration and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (configurations rotated)")
    ap.add_argument("--k", type=int, default=16, help="tasks in flight")
    ap.add_argument("--baseline-src", type=Path, help="a source tree whose atp_router/ runs as the 'baseline' router")
    args = ap.parse_args(argv)

    import trio

    from tests.otlp_receiver import OtlpReceiver

    print(f"bench_tracing: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_tracing_"))
    base_env = {k: v for k, v in gw.clean_env().items() if not k.startswith("OTEL_")}
    procs: list[subprocess.Popen] = []
    with OtlpReceiver() as rx:
        try:
            started = gw.start_mock(tmp, procs)
            if started is None:
                return 1
            mock_port, _ = started
            clis = dict.fromkeys(("off", "on"), "atp_router.deploy.cli")
            configs = {"off": base_env, "on": base_env | {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
                                                          "OTEL_SERVICE_NAME": "atp-bench"}}
            if args.baseline_src is not None:
                src = args.baseline_src.resolve()
                baseline_cli = cli_module(src)
                if baseline_cli is None:
                    print(f"--baseline-src {src}: no atp-router console script (pyproject.toml) whose module is there")
                    return 2
                configs["baseline"] = base_env | {"PYTHONPATH": str(src)}
                clis["baseline"] = baseline_cli
            routers: dict[str, tuple[int, str]] = {}
            for name, env in configs.items():
                # `python -m`, so that PYTHONPATH (the baseline's source) decides which router code runs
                r = gw.start_router(tmp / name, gw.RIB.format(port=mock_port), procs, env=env,
                                    exe=[sys.executable, "-m", clis[name]],
                                    args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"])
                if r is None:
                    return 1
                routers[name] = (r.proc.pid, r.url)
            print(f"routers up: {', '.join(routers)}; receiver {rx.endpoint}", flush=True)
            t0 = time.monotonic()
            runs = trio.run(measure, args, routers, rx)
            report(runs, args)
            print(f"({time.monotonic() - t0:.0f} s)")
            return 0
        finally:
            gw.stop_procs(procs)


if __name__ == "__main__":
    sys.exit(main())
