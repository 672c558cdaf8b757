"""Flow control through the real router (spec §5, §9, §10): one test per error code
of §10 in the situation its row names, plus windows and AIMD, the WINDOW_UPDATE
cadence, QoS preemption, circuit breakers, reroutes, fallbacks and ``ttl``.

Two harnesses, both the real :class:`~atp_router.runtime.router.Router` (sessions, FIB,
dispatcher, ledger, QoS scheduler, breakers):

* over the wire — the WebSocket ingress with the project's sans-IO client
  :class:`~atp_router.wire.session.Session`, or the HTTP API with the SDK — where a test
  is about frames on the wire;
* in process — frames fed to ``Router.open_stream`` / ``receive_frame`` and the
  stream's event log read directly, under ``trio``'s autojump clock, where a test
  is about timing (QoS latency, WINDOW_UPDATE cadence): deterministic, no sleeps.

Next-hops that must fail, hang or stream usage on cue are
:class:`~atp_router.adapters.testing.ScriptedAdapter` s registered as RIB ``tool:
scripted`` (they reproduce a provider adapter's shapes: ``AgentError`` with a
Retry-After, a hang past the deadline, cumulative usage on PARTIALs), since no
real peer can be made to fail on demand.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import atp
import msgspec
import pytest
import trio

from atp_router.adapters.base import Fragment
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, Severity, Usage
from atp_router.deploy import single
from atp_router.flow.breaker import RetryPolicy
from atp_router.policy.loader import load_rib_text
from atp_router.runtime.config import RouterConfig, build_authenticator
from atp_router.runtime.dataplane.eventlog import LoggedEvent
from atp_router.runtime.dataplane.stream import StreamCtx
from atp_router.runtime.router import Router
from atp_router.security.identity import ANONYMOUS, Identity, Role
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ErrorCode, PolicyError
from atp_router.wire.frame import (
    Budget,
    CostEstimate,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
    Window,
)
from tests.conftest import SHARED, start_router
from tests.unit.test_router_dispatch import (
    CLEAN,
    META,
    errors,
    golden,
    reporters,
    router_with,
    scripted_agent,
)
from tests.unit.test_router_ws import WINDOW, connect, task_payload

BIG_WINDOW = {"max_parallel": 64, "max_tokens": 10_000_000, "max_usd_micros": 100_000_000}


# ------------------------------------------------------------------ in-process harness

def agent(timeout_ms: int = 30_000, **extra: Any) -> dict:
    return {**scripted_agent(timeout_ms), **extra}


@asynccontextmanager
async def serving(tmp_path, doc: dict, **config: Any) -> AsyncIterator[Router]:
    """A real Router on the RIB ``doc`` (JSON is YAML), serving its background tasks."""
    path = tmp_path / f"rib-{secrets.token_hex(4)}.yaml"
    path.write_text(json.dumps(doc))
    router = single.build(RouterConfig(policies=path, **config))
    async with trio.open_nursery() as n:
        await n.start(router.serve)
        try:
            yield router
        finally:
            n.cancel_scope.cancel()


def tenant(name: str) -> Identity:
    """The identity an API key of tenant ``name`` authenticates as (role client);
    ``anonymous`` is the identity of a router without authentication."""
    return ANONYMOUS if name == "anonymous" else Identity(name, frozenset({Role.CLIENT}), name, "api_key")


def open_inproc(router: Router, *, task: dict | None = None, content: dict | None = None, client: str = "anonymous",
                qos: QoS | None = None, budget: Budget | None = None, key: str | None = None) -> StreamCtx:
    """Open a stream in-process as tenant ``client`` (:func:`tenant`)."""
    return router.open_stream(task=task or META, content=content or CLEAN, budget=budget, qos=qos, window=None,
                              idempotency_key=key, identity=tenant(client))


async def drain(ctx: StreamCtx) -> list[LoggedEvent]:
    return [ev async for ev in ctx.log.follow()]


def content_of(ev: LoggedEvent) -> Any:
    p = ev.frame.payload
    return msgspec.to_builtins(p.content) if p is not None else None


def errs(events: list[LoggedEvent]) -> list[dict]:
    return [content_of(ev) for ev in events if ev.type in ("ERROR", "RST")]


def types(events: list[LoggedEvent]) -> list[str]:
    return [ev.type for ev in events]


def high(file: str = "calc.py", line: int = 2, claim: str = "wrong operator") -> AgentFinding:
    return AgentFinding(file=file, start=line, end=line, severity=Severity.HIGH, claim=claim, confidence=0.9)


# ------------------------------------------------------------------ §10 EPROTO

async def test_eproto_bad_frame_is_answered_and_the_stream_reset(router_env):
    """EPROTO (bad frame/schema/version → RST): an unsupported version on an open
    stream resets it with RST EPROTO naming the version; the connection goes on."""
    async with connect(router_env.ws_url, "json", "s-eproto") as peer:
        await peer.open("t1")
        bad = Frame(v=1, session_id="s-eproto", stream_id="t1", msg_seq=1, flags=[Flag.MORE, Flag.FIN],
                    payload=Payload(type=PayloadType.TASK, content="x"))
        await peer.send(bad)
        await peer.pump_until(lambda: peer.closed("t1"))
        reset = [e for e in peer.events["t1"] if isinstance(e, S.StreamReset)]
        assert reset[0].error.code is ErrorCode.EPROTO and "illegal flag combination" in reset[0].error.reason
        await peer.send(peer.session.open_stream("t2", META, WINDOW, payload=task_payload()))
        await peer.pump_until(lambda: peer.closed("t2"))
        peer.final("t2")


# ------------------------------------------------------------------ §10 ESEQ_RETRY

async def test_eseq_retry_missing_fragment_is_requested_then_the_message_completes(router_env):
    """ESEQ_RETRY (missing/late fragment → request retransmit): fragment 1 of the
    task is withheld; the router NACKs with ESEQ_RETRY naming msg_seq 1 / frag_seq 1,
    and after the resend the task runs to its FINAL."""
    async with connect(router_env.ws_url, "json", "s-seq") as peer:
        await peer.open("t1")
        frames = peer.session.send_message("t1", Payload(type=PayloadType.TASK, content=json.dumps(golden())),
                                           max_chunk_chars=500)
        assert len(frames) >= 3
        await peer.send([frames[0], *frames[2:]])
        await peer.pump_until(lambda: bool(peer.errors("t1")))
        nack = peer.errors("t1")[0]
        assert (nack.code, nack.msg_seq, nack.frag_seq) == (ErrorCode.ESEQ_RETRY, 1, 1)
        await peer.send(frames[1])
        await peer.pump_until(lambda: peer.closed("t1"))
        peer.final("t1")


# ------------------------------------------------------------------ §10 EWINDOW

async def test_ewindow_next_hop_window_is_shared_by_streams_and_a_queued_send_is_nacked(
        tmp_path, scripted, autojump_clock):
    """EWINDOW (window exceeded → NACK + WINDOW_UPDATE): the next-hop's own window
    (one call) is shared by every stream. The second stream's call does not fit:
    it gets ERROR EWINDOW "queued until the window opens" and a WINDOW_UPDATE
    with the refusing window, then runs as soon as the first call completes
    (within the deadline) — nothing is dropped and nothing waits silently."""
    scripted["m.one"] = ScriptedAdapter.returning("m.one", delay_s=1.0)
    doc = {"agents": {"m.one": agent(window={"max_parallel": 1, "max_tokens": 1000, "max_usd_micros": 1000})},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.one"],
                         "window": BIG_WINDOW}]}
    async with serving(tmp_path, doc) as router:
        t0 = trio.current_time()
        a, b = open_inproc(router), open_inproc(router)
        events_a, events_b = await drain(a), await drain(b)
        assert trio.current_time() - t0 == pytest.approx(2.0)
    # Whichever task trio ran first got the slot; the other one was NACKed and queued.
    first, queued = (events_a, events_b) if not errs(events_a) else (events_b, events_a)
    assert errs(first) == [] and types(first)[-2:] == ["FINAL", "FIN"]
    assert errs(queued) == [{"kind": "ERROR", "code": "EWINDOW", "reason":
                             "m.one: next-hop window: parallel: 2 would exceed window 1; queued until the window opens"}]
    events_b = queued
    i = types(events_b).index("ERROR")
    assert events_b[i + 1].type == "WINDOW_UPDATE"
    assert content_of(events_b[i + 1])["window"] == {"max_parallel": 1, "max_tokens": 1000, "max_usd_micros": 1000}
    assert types(events_b)[-2:] == ["FINAL", "FIN"]
    assert len(scripted["m.one"].calls) == 2


async def test_ewindow_estimate_over_the_next_hop_window_is_refused_at_once(tmp_path, scripted, autojump_clock):
    """An estimate bigger than the next-hop's whole token window can never fit:
    NACK + WINDOW_UPDATE at once, no call, no queueing."""
    scripted["m.big"] = ScriptedAdapter.returning("m.big", estimate=CostEstimate(in_tokens=5000))
    doc = {"agents": {"m.big": agent(window={"max_parallel": 2, "max_tokens": 1000, "max_usd_micros": 1000})},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.big"],
                         "window": BIG_WINDOW}]}
    async with serving(tmp_path, doc) as router:
        events = await drain(open_inproc(router))
    assert [e["reason"] for e in errs(events) if e["code"] == "EWINDOW"] == [
        "m.big: next-hop window: tokens: 5000 would exceed window 1000"
    ]
    assert types(events)[-1] == "RST" and scripted["m.big"].calls == []


# ------------------------------------------------------------------ §5.3 AIMD, §5.4 cadence

async def test_aimd_on_the_next_hop_window_timeout_halves_timely_success_grows(tmp_path, scripted, autojump_clock):
    """AIMD with the field's names: ETIMEOUT halves the next-hop's cwnd (and
    ssthresh); timely successes grow it again (congestion avoidance)."""
    flaky = scripted["m.flaky"] = ScriptedAdapter.returning("m.flaky", delay_s=0.5)
    doc = {"agents": {"m.flaky": agent(timeout_ms=200, window={"max_parallel": 8, "max_tokens": 10_000,
                                                                "max_usd_micros": 10_000})},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.flaky"]}]}
    async with serving(tmp_path, doc, retry=RetryPolicy(max_attempts=1)) as router:
        w = router.gates.agent_windows.window("m.flaky")
        assert (w.cwnd, w.ssthresh) == (8, 8)
        events = await drain(open_inproc(router))
        # The only next-hop timed out: the stream ends ETIMEOUT (a gateway timeout, issue 24).
        assert [e["code"] for e in errs(events)] == ["ETIMEOUT", "ETIMEOUT"]
        assert (w.cwnd, w.ssthresh) == (4, 4)
        flaky.delay_s = 0.01
        for _ in range(4):
            await drain(open_inproc(router))
        assert 4 < w.cwnd < 5 and w.ssthresh == 4  # + 1/cwnd per timely ACK above ssthresh


async def test_window_update_keepalive_while_the_task_runs(tmp_path, scripted, autojump_clock):
    """§5.4 with ``window_update_interval_ms=100`` and ``window_update_keepalive_ms=300``:
    a stream whose call takes 1 s and whose window never moves gets its unchanged
    window every 300 ms, not every 100 ms (the SYN+ACK carried the first)."""
    scripted["m.slow"] = ScriptedAdapter.returning("m.slow", delay_s=1.0)
    doc = {"agents": {"m.slow": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.slow"]}]}
    async with serving(tmp_path, doc, window_update_interval_ms=100, window_update_keepalive_ms=300) as router:
        ctx = open_inproc(router)
        t0 = trio.current_time()
        seen: list[float] = []
        async for ev in ctx.log.follow():
            if ev.type == "WINDOW_UPDATE":
                seen.append(round(trio.current_time() - t0, 6))
    assert seen == pytest.approx([0.3, 0.6, 0.9])


async def test_window_update_on_a_20_percent_move_without_waiting_for_the_period(tmp_path, scripted, autojump_clock):
    """§5.4 "or when ≥ 20 % window delta occurs": an ETIMEOUT halves the stream's
    cwnd (2 → 1 calls): the WINDOW_UPDATE goes out at once, with the period at 60 s."""
    scripted["m.hang"] = ScriptedAdapter("m.hang", delay_s=math.inf)
    scripted["m.ok"] = ScriptedAdapter.returning("m.ok", delay_s=2.0)
    doc = {"agents": {"m.hang": agent(timeout_ms=300), "m.ok": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.hang", "m.ok"],
                         "window": {"max_parallel": 2, "max_tokens": 100_000, "max_usd_micros": 100_000}}]}
    async with serving(tmp_path, doc, window_update_interval_ms=60_000, retry=RetryPolicy(max_attempts=1)) as router:
        ctx = open_inproc(router)
        at: dict[str, float] = {}
        updates = []
        async for ev in ctx.log.follow():
            at.setdefault(ev.type, trio.current_time() - ctx.started)
            if ev.type == "WINDOW_UPDATE":
                updates.append(content_of(ev)["window"]["max_parallel"])
    # 2 → 1 at the timeout (0.3 s), 1 → 2 when m.ok answers in time (2 s): both ≥ 20 %.
    assert updates == [1, 2]
    assert at["WINDOW_UPDATE"] == pytest.approx(0.3) == at["ERROR"]


# ------------------------------------------------------------------ §10 EBUDGET

def _spender(name: str, steps: list[int], estimate: int = 100, delay_s: float = 0.1, **kw: Any) -> ScriptedAdapter:
    frags = [Fragment(type=PayloadType.PARTIAL, content=f"chunk {i}", usage=Usage(in_tokens=t))
             for i, t in enumerate(steps)]
    frags.append(Fragment(type=PayloadType.FINAL, content={"findings": []}, usage=Usage(in_tokens=steps[-1])))
    return ScriptedAdapter(name, frags, delay_s=delay_s, estimate=CostEstimate(in_tokens=estimate), **kw)


async def test_ebudget_exhaustion_ends_the_stream_with_error_then_fin(tmp_path, scripted, autojump_clock):
    """EBUDGET (budget exhausted → FIN): the only next-hop streams past the
    stream's 500 tokens and is cut; nothing was gathered, so the stream ends
    with ERROR EBUDGET then FIN (not RST), and exactly the budget is committed."""
    scripted["m.big"] = _spender("m.big", [200, 400, 600, 800])
    doc = {"agents": {"m.big": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.big"],
                         "budget": {"tokens": 500}}]}
    async with serving(tmp_path, doc) as router:
        ctx = open_inproc(router)
        events = await drain(ctx)
        state = router.ledger.state(ctx.account)
    assert types(events)[-2:] == ["ERROR", "FIN"] and "RST" not in types(events)
    codes = [(e["code"], e["reason"].split(":")[0]) for e in errs(events)]
    assert codes == [("EBUDGET", "m.big"), ("EBUDGET", "budget exhausted before any next-hop answered (m.big")]
    assert (state.committed_tokens, state.overage_tokens, state.reserved_tokens) == (500, 100, 0)


async def test_ebudget_client_budget_spans_its_streams(tmp_path, scripted, autojump_clock):
    """The client's budget (RIB ``clients``) caps all its streams together: the
    first stream spends the client's 1000 tokens; the next one of the same client
    is not called ("budget exhausted", ERROR EBUDGET + FIN) while another client
    is unaffected."""
    scripted["m.spend"] = _spender("m.spend", [600, 1000], estimate=400)
    doc = {"agents": {"m.spend": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.spend"]}],
           "clients": {"alice": {"budget": {"tokens": 1000}}}}
    async with serving(tmp_path, doc) as router:
        first = await drain(open_inproc(router, client="alice"))
        second = await drain(open_inproc(router, client="alice"))
        other = await drain(open_inproc(router, client="bob"))
        alice = router.ledger.state("client:alice")
    assert types(first)[-2:] == ["FINAL", "FIN"]
    assert next(e["reason"] for e in errs(second)) == (
        "m.spend not called: budget exhausted ('client:alice' tokens 1000/1000)")
    assert types(second)[-2:] == ["ERROR", "FIN"]
    assert types(other)[-2:] == ["FINAL", "FIN"]
    assert (alice.committed_tokens, alice.limit.tokens) == (1000, 1000)
    assert len(scripted["m.spend"].calls) == 2


# ------------------------------------------------------------------ §10 ETIMEOUT

async def test_etimeout_retries_with_backoff_then_reroutes_to_the_next_fib_candidate(tmp_path, scripted,
                                                                                  autojump_clock):
    """ETIMEOUT (agent timeout → retries + AIMD decrease): the best next-hop
    (fanout_k 1) hangs; it is retried once after a backoff, then the call is
    rerouted to the FIB's next candidate, which answers."""
    scripted["a.hang"] = ScriptedAdapter("a.hang", delay_s=math.inf)
    scripted["b.ok"] = ScriptedAdapter.returning("b.ok", [high()])
    doc = {"agents": {"a.hang": agent(timeout_ms=400, p95_ms=100), "b.ok": agent(p95_ms=900)},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.hang", "b.ok"],
                         "fanout_k": 1}]}
    async with serving(tmp_path, doc, seed=7) as router:
        ctx = open_inproc(router)
        assert [h.agent for h in ctx.route.next_hops] == ["a.hang"]
        assert [h.agent for h in ctx.route.alternates] == ["b.ok"]
        events = await drain(ctx)
        cwnd = router.gates.agent_windows.window("a.hang").cwnd
    reasons = [e["reason"] for e in errs(events)]
    assert reasons[0].startswith("a.hang: no answer within 400 ms; retry 2/2 in ")
    assert reasons[1:] == ["a.hang: no answer within 400 ms; rerouted to b.ok"]
    assert [e["code"] for e in errs(events)] == ["ETIMEOUT", "ETIMEOUT"]
    final = content_of(events[-2])
    assert [f["provenance"] for f in final["result"]["findings"]] == [["b.ok#0"]]
    assert len(scripted["a.hang"].calls) == 2 and len(scripted["b.ok"].calls) == 1
    assert cwnd == 4  # 16 → 8 → 4: each timed-out attempt halved the next-hop's window


