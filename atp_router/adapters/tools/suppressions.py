"""Suppression comments belong to the operator, not the change (issue 19, item 4).

A change under review could silence the analysers that review it: an inline
``# noqa``, ``# nosec``, ``# nosemgrep``, ``# type: ignore`` or ``# pylint:
disable=…``, or a file-level ``# ruff: noqa``, ``# mypy: ignore-errors`` or
``# pylint: skip-file``, and its reviewers never see the finding. So by default
the analyser next-hops (:class:`SuppressionAwareAdapter`: ruff, bandit,
semgrep, pylint, mypy) honour **no** suppression comment in the reviewed code:

1. the analyser runs with its own switch off where it has one
   (:attr:`~SuppressionAwareAdapter.suppression_flags`: ``ruff --ignore-noqa``,
   which also covers ``# ruff: noqa``, ``# flake8: noqa`` and ``# ruff:
   disable[…]``; ``bandit --ignore-nosec``; ``semgrep --disable-nosem``), and
2. on the copy of the files it reads, every suppression keyword inside a
   comment is *neutralised* (:func:`neutralise`): each of its characters
   becomes ``~``, so ``# pylint: skip-file`` reads ``# ~~~~~~: skip-file`` and
   ``# type: ignore[attr-defined]`` reads ``# ~~~~: ignore[attr-defined]``.
   pylint and mypy have no switch, so this is what turns theirs off; for the
   others it is a second lock. Comments are found with Python's own tokenizer
   on the text decoded as Python decodes it (the ``coding:`` cookie honoured,
   as pylint and mypy do), so only ``COMMENT`` tokens change: strings, code,
   line numbers and columns (in characters) stay as they were, and the
   findings' lines are the task's lines.

Every finding is reported. A finding the change itself silenced carries
``suppressed_by_change: true`` (:class:`~atp_router.consensus.types.AgentFinding`,
and the merged finding in the FINAL): the analyser, honouring only the
suppression comments on the lines the diff touched (``ParsedChange.changed``:
added or changed lines, and where a deletion was), would not have reported
it — an inline comment on that line or a file-level one the change adds alike.
This is measured, not guessed: when a changed line contains one of the
analyser's suppression keywords (anywhere in the line: semgrep and bandit read
some outside comments), the analyser runs a second time on a copy where only
the comments of the *unchanged* lines are neutralised, without its switch, and
the findings of the first run it does not repeat (same file, lines and rule)
are the ones the change silenced. A change that adds no suppression costs one
run; one that does, two, the second within what is left of the tool's
``timeout_s``. If the second run fails or runs out of time, the findings stand
unmarked and the summary says the marks are missing.

Suppressions on lines the change does not touch are not honoured either: the
diff that says which lines are "old" is the tenant's input as much as the
files, so a comment left out of the diff is no more the operator's than one in
it. Findings they would have hidden are reported without the mark (with
``scope: changed`` only those on changed lines are kept anyway). A task without
a diff (``scope: file``) is all change: every suppression in it is the change's.

The operator decides otherwise per next-hop: RIB ``agents.<x>.options.
allow_suppressions: true`` restores the analyser's normal behaviour (every
suppression comment honoured, one run, nothing marked).

Known limits: a suppression keyword that a tool reads outside a comment (semgrep
matches ``nosemgrep`` on the source line) is still ignored (the tool's switch
is off) but, on an unchanged line, counts as the change's when the second run
honours it; a file Python cannot tokenize is neutralised up to the point where
tokenizing stopped (pylint and mypy, which rely on the neutralising, cannot
parse such a file either and report the syntax error).
"""

from __future__ import annotations

import contextvars
import io
import re
import tokenize
from collections import Counter
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.tools.base import DEFAULT_LIMITS, ToolAdapter, ToolLimits
from atp_router.consensus.types import AgentFinding, AgentReport
from atp_router.task.body import CodeReview
from atp_router.task.change import ParsedChange, parse_change
from atp_router.wire.errors import AgentError

