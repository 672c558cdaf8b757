"""HTTP plumbing shared by the model and remote-agent adapters (spec §10, §14).

* :func:`status_error` / :func:`transport_error` map an HTTP failure onto the ATP
  error an adapter raises (``AgentError``)::

      connect failure, 5xx, 429, 401/403/404     EAGENTDOWN (retry_after_ms from Retry-After)
      read/write/pool timeout, 408               ETIMEOUT
      other 4xx                                  EPROTO

* :func:`retry_after_ms` reads ``retry-after-ms`` / ``Retry-After`` (seconds or an
  HTTP-date);
* :class:`RetryPolicy` and :func:`open_stream`: a streaming request retried with
  exponential backoff (and jitter) on 429/5xx answers, never sooner than the
  server's Retry-After. Only answers that carry no body stream are retried: once a
  response is 2xx and handed to the caller, its failures are the caller's. A wait
  longer than ``cap_ms`` is not slept: the error goes up with its
  ``retry_after_ms`` so the router can reroute (spec §10, EAGENTDOWN).
* :func:`sse_data` / :func:`json_object`: the ``data`` of a Server-Sent Events
  answer and one JSON object of a stream, EPROTO when malformed;
* :class:`HTTPNextHop`: the base of the HTTP next-hops (chat models, Agent API,
  A2A): one httpx client made on first use, health from the recent calls, usage
  priced by :meth:`HTTPNextHop._price`, failures stamped with the agent and
  scrubbed of the Agent Context's secrets; with tracing on (spec §12), every
  request carries the W3C ``traceparent`` of its leg span
  (:func:`atp_router.observability.tracing.httpx_hooks`).
"""

from __future__ import annotations

import abc
import contextlib
import email.utils
import json
import os
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import httpx_sse
import trio

from atp_router.adapters.base import CallStats, ProviderAdapter, estimate_tokens
from atp_router.adapters.context import scrub_error
from atp_router.consensus.types import Usage
from atp_router.observability import tracing
from atp_router.policy.health import Health
from atp_router.wire.errors import AgentError, ErrorCode

__all__ = [
    "DETAIL_CHARS",
    "NO_RETRY",
    "POOL_LIMITS",
    "ErrorOf",
    "HTTPNextHop",
    "RetryPolicy",
    "code_of_status",
    "env_secret",
    "json_object",
    "open_stream",
    "retry_after_ms",
    "retry_wait_ms",
    "sse_data",
    "status_error",
    "token_count",
    "transport_error",
]

#: How much of an error body is quoted in a reason (characters).
DETAIL_CHARS = 300

#: The connection pool of a next-hop's httpx client: at most this many calls to one
#: next-hop at once per router process (httpx's default, 100, is below what a RIB's
#: ``window.max_parallel`` may allow: the rest would wait in the pool holding their
#: reservations), of which this many idle connections are kept.
POOL_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=100)

#: Builds the AgentError for a failed answer from the response and its body.
ErrorOf = Callable[[httpx.Response, bytes], AgentError]


def retry_after_ms(headers: httpx.Headers | dict[str, str]) -> int | None:
    """``retry-after-ms`` (ms), else ``Retry-After`` as seconds or an HTTP-date,
    as a non-negative delay in ms; ``None`` when absent or unreadable."""
    headers = httpx.Headers(headers)
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        with contextlib.suppress(ValueError):
            return max(0, int(float(raw_ms)))
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0, int(float(raw) * 1000))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    # An HTTP-date is wall-clock time, so the wall clock is the reference here.
    return max(0, int((when.timestamp() - time.time()) * 1000))


def status_error(response: httpx.Response, body: bytes, *, detail: str | None = None) -> AgentError:
    """The AgentError for an HTTP error answer (status ≥ 400), per the table in
    the module docstring. ``detail`` replaces the quoted body (first
    :data:`DETAIL_CHARS` characters) in the reason."""
    status = response.status_code
    if detail is None:
        detail = body.decode("utf-8", "replace").strip()[:DETAIL_CHARS]
    origin = f"{response.request.url.scheme}://{response.request.url.netloc.decode()}"
    reason = f"HTTP {status} from {origin}: {detail or response.reason_phrase}"
    code = code_of_status(status)
    if code is ErrorCode.EAGENTDOWN:
        return AgentError(code, reason, retry_after_ms=retry_after_ms(response.headers))
    return AgentError(code, reason)


def code_of_status(status: int) -> ErrorCode:
    """The ATP error code of an HTTP error status (≥ 400), per the table in the
    module docstring: 408 ETIMEOUT; 5xx, 429, 401/403/404 EAGENTDOWN; else EPROTO."""
    if status == 408:
        return ErrorCode.ETIMEOUT
    if status >= 500 or status in (401, 403, 404, 429):
        return ErrorCode.EAGENTDOWN
    return ErrorCode.EPROTO


