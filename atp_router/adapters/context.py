"""Agent Context Protocol: the context message, its secrets and its data-scope labels.

``draft-liu-agent-context-protocol-00`` defines one JSON message, the *Agent Context
Message* (its Figure 2; transcribed in ``shared/specs/agent-context-message.example.json``),
that an orchestration layer passes "as a side channel along with agent workloads".
The transport is TBD in the draft, so in ATP the message rides in the stream's frame
meta, ``meta["agent_context"]``, exactly as received, and every adapter forwards it
unchanged in its protocol's side channel (Agent API: a system message with one
DataContent; A2A: ``metadata``; 2389: the envelope). Model adapters put it in the
system prompt only when the agent's ``options.context_in_prompt`` is true, and then
never its ``securityContext`` (:func:`prompt_context`).

Schema (:func:`parse_context`; field names are the draft's camelCase)::

    {"agentContext": {                       closed: these five sub-contexts, all optional
      "taskContext":     {taskId, taskName, taskProgress, goals[],
                          todoItems[{itemId, description}],
                          statusUpdates[{updateId, timestamp, message}]},
      "mcpContext":      {mcpServiceList[{serviceName, version}],
                          mcpFunctionList[{functionName, description}]},
      "policyContext":   {policies[{policyId, rule}]},
      "resourceContext": {requiredResources[{resourceType, ...}], availableResources[...]},
      "securityContext": {authenticationInfo{...}, accessControl{role, permissions[]},
                          dataProtection{encryptionEnabled, encryptionAlgorithm}}}}

Unknown fields: the draft names the five sub-contexts and shows each one's fields,
so the envelope, ``agentContext``, every sub-context and every list entry whose
shape Figure 2 fixes are closed (an unknown field is refused, ``EPROTO``). A
misspelt ``securityContex`` must not slip past the redaction as an unknown
extension. Two places are open because Figure 2 itself varies them: resource
entries (one carries ``quantity``, another ``bandwidth``; ``resourceType`` is
required, other attributes are scalars) and ``authenticationInfo`` (any credential
shape; every value in it is a secret).

Secrets: every string (and number) under ``securityContext.authenticationInfo``
is a secret; ``accessControl`` (role, permissions) and ``dataProtection`` are
authorisation facts, not secrets. :func:`redact_context` masks the secrets in a
copy for logs and traces; :func:`parse_context` also records them in a bounded
process-wide set (:func:`register_secrets`). The one scrubber,
:func:`atp_router.security.redact.scrub` (re-exported here with :func:`scrub_error`,
:func:`register_secrets`, :func:`known_secrets` and :data:`REDACTED`), masks them
— and whatever detect-secrets flags — in every adapter's error reasons, in any log
record through :class:`RedactingFilter` (a ``logging.Filter``) and
:func:`redact_event` (a structlog-style processor, without structlog). Values
shorter than :data:`MIN_SECRET_LEN` characters are not treated as secrets (masking
every ``"1"`` in a log would hide nothing and garble everything).

Data scope: :func:`data_scope_labels` turns ``policyContext`` into ATP data-scope
labels (spec §11) — ``acp.policy:<policyId>`` — that a RIB ``match`` on
``data_scope`` can use; :func:`with_context_scope` adds them to a task meta.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from atp_router.security.redact import (
    CONTEXT_PUBLIC,
    MAX_KNOWN_SECRETS,
    MIN_SECRET_LEN,
    REDACTED,
    known_secrets,
    redact_context_message,
    register_secrets,
    scrub,
    scrub_error,
)
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode, LocalProtocolError

__all__ = [
    "MAX_KNOWN_SECRETS",
    "MAX_LOG_CHARS",
    "META_KEY",
    "MIN_SECRET_LEN",
    "REDACTED",
    "AccessControl",
    "AgentContext",
    "DataProtection",
    "McpContext",
    "McpFunction",
    "McpService",
    "PolicyContext",
    "PolicyEntry",
    "RedactingFilter",
    "ResourceContext",
    "SecurityContext",
    "StatusUpdate",
    "TaskContext",
    "TodoItem",
    "context_of",
    "data_scope_labels",
    "forwarded_context",
    "install_log_redaction",
    "known_secrets",
    "parse_context",
    "prompt_context",
    "redact_context",
    "redact_event",
    "register_secrets",
    "scrub",
    "scrub_error",
    "secret_values",
    "with_context_scope",
]

#: Where the message travels in a frame's meta.
META_KEY = "agent_context"
#: How much of one log record the filter scrubs and keeps (characters).
MAX_LOG_CHARS = 64 * 1024

Id = Annotated[str, Meta(min_length=1)]
Scalar = str | int | float | bool


class _Closed(Struct, forbid_unknown_fields=True, rename="camel", omit_defaults=True):
    pass


class TodoItem(_Closed):
    item_id: Id
    description: str = ""


class StatusUpdate(_Closed):
    update_id: Id
    timestamp: str = ""
    message: str = ""


class TaskContext(_Closed):
    """Task progress shared with collaborating agents (draft §3, "Task Context")."""

    task_id: str | None = None
    task_name: str | None = None
    task_progress: str | None = None
    goals: list[str] = msgspec.field(default_factory=list)
    todo_items: list[TodoItem] = msgspec.field(default_factory=list)
    status_updates: list[StatusUpdate] = msgspec.field(default_factory=list)


class McpService(_Closed):
    service_name: Id
    version: str = ""


class McpFunction(_Closed):
    function_name: Id
    description: str = ""


class McpContext(_Closed):
    """The agent's MCP services and functions (draft §3, "MCP Context")."""

    mcp_service_list: list[McpService] = msgspec.field(default_factory=list)
    mcp_function_list: list[McpFunction] = msgspec.field(default_factory=list)


