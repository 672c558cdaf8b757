"""The RIB schema: models, agents and policies as strict msgspec Structs (spec §6.1, §23).

The RIB is the declarative control-plane table an operator writes in YAML (or
posts to the control API); :mod:`atp_router.policy.loader` parses and cross-checks it,
:mod:`atp_router.policy.fib` compiles it into the FIB the data plane looks up.

Shape (every Struct forbids unknown fields)::

    Rib
    ├── models:   {name: ModelSpec}    provider, ctx (tokens), cost (USD / 1M tokens), ...
    ├── agents:   {name: AgentSpec}    layer, model | tool, qos, p95_ms, win30d, window, fallback, ...
    ├── policies: [PolicySpec]         match, fanout, escalation, budget, window, cache, ...
    └── clients:  {name: ClientSpec}   budget (across all the client's streams), qos_max, scopes:
                                       task_types, max_stream_budget, max_streams, rate, data_categories

Units: ``ctx`` and ``max_out_tokens`` are tokens; ``cost``/``cost_in``/``cost_out``
are USD per 1M tokens (which is numerically USD micros per token); latencies and
timeouts are ms; ``window.max_usd_micros`` is USD micros; ``budget.usd`` is float USD.

Checks that need only one entry live here (``__post_init__`` raises
:class:`SpecError`, which msgspec wraps in a ``ValidationError``); checks across
entries (an agent's model exists, a fanout names known agents, the fallback
graph has no cycle) are :func:`reference_errors`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from atp_router.wire.frame import Budget, QoS, Window

__all__ = [
    "GOOGLE_KEY_ENVS",
    "PROVIDERS",
    "TOOLS",
    "TRIGGERS",
    "AgentSpec",
    "Budget",
    "CacheSpec",
    "ClientSpec",
    "EscalationSpec",
    "ModelSpec",
    "PolicySpec",
    "RateSpec",
    "RefError",
    "Rib",
    "SpecError",
    "TlsClientSpec",
    "Window",
    "agent_window",
    "fallback_cycle",
    "independence_source",
    "parse_tokens",
    "reference_errors",
]

#: Model providers an adapter exists for (spec §14).
PROVIDERS: tuple[str, ...] = ("openai", "openai_compat", "ollama", "google")
#: The environment variables a ``google`` model's key is read from when it sets no
#: ``api_key_env``, in order (the Gemini API's own names): the adapter reads them,
#: and the policy guard counts them among the variables a RIB makes the router read.
GOOGLE_KEY_ENVS: tuple[str, ...] = ("GOOGLE_API_KEY", "GEMINI_API_KEY")

#: Local tools usable as ``agents.<name>.tool``. Add a name here when its
#: adapter lands in :mod:`atp_router.adapters.tools`.
TOOLS: frozenset[str] = frozenset({"ruff", "bandit", "pylint", "mypy", "semgrep", "retriever", "summariser",
                                   "pytest", "tests"})
#: The tools shipped with the router: deterministic analysers, so two agents on
#: one of them are one consensus source (a tool registered later is its own).
BUILTIN_TOOLS: frozenset[str] = frozenset({"ruff", "bandit", "pylint", "mypy", "semgrep"})

#: Escalation triggers (spec §6.1, §15, §23): raised by the consensus engine.
TRIGGERS: tuple[str, ...] = (
    "low_conf",
    "test_fail",
    "disagree_high",
    "disagreement",
    "weak_citations",
    "no_findings",
)

Provider = Literal["openai", "openai_compat", "ollama", "google"]
Speed = Literal["fast", "medium", "slow"]
Layer = Literal["L0", "L1", "L2", "L3", "L4", "L5"]
Scope = Literal["changed", "file"]
Trigger = Literal["low_conf", "test_fail", "disagree_high", "disagreement", "weak_citations", "no_findings"]

UsdPerMTok = Annotated[float, Meta(ge=0.0)]
Confidence = Annotated[float, Meta(ge=0.0, le=1.0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Ms = Annotated[float, Meta(ge=0.0)]
# Names of env vars only: a value that looks like a key ("sk-...") is refused.
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
NonEmptyStr = Annotated[str, Meta(min_length=1)]

Scalar = str | int | float | bool
#: A ``match`` value: a scalar (equality / membership), a comparison string
#: such as ``">150"`` or a list meaning "any of" (see :mod:`atp_router.policy.match`).
MatchValue = Scalar | list[Scalar]

#: Names of models, agents and policies (brackets for the default "policy[i]").
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+\[\]-]{0,127}$")

_TOKENS_RE = re.compile(r"^\s*(\d+(?:_\d+)*(?:\.\d+)?)\s*([kKmM]?)\s*$")
_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}


class SpecError(ValueError):
    """One entry of the RIB is invalid. ``field`` is the dotted key below the
    entry (``"ctx"``, ``"fanout[2]"``) so the loader can report a precise key."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(reason)


