"""A cluster router's atomic OPEN does not block its trio loop (issue 22 item 2: no
store round trip on the hot path blocks the loop). The SYN's store step —
:meth:`RedisStore.open_stream_shared <atp_router.store.redis.RedisStore.open_stream_shared>`,
the tenant's shared quota entry and the stream's budget account in one script —
runs on a worker thread (:class:`~atp_router.runtime.dataplane.opening.StoreStep`,
:func:`~atp_router.runtime.dataplane.opening.run_stages`), on a real redis-server
and a real router served in-process on loopback.

The store call is held on a :class:`threading.Event` (what a Redis that is slow
to answer, or stopped, does to it): while it is held, the router answers another
request, and the SYN counts as open in the router's stream table; once released,
the open completes. On a router that runs the step on its loop, the other request
is answered only after the step returns, and the test fails."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import trio

from atp_router.security.identity import ANONYMOUS
from atp_router.store.redis import RedisStore
from tests.conftest import MECHANICS_RIB, start_router

HOLD_S = 20.0


async def test_the_atomic_open_runs_off_the_loop_and_counts_as_open_meanwhile(nursery, tmp_path, redis_server):
    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "state", store=redis_server.url,
                             store_namespace="t" + uuid.uuid4().hex[:12])
    store = env.router.store
    assert isinstance(store, RedisStore)
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    original = store.open_stream_shared

    def held(*args: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(HOLD_S)
        try:
            return original(*args, **kw)
        finally:
            returned.set()

    store.open_stream_shared = held  # type: ignore[method-assign]
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as http:
        opened: list[httpx.Response] = []

        async def open_one() -> None:
            opened.append(await http.post("/v1/streams", json={"task": {"task_type": "code_review"}}))

        async with trio.open_nursery() as n:
            n.start_soon(open_one)
            with trio.fail_after(30):
                while not entered.is_set():
                    await trio.sleep(0.01)
            health = await http.get("/v1/health")
            # Answered while the store call is still held: the loop was free.
            assert not returned.is_set(), "the router answered only after the OPEN's store call returned"
            assert health.status_code == 200
            assert env.router.streams.open_count == 1  # the SYN waiting on the store counts as open
            release.set()
        assert returned.is_set()
        assert opened[0].status_code == 201, opened[0].text
        sid = opened[0].json()["stream_id"]
        assert env.router.streams.open_count == 1
        assert env.router.find_stream(ANONYMOUS, sid) is not None


async def test_a_tenants_opens_waiting_on_the_store_count_against_its_quota_here(nursery, tmp_path, redis_server):
    """A second tenant's view: while a tenant's opens wait on the store, they count as
    its open streams on this router, so past its ``max_streams`` (2 here) a further
    open is refused at once (429 EWINDOW) without a store step — one tenant's queued
    opens cannot fill the router's stream table for the others."""
    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "state", store=redis_server.url,
                             store_namespace="t" + uuid.uuid4().hex[:12], tenant_max_streams=2)
    store = env.router.store
    assert isinstance(store, RedisStore)
    calls: list[object] = []
    release = threading.Event()
    original = store.open_stream_shared

    def held(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        release.wait(HOLD_S)
        return original(*args, **kw)

    store.open_stream_shared = held  # type: ignore[method-assign]
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as http:
        opened: list[httpx.Response] = []

        async def open_one() -> None:
            opened.append(await http.post("/v1/streams", json={"task": {"task_type": "code_review"}}))

        async with trio.open_nursery() as n:
            for _ in range(2):
                n.start_soon(open_one)
            # Both counted as the tenant's and both inside the store call (a store thread may
            # start a while after the SYN counted, on a busy machine).
            with trio.fail_after(30):
                while env.router.streams.tenant_open[ANONYMOUS.tenant] < 2 or len(calls) < 2:
                    await trio.sleep(0.01)
            third = await http.post("/v1/streams", json={"task": {"task_type": "code_review"}})
            assert third.status_code == 429 and third.json()["error"]["code"] == "EWINDOW", third.text
            assert len(calls) == 2  # refused here, before any store step
            release.set()
        assert sorted(r.status_code for r in opened) == [201, 201]
