"""Issue 22's chaos test with exact accounting: money charged exactly once across
routers through every fault a shared store meets, on real processes — three
``atp-router --store redis://…`` routers and a fourth carrying the kill-after-commit
fault hook (``ATP_FAULT_KILL_AFTER_COMMIT``), a real ``redis-server`` (append-only
file fsynced at every write) and an upstream that logs every call it receives
(:class:`~tests.replay_server.BillingModel`: an OpenAI-compatible model billing
:data:`BILLED` tokens a call, about ten times the adapter's estimate).

**Client.** Every stream carries an ``idempotency_key`` and the key in its text (so
the upstream's log says which key each call was for). It is opened on a router,
followed (SSE) to its end, and — like a client of a fleet — re-opened by its key on
the next router when its router cannot be reached or its stream ends in the RST of
a lost router; a 503 is retried after its ``Retry-After``.

**Faults**, one batch of :data:`BATCH` streams each, every batch's calls held in the
upstream until all arrived, then answered:

1. the fourth router is killed (SIGKILL, by its own fault hook) right after its first
   commit reached Redis, before that stream's FINAL is stored; its other streams'
   answers arrive at a dead router;
2. Redis is stopped (SIGSTOP) while the answers come, for longer than the routers'
   store call timeout (2 s) and the lease: commits time out on the routers and reach
   Redis late (refused there by their deadline, then made again);
3. Redis is killed (SIGKILL) while the answers come and restarted on its
   append-only file.

**Checked afterwards**, for every key: its last stream ends in a FINAL whose signed
usage is exactly what the upstream billed its call (:data:`BILLED`), whatever ran
twice (or, for at most a few keys whose reserve found the store unreachable on a
loaded machine, in ``EBUDGET`` "store unavailable … retry" with no call made); the upstream saw each key at most twice (a re-run after its router was lost
before its commit) and the key charged by the killed router's commit was not called
again (its paid answer replayed); for the tenant, the ledger in Redis committed
exactly the sum of the FINALs' signed usage — no key charged twice, no charge lost —
and nothing stays reserved once the routers' budget leases (issue 22 item 2) went idle
and were returned (the killed router's released when it was settled).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import trio

from atp_router.deploy.cluster import KILL_AFTER_COMMIT_ENV
from atp_router.store.redis import RedisStore
from tests.peers import RedisServer, start_redis
from tests.replay_server import BillingModel, serve
from tests.scale.common import BILLED, TASK, TOKENS, summarize_rib
from tests.scale.test_cluster import LEASE_MS, Cluster

#: Streams a fault's batch opens (spread over the routers).
BATCH = 16
#: The routers' store call timeout: short, so that a SIGSTOP of Redis times calls out.
STORE_QUERY = "?socket_timeout=2&socket_connect_timeout=2"
#: How long Redis stays stopped (SIGSTOP): past the call timeout, the calls' deadline
#: (twice the timeout: what Redis runs later is refused) and the lease.
STOPPED_S = 6.0
#: The RST reason of a stream whose router was lost (atp_router.deploy.cluster.ROUTER_LOST).
LOST = "the router running the stream was lost"
_KEY = re.compile(r"key=([\w-]+)")
_EVENT = re.compile(rb"event: (\w+)\ndata: (.*)\n")


@dataclass
class Outcome:
    """One key: its runs (stream ids), how the last ended, its FINAL's charge."""

    key: str
    runs: list[str] = field(default_factory=list)
    end: str = ""
    reason: str = ""
    tokens: int = 0
    replayed: bool = False


