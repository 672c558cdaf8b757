"""Replay protection that survives restarts and spans workers and routers (issue 19
item 5, spec §11 "nonces to prevent replay"): a correctly signed SYN captured once
and sent again is refused with ``ESEC`` — audited, not run, not charged — when
the router was killed with SIGKILL and restarted on its state directory, when it
lands on the other worker of ``--workers 2``, and when it is sent to another
router on the same Redis. The store is the authority (``Store.record_nonce``);
while it cannot be reached a signed frame is refused, never accepted unchecked.

Real components: ``atp-router`` processes (tests.helpers.RouterProcess) with
``ATP_HMAC_KEYS`` (two keys with ids), driven over real WebSockets; the next-hop
is tests.replay_server.BillingModel (every call bills 1,000 tokens); a real
redis-server for the cluster (tests.peers.start_redis). The guard's own rules
are checked on a real SQLite store and, for a store that fails, a real Redis
that was stopped.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time
from contextlib import asynccontextmanager, closing
from pathlib import Path

import msgspec
import pytest
import trio
from trio_websocket import open_websocket_url

from atp_router.flow.lease import LEASE_IDLE_S
from atp_router.security.signing import (
    DurableReplayGuard,
    ReplayGuard,
    frame_kid,
    sign_outbound,
)
from atp_router.store import SqliteStore
from atp_router.store.redis import RedisStore
from atp_router.wire import session as S
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType
from tests.helpers import RouterProcess, durable_db
from tests.peers import start_redis
from tests.replay_server import BillingModel, serve
from tests.scale.common import BILLED, CONTENT, TASK, TOKENS, held, summarize_rib
from tests.unit.test_router_ws import WINDOW, Peer

KEYS = {"k2": b"k2-replay-test-key-0123456789ab", "k1": b"k1-replay-test-key-0123456789ab"}
RING = KeyRing(KEYS)  # k2 signs (first), both verify: the router's ring
_ENV = {
    "ATP_HMAC_KEYS": ",".join(f"{kid}:{base64.b64encode(key).decode()}" for kid, key in KEYS.items()),
    "ATP_ROUTER_TOKENS": f"alice:{TOKENS['alice']},bob:{TOKENS['bob']},ops:{TOKENS['ops']}:admin+operator",
}


# ------------------------------------------------------------------ wire helpers
def signed_syn(session: S.Session, stream_id: str, *, task: bool = True) -> Frame:
    """A SYN of alice's ``summarize`` task (``task``: with its content, else the
    stream waits for it) opened in the client ``session``, signed by ``k2`` with
    a fresh nonce: what a client sends."""
    syn = session.open_stream(stream_id, dict(TASK), WINDOW,
                              payload=Payload(type=PayloadType.TASK, content=CONTENT) if task else None)
    return sign_outbound(syn, RING, int(time.time() * 1000))


def wire(frame: Frame) -> str:
    """``frame`` as it travels (already sealed and signed): the bytes an attacker captures."""
    return FrameCodec("json").encode(frame, seal_frame=False).decode()


@asynccontextmanager
async def ws(url: str, session_id: str):
    """A WebSocket of alice to the router at ``url``: a :class:`Peer` whose codec
    verifies the router's frames with the ring (and signs its ACKs)."""
    async with open_websocket_url(url, subprotocols=["atp.v1.json"],
                                  extra_headers=[("Authorization", f"Bearer {TOKENS['alice']}")]) as conn:
        yield Peer(conn, FrameCodec("json", keyring=RING), session_id)


async def run_once(url: str, session_id: str, stream_id: str) -> str:
    """Send a signed SYN with the task on a new connection and read its stream to
    the end: it must end with a FINAL. Returns the SYN as it travelled (captured)."""
    async with ws(url, session_id) as peer:
        captured = wire(signed_syn(peer.session, stream_id))
        await peer.send_raw(captured)
        await peer.pump_until(lambda: peer.closed(stream_id), timeout=60)
        assert [p.type for p in peer.messages(stream_id)][-1] is PayloadType.FINAL, peer.raw
    return captured


async def replay_refused(peer: Peer, message: str, stream_id: str) -> str:
    """Send the captured ``message``; the answer on ``stream_id`` must be an ESEC
    ERROR and nothing else (no SYN+ACK, no FINAL). Returns its reason."""
    before = len(peer.raw)
    await peer.send_raw(message)
    await peer.pump_until(lambda: bool(peer.raw_errors(stream_id)), timeout=30)
    err = peer.raw_errors(stream_id)[0]
    assert err.code == "ESEC", err
    answers = [f for f in peer.raw[before:] if f.stream_id == stream_id]
    assert all(f.payload is not None and f.payload.type is PayloadType.CONTROL for f in answers), answers
    assert not any(Flag.ACK in f.flags and Flag.SYN in f.flags for f in answers)
    return err.reason


