"""semgrep as a review next-hop: pattern rules for Python defect classes, run
offline with the rules shipped in this package (:data:`RULES_DIR`).

Runs ``semgrep scan --config RULES… --json --metrics off --disable-version-check
--no-git-ignore --no-rewrite-rule-ids --quiet -j 1 [--exclude-rule ID…] FILES`` in
the task's work directory. No registry and no network: every ``--config`` is a
local rule file, metrics and the version check are off (and
``SEMGREP_SEND_METRICS=off``, ``SEMGREP_ENABLE_VERSION_CHECK=0`` in its
environment). semgrep writes ``~/.semgrep`` (settings, log), so ``HOME``,
``XDG_CONFIG_HOME`` and ``XDG_CACHE_HOME`` point into the work directory, which
is removed after the run. Only ``.py`` files are written there, so no
``.semgrepignore``, ``.semgrep.yml`` or ``.semgrep/`` settings of a task are
read, and the targets are given explicitly. ``# nosemgrep`` / ``# nosem``
comments are not honoured unless the operator allows them (``--disable-nosem``,
and :data:`SUPPRESSIONS` neutralised; see :mod:`atp_router.adapters.tools.suppressions`).

Rule packs (``rules`` option, default all; :data:`RULE_PACKS`): ``regex``
(ReDoS-prone patterns, flags passed as count), ``security`` (shell injection,
TLS verification off, unsafe ``yaml``/``pickle`` loads, ``eval``, SQL built
from strings, weak randomness for secrets, timing-unsafe comparison, prefix
path checks) and ``correctness`` (``PATH`` split on ``":"`` instead of
``os.pathsep``, unchecked regex results and ``split()`` fields, ``is`` with a
literal, swallowed exceptions, absolute ``os.path.join`` components, ``Popen``
pipes read without reaping). Each rule carries a message, a severity
(``ERROR``/``WARNING``/``INFO`` → high/medium/low, :data:`SEVERITY`),
``metadata.confidence`` (``HIGH``/``MEDIUM``/``LOW`` → 0.85/0.65/0.4,
:data:`CONFIDENCE`) and ``metadata.cwe`` where one applies (``"CWE-1333: …"`` →
``cwe="CWE-1333"``).

Limits: semgrep-core is an OCaml 5 program whose runtime reserves a large
virtual address range up front: under ``RLIMIT_AS`` = 2 GiB (the tool default)
it cannot start its domains even with one job; 3 GiB suffices with ``-j 1``.
This adapter's default is therefore :data:`DEFAULT_SEMGREP_LIMITS`: the shared
defaults with ``address_space_bytes`` = 4 GiB (a reservation, not resident
memory: a small review uses ~200 MB). ``-j 1`` keeps that figure independent
of the machine's core count (each extra job reserves more).

Exit status: 0 whether or not rules matched; anything else (2 a fatal error such
as an unreadable rule, 7 a missing config) is ``EAGENTDOWN``. Files semgrep
could not parse are counted in the summary.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from atp_router.adapters.tools.base import (
    _ENV_KEEP,
    DEFAULT_LIMITS,
    GiB,
    ToolLimits,
    decode_items,
    find_executable,
    relative,
)
from atp_router.adapters.tools.suppressions import SuppressionAwareAdapter
from atp_router.consensus.types import AgentFinding, Severity

__all__ = [
    "CONFIDENCE",
    "DEFAULT_SEMGREP_LIMITS",
    "RULES_DIR",
    "RULE_PACKS",
    "SEVERITY",
    "SUPPRESSIONS",
    "SemgrepAdapter",
    "rule_ids",
    "rule_sources",
]

#: The rule files shipped with the router (package data, ``*.yaml``).
RULES_DIR = Path(__file__).resolve().parent / "semgrep_rules"
#: Rule packs by name: the ``.yaml`` files of :data:`RULES_DIR`.
RULE_PACKS: tuple[str, ...] = tuple(sorted(p.stem for p in RULES_DIR.glob("*.yaml")))

#: Rule severity → finding severity (semgrep's newer names included).
SEVERITY: dict[str, Severity] = {
    "ERROR": Severity.HIGH, "WARNING": Severity.MEDIUM, "INFO": Severity.LOW,
    "CRITICAL": Severity.CRITICAL, "HIGH": Severity.HIGH, "MEDIUM": Severity.MEDIUM, "LOW": Severity.LOW,
}  # fmt: skip
#: ``metadata.confidence`` → finding confidence (bandit's scale).
CONFIDENCE: dict[str, float] = {"HIGH": 0.85, "MEDIUM": 0.65, "LOW": 0.4}

#: semgrep's limits: the shared defaults with 4 GiB of address space (see the
#: module docstring: semgrep-core does not start under 2 GiB).
DEFAULT_SEMGREP_LIMITS = dataclasses.replace(DEFAULT_LIMITS, address_space_bytes=4 * GiB)

#: semgrep's suppression keyword (``# nosemgrep``, ``# nosem: rule-id``).
SUPPRESSIONS = re.compile(r"nosem", re.IGNORECASE)

_CWE_RE = re.compile(r"CWE-(\d+)")
_RULE_ID_RE = re.compile(r"^\s*-\s+id:\s*([A-Za-z0-9_.-]+)\s*$", re.MULTILINE)


def rule_ids(packs: Iterable[str] = RULE_PACKS) -> dict[str, str]:
    """Rule id → pack name for the shipped ``packs``. Raises ``ValueError`` on a
    pack that is not in :data:`RULE_PACKS`."""
    out: dict[str, str] = {}
    for pack in packs:
        if pack not in RULE_PACKS:
            raise ValueError(f"not a semgrep rule pack: {pack!r:.80} (available: {', '.join(RULE_PACKS)})")
        for rid in _RULE_ID_RE.findall((RULES_DIR / f"{pack}.yaml").read_text("utf-8")):
            out[rid] = pack
    return out


def rule_sources(packs: Iterable[str] = RULE_PACKS) -> dict[str, tuple[str, frozenset[str]]]:
    """Rule id → (its pack, the golden task ids of its ``metadata.source_tasks``:
    the tasks it may have been written after reading, which ``atp-router eval
    --leave-one-out`` excludes it on). Raises ``ValueError`` on an unknown pack or
    a rule whose ``source_tasks`` is not a list of strings."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for pack in packs:
        if pack not in RULE_PACKS:
            raise ValueError(f"not a semgrep rule pack: {pack!r:.80} (available: {', '.join(RULE_PACKS)})")
        doc = yaml.safe_load((RULES_DIR / f"{pack}.yaml").read_text("utf-8"))
        for rule in doc.get("rules", []):
            tasks = (rule.get("metadata") or {}).get("source_tasks", [])
            if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
                raise ValueError(f"semgrep rule {rule.get('id')!r}: metadata.source_tasks is not a list of task ids")
            out[str(rule["id"])] = (pack, frozenset(tasks))
    return out