class PolicyEntry(_Closed):
    policy_id: Id
    rule: str = ""


class PolicyContext(_Closed):
    """Rules the deploying organisation sets (draft §3, "Policy Context")."""

    policies: list[PolicyEntry] = msgspec.field(default_factory=list)


class ResourceContext(_Closed):
    """Resources a task needs and the system offers (draft §3, "Resource Context").
    Entries are open maps of scalars with a required ``resourceType``."""

    required_resources: list[dict[str, Scalar]] = msgspec.field(default_factory=list)
    available_resources: list[dict[str, Scalar]] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        for name, entries in (("requiredResources", self.required_resources),
                              ("availableResources", self.available_resources)):  # fmt: skip
            for i, entry in enumerate(entries):
                kind = entry.get("resourceType")
                if not isinstance(kind, str) or not kind:
                    raise ValueError(f"{name}[{i}]: resourceType (a non-empty string) is required")


class AccessControl(_Closed):
    role: str | None = None
    permissions: list[str] = msgspec.field(default_factory=list)


class DataProtection(_Closed):
    encryption_enabled: bool | None = None
    encryption_algorithm: str | None = None


class SecurityContext(_Closed):
    """Access control, authentication and data protection (draft §3, "Security
    Context"). ``authentication_info`` holds credentials: every value is secret."""

    authentication_info: dict[str, Any] = msgspec.field(default_factory=dict)
    access_control: AccessControl | None = None
    data_protection: DataProtection | None = None


class AgentContext(_Closed):
    """The five sub-contexts of the Agent Context Message (draft §3, Figure 2)."""

    task_context: TaskContext | None = None
    mcp_context: McpContext | None = None
    policy_context: PolicyContext | None = None
    resource_context: ResourceContext | None = None
    security_context: SecurityContext | None = None


class _Message(_Closed):
    agent_context: AgentContext


# -- parsing ---------------------------------------------------------------------------


def parse_context(obj: Mapping[str, Any] | bytes | str) -> AgentContext:
    """The :class:`AgentContext` of an Agent Context Message ``{"agentContext": {...}}``
    (a decoded JSON object, or JSON bytes/text).

    Records the message's secrets for the log filters (:func:`register_secrets`),
    also when it is refused. Raises :class:`LocalProtocolError` ``EPROTO`` naming
    the JSON path of the fault (``$.agentContext.taskContext.todoItems[0].itemId``);
    the reason never contains a secret.
    """
    if isinstance(obj, (bytes, str)):
        try:
            obj = msgspec.json.decode(obj)
        except msgspec.DecodeError as e:
            raise LocalProtocolError(ErrorCode.EPROTO, f"{META_KEY}: not JSON: {e}") from None
    secrets = secret_values(obj)
    register_secrets(secrets)
    if not isinstance(obj, Mapping):
        raise LocalProtocolError(ErrorCode.EPROTO, f"{META_KEY}: expected an object, got {type(obj).__name__}")
    try:
        return msgspec.convert(obj, _Message).agent_context
    except msgspec.ValidationError as e:
        raise LocalProtocolError(ErrorCode.EPROTO, scrub(f"{META_KEY}: {e}", secrets=secrets)) from None


