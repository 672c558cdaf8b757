"""The content-addressed response cache, sans-IO (spec §13 "cache (content-addressed)").

What a cached answer is keyed by, what is stored, and when a stored answer may be
served. No store, no clock: :mod:`atp_router.runtime.dataplane.cache` holds the store
(:meth:`~atp_router.store.base.Store.cache_get` / :meth:`~atp_router.store.base.Store.cache_put`)
and passes the time in.

**Key** (:func:`cache_key`): SHA-256 over the canonical JSON (sorted keys, compact)
of ::

    ["atp-cache", KEY_VERSION, scope, agent, fingerprint,
     task_type, instruction, content, meta without VOLATILE_META]

* ``scope`` is ``["tenant", <name>]`` — or ``["shared"]`` when the policy's
  ``cache.shared`` is true — so no hit crosses tenants unless a policy says so;
* ``agent`` the RIB agent name and ``fingerprint`` :func:`agent_fingerprint`:
  SHA-256 of the agent's compiled RIB entry and its model's, less the keys
  that only steer the router (:data:`ROUTER_AGENT_KEYS`,
  :data:`ROUTER_MODEL_KEYS`): a changed tool, model, endpoint, option,
  temperature, scope or data clearance is another key; a changed window,
  price or win rate is not;
* ``task_type``, ``instruction``, ``content`` and ``meta`` are the
  :class:`~atp_router.adapters.base.Prompt` *the adapter would receive*: after the
  data-scope redaction for that agent (spec §11), with the escalation's
  evidence if any. A cached answer therefore never reaches an agent's input
  the agent would not have seen: another redaction, another label
  (``meta.data_scope`` is part of the key), another key;
* ``meta`` keeps every field but the volatile ones (:data:`VOLATILE_META`:
  hop ``ttl``, replay ``ts`` / ``nonce``, ``trace`` / ``traceparent`` /
  ``tracestate``, ``idempotency_key``, ``budget``, ``resume_after``,
  ``subscribe``, ``route``, ``usage``). ``task_type``, ``languages``, ``risk``,
  ``data_scope``, ``diff_loc``, ``agent_context`` and any unknown field stay:
  a field we do not know is assumed to change the answer (a miss, never a
  wrong hit).

**Value** (:class:`CacheEntry`, msgpack): the agent's validated
:class:`~atp_router.consensus.types.AgentReport`, its streamed text (at most
:data:`~atp_router.consensus.types.ANSWER_CHARS` + 1 characters: what the FINAL keeps
of it, and whether it was cut), the usage of the call that made it (what
each hit saves) and when it was made (Unix ms). Only an attempt that answered
— no error, not cancelled, not cut by the budget — is stored
(:func:`cacheable`); a value larger than the store's entry bound is not
stored. A value read back is decoded strictly (:func:`decode_entry`): bytes
that are not an entry are a miss, never an answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, Protocol

import msgspec
from msgspec import Meta, Struct

from atp_router.consensus.types import ANSWER_CHARS, AgentReport, Usage
from atp_router.policy.rib import AgentSpec, CacheSpec, Rib

__all__ = [
    "KEY_VERSION",
    "ROUTER_AGENT_KEYS",
    "ROUTER_MODEL_KEYS",
    "VOLATILE_META",
    "CacheEntry",
    "CachePlan",
    "Prompt",
    "agent_fingerprint",
    "approx_chars",
    "cache_key",
    "cacheable",
    "compile_cache",
    "decode_entry",
    "encode_entry",
    "fresh",
]

#: Bumped when the key's encoding changes: old entries are then never hit (they
#: age out by TTL and size).
KEY_VERSION = 1

#: Task meta fields that differ between two requests for the same work and are
#: not part of the key (see the module docstring).
VOLATILE_META: frozenset[str] = frozenset({
    "ttl", "ts", "nonce", "trace", "traceparent", "tracestate", "idempotency_key", "budget", "resume_after",
    "subscribe", "route", "usage",
})

#: ``agents.<name>`` keys that steer the router, not the agent's answer.
ROUTER_AGENT_KEYS: tuple[str, ...] = (
    "p95_ms", "qos", "win30d", "strengths", "timeout_ms", "window", "fallback", "calibration",
)
#: ``models.<name>`` keys that steer the router (ECMP, pricing), not the answer.
ROUTER_MODEL_KEYS: tuple[str, ...] = ("cost", "cost_in", "cost_out", "speed", "strengths")

_canonical = msgspec.json.Encoder(order="sorted")


class CacheEntry(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One stored answer (the module docstring): ``report`` and ``text`` as the
    agent gave them, ``usage`` of the call that produced them (tokens, USD
    micros), ``created_ms`` Unix ms."""

    report: AgentReport
    created_ms: Annotated[int, Meta(ge=0)]
    text: Annotated[str, Meta(max_length=ANSWER_CHARS + 1)] = ""
    usage: Usage = msgspec.field(default_factory=Usage)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CacheEntry)


