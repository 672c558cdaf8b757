"""ATP compliance Level 1 (spec §17), flow control and the error model: windows
(§5.1–5.4), budgets (§4.3 BUDGET_UPDATE, §10 EBUDGET) and the §10 rows a Level 1
router produces — EWINDOW, EBUDGET, ETIMEOUT, EAGENTDOWN — each in the situation
its row names, checked over the WebSocket ingress.

Situations come from the conformance RIB (``policies/conformance.yaml``), whose
next-hops are served by the fault-injecting peer: its statistics say which calls
the implementation made, when, and whether it hung up on them.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
import trio

from atp_router.consensus.types import FinalResult
from tests.conformance.wire import (
    closes,
    connect,
    control,
    errors,
    flags,
    frame,
    is_final,
    syn,
    task,
    window_update_of,
)

POLICY_WINDOW = {"max_parallel": 4, "max_tokens": 200_000, "max_usd_micros": 50_000}


def final_of(frames: list[dict]) -> FinalResult:
    finals = [f for f in frames if is_final(f)]
    assert len(finals) == 1, f"{len(finals)} FINAL frames"
    return msgspec.convert(finals[0]["payload"]["content"], FinalResult)


def agents_of(result: FinalResult) -> set[str]:
    return {p.split("#")[0] for fd in result.result.findings for p in fd.provenance}


def window_updates(frames: list[dict]) -> list[dict]:
    return [w["window"] for f in frames if (w := window_update_of(f)) is not None]


async def run_task(target, session_id: str, task_type: str, *, window: dict | None = None,
                   meta: dict | None = None, token: str | None = None) -> tuple[dict, list[dict], list]:
    """SYN with the task on stream ``<session_id>.t1`` (stream ids are unique across
    sessions here, so concurrent tests never depend on how an implementation scopes
    them); returns (SYN+ACK, the stream's frames up to FIN/RST, the connection's
    (arrival time, frame) log)."""
    stream = session_id + ".t1"
    async with connect(target.ws, token or target.token) as c:
        await c.send(syn(session_id, stream, task_type, content=task(), window=window or POLICY_WINDOW, meta=meta))
        synack = await c.recv_until(lambda f: "SYN" in flags(f), stream_id=stream)
        synack = synack[-1]
        frames = await c.recv_until(closes, stream_id=stream)
    return synack, frames, c.log


# --- §5.1 windows, §5.2 preflight, §10 EWINDOW --------------------------------------------


async def test_concurrency_window_nacks_then_serialises_calls(target):
    """§5.1 concurrency window, §10 EWINDOW "NACK + WINDOW_UPDATE": with a client
    window of one call in flight, the second next-hop's send is NACKed with EWINDOW
    and a WINDOW_UPDATE (never a silent queue), and goes only after the first call
    ended; the task still completes."""
    window = {"max_parallel": 1, "max_tokens": 200_000, "max_usd_micros": 50_000}
    synack, frames, _ = await run_task(target, "s-f-1", "conf.pair", window=window)
    assert synack["window"]["max_parallel"] == 1
    nacks = errors(frames, "EWINDOW")
    assert nacks, "no EWINDOW NACK for the call that did not fit"
    i = next(i for i, f in enumerate(frames) if errors([f], "EWINDOW"))
    assert any(window_update_of(f) for f in frames[max(0, i - 1) : i + 2]), "EWINDOW without its WINDOW_UPDATE"
    assert "FIN" in flags(frames[-1])
    final_of(frames)
    a, b = target.peer.of("slow-a").log, target.peer.of("slow-b").log
    assert len(a) == 1 and len(b) == 1
    first, second = sorted([a[0], b[0]])
    assert second[0] >= first[1] - 0.01, "the two calls overlapped in a window of one"


@pytest.mark.parametrize("axis, window", [
    ("tokens", {"max_parallel": 4, "max_tokens": 50, "max_usd_micros": 50_000}),
    ("usd_micros", {"max_parallel": 4, "max_tokens": 200_000, "max_usd_micros": 5}),
])
async def test_estimate_beyond_the_window_is_refused_before_the_call(target, axis, window):
    """§5.2 "Router rejects sends that exceed the advertised window" (preflight
    estimate), §5.1 token / budget windows: a call whose estimate alone exceeds the
    stream's window is NACKed with EWINDOW and a WINDOW_UPDATE, and never made."""
    _, frames, _ = await run_task(target, f"s-f-2{axis}", "conf.pair", window=window)
    nacks = errors(frames, "EWINDOW")
    assert nacks and any(axis.split("_")[0] in e["reason"] for e in nacks), nacks
    assert window_updates(frames), "EWINDOW without a WINDOW_UPDATE"
    assert target.peer.of("slow-a").calls == 0 and target.peer.of("slow-b").calls == 0
    assert closes(frames[-1])


