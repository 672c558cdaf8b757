"""Bytes of request bodies in flight, per tenant (spec §5 windows, §10 ``EWINDOW``;
issue 19 item 8). Sans-IO: no clock, no I/O.

The per-body limit (``max_body_bytes``, ``max_ws_message_bytes``) bounds one
body; it does not bound how many a tenant sends at once. Forty concurrent 16 MiB
bodies from one tenant took a router from 119 MB to 635 MB of RSS and another
tenant's ``GET /v1/health`` to 5.3 s. :class:`BodyBudget` is the missing window:
each tenant may have at most ``per_tenant`` bytes of request bodies being
received or decoded at once, across every ingress (HTTP control API, OpenAI,
A2A, WebSocket). It is a window in the sense of spec §5 (a limit on what is
outstanding), and going over it is answered as a window is: ``EWINDOW`` with a
retry hint (HTTP 429 with ``Retry-After``; an ERROR frame on the WebSocket).

How an ingress uses it (the decisions are returned, never acted on here):

* :meth:`BodyBudget.open` when a body starts, with its declared size
  (``Content-Length``) if it has one → a :class:`BodyGrant`, or ``None``: the
  tenant is over its budget and the body must be refused **without reading
  it** (the grant holds the declared bytes from the start, so a tenant cannot
  start more bodies than its budget holds);
* :meth:`BodyGrant.grow` for each chunk of a body without a declared size (or
  one that runs past it) → ``False``: over the budget, stop reading;
* :meth:`BodyGrant.release` when the body is decoded (or refused, or the
  request ends): its bytes leave the tenant's count. Idempotent.

A body is held from its first byte until it is decoded: the raw bytes, their
join and the decoded value coexist only then. What a decoded task keeps for
its run (its content in the stream table) is bounded by the stream quotas, not
here.

Numbers: ``per_tenant`` is in bytes; a single body larger than ``per_tenant``
can never be admitted, so ``per_tenant`` must be at least the largest body
limit of the ingresses (``RouterConfig.tenant_body_bytes`` defaults to twice
``max_body_bytes``: two full-size bodies at once). :attr:`BodyBudget.refused`
counts refusals per tenant (metrics).
"""

from __future__ import annotations

from typing import Self

__all__ = ["RETRY_AFTER_MS", "BodyBudget", "BodyGrant"]

#: The retry hint of a refusal (ms): bodies in flight end within about a
#: round trip of their upload, so a second is a fair first back-off.
RETRY_AFTER_MS = 1000


class BodyGrant:
    """The bytes one body holds in its tenant's budget (:meth:`BodyBudget.open`)."""

    __slots__ = ("_budget", "held", "released", "tenant")

    def __init__(self, budget: BodyBudget, tenant: str, held: int) -> None:
        self._budget = budget
        self.tenant = tenant
        #: Bytes this body holds now.
        self.held = held
        self.released = False

    def grow(self, size: int) -> bool:
        """The body has reached ``size`` bytes: hold them (a grant never
        shrinks before :meth:`release`). ``False`` (nothing changed) when the
        tenant's budget cannot hold them: stop reading and refuse the body."""
        if self.released:
            raise RuntimeError("grow() after release()")
        extra = size - self.held
        if extra <= 0:
            return True
        if not self._budget._take(self.tenant, extra):
            return False
        self.held = size
        return True

    def release(self) -> None:
        """The body is decoded, refused or abandoned: its bytes leave the
        tenant's count. Idempotent."""
        if self.released:
            return
        self.released = True
        self._budget._give(self.tenant, self.held)
        self.held = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BodyBudget:
    """At most ``per_tenant`` bytes of request bodies in flight per tenant
    (module doc). ``per_tenant`` must be positive."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant <= 0:
            raise ValueError(f"per_tenant must be > 0 bytes, got {per_tenant}")
        self.per_tenant = per_tenant
        self._in_flight: dict[str, int] = {}
        #: Bodies refused per tenant since start.
        self.refused: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        """Bytes of ``tenant``'s bodies held now."""
        return self._in_flight.get(tenant, 0)

    def open(self, tenant: str, declared: int | None = None) -> BodyGrant | None:
        """A body of ``tenant`` starts, ``declared`` bytes long when it says so
        (``Content-Length``; None: unknown, the grant grows as it is read).
        Returns its grant, or None when the tenant's budget cannot hold it now
        (refuse the body unread: ``EWINDOW``, retry after
        :data:`RETRY_AFTER_MS`). A body that declares more than ``per_tenant``
        is refused too (it could never fit)."""
        size = max(int(declared or 0), 0)
        if not self._take(tenant, size):
            return None
        return BodyGrant(self, tenant, size)

    def _take(self, tenant: str, n: int) -> bool:
        have = self._in_flight.get(tenant, 0)
        if have + n > self.per_tenant:
            self.refused[tenant] = self.refused.get(tenant, 0) + 1
            return False
        if n:
            self._in_flight[tenant] = have + n
        return True

    def _give(self, tenant: str, n: int) -> None:
        left = self._in_flight.get(tenant, 0) - n
        if left > 0:
            self._in_flight[tenant] = left
        else:
            self._in_flight.pop(tenant, None)
