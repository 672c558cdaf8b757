"""The 2389 Agent Protocol on the wire, sans-IO (``specs/agent-protocol-2389-mqtt.txt``).

Topics (§5), the task envelope (§6.1), agent status (§6.2), error and response
messages (§6.3; the success shape is the reference implementation's), RFC 3339
timestamps, the pipeline depth (§7.4 step 5), the idempotency cache (§7.5) and
:func:`screen_task`, steps 2-6 of the processing algorithm (§7.4) as a pure
function: bytes in, a decision out. Used by both sides: the agent runtime
(:mod:`atp_router.agent2389.runtime`) and the router's adapter (:mod:`atp_router.adapters.mqtt2389`).
No I/O and no clock here: times come in as ``now`` (seconds since the epoch).

Decoding follows §6.2 FR-008: consumers ignore unknown fields, so the envelope and
status Structs do not forbid them (unlike the project's own config Structs).

Pipeline depth (§2, FR-013): "the count of nested next objects in a task envelope"
— 0 for an envelope without ``next``, 16 for a chain of 17 agents. A depth above the
maximum (default 16, §7.4 step 5) is refused with ``pipeline_depth_exceeded``: 16
nested ``next`` objects pass, 17 are refused.

Success replies (:func:`decode_reply`): the spec defines none. The reference sends
``{"response": "...", "task_id": ...}``; a spec-only agent may as well answer with
``result``, ``output``, ``content``, ``text`` or ``answer``, with a findings object
``{"findings": [...]}`` or with a bare JSON list: all are accepted.
"""

from __future__ import annotations

import datetime as _dt
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import Struct

__all__ = [
    "AGENT_ID_RE",
    "ERROR_CODES",
    "MAX_DEPTH",
    "MAX_MESSAGE_BYTES",
    "RESULT_KEYS",
    "Accept",
    "AgentStatus",
    "ErrorReply",
    "IdempotencyCache",
    "Ignore",
    "NextTask",
    "Reject",
    "Reply",
    "TaskEnvelope",
    "agent_of_input_topic",
    "canonicalize",
    "check_agent_id",
    "conversation_topic",
    "decode_reply",
    "decode_status",
    "encode_error",
    "encode_response",
    "encode_status",
    "encode_task",
    "input_topic",
    "pipeline_depth",
    "rfc3339",
    "sanitize",
    "screen_task",
    "status_topic",
]

#: §5.1 RULE-001.
AGENT_ID_RE = re.compile(r"^[a-zA-Z0-9._-]+$")
#: §7.4 step 5: the default maximum pipeline depth (nested ``next`` objects).
MAX_DEPTH = 16
#: §6.4 NFR-003.
MAX_MESSAGE_BYTES = 256 * 1024
#: §6.3.
ERROR_CODES = ("tool_execution_failed", "llm_error", "invalid_input", "pipeline_depth_exceeded", "internal_error")
ErrorCode2389 = Literal["tool_execution_failed", "llm_error", "invalid_input", "pipeline_depth_exceeded",
                        "internal_error"]

_SLASHES = re.compile(r"/{2,}")
# A conversation id becomes a topic level: no separators, wildcards or NUL.
_TOPIC_LEVEL_BAD = re.compile(r"[/+#\x00]")


# ---------------------------------------------------------------------- topics (§5)
def canonicalize(topic: str) -> str:
    """§5.2: one leading slash, no trailing slash, runs of slashes collapsed.
    ``//control//agents/foo/`` → ``/control/agents/foo``; ``""`` → ``/``."""
    t = "/" + _SLASHES.sub("/", topic).strip("/")
    return t


