"""Hot reload, complete (issue 8 items 6, 7; spec §4.3, §22): policy files
watched on disk, ROUTE_UPDATE deltas to WebSocket subscribers, and 100 reloads
(file edits, API bodies, broken files among them) while streams run — no
stream fails or is misrouted, a broken RIB never replaces a working one.

Next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` tools (RIB
``tool: scripted``) that name their generation in their finding, so a stream's
result shows which RIB routed it; no real analyser can be told what to answer.
"""

from __future__ import annotations

import json

import atp
import httpx
import msgspec
import trio
from trio_websocket import open_websocket_url

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, Severity
from atp_router.wire.codec import FrameCodec
from atp_router.wire.frame import Flag, Frame, RouteUpdate
from tests.helpers import golden, start_router_on
from tests.unit.test_router_dispatch import scripted_agent

META = {"task_type": "code_review"}
TOKENS = "alice:tok-alice-0000,ops:tok-ops-0000:admin+operator"


def _rib(agent: str, *, extra_task: str | None = None) -> str:
    policies = [{"name": "review", "match": {"task_type": "code_review"}, "fanout": [agent]}]
    if extra_task:
        policies.append({"name": extra_task, "match": {"task_type": extra_task}, "fanout": [agent]})
    return json.dumps({"agents": {a: scripted_agent() for a in ("gen.a", "gen.b")}, "policies": policies})


def _agents(scripted):
    for name in ("gen.a", "gen.b"):
        scripted[name] = ScriptedAdapter.returning(name, [AgentFinding(
            file="thefuck/utils.py", start=183, end=183, severity=Severity.HIGH, claim=f"by {name}",
            confidence=0.9)], delay_s=0.05)


def _table(routes: dict) -> tuple:
    """What a reload changes in ``GET /v1/routes`` (weights move with live metrics)."""
    return routes["version"], [(r["task_type"], r.get("policy"), r["next_hops"]) for r in routes["routes"]]


