"""What routing that learns costs on the SYN path (issue 8; spec §6.2).

    .venv/bin/python bench/bench_learning.py [--n 5000]

A three-next-hop policy with ``bandit:`` (fanout_k 1), live statistics warmed
with 50 calls per next-hop. Per operation, µs of CPU (best of 3 runs of ``--n``):

* the FIB lookup alone (the baseline: static RIB figures), and with the live view;
* the bandit's choice with meta features only, and with 2 KB of prompt text
  hashed (unigrams + bigrams);
* learning one quality observation, and one call's live statistics.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from atp_router.policy.fib import compile_fib
from atp_router.policy.learn import RoutingLearner
from atp_router.policy.rib import Rib

RIB = {
    "agents": {a: {"layer": "L2", "tool": "ruff", "p95_ms": 300, "win30d": w, "strengths": ["code_review"]}
               for a, w in (("a", 0.6), ("b", 0.7), ("c", 0.8))},
    "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a", "b", "c"], "fanout_k": 1,
                  "bandit": {"explore": 0.25}}],
}
META = {"task_type": "code_review", "languages": ["py"], "diff_loc": 120}
TEXT = ("+def load(path):\n+    data = open(path).read()\n+    return eval(data)\n" * 40)[:2000]


def best_us(f, n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.thread_time()
        for _ in range(n):
            f()
        best = min(best, (time.thread_time() - t) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    n = ap.parse_args().n
    rib = msgspec.convert(RIB, Rib)
    fib = compile_fib(rib, version=1)
    learner = RoutingLearner(seed=0)
    learner.sync(rib)
    for i in range(50):
        for a in "abc":
            learner.observe_call(a, policy="p", latency_ms=100 + i, ok=True, timeout=False, tokens=100, usd_micros=10)
    route = fib.lookup(META, live=learner.live.view())
    _, decision = learner.route(route, META, TEXT, tenant="t")
    rows = [
        ("FIB lookup, RIB figures (baseline)", best_us(lambda: fib.lookup(META), n)),
        ("FIB lookup + live view", best_us(lambda: fib.lookup(META, live=learner.live.view()), n)),
        ("bandit choice, meta features", best_us(lambda: learner.route(route, META, "", tenant="t"), n)),
        ("bandit choice, meta + 2 KB prompt", best_us(lambda: learner.route(route, META, TEXT, tenant="t"), n // 5)),
        ("learn one quality observation", best_us(lambda: learner.observe(decision, {"a": 1.0}), n)),
        ("record one call (live statistics)", best_us(
            lambda: learner.observe_call("a", policy="p", latency_ms=100, ok=True, timeout=False, tokens=1,
                                         usd_micros=1), n)),
    ]
    for name, us in rows:
        print(f"{name:<40} {us:8.1f} µs")


if __name__ == "__main__":
    main()
