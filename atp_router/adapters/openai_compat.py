"""Chat-model next-hops (spec §14, §5.2, §7.3): the shared base and the OpenAI-compatible one.

:class:`ChatModelAdapter` holds what every chat-model adapter shares (the review
conversation, preflight, usage → USD micros, health, error mapping, retries);
:class:`OpenAICompatAdapter`, :class:`~atp_router.adapters.ollama.OllamaAdapter` and
:class:`~atp_router.adapters.gemini.GeminiAdapter` supply the wire.

The OpenAI-compatible adapter speaks to any server of the ``POST {base_url}/chat/completions`` shape
(OpenAI, Ollama's ``/v1``, llama.cpp / llama-cpp-python, vLLM, ...). A call:

1. builds a code-review conversation from ``content["diff"]``: hunks rendered with
   after-diff line numbers so the model can cite ``file:line``; the prompt is cut
   to fit ``ctx_tokens - max_out_tokens``. A chat body (``{"messages"}``, the
   OpenAI ingress's) is sent as its own conversation (:func:`conversation`: one
   system prompt, then the client's turns, the newest kept when it must be cut);
2. streams the answer over SSE (``stream: true``, ``stream_options.include_usage``),
   yielding a PARTIAL :class:`Fragment` per text delta with the cumulative usage so
   far (estimated until the server reports it);
3. parses the answer tolerantly into an :class:`AgentReport` (JSON in code fences
   or prose; invalid entries dropped; lines must exist in the given files) and
   yields it as the FINAL fragment with the server's usage, priced from the RIB.

Errors (``AgentError``)::

    connect failure, 5xx, 429, 401/403/404   EAGENTDOWN (retry_after_ms from Retry-After)
    read/write/pool timeout, 408             ETIMEOUT
    other 4xx, non-SSE answer, bad SSE JSON  EPROTO

429/5xx answers are retried only with a ``retry`` policy (default none; see
:mod:`atp_router.adapters.http`). The streamed call goes through the lean client
(:mod:`atp_router.adapters.upstream`: trio streams, httptools, a keep-alive pool,
SSE scanned in place) unless the adapter was built with a ``transport``, with
``lean_upstream=False``, or for a ``base_url`` that the environment's proxy
settings route through a proxy: those keep httpx, decided at construction. Both
paths map errors, retry and drain the same way. The whole-call deadline is the router's
``trio.fail_after``; ``timeout_ms`` only bounds each network wait. Money: costs are USD per 1M tokens, which is USD micros
per token, so ``usd_micros = ceil(in_tokens * cost_in + out_tokens * cost_out)``
computed exactly on the decimal costs.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
import msgspec
import trio
from httpx._utils import URLPattern, get_environment_proxies

from atp_router.adapters import upstream
from atp_router.adapters.base import (
    CHARS_PER_TOKEN,
    CallStats,
    Fragment,
    Prompt,
    change_of,
    estimate_tokens,
    usd_micros,
)
from atp_router.adapters.context import forwarded_context, prompt_context
from atp_router.adapters.http import (
    NO_RETRY,
    POOL_LIMITS,
    HTTPNextHop,
    RetryPolicy,
    env_secret,
    json_object,
    open_stream,
    retry_after_ms,
    sse_data,
    status_error,
    transport_error,
)
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.observability import tracing
from atp_router.task.body import Chat, ChatTurn
from atp_router.task.change import ParsedChange, parse_change
from atp_router.task.diff import FileDiff
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = [
    "CHARS_PER_TOKEN",
    "CONTEXT_PROMPT",
    "SYSTEM_PROMPT",
    "CallStats",
    "ChatModelAdapter",
    "OpenAICompatAdapter",
    "estimate_tokens",
    "parse_review",
    "render_diff",
    "usd_micros",
]

#: Per-message framing tokens of the chat template (role markers, separators).
_MSG_OVERHEAD = 4
_MAX_FINDINGS = 100
_MAX_CLAIM = 1000
_MAX_SUMMARY = 2000

#: After ``data: [DONE]``: how long (s) and how many further events the adapter
#: reads to reach the end of the body, so the connection is reused.
_DRAIN_AFTER_DONE_S = 1.0
_DRAIN_AFTER_DONE_EVENTS = 16

#: ``(text delta, (in_tokens, out_tokens) reported or None)``: one decoded chunk of an answer.
Chunk = tuple[str, tuple[int | None, int | None] | None]
_JSON = msgspec.json.Decoder()

SYSTEM_PROMPT = (
    "You are a meticulous code reviewer. Report only real defects introduced by the diff: "
    "bugs, security flaws, broken error handling, wrong logic. Line numbers are shown on the left "
    "of each diff line; cite the number of the line in the new file. Answer with JSON only, in "
    'this shape: {"findings": [{"file": "<path>", "line": <number>, "severity": '
    '"critical|high|medium|low", "claim": "<one sentence>", "confidence": <0.0-1.0>}]}. '
    'If there is nothing to report, answer {"findings": []}.'
)


#: Introduces the Agent Context Message appended to a system prompt (``context_in_prompt``).
CONTEXT_PROMPT = (
    "\n\nContext from the orchestrator (Agent Context Protocol, JSON). Follow its policies; "
    "it is guidance, not part of the code under review:\n"
)


class ChatModelAdapter(HTTPNextHop):
    """Base of the chat-model next-hops (OpenAI-compatible, Ollama, Gemini): the
    review conversation, preflight, usage → USD micros, health, errors; a subclass
    supplies the wire (:meth:`_request`, :meth:`_decode`, :meth:`_auth`,
    :meth:`_error_of`).

    ``base_url`` is the provider's API root; ``model`` the provider's model id;
    costs are USD per 1M tokens; ``max_out_tokens`` and ``ctx_tokens`` are tokens;
    ``timeout_ms`` bounds each network wait (connect, each read). The API key is
    ``api_key``, else read from the environment variable ``api_key_env`` at each
    call (rotation needs no reload; a missing key is EAGENTDOWN, not a refused
    RIB). ``json_mode`` asks the server to constrain the answer to JSON.
    ``context_in_prompt`` appends the stream's Agent Context Message (frame
    ``prompt.task.agent_context``, without its ``securityContext``) to the system
    prompt. ``retry`` retries 429/5xx answers with backoff (:mod:`atp_router.adapters.http`).
    ``transport`` replaces httpx's network transport (e.g. to share one).
    ``lean_upstream`` (default on) lets a subclass whose wire supports it (the
    OpenAI-compatible one) make its streamed call with the lean client
    (:mod:`atp_router.adapters.upstream`); a ``transport``, or a ``base_url`` the
    environment proxies, keeps httpx (decided here, at construction).
    """

    #: Whether this wire can use the lean client (:meth:`_open_lean`).
    _LEAN_WIRE: ClassVar[bool] = False

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        api_key_env: str | None = None,
        cost_in_per_mtok: float = 0.0,
        cost_out_per_mtok: float = 0.0,
        max_out_tokens: int = 512,
        temperature: float = 0.0,
        timeout_ms: int = 60_000,
        ctx_tokens: int = 8192,
        strengths: Iterable[str] = (),
        json_mode: bool = False,
        context_in_prompt: bool = False,
        retry: RetryPolicy = NO_RETRY,
        transport: httpx.AsyncBaseTransport | None = None,
        lean_upstream: bool = True,
    ) -> None:
        if cost_in_per_mtok < 0 or cost_out_per_mtok < 0:
            raise ValueError("costs must be >= 0 USD per 1M tokens")
        if not 0 < max_out_tokens < ctx_tokens:
            raise ValueError(f"max_out_tokens ({max_out_tokens}) must be > 0 and below ctx_tokens ({ctx_tokens})")
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be > 0")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.cost_in_per_mtok = cost_in_per_mtok
        self.cost_out_per_mtok = cost_out_per_mtok
        self.max_out_tokens = max_out_tokens
        self.temperature = temperature
        self.ctx_tokens = ctx_tokens
        self.strengths = list(strengths)
        self.json_mode = json_mode
        self.context_in_prompt = context_in_prompt
        self.retry = retry
        self._api_key = api_key
        self._api_key_env = api_key_env
        self._init_http(timeout_ms=timeout_ms, transport=transport, base_url=self.base_url)
        self._upstream: upstream.UpstreamClient | None = None
        self.lean = self._LEAN_WIRE and lean_upstream and transport is None and _direct_route(self.base_url)

    # -- ProviderAdapter -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(agent=self.name, skills=list(self.strengths), max_ctx=self.ctx_tokens)

    def out_tokens(self, prompt: Prompt) -> int:
        """The output cap of a call for ``prompt`` (tokens): ``max_out_tokens``,
        or the task's own ``max_out_tokens`` when that is lower (OpenAI's
        ``max_tokens``, :class:`~atp_router.task.meta.TaskMeta`)."""
        cap = prompt.task.max_out_tokens
        return self.max_out_tokens if cap is None else min(cap, self.max_out_tokens)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight (spec §5.2): input tokens from the rendered conversation
        (chars/4, at most ``ctx_tokens - max_out_tokens``), output tokens =
        :meth:`out_tokens` (the worst case: the model is asked for no more),
        USD from the configured costs."""
        in_tokens = self._count(self.messages(prompt))
        out = self.out_tokens(prompt)
        micros = self._price(in_tokens, out)
        return CostEstimate(in_tokens=in_tokens, out_tokens=out, usd=micros / 1_000_000)

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """PARTIAL fragments (text deltas, cumulative usage so far, estimated until
        the server reports it) then one FINAL ``AgentReport`` priced from the
        reported usage. Raises ``AgentError`` per :mod:`atp_router.adapters.http` and the
        subclass's wire; ``EPROTO`` for an invalid Agent Context in the meta.
        Reasons never carry the context's secrets."""
        t0 = trio.current_time()
        try:
            _, secrets = forwarded_context(prompt.task)
        except AgentError as e:
            raise self._fail(e, t0) from None
        messages = self.messages(prompt)
        est_in = self._count(messages)
        parts: list[str] = []
        chars = 0
        reported: tuple[int | None, int | None] = (None, None)
        try:
            method, path, kwargs = self._request(messages, self.out_tokens(prompt))
            async with self._open(method, path, kwargs) as chunks:
                async for delta, usage in chunks:
                    if usage is not None:
                        reported = (
                            usage[0] if usage[0] is not None else reported[0],
                            usage[1] if usage[1] is not None else reported[1],
                        )
                    if delta:
                        parts.append(delta)
                        chars += len(delta)
                        yield Fragment(type=PayloadType.PARTIAL, content=delta, usage=self._usage(est_in, chars))
        except AgentError as e:
            raise self._fail(e, t0, secrets) from None
        except httpx.HTTPError as e:
            raise self._fail(transport_error(e, self.base_url, self.timeout_ms), t0, secrets) from None
        except upstream.UpstreamError as e:
            raise self._fail(upstream.transport_error(e, self.base_url, self.timeout_ms), t0, secrets) from None
        self._succeeded(t0)
        findings, summary = parse_review("".join(parts), prompt.content, change=prompt.change)
        yield Fragment(
            type=PayloadType.FINAL,
            content=AgentReport(findings=findings, summary=summary),
            usage=self._usage(est_in, chars, reported),
        )

    async def aclose(self) -> None:
        await super().aclose()
        if self._upstream is not None:
            await self._upstream.aclose()
            self._upstream = None

    @contextlib.asynccontextmanager
    async def _open(self, method: str, path: str, kwargs: dict[str, Any]) -> AsyncIterator[AsyncIterator[Chunk]]:
        """The decoded chunks of the streamed call, through the lean client when
        :attr:`lean`, else httpx (:func:`~atp_router.adapters.http.open_stream`)."""
        if self.lean:
            async with (
                upstream.open_upstream(self._lean_client(), method, self.base_url + path, json=kwargs["json"],
                                       headers={**kwargs["headers"], **tracing.outbound(self.name)},
                                       retry=self.retry, error_of=self._error_of) as answer,
                contextlib.aclosing(self._open_lean(answer)) as chunks,
            ):  # fmt: skip
                yield chunks
            return
        async with (
            open_stream(self._http(), method, path, retry=self.retry, error_of=self._error_of,
                        **kwargs) as response,
            contextlib.aclosing(self._decode(response)) as chunks,
        ):  # fmt: skip
            yield chunks

    def _lean_client(self) -> upstream.UpstreamClient:
        if self._upstream is None:
            t = self.timeout_ms / 1000
            # httpx's own default context (SSL_CERT_FILE / SSL_CERT_DIR, else certifi) or use_tls's:
            # the lean path trusts exactly what the httpx path trusts.
            tls = self._tls
            if tls is None and self.base_url.lower().startswith("https:"):
                tls = httpx.create_ssl_context()
            self._upstream = upstream.UpstreamClient(
                timeout_s=t, connect_timeout_s=min(t, 10.0), ssl_context=tls,
                max_connections=POOL_LIMITS.max_connections or 1024,
                max_idle=POOL_LIMITS.max_keepalive_connections or 0,
            )  # fmt: skip
        return self._upstream

    def _open_lean(self, answer: upstream.Response) -> AsyncIterator[Chunk]:
        """The chunks of a lean answer (a subclass with :attr:`_LEAN_WIRE` defines it)."""
        raise TypeError(f"{type(self).__name__} has no lean wire")

    # -- prompt --------------------------------------------------------------------

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages for ``prompt``: the review system prompt and the
        numbered diff (``code_review``); a chat body's own conversation
        (``{"messages"}``, the OpenAI ingress's: :func:`conversation`); or the
        instruction and JSON content (other task types). Cut to ``ctx_tokens -
        max_out_tokens`` (tokens, at :data:`CHARS_PER_TOKEN`). With
        ``context_in_prompt`` the system prompt ends with the Agent Context
        Message as JSON, ``securityContext`` removed."""
        change = change_of(prompt)
        raw = prompt.task.agent_context
        context = CONTEXT_PROMPT + prompt_context(raw) if self.context_in_prompt and isinstance(raw, Mapping) else ""
        if change is None and isinstance(body_ := prompt.body, Chat):
            return conversation(body_.messages, prompt.instruction + context,
                                (self.ctx_tokens - self.max_out_tokens) * CHARS_PER_TOKEN)
        if change is not None:
            system = SYSTEM_PROMPT
            head = (prompt.instruction + "\n\n" if prompt.instruction else "") + "Review this diff:\n\n"
            body = render_diff(change.files)
        else:
            system = "You are a precise assistant. Answer concisely."
            head = (prompt.instruction or prompt.task_type) + "\n\n"
            body = json.dumps(prompt.content, ensure_ascii=False, indent=1)
        system += context
        room = (self.ctx_tokens - self.max_out_tokens - 2 * _MSG_OVERHEAD) * CHARS_PER_TOKEN - len(system) - len(head)
        return [{"role": "system", "content": system}, {"role": "user", "content": head + _cut(body, max(room, 0))}]

    def _count(self, messages: list[dict[str, str]]) -> int:
        chars = sum(len(m["content"]) for m in messages)
        return min(estimate_tokens(chars) + _MSG_OVERHEAD * len(messages), self.ctx_tokens - self.max_out_tokens)

    # -- wire (subclasses) ---------------------------------------------------------

    def _request(self, messages: list[dict[str, str]], out_tokens: int) -> tuple[str, str, dict[str, Any]]:
        """``(method, path below base_url, client.stream kwargs)`` of the call
        that may answer at most ``out_tokens`` tokens."""
        raise TypeError(f"{type(self).__name__} does not define its request")

    def _decode(self, response: httpx.Response) -> AsyncIterator[tuple[str, tuple[int | None, int | None] | None]]:
        """``(text delta, (in_tokens, out_tokens) reported or None)`` per chunk of
        a successful answer; either count may be ``None`` when not reported.
        Raises ``AgentError`` (EPROTO for a malformed stream, in-band errors)."""
        raise TypeError(f"{type(self).__name__} does not define its stream decoder")

    def _error_of(self, response: httpx.Response, body: bytes) -> AgentError:
        """The AgentError of an HTTP error answer (see :func:`status_error`)."""
        return status_error(response, body)

    def _key(self) -> str | None:
        if self._api_key is None and self._api_key_env is not None:
            return env_secret(self._api_key_env, "API key")
        return self._api_key

    def _auth(self) -> dict[str, str]:
        key = self._key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _price(self, in_tokens: int, out_tokens: int) -> int:
        return usd_micros(in_tokens, out_tokens, self.cost_in_per_mtok, self.cost_out_per_mtok)


class OpenAICompatAdapter(ChatModelAdapter):
    """A chat-completions model as a review next-hop (see the module docstring).

    ``base_url`` ends before ``/chat/completions`` (e.g. ``http://127.0.0.1:8080/v1``);
    ``json_mode`` sets ``response_format: {"type": "json_object"}`` (small models
    need it); the key goes in ``Authorization: Bearer``. Other arguments: see
    :class:`ChatModelAdapter`.
    """

    def _request(self, messages: list[dict[str, str]], out_tokens: int) -> tuple[str, str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": out_tokens,
            "temperature": self.temperature,
        }
        if self.json_mode:
            body["response_format"] = {"type": "json_object"}
        return "POST", "/chat/completions", {"json": body, "headers": self._auth()}

    _LEAN_WIRE = True

    def _decode(self, response: httpx.Response) -> AsyncIterator[Chunk]:
        return self._chunks(sse_data(response))

    def _open_lean(self, answer: upstream.Response) -> AsyncIterator[Chunk]:
        return self._chunks(upstream.sse_data(answer))

    async def _chunks(self, sse: AsyncGenerator[str, None] | AsyncGenerator[bytearray, None]) -> AsyncIterator[Chunk]:
        """The chunks of an answer's SSE ``data`` (text from httpx, UTF-8 bytes from
        the lean client), up to ``[DONE]``, then the drain below."""
        async with contextlib.aclosing(sse) as events:
            async for data in events:
                if _is_done(data):
                    break
                yield self._decode_chunk(data)
            else:
                return
            # Read on to the end of the body (its last chunk follows [DONE] at once):
            # a response read to its end gives its keep-alive connection back to the
            # pool, where one abandoned at [DONE] is closed and the next call opens a
            # new one (issue 10: ~2 ms CPU a call and a TIME-WAIT socket each).
            # Bounded, so a server that keeps the body open cannot hold the call.
            with trio.move_on_after(_DRAIN_AFTER_DONE_S):
                extra = 0
                async for _ in events:
                    extra += 1
                    if extra > _DRAIN_AFTER_DONE_EVENTS:
                        break

    def _decode_chunk(self, data: str | bytearray) -> tuple[str, tuple[int, int] | None]:
        try:
            obj = _JSON.decode(data)
        except msgspec.DecodeError:
            obj = None
        if not isinstance(obj, dict):
            # json's reading (NaN, huge ints, invalid UTF-8 replaced) and its exact EPROTO reasons.
            obj = json_object(data if isinstance(data, str) else data.decode("utf-8", "replace"))
        if "error" in obj:
            # Servers report failures that happen mid-stream in-band.
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise AgentError(ErrorCode.EAGENTDOWN, f"server error in stream: {str(msg)[:300]}")
        usage = None
        u = obj.get("usage")
        if (
            isinstance(u, dict)
            and isinstance(u.get("prompt_tokens"), int)
            and isinstance(u.get("completion_tokens"), int)
        ):
            usage = (u["prompt_tokens"], u["completion_tokens"])
        delta = ""
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                d = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(d, dict) and isinstance(d.get("content"), str):
                    delta += d["content"]
        return delta, usage


def _is_done(data: str | bytearray) -> bool:
    """Whether an SSE ``data`` is the ``[DONE]`` sentinel (surrounding whitespace
    allowed); a bytearray is copied (stripped) only when it holds the sentinel."""
    if isinstance(data, str):
        return data.strip() == "[DONE]"
    return b"[DONE]" in data and data.strip() == b"[DONE]"


def _direct_route(base_url: str) -> bool:
    """Whether ``base_url`` is http(s) and httpx would not send it through a proxy
    from the environment (``HTTP(S)_PROXY``, ``ALL_PROXY``, ``NO_PROXY``; httpx's own
    matching): the lean client has no proxy support, so a proxied one keeps httpx."""
    if urlsplit(base_url).scheme.lower() not in ("http", "https"):
        return False
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL:
        return False
    mounts = {URLPattern(pattern): proxy for pattern, proxy in get_environment_proxies().items()}
    for pattern in sorted(mounts):
        if pattern.matches(url):
            return mounts[pattern] is None
    return True


#: Kept for callers of the old private name; see :func:`atp_router.adapters.http.retry_after_ms`.
_retry_after_ms = retry_after_ms


# -- rendering -----------------------------------------------------------------------


def render_diff(diffs: Iterable[FileDiff]) -> str:
    """The diff as the model sees it: per file a header, per hunk its lines with
    the after-diff line number on the left (blank for removed lines)::

        ### auth.py (modified)
        @@ def check(token):
          41   if not token:
          42 +     return True
             -     return False
    """
    out: list[str] = []
    for fd in diffs:
        moved = f" (from {fd.old_path})" if fd.status == "renamed" else ""
        out.append(f"### {fd.path} ({fd.status}{moved})")
        for h in fd.hunks:
            out.append(f"@@ {h.section}".rstrip())
            for dl in h.lines:
                num = "" if dl.new is None else str(dl.new)
                out.append(f"{num:>5} {dl.kind} {dl.text}")
        out.append("")
    return "\n".join(out)


def conversation(turns: Sequence[ChatTurn], system: str, room_chars: int) -> list[dict[str, str]]:
    """A chat body's turns as the model's messages: one system message first —
    ``system`` (the RIB's instruction and the Agent Context, when any), then the
    client's ``system`` and ``developer`` turns, in order, joined by a blank
    line (chat templates accept a system prompt only at the start, and only
    one) — then the other turns in order with their role, content and ``name``.
    Fitted to ``room_chars`` characters with :data:`_MSG_OVERHEAD` tokens a
    message counted: the system message is kept (cut to the room when it alone
    does not fit), then the newest turns as they fit; the turn that does not fit
    keeps its head with a ``[truncated: N more characters]`` marker, older ones
    are dropped (a ``[N earlier messages omitted]`` system note in their place)."""
    prompts = [system] if system else []
    prompts += [t.content for t in turns if t.role in ("system", "developer") and t.content]
    rest = [t for t in turns if t.role not in ("system", "developer")]
    overhead = _MSG_OVERHEAD * CHARS_PER_TOKEN
    left = room_chars - overhead * 2 - _NOTE_CHARS  # the omitted-messages note's room kept
    head = [{"role": "system", "content": _cut_text("\n\n".join(prompts), left - overhead)}] if prompts else []
    left -= sum(overhead + len(m["content"]) for m in head)
    kept: list[dict[str, str]] = []
    for t in reversed(rest):
        if kept and len(t.content) > left - overhead and left - overhead < _MIN_CUT:
            break  # neither fits nor leaves enough to cut: it and the older turns are omitted
        m = _message(t)
        m["content"] = _cut_text(m["content"], left - overhead)
        left -= overhead + len(m["content"])
        kept.append(m)
    omitted = len(rest) - len(kept)
    note = [{"role": "system", "content": f"[{omitted} earlier messages omitted]"}] if omitted else []
    return head + note + kept[::-1]


def _message(turn: ChatTurn) -> dict[str, str]:
    m = {"role": turn.role, "content": turn.content}
    if turn.name is not None:
        m["name"] = turn.name
    return m


_MARKER = "\n[truncated: {} more characters]"
#: A turn is cut only when at least this many characters of it can stay; else it is omitted.
_MIN_CUT = 64
_NOTE_CHARS = len("[999 earlier messages omitted]")


def _cut_text(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters (≥ 0): its head and the marker."""
    if len(text) <= limit:
        return text
    if limit < len(_MARKER) + 12:
        return text[: max(limit, 0)]
    head = text[: limit - len(_MARKER) - 12]
    return head + _MARKER.format(len(text) - len(head))


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = "\n[diff truncated: {} more lines]"
    head = text[: max(0, limit - len(marker) - 12)]
    head = head[: head.rfind("\n") + 1] if "\n" in head else ""
    return head + marker.format(text.count("\n", len(head)) + 1)


# -- answer parsing ------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n(.*?)```", re.DOTALL)
_LINE_RE = re.compile(r"^\s*L?(\d+)\s*(?:[-–:]\s*L?(\d+))?\s*$")
_SEVERITY = {
    "critical": Severity.CRITICAL, "blocker": Severity.CRITICAL,
    "high": Severity.HIGH, "error": Severity.HIGH, "major": Severity.HIGH, "severe": Severity.HIGH,
    "medium": Severity.MEDIUM, "warning": Severity.MEDIUM, "moderate": Severity.MEDIUM,
    "low": Severity.LOW, "minor": Severity.LOW, "note": Severity.LOW, "nit": Severity.LOW, "style": Severity.LOW,
    "info": Severity.INFO, "informational": Severity.INFO,
}  # fmt: skip


def parse_review(text: str, content: Mapping[str, Any], *,
                 change: ParsedChange | None = None) -> tuple[list[AgentFinding], str]:
    """Findings and a summary from a model's free-form answer to a review prompt.

    Looks for ``{"findings": [...]}`` (or a bare list of findings) in code fences,
    then anywhere in the text; failing that, gathers standalone finding objects (an
    answer cut off by ``max_tokens`` keeps its complete entries). Entries without a
    known ``file``, a ``line`` inside that file (``content["files"]``, else inside a
    hunk of ``content["diff"]``: ``change``, its parse when the caller has it) or a
    ``claim`` are dropped. When nothing parses, returns no findings and the text
    (up to 2000 chars) as the summary.
    """
    known = _known_lines(content, change)
    entries, summary = _json_findings(text)
    if entries is None:
        return [], text.strip()[:_MAX_SUMMARY]
    findings: list[AgentFinding] = []
    for entry in entries:
        f = _finding(entry, known)
        if f is not None and f not in findings:
            findings.append(f)
        if len(findings) == _MAX_FINDINGS:
            break
    for i, f in enumerate(findings, 1):
        f.ref = str(i)
    return findings, summary


def _known_lines(content: Mapping[str, Any], change: ParsedChange | None = None) -> dict[str, range | set[int]]:
    """Path → the lines a finding may cite (``change``: ``content["diff"]`` parsed, else parsed here)."""
    known: dict[str, range | set[int]] = {}
    files = content.get("files")
    if isinstance(files, dict):
        for path, text in files.items():
            if isinstance(path, str) and isinstance(text, str):
                n = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
                known[path] = range(1, n + 1)
    diff = content.get("diff")
    if isinstance(diff, str):
        for fd in (change if change is not None else parse_change(diff)).files:
            if fd.path not in known and fd.status != "deleted":
                known[fd.path] = {n for h in fd.hunks for n in h.new_range}
    return known


def _json_findings(text: str) -> tuple[list[Any] | None, str]:
    candidates = [m.group(1) for m in _FENCE_RE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    loose: list[Any] = []
    for blob in candidates:
        for start in (i for i, c in enumerate(blob) if c in "{["):
            try:
                obj, _ = decoder.raw_decode(blob, start)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("findings"), list):
                summary = obj.get("summary")
                return obj["findings"], summary.strip()[:_MAX_SUMMARY] if isinstance(summary, str) else ""
            if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
                return obj, ""
            if isinstance(obj, dict) and ("claim" in obj or "message" in obj or "issue" in obj):
                loose.append(obj)
    return (loose, "") if loose else (None, "")


def _finding(entry: Any, known: Mapping[str, range | set[int]]) -> AgentFinding | None:
    if not isinstance(entry, dict):
        return None
    path = entry.get("file") or entry.get("path")
    if path is None and len(known) == 1:
        path = next(iter(known))  # one file under review: the citation is unambiguous
    if not isinstance(path, str):
        return None
    path = path.strip()
    for prefix in ("a/", "b/", "./"):
        if path not in known and path.startswith(prefix):
            path = path[len(prefix) :]
    if path not in known:
        return None
    span = _span(entry)
    if span is None or span[0] not in known[path]:
        return None
    start, end = span
    if end not in known[path]:
        end = start
    claim = next((entry[k] for k in ("claim", "message", "issue", "description") if isinstance(entry.get(k), str)), "")
    claim = claim.strip()
    if not claim:
        return None
    sev = entry.get("severity")
    severity = _SEVERITY.get(sev.strip().lower(), Severity.MEDIUM) if isinstance(sev, str) else Severity.MEDIUM
    conf = entry.get("confidence")
    if isinstance(conf, bool) or not isinstance(conf, (int, float)) or conf < 0:
        conf = 0.5
    elif conf > 1:
        conf = conf / 100 if conf <= 100 else 0.5  # a percentage
    try:
        return AgentFinding(
            file=path, start=start, end=end, severity=severity, claim=claim[:_MAX_CLAIM], confidence=float(conf)
        )
    except msgspec.ValidationError:
        return None


def _span(entry: Mapping[str, Any]) -> tuple[int, int] | None:
    raw = entry.get("line", entry.get("start", entry.get("lines")))
    end_raw = entry.get("end")
    start = end = None
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        start = raw
    elif isinstance(raw, str):
        m = _LINE_RE.match(raw)
        if m:
            start = int(m[1])
            end = int(m[2]) if m[2] else None
    elif isinstance(raw, list) and raw and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        start, end = raw[0], raw[-1]
    if start is None:
        return None
    if isinstance(end_raw, int) and not isinstance(end_raw, bool):
        end = end_raw
    if end is None or end < start:
        end = start
    return start, end