# ------------------------------------------------------------------ §10 EAGENTDOWN

async def test_eagentdown_reroutes_to_the_rib_fallback_first(tmp_path, scripted, autojump_clock):
    """EAGENTDOWN (next-hop unhealthy → circuit break, reroute): the failing agent's
    RIB ``fallback`` (outside the policy's fanout) takes the call at once."""
    scripted["a.down"] = ScriptedAdapter("a.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 503")
    scripted["a.backup"] = ScriptedAdapter.returning("a.backup", [high()])
    doc = {"agents": {"a.down": agent(fallback="a.backup"), "a.backup": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.down"]}]}
    async with serving(tmp_path, doc) as router:
        events = await drain(open_inproc(router))
    assert [(e["code"], e["reason"]) for e in errs(events)] == [
        ("EAGENTDOWN", "a.down: HTTP 503; rerouted to a.backup")]
    assert types(events)[-2:] == ["FINAL", "FIN"]
    assert (len(scripted["a.down"].calls), len(scripted["a.backup"].calls)) == (1, 1)


async def test_eagentdown_opens_the_breaker_which_takes_the_agent_out_of_the_fib(tmp_path, scripted,
                                                                                autojump_clock):
    """EAGENTDOWN opens the agent's circuit breaker (threshold 1 here): the FIB
    lookup then excludes it — the next stream is routed to the other candidate,
    with no alternate left — and after the backoff, once its error rate has aged
    out of the breaker window, a half-open probe that succeeds closes it."""
    down = scripted["a.down"] = ScriptedAdapter("a.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 502")
    scripted["b.ok"] = ScriptedAdapter.returning("b.ok")
    doc = {"agents": {"a.down": agent(p95_ms=100), "b.ok": agent(p95_ms=900)},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.down", "b.ok"],
                         "fanout_k": 1}]}
    async with serving(tmp_path, doc, breaker_failures=1, breaker_window_s=2.0, breaker_backoff_s=5.0,
                       breaker_max_backoff_s=5.0) as router:
        events = await drain(open_inproc(router))
        assert [e["reason"] for e in errs(events)] == ["a.down: HTTP 502; rerouted to b.ok"]
        assert router.gates.breakers.open_agents(trio.current_time()) == {"a.down"}
        ctx = open_inproc(router)
        assert [h.agent for h in ctx.route.next_hops] == ["b.ok"] and ctx.route.alternates == []
        assert errs(await drain(ctx)) == []
        assert len(down.calls) == 1
        await trio.sleep(6.0)  # past the backoff (5 s capped) and the 2 s error-rate window: half-open
        down.fail_with = None
        down.fragments = [Fragment(type=PayloadType.FINAL, content={"findings": []}, usage=Usage())]
        ctx = open_inproc(router)
        assert [h.agent for h in ctx.route.next_hops] == ["a.down"]
        assert errs(await drain(ctx)) == []
        assert router.gates.breakers.statistics()["a.down"].state == "closed"


