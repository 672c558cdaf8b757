"""A2A next-hop: a remote agent over JSON-RPC 2.0 / HTTP (spec §14; JAF A2A v0.3.0, A2A 0.3 and 1.0).

One adapter speaks three dialects, chosen by ``remote.version``:

==========  ===============================================================================
``"0.3"``   official A2A v0.3 (a2a-sdk's compatibility mode, agentscope-runtime's ``/a2a``):
            ``message/send``, ``message/stream``, ``tasks/get``, ``tasks/cancel``; objects
            keyed on ``kind``; roles ``user``/``agent``; parts ``{"kind": "text", "text"}``;
            card at ``/.well-known/agent-card.json``. The default.
``"jaf"``   jaf-py (JAF A2A v0.3.0): the 0.3 wire, the card at ``/.well-known/agent-card``,
            jaf-py's error codes (below), and the spec's ``completion`` /
            ``partial-completion`` results besides the Task jaf-py actually returns.
``"1.0"``   official A2A 1.0: header ``A2A-Version: 1.0``; ``SendMessage``,
            ``SendStreamingMessage``, ``GetTask``, ``CancelTask``; results keyed by
            ``task`` / ``message`` / ``statusUpdate`` / ``artifactUpdate``; roles
            ``ROLE_USER``; parts ``{"text"}`` / ``{"data"}``; states ``TASK_STATE_*``.
==========  ===============================================================================

A call (:meth:`A2AAdapter.stream`):

1. discovers the agent card once (origin of ``remote.url`` + the dialect's well-known
   path) for its skills and ``capabilities.streaming``. The card's own URL is never
   used: requests always go to the configured ``remote.url`` (agentscope-runtime's
   card advertises an address it does not listen on);
2. sends the prompt as one user message: a text part (the instruction and, for a
   diff, the numbered diff as a model would see it) and a data part
   ``{"atp": {"task_type", "content"}}``; ``prompt.task.agent_context`` (an Agent
   Context Protocol message) travels unchanged as ``message.metadata.agent_context``;
3. streams with ``message/stream`` when the card says so (``options.stream``
   overrides): artifact text and JAF partial completions become PARTIAL fragments,
   status updates LOG fragments ``{"task_id", "state", "text"}``; otherwise
   ``message/send``, polling ``tasks/get`` while the returned Task is not terminal;
4. turns the result — a Task (artifacts, else its status message), a Message, or the
   JAF spec's ``completion`` — into an :class:`AgentReport`: JSON findings in text or
   data parts become findings (cited lines checked against the diff); plain text is
   zero findings and the summary;
5. charges ``usage`` when the agent reports it in any metadata it sends
   (``input_tokens``/``output_tokens``, ``prompt_tokens``/``completion_tokens`` or
   ``in_tokens``/``out_tokens``, optional ``usd``), else ``cost_usd_per_call``.

When the call is cancelled (the ATP stream's RST, a deadline) while a remote task
runs, the adapter sends ``tasks/cancel`` for it (shielded, at most 2 s, best effort).

Errors (``AgentError``)::

    HTTP 404, 5xx, 429, connect failure      EAGENTDOWN (5xx/429/connect: retry_after_ms,
                                             from Retry-After or 1000 ms)
    HTTP 401/403                              ESEC
    read/write timeout, HTTP 408              ETIMEOUT
    -32700 -32600 -32601 -32602               EPROTO
    -32603 internal error                     EAGENTDOWN
    -32001 task not found                     EAGENTDOWN (jaf-py also sends it for an
                                              unknown agent, and for any task after the
                                              request that made it)
    -32000 agent not found (JAF spec)         EAGENTDOWN
    -32002..-32005, -32007..-32009            EPROTO (not cancelable, push / operation /
                                              content type / extended card / extension /
                                              version not supported)
    -32006 invalid agent response             EAGENTDOWN
    task failed / rejected / canceled         EAGENTDOWN;  input-required EPROTO;
                                              auth-required ESEC
    bad JSON, no result, stream cut early     EPROTO

jaf-py's ``-32001..-32006`` are the official A2A codes, not the table of the JAF
v0.3.0 document (where -32002 is "agent unavailable", -32004 "authentication
required" …); jaf-py never sends the document's meanings, so no dialect uses them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx_sse
import trio

from atp_router.adapters.base import (
    Fragment,
    Prompt,
    ProviderAdapter,
    change_of,
    estimate_tokens,
    usd_micros_ceil,
)
from atp_router.adapters.context import forwarded_context, scrub
from atp_router.adapters.http import HTTPNextHop, env_secret, retry_after_ms
from atp_router.adapters.openai_compat import SYSTEM_PROMPT, parse_review, render_diff
from atp_router.consensus.types import AgentFinding, AgentReport, Usage
from atp_router.observability import tracing
from atp_router.policy.rib import AgentSpec
from atp_router.task.change import ParsedChange
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = [
    "DIALECTS",
    "A2AAdapter",
    "AgentCardInfo",
    "TaskSnapshot",
    "decode_response",
    "from_spec",
    "map_rpc_error",
    "normalize_state",
    "parts_of",
    "report_of",
    "restore_ints",
]

log = logging.getLogger("atp_router.adapters.a2a")

#: ``remote.version`` values.
DIALECTS: tuple[str, ...] = ("0.3", "jaf", "1.0")
#: Backoff hint (ms) on EAGENTDOWN for 5xx / connect failures without Retry-After.
DEFAULT_BACKOFF_MS = 1000
#: Longest wait for the best-effort ``tasks/cancel`` of a cancelled call (seconds).
CANCEL_TIMEOUT_S = 2.0
_MAX_SUMMARY = 2000

_METHODS = {
    "0.3": {"send": "message/send", "stream": "message/stream", "get": "tasks/get", "cancel": "tasks/cancel"},
    "jaf": {"send": "message/send", "stream": "message/stream", "get": "tasks/get", "cancel": "tasks/cancel"},
    "1.0": {"send": "SendMessage", "stream": "SendStreamingMessage", "get": "GetTask", "cancel": "CancelTask"},
}
_CARD_PATHS = {
    "0.3": ("/.well-known/agent-card.json", "/.well-known/agent-card"),
    "jaf": ("/.well-known/agent-card", "/.well-known/agent-card.json"),
    "1.0": ("/.well-known/agent-card.json", "/.well-known/agent-card"),
}

_COMMON_CODES: dict[int, tuple[ErrorCode, str]] = {
    -32700: (ErrorCode.EPROTO, "parse error"),
    -32600: (ErrorCode.EPROTO, "invalid request"),
    -32601: (ErrorCode.EPROTO, "method not found"),
    -32602: (ErrorCode.EPROTO, "invalid params"),
    -32603: (ErrorCode.EAGENTDOWN, "internal error"),
}
_OFFICIAL_CODES: dict[int, tuple[ErrorCode, str]] = {
    -32001: (ErrorCode.EAGENTDOWN, "task not found"),
    -32002: (ErrorCode.EPROTO, "task not cancelable"),
    -32003: (ErrorCode.EPROTO, "push notifications not supported"),
    -32004: (ErrorCode.EPROTO, "unsupported operation"),
    -32005: (ErrorCode.EPROTO, "content type not supported"),
    -32006: (ErrorCode.EAGENTDOWN, "invalid agent response"),
    -32007: (ErrorCode.EPROTO, "authenticated extended card not configured"),
}
#: Error codes per dialect (JSON-RPC code → ATP code, name).
ERROR_CODES: dict[str, dict[int, tuple[ErrorCode, str]]] = {
    "0.3": {**_COMMON_CODES, **_OFFICIAL_CODES},
    "1.0": {
        **_COMMON_CODES,
        **_OFFICIAL_CODES,
        -32008: (ErrorCode.EPROTO, "extension support required"),
        -32009: (ErrorCode.EPROTO, "version not supported"),
    },
    "jaf": {
        **_COMMON_CODES,
        **_OFFICIAL_CODES,
        -32000: (ErrorCode.EAGENTDOWN, "agent not found"),
        -32001: (ErrorCode.EAGENTDOWN, "task or agent not found"),
        -32005: (ErrorCode.EPROTO, "content type not supported (or streaming in a batch)"),
    },
}

#: Task states, normalised to the v0.3 spelling.
TERMINAL_STATES = frozenset({"completed", "failed", "canceled", "rejected"})
#: States in which the agent waits for something a routed call cannot give.
INTERRUPTED_STATES = frozenset({"input-required", "auth-required"})
_STATE_ERRORS = {
    "failed": (ErrorCode.EAGENTDOWN, "remote task failed"),
    "rejected": (ErrorCode.EAGENTDOWN, "remote agent rejected the task"),
    "canceled": (ErrorCode.EAGENTDOWN, "remote task was canceled by the agent"),
    "input-required": (ErrorCode.EPROTO, "remote agent asks for more input, which a routed call cannot give"),
    "auth-required": (ErrorCode.ESEC, "remote agent requires authentication for this task"),
}


def map_rpc_error(error: Any, dialect: str, secrets: Iterable[str] = ()) -> AgentError:
    """The ATP error for a JSON-RPC ``error`` object of a ``dialect`` peer (table in
    the module docstring); unknown codes are EAGENTDOWN. ``secrets`` (and every
    known Agent Context secret) are masked in the peer's message before it is
    shortened, so no part of one survives. Never raises."""
    if not isinstance(error, Mapping):
        return AgentError(ErrorCode.EPROTO, f"malformed JSON-RPC error: {scrub(str(error), secrets=secrets)[:200]}")
    code = error.get("code")
    message = scrub(str(error.get("message") or ""), secrets=secrets)[:300]
    known = ERROR_CODES[dialect].get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if known is None:
        return AgentError(ErrorCode.EAGENTDOWN, f"JSON-RPC error {code}: {message}")
    atp_code, name = known
    return AgentError(atp_code, f"JSON-RPC error {code} ({name}): {message}")


def decode_response(body: bytes, dialect: str, *, request_id: str | None = None,
                    secrets: Iterable[str] = ()) -> Any:
    """The ``result`` of one JSON-RPC response ``body``. Raises AgentError: EPROTO
    for bad JSON, a batch, a mismatched ``id`` or neither ``result`` nor ``error``;
    the mapped code (:func:`map_rpc_error`, ``secrets`` masked) for an ``error``."""
    try:
        obj = json.loads(body)
    except ValueError:
        quoted = scrub(body.decode("utf-8", "replace"), secrets=secrets)[:120]
        raise AgentError(ErrorCode.EPROTO, f"response is not JSON: {quoted!r}") from None
    if not isinstance(obj, dict):
        raise AgentError(ErrorCode.EPROTO, f"response is not a JSON-RPC object ({type(obj).__name__})")
    if "error" in obj and obj["error"] is not None:
        raise map_rpc_error(obj["error"], dialect, secrets)
    if "result" not in obj:
        raise AgentError(ErrorCode.EPROTO, "JSON-RPC response without result or error")
    rid = obj.get("id")
    if request_id is not None and rid is not None and rid != request_id:
        raise AgentError(ErrorCode.EPROTO, f"JSON-RPC response id {rid!r} does not match request {request_id!r}")
    return obj["result"]


def normalize_state(state: Any) -> str:
    """``"TASK_STATE_INPUT_REQUIRED"`` → ``"input-required"``; ``"cancelled"`` (the JAF
    document's spelling) → ``"canceled"``; ``""`` when absent."""
    if not isinstance(state, str):
        return ""
    s = state.removeprefix("TASK_STATE_").lower().replace("_", "-")
    return "canceled" if s == "cancelled" else s


@dataclass(frozen=True, slots=True)
class AgentCardInfo:
    """What the adapter uses from an agent card: its ``name``, whether it streams
    (``None``: the card does not say), its skill ids and tags, and the URLs it
    advertises (recorded, never used: the configured URL is)."""

    name: str
    streaming: bool | None
    skills: tuple[str, ...]
    advertised_urls: tuple[str, ...]
    card_url: str

    @classmethod
    def parse(cls, card: Any, card_url: str) -> AgentCardInfo:
        """From a v0.3 card (``url``) or a 1.0 card (``supportedInterfaces``).
        Raises AgentError(EPROTO) when ``card`` is not a JSON object."""
        if not isinstance(card, dict):
            raise AgentError(ErrorCode.EPROTO, f"agent card at {card_url} is not a JSON object")
        caps = card.get("capabilities")
        streaming = caps.get("streaming") if isinstance(caps, dict) else None
        skills: list[str] = []
        for skill in card.get("skills") or []:
            if isinstance(skill, dict):
                for s in [skill.get("id"), *(skill.get("tags") or [])]:
                    if isinstance(s, str) and s not in skills:
                        skills.append(s)
        urls = [card["url"]] if isinstance(card.get("url"), str) else []
        for iface in card.get("supportedInterfaces") or card.get("additionalInterfaces") or []:
            if isinstance(iface, dict) and isinstance(iface.get("url"), str) and iface["url"] not in urls:
                urls.append(iface["url"])
        name = card.get("name")
        return cls(
            name=name if isinstance(name, str) else "",
            streaming=streaming if isinstance(streaming, bool) else None,
            skills=tuple(skills),
            advertised_urls=tuple(urls),
            card_url=card_url,
        )


@dataclass(frozen=True, slots=True)
class TaskSnapshot:
    """A remote task as ``tasks/get`` / ``tasks/cancel`` returned it: ``state``
    normalised (:func:`normalize_state`), the text of its artifacts and status
    message, and the raw result."""

    id: str
    state: str
    text: str
    raw: Any


def _part(p: Any) -> tuple[str, Any] | None:
    """``("text", str)`` or ``("data", value)`` for a part of either dialect."""
    if not isinstance(p, dict):
        return None
    if isinstance(p.get("text"), str) and p.get("kind", "text") == "text":
        return ("text", p["text"])
    if "data" in p and p.get("kind", "data") == "data":
        return ("data", p["data"])
    return None


def parts_of(parts: Any) -> list[tuple[str, Any]]:
    """The text and data parts of an A2A ``parts`` list of either dialect, as
    ``("text", str)`` / ``("data", value)``; file, raw and url parts are skipped."""
    return [x for x in (_part(p) for p in parts) if x is not None] if isinstance(parts, list) else []


def _text(parts: Iterable[tuple[str, Any]]) -> str:
    return "".join(v for k, v in parts if k == "text")


def restore_ints(value: Any) -> Any:
    """Integral floats back to ints: protobuf-based peers (a2a-sdk 1.x) carry every
    JSON number as a double, so a cited line 12 arrives as 12.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [restore_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: restore_ints(v) for k, v in value.items()}
    return value


@dataclass
class _Reply:
    """Everything one call received, whatever the dialect and result shape."""

    task_id: str | None = None
    state: str = ""
    done: bool = False
    #: artifactId → parts, in arrival order (``append`` extends, otherwise replaces).
    artifacts: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    #: Parts of a final Message or JAF completion (they carry the whole answer).
    answer: list[tuple[str, Any]] | None = None
    status_parts: list[tuple[str, Any]] = field(default_factory=list)
    history_parts: list[tuple[str, Any]] = field(default_factory=list)
    usage: Mapping[str, Any] | None = None

    def _metadata(self, obj: Any) -> None:
        if isinstance(obj, dict):
            meta = obj.get("metadata")
            if isinstance(meta, dict) and isinstance(meta.get("usage"), dict):
                self.usage = meta["usage"]

    def _status(self, status: Any) -> str:
        """Apply a status; returns the text of its message (progress or reason)."""
        if not isinstance(status, dict):
            return ""
        self.state = normalize_state(status.get("state")) or self.state
        msg = status.get("message")
        if isinstance(msg, dict):
            self._metadata(msg)
            self.status_parts = parts_of(msg.get("parts"))
            return _text(self.status_parts)
        return ""

    def _task(self, task: dict[str, Any]) -> None:
        self.task_id = task.get("id") if isinstance(task.get("id"), str) else self.task_id
        self._metadata(task)
        self._status(task.get("status"))
        arts = task.get("artifacts")
        if isinstance(arts, list):
            self.artifacts = {}
            for i, art in enumerate(arts):
                if isinstance(art, dict):
                    self._metadata(art)
                    self.artifacts[str(art.get("artifactId", i))] = parts_of(art.get("parts"))
        for msg in task.get("history") or []:
            if isinstance(msg, dict) and msg.get("role") in ("agent", "ROLE_AGENT"):
                self.history_parts = parts_of(msg.get("parts"))
        if self.state in TERMINAL_STATES or self.state in INTERRUPTED_STATES:
            self.done = True

    def apply(self, result: Any, kind: str) -> list[Fragment]:
        """Fold one result (``kind`` from :func:`_kind_of`) in; returns the
        PARTIAL/LOG fragments it produces (text deltas and status lines)."""
        out: list[Fragment] = []
        if not isinstance(result, dict):
            raise AgentError(ErrorCode.EPROTO, f"A2A result is not an object: {str(result)[:120]}")
        if isinstance(result.get("taskId"), str):
            self.task_id = result["taskId"]
        self._metadata(result)
        if kind == "task":
            self._task(result)
            out.append(self._log(""))
        elif kind == "message":
            self.answer = parts_of(result.get("parts"))
            self.state, self.done = "completed", True
        elif kind == "status-update":
            text = self._status(result.get("status"))
            out.append(self._log(text))
            if result.get("final") is True or self.state in TERMINAL_STATES or self.state in INTERRUPTED_STATES:
                self.done = True
        elif kind == "artifact-update":
            art = result.get("artifact")
            if not isinstance(art, dict):
                raise AgentError(ErrorCode.EPROTO, "artifact-update without an artifact")
            self._metadata(art)
            aid = str(art.get("artifactId", len(self.artifacts)))
            parts = parts_of(art.get("parts"))
            if result.get("append") is True and aid in self.artifacts:
                self.artifacts[aid] = self.artifacts[aid] + parts
            else:
                self.artifacts[aid] = parts
            delta = _text(parts)
            if delta:
                out.append(Fragment(type=PayloadType.PARTIAL, content=delta))
        elif kind == "partial-completion":
            msg = result.get("message")
            delta = _text(parts_of(msg.get("parts"))) if isinstance(msg, dict) else ""
            if delta:
                out.append(Fragment(type=PayloadType.PARTIAL, content=delta))
        elif kind == "completion":
            msg = result.get("message")
            if isinstance(msg, dict):
                self._metadata(msg)
                self.answer = parts_of(msg.get("parts"))
            if result.get("final", True) is not False:
                self.state, self.done = "completed", True
        else:
            raise AgentError(ErrorCode.EPROTO, f"unknown A2A result kind {kind!r}")
        return out

    def _log(self, text: str) -> Fragment:
        return Fragment(type=PayloadType.LOG, content={"task_id": self.task_id, "state": self.state, "text": text})

    def parts(self) -> list[tuple[str, Any]]:
        """The answer: a Message/completion, else the artifacts (identical texts
        once: jaf-py repeats its answer in a second artifact), else the status
        message, else the last agent message of the history."""
        if self.answer is not None:
            return self.answer
        if self.artifacts:
            seen: set[str] = set()
            out: list[tuple[str, Any]] = []
            for parts in self.artifacts.values():
                key = json.dumps(parts, sort_keys=True, default=str)
                if key not in seen:
                    seen.add(key)
                    out.extend(parts)
            return out
        return self.status_parts or self.history_parts


def _kind_of(result: Any, dialect: str) -> tuple[str, Any]:
    """``(kind, object)`` of a message/send or stream result: v0.3 keys on ``kind``,
    1.0 wraps the object in its kind's key."""
    if not isinstance(result, dict):
        raise AgentError(ErrorCode.EPROTO, f"A2A result is not an object: {str(result)[:120]}")
    if dialect == "1.0":
        for key, kind in (("task", "task"), ("message", "message"), ("statusUpdate", "status-update"),
                          ("artifactUpdate", "artifact-update")):
            if isinstance(result.get(key), dict):
                return kind, result[key]
        if "status" in result and "id" in result:
            return "task", result
        raise AgentError(ErrorCode.EPROTO, f"A2A 1.0 result with none of task/message/statusUpdate/artifactUpdate: {list(result)[:8]}")
    kind = result.get("kind")
    if isinstance(kind, str):
        return kind, result
    if "status" in result and "id" in result:
        return "task", result  # a Task from a peer that omits kind
    raise AgentError(ErrorCode.EPROTO, f"A2A result without kind: {list(result)[:8]}")


_SPAN = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")


def _merged_findings(value: Any) -> dict[str, Any] | None:
    """``{"findings": [...]}`` from an ATP FINAL payload (another router answering as
    an A2A agent: ``result.findings`` with ``span`` ``"start-end"``), else None."""
    result = value.get("result") if isinstance(value, dict) else None
    if not isinstance(result, dict) or not isinstance(result.get("findings"), list):
        return None
    out = []
    for f in result["findings"]:
        m = _SPAN.match(str(f.get("span", ""))) if isinstance(f, dict) else None
        if m is not None:
            out.append({**f, "line": int(m[1]), "end": int(m[2] or m[1])})
    return {"findings": out}


def report_of(parts: list[tuple[str, Any]], content: Mapping[str, Any], *,
              change: ParsedChange | None = None) -> AgentReport:
    """An :class:`AgentReport` from answer parts: findings from JSON in data parts
    and in the text (see :func:`~atp_router.adapters.openai_compat.parse_review`), the
    summary from the JSON's ``summary`` or else the plain text. When a data part
    is an ATP FINAL payload (an ATP router behind A2A), only its merged findings
    count, not the per-agent reports beside it. ``change``: ``content["diff"]``
    parsed, when the caller has it."""
    findings: list[AgentFinding] = []
    summaries: list[str] = []
    datas = [restore_ints(v) for k, v in parts if k == "data"]
    merged = [m for m in map(_merged_findings, datas) if m is not None]
    for value in merged or datas:
        found, summary = parse_review(json.dumps(value), content, change=change)
        findings.extend(f for f in found if f not in findings)
        if summary:
            summaries.append(summary)
    text = _text(parts)
    if text.strip() and merged:
        summaries.append(text.strip())  # the router's own rendering of its findings
    elif text.strip():
        found, summary = parse_review(text, content, change=change)
        findings.extend(f for f in found if f not in findings)
        if summary:
            summaries.append(summary)
    for i, f in enumerate(findings, 1):
        f.ref = str(i)
    return AgentReport(findings=findings, summary="\n".join(summaries)[:_MAX_SUMMARY])


def _usage_of(reported: Mapping[str, Any] | None, flat_micros: int) -> Usage:
    """Usage from a peer's ``usage`` metadata (numbers may arrive as floats), else
    the flat per-call price."""
    if reported is None:
        return Usage(usd_micros=flat_micros)

    def num(*keys: str) -> float | None:
        for k in keys:
            v = reported.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v):
                return v
        return None

    tin = num("input_tokens", "prompt_tokens", "in_tokens")
    tout = num("output_tokens", "completion_tokens", "out_tokens")
    usd = num("usd", "cost_usd")
    micros = usd_micros_ceil(usd) if usd is not None else flat_micros
    return Usage(int(tin or 0), int(tout or 0), micros)


