"""``agent.toml``: the 2389 agent runtime's configuration (§9), as strict Structs.

::

    [agent]                      # §9 [agent]
    id = "sec-bandit"            # [a-zA-Z0-9._-]+
    description = "..."
    capabilities = ["security"]  # published in the status message (OPT-001)
    max_pipeline_depth = 16      # §7.4 step 5: nested `next` objects allowed (0..16)
    max_message_bytes = 262144   # §6.4
    idempotency_cache = 10000    # task ids remembered (§7.5)
    max_concurrency = 4          # tasks processed at once
    task_timeout_s = 120         # per task, tool call included
    status_expiry_s = 3600       # MQTT 5 expiry of the retained "available" (0: none)
    default_tool = "review"      # the tool that runs [adapter]
    allowed_tools = ["review"]   # allow-list (default: every configured tool)

    [mqtt]                       # §9 [mqtt]
    broker_url = "mqtts://broker.example:8883"   # mqtts:// → TLS with host name verification
    username_env = "MQTT_USERNAME"               # names of env vars, never the secrets
    password_env = "MQTT_PASSWORD"
    ca_file = "/etc/ssl/broker-ca.pem"           # optional trust anchors for TLS
    cert_file = "..."  key_file = "..."          # optional client certificate
    client_id = "atp2389-sec-bandit"             # default: atp2389-<agent id>
    clean_start = false          # persistent session: tasks queued while away are kept
    session_expiry_s = 3600
    keepalive_s = 60

    [adapter]                    # the "LLM" of §7.1 step 6: a RIB agent entry
    tool = "bandit"
    layer = "L1"
    p95_ms = 900

    [model]                      # only for model adapters: the RIB models.<x> entry

    [probe]                      # optional: a real call that must succeed before "available"
    content = { diff = "...", files = { "x.py" = "..." } }

    [tools]                      # §9 [tools]: extra tools (see atp_router.agent2389.tools)
    lint = { impl = "atp.adapter", config = { tool = "ruff", layer = "L1", p95_ms = 200 } }

The spec's ``[llm]`` table is replaced by ``[adapter]`` (+ ``[model]``): the agent's
engine is any router next-hop. Secrets are read from the environment only (NFR-004):
the file names env vars, and :func:`load_config` refuses values that are not names.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from atp_router.mqtt.agent_protocol import MAX_DEPTH, MAX_MESSAGE_BYTES
from atp_router.mqtt.client import parse_broker_url
from atp_router.policy.rib import AgentSpec, ModelSpec

__all__ = [
    "AgentConfig",
    "AgentSection",
    "ConfigError",
    "MqttSection",
    "ProbeSection",
    "ToolEntry",
    "load_config",
    "parse_config",
]

AgentId = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9._-]+$", max_length=128)]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
PosInt = Annotated[int, Meta(ge=1)]
PosFloat = Annotated[float, Meta(gt=0.0)]


class ConfigError(ValueError):
    """``agent.toml`` is unusable: ``key`` is the dotted key (``mqtt.broker_url``)."""

    def __init__(self, path: str, key: str, reason: str):
        self.path = path
        self.key = key
        self.reason = reason
        super().__init__(f"{path}: {key}: {reason}")


class AgentSection(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[agent]``: identity and processing limits (see the module docstring)."""

    id: AgentId
    description: str = ""
    capabilities: list[str] = msgspec.field(default_factory=list)
    max_pipeline_depth: Annotated[int, Meta(ge=0, le=MAX_DEPTH)] = MAX_DEPTH
    max_message_bytes: Annotated[int, Meta(ge=1024, le=MAX_MESSAGE_BYTES)] = MAX_MESSAGE_BYTES
    idempotency_cache: PosInt = 10_000
    max_concurrency: Annotated[int, Meta(ge=1, le=256)] = 4
    task_timeout_s: PosFloat = 120.0
    status_expiry_s: Annotated[int, Meta(ge=0)] = 3600
    default_tool: ToolName = "review"
    allowed_tools: list[ToolName] | None = None


class MqttSection(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[mqtt]``: the broker and how to authenticate (env var names only)."""

    broker_url: str
    username_env: EnvName | None = None
    password_env: EnvName | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    clean_start: bool = False
    session_expiry_s: Annotated[int, Meta(ge=0)] = 3600
    keepalive_s: Annotated[int, Meta(ge=5, le=65535)] = 60
    connect_timeout_s: PosFloat = 10.0


class ProbeSection(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[probe]``: parameters of a verification call of ``[adapter]`` at startup."""

    content: dict[str, Any]
    task_type: str = "code_review"
    instruction: str = ""
    timeout_s: PosFloat = 60.0


class ToolEntry(Struct, forbid_unknown_fields=True, kw_only=True):
    """One ``[tools]`` entry in its table form: ``{impl = "...", config = {...}}``."""

    impl: str
    config: dict[str, Any] = msgspec.field(default_factory=dict)


class AgentConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole ``agent.toml``."""

    agent: AgentSection
    mqtt: MqttSection
    adapter: AgentSpec
    model: ModelSpec | None = None
    probe: ProbeSection | None = None
    tools: dict[ToolName, str | ToolEntry] = msgspec.field(default_factory=dict)

    def tool_entries(self) -> dict[str, ToolEntry]:
        """``[tools]`` with the simple form ``name = "impl"`` expanded."""
        return {n: (ToolEntry(impl=e) if isinstance(e, str) else e) for n, e in self.tools.items()}


def parse_config(text: str, *, path: str = "agent.toml") -> AgentConfig:
    """Parse and check ``agent.toml`` text. Raises :class:`ConfigError`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "$", f"TOML syntax error: {e}") from None
    try:
        cfg = msgspec.convert(raw, AgentConfig)
    except msgspec.ValidationError as e:
        msg = str(e)
        key = msg.rsplit(" - at `$.", 1)[1].rstrip("`") if " - at `$." in msg else "$"
        raise ConfigError(path, key, msg.split(" - at `")[0]) from None
    try:
        parse_broker_url(cfg.mqtt.broker_url)
    except ValueError as e:
        raise ConfigError(path, "mqtt.broker_url", str(e)) from None
    if (cfg.mqtt.ca_file or cfg.mqtt.cert_file) and not parse_broker_url(cfg.mqtt.broker_url).tls:
        raise ConfigError(path, "mqtt.broker_url", "TLS files are given but the URL is not mqtts://")
    if cfg.mqtt.key_file and not cfg.mqtt.cert_file:
        raise ConfigError(path, "mqtt.key_file", "key_file needs cert_file")
    if cfg.adapter.model is not None and cfg.model is None:
        raise ConfigError(path, "model", f"[adapter] names model {cfg.adapter.model!r}: give its [model] table")
    if cfg.agent.default_tool in cfg.tools:
        raise ConfigError(path, f"tools.{cfg.agent.default_tool}",
                          "this name is the default tool that runs [adapter]; choose another")
    known = {cfg.agent.default_tool, *cfg.tools}
    for i, name in enumerate(cfg.agent.allowed_tools or []):
        if name not in known:
            raise ConfigError(path, f"agent.allowed_tools[{i}]", f"unknown tool {name!r} (known: {sorted(known)})")
    return cfg


def load_config(path: str | Path) -> AgentConfig:
    """Read and parse ``agent.toml`` at ``path``. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(p), "$", f"cannot read: {e.strerror}") from None
    return parse_config(text, path=str(p))
