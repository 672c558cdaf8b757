"""The store path of a router on Redis (issue 22 item 2), on real ``atp-router`` and
``redis-server`` processes:

* the store round trips a one-call task makes (``atp_store_round_trips_total``
  around sequential tasks and until their streams left memory, less the
  background's at the rate measured idle just before), held to
  :data:`MAX_TRIPS_PER_TASK` — a regression bound at the figure reached, not the
  issue's target of 3 (README "Several routers");
* the same on a busy router counted by operation
  (``atp_store_round_trips_by_op_total``): the OPEN and two group commits a
  task, a third only when its events were split (the learning slice rides them);
* Redis stopped (SIGSTOP) for several seconds: the router's event loop is not
  held by it — ``GET /v1/health`` is served about as often as in the same
  stretch before the stop (the same run's baseline), at most one request waits
  the store's socket timeout (the store's polls and group commits run in store
  threads, and the loop's own calls fail at once while those threads probe), and
  ``GET /v1/ready`` says the store is away without waiting for it.

No absolute speed is asserted here (bench/bench_cluster.py measures it).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import trio

from atp_router.store.redis import BACKGROUND_OPS
from tests.helpers import router_metric
from tests.peers import start_redis
from tests.replay_server import BillingModel, serve
from tests.scale.common import BILLED, CONTENT, TASK, TOKENS, auth
from tests.scale.test_cluster import Cluster

#: Store round trips a one-call task may make (issue 22 item 2): measured 3.5–3.8 here since the
#: learning slice rides the FINAL's group commit (the idle-rate estimate of the background and the
#: first task after the idle spell included; counted by operation on a busy router:
#: :func:`test_a_one_call_task_on_a_busy_router_makes_three_store_round_trips`); 4.35–4.40 (3.5–3.7
#: counted with Redis MONITOR over 20–30 sequential tasks, without this test's background estimate) since
#: budget leases (the call reserved inside its router's slice of the tenant's budget, no round
#: trip; its charge known here, so its commit goes in the group commit of its FINAL and the
#: END): the atomic OPEN, the SYN+ACK's group commit, the commit with the END, and a learning
#: slice every second task (5.3–6.3 before leases, 9.5 before the atomic OPEN; the issue's
#: target is 3), with room for how a task's events fall into group commits.
MAX_TRIPS_PER_TASK = 4.5


#: How long the round-trip test lets closed streams leave memory (their sweep: every 1 s), s.
_SETTLE_S = 2.5
#: How long it measures the background's round trips, s.
_IDLE_S = 3.0


async def _task(h: httpx.AsyncClient) -> None:
    """One one-call task over HTTP+SSE: open, then its events to the end."""
    r = await h.post("/v1/streams", json={"task": TASK, "content": CONTENT}, headers=auth("bob"))
    assert r.status_code == 201, r.text
    async with h.stream("GET", f"/v1/streams/{r.json()['stream_id']}/events", headers=auth("bob")) as ev:
        assert ev.status_code == 200
        text = (await ev.aread()).decode()
    assert "event: FIN" in text, text[-500:]


async def _trips(url: str) -> float:
    return sum((await router_metric(url, "atp_store_round_trips_total", TOKENS["ops"])).values())


@pytest.mark.parametrize("retain", [(), ("--retain-closed-s", "0")], ids=["retained", "left-at-once"])
async def test_a_one_call_task_makes_few_store_round_trips(nursery, tmp_path, retain):
    """A stream's budget account is closed in the store with its last events,
    whether the closed stream stays in memory or leaves it at once
    (``--retain-closed-s 0``): none is left open, and the count includes them."""
    model = await serve(nursery, BillingModel(BILLED))
    with start_redis() as redis:
        cluster = Cluster(redis, tmp_path, model, 0)
        cluster.routers.append(cluster._start(0, args=retain))
        try:
            url = await cluster.routers[0].wait_listening()
            async with httpx.AsyncClient(base_url=url, timeout=60) as h:
                for _ in range(5):
                    await _task(h)  # warm: scripts loaded, RIB adopted, connections pooled
                await trio.sleep(_SETTLE_S)  # the warm-up's streams leave memory
                c0 = await _trips(url)
                await trio.sleep(_IDLE_S)  # the background's round trips (lease, polls)
                idle_per_s = (await _trips(url) - c0) / _IDLE_S
                n = 30
                t0, c0 = time.monotonic(), await _trips(url)
                for _ in range(n):
                    await _task(h)
                await trio.sleep(_SETTLE_S)  # their streams leave memory (left-at-once: accounts closed)
                took_s, busy = time.monotonic() - t0, await _trips(url) - c0
                left = [a.key for a in cluster.store.load_ledger().accounts if a.key.startswith("stream:")]
        finally:
            cluster.stop()
    per_task = (busy - idle_per_s * took_s) / n
    print(f"store round trips a one-call task: {per_task:.2f} ({busy} in {took_s:.1f} s, background "
          f"{idle_per_s:.1f}/s)")
    assert 2.5 <= per_task <= MAX_TRIPS_PER_TASK, (busy, idle_per_s, took_s, per_task)
    assert left == []  # each closed with its stream's last events (the END), retained in memory or not


#: Tasks of 30 that may wait longer than LEARN_SLICE_S for their learning step on a loaded
#: machine (their router's slice expired meanwhile: one taken at once).
_SLOW_TASKS = 2


async def _trips_by_op(url: str) -> dict[str, float]:
    """The router's store round trips by operation (``atp_store_round_trips_by_op_total``)."""
    return {k.removeprefix('op="').removesuffix('"'): v for k, v in
            (await router_metric(url, "atp_store_round_trips_by_op_total", TOKENS["ops"])).items()}