async def test_cyclic_fallback_graph_is_refused_at_load_and_reload(router_env):
    """Retries never loop: a fallback cycle is a PolicyError naming the cycle, and a
    reload carrying one is refused (422) with the running RIB kept."""
    cyclic = """
agents:
  a: {layer: L1, tool: ruff, p95_ms: 1, fallback: b}
  b: {layer: L1, tool: bandit, p95_ms: 1, fallback: c}
  c: {layer: L1, tool: ruff, p95_ms: 1, fallback: a}
  d: {layer: L1, tool: ruff, p95_ms: 1, fallback: a}
policies:
  - {match: {task_type: code_review}, fanout: [d]}
"""
    with pytest.raises(PolicyError) as ei:
        load_rib_text(cyclic, file="rib.yaml")
    assert (ei.value.key, ei.value.detail) == ("agents.a.fallback", "cyclic fallback a → b → c → a")
    async with atp.Client(router_env.url) as c:
        with pytest.raises(atp.ATPClientError) as ei2:
            await c.reload_policies(cyclic)
        assert ei2.value.status == 422 and ei2.value.detail["key"] == "agents.a.fallback"
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route["rib_version"] == 1


# ------------------------------------------------------------------ §10 ESEC

async def test_esec_data_scope_violation_resets_the_stream_and_is_audited(nursery, tmp_path, scripted, caplog):
    """ESEC (data-scope violation → RST, audit): a task labelled ``data_scope:
    [export_controlled]`` (a label no detector covers, so no redaction can make it
    safe) may go only to agents cleared for it; none is, so the SYN is refused with
    RST ESEC and an audit record. A task inside the clearance runs."""
    scripted["m.public"] = ScriptedAdapter.returning("m.public")
    env = await router_with(nursery, tmp_path, {"m.public": agent(data_scope=["public"])}, fanout=["m.public"])
    async with atp.Client(env.url) as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task={**META, "data_scope": ["export_controlled"]}, content=CLEAN)
        _, st = await c.open_stream(task={**META, "data_scope": ["public"]}, content=CLEAN)
        await c.result(st)
    assert (ei.value.code, ei.value.status) == ("ESEC", 403)
    assert "data_scope ['export_controlled'] is not cleared for any next-hop of policy p (m.public)" in ei.value.reason
    assert any(r.name == "atp.audit" and r.getMessage().startswith("esec by ") for r in caplog.records)
    assert len(scripted["m.public"].calls) == 1


