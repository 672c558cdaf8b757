"""Durable router state (issue 7): the :class:`Store` interface, its embedded
SQLite default and the ledger journal that feeds it.

Start-up, in this order::

    store = SqliteStore.open(state_dir)                 # creates state_dir (0700)
    store.recover()                                     # open reservations → committed
    ledger = BudgetLedger()
    ledger.restore(store.load_ledger())                 # committed spend intact
    ledger.journal = StoreJournal(store)                # every mutation persisted
    for rec in store.interrupt_open_streams("router restarted", now_ms=...): ...  # RST them
"""

from atp.store.base import (
    CachePut,
    CacheStats,
    NotFound,
    SchemaError,
    Store,
    StoredEvent,
    StoreError,
    StoreJournal,
    StoreLimitError,
    StreamRecord,
    StreamState,
)
from atp.store.sqlite import SqliteStore

__all__ = [
    "CachePut",
    "CacheStats",
    "NotFound",
    "SchemaError",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreJournal",
    "StoreLimitError",
    "StoredEvent",
    "StreamRecord",
    "StreamState",
]
