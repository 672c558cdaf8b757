"""``atp-router eval``: labelled code-review tasks through a router, scored (spec §18).

Every task of a task file (the golden format of ``shared/golden/README.md``, one
JSON object a line: ``id``, ``diff``, ``files``, ``expected``; ``source``,
``repo``, ``base_commit``, ``buggy_commit``, ``negatives``, ``oracle`` optional,
unknown fields ignored) goes through a router exactly as a client sends it (the
SDK: ``POST /v1/streams`` with ``{diff, files}``, then the SSE events until
FIN/RST). Each FINAL is checked against spec §7.3 and scored:

* a reported finding **matches** an expected one when the file is the same and
  the line ranges overlap within ±:data:`SLACK` (3) lines;
* **units**: each expected finding is one unit, except that an advisory task
  (``source`` ``advisory-fix`` / ``advisory-introducing-commit``) is one unit,
  caught when any of its expected lines is (its fix also touches helper hunks);
* **recall** = caught units / units; **recall@N** the same counting only each
  task's N findings ranked first (confidence, then severity); a task is
  **caught** when any expected finding is matched;
* **precision** = reported findings matching some expected one / reported
  findings (``None`` when nothing was reported); **F1** their harmonic mean
  (0 when precision is undefined);
* **cost**: FINAL telemetry tokens and USD, per task;
* **latency**: nearest-rank p50/p95 of the router's SYN→FINAL ``latency_ms``
  and of the client's wall time open→FINAL;
* **escalation rate**: tasks whose FINAL says it escalated (a
  ``consensus.uncertainties`` entry ``"escalated on …"``) or carries a report
  from an agent outside the SYN-ACK's next-hops;
* **agreement**: mean ``consensus.agreement``;
* **per agent** (from the PARTIAL reports, before consensus): findings, matched,
  precision — the measured confidence a RIB can calibrate an agent with
  (``--calibration FILE`` writes them);
* **baseline** (:func:`changed_line_baseline`): flagging every changed line;
* **by the right reason** (:func:`score_right`, issue 23): the same recall,
  precision, F1 and caught tasks, but a finding catches a defect only when its
  class (:mod:`atp_router.review.defects`: its rule, CWE or claim) is the
  defect's, and a finding on a ``negatives`` line is a false positive;
* **tests as a reviewer** (issue 23 item 4): the tasks that ship tests (a
  ``files`` path named as pytest collects tests, ``test_*.py`` / ``*_test.py``,
  or, with ``--checkouts DIR``, an operator's checkout ``DIR/<task id>`` holding
  one — sent as the task's ``repo``, which the pytest next-hop runs only inside
  its RIB ``options.repos``: :func:`ships_tests`, :func:`with_checkouts`), of them those a pytest next-hop (RIB ``tool: pytest`` or
  ``tests``) reported on, and those it caught, by line and by the right reason
  (its own findings, before consensus) — a line of its own per variant
  (:func:`tests_line`). The golden format carries no tests (a BugsInPy task's
  ``oracle`` names its test, ``files`` holds only the touched source file), so
  on the shipped dev set it reads ``0/26 tasks ship tests``;
* **leave-one-out** (``--leave-one-out``): each task runs on a copy of the RIB
  whose semgrep agents leave out the shipped rules written from it (their
  ``metadata.source_tasks``; :func:`loo_exclusions`, :func:`derive_rib`).

Several RIB variants (``--policies A.yaml B.yaml …``) are compared in one run;
the report is a table, a PNG of cost (USD per task) and latency against recall,
and a last line ``EVAL tasks=<n> caught=<k> recall=<r> precision=<p> f1=<f>
usd_per_task=<u> right=<k2>`` for the best variant (highest F1, then lowest USD
per task, then highest recall): the line-only figures, then the tasks caught for
the right reason.

A variant naming an ``openai_compat`` model on a loopback port that is not
answering gets the local model server (:class:`ModelServers`) started
on that port for its run, unless ``--no-start-models``.

Where the tasks run: without ``--url`` each variant gets a private router,
started in this process on loopback with a temporary state directory and
stopped after its tasks. With ``--url`` the running router is used: with no
``--policies`` as it is; with ``--policies`` each variant is hot-loaded through
``POST /v1/policies/reload`` (a token with the ``policy_reload`` role) and the
router's own policy path is reloaded afterwards, whatever happened.

The scoring functions are pure (no I/O, no clock); :func:`review_task`,
:func:`run_tasks`, :func:`run_variant` and :func:`main` talk to routers. What
the harness needs of the layers above it — a private router
(:data:`ServeRouter`) and the local model servers (:class:`ModelServers`) — its
caller passes in (``atp-router eval`` passes :func:`atp_router.deploy.cli.serve_private`
and :mod:`atp_router.adapters.local_model`), so this package imports neither the router
nor an adapter.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import atp
import httpx
import msgspec
import trio

from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.consensus.types import FinalResult
from atp_router.review.defects import defect_category, finding_category
from atp_router.task.change import languages_of
from atp_router.task.diff import parse_diff
from atp_router.wire.errors import PolicyError

__all__ = [
    "PRIVATE_ROUTER",
    "SLACK",
    "TEST_FILE",
    "AgentScore",
    "Baseline",
    "EvalReport",
    "Expected",
    "GoldenTask",
    "ModelServers",
    "ServeRouter",
    "TaskRun",
    "TaskScore",
    "best_variant",
    "changed_line_baseline",
    "check_final",
    "eval_line",
    "format_report",
    "format_table",
    "is_escalated",
    "load_tasks",
    "main",
    "matches",
    "parse_span",
    "percentile",
    "review_task",
    "run_tasks",
    "score_task",
    "ships_tests",
    "summarize",
    "tests_line",
    "with_checkouts",
]

#: Lines of slack each side when matching a finding to an expected defect.
SLACK = 3
#: Findings per task counted by recall@N unless ``--top`` says otherwise.
DEFAULT_TOP = 5
#: Sources scored per task rather than per expected finding (golden README).
PER_TASK_SOURCES = frozenset({"advisory-fix", "advisory-introducing-commit"})
#: Prefix of the ``consensus.uncertainties`` entry the dispatcher adds when it escalated.
ESCALATED_PREFIX = "escalated on "
#: Budget sent with every task: generous, so the budget never shapes the score.
DEFAULT_BUDGET = {"usd": 0.10, "tokens": 200_000}
#: A test file's name, as pytest collects them by default (``python_files``).
TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
#: The RIB tools of a pytest next-hop (:mod:`atp_router.adapters.tools.testrunner`).
TEST_TOOLS = frozenset({"pytest", "tests"})
#: A task file larger than this is refused (bytes): eval reads it whole.
MAX_TASK_FILE_BYTES = 256 * 1024 * 1024
_SEVERITY_RANK = {"critical": 4, "high": 3, "medium": 2, "low": 1, "info": 0}

#: The RouterConfig fields of a private router: rates that never throttle the tasks.
PRIVATE_ROUTER: dict[str, Any] = {"tenant_rate_per_s": 1000.0, "tenant_rate_burst": 1000, "learn_rate_per_s": 1000.0,
                                  "learn_burst": 1000}
#: ``serve_router(policies, state_dir, *, task_status, **config)``: serve a private
#: router for the RIB at ``policies`` on free loopback ports, its state in
#: ``state_dir`` and ``config`` (RouterConfig fields, :data:`PRIVATE_ROUTER`)
#: applied; ``task_status.started(http_port)``, then serve until cancelled; raise
#: ``PolicyError`` for a refused RIB (:func:`atp_router.deploy.cli.serve_private`).
ServeRouter = Callable[..., Awaitable[None]]


class ModelServers(Protocol):
    """The local model server as the harness starts it for a variant's loopback
    models: :mod:`atp_router.adapters.local_model` (the module itself is passed)."""

    # Read-only (a property): a module's class matches it, a settable ``type[Exception]`` it does not.
    @property
    def ModelServerError(self) -> type[Exception]: ...

    def loopback_models(self, rib: Mapping[str, Any]) -> list[tuple[int, str]]: ...
    def is_up(self, base_url: str) -> bool: ...
    def serve(self, port: int, alias: str) -> contextlib.AbstractContextManager[Any]: ...


# --- the data set --------------------------------------------------------------------


class Expected(msgspec.Struct, frozen=True):
    """One expected defect: lines ``start..end`` (1-based, inclusive) of ``file``
    after the diff. ``kind`` is ``changed`` or ``omission``; ``category`` (a name
    of :data:`atp_router.review.defects.CATEGORIES`) and ``cwe`` (``"CWE-78"``) are
    optional, read by the right-reason score when present; unknown fields are
    ignored."""

    file: str
    start: int
    end: int
    kind: str = "changed"
    severity: str = "medium"
    claim: str = ""
    provenance: str = ""
    category: str = ""
    cwe: str = ""

    @property
    def defect_class(self) -> str:
        """Its defect class (:func:`atp_router.review.defects.defect_category`)."""
        return defect_category(self.claim, category=self.category or None, cwe=self.cwe or None)


class GoldenTask(msgspec.Struct, frozen=True):
    """One task line (fields as ``shared/golden/README.md`` describes them;
    ``buggy_commit`` and the other provenance fields may be absent, unknown
    fields are ignored). ``checkout``: an operator's checkout of the task's
    project on this host, sent as the task's ``repo``; ``checkout_tests``: it
    holds a test file (both set by :func:`with_checkouts`)."""

    id: str
    diff: str
    files: dict[str, str]
    expected: list[Expected]
    source: str = ""
    repo: str = ""
    base_commit: str = ""
    buggy_commit: str = ""
    negatives: list[dict[str, Any]] = []
    oracle: dict[str, Any] = {}
    split: str = "dev"
    checkout: str = ""
    checkout_tests: bool = False

    @property
    def per_task(self) -> bool:
        """Scored as one unit (advisories) rather than per expected finding."""
        return self.source in PER_TASK_SOURCES

    def negative_spans(self) -> list[tuple[str, int, int]]:
        """The ``negatives`` as ``(file, start, end)``: each entry a ``file`` with
        ``start``/``end`` or ``line``; an entry of another shape is skipped."""
        out: list[tuple[str, int, int]] = []
        for n in self.negatives:
            try:
                start = int(n["start"] if "start" in n else n["line"])
                out.append((str(n["file"]), start, int(n.get("end", start))))
            except (KeyError, TypeError, ValueError):
                continue
        return out


def load_tasks(path: Path) -> list[GoldenTask]:
    """Every task of a JSONL task file, in file order. Raises ``ValueError``
    naming the line on a line that is not a task (``msgspec.ValidationError``
    is one), on a repeated task id, and on a file over
    :data:`MAX_TASK_FILE_BYTES`; ``OSError`` when it cannot be read."""
    if path.stat().st_size > MAX_TASK_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_TASK_FILE_BYTES:,} bytes")
    dec = msgspec.json.Decoder(GoldenTask)
    tasks: list[GoldenTask] = []
    seen: set[str] = set()
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = dec.decode(line)
        except msgspec.MsgspecError as e:
            raise ValueError(f"{path}:{n}: not a task: {e}") from None
        if task.id in seen:
            raise ValueError(f"{path}:{n}: task id {task.id!r} repeats")
        seen.add(task.id)
        tasks.append(task)
    return tasks


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
    arrived as a PARTIAL; ``reports``: agent → its report as sent (the
    PARTIAL's ``report``), for per-agent scores; ``wall_ms``: client time from
    open to FINAL (or end).
    """

    id: str
    final: dict[str, Any] | None
    events: list[str]
    errors: list[dict[str, Any]] = []
    next_hops: list[str] = []
    reporters: list[str] = []
    reports: dict[str, Any] = {}
    wall_ms: float = 0.0


