"""ATP compliance Level 3 (spec §17 "Advanced"): consensus strategies (§10
ECONSENSUS → escalate, §8 step 6), circuit breakers (§5.3), resumption (§8), CBOR
(§4.1) — over the WebSocket ingress and the HTTP control API only. Bandit routing
has no wire-visible contract in v0.1 and is not covered here.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio

from atp_router.consensus.types import FinalResult
from tests.conformance.wire import (
    closes,
    connect,
    errors,
    flags,
    frame,
    is_final,
    is_partial,
    syn,
    task,
)


def final_of(frames: list[dict]) -> FinalResult:
    finals = [f for f in frames if is_final(f)]
    assert len(finals) == 1, f"{len(finals)} FINAL frames"
    return msgspec.convert(finals[0]["payload"]["content"], FinalResult)


def agents_of(result: FinalResult) -> set[str]:
    return {p.split("#")[0] for fd in result.result.findings for p in fd.provenance}


async def run_task(target, sid: str, task_type: str, **kw) -> list[dict]:
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, sid + ".t1", task_type, content=task(), **kw))
        return await c.recv_until(closes, stream_id=sid + ".t1")


# --- §7.2 consensus strategies, §10 ECONSENSUS, §8 step 6 escalation -------------------------


async def test_no_quorum_is_reported_and_escalated(target):
    """§10 ECONSENSUS "No quorum → Escalate", §7.2 two-phase commit, §8 step 6: two
    next-hops flag different lines under ``two_phase_commit``; the router reports
    ECONSENSUS and calls the escalation next-hop, whose agreement commits the finding."""
    frames = await run_task(target, "s-l3-q", "conf.quorum")
    assert errors(frames, "ECONSENSUS"), "no quorum was not reported"
    assert target.peer.of("q-judge").calls == 1, "no escalation"
    result = final_of(frames)
    assert any({"q.a", "q.judge"} <= {p.split("#")[0] for p in f.provenance} for f in result.result.findings)


# --- §5.3 circuit breakers ---------------------------------------------------------------------


async def test_circuit_breaker_opens_backs_off_and_closes_on_a_probe(target):
    """§5.3 "Circuit breakers: open on repeated 5xx/timeouts; exponential backoff per
    agent", §10 EAGENTDOWN "Circuit break": a next-hop failing with HTTP 500 is
    reported with EAGENTDOWN; after 3 failures its circuit opens and tasks stop
    calling it (the other next-hop serves them); after the backoff one probe goes,
    succeeds, and the next-hop is back in the FINAL."""
    brk = target.peer.of
    for i in range(3):
        frames = await run_task(target, f"s-l3-b{i}", "conf.breaker")
        assert errors(frames, "EAGENTDOWN") and "steady2" in agents_of(final_of(frames))
    assert brk("brk").calls == 3
    frames = await run_task(target, "s-l3-b3", "conf.breaker")
    assert brk("brk").calls == 3, "the open circuit still let a call through"
    assert "steady2" in agents_of(final_of(frames))
    with trio.fail_after(target.profile.breaker_backoff_s * 2 + 10):
        i = 4
        while brk("brk").calls == 3:  # half-open after the backoff: one probe
            await trio.sleep(target.profile.breaker_backoff_s / 2)
            frames = await run_task(target, f"s-l3-b{i}", "conf.breaker")
            i += 1
    assert brk("brk").calls == 4 and brk("brk").ok == 1
    assert "brk" in agents_of(final_of(frames)), "the successful probe's result was not used"
    frames = await run_task(target, "s-l3-bz", "conf.breaker")
    assert brk("brk").calls == 5 and {"brk", "steady2"} <= agents_of(final_of(frames)), "circuit did not close"


# --- §8 resumption -----------------------------------------------------------------------------


async def test_stream_resumes_on_a_new_connection_without_a_second_call(target):
    """§8 Resumption: "idempotency keys allow re-opening a stream after transient
    failures; duplicates are dropped". The connection drops mid-task; a SYN with the
    same idempotency key on a new connection re-opens the stream, replays it from
    the start (SYN+ACK first) and runs on to one FINAL; the task re-sent is dropped
    as a duplicate; the next-hop was called once."""
    sid, st = "s-l3-r", "s-l3-r.t1"
    meta = {"idempotency_key": "conformance-resume-1"}
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, st, "conf.resume", meta=meta))
        await c.recv()
        await c.send(frame(sid, st, 1, [], payload={"type": "task", "content": task()}))
        await c.recv_until(is_partial, stream_id=st)
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, st, "conf.resume", meta=meta))
        await c.send(frame(sid, st, 1, [], payload={"type": "task", "content": task()}))
        frames = await c.recv_until(closes, stream_id=st)
    assert {"SYN", "ACK"} <= flags(frames[0])
    assert "FIN" in flags(frames[-1])
    assert "resume" in agents_of(final_of(frames))
    assert target.peer.of("resume").calls == 1, "the resumed stream called its next-hop again"


async def test_resume_after_replays_only_what_was_missed(target):
    """§8 Resumption, §4.5 ordering: re-opened with the last router msg_seq the
    client received (``meta.resume_after``), the stream replays only later
    messages, in order, then runs to one FINAL."""
    sid, st = "s-l3-ra", "s-l3-ra.t1"
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, st, "conf.resume", content=task(), meta={"idempotency_key": "conformance-resume-2"}))
        got = await c.recv_until(is_partial, stream_id=st)
    last = max(f["msg_seq"] for f in got if f.get("payload") and "ACK" not in flags(f) and "SYN" not in flags(f))
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, st, "conf.resume", meta={"idempotency_key": "conformance-resume-2", "resume_after": last}))
        frames = await c.recv_until(closes, stream_id=st)
    data = [f for f in frames if f.get("payload") and not ({"ACK", "SYN", "RST"} & flags(f))]
    assert not any("SYN" in flags(f) for f in frames)
    assert data and data[0]["msg_seq"] > last
    assert [f["msg_seq"] for f in data] == sorted({f["msg_seq"] for f in data})
    final_of(frames)
    assert target.peer.of("resume").calls == 1


async def test_http_open_with_the_same_idempotency_key_returns_the_same_stream(target):
    """§8 Resumption over the control API (§22 ``POST /v1/streams``): opening again
    with the same idempotency key returns the stream already opened; the task runs
    once."""
    headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
    body = {"task": {"task_type": "conf.resume"}, "content": task(), "idempotency_key": "conformance-resume-3"}
    async with httpx.AsyncClient(base_url=target.http, headers=headers, timeout=10) as http:
        first = (await http.post("/v1/streams", json=body)).json()
        again = (await http.post("/v1/streams", json=body)).json()
        assert first["stream_id"] == again["stream_id"]
        with trio.fail_after(10):
            while target.peer.of("resume").ok == 0:
                await trio.sleep(0.05)
    assert target.peer.of("resume").calls == 1


# --- §4.1 CBOR ---------------------------------------------------------------------------------


async def test_cbor_encoding_is_negotiated_and_carries_a_task(target):
    """§4.1 "Optional: CBOR for compact binary", §8 step 2 encoding negotiation: a
    client offering only the CBOR subprotocol gets it, and a task runs to FINAL in
    binary frames (checksums verified on CBOR frames by the suite's client)."""
    async with connect(target.ws, target.token, encoding="cbor") as c:
        assert c.ws.subprotocol == "atp.v1.cbor"
        await c.send(syn("s-l3-c", "s-l3-c.t1", content=task()))
        frames = await c.recv_until(closes, stream_id="s-l3-c.t1")
    assert {"rev.a", "rev.b"} <= agents_of(final_of(frames))


# --- §5.3 bounded retries: a cyclic fallback graph is refused at policy load ------------------


CYCLIC = """
models:
  m: {provider: openai_compat, base_url: "http://127.0.0.1:9/v1", ctx: 8k, cost: 1}
agents:
  a: {layer: L2, p95_ms: 100, model: m, fallback: b}
  b: {layer: L2, p95_ms: 100, model: m, fallback: a}
policies:
  - {match: {task_type: code_review}, fanout: [a]}
"""


async def test_cyclic_fallback_graph_is_refused_and_the_running_rib_stays(target):
    """Issue #3 §10 reroutes "never looping (a cyclic fallback graph is detected at
    policy load)", §22 ``POST /v1/policies/reload``: a RIB whose fallbacks form a
    cycle is refused with an error naming it; tasks still run on the running RIB."""
    if target.token is not None and target.admin_token is None:
        pytest.skip("policy reload is an admin's (set ATP_CONFORMANCE_ADMIN_TOKEN)")
    headers = {"Authorization": f"Bearer {target.admin_token}"} if target.admin_token else {}
    async with httpx.AsyncClient(base_url=target.http, headers=headers, timeout=10) as http:
        r = await http.post("/v1/policies/reload", content=CYCLIC, headers={"content-type": "application/yaml"})
    assert r.status_code == 422, r.text
    assert "fallback" in (r.json()["error"].get("key") or "") + r.json()["error"]["reason"]
    frames = await run_task(target, "s-l3-cy", "code_review")
    assert {"rev.a", "rev.b"} <= agents_of(final_of(frames))
