"""The trio-socket Redis client of the cluster's hot path
(:class:`atp_router.store.redis_trio.TrioRedis`), on real redis-servers: a command
and its reply over TCP and a Unix socket, with the URL's password (``AUTH``) and
database (``SELECT``); an error reply returned, not raised; connections reused; a
Redis that does not answer within the timeout, or is not there, raises
:class:`~atp_router.store.redis_trio.TrioRedisError` and the next call connects
afresh; a Redis restarted while a connection sat idle answers the next call; a cancelled caller still waits for the reply of a command it sent."""

from __future__ import annotations

import os
import signal

import pytest
import redis
import trio

from atp_router.store.redis_trio import TrioRedis, TrioRedisError
from tests.peers import free_port, start_redis


def client(url: str, timeout_s: float = 2.0) -> TrioRedis:
    got = TrioRedis.of(redis.ConnectionPool.from_url(url), connect_timeout_s=timeout_s, socket_timeout_s=timeout_s)
    assert got is not None
    return got


@pytest.mark.parametrize("where", ["tcp", "unix"])
async def test_commands_and_replies_with_auth_and_db(where):
    with start_redis(appendonly=False, password="pw-test") as server:
        url = server.url if where == "tcp" else server.unix_url
        c = client(url.replace("/0", "/3") if where == "tcp" else url.replace("db=0", "db=3"))
        assert await c.execute("SET", "k", b"v\r\n\x00") == b"OK"
        assert await c.execute("GET", "k") == b"v\r\n\x00"
        assert await c.execute("EVAL", "return {1, 'a', ARGV[1]}", 0, 2.5) == [1, b"a", b"2.5"]
        err = await c.execute("INCR", "k")
        assert isinstance(err, redis.ResponseError) and "not an integer" in str(err)
        assert len(c._idle) == 1  # one connection, reused
        assert redis.Redis.from_url(server.url.replace("/0", "/3")).get("k") == b"v\r\n\x00"  # SELECT 3 held
        await c.aclose()
        bad = client(url.replace("pw-test", "wrong"))
        with pytest.raises(TrioRedisError, match="refused AUTH"):
            await bad.execute("PING")


async def test_a_silent_or_absent_redis_fails_within_the_timeout_and_the_next_call_reconnects():
    with start_redis(appendonly=False) as server:
        c = client(server.url, timeout_s=0.3)
        assert await c.execute("PING") == b"PONG"
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with trio.fail_after(5):
                with pytest.raises(TrioRedisError, match="Timeout reading"):
                    await c.execute("PING")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert not c._idle  # the silent connection was dropped: a late reply is never read as another's
        assert await c.execute("PING") == b"PONG"
    with pytest.raises(TrioRedisError, match="connecting"):
        await client(f"redis://127.0.0.1:{free_port()}/0").execute("PING")


async def test_a_restarted_redis_is_not_taken_for_a_failed_one():
    with start_redis(appendonly=False) as server:
        c = client(server.url)
        assert await c.execute("PING") == b"PONG"
        server.stop()
        server.start()  # same port: the idle connection is closed on the other side
        assert await c.execute("PING") == b"PONG"


async def test_a_cancelled_caller_still_gets_the_reply_of_what_it_sent():
    with start_redis(appendonly=False) as server:
        c = client(server.url, timeout_s=10)
        assert await c.execute("PING") == b"PONG"
        got: list[object] = []
        os.kill(server.proc.pid, signal.SIGSTOP)  # the command is sent, its reply does not come yet
        try:
            async with trio.open_nursery() as n:
                async def incr(scope: trio.CancelScope) -> None:
                    with scope:
                        got.append(await c.execute("INCR", "n"))
                scope = trio.CancelScope()
                n.start_soon(incr, scope)
                await trio.sleep(0.3)
                scope.cancel()  # the caller gives up while the reply is awaited
                await trio.sleep(0.2)
                assert got == []
                os.kill(server.proc.pid, signal.SIGCONT)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert got == [1]  # it waited for the reply of what it sent, then saw its cancellation
        assert await c.execute("GET", "n") == b"1"