class AgentTally(msgspec.Struct, kw_only=True):
    """One agent's raw findings on one task: how many, how many matched, how many
    matched for the right reason (:func:`score_right`)."""

    findings: int = 0
    matched: int = 0
    right: int = 0


class TaskScore(msgspec.Struct, kw_only=True):
    """The score of one task. ``caught``: one flag per expected finding;
    ``units`` / ``units_caught``: scoring units (see the module docstring);
    ``units_caught_top``: the same from the ``top`` first-ranked findings only;
    ``matched``: reported findings matching an expected one, of ``findings``;
    ``agents``: per-agent raw tallies (before consensus). Right-reason figures
    (:func:`score_right`): ``right_caught`` per expected finding,
    ``right_units_caught``, ``right_matched`` findings, ``negatives_hit`` findings
    on a ``negatives`` line; ``classes`` the expected defects' classes;
    ``excluded_rules`` the rules left out of this task's run (leave-one-out).
    Tests as a reviewer: ``ships_tests`` (:func:`ships_tests`); ``tests_ran``
    a pytest next-hop reported; ``tests_caught`` / ``tests_right`` one of its
    findings matched an expected defect by line / by the right reason."""

    id: str
    source: str
    caught: list[bool]
    units: int
    units_caught: int
    units_caught_top: int = 0
    findings: int
    matched: int
    tokens: int
    usd: float
    latency_ms: float
    wall_ms: float
    agreement: float
    escalated: bool
    matched_claims: list[str] = []
    agents: dict[str, AgentTally] = {}
    right_caught: list[bool] = []
    right_units_caught: int = 0
    right_matched: int = 0
    negatives_hit: int = 0
    classes: list[str] = []
    right_claims: list[str] = []
    excluded_rules: list[str] = []
    ships_tests: bool = False
    tests_ran: bool = False
    tests_caught: bool = False
    tests_right: bool = False

    @property
    def task_caught(self) -> bool:
        return any(self.caught)

    @property
    def task_right(self) -> bool:
        """Caught for the right reason: some expected defect matched by line and class."""
        return any(self.right_caught)


class AgentScore(msgspec.Struct, kw_only=True):
    """One agent's raw findings over all tasks (before consensus): ``precision``
    is the share that matched an expected defect (``None``: it reported none)."""

    agent: str
    tasks: int
    findings: int
    matched: int
    precision: float | None
    right: int = 0


