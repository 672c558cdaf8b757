"""What admitting and releasing one next-hop call costs (issue 10; spec §5, §9, §10).

    .venv/bin/python bench/bench_admission.py [--n 20000] [--tasks 2000] [--repeat 3] [--baseline REV]

Part 1, sans-IO, µs of CPU per call (best of ``--repeat`` runs of ``--n``): one
uncontended call through :class:`~atp_router.flow.admission.AdmissionControl` —
``begin`` + ``step`` (breaker, both windows, a QoS slot, the next-hop queue, the
budget) + ``release`` (commit, AIMD on both windows, slot, breaker) — against the
floor: the same calls on the same sans-IO pieces made by hand in one function.
Then a contended call: it waits at the next-hop window and is handed the room
when the call ahead of it is released.

Part 2, trio, µs of CPU per next-hop call through :meth:`Dispatcher.run
<atp_router.runtime.dataplane.dispatch.Dispatcher.run>` (zero-cost adapters answering at once, a
two-next-hop route): ``--tasks`` tasks one after another (uncontended), and the
same tasks 32 at a time against next-hop windows of 2 calls and 8 QoS slots
(queueing, NACKs, hand-offs). The new dispatcher is compared with the baseline
in the same run: ``atp_router/runtime/dataplane/dispatch.py`` as of ``--baseline`` (default: the
commit before ``atp_router/flow/admission.py`` was added, or ``HEAD`` while it is not
committed; at the path it had then, git following its renames), loaded from git
beside the current one; both runs alternate, best
of ``--repeat``. Each row also counts the NACKs (EWINDOW) and WINDOW_UPDATEs the
dispatchers sent, which must be alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.consensus.types import AgentReport, Usage
from atp_router.flow.admission import AdmissionControl, Admit, Outcome, StreamFlow, Wait
from atp_router.flow.breaker import BreakerBoard, RetryPolicy
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.flow.qos import QosScheduler
from atp_router.flow.window import Estimate, WindowTable
from atp_router.flow.window import Window as FlowWindow
from atp_router.policy.fib import NextHop, Route
from atp_router.runtime.dataplane.dispatch import Dispatcher
from atp_router.runtime.dataplane.gates import FlowGates, SlotGate
from atp_router.runtime.dataplane.plan import TaskPlan
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType, QoS, Window

EST = Estimate(tokens=900, usd_micros=1_800)
ROOMY = Window(max_parallel=8, max_tokens=1_000_000, max_usd_micros=10_000_000)
TIGHT = Window(max_parallel=2, max_tokens=1_000_000, max_usd_micros=10_000_000)
USED = Usage(in_tokens=600, out_tokens=200, usd_micros=1_600)


def best_us(f: Callable[[], None], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        for _ in range(n):
            f()
        best = min(best, (time.thread_time() - t) / n * 1e6)
    return best


# ------------------------------------------------------------------ part 1: sans-IO


def sans_io(n: int, repeat: int) -> list[tuple[str, float]]:
    breakers = BreakerBoard()
    windows = WindowTable(ROOMY)
    sched = QosScheduler(64, gold_reserved=8)
    ledger = BudgetLedger()
    ledger.open("client", Allowance())
    ledger.open("s", Allowance(), parent="client")
    adm = AdmissionControl(breakers, windows, sched)
    flow = StreamFlow("s", FlowWindow(ROOMY), QoS.SILVER, ledger, "s")
    done = Outcome(tokens=800, usd_micros=1_600, timely=True)
    now = 1.0

    def composed() -> None:
        call = adm.begin(flow, "a", EST)
        d = adm.step(call, now)
        assert isinstance(d, Admit)
        adm.release(call, done, now)

    def by_hand() -> None:
        # The floor: what the gates themselves cost, called in the order admission calls them.
        if ledger.exhausted("s") is not None or not breakers.allow("a", now):  # before the gates...
            raise AssertionError
        hop = windows.window("a")
        if not (flow.window.admit_when_idle(EST).admitted and hop.admit_when_idle(EST).admitted):
            raise AssertionError
        if not flow.window.admit(EST).admitted:
            raise AssertionError
        stream_call = flow.window.on_send(EST)
        flow.window.update_due(now)
        ticket = sched.request("s", QoS.SILVER, now, key="a").ticket
        queue = windows.queue("a")
        queue.enqueue(ticket, EST, QoS.SILVER)
        ((_, hop_call),) = queue.pump()
        if ledger.exhausted("s") is not None:  # ...and again at the budget gate: others may have spent meanwhile
            raise AssertionError
        r = ledger.reserve("s", EST.tokens, EST.usd_micros)
        ledger.commit(r, 800, 1_600)
        ledger.exhausted("s")
        flow.window.on_complete(stream_call, 800, 1_600, ok=True, timely=True)
        hop.on_complete(hop_call, 800, 1_600, ok=True, timely=True)
        sched.release(ticket, now)
        breakers.on_result("a", now, True, None)
        flow.window.update_due(now)
        windows.queue("a").pump()

    tight = WindowTable(TIGHT)
    adm2 = AdmissionControl(BreakerBoard(), tight, QosScheduler(64, gold_reserved=8))
    flows = [StreamFlow(f"s{i}", FlowWindow(ROOMY), QoS.SILVER, ledger, "s") for i in range(3)]
    head = [adm2.begin(flows[i], "a", EST) for i in range(2)]
    for c in head:
        assert isinstance(adm2.step(c, now), Admit)

    def contended() -> None:
        # Two calls hold the next-hop's window; this one waits, NACKed, and is
        # handed the room when the oldest is released.
        call = adm2.begin(flows[2], "a", EST)
        d = adm2.step(call, now)
        assert isinstance(d, Wait)
        oldest = head.pop(0)
        assert adm2.release(oldest, done, now).wake == (call,)
        assert isinstance(adm2.step(call, now), Admit)
        head.append(call)

    return [
        ("gates by hand (floor)", best_us(by_hand, n, repeat)),
        ("AdmissionControl begin+step+release", best_us(composed, n, repeat)),
        ("  contended: wait, handed room, admit", best_us(contended, n, repeat)),
    ]


# ------------------------------------------------------------------ part 2: trio, old vs new


class ZeroAdapter(ProviderAdapter):
    """Answers at once: a FINAL with an empty report and fixed usage."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._final = Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=USED)

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        return CostEstimate(in_tokens=600, out_tokens=300, usd=0.0018)

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        await trio.lowlevel.checkpoint()  # as a network read would: other calls run meanwhile
        yield self._final


