"""The attacks of issue 7, tried over the wire against a real router with two tenants
(alice, bob) and an admin (ops); each fails with the right code, leaves the router
serving the others, and leaves an audit record. (Cross-tenant reads and idle
streams: tests/unit/test_router_namespace.py; data scope:
test_data_scope.py; the 5 MB stall and tool limits: test_limits.py; kill -9:
test_durability.py.)

Next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` s (RIB ``tool:
scripted``), which record every prompt a provider adapter would have sent.
"""

from __future__ import annotations

import json
import time

import atp
import httpx
import msgspec
import pytest
import trio
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from atp_router.security.signing import UsageSignatureError, sign_outbound, verify_usage
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
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
    scripted["m.review"] = ScriptedAdapter.returning("m.review", usage=Usage(in_tokens=100, out_tokens=20))
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
    ring = KeyRing.single(KEY)
    async with connect(env.ws_url, "json", "sess-replay", hmac_key=KEY) as peer:
        syn = peer.session.open_stream("t1", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN))
        wire = FrameCodec("json").encode(sign_outbound(syn, ring, int(time.time() * 1000)), seal_frame=False).decode()
        await peer.send_raw(wire)
        await peer.pump_until(lambda: peer.closed("t1"))
        await peer.send_raw(wire)  # the same bytes again
        await peer.pump_until(lambda: bool(peer.raw_errors("t1")))
        assert peer.raw_errors("t1")[0].code == "ESEC" and "replay" in peer.raw_errors("t1")[0].reason.lower()
        stale = Frame(v=1, session_id="sess-replay", stream_id="t2", msg_seq=0, flags=[Flag.SYN], meta=META)
        stale = sign_outbound(stale, ring, int(time.time() * 1000) - 600_000)
        await peer.send_raw(FrameCodec("json").encode(stale, seal_frame=False).decode())
        await peer.pump_until(lambda: bool(peer.raw_errors("t2")))
        assert peer.raw_errors("t2")[0].code == "ESEC"
    assert len(review.calls) == 1
    assert env.router.ledger.state("client:anonymous").committed_tokens == 120  # charged once
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
                assert e.status == 429
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


