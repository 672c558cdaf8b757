"""What routing that learns costs on the SYN path (issue 8; spec §6.2).

    .venv/bin/python bench/bench_learning.py [--n 5000]

A three-next-hop policy with ``bandit:`` (fanout_k 1), live statistics warmed
with 50 calls per next-hop. Per operation, µs of CPU (best of 3 runs of ``--n``):

* the FIB lookup alone (the baseline: static RIB figures), and with the live view;
* the bandit's choice with meta features only, and with 2 KB of prompt text
  hashed (unigrams + bigrams);
* learning one quality observation, and one call's live statistics;
* the same choice and learning with a text gain model (``atp-router learn --method
  gain``, :mod:`atp_router.policy.textgain`: 2 heads, weight 1) on a two-next-hop policy: a
  vocabulary of 60,000 terms (random keys plus every term of the prompt, so all
  of them are looked up and found) — the TF-IDF columns of the prompt too.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import numpy as np

from atp_router.policy.fib import compile_fib
from atp_router.policy.learn import RoutingLearner
from atp_router.policy.rib import Rib
from atp_router.policy.textgain import TermVocab, TextGain, term_keys

RIB = {
    "agents": {a: {"layer": "L2", "tool": "ruff", "p95_ms": 300, "win30d": w, "strengths": ["code_review"]}
               for a, w in (("a", 0.6), ("b", 0.7), ("c", 0.8))},
    "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a", "b", "c"], "fanout_k": 1,
                  "bandit": {"explore": 0.25}},
                 {"name": "g", "match": {"task_type": "qa"}, "fanout": ["a", "c"], "fanout_k": 1,
                  "bandit": {"explore": 0.0}}],
}
QA = {"task_type": "qa", "subject": "astronomy"}
#: 2 KB of distinct words (every unigram and bigram its own term: the gain columns' worst case).
PROSE = " ".join(f"w{(i * 7919) % 100_003}" for i in range(400))[:2000]
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


def _gain_learner(rib: Rib) -> RoutingLearner:
    """A learner whose policy ``g`` holds a text gain model (the module doc)."""
    learner = RoutingLearner(seed=0)
    learner.sync(rib)
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate((rng.integers(0, 1 << 34, size=60_000, dtype=np.uint64), term_keys(TEXT), term_keys(PROSE))))
    vocab = TermVocab(keys, rng.uniform(1.0, 9.0, size=len(keys)), np.zeros(0, np.uint64))
    model = TextGain(vocab, heads=2)  # what ``learn --method gain`` writes by default (one head per arm)
    model.m[:] = rng.normal(0.0, 0.1, size=len(model.m))
    fps = learner.fingerprints("g")
    learner.load_gain([{"policy": "g", "arms": ["a", "c"], "fingerprints": [fps["a"], fps["c"]], "weight": 1.0,
                        "state": model.state()}])
    learner.sync(msgspec.convert(RIB, Rib))  # a reload: the stored gain model is attached
    return learner


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
    gl = _gain_learner(rib)
    groute = fib.lookup(QA)
    _, gdec = gl.route(groute, QA, TEXT, tenant="t")
    assert gdec is not None and gdec.context.aux is not None and len(gdec.context.aux.idx) > 10
    rows += [
        ("with a text gain: choice, meta + 2 KB", best_us(lambda: gl.route(groute, QA, TEXT, tenant="t"), n // 5)),
        ("2 KB of distinct words, no text gain", best_us(lambda: learner.route(route, META, PROSE, tenant="t"), n // 5)),
        ("2 KB of distinct words, with text gain", best_us(lambda: gl.route(groute, QA, PROSE, tenant="t"), n // 5)),
        ("with a text gain: learn one observation", best_us(lambda: gl.observe(gdec, {"a": 1.0}), n)),
    ]
    for name, us in rows:
        print(f"{name:<40} {us:8.1f} µs")


if __name__ == "__main__":
    main()
