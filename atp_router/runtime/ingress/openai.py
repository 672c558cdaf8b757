"""OpenAI-compatible ingress on the HTTP control API (issue 10 item 1).

=====================================  =========================================
``POST /v1/chat/completions``          a chat completion (``stream: false``: one
                                       :class:`ChatCompletion`; ``stream: true``:
                                       Server-Sent Events, one
                                       :class:`ChatCompletionChunk` per
                                       ``data:`` line, then ``data: [DONE]``)
``GET  /v1/models``                    :class:`ModelList`: the models the
                                       caller's tenant may use
=====================================  =========================================

Any OpenAI client works against it (``OpenAI(base_url="http://host:7070/v1",
api_key=<the tenant's ATP key>)``). Nothing here is a second data plane: a
completion is a stream opened with :meth:`Router.open_stream
<atp_router.runtime.router.Router.open_stream>` — the SYN ``POST /v1/streams`` synthesises —
so the policy's fan-out, escalation, consensus, budget, QoS and the tenant's
scopes, quotas, open rate and budget all apply, and the stream is audited and
stored like any other (its ``stream_id`` is in the answer's ``atp`` field:
``GET /v1/streams/{id}/events`` and ``POST /v1/streams/{id}/feedback`` work on it).

Authentication and authorization are the control API's own (``authorized`` in
:func:`atp_router.runtime.ingress.http_api.build_app`): the ``Authorization: Bearer <key>`` header,
action ``stream_open`` (role ``client``) for both endpoints.

**Models** (``model``; :func:`resolve_model`), in this order:

==========================  ================================================
``policy:<name>``           the RIB policy ``<name>``: the task meta is its
                            ``match``'s equality values (``task_type`` the
                            first the tenant may use); keys it compares
                            numerically (``diff_loc: ">400"``) come from the
                            task as usual. When another policy comes first in
                            the RIB for that meta, or the meta does not match
                            it, the request is refused (400 ``EPROTO``,
                            ``param: model``) — never silently routed elsewhere
``task:<type>``             task type ``<type>``: meta ``{task_type: <type>}``,
                            routed by the FIB (first matching policy)
``<type>``                  a task type some policy's ``match`` pins (as
                            ``task:<type>``)
``<name>``                  otherwise a policy name (as ``policy:<name>``)
anything else               404, ``code: EPROTO``, ``param: model``
==========================  ================================================

``GET /v1/models`` lists the pinned task types the tenant's ``task_types`` scope
allows (all without one) and ``policy:<name>`` for each policy with such a task
type (policies without a ``task_type`` in their match only for a tenant without
a scope); each entry's ``atp`` field says its ``kind`` and the policies / task
types behind it.

**Task content.** The messages become ``{"messages": [{"role", "content"}, …]}``
(``content`` a string; text parts are joined with ``\\n``; ``name`` kept). For
task type ``code_review``, when the last user message is a unified diff, the
content is ``{"diff": <that text>}`` instead, with ``files`` from ``atp.files``
(path → after-diff text) or, when the router runs with ``--repo``, read from the
checkout exactly as the A2A server does (:mod:`atp_router.runtime.ingress.a2a`). A task
whose routed next-hops need files they cannot get is refused (400 ``EPROTO``).

**Request** (:class:`ChatCompletionRequest`, strict: an unknown field is 400
naming it in ``param``): ``model``, ``messages`` (1..256; roles ``system``,
``developer``, ``user``, ``assistant``; content a string or text parts, at most
1,000,000 characters a message; the whole body at most ``max_body_bytes``, 413
above), ``stream``, ``stream_options.include_usage``, ``max_tokens`` /
``max_completion_tokens`` (tokens), ``n`` (1 only). ``temperature``, ``top_p``,
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``user``,
``metadata`` and ``store`` are validated and ignored: the policy's agents decide
how they sample. Tools, function calls, images and audio are refused (400).
``max_tokens`` (or ``max_completion_tokens``) caps the stream's **token budget**
— every next-hop's input *and* output tokens together, as ATP counts them, so
stricter than OpenAI's output-only meaning; the tighter of it and
``atp.budget.tokens`` applies, and the policy's budget and the tenant's
``max_stream_budget`` cap it further as for any stream. The extension ``atp``
(:class:`AtpOptions`): ``budget: {usd, tokens}`` (float USD, tokens), ``qos``
(``gold``/``silver``/``bronze``, at most the tenant's ``qos_max``),
``idempotency_key`` (a retried request with the same key gets the same stream,
never a second charge, spec §8) and ``files``.

**Answer** (:class:`ChatCompletion`): ``id`` ``chatcmpl-<stream_id>``,
``choices[0].message.content`` the FINAL rendered by :func:`completion_text`,
``finish_reason`` ``"length"`` when the budget cut the stream short (an ERROR
``EBUDGET`` came before the FINAL) else ``"stop"``; ``usage.total_tokens`` is
the FINAL's ``telemetry.tokens``, ``completion_tokens`` the output tokens the
next-hops' reports declare (at most the total), ``prompt_tokens`` the rest; the
extension ``atp`` (:class:`AtpCompletion`) has the cost in float USD, the
stream and session ids, the policy, the findings, consensus, prose answers and
the signed usage summary (``GET /v1/keys`` verifies it).

**Streaming**: a first chunk with ``delta.role = "assistant"``; the text deltas
of the first next-hop that streams prose (PARTIAL ``{agent, delta}``), live;
at the FINAL the rest of :func:`completion_text` — when the live text is a
prefix of it (one next-hop answering) the concatenated deltas equal the
non-streaming content, otherwise a blank line and the whole content follow the
live text; then a chunk with ``finish_reason`` and ``atp``; with
``stream_options.include_usage`` a chunk with ``choices: []`` and ``usage``; then
``data: [DONE]``. A stream that ends without a FINAL sends ``data: {"error":
{…}}`` (OpenAI clients raise it) and ``data: [DONE]``. A request whose client
goes away resets its stream (RST ``EPREEMPT``: its calls stop, what they used is
committed), unless it carries ``atp.idempotency_key`` (then the stream is
detached and stays resumable by a retry for the router's grace period).

**Errors** are OpenAI-shaped, ``{"error": {"message", "type", "code", "param"}}``,
``code`` the ATP code (spec §10): 400 ``EPROTO`` (malformed or unsupported
request, ``param`` the field), 401 ``ESEC`` (missing or unknown key,
``authentication_error``), 403 ``ESEC`` (a role, task type or data category
outside the tenant's scope, ``permission_error``), 404 ``EPROTO`` (unknown model),
402 ``EBUDGET`` (nothing could be run within the budget, ``insufficient_quota``),
409 ``EWINDOW`` (the router's stream table is full), 413 ``EPROTO`` (body over
``max_body_bytes``), 429 ``EWINDOW`` with ``Retry-After`` (s; the tenant's stream
quota or open rate), 503 ``EAGENTDOWN`` (no route, no healthy next-hop) or
``EPREEMPT``, 504 ``ETIMEOUT``, 502 ``ECONSENSUS``. An error that comes after the
task ran (the stream's RST or ``EBUDGET``) carries ``x-should-retry: false``: an
OpenAI client's automatic retry would run — and charge — the task again.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from atp_router.consensus.types import (
    Answer,
    ConsensusInfo,
    FinalResult,
    Finding,
    Result,
    SignedUsage,
)
from atp_router.policy.match import CompiledMatch, compile_match
from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.runtime.ingress.a2a import (
    _complete_from_repo,  # the A2A server's --repo reader
)
from atp_router.runtime.ingress.bodies import BodyRefused, decode_off_loop, release_body
from atp_router.runtime.router import Router, StreamCtx
from atp_router.security.identity import Identity
from atp_router.task.body import MAX_FILES, MAX_MESSAGES, Chat, ChatMessage
from atp_router.task.diff import count_changed_lines, parse_diff
from atp_router.task.meta import IDEMPOTENCY_KEY_CHARS
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, ErrorPayload, Frame, QoS

__all__ = [
    "CHAT_PATH",
    "MODELS_PATH",
    "AtpCompletion",
    "AtpOptions",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ModelList",
    "OpenAIErrorResponse",
    "completion_text",
    "openai_routes",
    "resolve_model",
]

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"


POLICY_PREFIX = "policy:"
TASK_PREFIX = "task:"
#: The task type whose unified diff in the last user message becomes ``{"diff"}``.
CODE_REVIEW = "code_review"

# ------------------------------------------------------------------ request Structs


class StreamOptions(Struct, forbid_unknown_fields=True):
    """``include_usage``: end the SSE stream with a chunk carrying ``usage``."""

    include_usage: bool = False


class AtpOptions(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The ``atp`` extension of a request: the stream's ``budget`` (float USD,
    tokens; capped by the policy and the tenant as for any stream), its ``qos``
    class, an ``idempotency_key`` (1..128 characters; the same key re-opens the
    same stream, spec §8) and, for a ``code_review`` diff, ``files`` (path →
    after-diff text, at most 2,000)."""

    budget: Budget | None = None
    qos: QoS | None = None
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=IDEMPOTENCY_KEY_CHARS)] | None = None
    files: Annotated[dict[str, str], Meta(max_length=MAX_FILES)] | None = None


class ChatCompletionRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Body of ``POST /v1/chat/completions`` (OpenAI's, strictly validated; see
    the module doc for the model mapping and which fields only are validated).
    ``max_tokens`` / ``max_completion_tokens`` cap the stream's token budget
    (input and output tokens of every next-hop)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    stop: Annotated[str, Meta(max_length=256)] | Annotated[
        list[Annotated[str, Meta(max_length=256)]], Meta(max_length=4)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    metadata: Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None
    store: bool | None = None
    atp: AtpOptions | None = None


# ------------------------------------------------------------------ response Structs


class CompletionUsage(Struct):
    """Tokens of the stream: ``total_tokens`` is the FINAL's ``telemetry.tokens``;
    ``completion_tokens`` the next-hops' reported output tokens; ``prompt_tokens``
    the rest."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Struct):
    role: Literal["assistant"]
    content: str


class Choice(Struct):
    index: int
    message: AssistantMessage
    #: ``"length"``: the budget cut the stream short (ERROR EBUDGET before the FINAL).
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class AtpCompletion(Struct, omit_defaults=True):
    """The ATP side of a completion: ``usd`` the stream's cost (float USD,
    the FINAL's ``telemetry.usd``), ``tokens`` and ``latency_ms`` (SYN → FINAL)
    likewise, the ids of the stream (``POST /v1/streams/{id}/feedback`` scores
    it), the ``policy`` that routed it, the FINAL's ``findings``, ``consensus``
    and prose ``answers``, and ``usage``, the router's signed usage summary."""

    stream_id: str
    session_id: str
    policy: str
    usd: float
    tokens: int
    latency_ms: float
    findings: list[Finding]
    consensus: ConsensusInfo
    answers: list[Answer] = []
    usage: SignedUsage | None = None


class ChatCompletion(Struct):
    """A non-streaming answer (OpenAI ``chat.completion``) with the ``atp``
    extension; ``created`` in unix s; ``model`` echoes the request's."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    atp: AtpCompletion


class ChunkDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, omit_defaults=True):
    """One ``data:`` event of a streaming answer (OpenAI
    ``chat.completion.chunk``); the finishing chunk carries ``atp``, the usage
    chunk (``choices: []``, with ``stream_options.include_usage``) ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    atp: AtpCompletion | None = None


class ModelAtp(Struct):
    """What a model id stands for: ``kind`` ``task_type`` (``policies``: those
    whose match pins it, in RIB order; the first matching one routes a task) or
    ``policy`` (``task_types``: the ones it pins that the tenant may use)."""

    kind: Literal["task_type", "policy"]
    policies: list[str]
    task_types: list[str]


class ModelCard(Struct):
    id: str
    object: Literal["model"]
    #: Unix s when the ingress first saw the running RIB generation.
    created: int
    owned_by: str
    atp: ModelAtp


class ModelList(Struct):
    """Body of ``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class OpenAIError(Struct):
    """OpenAI's error object: ``code`` is the ATP code (spec §10, e.g. ``EPROTO``,
    ``ESEC``, ``EBUDGET``); ``param`` the request field at fault, if any."""

    message: str
    type: str
    code: str | None
    param: str | None


class OpenAIErrorResponse(Struct):
    error: OpenAIError


# ------------------------------------------------------------------ errors

_STATUS = {
    ErrorCode.EPROTO: 400, ErrorCode.ESEQ_RETRY: 400, ErrorCode.ESEC: 403, ErrorCode.EWINDOW: 409,
    ErrorCode.EBUDGET: 402, ErrorCode.EAGENTDOWN: 503, ErrorCode.EPREEMPT: 503, ErrorCode.ETIMEOUT: 504,
    ErrorCode.ECONSENSUS: 502,
}
_TYPE = {
    ErrorCode.EPROTO: "invalid_request_error", ErrorCode.ESEQ_RETRY: "invalid_request_error",
    ErrorCode.ESEC: "permission_error", ErrorCode.EWINDOW: "rate_limit_error",
    ErrorCode.EBUDGET: "insufficient_quota", ErrorCode.EAGENTDOWN: "service_unavailable_error",
    ErrorCode.EPREEMPT: "service_unavailable_error", ErrorCode.ETIMEOUT: "timeout_error",
    ErrorCode.ECONSENSUS: "api_error",
}

_enc = msgspec.json.Encoder()


class IngressError(ATPError):
    """A refusal of this ingress: the ATP ``code``, the HTTP ``status`` and the
    request field at fault (``param``)."""

    def __init__(self, code: ErrorCode, reason: str, *, status: int | None = None, param: str | None = None):
        super().__init__(code, reason)
        self.status = status
        self.param = param


def error_body(e: ATPError, status: int) -> OpenAIErrorResponse:
    kind = "authentication_error" if status == 401 else _TYPE.get(e.code, "api_error")
    if status == 409:
        kind = "conflict_error"
    return OpenAIErrorResponse(OpenAIError(message=e.reason, type=kind, code=str(e.code),
                                           param=getattr(e, "param", None)))


def error_response(e: ATPError, status: int | None = None, *, after_run: bool = False) -> Response:
    """``e`` as an OpenAI error response. The status is ``status``, else the
    error's own (:class:`IngressError`), else by code (EWINDOW with a retry hint
    is 429 with ``Retry-After`` in s). ``after_run``: the task ran, so a retry
    would charge it again (``x-should-retry: false``)."""
    headers: dict[str, str] = {}
    if status is None:
        status = getattr(e, "status", None)
    if status is None:
        if e.code is ErrorCode.EWINDOW and e.retry_after_ms is not None:
            status = 429
        else:
            status = _STATUS.get(e.code, 400)
    if status == 429 and e.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-e.retry_after_ms // 1000)))
    if after_run:
        headers["x-should-retry"] = "false"
    return Response(_enc.encode(error_body(e, status)), status_code=status, media_type="application/json",
                    headers=headers)


_AT = re.compile(r" - at `\$\.?(.*)`$")
_FIELD = re.compile(r"(?:unknown|required) field `([^`]+)`")


def _param_of(message: str) -> str | None:
    """The request field a msgspec validation message names (``messages[0].role``)."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    f = _FIELD.search(message)
    if f is not None:
        return f"{path}.{f.group(1)}" if path else f.group(1)
    return path or None