def check_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` if it matches ``[a-zA-Z0-9._-]+`` (RULE-001); raise ValueError."""
    if not isinstance(agent_id, str) or not AGENT_ID_RE.match(agent_id):
        raise ValueError(f"agent id {agent_id!r:.80} must match [a-zA-Z0-9._-]+")
    return agent_id


def input_topic(agent_id: str) -> str:
    return f"/control/agents/{check_agent_id(agent_id)}/input"


def status_topic(agent_id: str) -> str:
    return f"/control/agents/{check_agent_id(agent_id)}/status"


def conversation_topic(conversation_id: str, agent_id: str) -> str:
    """``/conversations/{conversation_id}/{agent_id}``; ValueError if the conversation
    id cannot be one topic level (empty, or contains ``/``, ``+``, ``#``, NUL)."""
    if not conversation_id or _TOPIC_LEVEL_BAD.search(conversation_id):
        raise ValueError(f"conversation id {conversation_id!r:.80} cannot be a topic level")
    return f"/conversations/{conversation_id}/{check_agent_id(agent_id)}"


def agent_of_input_topic(topic: str) -> str | None:
    """The agent id of a (canonicalized) ``/control/agents/{id}/input`` topic, else None."""
    parts = canonicalize(topic).split("/")
    if len(parts) == 5 and parts[1:3] == ["control", "agents"] and parts[4] == "input" and AGENT_ID_RE.match(parts[3]):
        return parts[3]
    return None


def agent_of_status_topic(topic: str) -> str | None:
    """The agent id of a ``/control/agents/{id}/status`` topic, else None."""
    parts = canonicalize(topic).split("/")
    if len(parts) == 5 and parts[1:3] == ["control", "agents"] and parts[4] == "status" and AGENT_ID_RE.match(parts[3]):
        return parts[3]
    return None


# ---------------------------------------------------------------------- time
def rfc3339(now: float) -> str:
    """``now`` (seconds since the epoch) as RFC 3339 UTC with a ``Z`` suffix and
    milliseconds (RULE-003): ``2025-08-26T12:00:00.123Z``."""
    t = _dt.datetime.fromtimestamp(now, tz=_dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


# ---------------------------------------------------------------------- messages (§6)
class NextTask(Struct, kw_only=True):
    """The ``next`` continuation of a task envelope (§6.1)."""

    topic: str
    instruction: str | None = None
    input: Any = None
    next: NextTask | None = None


class TaskEnvelope(Struct, kw_only=True):
    """A task envelope (§6.1). ``version``/``context``/``routing_trace`` are the
    reference's v2 fields (absent in v1 envelopes). ``traceparent`` /
    ``tracestate`` carry the sender's W3C trace context (ATP spec §12; an
    extension: consumers ignore unknown fields, FR-008), absent when unset."""

    task_id: str
    conversation_id: str
    topic: str
    instruction: str | None = None
    input: Any = None
    next: NextTask | None = None
    version: str | None = None
    context: Any = None
    routing_trace: list[Any] | None = None
    traceparent: str | None = None
    tracestate: str | None = None


def _next_builtins(n: NextTask | None) -> dict[str, Any] | None:
    if n is None:
        return None
    return {"topic": n.topic, "instruction": n.instruction, "input": n.input, "next": _next_builtins(n.next)}


def encode_task(env: TaskEnvelope) -> bytes:
    """The envelope as JSON: the six §6.1 fields always present (``null`` where
    unset), the v2 fields only when ``version`` is set, ``traceparent`` and
    ``tracestate`` only when set."""
    out: dict[str, Any] = {
        "task_id": env.task_id,
        "conversation_id": env.conversation_id,
        "topic": env.topic,
        "instruction": env.instruction,
        "input": env.input,
        "next": _next_builtins(env.next),
    }
    if env.version is not None:
        out["version"] = env.version
        out["context"] = env.context
        out["routing_trace"] = env.routing_trace
    if env.traceparent is not None:
        out["traceparent"] = env.traceparent
        if env.tracestate is not None:
            out["tracestate"] = env.tracestate
    return msgspec.json.encode(out)


class AgentStatus(Struct, kw_only=True):
    """Agent status (§6.2). ``capabilities``/``description`` are optional extras
    (OPT-001) the reference sends; other unknown fields are ignored (FR-008)."""

    agent_id: str
    status: Literal["available", "unavailable"]
    timestamp: str
    capabilities: list[str] | None = None
    description: str | None = None


def encode_status(agent_id: str, status: Literal["available", "unavailable"], now: float, *,
                  capabilities: list[str] | None = None, description: str | None = None) -> bytes:
    out: dict[str, Any] = {"agent_id": check_agent_id(agent_id), "status": status, "timestamp": rfc3339(now)}
    if capabilities:
        out["capabilities"] = list(capabilities)
    if description:
        out["description"] = description
    return msgspec.json.encode(out)


def decode_status(payload: bytes) -> AgentStatus:
    """Raises msgspec.DecodeError / ValidationError on anything but a §6.2 status."""
    return msgspec.json.decode(payload, type=AgentStatus)


def encode_error(task_id: str, code: ErrorCode2389, message: str) -> bytes:
    """The §6.3 error message; ``message`` is passed through :func:`sanitize`."""
    if code not in ERROR_CODES:
        raise ValueError(f"not a 2389 error code: {code!r}")
    return msgspec.json.encode({"error": {"code": code, "message": sanitize(message)}, "task_id": task_id})


def encode_response(task_id: str, response: str) -> bytes:
    """The reference's success message: ``{"response": "...", "task_id": "..."}``."""
    return msgspec.json.encode({"response": response, "task_id": task_id})


@dataclass(frozen=True, slots=True)
class Reply:
    """A success message on a conversation topic."""

    task_id: str | None
    response: str


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error message (§6.3) on a conversation topic."""

    task_id: str | None
    code: str
    message: str


#: Keys a success message may carry its answer in, in order of preference.
RESULT_KEYS = ("response", "result", "output", "content", "text", "answer")
_EXPECTED = ('expected {"response": ...} (or result, output, content, text, answer), {"findings": [...]}, '
             'a JSON list, or a §6.3 {"error": {"code", "message"}}')


def decode_reply(payload: bytes) -> Reply | ErrorReply:
    """A message from ``/conversations/{conversation_id}/{agent_id}``: the §6.3
    error shape (also ``{"error": "text"}``, as ``internal_error``) or a success
    message — the value of the first of :data:`RESULT_KEYS` present, a findings
    object ``{"findings": [...], ...}`` (the whole object) or a bare JSON list. An
    answer that is not a string is kept as its JSON text. Unknown fields are
    ignored. Raises ValueError naming what was expected for anything else."""
    try:
        data = msgspec.json.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON ({e}); {_EXPECTED}") from None
    if isinstance(data, list):
        return Reply(None, msgspec.json.encode(data).decode())
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}; {_EXPECTED}")  # noqa: TRY004 (callers catch ValueError)
    task_id = data.get("task_id") if isinstance(data.get("task_id"), str) else None
    err = data.get("error")
    if isinstance(err, dict):
        return ErrorReply(task_id, str(err.get("code") or "internal_error"), str(err.get("message") or ""))
    if isinstance(err, str) and err:
        return ErrorReply(task_id, "internal_error", err)
    for key in RESULT_KEYS:
        if key in data and data[key] is not None:
            value = data[key]
            return Reply(task_id, value if isinstance(value, str) else msgspec.json.encode(value).decode())
    if isinstance(data.get("findings"), list):
        return Reply(task_id, msgspec.json.encode(data).decode())
    keys = ", ".join(sorted(map(str, data))[:8]) or "none"
    raise ValueError(f"an object with keys [{keys}]; {_EXPECTED}")


# ---------------------------------------------------------------------- safety (§6.3)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.DOTALL)
_FRAME = re.compile(r'File "[^"]*", line \d+')
# Absolute POSIX paths (two components or more), home-relative and Windows paths.
_PATH = re.compile(r"(?<![\w.])(?:~|/)[\w.@%+-]*(?:/[\w.@%+-]+)+/?|\b[A-Za-z]:\\[^\s'\"]+")
_SECRETY = re.compile(r"(?i)\b(password|passwd|secret|token|api[_-]?key|authorization)\b(\s*[:=]\s*)\S+")
_MAX_ERROR_MESSAGE = 300


def sanitize(message: str) -> str:
    """An error message fit for the wire (RULE-002, NFR-005): tracebacks and frame
    lines cut, file paths replaced by ``<path>``, ``key=value`` secrets redacted,
    whitespace collapsed, at most 300 characters."""
    text = _TRACEBACK.sub("", message)
    text = _FRAME.sub("", text)
    text = _PATH.sub("<path>", text)
    text = _SECRETY.sub(r"\1\2<redacted>", text)
    text = " ".join(text.split())
    if len(text) > _MAX_ERROR_MESSAGE:
        text = text[: _MAX_ERROR_MESSAGE - 1] + "…"
    return text or "error"


# ---------------------------------------------------------------------- steps 2-6 (§7.4)
def pipeline_depth(envelope: Any, *, limit: int = 1000) -> int:
    """The number of nested ``next`` objects of a decoded envelope (a dict): §2's
    pipeline depth, 0 without ``next``; counting stops past ``limit``."""
    depth = 0
    cur = envelope.get("next") if isinstance(envelope, dict) else None
    while isinstance(cur, dict) and depth <= limit:
        depth += 1
        cur = cur.get("next")
    return depth


class IdempotencyCache:
    """Recently seen task ids (§7.5), least recently seen evicted past ``capacity``."""

    def __init__(self, capacity: int = 10_000):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()

    def seen(self, task_id: str) -> bool:
        """True if ``task_id`` was already recorded; records it either way."""
        if task_id in self._seen:
            self._seen.move_to_end(task_id)
            return True
        self._seen[task_id] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(frozen=True, slots=True)
class Ignore:
    """Discard without a reply (retained, topic mismatch, duplicate, or an error that
    cannot be routed because the envelope has no usable ``conversation_id``).
    ``step`` is the §7.4 step that decided."""

    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Publish the §6.3 error ``code``/``message`` to
    ``/conversations/{conversation_id}/{agent}`` and stop."""

    step: int
    conversation_id: str
    task_id: str
    code: ErrorCode2389
    message: str


@dataclass(frozen=True, slots=True)
class Accept:
    """Steps 2-6 passed: process ``envelope`` (step 7 onwards)."""

    envelope: TaskEnvelope


def _task_id_ok(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def screen_task(
    payload: bytes,
    *,
    received_topic: str,
    retained: bool,
    cache: IdempotencyCache,
    max_depth: int = MAX_DEPTH,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Ignore | Reject | Accept:
    """Steps 2-6 of §7.4 for one message received on an agent's input topic.

    2. retained → Ignore (FR-005);
    3. ``topic`` canonicalized must equal the received topic canonicalized, else
       Ignore (FR-006; an envelope that is not a JSON object with a string
       ``topic`` cannot match either);
    4. ``task_id`` (a UUID) already in ``cache`` → Ignore; else it is recorded;
       then a message larger than ``max_bytes`` → Reject ``invalid_input`` (NFR-003);
    5. depth (nested ``next`` objects) above ``max_depth`` → Reject
       ``pipeline_depth_exceeded`` (FR-013);
    6. the envelope must parse (types of §6.1; every ``next.topic`` an agent input
       topic, so an agent never publishes a task elsewhere) → else Reject
       ``invalid_input``.

    An error that has no valid ``conversation_id`` to go to is an Ignore (FR-011:
    log, no publication).
    """
    if retained:
        return Ignore(2, "retained message on an input topic")
    data = _json_or_none(payload)
    conv = data.get("conversation_id") if isinstance(data, dict) else None
    tid = data.get("task_id") if isinstance(data, dict) else None
    routable = isinstance(conv, str) and bool(conv) and not _TOPIC_LEVEL_BAD.search(conv)

    def reject(step: int, code: ErrorCode2389, message: str) -> Ignore | Reject:
        if not routable:
            return Ignore(step, f"{code}: {message} (no conversation_id to report to)")
        return Reject(step, conv, tid if isinstance(tid, str) else "", code, message)

    if not isinstance(data, dict) or not isinstance(data.get("topic"), str):
        return Ignore(3, "not a task envelope with a topic")
    if canonicalize(data["topic"]) != canonicalize(received_topic):
        return Ignore(3, f"topic mismatch: envelope {canonicalize(data['topic'])!r:.120}, "
                         f"received on {canonicalize(received_topic)!r:.120}")
    if not _task_id_ok(tid):
        return reject(4, "invalid_input", "task_id must be a UUID")
    if cache.seen(tid):
        return Ignore(4, f"duplicate task_id {tid}")
    if len(payload) > max_bytes:
        return reject(4, "invalid_input", f"message of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    depth = pipeline_depth(data, limit=max_depth + 1)
    if depth > max_depth:
        return reject(5, "pipeline_depth_exceeded",
                      f"pipeline depth (nested next objects) exceeds the maximum of {max_depth}")
    if not routable:
        return Ignore(6, "conversation_id missing or not usable as a topic level")
    env = _parse_envelope(data)
    if isinstance(env, str):
        return reject(6, "invalid_input", env)
    return Accept(env)


def _json_or_none(payload: bytes) -> Any:
    """``payload`` decoded as JSON, or ``None`` when it is not JSON."""
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None


def _parse_envelope(data: dict[str, Any]) -> TaskEnvelope | str:
    """Step 6 of :func:`screen_task`: the envelope parsed (types of §6.1, every
    ``next.topic`` an agent input topic), or why it does not parse."""
    try:
        env = msgspec.convert(data, TaskEnvelope)
    except msgspec.ValidationError as e:
        return f"task envelope: {e}"
    nxt = env.next
    while nxt is not None:
        if agent_of_input_topic(nxt.topic) is None:
            return "next.topic must name an agent's input topic"
        nxt = nxt.next
    return env
