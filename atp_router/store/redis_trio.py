"""Redis round trips on the router's trio loop, without a thread (issue 22 item 2: no
store round trip blocks the loop).

:class:`TrioRedis` sends one command on a trio socket and waits for its reply while
the loop serves everything else: the command is packed by ``hiredis.pack_command``
and the reply parsed by ``hiredis.Reader`` — the C parser redis-py itself uses —,
so only the socket I/O is ours. A store thread (:mod:`atp_router.store.threads`)
does the same without blocking the loop, but under load its hand-offs cost more
than the call: each takes the GIL back and forth with the busy loop (measured:
about 80 futex calls a task against 30, and 10 % fewer tasks a second with two
routers on 2 cores, when the OPEN went to a store thread).

Connections: plain TCP (``redis://``) and Unix sockets (``unix://``), with the
URL's user, password and database (``AUTH``, ``SELECT`` when opened). A TLS URL
(``rediss://``) has no loop connection: :meth:`TrioRedis.of` returns None and the
caller uses its store threads. One command per connection at a time (replies
are not matched across callers); at most :data:`MAX_CONNECTIONS` open, idle ones
kept for the next call.

Failures: connect and reply each bounded by the client's timeouts; a timeout or
a connection error raises :class:`TrioRedisError` and drops that connection (a
late reply is never read as another call's); an idle connection the server
closed (a Redis restarted) is dropped before it is used. The call is shielded from
cancellation: once sent, its reply is waited for (at most the timeout), as a
store thread is never abandoned — the caller always learns whether it ran.
"""

from __future__ import annotations

import select
from typing import Any

import hiredis
import redis
import trio

__all__ = ["MAX_CONNECTIONS", "TrioRedis", "TrioRedisError"]

#: Connections a :class:`TrioRedis` holds at most (callers past it wait for one).
MAX_CONNECTIONS = 32
#: Bytes read from the socket at a time.
_READ = 65536


class TrioRedisError(Exception):
    """Redis could not be reached or did not answer in time (the command may or may
    not have run: the same uncertainty as a timed-out call of redis-py)."""


class _Conn:
    __slots__ = ("reader", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.reader = hiredis.Reader(replyError=redis.ResponseError)


class TrioRedis:
    """Connections to one Redis for calls made on the trio loop (module docstring).
    ``target``: ``("tcp", host, port)`` or ``("unix", path)``; ``auth``: the
    ``AUTH`` arguments (``[user,] password``, empty: none); ``db``: the database
    ``SELECT``-ed (0: none); timeouts in seconds."""

    def __init__(self, target: tuple[Any, ...], *, auth: tuple[str, ...], db: int, connect_timeout_s: float,
                 socket_timeout_s: float) -> None:
        self.target, self.auth, self.db = target, auth, db
        self.connect_timeout_s, self.socket_timeout_s = connect_timeout_s, socket_timeout_s
        self._idle: list[_Conn] = []
        self._slots = trio.Semaphore(MAX_CONNECTIONS)

    @classmethod
    def of(cls, pool: redis.ConnectionPool, *, connect_timeout_s: float, socket_timeout_s: float) -> TrioRedis | None:
        """The :class:`TrioRedis` of redis-py ``pool``'s server and credentials;
        None for a connection kind it does not speak (TLS)."""
        kw = pool.connection_kwargs
        kind = pool.connection_class
        if issubclass(kind, redis.UnixDomainSocketConnection):
            target: tuple[Any, ...] = ("unix", kw["path"])
        elif issubclass(kind, redis.SSLConnection) or not issubclass(kind, redis.Connection):
            return None
        else:
            target = ("tcp", kw.get("host", "localhost"), int(kw.get("port", 6379)))
        password, username = kw.get("password"), kw.get("username")
        auth = () if password is None else ((username, password) if username else (password,))
        return cls(target, auth=auth, db=int(kw.get("db") or 0), connect_timeout_s=connect_timeout_s,
                   socket_timeout_s=socket_timeout_s)

    async def execute(self, *args: Any) -> Any:
        """Send the command ``args`` and return its reply (an error reply as a
        :class:`redis.ResponseError` instance, not raised). Raises
        :class:`TrioRedisError` (not reached, or no reply within the timeout)."""
        async with self._slots:
            with trio.CancelScope(shield=True):
                conn = await self._take() or await self._connect()
                try:
                    reply = await self._round_trip(conn, hiredis.pack_command(args))
                except BaseException:
                    await trio.aclose_forcefully(conn.stream)
                    raise
                self._idle.append(conn)
                return reply

    async def _take(self) -> _Conn | None:
        """An idle connection still fit for a command: one the server closed, or
        that holds bytes nobody asked for, is dropped (as redis-py's pool does at
        checkout), so a Redis restarted meanwhile is not taken for one that failed."""
        while self._idle:
            conn = self._idle.pop()
            if not _readable(conn.stream):
                return conn
            await trio.aclose_forcefully(conn.stream)
        return None

    async def _round_trip(self, conn: _Conn, data: bytes) -> Any:
        with trio.move_on_after(self.socket_timeout_s) as timer:
            try:
                await conn.stream.send_all(data)
                reply = conn.reader.gets()
                while reply is False:
                    chunk = await conn.stream.receive_some(_READ)
                    if not chunk:
                        raise TrioRedisError("Connection closed by server.")
                    conn.reader.feed(bytes(chunk))
                    reply = conn.reader.gets()
                return reply
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise TrioRedisError(f"Error while reading from redis: {e}") from None
            except hiredis.ProtocolError as e:
                raise TrioRedisError(f"Protocol error: {e}") from None
        assert timer.cancelled_caught
        raise TrioRedisError(f"Timeout reading from redis ({self.socket_timeout_s:g} s)")

    async def _connect(self) -> _Conn:
        with trio.move_on_after(self.connect_timeout_s) as timer:
            try:
                if self.target[0] == "unix":
                    stream: trio.abc.Stream = await trio.open_unix_socket(self.target[1])
                else:
                    stream = await trio.open_tcp_stream(self.target[1], self.target[2])
            except OSError as e:
                raise TrioRedisError(f"Error connecting to redis: {e}") from None
        if timer.cancelled_caught:
            raise TrioRedisError(f"Timeout connecting to redis ({self.connect_timeout_s:g} s)")
        conn = _Conn(stream)
        try:
            cmds: list[tuple[Any, ...]] = [("AUTH", *self.auth)] if self.auth else []
            if self.db:
                cmds.append(("SELECT", self.db))
            for cmd in cmds:
                reply = await self._round_trip(conn, hiredis.pack_command(cmd))
                if isinstance(reply, redis.ResponseError):
                    raise TrioRedisError(f"redis refused {cmd[0]}: {reply}")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return conn

    async def aclose(self) -> None:
        """Close the idle connections."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)


def _readable(stream: trio.abc.Stream) -> bool:
    """Whether ``stream``'s socket has something to read now (EOF included): no wait."""
    poller = select.poll()
    poller.register(stream.socket.fileno(), select.POLLIN)  # type: ignore[attr-defined]
    return bool(poller.poll(0))