def audited_esec(db: Path) -> list[dict]:
    """The ``esec`` records of the audit trail in the state database ``db``."""
    with closing(sqlite3.connect(f"file:{durable_db(db)}?mode=ro", uri=True)) as c:
        return [json.loads(d) for (d,) in c.execute("SELECT detail FROM audit WHERE kind = 'esec' ORDER BY seq")]


def committed(db: Path, account: str) -> int:
    # Closed, not left to the GC: an open connection keeps a lock the next router's (exclusive) open waits for.
    with closing(sqlite3.connect(f"file:{durable_db(db)}?mode=ro", uri=True)) as c:
        return c.execute("SELECT committed_tokens FROM account WHERE key = ?", (account,)).fetchone()[0]


def router(policies: Path, state: Path, *extra: str) -> RouterProcess:
    return RouterProcess("--policies", policies, "--state-dir", state, "--http-port", "0", "--ws-port", "0",
                         "--no-watch", *extra, env=_ENV)


@pytest.fixture
async def model(nursery) -> BillingModel:
    return await serve(nursery, BillingModel(BILLED))


@pytest.fixture
def policies(tmp_path, model) -> Path:
    d = tmp_path / "rib"
    d.mkdir()
    (d / "rib.yaml").write_text(summarize_rib(model.url))
    return d


# ------------------------------------------------------------------ over the wire
async def test_a_signed_syn_replayed_after_kill9_and_restart_is_esec_not_run_not_charged(tmp_path, model,
                                                                                           policies):
    """Captured, run once, the router SIGKILLed and restarted on the same state
    directory, the same bytes sent again within the window: ESEC (audited), the
    model not called again, alice charged once. The same frame with its ``sig``
    stripped of the key id (verified against the signing key: the same key) is
    refused too."""
    state = tmp_path / "state"
    first = router(policies, state)
    try:
        await first.wait_listening()
        captured = await run_once(first.ws_url, "sess-capture", "t1")
        assert len(model.requests) == 1
    finally:
        first.kill9()
    assert committed(state / "state.db", "client:alice") == BILLED

    again = router(policies, state)
    try:
        await again.wait_listening()
        async with ws(again.ws_url, "sess-capture") as peer:
            # First the frame with its sig stripped of the key id ("k2:<mac>" -> "<mac>",
            # checked against the signing key: the same key): the store must know it.
            stripped = json.loads(captured)
            stripped["sig"] = stripped["sig"].partition(":")[2]
            assert frame_kid(msgspec.convert(stripped, Frame), RING) == "k2"
            reason = await replay_refused(peer, json.dumps(stripped), "t1")
            assert "replayed frame" in reason and "before a restart" in reason
            reason = await replay_refused(peer, captured, "t1")  # the bytes as captured
            assert "replayed frame" in reason
            # The router still serves alice: a fresh signature of the same task runs.
            await run_once(again.ws_url, "sess-capture", "t2")
    finally:
        again.stop()
    assert len(model.requests) == 2  # t1 once, t2 once: the replays ran nothing
    assert committed(state / "state.db", "client:alice") == 2 * BILLED
    replays = [d for d in audited_esec(state / "state.db") if "replayed frame" in d.get("reason", "")]
    assert len(replays) == 2 and {d["stream_id"] for d in replays} == {"t1"}


async def _worker_of(state: Path, stream_id: str) -> str:
    """The slot of the worker that owns stream ``stream_id`` (its store record's
    owner ``w<slot>.<pid>``), once it is stored."""
    with trio.fail_after(20):
        while True:
            with sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True) as c:
                row = c.execute("SELECT owner FROM stream WHERE tenant = 'alice' AND stream_id = ?",
                                (stream_id,)).fetchone()
            if row is not None and row[0]:
                return row[0].partition(".")[0]
            await trio.sleep(0.05)


