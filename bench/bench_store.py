"""What one store operation costs on each backend (issue 12): the embedded
SQLite store against the shared Redis store, in the same run.

Run: ``python bench/bench_store.py [--n 400] [--rounds 5]``. Plain script,
< 1 min; needs Debian's redis-server (scripts/peers/redis.sh).

Backends (columns): SQLite in a temporary state dir with ``synchronous``
NORMAL (the default) and FULL (an fsync per commit); a private redis-server on
loopback with AOF ``appendfsync everysec`` (Redis' default for AOF) and
``always`` (an fsync per write, what the tests run). Operations (rows), each
the way the router makes it:

* **reserve+commit**: one :class:`~atp_router.flow.budget.SharedBudgetLedger`
  reserve and commit on a stream account under a tenant (the shared ledger
  of ``--workers`` and of several routers: ``reserve_shared`` +
  ``commit_shared``);
* **put_stream**: a stream record at SYN;
* **append_event ×10 in a batch**: ten 300-byte frames in one ``batch()`` (the
  group commit of a scheduler pass), per batch;
* **find_idempotent**: the newest stream of a key among 1,000 of the tenant;
* **floor**: the backend's cheapest round trip — SQLite ``SELECT 1`` on the
  store's connection, Redis ``PING`` on a pooled connection.

Each cell is wall µs per operation (best of ``--rounds`` rounds of ``--n``,
backends alternating per round) and, in brackets, this thread's CPU µs — the
part the router's trio thread pays; the rest is waiting for the server (and
its fsync). Last line ``STORE us reserve_commit sqlite=… redis=…``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from atp_router.flow.budget import Allowance, SharedBudgetLedger
from atp_router.store import SqliteStore, Store, StreamRecord
from atp_router.store.redis import RedisStore
from tests.peers import RedisServer, find_redis_server, free_port

FRAME = b"f" * 300


def record(sid: str, key: str | None = None, created: int = 1) -> StreamRecord:
    return StreamRecord(tenant="alice", session_id="sess", stream_id=sid, idempotency_key=key,
                        meta={"task_type": "code_review"}, qos=None, budget=None, created_ms=created, owner="r.1")


class Subject:
    """One backend under test with its per-operation closures."""

    def __init__(self, name: str, store: Store, floor: Callable[[], object]) -> None:
        self.name, self.store, self.floor = name, store, floor
        self.ledger = SharedBudgetLedger(store, owner="r.1")
        self.ledger.open("client:alice", Allowance(tokens=10**12, usd_micros=10**12))
        self.ledger.open("stream:s", Allowance(), parent="client:alice")
        for i in range(1_000):
            store.put_stream(record(f"idem-{i}", key=f"k{i % 100}", created=i))
        self.n_put = 0
        self.n_batch = 0

    def reserve_commit(self) -> None:
        r = self.ledger.reserve("stream:s", 100, 1_000)
        self.ledger.commit(r, 90, 900)

    def put_stream(self) -> None:
        self.n_put += 1
        self.store.put_stream(record(f"p{self.n_put}"))

    def append_batch(self) -> None:
        self.n_batch += 1
        sid = f"b{self.n_batch}"
        self.store.put_stream(record(sid))
        with self.store.batch():
            for i in range(1, 11):
                self.store.append_event("alice", "sess", sid, i, "PARTIAL", FRAME)

    def put_only(self) -> None:  # what append_batch pays besides the batch
        self.n_batch += 1
        self.store.put_stream(record(f"b{self.n_batch}"))

    def find(self) -> None:
        self.store.find_idempotent("alice", "k42")


def measure(fn: Callable[[], object], n: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400, help="operations per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    exe = find_redis_server()
    if exe is None:
        sys.exit("redis-server is not installed (scripts/peers/redis.sh)")
    with tempfile.TemporaryDirectory(prefix="atp-bench-store-") as d:
        servers, subjects = [], []
        try:
            for fsync in ("everysec", "always"):
                work = Path(d) / f"redis-{fsync}"
                work.mkdir()
                server = RedisServer(exe, work, free_port())  # AOF, appendfsync always
                server.start()
                servers.append(server)
                redis.Redis.from_url(server.url).config_set("appendfsync", fsync)
            for sync in ("NORMAL", "FULL"):
                s = SqliteStore.open(Path(d) / f"sqlite-{sync}", synchronous=sync)
                subjects.append(Subject(f"sqlite {sync}", s, lambda s=s: s._conn.execute("SELECT 1").fetchone()))
            for server, fsync in zip(servers, ("everysec", "always"), strict=True):
                s = RedisStore.open(server.url, namespace="bench")
                subjects.append(Subject(f"redis aof {fsync}", s, lambda s=s: s._client.ping()))
            ops = [("reserve+commit", "reserve_commit"), ("put_stream", "put_stream"),
                   ("append_event x10 in a batch", "append_batch"), ("find_idempotent (1k streams)", "find"),
                   ("floor (SELECT 1 / PING)", "floor")]
            best: dict[tuple[str, str], tuple[float, float]] = {}
            for _ in range(args.rounds):
                for label, attr in ops:
                    for sub in subjects:
                        wall, cpu = measure(getattr(sub, attr), args.n)
                        if attr == "append_batch":  # less the put_stream each batch starts with
                            w0, c0 = measure(sub.put_only, args.n)
                            wall, cpu = wall - w0, cpu - c0
                        key = (label, sub.name)
                        old = best.get(key)
                        best[key] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
            print(f"per operation: wall µs [this thread's CPU µs], best of {args.rounds} rounds × {args.n}")
            print(f"{'operation':30}" + "".join(f"{s.name:>22}" for s in subjects))
            for label, _ in ops:
                print(f"{label:30}" + "".join(f"{best[(label, s.name)][0]:>13.0f} [{best[(label, s.name)][1]:>4.0f}]"
                                              for s in subjects))
            rc = {s.name: best[("reserve+commit", s.name)][0] for s in subjects}
            print(f"STORE us reserve_commit sqlite={rc['sqlite NORMAL']:.0f} redis={rc['redis aof everysec']:.0f} "
                  f"redis_always={rc['redis aof always']:.0f}")
        finally:
            for sub in subjects:
                sub.store.close()
            for server in servers:
                server.stop()


if __name__ == "__main__":
    main()
