"""The 2389 tool interface (§8) and the tools this runtime ships.

Every tool implements ``describe()`` (name, description, a JSON Schema of its
parameters), ``initialize(config) -> bool``, ``execute(parameters, context)`` (a
JSON-serialisable result, or :class:`ToolError`) and optionally ``shutdown()``.
The runtime validates every call against an allow-list and the tool's schema
before ``execute`` (NFR-005, FR-009).

Schema validation: jsonschema is not a dependency, so :func:`validate` is a small
strict validator of the JSON Schema Draft 2020-12 subset that §8.1 describes —
``type`` (incl. ``integer`` and ``null``, or a list of types), ``properties``,
``required``, ``additionalProperties`` (bool or schema), ``items``, ``enum``,
``const``, ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``,
``minLength``/``maxLength``, ``pattern``, ``minItems``/``maxItems``, plus the
annotations ``description``/``title``/``default``/``examples``/``$comment``.
:func:`check_schema` refuses a schema using any other keyword (a tool whose schema
could not be enforced is not loaded) — strict, not silently permissive.

Tools are loaded from a registry (OPT-002), :data:`TOOL_IMPLS`:

``atp.adapter``
    any router next-hop (:class:`~atp_router.adapters.base.ProviderAdapter`) built by
    :func:`atp_router.adapters.registry.build_adapter` from ``config`` — a RIB agent entry
    (``tool = "ruff"``, ``layer``, ``p95_ms``, ...), with a ``model_spec`` table for
    model agents. The agent's own ``[adapter]`` is exposed the same way.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Prompt, ProviderAdapter
from atp_router.adapters.registry import build_adapter
from atp_router.policy.rib import AgentSpec, ModelSpec
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import PayloadType

__all__ = [
    "TOOL_IMPLS",
    "AdapterTool",
    "ParameterError",
    "SchemaError",
    "TaskContext",
    "Tool",
    "ToolError",
    "adapter_tool_from_config",
    "check_schema",
    "validate",
]


class ToolError(Exception):
    """A tool call failed; ``code`` is a §6.3 error code, ``message`` safe to publish
    once sanitized (the runtime sanitizes it)."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


@dataclass(frozen=True, slots=True)
class TaskContext:
    """What a tool may know about the task beside its parameters: ids, the
    envelope's ``instruction``, and the v2 envelope's ``context`` (an Agent Context
    Protocol message, passed on unchanged)."""

    task_id: str
    conversation_id: str
    instruction: str | None = None
    agent_context: Any = None


class Tool(abc.ABC):
    """The §8 tool interface."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """``{"name", "description", "parameters": <JSON Schema>}`` (§8.1)."""

    @abc.abstractmethod
    async def initialize(self, config: Mapping[str, Any]) -> bool:
        """Set up from the tool's ``config`` table; True on success (§8.2)."""

    @abc.abstractmethod
    async def execute(self, parameters: dict[str, Any], context: TaskContext) -> Any:
        """Run with already validated ``parameters``; a JSON-serialisable result.
        Raises :class:`ToolError` (never crashes the agent, §8.3)."""

    async def shutdown(self) -> None:
        """Release resources at agent shutdown (§8.4)."""


# ---------------------------------------------------------------------- JSON Schema subset
class SchemaError(ValueError):
    """A tool's schema uses something the validator cannot enforce."""