class EvalReport(msgspec.Struct, kw_only=True):
    """Aggregates over tasks. ``precision`` is ``None`` when no finding was
    reported; ``f1`` is 0 then; latencies in ms; ``usd`` and ``usd_per_task`` in
    float USD; ``top`` is the N of ``recall_at_top``. The ``right_*`` fields are
    the same figures scored by the right reason (:func:`score_right`: class
    match, a finding on a ``negatives`` line a false positive), ``negatives_hit``
    the findings on such lines; ``leave_one_out`` is true when each task ran
    without the rules written from it (``excluded_rules`` per task).
    ``tests_tasks``: tasks that ship tests; of them ``tests_ran`` a pytest
    next-hop reported on, ``tests_caught`` / ``tests_right`` it caught by line /
    by the right reason (:class:`TaskScore`)."""

    tasks: list[TaskScore]
    n_tasks: int
    tasks_caught: int
    units: int
    units_caught: int
    recall: float
    top: int
    recall_at_top: float
    findings: int
    matched: int
    precision: float | None
    f1: float
    tokens: int
    usd: float
    tokens_per_task: float
    usd_per_task: float
    latency_p50_ms: float
    latency_p95_ms: float
    wall_p50_ms: float
    wall_p95_ms: float
    escalation_rate: float
    agreement_mean: float
    agents: list[AgentScore] = []
    failed: list[str] = []
    right_tasks_caught: int = 0
    right_units_caught: int = 0
    right_recall: float = 0.0
    right_matched: int = 0
    right_precision: float | None = None
    right_f1: float = 0.0
    negatives_hit: int = 0
    leave_one_out: bool = False
    tests_tasks: int = 0
    tests_ran: int = 0
    tests_caught: int = 0
    tests_right: int = 0


#: The harness's older name for :class:`EvalReport`.
GoldenReport = EvalReport


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


#: One finding as the right-reason score reads it: ``(file, start, end, class)``
#: (class ``None``: none could be read, never a right-reason catch).
Classed = tuple[str, int, int, str | None]


def score_right(task: GoldenTask, findings: Sequence[Classed]) -> tuple[list[bool], list[bool], list[bool], int]:
    """Score findings by the right reason: ``(caught per expected, right per
    finding, on a negatives line per finding, units caught)``.

    A finding whose lines overlap a ``negatives`` line of the task (and none of
    an expected defect's own lines) is a false positive: it matches nothing. Any
    other finding catches an expected defect when it :func:`matches` it by line
    and its class equals the defect's class (:attr:`Expected.defect_class`);
    units as in :func:`score_spans`."""
    negs = task.negative_spans()
    classes = [e.defect_class for e in task.expected]

    def on_negative(file: str, s: int, e: int) -> bool:
        return (any(file == nf and s <= ne and e >= ns for nf, ns, ne in negs)
                and not any(file == x.file and s <= x.end and e >= x.start for x in task.expected))

    neg = [on_negative(f, s, e) for f, s, e, _ in findings]
    hits = [[not n and c is not None and c == classes[j] and matches(f, s, e, exp)
             for j, exp in enumerate(task.expected)] for (f, s, e, c), n in zip(findings, neg, strict=True)]
    caught = [any(h[j] for h in hits) for j in range(len(task.expected))]
    units_caught = int(any(caught)) if task.per_task else sum(caught)
    return caught, [any(h) for h in hits], neg, units_caught


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _contributor(reports: Mapping[str, Any], prov: str) -> Mapping[str, Any] | None:
    """The agent finding behind provenance ``"<agent>#<ref>"`` in the PARTIAL
    reports: the one whose ``ref`` it is, else the one at index ``ref``."""
    agent, _, ref = prov.partition("#")
    report = reports.get(agent)
    findings = report.get("findings") if isinstance(report, Mapping) else None
    if not isinstance(findings, list):
        return None
    for f in findings:
        if isinstance(f, Mapping) and f.get("ref") == ref:
            return f
    if ref.isdigit() and int(ref) < len(findings) and isinstance(findings[int(ref)], Mapping):
        found: Mapping[str, Any] = findings[int(ref)]
        return found
    return None


def finding_class(provenance: Sequence[str], claim: str, reports: Mapping[str, Any],
                  analysers: Mapping[str, str]) -> str | None:
    """A merged finding's class: its lead contributor's (``provenance[0]``, who
    wrote the claim) — rule, CWE, claim (:func:`~atp_router.review.defects.finding_category`,
    the agent's analyser from ``analysers``, else its name) — or the merged
    claim's words when that contributor's report is not at hand."""
    if provenance:
        f = _contributor(reports, provenance[0])
        if f is not None:
            agent = provenance[0].partition("#")[0]
            return finding_category(analysers.get(agent, agent), _text(f.get("rule")), _text(f.get("cwe")),
                                    str(f.get("claim", "")))
    return finding_category("", None, None, claim)


def _agent_tallies(task: GoldenTask, reports: Mapping[str, Any],
                   analysers: Mapping[str, str]) -> dict[str, AgentTally]:
    out: dict[str, AgentTally] = {}
    for agent, report in reports.items():
        tally = out[agent] = AgentTally()
        findings = report.get("findings") if isinstance(report, Mapping) else None
        classed: list[Classed] = []
        for f in findings or []:
            try:
                file, start, end = str(f["file"]), int(f["start"]), int(f["end"])
            except (KeyError, TypeError, ValueError):
                continue
            start, end = min(start, end), max(start, end)
            tally.findings += 1
            tally.matched += any(matches(file, start, end, exp) for exp in task.expected)
            cls = finding_category(analysers.get(agent, agent), _text(f.get("rule")), _text(f.get("cwe")),
                                   str(f.get("claim", "")))
            classed.append((file, start, end, cls))
        tally.right = sum(score_right(task, classed)[1])
    return out


def ships_tests(task: GoldenTask) -> bool:
    """Whether ``task`` ships tests: a path of its ``files`` is a test file
    (:data:`TEST_FILE`), or its ``checkout`` holds one."""
    return task.checkout_tests or any(TEST_FILE.search(p) for p in task.files)


#: Directory entries :func:`with_checkouts` reads per checkout looking for a test file.
CHECKOUT_SCAN_MAX = 100_000


def with_checkouts(tasks: Sequence[GoldenTask], root: Path) -> list[GoldenTask]:
    """``tasks`` with ``checkout`` set to ``root/<task id>`` (absolute) where that
    is a directory, and ``checkout_tests`` when a test file is among its first
    :data:`CHECKOUT_SCAN_MAX` entries (``.git`` and symlinks not followed)."""
    out = []
    for t in tasks:
        d = root.resolve() / t.id
        if t.id in (".", "..") or "/" in t.id or not d.is_dir():
            out.append(t)
            continue
        seen, found = 0, False
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames[:] = [n for n in dirnames if n != ".git"]
            seen += len(dirnames) + len(filenames)
            found = any(TEST_FILE.search(f) for f in filenames)
            if found or seen > CHECKOUT_SCAN_MAX:
                break
        out.append(msgspec.structs.replace(t, checkout=str(d), checkout_tests=found))
    return out


def _tests_flags(task: GoldenTask, agents: Mapping[str, AgentTally], analysers: Mapping[str, str]) -> dict[str, bool]:
    """The tests-as-a-reviewer fields of :class:`TaskScore`."""
    mine = [t for a, t in agents.items() if analysers.get(a, a) in TEST_TOOLS]
    return {"ships_tests": ships_tests(task), "tests_ran": bool(mine),
            "tests_caught": any(t.matched for t in mine), "tests_right": any(t.right for t in mine)}