def parse_tokens(value: int | str) -> int:
    """A token count: an int, or a string like ``"32k"``, ``"2M"``, ``"1.5k"``,
    ``"128_000"``. ``k`` is 1024 and ``M`` is 1024² (context windows are powers of
    two: ``32k`` = 32768). Raises ValueError on anything else or a negative count."""
    if isinstance(value, bool):
        raise ValueError(f"expected a token count, got {value!r}")  # noqa: TRY004 (callers catch ValueError)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a non-negative token count, got {value}")
        return value
    m = _TOKENS_RE.match(value)
    if m is None:
        raise ValueError(f"expected a token count like 32768, '32k' or '2M', got {value!r}")
    return int(float(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).lower()])


class TlsClientSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """TLS towards an HTTP next-hop (spec §4.1, §11 AuthN: mTLS between router and
    agents or downstream routers): ``ca_file`` the PEM bundle that verifies the
    peer's certificate (None: the system's trust store); ``cert_file`` /
    ``key_file`` the router's own client certificate and key (both or neither),
    which makes the connection mutual TLS at TLS 1.3. Paths are files on the
    router's host; they are read when the RIB is compiled (a missing or bad file
    refuses the RIB)."""

    ca_file: NonEmptyStr | None = None
    cert_file: NonEmptyStr | None = None
    key_file: NonEmptyStr | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise SpecError("cert_file", "give cert_file and key_file together (the client certificate and its key)")


class ModelSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """A model registry entry (spec §6.1).

    ``ctx`` accepts ``"32k"``-style strings and is an int (tokens) after
    construction. ``cost`` is the blended USD per 1M tokens; ``cost_in`` /
    ``cost_out`` override it for input / output tokens (``cost`` may then be
    omitted, when both are given). ``model`` is the provider's model id (the
    loader defaults it to the registry key). ``api_key_env`` names the env var
    holding the key, never the key. ``openai_compat`` requires ``base_url``.
    ``tls`` sets the CA and the client certificate towards ``base_url``
    (:class:`TlsClientSpec`). ``slots``: how many requests the model's server
    serves at once (llama.cpp's ``--parallel``; 1 for llama-cpp-python's server,
    which interrupts a running request for a new one): every agent on this model
    then runs at most that many calls at once (:func:`agent_window`), and the
    others wait in the next-hop's queue instead of failing at the server.
    """

    provider: Provider
    ctx: int | str
    cost: UsdPerMTok | None = None
    cost_in: UsdPerMTok | None = None
    cost_out: UsdPerMTok | None = None
    speed: Speed = "medium"
    strengths: list[str] = msgspec.field(default_factory=list)
    base_url: NonEmptyStr | None = None
    model: NonEmptyStr | None = None
    api_key_env: EnvName | None = None
    max_out_tokens: PosInt = 512
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    tls: TlsClientSpec | None = None
    slots: PosInt | None = None

    def __post_init__(self) -> None:
        try:
            self.ctx = parse_tokens(self.ctx)
        except ValueError as e:
            raise SpecError("ctx", str(e)) from None
        if self.cost is None and (self.cost_in is None or self.cost_out is None):
            raise SpecError("cost", "cost is required unless both cost_in and cost_out are given")
        if self.provider == "openai_compat" and self.base_url is None:
            raise SpecError("base_url", "required for provider openai_compat")

    @property
    def usd_per_mtok_in(self) -> float:
        """USD per 1M input tokens (= USD micros per input token)."""
        return self.cost_in if self.cost_in is not None else self.cost  # type: ignore[return-value]

    @property
    def usd_per_mtok_out(self) -> float:
        """USD per 1M output tokens (= USD micros per output token)."""
        return self.cost_out if self.cost_out is not None else self.cost  # type: ignore[return-value]

    @property
    def usd_per_mtok(self) -> float:
        """Blended USD per 1M tokens: ``cost``, else the mean of in and out."""
        if self.cost is not None:
            return self.cost
        return (self.usd_per_mtok_in + self.usd_per_mtok_out) / 2