class CountingIO:
    def __init__(self, stream_id: str, counts: Counter) -> None:
        self.stream_id = stream_id
        self.counts = counts

    def emit_partial(self, agent: str, content: dict[str, Any], *, confidence: float | None = None) -> None:
        self.counts["PARTIAL"] += 1

    def emit_error(self, code, reason: str, *, agent: str | None = None, retry_after_ms: int | None = None) -> None:
        self.counts[str(code)] += 1

    def emit_window_update(self, update) -> None:
        self.counts["WINDOW_UPDATE"] += 1


#: The dispatcher's path in this tree; an older ``rev`` may have it elsewhere.
DISPATCH = "atp_router/runtime/dataplane/dispatch.py"


def dispatch_path_at(rev: str) -> str:
    """The path :data:`DISPATCH` had at ``rev``: git follows its renames back from
    ``HEAD`` and the first of those names that ``rev`` has is it (``DISPATCH``
    when none is, and ``git show`` then says so)."""
    names = subprocess.run(["git", "log", "--follow", "--name-only", "--format=", "--", DISPATCH], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.split()
    for path in dict.fromkeys([DISPATCH, *names]):
        if subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                          check=False).returncode == 0:
            return path
    return DISPATCH


def baseline_module(rev: str | None) -> tuple[ModuleType | None, str]:
    """The dispatcher (:data:`DISPATCH`) as of ``rev`` (see the module doc), imported
    beside the current one; ``None`` with the reason when it cannot be."""
    if rev is None:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "atp_router/flow/admission.py"],
                               cwd=ROOT, capture_output=True, text=True, check=False).stdout.split()
        rev = f"{added[-1]}^" if added else "HEAD"
    path = dispatch_path_at(rev)
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
    if src.returncode != 0:
        return None, f"git show {rev}: {src.stderr.strip()}"
    if "class AdmissionControl" in src.stdout or "AdmissionControl(" in src.stdout:
        return None, f"{rev} already has the new admission"
    name = "atp_router.runtime.dataplane._dispatch_baseline"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        exec(compile(src.stdout, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102
    except (ImportError, AttributeError, NameError, TypeError, SyntaxError) as e:  # what the old file needs may be gone
        return None, f"{rev}: {type(e).__name__}: {e}"
    return mod, rev


#: The current dispatcher's parts, named as the baseline's single module names them
#: (its one file since split into dispatch, gates and plan).
NEW_DISPATCH = SimpleNamespace(Dispatcher=Dispatcher, FlowGates=FlowGates, SlotGate=SlotGate, TaskPlan=TaskPlan)


async def run_tasks(impl: ModuleType | SimpleNamespace, tasks: int, concurrency: int, hop_window: Window, slots: int) -> tuple[float, Counter]:
    """CPU µs per next-hop call of ``tasks`` two-next-hop tasks, ``concurrency`` at a time."""
    counts: Counter = Counter()
    ledger = BudgetLedger()
    ledger.open("client", Allowance())
    slot_gate = impl.SlotGate(QosScheduler(slots, gold_reserved=1), lambda p: None)
    gates = impl.FlowGates(WindowTable(hop_window), slot_gate, BreakerBoard(), RetryPolicy())
    adapters = {a: ZeroAdapter(a) for a in ("a", "b")}
    dispatcher = impl.Dispatcher(adapters, ledger, win_rates={"a": 0.6, "b": 0.7}, gates=gates)
    hops = [NextHop(agent=a, weight=1.0, qos=QoS.SILVER, timeout_ms=10_000) for a in adapters]
    route = Route(policy="p", next_hops=hops, escalation=None, escalation_hop=None, budget=None, window=None,
                  consensus="union_tiebreak", qos=QoS.SILVER, deadline_ms=600_000)
    prompt = Prompt(task_type="code_review", content={"diff": "", "files": {}})
    todo = iter(range(tasks))

    async def worker() -> None:
        for i in todo:
            key = f"stream:{i}"
            ledger.open(key, Allowance(), parent="client")
            now = trio.current_time()
            plan = impl.TaskPlan(prompt=prompt, route=route, window=FlowWindow(ROOMY), ledger_key=key,
                                 qos=QoS.SILVER, started=now, deadline=now + 600, stream_id=key)
            await dispatcher.run(CountingIO(key, counts), plan)
            ledger.close(key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slot_gate.run)
        t = time.thread_time()
        async with trio.open_nursery() as workers:
            for _ in range(concurrency):
                workers.start_soon(worker)
        cpu = time.thread_time() - t
        nursery.cancel_scope.cancel()
    assert ledger.state("client").committed_tokens == tasks * 2 * USED.tokens  # every call ran and was committed
    return cpu / (tasks * 2) * 1e6, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="sans-IO calls per run")
    ap.add_argument("--tasks", type=int, default=2_000, help="tasks per trio run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="git revision of the old dispatcher")
    args = ap.parse_args()

    print("Part 1: sans-IO, one call (µs CPU, best of", args.repeat, "runs)")
    for name, us in sans_io(args.n, args.repeat):
        print(f"  {name:<40} {us:8.2f} µs")

    old, what = baseline_module(args.baseline)
    impls: list[tuple[str, ModuleType | SimpleNamespace]] = [("new (AdmissionControl)", NEW_DISPATCH)]
    if old is not None:
        impls.insert(0, (f"old ({what[:12]})", old))
    else:
        print(f"baseline unavailable: {what}")
    scenarios = [("uncontended, 1 task at a time", 1, ROOMY, 64), ("32 at a time, window 2, 8 slots", 32, TIGHT, 8)]
    print(f"\nPart 2: Dispatcher.run, zero-cost next-hops (µs CPU per next-hop call, best of {args.repeat})")
    for label, conc, hop_window, slots in scenarios:
        best: dict[str, float] = {}
        counts: dict[str, Counter] = {}
        for _ in range(args.repeat):
            for name, impl in impls:  # alternate, so a busy neighbour skews both alike
                us, c = trio.run(run_tasks, impl, args.tasks, conc, hop_window, slots)
                best[name] = min(best.get(name, float("inf")), us)
                counts[name] = c
        print(f"  {label}")
        for name, _ in impls:
            c = counts[name]
            print(f"    {name:<28} {best[name]:8.1f} µs   NACKs {c['EWINDOW']:>6}   WINDOW_UPDATEs "
                  f"{c['WINDOW_UPDATE']:>6}")
    if old is not None:
        print(f"\nADMISSION us_per_call old={best[impls[0][0]]:.1f} new={best[impls[1][0]]:.1f} (contended)")


if __name__ == "__main__":
    main()
