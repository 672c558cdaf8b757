"""The store tests' backends: every test of the :class:`~atp_router.store.Store`
interface takes the ``backend`` fixture and runs on the embedded SQLite store
(as ``--workers`` opens it, and as a single router opens it: exclusive, with its
redo log, ``sqlite-redo``) and on Redis (a real redis-server on loopback, one per session, a fresh
namespace per test; its tests are marked ``peers``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from atp_router.store import SqliteStore, Store
from atp_router.store.redis import RedisStore
from tests.peers import RedisServer, start_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server (AOF, fsync always) for the session's store tests."""
    with start_redis() as server:
        yield server


@dataclass
class Backend:
    """A store backend under test: ``open(**options)`` opens another
    :class:`Store` on the same state (the state dir, or the Redis namespace),
    as a restarted router or a second process would; ``spec`` names that state
    for a child process (:func:`open_spec`)."""

    name: str
    spec: str
    opener: Callable[..., Store]
    opened: list[Store] = field(default_factory=list)

    def open(self, **options: Any) -> Store:
        if self.name == "sqlite-redo" and not options.get("multiprocess") and any(
                isinstance(s, SqliteStore) and s.path.parent == Path(self.spec.partition(":")[2])
                and s._ofd is not None for s in self.opened):
            # Exclusive: a second handle on the file is refused (tests/store/test_sqlite_store.py checks that).
            pytest.skip("the single router's store has one handle at a time")
        store = self.opener(**options)
        self.opened.append(store)
        return store


    def fresh(self, n: int) -> Backend:
        """Another, empty state of the same backend (the ``n``-th)."""
        kind, _, rest = self.spec.partition(":")
        if kind in ("sqlite", "sqlite-redo"):
            spec = f"{kind}:{rest}-{n}"
        else:
            ns, _, url = rest.partition(":")
            spec = f"redis:{ns}-{n}:{url}"
        return Backend(self.name, spec, lambda **options: open_spec(spec, **options), self.opened)


def open_spec(spec: str, **options: Any) -> Store:
    """The store a :attr:`Backend.spec` names: ``sqlite:<dir>`` or
    ``redis:<namespace>:<url>`` (for child processes). ``multiprocess`` is
    SQLite's (a Redis store is always shared)."""
    kind, _, rest = spec.partition(":")
    if kind == "sqlite":
        return SqliteStore.open(rest, **options)
    if kind == "sqlite-redo":
        # The single router's store (atp_router.deploy.single): exclusive, write transactions in
        # the redo log (atp_router.store.redo); a multiprocess open of the same file is the
        # --workers store that replays what the log holds first.
        if options.get("multiprocess"):
            return SqliteStore.open(rest, **options)
        return SqliteStore.open(rest, exclusive=True, redo=True, **options)
    options.pop("multiprocess", None)
    # These tests check accounting, not fast fail (tests/store/test_redis_store.py does, with its own
    # timeouts): a Redis on a loaded machine may answer slower than the router's 0.5 s default.
    options.setdefault("socket_timeout_s", 10.0)
    options.setdefault("connect_timeout_s", 10.0)
    ns, _, url = rest.partition(":")
    return RedisStore.open(url, namespace=ns, **options)


@pytest.fixture(params=["sqlite", "sqlite-redo", pytest.param("redis", marks=pytest.mark.peers)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param in ("sqlite", "sqlite-redo"):
        spec = f"{request.param}:{tmp_path / 'state'}"
    else:
        server = request.getfixturevalue("redis_server")
        spec = f"redis:t{uuid.uuid4().hex[:12]}:{server.url}"
    b = Backend(request.param, spec, lambda **options: open_spec(spec, **options))
    yield b
    for store in b.opened:
        store.close()


def account_keys(store: Store) -> list[str]:
    """Every account the store still keeps, open or closed (sorted)."""
    if isinstance(store, SqliteStore):
        return sorted(r[0] for r in store._conn.execute("SELECT key FROM account"))
    assert isinstance(store, RedisStore)
    c, p = store._client, store._prefix
    return sorted(k.decode() for k in c.sunion(p + "ao", p + "ac"))


def rib_count(store: Store) -> int:
    """How many RIB versions the store keeps."""
    if isinstance(store, SqliteStore):
        return store._conn.execute("SELECT COUNT(*) FROM rib").fetchone()[0]
    assert isinstance(store, RedisStore)
    return store._client.llen(store._prefix + "rib")


#: Schema 2's stream and event tables (SQLite store), as routers before schema 3 wrote
#: them: a script turning a new store's into them, for the migration tests.
STREAM_EVENT_V2 = """
DROP TABLE event; DROP TABLE stream;
CREATE TABLE stream (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, idempotency_key TEXT,
    state TEXT NOT NULL, close_reason TEXT, created_ms INTEGER NOT NULL, closed_ms INTEGER,
    n_events INTEGER NOT NULL DEFAULT 0, body BLOB NOT NULL, owner TEXT,
    PRIMARY KEY (tenant, session_id, stream_id));
CREATE INDEX stream_idem ON stream (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX stream_done ON stream (state, closed_ms);
CREATE INDEX stream_by_id ON stream (tenant, stream_id);
CREATE TABLE event (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, stream_id TEXT NOT NULL, event_id INTEGER NOT NULL,
    type TEXT NOT NULL, frame BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id, stream_id, event_id)) WITHOUT ROWID;
UPDATE meta SET value = '2' WHERE key = 'schema_version';
"""
