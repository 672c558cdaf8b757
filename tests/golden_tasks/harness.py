"""Golden code-review tasks through a real router: run, score, report.

Every task of ``shared/golden/dev.jsonl`` goes through a running router as any
application sends it (the SDK: ``POST /v1/streams`` then the SSE events until
FIN/RST); the FINAL (spec §7.3) is checked for shape and scored against the
task's expected defects with the rule of ``shared/golden/README.md``:

* a reported finding **matches** an expected one when the file is the same and
  the line ranges overlap within ±:data:`SLACK` (3) lines;
* **units**: each expected finding of a BugsInPy task is one unit; an advisory
  task (``advisory-fix``, ``advisory-introducing-commit``) is one unit as a whole,
  caught when any of its expected lines is (its fix also touches helper hunks);
* **recall** = caught units / units; a task is **caught** when any expected
  finding is matched;
* **precision** = reported findings matching some expected one / reported
  findings (``None`` when nothing was reported); findings that match nothing,
  ``negatives`` included, count against it;
* **cost**: telemetry tokens and USD summed over tasks;
* **latency**: p50/p95 (nearest rank) of the router's SYN→FINAL ``latency_ms``
  and of the client's wall time open→FINAL;
* **escalation rate**: share of tasks whose FINAL says it escalated (a
  ``consensus.uncertainties`` entry ``"escalated on …"``, as the dispatcher
  writes it) or carries a report from an agent outside the SYN-ACK's next-hops;
* **agreement**: mean of ``consensus.agreement``;
* **baseline** (:func:`changed_line_baseline`): the score of a reviewer that flags
  every changed line. Expected lines sit on or next to changed lines, so on this
  set it catches every task: a catch counts only as much as its claim names the
  defect, which the line rule cannot tell.

Run it::

    .venv/bin/python -m tests.golden_tasks.harness                 # in-process router, policies/
    .venv/bin/python tests/golden_tasks/harness.py --router http://127.0.0.1:7070
    .venv/bin/python -m tests.golden_tasks.harness --policies my_rib/ --concurrency 4 --json out.json

The scoring functions are pure (no I/O, no clock); only :func:`review_task`,
:func:`run_tasks` and :func:`run_golden` talk to a router.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

import atp
from atp.consensus.types import FinalResult
from atp.review.diff import parse_diff

ROOT = Path(__file__).resolve().parents[2]
#: The dev set (``shared/`` sits beside the repository).
GOLDEN_PATH = ROOT.parent / "shared" / "golden" / "dev.jsonl"
DEFAULT_POLICIES = ROOT / "policies"
#: Lines of slack each side when matching a finding to an expected defect.
SLACK = 3
#: Sources scored per task rather than per expected finding (golden README).
PER_TASK_SOURCES = frozenset({"advisory-fix", "advisory-introducing-commit"})
#: Prefix of the ``consensus.uncertainties`` entry the dispatcher adds when it escalated.
ESCALATED_PREFIX = "escalated on "
#: Budget sent with every task: generous, so the budget never shapes the score.
DEFAULT_BUDGET = {"usd": 0.10, "tokens": 200_000}


# --- the data set --------------------------------------------------------------------


class Expected(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One expected defect: lines ``start..end`` (1-based, inclusive) of ``file``
    after the diff. ``kind`` is ``changed`` or ``omission``."""

    file: str
    start: int
    end: int
    kind: str
    severity: str
    claim: str
    provenance: str