# ------------------------------------------------------------------ §10 ECONSENSUS

async def test_econsensus_no_quorum_is_reported_and_escalated(tmp_path, scripted, autojump_clock):
    """ECONSENSUS (no quorum → escalate): under ``two_phase_commit`` a high finding
    flagged by one agent only has no quorum: ERROR ECONSENSUS, the escalation
    target is called, its ACK commits the finding."""
    scripted["a.one"] = ScriptedAdapter.returning("a.one", [high()])
    scripted["b.two"] = ScriptedAdapter.returning("b.two")
    scripted["c.judge"] = ScriptedAdapter.returning("c.judge", [high(claim="confirmed")])
    doc = {"agents": {"a.one": agent(), "b.two": agent(), "c.judge": agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.one", "b.two"],
                         "consensus": "two_phase_commit",
                         "escalation": {"on": ["low_conf"], "to": "c.judge"}}]}
    async with serving(tmp_path, doc) as router:
        events = await drain(open_inproc(router))
    assert errs(events) == [{"kind": "ERROR", "code": "ECONSENSUS",
                             "reason": "two_phase_commit: no quorum (escalating to c.judge)"}]
    final = content_of(events[-2])
    assert [sorted(p.split("#")[0] for p in f["provenance"]) for f in final["result"]["findings"]] == [
        ["a.one", "c.judge"]]
    assert "escalated on no_quorum" in final["result"]["consensus"]["uncertainties"]
    assert len(scripted["c.judge"].calls) == 1


