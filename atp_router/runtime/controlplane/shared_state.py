"""Learning and circuit breakers shared by the routers of one store (issue 12).

Several router processes on one store — ``atp-router --workers N`` on the
embedded SQLite store, or routers on a shared store (``--store redis://…``,
:mod:`atp_router.deploy.cluster`) — run :func:`background_tasks` as one of
their background services; it switches the router to shared mode and returns the
loops that keep it so:

* **learning** (:meth:`~atp_router.runtime.controlplane.learning.Learning.sync_shared`, every
  :data:`~atp_router.runtime.controlplane.learning.SHARED_SYNC_S` and once more at shutdown): the
  bandit arms and the live FIB statistics are *merged* — each router pushes
  what it learned since its last sync and adopts the merged result — never
  last-writer-wins: an arm's observation count is the sum of every router's.
  The merge math is sans-IO in :mod:`atp_router.policy.bandit` (natural parameters of
  the diagonal Gaussian posteriors add) and :mod:`atp_router.policy.learn` (decayed
  sums fold in as ``shared·(1−α)^n + contribution``).
* **circuit breakers** (:class:`~atp_router.flow.breaker.BreakerShare`): a breaker
  opening on this router's own evidence is published at once to
  ``breaker/<agent>`` (``{state, open_until_ms, owner, reason, openings,
  at_ms}``, wall-clock ms); every :data:`BREAKER_POLL_S` each router reads
  ``breaker/`` and forces its breaker of an agent another router opened open
  until that deadline, then probes it itself (HALF_OPEN as usual); a router
  whose probe succeeds publishes ``closed``. **Bound**: every router's
  breaker is open within :data:`BREAKER_POLL_S` + two store round trips (the
  publishing write and the follower's read) of the opening — about 0.5 s on a
  loopback store, plus the event loop's own latency under load. A tenant's
  client-fault errors never open a breaker, so they never reach the others.

A store that cannot be reached (``StoreUnavailable``) skips a round: what was
not pushed or published is the next round's (logged once per outage).

Still per router: each bandit's λ (its dual ascent follows this router's
choices), a tenant's learning rate (``learn_rate_per_s`` is per router, so N
routers let a tenant teach N times as fast), and the breakers' failure counts
(an agent failing a little on every router opens each router's breaker only
at its own threshold; the first router to open it opens it everywhere).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import trio

from atp_router.flow.breaker import BreakerBoard, BreakerShare, BreakerTransition
from atp_router.runtime.controlplane.learn_entries import SEQ_KEY
from atp_router.runtime.controlplane.learning import SHARED_SYNC_S
from atp_router.store import StoreError
from atp_router.store.threads import off_loop

if TYPE_CHECKING:
    from atp_router.runtime.controlplane.control import ControlPlane
    from atp_router.runtime.controlplane.learning import Learning
    from atp_router.runtime.router import Router
    from atp_router.store import Store

__all__ = ["BREAKER_POLL_S", "BREAKER_PREFIX", "background_tasks"]

log = logging.getLogger("atp_router.runtime.controlplane.shared_state")

#: How often a router reads the other routers' breaker records, s.
BREAKER_POLL_S = 0.5
#: Store kv prefix of the breaker records (``breaker/<agent>``, JSON).
BREAKER_PREFIX = "breaker/"


def background_tasks(router: Router, owner: str) -> list[Callable[[], Awaitable[None]]]:
    """Switch ``router`` to shared learning and breakers and return the loops
    that keep them shared (see the module doc): a background service of the
    router (:data:`~atp_router.runtime.deployment.Service`, ``Router(services=[...])``),
    called once when it starts serving, before traffic. ``owner`` (its name in
    the store) names it in the breaker records. The loops are given the
    router's parts they use (its learning, store, breakers and control plane),
    not the router."""
    router.learning.share()
    share = BreakerShare(owner)
    wake = _Wake()

    def on_transition(t: BreakerTransition) -> None:
        if share.on_transition(t, _now_ms()):
            wake.set()

    router.gates.breakers.add_listener(on_transition)
    return [functools.partial(_sync_learning, router.learning),
            functools.partial(_publish_breakers, router.store, share, wake),
            functools.partial(_follow_breakers, router.store, router.gates.breakers, router.control, share)]


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Wake:
    """A re-armable trio event: the breaker listener sets it from the call path."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event = trio.Event()


