"""ATP frame v1 and control payloads as strict msgspec Structs (spec §4.2, §4.3).

These classes are the single schema source: the codecs decode into them, the
JSON Schemas in ``proto/`` are generated from them, and the control API bodies
reuse them.

Units: tokens are integers; money on the wire is **USD micros** (1 USD =
1_000_000) in windows, budgets and telemetry counters, except where the spec
shows a float USD (``payload.cost_est.usd``, FINAL ``telemetry.usd``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from atp_router.wire.errors import ErrorCode

PROTOCOL_VERSION: Final = 1  # Final: typed Literal[1], the one value Frame.v accepts

NonNegInt = Annotated[int, Meta(ge=0)]
Id = Annotated[str, Meta(min_length=1, max_length=128)]
Confidence = Annotated[float, Meta(ge=0.0, le=1.0)]


class Flag(enum.StrEnum):
    """Frame flags (spec §4.4)."""

    SYN = "SYN"
    ACK = "ACK"
    FIN = "FIN"
    RST = "RST"
    MORE = "MORE"
    HB = "HB"
    CTRL = "CTRL"


class QoS(enum.StrEnum):
    """QoS classes (spec §9)."""

    GOLD = "gold"
    SILVER = "silver"
    BRONZE = "bronze"


class PayloadType(enum.StrEnum):
    """``payload.type`` values (spec §4.2); ``task`` carries a client's task body."""

    TASK = "task"
    PARTIAL = "agent.result.partial"
    FINAL = "agent.result.final"
    QUESTION = "agent.result.question"
    LOG = "agent.result.log"
    CONTROL = "control"


class Window(Struct, forbid_unknown_fields=True, frozen=True):
    """The window triplet (spec §5.1): in-flight calls, tokens (in+out), USD micros."""

    max_parallel: NonNegInt
    max_tokens: NonNegInt
    max_usd_micros: NonNegInt


class CostEstimate(Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """A preflight estimate or an actual cost (spec §5.2): tokens and float USD."""

    in_tokens: NonNegInt = 0
    out_tokens: NonNegInt = 0
    usd: Annotated[float, Meta(ge=0.0)] = 0.0


class Payload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Frame payload (spec §4.2). ``checksum`` is ``sha256:<hex>`` of the payload
    encoded canonically without its own checksum (see :mod:`atp_router.wire.codec`)."""

    type: PayloadType
    content: Any = None
    confidence: Confidence | None = None
    cost_est: CostEstimate | None = None
    checksum: str | None = None


class Frame(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One ATP segment (spec §4.2).

    ``flags`` is a list of :class:`Flag` on the wire; ``checksum`` covers the
    canonical encoding of every field but ``sig`` and ``checksum``; ``sig`` is
    ``base64(HMAC-SHA256(key, same bytes))``. ``ttl`` is decremented per router
    hop.
    """

    v: Literal[1]
    session_id: Id
    stream_id: Id
    msg_seq: NonNegInt
    frag_seq: NonNegInt = 0
    flags: list[Flag] = msgspec.field(default_factory=list)
    qos: QoS = QoS.SILVER
    ttl: Annotated[int, Meta(ge=0, le=255)] = 8
    window: Window | None = None
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    payload: Payload | None = None
    sig: str | None = None
    checksum: str | None = None

    def has(self, flag: Flag) -> bool:
        return flag in self.flags


# --- control payloads (spec §4.3): payload.type == "control", content is one of these ---


class Capabilities(Struct, tag="CAPABILITIES", tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """Agent or router advertisement: skills, context size (tokens), tools,
    safety domains; at the handshake also the chosen encoding."""

    agent: str = ""
    skills: list[str] = msgspec.field(default_factory=list)
    max_ctx: NonNegInt = 0
    tools: list[str] = msgspec.field(default_factory=list)
    safety_domains: list[str] = msgspec.field(default_factory=list)
    encodings: list[Literal["json", "cbor"]] = msgspec.field(default_factory=lambda: ["json"])


class WindowUpdate(Struct, tag="WINDOW_UPDATE", tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """The router moved a window (spec §5.4). ``ack`` piggybacks the highest
    ``msg_seq`` received (spec §4.4)."""

    window: Window
    ack: int | None = None


class Budget(Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """A spend limit: float USD and tokens. ``None`` means no limit on that axis."""

    usd: Annotated[float, Meta(ge=0.0)] | None = None
    tokens: NonNegInt | None = None


class BudgetUpdate(Struct, tag="BUDGET_UPDATE", tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """Client or router adjusts the remaining budget of a stream."""

    budget: Budget


class RouteEntry(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One FIB entry (§4.3): the next-hops (and ECMP weights) a task of
    ``task_type`` gets; ``policy`` names the RIB policy the entry comes from and
    ``match`` is that policy's match (so two entries of one task type — a
    ``diff_loc: ">400"`` policy before the general one — can be told apart)."""

    task_type: str
    next_hops: list[str]
    weights: list[float] = msgspec.field(default_factory=list)
    policy: str = ""
    match: dict[str, Any] = msgspec.field(default_factory=dict)


class RouteUpdate(Struct, tag="ROUTE_UPDATE", tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """FIB deltas published to downstream switches; ``version`` is the RIB generation."""

    version: NonNegInt
    routes: list[RouteEntry] = msgspec.field(default_factory=list)
    withdrawn: list[str] = msgspec.field(default_factory=list)


class ErrorPayload(Struct, tag="ERROR", tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """Structured error (spec §4.3, §10): code, reason, retry/backoff hint in ms.
    ``msg_seq``/``frag_seq`` name the frame concerned (e.g. the gap of ESEQ_RETRY)."""

    code: ErrorCode
    reason: str
    retry_after_ms: NonNegInt | None = None
    msg_seq: NonNegInt | None = None
    frag_seq: NonNegInt | None = None


Control = Capabilities | WindowUpdate | BudgetUpdate | RouteUpdate | ErrorPayload

CONTROL_TYPES: tuple[type, ...] = (Capabilities, WindowUpdate, BudgetUpdate, RouteUpdate, ErrorPayload)