__all__ = [
    "BLANK",
    "Neutralised",
    "SuppressionAwareAdapter",
    "SuppressionPlan",
    "mark_suppressed",
    "neutralise",
    "plan_suppressions",
]

#: What each character of a neutralised keyword becomes (one character, ASCII:
#: columns in characters stay, and no tool reads ``~`` as a directive).
BLANK = "~"

#: The diff of the task under review and its parse (None: parsed where needed),
#: for :meth:`SuppressionAwareAdapter._run` (set around :meth:`ToolAdapter.review`
#: in the task that runs it; ``None``: no diff). A context variable, not an attribute: one adapter serves many
#: streams at once.
_DIFF: contextvars.ContextVar[tuple[str, ParsedChange | None] | None] = contextvars.ContextVar(
    "atp_review_diff", default=None)
#: True while the second run (the change's suppressions honoured) builds its argv.
_HONOURING: contextvars.ContextVar[bool] = contextvars.ContextVar("atp_honouring_suppressions", default=False)


@dataclass(frozen=True, slots=True)
class Neutralised:
    """One file after :func:`neutralise`: its new bytes, the lines (1-based) whose
    comment was neutralised, and the lines whose comment was kept (``keep``)."""

    data: bytes
    neutralised: frozenset[int]
    kept: frozenset[int]


@dataclass(frozen=True, slots=True)
class _Scan:
    """Where a file's comments match a keyword pattern: the encoding Python
    reads it in, its text split at ``\\n`` (ends dropped), and the matches'
    column spans (characters) by 1-based line."""

    encoding: str
    lines: list[str]
    spans: dict[int, list[tuple[int, int]]]


def _scan(data: bytes, pattern: re.Pattern[str], *, after_hash: bool = False) -> _Scan | None:
    """The :class:`_Scan` of ``data``; ``None`` when nothing can match (the text
    does not mention the pattern at all) or Python could not decode the file
    (then no Python tool reads its comments either). Matches are those inside a
    ``COMMENT`` token, or with ``after_hash`` every one that follows a ``#`` on
    its line, strings included (:attr:`SuppressionAwareAdapter.suppression_after_hash`).
    Lines are split at ``\\n`` only, as the tokenizer and the diff count them."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError, ValueError):
        return None
    if pattern.search(text) is None:
        return None
    lines = text.split("\n")
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, line in enumerate(lines, 1):
        col = line.find("#")
        if col >= 0:
            found = [(m.start(), m.end()) for m in pattern.finditer(line, col)]
            if found:
                spans[row] = found
    if after_hash or not spans:
        # A comment match follows a '#' on its line: no such line, no tokenizing.
        return _Scan(encoding, lines, spans)
    spans = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                found = [(col + m.start(), col + m.end()) for m in pattern.finditer(tok.string)]
                if found:
                    spans.setdefault(row, []).extend(found)
    except (tokenize.TokenError, SyntaxError):  # IndentationError is a SyntaxError
        pass  # Python cannot parse the file: what was read is neutralised
    return _Scan(encoding, lines, spans)


def _apply(data: bytes, scan: _Scan | None, keep: Container[int]) -> Neutralised:
    """``data`` with ``scan``'s matches blanked except on the lines in ``keep``."""
    if scan is None or not scan.spans:
        return Neutralised(data, frozenset(), frozenset())
    lines = list(scan.lines)
    done: set[int] = set()
    kept: set[int] = set()
    for row, spans in scan.spans.items():
        if row in keep:
            kept.add(row)
            continue
        line = lines[row - 1]
        for a, b in spans:
            line = line[:a] + BLANK * (b - a) + line[b:]
        lines[row - 1] = line
        done.add(row)
    if not done:
        return Neutralised(data, frozenset(), frozenset(kept))
    try:
        out = "\n".join(lines).encode(scan.encoding)
    except UnicodeEncodeError:  # pragma: no cover - BLANK is ASCII; the codec decoded this text
        return Neutralised(data, frozenset(), frozenset())
    return Neutralised(out, frozenset(done), frozenset(kept))


