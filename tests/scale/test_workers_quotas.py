"""A tenant's ``max_streams`` shared by the workers of ``atp-router --workers 2`` (issue 22
item 3): a real supervisor and its two real workers on one state directory (their
SQLite store), driven over real sockets, the model holding every call.

Checked: two streams held on each worker make the tenant's 4; a fifth is refused on
either worker with the single router's answer (429 ``EWINDOW``), though each worker
alone holds only 2; a worker killed with kill -9 is settled by the supervisor, which
frees its 2 slots, and 2 more are admitted.
"""

from __future__ import annotations

import os
import signal

import httpx
import trio

from tests.replay_server import BillingModel, serve
from tests.scale.common import BILLED, CONTENT, TASK, auth
from tests.scale.test_cluster_quotas import QUOTA, quota_rib
from tests.scale.test_workers import Supervisor, _other_worker


async def _post(h: httpx.AsyncClient) -> httpx.Response:
    return await h.post("/v1/streams", json={"task": TASK, "content": CONTENT})


def _refused_by_quota(r: httpx.Response) -> bool:
    return (r.status_code == 429 and r.json()["error"]["code"] == "EWINDOW" and r.headers["retry-after"] == "1"
            and r.json()["error"]["reason"] == f"tenant 'bob' is at its limit of {QUOTA} open streams")


async def test_max_streams_holds_across_workers_and_a_dead_workers_slots_are_freed(nursery, tmp_path):
    model = await serve(nursery, BillingModel(BILLED))
    model.hold = trio.Event()
    policies = tmp_path / "rib" / "rib.yaml"
    policies.parent.mkdir()
    policies.write_text(quota_rib(model.url))
    sup = Supervisor(policies.parent, tmp_path / "state")
    try:
        await sup.wait_listening()
        async with _other_worker(sup.url, None, "bob") as x:
            first = [await _post(x) for _ in range(2)]
            slot_x = first[0].headers["x-atp-worker"]
            async with _other_worker(sup.url, slot_x, "bob") as y:
                second = [await _post(y) for _ in range(2)]
                assert [r.status_code for r in first + second] == [201] * 4, [r.text for r in first + second]
                assert {r.headers["x-atp-worker"] for r in second} != {slot_x}
                # Each worker holds 2 of bob's 4: a fifth is refused on either.
                assert _refused_by_quota(await _post(y))
                assert _refused_by_quota(await _post(x))
        with trio.fail_after(30):
            while model.waiting < 4:
                await trio.sleep(0.05)
        with sup.db() as db:
            victim = db.execute("SELECT owner FROM stream WHERE stream_id = ?",
                                (first[0].json()["stream_id"],)).fetchone()[0]
            assert db.execute("SELECT COUNT(*) FROM quota_stream WHERE tenant = 'bob' AND owner = ?",
                              (victim,)).fetchone()[0] == 2
        os.kill(int(victim.split(".")[1]), signal.SIGKILL)
        with trio.fail_after(60):  # the supervisor settles the dead worker: its slots are freed
            while True:
                with sup.db() as db:
                    left = db.execute("SELECT COUNT(*) FROM quota_stream WHERE owner = ?", (victim,)).fetchone()[0]
                if left == 0:
                    break
                await trio.sleep(0.1)
        async with httpx.AsyncClient(base_url=sup.url, timeout=30, headers=auth("bob")) as h:
            after = [await _post(h) for _ in range(3)]
        assert [r.status_code for r in after[:2]] == [201, 201], [r.text for r in after]
        assert _refused_by_quota(after[2])
    finally:
        model.hold.set()
        sup.stop()
