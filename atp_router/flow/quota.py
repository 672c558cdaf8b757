"""A tenant's stream quota and open rate held across router processes (issue 22
item 3; spec §11 AuthZ, §19 resource abuse), sans-IO.

Each router decides a SYN against the tenant's ``clients.<tenant>`` entry
(:class:`~atp_router.security.authz.StreamAdmission`); alone, its quota and rate
are its own, so three routers admit three times a tenant's ``max_streams``.
Routers that share a store (``--store redis://…``, ``--workers N`` on one SQLite
file) keep per tenant, in the store:

* its **open streams**: one entry per stream, ``(owner router, stream id)`` with
  an expiry (Unix ms). A stream's close removes its entry; the reaper's settling
  of a lost router removes all of that owner's (``Store.quota_release_owned``);
  the owner renews its entries' expiry while it lives, so an entry that nobody
  removed (a router gone and never settled) ends at its expiry — nothing leaks;
* its **open rate** as GCRA (the generic cell rate algorithm, a token bucket
  kept as one number): the theoretical arrival time ``tat`` (ms). With the
  emission interval ``T = 1000 / per_s`` ms, a SYN at ``now`` is admitted when
  ``max(tat, now) + T - now <= burst * T`` — ``burst`` opens at once, then one
  every ``T`` —, and moves ``tat`` there; else it is refused with the wait
  until it would pass.

:func:`decide` is the decision of one SYN on that state; a store runs it — the
state read, decided and written in one atomic step (a Redis script, a SQLite
``BEGIN IMMEDIATE`` transaction) — and answers a :class:`QuotaGrant`::

    grant, tat = decide(open_now=3, held=False, tat_ms=None, now_ms=1_000, ask=QuotaAsk("t", "s1", 4, 50.0, 100))
    # QuotaGrant(admitted=True, open=4, refused=None, retry_after_ms=None), tat = 1_020.0

Checked in order (as :meth:`StreamAdmission.decide <atp_router.security.authz.StreamAdmission.decide>`):
the stream quota (``refused="streams"``), then the rate (``refused="rate"``,
``retry_after_ms`` = ms until a SYN would pass); a refused SYN takes no rate and
holds no entry. A stream already held (the same owner and id: a retried ask)
is admitted again without counting twice or taking the rate. Numbers are
milliseconds (``tat`` a float: sub-millisecond intervals at high rates).
"""

from __future__ import annotations

import math

from msgspec import Struct

__all__ = ["QuotaAsk", "QuotaGrant", "decide", "gcra"]


class QuotaAsk(Struct, frozen=True):
    """One SYN's ask: ``tenant`` opens ``stream_id``; its ``max_streams`` and its
    open rate (``per_s`` opens a second, bursts of ``burst``) from its RIB entry."""

    tenant: str
    stream_id: str
    max_streams: int
    per_s: float
    burst: int


class QuotaGrant(Struct, frozen=True):
    """The store's answer: ``admitted`` (the stream holds an entry now), the
    tenant's ``open`` streams after it, what refused it (``"streams"`` or
    ``"rate"``; None admitted) and, for the rate, ``retry_after_ms``."""

    admitted: bool
    open: int
    refused: str | None = None
    retry_after_ms: int | None = None


def gcra(tat_ms: float | None, now_ms: float, per_s: float, burst: int) -> tuple[float | None, int | None]:
    """One take of a GCRA bucket (module docstring) whose theoretical arrival
    time is ``tat_ms`` (None: never used, full): ``(new tat, None)`` when it
    passes, ``(None, ms until it would)`` when not. ``per_s > 0``, ``burst >= 1``."""
    interval = 1000.0 / per_s
    tat = now_ms if tat_ms is None else max(tat_ms, now_ms)
    new = tat + interval
    over = new - now_ms - burst * interval
    if over > 1e-9:
        return None, max(1, math.ceil(over))
    return new, None


def decide(*, open_now: int, held: bool, tat_ms: float | None, now_ms: float,
           ask: QuotaAsk) -> tuple[QuotaGrant, float | None]:
    """Decide ``ask`` on the tenant's state: ``open_now`` unexpired entries
    (this stream's included when ``held``), its open-rate ``tat_ms`` (None:
    none). Returns the grant and the ``tat`` to store (None: unchanged)."""
    if held:
        return QuotaGrant(True, open_now), None
    if open_now >= ask.max_streams:
        return QuotaGrant(False, open_now, "streams"), None
    tat, wait_ms = gcra(tat_ms, now_ms, ask.per_s, ask.burst)
    if tat is None:
        return QuotaGrant(False, open_now, "rate", wait_ms), None
    return QuotaGrant(True, open_now + 1), tat