def neutralise(
    data: bytes, pattern: re.Pattern[str], *, keep: Container[int] = (), after_hash: bool = False
) -> Neutralised:
    """``data`` (a Python file's bytes) with every match of ``pattern`` inside a
    comment replaced by :data:`BLANK` characters, one per character matched,
    except in comments on a line (1-based) in ``keep``.

    The text is decoded as Python decodes a source file (``coding:`` cookie or
    BOM, default UTF-8) and encoded back the same way, so a tool that honours the
    cookie sees the comments this function saw. Only ``COMMENT`` tokens of
    Python's tokenizer change: strings, code and line breaks do not, so every
    line keeps its number and every character its column. A file that cannot be
    decoded (nor then parsed by Python) is returned unchanged; one whose
    tokenizing fails part way (an unterminated string or bracket: Python cannot
    parse it either) is neutralised up to that point. With ``after_hash``, every
    match that follows a ``#`` on its line is neutralised, in a string too (for
    a tool whose parser finds comments where Python's tokenizer sees strings).
    Never raises."""
    return _apply(data, _scan(data, pattern, after_hash=after_hash), keep)


@dataclass(frozen=True, slots=True)
class SuppressionPlan:
    """What to run for one task: ``off`` the files with every suppression
    comment neutralised (the run whose findings are reported); ``honour`` the
    files with only the change's suppression comments left (the second run), or
    ``None`` when no changed line mentions a suppression keyword; ``found`` the
    number of lines whose suppression comment ``off`` neutralised, ``added`` how
    many of those the change touched."""

    off: dict[str, bytes]
    honour: dict[str, bytes] | None
    found: int
    added: int


class _All:
    """Every line number: a task without a diff is all change."""

    def __contains__(self, item: object) -> bool:
        return True


def plan_suppressions(
    targets: Mapping[str, bytes],
    pattern: re.Pattern[str],
    changed: Mapping[str, Iterable[int]] | None,
    *,
    after_hash: bool = False,
) -> SuppressionPlan:
    """The :class:`SuppressionPlan` of ``targets`` (path → bytes) for a tool whose
    suppression keywords ``pattern`` matches; ``changed`` maps paths to the
    lines the diff touched (``None``: no diff, every line is the change's);
    ``after_hash`` as for :func:`neutralise`. Blocking (tokenizes each file
    that mentions a keyword, once): run it in a worker thread."""
    off: dict[str, bytes] = {}
    honour: dict[str, bytes] = {}
    found = added = 0
    change_suppresses = False
    for path, data in targets.items():
        scan = _scan(data, pattern, after_hash=after_hash)
        lines: Container[int] = _All() if changed is None else frozenset(changed.get(path, ()))
        n = _apply(data, scan, ())
        off[path] = n.data
        found += len(n.neutralised)
        h = _apply(data, scan, lines)
        honour[path] = h.data
        added += len(h.kept)
        if scan is not None and not change_suppresses:
            # Anywhere on a changed line, comment or not: semgrep, for one, reads
            # its keyword on the source line.
            change_suppresses = any(
                pattern.search(line) for i, line in enumerate(scan.lines, 1) if i in lines
            )
    return SuppressionPlan(off, honour if change_suppresses else None, found, added)


def mark_suppressed(findings: list[AgentFinding], quiet: Iterable[AgentFinding]) -> int:
    """Mark ``suppressed_by_change`` on each of ``findings`` (the run without
    suppressions) that ``quiet`` (the run honouring the change's suppressions)
    does not repeat: same file, lines and rule, counted as a multiset. Returns
    how many were marked."""
    left = Counter(_key(f) for f in quiet)
    marked = 0
    for f in findings:
        k = _key(f)
        if left[k] > 0:
            left[k] -= 1
        else:
            f.suppressed_by_change = True
            marked += 1
    return marked


def _key(f: AgentFinding) -> tuple[str, int, int, str | None]:
    return f.file, f.start, f.end, f.rule


