"""The live status snapshot (issue 11 item 4, :mod:`atp_router.runtime.admin.status`): a real
router on scripted next-hops, its snapshot read by the sans-IO builder and over
HTTP/SSE. The page itself is tested in headless Chromium (tests/ops)."""

from __future__ import annotations

import math

import httpx
import msgspec
import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from atp_router.runtime.admin.snapshot import StatusLimits, StatusSnapshot
from atp_router.runtime.admin.status import StatusBuilder, histogram_quantile
from atp_router.runtime.admin.statuspage import StatusFeed
from atp_router.security.identity import Role
from atp_router.wire.errors import ErrorCode
from tests.helpers import golden, start_router_on

AGENT = {"layer": "L2", "tool": "scripted", "p95_ms": 300, "timeout_ms": 30_000, "strengths": ["code_review"]}
RIB = {
    "agents": {"hold": AGENT, "fast": AGENT, "broken": AGENT},
    "policies": [
        {"name": "held", "match": {"task_type": "code_review", "tier": "hold"}, "fanout": ["hold"],
         "budget": {"usd": 0.04, "tokens": 90_000},
         "window": {"max_parallel": 3, "max_tokens": 90_000, "max_usd_micros": 40_000}},
        {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["fast", "broken"]},
    ],
}
WALL = 1_800_000_000_000


@pytest.fixture
def agents(scripted):
    scripted["hold"] = ScriptedAdapter("hold", delay_s=math.inf)  # runs until reset
    scripted["fast"] = ScriptedAdapter.returning("fast", usage=Usage(100, 20, 250), delay_s=0.01)
    scripted["broken"] = ScriptedAdapter("broken", fail_with=ErrorCode.EAGENTDOWN, fail_reason="peer is gone")
    return scripted


async def _open(env, tier: str | None = None) -> str:
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        meta = {"task_type": "code_review", **({"tier": tier} if tier else {})}
        r = await h.post("/v1/streams", json={"task": meta, "content": golden()})
        assert r.status_code == 201, r.text
        return r.json()["stream_id"]


