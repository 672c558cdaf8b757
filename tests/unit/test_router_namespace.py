"""Stream namespace (spec §11 "streams are scoped to the authenticated principal"):
sessions, streams, idempotency keys and the HTTP ids are the tenant's.

Attacks from issue 7 on a real router over the wire: Bob naming Alice's session
and stream ids in a signed SYN over the WebSocket (once he got ESEC *and then
every event of her stream*), Bob evicting Alice's finished stream by reusing its
id, Bob probing which ids exist over HTTP. Then the stream table's own bounds:
idle streams without a task expire, closed streams are retained per tenant.
Next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` s whose PARTIALs
carry text naming their tenant, so a leaked event is visible in the bytes.
"""

from __future__ import annotations

import hashlib
import json

import atp
import httpx
import msgspec
import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.runtime.config import RouterConfig, build_authenticator
from atp_router.runtime.router import ACTIONS, Router
from atp_router.security.identity import ANONYMOUS, Identity, Role
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import CLEAN, scripted_agent
from tests.unit.test_router_flow import content_of, drain, serving, types
from tests.unit.test_router_ws import WINDOW, Peer, connect

KEY = b"h" * 32
TOKENS = {"alice": "tok-alice-1111", "bob": "tok-bob-2222"}
ALICE = {"task_type": "alice_review"}
BOB = {"task_type": "bob_review"}


def _rib(**extra) -> dict:
    return {
        "agents": {"m.alice": scripted_agent(), "m.bob": scripted_agent()},
        "policies": [
            {"name": "a", "match": {"task_type": "alice_review"}, "fanout": ["m.alice"]},
            {"name": "b", "match": {"task_type": "bob_review"}, "fanout": ["m.bob"]},
        ],
        **extra,
    }


@pytest.fixture
def tenants_scripted(scripted):
    """m.alice streams five PARTIALs naming Alice's secret, 50 ms apart; m.bob one of Bob's."""
    scripted["m.alice"] = ScriptedAdapter.returning(
        "m.alice", partials=[f"alice-secret-{i}" for i in range(5)], delay_s=0.05)
    scripted["m.bob"] = ScriptedAdapter.returning("m.bob", partials=["bob-own-0"])
    return scripted


async def _env(nursery, tmp_path, **config):
    return await start_router_on(nursery, tmp_path, _rib(), client_tokens=TOKENS, hmac_key=KEY, **config)


def _leaks(peer: Peer, word: str = "alice") -> list[Frame]:
    return [f for f in peer.raw if word in msgspec.json.encode(f).decode()]


def _task(content=CLEAN) -> Payload:
    return Payload(type=PayloadType.TASK, content=content)


# ------------------------------------------------------------------ WebSocket

async def test_bob_naming_alices_session_and_stream_gets_his_own_stream_and_none_of_hers(
        nursery, tmp_path, tenants_scripted):
    """The issue's attack: Bob sends a correctly signed SYN on Alice's session
    and stream ids while her stream runs. He gets a stream of his own (his
    SYN+ACK, his agent's PARTIAL, his FINAL) and not one frame of hers; her
    stream runs to its FINAL untouched."""
    env = await _env(nursery, tmp_path)
    async with connect(env.ws_url, "json", "sess-a", hmac_key=KEY, token=TOKENS["alice"]) as a, \
            connect(env.ws_url, "json", "sess-a", hmac_key=KEY, token=TOKENS["bob"]) as b:
        await a.send(a.session.open_stream("t1", ALICE, WINDOW, payload=_task()))
        await a.pump_until(lambda: bool(a.messages("t1")))  # her stream is streaming
        await b.send(b.session.open_stream("t1", BOB, WINDOW, payload=_task()))
        await b.pump_until(lambda: b.closed("t1"))
        await a.pump_until(lambda: a.closed("t1"))
        b.final("t1")
        a.final("t1")
        # Bob's connection stays open until Alice's stream ended: anything of hers
        # it were following would have reached it by now.
        await b.send(b.session.open_stream("t2", BOB, WINDOW, payload=_task()))
        await b.pump_until(lambda: b.closed("t2"))
    assert _leaks(b) == []
    assert b.errors("t1") == [] and b.raw_errors("t1") == []
    assert [p.content["delta"] for p in b.messages("t1") if p.type is PayloadType.PARTIAL and "delta" in p.content] \
        == ["bob-own-0"]
    assert len([p for p in a.messages("t1") if p.type is PayloadType.PARTIAL and "delta" in p.content]) == 5
    alice, bob = env.router.streams.find("alice", "t1"), env.router.streams.find("bob", "t1")
    assert alice is not bob and (alice.session_id, bob.session_id) == ("sess-a", "sess-a")


