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
"""

from __future__ import annotations

import contextlib
import email.utils
import random
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from atp.wire.errors import AgentError, ErrorCode

__all__ = [
    "DETAIL_CHARS",
    "NO_RETRY",
    "ErrorOf",
    "RetryPolicy",
    "open_stream",
    "retry_after_ms",
    "status_error",
    "transport_error",
]

#: How much of an error body is quoted in a reason (characters).
DETAIL_CHARS = 300

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
    if status == 408:
        return AgentError(ErrorCode.ETIMEOUT, reason)
    if status >= 500 or status in (401, 403, 404, 429):
        return AgentError(ErrorCode.EAGENTDOWN, reason, retry_after_ms=retry_after_ms(response.headers))
    return AgentError(ErrorCode.EPROTO, reason)


def transport_error(e: httpx.HTTPError, base_url: str, timeout_ms: int) -> AgentError:
    """The AgentError for an httpx failure without an HTTP answer: connect
    failures (and other transport faults) EAGENTDOWN, timeouts ETIMEOUT."""
    if isinstance(e, httpx.ConnectTimeout):
        return AgentError(ErrorCode.EAGENTDOWN, f"cannot connect to {base_url}: {e!r}")
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
        wait = None
        if response.status_code in retry.statuses:
            # Jitter only spreads retries out; it needs no cryptographic randomness.
            wait = retry.delay_ms(attempt, error.retry_after_ms, random.random())  # nosec B311
        if wait is None:
            raise error
        await trio.sleep(wait / 1000)
        attempt += 1