#: Network protocols a remote agent can be reached by (spec §14 adapters).
REMOTE_PROTOCOLS: tuple[str, ...] = ("mqtt2389", "a2a", "agent_api", "mcp")


class RemoteSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """How to reach a remote agent (spec §14): ``protocol`` is one of
    :data:`REMOTE_PROTOCOLS`; ``url`` the peer's address (``mqtt://host:port`` for a
    2389 broker, the JSON-RPC endpoint for A2A, the base URL for the Agent API, the
    streamable HTTP endpoint of an MCP server, whose tool ``options.tool`` is the
    next-hop); ``agent_id`` the peer's own name for the agent (2389 agent id, A2A
    agent name); ``version`` a protocol version where the protocol has several (A2A
    ``0.3`` / ``1.0``, MCP ``2025-11-25`` / ``2026-07-28``); ``auth_env`` the env var
    holding a credential (never the credential);
    ``cost_usd_per_call`` a flat price charged when the peer reports no usage;
    ``options`` protocol-specific settings, validated by the adapter; ``tls`` the
    CA and client certificate for ``https://`` (A2A, Agent API, MCP) and ``mqtts://``
    (2389) peers (:class:`TlsClientSpec`; for mqtt2389 the older
    ``options.ca_file/cert_file/key_file`` still work).
    """

    protocol: Literal["mqtt2389", "a2a", "agent_api", "mcp"]
    url: NonEmptyStr
    agent_id: NonEmptyStr | None = None
    version: NonEmptyStr | None = None
    auth_env: NonEmptyStr | None = None
    cost_usd_per_call: Annotated[float, Meta(ge=0.0)] = 0.0
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    tls: TlsClientSpec | None = None


class CalibrationSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What an evaluation measured of an agent's findings (``atp-router eval
    --calibration`` writes it): ``findings`` reported, ``matched`` a labelled
    defect. The confidence the router gives each of the agent's findings is the
    posterior mean ``(matched + weight·c) / (findings + weight)``, ``c`` being the
    confidence the agent stated — so a measured precision overrides an
    analyser's hard-coded grades as evidence accumulates (spec §7.1)."""

    findings: Annotated[int, Meta(ge=0)]
    matched: Annotated[int, Meta(ge=0)]
    weight: Annotated[float, Meta(gt=0.0, le=1000.0)] = 5.0

    def __post_init__(self) -> None:
        if self.matched > self.findings:
            raise SpecError("matched", f"matched {self.matched} exceeds findings {self.findings}")

    def apply(self, confidence: float) -> float:
        """The calibrated confidence (0..1) of a finding stated at ``confidence``."""
        return (self.matched + self.weight * confidence) / (self.findings + self.weight)


class AgentSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """An agent registry entry (spec §6.1): exactly one of ``model`` (a key of
    ``Rib.models``), ``tool`` (one of :data:`TOOLS`) or ``remote`` (a
    :class:`RemoteSpec`).

    ``p95_ms`` is the configured p95 latency (ms), ``win30d`` the 30-day win rate
    (0..1) that seeds ECMP weights, ``timeout_ms`` the overall per-call deadline,
    ``scope`` whether findings are kept only on changed lines (``changed``) or on
    the whole file (``file``); ``options`` is passed to the tool / model adapter.

    Flow control and failure handling (spec §5.1, §5.3, §10): ``window`` is this
    next-hop's own triplet (calls in flight, tokens, USD micros), shared by
    every stream that calls it (None: the router's default agent window);
    ``fallback`` the agent a call is rerouted to when this one is down
    (``EAGENTDOWN``, circuit open, retries spent), tried before the FIB's other
    candidates — the fallback graph must be acyclic; ``data_scope`` the
    ``meta.data_scope`` labels this agent is cleared to receive (None: any;
    a task with a label outside the list never goes to it, spec §11).
    ``calibration`` the measured precision of its findings
    (:class:`CalibrationSpec`; None: its stated confidences are used as given).
    """

    layer: Layer
    p95_ms: Ms
    model: NonEmptyStr | None = None
    tool: NonEmptyStr | None = None
    remote: RemoteSpec | None = None
    qos: QoS = QoS.SILVER
    win30d: Confidence = 0.5
    strengths: list[str] = msgspec.field(default_factory=list)
    timeout_ms: PosInt = 60_000
    scope: Scope = "changed"
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    window: Window | None = None
    fallback: NonEmptyStr | None = None
    data_scope: list[NonEmptyStr] | None = None
    calibration: CalibrationSpec | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window.max_parallel < 1:
            raise SpecError("window.max_parallel", "max_parallel must be >= 1 (0 would never admit a call)")
        given = [k for k in ("model", "tool", "remote") if getattr(self, k) is not None]
        if not given:
            raise SpecError("model", "exactly one of 'model', 'tool' or 'remote' is required")
        if len(given) > 1:
            raise SpecError(given[1], f"give only one of 'model', 'tool' or 'remote', not {' and '.join(given)}")
        if self.tool is not None and self.tool not in TOOLS:
            raise SpecError("tool", f"unknown tool {self.tool!r} (known: {', '.join(sorted(TOOLS))})")


class EscalationSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Escalate to agent ``to`` when any trigger in ``on`` fires (spec §6.1);
    ``threshold`` is the confidence under which ``low_conf`` fires. With
    ``evidence`` the escalation next-hop gets what the first stage found as
    ``content["evidence"]`` (spec §15.3: synthesis "only with document
    snippets"; see :func:`atp_router.runtime.dataplane.plan.hand_evidence`)."""

    on: Annotated[list[Trigger], Meta(min_length=1)]
    to: NonEmptyStr
    threshold: Confidence = 0.5
    evidence: bool = False


class BanditSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Contextual-bandit routing over the policy's fanout (spec §6.2;
    :mod:`atp_router.policy.bandit`). The arms are the fanout's agents; the FIB's
    healthy, cleared candidates are re-ordered by ``sampled quality − λ·cost``
    and cut to ``fanout_k`` again.

    ``explore``: scale of the posterior draws (0: greedy; the replay bench found
    0.25 best on MMLU learning from zero, and 0 for arms warm-started by
    ``atp-router learn --method fit``, both on validation); ``lambda``: fixed cost weight, quality points per call of
    the dearest arm; ``target_cost``: instead, a spend rate (0..1 of the dearest
    arm's cost per task) that λ tracks by dual ascent; with neither, λ comes
    from the stream's budget (the dearest arm's expected USD per call over the
    stream's USD budget, at most 1); ``bar``: prefer the cheapest arm whose
    sampled quality clears it (0: off); ``text_features``: hash the prompt's
    words into the context; ``bits``: 2**bits weights per arm.
    """

    explore: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.25
    lam: Annotated[float, Meta(ge=0.0, le=100.0)] | None = msgspec.field(default=None, name="lambda")
    target_cost: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    bar: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    text_features: bool = True
    bits: Annotated[int, Meta(ge=8, le=16)] = 12

    def __post_init__(self) -> None:
        if self.lam is not None and self.target_cost is not None:
            raise SpecError("target_cost", "give either lambda (fixed) or target_cost (adaptive λ), not both")


class ShadowSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Shadow routing (spec §18): a share ``rate`` (0..1] of the policy's tasks
    is also sent to the challenger ``agent`` on bronze, after the client's
    FINAL, never touching the client's result or budget. ``budget`` is the
    shadow's own total spend cap for this policy (router-wide, durable); a
    shadow call stops when it is spent. Its outcome feeds ``atp_shadow_regret``
    and, when ``agent`` is one of the policy's bandit arms, the bandit."""

    agent: NonEmptyStr
    rate: Annotated[float, Meta(gt=0.0, le=1.0)]
    budget: Budget


class CacheSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The policy's content-addressed response cache (spec §13;
    :mod:`atp_router.policy.cache`, :mod:`atp_router.runtime.dataplane.cache`): a next-hop answer that
    completed is stored, and the same call again (same agent and agent
    config, same prompt as that agent sees it, same task meta but for its
    volatile fields) is served from the store at zero cost while it is
    younger than ``ttl_s`` seconds (> 0, at most 30 days). ``shared``: the
    answers are shared by every tenant whose stream this policy routes
    (default false: each tenant has its own, no hit crosses tenants)."""

    ttl_s: Annotated[float, Meta(gt=0.0, le=30 * 86_400.0)] = 3600.0
    shared: bool = False


class PolicySpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """One policy (spec §6.1, §23). Policies are tried in RIB order; the first
    whose ``match`` accepts the task meta routes it.

    ``name`` defaults to ``policy[i]`` (i = position in the merged RIB);
    ``fanout_k`` keeps the top-K next-hops by score (default all);
    ``quorum`` is the K of K-of-N for ``consensus: two_phase_commit``: distinct
    sources that must flag a place before it is committed (None: 2; at most
    the fanout plus the escalation target); ``window`` is the initial window triplet (spec §5.1, §15.1: in-flight calls,
    tokens, USD micros; all three given, ``max_parallel`` ≥ 1) or None for the
    router's default; ``deadline_ms`` is the overall stream deadline;
    ``cache`` serves repeated next-hop calls from the response cache
    (:class:`CacheSpec`; None: no cache).
    """

    match: dict[str, MatchValue]
    fanout: Annotated[list[NonEmptyStr], Meta(min_length=1)]
    name: NonEmptyStr | None = None
    fanout_k: PosInt | None = None
    escalation: EscalationSpec | None = None
    budget: Budget | None = None
    window: Window | None = None
    consensus: NonEmptyStr = "union_tiebreak"
    quorum: PosInt | None = None
    qos: QoS | None = None
    deadline_ms: PosInt = 120_000
    bandit: BanditSpec | None = None
    shadow: ShadowSpec | None = None
    cache: CacheSpec | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, agent in enumerate(self.fanout):
            if agent in seen:
                raise SpecError(f"fanout[{i}]", f"duplicate agent {agent!r} in fanout")
            seen.add(agent)
        if self.fanout_k is not None and self.fanout_k > len(self.fanout):
            raise SpecError("fanout_k", f"fanout_k {self.fanout_k} exceeds the fanout size {len(self.fanout)}")
        if self.window is not None and self.window.max_parallel < 1:
            raise SpecError("window.max_parallel", "max_parallel must be >= 1 (0 would never admit a call)")
        if self.quorum is not None and self.quorum > len(self.fanout) + (self.escalation is not None):
            raise SpecError("quorum", f"quorum {self.quorum} exceeds the {len(self.fanout)} fanout agent(s)"
                            + (" plus the escalation target" if self.escalation is not None else "")
                            + ": nothing could ever be committed")
        if self.escalation is not None and self.escalation.to in seen:
            raise SpecError(
                "escalation.to",
                f"escalation target {self.escalation.to!r} is already in the fanout (escalate to an agent outside it)",
            )


class RateSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A token bucket (spec §11 AuthZ, §19 resource abuse): ``per_s`` tokens added
    per second (float > 0), at most ``burst`` held (int ≥ 1). One stream open
    takes one token; a full bucket lets ``burst`` opens through at once."""

    per_s: Annotated[float, Meta(gt=0.0, description="stream opens per second (> 0)")]
    burst: PosInt


class ClientSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """A client of the router — a tenant (spec §5.1 budget window, §9, §11 AuthZ):
    the identity a bearer token, JWT or certificate maps to (see
    :mod:`atp_router.security.identity`; without authentication the client is
    ``anonymous``).

    ``budget`` caps the client's committed spend across all its streams, over
    the router's lifetime (float USD and tokens; None: no client cap, each
    stream still has its own); the operator raises it with a RIB reload.
    ``qos_max`` is the highest QoS class the client's streams get: a SYN asking
    above it is served (and confirmed at SYN+ACK) at ``qos_max``.

    Scopes (enforced by :class:`atp_router.security.authz.StreamAdmission`):
    ``task_types`` the ``task_type`` values the client may open streams for
    (None: any; a task type outside it is refused with ``ESEC``);
    ``max_stream_budget`` caps each stream's budget on each axis (float USD,
    tokens; a SYN asking for more gets the cap, one asking for nothing gets the
    cap); ``max_streams`` the client's concurrently open streams and ``rate``
    its stream opens per second (a token bucket; beyond either the SYN is
    refused with ``EWINDOW`` and a retry hint in ms) — None for either means the
    router's default (1000 streams, 50 opens/s with a burst of 100 unless the
    router is configured otherwise), so no tenant can take every stream slot;
    ``data_categories`` the ``meta.data_scope`` labels the client may send
    (None: any; a label outside it is refused with ``ESEC``).

    Learning (spec §6.2, :mod:`atp_router.policy.learn`): ``feedback`` ``"tenant"``
    (default) makes the client's ``POST /v1/streams/{id}/feedback`` scores
    train only the client's own routing (its tenant feature of each bandit arm),
    never other tenants' — a tenant cannot steer or poison routing for everyone;
    ``"shared"`` (a trusted evaluation or QA client) trains the shared weights
    and the next-hops' live quality too.
    """

    budget: Budget | None = None
    qos_max: QoS = QoS.GOLD
    task_types: list[NonEmptyStr] | None = None
    max_stream_budget: Budget | None = None
    max_streams: PosInt | None = None
    rate: RateSpec | None = None
    data_categories: list[NonEmptyStr] | None = None
    feedback: Literal["tenant", "shared"] = "tenant"


class Rib(Struct, forbid_unknown_fields=True, kw_only=True):
    """The routing information base (spec §6.1): registries, ordered policies,
    and the clients' budgets."""

    models: dict[str, ModelSpec] = msgspec.field(default_factory=dict)
    agents: dict[str, AgentSpec] = msgspec.field(default_factory=dict)
    policies: list[PolicySpec] = msgspec.field(default_factory=list)
    clients: dict[str, ClientSpec] = msgspec.field(default_factory=dict)


def agent_window(rib: Rib, agent: str, default: Window) -> Window | None:
    """The window triplet of RIB agent ``agent`` (spec §5.1; ``None``: the
    router's ``default``, unchanged): its own ``window``, with ``max_parallel``
    capped to its model's ``slots`` (:class:`ModelSpec`) when it has one — an
    agent without a window then gets ``default`` capped."""
    spec = rib.agents.get(agent)
    if spec is None:
        return None
    model = rib.models.get(spec.model) if spec.model is not None else None
    if model is None or model.slots is None:
        return spec.window
    own = spec.window or default
    if own.max_parallel <= model.slots:
        return spec.window
    return msgspec.structs.replace(own, max_parallel=model.slots)