class SuppressionAwareAdapter(ToolAdapter):
    """A :class:`ToolAdapter` for an analyser that reads suppression comments
    (module docstring). Subclasses set :attr:`suppression_pattern` (the
    keywords to neutralise inside comments) and :attr:`suppression_flags` (the
    analyser's own switch, added to its argv through :meth:`suppression_args`).

    ``allow_suppressions`` (RIB ``options.allow_suppressions``, default false)
    restores the analyser's own behaviour. Raises ``TypeError`` when it is not
    a bool. Other arguments: :class:`ToolAdapter`."""

    #: Suppression keywords inside a comment, each match neutralised.
    suppression_pattern: ClassVar[re.Pattern[str]]
    #: The analyser's arguments that make it ignore suppression comments.
    suppression_flags: ClassVar[tuple[str, ...]] = ()
    #: Neutralise a keyword wherever it follows a ``#`` on its line, strings
    #: included, not only in Python's ``COMMENT`` tokens: for an analyser whose
    #: parser finds comments where the router's tokenizer sees a string.
    suppression_after_hash: ClassVar[bool] = False

    def __init__(
        self,
        name: str,
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        limits: ToolLimits = DEFAULT_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits)
        if not isinstance(allow_suppressions, bool):
            raise TypeError(f"allow_suppressions: must be a bool, got {allow_suppressions!r:.40}")
        self.allow_suppressions = allow_suppressions

    def suppression_args(self) -> list[str]:
        """:attr:`suppression_flags` for the run whose findings are reported;
        none when the operator allows suppressions or in the run that honours
        the change's own."""
        if self.allow_suppressions or _HONOURING.get():
            return []
        return list(self.suppression_flags)

    async def review(self, prompt: Prompt) -> AgentReport:
        """:meth:`ToolAdapter.review` with the task's diff (and its parse, when the
        prompt carries it) at hand for :meth:`_run`."""
        body = prompt.body
        diff = body.diff if isinstance(body, CodeReview) else None
        token = _DIFF.set((diff, prompt.change) if diff is not None else None)
        try:
            return await super().review(prompt)
        finally:
            _DIFF.reset(token)

    async def _run(self, targets: Mapping[str, bytes]) -> tuple[list[AgentFinding], list[str]]:
        """Run the analyser with suppressions off and mark what the change's own
        suppression comments hide (module docstring); with
        ``allow_suppressions``, the analyser's own run."""
        if self.allow_suppressions:
            return await super()._run(targets)
        diff = _DIFF.get()
        t0 = trio.current_time()
        plan = await trio.to_thread.run_sync(self._plan, targets, diff)
        findings, notes = await super()._run(plan.off)
        notes = list(notes)
        if plan.found:
            notes.append(f"{plan.found} suppression comment(s) not honoured ({plan.added} on changed lines)")
        if plan.honour is None or not findings:
            return findings, notes
        # The second run only marks: it gets what is left of timeout_s, so it
        # never makes the call outlast the tool's own wall-clock limit, and its
        # failure loses the marks, never the findings.
        unknown = "which findings the change's suppression comments hide is unknown"
        token = _HONOURING.set(True)
        try:
            with trio.move_on_after(self.limits.timeout_s - (trio.current_time() - t0)) as budget:
                quiet, _ = await super()._run(plan.honour)
        except AgentError as e:
            notes.append(f"{unknown}: {e.reason[:200]}")
            return findings, notes
        finally:
            _HONOURING.reset(token)
        if budget.cancelled_caught:
            notes.append(f"{unknown}: the second run would pass timeout_s={self.limits.timeout_s:g} s")
            return findings, notes
        if mark_suppressed(findings, quiet):
            notes.append("findings the change's own suppression comments silence are reported, marked "
                         "suppressed_by_change")
        return findings, notes

    def _plan(self, targets: Mapping[str, bytes], diff: tuple[str, ParsedChange | None] | None) -> SuppressionPlan:
        """The suppression plan of ``targets``; ``diff`` is the task's diff and its
        parse when the prompt carried one (else parsed here), None without a diff."""
        changed = None
        if diff is not None:
            text, change = diff
            changed = (change if change is not None else parse_change(text)).changed
        return plan_suppressions(targets, self.suppression_pattern, changed, after_hash=self.suppression_after_hash)
