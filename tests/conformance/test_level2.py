"""ATP compliance Level 2 (spec §17 "Secure"): authn/authz, signatures, data-scope
tags (§10 ESEC), QoS (§9, EPREEMPT) — over the WebSocket ingress and the HTTP
control API only.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio
from trio_websocket import ConnectionRejected

from atp_router.consensus.types import FinalResult
from tests.conformance.conftest import start_local
from tests.conformance.wire import (
    closes,
    connect,
    error_of,
    errors,
    flags,
    frame,
    is_final,
    sealed,
    syn,
    task,
)

HMAC_KEY = b"conformance-hmac-key"


def task_frame(session_id: str, stream_id: str, msg_seq: int = 1) -> dict:
    return frame(session_id, stream_id, msg_seq, [], payload={"type": "task", "content": task()})


# --- §11 authentication and authorization (ESEC) --------------------------------------------


async def test_missing_or_unknown_token_is_refused(target):
    """§11 authn, §10 ESEC: without a valid bearer token the WebSocket handshake is
    refused (401) and the control API answers 401 with an ESEC error."""
    if target.token is None:
        pytest.skip("the target runs without authentication (set ATP_CONFORMANCE_TOKEN)")
    for token in (None, "not-a-token"):
        with pytest.raises(ConnectionRejected) as e:
            async with connect(target.ws, token):
                pass
        assert e.value.status_code == 401
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(base_url=target.http) as http:
            r = await http.post("/v1/streams", json={"task": {"task_type": "code_review"}}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "ESEC"


async def test_another_clients_session_id_is_another_session(target):
    """§11 authz (streams are scoped to the authenticated principal): a session id
    another client uses is, for this client, simply another session. Its frame
    there is answered exactly as on an id nobody uses (no oracle), its SYN on the
    same ids opens a stream of its own, and the owner's stream runs on untouched
    and is never sent to it."""
    if target.token_b is None:
        pytest.skip("needs two clients (ATP_CONFORMANCE_TOKEN and ATP_CONFORMANCE_TOKEN_B)")
    async with connect(target.ws, target.token) as a, connect(target.ws, target.token_b) as b:
        await a.send(syn("s-l2-own", "s-l2-own.t1"))
        await a.recv()
        await b.send(task_frame("s-l2-own", "s-l2-own.t1"))
        taken = error_of((await b.recv_until(lambda f: error_of(f) is not None))[-1])
        await b.send(task_frame("s-l2-nul", "s-l2-nul.t1"))
        never = error_of((await b.recv_until(lambda f: error_of(f) is not None))[-1])
        assert taken["code"] == never["code"]
        assert taken["reason"].replace("s-l2-own", "?") == never["reason"].replace("s-l2-nul", "?")
        await b.send(syn("s-l2-own", "s-l2-own.t1", content=task()))
        theirs = await b.recv_until(closes, stream_id="s-l2-own.t1")
        await a.send(task_frame("s-l2-own", "s-l2-own.t1"))
        frames = await a.recv_until(closes, stream_id="s-l2-own.t1")
        # B's connection stays open past the end of A's stream: nothing of it may come.
        leaked = await b.quiet(0.5, stream_id="s-l2-own.t1")
    assert sum(is_final(f) for f in frames) == 1 and not errors(frames, "ESEC")
    assert sum(is_final(f) for f in theirs) == 1 and leaked == []
    assert target.peer.of("rev-a").calls == 2


@pytest.mark.parametrize("labels, allowed", [(["secret"], False), (["public"], True)])
async def test_data_scope_violation_is_reset_with_esec(target, labels, allowed):
    """§10 ESEC "Data-scope violation → RST, audit", §11 data-scope tags: a task
    whose ``meta.data_scope`` labels no next-hop is cleared for is reset with ESEC
    and reaches no next-hop; with cleared labels it runs."""
    sid = f"s-l2-ds{allowed}"
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, sid + ".t1", "conf.scoped", content=task(), meta={"data_scope": labels}))
        frames = await c.recv_until(closes, stream_id=sid + ".t1")
    if allowed:
        assert sum(is_final(f) for f in frames) == 1 and not errors(frames, "ESEC")
    else:
        assert "RST" in flags(frames[-1]) and error_of(frames[-1])["code"] == "ESEC"
        assert target.peer.of("scoped").calls == 0


# --- §11 signatures ---------------------------------------------------------------------------


@pytest.fixture
async def signed(target, nursery, tmp_path):
    """A target that requires HMAC-SHA256 frame signatures: the remote one when
    ATP_CONFORMANCE_HMAC_KEY is set, else this repository's router started with a key."""
    if target.hmac_key is not None:
        return target.ws, target.token, target.hmac_key
    if not target.local:
        pytest.skip("set ATP_CONFORMANCE_HMAC_KEY to test signatures on a target that requires them")
    _, ws = await start_local(nursery, tmp_path, target.peer, hmac_key=HMAC_KEY)
    return ws, target.token, HMAC_KEY


