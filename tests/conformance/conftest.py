"""Conformance fixtures: the implementation under test is reached only over the wire.

Set ``ATP_CONFORMANCE_HTTP`` (control API base URL) and ``ATP_CONFORMANCE_WS``
(WebSocket ingress URL) to test another ATP implementation; README.md lists the
other variables (tokens, HMAC key, timing profile) and the RIB it must run
(``tests/conformance/policies/``). Unset, the suite starts this repository's router
on free loopback ports with that RIB, the tokens of its ``clients`` and a short
timing profile (:data:`LOCAL_PROFILE`) so timed behaviour is seen in well under a
second.

Either way the suite starts its fault-injecting next-hop (:mod:`faulty_peer`) on
127.0.0.1: on a free port for the local router (the RIB copy is rewritten to
it), on ``ATP_CONFORMANCE_PEER_PORT`` (default 18099, the RIB's) for a remote one.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.conformance.faulty_peer import FaultyPeer

HERE = Path(__file__).resolve().parent
RIB_DIR = HERE / "policies"
RIB_PEER = "127.0.0.1:18099"
#: The clients of the RIB and the bearer tokens the local router gives them.
LOCAL_TOKENS = {"conf-a": "tok-conformance-a", "conf-b": "tok-conformance-b", "conf-c": "tok-conformance-c"}
#: The local router's administrator (role admin: policy reload, routes).
LOCAL_ADMIN = ("conf-admin", "tok-conformance-admin")


@dataclass(frozen=True)
class Profile:
    """Timing and capacity settings of the target that tests must know to observe
    timed behaviour: WINDOW_UPDATE period (ms) and the keep-alive period of an
    unchanged window (ms), HB interval and dead-peer timeout
    (s), the circuit breaker's first backoff (s), and how many concurrent bronze
    streams saturate its next-hop call slots."""

    window_update_ms: int
    window_keepalive_ms: int
    hb_interval_s: float
    hb_timeout_s: float
    breaker_backoff_s: float
    flood: int


#: What the local router runs with (RouterConfig below) — and the defaults the
#: README asks a remote target to be configured with.
LOCAL_PROFILE = Profile(window_update_ms=300, window_keepalive_ms=600, hb_interval_s=0.3, hb_timeout_s=1.5, breaker_backoff_s=0.5, flood=8)


@dataclass(frozen=True)
class Target:
    """The implementation under test. ``token`` is client ``conf-a`` (qos_max gold),
    ``token_b`` client ``conf-b`` (qos_max silver), ``token_c`` client ``conf-c``
    (client budget USD 0.002), ``admin_token`` an administrator's (policy reload);
    ``None`` when the target runs without authentication. ``hmac_key``: frames
    must be signed (§11)."""

    http: str
    ws: str
    token: str | None
    token_b: str | None
    token_c: str | None
    admin_token: str | None
    hmac_key: bytes | None
    profile: Profile
    peer: FaultyPeer
    local: bool


def _remote_profile() -> Profile:
    def env(name: str, default: float) -> float:
        return float(os.environ.get("ATP_CONFORMANCE_" + name, default))

    p = LOCAL_PROFILE
    return Profile(
        window_update_ms=int(env("WINDOW_UPDATE_MS", p.window_update_ms)),
        window_keepalive_ms=int(env("WINDOW_KEEPALIVE_MS", p.window_keepalive_ms)),
        hb_interval_s=env("HB_INTERVAL_S", p.hb_interval_s),
        hb_timeout_s=env("HB_TIMEOUT_S", p.hb_timeout_s),
        breaker_backoff_s=env("BREAKER_BACKOFF_S", p.breaker_backoff_s),
        flood=int(env("FLOOD", p.flood)),
    )


def local_config(policies: Path, **overrides):
    """The RouterConfig of the local target (LOCAL_PROFILE in the router's terms)."""
    from atp_router.flow.breaker import RetryPolicy
    from atp_router.runtime.config import RouterConfig
    from atp_router.security.identity import Role

    p = LOCAL_PROFILE
    cfg = RouterConfig(
        policies=policies, http_port=0, ws_port=0, client_tokens=dict([*LOCAL_TOKENS.items(), LOCAL_ADMIN]),
        client_roles={LOCAL_ADMIN[0]: frozenset({Role.ADMIN})},
        window_update_interval_ms=p.window_update_ms, window_update_keepalive_ms=p.window_keepalive_ms,
        hb_interval_s=p.hb_interval_s, hb_timeout_s=p.hb_timeout_s,
        # The RIB's `brk` fails its first 3 calls: the breaker must open within 3.
        breaker_failures=3, breaker_backoff_s=p.breaker_backoff_s, breaker_max_backoff_s=2.0, resume_grace_s=10.0,
        # 6 call slots, 1 reserved for gold: LOCAL_PROFILE.flood = 8 bronze streams saturate them.
        slots=6, gold_reserved=1, preempt_after_ms=100.0, gold_sla_ms=500.0,
        retry=RetryPolicy(max_attempts=2, base_backoff_s=0.05, max_backoff_s=0.5), seed=1,
    )
    return replace(cfg, **overrides)


async def start_local(nursery, tmp_path: Path, peer: FaultyPeer, **overrides) -> tuple[str, str]:
    """Start this repository's router on the conformance RIB (pointed at ``peer``);
    returns its (http, ws) URLs."""
    from atp_router.deploy.cli import run

    d = tmp_path / f"rib-{len(list(tmp_path.glob('rib-*')))}"
    shutil.copytree(RIB_DIR, d)
    for f in d.glob("*.yaml"):
        f.write_text(f.read_text().replace(RIB_PEER, f"127.0.0.1:{peer.port}"))
    _, http_port, ws_port = await nursery.start(run, local_config(d, **overrides))
    return f"http://127.0.0.1:{http_port}", f"ws://127.0.0.1:{ws_port}"


@pytest.fixture
async def peer(nursery) -> FaultyPeer:
    remote = bool(os.environ.get("ATP_CONFORMANCE_HTTP"))
    port = int(os.environ.get("ATP_CONFORMANCE_PEER_PORT", RIB_PEER.rsplit(":", 1)[1])) if remote else 0
    return await nursery.start(FaultyPeer().serve, "127.0.0.1", port)


@pytest.fixture
async def target(nursery, tmp_path, peer) -> Target:
    http, ws = os.environ.get("ATP_CONFORMANCE_HTTP"), os.environ.get("ATP_CONFORMANCE_WS")
    if http and ws:
        key = os.environ.get("ATP_CONFORMANCE_HMAC_KEY")
        return Target(http, ws, os.environ.get("ATP_CONFORMANCE_TOKEN"), os.environ.get("ATP_CONFORMANCE_TOKEN_B"),
                      os.environ.get("ATP_CONFORMANCE_TOKEN_C"), os.environ.get("ATP_CONFORMANCE_ADMIN_TOKEN"),
                      key.encode() if key else None, _remote_profile(),
                      peer, local=False)
    http, ws = await start_local(nursery, tmp_path, peer)
    t = LOCAL_TOKENS
    return Target(http, ws, t["conf-a"], t["conf-b"], t["conf-c"], LOCAL_ADMIN[1], None, LOCAL_PROFILE, peer,
                  local=True)