async def test_a_refused_syn_attaches_nothing(nursery, tmp_path, tenants_scripted):
    """A SYN the router refuses leaves its connection following nothing. Bob
    sends a signed SYN on Alice's session and stream ids that is malformed
    (EPROTO meta.budget) — once he got his refusal and then her whole stream —,
    and Alice's second connection one on her open stream's id from another
    session (EPROTO "already in use"): each gets its refusal and nothing else of
    the stream, which runs on to its FINAL on the first connection."""
    env = await _env(nursery, tmp_path)
    async with connect(env.ws_url, "json", "sess-a", hmac_key=KEY, token=TOKENS["alice"]) as a, \
            connect(env.ws_url, "json", "sess-a2", hmac_key=KEY, token=TOKENS["alice"]) as a2, \
            connect(env.ws_url, "json", "sess-a", hmac_key=KEY, token=TOKENS["bob"]) as b:
        await a.send(a.session.open_stream("t1", ALICE, WINDOW))
        await a.pump_until(lambda: bool(a.events["t1"]))  # SYN+ACK: open, no task yet
        await a2.send(a2.session.open_stream("t1", ALICE, WINDOW, payload=_task()))
        await b.send(b.session.open_stream("t1", {**BOB, "budget": "lots"}, WINDOW, payload=_task()))
        await a2.pump_until(lambda: a2.closed("t1"))
        await b.pump_until(lambda: b.closed("t1"))
        await a.send(a.session.send_message("t1", _task()))
        await a.pump_until(lambda: a.closed("t1"))
        a.final("t1")
        for peer in (a2, b):  # a stream of their own, after hers ended, flushes their connections
            await peer.send(peer.session.open_stream("t9", BOB if peer is b else ALICE, WINDOW, payload=_task()))
            await peer.pump_until(lambda peer=peer: peer.closed("t9"))
    assert "already in use" in a2.raw_errors("t1")[0].reason
    assert "meta.budget" in b.raw_errors("t1")[0].reason
    for peer in (a2, b):
        t1 = [f for f in peer.raw if f.stream_id == "t1"]
        assert [f.flags for f in t1] == [[Flag.RST, Flag.CTRL]], [f.flags for f in t1]
        assert not [f for f in peer.raw if f.stream_id == "t1" and f.payload and f.payload.type is PayloadType.PARTIAL]


# ------------------------------------------------------------------ HTTP

async def test_another_tenants_stream_id_answers_exactly_like_a_missing_one(nursery, tmp_path, tenants_scripted):
    """Bob asks for Alice's stream over HTTP (events, frames): the same 404 and
    body as for an id that never existed (only the id differs, same length), so
    he learns nothing; his RST posted on her id touches nothing."""
    env = await _env(nursery, tmp_path)
    async with atp.Client(env.url, TOKENS["alice"]) as alice:
        _, st = await alice.open_stream(task=ALICE, content=CLEAN)
        await alice.result(st)
    sid = st.stream_id
    never = sid[:-4] + ("0000" if not sid.endswith("0000") else "1111")
    rst = {"v": 1, "session_id": st.session_id, "stream_id": sid, "msg_seq": 0, "flags": ["RST", "CTRL"],
           "payload": {"type": "control", "content": {"kind": "ERROR", "code": "EPROTO", "reason": "bob"}}}

    async def ask(token: str, stream_id: str) -> list[tuple[int, str, str]]:
        out = []
        async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {token}"}) as h:
            for r in (await h.get(f"/v1/streams/{stream_id}/events"),
                      await h.post(f"/v1/streams/{stream_id}/frames", json={**rst, "stream_id": stream_id})):
                out.append((r.status_code, r.headers["content-type"], r.text.replace(stream_id, "<id>")))
        return out

    theirs, missing = await ask(TOKENS["bob"], sid), await ask(TOKENS["bob"], never)
    assert theirs == missing
    assert {status for status, _, _ in theirs} == {404}
    assert json.loads(theirs[0][2]) == {"error": {"code": "EPROTO", "reason": "unknown stream '<id>'"}}
    async with atp.Client(env.url, TOKENS["alice"]) as alice:  # still hers, whole, FINAL and FIN
        assert [ev.type for ev in [ev async for ev in alice.events(st)]][-2:] == ["FINAL", "FIN"]


# ------------------------------------------------------------------ the stream table

def _syn(session_id: str, stream_id: str, meta: dict, *, task: bool = True) -> Frame:
    return Frame(v=1, session_id=session_id, stream_id=stream_id, msg_seq=0, flags=[Flag.SYN], meta=meta,
                 window=WINDOW, payload=_task() if task else None)


def _who(name: str) -> Identity:
    return Identity(name, frozenset({Role.CLIENT}), name, "api_key")


