"""Durable router state (issue 7): the :class:`Store` interface, its embedded
SQLite default and the ledger journal that feeds it.

Start-up, in this order::

    store = SqliteStore.open(state_dir)                 # creates state_dir (0700)
    store.recover()                                     # open reservations → committed
    ledger = BudgetLedger()
    ledger.restore(store.load_ledger())                 # committed spend intact
    ledger.journal = StoreJournal(store)                # every mutation persisted
    for rec in store.interrupt_open_streams("router restarted", now_ms=...): ...  # RST them

Several routers (issue 12) share ``RedisStore.open("redis://host:6379/0", namespace="atp")``
(:mod:`atp_router.store.redis`; imported on first use of ``atp_router.store.RedisStore``: redis-py
takes ~0.15 s to import).
"""

from typing import TYPE_CHECKING, Any

from atp_router.store.base import (
    CachePut,
    CacheStats,
    Fenced,
    NotFound,
    SchemaError,
    Store,
    StoredEvent,
    StoreError,
    StoreFull,
    StoreJournal,
    StoreLimitError,
    StoreUnavailable,
    StreamRecord,
    StreamState,
)
from atp_router.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from atp_router.store.redis import RedisStore

__all__ = [
    "CachePut",
    "CacheStats",
    "Fenced",
    "NotFound",
    "RedisStore",
    "SchemaError",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreJournal",
    "StoreLimitError",
    "StoreUnavailable",
    "StoredEvent",
    "StreamRecord",
    "StreamState",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from atp_router.store.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