def score_task(task: GoldenTask, run: TaskRun, *, top: int = DEFAULT_TOP,
               analysers: Mapping[str, str] | None = None, excluded_rules: Sequence[str] = ()) -> TaskScore:
    """Score one task's run, by line and by the right reason; recall@``top``
    counts the ``top`` findings ranked first by confidence, then severity.
    ``analysers``: agent → the analyser (RIB ``tool``) behind it, for reading its
    rule codes (an agent not in it is read by its own name); ``excluded_rules``
    is recorded (the rules this task ran without). Raises ``ValueError`` when
    the run has no FINAL or its FINAL is not of the §7.3 shape."""
    if run.final is None:
        raise ValueError(f"{task.id}: no FINAL (events {run.events}, errors {run.errors})")
    final = check_final(run.final)
    findings = final.result.findings
    spans = [(f.file, *parse_span(f.span)) for f in findings]
    caught, matched, units, units_caught = score_spans(task, spans)
    ranked = sorted(range(len(findings)),
                    key=lambda i: (-findings[i].confidence, -_SEVERITY_RANK.get(str(findings[i].severity), 0), i))
    _, _, _, units_caught_top = score_spans(task, [spans[i] for i in ranked[:top]])
    hits = [(*span, f.claim) for span, f, m in zip(spans, findings, matched, strict=True) if m]
    tel = final.telemetry
    analysers = analysers or {}
    classed = [(*span, finding_class(f.provenance, f.claim, run.reports, analysers))
               for span, f in zip(spans, findings, strict=True)]
    r_caught, r_matched, on_neg, r_units = score_right(task, classed)
    agents = _agent_tallies(task, run.reports, analysers)
    return TaskScore(
        id=task.id,
        source=task.source,
        caught=caught,
        units=units,
        units_caught=units_caught,
        units_caught_top=units_caught_top,
        findings=len(spans),
        matched=sum(matched),
        tokens=tel.tokens,
        usd=tel.usd,
        latency_ms=tel.latency_ms,
        wall_ms=run.wall_ms,
        agreement=final.result.consensus.agreement,
        escalated=is_escalated(final, run.next_hops, run.reporters),
        matched_claims=[f"{file}:{s}-{e} {claim}" for file, s, e, claim in hits],
        agents=agents,
        right_caught=r_caught,
        right_units_caught=r_units,
        right_matched=sum(r_matched),
        negatives_hit=sum(on_neg),
        classes=[e.defect_class for e in task.expected],
        right_claims=[f"{c[0]}:{c[1]}-{c[2]} [{c[3]}] {f.claim}"
                      for c, f, m in zip(classed, findings, r_matched, strict=True) if m],
        excluded_rules=sorted(excluded_rules),
        **_tests_flags(task, agents, analysers),
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


def f1_score(recall: float, precision: float | None) -> float:
    """Harmonic mean of recall and precision (0 when precision is undefined or both are 0)."""
    if precision is None or recall + precision == 0:
        return 0.0
    return 2 * recall * precision / (recall + precision)


def _right_figures(scores: Sequence[TaskScore]) -> dict[str, Any]:
    """The right-reason aggregates of :class:`EvalReport` (``right_*``, ``negatives_hit``)."""
    units = sum(s.units for s in scores)
    findings = sum(s.findings for s in scores)
    right_units = sum(s.right_units_caught for s in scores)
    right_matched = sum(s.right_matched for s in scores)
    recall = right_units / units if units else 0.0
    precision = right_matched / findings if findings else None
    return {"right_tasks_caught": sum(s.task_right for s in scores), "right_units_caught": right_units,
            "right_recall": recall, "right_matched": right_matched, "right_precision": precision,
            "right_f1": f1_score(recall, precision), "negatives_hit": sum(s.negatives_hit for s in scores),
            "leave_one_out": any(s.excluded_rules for s in scores),
            "tests_tasks": sum(s.ships_tests for s in scores),
            "tests_ran": sum(s.ships_tests and s.tests_ran for s in scores),
            "tests_caught": sum(s.ships_tests and s.tests_caught for s in scores),
            "tests_right": sum(s.ships_tests and s.tests_right for s in scores)}


def summarize(scores: Sequence[TaskScore], *, failed: Sequence[str] = (), top: int = DEFAULT_TOP) -> EvalReport:
    """Aggregate task scores (see the module docstring); ``failed`` names tasks
    that ended without a FINAL (kept out of the scores, listed in the report).
    Raises ``ValueError`` on no scores."""
    if not scores:
        raise ValueError("no task scores to summarize")
    units = sum(s.units for s in scores)
    units_caught = sum(s.units_caught for s in scores)
    findings = sum(s.findings for s in scores)
    matched = sum(s.matched for s in scores)
    lat = [s.latency_ms for s in scores]
    wall = [s.wall_ms for s in scores]
    recall = units_caught / units if units else 0.0
    precision = matched / findings if findings else None
    per_agent: dict[str, list[int]] = {}
    for s in scores:
        for agent, t in s.agents.items():
            acc = per_agent.setdefault(agent, [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += t.findings
            acc[2] += t.matched
            acc[3] += t.right
    n = len(scores)
    return EvalReport(
        tasks=list(scores),
        n_tasks=n,
        tasks_caught=sum(s.task_caught for s in scores),
        units=units,
        units_caught=units_caught,
        recall=recall,
        top=top,
        recall_at_top=sum(s.units_caught_top for s in scores) / units if units else 0.0,
        findings=findings,
        matched=matched,
        precision=precision,
        f1=f1_score(recall, precision),
        tokens=sum(s.tokens for s in scores),
        usd=sum(s.usd for s in scores),
        tokens_per_task=sum(s.tokens for s in scores) / n,
        usd_per_task=sum(s.usd for s in scores) / n,
        latency_p50_ms=percentile(lat, 50),
        latency_p95_ms=percentile(lat, 95),
        wall_p50_ms=percentile(wall, 50),
        wall_p95_ms=percentile(wall, 95),
        escalation_rate=sum(s.escalated for s in scores) / n,
        agreement_mean=sum(s.agreement for s in scores) / n,
        agents=[AgentScore(agent=a, tasks=t, findings=f, matched=m, precision=m / f if f else None, right=r)
                for a, (t, f, m, r) in sorted(per_agent.items())],
        failed=list(failed),
        **_right_figures(scores),
    )


def format_report(report: EvalReport, *, title: str = "golden dev set") -> str:
    """One variant's report as a plain-text table: a row per task, then the aggregates."""
    head = f"{'task':<26} {'units':>6} {'caught':>6} {'findings':>8} {'matched':>7} {'tokens':>6} " \
           f"{'usd':>8} {'lat_ms':>7} {'wall_ms':>7} {'agree':>5} {'esc':>3}"
    lines = [f"== {title}: {report.n_tasks} tasks", head, "-" * len(head)]
    for s in report.tasks:
        lines.append(
            f"{s.id[:26]:<26} {s.units_caught:>3}/{s.units:<2} {'yes' if s.task_caught else 'no':>6} {s.findings:>8} "
            f"{s.matched:>7} {s.tokens:>6} {s.usd:>8.4f} {s.latency_ms:>7.0f} {s.wall_ms:>7.0f} "
            f"{s.agreement:>5.2f} {'yes' if s.escalated else 'no':>3}"
        )
        lines.extend(f"{'':<28}matched: {c}" for c in s.matched_claims)
        lines.append(f"{'':<28}class: {', '.join(sorted(set(s.classes)))}; right reason: "
                     f"{'yes' if s.task_right else 'no'}; on negatives lines: {s.negatives_hit}"
                     + (f"; run without {', '.join(s.excluded_rules)}" if s.excluded_rules else ""))
        lines.extend(f"{'':<28}right: {c}" for c in s.right_claims)
    p = "n/a" if report.precision is None else f"{report.precision:.3f}"
    lines += [
        "-" * len(head),
        f"tasks caught      {report.tasks_caught}/{report.n_tasks}",
        (f"recall (units)    {report.units_caught}/{report.units} = {report.recall:.3f}"
         f"   (BugsInPy per expected finding, advisories per task); recall@{report.top} {report.recall_at_top:.3f}"),
        f"precision         {report.matched}/{report.findings} = {p}",
        f"F1                {report.f1:.3f}",
        *_right_lines(report),
        f"cost              {report.tokens} tokens, {report.usd:.6f} USD ({report.usd_per_task:.6f} USD per task)",
        f"latency SYN→FINAL p50 {report.latency_p50_ms:.0f} ms, p95 {report.latency_p95_ms:.0f} ms (router telemetry)",
        f"wall open→FINAL   p50 {report.wall_p50_ms:.0f} ms, p95 {report.wall_p95_ms:.0f} ms (client)",
        f"escalation rate   {report.escalation_rate:.3f}",
        f"agreement (mean)  {report.agreement_mean:.3f}",
    ]
    for a in report.agents:
        ap = "n/a" if a.precision is None else f"{a.precision:.3f}"
        lines.append(f"agent {a.agent:<20} {a.findings} findings on {a.tasks} tasks, {a.matched} matched "
                     f"({a.right} for the right reason), precision {ap}")
    if report.failed:
        lines.append(f"no FINAL          {', '.join(report.failed)}")
    return "\n".join(lines)


def tests_line(report: EvalReport) -> str:
    """Tests as a reviewer, one line: ``<t>/<n> tasks ship tests (test files in
    files or a checkout); a pytest next-hop reported on <r>, caught <k> by line, <k2> for the
    right reason``."""
    return (f"{report.tests_tasks}/{report.n_tasks} tasks ship tests (test files in files or a checkout); "
            "a pytest next-hop "
            f"reported on {report.tests_ran}, caught {report.tests_caught} by line, {report.tests_right} for the "
            "right reason")


def _right_lines(report: EvalReport) -> list[str]:
    """The right-reason and tests lines of :func:`format_report`."""
    p = "n/a" if report.right_precision is None else f"{report.right_precision:.3f}"
    return [
        f"right reason      {report.right_tasks_caught}/{report.n_tasks} tasks, recall {report.right_units_caught}/"
        f"{report.units} = {report.right_recall:.3f}, precision {report.right_matched}/{report.findings} = {p}, "
        f"F1 {report.right_f1:.3f}; {report.negatives_hit} finding(s) on negatives lines"
        + (" (leave-one-out)" if report.leave_one_out else ""),
        f"tests reviewer    {tests_line(report)}",
    ]


def format_table(reports: Mapping[str, EvalReport]) -> str:
    """The comparison of variants: one row each (name → report, in order)."""
    head = (f"{'policy':<22} {'tasks':>5} {'caught':>6} {'recall':>6} {'r@N':>5} {'prec':>5} {'f1':>5} "
            f"{'right':>5} {'r.rec':>5} {'r.prec':>6} {'r.f1':>5} {'neg':>3} "
            f"{'tok/task':>8} {'usd/task':>9} {'p50_ms':>7} {'p95_ms':>7} {'esc':>5} {'agree':>5}")
    lines = [head, "-" * len(head)]
    for name, r in reports.items():
        p = "  n/a" if r.precision is None else f"{r.precision:5.3f}"
        rp = "   n/a" if r.right_precision is None else f"{r.right_precision:6.3f}"
        lines.append(
            f"{name[:22]:<22} {r.n_tasks:>5} {r.tasks_caught:>6} {r.recall:>6.3f} {r.recall_at_top:>5.3f} {p} "
            f"{r.f1:>5.3f} {r.right_tasks_caught:>5} {r.right_recall:>5.3f} {rp} {r.right_f1:>5.3f} "
            f"{r.negatives_hit:>3} {r.tokens_per_task:>8.0f} {r.usd_per_task:>9.6f} {r.latency_p50_ms:>7.0f} "
            f"{r.latency_p95_ms:>7.0f} {r.escalation_rate:>5.2f} {r.agreement_mean:>5.2f}"
        )
    return "\n".join(lines)


def best_variant(reports: Mapping[str, EvalReport]) -> str:
    """The best variant's name: highest F1, then lowest USD per task, then highest
    recall, then lowest p50 latency, then first given. Raises ``ValueError`` on
    no reports."""
    if not reports:
        raise ValueError("no reports to compare")
    order = list(reports)
    return min(order, key=lambda n: (-reports[n].f1, reports[n].usd_per_task, -reports[n].recall,
                                     reports[n].latency_p50_ms, order.index(n)))


def eval_line(report: EvalReport) -> str:
    """The exact last line: ``EVAL tasks=<n> caught=<k> recall=<r> precision=<p>
    f1=<f> usd_per_task=<u> right=<k2>`` (r, p, f three decimals, u six; p 0.000
    when nothing was reported; caught, recall, precision and f1 are the
    line-only figures; k2 the tasks caught for the right reason)."""
    p = report.precision or 0.0
    return (f"EVAL tasks={report.n_tasks} caught={report.tasks_caught} recall={report.recall:.3f} "
            f"precision={p:.3f} f1={report.f1:.3f} usd_per_task={report.usd_per_task:.6f} "
            f"right={report.right_tasks_caught}")


def calibration(reports: Mapping[str, EvalReport]) -> dict[str, dict[str, Any]]:
    """Per agent, pooled over the variants: tasks, findings, matched and the
    measured precision (``None`` with no findings) — what an agent's confidence
    should be calibrated to."""
    pooled: dict[str, list[int]] = {}
    for r in reports.values():
        for a in r.agents:
            acc = pooled.setdefault(a.agent, [0, 0, 0])
            acc[0] += a.tasks
            acc[1] += a.findings
            acc[2] += a.matched
    return {a: {"tasks": t, "findings": f, "matched": m, "precision": (m / f if f else None)}
            for a, (t, f, m) in sorted(pooled.items())}


def calibration_yaml(cal: Mapping[str, Mapping[str, Any]], *, source: str) -> str:
    """:func:`calibration` as YAML: one ``<agent>: {findings, matched}`` entry per
    agent that reported anything — the value of RIB ``agents.<agent>.calibration``
    (:class:`atp_router.policy.rib.CalibrationSpec`)."""
    lines = [f"# Measured by atp-router eval on {source}: each entry is agents.<name>.calibration in a RIB."]
    for agent, c in cal.items():
        if c["findings"]:
            lines.append(f"{agent}: {{findings: {c['findings']}, matched: {c['matched']}}}"
                         f"  # precision {c['precision']:.3f} over {c['tasks']} task runs")
        else:
            lines.append(f"# {agent}: no findings on {c['tasks']} task runs: nothing to calibrate")
    return "\n".join(lines) + "\n"


# --- running tasks through a router ----------------------------------------------------


def task_meta(task: GoldenTask) -> dict[str, Any]:
    """The task meta a code-review client sends (the router adds ``diff_loc``)."""
    return {"task_type": "code_review", "languages": languages_of(task.files)}


async def review_task(
    client: atp.Client, task: GoldenTask, *, budget: Mapping[str, Any] = DEFAULT_BUDGET
) -> TaskRun:
    """Open one stream for ``task`` and follow its events to FIN/RST. A refused
    stream or a lost connection is recorded in ``errors`` (with an event
    ``"REFUSED"`` / the error code), not raised, so one task cannot hide the others."""
    t0 = trio.current_time()
    run = TaskRun(id=task.id, final=None, events=[])
    try:
        _, stream = await client.open_stream(
            task=task_meta(task), budget=budget,
            content={"diff": task.diff, "files": task.files, **({"repo": task.checkout} if task.checkout else {})},
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
                agent = str(ev.payload.get("agent"))
                run.reporters.append(agent)
                run.reports[agent] = ev.payload["report"]
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
    timeout_s: float = 300.0,
) -> list[TaskRun]:
    """Run ``tasks`` through the router at ``url``, at most ``concurrency`` streams
    at once; runs come back in task order."""
    runs: list[TaskRun | None] = [None] * len(tasks)
    limiter = trio.CapacityLimiter(max(concurrency, 1))
    async with atp.Client(url, token, timeout=timeout_s) as client:

        async def one(i: int) -> None:
            async with limiter:
                runs[i] = await review_task(client, tasks[i], budget=budget)

        async with trio.open_nursery() as nursery:
            for i in range(len(tasks)):
                nursery.start_soon(one, i)
    return [r for r in runs if r is not None]


async def run_in_process(
    policies: Path, tasks: Sequence[GoldenTask], *, serve_router: ServeRouter, concurrency: int = 1,
    budget: Mapping[str, Any] = DEFAULT_BUDGET,
) -> list[TaskRun]:
    """:func:`run_tasks` against a private router (``serve_router``) on loopback
    (free ports, a temporary state directory) with the RIB at ``policies``,
    stopped afterwards. Raises :class:`~atp_router.wire.errors.PolicyError` when the
    RIB is refused."""
    with tempfile.TemporaryDirectory(prefix="atp-eval-") as state:
        async with trio.open_nursery() as nursery:
            http_port = await nursery.start(partial(serve_router, policies, Path(state), **PRIVATE_ROUTER))
            runs = await run_tasks(f"http://127.0.0.1:{http_port}", tasks, concurrency=concurrency, budget=budget)
            nursery.cancel_scope.cancel()
    return runs


async def _reload(url: str, token: str | None, body: bytes) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=30.0) as http:
        resp = await http.post(f"{url.rstrip('/')}/v1/policies/reload", content=body, headers=headers)
    if resp.status_code != 200:
        try:
            err = resp.json()
        except ValueError:
            err = resp.text[:500]
        raise RuntimeError(f"the router refused the policy reload (HTTP {resp.status_code}): {err}")


async def run_variant(
    tasks: Sequence[GoldenTask],
    *,
    policies: Path | None,
    url: str | None,
    token: str | None,
    concurrency: int,
    serve_router: ServeRouter,
    budget: Mapping[str, Any] = DEFAULT_BUDGET,
) -> list[TaskRun]:
    """One variant's runs: a private router (``serve_router``) for ``policies``
    (no ``url``), the running router as it is (``url``, no ``policies``), or the
    running router with ``policies`` hot-loaded (then its own policy path
    reloaded again).
    Raises ``RuntimeError`` when the running router refuses the RIB."""
    if url is None:
        assert policies is not None
        return await run_in_process(policies, tasks, serve_router=serve_router, concurrency=concurrency,
                                    budget=budget)
    if policies is None:
        return await run_tasks(url, tasks, token=token, concurrency=concurrency, budget=budget)
    await _reload(url, token, policies.read_bytes())
    try:
        return await run_tasks(url, tasks, token=token, concurrency=concurrency, budget=budget)
    finally:
        with trio.CancelScope(shield=True):
            await _reload(url, token, b"")  # empty body: the router's own --policies path


def plot(reports: Mapping[str, EvalReport], path: Path, *, title: str) -> None:
    """Write a PNG: recall against USD per task and against p50 latency, one
    marker per variant, named in the legend with its recall, F1 and cost.
    Raises ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    markers = "osD^v<>pPX*h"
    for i, (name, r) in enumerate(reports.items()):
        style = {"marker": markers[i % len(markers)], "s": 70, "alpha": 0.8, "color": f"C{i % 10}"}
        label = f"{name}: recall {r.recall:.2f}, F1 {r.f1:.2f}, ${r.usd_per_task * 1000:.4f}/1k tasks"
        ax1.scatter(r.usd_per_task * 1000, r.recall, label=label, **style)
        ax2.scatter(r.latency_p50_ms, r.recall, **style)
    ax1.set_xlabel("USD per 1,000 tasks")
    ax1.set_title("cost vs recall")
    ax2.set_xlabel("p50 latency SYN→FINAL (ms)")
    ax2.set_title("latency vs recall")
    for ax in (ax1, ax2):
        ax.set_ylabel("recall (units)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=-0.02, top=max([r.recall for r in reports.values()] + [0.1]) * 1.15)
    fig.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(reports) + 1) // 2), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rib_documents(path: Path) -> list[Any]:
    import yaml

    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    docs = []
    for f in files:
        try:
            docs.append(yaml.safe_load(f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the router reports it precisely when it loads the RIB
    return docs


def _start_models(local_model: ModelServers, policies: Path, stack: contextlib.ExitStack, name: str) -> None:
    """Start the local model server for each loopback ``openai_compat`` model of
    the RIB at ``policies`` that is not answering (when llama_cpp and the GGUF
    are installed); a server that cannot start is a warning, and the variant
    runs without it (its calls fail with EAGENTDOWN, as they would in production)."""
    for doc in _rib_documents(policies):
        for port, alias in local_model.loopback_models(doc if isinstance(doc, dict) else {}):
            if local_model.is_up(f"http://127.0.0.1:{port}/v1"):
                continue
            print(f"eval: {name}: starting the local model server ({alias}) on 127.0.0.1:{port}…",
                  file=sys.stderr, flush=True)
            try:
                stack.enter_context(local_model.serve(port, alias))
            except local_model.ModelServerError as e:
                print(f"WARNING: {name}: the local model server could not start ({e}); "
                      "the variant runs without it", file=sys.stderr, flush=True)


#: ``rule_sources()``: shipped rule id → (its pack, the golden task ids it may have
#: been written after reading) (:func:`atp_router.adapters.tools.semgrep.rule_sources`).
RuleSources = Callable[[], Mapping[str, tuple[str, frozenset[str]]]]


def rib_analysers(policies: Path | None) -> dict[str, str]:
    """Agent → the analyser behind it (its RIB ``tool``) for the RIB at
    ``policies`` (a file or a directory of them); ``{}`` for ``None``."""
    out: dict[str, str] = {}
    for doc in _rib_documents(policies) if policies is not None else []:
        agents = doc.get("agents") if isinstance(doc, dict) else None
        for name, spec in (agents or {}).items():
            if isinstance(spec, dict) and isinstance(spec.get("tool"), str):
                out[str(name)] = spec["tool"]
    return out


def _semgrep_packs(doc: Any, all_packs: Iterable[str]) -> list[tuple[dict[str, Any], set[str]]]:
    """Each semgrep agent's spec of one RIB document with the packs it runs."""
    agents = doc.get("agents") if isinstance(doc, dict) else None
    out = []
    for spec in (agents or {}).values():
        if isinstance(spec, dict) and spec.get("tool") == "semgrep":
            rules = (spec.get("options") or {}).get("rules")
            out.append((spec, set(rules) if isinstance(rules, list) else set(all_packs)))
    return out


def loo_exclusions(policies: Path, tasks: Sequence[GoldenTask],
                   sources: Mapping[str, tuple[str, frozenset[str]]]) -> dict[str, list[str]]:
    """Leave-one-out: task id → the shipped rules to leave out of its run — those
    whose source tasks name it, in a pack a semgrep agent of the RIB at
    ``policies`` runs. Tasks with nothing to leave out are absent."""
    all_packs = {pack for pack, _ in sources.values()}
    packs: set[str] = set()
    for doc in _rib_documents(policies):
        for _, p in _semgrep_packs(doc, all_packs):
            packs |= p
    out = {t.id: sorted(r for r, (pack, srcs) in sources.items() if t.id in srcs and pack in packs) for t in tasks}
    return {tid: rules for tid, rules in out.items() if rules}


def derive_rib(policies: Path, exclude: Sequence[str], sources: Mapping[str, tuple[str, frozenset[str]]],
               out_dir: Path) -> Path:
    """A copy of the RIB at ``policies`` (file or directory) in ``out_dir`` whose
    semgrep agents also leave out the rules ``exclude`` (each agent those of the
    packs it runs, added to its ``options.exclude_rules``); returns its path."""
    import yaml

    all_packs = {pack for pack, _ in sources.values()}
    files = sorted(policies.glob("*.yaml")) if policies.is_dir() else [policies]
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        doc = yaml.safe_load(f.read_text(encoding="utf-8"))
        for spec, packs in _semgrep_packs(doc, all_packs):
            opts = spec.setdefault("options", {})
            mine = [r for r in exclude if r in sources and sources[r][0] in packs]
            opts["exclude_rules"] = sorted(set(opts.get("exclude_rules") or []) | set(mine))
        (out_dir / f.name).write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return out_dir if policies.is_dir() else out_dir / policies.name


def _policy_error(e: BaseException) -> BaseException | None:
    """The PolicyError inside ``e`` (possibly wrapped in nursery exception groups)."""
    if isinstance(e, PolicyError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _policy_error(sub)
            if found is not None:
                return found
    return None


def default_variants() -> list[Path]:
    """The RIB variants shipped in ``examples/eval/policies`` (sorted by name)."""
    root = Path(__file__).resolve().parents[2] / "examples" / "eval" / "policies"
    return sorted(root.glob("*.yaml"))


def main(argv: list[str] | None = None, *, serve_router: ServeRouter, model_servers: ModelServers,
         rule_sources: RuleSources | None = None) -> int:
    """``atp-router eval``: exit 0 when every task produced a FINAL, 1 when some
    did not (they are listed), 2 on bad arguments or a refused RIB. A variant
    without ``--url`` runs on ``serve_router``'s private router, after
    ``model_servers`` started what it needs (unless ``--no-start-models``).
    ``rule_sources`` gives the shipped rules' source tasks for ``--leave-one-out``."""
    ap = _eval_parser()
    args = ap.parse_args(argv)
    # An in-process router logs its audit trail at WARNING: keep the report readable.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.concurrency < 1 or args.top < 1:
        ap.error("--concurrency and --top must be at least 1")
    try:
        tasks = load_tasks(args.tasks)
    except (OSError, ValueError) as e:
        print(f"atp-router eval: {e}", file=sys.stderr)
        return 2
    if args.task:
        wanted = set(args.task)
        tasks = [t for t in tasks if t.id in wanted]
    if not tasks:
        print(f"atp-router eval: no tasks to run in {args.tasks}", file=sys.stderr)
        return 2
    if args.checkouts is not None:
        if not args.checkouts.is_dir():
            print(f"atp-router eval: --checkouts {args.checkouts}: not a directory", file=sys.stderr)
            return 2
        tasks = with_checkouts(tasks, args.checkouts)
    variants = _variants(args.policies, args.url)
    if variants is None:
        return 2
    if args.leave_one_out and (rule_sources is None or None in variants):
        print("atp-router eval: --leave-one-out needs --policies (or the default variants): the RIB whose "
              "rules it leaves out", file=sys.stderr)
        return 2
    sources = rule_sources() if args.leave_one_out and rule_sources is not None else {}
    reports: dict[str, EvalReport] = {}
    broken_any = False
    for v in variants:
        name = "running" if v is None else v.stem if v.is_file() else v.name
        outcome = _variant_report(name, v, tasks, args, serve_router=serve_router, model_servers=model_servers,
                                  sources=sources)
        if outcome is None:
            return 2
        report, broken = outcome
        broken_any = broken_any or broken
        if report is None:
            continue
        reports[name] = report
        if args.verbose:
            print(format_report(reports[name], title=name))
            print()
    if not reports:
        return 1
    _print_results(reports, tasks, args)
    return 1 if broken_any else 0


def _variant_report(name: str, v: Path | None, tasks: list[GoldenTask], args: argparse.Namespace, *,
                    serve_router: ServeRouter, model_servers: ModelServers,
                    sources: Mapping[str, tuple[str, frozenset[str]]]) -> tuple[EvalReport | None, bool] | None:
    """Run and score variant ``name``: ``(its report, whether a task had no
    FINAL)``; the report ``None`` when no task produced one; ``None`` (the error
    printed) when the router could not be reached or refused the RIB. With
    ``sources`` (``--leave-one-out``) each task runs without the rules written
    from it (:func:`loo_exclusions`)."""
    excluded = loo_exclusions(v, tasks, sources) if sources and v is not None else {}
    print(f"eval: {name}: {len(tasks)} task(s)…", file=sys.stderr, flush=True)
    if excluded:
        print(f"eval: {name}: leave-one-out: {len(excluded)} task(s) run without the rules written from them",
              file=sys.stderr, flush=True)
    runs = _run_one(name, v, tasks, args, serve_router=serve_router, model_servers=model_servers,
                    excluded=excluded, sources=sources)
    if runs is None:
        return None
    broken = [r for r in runs if r.final is None]
    for r in broken:
        print(f"{name}: {r.id}: no FINAL; events {r.events}; errors {r.errors}", file=sys.stderr)
    by_id = {t.id: t for t in tasks}
    analysers = rib_analysers(v)
    scores = [score_task(by_id[r.id], r, top=args.top, analysers=analysers, excluded_rules=excluded.get(r.id, ()))
              for r in runs if r.final is not None]
    if not scores:
        print(f"atp-router eval: {name}: no task produced a FINAL", file=sys.stderr)
        return None, bool(broken)
    return summarize(scores, failed=[r.id for r in broken], top=args.top), bool(broken)


def _eval_parser() -> argparse.ArgumentParser:
    """:func:`main`'s command line."""
    ap = argparse.ArgumentParser(
        prog="atp-router eval", formatter_class=DefaultsHelpFormatter,
        description="Run labelled code-review tasks through a router as a client would and score them "
                    "(recall, precision, F1, caught tasks, cost, latency, escalation, agreement) per RIB variant.")
    ap.add_argument("--tasks", type=Path, required=True, help="task file (JSONL, the golden format)")
    ap.add_argument("--policies", type=Path, nargs="+",
                    help="RIB variants to compare (YAML files or directories; default: examples/eval/policies/*.yaml, "
                         "or the running RIB with --url)")
    ap.add_argument("--url", help="a running router (default: a private router per variant in this process)")
    ap.add_argument("--token", default=os.environ.get("ATP_TOKEN"),
                    help="bearer token for --url (default $ATP_TOKEN); with --policies it needs policy_reload")
    ap.add_argument("--concurrency", type=int, default=2, help="streams in flight at once (default 2)")
    ap.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"N of recall@N (default {DEFAULT_TOP})")
    ap.add_argument("--task", action="append", help="run only this task id (repeatable)")
    ap.add_argument("--png", type=Path, default=Path("eval-results.png"), help="PNG of cost/latency vs recall")
    ap.add_argument("--json", type=Path, help="write every variant's report as JSON here")
    ap.add_argument("--calibration", type=Path,
                    help="write each agent's measured findings/matched here (YAML: agents.<x>.calibration of a RIB)")
    ap.add_argument("--no-start-models", dest="start_models", action="store_false",
                    help="do not start the local model server for a variant's loopback openai_compat models")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="run each task without the shipped semgrep rules written after reading it (their "
                         "metadata.source_tasks), in a copy of the RIB; the figures printed are then leave-one-out")
    ap.add_argument("--checkouts", type=Path,
                    help="a directory of the operator's checkouts, one per task (DIR/<task id>): each is sent as the "
                         "task's repo, for a pytest next-hop whose options.repos allows it; a checkout holding a "
                         "test file makes its task one that ships tests")
    ap.add_argument("--verbose", "-v", action="store_true", help="print each variant's per-task table and the router's log")
    return ap


def _variants(policies: list[Path] | None, url: str | None) -> list[Path | None] | None:
    """The RIB variants to run: ``--policies``, else the running RIB (``None``)
    with ``--url``, else :func:`default_variants`. ``None`` (the error printed)
    when there are none or a path does not exist."""
    variants: list[Path | None]
    if policies:
        variants = list(policies)
    elif url:
        variants = [None]
    else:
        variants = list(default_variants())
        if not variants:
            print("atp-router eval: no --policies given and no examples/eval/policies/*.yaml found", file=sys.stderr)
            return None
    for v in variants:
        if v is not None and not v.exists():
            print(f"atp-router eval: no such policy file or directory: {v}", file=sys.stderr)
            return None
    return variants


async def _run_groups(v: Path | None, tasks: list[GoldenTask], args: argparse.Namespace, *,
                      serve_router: ServeRouter, excluded: Mapping[str, Sequence[str]],
                      sources: Mapping[str, tuple[str, frozenset[str]]]) -> list[TaskRun]:
    """:func:`run_variant` once per set of rules to leave out (``excluded``:
    task id → rules): the tasks with none on RIB ``v``, each other group on a
    copy of it without those rules (:func:`derive_rib`); runs in task order."""
    groups: dict[tuple[str, ...], list[GoldenTask]] = {}
    for t in tasks:
        groups.setdefault(tuple(excluded.get(t.id, ())), []).append(t)
    runs: list[TaskRun] = []
    with tempfile.TemporaryDirectory(prefix="atp-eval-loo-") as tmp:
        for i, (rules, group) in enumerate(sorted(groups.items())):
            policies = derive_rib(v, rules, sources, Path(tmp) / str(i)) if rules and v is not None else v
            runs += await run_variant(group, policies=policies, url=args.url, token=args.token,
                                      concurrency=args.concurrency, serve_router=serve_router)
    order = {t.id: i for i, t in enumerate(tasks)}
    return sorted(runs, key=lambda r: order[r.id])


def _run_one(name: str, v: Path | None, tasks: list[GoldenTask], args: argparse.Namespace, *,
             serve_router: ServeRouter, model_servers: ModelServers,
             excluded: Mapping[str, Sequence[str]] | None = None,
             sources: Mapping[str, tuple[str, frozenset[str]]] | None = None) -> list[TaskRun] | None:
    """Variant ``name`` (RIB ``v``; ``None``: the running one) run on ``tasks``
    with :func:`run_variant` (per leave-one-out group, :func:`_run_groups`), after
    starting its local models (unless ``--url`` or ``--no-start-models``).
    ``None`` (the error printed) when the router could not be reached or refused
    the RIB."""
    try:
        with contextlib.ExitStack() as models:
            if v is not None and args.url is None and args.start_models:
                _start_models(model_servers, v, models, name)
            return trio.run(lambda v=v: _run_groups(v, tasks, args, serve_router=serve_router,
                                                    excluded=excluded or {}, sources=sources or {}))
    except (RuntimeError, atp.ATPClientError, httpx.HTTPError) as e:
        print(f"atp-router eval: {name}: {e}", file=sys.stderr)
        return None
    except Exception as e:  # a refused RIB (PolicyError) when the router starts in-process
        refused = _policy_error(e)
        if refused is None:
            raise
        print(f"atp-router eval: {name}: refused RIB: {refused}", file=sys.stderr)
        return None


def _print_results(reports: dict[str, EvalReport], tasks: list[GoldenTask], args: argparse.Namespace) -> None:
    """The comparison table, the baseline and calibration lines, the ``--json``,
    ``--calibration`` and PNG files, and the best variant."""
    b = changed_line_baseline(tasks)
    print(format_table(reports))
    print(f"(recall counts units: BugsInPy per expected finding, advisories per task; r@N: recall@{args.top}; "
          f"a match is the same file within ±{SLACK} lines. Flagging every changed line would catch "
          f"{b.tasks_caught}/{b.n_tasks} tasks at precision {b.matched}/{b.findings})")
    print("(right, r.rec, r.prec, r.f1: the same scored by the right reason — a catch only when the finding's "
          "class (its rule, CWE or claim: atp_router/review/defects.py) is the defect's, and a finding on a "
          "negatives line a false positive; neg: findings on negatives lines"
          + ("; leave-one-out: each task ran without the rules written from it)" if args.leave_one_out else ")"))
    for name, r in reports.items():
        print(f"tests {name}: {tests_line(r)}")
    for agent, c in calibration(reports).items():
        p = "n/a" if c["precision"] is None else f"{c['precision']:.3f}"
        print(f"agent {agent:<22} findings {c['findings']:>4}  matched {c['matched']:>3}  precision {p}")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(reports)))
    if args.calibration:
        args.calibration.write_text(calibration_yaml(calibration(reports), source=args.tasks.name))
    try:
        plot(reports, args.png, title=f"{args.tasks.name}: {len(tasks)} tasks")
        print(f"wrote {args.png}")
    except ImportError:
        print("no PNG: matplotlib is not installed", file=sys.stderr)
    best = best_variant(reports)
    print(f"best: {best}")
    print(eval_line(reports[best]))
