"""Flow control under load: ≥ 1,000 concurrent streams against failing, slow agents.

Run: ``python bench/load_router.py [--streams 1000] [--gold 100] [--seed 7]``.
Plain script, < 3 min on 2 cores, loopback only (127.0.0.1). Exit status 1 when
any budget is overshot (or fewer streams than asked were open at once), else 0.

A real router runs in this process (``atp_router.deploy.cli.run``) on a RIB written to a
temporary directory: one policy, three next-hops (top-2 fan-out, the third an
alternate for reroutes), a window of 2 calls per stream, and four clients, one
of which (``c3``) has a client budget it exhausts during the run. Its next-hops
are swapped, in the running generation, for :class:`ChaosAdapter`: each call plays
a :class:`atp_router.adapters.testing.ScriptedAdapter` script drawn at random — normal
(5–40 ms per fragment), slow (0.1–0.4 s per fragment), down (``EAGENTDOWN``),
hung (past the agent's 1.5 s timeout: ``ETIMEOUT``), and 5 % of answers billing
10× their preflight estimate (what the budget governor must cap).

The load generator is this script in a child process (``--client``), so the
router process's RSS and CPU are the router's alone. Over 8 WebSocket connections
(sans-IO client ``Session`` + JSON ``FrameCodec``, as ``bench_router.py`` does) it
runs two phases:

1. **gold alone**: ``--gold`` gold streams, one every 20 ms;
2. **flood**: ``--streams`` bronze (70 %) and silver (30 %) streams opened at once,
   and ``--gold`` gold streams again, one every 20 ms from 0.3 s in.

Stream budgets are drawn per stream (70 % USD 0.02, 20 % USD 0.003 — about one
and a half calls —, 10 % USD 0.0005 — below one call's estimate).

Reported: how every stream ended (FINAL, FINAL after EBUDGET, EBUDGET → FIN, RST
with its code …); the peak of streams open at once in the router; **budget
overshoot** from the router's ledger against independent limits — per stream
``min(asked, policy)``, per client its RIB budget, and the sum of the client's
stream accounts against the same (must all be 0); FINAL ``telemetry.usd`` above the
stream's budget (what the client is told it spent; reported, not the ledger);
gold p50/p95 latency without and with the flood, client-side (SYN → FIN/RST) and
router-side (FINAL ``telemetry.latency_ms``); router RSS growth per open stream
((peak RSS − RSS at start) / peak of open streams); the QoS slots (peak running,
peak gold queued, gold SLA misses, preemptions), the lowest ``cwnd`` of each
next-hop window, circuit-breaker failures. ``--agent-window N`` gives every
next-hop a window of N calls instead of the router's default.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from atp_router.flow.budget import usd_to_micros
from atp_router.policy.health import Health
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

CONNECTIONS = 8
CLIENTS = {"c0": "tok-load-0", "c1": "tok-load-1", "c2": "tok-load-2", "c3": "tok-load-3"}
C3_BUDGET_USD = 0.25
POLICY_BUDGET_USD = 0.05
#: USD micros per token of the chaos agents (USD 2 per 1M tokens).
MICROS_PER_TOKEN = 2
ESTIMATE = CostEstimate(in_tokens=600, out_tokens=300, usd=900 * MICROS_PER_TOKEN / 1e6)
BUDGETS = [(0.70, 0.02), (0.20, 0.003), (0.10, 0.0005)]  # (share, USD)
TASK = {"diff": "--- a/m.py\n+++ b/m.py\n@@ -1,1 +1,2 @@\n x = 1\n+y = eval(input())\n",
        "files": {"m.py": "x = 1\ny = eval(input())\n"}}

RIB = """
models:
  chaos: {{provider: openai_compat, base_url: "http://127.0.0.1:9/v1", ctx: 8k, cost: {micros_per_token}}}
agents:
  a1: {{layer: L2, p95_ms: 300, model: chaos, timeout_ms: 1500, win30d: 0.6{agent_window}}}
  a2: {{layer: L2, p95_ms: 300, model: chaos, timeout_ms: 1500, win30d: 0.5{agent_window}}}
  a3: {{layer: L2, p95_ms: 300, model: chaos, timeout_ms: 1500, win30d: 0.4{agent_window}}}
