"""A tenant's quotas shared by several ``atp-router`` processes on one Redis (issue 22
item 3, atp_router.runtime.dataplane.quotas): three real routers (``--store redis://…``)
and a real ``redis-server`` on loopback, driven over HTTP.

Checked: a tenant whose ``max_streams`` is 4 opening 12 streams at once, round-robin
over the three routers, while the model holds every call: exactly 4 are admitted and
8 refused with the single router's answer (``EWINDOW``, HTTP 429, ``Retry-After: 1``);
once those 4 finish, 4 more are admitted (a close frees its slot everywhere). A router
killed with kill -9 holding 2 of them: its slots stay taken until its lease lapses,
then the reaper's settling frees them and 2 more are admitted. A tenant's open rate
(burst 5, then one open every 100 s) holds across the routers: 12 opens, 5 admitted.
"""

from __future__ import annotations

import pytest
import trio

from atp_router.store.redis import RedisStore
from tests.peers import RedisServer, start_redis
from tests.replay_server import BillingModel, serve
from tests.scale.common import BILLED, summarize_rib
from tests.scale.test_cluster import Cluster, _events, _open, _until

QUOTA = 4


def quota_rib(model_url: str) -> str:
    """The scale tests' RIB with bob at ``max_streams`` 4 and alice's open rate at
    burst 5, one open every 100 s."""
    head = summarize_rib(model_url).split("clients:\n")[0]
    return (head + "clients:\n"
            "  alice: {budget: {tokens: 10000000}, max_streams: 500, rate: {per_s: 0.01, burst: 5}}\n"
            f"  bob: {{budget: {{tokens: 10000000}}, max_streams: {QUOTA}, rate: {{per_s: 500, burst: 500}}}}\n")


class QuotaCluster(Cluster):
    """:class:`~tests.scale.test_cluster.Cluster` on :func:`quota_rib`."""

    def __init__(self, redis: RedisServer, directory, model: BillingModel, n: int) -> None:
        self.redis, self.dir, self.model = redis, directory, model
        self.policies = directory / "rib.yaml"
        self.policies.write_text(quota_rib(model.url))
        self.routers = [self._start(i) for i in range(n)]
        self.store = RedisStore.open(redis.url, socket_timeout_s=10.0, connect_timeout_s=10.0)  # the test's reader


@pytest.fixture
async def cluster(nursery, tmp_path):
    model = await serve(nursery, BillingModel(BILLED))
    with start_redis() as redis:
        c = QuotaCluster(redis, tmp_path, model, 3)
        try:
            async with trio.open_nursery() as starting:
                for r in c.routers:
                    starting.start_soon(r.wait_listening)
            yield c
        finally:
            if model.hold is not None:
                model.hold.set()
            c.stop()


async def _open_all(urls: list[str], tenant: str) -> list:
    """One open per URL, all at once; the responses in URL order."""
    out: list = [None] * len(urls)

    async def one(i: int) -> None:
        out[i] = await _open(urls[i], tenant)

    async with trio.open_nursery() as n:
        for i in range(len(urls)):
            n.start_soon(one, i)
    return out


def _refused_by_quota(r) -> bool:
    err = r.json()["error"]
    return (r.status_code == 429 and err["code"] == "EWINDOW" and r.headers["retry-after"] == "1"
            and err["reason"] == f"tenant 'bob' is at its limit of {QUOTA} open streams")


async def test_max_streams_holds_across_three_routers_and_a_lost_routers_slots_are_freed(cluster):
    a, b, c = cluster.routers
    model = cluster.model
    model.hold = trio.Event()
    urls = [r.url for r in cluster.routers]

    answers = await _open_all([urls[i % 3] for i in range(12)], "bob")
    admitted = [r for r in answers if r.status_code == 201]
    assert len(admitted) == QUOTA, [(r.status_code, r.text) for r in answers]
    assert all(_refused_by_quota(r) for r in answers if r.status_code != 201), [r.text for r in answers]
    await _until(lambda: model.waiting == QUOTA)
    assert cluster.store.quota_open_count("bob", now_ms=0) == QUOTA

    # The four finish: their slots are free on every router.
    model.hold.set()
    model.hold = trio.Event()
    model.waiting = 0
    for r in admitted:
        events, _ = await _events(urls[0], "bob", r.json()["stream_id"])
        assert [t for t, _ in events][-2:] == ["FINAL", "FIN"]
    assert cluster.store.quota_open_count("bob", now_ms=0) == 0

    # Four more, two of them on a; a fifth anywhere is refused.
    again = await _open_all([a.url, a.url, b.url, c.url], "bob")
    assert [r.status_code for r in again] == [201] * 4, [r.text for r in again]
    assert _refused_by_quota(await _open(c.url, "bob"))
    await _until(lambda: model.waiting == QUOTA)

    # a dies holding two: its slots stay taken until its lease lapses, then the reaper frees them.
    a.kill9()
    assert _refused_by_quota(await _open(b.url, "bob"))
    await _until(lambda: any(f"router {a.owner} lost" in line for r in (b, c) for line in r.lines), timeout=20)
    assert cluster.store.quota_open_count("bob", now_ms=0) == 2
    after = await _open_all([b.url, c.url], "bob")
    assert [r.status_code for r in after] == [201, 201], [r.text for r in after]
    assert _refused_by_quota(await _open(b.url, "bob"))
    assert cluster.store.quota_open_count("bob", now_ms=0) == QUOTA


async def test_a_tenants_open_rate_holds_across_three_routers(cluster):
    urls = [r.url for r in cluster.routers]
    answers = await _open_all([urls[i % 3] for i in range(12)], "alice")
    assert sorted(r.status_code for r in answers) == [201] * 5 + [429] * 7, [r.text for r in answers]
    for r in answers:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "EWINDOW", r.text
            assert err["reason"] == "tenant 'alice' exceeds its rate of 0.01 stream opens/s (burst 5)"
            assert 1 <= int(r.headers["retry-after"]) <= 100
