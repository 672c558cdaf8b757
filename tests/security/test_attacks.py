"""The attacks of issue 7, tried over the wire against a real router with two tenants
(alice, bob) and an admin (ops); each fails with the right code, leaves the router
serving the others, and leaves an audit record. (Cross-tenant reads and idle
streams: tests/unit/test_router_namespace.py; data scope:
test_data_scope.py; the 5 MB stall and tool limits: test_limits.py; kill -9:
test_durability.py.)

Next-hops are :class:`~atp.adapters.testing.ScriptedAdapter` s (RIB ``tool:
scripted``), which record every prompt a provider adapter would have sent.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import msgspec
import pytest
import trio
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

import atp
from atp.adapters.testing import ScriptedAdapter
from atp.security.signing import UsageSignatureError, verify_usage
from atp.wire.codec import FrameCodec
from atp.wire.frame import Flag, Frame, Payload, PayloadType
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import CLEAN, scripted_agent
from tests.unit.test_router_ws import WINDOW, connect

KEY = b"k" * 32
TOKENS = {"alice": "tok-alice-0000", "bob": "tok-bob-0000", "ops": "tok-ops-0000"}
ROLES = "alice:tok-alice-0000,bob:tok-bob-0000,ops:tok-ops-0000:admin+operator"
META = {"task_type": "code_review"}


def _rib(**clients) -> dict:
    return {"agents": {"m.review": scripted_agent()},
            "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.review"]}],
            "clients": clients}


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


@pytest.fixture
def review(scripted):
    scripted["m.review"] = ScriptedAdapter.returning("m.review")
    return scripted["m.review"]


async def test_a_client_cannot_reload_policy_and_an_admin_cannot_point_it_at_router_secrets(
        nursery, tmp_path, review, caplog):
    """Alice's hostile reload (her server as base_url, the router's HMAC key as the
    model's key) is 403; the same body from the admin is refused (422, the key
    named) because ATP_* variables are the router's own; the RIB is unchanged and
    both refusals are audited."""
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    hostile = ("models:\n  evil: {provider: openai_compat, ctx: 8k, cost: 0, base_url: 'http://127.0.0.1:9/v1',"
               " api_key_env: ATP_HMAC_KEY}\nagents:\n  m.review: {layer: L2, p95_ms: 1, model: evil}\n"
               "policies:\n  - {match: {task_type: code_review}, fanout: [m.review]}\n"
               "clients:\n  bob: {budget: {tokens: 1}}\n")
    async with httpx.AsyncClient(base_url=env.url) as h:
        r = await h.post("/v1/policies/reload", content=hostile, headers=_auth("alice"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "ESEC"
        r = await h.post("/v1/policies/reload", content=hostile, headers=_auth("ops"))
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["key"] == "models.evil.api_key_env" and "router's own" in err["reason"]
        assert (await h.get("/v1/routes", headers=_auth("alice"))).status_code == 403
    assert env.router.gen.version == 1 and "evil" not in env.router.gen.rib.models
    assert env.router.client_spec("bob").budget is None
    kinds = [r["kind"] for r in map(msgspec.to_builtins, env.router.store.audit_records())]
    assert "esec" in kinds and "policy_reload" in kinds


async def test_a_replayed_signed_syn_is_esec_and_runs_nothing_twice(nursery, tmp_path, review):
    """A correctly signed SYN sent again verbatim: ESEC (audited); the task ran and
    was charged once. A frame whose timestamp is ten minutes old: ESEC."""
    env = await start_router_on(nursery, tmp_path, _rib(), hmac_key=KEY)
    async with connect(env.ws_url, "json", "sess-replay", hmac_key=KEY) as peer:
        syn = peer.session.open_stream("t1", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN))
        frame = msgspec.structs.replace(syn, meta={**syn.meta, "nonce": secrets.token_urlsafe(24),
                                                   "ts": int(time.time() * 1000)})
        wire = FrameCodec("json", hmac_key=KEY).encode(frame).decode()
        await peer.send_raw(wire)
        await peer.pump_until(lambda: peer.closed("t1"))
        await peer.send_raw(wire)  # the same bytes again
        await peer.pump_until(lambda: bool(peer.raw_errors("t1")))
        assert peer.raw_errors("t1")[0].code == "ESEC" and "replay" in peer.raw_errors("t1")[0].reason.lower()
        stale = Frame(v=1, session_id="sess-replay", stream_id="t2", msg_seq=0, flags=[Flag.SYN],
                      meta={**META, "nonce": secrets.token_urlsafe(24), "ts": int(time.time() * 1000) - 600_000})
        await peer.send_raw(FrameCodec("json", hmac_key=KEY).encode(stale).decode())
        await peer.pump_until(lambda: bool(peer.raw_errors("t2")))
        assert peer.raw_errors("t2")[0].code == "ESEC"
    assert len(review.calls) == 1
    esec = [r for r in env.router.store.audit_records() if r.kind == "esec"]
    assert len(esec) >= 2


async def test_one_tenant_cannot_take_every_stream_slot(nursery, tmp_path, review):
    """Alice (max_streams 2) is refused with EWINDOW past her quota; Bob still
    opens streams. (The open rate's token bucket: tests/security/test_authz.py.)"""
    env = await start_router_on(nursery, tmp_path, _rib(alice={"max_streams": 2, "rate": {"per_s": 3, "burst": 3}}),
                                tokens_env=ROLES)
    refused = []
    async with atp.Client(env.url, TOKENS["alice"]) as alice:
        for _ in range(4):
            try:
                await alice.open_stream(task=META)  # no task: the stream stays open
            except atp.ATPClientError as e:
                refused.append((e.code, e.reason))
    assert len(refused) == 2 and all(code == "EWINDOW" for code, _ in refused)
    assert all("limit of 2 open streams" in reason for _, reason in refused), refused
    async with atp.Client(env.url, TOKENS["bob"]) as bob:
        _, st = await bob.open_stream(task=META, content=CLEAN)
        with trio.fail_after(20):
            await bob.result(st)


async def test_oversized_bodies_are_413_before_being_read(nursery, tmp_path, review):
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES, max_body_bytes=1 << 20,
                                max_policy_bytes=64 << 10)
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        t0 = trio.current_time()
        r = await h.post("/v1/streams", content=b"x" * (20 << 20), headers=_auth("alice"))
        assert r.status_code == 413 and r.json()["error"]["code"] == "EPROTO"
        assert trio.current_time() - t0 < 5

        async def chunks():  # no Content-Length: refused as the stream passes the limit
            for _ in range(64):
                yield b"y" * (64 << 10)

        r = await h.post("/v1/policies/reload", content=chunks(), headers=_auth("ops"))
        assert r.status_code == 413
        assert (await h.get("/v1/health", headers=_auth("bob"))).status_code == 200