class GoldenTask(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One line of ``dev.jsonl`` (fields as the golden README describes them)."""

    id: str
    source: str
    repo: str
    base_commit: str
    buggy_commit: str
    diff: str
    files: dict[str, str]
    expected: list[Expected]
    negatives: list[dict[str, Any]] = []
    oracle: dict[str, Any] = {}
    split: str = "dev"

    @property
    def per_task(self) -> bool:
        """Scored as one unit (advisories) rather than per expected finding."""
        return self.source in PER_TASK_SOURCES


def load_tasks(path: Path = GOLDEN_PATH) -> list[GoldenTask]:
    """Every task of a golden JSONL file, in file order. Raises
    ``msgspec.ValidationError`` on a line that is not a task."""
    dec = msgspec.json.Decoder(GoldenTask)
    return [dec.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


# --- scoring (pure) --------------------------------------------------------------------


def parse_span(span: str) -> tuple[int, int]:
    """``"45-80"`` → ``(45, 80)``, ``"7"`` → ``(7, 7)``. Raises ``ValueError`` when
    it is not one or two positive line numbers in order."""
    a, sep, b = span.partition("-")
    start, end = int(a), int(b) if sep else int(a)
    if start < 1 or end < start:
        raise ValueError(f"span {span!r} is not 'start-end' with 1 <= start <= end")
    return start, end


def matches(
    file: str, start: int, end: int, expected: Expected | Mapping[str, Any], slack: int = SLACK
) -> bool:
    """Whether lines ``start..end`` of ``file`` overlap the expected defect's lines
    widened by ``slack`` on each side (same file required)."""
    e_file, e_start, e_end = (
        (expected.file, expected.start, expected.end)
        if isinstance(expected, Expected)
        else (expected["file"], expected["start"], expected["end"])
    )
    return file == e_file and start <= e_end + slack and end >= e_start - slack


class TaskRun(msgspec.Struct, kw_only=True):
    """What one task's stream produced, as the client saw it.

    ``final``: the FINAL payload (``None`` if the stream ended without one);
    ``events``: event types in order; ``errors``: ERROR/RST payloads;
    ``next_hops``: the route of the SYN-ACK; ``reporters``: agents whose report
    arrived as a PARTIAL; ``wall_ms``: client time from open to FINAL (or end).
    """

    id: str
    final: dict[str, Any] | None
    events: list[str]
    errors: list[dict[str, Any]] = []
    next_hops: list[str] = []
    reporters: list[str] = []
    wall_ms: float = 0.0


class TaskScore(msgspec.Struct, kw_only=True):
    """The score of one task. ``caught``: one flag per expected finding;
    ``units`` / ``units_caught``: scoring units (see the module docstring);
    ``matched``: reported findings matching an expected one, of ``findings``."""

    id: str
    source: str
    caught: list[bool]
    units: int
    units_caught: int
    findings: int
    matched: int
    tokens: int
    usd: float
    latency_ms: float
    wall_ms: float
    agreement: float
    escalated: bool
    matched_claims: list[str] = []

    @property
    def task_caught(self) -> bool:
        return any(self.caught)


class GoldenReport(msgspec.Struct, kw_only=True):
    """Aggregates over tasks. ``precision`` is ``None`` when no finding was
    reported; latencies in ms; ``usd`` in float USD."""

    tasks: list[TaskScore]
    n_tasks: int
    tasks_caught: int
    units: int
    units_caught: int
    recall: float
    findings: int
    matched: int
    precision: float | None
    tokens: int
    usd: float
    latency_p50_ms: float
    latency_p95_ms: float
    wall_p50_ms: float
    wall_p95_ms: float
    escalation_rate: float
    agreement_mean: float


def check_final(payload: Any) -> FinalResult:
    """The FINAL payload as a :class:`FinalResult`, checked against spec §7.3:
    exactly the fields of the schema, spans ``"start-end"``, finding ids unique,
    provenance non-empty. Raises ``ValueError`` (``msgspec.ValidationError`` is one)."""
    final = msgspec.convert(payload, FinalResult)
    ids = [f.id for f in final.result.findings]
    if len(set(ids)) != len(ids):
        raise ValueError(f"finding ids repeat: {ids}")
    for f in final.result.findings:
        parse_span(f.span)
        if not f.provenance:
            raise ValueError(f"finding {f.id} has no provenance")
    return final


def is_escalated(final: FinalResult, next_hops: Iterable[str], reporters: Iterable[str]) -> bool:
    """Whether the stream escalated: the dispatcher's ``"escalated on …"``
    uncertainty, or a report from an agent that was not a next-hop at SYN-ACK."""
    if any(u.startswith(ESCALATED_PREFIX) for u in final.result.consensus.uncertainties):
        return True
    return bool(set(reporters) - set(next_hops))


def score_spans(task: GoldenTask, spans: Sequence[tuple[str, int, int]]) -> tuple[list[bool], list[bool], int, int]:
    """Match reported ``(file, start, end)`` spans against the task's expected
    defects: ``(caught per expected, matched per span, units, units caught)``."""
    caught = [any(matches(file, s, e, exp) for file, s, e in spans) for exp in task.expected]
    matched = [any(matches(file, s, e, exp) for exp in task.expected) for file, s, e in spans]
    if task.per_task:
        return caught, matched, 1, int(any(caught))
    return caught, matched, len(caught), sum(caught)


def score_task(task: GoldenTask, run: TaskRun) -> TaskScore:
    """Score one task's run. Raises ``ValueError`` when the run has no FINAL or
    its FINAL is not of the §7.3 shape (the harness does not score broken runs)."""
    if run.final is None:
        raise ValueError(f"{task.id}: no FINAL (events {run.events}, errors {run.errors})")
    final = check_final(run.final)
    spans = [(f.file, *parse_span(f.span)) for f in final.result.findings]
    caught, matched, units, units_caught = score_spans(task, spans)
    hits = [(*span, f.claim) for span, f, m in zip(spans, final.result.findings, matched, strict=True) if m]
    tel = final.telemetry
    return TaskScore(
        id=task.id,
        source=task.source,
        caught=caught,
        units=units,
        units_caught=units_caught,
        findings=len(spans),
        matched=sum(matched),
        tokens=tel.tokens,
        usd=tel.usd,
        latency_ms=tel.latency_ms,
        wall_ms=run.wall_ms,
        agreement=final.result.consensus.agreement,
        escalated=is_escalated(final, run.next_hops, run.reporters),
        matched_claims=[f"{file}:{s}-{e} {claim}" for file, s, e, claim in hits],
    )


class Baseline(msgspec.Struct, kw_only=True):
    """What a reviewer flagging every changed line (and every deletion point)
    would score: the floor any real reviewer's numbers must be read against."""

    tasks_caught: int
    n_tasks: int
    units_caught: int
    units: int
    findings: int
    matched: int


def changed_line_baseline(tasks: Sequence[GoldenTask]) -> Baseline:
    """Score the every-changed-line reviewer on ``tasks`` (one one-line finding per
    added/changed line and per deletion point of the diff)."""
    tc = uc = units = nf = nm = 0
    for task in tasks:
        spans: list[tuple[str, int, int]] = []
        for d in parse_diff(task.diff):
            spans += [(d.path, n, n) for n in sorted(set(d.added) | set(d.deleted_at))]
        caught, matched, u, u_caught = score_spans(task, spans)
        tc += any(caught)
        uc += u_caught
        units += u
        nf += len(spans)
        nm += sum(matched)
    return Baseline(tasks_caught=tc, n_tasks=len(tasks), units_caught=uc, units=units, findings=nf, matched=nm)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` % of the
    values at or below it (``q`` in (0, 100]). Raises ``ValueError`` on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


def summarize(scores: Sequence[TaskScore]) -> GoldenReport:
    """Aggregate task scores (see the module docstring). Raises ``ValueError`` on
    no scores."""
    if not scores:
        raise ValueError("no task scores to summarize")
    units = sum(s.units for s in scores)
    units_caught = sum(s.units_caught for s in scores)
    findings = sum(s.findings for s in scores)
    matched = sum(s.matched for s in scores)
    lat = [s.latency_ms for s in scores]
    wall = [s.wall_ms for s in scores]
    return GoldenReport(
        tasks=list(scores),
        n_tasks=len(scores),
        tasks_caught=sum(s.task_caught for s in scores),
        units=units,
        units_caught=units_caught,
        recall=units_caught / units if units else 0.0,
        findings=findings,
        matched=matched,
        precision=matched / findings if findings else None,
        tokens=sum(s.tokens for s in scores),
        usd=sum(s.usd for s in scores),
        latency_p50_ms=percentile(lat, 50),
        latency_p95_ms=percentile(lat, 95),
        wall_p50_ms=percentile(wall, 50),
        wall_p95_ms=percentile(wall, 95),
        escalation_rate=sum(s.escalated for s in scores) / len(scores),
        agreement_mean=sum(s.agreement for s in scores) / len(scores),
    )


def format_report(report: GoldenReport, *, title: str = "golden dev set") -> str:
    """The report as a plain-text table: one row per task, then the aggregates."""
    head = f"{'task':<26} {'units':>6} {'caught':>6} {'findings':>8} {'matched':>7} {'tokens':>6} " \
           f"{'usd':>8} {'lat_ms':>7} {'wall_ms':>7} {'agree':>5} {'esc':>3}"
    lines = [f"== {title}: {report.n_tasks} tasks", head, "-" * len(head)]
    for s in report.tasks:
        lines.append(
            f"{s.id:<26} {s.units_caught:>3}/{s.units:<2} {'yes' if s.task_caught else 'no':>6} {s.findings:>8} "
            f"{s.matched:>7} {s.tokens:>6} {s.usd:>8.4f} {s.latency_ms:>7.0f} {s.wall_ms:>7.0f} "
            f"{s.agreement:>5.2f} {'yes' if s.escalated else 'no':>3}"
        )
        lines.extend(f"{'':<28}matched: {c}" for c in s.matched_claims)
    p = "n/a" if report.precision is None else f"{report.precision:.3f}"
    lines += [
        "-" * len(head),
        f"tasks caught      {report.tasks_caught}/{report.n_tasks}",
        f"recall (units)    {report.units_caught}/{report.units} = {report.recall:.3f}"
        "   (BugsInPy per expected finding, advisories per task)",
        f"precision         {report.matched}/{report.findings} = {p}",
        f"cost              {report.tokens} tokens, {report.usd:.6f} USD",
        f"latency SYN→FINAL p50 {report.latency_p50_ms:.0f} ms, p95 {report.latency_p95_ms:.0f} ms (router telemetry)",
        f"wall open→FINAL   p50 {report.wall_p50_ms:.0f} ms, p95 {report.wall_p95_ms:.0f} ms (client)",
        f"escalation rate   {report.escalation_rate:.3f}",
        f"agreement (mean)  {report.agreement_mean:.3f}",
    ]
    return "\n".join(lines)


# --- running tasks through a router ----------------------------------------------------


def task_meta(task: GoldenTask) -> dict[str, Any]:
    """The task meta a code-review client sends (the router adds ``diff_loc``)."""
    languages = sorted({Path(p).suffix.lstrip(".") for p in task.files if Path(p).suffix})
    return {"task_type": "code_review", "languages": languages}


async def review_task(
    client: atp.Client, task: GoldenTask, *, budget: Mapping[str, Any] = DEFAULT_BUDGET
) -> TaskRun:
    """Open one stream for ``task`` and follow its events to FIN/RST. A refused
    stream or a lost connection is recorded in ``errors`` (with an event
    ``"REFUSED"`` / ``"ETRANSPORT"``), not raised, so one task cannot hide the others."""
    t0 = trio.current_time()
    run = TaskRun(id=task.id, final=None, events=[])
    try:
        _, stream = await client.open_stream(
            task=task_meta(task), budget=budget, content={"diff": task.diff, "files": task.files}
        )
    except atp.ATPClientError as e:
        run.events.append("REFUSED")
        run.errors.append({"code": e.code, "reason": e.reason})
        return run
    run.next_hops = list(stream.route.get("next_hops", []))
    try:
        async for ev in client.events(stream):
            run.events.append(ev.type)
            if ev.type == "FINAL":
                run.final = ev.payload
                run.wall_ms = (trio.current_time() - t0) * 1000
            elif ev.type in ("ERROR", "RST") and isinstance(ev.payload, dict):
                run.errors.append(ev.payload)
            elif ev.type == "PARTIAL" and isinstance(ev.payload, dict) and "report" in ev.payload:
                run.reporters.append(str(ev.payload.get("agent")))
    except atp.ATPClientError as e:
        run.events.append(e.code)
        run.errors.append({"code": e.code, "reason": e.reason})
    if run.final is None:
        run.wall_ms = (trio.current_time() - t0) * 1000
    return run


async def run_tasks(
    url: str,
    tasks: Sequence[GoldenTask],
    *,
    token: str | None = None,
    concurrency: int = 1,
    budget: Mapping[str, Any] = DEFAULT_BUDGET,
) -> list[TaskRun]:
    """Run ``tasks`` through the router at ``url``, at most ``concurrency`` streams
    at once; runs come back in task order."""
    runs: list[TaskRun | None] = [None] * len(tasks)
    limiter = trio.CapacityLimiter(max(concurrency, 1))
    async with atp.Client(url, token, timeout=120.0) as client:

        async def one(i: int) -> None:
            async with limiter:
                runs[i] = await review_task(client, tasks[i], budget=budget)

        async with trio.open_nursery() as nursery:
            for i in range(len(tasks)):
                nursery.start_soon(one, i)
    return [r for r in runs if r is not None]


async def run_golden(
    tasks: Sequence[GoldenTask],
    *,
    url: str | None = None,
    policies: Path = DEFAULT_POLICIES,
    token: str | None = None,
    concurrency: int = 1,
) -> list[TaskRun]:
    """:func:`run_tasks` against ``url``, or against a router started in-process on
    127.0.0.1 (free ports) with the RIB at ``policies`` and stopped afterwards."""
    if url is not None:
        return await run_tasks(url, tasks, token=token, concurrency=concurrency)
    from atp.router.cli import run
    from atp.router.core import RouterConfig

    async with trio.open_nursery() as nursery:
        _, http_port, _ = await nursery.start(run, RouterConfig(policies=policies, http_port=0, ws_port=0))
        runs = await run_tasks(f"http://127.0.0.1:{http_port}", tasks, concurrency=concurrency)
        nursery.cancel_scope.cancel()
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the golden code-review tasks through an ATP router and score them.")
    ap.add_argument("--golden", type=Path, default=GOLDEN_PATH, help="tasks JSONL (default: shared/golden/dev.jsonl)")
    ap.add_argument("--policies", type=Path, default=DEFAULT_POLICIES, help="RIB for the in-process router")
    ap.add_argument("--router", help="use a running router at this URL instead of starting one")
    ap.add_argument("--token", help="bearer token for --router")
    ap.add_argument("--concurrency", type=int, default=1, help="streams in flight at once (default 1)")
    ap.add_argument("--task", action="append", help="run only this task id (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    tasks = load_tasks(args.golden)
    if args.task:
        tasks = [t for t in tasks if t.id in set(args.task)]
        if not tasks:
            print(f"no such task in {args.golden}: {args.task}", file=sys.stderr)
            return 2
    runs = trio.run(lambda: run_golden(
        tasks, url=args.router, policies=args.policies, token=args.token, concurrency=args.concurrency
    ))
    broken = [r for r in runs if r.final is None]
    for r in broken:
        print(f"{r.id}: no FINAL; events {r.events}; errors {r.errors}", file=sys.stderr)
    by_id = {t.id: t for t in tasks}
    scores = [score_task(by_id[r.id], r) for r in runs if r.final is not None]
    if not scores:
        print("no task produced a FINAL: nothing to score", file=sys.stderr)
        return 1
    report = summarize(scores)
    source = args.router or f"in-process router, RIB {args.policies}"
    print(format_report(report, title=f"{args.golden.name} via {source}"))
    b = changed_line_baseline(tasks)
    print(f"baseline          flagging every changed line would catch {b.tasks_caught}/{b.n_tasks} tasks, "
          f"{b.units_caught}/{b.units} units, precision {b.matched}/{b.findings}: the ±{SLACK} rule alone "
          "does not tell a real catch from noise on a changed line")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
