"""``GET /v1/ready`` of one router on its embedded store under a full disk (issue 22
item 4), on a real ``atp-router`` process: readiness fails (503, ``Retry-After``, the
store named) while liveness (``/v1/health``) stays 200, it comes back by itself when
space returns, and the audit records of what was refused meanwhile are in the chain,
in order, which ``atp-router audit verify`` accepts.

The state directory is on a small tmpfs of its own filled to the last byte
(:func:`tests.security.test_store_faults.tmpfs`; skipped where mounting is not allowed).
"""

from __future__ import annotations

import json
import sys

import httpx
import trio

from tests import helpers
from tests.replay_server import BillingModel, serve
from tests.security.test_store_faults import _fill, _rib, tmpfs

BOB, OPS = "tok-bob-0123456789", "tok-ops-0123456789"
ENV = {"ATP_ROUTER_TOKENS": f"bob:{BOB},ops:{OPS}:admin+operator"}
#: Actions a client may not take: each refusal is an audited ``esec`` record naming the action.
FORBIDDEN = [("/v1/policies", "policy_read"), ("/v1/routes", "routes_read"), ("/v1/audit", "audit_read")]


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _until(h: httpx.AsyncClient, status: int, timeout: float = 30) -> httpx.Response:
    """``GET /v1/ready`` (as the operator) until it answers ``status``."""
    with trio.fail_after(timeout):
        while (r := await h.get("/v1/ready", headers=_auth(OPS))).status_code != status:
            await trio.sleep(0.2)
    return r


async def test_a_full_disk_makes_the_router_not_ready_until_space_returns(nursery, tmp_path):
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_rib(model.url))
    with tmpfs(tmp_path / "fs", "16m") as fs:
        state = fs / "state"
        router = helpers.RouterProcess("--policies", policies, "--state-dir", state, "--http-port", "0",
                                       "--ws-port", "0", "--no-watch", env=ENV)
        try:
            url = await router.wait_listening()
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                r = await h.get("/v1/ready", headers=_auth(OPS))
                assert r.status_code == 200, r.text
                assert r.json()["status"] == "ready"
                assert {c["name"]: c["ok"] for c in r.json()["checks"]} == {
                    "store": True, "rib": True, "state_dir": True, "audit": True, "drain": True}
                anon = await h.get("/v1/ready")  # a load balancer's probe: the verdict, no reasons
                assert anon.status_code == 200 and all("reason" not in c for c in anon.json()["checks"])

                filler = _fill(fs)
                r = await _until(h, 503)
                assert int(r.headers["Retry-After"]) >= 1
                body = r.json()
                assert body["status"] == "not_ready"
                store = next(c for c in body["checks"] if c["name"] == "store")
                assert not store["ok"]
                assert store["reason"].startswith(f"state store full: {state / 'state.db'}: no space left"), store
                assert "store" in [c["name"] for c in (await h.get("/v1/ready")).json()["checks"] if not c["ok"]]
                assert (await h.get("/v1/health")).status_code == 200  # liveness: the process answers
                assert (await h.get("/v1/health", headers=_auth(OPS))).status_code == 200
                for path, _ in FORBIDDEN:  # audited while the disk is full
                    assert (await h.get(path, headers=_auth(BOB))).status_code == 403

                filler.unlink()
                r = await _until(h, 200)  # by itself
                assert r.json()["status"] == "ready"
        finally:
            assert router.stop() == 0
        out = "".join(router.lines)
        assert "Traceback" not in out, out[-4000:]

        verify = await trio.run_process([sys.executable, "-m", "atp_router.deploy.cli", "audit", "verify",
                                         "--state-dir", str(state)], capture_stdout=True, capture_stderr=True,
                                        check=False)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        show = await trio.run_process([sys.executable, "-m", "atp_router.deploy.cli", "audit", "show", "--json",
                                       "--state-dir", str(state)], capture_stdout=True)
        records = [json.loads(line) for line in show.stdout.decode().splitlines()]
        refused = [r["detail"].get("action") for r in records if r["kind"] == "esec"]
        assert refused, records
        assert refused == [action for _, action in FORBIDDEN]


async def _every_worker(url: str, status: int, workers: int = 2, timeout: float = 60) -> dict[str, dict]:
    """``GET /v1/ready`` on fresh connections (the kernel picks the worker) until
    each of ``workers`` workers has answered ``status``: their bodies by worker."""
    seen: dict[str, dict] = {}
    with trio.fail_after(timeout):
        while len(seen) < workers:
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                r = await h.get("/v1/ready", headers=_auth(OPS))
            if r.status_code == status:
                seen[r.headers["x-atp-worker"]] = r.json()
            else:
                seen.pop(r.headers["x-atp-worker"], None)
                await trio.sleep(0.1)
    return seen


async def test_with_workers_every_worker_answers_for_the_shared_store(nursery, tmp_path):
    model = await serve(nursery, BillingModel(1_000))
    policies = tmp_path / "rib.yaml"
    policies.write_text(_rib(model.url))
    with tmpfs(tmp_path / "fs", "16m") as fs:
        state = fs / "state"
        sup = helpers.RouterProcess("--workers", "2", "--policies", policies, "--state-dir", state, "--http-port",
                                    "0", "--ws-port", "0", "--no-watch", env=ENV)
        try:
            url = await sup.wait_listening()
            await _every_worker(url, 200)
            filler = _fill(fs)
            for body in (await _every_worker(url, 503)).values():
                store = next(c for c in body["checks"] if c["name"] == "store")
                assert store["reason"].startswith(f"state store full: {state / 'state.db'}"), body
            filler.unlink()
            await _every_worker(url, 200)
        finally:
            assert sup.stop() == 0
