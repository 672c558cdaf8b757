"""What merging the learned routing state through a shared store costs (issue 12,
atp_router.runtime.controlplane.shared_state): one router's periodic sync, against what a single
router does in the same interval (its last-writer-wins save), in the same run.

    .venv/bin/python bench/bench_shared_learning.py [--rounds 60] [--bits 12]

bench_learning.py's policy (three arms, ``bits`` = 12: 4,096 weights per arm,
prompt-text features on), two learners A and B as two routers would hold them,
each learning 20 tasks (a quality observation and a call per task, on arms of
its choosing) between two syncs, syncing in turn. Timed per sync, wall clock
(the store round trips are the cost; the trio loop is blocked meanwhile), best
and median over ``--rounds``:

* **baseline**: ``Learning.save`` (every changed arm ``put`` as float32, the
  live statistics ``put`` whole) on a SQLite store — a single router's save;
* **sqlite**: ``Learning.sync_shared`` on one SQLite store (multiprocess, as
  ``--workers`` opens it): each changed arm pushed by ``Store.update`` as a
  float64 delta, merged and adopted, the live document likewise, the other
  router's changes read back;
* **redis**: the same on a private redis-server (append-only, ``everysec``;
  needs Debian's redis-server, scripts/peers/redis.sh; skipped without it).

The learners being the router's own ``Learning``, built from the store and a
control plane stand-in holding just the generation (all a sync reads of it),
the numbers are the learning sync alone. Also printed: the stored bytes of
one arm. Last line: ``SHARED_LEARNING ms_per_sync
baseline=… sqlite=… redis=…`` (medians).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atp_router.flow.budget import BudgetLedger
from atp_router.observability.metrics import RouterMetrics
from atp_router.policy.learn import Decision
from atp_router.policy.rib import Rib
from atp_router.runtime.controlplane.learning import Learning, LearnLimits
from atp_router.store import SqliteStore
from bench.bench_learning import META, RIB, TEXT

TASKS_PER_SYNC = 20


def _learning(store, bits: int) -> Learning:
    rib = {**RIB, "policies": [{**RIB["policies"][0], "bandit": {"explore": 0.25, "text_features": True,
                                                                  "bits": bits}}]}
    gen = SimpleNamespace(version=1, rib=msgspec.convert(rib, Rib))
    # The control plane stand-in holds just the running generation (what a sync reads of it).
    return Learning(store, ledger=BudgetLedger(), metrics=RouterMetrics(), control=SimpleNamespace(gen=gen),
                    audit=lambda *_: None, limits=LearnLimits(rate_per_s=1e9, burst=10**9, share=1.0), tenants=False)


def _learn(learning: Learning, i: int) -> None:
    """One task: the bandit's choice, a quality observation of the chosen arm, its call."""
    learner = learning.learner
    route = SimpleNamespace(policy="p", next_hops=[], alternates=[], escalation_hop=None)
    pb = learner._bandits["p"]
    ctx = pb.featurizer(META, TEXT, extra=(f"tenant=t{i % 5}",))
    arm = ("a", "b", "c")[i % 3]
    learner.observe(Decision(route.policy, ("a", "b", "c"), 1, ctx, 0.0), {arm: (i % 4) / 3})
    learner.observe_call(arm, policy="p", latency_ms=200 + i % 50, ok=i % 7 != 0, timeout=False, tokens=1500,
                         usd_micros=300)


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def run(name: str, stores: list, bits: int, rounds: int, shared: bool) -> list[float]:
    learners = [_learning(s, bits) for s in stores]
    for learning in learners:
        learning.sync(learning.control.gen)
        if shared:
            learning.share()
    times = []
    i = 0
    for r in range(rounds):
        for learning in learners:
            for _ in range(TASKS_PER_SYNC):
                _learn(learning, i)
                i += 1
            times.append(_time(learning.sync_shared if shared else learning.save))
    print(f"{name:10s} ms per sync: best {min(times):7.2f}  median {statistics.median(times):7.2f}  "
          f"({len(times)} syncs)", flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--bits", type=int, default=12)
    args = ap.parse_args()
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        with SqliteStore.open(Path(d) / "single") as store:
            results["baseline"] = statistics.median(run("baseline", [store], args.bits, args.rounds, False))
            raw = store.get("bandit/p/a")
            print(f"stored arm (single router, float32): {len(raw or b'') / 1024:.0f} KiB")
        with SqliteStore.open(Path(d) / "shared", multiprocess=True) as a, \
                SqliteStore.open(Path(d) / "shared", multiprocess=True) as b:
            results["sqlite"] = statistics.median(run("sqlite", [a, b], args.bits, args.rounds, True))
            raw = a.get("bandit/p/a")
            print(f"stored arm (shared, float64): {len(raw or b'') / 1024:.0f} KiB")
        results["redis"] = _redis(Path(d), args) or float("nan")
    print(f"SHARED_LEARNING ms_per_sync baseline={results['baseline']:.2f} sqlite={results['sqlite']:.2f} "
          f"redis={results['redis']:.2f}")


def _redis(work: Path, args: argparse.Namespace) -> float | None:
    from atp_router.store.redis import RedisStore
    from tests.peers import RedisServer, find_redis_server, free_port

    exe = find_redis_server()
    if exe is None:
        print("redis: skipped (redis-server is not installed: scripts/peers/redis.sh)")
        return None
    (work / "redis").mkdir()
    server = RedisServer(exe, work / "redis", free_port(), appendonly=True)
    server.start()
    try:
        with RedisStore.open(server.url) as a, RedisStore.open(server.url) as b:
            a._client.config_set("appendfsync", "everysec")
            return statistics.median(run("redis", [a, b], args.bits, args.rounds, True))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
