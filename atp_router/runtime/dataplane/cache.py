"""The response cache at run time (spec §13 "cache (content-addressed)"): a
policy with a ``cache`` key (:class:`~atp_router.policy.rib.CacheSpec`) has its
next-hop answers stored in the durable store and a repeated call served from it.

Keys, values and freshness are :mod:`atp_router.policy.cache` (sans-IO); this module
adds the store, the wall clock (entries outlive the process, so their times are
Unix ms, not trio time), the bounds and the metrics.

Per stream, :meth:`ResponseCache.view` gives the dispatcher a :class:`CacheView`
bound to the stream's tenant and policy (``None``: the policy does not cache, or
the router's cache is off with ``--cache-max-bytes 0``). For every attempt at a
next-hop, before it is admitted, the dispatcher asks :meth:`CacheView.serve`:

* **hit** — the stored report and text are replayed to the client as the
  agent's PARTIALs (marked ``"cached": true``, usage ``{}``) and become the
  attempt's answer. Nothing is estimated, reserved, charged or counted against
  a window, a QoS slot or the circuit breaker, and the next-hop is not called
  (``LegOutcome.called`` stays false, so the bandit and the live metrics learn
  nothing from a replay). The FINAL says so (:func:`annotate`): its
  ``telemetry.cached`` lists the agents served from the cache, their
  ``answers`` and every finding whose provenance is only cached agents carry
  ``cached: true``; tokens and USD in the telemetry are what was charged, 0 for
  them;
* **miss** — the call goes out as usual, and when it completes
  (:func:`~atp_router.policy.cache.cacheable`) :meth:`CacheView.record` stores it
  for ``ttl_s``.

Bounds: a value is at most :data:`MAX_ENTRY_BYTES` (and at most the cache's
size); the store keeps the values within ``max_bytes`` (``--cache-max-bytes``,
default :data:`DEFAULT_MAX_BYTES`), dropping expired entries first. **Per
tenant** (issue 19): each tenant's answers hold at most ``tenant_max_bytes``
(``--cache-tenant-max-bytes``, default a quarter of ``max_bytes``); storing one
drops only that tenant's own least recently used entries, never another
tenant's, and when the whole cache is full of other tenants' fresh entries the
answer is simply not stored (``atp_cache_stores{result="too_large"}``) — one
tenant filling the cache cannot evict another's. An entry of a policy with
``cache: {shared: true}`` counts against the budget of the tenant whose call
made it (its owner; a hit by another tenant refreshes it but does not move it):
a tenant cannot push out the shared entries others made, and what it shares
it pays for in its own budget. Tenants: the key holds the tenant unless the policy says
``shared: true``, so tenant B never gets tenant A's entry otherwise; the key also
holds the prompt *as the agent receives it* after the data-scope redaction, and
the task's ``data_scope`` labels, so a cached answer never stands in for a call
the tenant's labels would have shaped differently.

A store failure never fails a task: a lookup that fails is a miss, a write that
fails is dropped (both logged and counted).

Metrics (:class:`~atp_router.observability.metrics.RouterMetrics`): ``atp_cache_lookups``
(agent, result hit/miss), ``atp_cache_stores`` (result stored / too_large /
error), ``atp_cache_evictions`` (reason expired / size), ``atp_cache_bytes``,
``atp_cache_entries``, ``atp_cache_saved_tokens`` and
``atp_cache_saved_usd_micros`` (agent): what the hits did not spend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Prompt
from atp_router.consensus.types import ANSWER_CHARS, FinalResult
from atp_router.observability.metrics import RouterMetrics
from atp_router.policy.cache import (
    CacheEntry,
    CachePlan,
    approx_chars,
    cache_key,
    cacheable,
    decode_entry,
    encode_entry,
    fresh,
)
from atp_router.policy.rib import CacheSpec
from atp_router.store.base import Store, StoreError
from atp_router.task.body import TaskBody

__all__ = ["DEFAULT_MAX_BYTES", "MAX_ENTRY_BYTES", "CacheView", "ResponseCache", "annotate"]

log = logging.getLogger("atp_router.runtime.dataplane.cache")

#: The cache's default bound on its stored values (``--cache-max-bytes``): 64 MiB.
DEFAULT_MAX_BYTES = 64 << 20
#: The largest value stored (a bigger answer is served and not cached): 1 MiB.
MAX_ENTRY_BYTES = 1 << 20
#: Prompts with more characters than this are keyed in a worker thread (~0.5 ms
#: of encoding and hashing and up), not on the event loop.
_INLINE_KEY_CHARS = 64 * 1024



class ResponseCache:
    """The router's response cache on ``store`` (module docstring). ``max_bytes``
    bounds the stored values (0: off, no policy caches); ``clock`` gives Unix
    seconds."""

    def __init__(self, store: Store, metrics: RouterMetrics, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 tenant_max_bytes: int | None = None, clock: Callable[[], float] = time.time):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if tenant_max_bytes is not None and tenant_max_bytes <= 0:
            raise ValueError(f"tenant_max_bytes must be > 0, got {tenant_max_bytes}")
        self.store = store
        self.metrics = metrics
        self.max_bytes = max_bytes
        #: What one tenant's answers may hold of the cache (module doc, "Tenants").
        self.tenant_max_bytes = min(tenant_max_bytes or max(max_bytes // 4, 1), max_bytes)
        self.max_entry_bytes = min(MAX_ENTRY_BYTES, max_bytes)
        self.clock = clock
        if max_bytes:
            try:
                stats = store.cache_stats()
            except StoreError:
                log.exception("response cache: cannot read its size from the store")
            else:
                metrics.cache_entries.set(stats.entries)
                metrics.cache_bytes.set(stats.bytes)

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def view(self, tenant: str, plan: CachePlan | None, policy: str) -> CacheView | None:
        """The cache as stream of ``tenant`` routed by ``policy`` of a generation
        whose :class:`~atp_router.policy.cache.CachePlan` is ``plan`` sees it, or None
        when that policy does not cache (or the cache is off)."""
        if not self.max_bytes or plan is None:
            return None
        spec = plan.spec(policy)
        if spec is None:
            return None
        return CacheView(self, tenant, spec, plan.fingerprints)


class CacheView:
    """One stream's use of the cache: its tenant and its policy's
    :class:`~atp_router.policy.rib.CacheSpec`. The dispatcher calls :meth:`serve`
    before each attempt and :meth:`record` after one that answered."""

    def __init__(self, cache: ResponseCache, tenant: str, spec: CacheSpec, fingerprints: dict[str, str]):
        self.cache = cache
        self.tenant = tenant
        self.spec = spec
        self.fingerprints = fingerprints
        #: The key of each agent's last prompt (record stores under it without keying again).
        self._keys: dict[str, tuple[Prompt[TaskBody], bytes]] = {}

    @property
    def _scope(self) -> str | None:
        return None if self.spec.shared else self.tenant

    def _key_now(self, agent: str, prompt: Prompt[TaskBody]) -> bytes | None:
        fp = self.fingerprints.get(agent)
        if fp is None:
            return None
        return cache_key(agent=agent, fingerprint=fp, prompt=prompt, tenant=self._scope)

    async def _key(self, agent: str, prompt: Prompt[TaskBody]) -> bytes | None:
        """``agent``'s key for ``prompt`` (None: not cacheable), kept for :meth:`record`."""
        try:
            if approx_chars(prompt) > _INLINE_KEY_CHARS:
                key = await trio.to_thread.run_sync(partial(self._key_now, agent, prompt))
            else:
                key = self._key_now(agent, prompt)
        except (TypeError, ValueError, msgspec.EncodeError):
            log.warning("response cache: %s's prompt cannot be keyed: not cached", agent)
            key = None
        if key is not None:
            self._keys[agent] = (prompt, key)
        return key

    async def serve(self, io: Any, agent: str, prompt: Prompt[TaskBody], out: Any) -> bool:
        """Answer ``agent``'s attempt ``out`` (a
        :class:`~atp_router.runtime.dataplane.plan.LegOutcome`) for ``prompt`` — the prompt
        the agent would receive — from the cache. On a hit: emits the stored
        answer on ``io`` as the agent's PARTIALs, sets ``out.report``,
        ``out.text``, ``out.cached`` and ``out.usage`` (the stored call's, for
        the consensus cost scorer; nothing is charged) and returns True; the
        attempt is over.
        False on a miss: call the agent (and :meth:`record` its answer)."""
        key = await self._key(agent, prompt)
        if key is None:
            return False
        c = self.cache
        m = c.metrics
        now_ms = c.now_ms()
        try:
            value = c.store.cache_get(key, now_ms=now_ms)
        except StoreError:
            log.exception("response cache: lookup failed (a miss)")
            value = None
        entry = decode_entry(value) if value is not None else None
        if value is not None and entry is None:
            log.warning("response cache: a stored value for %s is not an entry: dropped", agent)
            self._drop(key)
        if entry is None or not fresh(entry, now_ms=now_ms, ttl_s=self.spec.ttl_s):
            m.cache_lookups.labels(agent, "miss").inc()
            return False
        out.report = entry.report
        out.text = entry.text
        # What the answer cost when it was made: the consensus cost scorer ranks
        # it as before (the same FINAL); charged stays 0 (the budget sees nothing).
        out.usage = entry.usage
        out.cached = True
        if entry.text:
            io.emit_partial(agent, {"agent": agent, "delta": entry.text, "cached": True})
        io.emit_partial(agent, {"agent": agent, "report": msgspec.to_builtins(entry.report), "usage": {},
                                "cached": True}, confidence=entry.report.confidence)
        m.cache_lookups.labels(agent, "hit").inc()
        m.cache_saved_tokens.labels(agent).inc(entry.usage.tokens)
        m.cache_saved_usd_micros.labels(agent).inc(entry.usage.usd_micros)
        return True

    def record(self, agent: str, prompt: Prompt[TaskBody], out: Any) -> None:
        """Store ``agent``'s answer ``out`` to ``prompt`` when it completed
        (:func:`~atp_router.policy.cache.cacheable`) for the policy's ``ttl_s``. Never
        raises: a failed write is logged and counted."""
        if not cacheable(report=out.report, error=out.error, cancelled=out.cancelled):
            return
        kept = self._keys.get(agent)
        key = kept[1] if kept is not None and kept[0] is prompt else None
        c = self.cache
        m = c.metrics
        try:
            if key is None:
                key = self._key_now(agent, prompt)
            if key is None:
                return
            now_ms = c.now_ms()
            value = encode_entry(CacheEntry(report=out.report, created_ms=now_ms, text=out.text[:ANSWER_CHARS + 1],
                                            usage=out.usage))
            if len(value) > c.max_entry_bytes:
                m.cache_stores.labels("too_large").inc()
                return
            # The entry counts against the budget of the tenant whose call made it,
            # shared (policy cache: {shared: true}) or not (module doc, "Tenants").
            put = c.store.cache_put(key, value, tenant=self.tenant, now_ms=now_ms,
                                    expires_ms=now_ms + int(self.spec.ttl_s * 1000), max_bytes=c.max_bytes,
                                    tenant_max_bytes=c.tenant_max_bytes)
        except (StoreError, TypeError, ValueError, msgspec.EncodeError):
            log.exception("response cache: storing %s's answer failed", agent)
            m.cache_stores.labels("error").inc()
            return
        m.cache_stores.labels("stored" if put.stored else "too_large").inc()
        if put.expired:
            m.cache_evictions.labels("expired").inc(put.expired)
        if put.evicted:
            m.cache_evictions.labels("size").inc(put.evicted)
        m.cache_entries.set(put.stats.entries)
        m.cache_bytes.set(put.stats.bytes)

    def _drop(self, key: bytes) -> None:
        try:
            self.cache.store.cache_drop(key)
        except StoreError:
            log.exception("response cache: dropping a bad value failed")


def annotate(final: FinalResult, attempts: Iterable[Any]) -> FinalResult:
    """``final`` with what the cache served marked (module docstring):
    ``telemetry.cached`` the agents whose answer came from the cache (sorted),
    ``cached: true`` on their answers and on each finding whose provenance
    (``"<agent>#<ref>"``) names only them. ``final`` itself when none did."""
    cached = sorted({o.agent for o in attempts if getattr(o, "cached", False)})
    if not cached:
        return final
    hit = set(cached)
    result = final.result
    findings = [
        msgspec.structs.replace(f, cached=True)
        if f.provenance and all(p.split("#", 1)[0] in hit for p in f.provenance) else f
        for f in result.findings
    ]
    answers = [msgspec.structs.replace(a, cached=True) if a.agent in hit else a for a in result.answers]
    return msgspec.structs.replace(
        final,
        result=msgspec.structs.replace(result, findings=findings, answers=answers),
        telemetry=msgspec.structs.replace(final.telemetry, cached=cached),
    )