# --- §5.3 AIMD, §5.4 cadence, §10 ETIMEOUT -------------------------------------------------


async def test_etimeout_is_retried_and_decreases_the_window(target):
    """§10 ETIMEOUT "Retries + AIMD decrease", §5.3 AIMD on timeout, §5.4 update on
    a ≥ 20 % move: a next-hop that does not answer within its timeout is reported
    with ETIMEOUT and retried; the stream's window is cut (WINDOW_UPDATE with fewer
    calls in flight, sent at once, not at the next period); the other next-hop's
    result still makes the FINAL."""
    synack, frames, log = await run_task(target, "s-f-3", "conf.timeout")
    granted = synack["window"]["max_parallel"]
    timeouts = errors(frames, "ETIMEOUT")
    assert timeouts, "no ETIMEOUT reported"
    assert target.peer.of("hang").calls >= 2, "the timed-out call was not retried"
    decreased = [w for w in window_updates(frames) if w["max_parallel"] <= 0.8 * granted]
    assert decreased, f"no WINDOW_UPDATE below {granted} calls after ETIMEOUT"
    # The update follows the timeout at once (≥ 20 % move), not a period later.
    t_err = next(t for t, f in log if errors([f], "ETIMEOUT"))
    t_upd = next(t for t, f in log if (w := window_update_of(f)) and w["window"]["max_parallel"] <= 0.8 * granted)
    assert abs(t_upd - t_err) < target.profile.window_update_ms / 1000 / 2
    assert "steady" in agents_of(final_of(frames))


async def test_window_update_is_sent_every_period(target):
    """§5.4 "Router issues WINDOW_UPDATE every N ms": during a task of ~1.8 s whose
    window does not move, the client receives WINDOW_UPDATEs at least every
    keep-alive period K — and never the same window again sooner than K (issue
    24: an update every N ms that says nothing new is noise; a changed window
    goes out at the next N-ms check, tested in tests/unit/test_window.py)."""
    keepalive = target.profile.window_keepalive_ms / 1000
    _, frames, log = await run_task(target, "s-f-4", "conf.cadence")
    final_of(frames)
    t_syn = log[0][0]
    t_final = next(t for t, f in log if is_final(f))
    # The SYN+ACK's window aside: when it arrives says little of when the router planned the task.
    updates = [(t, u.get("window")) for t, f in log[1:] if (u := window_update_of(f)) and t < t_final]
    assert t_final - t_syn >= 1.5, "the task should stream for ~1.8 s"
    gaps = [b - a for a, b in itertools.pairwise([t_syn] + [t for t, _ in updates])]
    # Generous: a loaded machine delays frames; what matters is that updates keep coming.
    assert updates and max(gaps) <= 1.5 * keepalive + 0.5, f"a {max(gaps):.2f} s gap (keep-alive {keepalive} s)"
    for (t0, w0), (t1, w1) in itertools.pairwise(updates):
        assert w0 != w1 or t1 - t0 >= keepalive - 0.05, f"the same window {w1} again after {t1 - t0:.2f} s"


# --- §10 EAGENTDOWN --------------------------------------------------------------------------


@pytest.mark.parametrize("task_type, label", [("conf.down500", "down500"), ("conf.drop", "drop")])
async def test_agent_down_is_reported_and_rerouted(target, task_type, label):
    """§10 EAGENTDOWN "Circuit break, reroute": a next-hop answering HTTP 500, or
    dropping its connection mid-stream, is reported with EAGENTDOWN and the call is
    rerouted to another next-hop (the RIB's fallback), whose result is the FINAL."""
    _, frames, _ = await run_task(target, f"s-f-5{label}", task_type)
    assert errors(frames, "EAGENTDOWN"), "the failure was not reported"
    assert target.peer.of(label).calls >= 1 and target.peer.of("backup").calls == 1
    assert "FIN" in flags(frames[-1])
    assert agents_of(final_of(frames)) == {"backup"}