@pytest.mark.parametrize("how", ["unsigned", "wrong key"])
async def test_unsigned_or_badly_signed_frame_is_refused_with_esec(signed, how):
    """§4.2 ``sig`` HMAC-SHA256, §11 signatures: where signatures are required, a
    frame without ``sig`` or with one made under another key is refused with ESEC
    and opens nothing."""
    ws, token, key = signed
    async with connect(ws, token, hmac_key=key) as c:
        raw = sealed(syn("s-l2-sig", "s-l2-sig.t1"), None if how == "unsigned" else b"another key")
        await c.send(raw.decode())
        f = (await c.recv_until(lambda f: error_of(f) is not None))[-1]
        assert error_of(f)["code"] == "ESEC"
        assert not ({"SYN", "ACK"} <= flags(f))


async def test_signed_frames_are_accepted_and_answered_signed(signed):
    """§11 signatures: signed frames open a stream and run a task; every frame the
    router sends carries a ``sig`` that verifies under the shared key (checked by
    the suite's client on receipt)."""
    ws, token, key = signed
    async with connect(ws, token, hmac_key=key) as c:
        await c.send(syn("s-l2-ok", "s-l2-ok.t1", content=task()))
        frames = await c.recv_until(closes, stream_id="s-l2-ok.t1")
    assert all(f.get("sig") for f in frames)
    assert sum(is_final(f) for f in frames) == 1


# --- §9 QoS -----------------------------------------------------------------------------------


async def test_syn_ack_confirms_the_qos_class(target):
    """§8 step 2 "router confirms window/QoS", §9: a gold SYN of a client allowed
    gold is confirmed gold; a client whose class is capped at silver is confirmed
    silver."""
    async with connect(target.ws, target.token) as c:
        await c.send(syn("s-l2-q1", "s-l2-q1.t1", qos="gold"))
        assert (await c.recv())["qos"] == "gold"
    if target.token_b is None:
        return
    async with connect(target.ws, target.token_b) as c:
        await c.send(syn("s-l2-q2", "s-l2-q2.t1", qos="gold"))
        assert (await c.recv()).get("qos", "silver") == "silver"


#: The ``long`` next-hop's call (policies/conformance.yaml: 4 chunks 1 s apart), s.
LONG_CALL_S = 4.0


async def test_gold_preempts_a_bronze_flood_and_silver_is_not_starved(target):
    """§9 gold "reserved windows; preempt bronze", bronze "may be dropped during
    congestion", §9 Preemption "RST to bronze streams with code=EPREEMPT when SLAs
    threaten gold", silver WFQ (starvation-free), §5.3 "Bronze preemption under
    pressure; gold has reserved minima": with the target's call slots full of
    bronze calls of LONG_CALL_S, gold tasks (0.8 s of next-hop work) finish
    before any bronze stream that ran its call to its FINAL — a bound relative to
    the bronze calls as they ran, not to a clock, so a loaded machine slows both
    sides alike (issue 20) —
    at least one bronze stream is reset with EPREEMPT, and a silver task completes."""
    p = target.profile
    outcomes: dict[str, list] = {"bronze": [], "gold": [], "silver": []}

    async def one(qos: str, i: int, task_type: str) -> None:
        sid = f"s-l2-{qos}{i}"
        t0 = trio.current_time()
        async with connect(target.ws, target.token) as c:
            await c.send(syn(sid, sid + ".t1", task_type, content=task(), qos=qos))
            frames = await c.recv_until(closes, stream_id=sid + ".t1", timeout=20)
        outcomes[qos].append((trio.current_time(), frames))  # (when it closed, its frames)

    async with trio.open_nursery() as n:
        for i in range(p.flood):
            n.start_soon(one, "bronze", i, "conf.long")
        with trio.fail_after(5):  # the flood holds calls at the next-hop
            while target.peer.of("long").in_flight < 2:
                await trio.sleep(0.02)
        await trio.sleep(0.2)
        for i in range(2):  # two next-hop calls of 0.4 s each: more than gold's reserve
            n.start_soon(one, "gold", i, "conf.pair")
        n.start_soon(one, "silver", 0, "conf.fast")

    for _, frames in outcomes["gold"]:
        assert sum(is_final(f) for f in frames) == 1, frames[-1]
    bronze_finished = [end for end, fr in outcomes["bronze"] if any(is_final(f) for f in fr)]
    if bronze_finished:  # else every bronze call was cut short: nothing gold could have waited behind
        gold_end = max(end for end, _ in outcomes["gold"])
        assert gold_end < min(bronze_finished), (
            f"gold ended {gold_end - min(bronze_finished):.2f} s after a bronze call of {LONG_CALL_S:g} s ran to its end")
    preempted = [fr for _, fr in outcomes["bronze"] if "RST" in flags(fr[-1]) and error_of(fr[-1])["code"] == "EPREEMPT"]
    assert preempted, "no bronze stream was preempted"
    (_, frames), = outcomes["silver"]
    assert sum(is_final(f) for f in frames) == 1
    result = msgspec.convert(next(f for f in frames if is_final(f))["payload"]["content"], FinalResult)
    assert result.result.findings
