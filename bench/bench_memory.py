"""The router's memory: RSS idle, during and after a load run, after the retention age, per open idle stream (issue 10 item 3).

Run: ``python bench/bench_memory.py [--tasks 5000] [--rate 50] [--retain-s 20]
[--idle-streams 10000] [--waiting-streams 1000] [--skip-no-trim]``. Plain
script, ≈ 9 min with the defaults on 2 cores. What it does, printing each step:

1. Starts a **mock OpenAI upstream** (``bench_gateway.py --mock-upstream``: 6
   content chunks, usage, ``[DONE]``) and a **silent upstream** (this script with
   ``--silent-upstream PORT``: accepts TCP connections, reads, never answers).
   Then, one after the other, **``atp-router`` processes** on bench_gateway.py's
   RIB (``openai_compat`` agent ``model.m`` at the mock, policy ``chat``) plus an
   agent ``model.silent`` at the silent upstream (policy ``wait``, task type
   ``wait``); each with its own ``--state-dir``, ``--no-watch``, one bearer token
   (tenant ``bench``, roles client+operator), the tenant's open rate and stream
   quota lifted out of the way, ``--max-streams`` above the streams held,
   ``--idle-task-s 3600`` and ``--retain-closed-s <--retain-s>``; the retention
   count and byte bounds are the router's defaults unless ``--router-arg`` says
   otherwise. Every router first runs the same warm-up — 100 tasks, half over
   HTTP+SSE, half over WebSocket — and 2 s of quiet: its **idle** RSS, the
   baseline its other rows are compared with.
2. **Load run** (a router as it ships, then one with ``--no-idle-trim``, unless
   ``--skip-no-trim``: the comparison shows what the idle trim gives back):
   ``--tasks`` tasks started at ``--rate`` per second whatever is in flight
   (open loop), alternately over HTTP+SSE (``POST /v1/streams`` then ``GET
   /v1/streams/{id}/events`` to the FIN) and over one WebSocket (SYN with the
   task, FINAL, our FIN); each must complete whole (FINAL with the mock's last
   token; failures are counted with their reason). RSS is sampled every 0.25 s
   (peak, mean). **After load**: RSS 2 s after the last task, with the closed
   streams the router still keeps in memory (``atp_retained_streams`` /
   ``atp_retained_bytes`` from ``/v1/metrics``); then, once the retention age,
   the table's sweep and the idle trim (≤ 10 s apart) have passed, RSS again.
3. **Idle streams** (a router of their own): ``--idle-streams`` streams opened
   over WebSocket and left **idle** — each a SYN with task type ``chat`` and *no
   task payload*, answered by the router's SYN+ACK: the stream is open (it counts
   against ``--max-streams`` and holds its ledger account and its follower on
   the connection) and waits for its task, which never comes. 40 connections,
   one client session of 250 streams each, each connection sending an HB every
   5 s (the router's sessions send theirs). RSS once every SYN+ACK is in, minus
   the RSS just before, per stream; RSS again 10 s later (does an open stream
   grow while it waits?); then the client resets them all (RST) and RSS once they
   left memory (a stream that delivered no result stays 1 s).
4. **Waiting streams** (a router of their own): ``--waiting-streams`` streams
   opened over WebSocket *with* a task routed to ``model.silent``: the calls hang
   (up to the router's ``--slots`` in flight, the rest queued for a slot).
   Measured as the idle streams.

Prints a table (MB, and the difference from that router's idle RSS) and last
the line ``MEMORY idle_mb=… after_load_mb=… delta_mb=… after_retention_mb=…
delta_retention_mb=… idle_stream_kb=… waiting_stream_kb=…
waiting_stream_kb_per_s=… notrim_delta_retention_mb=…`` (``delta_mb``: after
load minus idle, the retention in effect; ``delta_retention_mb``: once the
retention age passed; ``notrim_…``: the same with ``--no-idle-trim``). RSS is
``VmRSS`` of ``/proc/<pid>/status`` of the router process.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_gateway import (
    RIB,
    Drivers,
    free_port,
    rss_mb,
    spawn,
    start_mock,
    start_router,
    stop_procs,
)

#: Streams per client session (the router's sessions take at most 256 at once).
PER_SESSION = 250
#: How much longer the open streams are held after the first measurement, s.
HOLD_S = 10.0

SILENT_RIB = """
  silent:
    provider: openai_compat
    base_url: http://127.0.0.1:{silent_port}/v1
    model: m
    ctx: 8k
    cost: 0
    max_out_tokens: 64
    temperature: 0
