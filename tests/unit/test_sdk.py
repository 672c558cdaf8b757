"""The client SDK (``atp.Client``, spec §22) against a real router on loopback.

The router runs the default RIB (real ruff and bandit next-hops); tasks are
labelled golden tasks from ``shared/golden/dev.jsonl``. Also: bearer-token
authentication on every control-API endpoint, the SSE events and the WebSocket
handshake (ESEC, 401), and the SDK importing and working without the router's
dependencies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import atp
import httpx
import msgspec
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from atp_router.consensus.types import FinalResult
from atp_router.security.identity import Role
from atp_router.wire.codec import FrameCodec
from atp_router.wire.frame import Flag, Frame
from tests.conftest import start_router
from tests.helpers import golden

META = {"task_type": "code_review", "languages": ["py"]}
BUDGET = {"usd": 0.10, "tokens": 200_000}


async def test_golden_task_events_and_final_shape(router_env):
    """§8 steps 1-7 and §7.3: SYN_ACK, PARTIALs, FINAL, FIN; the FINAL is exactly
    ``{result, telemetry}``; the pickle line of thefuck#23 carries both agents."""
    async with atp.Client(router_env.url) as c:
        session_id, st = await c.open_stream(task=META, budget=BUDGET, content=golden("bugsinpy-thefuck-23"))
        assert session_id == st.session_id and str(st) == st.stream_id
        assert set(st.route["next_hops"]) == {"lint.ruff", "sec.bandit"}
        assert st.route["rib_version"] == 1 and st.route["policy"] == "code_review"
        assert st.window == {"max_parallel": 4, "max_tokens": 200_000, "max_usd_micros": 50_000}
        events = [ev async for ev in c.events(st)]

    types = [ev.type for ev in events]
    assert types[0] == "SYN_ACK" and types[-2:] == ["FINAL", "FIN"], types
    assert types.count("PARTIAL") >= 2 and "ERROR" not in types and "RST" not in types
    assert [ev.id for ev in events] == list(range(1, len(events) + 1))
    assert all(ev.frame["stream_id"] == st.stream_id for ev in events)

    final = events[-2].payload
    assert set(final) == {"result", "telemetry"}
    assert set(final["result"]) == {"findings", "consensus", "answers"}
    # Each next-hop's prose answer (a tool's summary line) beside the findings.
    assert {a["agent"] for a in final["result"]["answers"]} == {"lint.ruff", "sec.bandit"}
    assert all(a["text"].startswith(("ruff:", "bandit:")) for a in final["result"]["answers"])
    assert set(final["telemetry"]) == {"tokens", "usd", "latency_ms", "usage"}  # usage: the signed summary (§19)
    parsed = msgspec.convert(final, FinalResult)
    assert parsed.result.consensus.strategy == "union_tiebreak"
    assert parsed.telemetry.latency_ms > 0
    assert parsed.telemetry.tokens == 0 and parsed.telemetry.usd == 0.0  # static analysers cost nothing
    pickle = [f for f in parsed.result.findings if f.file == "thefuck/utils.py" and f.span.startswith("183")]
    assert pickle, parsed.result.findings
    assert {p.split("#")[0] for p in pickle[0].provenance} == {"lint.ruff", "sec.bandit"}

    reports = {ev.payload["agent"]: ev.payload for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}
    assert set(reports) == {"lint.ruff", "sec.bandit"}
    assert all(r["report"]["findings"] for r in reports.values())


async def test_result_is_the_final_payload(router_env):
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(task=META, budget=BUDGET, content=golden("bugsinpy-thefuck-23"))
        result = await c.result(st)
        final = [ev.payload async for ev in c.events(st) if ev.type == "FINAL"]
    assert final == [result]
    msgspec.convert(result, FinalResult)


async def test_result_raises_the_routers_code(router_env):
    """A window of zero calls admits no next-hop: every leg is refused (EWINDOW)
    and the stream ends in RST EAGENTDOWN, which result() raises."""
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(
            task=META, content=golden("bugsinpy-thefuck-23"),
            window={"max_parallel": 0, "max_tokens": 1000, "max_usd_micros": 1000},
        )
        with pytest.raises(atp.ATPClientError) as ei:
            await c.result(st)
        assert ei.value.code == "EAGENTDOWN"
        types = [ev.type async for ev in c.events(st)]
    assert types.count("ERROR") == 2 and types[-1] == "RST" and "FINAL" not in types


