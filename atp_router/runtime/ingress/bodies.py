"""Request bodies at the HTTP ingresses (control API, OpenAI, A2A): bounded per
body, per tenant in flight, and decoded off the event loop when large.

* :func:`open_body` — before a body is read (and after the caller is
  authenticated, so its tenant is known): a grant in the router's
  :class:`~atp_router.flow.body_budget.BodyBudget` for the declared
  ``Content-Length``; a tenant with more body bytes in flight than its budget
  (``RouterConfig.tenant_body_bytes``) is refused with :class:`BodyRefused`
  (``EWINDOW``, HTTP 429, ``Retry-After``) **before a byte of the body is
  read**. The grant is kept on the request (``request.state.body_grant``) and
  released by the caller once the body is decoded.
* :func:`read_body` — the body, at most ``limit`` bytes (:class:`BodyTooLarge`,
  413, ``EPROTO``; a larger ``Content-Length`` is refused unread) and within the
  request's grant (a body without ``Content-Length`` grows it chunk by chunk:
  past the tenant's budget → :class:`BodyRefused`, the rest is not read).
* :func:`decode_off_loop` — ``fn(body)`` on the event loop for a small body, in
  a worker thread (``trio.to_thread``) for one of more than
  :data:`THREAD_DECODE_BYTES`: decoding 13 MB of JSON takes ~15–30 ms, and one
  tenant's upload must not hold another tenant's ``GET /v1/health`` that long
  (issue 20: health went from 25–41 ms to 122–158 ms while a 5.4 MB task was
  posted, all of it one task step).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio
from starlette.requests import Request

from atp_router.flow.body_budget import RETRY_AFTER_MS, BodyBudget, BodyGrant
from atp_router.wire.errors import ATPError, ErrorCode

__all__ = [
    "THREAD_DECODE_BYTES",
    "BodyRefused",
    "BodyTooLarge",
    "declared_length",
    "decode_off_loop",
    "open_body",
    "read_body",
    "release_body",
]

#: Bodies larger than this (bytes) are decoded in a worker thread.
THREAD_DECODE_BYTES = 256 * 1024

T = TypeVar("T")
B = TypeVar("B", bytes, str)


class BodyTooLarge(ATPError):
    """A request body over its limit (HTTP 413, code ``EPROTO``)."""

    def __init__(self, limit: int):
        super().__init__(ErrorCode.EPROTO, f"request body exceeds the limit of {limit} bytes")


class BodyRefused(ATPError):
    """The tenant has too many body bytes in flight (HTTP 429, code ``EWINDOW``,
    ``retry_after_ms``)."""

    def __init__(self, budget: BodyBudget, tenant: str):
        super().__init__(
            ErrorCode.EWINDOW,
            f"tenant {tenant!r} has {budget.in_flight(tenant):,} bytes of request bodies in flight; the limit "
            f"tenant_body_bytes={budget.per_tenant:,} is reached: retry when they are done",
            retry_after_ms=RETRY_AFTER_MS)


def declared_length(request: Request) -> int | None:
    """The request's ``Content-Length`` (None: absent or not a number)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def open_body(budget: BodyBudget, request: Request, tenant: str) -> BodyGrant:
    """Take ``tenant``'s grant for ``request``'s body (module doc) and keep it on
    the request. A declared length over the whole budget is not held (the
    body's own limit refuses it unread, 413). Raises :class:`BodyRefused`."""
    declared = declared_length(request)
    grant = budget.open(tenant, declared if declared is not None and declared <= budget.per_tenant else None)
    if grant is None:
        raise BodyRefused(budget, tenant)
    request.state.body_grant = grant
    return grant


def release_body(request: Request) -> None:
    """Release the request's grant, if it has one (idempotent)."""
    grant = getattr(request.state, "body_grant", None)
    if grant is not None:
        grant.release()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a larger ``Content-Length`` is
    refused before anything is read, and a body streamed past the limit is
    refused as soon as it passes it (memory stays bounded). Within the
    request's grant, when :func:`open_body` gave it one. Raises
    :class:`BodyTooLarge` or :class:`BodyRefused`."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise BodyTooLarge(limit)
    grant: BodyGrant | None = getattr(request.state, "body_grant", None)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        if grant is not None and not grant.grow(size):
            raise BodyRefused(grant._budget, grant.tenant)
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_off_loop(fn: Callable[[B], T], body: B) -> T:
    """``fn(body)`` (``body`` bytes or text), in a worker thread when it is longer than
    :data:`THREAD_DECODE_BYTES` (its exceptions propagate either way)."""
    if len(body) > THREAD_DECODE_BYTES:
        return await trio.to_thread.run_sync(partial(fn, body))
    return fn(body)
