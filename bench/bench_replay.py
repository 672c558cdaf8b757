"""What the replay check of one signed frame costs (issue 19): the in-memory
nonce cache alone (what the router did before) against the durable check that
also records the nonce in the store, on each backend, in the same run.

Run: ``python bench/bench_replay.py [--n 1000] [--rounds 5]``. Plain script,
< 1 min; needs Debian's redis-server (scripts/peers/redis.sh).

Rows, each one signed ~1.3 KB frame (a fresh ``meta.nonce`` and ``meta.ts``,
decoded and HMAC-verified beforehand, outside the timing):

* **memory** — :class:`~atp_router.security.signing.ReplayGuard` (nonce cache per
  session + timestamp window): the check before issue 19;
* **durable sqlite** / **durable sqlite multiprocess** —
  :class:`~atp_router.security.signing.DurableReplayGuard` on the embedded store
  (``synchronous`` NORMAL; the second as ``--workers`` open it: an ``flock``
  around each write) — the memory check plus one ``record_nonce``;
* **durable redis everysec** / **always** — the same on a private
  redis-server on loopback with AOF ``appendfsync everysec`` and ``always``;
* floors: the same store's cheapest write — SQLite ``put`` of a 40-byte kv
  value, Redis ``put`` (one EVALSHA ``SET``) — so the added cost reads as
  "about one small store write".

Each cell is wall µs per frame (best of ``--rounds`` rounds of ``--n``) and, in
brackets, this thread's CPU µs (the router's trio thread pays it; the rest is
waiting for the server or the disk). Each store also holds 50,000 live nonces
of other tenants while measured (the sweep and the indexes at a realistic size).
Last line ``REPLAY us_per_frame memory=… sqlite=… sqlite_mp=… redis=… redis_always=…``.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from atp_router.security.signing import (
    DurableReplayGuard,
    KeyRing,
    ReplayGuard,
    sign_outbound,
)
from atp_router.store import SqliteStore, Store
from atp_router.store.redis import RedisStore
from atp_router.wire.codec import FrameCodec
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
from tests.peers import RedisServer, find_redis_server, free_port

RING = KeyRing({"k2": b"k2-bench-key-0123456789abcdef", "k1": b"k1-bench-key-0123456789abcdef"})
CONTENT = {"diff": "x" * 1_100, "files": {"a.py": "print(1)\n"}}


def frames(n: int) -> list[Frame]:
    """``n`` distinct signed frames as the ingress has them after decode + HMAC."""
    codec = FrameCodec("json", keyring=RING)
    now = int(time.time() * 1000)
    out = []
    for i in range(n):
        f = Frame(v=1, session_id=f"sess-{i % 16}", stream_id=f"st-{i}", msg_seq=0, flags=[Flag.SYN],
                  meta={"task_type": "code_review"}, payload=Payload(type=PayloadType.TASK, content=CONTENT))
        out.append(codec.decode(FrameCodec("json").encode(sign_outbound(f, RING, now), seal_frame=False)))
    return out


def fill(store: Store, n: int = 50_000) -> None:
    """``n`` live nonces of other tenants (a store in use)."""
    now = int(time.time() * 1000)
    with store.batch():
        for i in range(n):
            store.record_nonce(f"tenant-{i % 50}", "k2", secrets.token_urlsafe(24), now_ms=now,
                               expires_ms=now + 270_000, max_per_tenant=10**6)


def measure(fn: Callable[[Frame], object], batch: list[Frame]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for f in batch:
        fn(f)
    n = len(batch)
    return (time.perf_counter() - t0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000, help="frames per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    exe = find_redis_server()
    if exe is None:
        sys.exit("redis-server is not installed (scripts/peers/redis.sh)")
    with tempfile.TemporaryDirectory(prefix="atp-bench-replay-") as d:
        servers: list[RedisServer] = []
        stores: list[Store] = []
        rows: list[tuple[str, Callable[[Frame], object]]] = []
        try:
            memory = ReplayGuard()
            rows.append(("memory (before)", lambda f: memory.check(("alice", f.session_id), f, int(time.time() * 1000))))
            subjects: list[tuple[str, Store]] = [
                ("sqlite", SqliteStore.open(Path(d) / "sqlite")),
                ("sqlite_mp", SqliteStore.open(Path(d) / "sqlite-mp", multiprocess=True)),
            ]
            for fsync in ("everysec", "always"):
                work = Path(d) / f"redis-{fsync}"
                work.mkdir()
                server = RedisServer(exe, work, free_port())
                server.start()
                servers.append(server)
                redis.Redis.from_url(server.url).config_set("appendfsync", fsync)
                subjects.append(("redis" if fsync == "everysec" else "redis_always",
                                 RedisStore.open(server.url, namespace="bench")))
            for name, store in subjects:
                stores.append(store)
                fill(store)
                guard = DurableReplayGuard(store, RING)
                rows.append((f"durable {name}", lambda f, g=guard: g.check("alice", f, int(time.time() * 1000))))
                counter = iter(range(10**9))
                rows.append((f"  floor {name} (kv put)",
                             lambda f, s=store, c=counter: s.put(f"floor-{next(c)}", b"v" * 40)))
            best: dict[str, tuple[float, float]] = {}
            for _ in range(args.rounds):
                for label, fn in rows:
                    wall, cpu = measure(fn, frames(args.n))
                    old = best.get(label)
                    best[label] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
            print(f"replay check per signed frame: wall µs [this thread's CPU µs], best of {args.rounds} rounds × "
                  f"{args.n} (stores hold 50,000 other nonces)")
            for label, _ in rows:
                w, c = best[label]
                print(f"{label:34}{w:>10.1f} [{c:>6.1f}]")
            b = {label.split(" ", 1)[-1]: v[0] for label, v in best.items() if label.startswith("durable")}
            print(f"REPLAY us_per_frame memory={best['memory (before)'][0]:.1f} sqlite={b['sqlite']:.0f} "
                  f"sqlite_mp={b['sqlite_mp']:.0f} redis={b['redis']:.0f} redis_always={b['redis_always']:.0f}")
        finally:
            for store in stores:
                store.close()
            for server in servers:
                server.stop()


if __name__ == "__main__":
    main()