async def test_agent_down_carries_the_peer_retry_hint(target):
    """§4.3 ERROR "retry/backoff hints": a next-hop answering 429 with Retry-After:
    7 is reported as EAGENTDOWN whose retry hint is 7000 ms; the call is rerouted."""
    _, frames, _ = await run_task(target, "s-f-6", "conf.rl429")
    downs = errors(frames, "EAGENTDOWN")
    assert downs and downs[0].get("retry_after_ms") == 7000, downs
    assert agents_of(final_of(frames)) == {"backup"}


# --- §4.3 BUDGET_UPDATE, §10 EBUDGET ---------------------------------------------------------


async def test_budget_below_the_estimate_ends_with_ebudget_and_fin(target):
    """§10 EBUDGET "Budget exhausted → FIN": a client budget that cannot cover a
    single call's estimate ends the stream with ERROR EBUDGET and FIN (not RST),
    and no next-hop is called."""
    _, frames, _ = await run_task(target, "s-f-7", "conf.pair", meta={"budget": {"usd": 0.000001}})
    assert errors(frames, "EBUDGET")
    assert "FIN" in flags(frames[-1]) and "RST" not in flags(frames[-1])
    assert target.peer.of("slow-a").calls == 0 and target.peer.of("slow-b").calls == 0


async def test_spend_never_passes_the_budget(target):
    """§10 EBUDGET, §5.1 budget window: a next-hop billing far above its estimate
    (100 100 tokens at 1 µUSD) exhausts a USD 0.01 budget; the router charges no
    more than the budget (FINAL telemetry), calls nothing further (the escalation is
    refused with EBUDGET) and ends the stream with FIN."""
    _, frames, _ = await run_task(target, "s-f-8", "conf.budget", meta={"budget": {"usd": 0.01}})
    result = final_of(frames)
    assert result.telemetry.usd <= 0.01, f"charged USD {result.telemetry.usd} on a USD 0.01 budget"
    assert errors(frames, "EBUDGET"), "exhaustion not reported"
    assert target.peer.of("judge").calls == 0, "a call was made after the budget was exhausted"
    assert "FIN" in flags(frames[-1]) and "RST" not in flags(frames[-1])


@pytest.mark.parametrize("before, after, ends_with", [(0.000001, 0.05, "FINAL"), (0.05, 0.000001, "EBUDGET")])
async def test_budget_update_moves_the_budget_live(target, before, after, ends_with):
    """§4.3 BUDGET_UPDATE "client/router adjusts remaining budget": raised, a budget
    too small for any call lets the task run; lowered, a sufficient one stops it
    with EBUDGET + FIN."""
    sid = f"s-f-9{ends_with}"
    async with connect(target.ws, target.token) as c:
        await c.send(syn(sid, "t1", "conf.pair", meta={"budget": {"usd": before}}))
        await c.recv()
        await c.send(frame(sid, "t1", 1, ["CTRL"], payload=control("BUDGET_UPDATE", budget={"usd": after})))
        await c.send(frame(sid, "t1", 2, [], payload={"type": "task", "content": task()}))
        frames = await c.recv_until(closes, stream_id="t1")
    assert "FIN" in flags(frames[-1]) and "RST" not in flags(frames[-1]), frames[-1]
    if ends_with == "FINAL":
        final_of(frames)
        assert not errors(frames, "EBUDGET")
    else:
        assert errors(frames, "EBUDGET")
        assert not any(is_final(f) for f in frames)


async def test_client_budget_holds_across_concurrent_streams(target):
    """§5.1 budget window per client, §10 EBUDGET: six concurrent streams of a
    client whose budget (USD 0.002) covers about two of them are charged, together,
    no more than that budget; the others end with EBUDGET + FIN."""
    if target.token_c is None:
        pytest.skip("needs ATP_CONFORMANCE_TOKEN_C (client conf-c of the RIB)")
    spent: list[float] = []
    ebudget = 0

    async def one(i: int) -> None:
        nonlocal ebudget
        _, frames, _ = await run_task(target, f"s-f-10-{i}", "conf.pair", token=target.token_c)
        assert "RST" not in flags(frames[-1]), frames[-1]
        finals = [f for f in frames if is_final(f)]
        if finals:
            spent.append(msgspec.convert(finals[0]["payload"]["content"], FinalResult).telemetry.usd)
        ebudget += bool(errors(frames, "EBUDGET"))

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(one, i)
    assert sum(spent) <= 0.002 + 1e-9, f"client charged USD {sum(spent):.6f} on a USD 0.002 budget"
    assert spent and ebudget >= 1