async def test_a_tenant_over_its_open_rate_gets_429_and_ewindow_with_a_retry_hint(nursery, tmp_path, review):
    """Alice (2 opens, then 1 per 10 s): her third open is HTTP 429 EWINDOW with
    ``Retry-After``; over WebSocket the refused SYN is an RST EWINDOW carrying
    ``retry_after_ms``. Bob, at the router's defaults, is not slowed by her."""
    env = await start_router_on(nursery, tmp_path, _rib(alice={"rate": {"per_s": 0.1, "burst": 2}}),
                                tokens_env=ROLES)
    async with httpx.AsyncClient(base_url=env.url) as h:
        for _ in range(2):
            r = await h.post("/v1/streams", json={"task": META}, headers=_auth("alice"))
            assert r.status_code == 201, r.text
        r = await h.post("/v1/streams", json={"task": META}, headers=_auth("alice"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "EWINDOW"
        assert "rate" in r.json()["error"]["reason"] and 1 <= int(r.headers["Retry-After"]) <= 10
        for _ in range(5):
            assert (await h.post("/v1/streams", json={"task": META}, headers=_auth("bob"))).status_code == 201
    async with connect(env.ws_url, "json", "sess-rate", token=TOKENS["alice"]) as peer:
        await peer.send(peer.session.open_stream("t1", META, WINDOW))
        await peer.pump_until(lambda: peer.closed("t1"))
        err = peer.raw_errors("t1")[0]
        assert err.code == "EWINDOW" and 0 < err.retry_after_ms <= 10_000
    assert env.router.streams.get("alice", "sess-rate", "t1") is None


async def test_bob_cannot_change_alices_budget(nursery, tmp_path, review):
    """Bob's BUDGET_UPDATE on Alice's stream (ids in hand) answers exactly as an
    unknown stream (404) and changes nothing; his reload is 403. Alice's own
    update, the same frame from her, is applied."""
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    async with atp.Client(env.url, TOKENS["alice"]) as alice, atp.Client(env.url, TOKENS["bob"]) as bob:
        _, st = await alice.open_stream(task=META, budget={"tokens": 1000})
        ctx = env.router.streams.get("alice", st.session_id, st.stream_id)
        before = env.router.ledger.state(ctx.account).limit
        with pytest.raises(atp.ATPClientError) as theirs:
            await bob.budget_update(st, tokens=10**9, msg_seq=1)
        with pytest.raises(atp.ATPClientError) as missing:
            await bob.budget_update(atp.StreamHandle(st.session_id, "task_" + "0" * 16), tokens=10**9, msg_seq=1)
        assert theirs.value.status == missing.value.status == 404
        assert theirs.value.reason.replace(st.stream_id, "ID") == missing.value.reason.replace("task_" + "0" * 16, "ID")
        assert env.router.ledger.state(ctx.account).limit == before
        async with httpx.AsyncClient(base_url=env.url) as h:
            r = await h.post("/v1/policies/reload", content=json.dumps(_rib(alice={"budget": {"tokens": 1}})),
                             headers=_auth("bob"))
            assert r.status_code == 403
        assert env.router.client_spec("alice").budget is None
        await alice.budget_update(st, tokens=500)
        assert env.router.ledger.state(ctx.account).limit.tokens == 500


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(nursery, tmp_path, review):
    """A request that announces 20 MB and sends 1 KB is answered 413 at once: the
    router does not wait for (or buffer) the body it would refuse."""
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    host, port = env.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(
            f"POST /v1/streams HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKENS['alice']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {20 << 20}\r\n\r\n".encode() + b"{" * 1024)
        answer = b""
        with trio.fail_after(5):
            while b"\r\n\r\n" not in answer:
                chunk = await stream.receive_some(4096)
                assert chunk, answer
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def test_the_running_policy_is_readable_by_admins_only(nursery, tmp_path, review):
    """``GET /v1/policies``: the running RIB's version and YAML (admin); 403 for a
    client. A body reload answers with the endpoints it changed and who reloaded;
    ``GET /v1/policies`` then shows the posted text."""
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    async with httpx.AsyncClient(base_url=env.url) as h:
        assert (await h.get("/v1/policies", headers=_auth("alice"))).status_code == 403
        got = (await h.get("/v1/policies", headers=_auth("ops"))).json()
        assert got["version"] == 1 and got["files"] == [{"file": str(tmp_path / "rib.yaml"),
                                                         "text": (tmp_path / "rib.yaml").read_text()}]
        posted = json.dumps({**_rib(bob={"budget": {"tokens": 5000}}), "models": {
            "local": {"provider": "openai_compat", "ctx": "8k", "cost": 0, "base_url": "http://127.0.0.1:9/v1"}}})
        r = await h.post("/v1/policies/reload", content=posted, headers=_auth("ops"))
        assert r.status_code == 200, r.text
        # The caller sees what the reload changed towards the outside, and as whom.
        assert r.json()["by"] == "env:ops" and r.json()["changes"] == [
            {"kind": "endpoint", "key": "models.local.base_url", "change": "added", "old": None,
             "new": "http://127.0.0.1:9/v1"}]
        got = (await h.get("/v1/policies", headers=_auth("ops"))).json()
        assert got["version"] == 2 and got["files"] == [{"file": "<request body>", "text": posted}]


async def test_adapters_see_only_declared_secrets_while_the_router_runs(tmp_path, monkeypatch, review):
    """While a router with policy secrets runs, an adapter asking for the router's
    own key gets nothing even though it is in the environment; a declared name
    resolves. When the router stops, the environment is read again."""
    from atp_router.adapters.http import env_secret
    from atp_router.security.policy_guard import PolicySecrets
    from atp_router.wire.errors import AgentError

    monkeypatch.setenv("ATP_HMAC_KEY", "router-own-key")
    monkeypatch.setenv("MODEL_KEY", "model-key")
    secrets_ = PolicySecrets.load(["MODEL_KEY"])
    async with trio.open_nursery() as n:
        await start_router_on(n, tmp_path, _rib(), policy_secrets=secrets_)
        assert env_secret("MODEL_KEY") == "model-key"
        with pytest.raises(AgentError, match="ATP_HMAC_KEY is not set"):
            env_secret("ATP_HMAC_KEY")
        n.cancel_scope.cancel()
    assert env_secret("ATP_HMAC_KEY") == "router-own-key"


async def test_mtls_websocket_identity_from_the_client_certificate(nursery, tmp_path, review, tls_ca, tls_other_ca,
                                                                   tls_server_files, tls_uri_leaf, tls_leaf, caplog):
    """WSS with ``--require-client-cert``: a certificate whose SAN the ``--auth``
    file maps (a SPIFFE id) opens streams as that tenant with no bearer token; a
    certificate of the right CA with an unmapped SAN is refused (401); one from
    another CA, or none, fails the TLS handshake."""
    import logging
    import ssl

    from trio_websocket import ConnectionRejected, open_websocket_url

    from atp_router.security.tls import ServerTls
    from tests.unit.test_router_ws import Peer

    auth = tmp_path / "auth.yaml"
    auth.write_text("mtls:\n  identities:\n    - {san: 'URI:spiffe://corp/router-b', tenant: routerb, roles: [client]}\n")
    tls = ServerTls(tls_server_files.cert, tls_server_files.key, client_ca_file=tls_server_files.ca,
                    require_client_cert=True)
    env = await start_router_on(nursery, tmp_path, _rib(), auth_file=auth, tls=tls)
    wss = env.ws_url.replace("ws://", "wss://")

    def client(files=None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        tls_ca.configure_trust(ctx)
        if files is not None:
            ctx.load_cert_chain(files.cert, files.key)
        return ctx

    mapped = tls_uri_leaf(tls_ca, "router-b", "spiffe://corp/router-b")
    async with open_websocket_url(wss, ssl_context=client(mapped), subprotocols=["atp.v1.json"]) as ws:
        peer = Peer(ws, FrameCodec("json"), "sess-mtls")
        await peer.send(peer.session.open_stream("t1", META, WINDOW,
                                                 payload=Payload(type=PayloadType.TASK, content=CLEAN)))
        await peer.pump_until(lambda: peer.closed("t1"))
        assert peer.final("t1").telemetry.usage.summary["tenant"] == "routerb"
    assert env.router.streams.get("routerb", "sess-mtls", "t1") is not None
    unmapped = tls_leaf(tls_ca, "stranger", "stranger.internal")
    with pytest.raises(ConnectionRejected) as rejected:
        async with open_websocket_url(wss, ssl_context=client(unmapped), subprotocols=["atp.v1.json"]):
            pass
    assert rejected.value.status_code == 401
    foreign = tls_leaf(tls_other_ca, "foreign", "foreign.internal")
    host, port = env.ws_url.removeprefix("ws://").split(":")
    caplog.set_level(logging.INFO, logger="atp_router.security.tls")
    for ctx, alert in ((client(foreign), "CERTIFICATE_VERIFY_FAILED"), (client(), "PEER_DID_NOT_RETURN_A_CERTIFICATE")):
        tcp = await trio.open_tcp_stream(host, int(port))
        conn = trio.SSLStream(tcp, ctx, server_hostname=host)
        answer = None
        with trio.fail_after(10):
            # TLS 1.3: the client's handshake ends before the server has checked
            # its certificate; the server's alert arrives on the first read (or,
            # with some Python builds' ssl, the connection's end).
            try:
                await conn.do_handshake()
                await conn.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = await conn.receive_some(1024)
            except trio.BrokenResourceError as broken:
                assert isinstance(broken.__cause__, ssl.SSLError)  # the TLS session failed
        assert not answer  # no HTTP answer
        await trio.aclose_forcefully(conn)
        with trio.fail_after(5):
            while not any(alert in r.getMessage() for r in caplog.records):
                await trio.sleep(0.01)  # the server logs why it refused the handshake


async def test_default_limits_refuse_a_2mb_policy_and_a_20mb_task(nursery, tmp_path, review):
    """At the defaults (a policy 1 MiB, a body 16 MiB): a 2 MB policy body is 413
    and the RIB stays; a 2 MB task body is under the body limit and is served;
    20 MB is 413."""
    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES)
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        r = await h.post("/v1/policies/reload", content=b"# " + b"x" * (2 << 20), headers=_auth("ops"))
        assert r.status_code == 413 and "1048576 bytes" in r.json()["error"]["reason"]
        assert env.router.gen.version == 1
        files = {"notes.txt": "y" * (2 << 20)}
        r = await h.post("/v1/streams", json={"task": META, "content": {**CLEAN, "files": {**CLEAN["files"], **files}}},
                         headers=_auth("alice"))
        assert r.status_code == 201, r.text[:300]
        r = await h.post("/v1/streams", content=b" " * (20 << 20), headers=_auth("alice"))
        assert r.status_code == 413 and "16777216 bytes" in r.json()["error"]["reason"]


async def test_an_oversized_websocket_message_closes_only_its_connection_with_1009(nursery, tmp_path, review):
    from trio_websocket import ConnectionClosed

    env = await start_router_on(nursery, tmp_path, _rib(), tokens_env=ROLES, max_ws_message_bytes=64 << 10)
    async with connect(env.ws_url, "json", "sess-big", token=TOKENS["alice"]) as big, \
            connect(env.ws_url, "json", "sess-ok", token=TOKENS["bob"]) as ok:
        await big.send_raw("x" * (100 << 10))
        with trio.fail_after(10), pytest.raises(ConnectionClosed) as closed:
            await big.ws.get_message()
        assert closed.value.reason.code == 1009
        await ok.send(ok.session.open_stream("t1", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN)))
        await ok.pump_until(lambda: ok.closed("t1"))
        assert ok.final("t1").telemetry.usage.summary["tenant"] == "bob"