# ------------------------------------------------------------------ §9 QoS, §10 EPREEMPT

async def _gold_latencies(router: Router, n: int) -> list[float]:
    out: list[float] = []

    async def one() -> None:
        ctx = open_inproc(router, task={"task_type": "gold_task"}, qos=QoS.GOLD)
        events = await drain(ctx)
        assert types(events)[-2:] == ["FINAL", "FIN"], errs(events)
        out.append(content_of(events[-2])["telemetry"]["latency_ms"])

    async with trio.open_nursery() as n_:
        for _ in range(n):
            n_.start_soon(one)
    return out


QOS_DOC = {
    "agents": {name: agent(window=BIG_WINDOW) for name in ("g.fast", "s.slow", "b.slow")},
    "policies": [
        {"name": "gold", "match": {"task_type": "gold_task"}, "fanout": ["g.fast"], "window": BIG_WINDOW},
        {"name": "silver", "match": {"task_type": "silver_task"}, "fanout": ["s.slow"], "window": BIG_WINDOW},
        {"name": "bronze", "match": {"task_type": "bronze_task"}, "fanout": ["b.slow"], "window": BIG_WINDOW},
    ],
}


async def test_epreempt_gold_keeps_its_latency_under_a_bronze_and_silver_flood(tmp_path, scripted, autojump_clock):
    """§9: 4 call slots, 1 reserved for gold. Baseline: 5 concurrent gold streams
    (200 ms calls). Flood: 20 bronze streams (3 s calls) take the 3 shared slots,
    20 silver streams queue behind them, then 5 gold streams arrive. Gold queued past ``preempt_after_ms``
    makes the router RST bronze streams with EPREEMPT and take their slots: gold
    latency stays within ``preempt_after_ms`` + one call of its baseline (not the
    3 s of a bronze call), no gold SLA is missed, and every silver stream still
    completes (WFQ, no starvation)."""
    scripted["g.fast"] = ScriptedAdapter.returning("g.fast", delay_s=0.2)
    scripted["s.slow"] = ScriptedAdapter.returning("s.slow", delay_s=3.0)
    scripted["b.slow"] = ScriptedAdapter.returning("b.slow", delay_s=3.0)
    config = {"slots": 4, "gold_reserved": 1, "preempt_after_ms": 250, "gold_sla_ms": 2000}
    async with serving(tmp_path, QOS_DOC, **config) as router:
        baseline = await _gold_latencies(router, 5)

    async with serving(tmp_path, QOS_DOC, **config) as router:
        flood: dict[str, list[list[LoggedEvent]]] = {"bronze": [], "silver": []}

        async def background(kind: str) -> None:
            ctx = open_inproc(router, task={"task_type": f"{kind}_task"}, qos=QoS(kind))
            flood[kind].append(await drain(ctx))

        async with trio.open_nursery() as n:
            for kind in ("bronze", "silver"):  # bronze first: it holds the 3 shared slots
                for _ in range(20):
                    n.start_soon(background, kind)
                await trio.sleep(0.05)
            flooded = await _gold_latencies(router, 5)
        stats = router.gates.slots.scheduler.statistics()

    assert sorted(baseline) == [200.0] * 4 + [400.0]  # gold may use all 4 slots: 4 run, then 1
    # Under the flood gold waits at most preempt_after_ms more; without preemption it
    # would wait for a 3 s bronze call to end.
    assert max(flooded) <= max(baseline) + 250
    assert stats.gold_sla_misses == 0 and stats.bronze.preempted == 3
    assert stats.gold.granted == 5 and stats.silver.granted == 20
    preempted = [e for evs in flood["bronze"] for e in errs(evs) if e["code"] == "EPREEMPT"]
    assert len(preempted) == stats.bronze.preempted + stats.bronze.shed
    assert all(evs[-1].type == "RST" for evs in flood["bronze"] if any(e["code"] == "EPREEMPT" for e in errs(evs)))
    assert all(types(evs)[-2:] == ["FINAL", "FIN"] for evs in flood["silver"]) and len(flood["silver"]) == 20


