"""What the response cache costs and saves (issue 11 item 5, spec §13).

Run: ``python bench/bench_cache.py [--tasks N]``. Plain script, < 1 min.

Part 1, per operation (CPU µs of this thread, best of 5 rounds of 200):

* **key**: :func:`atp_router.policy.cache.cache_key` of a golden code-review prompt (its
  diff and files) and of a 1 MiB one, beside the floor in the same run — one
  SHA-256 of the same prompt's JSON (``msgspec.json.encode`` + ``hashlib``);
* **store**: ``cache_get`` of a hit (read + touch) and ``cache_put`` of a typical
  entry on the embedded SQLite store, beside the store's own ``kv`` ``get`` /
  ``put`` of the same bytes.

Part 2, end to end: the golden tasks through a real in-process router on the
two-tool RIB (ruff + bandit) over HTTP + SSE, SYN → FINAL wall ms p50/p95, for a
policy without ``cache`` (baseline), the first pass with ``cache`` (misses:
the tools run and the answers are stored), and the second pass (hits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import atp
import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.consensus.types import AgentFinding, AgentReport, Severity, Usage
from atp_router.deploy.cli import run
from atp_router.policy.cache import CacheEntry, cache_key, encode_entry
from atp_router.runtime.config import RouterConfig
from atp_router.store import SqliteStore

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT.parent / "shared" / "golden" / "dev.jsonl"
META = {"task_type": "code_review", "languages": ["py"]}
RUFF = {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"]}
BANDIT = {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"]}


def tasks() -> list[dict]:
    return [{"diff": t["diff"], "files": t["files"]} for t in map(json.loads, GOLDEN.read_text().splitlines())]


def best_us(fn, n: int = 200, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - t0) / n)
    return min(out) * 1e6


def part1(task: dict) -> None:
    big = {"diff": "+x = 1\n" * (1 << 17), "files": {"x.py": "x = 1\n" * (1 << 17)}}  # ~1.75 MiB of text
    print("Part 1: per operation, CPU µs (best of 5 × 200)")
    print(f"{'operation':44} {'cache':>10} {'floor':>10}")
    for label, content in ((f"key of a golden task ({len(json.dumps(task)) // 1024} KB)", task),
                           (f"key of a {len(json.dumps(big)) / 2**20:.1f} MiB prompt", big)):
        p = Prompt(task_type="code_review", content=content, meta={**META, "ts": 1, "nonce": "n"})
        n = 200 if content is task else 5
        ours = best_us(lambda p=p: cache_key(agent="lint.ruff", fingerprint="f" * 64, prompt=p, tenant="alice"), n)
        floor = best_us(lambda p=p: hashlib.sha256(msgspec.json.encode(p)).digest(), n)
        print(f"{label:44} {ours:10.1f} {floor:10.1f}")
    report = AgentReport(findings=[AgentFinding(file="a.py", start=i, end=i, severity=Severity.LOW,
                                                claim=f"F401: `m{i}` imported but unused", ref=str(i))
                                   for i in range(1, 6)], summary="ruff: 5 findings")
    value = encode_entry(CacheEntry(report=report, created_ms=1, usage=Usage(100, 50, 10)))
    with tempfile.TemporaryDirectory() as d:
        store = SqliteStore.open(d)
        key = hashlib.sha256(b"k").digest()
        store.cache_put(key, value, tenant="alice", now_ms=1, expires_ms=10**13, max_bytes=64 << 20)
        store.put("kv-key", value)
        clock = iter(range(2, 10**9))
        get = best_us(lambda: store.cache_get(key, now_ms=next(clock)))
        kv_get = best_us(lambda: store.get("kv-key"))
        keys = iter(hashlib.sha256(str(i).encode()).digest() for i in range(10**6))
        put = best_us(lambda: store.cache_put(next(keys), value, tenant="alice", now_ms=next(clock),
                                              expires_ms=10**13, max_bytes=64 << 20), 100)
        kv_put = best_us(lambda: store.put("kv-key", value), 100)
        store.close()
    label = f"store get, hit ({len(value)} B entry; floor: kv get)"
    print(f"{label:44} {get:10.1f} {kv_get:10.1f}")
    print(f"{'store put (floor: kv put)':44} {put:10.1f} {kv_put:10.1f}")


async def part2(todo: list[dict]) -> None:
    print(f"\nPart 2: {len(todo)} golden tasks through a router (ruff + bandit), SYN → FINAL wall ms")
    results: dict[str, list[float]] = {}
    for label, cache in (("no cache (baseline)", None), ("cache, first pass (miss)", {"ttl_s": 3600})):
        with tempfile.TemporaryDirectory() as d:
            policy = {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["lint.ruff", "sec.bandit"]}
            if cache:
                policy["cache"] = cache
            rib = Path(d) / "rib.yaml"
            rib.write_text(json.dumps({"agents": {"lint.ruff": RUFF, "sec.bandit": BANDIT}, "policies": [policy]}))
            cfg = RouterConfig(policies=rib, http_port=0, ws_port=0, state_dir=Path(d) / "state")
            async with trio.open_nursery() as nursery:
                _, http_port, _ = await nursery.start(run, cfg)
                passes = [label] + (["cache, second pass (hit)"] if cache else [])
                async with atp.Client(f"http://127.0.0.1:{http_port}") as c:
                    for name in passes:
                        results[name] = []
                        for t in todo:
                            t0 = time.perf_counter()
                            _, st = await c.open_stream(task=META, content=t)
                            final = await c.result(st)
                            results[name].append((time.perf_counter() - t0) * 1000)
                            assert ("cached" in final["telemetry"]) == name.endswith("(hit)"), final["telemetry"]
                nursery.cancel_scope.cancel()
    for name, ms in results.items():
        q = statistics.quantiles(ms, n=20)
        print(f"  {name:28} p50 {statistics.median(ms):7.1f}  p95 {q[18]:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=26, help="golden tasks to run in part 2")
    args = ap.parse_args()
    todo = tasks()
    part1(todo[0])
    trio.run(part2, todo[: args.tasks])


if __name__ == "__main__":
    main()
