"""Store calls off the trio event loop (issue 22 item 2): a store whose client is
thread-safe (:attr:`Store.threaded <atp_router.store.base.Store.threaded>`: the
Redis store several routers share) is called from a small pool of store threads,
so a store that stalls (Redis paused, a slow fsync) holds those threads, not the
router's loop and every tenant on it.

:func:`off_loop` runs one store call (or a function making several) through
``trio.to_thread.run_sync`` under the store's :class:`trio.CapacityLimiter` of
:data:`STORE_THREADS` threads; a store that is not threaded (the embedded SQLite
store: its writes are quick and serialised by its own lock) is called on the
loop, as before.

Cancellation: a thread cannot be interrupted, so the call is **not abandoned**
when its caller is cancelled — the caller waits for it (at most the store's own
socket timeout: :class:`~atp_router.store.redis.RedisStore` fails fast) and sees
its outcome, so a write that may still apply is never lost track of (a named
reserve is cancelled, a named commit re-committed, by the caller's own rules).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["STORE_THREADS", "limiter", "off_loop"]

#: Store threads per store (and trio run): enough for the group commit, the lease-free
#: pollers and a few reads at once; more only queue on Redis' one thread.
STORE_THREADS = 4

T = TypeVar("T")


def limiter(store: Any) -> trio.CapacityLimiter:
    """The :class:`trio.CapacityLimiter` of ``store``'s threads in the current
    trio run (made on first use: a limiter belongs to one run)."""
    token = trio.lowlevel.current_trio_token()
    got = getattr(store, "_atp_threads", None)
    if got is None or got[0] is not token:
        got = (token, trio.CapacityLimiter(STORE_THREADS))
        store._atp_threads = got
    return got[1]


async def off_loop(store: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` — a call of ``store`` — in one of its store threads when it
    is :attr:`~atp_router.store.base.Store.threaded`, else here; its result, or
    its exception raised here. Never abandoned on cancellation (module docstring)."""
    if not getattr(store, "threaded", False):
        return fn(*args)
    return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter(store))
