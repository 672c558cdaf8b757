"""Agent API protocol next-hop: ``POST {url}/process`` answered by Server-Sent Events
(``shared/specs/agent-api-protocol.txt``; peer: agentscope-runtime, spec §14).

Request (the protocol's ``AgentRequest``)::

    {"input": [
       {"role": "system", "type": "message",                    only with an Agent Context:
        "content": [{"type": "data", "data": <prompt.task.agent_context as received>}]},
       {"role": "user", "type": "message",
        "content": [{"type": "text", "text": <review instructions + numbered diff>},
                    {"type": "data", "data": {"atp": {"task_type", "content", "instruction"}}}]}],
     "stream": true, "session_id": "atp-<uuid4>", "model"?: …, "max_tokens"?: …}

The Agent Context Message travels in the one slot the protocol text gives a client
for structured side data: a DataContent (``data: Dict``) of a ``system``-role
message, unchanged, ahead of the user turn. The task itself rides twice: as text
for a language-model agent and as a DataContent for an agent that reads structure.

Answer: a sequence of ``data:`` events (:class:`AgentApiDecoder` checks it):

* ``sequence_number`` starts at 0 and strictly increases (when the server numbers
  its events at all; numbering some events and not others is a fault);
* statuses only move forward (``created`` → ``in_progress`` → terminal) per
  response and message, and no content follows its completion; exactly one
  terminal *response* event (``completed``, ``failed``, ``rejected``,
  ``canceled``) ends the stream, with one response id throughout;
* text deltas are joined per (``msg_id``, ``index``) and streamed as PARTIAL
  fragments; a completed content (or the message's completed ``content``) must
  equal the joined deltas;
* the answer is the text of the assistant's ``message``-type messages (not
  reasoning, tool or heartbeat messages), parsed into an ``AgentReport`` like a
  model's (or a DataContent ``{"findings": [...]}`` when the agent sends one).

Errors (``AgentError``), in-band ones arriving with HTTP 200::

    status failed + error.code     by code: TIMEOUT/MODEL_TIMEOUT → ETIMEOUT;
                                   INVALID_PARAMETER/MISSING_PARAMETER/PARAMETER_VALIDATION/
                                   MODEL_CONTEXT_LENGTH_EXCEEDED → EPROTO; auth/permission
                                   codes → ESEC; anything else (AGENT_UNKNOWN_ERROR, …) → EAGENTDOWN
    status rejected                ESEC;  status canceled: EAGENTDOWN
    single {"error": "..."}         EPROTO before any event (request refused), EAGENTDOWN after
    sequence/transition/terminal   EPROTO (also a stream ending without a terminal response)
    HTTP errors, transport         per atp_router.adapters.http (429/502/503/504 retried with backoff)

Cost: usage is the terminal response's ``usage`` (``input_tokens``/``output_tokens``,
or ``prompt_tokens``/``completion_tokens``), estimated from characters (chars/4)
until or unless the agent reports it. With ``cost_in``/``cost_out`` (USD per 1M
tokens) configured a call costs its usage at those prices, like a model's;
otherwise it costs the flat ``cost_usd_per_call``, owed from the moment the call
is made (a stream cut short is charged it too).
Reasons never carry the Agent Context's secrets.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from atp_router.adapters.base import (
    Fragment,
    Prompt,
    ProviderAdapter,
    change_of,
    estimate_tokens,
    usd_micros,
    usd_micros_ceil,
)
from atp_router.adapters.context import forwarded_context
from atp_router.adapters.http import (
    HTTPNextHop,
    RetryPolicy,
    env_secret,
    open_stream,
    sse_data,
    transport_error,
)
from atp_router.adapters.openai_compat import SYSTEM_PROMPT, parse_review, render_diff
from atp_router.consensus.types import AgentReport
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = [
    "DEFAULT_RETRY",
    "ERROR_CODES",
    "AgentApiAdapter",
    "AgentApiDecoder",
    "Answer",
    "TextDelta",
    "from_spec",
]

#: POST /process is not idempotent: retry only answers that say the run did not start.
DEFAULT_RETRY = RetryPolicy(statuses=frozenset({429, 502, 503, 504}))

#: In-band ``error.code`` → ATP error (anything else: EAGENTDOWN).
ERROR_CODES: dict[str, ErrorCode] = {
    "TIMEOUT": ErrorCode.ETIMEOUT,
    "MODEL_TIMEOUT": ErrorCode.ETIMEOUT,
    "INVALID_PARAMETER": ErrorCode.EPROTO,
    "MISSING_PARAMETER": ErrorCode.EPROTO,
    "PARAMETER_VALIDATION": ErrorCode.EPROTO,
    "MODEL_CONTEXT_LENGTH_EXCEEDED": ErrorCode.EPROTO,
    "AUTH_FAILED": ErrorCode.ESEC,
    "TOKEN_EXPIRED": ErrorCode.ESEC,
    "INVALID_TOKEN": ErrorCode.ESEC,
    "PERMISSION_DENIED": ErrorCode.ESEC,
    "ACCESS_DENIED": ErrorCode.ESEC,
    "MODEL_UNAUTHORIZED_ACCESS": ErrorCode.ESEC,
}

_TERMINAL = frozenset({"completed", "failed", "rejected", "canceled"})
#: Forward order of the run statuses ("unknown" is a no-op, never a step back).
_RANK = {"created": 0, "in_progress": 1, "completed": 2, "failed": 2, "rejected": 2, "canceled": 2}
_NOT_ANSWER = frozenset({
    "reasoning", "heartbeat", "error", "function_call", "function_call_output", "plugin_call",
    "plugin_call_output", "component_call", "component_call_output", "mcp_list_tools",
    "mcp_approval_request", "mcp_call", "mcp_approval_response",
})  # fmt: skip
_MAX_DETAIL = 300


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New answer text of content slot (``msg_id``, ``index``)."""

    msg_id: str
    index: int
    text: str