def independence_source(rib: Rib, agent: str) -> str:
    """What stands behind RIB agent ``agent`` for consensus independence (spec §19
    consensus poisoning: "require independent sources; penalize correlated
    errors"): ``model:<provider>:<model id>`` for a model agent (two agents on one
    model are one source, whatever their prompts), ``tool:<tool>`` for a built-in
    local tool (:data:`BUILTIN_TOOLS`; a plug-in tool is its own source),
    ``remote:<protocol>:<url>#<agent_id>`` for a remote agent; ``agent:<name>`` for
    a name the RIB does not have."""
    spec = rib.agents.get(agent)
    if spec is None:
        return "agent:" + agent
    if spec.model is not None:
        model = rib.models.get(spec.model)
        ident = (model.model or spec.model) if model is not None else spec.model
        return f"model:{model.provider if model is not None else '?'}:{ident}"
    if spec.tool is not None and spec.tool in BUILTIN_TOOLS:
        return "tool:" + spec.tool
    if spec.remote is not None:
        return f"remote:{spec.remote.protocol}:{spec.remote.url}#{spec.remote.agent_id or ''}"
    return "agent:" + agent


class RefError(Struct, frozen=True):
    """A dangling or invalid cross-reference: ``section`` is ``"agents"`` or
    ``"policies"``, ``entry`` the agent name or policy index, ``field`` the key
    below it (``".model"``, ``".fanout[1]"``)."""

    section: str
    entry: str | int
    field: str
    reason: str


def _known(names: Any) -> str:
    listed = sorted(names)
    return ", ".join(listed) if listed else "none defined"


def fallback_cycle(agents: dict[str, AgentSpec], start: str) -> list[str] | None:
    """The fallback cycle reached from ``start`` as ``[a, b, …, a]``, or None.

    Each agent has at most one ``fallback``, so following them from ``start``
    either ends (an agent without one, or an unknown name) or enters a cycle."""
    seen: dict[str, int] = {}
    path: list[str] = []
    name: str | None = start
    while name is not None and name in agents:
        if name in seen:
            return path[seen[name] :] + [name]
        seen[name] = len(path)
        path.append(name)
        name = agents[name].fallback
    return None


def reference_errors(rib: Rib) -> Iterator[RefError]:
    """Yield every cross-reference fault of ``rib`` in document order: an agent's
    model or fallback missing; a fallback cycle (reported once, at its first
    agent in document order, naming the whole cycle: a reroute along it would
    never end); a fanout or escalation agent missing; no policies at all."""
    reported: set[str] = set()
    for name, agent in rib.agents.items():
        if agent.model is not None and agent.model not in rib.models:
            yield RefError("agents", name, ".model", f"unknown model {agent.model!r} (known: {_known(rib.models)})")
        if agent.fallback is not None:
            if agent.fallback not in rib.agents:
                yield RefError(
                    "agents", name, ".fallback", f"unknown agent {agent.fallback!r} (known: {_known(rib.agents)})"
                )
            elif name not in reported and (cycle := fallback_cycle(rib.agents, name)) is not None and cycle[0] == name:
                # ``name`` is on the cycle (not merely leading into it): report it here, once.
                reported.update(cycle)
                yield RefError("agents", name, ".fallback", "cyclic fallback " + " → ".join(cycle))
    for i, policy in enumerate(rib.policies):
        for j, agent_name in enumerate(policy.fanout):
            if agent_name not in rib.agents:
                yield RefError(
                    "policies", i, f".fanout[{j}]", f"unknown agent {agent_name!r} (known: {_known(rib.agents)})"
                )
        if policy.escalation is not None and policy.escalation.to not in rib.agents:
            yield RefError(
                "policies",
                i,
                ".escalation.to",
                f"unknown agent {policy.escalation.to!r} (known: {_known(rib.agents)})",
            )
        if policy.shadow is not None and policy.shadow.agent not in rib.agents:
            yield RefError(
                "policies", i, ".shadow.agent", f"unknown agent {policy.shadow.agent!r} (known: {_known(rib.agents)})"
            )
    if not rib.policies:
        yield RefError("policies", -1, "", "no policies: a RIB needs at least one")