async def test_open_stream_errors_carry_spec_codes(router_env):
    async with atp.Client(router_env.url) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task={"task_type": "no_such_task"})
        assert (ei.value.code, ei.value.status) == ("EAGENTDOWN", 503)
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, content={"diff": 42})
        assert (ei.value.code, ei.value.status) == ("EPROTO", 400)
        assert "diff" in ei.value.reason
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, budget={"usd": -1})
        assert (ei.value.code, ei.value.status) == ("EPROTO", 400)


async def test_idempotency_key_returns_the_same_stream(router_env):
    """§8 resumption: re-opening with the same key gives the same stream."""
    async with atp.Client(router_env.url) as c:
        _, a = await c.open_stream(task=META, content=golden("bugsinpy-thefuck-23"), idempotency_key="k-1")
        _, b = await c.open_stream(task=META, content=golden("bugsinpy-thefuck-23"), idempotency_key="k-1")
        _, other = await c.open_stream(task=META, content=golden("bugsinpy-thefuck-23"), idempotency_key="k-2")
        assert a.stream_id == b.stream_id != other.stream_id
        await c.result(a)
        await c.result(other)


# ---------------------------------------------------------------------------- auth

TOKEN_A, TOKEN_B = "tok-alpha-0123456789", "tok-bravo-9876543210"
#: Tenant ``ops``, role operator only (metrics and health, no streams).
TOKEN_OPS = "tok-ops-5555555555"


