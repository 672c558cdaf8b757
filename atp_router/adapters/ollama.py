"""Ollama's native chat API as a review next-hop (spec §14, §5.2).

``POST {base_url}/api/chat`` with ``stream: true`` answers NDJSON
(``application/x-ndjson``), one object per line::

    {"model":"m","created_at":"…","message":{"role":"assistant","content":"The"},"done":false}
    …
    {"model":"m","created_at":"…","message":{"role":"assistant","content":""},"done":true,
     "done_reason":"stop","total_duration":…,"prompt_eval_count":26,"eval_count":282,…}

Usage is the final line's ``prompt_eval_count`` (input tokens; Ollama omits it
when the whole prompt came from its cache, and the estimate stands in) and
``eval_count`` (output tokens). ``message.thinking`` (reasoning models) is not
part of the answer. The request sets ``options.num_predict`` (= ``max_out_tokens``),
``options.num_ctx`` (= the RIB's ``ctx``), ``options.temperature`` and, with
``json_mode``, ``format: "json"``.

Errors: an HTTP error answer carries ``{"error": "…"}`` (mapped per
:mod:`atp_router.adapters.http`; 429/5xx retried with backoff, honouring Retry-After);
an error after the stream started arrives as a line ``{"error": "…"}`` with the
status already 200 (EAGENTDOWN); a stream that ends without ``done: true``, a
line that is not a JSON object, or a non-NDJSON answer is EPROTO. No key is needed
for a local server; ``api_key_env`` sends ``Authorization: Bearer`` (a proxied or
hosted Ollama).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from atp_router.adapters.http import (
    DETAIL_CHARS,
    RetryPolicy,
    json_object,
    status_error,
    token_count,
)
from atp_router.adapters.openai_compat import ChatModelAdapter
from atp_router.wire.errors import AgentError, ErrorCode

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_RETRY", "OllamaAdapter"]

DEFAULT_BASE_URL = "http://127.0.0.1:11434"
#: Two retries, 0.5 s then 1 s (jittered), never sooner than Retry-After, at most 8 s.
DEFAULT_RETRY = RetryPolicy()

_NDJSON_TYPES = ("application/x-ndjson", "application/json", "application/jsonl")


class OllamaAdapter(ChatModelAdapter):
    """An Ollama model through ``/api/chat`` (see the module docstring).

    ``base_url`` is the server root (default ``http://127.0.0.1:11434``); a trailing
    ``/v1`` (the OpenAI-compatible root of the same server) is dropped, so a RIB
    written for Ollama's ``/v1`` keeps working. ``model`` is Ollama's model tag
    (``qwen2.5:7b``). Other arguments: see :class:`ChatModelAdapter`; ``retry``
    defaults to :data:`DEFAULT_RETRY`.
    """

    def __init__(self, name: str, *, base_url: str = DEFAULT_BASE_URL, retry: RetryPolicy = DEFAULT_RETRY,
                 **kwargs: Any) -> None:
        root = base_url.rstrip("/")
        root = root.removesuffix("/v1")
        super().__init__(name, base_url=root, retry=retry, **kwargs)

    def _request(self, messages: list[dict[str, str]], out_tokens: int) -> tuple[str, str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "options": {
                "num_predict": out_tokens,
                "num_ctx": self.ctx_tokens,
                "temperature": self.temperature,
            },
        }
        if self.json_mode:
            body["format"] = "json"
        return "POST", "/api/chat", {"json": body, "headers": self._auth()}

    def _error_of(self, response: httpx.Response, body: bytes) -> AgentError:
        return status_error(response, body, detail=_error_text(body))

    async def _decode(self, response: httpx.Response) -> AsyncIterator[tuple[str, tuple[int | None, int | None] | None]]:
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in _NDJSON_TYPES:
            raise AgentError(ErrorCode.EPROTO, f"not an NDJSON stream: content-type {ctype or 'missing'!r}")
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            obj = json_object(line, bad_json="bad JSON line in stream", not_object="stream line is not a JSON object")
            if "error" in obj:
                raise AgentError(ErrorCode.EAGENTDOWN, f"server error in stream: {_error_text(line.encode())}")
            msg = obj.get("message")
            delta = msg.get("content") if isinstance(msg, dict) else None
            delta = delta if isinstance(delta, str) else ""
            if obj.get("done") is True:
                yield delta, (token_count(obj.get("prompt_eval_count")), token_count(obj.get("eval_count")))
                return
            yield delta, None
        raise AgentError(ErrorCode.EPROTO, "stream ended without a done: true line")


def _error_text(body: bytes) -> str:
    """The ``error`` string of an Ollama error body, else the body itself (cut)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:DETAIL_CHARS]
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"][:DETAIL_CHARS]
    return text[:DETAIL_CHARS]