async def test_a_one_call_task_on_a_busy_router_makes_three_store_round_trips(nursery, tmp_path):
    """Tasks one after another on a router that holds its budget lease and its
    learning slice (issue 22 item 2), counted by operation: the task's round trips
    (all, less the background's) are its OPEN — the only script sent alone — and
    group commits (pipelines): the SYN+ACK's, and the call's commit with the FINAL,
    the END and the audit record, where the next learning slice rides too (before:
    a ``rate_take_upto`` of its own every second task: 3.5). 3 a task, and one
    more only when a task's events fall into two group commits (the flusher ran
    between its call's end and its FINAL: 1–14 of 30 tasks in runs here)."""
    model = await serve(nursery, BillingModel(BILLED))
    with start_redis() as redis:
        cluster = Cluster(redis, tmp_path, model, 0)
        cluster.routers.append(cluster._start(0))
        try:
            url = await cluster.routers[0].wait_listening()
            async with httpx.AsyncClient(base_url=url, timeout=60) as h:
                for _ in range(5):
                    await _task(h)  # warm: scripts loaded, the lease and a learning slice taken
                n = 30
                before = await _trips_by_op(url)
                for _ in range(n):
                    await _task(h)
                after = await _trips_by_op(url)
        finally:
            cluster.stop()
    d = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    background = sum(v for op, v in d.items() if op in BACKGROUND_OPS or op == "time")
    task_trips = sum(d.values()) - background
    print(f"the task's store round trips a one-call task: {task_trips / n:.2f} ({background:.0f} background; "
          f"{ {op: v for op, v in d.items() if v} })")
    alone = {op: v for op, v in d.items() if v and op not in BACKGROUND_OPS and op not in ("time", "pipeline")}
    assert d["open_stream"] == n  # the atomic OPEN, one a task
    # The learning slices rode the group commits (before: about n / 2 taken alone); one is taken at
    # once only after a task took longer than LEARN_SLICE_S (a loaded machine), and the budget
    # lease may grow while the tasks spend it — nothing else is sent alone.
    assert d.get("rate_take_upto", 0) <= _SLOW_TASKS, d
    assert set(alone) <= {"open_stream", "rate_take_upto", "lease_take"}, alone
    split = d["pipeline"] - 2 * n  # tasks whose events fell into a third group commit
    assert 0 <= split <= n, d
    assert task_trips - split <= 3 * n + _SLOW_TASKS + d.get("lease_take", 0), d


#: The store's socket timeout in :func:`test_a_stopped_redis_does_not_hold_the_event_loop`, s:
#: a store call made on the loop while Redis is stopped holds the loop this long.
_SOCKET_TIMEOUT_S = 1.0
#: How long that test probes ``/v1/health`` before and while Redis is stopped, s.
_WINDOW_S = 6.0


async def _health_served(h: httpx.AsyncClient, window_s: float) -> list[float]:
    """``GET /v1/health`` one after the other (0.1 s apart) for ``window_s``:
    each one's latency, s."""
    took: list[float] = []
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        t0 = time.monotonic()
        assert (await h.get("/v1/health", headers=auth("alice"))).status_code == 200
        took.append(time.monotonic() - t0)
        await trio.sleep(0.1)
    return took


async def test_a_stopped_redis_does_not_hold_the_event_loop(nursery, tmp_path):
    model = await serve(nursery, BillingModel(BILLED))
    with start_redis() as redis:
        cluster = Cluster(redis, tmp_path, model, 0)
        # Calls wait up to 1 s for Redis: each one made on the loop would stall it that long.
        t = int(_SOCKET_TIMEOUT_S)
        router = cluster._start(0, store_url=redis.url + f"?socket_timeout={t}&socket_connect_timeout={t}")
        cluster.routers.append(router)
        try:
            url = await router.wait_listening()
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                await _task(h)
                baseline = await _health_served(h, _WINDOW_S)  # the same run, Redis up
                os.kill(redis.proc.pid, signal.SIGSTOP)
                try:
                    took = await _health_served(h, _WINDOW_S)
                    t0 = time.monotonic()
                    ready = await h.get("/v1/ready", headers=auth("ops"))
                    ready_s = time.monotonic() - t0
                finally:
                    os.kill(redis.proc.pid, signal.SIGCONT)
                await trio.sleep(1.0)
                await _task(h)  # served again without a restart
        finally:
            cluster.stop()
    # Before issue 22 item 2 the store's polls (RIB, breakers, learning, lost routers, expiry)
    # ran on the loop, each stalling it a socket timeout: 4 s of these 6 (measured), so about
    # a third of the baseline's requests were served. Now at most the one loop call that may
    # find Redis stopped first (a quota renewal) waits a socket timeout.
    waited = [x for x in took if x >= 0.9 * _SOCKET_TIMEOUT_S]
    assert len(waited) <= 1, (waited, took)
    assert len(took) >= 0.7 * len(baseline), (len(took), len(baseline), took)
    # Readiness says the store is away from what it knows, without a store call of its own.
    assert ready.status_code == 503 and ready_s < 0.9 * _SOCKET_TIMEOUT_S, (ready.status_code, ready_s)