async def test_one_tenant_cannot_evict_another_tenants_finished_stream(tmp_path, tenants_scripted, autojump_clock):
    """Alice's finished stream ``t1`` stays readable while Bob reuses its id (in
    her session id and in another) and fills his own retention: each tenant
    keeps ``retain_closed_max`` closed streams of its own, the oldest going
    first, and never displaces another tenant's."""
    async with serving(tmp_path, _rib(), retain_closed_max=2) as router:
        now = trio.current_time()
        router.receive_frame(_syn("sess-a", "t1", ALICE), identity=_who("alice"), now=now)
        hers = router.streams.find("alice", "t1")
        await drain(hers)
        for i, (session_id, stream_id) in enumerate([("sess-a", "t1"), ("sess-x", "t1"), ("sess-y", "t2"),
                                                     ("sess-z", "t3")]):
            router.receive_frame(_syn(session_id, stream_id, BOB), identity=_who("bob"), now=trio.current_time())
            ctx = router.streams.get("bob", session_id, stream_id)
            assert ctx is not None, i
            await drain(ctx)
            while router.ledger.state(ctx.account).open_reservations:
                await trio.sleep(0.01)
        assert router.streams.find("alice", "t1") is hers and types(await drain(hers))[-2:] == ["FINAL", "FIN"]
        # Bob's own retention: his two newest closed streams (t1 was replaced by his second SYN on it, then evicted).
        assert router.streams.find("bob", "t1") is None
        assert [router.streams.find("bob", s) is not None for s in ("t2", "t3")] == [True, True]
        assert router.ledger.has(hers.account)


async def test_stream_without_a_task_expires_after_idle_task_s(tmp_path, tenants_scripted, autojump_clock):
    """A SYN without payload opens a stream that holds a slot; with no task
    within ``idle_task_s`` it is reset with RST ETIMEOUT "no task within …" and
    no longer counts as open. One whose task came in time runs to its FINAL."""
    async with serving(tmp_path, _rib(), idle_task_s=5.0, resume_grace_s=600.0) as router:
        t0 = trio.current_time()
        router.receive_frame(_syn("s", "idle", ALICE, task=False), identity=_who("alice"), now=t0)
        router.receive_frame(_syn("s", "busy", ALICE, task=False), identity=_who("alice"), now=t0)
        idle, busy = router.streams.find("alice", "idle"), router.streams.find("alice", "busy")
        assert router.open_count == 2
        await trio.sleep(4.0)
        task = Frame(v=1, session_id="s", stream_id="busy", msg_seq=1, payload=_task())
        router.receive_frame(task, identity=_who("alice"), now=trio.current_time())
        events = await drain(idle)
        assert 5.0 <= trio.current_time() - t0 < 6.0
        assert types(events) == ["SYN_ACK", "RST"]
        assert content_of(events[-1])["code"] == "ETIMEOUT"
        assert content_of(events[-1])["reason"] == "no task within 5 s"
        assert types(await drain(busy))[-2:] == ["FINAL", "FIN"]
        assert router.open_count == 0


async def test_closed_streams_leave_after_retain_closed_s_with_their_account_and_session(
        tmp_path, tenants_scripted, autojump_clock):
    """A closed stream stays readable for ``retain_closed_s``, then leaves the
    table: its ledger account is closed, its idempotency key forgotten, and its
    session (with no stream left) dropped at the next sweep."""
    async with serving(tmp_path, _rib(), retain_closed_s=10.0) as router:
        ctx = router.open_stream(task=ALICE, content=CLEAN, budget=None, qos=None, window=None,
                                 idempotency_key="k1", identity=_who("alice"))
        await drain(ctx)
        await trio.sleep(9.0)
        assert router.streams.find("alice", ctx.stream_id) is ctx
        assert router.streams.resumable("alice", "k1") is ctx
        await trio.sleep(2.0)
        assert router.streams.find("alice", ctx.stream_id) is None
        assert router.streams.resumable("alice", "k1") is None
        assert not router.ledger.has(ctx.account)
        await trio.sleep(10.0)
        assert router.streams.get_session("alice", ctx.session_id) is None


async def test_idempotency_keys_are_per_tenant(tmp_path, tenants_scripted, autojump_clock):
    """The same client-chosen idempotency key in two tenants opens two streams;
    each tenant's retry of it gets its own stream back (§8), never the other's."""
    async with serving(tmp_path, _rib()) as router:
        def opened(who: str) -> object:
            return router.open_stream(task=ALICE if who == "alice" else BOB, content=CLEAN, budget=None, qos=None,
                                      window=None, idempotency_key="k-same", identity=_who(who))

        a, b = opened("alice"), opened("bob")
        assert a is not b and (a.tenant, b.tenant) == ("alice", "bob")
        assert opened("alice") is a and opened("bob") is b
        await drain(a)
        await drain(b)