async def test_final_usage_is_signed_and_a_tampered_summary_fails(nursery, tmp_path, review):
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    async with atp.Client(env.url, TOKENS["alice"]) as c:
        _, st = await c.open_stream(task=META, content=CLEAN)
        with trio.fail_after(20):
            final = await c.result(st)
    usage = final["telemetry"]["usage"]
    async with httpx.AsyncClient(base_url=env.url) as h:
        jwks = (await h.get("/v1/keys", headers=_auth("bob"))).json()
    got = verify_usage(usage["jws"], jwks["keys"][0])
    assert got == usage["summary"] and got["tenant"] == "alice" and got["tokens"] == final["telemetry"]["tokens"]
    head, body, sig = usage["jws"].split(".")
    forged = json.loads(jwt_b64d(body))
    forged["tokens"] = 0
    with pytest.raises(UsageSignatureError):
        verify_usage(".".join([head, jwt_b64e(json.dumps(forged).encode()), sig]), jwks["keys"][0])


async def test_audit_is_admin_only(nursery, tmp_path, review):
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    async with httpx.AsyncClient(base_url=env.url) as h:
        assert (await h.get("/v1/audit", headers=_auth("alice"))).status_code == 403
        r = await h.get("/v1/audit?since=0&limit=10", headers=_auth("ops"))
        assert r.status_code == 200 and r.json()["records"][0]["seq"] == 1
        assert (await h.get("/v1/audit?limit=0", headers=_auth("ops"))).status_code == 400


async def test_jwt_bearer_tokens_from_a_jwks_file(nursery, tmp_path, review):
    """OIDC: a token signed by a JWKS key with the right issuer and audience opens a
    stream as its tenant; an expired one is 401 with WWW-Authenticate."""
    key = RSAKey.generate_key(2048, parameters={"kid": "idp-1"})
    (tmp_path / "jwks.json").write_text(json.dumps(KeySet([key]).as_dict(private=False)))
    auth = tmp_path / "auth.yaml"
    auth.write_text("jwt: {issuer: 'https://idp.test', audience: atp-router, jwks_file: jwks.json}\n")
    env = await start_router_on(nursery, tmp_path, _rib(), auth_file=auth)
    now = int(time.time())

    def token(exp: int) -> str:
        return jwt.encode({"alg": "RS256", "kid": "idp-1"},
                          {"iss": "https://idp.test", "aud": "atp-router", "sub": "ci-bot", "tenant": "alice",
                           "roles": ["client"], "iat": now - 10, "exp": exp}, key)

    async with atp.Client(env.url, token(now + 600)) as c:
        _, st = await c.open_stream(task=META, content=CLEAN)
        with trio.fail_after(20):
            await c.result(st)
    assert env.router.find_stream(env.router.authenticate("Bearer " + token(now + 600)), st.stream_id) is not None
    async with httpx.AsyncClient(base_url=env.url) as h:
        r = await h.get("/v1/health", headers={"Authorization": "Bearer " + token(now - 3600)})
        assert r.status_code == 401 and "WWW-Authenticate" in r.headers


def jwt_b64d(part: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def jwt_b64e(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