def transport_error(e: httpx.HTTPError, base_url: str, timeout_ms: int) -> AgentError:
    """The AgentError for an httpx failure without an HTTP answer: connect
    failures (and other transport faults) EAGENTDOWN, timeouts ETIMEOUT."""
    if isinstance(e, httpx.ConnectTimeout):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {base_url}: {e!r}", timed_out=True)
    if isinstance(e, httpx.TimeoutException):
        return AgentError(ErrorCode.ETIMEOUT, f"{type(e).__name__} after {timeout_ms} ms")
    if isinstance(e, httpx.ConnectError):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {base_url}: {e}")
    return AgentError(ErrorCode.EAGENTDOWN, f"{type(e).__name__}: {e}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of one call: at most ``retries`` more attempts after an answer
    whose status is in ``statuses``; before attempt ``n`` (0-based retry count)
    wait ``base_ms * 2**n`` ms (times a factor in [0.5, 1) with ``jitter``), but
    never less than the answer's Retry-After; give up when that wait would pass
    ``cap_ms``."""

    retries: int = 2
    base_ms: int = 500
    cap_ms: int = 8_000
    statuses: Collection[int] = frozenset({429, 500, 502, 503, 504})
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.retries < 0 or self.base_ms < 0 or self.cap_ms < 0:
            raise ValueError("retries, base_ms and cap_ms must be >= 0")

    def delay_ms(self, attempt: int, retry_after: int | None, rand: float = 0.0) -> int | None:
        """The wait (ms) before retry number ``attempt`` (0-based), or ``None`` to
        give up: retries exhausted, or the wait passes ``cap_ms``. ``rand`` in
        [0, 1) draws the jitter."""
        if attempt >= self.retries:
            return None
        backoff = self.base_ms * 2**attempt
        if self.jitter:
            backoff = backoff * (0.5 + rand / 2)
        wait = max(int(backoff), retry_after or 0)
        return wait if wait <= self.cap_ms else None


#: No retries (the OpenAI-compatible adapter's default).
NO_RETRY = RetryPolicy(retries=0)


@contextlib.asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    retry: RetryPolicy = NO_RETRY,
    error_of: ErrorOf = status_error,
    **kwargs: Any,
) -> AsyncIterator[httpx.Response]:
    """Send a streaming request and yield its successful (< 400) response, open.

    An answer ≥ 400 is read (its body closes the attempt) and turned into an
    AgentError by ``error_of``; if its status is retryable under ``retry`` and a
    wait is due, the request is sent again after ``trio.sleep``; otherwise the
    error is raised. ``kwargs`` go to ``client.stream``. httpx exceptions are not
    mapped here (see :func:`transport_error`).
    """
    attempt = 0
    while True:
        async with client.stream(method, url, **kwargs) as response:
            if response.status_code < 400:
                yield response
                return
            error = error_of(response, await response.aread())
        wait = retry_wait_ms(retry, response.status_code, error, attempt)
        if wait is None:
            raise error
        await trio.sleep(wait / 1000)
        attempt += 1


def retry_wait_ms(retry: RetryPolicy, status: int, error: AgentError, attempt: int) -> int | None:
    """How long to wait before sending attempt ``attempt + 1`` again after an
    answer ``status`` that ``error`` describes, in ms; ``None``: do not retry
    (status not retryable under ``retry``, or its attempts are spent)."""
    if status not in retry.statuses:
        return None
    # Jitter only spreads retries out; it needs no cryptographic randomness.
    return retry.delay_ms(attempt, error.retry_after_ms, random.random())  # nosec B311


#: Where adapters read the secrets a RIB names (``api_key_env``, ``auth_env``):
#: the router installs its policy-secrets resolver (declared names only, values
#: from ``--policy-secrets-file`` or the environment; spec §11); standalone use
#: (``atp-agent2389``, tests) reads the environment.
_resolver: Callable[[str], str | None] = os.environ.get


def install_secret_resolver(resolver: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """Make every adapter read RIB-named secrets through ``resolver`` (None: the
    environment again). Returns the resolver it replaces, so a router that stops
    can put it back."""
    global _resolver
    previous = _resolver
    _resolver = resolver if resolver is not None else os.environ.get
    return previous


def secret_value(variable: str) -> str | None:
    """The value of RIB-named secret ``variable`` (see :func:`install_secret_resolver`)."""
    return _resolver(variable)


def env_secret(variable: str, what: str = "credential") -> str:
    """The value of the secret ``variable`` a RIB names, read at each call so a
    rotated secret needs no reload (through the router's policy-secrets resolver
    when it runs one). Raises AgentError(EAGENTDOWN) ``"<what> variable
    <variable> is not set"`` when it is unset, empty or not declared for policies."""
    value = _resolver(variable)
    if not value:
        raise AgentError(ErrorCode.EAGENTDOWN, f"{what} variable {variable} is not set")
    return value


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each Server-Sent Event of ``response``, in order. Raises
    AgentError(EPROTO) ``"not an SSE stream: …"`` when the answer is not one."""
    try:
        async with contextlib.aclosing(httpx_sse.EventSource(response).aiter_sse()) as events:
            async for event in events:
                yield event.data
    except httpx_sse.SSEError as e:
        raise AgentError(ErrorCode.EPROTO, f"not an SSE stream: {e}") from None


def json_object(text: str, *, bad_json: str = "bad JSON in SSE data",
                not_object: str = "SSE data is not a JSON object") -> dict[str, Any]:  # fmt: skip
    """``text`` (one SSE ``data``, one NDJSON line) decoded as a JSON object. Raises
    AgentError(EPROTO) ``"<bad_json>: <text>"`` for invalid JSON and ``"<not_object>:
    <text>"`` for another JSON value (the text quoted up to 120 characters)."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise AgentError(ErrorCode.EPROTO, f"{bad_json}: {text[:120]!r}") from None
    if not isinstance(obj, dict):
        raise AgentError(ErrorCode.EPROTO, f"{not_object}: {text[:120]!r}")
    return obj


def token_count(value: Any) -> int | None:
    """``value`` when it is a token count a server may report (an int ≥ 0, not a
    bool), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class HTTPNextHop(ProviderAdapter):
    """Base of the next-hops that speak HTTP (chat models, Agent API, A2A).

    A subclass's ``__init__`` sets ``name`` and calls :meth:`_init_http`; it
    records each call with :meth:`_succeeded` or raises ``self._fail(error, t0,
    secrets)``, and defines :meth:`_price` (USD micros of a call).
    """

    timeout_ms: int

    def _init_http(self, *, timeout_ms: int, transport: httpx.AsyncBaseTransport | None,
                   base_url: str = "") -> None:  # fmt: skip
        """``timeout_ms`` bounds each network wait (connect at most 10 s);
        ``base_url`` prefixes relative request URLs; ``transport`` replaces httpx's
        network transport."""
        self.timeout_ms = timeout_ms
        self._base_url = base_url
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._stats = CallStats()
        self._tls: ssl.SSLContext | None = None

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Verify the next-hop's certificate with ``context`` (its CA, and the
        router's client certificate for mTLS: :func:`atp_router.security.tls.client_context`)
        instead of the system defaults. Call before the first request."""
        self._tls = context

    def health(self) -> Health:
        """p95 latency (ms) and error rate over the last ~100 calls; ``up`` is false
        after a call found the next-hop unreachable (EAGENTDOWN)."""
        return self._stats.health()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            t = self.timeout_ms / 1000
            self._client = httpx.AsyncClient(
                base_url=self._base_url,
                timeout=httpx.Timeout(t, connect=min(t, 10.0)),
                limits=POOL_LIMITS,
                transport=self._transport,
                verify=self._tls if self._tls is not None else True,
                event_hooks=tracing.httpx_hooks(self.name),
            )
        return self._client

    @abc.abstractmethod
    def _price(self, in_tokens: int, out_tokens: int) -> int:
        """USD micros of a call that used ``in_tokens`` + ``out_tokens``."""

    def _usage(self, est_in: int, out_chars: int, reported: tuple[int | None, int | None] | None = None) -> Usage:
        # Until (or unless) the server reports usage, count the prompt as estimated
        # and the output as chars/4: a stream cut short is still charged.
        rep_in, rep_out = reported if reported is not None else (None, None)
        in_tok = rep_in if rep_in is not None else est_in
        out_tok = rep_out if rep_out is not None else estimate_tokens(out_chars)
        return Usage(in_tok, out_tok, self._price(in_tok, out_tok))

    def _succeeded(self, t0: float) -> None:
        """Record a call started at ``t0`` (trio time, s) that succeeded."""
        self._stats.record((trio.current_time() - t0) * 1000, ok=True)

    def _fail(self, e: AgentError, t0: float, secrets: Iterable[str] = ()) -> AgentError:
        """``e`` stamped with this agent and with ``secrets`` masked (a peer may echo
        the request, Agent Context included), recorded as a failed call started at
        ``t0``; returned for the caller to raise."""
        e.agent = e.agent or self.name
        scrub_error(e, secrets)
        self._stats.record((trio.current_time() - t0) * 1000, ok=False, down=e.code is ErrorCode.EAGENTDOWN)
        return e
