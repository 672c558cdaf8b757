"""The wire shapes of the OpenAI-compatible ingress (:mod:`atp_router.runtime.ingress.openai`):
the request and answer Structs (OpenAI's, with the ``atp`` extensions), its
OpenAI-shaped errors and the strict request decoder. The model mapping, which
fields are only validated and the error table are in :mod:`~atp_router.runtime.ingress.openai`'s
docstring; ``proto/openapi.json`` is generated from these Structs.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct
from starlette.responses import Response

from atp_router.consensus.types import Answer, ConsensusInfo, Finding, SignedUsage
from atp_router.task.body import MAX_FILES, MAX_MESSAGES, ChatMessage
from atp_router.task.meta import IDEMPOTENCY_KEY_CHARS
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, QoS

__all__ = [
    "AssistantMessage",
    "AtpCompletion",
    "AtpOptions",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Choice",
    "ChunkChoice",
    "ChunkDelta",
    "CompletionUsage",
    "IngressError",
    "ModelAtp",
    "ModelCard",
    "ModelList",
    "OpenAIError",
    "OpenAIErrorResponse",
    "StreamOptions",
    "decode_request",
    "error_body",
    "error_response",
]

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
    ``max_tokens`` / ``max_completion_tokens`` cap each model next-hop's
    output tokens (tokens), as OpenAI means them."""

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
    is 429, EBUDGET with one — the budget store could not record spend, e.g.
    unreachable or its disk full — 503, both with ``Retry-After`` in s, as the
    control API answers; EBUDGET without one is 402, the budget is spent).
    ``after_run``: the task ran, so a retry would charge it again
    (``x-should-retry: false``)."""
    headers: dict[str, str] = {}
    if status is None:
        status = getattr(e, "status", None)
    if status is None:
        if e.code is ErrorCode.EWINDOW and e.retry_after_ms is not None:
            status = 429
        elif e.code is ErrorCode.EBUDGET and e.retry_after_ms is not None:
            status = 503
        else:
            status = _STATUS.get(e.code, 400)
    if status in (429, 503) and e.retry_after_ms is not None:
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