def decode_request(body: bytes) -> ChatCompletionRequest:
    """The request, strictly validated. Raises :class:`IngressError` (EPROTO,
    400, ``param`` the field at fault)."""
    try:
        return msgspec.json.decode(body, type=ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise IngressError(ErrorCode.EPROTO, f"invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise IngressError(ErrorCode.EPROTO, f"request body is not JSON: {e}") from None


# ------------------------------------------------------------------ model mapping


@dataclass
class Target:
    """What a ``model`` resolved to: the stream's task ``meta`` and, for a
    policy, the ``policy`` that must route it."""

    model: str
    meta: dict[str, Any]
    policy: str | None = None


@dataclass
class _RibView:
    """The running FIB's policies with their compiled matches (per generation)."""

    fib: Any = None
    policies: list[tuple[str, Any, CompiledMatch]] = field(default_factory=list)
    task_types: dict[str, list[str]] = field(default_factory=dict)  # task type → policies pinning it
    #: Unix s when this ingress first saw the generation (``created`` of the models).
    seen_at: int = 0

    def refresh(self, fib: Any) -> _RibView:
        if fib is not self.fib:
            policies = [(name, spec, compile_match(spec.match)) for name, spec in zip(fib.policy_names,
                                                                                      fib.rib.policies)]
            task_types: dict[str, list[str]] = {}
            for name, _, cm in policies:
                for tt in cm.equals_values("task_type") or []:
                    if isinstance(tt, str):
                        task_types.setdefault(tt, []).append(name)
            self.fib, self.policies, self.task_types = fib, policies, task_types
            self.seen_at = int(time.time())
        return self

    def policy(self, name: str) -> tuple[str, Any, CompiledMatch] | None:
        return next((p for p in self.policies if p[0] == name), None)

    def first_match(self, meta: Mapping[str, Any]) -> str | None:
        return next((name for name, _, cm in self.policies if cm(meta)), None)


def _unknown(model: str) -> IngressError:
    return IngressError(ErrorCode.EPROTO, f"unknown model {model[:256]!r}: GET /v1/models lists the models this key "
                        "may use (task types and policy:<name>); task:<type> names any task type",
                        status=404, param="model")


def resolve_model(model: str, view: _RibView, allowed: list[str] | None) -> Target:
    """``model`` → the stream's task meta (module doc, "Models"). ``allowed``
    is the tenant's ``task_types`` scope (None: any), used to pick a policy's
    task type; the scope itself is enforced by the router at SYN (403).
    Raises :class:`IngressError` 404 for an unknown model."""
    if model.startswith(TASK_PREFIX):
        task_type = model[len(TASK_PREFIX):]
        if not task_type:
            raise _unknown(model)
        return Target(model, {"task_type": task_type})
    if model.startswith(POLICY_PREFIX):
        name = model[len(POLICY_PREFIX):]
    elif model in view.task_types:
        return Target(model, {"task_type": model})
    else:
        name = model
    found = view.policy(name)
    if found is None:
        raise _unknown(model)
    meta: dict[str, Any] = {}
    for key, _ in found[2].items:
        values = found[2].equals_values(key)
        if not values:
            continue  # compared numerically: from the task (diff_loc from the diff)
        if key == "task_type" and allowed is not None:
            values = [v for v in values if v in allowed] or values
        meta[key] = values[0]
    return Target(model, meta, policy=name)


def _models(view: _RibView, allowed: list[str] | None, created: int) -> ModelList:
    cards: list[ModelCard] = []
    may = (lambda tt: True) if allowed is None else (lambda tt: tt in allowed)
    for tt, policies in view.task_types.items():
        if may(tt):
            cards.append(ModelCard(tt, "model", created, "atp-router", ModelAtp("task_type", policies, [tt])))
    for name, _, cm in view.policies:
        pinned = [v for v in cm.equals_values("task_type") or [] if isinstance(v, str)]
        if (pinned and any(may(t) for t in pinned)) or (not pinned and allowed is None):
            cards.append(ModelCard(POLICY_PREFIX + name, "model", created, "atp-router",
                                   ModelAtp("policy", [name], [t for t in pinned if may(t)])))
    return ModelList("list", cards)


# ------------------------------------------------------------------ task content


def task_content(req: ChatCompletionRequest, task_type: str | None) -> dict[str, Any]:
    """The stream's task content (module doc, "Task content"). Raises
    :class:`IngressError` for ``atp.files`` without a diff."""
    files = req.atp.files if req.atp is not None else None
    if task_type == CODE_REVIEW:
        last = next((m for m in reversed(req.messages) if m.role == "user"), None)
        text = last.text() if last is not None else ""
        try:
            is_diff = bool(parse_diff(text))
        except ValueError:
            is_diff = False
        if is_diff:
            content: dict[str, Any] = {"diff": text}
            if files is not None:
                content["files"] = dict(files)
            return content
    if files is not None:
        raise IngressError(ErrorCode.EPROTO, "atp.files goes with a code_review task whose last user message is a "
                           "unified diff", param="atp.files")
    body: dict[str, Any] = msgspec.to_builtins(Chat(messages=[m.turn() for m in req.messages]))
    return body


def _budget(req: ChatCompletionRequest) -> Budget | None:
    asked = req.atp.budget if req.atp is not None else None
    cap = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if cap is None:
        return asked
    tokens = cap if asked is None or asked.tokens is None else min(cap, asked.tokens)
    return Budget(usd=asked.usd if asked is not None else None, tokens=tokens)


# ------------------------------------------------------------------ answer


#: Appended to a finding's line when the change itself carried the comment that would
#: have suppressed it (issue 19: a reviewer sees that the author silenced it).
SILENCED = " (silenced by the change)"


def completion_text(result: Result) -> str:
    """The message content of a FINAL ``result``, exactly:

    * one prose answer, no finding and no failed next-hop: that answer's text;
    * otherwise blocks joined by a blank line: each answer as ``<agent>: <text>``
      (FINAL order); ``N finding(s):`` then one line per merged finding,
      ``- <file>:<span> <severity>: <claim> [<provenance, …>]`` (then `` (silenced
      by the change)`` when ``suppressed_by_change``); ``incomplete:``
      then ``- next-hop failed: <agent>: <code>: <reason>`` per failed next-hop
      (``consensus.uncertainties``); ``no findings`` when there is nothing else.
    """
    failed = [u for u in result.consensus.uncertainties if u.startswith(NEXT_HOP_FAILED)]
    if len(result.answers) == 1 and not result.findings and not failed:
        return result.answers[0].text
    blocks = [f"{a.agent}: {a.text}" for a in result.answers]
    if result.findings:
        blocks.append(f"{len(result.findings)} finding(s):\n" + "\n".join(
            f"- {f.file}:{f.span} {f.severity}: {f.claim} [{', '.join(f.provenance)}]"
            + (SILENCED if f.suppressed_by_change else "") for f in result.findings))
    if failed:
        blocks.append("incomplete:\n" + "\n".join(f"- {u}" for u in failed))
    return "\n\n".join(blocks) if blocks else "no findings"


def _error_of(frame: Frame) -> tuple[ErrorCode, str] | None:
    p = frame.payload
    c = p.content if p is not None else None
    if isinstance(c, ErrorPayload):
        return c.code, c.reason
    if isinstance(c, dict) and c.get("kind") == "ERROR":
        try:
            return ErrorCode(str(c.get("code"))), str(c.get("reason", ""))
        except ValueError:
            return ErrorCode.EPROTO, str(c.get("reason", ""))
    return None


@dataclass
class _Outcome:
    """What a stream's events said, as they are read."""

    final: FinalResult | None = None
    budget_cut: bool = False
    error: tuple[ErrorCode, str] | None = None  # the RST's, or EBUDGET without a FINAL
    out_tokens: int = 0
    live_agent: str | None = None

    def see(self, ev: Any) -> str | None:
        """Take one event; returns live text to stream, if any."""
        t, frame = ev.type, ev.frame
        if t == "PARTIAL":
            c = frame.payload.content if frame.payload is not None else None
            if not isinstance(c, dict):
                return None
            if isinstance(c.get("delta"), str):
                agent = c.get("agent")
                if self.live_agent is None:
                    self.live_agent = agent
                return c["delta"] if agent == self.live_agent else None
            usage = c.get("usage")
            if "report" in c and isinstance(usage, dict):
                out = usage.get("out_tokens", 0)
                self.out_tokens += out if isinstance(out, int) else 0
        elif t == "FINAL":
            content = frame.payload.content if frame.payload is not None else None
            self.final = msgspec.convert(msgspec.to_builtins(content), FinalResult)
        elif t in ("ERROR", "RST"):
            err = _error_of(frame)
            if err is not None and err[0] is ErrorCode.EBUDGET:
                self.budget_cut = True
            if t == "RST":
                self.error = err or (ErrorCode.EPROTO, "stream reset")
        elif t == "FIN" and self.final is None and self.error is None:
            self.error = ((ErrorCode.EBUDGET, "budget exhausted before any next-hop could answer")
                          if self.budget_cut else (ErrorCode.EAGENTDOWN, "the stream ended without a result"))
        return None

    def failure(self) -> ATPError:
        code, reason = self.error or (ErrorCode.EAGENTDOWN, "the stream ended without a result")
        return ATPError(code, reason)

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return "length" if self.budget_cut else "stop"

    def usage(self) -> CompletionUsage:
        assert self.final is not None
        total = self.final.telemetry.tokens
        completion = min(self.out_tokens, total)
        return CompletionUsage(prompt_tokens=total - completion, completion_tokens=completion, total_tokens=total)

    def atp(self, ctx: StreamCtx) -> AtpCompletion:
        assert self.final is not None
        r, t = self.final.result, self.final.telemetry
        return AtpCompletion(stream_id=ctx.stream_id, session_id=ctx.session_id, policy=str(ctx.route.policy),
                             usd=t.usd, tokens=t.tokens, latency_ms=t.latency_ms, findings=r.findings,
                             consensus=r.consensus, answers=r.answers, usage=t.usage)


# ------------------------------------------------------------------ routes

Authorized = Callable[..., Callable[[Request], Awaitable[Response]]]
ReadBody = Callable[[Request, int], Awaitable[bytes]]


def remaining_text(full: str, streamed: str) -> str:
    """What a streaming client still needs after the ``streamed`` live text to
    hold the ``full`` answer: the rest of ``full`` when ``streamed`` is its start
    — whitespace the live text ended with aside (the answer text is trimmed) —
    else a blank line and ``full`` whole."""
    if full.startswith(streamed):
        return full[len(streamed):]
    head = streamed.rstrip()
    if head and full.startswith(head):
        tail, sent_ws = full[len(head):], streamed[len(head):]
        return tail.removeprefix(sent_ws)
    return ("\n\n" if streamed else "") + full


def openai_routes(router: Router, authorized: Authorized, read_body: ReadBody,
                  body_too_large: type[ATPError]) -> list[Route]:
    """The ingress's routes for the control API's Starlette app. ``authorized``
    is the control API's own wrapper (``authorized(action, handler, render)``:
    authentication, then the action, errors rendered by ``render(error,
    status)``); ``read_body`` reads a body up to a limit, raising
    ``body_too_large`` (413)."""
    view = _RibView()
    max_body = router.config.max_body_bytes

    def allowed(identity: Identity) -> list[str] | None:
        spec = router.client_spec(identity.tenant)
        return list(spec.task_types) if spec.task_types is not None else None

    async def models(request: Request, identity: Identity) -> Response:
        v = view.refresh(router.gen.fib)
        return Response(_enc.encode(_models(v, allowed(identity), v.seen_at)), media_type="application/json")

    async def prepare(request: Request, identity: Identity) -> tuple[ChatCompletionRequest, StreamCtx]:
        # A large body is decoded in a worker thread (atp_router.runtime.ingress.bodies): the event loop stays free.
        req = await decode_off_loop(decode_request, await read_body(request, max_body))
        release_body(request)  # decoded: the raw bytes are done with (the task may run for minutes)
        v = view.refresh(router.gen.fib)
        target = resolve_model(req.model, v, allowed(identity))
        meta = dict(target.meta)
        content = task_content(req, meta.get("task_type"))
        if "files" not in content:
            refused = await _complete_from_repo(router, meta, content)
            if refused is not None:
                raise IngressError(ErrorCode.EPROTO, refused, param="messages")
        if target.policy is not None:
            if "diff" in content and "diff_loc" not in meta:
                # As the router does at SYN, off the event loop for a large diff.
                meta["diff_loc"] = await decode_off_loop(count_changed_lines, content["diff"])
            first = v.first_match(meta)
            if first != target.policy:
                match = next(cm.source for name, _, cm in v.policies if name == target.policy)
                why = (f"policy {first!r} comes first in the RIB and matches it" if first is not None
                       else f"its match {match} does not accept it")
                raise IngressError(ErrorCode.EPROTO, f"policy {target.policy!r} does not take this request "
                                   f"(task meta {meta}): {why}", param="model")
        opts = req.atp or AtpOptions()
        ctx = router.open_stream(task=meta, content=content, budget=_budget(req), qos=opts.qos, window=None,
                                 idempotency_key=opts.idempotency_key, identity=identity)
        return req, ctx

    def let_go(ctx: StreamCtx) -> None:
        """The request is over: stop following; a stream nobody can resume
        (no idempotency key) is reset so it spends nothing more."""
        ctx.detach()
        if not ctx.log.closed and ctx.idempotency_key is None:
            router.stream_closed(ctx.stop(ErrorCode.EPREEMPT, "canceled: the OpenAI-compatible client went away"))

    async def chat(request: Request, identity: Identity) -> Response:
        try:
            req, ctx = await prepare(request, identity)
        except body_too_large as e:
            return error_response(e, 413)
        except BodyRefused:
            raise  # the authorized wrapper answers 429 + Retry-After and closes
        except ATPError as e:
            return error_response(e)
        created = int(time.time())
        cid = "chatcmpl-" + ctx.stream_id
        if req.stream:
            return StreamingResponse(_sse(req, ctx, cid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = _Outcome()
        ctx.attach()
        try:
            async for ev in ctx.log.follow():
                out.see(ev)
        finally:
            let_go(ctx)
        if out.final is None:
            return error_response(out.failure(), after_run=True)
        body = ChatCompletion(
            id=cid, object="chat.completion", created=created, model=req.model,
            choices=[Choice(0, AssistantMessage("assistant", completion_text(out.final.result)), out.finish_reason)],
            usage=out.usage(), atp=out.atp(ctx))
        return Response(_enc.encode(body), media_type="application/json")

    async def _sse(req: ChatCompletionRequest, ctx: StreamCtx, cid: str,
                   created: int) -> AsyncIterator[bytes]:
        def chunk(**kw: Any) -> bytes:
            return b"data: " + _enc.encode(ChatCompletionChunk(id=cid, object="chat.completion.chunk",
                                                               created=created, model=req.model, **kw)) + b"\n\n"

        out = _Outcome()
        ctx.attach()
        try:
            yield chunk(choices=[ChunkChoice(0, ChunkDelta(role="assistant", content=""))])
            live: list[str] = []
            async for ev in ctx.log.follow():
                text = out.see(ev)
                if text:
                    live.append(text)
                    yield chunk(choices=[ChunkChoice(0, ChunkDelta(content=text))])
            if out.final is None:
                e = out.failure()
                status = error_response(e).status_code
                yield b"data: " + _enc.encode(error_body(e, status)) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            rest = remaining_text(completion_text(out.final.result), "".join(live))
            if rest:
                yield chunk(choices=[ChunkChoice(0, ChunkDelta(content=rest))])
            yield chunk(choices=[ChunkChoice(0, ChunkDelta(), out.finish_reason)], atp=out.atp(ctx))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk(choices=[], usage=out.usage())
            yield b"data: [DONE]\n\n"
        finally:
            let_go(ctx)

    return [
        Route(CHAT_PATH, authorized("stream_open", chat, error_response), methods=["POST"]),
        Route(MODELS_PATH, authorized("stream_open", models, error_response), methods=["GET"]),
    ]