class Client:
    """The fleet's client (module docstring): one connection pool per router."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        headers = {"Authorization": f"Bearer {TOKENS['bob']}"}
        self.http = [httpx.AsyncClient(base_url=u, headers=headers, timeout=120) for u in urls]
        self.outcomes: dict[str, Outcome] = {}
        self.refused: Counter[str] = Counter()

    async def aclose(self) -> None:
        for h in self.http:
            await h.aclose()

    async def run(self, key: str, r: int) -> None:
        out = self.outcomes[key] = Outcome(key)
        body = {"task": TASK, "content": {"text": f"summarise this (key={key})"}, "idempotency_key": key}
        while True:
            h = self.http[r]
            try:
                resp = await h.post("/v1/streams", json=body)
                if resp.status_code == 503:
                    self.refused[resp.json()["error"]["code"]] += 1
                    await trio.sleep(float(resp.headers["retry-after"]))
                    continue
                assert resp.status_code == 201, resp.text
                sid = resp.json()["stream_id"]
                if not out.runs or out.runs[-1] != sid:
                    out.runs.append(sid)
                async with h.stream("GET", f"/v1/streams/{sid}/events") as ev:
                    if ev.status_code == 503:
                        await trio.sleep(float(ev.headers["retry-after"]))
                        continue
                    assert ev.status_code == 200, await ev.aread()
                    data = await ev.aread()
            except httpx.TransportError:
                r = (r + 1) % len(self.urls)  # its router is gone: the next one
                await trio.sleep(0.2)
                continue
            events = [(m[1].decode(), json.loads(m[2])) for m in _EVENT.finditer(data)]
            assert events and events[-1][0] in ("FIN", "RST"), (key, [t for t, _ in events])
            if events[-1][0] == "RST" and LOST in json.dumps(events[-1][1]):
                r = (r + 1) % len(self.urls)  # interrupted with its router: re-run by key elsewhere
                continue
            finals = [f for t, f in events if t == "FINAL"]
            if finals:
                out.end = "FINAL"
                out.tokens = finals[-1]["payload"]["content"]["telemetry"]["usage"]["summary"]["tokens"]
            else:
                last = next((f["payload"]["content"] for t, f in reversed(events) if t in ("ERROR", "RST")), {})
                out.end, out.reason = last.get("code", events[-1][0]), str(last.get("reason", ""))
            out.replayed = any(t == "PARTIAL" and f["payload"]["content"].get("replayed") for t, f in events)
            return


class ChaosCluster(Cluster):
    """Three routers and the fault-hooked fourth (module docstring), their store
    calls timing out after 1 s (:data:`STORE_QUERY`)."""

    def __init__(self, redis: RedisServer, directory, model: BillingModel) -> None:
        self.redis, self.dir, self.model = redis, directory, model
        self.policies = directory / "rib.yaml"
        self.policies.write_text(summarize_rib(model.url))
        url = redis.url + STORE_QUERY
        self.routers = [self._start(i, url) for i in range(3)] + [
            self._start(3, url, env={KILL_AFTER_COMMIT_ENV: "1"})]
        self.store = RedisStore.open(redis.url, socket_timeout_s=10.0, connect_timeout_s=10.0)  # the test's reader


@pytest.fixture
async def chaos(nursery, tmp_path):
    model = await serve(nursery, BillingModel(BILLED))
    with start_redis() as redis:
        c = ChaosCluster(redis, tmp_path, model)
        try:
            async with trio.open_nursery() as starting:
                for r in c.routers:
                    starting.start_soon(r.wait_listening)
            yield c
        finally:
            if model.hold is not None:
                model.hold.set()
            c.stop()


async def _batch(cluster: Cluster, client: Client, tag: str, routers: list[int], fault) -> None:
    """:data:`BATCH` keyed streams on ``routers`` (round-robin), their calls held in
    the upstream until all arrived; then ``fault()`` and the answers, and every
    stream followed to its end."""
    model = cluster.model
    model.hold = trio.Event()
    model.waiting = 0
    async with trio.open_nursery() as n:
        for i in range(BATCH):
            n.start_soon(client.run, f"{tag}-{i}", routers[i % len(routers)])
        with trio.fail_after(60):
            while model.waiting < BATCH:
                await trio.sleep(0.05)
        await fault(model.hold)
    model.hold = None


async def test_every_key_is_charged_exactly_once_through_kill9_sigstop_and_a_redis_restart(chaos):
    cluster = chaos
    k = cluster.routers[3]
    client = Client([r.url for r in cluster.routers])
    killed_key: list[str] = []

    async def kill_after_commit(hold: trio.Event) -> None:
        hold.set()
        await _until(lambda: k.proc.poll() is not None, 60)
        assert k.proc.returncode == -signal.SIGKILL, k.lines[-20:]
        assert any("killing this router right after a commit" in line for line in k.lines)

    async def stop_redis(hold: trio.Event) -> None:
        os.kill(cluster.redis.proc.pid, signal.SIGSTOP)
        try:
            hold.set()  # the answers come while Redis is stopped: the commits time out
            await trio.sleep(STOPPED_S)
        finally:
            os.kill(cluster.redis.proc.pid, signal.SIGCONT)

    async def restart_redis(hold: trio.Event) -> None:
        cluster.redis.kill()
        hold.set()
        await trio.sleep(2 * LEASE_MS / 1000)
        await trio.to_thread.run_sync(cluster.redis.start)

    try:
        with trio.fail_after(300):
            # k (index 3) takes a quarter of the first batch; the client moves its streams on.
            await _batch(cluster, client, "kill", [0, 1, 2, 3], kill_after_commit)
            killed_key[:] = [o.key for o in client.outcomes.values() if o.replayed]
            await _batch(cluster, client, "stop", [0, 1, 2], stop_redis)
            await _batch(cluster, client, "restart", [0, 1, 2], restart_redis)
    finally:
        await client.aclose()

    outcomes = client.outcomes
    assert len(outcomes) == 3 * BATCH
    calls = Counter(_KEY.search(json.dumps(body))[1] for _, body in cluster.model.requests)
    finals = {key for key, o in outcomes.items() if o.end == "FINAL"}
    # A stream whose reserve found the store unreachable (a loaded machine's fsync stall
    # past the 2 s timeout, outside the faults) ends EBUDGET "retry" with no call made.
    others = {key: (o.end, o.reason) for key, o in outcomes.items() if key not in finals}
    assert all(end == "EBUDGET" and "store unavailable" in why and not calls[key]
               for key, (end, why) in others.items()), others
    assert len(finals) >= 3 * BATCH - 4, others
    # Each key's FINAL reports exactly what the upstream billed its one charged call.
    assert {key: outcomes[key].tokens for key in finals} == {key: BILLED for key in finals}
    assert set(calls) == finals and max(calls.values()) <= 2, calls
    # The key k charged before it died: its paid answer was replayed, the upstream not called again.
    assert len(killed_key) == 1 and calls[killed_key[0]] == 1, (killed_key, calls)
    # The ledger: exactly the FINALs (nothing charged twice, nothing lost); reserved only the
    # live routers' budget leases (the killed router's released when it was settled), then,
    # once they went back idle, nothing.
    await cluster.settled("bob", BILLED * len(finals))


async def _until(check, timeout: float):
    with trio.fail_after(timeout):
        while not (out := check()):
            await trio.sleep(0.1)
        return out