class A2AAdapter(HTTPNextHop):
    """A remote A2A agent as a next-hop (see the module docstring).

    ``url`` is the JSON-RPC endpoint; ``dialect`` one of :data:`DIALECTS`;
    ``agent_id``, when given, must be the card's ``name`` (a guard against a URL
    that reaches another agent; for ``jaf`` it also selects
    ``/a2a/agents/<agent_id>/card``). ``auth_env`` names the env var holding the
    credential, read at every call and sent as ``Authorization: Bearer <value>``
    (``auth="bearer"``) or as header ``header`` (``auth="api_key"``, default
    ``X-API-Key``). ``cost_usd_per_call`` is charged when the agent reports no usage.
    ``stream`` forces ``message/stream`` (True) or ``message/send`` (False) instead
    of following the card. ``timeout_ms`` bounds each network wait; ``poll_ms`` is
    the ``tasks/get`` interval for a task still running after ``message/send``;
    ``max_out_tokens`` the output tokens assumed by :meth:`estimate`.
    """

    def __init__(
        self,
        name: str,
        *,
        url: str,
        dialect: str = "0.3",
        agent_id: str | None = None,
        auth_env: str | None = None,
        auth: str = "bearer",
        header: str | None = None,
        cost_usd_per_call: float = 0.0,
        stream: bool | None = None,
        card_path: str | None = None,
        timeout_ms: int = 60_000,
        poll_ms: int = 500,
        max_out_tokens: int = 1024,
        strengths: Iterable[str] = (),
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"remote.version: expected one of {', '.join(DIALECTS)}, got {dialect!r}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"remote.url: expected an http(s) URL, got {url!r}")
        if auth not in ("bearer", "api_key"):
            raise ValueError(f"options.auth: expected 'bearer' or 'api_key', got {auth!r}")
        if header is not None and auth != "api_key":
            raise ValueError("options.header: only meaningful with options.auth: api_key")
        if cost_usd_per_call < 0 or timeout_ms <= 0 or poll_ms <= 0 or max_out_tokens < 0:
            raise ValueError("cost_usd_per_call, timeout_ms, poll_ms and max_out_tokens must be positive")
        if card_path is not None and not card_path.startswith("/"):
            raise ValueError(f"options.card_path: expected an absolute path, got {card_path!r}")
        self.name = name
        self.url = url
        self.dialect = dialect
        self.agent_id = agent_id
        self.auth_env = auth_env
        self.auth = auth
        self.header = header or ("X-API-Key" if auth == "api_key" else "Authorization")
        self.flat_micros = usd_micros_ceil(cost_usd_per_call)
        self.force_stream = stream
        self.poll_ms = poll_ms
        self.max_out_tokens = max_out_tokens
        self.strengths = list(strengths)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        if card_path is not None:
            self.card_paths: tuple[str, ...] = (card_path,)
        elif dialect == "jaf" and agent_id:
            self.card_paths = (f"/a2a/agents/{agent_id}/card", *_CARD_PATHS[dialect])
        else:
            self.card_paths = _CARD_PATHS[dialect]
        self.methods = _METHODS[dialect]
        self.card: AgentCardInfo | None = None
        self._card_checked = False
        # No base URL: requests go to the configured URL and the card's origin.
        self._init_http(timeout_ms=timeout_ms, transport=transport)

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """RIB strengths plus the card's skill ids and tags once discovered."""
        skills = list(self.strengths)
        if self.card is not None:
            skills += [s for s in self.card.skills if s not in skills]
        return Capabilities(agent=self.name, skills=skills)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight (spec §5.2): input tokens = chars/4 of the message sent,
        output tokens = ``max_out_tokens``, USD = the flat per-call price."""
        chars = len(self.render(prompt)) + len(json.dumps(prompt.content, ensure_ascii=False))
        in_tokens = estimate_tokens(chars)
        return CostEstimate(in_tokens=in_tokens, out_tokens=self.max_out_tokens,
                            usd=self._price(in_tokens, self.max_out_tokens) / 1_000_000)

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """PARTIAL (text) and LOG (task status) fragments, then one FINAL
        :class:`AgentReport`; usage on every fragment is cumulative (the flat price
        from the first). Raises AgentError as tabled in the module docstring."""
        t0 = trio.current_time()
        reply = _Reply()
        secrets: frozenset[str] = frozenset()
        try:
            context, secrets = forwarded_context(prompt.task)
            card = await self.discover()
            streaming = self.force_stream if self.force_stream is not None else bool(card and card.streaming)
            params = self.message_params(prompt, context)
            if streaming:
                async with contextlib.aclosing(self._rpc_stream(self.methods["stream"], params, secrets)) as results:
                    async for result in results:
                        kind, obj = _kind_of(result, self.dialect)
                        for frag in reply.apply(obj, kind):
                            frag.usage = _usage_of(reply.usage, self.flat_micros)
                            yield frag
                        if reply.done:
                            break
                if not reply.done:
                    raise AgentError(ErrorCode.EPROTO, "stream ended before the remote task finished")
            else:
                result = await self._rpc(self.methods["send"], params, secrets)
                kind, obj = _kind_of(result, self.dialect)
                reply.apply(obj, kind)
                while not reply.done:
                    if reply.task_id is None:
                        raise AgentError(ErrorCode.EPROTO, f"non-final {kind} result without a task id")
                    await trio.sleep(self.poll_ms / 1000)
                    reply.apply(await self._rpc(self.methods["get"], {"id": reply.task_id}, secrets), "task")
            error = _STATE_ERRORS.get(reply.state)
            if error is not None:
                detail = scrub(_text(reply.status_parts), secrets=secrets).strip()[:300]
                raise AgentError(error[0], error[1] + (f": {detail}" if detail else ""))
        except AgentError as e:
            raise self._fail(e, t0, secrets) from None
        except httpx_sse.SSEError as e:
            raise self._fail(AgentError(ErrorCode.EPROTO, f"bad SSE stream: {e}"), t0, secrets) from None
        except httpx.HTTPError as e:
            raise self._fail(_http_error(e, self.url, self.timeout_ms), t0, secrets) from None
        finally:
            if reply.task_id is not None and (not reply.done or reply.state in INTERRUPTED_STATES):
                # Cancelled (RST, deadline), failed mid-task or left waiting for input
                # that will never come: stop the remote work too.
                with trio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
                    await self._cancel_quietly(reply.task_id)
        self._succeeded(t0)
        yield Fragment(
            type=PayloadType.FINAL,
            content=report_of(reply.parts(), prompt.content, change=prompt.change),
            usage=_usage_of(reply.usage, self.flat_micros),
        )

    # -- A2A operations ------------------------------------------------------------

    async def discover(self) -> AgentCardInfo | None:
        """The agent card (fetched once): tries the dialect's well-known paths on
        the origin of ``url``; ``None`` when the agent serves none (every path 404).
        Raises AgentError: EAGENTDOWN (unreachable, or ``agent_id`` differs from
        the card's name), ESEC (401/403), EPROTO (not JSON)."""
        if self._card_checked:
            return self.card
        for path in self.card_paths:
            card_url = self.origin + path
            try:
                response = await self._http().get(card_url, headers=self._headers())
            except httpx.HTTPError as e:
                raise _http_error(e, card_url, self.timeout_ms) from None
            if response.status_code == 404:
                continue
            _check_status(response, card_url)
            try:
                card = AgentCardInfo.parse(response.json(), card_url)
            except ValueError:
                raise AgentError(ErrorCode.EPROTO, f"agent card at {card_url} is not JSON") from None
            if self.agent_id and card.name != self.agent_id:
                raise AgentError(
                    ErrorCode.EAGENTDOWN, f"agent card at {card_url} names {card.name!r}, not {self.agent_id!r}"
                )
            self.card = card
            break
        self._card_checked = True
        return self.card

    async def get_task(self, task_id: str) -> TaskSnapshot:
        """``tasks/get`` (``GetTask``). Raises AgentError (jaf-py: always -32001 →
        EAGENTDOWN: it keeps no task past its request)."""
        return self._snapshot(task_id, await self._rpc(self.methods["get"], {"id": task_id}))

    async def cancel_task(self, task_id: str) -> TaskSnapshot:
        """``tasks/cancel`` (``CancelTask``); the JAF document's ``{"cancelled":
        true}`` answer counts as state ``canceled``. Raises AgentError (a finished
        task: -32002 → EPROTO)."""
        return self._snapshot(task_id, await self._rpc(self.methods["cancel"], {"id": task_id}))

    def _snapshot(self, task_id: str, result: Any) -> TaskSnapshot:
        if isinstance(result, dict) and result.get("cancelled") is True:
            return TaskSnapshot(id=task_id, state="canceled", text="", raw=result)
        reply = _Reply()
        kind, obj = _kind_of(result, self.dialect)
        reply.apply(obj, kind)
        return TaskSnapshot(id=reply.task_id or task_id, state=reply.state, text=_text(reply.parts()), raw=result)

    async def _cancel_quietly(self, task_id: str) -> None:
        try:
            snap = await self.cancel_task(task_id)
            log.info("%s: cancelled remote task %s (state %s)", self.name, task_id, snap.state)
        except (AgentError, httpx.HTTPError) as e:
            log.info("%s: tasks/cancel for remote task %s failed: %s", self.name, task_id, e)

    # -- request building ----------------------------------------------------------

    def render(self, prompt: Prompt) -> str:
        """The text part: the instruction (for a diff, by default the reviewer
        instruction asking for JSON findings) and the numbered diff, or the JSON
        content for other task types."""
        change = change_of(prompt)
        if change is not None:
            head = prompt.instruction or SYSTEM_PROMPT
            return f"{head}\n\nReview this diff:\n\n{render_diff(change.files)}"
        head = prompt.instruction or f"Task: {prompt.task_type}"
        return f"{head}\n\n{json.dumps(prompt.content, ensure_ascii=False, indent=1)}"

    def message_params(self, prompt: Prompt, context: Any = None) -> dict[str, Any]:
        """The ``params`` of message/send and message/stream (SendMessage in 1.0);
        ``context`` (the Agent Context Message as received, see
        :func:`~atp_router.adapters.context.forwarded_context`) goes in
        ``message.metadata.agent_context`` unchanged; with tracing on, the call's
        W3C trace context in ``message.metadata.traceparent`` (and ``tracestate``;
        spec §12, :func:`atp_router.observability.tracing.outbound`)."""
        data = {"atp": {"task_type": prompt.task_type, "content": prompt.content}}
        message: dict[str, Any] = {"messageId": uuid.uuid4().hex, "contextId": uuid.uuid4().hex}
        if self.dialect == "1.0":
            message.update(role="ROLE_USER", parts=[{"text": self.render(prompt)}, {"data": data}])
        else:
            message.update(
                role="user", kind="message",
                parts=[{"kind": "text", "text": self.render(prompt)}, {"kind": "data", "data": data}],
            )
        metadata: dict[str, Any] = tracing.outbound(self.name)
        if context is not None:
            metadata["agent_context"] = context
        if metadata:
            message["metadata"] = metadata
        params: dict[str, Any] = {"message": message}
        if self.dialect != "1.0":
            params["configuration"] = {"blocking": True}
        return params

    # -- HTTP ----------------------------------------------------------------------

    def _price(self, in_tokens: int, out_tokens: int) -> int:
        # The flat per-call price: usage the agent reports is priced by _usage_of.
        return self.flat_micros

    def _headers(self) -> dict[str, str]:
        headers = {"A2A-Version": "1.0"} if self.dialect == "1.0" else {}
        if self.auth_env is not None:
            secret = env_secret(self.auth_env)
            headers[self.header] = f"Bearer {secret}" if self.auth == "bearer" else secret
        return headers

    def _body(self, method: str, params: Any) -> tuple[str, dict[str, Any]]:
        rid = uuid.uuid4().hex
        return rid, {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}

    async def _rpc(self, method: str, params: Any, secrets: frozenset[str] = frozenset()) -> Any:
        rid, body = self._body(method, params)
        response = await self._http().post(self.url, json=body, headers=self._headers())
        _check_status(response, self.url, secrets)
        return decode_response(response.content, self.dialect, request_id=rid, secrets=secrets)

    async def _rpc_stream(self, method: str, params: Any, secrets: frozenset[str]) -> AsyncIterator[Any]:
        """Results of a streaming call, one per SSE event. A server that answers
        plain JSON (an error, or no streaming) yields its one result or raises."""
        rid, body = self._body(method, params)
        headers = {**self._headers(), "Accept": "text/event-stream"}
        async with httpx_sse.aconnect_sse(self._http(), "POST", self.url, json=body, headers=headers) as source:
            response = source.response
            if response.status_code >= 400:
                await response.aread()
            _check_status(response, self.url, secrets)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                yield decode_response(await response.aread(), self.dialect, request_id=rid, secrets=secrets)
                return
            async with contextlib.aclosing(source.aiter_sse()) as events:
                async for event in events:
                    if not event.data.strip():
                        continue
                    yield decode_response(event.data.encode(), self.dialect, request_id=rid, secrets=secrets)


def _check_status(response: httpx.Response, url: str, secrets: Iterable[str] = ()) -> None:
    """HTTP status → AgentError (JSON-RPC errors come with 200; a body that is a
    JSON-RPC error with a 4xx/5xx status is left to the status). The quoted body
    has ``secrets`` masked."""
    status = response.status_code
    if status < 400:
        return
    body = response.content.decode("utf-8", "replace") if response.is_stream_consumed else ""
    detail = scrub(body, secrets=secrets).strip()[:300]
    reason = f"HTTP {status} from {url}" + (f": {detail}" if detail else "")
    if status == 408:
        raise AgentError(ErrorCode.ETIMEOUT, reason)
    if status in (401, 403):
        raise AgentError(ErrorCode.ESEC, reason)
    if status == 404:
        raise AgentError(ErrorCode.EAGENTDOWN, reason)
    if status >= 500 or status == 429:
        hint = retry_after_ms(response.headers)
        raise AgentError(ErrorCode.EAGENTDOWN, reason, retry_after_ms=DEFAULT_BACKOFF_MS if hint is None else hint)
    raise AgentError(ErrorCode.EPROTO, reason)


def _http_error(e: httpx.HTTPError, url: str, timeout_ms: int) -> AgentError:
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {url}: {e!r}", retry_after_ms=DEFAULT_BACKOFF_MS)
    if isinstance(e, httpx.TimeoutException):
        return AgentError(ErrorCode.ETIMEOUT, f"{type(e).__name__} after {timeout_ms} ms waiting for {url}")
    return AgentError(ErrorCode.EAGENTDOWN, f"{type(e).__name__} talking to {url}: {e}",
                      retry_after_ms=DEFAULT_BACKOFF_MS)


def from_spec(agent_name: str, agent: AgentSpec) -> ProviderAdapter:
    """The registry's factory for ``agents.<x>.remote.protocol: a2a`` (spec §6.1, §14).

    Reads ``remote.url`` (the JSON-RPC endpoint), ``remote.version`` (``"0.3"``
    default, ``"jaf"``, ``"1.0"``), ``agent_id``, ``auth_env``,
    ``cost_usd_per_call`` and ``remote.options``: ``auth`` (``bearer`` |
    ``api_key``), ``header``, ``stream`` (bool), ``card_path``, ``poll_ms``,
    ``max_out_tokens``. ``timeout_ms`` and ``strengths`` come from the agent.
    Raises ValueError ``<field>: <reason>`` on anything else.
    """
    remote = agent.remote
    if remote is None or remote.protocol != "a2a":
        raise ValueError("remote: an a2a agent needs remote.protocol: a2a")
    opts = _options_of({**agent.options, **remote.options})
    return A2AAdapter(
        agent_name,
        url=remote.url,
        dialect=remote.version or "0.3",
        agent_id=remote.agent_id,
        auth_env=remote.auth_env,
        cost_usd_per_call=remote.cost_usd_per_call,
        timeout_ms=agent.timeout_ms,
        strengths=agent.strengths,
        **opts,
    )


#: ``options`` an a2a agent accepts (``agent.options`` and ``remote.options`` merged).
OPTIONS: dict[str, type] = {
    "auth": str, "header": str, "stream": bool, "card_path": str, "poll_ms": int, "max_out_tokens": int,
}


def _options_of(options: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in options.items():
        want = OPTIONS.get(key)
        if want is None:
            raise ValueError(f"options.{key}: unknown option for remote a2a (known: {', '.join(sorted(OPTIONS))})")
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise ValueError(f"options.{key}: expected {want.__name__}, got {value!r:.80}")
    return dict(options)