# ------------------------------------------------------------------ identity and authorization

def test_router_authenticator_resolves_tenants_and_roles_and_refuses_the_rest(tmp_path):
    """The router's one authenticator (:func:`build_authenticator`) over tokens
    given in the config and ``ATP_ROUTER_TOKENS``: tenants, roles, refusals."""
    auth = build_authenticator(RouterConfig(
        policies=tmp_path, tokens=frozenset({"bare-tok"}), client_tokens={"alice": "tok-a"},
        tokens_env="ops:tok-o:admin+operator"))
    alice = auth.authenticate("Bearer tok-a", now=0.0)
    assert (alice.tenant, alice.roles, alice.subject, alice.method) == (
        "alice", frozenset({Role.CLIENT}), "env:alice", "api_key")
    assert auth.authenticate("Bearer tok-o", now=0.0).roles == frozenset({Role.ADMIN, Role.OPERATOR})
    bare = auth.authenticate("Bearer bare-tok", now=0.0)
    assert bare.tenant == "tok_" + hashlib.sha256(b"bare-tok").hexdigest()[:12] and bare.roles == {Role.CLIENT}
    for header in (None, "", "Bearer", "Bearer wrong", "Basic tok-a", "tok-a"):
        with pytest.raises(ATPError) as ei:
            auth.authenticate(header, now=0.0)
        assert ei.value.code is ErrorCode.ESEC
    assert build_authenticator(RouterConfig(policies=tmp_path)).authenticate(None, now=0.0) is ANONYMOUS


@pytest.mark.parametrize("roles, allowed", [
    ({Role.CLIENT}, {"stream_open", "stream_access", "health_read"}),
    ({Role.OPERATOR}, {"metrics_read", "health_read"}),
    ({Role.ADMIN}, {"policy_reload", "policy_read", "routes_read", "audit_read", "tenant_admin", "metrics_read",
                    "health_read"}),
    (set(Role), set(ACTIONS)),
])
async def test_authorize_checks_the_role_of_every_action(tmp_path, tenants_scripted, roles, allowed):
    async with serving(tmp_path, _rib()) as router:
        who = Identity("t", frozenset(roles), "t", "api_key")
        got = set()
        for action in ACTIONS:
            try:
                router.authorize(who, action)
                got.add(action)
            except ATPError as e:
                assert e.code is ErrorCode.ESEC
        assert got == allowed
        for action in ACTIONS:
            router.authorize(ANONYMOUS, action)  # authentication off: every role
        with pytest.raises(ValueError):
            router.authorize(ANONYMOUS, "launch_missiles")


async def test_a_client_token_may_not_reload_or_read_routes_an_admin_may(nursery, tmp_path, tenants_scripted):
    """The issue's first attack, at the door: Alice (role client) posting a policy
    is refused ESEC 403 and the RIB stays; the admin's reload goes through."""
    env = await start_router_on(nursery, tmp_path, _rib(), client_tokens={**TOKENS, "root": "tok-root"},
                                client_roles={"root": frozenset({Role.ADMIN})})
    async with httpx.AsyncClient(base_url=env.url) as h:
        alice = {"Authorization": f"Bearer {TOKENS['alice']}"}
        root = {"Authorization": "Bearer tok-root"}
        refused = await h.post("/v1/policies/reload", content=json.dumps(_rib()), headers=alice)
        routes = await h.get("/v1/routes", headers=alice)
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "ESEC")
        assert (routes.status_code, routes.json()["error"]["code"]) == (403, "ESEC")
        assert env.router.gen.version == 1
        ok = await h.post("/v1/policies/reload", content=json.dumps(_rib()), headers=root)
        assert ok.status_code == 200 and ok.json()["version"] == 2
        assert (await h.get("/v1/routes", headers=root)).status_code == 200
        assert (await h.get("/v1/health", headers=alice)).status_code == 200


def test_router_is_importable_from_core():
    """The split keeps each name importable from the module that owns it (the
    facade, its configuration, the data plane, the stream, the control plane)."""
    import importlib

    homes = {"Router": "atp_router.runtime.router", "RouterConfig": "atp_router.runtime.config",
             "build_authenticator": "atp_router.runtime.config", "StreamCtx": "atp_router.runtime.dataplane.stream",
             "connection_error": "atp_router.runtime.dataplane.stream", "DataPlane": "atp_router.runtime.dataplane.plane",
             "parse_tokens_env": "atp_router.security.authn", "Generation": "atp_router.runtime.controlplane.control"}
    for name, module in homes.items():
        assert hasattr(importlib.import_module(module), name), (module, name)
    assert importlib.import_module("atp_router.runtime.router").Router is Router