def encode_entry(entry: CacheEntry) -> bytes:
    """``entry`` as stored (msgpack)."""
    return _encoder.encode(entry)


def decode_entry(value: bytes) -> CacheEntry | None:
    """The entry stored as ``value``, or None when the bytes are not a valid
    entry (a foreign or damaged value is a miss, never an answer)."""
    try:
        return _decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def agent_fingerprint(rib: Rib, agent: str) -> str:
    """Hex SHA-256 of RIB agent ``agent``'s entry and its model's, less
    :data:`ROUTER_AGENT_KEYS` / :data:`ROUTER_MODEL_KEYS`; raises KeyError for
    an agent the RIB does not have."""
    spec: AgentSpec = rib.agents[agent]
    a = msgspec.to_builtins(spec)
    for k in ROUTER_AGENT_KEYS:
        a.pop(k, None)
    model = rib.models.get(spec.model) if spec.model is not None else None
    m = msgspec.to_builtins(model) if model is not None else None
    if m is not None:
        for k in ROUTER_MODEL_KEYS:
            m.pop(k, None)
    return hashlib.sha256(_canonical.encode([a, m])).hexdigest()


class Prompt(Protocol):
    """What a cache key reads of a prompt: the fields of the adapters'
    :class:`~atp_router.adapters.base.Prompt`, named structurally (the policy layer reads
    a prompt's fields, it needs no adapter)."""

    @property
    def task_type(self) -> str: ...
    @property
    def instruction(self) -> str: ...
    @property
    def content(self) -> Mapping[str, Any]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...


def cache_key(*, agent: str, fingerprint: str, prompt: Prompt, tenant: str | None) -> bytes:
    """The 32-byte key of ``agent``'s answer to ``prompt`` (the prompt that agent
    receives) for ``tenant`` (None: shared by every tenant). Raises
    ``TypeError`` for content JSON cannot encode (not a task the router decoded)."""
    scope = ["shared"] if tenant is None else ["tenant", tenant]
    meta = {k: v for k, v in prompt.meta.items() if k not in VOLATILE_META}
    doc = ["atp-cache", KEY_VERSION, scope, agent, fingerprint, prompt.task_type, prompt.instruction,
           prompt.content, meta]
    return hashlib.sha256(_canonical.encode(doc)).digest()


def approx_chars(prompt: Prompt) -> int:
    """A cheap lower bound of the prompt's encoded size in characters (its
    strings one level deep: the diff and the files), to decide whether keying it
    is worth a worker thread."""
    n = 0
    for v in prompt.content.values():
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, Mapping):
            n += sum(len(x) for x in v.values() if isinstance(x, str))
    return n


def cacheable(*, report: AgentReport | None, error: Any, cancelled: bool) -> bool:
    """May an attempt's answer be stored? Only one that completed: a report, no
    error (a failure, a budget cut ``EBUDGET``, a timeout), not cancelled."""
    return report is not None and error is None and not cancelled


def fresh(entry: CacheEntry, *, now_ms: int, ttl_s: float) -> bool:
    """Is ``entry`` young enough for a policy with ``ttl_s`` at ``now_ms``? (A
    stored entry also expires at the TTL of the policy that stored it.)"""
    return now_ms - entry.created_ms < ttl_s * 1000


class CachePlan:
    """What a RIB generation says about caching: each policy's
    :class:`~atp_router.policy.rib.CacheSpec` (by policy name) and each agent's
    :func:`agent_fingerprint`. Built by :func:`compile_cache`."""

    __slots__ = ("fingerprints", "policies")

    def __init__(self, policies: Mapping[str, CacheSpec], fingerprints: Mapping[str, str]):
        self.policies = dict(policies)
        self.fingerprints = dict(fingerprints)

    def spec(self, policy: str) -> CacheSpec | None:
        """The ``cache`` of policy ``policy``, or None (no cache)."""
        return self.policies.get(policy)


def compile_cache(rib: Rib) -> CachePlan:
    """The :class:`CachePlan` of ``rib`` (a loaded RIB: every policy named).
    Agents are fingerprinted only when some policy caches."""
    policies = {p.name: p.cache for p in rib.policies if p.cache is not None and p.name is not None}
    fingerprints = {name: agent_fingerprint(rib, name) for name in rib.agents} if policies else {}
    return CachePlan(policies, fingerprints)