# ------------------------------------------------------------------ ttl (§4.2)

async def test_ttl_is_decremented_per_hop_and_a_frame_at_zero_is_dropped_with_an_error(nursery, tmp_path, scripted):
    """Over the WebSocket: a SYN at ttl 3 reaches the next-hop with ttl 2 in its
    meta (one router hop); a SYN at ttl 0 is refused (RST EPROTO "ttl expired");
    a DATA frame at ttl 0 on an open stream is NACKed and the stream goes on."""
    seen = scripted["m.echo"] = ScriptedAdapter.returning("m.echo")
    env = await router_with(nursery, tmp_path, {"m.echo": agent()}, fanout=["m.echo"])
    async with connect(env.ws_url, "json", "s-ttl") as peer:
        syn = peer.session.open_stream("t1", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN))
        await peer.send(msgspec.structs.replace(syn, ttl=3))
        await peer.pump_until(lambda: peer.closed("t1"))
        assert seen.calls[0].meta["ttl"] == 2

        dead = peer.session.open_stream("t0", META, WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN))
        await peer.send(msgspec.structs.replace(dead, ttl=0))
        await peer.pump_until(lambda: peer.closed("t0"))
        reset = next(e for e in peer.events["t0"] if isinstance(e, S.StreamReset))
        assert (reset.error.code, reset.error.reason) == (ErrorCode.EPROTO, "ttl expired")

        await peer.open("t2")
        late = peer.session.send_message("t2", Payload(type=PayloadType.TASK, content=CLEAN))
        await peer.send(msgspec.structs.replace(late[0], ttl=0))
        await peer.pump_until(lambda: bool(peer.errors("t2")))
        assert (peer.errors("t2")[0].code, peer.errors("t2")[0].reason) == (ErrorCode.EPROTO, "ttl expired")
        assert not peer.closed("t2")
    assert len(seen.calls) == 1


# ------------------------------------------------------------------ BUDGET_UPDATE (§4.3)

async def test_budget_update_over_ws_raises_the_budget_live(nursery, tmp_path, scripted):
    """BUDGET_UPDATE on the WebSocket: a stream opened with 100 tokens would have
    its 300-token call refused; raised to 1000 before the task, the call runs."""
    scripted["m.cost"] = ScriptedAdapter.returning("m.cost", usage=Usage(in_tokens=250),
                                                   estimate=CostEstimate(in_tokens=300))
    env = await router_with(nursery, tmp_path, {"m.cost": agent()}, fanout=["m.cost"])
    from atp_router.wire.frame import BudgetUpdate

    async with connect(env.ws_url, "json", "s-bu") as peer:
        await peer.send(peer.session.open_stream("t1", {**META, "budget": {"tokens": 100}}, WINDOW))
        await peer.pump_until(lambda: any(isinstance(e, S.StreamAccepted) for e in peer.events["t1"]))
        await peer.send(peer.session.send_control("t1", BudgetUpdate(budget=Budget(tokens=1000))))
        await peer.send(peer.session.send_message("t1", Payload(type=PayloadType.TASK, content=CLEAN)))
        await peer.pump_until(lambda: peer.closed("t1"))
        peer.final("t1")
        assert peer.errors("t1") == []
    state = env.router.ledger.state("stream:anonymous:t1")
    assert (state.limit.tokens, state.committed_tokens) == (1000, 250)