policies:
  - name: load
    match: {{task_type: load}}
    fanout: [a1, a2, a3]
    fanout_k: 2
    budget: {{usd: {policy_budget_usd}, tokens: 200_000}}
    window: {{max_parallel: 2, max_tokens: 200_000, max_usd_micros: 100_000}}
    deadline_ms: 30_000
clients:
  c0: {{}}
  c1: {{}}
  c2: {{}}
  c3: {{budget: {{usd: {c3_budget_usd}}}}}
"""


# --- the chaos next-hop (router process) ---------------------------------------------------------


class ChaosAdapter(ProviderAdapter):
    """A next-hop whose every call plays a randomly drawn ScriptedAdapter script
    (see the module docstring); ``outcomes`` counts the draws."""

    def __init__(self, name: str, rng: random.Random):
        self.name = name
        self.rng = rng
        self.outcomes: Counter[str] = Counter()

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        return ESTIMATE

    def health(self) -> Health:
        return Health()

    def _script(self) -> ScriptedAdapter:
        r = self.rng.random()
        tokens_in = self.rng.randint(400, 600)
        tokens_out = self.rng.randint(100, 300)
        if self.rng.random() < 0.05:  # billed far above the preflight estimate
            tokens_out *= 10
            self.outcomes["over-estimate"] += 1
        usage = Usage(tokens_in, tokens_out, (tokens_in + tokens_out) * MICROS_PER_TOKEN)
        if r < 0.03:
            self.outcomes["down"] += 1
            return ScriptedAdapter(self.name, fail_with=ErrorCode.EAGENTDOWN, fail_reason="chaos: 503",
                                   delay_s=self.rng.uniform(0.005, 0.05))
        if r < 0.05:
            self.outcomes["hung"] += 1
            return ScriptedAdapter(self.name, delay_s=5.0)
        slow = r < 0.25
        self.outcomes["slow" if slow else "normal"] += 1
        delay = self.rng.uniform(0.1, 0.4) if slow else self.rng.uniform(0.005, 0.04)
        half = Usage(tokens_in, tokens_out // 2, (tokens_in + tokens_out // 2) * MICROS_PER_TOKEN)
        return ScriptedAdapter(self.name, [
            Fragment(type=PayloadType.PARTIAL, content="reviewing", usage=half),
            Fragment(type=PayloadType.PARTIAL, content=" done", usage=usage),
            Fragment(type=PayloadType.FINAL, content={"findings": []}, usage=usage),
        ], delay_s=delay)

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        async for frag in self._script().stream(prompt):
            yield frag


def swap_in_chaos(router: Any, seed: int) -> list[ChaosAdapter]:
    """Replace the running generation's next-hops by ChaosAdapters (same names)."""
    rng = random.Random(seed)
    g = router.gen
    chaos = {name: ChaosAdapter(name, rng) for name in g.adapters}
    dispatcher = copy.copy(g.dispatcher)  # keeps the router's ledger, gates and hooks
    dispatcher.adapters = chaos
    router.gen = dataclasses.replace(g, adapters=chaos, dispatcher=dispatcher)
    return list(chaos.values())


# --- the load generator (child process) ----------------------------------------------------------


@dataclasses.dataclass
class Record:
    stream_id: str
    phase: str
    qos: str
    client: str
    budget_usd: float
    t0: float
    ms: float | None = None
    outcome: str = "open"
    codes: list[str] = dataclasses.field(default_factory=list)
    telemetry_usd: float | None = None
    #: The router's own SYN → FINAL ms (FINAL telemetry), without client-side queueing.
    router_ms: float | None = None
    reason: str = ""