@dataclass(slots=True)
class Answer:
    """What a completed run produced: the answer text (answer messages in order of
    first appearance, slots in index order), DataContent objects, and the reported
    usage ``(in_tokens, out_tokens)`` if any."""

    text: str
    data: list[dict[str, Any]] = field(default_factory=list)
    usage: tuple[int, int] | None = None


class AgentApiDecoder:
    """Sans-IO checker of one ``/process`` answer (see the module docstring).

    Feed each event's decoded JSON to :meth:`receive`; it returns the
    :class:`TextDelta` s to stream and raises ``AgentError`` on an in-band error
    or a protocol fault. :meth:`finish` (after the last event) returns the
    :class:`Answer`, or raises EPROTO when no terminal response arrived.
    """

    def __init__(self) -> None:
        self.events = 0
        self._sequenced: bool | None = None
        self._last_seq = -1
        self._response_id: str | None = None
        self._response_status: str | None = None
        self._terminal: dict[str, Any] | None = None
        self._msg_status: dict[str, str] = {}
        self._msg_type: dict[str, str] = {}
        self._order: list[str] = []  # msg ids by first appearance
        self._slots: dict[tuple[str, int], list[str]] = {}
        self._done_slots: set[tuple[str, int]] = set()
        self._data: list[dict[str, Any]] = []

    # -- events ----------------------------------------------------------------

    def receive(self, event: Any) -> list[TextDelta]:
        """Check and apply one event; returns the text to stream."""
        if not isinstance(event, dict):
            raise AgentError(ErrorCode.EPROTO, f"event is not a JSON object: {str(event)[:120]!r}")
        if self._terminal is not None:
            raise AgentError(ErrorCode.EPROTO, "event after the terminal response event")
        if "object" not in event and "error" in event:
            # The server's refusal of the whole request, or a fault outside the run.
            code = ErrorCode.EPROTO if self.events == 0 else ErrorCode.EAGENTDOWN
            raise AgentError(code, f"agent error: {_text(event['error'])}")
        self._check_sequence(event)
        self.events += 1
        match event.get("object"):
            case "response":
                self._on_response(event)
                return []
            case "message":
                return self._on_message(event)
            case "content":
                return self._on_content(event)
            case _:
                return []  # heartbeats and future object kinds carry no answer

    def _check_sequence(self, event: dict[str, Any]) -> None:
        seq = event.get("sequence_number")
        numbered = seq is not None
        if self._sequenced is None:
            self._sequenced = numbered
        elif self._sequenced != numbered:
            raise AgentError(ErrorCode.EPROTO, f"event {self.events} {'has' if numbered else 'lacks'} a "
                             "sequence_number unlike the events before it")  # fmt: skip
        if not numbered:
            return
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise AgentError(ErrorCode.EPROTO, f"sequence_number is not an integer: {seq!r:.40}")
        if self._last_seq < 0 and seq != 0:
            raise AgentError(ErrorCode.EPROTO, f"sequence_number starts at {seq}, not 0")
        if seq <= self._last_seq:
            raise AgentError(ErrorCode.EPROTO, f"sequence_number {seq} after {self._last_seq}: not increasing")
        self._last_seq = seq

    @staticmethod
    def _step(what: str, old: str | None, new: Any) -> str | None:
        """The status after ``old`` → ``new`` (``None`` keeps ``old``), or EPROTO."""
        if new is None or new == "unknown":
            return old
        if new not in _RANK:
            raise AgentError(ErrorCode.EPROTO, f"{what}: unknown status {str(new)[:40]!r}")
        if old is not None and (old in _TERMINAL or _RANK[new] < _RANK[old]):
            raise AgentError(ErrorCode.EPROTO, f"{what}: status {new} after {old}")
        return new

    def _on_response(self, event: dict[str, Any]) -> None:
        rid = event.get("id")
        if self._response_id is None:
            self._response_id = rid
        elif rid is not None and rid != self._response_id:
            raise AgentError(ErrorCode.EPROTO, f"a second response id {str(rid)[:60]!r} in one stream")
        status = self._step("response", self._response_status, event.get("status"))
        self._response_status = status
        if status not in _TERMINAL:
            return
        self._terminal = event
        err = event.get("error")
        if status == "failed":
            code, detail = _code_detail(err)
            raise AgentError(ERROR_CODES.get(code, ErrorCode.EAGENTDOWN), f"agent run failed: {code}: {detail}")
        if status == "rejected":
            code, detail = _code_detail(err)
            raise AgentError(ErrorCode.ESEC, f"agent rejected the request: {code}: {detail}")
        if status == "canceled":
            raise AgentError(ErrorCode.EAGENTDOWN, "agent canceled the run")
        for msg in event.get("output") or ():
            # The final output repeats the messages; it is the answer when none streamed.
            if isinstance(msg, dict) and msg.get("id") not in self._msg_status:
                self._absorb_message(msg, from_output=True)

    def _on_message(self, event: dict[str, Any]) -> list[TextDelta]:
        msg_id = event.get("id")
        if not isinstance(msg_id, str):
            raise AgentError(ErrorCode.EPROTO, "message event without a string id")
        if event.get("type") == "error" or (event.get("status") == "failed" and event.get("code")):
            raise AgentError(
                ERROR_CODES.get(str(event.get("code")), ErrorCode.EAGENTDOWN),
                f"agent message error: {_text(event.get('code'))}: {_text(event.get('message'))}",
            )
        return self._absorb_message(event, from_output=False)

    def _absorb_message(self, event: dict[str, Any], *, from_output: bool) -> list[TextDelta]:
        msg_id = event["id"]
        if msg_id not in self._msg_type or event.get("type") is not None:
            self._msg_type[msg_id] = str(event.get("type") or self._msg_type.get(msg_id, "message"))
        if event.get("role") not in (None, "assistant"):
            self._msg_type[msg_id] = "foreign"
        if msg_id not in self._order:
            self._order.append(msg_id)
        old = self._msg_status.get(msg_id)
        status = self._step(f"message {msg_id[:40]}", old, event.get("status"))
        if status is not None:
            self._msg_status[msg_id] = status
        out: list[TextDelta] = []
        if status == "completed":
            for i, part in enumerate(event.get("content") or ()):
                if isinstance(part, dict):
                    index = part.get("index") if isinstance(part.get("index"), int) else i
                    out += self._complete_slot(msg_id, index, part, stream=not from_output)
        return out

    def _on_content(self, event: dict[str, Any]) -> list[TextDelta]:
        msg_id = event.get("msg_id")
        if not isinstance(msg_id, str):
            raise AgentError(ErrorCode.EPROTO, "content event without a string msg_id")
        index = event.get("index")
        index = 0 if index is None else index
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise AgentError(ErrorCode.EPROTO, f"content index is not a non-negative integer: {index!r:.40}")
        if msg_id not in self._order:
            self._order.append(msg_id)
        if self._msg_status.get(msg_id) in _TERMINAL:
            raise AgentError(ErrorCode.EPROTO, f"content for message {msg_id[:40]} after it ended")
        slot = (msg_id, index)
        if slot in self._done_slots:
            raise AgentError(ErrorCode.EPROTO, f"content {msg_id[:40]}[{index}] after it completed")
        if event.get("delta") is True:
            if event.get("type") == "text" and isinstance(event.get("text"), str):
                self._slots.setdefault(slot, []).append(event["text"])
                if self._answers(msg_id) and event["text"]:
                    return [TextDelta(msg_id, index, event["text"])]
            return []
        if event.get("status") == "completed" or event.get("type") == "data":
            return self._complete_slot(msg_id, index, event, stream=True)
        return []

    def _complete_slot(self, msg_id: str, index: int, part: dict[str, Any], *, stream: bool) -> list[TextDelta]:
        slot = (msg_id, index)
        if part.get("type") == "data":
            if isinstance(part.get("data"), dict) and slot not in self._done_slots:
                self._data.append(part["data"])
            self._done_slots.add(slot)
            return []
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            self._done_slots.add(slot)
            return []
        text = part["text"]
        joined = "".join(self._slots.get(slot, ()))
        if slot in self._done_slots:
            if joined != text:
                raise AgentError(ErrorCode.EPROTO, f"message {msg_id[:40]} completes content [{index}] with "
                                 "other text than its content event")  # fmt: skip
            return []
        self._done_slots.add(slot)
        if slot in self._slots:
            if joined != text:
                raise AgentError(ErrorCode.EPROTO, f"content {msg_id[:40]}[{index}]: completed text differs "
                                 f"from its joined deltas ({len(text)} vs {len(joined)} chars)")  # fmt: skip
            return []
        self._slots[slot] = [text]
        return [TextDelta(msg_id, index, text)] if stream and self._answers(msg_id) and text else []

    def _answers(self, msg_id: str) -> bool:
        return self._msg_type.get(msg_id, "message") not in _NOT_ANSWER | {"foreign"}

    # -- end -------------------------------------------------------------------

    def finish(self) -> Answer:
        """The answer of a completed run; EPROTO if the stream ended before its
        terminal response event."""
        if self._terminal is None:
            raise AgentError(ErrorCode.EPROTO, f"stream ended after {self.events} events without a terminal response")
        texts = []
        for msg_id in self._order:
            if self._answers(msg_id):
                for index in sorted(i for m, i in self._slots if m == msg_id):
                    texts.append("".join(self._slots[(msg_id, index)]))
        return Answer(text="\n".join(t for t in texts if t), data=self._data, usage=_usage(self._terminal))


