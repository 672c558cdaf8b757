"""What permessage-deflate costs and saves on the WebSocket ingress (issue 10, spec §4.1).

Run: ``python bench/bench_ws_deflate.py [--tasks N]``. Plain script, < 1 min.
Starts a real router in-process (the two-tool RIB ``tests/fixtures/rib_ruff_bandit``)
and runs the golden code-review tasks over the WebSocket ingress with a wsproto
client (``tests/unit/test_ws_deflate.py``'s), alternating a connection that
offers permessage-deflate and one that does not, task by task. Prints, per mode,
the bytes on the wire per task each way (the client's SYN carries the diff and
the files) and the process CPU per task (router and client together, both
compressing; the analysers' subprocesses excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import MECHANICS_RIB, start_router  # noqa: E402
from tests.unit import test_ws_deflate as client  # noqa: E402


async def bench(n: int) -> dict[str, list[tuple[int, int, float]]]:
    golden = [json.loads(line) for line in (ROOT.parent / "shared/golden/dev.jsonl").read_text().splitlines()]
    out: dict[str, list[tuple[int, int, float]]] = {"plain": [], "deflate": []}
    async with trio.open_nursery() as nursery:
        env = await start_router(nursery, MECHANICS_RIB, state_dir=Path(tempfile.mkdtemp()))
        for i in range(n):
            task = golden[i % len(golden)]
            client.golden = lambda task=task: {"diff": task["diff"], "files": task["files"]}
            for mode in (("plain", "deflate") if i % 2 == 0 else ("deflate", "plain")):
                t0 = time.process_time()
                c, _ = await client._run_task(env, deflate=mode == "deflate")
                out[mode].append((c.wire_in, c.wire_out, time.process_time() - t0))
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=26)
    args = ap.parse_args()
    res = trio.run(bench, args.tasks)
    print(f"WebSocket ingress, {args.tasks} golden code-review tasks per mode, Python {sys.version.split()[0]}")
    print(f"{'mode':<10} {'router → client B/task':>23} {'client → router B/task':>23} {'process CPU ms/task':>20}")
    for mode, rows in res.items():
        down = sum(r[0] for r in rows) / len(rows)
        up = sum(r[1] for r in rows) / len(rows)
        cpu = sorted(r[2] for r in rows)[len(rows) // 2] * 1000
        print(f"{mode:<10} {down:>23,.0f} {up:>23,.0f} {cpu:>20.2f}")
    for i, way in ((0, "router → client"), (1, "client → router")):
        plain, packed = (sum(r[i] for r in res[m]) for m in ("plain", "deflate"))
        print(f"{way}: deflate sends {packed / plain:.1%} of the bytes")


if __name__ == "__main__":
    main()