async def _finish(env, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        sid = await _open(env)
        ctx = env.router.streams.find("anonymous", sid)
        with trio.fail_after(10):
            while not ctx.log.closed:
                await trio.sleep(0.01)
        ids.append(sid)
    return ids


def _build(router, builder: StatusBuilder, *, chunk: int | None = None, now: float | None = None) -> StatusSnapshot:
    scan = builder.scan(trio.current_time() if now is None else now, WALL)
    ctxs = list(router.streams.values())
    step = chunk or max(1, len(ctxs))
    for i in range(0, len(ctxs), step):
        scan.feed(ctxs[i:i + step])
    return builder.build(router, scan)


async def test_open_streams_longest_running_first_with_window_budget_and_the_rest_counted(nursery, tmp_path, agents):
    env = await start_router_on(nursery, tmp_path, RIB)
    ids = []
    for _ in range(7):
        ids.append(await _open(env, "hold"))
        await trio.sleep(0.01)  # distinct SYN times
    with trio.fail_after(5):
        while len(agents["hold"].calls) < 7:
            await trio.sleep(0.01)
    snap = _build(env.router, StatusBuilder(StatusLimits(max_streams=3)))
    assert snap.totals.open_streams == snap.streams.count == 7 == env.router.open_count
    assert [r.stream_id for r in snap.streams.listed] == ids[:3] and snap.streams.more == 4
    ages = [r.age_ms for r in snap.streams.listed]
    assert ages == sorted(ages, reverse=True)
    for row in snap.streams.listed:
        assert (row.tenant, row.policy, row.qos, row.state, row.next_hops) == (
            "anonymous", "held", "silver", "running", ["hold"])
        assert (row.window.max_parallel, row.window.max_tokens, row.window.max_usd_micros) == (3, 90_000, 40_000)
        assert row.budget is not None and (row.budget.limit_usd_micros, row.budget.limit_tokens) == (40_000, 90_000)
        assert row.budget.spent_usd_micros == 0
    hold = {a.name: a for a in snap.agents}["hold"]
    stats = env.router.gates.agent_windows.statistics()["hold"]
    assert (hold.in_flight, hold.cwnd, hold.breaker, hold.up) == (stats.in_flight, stats.cwnd, "closed", True)
    assert hold.in_flight == 7 and snap.slots.running == 7
    fib = env.router.gen.fib.routes(live=env.router.learning.live_view())
    assert [(r.policy, r.next_hops) for r in snap.fib.routes] == [(e.policy, e.next_hops) for e in fib]
    assert [r.policy for r in snap.fib.routes] == ["held", "review"] and snap.fib.more_routes == 0


async def test_finished_tasks_errors_and_totals_are_read_once(nursery, tmp_path, agents):
    env = await start_router_on(nursery, tmp_path, RIB)
    builder = StatusBuilder()
    ids = await _finish(env, 4)
    snap = _build(env.router, builder)
    t = snap.tasks
    assert t.outcome == ["final"] * 4 and t.policy == ["review"] * 4 and t.skipped == 0
    assert t.usd_micros == [250] * 4 and t.tokens == [120] * 4
    assert all(a is not None for a in t.agreement) and t.t_ms == sorted(t.t_ms)
    assert snap.totals.completed == 4 and snap.totals.usd_micros == 1000 and snap.totals.opened == 4
    errs = snap.errors.listed
    assert {e.stream_id for e in errs} == set(ids) and {e.code for e in errs} == {"EAGENTDOWN"}
    assert all("peer is gone" in e.reason and e.tenant == "anonymous" and e.policy == "review" for e in errs)
    by = {a.name: a for a in snap.agents}
    assert by["broken"].calls_failed >= 4 and by["fast"].calls_ok == 4 and by["fast"].usd_micros == 1000
    [review] = [p for p in snap.policies if p.policy == "review"]
    assert review.tasks == 4 and review.usd_micros_per_task == 250
    # A second snapshot reads nothing twice; a new task adds one of each.
    again = _build(env.router, builder)
    assert again.tasks.t_ms == t.t_ms and len(again.errors.listed) == len(errs)
    await _finish(env, 1)
    third = _build(env.router, builder)
    assert len(third.tasks.t_ms) == 5 and len(third.errors.listed) == len(errs) + len(errs) // 4
    assert third.seq == snap.seq + 2


async def test_a_scan_reads_at_most_max_closed_per_scan_closed_streams_the_newest(nursery, tmp_path, agents):
    env = await start_router_on(nursery, tmp_path, RIB)
    await _finish(env, 5)
    now = trio.current_time()
    full = _build(env.router, StatusBuilder(), now=now)
    bounded = _build(env.router, StatusBuilder(StatusLimits(max_closed_per_scan=2)), now=now)
    assert bounded.tasks.t_ms == full.tasks.t_ms[-2:] and bounded.tasks.skipped == 3
    # Chunked scanning (the feed yields between chunks) sees what one pass sees.
    chunked = _build(env.router, StatusBuilder(), chunk=1, now=now)
    assert msgspec.json.encode(chunked) == msgspec.json.encode(full)


async def test_the_encoded_snapshot_fits_max_bytes(nursery, tmp_path, agents):
    env = await start_router_on(nursery, tmp_path, RIB)
    await _finish(env, 6)
    for _ in range(6):
        await _open(env, "hold")
    whole = StatusBuilder().encode(_build(env.router, StatusBuilder()))
    assert b'"truncated":false' in whole
    cap = len(whole) - 600
    builder = StatusBuilder(StatusLimits(max_bytes=cap))
    data = builder.encode(_build(env.router, builder))
    snap = msgspec.json.decode(data, type=StatusSnapshot)
    assert len(data) <= cap and snap.truncated
    assert snap.streams.count == 6 and snap.streams.more == 6 - len(snap.streams.listed)
    assert len(snap.tasks.t_ms) < 6 and len(snap.series.t_ms) == len(snap.series.open)
    tiny = StatusBuilder(StatusLimits(max_bytes=200))
    with pytest.raises(ValueError, match="does not fit max_bytes=200"):
        tiny.encode(_build(env.router, tiny))


@pytest.mark.parametrize(("q", "bounds", "counts", "want"), [
    (0.5, (1.0, 2.0, 4.0), (0, 10, 10, 10), 1.5),          # inside the second bucket, linear
    (0.95, (1.0, 2.0, 4.0), (0, 10, 10, 10), 1.95),
    (0.5, (1.0, 2.0, 4.0), (4, 4, 8, 8), 1.0),             # the rank ends the first bucket
    (0.9, (1.0, 2.0, 4.0), (0, 0, 5, 10), 4.0),            # in +Inf: the largest finite bound
    (0.5, (1.0, 2.0), (0, 0, 0), None),                    # empty
])
def test_histogram_quantile(q, bounds, counts, want):
    got = histogram_quantile(q, bounds, counts)
    assert got == pytest.approx(want) if want is not None else got is None


async def test_event_stream_pushes_on_change_and_bounds_its_watchers(nursery, tmp_path, agents):
    env = await start_router_on(nursery, tmp_path, RIB)
    # An interval far beyond the test: a second event can only come from a change.
    feed = StatusFeed(env.router, interval_s=3600, min_interval_s=0.05, max_watchers=1)
    events = feed.events()
    with trio.fail_after(10):
        first = await events.__anext__()
        assert first.startswith(b"id: 1\nevent: status\ndata: ")
        assert msgspec.json.decode(first.split(b"data: ", 1)[1], type=StatusSnapshot).totals.open_streams == 0
        # One watcher at most: a second gets an error event and ends.
        assert [e async for e in feed.events()] == [
            b'event: error\ndata: {"code":"EWINDOW","reason":"too many status watchers"}\n\n']
        await _open(env, "hold")
        second = await events.__anext__()
    snap = msgspec.json.decode(second.split(b"data: ", 1)[1], type=StatusSnapshot)
    assert snap.totals.open_streams == 1 and snap.seq == 2
    await events.aclose()
    assert feed.watchers == 0


async def test_status_endpoints_are_admin_only(nursery, tmp_path, agents):
    tokens = {"ops": "tok-ops", "acme": "tok-acme", "watch": "tok-watch"}
    roles = {"ops": frozenset({Role.ADMIN}), "acme": frozenset({Role.CLIENT}), "watch": frozenset({Role.OPERATOR})}
    env = await start_router_on(nursery, tmp_path, RIB, client_tokens=tokens, client_roles=roles)
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        for path in ("/v1/status", "/v1/status/events"):
            r = await h.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            for who in ("acme", "watch"):
                r = await h.get(path, headers={"Authorization": f"Bearer {tokens[who]}"})
                assert r.status_code == 403 and r.json()["error"] == {
                    "code": "ESEC", "reason": f"tenant.admin needs the admin role; 'env:{who}' (tenant {who!r}) has "
                                              f"{'client' if who == 'acme' else 'operator'}"}
        r = await h.get("/v1/status", headers={"Authorization": "Bearer tok-ops"})
        assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
        snap = msgspec.json.decode(r.content, type=StatusSnapshot)
        assert snap.rib.version == 1 and {a.name for a in snap.agents} == {"hold", "fast", "broken"}
        # The page is public and holds no data; its own files only, under a strict CSP.
        page = await h.get("/status")
        assert page.status_code == 200 and b"v1/status/events" not in page.content
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert (await h.get("/status/status.css")).headers["content-type"].startswith("text/css")
        assert (await h.get("/status/index.html")).status_code == 404