class LoadConn:
    """One WebSocket, one client ``Session``, many streams (see bench_router.WsClient)."""

    def __init__(self, ws: Any, client: str):
        from atp_router.wire import session as S
        from atp_router.wire.codec import FrameCodec

        self.S = S
        self.ws = ws
        self.client = client
        self.codec = FrameCodec("json")
        self.session = S.Session(S.Role.CLIENT, "sess_" + secrets.token_hex(6), now=trio.current_time(),
                                 hb_interval=5.0, hb_timeout=600.0, max_streams=4096)
        self.records: dict[str, Record] = {}
        self.done: dict[str, trio.Event] = {}
        self.accepted: dict[str, trio.Event] = {}

    async def send(self, frames: Sequence[Any]) -> None:
        for f in frames:
            await self.ws.send_message(self.codec.encode(f).decode())

    async def reader(self) -> None:
        S = self.S
        while True:
            msg = await self.ws.get_message()
            frame = self.codec.decode(msg.encode() if isinstance(msg, str) else msg)
            fins = []
            for ev in self.session.receive_frame(frame, trio.current_time()):
                match ev:
                    case S.MessageReceived(stream_id=sid, payload=p) if p.type is PayloadType.FINAL:
                        rec = self.records.get(sid)
                        if rec is not None:
                            rec.telemetry_usd = p.content["telemetry"]["usd"]
                            rec.router_ms = p.content["telemetry"]["latency_ms"]
                    case S.ControlReceived(stream_id=sid, control=c) if type(c).__name__ == "ErrorPayload":
                        rec = self.records.get(sid)
                        if rec is not None:
                            rec.codes.append(str(c.code))
                    case S.StreamAccepted(stream_id=sid):
                        if sid in self.accepted:
                            self.accepted[sid].set()
                    case S.StreamFinished(stream_id=sid):
                        fins.append(sid)
                        self._end(sid, None)
                    case S.StreamReset(stream_id=sid, error=err):
                        if sid in self.records:
                            self.records[sid].reason = err.reason
                        self._end(sid, str(err.code))
                    case S.SendFrames(frames=frames):
                        await self.send(frames)
            for sid in fins:
                await self.send([self.session.finish(sid)])

    async def heartbeat(self) -> None:
        while True:
            await trio.sleep(2.0)
            await self.send([self.session.heartbeat(trio.current_time())])

    def _end(self, sid: str, rst_code: str | None) -> None:
        rec = self.records.get(sid)
        if rec is None or rec.ms is not None:
            return
        rec.ms = (time.perf_counter() - rec.t0) * 1000
        if rst_code is not None:
            rec.outcome = f"RST {rst_code}"
        elif rec.telemetry_usd is not None:
            rec.outcome = "FINAL after EBUDGET" if "EBUDGET" in rec.codes else "FINAL"
        else:
            rec.outcome = "EBUDGET → FIN" if "EBUDGET" in rec.codes else "FIN without FINAL"
        self.done[sid].set()
        if sid in self.accepted:
            self.accepted[sid].set()

    async def run_stream(self, rec: Record, timeout: float, go: trio.Event | None = None,
                         opened: trio.CapacityLimiter | None = None) -> None:
        """SYN with the task; or, with ``go``, SYN alone, then (once the SYN+ACK came
        and ``go`` is set) the task as message 1 — so every stream of the flood is
        open at once before any task runs."""
        from atp_router.wire.frame import Payload, QoS

        self.records[rec.stream_id] = rec
        done = self.done[rec.stream_id] = trio.Event()
        accepted = self.accepted[rec.stream_id] = trio.Event()
        meta = {"task_type": "load", "budget": {"usd": rec.budget_usd}}
        body = Payload(type=PayloadType.TASK, content=TASK)
        rec.t0 = time.perf_counter()
        with trio.move_on_after(timeout):
            if go is None:
                await self.send([self.session.open_stream(rec.stream_id, meta, None, qos=QoS(rec.qos), payload=body)])
            else:
                await self.send([self.session.open_stream(rec.stream_id, meta, None, qos=QoS(rec.qos))])
                await accepted.wait()
                if opened is not None:
                    opened.release_on_behalf_of(rec.stream_id)
                await go.wait()
                if done.is_set():
                    return
                rec.t0 = time.perf_counter()
                await self.send(self.session.send_message(rec.stream_id, body))
            await done.wait()
        if not done.is_set():
            rec.outcome = "client timeout"