async def test_budget_update_over_http_with_the_sdk_lowers_the_budget_live(nursery, tmp_path, scripted):
    """BUDGET_UPDATE with ``Client.budget_update`` (the HTTP frames endpoint): a
    stream whose first call is running is lowered to what it holds; its second
    call (queued behind a one-call window) is then not admitted: EBUDGET."""
    scripted["a.first"] = ScriptedAdapter.returning("a.first", usage=Usage(in_tokens=100), delay_s=0.5,
                                                    estimate=CostEstimate(in_tokens=100))
    scripted["b.second"] = ScriptedAdapter.returning("b.second", estimate=CostEstimate(in_tokens=100))
    env = await router_with(nursery, tmp_path, {"a.first": agent(p95_ms=10), "b.second": agent(p95_ms=900)},
                            fanout=["a.first", "b.second"],
                            window={"max_parallel": 1, "max_tokens": 100_000, "max_usd_micros": 100_000})
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=CLEAN, budget={"tokens": 10_000})
        with trio.fail_after(5):
            while not scripted["a.first"].calls:
                await trio.sleep(0.01)
        acks = await c.budget_update(st, tokens=0)
        assert [f["flags"] for f in acks] == [["ACK"]] and acks[0]["msg_seq"] == 1
        events = [ev async for ev in c.events(st)]
    assert [(e["code"], e["reason"].split(" (")[0]) for e in errors(events) if e["code"] == "EBUDGET"] == [
        ("EBUDGET", "b.second not called: budget exhausted")]
    assert reporters(events) == {"a.first"} and scripted["b.second"].calls == []
    state = env.router.ledger.state(f"stream:anonymous:{st.stream_id}")
    assert (state.limit.tokens, state.committed_tokens) == (100, 100)


# ------------------------------------------------------------------ per-agent windows (sans-IO)

def test_window_table_keeps_aimd_state_and_calls_in_flight_across_reloads():
    from atp_router.flow.window import Estimate, WindowTable

    table = WindowTable(Window(4, 1000, 1000), {"a": Window(8, 100, 100)})
    a = table.window("a")
    call = a.on_send(Estimate(50, 0))
    a.on_complete(a.on_send(Estimate(10, 0)), 10, 0, ok=False, timely=True)
    assert (a.cwnd, table.window("b").limits) == (4, Window(4, 1000, 1000))
    table.configure({"a": Window(2, 100, 100), "c": None})  # reload: "a" narrower, "b" gone
    assert table.window("a") is a and a.cwnd == 2 and a.in_flight == 1
    assert "b" not in table.statistics() and table.window("c").limits == Window(4, 1000, 1000)
    assert not a.admit_when_idle(Estimate(101, 0)).admitted and a.admit_when_idle(Estimate(100, 0)).admitted
    a.on_cancel(call)  # a cancelled call: out of flight, no AIMD
    assert (a.in_flight, a.cwnd) == (0, 2)


# ------------------------------------------------------------------ atp-router flags (conformance against a remote router)

def test_cli_flags_configure_flow_control_as_the_conformance_profile_documents(tmp_path):
    """``atp-router`` sets every timing and capacity the conformance suite needs
    from a remote target (tests/conformance/README.md, ATP_CONFORMANCE_*): the
    command line the CLI documents for the suite's local profile yields the very
    RouterConfig the suite's local router runs with. Without flags: the
    RouterConfig defaults. Inconsistent values are refused (exit status 2)."""
    import re
    import shlex

    from atp_router.deploy import cli
    from tests.conformance.conftest import local_config

    documented = re.search(r"its local\s+profile: ``(.+?)``", cli.__doc__, re.DOTALL).group(1)
    got = cli.config_from_args(["--policies", str(tmp_path), *shlex.split(documented)], environ={})
    want = local_config(tmp_path)
    fields = ("window_update_interval_ms", "window_update_delta", "hb_interval_s", "hb_timeout_s", "resume_grace_s",
              "breaker_failures", "breaker_window_s", "breaker_backoff_s", "breaker_max_backoff_s", "slots",
              "gold_reserved", "preempt_after_ms", "gold_sla_ms")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert (got.retry.max_attempts, got.retry.base_backoff_s, got.retry.max_backoff_s) == (
        want.retry.max_attempts, want.retry.base_backoff_s, want.retry.max_backoff_s)

    defaults = RouterConfig(policies=tmp_path)
    plain = cli.config_from_args(["--policies", str(tmp_path)], environ={"ATP_ROUTER_TOKENS": "alice:tok-a"})
    assert {f: getattr(plain, f) for f in (*fields, "retry")} == {f: getattr(defaults, f) for f in (*fields, "retry")}
    assert plain.tokens_env == "alice:tok-a"
    assert build_authenticator(plain).authenticate("Bearer tok-a", now=0.0).tenant == "alice"
    for bad in (["--gold-reserved", "64"], ["--preempt-after-ms", "3000"], ["--hb-interval-s", "0"],
                ["--retry-backoff-s", "5"]):
        with pytest.raises(SystemExit) as ei:
            cli.config_from_args(bad, environ={})
        assert ei.value.code == 2


def test_cli_installs_log_redaction_after_configuring_logging(tmp_path, caplog):
    """``atp-router`` masks Agent Context secrets in every log handler: after
    ``main`` (here it stops at once: no RIB there), a record carrying a secret a
    client sent is printed with ``[REDACTED]``."""
    from atp_router.adapters.context import REDACTED, RedactingFilter, register_secrets
    from atp_router.deploy import cli

    root = logging.getLogger()
    try:
        assert cli.main(["--policies", str(tmp_path / "missing")]) == 2
        secret = "tok-" + secrets.token_hex(8)
        register_secrets([secret])
        logging.getLogger("atp_router.runtime").warning("client sent %s", secret)
        assert caplog.records[-1].getMessage() == f"client sent {REDACTED}"
    finally:
        for h in root.handlers:
            for f in [f for f in h.filters if isinstance(f, RedactingFilter)]:
                h.removeFilter(f)


# ------------------------------------------------------------------ Agent Context Protocol at ingress

CONTEXT_EXAMPLE = SHARED / "specs" / "agent-context-message.example.json"