@pytest.fixture
async def authed_env(nursery, policies_dir):
    return await start_router(nursery, policies_dir, tokens=frozenset({TOKEN_A, TOKEN_B}),
                              client_tokens={"ops": TOKEN_OPS}, client_roles={"ops": frozenset({Role.OPERATOR})})


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN_A}", TOKEN_A])
async def test_every_endpoint_refuses_missing_or_wrong_token(authed_env, header):
    """ESEC 401 on every endpoint, before anything else (an existing stream id
    is used so a 404 cannot stand in for the refusal)."""
    async with atp.Client(authed_env.url, TOKEN_A) as c:
        _, st = await c.open_stream(task=META, content=golden("bugsinpy-thefuck-23"))
        await c.result(st)
    sid = st.stream_id
    endpoints = [
        ("POST", "/v1/streams", {"task": META}),
        ("POST", f"/v1/streams/{sid}/frames", {"v": 1, "session_id": st.session_id, "stream_id": sid,
                                               "msg_seq": 1, "flags": ["FIN"]}),
        ("GET", f"/v1/streams/{sid}/events", None),
        ("POST", "/v1/policies/reload", None),
        ("GET", "/v1/routes", None),
        ("GET", "/v1/metrics", None),
    ]
    if header is not None:  # liveness answers any caller without a credential (README); a wrong one is refused
        endpoints.append(("GET", "/v1/health", None))
    headers = {"Authorization": header} if header else {}
    async with httpx.AsyncClient(base_url=authed_env.url, headers=headers) as h:
        for method, path, body in endpoints:
            r = await h.request(method, path, json=body)
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "ESEC", (method, path)
        if header is None:
            health = await h.get("/v1/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}  # nothing else to a stranger
    assert authed_env.router.gen.version == 1  # the refused reload did nothing


async def test_sdk_with_tokens(authed_env):
    async with atp.Client(authed_env.url, "not-a-token") as bad:
        with pytest.raises(atp.ATPClientError) as ei:
            await bad.open_stream(task=META)
        assert (ei.value.code, ei.value.status) == ("ESEC", 401)
    async with atp.Client(authed_env.url, TOKEN_A) as a, atp.Client(authed_env.url, TOKEN_B) as b:
        _, st = await a.open_stream(task=META, content=golden("bugsinpy-thefuck-23"))
        assert (await a.result(st))["result"]["findings"]
        # Metrics are an operator's: a client token is refused after authentication.
        with pytest.raises(atp.ATPClientError) as ei:
            await a.metrics()
        assert (ei.value.code, ei.value.status) == ("ESEC", 403)
        # Another valid token is another tenant: to it this stream does not exist.
        with pytest.raises(atp.ATPClientError) as ei:
            await b.result(st)
        assert (ei.value.code, ei.value.status) == ("EPROTO", 404)
    async with atp.Client(authed_env.url, TOKEN_OPS) as ops:
        assert "atp_streams_opened" in await ops.metrics()
        with pytest.raises(atp.ATPClientError) as ei:
            await ops.open_stream(task=META)
        assert (ei.value.code, ei.value.status) == ("ESEC", 403)  # an operator opens no stream
    async with atp.Client(authed_env.url) as anonymous:
        with pytest.raises(atp.ATPClientError) as ei:
            [ev async for ev in anonymous.events(st)]
        assert (ei.value.code, ei.value.status) == ("ESEC", 401)


@pytest.mark.parametrize("headers", [None, [("Authorization", "Bearer wrong")], [("Authorization", "bearer")]])
async def test_websocket_handshake_refuses_missing_or_wrong_token(authed_env, headers):
    with pytest.raises(ConnectionRejected) as ei:
        async with open_websocket_url(authed_env.ws_url, subprotocols=["atp.v1.json"], extra_headers=headers):
            pass
    assert ei.value.status_code == 401
    assert json.loads(ei.value.body)["error"]["code"] == "ESEC"


async def test_websocket_handshake_accepts_a_valid_token(authed_env):
    async with open_websocket_url(
        authed_env.ws_url, subprotocols=["atp.v1.json"], extra_headers=[("Authorization", f"Bearer {TOKEN_B}")]
    ) as ws:
        assert ws.subprotocol == "atp.v1.json"
        syn = Frame(v=1, session_id="s-auth", stream_id="t1", msg_seq=0, flags=[Flag.SYN], meta=META)
        await ws.send_message(FrameCodec("json").encode(syn).decode())
        with trio.fail_after(10):
            synack = json.loads(await ws.get_message())
    assert {"SYN", "ACK"} <= set(synack["flags"])


# ---------------------------------------------------------------- SDK on its own

_ISOLATED = textwrap.dedent(
    """
    import asyncio, importlib.abc, json, sys

    BLOCKED = {"trio", "msgspec", "starlette", "hypercorn", "cbor2"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: a client application does not have it")
            return None

    sys.meta_path.insert(0, Block())
    import atp

    try:
        import atp_router.runtime.router
    except ImportError:
        pass
    else:
        raise SystemExit("the block did not hold: atp_router.runtime imported")

    async def main(url, task):
        async with atp.Client(url) as c:
            _, st = await c.open_stream(task={"task_type": "code_review"}, budget={"usd": 0.1}, content=task)
            types = [ev.type async for ev in c.events(st)]
            final = await c.result(st)
        return types, final

    types, final = asyncio.run(main(sys.argv[1], json.loads(sys.stdin.read())))
    leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print(json.dumps({"types": types, "final": final, "leaked": leaked, "client": atp.Client.__module__}))
    """
)


async def test_sdk_imports_and_works_without_router_dependencies(router_env, tmp_path):
    """A client application has only httpx and httpx-sse: with trio, msgspec,
    starlette, hypercorn and cbor2 unimportable, ``import atp`` and a whole
    stream under asyncio still work."""
    proc = await trio.run_process(
        [sys.executable, "-c", _ISOLATED, router_env.url],
        stdin=json.dumps(golden("bugsinpy-thefuck-23")).encode(),
        capture_stdout=True, capture_stderr=True, cwd=tmp_path, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert out["leaked"] == [] and out["client"] == "atp._client"
    assert out["types"][0] == "SYN_ACK" and out["types"][-2:] == ["FINAL", "FIN"]
    assert set(out["final"]) == {"result", "telemetry"}


async def test_cli_reads_tokens_from_the_environment(policies_dir, tmp_path):
    """``atp-router`` takes its bearer tokens from ATP_ROUTER_TOKENS (comma-separated,
    blanks ignored): a listed token works, anything else is ESEC 401."""
    env = {**os.environ, "ATP_ROUTER_TOKENS": f" {TOKEN_A} ,, {TOKEN_B} ", "PYTHONUNBUFFERED": "1"}
    env.pop("ATP_HMAC_KEY", None)
    argv = [sys.executable, "-m", "atp_router.deploy.cli", "--policies", str(policies_dir),
            "--state-dir", str(tmp_path / "state"), "--http-port", "0", "--ws-port", "0", "--log-level", "WARNING"]
    proc = await trio.lowlevel.open_process(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(1)
                assert chunk, "atp-router exited before listening"
                line += chunk
        match = re.search(rb"listening (http://\S+) ws://", line)
        assert match, line
        url = match.group(1).decode()
        async with atp.Client(url, TOKEN_B) as good, atp.Client(url, "tok-alpha") as bad:
            _, st = await good.open_stream(task=META, content=golden("bugsinpy-thefuck-23"))
            assert (await good.result(st))["result"]["findings"]
            with pytest.raises(atp.ATPClientError) as ei:
                await bad.metrics()
            assert (ei.value.code, ei.value.status) == ("ESEC", 401)
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            assert await proc.wait() == 0