"""
SILENT_AGENT = """
  model.silent:
    layer: L2
    model: silent
    p95_ms: 1000
    timeout_ms: 3600000
    window: {{max_parallel: 100000, max_tokens: 1000000000000, max_usd_micros: 1000000000000}}
"""
SILENT_POLICY = """
  - name: wait
    match: {{task_type: wait}}
    fanout: [model.silent]
    budget: {{usd: 1.0, tokens: 100000}}
"""


def rib(mock_port: int, silent_port: int) -> str:
    """bench_gateway.py's RIB with the silent model, agent and policy added."""
    text = RIB.format(port=mock_port)
    text = text.replace("agents:\n", SILENT_RIB.format(silent_port=silent_port) + "agents:\n", 1)
    text = text.replace("policies:\n", SILENT_AGENT.format() + "policies:\n", 1)
    return text + SILENT_POLICY.format()


def run_silent(port: int) -> None:
    """An upstream that accepts connections, reads what comes and never answers."""
    import selectors

    sel = selectors.DefaultSelector()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(4096)
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is srv:
                conn, _ = srv.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
            else:
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()


async def metric(url: str, key: str, name: str) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(url + "/v1/metrics", headers={"authorization": f"Bearer {key}"})).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


class IdleConn:
    """One WebSocket carrying one client session of up to :data:`PER_SESSION` streams."""

    def __init__(self, ws, session) -> None:
        from atp_router.wire.codec import FrameCodec

        self.ws = ws
        self.session = session
        self.codec = FrameCodec("json")
        self.accepted = 0
        self.closed = 0

    async def send(self, frames) -> None:
        for f in frames:
            await self.ws.send_message(self.codec.encode(f).decode("utf-8"))

    async def reader(self) -> None:
        from atp_router.wire import session as S

        while True:
            msg = await self.ws.get_message()
            frame = self.codec.decode(msg.encode("utf-8") if isinstance(msg, str) else msg)
            import trio

            for ev in self.session.receive_frame(frame, trio.current_time()):
                if isinstance(ev, S.StreamAccepted):
                    self.accepted += 1
                elif isinstance(ev, (S.StreamReset, S.StreamFinished)):
                    self.closed += 1
                elif isinstance(ev, S.SendFrames):
                    await self.send(ev.frames)

    async def heartbeats(self) -> None:
        import trio

        while True:
            await trio.sleep(5.0)
            await self.send([self.session.heartbeat(trio.current_time())])