class _Pos(msgspec.Struct):
    line: int


class _Extra(msgspec.Struct):
    message: str = ""
    severity: str = ""
    metadata: dict[str, Any] = {}


class _Result(msgspec.Struct):
    """The fields of one semgrep JSON result the adapter reads (others are skipped)."""

    check_id: str
    path: str
    start: _Pos
    end: _Pos
    extra: _Extra


class _Report(msgspec.Struct):
    results: list[msgspec.Raw]
    errors: list[dict[str, Any]] = []


class SemgrepAdapter(SuppressionAwareAdapter):
    """semgrep next-hop. ``rules`` names the rule packs to run (default all of
    :data:`RULE_PACKS`), ``exclude_rules`` rule ids of those packs not to report.
    Default limits :data:`DEFAULT_SEMGREP_LIMITS`. Raises ``ValueError`` on an
    unknown pack or rule id, or no pack, and
    :class:`~atp_router.adapters.tools.sandbox.SandboxUnavailable` (a ``ValueError``)
    when a run could not see the packs' rule files (e.g. under ``/tmp``). Other arguments:
    :class:`~atp_router.adapters.tools.suppressions.SuppressionAwareAdapter`."""

    tool = "semgrep"
    suppression_pattern = SUPPRESSIONS
    suppression_flags = ("--disable-nosem",)
    default_strengths = ("static_analysis", "security", "bug_detection", "cwe")

    def __init__(
        self,
        name: str = "semgrep",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        rules: Iterable[str] = RULE_PACKS,
        exclude_rules: Iterable[str] = (),
        limits: ToolLimits = DEFAULT_SEMGREP_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits,
                         allow_suppressions=allow_suppressions)
        self.rules = list(rules)
        if not self.rules:
            raise ValueError("rules: must name at least one semgrep rule pack")
        try:
            known = rule_ids(self.rules)
        except ValueError as e:
            raise ValueError(f"rules: {e}") from None
        self.exclude_rules = list(exclude_rules)
        for rid in self.exclude_rules:
            if rid not in known:
                raise ValueError(f"exclude_rules: not a rule id of the selected semgrep packs: {rid!r:.80}")
        # Each run mounts the rule files read-only: refused at load, not on the first task, when it could not see them.
        self.sandbox(find_executable(self.tool)).check([str(RULES_DIR / f"{pack}.yaml") for pack in self.rules])

    def argv(self, paths: list[str]) -> list[str]:
        args = ["scan"]
        for pack in self.rules:
            args += ["--config", str(RULES_DIR / f"{pack}.yaml")]
        args += [
            "--json", "--metrics", "off", "--disable-version-check", "--no-git-ignore", "--no-rewrite-rule-ids",
            "--quiet", "-j", "1",
        ]  # fmt: skip
        for rid in self.exclude_rules:
            args += ["--exclude-rule", rid]
        return [*args, *self.suppression_args(), "--", *paths]

    def environment(self, root: str) -> dict[str, str]:
        """The analyser's environment: the router's minimal one with ``HOME`` and
        the XDG directories inside the work dir ``root``, metrics and version
        checks off."""
        env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
        env.update(
            HOME=root,
            XDG_CONFIG_HOME=os.path.join(root, ".config"),
            XDG_CACHE_HOME=os.path.join(root, ".cache"),
            SEMGREP_SEND_METRICS="off",
            SEMGREP_ENABLE_VERSION_CHECK="0",
        )
        return env

    async def _exec(
        self, argv: list[str], root: str, *, env: Mapping[str, str] | None = None, preexec: Any = None
    ) -> tuple[int, bytes, bytes]:
        return await super()._exec(argv, root, env=env if env is not None else self.environment(root), preexec=preexec)

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """semgrep's JSON report (``results``) as findings, one per rule and span
        (runs in a worker thread). Notes: files semgrep could not parse."""
        report = msgspec.json.decode(stdout, type=_Report)
        findings: list[AgentFinding] = []
        seen: set[tuple[str, str, int, int]] = set()
        paths: dict[str, str] = {}
        for r in decode_items(report.results, _Result):
            path = paths.get(r.path)
            if path is None:
                path = paths[r.path] = relative(r.path, root)
            rule = r.check_id.rsplit(".", 1)[-1]
            start = max(r.start.line, 1)
            end = max(start, r.end.line)
            key = (path, rule, start, end)
            if key in seen:  # one literal can bind twice (e.g. inside parentheses)
                continue
            seen.add(key)
            meta = r.extra.metadata or {}
            cwe = meta.get("cwe")
            if isinstance(cwe, list):
                cwe = cwe[0] if cwe else None
            m = _CWE_RE.search(cwe) if isinstance(cwe, str) else None
            conf = meta.get("confidence")
            findings.append(
                AgentFinding(
                    file=path,
                    start=start,
                    end=end,
                    severity=SEVERITY.get(r.extra.severity.upper(), Severity.LOW),
                    claim=f"{rule}: {' '.join(r.extra.message.split())}",
                    confidence=CONFIDENCE.get(conf.upper(), 0.4) if isinstance(conf, str) else 0.4,
                    rule=rule,
                    cwe=f"CWE-{m.group(1)}" if m else None,
                )
            )
        unparsed = {e.get("path") for e in report.errors if "Syntax" in str(e.get("type", ""))}
        notes = [f"{len(unparsed)} file(s) could not be parsed"] if unparsed else []
        return findings, notes
