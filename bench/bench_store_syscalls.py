"""Store syscalls per task of a router on the embedded SQLite store (issue 25 item 2).

Run: ``python bench/bench_store_syscalls.py [--tasks 200] [--in-flight 1]``. Plain
script, about a minute; needs ``strace`` (Debian's ``strace`` package).

bench_gateway.py's mock OpenAI upstream and RIB, and one ``atp-router`` process on
its embedded store (``--state-dir``), with a bearer token. After a warm-up of 20
tasks, ``strace -f -y`` attaches to the router and ``--tasks`` OpenAI-ingress tasks
(``POST /v1/chat/completions``, streamed, the same request as bench_gateway.py's)
run, ``--in-flight`` at a time; then strace detaches. Each syscall strace printed
with a file descriptor (``-y`` names its file) is counted by what the descriptor
is: a **store** syscall names a file of the state directory (``state.db``, its
``-wal`` / ``-shm``, the audit head and spool), ``fsync``/``fdatasync`` on them
counted apart; the rest are sockets, pipes, epoll and so on. Syscalls naming no
descriptor (``clock_gettime`` is a vDSO call and never seen) are counted as other.

Prints the table (store syscalls by name, per task), then exactly one last line::

    STORE_SYSCALLS per_task=<s> fsync_per_task=<f> all_per_task=<a> tasks=<N>

``ATP_BENCH_KEEP_TRACE=FILE`` keeps strace's output there (which file, which lock).
Measured 2026-11-28: ~8 write transactions a task (the WAL write lock, byte 120 of
``-shm``, taken 8.1 times a task), ~7 ``pwrite64`` each. 2026-11-29, after a
stream's end settlements, record and audit records joined the group commit:
~4 transactions a task, ``fcntl`` 48 → ~24, ``pwrite64`` still ~61. Later that day, the
single router's store opened exclusive (``PRAGMA locking_mode=EXCLUSIVE``: ``fcntl`` 24 → 0)
and schema 3 (a task's events appended at the end of one B-tree instead of at random
places of a WITHOUT ROWID one; the stream's unique key serving lookups by id):
``pwrite64`` 61.5 → 44.7 (about 22 WAL frames a task in its ~4 transactions, two
``pwrite64`` each), ``pread64`` 4.7 → 1.7 (the WAL checkpoint's reads), 91.1 → 46.6 in all.
Session 18: the single router's redo log (atp_router/store/redo.py: a transaction is one
``write`` of ``state.db.redo``; SQLite committed at most a second apart, a page its tasks
all touch written once a commit): ``per_task`` 44.8 → 6.8 (200 tasks), 9.2 (1,000 tasks,
the commits' share included: ``write`` 4.0, ``pwrite64`` ~4.5); 16 … 8 in flight 24.1 → 7.5.

Baseline in the same run: ``all_per_task`` (every syscall the router makes a
task) beside the store's share; the issue's target is ``per_task ≤ 20``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_gateway as bg

KEY = "bench-store-syscalls"
#: ``name(fd</path>...`` as ``strace -y`` prints a syscall on a descriptor.
_CALL = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(?P<name>[a-z_0-9]+)\((?P<fd>\d+)<(?P<what>[^>]*)>")
_ANY = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(?P<name>[a-z_0-9]+)\(")


def classify(lines: list[str], state_dir: str) -> tuple[Counter[str], Counter[str]]:
    """``(store, other)``: syscall names counted, the store's those on a file of
    ``state_dir``; resumed halves (``<... read resumed>``) and strace's own
    notes are not calls."""
    store: Counter[str] = Counter()
    other: Counter[str] = Counter()
    for line in lines:
        m = _CALL.match(line)
        if m is not None:
            (store if m.group("what").startswith(state_dir) else other)[m.group("name")] += 1
            continue
        m = _ANY.match(line)
        if m is not None and "resumed>" not in line:
            other[m.group("name")] += 1
    return store, other


async def run_tasks(url: str, n: int, in_flight: int) -> int:
    """``n`` streamed chat completions, ``in_flight`` at a time; how many completed."""
    body = httpx.Request("POST", "/", json={"model": "m", "messages": bg.MESSAGES, "stream": True,
                                             "max_tokens": 16}).content
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    done = 0
    lock = trio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one() -> None:
            nonlocal done
            async with lock:
                async with client.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as r:
                    data = b"".join([b async for b in r.aiter_bytes()])
                if r.status_code == 200 and b"tok5" in data:
                    done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--in-flight", type=int, default=1)
    args = ap.parse_args()
    strace = shutil.which("strace")
    if strace is None:
        print("bench_store_syscalls: needs strace (apt-get install strace)", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench_store_syscalls_") as tmp_s:
        tmp = Path(tmp_s)
        try:
            mock = bg.start_mock(tmp, procs, announce="bench_store_syscalls")
            if mock is None:
                return 1
            # The tenant's stream-open rate out of the way, as in bench_gateway.py: 220 tasks in ~2 s
            # exceed the default 50/s (burst 100), and a refused task is no measurement.
            router = bg.start_router(tmp / "router", bg.gateway_rib(mock[0]), procs, key=KEY, announce="router",
                                     args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"])
            if router is None:
                return 1
            trio.run(run_tasks, router.url, 20, 1)  # warm: imports, first-use caches, accounts opened
            state_dir = os.path.realpath(tmp / "router" / "state")
            out = tmp / "strace.txt"
            tracer = subprocess.Popen([strace, "-f", "-y", "-qq", "-o", str(out), "-p", str(router.proc.pid)],
                                      stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached to every thread
            t0 = time.monotonic()
            done = trio.run(run_tasks, router.url, args.tasks, args.in_flight)
            took = time.monotonic() - t0
            time.sleep(0.5)  # the group commit behind the last FINAL
            tracer.terminate()
            tracer.wait(timeout=10)
            text = out.read_text(errors="replace")
            if os.environ.get("ATP_BENCH_KEEP_TRACE"):
                shutil.copy(out, os.environ["ATP_BENCH_KEEP_TRACE"])
            store, other = classify(text.splitlines(), state_dir)
        finally:
            bg.stop_procs(procs)
    if done != args.tasks:
        print(f"bench_store_syscalls: {args.tasks - done} of {args.tasks} tasks did not complete", file=sys.stderr)
        return 1
    n = args.tasks
    fsyncs = store["fsync"] + store["fdatasync"]
    print(f"{n} tasks, {args.in_flight} in flight, under strace in {took:.1f} s; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("store syscalls per task, by name:")
    for name, c in store.most_common():
        print(f"  {name:<16} {c / n:7.2f}")
    print(f"other syscalls per task: {sum(other.values()) / n:.2f} "
          f"({', '.join(f'{k} {v / n:.1f}' for k, v in other.most_common(6))})")
    print(f"STORE_SYSCALLS per_task={sum(store.values()) / n:.1f} fsync_per_task={fsyncs / n:.2f} "
          f"all_per_task={(sum(store.values()) + sum(other.values())) / n:.1f} tasks={n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
