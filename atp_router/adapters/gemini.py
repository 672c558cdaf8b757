"""Google's Gemini API as a review next-hop (spec §14, §5.2).

``POST {base_url}/models/{model}:streamGenerateContent?alt=sse`` with the key in
``x-goog-api-key`` answers Server-Sent Events, one ``GenerateContentResponse``
per ``data:`` line::

    data: {"candidates":[{"content":{"parts":[{"text":"The"}],"role":"model"},"index":0}],
           "usageMetadata":{"promptTokenCount":9,"totalTokenCount":9},"modelVersion":"…"}
    …
    data: {"candidates":[{"content":{"parts":[{"text":"."}],"role":"model"},"finishReason":"STOP",
           "index":0}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":31,
           "thoughtsTokenCount":12,"totalTokenCount":52}}

The request carries the system prompt as ``systemInstruction``, the user turn in
``contents`` and ``generationConfig`` (``maxOutputTokens``, ``temperature``, and
``responseMimeType: application/json`` with ``json_mode``). Usage is the latest
``usageMetadata``: input ``promptTokenCount``, output ``candidatesTokenCount`` +
``thoughtsTokenCount`` (thinking is billed as output). Parts marked
``"thought": true`` are not part of the answer.

Errors: Google's error body ``{"error": {"code", "message", "status", "details"}}``
— by HTTP status per :mod:`atp_router.adapters.http`, with these refinements: a
``google.rpc.RetryInfo`` ``retryDelay`` is the backoff hint when no Retry-After
header is sent; ``status: DEADLINE_EXCEEDED`` is ETIMEOUT; an invalid or missing
API key (400 with ``ErrorInfo.reason`` ``API_KEY_INVALID``, 401, 403) and
``FAILED_PRECONDITION`` are EAGENTDOWN (the next-hop cannot serve until an
operator acts). 429/5xx are retried with backoff. The same error object inside
the stream is mapped the same way. A blocked prompt (``promptFeedback.blockReason``)
or answer (``finishReason`` other than ``STOP``/``MAX_TOKENS``) is EPROTO, as is a
stream that ends without a ``finishReason``.

Credentials: the key is read per call from ``api_key_env`` when configured, else
from ``GOOGLE_API_KEY`` then ``GEMINI_API_KEY`` (the precedence of Google's SDKs);
none set is EAGENTDOWN.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx

from atp_router.adapters.http import (
    DETAIL_CHARS,
    RetryPolicy,
    code_of_status,
    json_object,
    secret_value,
    sse_data,
    status_error,
    token_count,
)
from atp_router.adapters.openai_compat import ChatModelAdapter
from atp_router.policy.rib import GOOGLE_KEY_ENVS
from atp_router.wire.errors import AgentError, ErrorCode

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_RETRY", "GeminiAdapter"]

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
#: Two retries, 0.5 s then 1 s (jittered), never sooner than the server's hint, at most 8 s.
DEFAULT_RETRY = RetryPolicy()

_DONE = frozenset({"STOP", "MAX_TOKENS"})
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")
_DOWN_STATUSES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                            "UNAVAILABLE", "INTERNAL", "NOT_FOUND"})  # fmt: skip


class GeminiAdapter(ChatModelAdapter):
    """A Gemini model through ``streamGenerateContent`` (see the module docstring).

    ``base_url`` is the API root including its version (default
    ``https://generativelanguage.googleapis.com/v1beta``); ``model`` is the model id
    (``gemini-2.5-flash``; a ``models/`` prefix is accepted). Other arguments: see
    :class:`ChatModelAdapter`; ``retry`` defaults to :data:`DEFAULT_RETRY`.
    """

    def __init__(self, name: str, *, base_url: str = DEFAULT_BASE_URL, retry: RetryPolicy = DEFAULT_RETRY,
                 **kwargs: Any) -> None:
        super().__init__(name, base_url=base_url, retry=retry, **kwargs)
        self.model = self.model.removeprefix("models/")

    def _key(self) -> str | None:
        if self._api_key is not None or self._api_key_env is not None:
            return super()._key()
        for env in GOOGLE_KEY_ENVS:
            key = secret_value(env)
            if key:
                return key
        raise AgentError(ErrorCode.EAGENTDOWN, f"no Gemini API key: set {' or '.join(GOOGLE_KEY_ENVS)} (or api_key_env)")

    def _auth(self) -> dict[str, str]:
        key = self._key()
        return {"x-goog-api-key": key} if key else {}

    def _request(self, messages: list[dict[str, str]], out_tokens: int) -> tuple[str, str, dict[str, Any]]:
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        contents = [
            {"role": "model" if m["role"] == "assistant" else "user", "parts": [{"text": m["content"]}]}
            for m in messages
            if m["role"] != "system"
        ]
        config: dict[str, Any] = {"maxOutputTokens": out_tokens, "temperature": self.temperature}
        if self.json_mode:
            config["responseMimeType"] = "application/json"
        body: dict[str, Any] = {"contents": contents, "generationConfig": config}
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        path = f"/models/{quote(self.model, safe='-._~')}:streamGenerateContent"
        return "POST", path, {"params": {"alt": "sse"}, "json": body, "headers": self._auth()}

    def _error_of(self, response: httpx.Response, body: bytes) -> AgentError:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            return status_error(response, body)
        base = status_error(response, body, detail=_describe(err))
        return _refine(base, err)

    async def _decode(self, response: httpx.Response) -> AsyncIterator[tuple[str, tuple[int | None, int | None] | None]]:
        finished = False
        async with contextlib.aclosing(sse_data(response)) as events:
            async for data in events:
                if not data.strip():
                    continue
                obj = json_object(data)
                if isinstance(obj.get("error"), dict):
                    raise _stream_error(obj["error"])
                delta, done = _chunk(obj)
                finished = finished or done
                yield delta, _usage(obj.get("usageMetadata"))
        if not finished:
            raise AgentError(ErrorCode.EPROTO, "stream ended without a finishReason")


def _chunk(obj: Mapping[str, Any]) -> tuple[str, bool]:
    """(answer text of the first candidate, whether it finished) of one response."""
    feedback = obj.get("promptFeedback")
    if isinstance(feedback, dict) and feedback.get("blockReason"):
        raise AgentError(ErrorCode.EPROTO, f"prompt blocked by the provider: {feedback['blockReason']}")
    candidates = obj.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        return "", False
    cand = candidates[0]
    if not isinstance(cand, dict):
        raise AgentError(ErrorCode.EPROTO, "candidate is not a JSON object")
    text = ""
    content = cand.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    for part in parts if isinstance(parts, list) else ():
        if isinstance(part, dict) and isinstance(part.get("text"), str) and not part.get("thought"):
            text += part["text"]
    reason = cand.get("finishReason")
    if reason is not None and reason not in _DONE:
        raise AgentError(ErrorCode.EPROTO, f"answer blocked by the provider: finishReason {reason}")
    return text, reason is not None


def _usage(meta: Any) -> tuple[int | None, int | None] | None:
    if not isinstance(meta, dict):
        return None
    prompt = token_count(meta.get("promptTokenCount"))
    cand, thoughts = token_count(meta.get("candidatesTokenCount")), token_count(meta.get("thoughtsTokenCount"))
    out = None if cand is None and thoughts is None else (cand or 0) + (thoughts or 0)
    return prompt, out


def _describe(err: Mapping[str, Any]) -> str:
    status = err.get("status")
    message = str(err.get("message", ""))[:DETAIL_CHARS]
    return f"{status}: {message}" if isinstance(status, str) else message


def _retry_delay_ms(err: Mapping[str, Any]) -> int | None:
    """``retryDelay`` of a ``google.rpc.RetryInfo`` detail (a Duration like "37s"), in ms."""
    for d in err.get("details") or ():
        if isinstance(d, dict) and str(d.get("@type", "")).endswith("google.rpc.RetryInfo"):
            m = _DURATION_RE.match(str(d.get("retryDelay", "")))
            if m:
                return int(float(m[1]) * 1000)
    return None


def _key_invalid(err: Mapping[str, Any]) -> bool:
    return any(
        isinstance(d, dict) and str(d.get("@type", "")).endswith("google.rpc.ErrorInfo")
        and d.get("reason") in ("API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED", "API_KEY_HTTP_REFERRER_BLOCKED")
        for d in err.get("details") or ()
    )  # fmt: skip


def _refine(base: AgentError, err: Mapping[str, Any]) -> AgentError:
    """``base`` (mapped from the HTTP status) corrected by Google's error status and
    details; a Retry-After header (already in ``base``) wins over ``retryDelay``."""
    status = err.get("status")
    code, hint = base.code, base.retry_after_ms
    if hint is None:
        hint = _retry_delay_ms(err)
    if status == "DEADLINE_EXCEEDED":
        code = ErrorCode.ETIMEOUT
    elif status in _DOWN_STATUSES or _key_invalid(err):
        code = ErrorCode.EAGENTDOWN
    return AgentError(code, base.reason, retry_after_ms=hint)


def _stream_error(err: Mapping[str, Any]) -> AgentError:
    """An error object sent inside a 200 stream, mapped as if it were the status."""
    http = err.get("code")
    http = http if isinstance(http, int) and 400 <= http <= 599 else 500
    base = AgentError(code_of_status(http), f"error in stream (HTTP {http}): {_describe(err)}")
    return _refine(base, err)