async def test_with_two_workers_a_replay_landing_on_the_other_worker_is_esec(tmp_path, model, policies):
    """``--workers 2``: the signed SYN runs on one worker; the same bytes sent on a
    connection the kernel gave the other worker (found with a fresh probe SYN
    whose stream's owner says which) and on one to the same worker: ESEC both,
    the model called once, alice charged once."""
    state = tmp_path / "state"
    sup = router(policies, state, "--workers", "2")
    try:
        await sup.wait_listening()
        captured = await run_once(sup.ws_url, "sess-w", "t1")
        ran_on = await _worker_of(state, "t1")
        landed: dict[str, str] = {}
        claimed: set[str] = set()

        async def probe_one(name: str) -> None:
            async with ws(sup.ws_url, f"sess-probe-{name}") as peer:
                probe = signed_syn(peer.session, f"probe-{name}", task=False)  # opens, runs nothing
                await peer.send_raw(wire(probe))
                await peer.pump_until(lambda p=probe: bool(peer.events[p.stream_id]), timeout=30)
                slot = await _worker_of(state, probe.stream_id)
                if slot not in claimed:
                    claimed.add(slot)
                    landed[slot] = await replay_refused(peer, captured, "t1")

        # Connections opened a batch at a time: while one worker is busy accepting and
        # answering, the kernel hands the next to the other (one at a time, an idle
        # worker can win every accept).
        for batch in range(8):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(probe_one, f"{batch}-{i}")
            if len(landed) == 2:
                break
        assert set(landed) == {"w0", "w1"}, f"64 connections did not reach both workers: {landed}"
        other = next(s for s in landed if s != ran_on)
        assert "replayed frame" in landed[other] and "another worker" in landed[other]  # the store's refusal
    finally:
        sup.stop()
    assert len(model.requests) == 1
    assert committed(state / "state.db", "client:alice") == BILLED
    assert sum("replayed frame" in d.get("reason", "") for d in audited_esec(state / "state.db")) == 2


@pytest.mark.peers
async def test_two_routers_on_one_redis_refuse_a_replay_on_the_other_and_fail_closed_without_it(tmp_path, model,
                                                                                                   policies):
    """Two routers on one Redis: the SYN runs on the first; the same bytes sent to
    the second: ESEC, audited, nothing run or charged. Then Redis stops: a fresh
    signed SYN is refused with ESEC "replay check unavailable" (not accepted
    unchecked), and nothing runs."""
    with start_redis() as server:
        routers = [router(policies, tmp_path / f"s{i}", "--store", server.url) for i in range(2)]
        store = RedisStore.open(server.url)
        try:
            for r in routers:
                await r.wait_listening()
            captured = await run_once(routers[0].ws_url, "sess-c", "t1")
            assert len(model.requests) == 1
            async with ws(routers[1].ws_url, "sess-c") as peer:
                reason = await replay_refused(peer, captured, "t1")
                assert "replayed frame" in reason and "another router" in reason
            totals = store.shared_totals("client:alice").totals[0]
            assert totals.committed_tokens == BILLED
            # What stays reserved is only the routers' budget leases on alice's own account (issue 22:
            # a call's reservation left on its stream fails here), then nothing once they went back idle.
            reserved, rows = held(server.url, "alice")
            assert all(account == "client:alice" for account, _, _ in rows), rows
            assert reserved == sum(t for _, t, _ in rows)
            with trio.fail_after(10 * LEASE_IDLE_S):
                while store.shared_totals("client:alice").totals[0].reserved_tokens:
                    await trio.sleep(0.1)
            assert store.shared_totals("client:alice").totals[0].committed_tokens == BILLED
            # Audit records are written behind, in the router's next group commit (issue 25 item 2):
            # the refusal's record is in the shared chain within a few flushes.
            def refused_t1(records: list) -> bool:
                return any("replayed frame" in r.detail.get("reason", "") and r.detail.get("stream_id") == "t1"
                           for r in records)

            esec: list = []
            with trio.move_on_after(10):
                while not refused_t1(esec := [r for r in store.audit_records() if r.kind == "esec"]):
                    await trio.sleep(0.05)
            assert refused_t1(esec), esec

            server.stop()
            async with ws(routers[1].ws_url, "sess-down") as peer:
                reason = await replay_refused(peer, wire(signed_syn(peer.session, "t2")), "t2")
                assert "replay check unavailable" in reason and "refused rather than accepted unchecked" in reason
            assert len(model.requests) == 1
        finally:
            for r in routers:
                r.stop()
            store.close()


# ------------------------------------------------------------------ the guard itself
NOW = 1_760_000_000_000


def _signed(session: str = "s1", *, nonce: str | None = None, ts: int = NOW, ring: KeyRing = RING) -> Frame:
    f = Frame(v=1, session_id=session, stream_id="st", msg_seq=0, flags=[Flag.SYN], meta={"task_type": "x"})
    return FrameCodec("json", keyring=RING).decode(
        FrameCodec("json").encode(sign_outbound(f, ring, ts, nonce=nonce), seal_frame=False))


