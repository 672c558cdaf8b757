"""The control API (spec §22) of a real router on loopback: hot reload of the RIB,
SSE events (replay, ``Last-Event-ID``, concurrent followers), the HTTP frame
fallback, and the Prometheus metrics after real streams.

Real ruff and bandit next-hops review golden tasks. Where a test needs a next-hop
that is slow on purpose (to still be running across a reload, or while several
followers listen) it is an :class:`~atp_router.adapters.testing.ScriptedAdapter`,
registered through the adapter registry as RIB ``tool: scripted``: no real
analyser can be made to take a chosen time.
"""

from __future__ import annotations

import json

import atp
import httpx
import msgspec
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, FinalResult, Severity
from tests.helpers import golden, start_router_on

META = {"task_type": "code_review", "languages": ["py"]}


def finding(line: int = 183, claim: str = "scripted finding") -> AgentFinding:
    return AgentFinding(file="thefuck/utils.py", start=line, end=line, severity=Severity.HIGH, claim=claim,
                        confidence=0.9)


def agents_of(final: dict) -> set[str]:
    return {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]}


async def get_json(url: str, path: str) -> dict:
    async with httpx.AsyncClient(base_url=url) as h:
        r = await h.get(path)
        r.raise_for_status()
        return r.json()


# -------------------------------------------------------------------- hot reload

RUFF_ONLY = """
agents:
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}
policies:
  - name: ruff_only
    match: {task_type: code_review}
    fanout: [lint.ruff]
"""

BANDIT_ONLY = """
agents:
  sec.bandit: {layer: L1, tool: bandit, p95_ms: 900, strengths: [code_review, security]}
policies:
  - name: bandit_only
    match: {task_type: code_review}
    fanout: [sec.bandit]
"""


async def test_good_file_edit_takes_effect_on_the_next_stream(router_env):
    rib = router_env.policies / "default.yaml"
    text = rib.read_text()
    edited = text.replace(
        "  - name: code_review\n    match: { task_type: code_review }\n    fanout: [lint.ruff, sec.bandit]",
        "  - name: code_review\n    match: { task_type: code_review }\n    fanout: [lint.ruff]",
    )
    assert edited != text
    rib.write_text(edited)
    async with atp.Client(router_env.url) as c:
        assert await c.reload_policies() == {"version": 2, "policies": 2, "agents": ["lint.ruff", "sec.bandit"],
                                             "changes": [], "by": "anonymous"}
        routes = await get_json(router_env.url, "/v1/routes")
        assert routes["version"] == 2 and routes["routes"][1]["next_hops"] == ["lint.ruff"]
        assert (await get_json(router_env.url, "/v1/health"))["rib_version"] == 2
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route == {"policy": "code_review", "next_hops": ["lint.ruff"], "rib_version": 2}
        assert agents_of(await c.result(st)) == {"lint.ruff"}


async def test_yaml_body_reload_replaces_the_rib(router_env):
    async with atp.Client(router_env.url) as c:
        assert await c.reload_policies(BANDIT_ONLY) == {"version": 2, "policies": 1, "agents": ["sec.bandit"],
                                                        "changes": [], "by": "anonymous"}
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route == {"policy": "bandit_only", "next_hops": ["sec.bandit"], "rib_version": 2}
        assert agents_of(await c.result(st)) == {"sec.bandit"}
        # An empty body means "reload from the policy path": back to the files.
        assert (await c.reload_policies())["version"] == 3
        _, st = await c.open_stream(task=META, content=golden())
        assert set(st.route["next_hops"]) == {"lint.ruff", "sec.bandit"}


_FANOUT = "fanout: [lint.ruff, sec.bandit]\n    budget: { usd: 0.05, tokens: 200_000 }"
BAD_EDITS = {
    "yaml_syntax": ((_FANOUT, "fanout: [lint.ruff, sec.bandit\n    budget: { usd: 0.05, tokens: 200_000 }"),
                    "$", "YAML syntax error"),
    "unknown_agent": ((_FANOUT, "fanout: [lint.ruff, reviewer.ghost]\n    budget: { usd: 0.05, tokens: 200_000 }"),
                      "policies[1].fanout[1]", "reviewer.ghost"),
    "bad_comparison": (('diff_loc: ">400"', 'diff_loc: ">>400"'), "policies[0].match.diff_loc", ">>400"),
}