async def hold_streams(url: str, ws_url: str, key: str, n: int, task_type: str, with_task: bool, pid: int,
                       settle_s: float) -> dict:
    """Open ``n`` streams over WebSocket (no task, or a task), wait for every
    SYN+ACK, measure, then reset them all. RSS before, with them, and after."""
    import trio
    from trio_websocket import open_websocket_url

    from atp_router.wire import session as S
    from atp_router.wire.errors import ErrorCode
    from atp_router.wire.frame import Payload, PayloadType

    out: dict = {"before": rss_mb(pid)}
    payload = Payload(type=PayloadType.TASK, content={"messages": [{"role": "user", "content": "wait"}]})
    conns: list[IdleConn] = []
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for c in range((n + PER_SESSION - 1) // PER_SESSION):
            ws = await nursery.start(_open_ws, open_websocket_url, ws_url, key)
            conn = IdleConn(ws, S.Session(S.Role.CLIENT, f"sess_{task_type}_{c}", now=trio.current_time()))
            conns.append(conn)
            nursery.start_soon(conn.reader)
            nursery.start_soon(conn.heartbeats)
            count = min(PER_SESSION, n - c * PER_SESSION)
            for i in range(count):
                # Stream ids are unique per tenant (the HTTP API names a stream by its id alone).
                await conn.send([conn.session.open_stream(f"{task_type}{c}_{i}", {"task_type": task_type}, None,
                                                          payload=payload if with_task else None)])
        while sum(c.accepted for c in conns) < n:
            if time.monotonic() - t0 > 300:
                raise SystemExit(f"only {sum(c.accepted for c in conns)}/{n} streams accepted in 300 s")
            await trio.sleep(0.2)
        out["open_s"] = time.monotonic() - t0
        await trio.sleep(settle_s)
        out["with"] = rss_mb(pid)
        # Held longer: does an open stream's memory grow while it waits?
        await trio.sleep(HOLD_S)
        out["with_later"] = rss_mb(pid)
        for conn in conns:
            for sid in conn.session.open_streams:
                if sid != S.HB_STREAM_ID:
                    await conn.send([conn.session.reset(sid, ErrorCode.ETIMEOUT, "bench done")])
        # A stream that delivered no result leaves memory after 1 s; the idle trim follows 2 s later.
        await trio.sleep(settle_s + 5.0)
        out["after"] = rss_mb(pid)
        out["after_open"] = await metric(url, key, "atp_open_streams")
        out["after_kept"] = await metric(url, key, "atp_retained_streams")
        nursery.cancel_scope.cancel()
    return out


async def _open_ws(open_websocket_url, url: str, key: str, task_status) -> None:
    import trio

    async with open_websocket_url(url, subprotocols=["atp.v1.json"], message_queue_size=1024,
                                  extra_headers=[(b"authorization", f"Bearer {key}".encode())]) as ws:
        task_status.started(ws)
        await trio.sleep_forever()


async def warm_up(drivers: Drivers, pid: int, res: dict) -> None:
    import trio

    res["start"] = rss_mb(pid)
    print("  warm-up: 100 tasks (50 HTTP+SSE, 50 WebSocket) ...", flush=True)
    oks = [await drivers.run("atp_http" if i % 2 else "atp_ws") for i in range(100)]
    if not all(oks):
        raise SystemExit(f"warm-up: {oks.count(False)}/100 tasks failed")
    await trio.sleep(2.0)
    res["idle"] = rss_mb(pid)
    print(f"  idle RSS {res['idle']:.1f} MB", flush=True)


async def load_phases(args: argparse.Namespace, url: str, ws_url: str, key: str, pid: int) -> dict:
    """Steps 2–4 of the module doc on one router: idle, load, after load, after the retention age."""
    import trio

    res: dict = {}
    async with Drivers({"atp_http": url, "atp_ws": ws_url}, {"atp_http": key, "atp_ws": key}) as drivers:
        await warm_up(drivers, pid, res)
        print(f"  load: {args.tasks} tasks at {args.rate:g}/s, alternately HTTP+SSE and WebSocket ...", flush=True)
        samples: list[float] = []
        why: Counter[str] = Counter()
        done = failed = 0

        async def one(i: int) -> None:
            nonlocal failed, done
            target = "atp_http" if i % 2 else "atp_ws"
            try:
                ok = await drivers.run(target)
            except Exception as e:  # noqa: BLE001 - a transport error is a failed task, counted
                ok = False
                why[f"{target}: {type(e).__name__}: {str(e)[:80]}"] += 1
            else:
                if not ok:
                    why[f"{target}: incomplete answer"] += 1
            if ok:
                done += 1
            else:
                failed += 1

        async def sampler() -> None:
            while True:
                samples.append(rss_mb(pid))
                await trio.sleep(0.25)

        t0 = time.monotonic()
        async with trio.open_nursery() as outer:
            outer.start_soon(sampler)
            async with trio.open_nursery() as nursery:
                start = trio.current_time() + 0.05
                for i in range(args.tasks):
                    await trio.sleep_until(start + i / args.rate)
                    nursery.start_soon(one, i)
            outer.cancel_scope.cancel()
        res["load_s"] = time.monotonic() - t0
        res["load_peak"], res["load_mean"] = max(samples), sum(samples) / len(samples)
        res["done"], res["failed"] = done, failed
        for reason, n in why.most_common(5):
            print(f"  failed: {n} x {reason}", flush=True)
        print(f"  {done} done, {failed} failed in {res['load_s']:.1f} s; RSS peak {res['load_peak']:.1f} MB",
              flush=True)
    await trio.sleep(2.0)
    res["after_load"] = rss_mb(pid)
    res["kept_streams"] = await metric(url, key, "atp_retained_streams")
    res["kept_bytes"] = await metric(url, key, "atp_retained_bytes")
    print(f"  after load RSS {res['after_load']:.1f} MB; {res['kept_streams']:.0f} closed streams "
          f"({res['kept_bytes'] / 2**20:.1f} MB of logs) in memory", flush=True)
    # The age, the table's sweep, and the idle trim after the last stream left (≤ 10 s apart).
    wait = args.retain_s + max(min(args.retain_s, 30.0), 1.0) + 12.0
    print(f"  waiting {wait:.0f} s: the retention age (--retain-closed-s {args.retain_s:g}), the sweep, "
          "the idle trim ...", flush=True)
    await trio.sleep(wait)
    res["after_retention"] = rss_mb(pid)
    res["kept_after"] = await metric(url, key, "atp_retained_streams")
    print(f"  RSS {res['after_retention']:.1f} MB; {res['kept_after']:.0f} closed streams in memory", flush=True)
    return res


async def stream_phases(args: argparse.Namespace, url: str, ws_url: str, key: str, pid: int) -> dict:
    """Steps 5–6 of the module doc on one router: idle, then idle streams, then waiting streams."""
    res: dict = {}
    async with Drivers({"atp_http": url, "atp_ws": ws_url}, {"atp_http": key, "atp_ws": key}) as drivers:
        await warm_up(drivers, pid, res)
    for name, n, task_type, with_task in (("idle_streams", args.idle_streams, "chat", False),
                                          ("waiting_streams", args.waiting_streams, "wait", True)):
        if name != f"{args.phase}_streams":
            continue
        what = "SYN without a task" if not with_task else "a task on the silent upstream"
        print(f"  {n} streams over WebSocket, {what} ...", flush=True)
        r = res[name] = await hold_streams(url, ws_url, key, n, task_type, with_task, pid, 3.0)
        r["n"] = n
        print(f"  opened in {r['open_s']:.1f} s; RSS {r['before']:.1f} -> {r['with']:.1f} MB "
              f"({(r['with'] - r['before']) * 1024 / n:.2f} KB a stream); after reset {r['after']:.1f} MB",
              flush=True)
    res["end"] = rss_mb(pid)
    return res


def report(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    load, notrim = runs["load"], runs.get("load_notrim")
    print(f"\nRouter RSS (VmRSS, MB) of atp-router processes, each against its own idle RSS after the same "
          f"warm-up. Python {sys.version.split()[0]}, {os.cpu_count()} CPUs.")
    cols = ["load run" + (", idle trim (default)" if notrim else "")]
    if notrim:
        cols.append("load run, --no-idle-trim")
    print(f"{'':<44}" + "".join(f"{c:>32}" for c in cols))

    def row(label: str, key: str, note=None) -> None:
        cells = []
        for r in [load] + ([notrim] if notrim else []):
            v = r[key]
            cells.append(f"{v:.1f} ({v - r['idle']:+.1f})" + (f" {note(r)}" if note else ""))
        print(f"{label:<44}" + "".join(f"{c:>32}" for c in cells))

    row("started, before any traffic", "start")
    row("idle (after 100 warm-up tasks) = baseline", "idle")
    row(f"during load, peak ({args.tasks} at {args.rate:g}/s)", "load_peak")
    row("during load, mean", "load_mean")
    row("after load (2 s later)", "after_load")
    row(f"after the retention age ({args.retain_s:g} s) + trim", "after_retention")
    for r, label in ((load, cols[0]), (notrim, cols[-1])):
        if r is not None:
            print(f"  {label}: {r['done']} tasks done, {r['failed']} failed in {r['load_s']:.0f} s; right after "
                  f"load {r['kept_streams']:.0f} closed streams in memory ({r['kept_bytes'] / 2**20:.1f} MB of "
                  f"logs), after the age {r['kept_after']:.0f}")
    print("\nOpen streams, each kind on a router process of its own (RSS before = its idle RSS after warm-up):")
    per: dict[str, float] = {}
    for name, label in (("idle_streams", "idle"), ("waiting_streams", "waiting")):
        r = runs.get(name.split("_")[0], {}).get(name)
        if r is None:
            per[name] = float("nan")
            continue
        per[name] = (r["with"] - r["before"]) * 1024 / r["n"]
        grow = (r["with_later"] - r["with"]) * 1024 / r["n"] / HOLD_S
        print(f"  {r['n']:>6} {label:<8} streams: {r['before']:.1f} -> {r['with']:.1f} MB = {per[name]:.2f} KB a "
              f"stream; {HOLD_S:g} s later {r['with_later']:.1f} MB ({grow:+.2f} KB a stream a second); after "
              f"they were reset {r['after']:.1f} MB ({r['after_open']:.0f} open, {r['after_kept']:.0f} closed in "
              "memory)")
        per[name + "_grow"] = grow
    extra = ""
    if notrim:
        extra = f" notrim_delta_retention_mb={notrim['after_retention'] - notrim['idle']:.1f}"
    print(f"MEMORY idle_mb={load['idle']:.1f} after_load_mb={load['after_load']:.1f} "
          f"delta_mb={load['after_load'] - load['idle']:.1f} after_retention_mb={load['after_retention']:.1f} "
          f"delta_retention_mb={load['after_retention'] - load['idle']:.1f} "
          f"idle_stream_kb={per['idle_streams']:.2f} waiting_stream_kb={per['waiting_streams']:.2f} "
          f"waiting_stream_kb_per_s={per.get('waiting_streams_grow', float('nan')):.2f}{extra}")


def bench(args: argparse.Namespace) -> int:
    import trio

    print(f"bench_memory: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    procs: list[subprocess.Popen] = []
    key = "atp-" + secrets.token_hex(32)
    try:
        silent_port = free_port()
        procs.append(spawn([sys.executable, __file__, "--silent-upstream", str(silent_port)], tmp / "silent.log"))
        started = start_mock(tmp, procs)
        if started is None:
            return 1
        mock_port, _ = started
        n_open = max(args.idle_streams, args.waiting_streams) + 1000
        plan = [("load", "load run (idle trim: the default)", load_phases, [])]
        if not args.skip_no_trim:
            plan.append(("load_notrim", "load run, --no-idle-trim", load_phases, ["--no-idle-trim"]))
        if args.idle_streams:
            plan.append(("idle", "open idle streams", stream_phases, []))
        if args.waiting_streams:
            plan.append(("waiting", "open waiting streams", stream_phases, []))
        runs: dict[str, dict] = {}
        for name, label, phases, extra in plan:
            r = start_router(tmp / name, rib(mock_port, silent_port), procs, key=key, roles="client+operator",
                             announce=label,
                             args=["--tenant-rate-per-s", "1000000", "--tenant-rate-burst", "1000000",
                                   "--tenant-max-streams", str(n_open), "--max-streams", str(n_open),
                                   "--idle-task-s", "3600", "--retain-closed-s", f"{args.retain_s:g}", *extra,
                                   *args.router_arg])
            if r is None:
                return 1
            router, rlog = r.proc, r.log
            args.phase = name
            runs[name] = trio.run(phases, args, r.url, r.ws_url, key, router.pid)
            if router.poll() is not None:
                print(f"!! the router exited ({router.returncode}); see {rlog}")
                return 1
            router.terminate()
            router.wait(timeout=20)
        report(args, runs)
        return 0
    finally:
        stop_procs(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=5000, help="tasks in the load run")
    ap.add_argument("--rate", type=float, default=50.0, help="tasks started per second in the load run")
    ap.add_argument("--retain-s", type=float, default=20.0, help="the router's --retain-closed-s, s")
    ap.add_argument("--idle-streams", type=int, default=10_000, help="open idle streams (0: skip)")
    ap.add_argument("--waiting-streams", type=int, default=1000,
                    help="streams waiting on a silent upstream (0: skip)")
    ap.add_argument("--skip-no-trim", action="store_true",
                    help="no second load run with --no-idle-trim (the comparison that shows what the trim gives)")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="one more atp-router argument (repeat), e.g. --router-arg=--retain-closed-bytes=1000000")
    ap.add_argument("--silent-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # SIGTERM (e.g. ``timeout``) unwinds like Ctrl-C: the servers started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.silent_upstream:
        run_silent(args.silent_upstream)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