async def _wait_version(router, version: int, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while router.gen.version < version:
            await trio.sleep(0.02)


async def test_an_edited_policy_file_is_reloaded_and_a_broken_one_is_refused(nursery, tmp_path, scripted, caplog):
    _agents(scripted)
    env = await start_router_on(nursery, tmp_path, _rib("gen.a"), watch_policies=True, watch_debounce_ms=50)
    await trio.sleep(0.3)  # the watcher is up
    env.policies.write_text(_rib("gen.b"))
    await _wait_version(env.router, 2)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route["next_hops"] == ["gen.b"]
    env.policies.write_text(_rib("gen.a").replace('"fanout": ["gen.a"]', '"fanout": ["ghost"]'))
    with trio.fail_after(10):
        while "RIB refused" not in caplog.text:
            await trio.sleep(0.02)
    assert env.router.gen.version == 2
    assert "policies[0].fanout[0]: unknown agent 'ghost'" in caplog.text
    assert "rib.yaml:1:" in caplog.text  # file:line of the fault


async def test_route_update_subscription_gets_the_fib_then_deltas(nursery, tmp_path, scripted):
    _agents(scripted)
    env = await start_router_on(nursery, tmp_path, _rib("gen.a"), tokens_env=TOKENS)
    codec = FrameCodec("json")
    subscribe = Frame(v=1, session_id="down-1", stream_id="0", msg_seq=1, flags=[Flag.CTRL],
                      meta={"subscribe": "routes"})

    async def updates(ws, n: int) -> list[RouteUpdate]:
        out = []
        with trio.fail_after(10):
            while len(out) < n:
                f = codec.decode(await ws.get_message())
                if f.stream_id == "0" and f.payload is not None and isinstance(f.payload.content, dict) \
                        and f.payload.content.get("kind") == "ROUTE_UPDATE":
                    out.append(msgspec.convert(f.payload.content, RouteUpdate))
        return out

    async with open_websocket_url(env.ws_url, subprotocols=["atp.v1.json"],
                                  extra_headers=[("Authorization", "Bearer tok-ops-0000")]) as ws:
        await ws.send_message(codec.encode(subscribe).decode())
        [full] = await updates(ws, 1)
        assert full.version == 1 and [(r.task_type, r.policy, r.next_hops) for r in full.routes] == [
            ("code_review", "review", ["gen.a"])]
        async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": "Bearer tok-ops-0000"}) as h:
            r = await h.post("/v1/policies/reload", content=_rib("gen.b", extra_task="summarize"))
            assert r.status_code == 200, r.text
            [delta] = await updates(ws, 1)
            assert delta.version == 2 and delta.withdrawn == []
            assert {(r.task_type, r.next_hops[0]) for r in delta.routes} == {("code_review", "gen.b"),
                                                                             ("summarize", "gen.b")}
            r = await h.post("/v1/policies/reload", content=_rib("gen.b"))
            [delta] = await updates(ws, 1)
            assert delta.version == 3 and delta.routes == [] and delta.withdrawn == ["summarize"]
            # A refused RIB publishes nothing.
            r = await h.post("/v1/policies/reload", content="policies: 7")
            assert r.status_code == 422
            with trio.move_on_after(0.3):
                await updates(ws, 1)
                raise AssertionError("a refused reload published a ROUTE_UPDATE")
            # Live metrics move the FIB too: gen.b failing every call loses most of its weight.
            before = delta
            for _ in range(20):
                env.router.learning.learner.observe_call("gen.b", policy="review", latency_ms=50, ok=False,
                                                         timeout=False, tokens=0, usd_micros=0)
            [moved] = await updates(ws, 1)
            assert moved.version == 3 and [r.task_type for r in moved.routes] == ["code_review"]
            assert moved.routes[0].weights[0] < 0.5 * full.routes[0].weights[0]
            assert before.version == 3

    # A client (no routes_read) is refused, with ESEC on stream "0".
    async with open_websocket_url(env.ws_url, subprotocols=["atp.v1.json"],
                                  extra_headers=[("Authorization", "Bearer tok-alice-0000")]) as ws:
        await ws.send_message(codec.encode(subscribe).decode())
        with trio.fail_after(5):
            f = codec.decode(await ws.get_message())
        assert f.stream_id == "0" and f.payload.content["code"] == "ESEC"


async def test_100_reloads_while_streams_run(nursery, tmp_path, scripted):
    """50 file edits (watched) and 50 API reloads alternate between two RIBs,
    with a broken file or body after every fifth; streams run all along. Each
    stream is answered by the agent of the generation that routed its SYN."""
    _agents(scripted)
    env = await start_router_on(nursery, tmp_path, _rib("gen.a"), watch_policies=True, watch_debounce_ms=20,
                                tenant_rate_per_s=10_000, tenant_rate_burst=10_000)
    router = env.router
    await trio.sleep(0.3)
    results: list[tuple[int, str, set[str]]] = []
    stop = trio.Event()
    failures: list[str] = []

    async def client(n: int) -> None:
        async with atp.Client(env.url) as c:
            while not stop.is_set():
                _, st = await c.open_stream(task=META, content=golden())
                try:
                    final = await c.result(st)
                except atp.ATPClientError as e:
                    failures.append(f"{st.stream_id}: {e.code} {e.reason}")
                    continue
                gen_version = st.route["rib_version"]
                agents = {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]}
                results.append((gen_version, st.route["next_hops"][0], agents))

    async with trio.open_nursery() as clients:
        for i in range(4):
            clients.start_soon(client, i)
        expected: dict[int, str] = {1: "gen.a"}
        async with httpx.AsyncClient(base_url=env.url) as h:
            for i in range(100):
                agent = "gen.b" if i % 2 == 0 else "gen.a"
                before = router.gen.version
                routes_before = _table((await h.get("/v1/routes")).json())
                if i % 5 == 4:  # a broken RIB, by file or by API: refused, nothing changes
                    broken = _rib(agent).replace('"fanout": ["gen.', '"fanout": ["nope.')
                    if i % 10 == 4:
                        r = await h.post("/v1/policies/reload", content=broken)
                        assert r.status_code == 422
                    else:
                        env.policies.write_text(broken)
                        await trio.sleep(0.25)  # the watcher saw it and refused it
                    assert router.gen.version == before
                    assert _table((await h.get("/v1/routes")).json()) == routes_before
                    continue
                if i % 2 == 0:
                    env.policies.write_text(_rib(agent))
                    await _wait_version(router, before + 1)
                else:
                    r = await h.post("/v1/policies/reload", content=_rib(agent))
                    assert r.status_code == 200, r.text
                expected[router.gen.version] = agent
                await trio.sleep(0.03)
        stop.set()
    assert not failures, failures[:5]
    assert len(results) >= 50
    for version, hop, agents in results:
        assert hop == expected[version] and agents == {hop}, (version, hop, agents)
    assert router.gen.version == 1 + len(expected) - 1