@pytest.mark.parametrize("via", ["file", "body"])
@pytest.mark.parametrize("case", sorted(BAD_EDITS))
async def test_bad_policy_is_refused_and_the_running_rib_stays(router_env, case, via):
    (old, new), key, words = BAD_EDITS[case]
    rib = router_env.policies / "default.yaml"
    bad = rib.read_text().replace(old, new)
    assert bad != rib.read_text()
    routes_before = await get_json(router_env.url, "/v1/routes")
    async with httpx.AsyncClient(base_url=router_env.url) as h:
        if via == "file":
            rib.write_text(bad)
            r = await h.post("/v1/policies/reload")
        else:
            r = await h.post("/v1/policies/reload", content=bad, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert set(err) == {"code", "file", "line", "key", "reason", "errors"}
    assert err["code"] == "EPROTO" and err["key"] == key and words in err["reason"]
    assert err["errors"][0] == {k: err[k] for k in ("file", "line", "key", "reason")}
    assert isinstance(err["line"], int) and err["line"] >= 1
    assert err["file"] == (str(rib) if via == "file" else "<request body>")

    assert await get_json(router_env.url, "/v1/routes") == routes_before
    assert (await get_json(router_env.url, "/v1/health"))["rib_version"] == 1
    async with atp.Client(router_env.url) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.reload_policies(bad if via == "body" else None)
        assert ei.value.status == 422 and ei.value.detail["key"] == key
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route["rib_version"] == 1 and set(st.route["next_hops"]) == {"lint.ruff", "sec.bandit"}
        assert agents_of(await c.result(st)) == {"lint.ruff", "sec.bandit"}
        metrics = await c.metrics()
    assert 'atp_policy_reloads_total{result="refused"} 2.0' in metrics


async def test_running_streams_finish_on_their_generation(nursery, tmp_path, scripted):
    """A reload swaps the RIB for new streams only: a stream whose task is
    running, and a stream opened (SYN) before the reload whose task arrives after
    it, both run on the generation that routed their SYN."""
    slow = scripted["review.slow"] = ScriptedAdapter.returning(
        "review.slow", [finding(claim="from generation 1")], partials=["thinking"], delay_s=0.3
    )
    env = await start_router_on(nursery, tmp_path, """
agents:
  review.slow: {layer: L2, tool: scripted, p95_ms: 300, timeout_ms: 10000, strengths: [code_review]}
policies:
  - name: slow
    match: {task_type: code_review}
    fanout: [review.slow]
""")
    async with atp.Client(env.url) as c:
        _, running = await c.open_stream(task=META, content=golden())
        _, syn_only = await c.open_stream(task=META)
        with trio.fail_after(5):
            while not slow.calls:
                await trio.sleep(0.01)
        assert (await c.reload_policies(RUFF_ONLY))["version"] == 2
        frames = await c.send_frame(syn_only, {
            "v": 1, "session_id": syn_only.session_id, "stream_id": syn_only.stream_id, "msg_seq": 1,
            "payload": {"type": "task", "content": golden()},
        })
        assert [f["flags"] for f in frames] == [["ACK"]]
        _, fresh = await c.open_stream(task=META, content=golden())
        assert fresh.route == {"policy": "ruff_only", "next_hops": ["lint.ruff"], "rib_version": 2}
        assert agents_of(await c.result(running)) == {"review.slow"}
        assert agents_of(await c.result(syn_only)) == {"review.slow"}
        assert agents_of(await c.result(fresh)) == {"lint.ruff"}
    assert running.route["rib_version"] == syn_only.route["rib_version"] == 1
    assert len(slow.calls) == 2


# -------------------------------------------------------------------------- SSE

async def test_late_subscriber_replays_every_event(router_env):
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        await c.result(st)  # the stream is over before anyone follows it
        first = [ev async for ev in c.events(st)]
        again = [ev async for ev in c.events(st)]
    assert [ev.id for ev in first] == list(range(1, len(first) + 1))
    assert first[0].type == "SYN_ACK" and [ev.type for ev in first[-2:]] == ["FINAL", "FIN"]
    assert [(ev.id, ev.type, ev.frame) for ev in again] == [(ev.id, ev.type, ev.frame) for ev in first]
    msgspec.convert(first[-2].payload, FinalResult)


async def test_last_event_id_resumes_after_that_event(router_env):
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        full = [ev async for ev in c.events(st)]
        for after in (0, 1, 2, len(full) - 1, len(full)):
            resumed = [ev async for ev in c.events(st, last_event_id=after)]
            assert [(ev.id, ev.frame) for ev in resumed] == [(ev.id, ev.frame) for ev in full[after:]]
    # The header itself, on the wire.
    headers = {"Last-Event-ID": str(len(full) - 1)}
    async with httpx.AsyncClient(base_url=router_env.url) as h, h.stream(
        "GET", f"/v1/streams/{st}/events", headers=headers
    ) as r:
        body = (await r.aread()).decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    assert body == f"id: {len(full)}\nevent: FIN\ndata: {json.dumps(full[-1].frame, separators=(',', ':'))}\n\n"


async def test_concurrent_subscribers_see_the_same_events(nursery, tmp_path, scripted):
    scripted["review.slow"] = ScriptedAdapter.returning(
        "review.slow", [finding()], partials=["a", "b", "c"], delay_s=0.05
    )
    env = await start_router_on(nursery, tmp_path, """
agents:
  review.slow: {layer: L2, tool: scripted, p95_ms: 300, strengths: [code_review]}
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}
policies:
  - match: {task_type: code_review}
    fanout: [review.slow, lint.ruff]
""")
    seen: dict[int, list] = {}

    async def follow(i: int, c: atp.Client, st) -> None:
        seen[i] = [(ev.id, ev.type, ev.frame) async for ev in c.events(st)]

    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(follow, i, c, st)
    assert seen[0] == seen[1] == seen[2]
    types = [t for _, t, _ in seen[0]]
    assert types[0] == "SYN_ACK" and types[-2:] == ["FINAL", "FIN"] and types.count("PARTIAL") == 5


async def test_unknown_stream_is_404(router_env):
    async with atp.Client(router_env.url) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            [ev async for ev in c.events("task_does_not_exist")]
        assert ei.value.status == 404 and ei.value.code == "EPROTO" and "task_does_not_exist" in ei.value.reason
        with pytest.raises(atp.ATPClientError) as ei:
            await c.send_frame("task_does_not_exist", {"v": 1, "session_id": "s", "stream_id": "x",
                                                       "msg_seq": 1, "flags": ["FIN"]})
        assert ei.value.status == 404


# ------------------------------------------------------------ HTTP frame fallback

async def test_client_rst_stops_the_task_and_ends_the_stream(nursery, tmp_path, scripted):
    """An RST from the client (spec §4.4) cancels the running next-hop call, ends
    the event log (followers return) and frees the stream; nothing answers it."""
    hang = scripted["review.hang"] = ScriptedAdapter.returning("review.hang", [], delay_s=3600)
    env = await start_router_on(nursery, tmp_path, """
agents:
  review.hang: {layer: L2, tool: scripted, p95_ms: 300, timeout_ms: 3600000, strengths: [code_review]}
policies:
  - match: {task_type: code_review}
    fanout: [review.hang]
    deadline_ms: 3600000
""")
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        with trio.fail_after(5):
            while not hang.calls:
                await trio.sleep(0.01)
        assert (await get_json(env.url, "/v1/health"))["open_streams"] == 1
        rst = {"v": 1, "session_id": st.session_id, "stream_id": st.stream_id, "msg_seq": 0, "flags": ["RST", "CTRL"],
               "payload": {"type": "control", "content": {"kind": "ERROR", "code": "EPREEMPT", "reason": "user"}}}
        assert await c.send_frame(st, rst) == []
        with trio.fail_after(5):
            types = [ev.type async for ev in c.events(st)]
    assert types == ["SYN_ACK"]
    assert (await get_json(env.url, "/v1/health"))["open_streams"] == 0
    state = env.router.ledger.state(f"stream:anonymous:{st.stream_id}")
    assert state.open_reservations == 0


async def test_client_fin_before_any_task_closes_cleanly(router_env):
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(task=META)
        fin = {"v": 1, "session_id": st.session_id, "stream_id": st.stream_id, "msg_seq": 0, "flags": ["FIN"]}
        frames = await c.send_frame(st, fin)
        assert [f["flags"] for f in frames] == [["FIN"]]
        assert [ev.type async for ev in c.events(st)] == ["SYN_ACK", "FIN"]


# ----------------------------------------------------------------------- metrics

def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_count_streams_calls_and_frames(router_env):
    async with atp.Client(router_env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        await c.result(st)
        m = samples(await c.metrics())
        assert m[("atp_streams_opened_total", (("qos", "silver"),))] == 1
        assert m[("atp_streams_closed_total", (("outcome", "final"),))] == 1
        assert m[("atp_open_streams", ())] == 0
        assert m[("atp_rib_version", ())] == 1
        for agent in ("lint.ruff", "sec.bandit"):
            assert m[("atp_agent_calls_total", (("agent", agent), ("outcome", "ok")))] == 1
            assert m[("atp_agent_latency_seconds_count", (("agent", agent),))] == 1
        assert m[("atp_frames_total", (("direction", "in"), ("kind", "SYN")))] == 1
        assert m[("atp_frames_total", (("direction", "out"), ("kind", "SYN_ACK")))] == 1
        assert m[("atp_frames_total", (("direction", "out"), ("kind", "FINAL")))] == 1
        assert m[("atp_frames_total", (("direction", "out"), ("kind", "FIN")))] == 1
        assert m[("atp_stream_latency_seconds_count", ())] == 1
        assert m[("atp_consensus_agreement_count", ())] == 1

        # A stream whose window admits nothing: two EWINDOW errors, no call, RST.
        _, st = await c.open_stream(task=META, content=golden(),
                                    window={"max_parallel": 0, "max_tokens": 1, "max_usd_micros": 1})
        [ev async for ev in c.events(st)]
        m = samples(await c.metrics())
    assert m[("atp_streams_opened_total", (("qos", "silver"),))] == 2
    assert m[("atp_streams_closed_total", (("outcome", "EAGENTDOWN"),))] == 1
    assert m[("atp_errors_total", (("code", "EWINDOW"),))] == 2
    assert m[("atp_errors_total", (("code", "EAGENTDOWN"),))] == 1
    assert m[("atp_agent_calls_total", (("agent", "lint.ruff"), ("outcome", "ok")))] == 1
    assert m[("atp_open_streams", ())] == 0


async def test_metrics_content_type_is_prometheus(router_env):
    async with httpx.AsyncClient(base_url=router_env.url) as h:
        r = await h.get("/v1/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE atp_streams_opened_total counter" in r.text

