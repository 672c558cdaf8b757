"""Findings and results: what review agents produce and what the router returns
(spec §7.3). Strict msgspec Structs, shared by adapters, consensus and the API.

Lines are 1-based in the file *after* the diff; ``end`` is inclusive.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from atp_router.wire.frame import QoS

Line = Annotated[int, Meta(ge=1)]
Confidence = Annotated[float, Meta(ge=0.0, le=1.0)]


class Severity(enum.StrEnum):
    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"
    INFO = "info"

    @property
    def rank(self) -> int:
        """4 for critical … 0 for info, for ordering and thresholds."""
        return _RANK[self]


_RANK = {Severity.CRITICAL: 4, Severity.HIGH: 3, Severity.MEDIUM: 2, Severity.LOW: 1, Severity.INFO: 0}


class AgentFinding(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One finding as an agent reports it. ``ref`` is the agent's own local id
    (provenance is ``"<agent>#<ref>"``); ``rule`` the analyser's rule code;
    ``suppressed_by_change`` is true when a suppression comment the reviewed
    change adds (``# noqa``, ``# nosec``, ``# pylint: disable``, a file-level
    ``# ruff: noqa`` …) would have hidden it from the analyser: reported anyway,
    so a reviewer sees that the author silenced it
    (:mod:`atp_router.adapters.tools.suppressions`)."""

    file: str
    start: Line
    end: Line
    severity: Severity
    claim: str
    confidence: Confidence = 0.5
    ref: str = ""
    rule: str | None = None
    cwe: str | None = None
    patch: str | None = None
    tests: list[str] = msgspec.field(default_factory=list)
    suppressed_by_change: bool = False


class Usage(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Actual consumption of one call: tokens and USD micros (1 USD = 1_000_000)."""

    in_tokens: Annotated[int, Meta(ge=0)] = 0
    out_tokens: Annotated[int, Meta(ge=0)] = 0
    usd_micros: Annotated[int, Meta(ge=0)] = 0

    @property
    def tokens(self) -> int:
        return self.in_tokens + self.out_tokens

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(
            self.in_tokens + other.in_tokens, self.out_tokens + other.out_tokens, self.usd_micros + other.usd_micros
        )


class AgentReport(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The content of an agent's FINAL fragment for a review task."""

    findings: list[AgentFinding] = msgspec.field(default_factory=list)
    summary: str = ""
    confidence: Confidence | None = None


class FindingScores(Struct, forbid_unknown_fields=True):
    """The consensus scorers of one merged finding (spec §7.1), each 0..1:
    ``evidence`` the best contributor's citation score (file and lines exist,
    inside the change or naming a test); ``agreement`` the share of the
    reporting sources that flagged this place; ``claims`` the mean pairwise
    word similarity of the contributors' claims (1.0 with one); ``cost`` the
    best contributor's cost score (1.0: free or a high-severity finding)."""

    evidence: Annotated[float, Meta(ge=0.0, le=1.0)]
    agreement: Annotated[float, Meta(ge=0.0, le=1.0)]
    claims: Annotated[float, Meta(ge=0.0, le=1.0)]
    cost: Annotated[float, Meta(ge=0.0, le=1.0)]


class Finding(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A merged finding in the FINAL result (spec §7.3). ``span`` is ``"start-end"``;
    ``scores`` the consensus scorers behind its confidence; ``cached`` is true
    when every agent of its ``provenance`` answered from the response cache
    (spec §13: a stored answer, not a new call); ``suppressed_by_change`` when
    any contributor's finding is (:class:`AgentFinding`): the change silenced
    this place for at least one of its reviewers."""

    id: str
    severity: Severity
    file: str
    span: str
    claim: str
    confidence: Confidence
    provenance: list[str]
    patch: str | None = None
    tests: list[str] = msgspec.field(default_factory=list)
    scores: FindingScores | None = None
    cached: bool = False
    suppressed_by_change: bool = False


class ConsensusInfo(Struct, forbid_unknown_fields=True):
    strategy: str
    agreement: Annotated[float, Meta(ge=0.0, le=1.0)]
    uncertainties: list[str] = msgspec.field(default_factory=list)


#: Characters of one agent's prose answer kept in FINAL.
ANSWER_CHARS = 32_000


class Answer(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One next-hop's answer in prose, beside the findings (§7.3; a model or A2A
    agent that answers in text is visible in FINAL): ``text`` is the summary of
    its report, else the text it streamed, at most :data:`ANSWER_CHARS`
    characters (``truncated`` when cut); ``confidence`` its own, if it gave one;
    ``cached`` when the answer came from the response cache (spec §13)."""

    agent: str
    text: str
    confidence: Confidence | None = None
    truncated: bool = False
    cached: bool = False


class Result(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The merged result (§7.3): ``findings`` with provenance, the
    ``consensus`` that merged them, and each answering next-hop's prose
    ``answers`` (omitted when none answered in prose)."""

    findings: list[Finding]
    consensus: ConsensusInfo
    answers: list[Answer] = msgspec.field(default_factory=list)


class SignedUsage(Struct, forbid_unknown_fields=True):
    """A usage summary the router signed (spec §19 billing abuse): ``summary``
    (tenant, session and stream ids, tokens, USD micros, next-hops that
    reported, RIB version, close time in unix ms) and ``jws``, its compact JWS
    (Ed25519) a client verifies against the router's ``GET /v1/keys``."""

    summary: dict[str, Any]
    jws: str


class Telemetry(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Totals of a stream: tokens (in+out), float USD, wall time SYN → FINAL in ms;
    ``usage`` the router's signed summary of the same spend (absent when the
    router signs none); ``cached`` the agents whose answer was served from the
    response cache at no cost (spec §13; absent when none). ``qos_asked`` /
    ``qos_served``: only when the tenant's ``qos_max`` lowered the class the SYN
    asked for (spec §9, §11): what it asked and the class it ran at."""

    tokens: Annotated[int, Meta(ge=0)]
    usd: Annotated[float, Meta(ge=0.0)]
    latency_ms: Annotated[float, Meta(ge=0.0)]
    usage: SignedUsage | None = None
    cached: list[str] = msgspec.field(default_factory=list)
    qos_asked: QoS | None = None
    qos_served: QoS | None = None


class FinalResult(Struct, forbid_unknown_fields=True):
    """The FINAL payload content, exactly the shape of spec §7.3."""

    result: Result
    telemetry: Telemetry