def context_of(meta: Mapping[str, Any]) -> tuple[Any, AgentContext | None]:
    """``(message, parsed)`` of the Agent Context Message in a frame meta, or
    ``(None, None)`` when the meta carries none. ``message`` is the object exactly
    as received (what adapters forward). Raises like :func:`parse_context`."""
    raw = meta.get(META_KEY)
    if raw is None:
        return None, None
    return raw, parse_context(raw)


def forwarded_context(task: TaskMeta) -> tuple[Any, frozenset[str]]:
    """For adapters: ``(message as received, its secrets)`` of a task's Agent
    Context Message (``task.agent_context``: :attr:`Prompt.task
    <atp_router.adapters.base.Prompt.task>`), validated; ``(None, frozenset())``
    without one. Raises ``AgentError`` ``EPROTO`` (secret-free reason) when it is
    invalid."""
    raw = task.agent_context
    if raw is None:
        return None, frozenset()
    try:
        parse_context(raw)
    except LocalProtocolError as e:
        raise AgentError(ErrorCode.EPROTO, e.reason) from None
    return raw, secret_values(raw)


# -- secrets ---------------------------------------------------------------------------


def _security(obj: Any) -> Any:
    if isinstance(obj, AgentContext):
        return obj.security_context
    if isinstance(obj, Mapping):
        inner = obj.get("agentContext", obj)
        if isinstance(inner, Mapping):
            return inner.get("securityContext")
    return None


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, str):
        yield value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield str(value)


def _secret_parts(sec: Mapping[str, Any]) -> Iterable[Any]:
    """Every part of a raw securityContext that may hold a secret: all of it but
    the public members of :data:`~atp_router.security.redact.CONTEXT_PUBLIC` (an unknown
    member counts as secret)."""
    for key, value in sec.items():
        public = CONTEXT_PUBLIC.get(key)
        if public is None or not isinstance(value, Mapping):
            yield value
        else:
            yield from (v for k, v in value.items() if k not in public)


def secret_values(obj: Any) -> frozenset[str]:
    """The secret strings of a context message (raw mapping, possibly invalid) or
    an :class:`AgentContext`: every scalar under ``securityContext`` except the
    role, permissions and data-protection flags, at least :data:`MIN_SECRET_LEN`
    characters long."""
    sec = _security(obj)
    if sec is None:
        return frozenset()
    if isinstance(sec, SecurityContext):
        parts: Iterable[Any] = [sec.authentication_info]
    elif isinstance(sec, Mapping):
        parts = _secret_parts(sec)
    else:
        parts = [sec]
    return frozenset(s for s in _leaves(list(parts)) if len(s) >= MIN_SECRET_LEN)


def redact_context(obj: Any) -> Any:
    """A copy of a context message (raw mapping or :class:`AgentContext`, which is
    first turned into its message) with every secret of ``securityContext``
    replaced by :data:`REDACTED`, keys kept
    (:func:`atp_router.security.redact.redact_context_message`); fit for logs, traces
    and errors. Anything that is not a mapping is returned unchanged."""
    if isinstance(obj, AgentContext):
        obj = {"agentContext": msgspec.to_builtins(obj, order=None)}
    if not isinstance(obj, Mapping):
        return obj
    return redact_context_message(obj)


# -- logs ------------------------------------------------------------------------------


def _scrub_log(text: str) -> str:
    """:func:`~atp_router.security.redact.scrub` with the log bound (:data:`MAX_LOG_CHARS`)."""
    return scrub(text, max_chars=MAX_LOG_CHARS)


