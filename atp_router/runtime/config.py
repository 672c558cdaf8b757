"""A router process's static configuration (:class:`RouterConfig`) and the one
authenticator made from it (:func:`build_authenticator`, spec §11)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from atp_router.flow.breaker import RetryPolicy
from atp_router.runtime.dataplane.cache import (
    DEFAULT_MAX_BYTES as DEFAULT_CACHE_MAX_BYTES,
)
from atp_router.runtime.dataplane.streams import DEFAULT_RETAIN_CLOSED_BYTES
from atp_router.security.audit import AuditOptions
from atp_router.security.authn import (
    Authenticator,
    EnvToken,
    load_auth_config,
    parse_tokens_env,
)
from atp_router.security.identity import Identity, Role
from atp_router.security.policy_guard import PolicySecrets
from atp_router.security.tls import ServerTls
from atp_router.wire.codec import KeyRing
from atp_router.wire.frame import Window

__all__ = ["DEFAULT_AGENT_WINDOW", "RouterConfig", "build_authenticator"]

#: Per-next-hop window of an agent without ``agents.<name>.window`` in the RIB.
DEFAULT_AGENT_WINDOW = Window(max_parallel=16, max_tokens=2_000_000, max_usd_micros=20_000_000)


@dataclass
class RouterConfig:
    """Static configuration of one router process.

    Authentication (spec §11, :func:`build_authenticator`): ``auth_file`` is the
    ``--auth`` YAML (API-key hashes, JWT/JWKS, mTLS identities,
    :mod:`atp_router.security.authn`); ``tokens_env`` the value of ``ATP_ROUTER_TOKENS``;
    ``tokens`` are further bare bearer tokens (tenant ``tok_<sha256 prefix>``) and
    ``client_tokens`` maps tenant names (the RIB's ``clients`` keys) to a token,
    ``client_roles`` their roles (default ``client``). Nothing configured:
    authentication off, every caller is the tenant ``anonymous`` with every role
    (a local appliance only). ``keyring`` (or the legacy single ``hmac_key``)
    makes signed frames with a nonce and timestamp mandatory (§11;
    :class:`~atp_router.security.signing.DurableReplayGuard`: nonces kept in the store, so
    a replay after a restart, on another worker or router is refused too).

    Tenant scopes (spec §11 AuthZ): a tenant without ``clients.<tenant>.max_streams``
    / ``rate`` in the RIB may have ``tenant_max_streams`` streams open and open
    ``tenant_rate_per_s`` streams per second (bursts of ``tenant_rate_burst``).
    ``policy_secrets`` are the env vars a RIB may reference
    (:class:`~atp_router.security.policy_guard.PolicySecrets`; None: none). Bodies:
    ``max_body_bytes`` per HTTP request (streams, frames), ``max_policy_bytes`` per
    policy body, ``max_ws_message_bytes`` per WebSocket message (after
    inflation when ``ws_deflate`` negotiated permessage-deflate, RFC 7692: on
    by default, used only when the client offers it). ``tls`` serves
    both ingresses over TLS 1.3 (HTTPS, WSS; mTLS identities on WSS).
    ``http_server``: what serves the HTTP API — ``lean``
    (:mod:`atp_router.runtime.ingress.server`: HTTP/1.1 on httptools, ~1 ms less
    CPU a request), ``hypercorn`` (adds HTTP/2 by ALPN under TLS), or ``auto``:
    lean for plain HTTP, hypercorn with ``tls`` (HTTP/2 kept for HTTPS clients).

    Durable state (:mod:`atp_router.store`): ``state_dir`` holds the SQLite store (budget
    ledgers, streams and their events, the active RIB, the audit chain); None is a
    private temporary directory removed at shutdown (the same code path, nothing
    kept). ``state_sync`` ``"NORMAL"`` survives a process crash, ``"FULL"`` an OS
    crash too. Closed streams stay in the store ``state_retain_s`` (default 7 days).
    The response cache of the policies with a ``cache`` key (spec §13,
    :mod:`atp_router.runtime.dataplane.cache`) keeps at most ``cache_max_bytes`` bytes of answers
    there (0: no policy caches).

    Flow control (spec §5, §9, §10): ``window_update_interval_ms`` /
    ``window_update_delta`` are the WINDOW_UPDATE cadence (every N ms, or when
    the window moved by that fraction), an unchanged window re-sent only every
    ``window_update_keepalive_ms`` (at least the interval); ``agent_window`` the per-next-hop triplet
    of agents without their own; ``slots`` the router-wide number of next-hop
    calls in flight, ``gold_reserved`` of them for gold only; gold waiting
    ``preempt_after_ms`` for a slot preempts a bronze call (RST ``EPREEMPT``),
    ``gold_sla_ms`` is gold's queueing SLA; ``retry`` bounds retries;
    ``breaker_*`` configure the per-agent circuit breakers (failures within
    ``breaker_window_s`` that open it, first backoff and its cap in s).

    Stream table (spec §8): at most ``max_streams`` open streams router-wide; a
    closed stream stays in memory for ``retain_closed_s``, each tenant keeps at
    most ``retain_closed_max`` closed streams there and the router at most
    ``retain_closed_bytes`` bytes of closed logs (the oldest go first); reads of
    a stream no longer in memory are served from the state store. With
    ``idle_trim`` the router gives freed memory back to the OS when no stream is
    open (:func:`atp_router.runtime.dataplane.memory.trim`, at most every 10 s). A stream
    opened without a task that gets none within ``idle_task_s`` is reset with
    ``ETIMEOUT``.

    Liveness and resumption (spec §4.4 HB, §8): the WebSocket ingress sends HB
    every ``hb_interval_s`` and declares a connection dead after
    ``hb_timeout_s`` without a frame from it; a stream left without a follower
    stays resumable for ``resume_grace_s``. ``seed`` seeds backoff jitter
    and the bandits' draws (reproducible tests).

    Learning (spec §6.2): each tenant's tasks move the shared routing state
    (live quality and latency, bandit weights) at most ``learn_rate_per_s``
    tasks per second with bursts of ``learn_burst`` (a token bucket): one
    tenant's traffic cannot outvote the others'. Client feedback is scoped by
    the RIB (``clients.<t>.feedback``).

    Hot reload (spec §22): with ``watch_policies`` the ``policies`` path is
    watched (watchfiles) and every change of a ``*.yaml``/``*.yml`` file in it
    reloads the RIB as ``POST /v1/policies/reload`` does (a refused RIB is
    logged with every fault and audited; the running one stays), after
    ``watch_debounce_ms`` without further change.
    """

    policies: Path
    host: str = "127.0.0.1"
    http_port: int = 7070
    ws_port: int = 7071
    tokens: frozenset[str] = frozenset()
    client_tokens: Mapping[str, str] = field(default_factory=dict)
    client_roles: Mapping[str, frozenset[Role]] = field(default_factory=dict)
    auth_file: Path | None = None
    tokens_env: str | None = None
    hmac_key: bytes | None = None
    keyring: KeyRing | None = None
    tenant_max_streams: int = 1000
    tenant_rate_per_s: float = 50.0
    tenant_rate_burst: int = 100
    policy_secrets: PolicySecrets | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_policy_bytes: int = 1024 * 1024
    max_ws_message_bytes: int = 16 * 1024 * 1024
    ws_deflate: bool = True
    http_server: Literal["auto", "lean", "hypercorn"] = "auto"
    #: Bytes of request bodies a tenant may have in flight at once, every ingress
    #: together (atp_router.flow.body_budget; None: twice the larger body limit).
    tenant_body_bytes: int | None = None
    #: A WebSocket connection must finish its upgrade (and TLS) within this, s;
    #: at most ``ws_pending_per_peer`` such connections per peer address (atp_router.runtime.ingress.ws_gate).
    ws_handshake_timeout_s: float = 10.0
    ws_pending_per_peer: int = 32
    #: The lean HTTP server serves at most this many connections from one peer IP
    #: address at once (more: 429 EWINDOW at accept; atp_router.runtime.ingress.server).
    #: Behind a load balancer every client shares its address: raise it there.
    http_conns_per_peer: int = 1024
    #: On SIGTERM/SIGINT the router drains up to this long, s: new streams are
    #: refused (EAGENTDOWN, 503), running ones finish (atp_router.runtime.controlplane.drain).
    drain_s: float = 10.0
    tls: ServerTls | None = None
    state_dir: Path | None = None
    state_sync: str = "NORMAL"
    state_retain_s: float = 7 * 24 * 3600.0
    retain_closed_s: float = 300.0
    retain_closed_max: int = 1000
    retain_closed_bytes: int = DEFAULT_RETAIN_CLOSED_BYTES
    #: Give freed memory back to the OS when no stream is open (atp_router.runtime.dataplane.memory).
    idle_trim: bool = True
    max_streams: int = 10_000
    idle_task_s: float = 30.0
    window_update_interval_ms: int = 1000
    window_update_delta: float = 0.2
    window_update_keepalive_ms: int = 10_000
    agent_window: Window = DEFAULT_AGENT_WINDOW
    slots: int = 64
    gold_reserved: int = 8
    gold_sla_ms: float = 2000.0
    preempt_after_ms: float = 250.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker_failures: int = 5
    breaker_window_s: float = 30.0
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 60.0
    hb_interval_s: float = 10.0
    hb_timeout_s: float = 30.0
    resume_grace_s: float = 60.0
    seed: int | None = None
    watch_policies: bool = False
    watch_debounce_ms: int = 300
    learn_rate_per_s: float = 10.0
    learn_burst: int = 200
    #: The most of a shared statistic's quality weight one tenant may hold
    #: (atp_router.policy.learn.TenantShares; 1.0: no cap).
    learn_share: float = 0.25
    #: A local checkout the router reads the after-diff files of a diff-only task
    #: from (``--repo``; the A2A server's plain-text diffs), confined to its root.
    repo: Path | None = None
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    #: Bytes of the response cache one tenant's answers may hold (None: a quarter of ``cache_max_bytes``).
    cache_tenant_max_bytes: int | None = None
    #: The store several routers share (issue 12, atp_router.deploy.cluster): ``"sqlite"``
    #: (the embedded one in ``state_dir``, this router alone) or a ``redis://``,
    #: ``rediss://`` or ``unix://`` URL; its keys live under ``store_namespace``.
    store: str = "sqlite"
    store_namespace: str = "atp"
    #: A cluster router's lease in the shared store, ms: it is settled by the others
    #: this long after its last heartbeat (every ``lease_ms / 5``).
    lease_ms: int = 5000
    #: The URL the other routers reach this one's HTTP API on (None: from the bound host and port).
    advertise_url: str | None = None
    #: The audit key's file, the anchor file and syslog sink of the checkpoints (atp_router.security.audit).
    audit: AuditOptions = field(default_factory=AuditOptions)


def build_authenticator(config: RouterConfig) -> Authenticator:
    """The router's one :class:`~atp_router.security.authn.Authenticator`: the ``--auth``
    file, ``ATP_ROUTER_TOKENS`` (``tokens_env``) and the tokens given in
    ``config`` directly. Raises ``ValueError`` naming the source of a fault."""
    doc = load_auth_config(config.auth_file) if config.auth_file is not None else None
    tokens = parse_tokens_env(config.tokens_env) if config.tokens_env else []
    for name, token in config.client_tokens.items():
        roles = config.client_roles.get(name, frozenset({Role.CLIENT}))
        tokens.append(EnvToken(Identity(name, roles, f"env:{name}", "api_key"), hashlib.sha256(token.encode()).digest()))
    for token in config.tokens:
        digest = hashlib.sha256(token.encode()).digest()
        tenant = "tok_" + digest.hex()[:12]
        tokens.append(EnvToken(Identity(tenant, frozenset({Role.CLIENT}), f"env:{tenant}", "api_key"), digest))
    base = config.auth_file.parent if config.auth_file is not None else Path(".")
    return Authenticator(doc, env_tokens=tokens, base_dir=base, file=str(config.auth_file or "ATP_ROUTER_TOKENS"),
                         required=config.auth_file is not None)