class ParameterError(ValueError):
    """Parameters do not match the schema; ``path`` is a JSON path (``$.content``)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}
_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
} | _ANNOTATIONS


def check_schema(schema: Any, path: str = "$") -> None:
    """Raise SchemaError unless ``schema`` uses only the supported subset, well typed."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{path}: a schema must be an object")
    unknown = set(schema) - _KEYWORDS
    if unknown:
        raise SchemaError(f"{path}: unsupported keyword(s) {sorted(unknown)}")
    types = schema.get("type")
    if types is not None:
        listed = types if isinstance(types, list) else [types]
        if not listed or any(t not in _TYPES for t in listed):
            raise SchemaError(f"{path}.type: expected one or more of {_TYPES}")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError(f"{path}.properties: must be an object")
    for key, sub in props.items():
        check_schema(sub, f"{path}.properties.{key}")
    req = schema.get("required", [])
    if not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise SchemaError(f"{path}.required: must be a list of names")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        check_schema(extra, f"{path}.additionalProperties")
    if "items" in schema:
        check_schema(schema["items"], f"{path}.items")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise SchemaError(f"{path}.enum: must be a list")
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if k in schema and (isinstance(schema[k], bool) or not isinstance(schema[k], int | float)):
            raise SchemaError(f"{path}.{k}: must be a number")
    for k in ("minLength", "maxLength", "minItems", "maxItems"):
        if k in schema and (isinstance(schema[k], bool) or not isinstance(schema[k], int) or schema[k] < 0):
            raise SchemaError(f"{path}.{k}: must be a non-negative integer")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except (re.error, TypeError) as e:
            raise SchemaError(f"{path}.pattern: {e}") from None


def _is_type(value: Any, t: str) -> bool:
    match t:
        case "string":
            return isinstance(value, str)
        case "boolean":
            return isinstance(value, bool)
        case "null":
            return value is None
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
        case "integer":
            return (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, float) and value.is_integer())
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return False


