"""bench/lean_load.py, the cluster bench's load generator, against a real router
and the gateway bench's mock upstream (real processes): a task counts only when
it reached its FINAL with the mock's text, a refused task is a failure, and the
connection is kept alive across tasks (one connection for sequential tasks)."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import pytest
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_gateway as gw  # noqa: E402
from lean_load import LeanDrivers  # noqa: E402


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("lean_load")
    procs: list = []
    key = "atp-" + secrets.token_hex(32)
    try:
        started = gw.start_mock(tmp, procs)
        assert started is not None, "the mock upstream did not start"
        # The cluster bench's rate (the default tenant rate would refuse a closed loop).
        r = gw.start_router(tmp / "router", gw.RIB.format(port=started[0]), procs, key=key, timeout_s=90,
                            args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"])
        assert r is not None, "the router did not start"
        yield r.url, key
    finally:
        gw.stop_procs(procs, 20)


def test_tasks_complete_on_one_kept_alive_connection(router) -> None:
    url, key = router

    async def run() -> tuple[list[bool], int]:
        async with LeanDrivers({"atp_http": url}, {"atp_http": key}) as d:
            got = [await d.run("atp_http") for _ in range(5)]
            return got, len(d.idle)

    got, idle = trio.run(run)
    assert got == [True] * 5
    assert idle == 1


def test_concurrent_tasks_each_complete(router) -> None:
    url, key = router

    async def run() -> dict:
        async with LeanDrivers({"atp_http": url}, {"atp_http": key}) as d:
            return await gw.closed_loop(d, "atp_http", 8, 1.0)

    res = trio.run(run)
    assert res["failed"] == 0, res["errors"]
    assert res["tasks"] >= 8


def test_a_refused_task_is_a_failure(router) -> None:
    url, _ = router

    async def run() -> bool:
        async with LeanDrivers({"atp_http": url}, {"atp_http": "atp-" + "0" * 64}) as d:
            return await d.run("atp_http")

    assert trio.run(run) is False