def _esec(guard: DurableReplayGuard, tenant: str, frame: Frame, now: int = NOW) -> str:
    with pytest.raises(LocalProtocolError) as e:
        guard.check(tenant, frame, now)
    assert e.value.code is ErrorCode.ESEC
    return e.value.reason


def test_two_guards_on_one_store_refuse_each_others_nonces_per_tenant_and_key(tmp_path):
    """Two processes' guards (two handles on one state dir, as --workers): a nonce
    accepted by one is a replay for the other — in any session of the tenant —
    but not for another tenant; a frame signed by another key of the ring with the
    same nonce is another (tenant, kid, nonce)."""
    a = DurableReplayGuard(SqliteStore.open(tmp_path / "st", multiprocess=True), RING)
    b = DurableReplayGuard(SqliteStore.open(tmp_path / "st", multiprocess=True), RING)
    f = _signed(nonce="N" * 24)
    a.check("alice", f, NOW)
    assert "replayed frame" in _esec(b, "alice", f)
    assert "replayed frame" in _esec(b, "alice", _signed("s2", nonce="N" * 24))  # another session, same nonce
    b.check("bob", f, NOW)
    k1 = KeyRing(KEYS, signing_kid="k1")
    g = _signed("s3", nonce="N" * 24, ring=k1)
    assert frame_kid(g, RING) == "k1"
    b.check("alice", g, NOW)
    assert b.statistics().store_replayed == 2 and b.statistics().refused == 2


def test_a_tenant_at_its_bound_is_esec_and_may_send_again_once_nonces_expired(tmp_path):
    guard = DurableReplayGuard(SqliteStore.open(tmp_path / "st"), RING, max_per_tenant=2, slack_ms=1_000)
    guard.check("alice", _signed(nonce="a" * 20), NOW)
    guard.check("alice", _signed(nonce="b" * 20), NOW)
    third = _signed(nonce="c" * 20, ts=NOW + 5_000)
    assert "too many signed frames" in _esec(guard, "alice", third, NOW + 5_000)
    guard.check("bob", _signed(nonce="c" * 20), NOW)  # other tenants are served
    # The same frame, once the first two left the store (ts + window + slack): accepted,
    # because the refusal left no trace in the in-memory cache either.
    later = NOW + guard.window_ms + 1_000
    guard.check("alice", third, later)
    assert guard.statistics().store_full == 1


@pytest.mark.peers
def test_a_store_that_cannot_be_reached_refuses_and_the_frame_is_judged_again_later(tmp_path):
    """Redis stopped: ESEC "replay check unavailable" — and the frame is not
    remembered as seen, so once a store answers it is checked there (fresh)."""
    with start_redis() as server:
        store = RedisStore.open(server.url, namespace="g", socket_timeout_s=0.3, connect_timeout_s=0.3,
                                backoff_s=0.0)
        guard = DurableReplayGuard(store, RING, memory=ReplayGuard())
        server.stop()
        f = _signed(nonce="d" * 20, ts=int(time.time() * 1000))
        now = int(time.time() * 1000)
        reason = _esec(guard, "alice", f, now)
        assert "replay check unavailable" in reason and "cannot be reached" in reason
        assert "127.0.0.1" not in reason and "redis" not in reason.lower()  # no store details to the client
        assert guard.statistics().store_unavailable == 1 and guard.memory.statistics().nonces == 0
        server.start()
        guard.check("alice", f, now)
        assert "replayed frame" in _esec(DurableReplayGuard(store, RING), "alice", f, now)
        store.close()


def test_a_store_that_fails_refuses_the_frame(tmp_path):
    """Any store failure (here SQLite's own error on a closed database, wrapped as
    a StoreError) refuses the frame: ESEC, nothing about the store told."""
    store = SqliteStore.open(tmp_path / "st")
    guard = DurableReplayGuard(store, RING)
    store.close()
    reason = _esec(guard, "alice", _signed(nonce="e" * 20))
    assert "replay check unavailable" in reason and "nonce store failed" in reason
    assert str(tmp_path) not in reason and guard.statistics().store_unavailable == 1


def test_guard_parameters_are_checked(tmp_path):
    store = SqliteStore.open(tmp_path / "st")
    for kw in ({"slack_ms": 0}, {"max_per_tenant": 0}):
        with pytest.raises(ValueError):
            DurableReplayGuard(store, RING, **kw)