def _clean(value: Any) -> Any:
    """A log value with secrets masked: context messages are redacted
    structurally, strings scrubbed, containers walked."""
    if isinstance(value, str):
        return _scrub_log(value)
    if isinstance(value, AgentContext):
        return redact_context(value)
    if isinstance(value, Mapping):
        if "agentContext" in value or "securityContext" in value:
            value = redact_context(value)
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clean(v) for v in value)
    if isinstance(value, BaseException):
        text = str(value)
        cleaned = _scrub_log(text)
        return value if cleaned == text else f"{type(value).__name__}: {cleaned}"
    return value


_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class RedactingFilter(logging.Filter):
    """A ``logging.Filter`` that masks Agent Context secrets in every record it
    sees: the formatted message (so ``%``-args are covered), ``extra`` attributes,
    and the exception text, which it pre-renders scrubbed into ``exc_text`` (what
    formatters print; ``exc_info`` is dropped when the exception held a secret).
    Attach it to handlers (a filter on a logger does not see records propagated
    from child loggers); :func:`install_log_redaction` does. Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            try:
                message = _render(record)
            except (TypeError, ValueError, KeyError):
                # A bad format string: keep what the handler would have reported, cleaned.
                message = f"{record.msg!r} % {_clean(record.args)!r}"
            record.msg, record.args = _scrub_log(message), None
        else:
            record.msg = _clean(record.msg)
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD:
                setattr(record, key, _clean(value))
        if record.exc_info and record.exc_info[1] is not None:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text = _scrub_log(text)
            if record.exc_text != text:
                # The exception object itself still holds the secret: formatters
                # print exc_text, so the record keeps only that.
                record.exc_info = None
        if record.stack_info:
            record.stack_info = _scrub_log(record.stack_info)
        return True


def _render(record: logging.LogRecord) -> str:
    """The record's message with context messages in its args redacted first."""
    args = record.args
    if isinstance(args, Mapping):
        return str(record.msg) % {k: _clean(v) for k, v in args.items()}
    if isinstance(args, tuple):
        return str(record.msg) % tuple(_clean(a) for a in args)
    return str(record.msg) % _clean(args)


def redact_event(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog-style processor (``(logger, method_name, event_dict) ->
    event_dict``) masking Agent Context secrets in every value; usable in any
    structlog chain without importing structlog."""
    return {k: _clean(v) for k, v in event_dict.items()}


def install_log_redaction(*handlers: logging.Handler) -> RedactingFilter:
    """Attach one :class:`RedactingFilter` to ``handlers`` (default: every handler
    of the root logger) and return it; idempotent per handler."""
    targets = handlers or tuple(logging.getLogger().handlers)
    filt = RedactingFilter()
    for h in targets:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(filt)
    return filt


# -- prompts and data scope ------------------------------------------------------------


def prompt_context(raw: Mapping[str, Any]) -> str:
    """The context message as model-prompt text: compact JSON of the message as
    received without its ``securityContext`` (never shown to a model)."""
    message = dict(raw)
    inner = message.get("agentContext")
    if isinstance(inner, Mapping):
        message["agentContext"] = {k: v for k, v in inner.items() if k != "securityContext"}
    else:
        message.pop("securityContext", None)
    return msgspec.json.encode(message).decode()


def data_scope_labels(ctx: AgentContext) -> list[str]:
    """ATP data-scope labels (spec §11) from ``policyContext``: one
    ``acp.policy:<policyId>`` per policy, in order, without duplicates. A RIB
    policy selects on them with ``match: {data_scope: "acp.policy:P001"}``."""
    if ctx.policy_context is None:
        return []
    return list(dict.fromkeys(f"acp.policy:{p.policy_id}" for p in ctx.policy_context.policies))


def with_context_scope(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a task meta whose ``data_scope`` list also holds the
    :func:`data_scope_labels` of its ``agent_context`` (validated: raises like
    :func:`parse_context`). A meta without a context is copied unchanged."""
    out = dict(meta)
    _, ctx = context_of(meta)
    if ctx is None:
        return out
    scope = out.get("data_scope", [])
    scope = [scope] if isinstance(scope, str) else list(scope)
    out["data_scope"] = list(dict.fromkeys([*scope, *data_scope_labels(ctx)]))
    return out