def draw_budget(rng: random.Random) -> float:
    x = rng.random()
    for share, usd in BUDGETS:
        if x < share:
            return usd
        x -= share
    return BUDGETS[0][1]


async def client_main(ws_url: str, streams: int, gold: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    records: list[Record] = []
    names = list(CLIENTS)
    async with trio.open_nursery() as outer:
        conns: list[LoadConn] = []
        for i in range(CONNECTIONS):
            client = names[i % len(names)]
            ws = await outer.start(_ws, ws_url, CLIENTS[client])
            conn = LoadConn(ws, client)
            conns.append(conn)
            outer.start_soon(conn.reader)
            outer.start_soon(conn.heartbeat)

        def rec(phase: str, qos: str, i: int) -> tuple[LoadConn, Record]:
            conn = conns[i % CONNECTIONS]
            r = Record(f"{phase}-{qos}-{i}", phase, qos, conn.client, draw_budget(rng), 0.0)
            records.append(r)
            return conn, r

        async def trickle_gold(phase: str, start: float) -> None:
            await trio.sleep(start)
            async with trio.open_nursery() as n:
                for i in range(gold):
                    conn, r = rec(phase, "gold", i)
                    n.start_soon(conn.run_stream, r, 60.0)
                    await trio.sleep(0.02)

        print("phase gold-alone", file=sys.stderr, flush=True)
        await trickle_gold("alone", 0.0)
        await trio.sleep(0.5)
        print("phase flood", file=sys.stderr, flush=True)
        go = trio.Event()
        opened = trio.CapacityLimiter(streams)  # counts flood streams not yet accepted
        async with trio.open_nursery() as n:
            for i in range(streams):
                conn, r = rec("flood", "bronze" if rng.random() < 0.7 else "silver", i)
                await opened.acquire_on_behalf_of(r.stream_id)
                n.start_soon(conn.run_stream, r, 120.0, go, opened)
            with trio.move_on_after(60):
                while opened.borrowed_tokens:
                    await trio.sleep(0.01)
            go.set()
            n.start_soon(trickle_gold, "flood", 0.3)
        outer.cancel_scope.cancel()
    return [dataclasses.asdict(r) for r in records]


async def _ws(url: str, token: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from trio_websocket import open_websocket_url

    async with open_websocket_url(url, subprotocols=["atp.v1.json"], message_queue_size=4096,
                                  extra_headers=[("Authorization", f"Bearer {token}")]) as ws:
        task_status.started(ws)
        await trio.sleep_forever()


# --- the router process ---------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


def ledger_overshoot(router: Any, records: list[dict[str, Any]]) -> list[str]:
    """Ledger commits above independent limits: per stream ``min(asked, policy)``,
    per client its RIB budget, and the sum of the client's streams against it."""
    over: list[str] = []
    per_client: Counter[str] = Counter()
    for r in records:
        ctx = router.streams.find(r["client"], r["stream_id"])
        if ctx is None:
            continue  # refused at SYN: no account
        st = router.ledger.state(ctx.account)
        limit = usd_to_micros(min(r["budget_usd"], POLICY_BUDGET_USD))
        if st.committed_usd_micros > limit:
            over.append(f"stream {r['stream_id']}: committed {st.committed_usd_micros} > {limit} µUSD")
        if st.committed_tokens > 200_000:
            over.append(f"stream {r['stream_id']}: committed {st.committed_tokens} > 200000 tokens")
        per_client[r["client"]] += st.committed_usd_micros
    c3 = usd_to_micros(C3_BUDGET_USD)
    st = router.ledger.state("client:c3")
    if st.committed_usd_micros > c3:
        over.append(f"client c3: account committed {st.committed_usd_micros} > {c3} µUSD")
    if per_client["c3"] > c3:
        over.append(f"client c3: its streams committed {per_client['c3']} > {c3} µUSD")
    return over


async def bench(args: argparse.Namespace) -> int:
    from atp_router.deploy.cli import run
    from atp_router.runtime.config import RouterConfig

    d = Path(tempfile.mkdtemp(prefix="atp-load-"))
    agent_window = ("" if args.agent_window is None else
                    f", window: {{max_parallel: {args.agent_window}, max_tokens: 1_000_000_000, "
                    "max_usd_micros: 1_000_000_000}")
    (d / "load.yaml").write_text(RIB.format(micros_per_token=MICROS_PER_TOKEN, policy_budget_usd=POLICY_BUDGET_USD,
                                            c3_budget_usd=C3_BUDGET_USD, agent_window=agent_window))
    cfg = RouterConfig(policies=d, http_port=0, ws_port=0, client_tokens=CLIENTS, hb_timeout_s=600.0,
                       breaker_failures=20, breaker_window_s=10.0, breaker_backoff_s=0.5, seed=args.seed,
                       # One load generator opens 1,200 streams at once: lift the per-tenant quota and rate.
                       tenant_max_streams=100_000, tenant_rate_per_s=1e6, tenant_rate_burst=100_000)
    async with trio.open_nursery() as nursery:
        router, _, ws_port = await nursery.start(run, cfg)
        chaos = swap_in_chaos(router, args.seed)
        rss0 = rss_bytes()
        peak: dict[str, Any] = {"open": 0, "rss": rss0, "gold_queued": 0, "slots_running": 0, "cwnd": {}}
        stop = trio.Event()

        async def sample() -> None:
            while not stop.is_set():
                peak["open"] = max(peak["open"], router.open_count)
                peak["rss"] = max(peak["rss"], rss_bytes())
                q = router.gates.slots.scheduler.statistics()
                peak["gold_queued"] = max(peak["gold_queued"], q.gold.queued)
                peak["slots_running"] = max(peak["slots_running"], q.running)
                for agent, w in router.gates.agent_windows.statistics().items():
                    peak["cwnd"][agent] = min(peak["cwnd"].get(agent, math.inf), w.cwnd)
                await trio.sleep(0.02)

        nursery.start_soon(sample)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        cmd = [sys.executable, __file__, "--client", f"ws://127.0.0.1:{ws_port}", "--streams", str(args.streams),
               "--gold", str(args.gold), "--seed", str(args.seed)]
        proc = await trio.run_process(cmd, capture_stdout=True, stderr=None, check=False)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        stop.set()
        if proc.returncode != 0:
            print(f"load generator failed with exit status {proc.returncode}", file=sys.stderr)
            return 2
        out = json.loads(proc.stdout)
        records, client_cpu = out["records"], out["cpu_s"]
        with trio.move_on_after(5):  # let cut or cancelled calls settle their reservations
            while any(router.ledger.state(c.account).open_reservations for c in router.streams.values()):
                await trio.sleep(0.05)
        over = ledger_overshoot(router, records)
        breakers = router.gates.breakers.statistics(trio.current_time())
        qos = router.gates.slots.scheduler.statistics()
        nursery.cancel_scope.cancel()

    # --- report ---
    flood = [r for r in records if r["phase"] == "flood"]
    ends = Counter(r["outcome"] for r in records)
    by_qos: dict[str, Counter[str]] = {q: Counter() for q in ("gold", "silver", "bronze")}
    for r in flood:
        by_qos[r["qos"]][r["outcome"]] += 1
    told_over = [r for r in records if r["telemetry_usd"] is not None
                 and r["telemetry_usd"] > min(r["budget_usd"], POLICY_BUDGET_USD) + 1e-9]
    gold = {ph: [r["ms"] for r in records if r["phase"] == ph and r["qos"] == "gold" and r["ms"] is not None]
            for ph in ("alone", "flood")}
    gold_router = {ph: [r["router_ms"] for r in records if r["phase"] == ph and r["qos"] == "gold"
                        and r["router_ms"] is not None] for ph in ("alone", "flood")}
    gold_ok = {ph: sum(r["outcome"].startswith("FINAL") for r in records if r["phase"] == ph and r["qos"] == "gold")
               for ph in ("alone", "flood")}
    draws = Counter()
    for a in chaos:
        draws.update(a.outcomes)
    rss_growth = max(peak["rss"] - rss0, 0)

    print(f"\nATP router under load — {len(records)} streams ({args.streams} flood + 2 × {args.gold} gold), "
          f"{CONNECTIONS} WebSockets, seed {args.seed}, wall {wall:.1f} s, CPU router {cpu:.1f} s / load generator "
          f"{client_cpu:.1f} s")
    print(f"agent calls drawn: {dict(draws)}; breaker openings: "
          f"{ {a: s.failures for a, s in breakers.items()} } failures, states "
          f"{ {a: str(s.state) for a, s in breakers.items()} }")
    print(f"QoS slots: capacity {qos.capacity} (gold reserve {qos.gold_reserved}), peak running "
          f"{peak['slots_running']}, peak gold queued {peak['gold_queued']}, gold SLA misses {qos.gold_sla_misses}; "
          + ", ".join(f"{c} granted {getattr(qos, c).granted} preempted {getattr(qos, c).preempted} "
                      f"shed {getattr(qos, c).shed}" for c in ("gold", "silver", "bronze")))
    print("next-hop windows (AIMD, shared by all streams): lowest cwnd "
          + ", ".join(f"{a} {c:.1f}" for a, c in sorted(peak["cwnd"].items())))
    print("\n| how streams ended | all | flood gold | flood silver | flood bronze |")
    print("|---|---:|---:|---:|---:|")
    for outcome in sorted(ends, key=lambda o: -ends[o]):
        print(f"| {outcome} | {ends[outcome]} | {by_qos['gold'][outcome]} | {by_qos['silver'][outcome]} | "
              f"{by_qos['bronze'][outcome]} |")
    completed = sum(n for o, n in ends.items() if o != "client timeout" and o != "open")
    print(f"| **completed (ended by the router)** | {completed} / {len(records)} | | | |")
    print("\n| measure | value |")
    print("|---|---:|")
    print(f"| peak streams open at once (router) | {peak['open']} |")
    print(f"| budget overshoot, ledger vs limits (streams, client c3, Σ c3 streams) | {len(over)} |")
    print(f"| FINAL telemetry.usd above the stream's budget (what the client is told) | {len(told_over)} |")
    for ph, label in (("alone", "gold alone"), ("flood", "gold under bronze/silver flood")):
        print(f"| {label}: FINAL / p50 / p95 ms, client SYN → FIN | {gold_ok[ph]}/{len(gold[ph])} / "
              f"{pct(gold[ph], 50):.0f} / {pct(gold[ph], 95):.0f} |")
        print(f"| {label}: p50 / p95 ms, router SYN → FINAL (telemetry) | {pct(gold_router[ph], 50):.0f} / "
              f"{pct(gold_router[ph], 95):.0f} |")
    print(f"| router RSS growth per open stream: (peak − start) / peak open | "
          f"{rss_growth / max(peak['open'], 1) / 1024:.1f} KiB |")
    for line in over[:10]:
        print("OVERSHOOT:", line)
    if told_over:
        r = told_over[0]
        print(f"note: e.g. {r['stream_id']} budget USD {r['budget_usd']} told telemetry.usd {r['telemetry_usd']}")
    reasons = Counter(f"{r['outcome']}: {r['reason'][:90]}" for r in records if r["outcome"].startswith("RST"))
    for reason, n in reasons.most_common(6):
        print(f"  {n:5d} × {reason}")
    if over:
        return 1
    if peak["open"] < args.streams:
        print(f"only {peak['open']} streams were open at once (asked {args.streams})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000, help="flood streams opened at once (bronze 70 %%, silver 30 %%)")
    ap.add_argument("--gold", type=int, default=100, help="gold streams per phase, one every 20 ms")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--agent-window", type=int, metavar="N",
                    help="per-next-hop window of N calls (default: the router's default agent window)")
    ap.add_argument("--client", metavar="WS_URL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        cpu0 = time.process_time()
        records = trio.run(client_main, args.client, args.streams, args.gold, args.seed)
        sys.stdout.write(json.dumps({"records": records, "cpu_s": time.process_time() - cpu0}))
        return 0
    return trio.run(bench, args)


if __name__ == "__main__":
    sys.exit(main())
