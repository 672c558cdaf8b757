"""What retained closed streams cost the garbage collector and memory (issue 10).

Run: ``python bench/bench_retention.py [--streams N]``. Plain script, a few
seconds. Builds N closed stream logs shaped like a code-review stream through
the router (SYN+ACK, two PARTIAL reports with findings, a WINDOW_UPDATE, the
FINAL with merged findings and telemetry, FIN: the frames ``atp_router.runtime.dataplane.eventlog``
keeps for resumption), then, in the same run:

* **live**: the logs as they were kept before (``EventLog`` holding its frames);
* **compacted**: the same logs after :meth:`EventLog.compact` (one msgpack
  ``bytes`` of the frames' JSON each), as the router now keeps a closed stream nobody follows.

Each event's JSON is encoded when it is appended, as the router's store write and
followers encode it (the live logs hold it too).

Prints, for each: a full ``gc.collect()`` (ms, best of 5), objects tracked by the
GC, and the memory they hold (tracemalloc, MB); then the cost of compacting
one log and of reading one back (µs).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atp_router.runtime.dataplane.eventlog import EventLog
from atp_router.wire.frame import (
    Flag,
    Frame,
    Payload,
    PayloadType,
    Window,
    WindowUpdate,
)


def _report(agent: str, n: int) -> dict:
    return {"agent": agent, "report": {"summary": f"{agent}: {n} finding(s) in 1 file(s)", "findings": [
        {"file": "thefuck/utils.py", "start": 180 + i, "end": 180 + i, "severity": "medium",
         "claim": f"S30{i}: pickle and modules that wrap it can be unsafe", "confidence": 0.6, "ref": str(i),
         "rule": f"S30{i}"} for i in range(n)]}}


def stream_log(i: int) -> EventLog:
    sid, st = f"sess_{i:012x}", f"task_{i:012x}"
    log = EventLog()
    frames = [
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=0, flags=[Flag.SYN, Flag.ACK],
              meta={"route": {"policy": "code_review", "next_hops": ["lint.ruff", "sec.bandit"]}}),
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=1,
              payload=Payload(type=PayloadType.PARTIAL, content=_report("lint.ruff", 2))),
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=2,
              payload=Payload(type=PayloadType.PARTIAL, content=_report("sec.bandit", 1))),
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=3, payload=Payload(
            type=PayloadType.CONTROL, content=WindowUpdate(window=Window(max_parallel=4, max_tokens=200_000,
                                                                         max_usd_micros=50_000)))),
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=4, payload=Payload(type=PayloadType.FINAL, content={
            "result": {"findings": [{"id": "F-1", "severity": "medium", "file": "thefuck/utils.py",
                                     "span": "183-183", "claim": "B301: pickle", "confidence": 0.98,
                                     "provenance": ["sec.bandit#1", "lint.ruff#1"]}],
                       "consensus": {"strategy": "union_tiebreak", "agreement": 0.5, "uncertainties": []}},
            "telemetry": {"tokens": 0, "usd": 0.0, "latency_ms": 221.0}})),
        Frame(v=1, session_id=sid, stream_id=st, msg_seq=5, flags=[Flag.FIN]),
    ]
    for f in frames:
        log.append(f).json_bytes()  # as in the router: each event encoded once, for the store and followers
    return log


def measure(logs: list[EventLog]) -> tuple[float, int, float]:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t0)
    return best * 1000, len(gc.get_objects()), 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=10_000)
    args = ap.parse_args()
    gc.collect()
    base_ms, base_objs, _ = measure([])
    rows = []
    for mode in ("live", "compacted"):
        tracemalloc.start()
        logs = [stream_log(i) for i in range(args.streams)]
        if mode == "compacted":
            for log in logs:
                log.compact()
        gc.collect()
        mem = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        ms, objs, _ = measure(logs)
        rows.append((mode, ms, objs - base_objs, mem))
        del logs
        gc.collect()
    fresh = [stream_log(i) for i in range(1000)]
    t0 = time.perf_counter()
    for log in fresh:
        log.compact()
    pack_us = (time.perf_counter() - t0) / len(fresh) * 1e6
    t0 = time.perf_counter()
    for log in fresh:
        assert len(log.events) == 6
    read_us = (time.perf_counter() - t0) / len(fresh) * 1e6
    print(f"{args.streams:,} retained closed code-review streams (6 frames each), Python {sys.version.split()[0]}; "
          f"empty heap: gc.collect() {base_ms:.1f} ms")
    print(f"{'kept as':<12} {'gc.collect() ms':>16} {'GC-tracked objects':>19} {'memory MB':>10}")
    for mode, ms, objs, mem in rows:
        print(f"{mode:<12} {ms:>16.1f} {objs:>19,} {mem:>10.1f}")
    print(f"compact one log {pack_us:.1f} µs; read one back {read_us:.1f} µs")


if __name__ == "__main__":
    main()