async def test_syn_with_an_agent_context_routes_by_its_policy_labels_and_never_leaks_its_secrets(
        nursery, tmp_path, scripted, caplog):
    """The example Agent Context Message of the draft in ``meta.agent_context``:
    its policyContext labels (``acp.policy:P001``, ``P002``) join the task's
    data_scope, so the stream goes to the agent cleared for them, and is refused
    (RST ESEC) where only ``public`` is cleared; the next-hop receives the message
    as sent. A context with a misspelt sub-context is reset with EPROTO naming
    the field. The securityContext token is registered for the log filter and
    appears in no frame the router sends and no log record."""
    from atp_router.adapters.context import known_secrets

    caplog.set_level(logging.DEBUG)
    message = json.loads(CONTEXT_EXAMPLE.read_text())
    token = message["agentContext"]["securityContext"]["authenticationInfo"]["token"]
    scripted["m.cleared"] = ScriptedAdapter.returning("m.cleared")
    scripted["m.public"] = ScriptedAdapter.returning("m.public")
    doc = {"agents": {"m.cleared": agent(data_scope=["acp.policy:P001", "acp.policy:P002"]),
                      "m.public": agent(data_scope=["public"])},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.cleared"]},
                        {"name": "q", "match": {"task_type": "public_review"}, "fanout": ["m.public"]}]}
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    env = await start_router(nursery, path)
    bad = json.loads(json.dumps(message))
    bad["agentContext"]["securityContex"] = bad["agentContext"].pop("securityContext")
    async with connect(env.ws_url, "json", "s-acp") as peer:
        await peer.send(peer.session.open_stream("t1", {**META, "agent_context": message}, WINDOW,
                                                 payload=Payload(type=PayloadType.TASK, content=CLEAN)))
        await peer.send(peer.session.open_stream("t2", {"task_type": "public_review", "agent_context": message},
                                                 WINDOW, payload=Payload(type=PayloadType.TASK, content=CLEAN)))
        await peer.send(peer.session.open_stream("t3", {**META, "agent_context": bad}, WINDOW,
                                                 payload=Payload(type=PayloadType.TASK, content=CLEAN)))
        await peer.pump_until(lambda: all(peer.closed(t) for t in ("t1", "t2", "t3")))
        peer.final("t1")
    prompt = scripted["m.cleared"].calls[0]
    assert prompt.meta["agent_context"] == message
    assert prompt.meta["data_scope"] == ["acp.policy:P001", "acp.policy:P002"]
    refusals = {t: next(e.error for e in peer.events[t] if isinstance(e, S.StreamReset)) for t in ("t2", "t3")}
    assert refusals["t2"].code is ErrorCode.ESEC and "acp.policy:P001" in refusals["t2"].reason
    assert refusals["t3"].code is ErrorCode.EPROTO and "agent_context" in refusals["t3"].reason
    assert "securityContex" in refusals["t3"].reason and scripted["m.public"].calls == []
    assert token in known_secrets()
    sent = b"".join(FrameCodec("json").encode(f) for f in peer.raw)
    assert token.encode() not in sent
    assert all(token not in r.getMessage() and token not in (r.exc_text or "") for r in caplog.records)


# ------------------------------------------------------------------ hot reload closes the adapters it dropped

class ClosingAdapter(ScriptedAdapter):
    """A ScriptedAdapter that records ``aclose`` (what drops a 2389 agent's broker
    connection or a model adapter's HTTP pool)."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, [Fragment(type=PayloadType.FINAL, content={"findings": []}, usage=Usage())], **kw)
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def test_reload_closes_a_dropped_adapter_once_no_stream_of_its_generation_runs(
        tmp_path, scripted, autojump_clock):
    """Generation 1 has ``m.old`` and ``m.keep``; a stream runs on both. A reload
    drops ``m.old``: it stays open while that stream's call runs (the stream
    finishes on its generation), and is closed — once — when it ends. ``m.keep``,
    unchanged, is the same adapter in generation 2 and stays open. A second
    reload that drops ``m.keep`` with no stream running closes it at once."""
    old = scripted["m.old"] = ClosingAdapter("m.old", delay_s=2.0)
    keep = scripted["m.keep"] = ClosingAdapter("m.keep")

    def rib(*agents: str) -> str:
        return json.dumps({"agents": {a: agent() for a in agents},
                           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": list(agents)}]})

    path = tmp_path / "rib.yaml"
    path.write_text(rib("m.old", "m.keep"))
    router = single.build(RouterConfig(policies=path))
    async with trio.open_nursery() as n:
        await n.start(router.serve)
        ctx = open_inproc(router)
        await trio.sleep(0.5)
        scripted["m.new"] = ClosingAdapter("m.new")
        assert router.reload(rib("m.keep", "m.new"))["version"] == 2
        await trio.sleep(1.0)
        assert (old.closed, keep.closed) == (0, 0)  # generation 1 still runs a call on m.old
        events = await drain(ctx)
        await trio.testing.wait_all_tasks_blocked()
        assert types(events)[-2:] == ["FINAL", "FIN"] and len(old.calls) == 1
        assert (old.closed, keep.closed) == (1, 0)
        assert router.gen.adapters["m.keep"] is keep
        router.reload(rib("m.new"))
        await trio.testing.wait_all_tasks_blocked()
        assert (old.closed, keep.closed, scripted["m.new"].closed) == (1, 1, 0)
        n.cancel_scope.cancel()
    assert scripted["m.new"].closed == 1  # the router closes what it still holds when it stops