def _text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("message", value)
    return str(value)[:_MAX_DETAIL]


def _code_detail(err: Any) -> tuple[str, str]:
    if isinstance(err, dict):
        return str(err.get("code") or "UNKNOWN"), str(err.get("message") or "")[:_MAX_DETAIL]
    return "UNKNOWN", _text(err) if err is not None else ""


def _usage(event: Mapping[str, Any]) -> tuple[int, int] | None:
    candidates = [event.get("usage")]
    candidates += [m.get("usage") for m in event.get("output") or () if isinstance(m, dict)]
    for u in candidates:
        if not isinstance(u, dict):
            continue
        for k_in, k_out in (("input_tokens", "output_tokens"), ("prompt_tokens", "completion_tokens")):
            a, b = u.get(k_in), u.get(k_out)
            if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (a, b)):
                return a, b
    return None


class AgentApiAdapter(HTTPNextHop):
    """A remote agent behind the Agent API protocol (see the module docstring).

    ``url`` is the server's base URL and ``endpoint`` the path below it
    (``/process``). ``auth_env`` names the env var whose value is sent as
    ``Authorization: Bearer`` (read per call; unset → EAGENTDOWN).
    ``cost_usd_per_call`` is the flat USD price of a call, used when neither
    ``cost_in`` nor ``cost_out`` (USD per 1M tokens of usage) is set; ``max_out_tokens``
    (tokens) bounds the preflight estimate and is sent as ``max_tokens``;
    ``model`` is sent as ``model`` when set; ``ctx_tokens`` is the advertised
    context size; ``timeout_ms`` bounds each network wait.
    """

    def __init__(
        self,
        name: str,
        *,
        url: str,
        endpoint: str = "/process",
        auth_env: str | None = None,
        cost_usd_per_call: float = 0.0,
        cost_in: float = 0.0,
        cost_out: float = 0.0,
        max_out_tokens: int = 1024,
        ctx_tokens: int = 32768,
        model: str | None = None,
        timeout_ms: int = 60_000,
        strengths: Iterable[str] = (),
        retry: RetryPolicy = DEFAULT_RETRY,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if min(cost_usd_per_call, cost_in, cost_out) < 0:
            raise ValueError("costs must be >= 0")
        if max_out_tokens <= 0 or ctx_tokens <= 0 or timeout_ms <= 0:
            raise ValueError("max_out_tokens, ctx_tokens and timeout_ms must be > 0")
        self.name = name
        self.url = url.rstrip("/")
        self.endpoint = "/" + endpoint.lstrip("/")
        self.auth_env = auth_env
        self.cost_usd_per_call = cost_usd_per_call
        self.cost_in = cost_in
        self.cost_out = cost_out
        self.max_out_tokens = max_out_tokens
        self.ctx_tokens = ctx_tokens
        self.model = model
        self.strengths = list(strengths)
        self.retry = retry
        self._flat_micros = usd_micros_ceil(cost_usd_per_call)
        self._init_http(timeout_ms=timeout_ms, transport=transport, base_url=self.url)

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=list(self.strengths), max_ctx=self.ctx_tokens)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight (spec §5.2): input tokens = request characters / 4, output =
        :meth:`out_tokens`; USD = the token price of that when ``cost_in``/
        ``cost_out`` are set, else the flat per-call price."""
        in_tokens = estimate_tokens(len(json.dumps(self.request(prompt), ensure_ascii=False)))
        out = self.out_tokens(prompt)
        micros = self._price(in_tokens, out)
        return CostEstimate(in_tokens=in_tokens, out_tokens=out, usd=micros / 1_000_000)

    def out_tokens(self, prompt: Prompt) -> int:
        """The request's ``max_tokens``: ``max_out_tokens``, or the task's own
        ``max_out_tokens`` when lower (:class:`~atp_router.task.meta.TaskMeta`)."""
        cap = prompt.task.max_out_tokens
        return self.max_out_tokens if cap is None else min(cap, self.max_out_tokens)

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """PARTIAL fragments (joined text deltas of the answer, with the usage so
        far) then one FINAL ``AgentReport`` priced per the module docstring.
        Raises ``AgentError`` per the module docstring's table."""
        t0 = trio.current_time()
        secrets: frozenset[str] = frozenset()
        try:
            _, secrets = forwarded_context(prompt.task)
            body = self.request(prompt)
            est_in = estimate_tokens(len(json.dumps(body, ensure_ascii=False)))
            decoder = AgentApiDecoder()
            chars = 0
            async with (
                open_stream(self._http(), "POST", self.endpoint, retry=self.retry, json=body,
                            headers=self._auth()) as response,
                contextlib.aclosing(self._events(response)) as events,
            ):  # fmt: skip
                async for event in events:
                    for delta in decoder.receive(event):
                        chars += len(delta.text)
                        yield Fragment(type=PayloadType.PARTIAL, content=delta.text, usage=self._usage(est_in, chars))
            answer = decoder.finish()
        except AgentError as e:
            raise self._fail(e, t0, secrets) from None
        except httpx.HTTPError as e:
            raise self._fail(transport_error(e, self.url, self.timeout_ms), t0, secrets) from None
        self._succeeded(t0)
        findings, summary = parse_review(answer.text, prompt.content, change=prompt.change)
        for data in answer.data:
            if not findings and isinstance(data.get("findings"), list):
                findings, summary = parse_review(json.dumps(data), prompt.content, change=prompt.change)
        yield Fragment(
            type=PayloadType.FINAL,
            content=AgentReport(findings=findings, summary=summary),
            usage=self._usage(est_in, len(answer.text), answer.usage),
        )

    # -- request ---------------------------------------------------------------------

    def request(self, prompt: Prompt) -> dict[str, Any]:
        """The ``AgentRequest`` body for ``prompt`` (shape in the module docstring;
        the ``session_id`` is fresh per call)."""
        change = change_of(prompt)
        if change is not None:
            text = (
                SYSTEM_PROMPT + "\n\n" + (prompt.instruction + "\n\n" if prompt.instruction else "")
                + "Review this diff:\n\n" + render_diff(change.files)
            )  # fmt: skip
        else:
            text = (prompt.instruction or prompt.task_type) + "\n\n" + json.dumps(prompt.content, ensure_ascii=False)
        task: dict[str, Any] = {"task_type": prompt.task_type, "content": prompt.content}
        if prompt.instruction:
            task["instruction"] = prompt.instruction
        messages: list[dict[str, Any]] = []
        context = prompt.task.agent_context
        if context is not None:
            messages.append({"role": "system", "type": "message", "content": [{"type": "data", "data": context}]})
        messages.append({
            "role": "user", "type": "message",
            "content": [{"type": "text", "text": text}, {"type": "data", "data": {"atp": task}}],
        })  # fmt: skip
        body: dict[str, Any] = {"input": messages, "stream": True, "session_id": f"atp-{uuid.uuid4().hex}"}
        if self.model is not None:
            body["model"] = self.model
        body["max_tokens"] = self.out_tokens(prompt)
        return body

    # -- HTTP ----------------------------------------------------------------------

    def _auth(self) -> dict[str, str]:
        if self.auth_env is None:
            return {}
        return {"Authorization": f"Bearer {env_secret(self.auth_env)}"}

    @staticmethod
    async def _events(response: httpx.Response) -> AsyncIterator[Any]:
        """Decoded events of the answer: SSE ``data:`` lines, or one JSON body."""
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/json":
            body = await response.aread()
            try:
                yield json.loads(body)
            except ValueError:
                raise AgentError(ErrorCode.EPROTO, f"bad JSON answer: {body[:120]!r}") from None
            return
        async with contextlib.aclosing(sse_data(response)) as events:
            async for data in events:
                if not data.strip():
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    raise AgentError(ErrorCode.EPROTO, f"bad JSON in SSE data: {data[:120]!r}") from None
                yield event

    # -- accounting ----------------------------------------------------------------

    def _price(self, in_tokens: int, out_tokens: int) -> int:
        if self.cost_in or self.cost_out:
            return usd_micros(in_tokens, out_tokens, self.cost_in, self.cost_out)
        return self._flat_micros