class _Outage:
    """Logs a store outage once per loop, and its end."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.down = False

    def failed(self, e: Exception) -> None:
        if not self.down:
            log.warning("shared %s: the store is unavailable (%s); retrying", self.what, e)
        self.down = True

    def ok(self) -> None:
        if self.down:
            log.info("shared %s: the store is back", self.what)
        self.down = False


def _sync_once(learning: Learning, outage: _Outage, index_raw: bytes | None | Literal[False] = False) -> None:
    try:
        learning.sync_shared(index_raw)
    except StoreError as e:
        outage.failed(e)
    except Exception:
        log.exception("shared learning: sync failed")
    else:
        outage.ok()


async def _sync_learning(learning: Learning) -> None:
    outage = _Outage("learning")
    try:
        while True:
            await trio.sleep(SHARED_SYNC_S)
            try:
                # Its first read in a store thread: a store that stalls holds that thread, and
                # the writes that follow fail fast (the store's back-off) instead of blocking here.
                index_raw = await off_loop(learning.store, learning.store.get, SEQ_KEY)
            except StoreError as e:
                outage.failed(e)
                continue
            _sync_once(learning, outage, index_raw)
    finally:
        _sync_once(learning, outage)  # synchronous store calls: runs to the end when cancelled


async def _publish_breakers(store: Store, share: BreakerShare, wake: _Wake) -> None:
    """Publish each breaker opening (or closing) as it happens."""
    outage = _Outage("breakers")
    while True:
        if not share.pending:
            await wake.wait()
        records = share.take()
        failed: dict[str, dict[str, Any]] = {}
        for agent, rec in records.items():
            try:
                store.update(f"{BREAKER_PREFIX}{agent}",
                                    functools.partial(_merge_record, rec, _now_ms()))
            except StoreError as e:
                outage.failed(e)
                failed[agent] = rec
            except Exception:
                log.exception("shared breakers: publishing %s failed", agent)
            else:
                outage.ok()
                log.debug("shared breakers: %s published %s", agent, rec["state"])
        if failed:
            share.restore(failed)
            await trio.sleep(BREAKER_POLL_S)  # retried when the store is back


def _merge_record(rec: dict[str, Any], now_ms: int, old: bytes | None) -> bytes:
    existing = None
    if old is not None:
        try:
            existing = json.loads(old)
        except ValueError:
            existing = None
    return json.dumps(BreakerShare.merge(existing, rec, now_ms)).encode()


async def _follow_breakers(store: Store, breakers: BreakerBoard, control: ControlPlane,
                           share: BreakerShare) -> None:
    """Every :data:`BREAKER_POLL_S`: apply the other routers' breaker records."""
    outage = _Outage("breaker follower")
    while True:
        try:
            items = await off_loop(store, store.items, BREAKER_PREFIX)  # a store thread: a stalled store holds it
        except StoreError as e:
            outage.failed(e)
            items = None
        except Exception:
            log.exception("shared breakers: reading the records failed")
            items = None
        if items is not None:
            outage.ok()
            records = {}
            for key, raw in items:
                try:
                    records[key.removeprefix(BREAKER_PREFIX)] = json.loads(raw)
                except ValueError:
                    continue
            moved = share.follow(breakers, records, now=trio.current_time(), now_ms=_now_ms(),
                                 agents=control.gen.rib.agents)
            for agent, rec in moved:  # the transition itself is logged once, by the router
                log.debug("circuit breaker of %s: %s by router %s (%s)", agent, rec.get("state"), rec.get("owner"),
                          rec.get("reason"), extra={"agent": agent})
        await trio.sleep(BREAKER_POLL_S)
