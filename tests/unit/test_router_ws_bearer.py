"""A bearer token in a WebSocket subprotocol (issue 24 item 4; ``ws.py`` module doc).

A browser's ``WebSocket`` cannot send ``Authorization``, so it offers
``atp.bearer.<base64url(token)>`` beside its encoding. Against a real router on
loopback with three tenants' keys (a client, an operator that may not open streams,
an admin that reads the audit trail), with real trio-websocket handshakes: the token
opens streams as its tenant and is never the chosen subprotocol; every malformed,
ambiguous or wrong credential is a 401 ``ESEC`` with a reason naming the fault; the
token is in no log line and no audit record.
"""

from __future__ import annotations

import base64
import json
import logging

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from atp_router.security.identity import Role
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec
from tests.conftest import start_router
from tests.unit.test_router_ws import SUBPROTOCOL, Peer, task_payload

KEYS = {"alice": "alice-secret-7f3a9c", "ops": "ops-secret-51d2e0", "root": "root-secret-c0ffee"}
ROLES = {"ops": frozenset({Role.OPERATOR}), "root": frozenset({Role.ADMIN})}


def bearer(token: str | bytes) -> str:
    raw = token.encode() if isinstance(token, str) else token
    return "atp.bearer." + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@pytest.fixture
async def env(nursery, policies_dir):
    return await start_router(nursery, policies_dir, client_tokens=KEYS, client_roles=ROLES)


async def refused(url: str, offer: list[str], headers: list[tuple[str, str]] | None = None) -> tuple[int, dict]:
    with pytest.raises(ConnectionRejected) as ei:
        async with open_websocket_url(url, subprotocols=offer, extra_headers=headers):
            pass
    return ei.value.status_code, json.loads(ei.value.body)["error"]


@pytest.mark.parametrize("encoding", ["json", "cbor"])
async def test_a_token_in_the_subprotocol_opens_streams_as_its_tenant(env, encoding):
    """The handshake has no Authorization header: the subprotocol's token makes the
    connection alice's; the chosen subprotocol is the encoding's; a task runs to FIN."""
    offer = [bearer(KEYS["alice"]), SUBPROTOCOL[encoding]]
    async with open_websocket_url(env.ws_url, subprotocols=offer) as ws:
        assert ws.subprotocol == SUBPROTOCOL[encoding]
        peer = Peer(ws, FrameCodec(encoding), f"sess-bearer-{encoding}")
        await peer.open("t1")
        assert env.router.streams.find("alice", "t1") is not None
        assert env.router.streams.find("anonymous", "t1") is None
        await peer.send(peer.session.send_message("t1", task_payload()))
        await peer.pump_until(lambda: peer.closed("t1"))
        assert peer.final("t1").result.findings is not None
        assert any(isinstance(e, S.StreamFinished) for e in peer.events["t1"])


async def test_without_an_encoding_offered_the_connection_is_json_and_names_no_subprotocol(env):
    async with open_websocket_url(env.ws_url, subprotocols=[bearer(KEYS["alice"])]) as ws:
        assert ws.subprotocol is None  # the bearer subprotocol is never selected
        peer = Peer(ws, FrameCodec("json"), "sess-bearer-only")
        await peer.open("t1")
        assert env.router.streams.find("alice", "t1") is not None


@pytest.mark.parametrize(("offer", "header", "reason"), [
    ([bearer("not-a-key")], None, "unknown bearer token"),
    ([bearer(KEYS["alice"])], KEYS["alice"], "ambiguous credentials"),
    ([bearer("not-a-key")], KEYS["alice"], "ambiguous credentials"),
    ([bearer(KEYS["alice"]), bearer(KEYS["ops"])], None, "2 atp.bearer. subprotocols"),
    (["atp.bearer.YWxpY2U.x"], None, "not unpadded base64url"),
    (["atp.bearer.a"], None, "not unpadded base64url"),
    (["atp.bearer.QR"], None, "not canonical base64url"),
    (["atp.bearer."], None, "not unpadded base64url"),
    ([bearer(b"\xff\xfe")], None, "not UTF-8"),
    ([bearer("alice secret")], None, "whitespace or control"),
    ([bearer("alice\n")], None, "whitespace or control"),
    ([bearer("k" * 8193)], None, "over 8192 bytes"),
])
async def test_a_bad_or_ambiguous_bearer_subprotocol_is_a_401(env, offer, header, reason):
    headers = [("Authorization", f"Bearer {header}")] if header else None
    status, err = await refused(env.ws_url, [*offer, "atp.v1.json"], headers)
    assert (status, err["code"]) == (401, "ESEC")
    assert reason in err["reason"], err
    for token in (*KEYS.values(), "not-a-key"):
        assert token not in err["reason"]


async def test_the_largest_token_is_read_and_checked(env):
    """8192 bytes is within the bound: authenticated (and refused as unknown), not cut."""
    status, err = await refused(env.ws_url, [bearer("k" * 8192), "atp.v1.json"])
    assert (status, err["reason"]) == (401, "unknown bearer token")


async def test_a_tenant_that_may_not_open_streams_is_a_403(env):
    status, err = await refused(env.ws_url, [bearer(KEYS["ops"]), "atp.v1.json"])
    assert (status, err["code"]) == (403, "ESEC")


async def test_the_token_is_in_no_log_line_nor_audit_record(env, caplog):
    """Every logger at DEBUG (trio-websocket's included) over an accepted
    connection, a wrong token, ambiguous credentials and a 403: neither the token
    nor its base64url appears in any record (message, arguments, extras); the
    401s are logged as ESEC refusals; the audit trail (GET /v1/audit) names no token."""
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-secret-9b8a7c"
    async with open_websocket_url(env.ws_url, subprotocols=[bearer(KEYS["alice"]), "atp.v1.json"]) as ws:
        peer = Peer(ws, FrameCodec("json"), "sess-log")
        await peer.open("t1")
    await refused(env.ws_url, [bearer(wrong), "atp.v1.json"])
    await refused(env.ws_url, [bearer(KEYS["alice"]), "atp.v1.json"], [("Authorization", f"Bearer {wrong}")])
    await refused(env.ws_url, [bearer(KEYS["ops"]), "atp.v1.json"])
    refusals = [r for r in caplog.records if r.name == "atp.audit" and "esec (authentication) at websocket"
                in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in caplog.records if r.name == "atp.audit"]
    secrets = [KEYS["alice"], KEYS["ops"], wrong]
    secrets += [bearer(s).removeprefix("atp.bearer.") for s in secrets]
    for r in caplog.records:
        text = r.getMessage() + repr(r.__dict__)
        assert not [s for s in secrets if s in text], text
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
            trail = await h.get("/v1/audit", params={"limit": 1000},
                                headers={"Authorization": f"Bearer {KEYS['root']}"})
    assert trail.status_code == 200, trail.text
    assert "stream_open" in trail.text  # the 403 was audited
    assert not [s for s in secrets if s in trail.text]
