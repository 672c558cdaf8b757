"""A cluster router's atomic OPEN does not block its trio loop (issue 22 item 2: no
store round trip on the hot path blocks the loop), on real redis-servers and real
routers served in-process on loopback. The SYN's store step —
:meth:`RedisStore.open_stream_shared <atp_router.store.redis.RedisStore.open_stream_shared>`,
the tenant's shared quota entry and the stream's budget account in one script — is a
:class:`~atp_router.runtime.dataplane.steps.StoreStep` that
:func:`~atp_router.runtime.dataplane.opening.run_stages` awaits on the loop
(:class:`~atp_router.store.redis_trio.TrioRedis`: a trio socket) or, for a URL the
loop client does not speak (TLS), runs in a store thread.

* Redis stopped (SIGSTOP) under an open: the router answers another request while
  the open waits, the SYN counts as open meanwhile, and the open completes once
  Redis runs again. (On a router that makes the call on its loop, the loop — and
  this test, which runs on it — waits for Redis: the SYN is never seen waiting.)
* The thread path, the store call held on a :class:`threading.Event`: the same.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from typing import Any

import httpx
import pytest
import trio

from atp_router.security.identity import ANONYMOUS
from atp_router.store.redis import RedisStore
from tests.conftest import MECHANICS_RIB, start_router
from tests.peers import start_redis

HOLD_S = 20.0


async def _open_while_waiting(env: Any, waiting: Any, resume: Any, open_before: int = 0) -> None:
    """POST /v1/streams; once ``waiting()`` (the open is at its store call), /v1/health
    answers and the SYN counts open; then ``resume()``: the open completes (201)."""
    async with httpx.AsyncClient(base_url=env.url, timeout=60) as http:
        opened: list[httpx.Response] = []

        async def open_one() -> None:
            opened.append(await http.post("/v1/streams", json={"task": {"task_type": "code_review"}}))

        async with trio.open_nursery() as n:
            n.start_soon(open_one)
            with trio.fail_after(30):
                while not waiting():
                    await trio.sleep(0.01)
            assert (await http.get("/v1/health")).status_code == 200
            assert not opened, "the open finished while its store call was held"
            assert env.router.streams.open_count == open_before + 1  # the SYN waiting on the store counts open
            resume()
        assert opened[0].status_code == 201, opened[0].text
        assert env.router.find_stream(ANONYMOUS, opened[0].json()["stream_id"]) is not None
        assert env.router.streams.open_count == open_before + 1


async def test_a_stopped_redis_holds_the_open_not_the_loop(nursery, tmp_path):
    with start_redis(password="s3cret-" + uuid.uuid4().hex[:8]) as redis_server:
        # A long socket timeout: the open waits for Redis to run again instead of failing.
        env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "state",
                                 store=redis_server.url + "?socket_timeout=20", store_namespace="t-loop")
        assert isinstance(env.router.store, RedisStore) and env.router.store.loop_ready
        async with httpx.AsyncClient(base_url=env.url, timeout=60) as http:
            # The tenant's first stream on this router opens the tenant's account too (once).
            first = await http.post("/v1/streams", json={"task": {"task_type": "code_review"}})
            assert first.status_code == 201, first.text
        before = env.router.store.round_trips_by_op.get("open_stream", 0)
        pid = redis_server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            await _open_while_waiting(env, lambda: env.router.streams.open_count == 2,
                                      lambda: os.kill(pid, signal.SIGCONT), open_before=1)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert env.router.store.round_trips_by_op["open_stream"] == before + 1


async def test_the_open_runs_in_a_store_thread_where_the_loop_client_does_not_go(nursery, tmp_path, redis_server,
                                                                                 monkeypatch):
    monkeypatch.setattr(RedisStore, "loop_ready", property(lambda self: False))  # as for a rediss:// URL
    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "state", store=redis_server.url,
                             store_namespace="t" + uuid.uuid4().hex[:12])
    store = env.router.store
    assert isinstance(store, RedisStore)
    entered, release = threading.Event(), threading.Event()
    original = store.open_stream_shared

    def held(*args: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(HOLD_S)
        return original(*args, **kw)

    store.open_stream_shared = held  # type: ignore[method-assign]
    await _open_while_waiting(env, entered.is_set, release.set)


def test_the_loop_client_is_off_for_tls_urls():
    import redis

    from atp_router.store.redis_trio import TrioRedis

    pool = redis.ConnectionPool.from_url("rediss://127.0.0.1:1/0")
    assert TrioRedis.of(pool, connect_timeout_s=0.5, socket_timeout_s=0.5) is None
    with pytest.raises(AssertionError):
        assert TrioRedis.of(redis.ConnectionPool.from_url("redis://127.0.0.1:1/0"), connect_timeout_s=0.5,
                            socket_timeout_s=0.5) is None
