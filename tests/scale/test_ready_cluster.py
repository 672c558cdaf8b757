"""``GET /v1/ready`` and the audit spool of routers on a shared Redis (issue 22 item
4), on real ``atp-router`` and ``redis-server`` processes:

* Redis stopped (SIGSTOP: calls time out, and Redis runs them when it resumes) and
  then killed and restarted: readiness answers 503 naming the store while
  liveness stays 200; the audit records of the actions refused meanwhile are
  spooled and chained, in order and each once, when Redis answers again, and
  ``atp-router audit verify --store …`` accepts the chain;
* a spool bounded to 3 records with Redis down: the records past it are dropped,
  counted in ``atp_audit_dropped_total``, and said in one log line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx
import trio

from tests.helpers import RouterProcess, router_metric
from tests.peers import RedisServer, start_redis
from tests.replay_server import BillingModel, serve
from tests.scale.common import TOKENS, auth, summarize_rib

LEASE_MS = 3_000
AUDIT_KEY = "cluster-test-audit-key-0123456789"
_ENV = {"ATP_ROUTER_TOKENS": ",".join([f"bob:{TOKENS['bob']}", f"ops:{TOKENS['ops']}:admin+operator"]),
        "ATP_AUDIT_KEY": AUDIT_KEY}
_CLI = [sys.executable, "-m", "atp_router.deploy.cli"]


def _router(redis: RedisServer, policies: Path, state: Path, *extra: str) -> RouterProcess:
    return RouterProcess("--store", redis.url, "--policies", policies, "--state-dir", state, "--http-port", "0",
                         "--ws-port", "0", "--no-watch", "--lease-ms", str(LEASE_MS), *extra, env=_ENV)


async def _ready_until(h: httpx.AsyncClient, status: int, timeout: float = 30) -> httpx.Response:
    with trio.fail_after(timeout):
        while (r := await h.get("/v1/ready", headers=auth("ops"))).status_code != status:
            await trio.sleep(0.2)
    return r


async def _refuse(h: httpx.AsyncClient, paths: list[str]) -> None:
    """bob (a client) asks for admin-only paths: each refusal (403) is an audited ``esec`` record."""
    for path in paths:
        assert (await h.get(path, headers=auth("bob"))).status_code == 403


def _failing(r: httpx.Response) -> dict[str, str]:
    return {c["name"]: c.get("reason", "") for c in r.json()["checks"] if not c["ok"]}


async def _audit(redis: RedisServer, state: Path, cmd: str, *args: str) -> trio.CompletedProcess[bytes]:
    return await trio.run_process([*_CLI, "audit", cmd, "--state-dir", str(state), "--store", redis.url, *args],
                                  capture_stdout=True, capture_stderr=True, check=False,
                                  env={**os.environ, "ATP_AUDIT_KEY": AUDIT_KEY})


async def _refused_actions(redis: RedisServer, state: Path) -> list[str]:
    show = await _audit(redis, state, "show", "--json")
    assert show.returncode == 0, show.stderr
    records = [json.loads(line) for line in show.stdout.decode().splitlines()]
    return [r["detail"]["action"] for r in records if r["kind"] == "esec"]


async def test_redis_stopped_or_killed_makes_routers_not_ready_and_no_audit_record_is_lost(nursery, tmp_path):
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(summarize_rib(model.url))
    with start_redis() as redis:
        routers = [_router(redis, policies, tmp_path / f"s{i}") for i in range(2)]
        try:
            urls = [await r.wait_listening() for r in routers]
            async with httpx.AsyncClient(base_url=urls[0], timeout=30) as h, \
                    httpx.AsyncClient(base_url=urls[1], timeout=30) as h2:
                for c in (h, h2):
                    assert (await c.get("/v1/ready", headers=auth("ops"))).status_code == 200
                assert redis.proc is not None
                # Redis stopped: calls time out (and run when it resumes).
                os.kill(redis.proc.pid, signal.SIGSTOP)
                try:
                    r = await _ready_until(h, 503)
                    assert int(r.headers["Retry-After"]) >= 1
                    assert "cannot be reached" in _failing(r)["store"], r.json()
                    assert (await h.get("/v1/health")).status_code == 200
                    await _refuse(h, ["/v1/policies", "/v1/routes"])
                    r = await _ready_until(h2, 503)
                    assert "store" in _failing(r)
                finally:
                    os.kill(redis.proc.pid, signal.SIGCONT)
                await _ready_until(h, 200)
                await _ready_until(h2, 200)
                # Redis killed, then restarted on its data: connections refused meanwhile.
                redis.kill()
                r = await _ready_until(h, 503)
                assert "store" in _failing(r)
                assert (await h.get("/v1/health")).status_code == 200
                await _refuse(h, ["/v1/audit", "/v1/metrics"])
                r = await h.get("/v1/ready", headers=auth("ops"))
                assert "audit" in _failing(r), r.json()  # the records wait in the spool
                redis.start()
                await _ready_until(h, 200)
                await _ready_until(h2, 200)
        finally:
            for router in routers:
                router.stop()
        for router in routers:
            assert "Traceback" not in "".join(router.lines), "".join(router.lines)[-4000:]
        verify = await _audit(redis, tmp_path / "s0", "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert await _refused_actions(redis, tmp_path / "s0") == [
            "policy_read", "routes_read", "audit_read", "metrics_read"]


async def test_a_full_audit_spool_counts_and_logs_what_it_drops(nursery, tmp_path):
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(summarize_rib(model.url))
    with start_redis() as redis:
        router = _router(redis, policies, tmp_path / "s0", "--audit-spool-records", "3")
        try:
            url = await router.wait_listening()
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                assert (await router_metric(url, "atp_audit_dropped_total", TOKENS["ops"])) == {"": 0.0}
                redis.kill()
                await _ready_until(h, 503)
                await _refuse(h, ["/v1/policies", "/v1/routes", "/v1/audit", "/v1/fib", "/v1/metrics"])
                assert (await router_metric(url, "atp_audit_dropped_total", TOKENS["ops"])) == {"": 2.0}
                assert (await router_metric(url, "atp_audit_spooled", TOKENS["ops"])) == {"": 3.0}
                r = await h.get("/v1/ready", headers=auth("ops"))
                assert _failing(r)["audit"] == ("3 audit records wait for the store (spool bound 3); 2 dropped since "
                                                "start (the spool was full)"), r.json()
                redis.start()
                await _ready_until(h, 200)
        finally:
            router.stop()
        full = [line for line in router.lines if "audit spool full" in line]
        assert len(full) == 1, "".join(router.lines)[-4000:]
        assert "DROPPED" in full[0] and "atp_audit_dropped_total" in full[0]
        verify = await _audit(redis, tmp_path / "s0", "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert await _refused_actions(redis, tmp_path / "s0") == ["policy_read", "routes_read", "audit_read"]