_OPTIONS: dict[str, tuple[type, ...]] = {
    "endpoint": (str,),
    "model": (str,),
    "cost_in": (int, float),
    "cost_out": (int, float),
    "max_out_tokens": (int,),
    "ctx_tokens": (int,),
    "retries": (int,),
}


def from_spec(agent_name: str, agent: AgentSpec) -> ProviderAdapter:
    """The :class:`AgentApiAdapter` for RIB agent ``agent_name`` with
    ``remote.protocol: agent_api``. ``remote.url`` is the base URL (http/https),
    ``remote.auth_env`` the bearer-token variable, ``remote.cost_usd_per_call`` the
    flat price; ``remote.options`` may set ``endpoint``, ``model``, ``cost_in``,
    ``cost_out`` (USD per 1M tokens), ``max_out_tokens``, ``ctx_tokens``, ``retries``
    (429/502/503/504 answers retried with backoff, default 2).
    Raises ``ValueError("<field>: <reason>")`` for anything else: a wrong
    protocol, a non-http URL, ``agent_id``/``version`` (the Agent API addresses an
    agent by URL and has one version), an unknown or mistyped option. Options may
    also be given as ``agents.<x>.options`` (``remote.options`` wins), as for A2A."""
    remote = agent.remote
    if remote is None or remote.protocol != "agent_api":
        raise ValueError("remote.protocol: the Agent API adapter serves remote.protocol agent_api")
    if not remote.url.startswith(("http://", "https://")):
        raise ValueError(f"remote.url: expected an http(s) URL, got {remote.url!r}")
    for key in ("agent_id", "version"):
        if getattr(remote, key) is not None:
            raise ValueError(f"remote.{key}: not used by the Agent API (one agent per URL, one protocol version)")
    opts: dict[str, Any] = {}
    for key, value in {**agent.options, **remote.options}.items():
        types = _OPTIONS.get(key)
        if types is None:
            raise ValueError(f"remote.options.{key}: unknown option for agent_api (known: {', '.join(sorted(_OPTIONS))})")
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            # The registry reports every RIB fault as a ValueError.
            raise ValueError(f"remote.options.{key}: expected {names}, got {value!r:.80}")  # noqa: TRY004
        opts[key] = value
    retries = opts.pop("retries", DEFAULT_RETRY.retries)
    if retries < 0:
        raise ValueError("remote.options.retries: must be >= 0")
    try:
        return AgentApiAdapter(
            agent_name,
            url=remote.url,
            auth_env=remote.auth_env,
            cost_usd_per_call=remote.cost_usd_per_call,
            timeout_ms=agent.timeout_ms,
            strengths=agent.strengths,
            retry=RetryPolicy(retries=retries, statuses=DEFAULT_RETRY.statuses),
            **opts,
        )
    except ValueError as e:
        raise ValueError(f"remote.options: {e}") from None