def validate(schema: Mapping[str, Any], value: Any, path: str = "$") -> None:
    """Raise :class:`ParameterError` at the first place ``value`` breaks ``schema``
    (a schema that passed :func:`check_schema`)."""
    types = schema.get("type")
    if types is not None:
        listed = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in listed):
            raise ParameterError(path, f"expected {' or '.join(listed)}, got {_json_type(value)}")
    if "const" in schema and value != schema["const"]:
        raise ParameterError(path, f"must be {schema['const']!r:.60}")
    if "enum" in schema and value not in schema["enum"]:
        raise ParameterError(path, f"must be one of {schema['enum']!r:.120}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise ParameterError(path, f"shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise ParameterError(path, f"longer than {schema['maxLength']} characters")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            raise ParameterError(path, f"does not match the pattern {schema['pattern']!r:.80}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise ParameterError(path, f"below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ParameterError(path, f"above the maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise ParameterError(path, f"not above {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            raise ParameterError(path, f"not below {schema['exclusiveMaximum']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise ParameterError(path, f"fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise ParameterError(path, f"more than {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                validate(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        for name in schema.get("required", []):
            if name not in value:
                raise ParameterError(path, f"missing required property {name!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                validate(props[key], item, f"{path}.{key}")
            elif extra is False:
                raise ParameterError(path, f"unexpected property {key!r:.60}")
            elif isinstance(extra, dict):
                validate(extra, item, f"{path}.{key}")


def _json_type(value: Any) -> str:
    for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, t):
            return t
    return type(value).__name__


# ---------------------------------------------------------------------- adapters as tools
#: Parameters of :class:`AdapterTool`: the router's task body.
ADAPTER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task_type": {"type": "string", "minLength": 1, "maxLength": 64,
                      "description": "ATP task type, e.g. code_review"},
        "content": {"type": "object",
                    "description": "the task body; for code_review {diff: unified diff, files: {path: text}}"},
        "instruction": {"type": "string", "description": "extra instruction for the agent"},
        "meta": {"type": "object", "description": "task meta passed to the adapter unchanged"},
    },
    "required": ["content"],
    "additionalProperties": False,
}


class AdapterTool(Tool):
    """A :class:`ProviderAdapter` behind the tool interface.

    ``execute`` runs ``adapter.stream`` on ``Prompt(task_type, content,
    instruction, meta)`` (its typed ``task``: the task type and the envelope's
    Agent Context) and returns the FINAL content as JSON data (an
    ``AgentReport`` becomes ``{"findings": [...], "summary": ..., "confidence"?}``)
    plus ``"usage"`` (tokens, USD micros) when the adapter reported it. Adapter
    errors map to §6.3 codes: ``EPROTO`` (it could not accept the input) →
    ``invalid_input``; anything else → ``failure_code`` (``llm_error`` for model
    adapters, ``tool_execution_failed`` for tools and remote agents).

    ``initialize`` verifies the adapter: ``health().up``, then, when ``probe`` (a
    parameters object) is given, a real call that must end with a FINAL within
    ``probe_timeout_s``.
    """

    def __init__(
        self,
        name: str,
        adapter: ProviderAdapter,
        *,
        description: str = "",
        failure_code: str = "tool_execution_failed",
        default_task_type: str = "code_review",
        probe: dict[str, Any] | None = None,
        probe_timeout_s: float = 60.0,
    ):
        self.name = name
        self.adapter = adapter
        self.description = description or f"runs the ATP next-hop {adapter.name!r} on a task"
        self.failure_code = failure_code
        self.default_task_type = default_task_type
        self.probe = probe
        self.probe_timeout_s = probe_timeout_s
        if probe is not None:
            validate(ADAPTER_PARAMETERS, probe)
        #: Why the last :meth:`initialize` failed (for the startup log), or None.
        self.failure: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": ADAPTER_PARAMETERS}

    async def initialize(self, config: Mapping[str, Any]) -> bool:
        self.failure = None
        if not self.adapter.health().up:
            self.failure = "the adapter reports itself down"
            return False
        if self.probe is None:
            return True
        ctx = TaskContext(task_id="probe", conversation_id="probe")
        try:
            with trio.fail_after(self.probe_timeout_s):
                await self.execute(dict(self.probe), ctx)
        except trio.TooSlowError:
            self.failure = f"the probe call did not finish within {self.probe_timeout_s} s"
            return False
        except ToolError as e:
            self.failure = f"the probe call failed: {e.message}"
            return False
        return True

    async def execute(self, parameters: dict[str, Any], context: TaskContext) -> Any:
        meta = dict(parameters.get("meta") or {})
        task_type = parameters.get("task_type") or self.default_task_type
        meta.setdefault("task_type", task_type)
        if context.agent_context is not None:
            meta["agent_context"] = context.agent_context
        prompt = Prompt(
            task_type=task_type,
            content=parameters["content"],
            meta=meta,
            instruction=parameters.get("instruction") or context.instruction or "",
            task=TaskMeta(task_type=task_type, agent_context=context.agent_context),
        )
        final = None
        usage = None
        try:
            async with aclosing(self.adapter.stream(prompt)) as fragments:
                async for frag in fragments:
                    if frag.usage is not None:
                        usage = frag.usage
                    if frag.type is PayloadType.FINAL:
                        final = frag
                        break
        except AgentError as e:
            code = "invalid_input" if e.code is ErrorCode.EPROTO else self.failure_code
            raise ToolError(code, e.reason) from None
        if final is None:
            raise ToolError(self.failure_code, "the adapter ended without a result")
        out = msgspec.to_builtins(final.content)
        if not isinstance(out, dict):
            out = {"result": out}
        if final.confidence is not None and "confidence" not in out:
            out["confidence"] = final.confidence
        if usage is not None:
            out["usage"] = msgspec.to_builtins(usage)
        return out

    async def shutdown(self) -> None:
        await self.adapter.aclose()


def adapter_tool_from_config(name: str, config: Mapping[str, Any]) -> AdapterTool:
    """``impl = "atp.adapter"``: ``config`` is a RIB agent entry (plus ``model_spec``,
    a RIB model entry, for model agents). Raises ValueError naming the field."""
    spec = dict(config)
    model_raw = spec.pop("model_spec", None)
    try:
        agent = msgspec.convert(spec, AgentSpec)
        model = msgspec.convert(model_raw, ModelSpec) if model_raw is not None else None
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
    adapter = build_adapter(name, agent, model)
    return AdapterTool(name, adapter, failure_code="llm_error" if agent.model else "tool_execution_failed")


#: Tool implementations by ``impl`` identifier (§9 ``[tools]``, OPT-002).
TOOL_IMPLS: dict[str, Callable[[str, Mapping[str, Any]], Tool]] = {"atp.adapter": adapter_tool_from_config}
