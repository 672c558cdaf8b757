"""Per-tenant resource shares (issue 19 item 8), over the wire against a real router
(``tests.conftest.start_router``) with API keys for alice, bob and an operator:

* request bodies in flight per tenant (:mod:`atp_router.flow.body_budget`): alice's
  third concurrent upload is refused 429 ``EWINDOW`` with ``Retry-After`` before
  its body is read, while bob is served;
* the response cache's byte budget per tenant: alice filling the cache does not
  evict bob's entry;
* the WebSocket pre-handshake timeout and per-peer bound;
* ``GET /v1/health`` answers any caller (liveness only without a credential);
* one tenant's share of the shared quality evidence (:class:`~atp_router.policy.learn.TenantShares`).

Each fails on the router before these shares existed.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from atp_router.policy.learn import (
    ALPHA,
    QUALITY_PRIOR_WEIGHT,
    RoutingLearner,
    TenantShares,
)
from tests.conftest import start_router
from tests.unit.test_cache import OTHER, SOURCE, TASK, _diff, _review, rib

TOKENS = "alice:tok-alice,bob:tok-bob,ops:tok-ops:admin+operator"


async def _start(nursery, tmp_path, doc: dict | None = None, **config):
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc or rib()))
    return await start_router(nursery, path, tokens_env=TOKENS, state_dir=tmp_path / "state", **config)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ------------------------------------------------------------------ health

async def test_health_answers_any_caller_with_liveness_only(nursery, tmp_path):
    env = await _start(nursery, tmp_path)
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        anon = await h.get("/v1/health")
        bad = await h.get("/v1/health", headers={"Authorization": "Bearer nope"})
        alice = await h.get("/v1/health", headers={"Authorization": "Bearer tok-alice"})
    assert anon.status_code == 200 and anon.json() == {"status": "ok"}  # nothing about tenants or internals
    assert bad.status_code == 401  # a credential, when given, is checked as everywhere
    assert alice.status_code == 200 and set(alice.json()) == {"status", "rib_version", "open_streams"}


# ------------------------------------------------------------------ bodies in flight

async def _upload(port: int, token: str, declared: int, *, send: int, hold: trio.Event | None = None,
                  path: str = "/v1/streams") -> tuple[int, dict[str, str]]:
    """POST ``declared`` bytes (Content-Length) on a raw connection, sending
    ``send`` of them, then waiting for ``hold`` (the upload stays in flight);
    returns the status and headers of the answer as soon as one arrives."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:
        await stream.send_all((f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode())
        async with trio.open_nursery() as n:

            async def sender() -> None:
                try:
                    await stream.send_all(b" " * send)
                    if hold is not None:
                        await hold.wait()
                        await stream.send_all(b" " * (declared - send))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            n.start_soon(sender)
            while b"\r\n\r\n" not in got:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                got += chunk
            n.cancel_scope.cancel()
    head = got.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    assert head and head[0].startswith("HTTP/1.1 "), got[:200]
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head[1:])}
    return int(head[0].split()[1]), headers


async def test_a_tenants_bodies_in_flight_are_bounded_before_they_are_read(nursery, tmp_path):
    mib = 1 << 20
    env = await _start(nursery, tmp_path, max_body_bytes=mib, max_ws_message_bytes=mib, tenant_body_bytes=2 * mib)
    port = _port(env.url)
    budget = env.router.body_budget
    hold = trio.Event()
    answers: list[int] = []

    async def slow(token: str) -> None:
        answers.append((await _upload(port, token, mib, send=64 * 1024, hold=hold))[0])

    async with trio.open_nursery() as n:
        n.start_soon(slow, "tok-alice")
        n.start_soon(slow, "tok-alice")
        with trio.fail_after(30):
            while budget.in_flight("alice") < 2 * mib:  # both uploads admitted, in flight
                await trio.sleep(0.01)
        # The condition: alice holds her whole budget. A third upload is refused at once,
        # its body unread (the client never sends it).
        with trio.fail_after(30):
            status, headers = await _upload(port, "tok-alice", mib, send=0)
        assert status == 429 and headers.get("retry-after") == "1", (status, headers)
        # Bob is not alice: his upload is taken (and refused only as the bad body it is).
        with trio.fail_after(30):
            bob, _ = await _upload(port, "tok-bob", 10, send=10)
        assert bob == 400
        hold.set()
    assert answers == [400, 400]  # alice's two bodies were read to the end (spaces: not JSON)
    assert budget.in_flight("alice") == 0 and budget.in_flight("bob") == 0
    # The OpenAI and A2A ingresses share the budget.
    hold = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(slow, "tok-alice")
        n.start_soon(slow, "tok-alice")
        with trio.fail_after(30):
            while budget.in_flight("alice") < 2 * mib:
                await trio.sleep(0.01)
        for path in ("/v1/chat/completions", "/a2a"):
            with trio.fail_after(30):
                status, headers = await _upload(port, "tok-alice", 1000, send=0, path=path)
            assert status == 429 and "retry-after" in headers, (path, status)
        hold.set()
    assert budget.in_flight("alice") == 0


# ------------------------------------------------------------------ the cache

async def test_a_tenant_filling_the_cache_does_not_evict_another_tenants_entry(nursery, tmp_path):
    env = await _start(nursery, tmp_path, rib(cache={"ttl_s": 3600}))
    await _review(env, "tok-bob")
    one = env.router.store.cache_stats().bytes  # one review's two entries
    # Room for three reviews in all, and for one review (plus slack) per tenant.
    env.router.cache.max_bytes = 3 * one + 200
    env.router.cache.tenant_max_bytes = one + 200
    third = {"diff": _diff("third.py", SOURCE.replace("cmd", "c3")), "files": {"third.py": SOURCE.replace("cmd", "c3")}}
    for content in (TASK, OTHER, third):
        await _review(env, "tok-alice", content=content)
    # The condition: alice stored more than her budget holds (her own entries made room).
    assert env.router.store.cache_stats().bytes <= 3 * one + 200
    again, _, _ = await _review(env, "tok-bob")
    assert again["telemetry"].get("cached") == ["lint.ruff", "sec.bandit"], "bob's entry was evicted by alice's"
    latest, _, _ = await _review(env, "tok-alice", content=third)
    assert latest["telemetry"].get("cached") == ["lint.ruff", "sec.bandit"]  # alice keeps her newest


# ------------------------------------------------------------------ WebSocket handshake

async def test_pre_handshake_websocket_sockets_are_bounded_and_closed_after_the_timeout(nursery, tmp_path):
    env = await _start(nursery, tmp_path, ws_handshake_timeout_s=1.0, ws_pending_per_peer=8)
    port = _port(env.ws_url)
    closed_after: list[float] = []

    async def idle_socket() -> None:
        t0 = trio.current_time()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            with trio.fail_after(20):  # the old router kept them 60 s
                try:
                    while await stream.receive_some(1024):
                        pass
                except trio.BrokenResourceError:
                    pass
        closed_after.append(trio.current_time() - t0)

    async with trio.open_nursery() as n:
        for _ in range(40):
            n.start_soon(idle_socket)
    closed_after.sort()
    # 32 over the peer's bound are closed at accept; the 8 others at the 1 s timeout.
    assert sum(t < 0.9 for t in closed_after) >= 30, closed_after
    assert closed_after[-1] >= 0.9, closed_after
    assert env.router.ws_handshake_gate.pending("127.0.0.1") == 0
    # A real client still connects, authenticates and stays past the timeout.
    from trio_websocket import open_websocket_url

    async with open_websocket_url(env.ws_url, extra_headers=[("Authorization", "Bearer tok-alice")],
                                  subprotocols=["atp.v1.json"]) as ws:
        await trio.sleep(1.5)
        assert not ws.closed


# ------------------------------------------------------------------ learning share

def test_one_tenant_moves_a_shared_quality_by_at_most_its_share():
    """The rule on the live statistics: bob has rated an agent at its prior; alice's
    100 tasks all scoring 1.0 then move its quality by at most her share (a half,
    with two tenants) of the distance, where without the rule they take it most
    of the way; bob's evidence still counts in full after."""
    share, prior = 0.25, 0.656
    learner = RoutingLearner(share=share)
    learner._priors["a"] = prior
    for _ in range(20):
        learner.observe_quality("a", prior, policy="p", tenant="bob")
    before = learner.live.view()["a"].quality
    for _ in range(100):
        learner.observe_quality("a", 1.0, policy="p", tenant="alice")
    after = learner.live.view()["a"].quality
    assert after > before  # the condition: alice's tasks did move it
    assert after - before <= 0.5 * (1.0 - before) + 1e-9, (before, after)
    mine, total = learner.shares.held("a", "alice")
    assert mine <= 0.5 * (QUALITY_PRIOR_WEIGHT + total) + 1e-9
    for _ in range(10):
        learner.observe_quality("a", 0.0, policy="p", tenant="bob")
    assert learner.live.view()["a"].quality < after - 0.05
    # Without the rule (share 1.0) the same traffic takes it most of the way to 1.0.
    free = RoutingLearner(share=1.0)
    free._priors["a"] = prior
    for _ in range(20):
        free.observe_quality("a", prior, policy="p", tenant="bob")
    for _ in range(100):
        free.observe_quality("a", 1.0, policy="p", tenant="alice")
    assert free.live.view()["a"].quality - before > 0.5 * (1.0 - before) + 0.03


def test_four_tenants_hold_at_most_the_share_each_and_a_lone_tenant_learns_in_full():
    """With four or more tenants on an agent the floor is ``share``; a tenant alone on
    an agent is not capped (capping it would freeze learning on a one-team router)."""
    s = TenantShares(0.25)
    seen: set[str] = set()
    for i in range(400):
        tenant = ("bob", "carol", "dave")[(i // 2) % 3] if i % 2 else "alice"  # alice sends half the traffic
        s.admit("a", tenant, 1.0)
        seen.add(tenant)
        if len(seen) < 2:
            continue
        for t in seen:
            mine, total = s.held("a", t)
            assert mine <= max(0.25, 1 / len(seen)) * (QUALITY_PRIOR_WEIGHT + total) + 1e-9, (i, t)
    assert len(seen) == 4
    assert s.held("a", "alice")[0] <= 0.25 * (QUALITY_PRIOR_WEIGHT + s.held("a", "alice")[1]) + 1e-9
    lone = TenantShares(0.25)
    assert [lone.admit("b", "alice", 1.0) for _ in range(50)] == [1.0] * 50


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_tenant_shares_hold_under_mixed_weights(share):
    s = TenantShares(share)
    total_w = 0.0
    for i in range(500):
        tenant = "alice" if i % 5 else "bob"
        eff = s.admit("a", tenant, 2.0 if i % 3 == 0 else 1.0)
        total_w = total_w * (1 - ALPHA) ** eff + eff
        if i == 0:
            continue  # alice alone so far: uncapped
        for t in ("alice", "bob"):
            mine, total = s.held("a", t)
            # Once bob holds evidence too, each tenant holds at most max(share, 1/2).
            assert mine <= max(share, 0.5) * (QUALITY_PRIOR_WEIGHT + total) + 1e-9
    assert s.held("a", "alice")[1] == pytest.approx(total_w)


# ------------------------------------------------------------------ big bodies against a router process

def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


#: Health's floor (s) beside the forty bodies. The two bodies alice's share admits
#: are still stored on the router's event loop after their upload (a known cost left
#: for a later issue): tens of ms each on a quiet machine, 651.6 ms of health at
#: load 10–13 with an idle worst of 37.4 ms (a bound of 374 ms at the factor alone).
#: 1.0 s passes that on every machine this suite runs on, and the regression this
#: test guards, health at 5.3 s while all forty were read, is over 5× it.
FORTY_BODIES_HEALTH_FLOOR_S = 1.0


async def test_forty_big_bodies_from_one_tenant_keep_the_router_small_and_bob_served(tmp_path):
    """The issue's attack on a real ``atp-router`` process: 40 concurrent ~15 MiB
    bodies from alice took its RSS from 119 to 635 MB and bob's health to 5.3 s.
    Now at most ``--tenant-body-bytes`` (32 MiB here, the default) of hers are in
    flight: the rest are refused 429 before they are read (at least 30, asserted
    on each run), the router's peak RSS grows by far less than the 40 bodies'
    600 MB, and health — polled from a process of its own, so this process's
    uploads do not delay the probe — stays within a factor of its idle latency
    measured in the same run, at least :data:`FORTY_BODIES_HEALTH_FLOOR_S`
    (``tests.security.test_limits.health_beside``: the attack runs again when
    load alone put health over). Guards the 5.3 s and the +516 MB: both fail it."""
    from tests.conftest import MECHANICS_RIB
    from tests.helpers import RouterProcess
    from tests.peers import free_port
    from tests.security.test_limits import health_beside

    router = RouterProcess("--policies", MECHANICS_RIB, "--state-dir", tmp_path / "state", "--no-watch",
                           "--http-port", free_port(), "--ws-port", free_port(),
                           env={"ATP_ROUTER_TOKENS": TOKENS})
    try:
        url = await router.wait_listening()
        text = "x = 1\n" * (13 * 2**20 // 6)  # JSON escapes each newline: ~15 MiB of body
        body = json.dumps({"task": {"task_type": "code_review"},
                           "content": {"diff": "--- a/a.py\n+++ b/a.py\n", "files": {"a.py": text}}}).encode()
        assert 14 * 2**20 < len(body) < 16 * 2**20  # under the per-body limit: only the tenant's share stops it
        rss0 = _rss_bytes(router.pid)  # before any attack: later runs are measured from here too

        async def upload(statuses: list[int]) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as own:
                r = await own.post("/v1/streams", content=body, headers={
                    "Authorization": "Bearer tok-alice", "Content-Type": "application/json"})
            statuses.append(r.status_code)

        async def watch_rss(peak: list[int], done: trio.Event) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes(router.pid))
                await trio.sleep(0.02)

        async def attack() -> None:
            statuses: list[int] = []
            peak = [rss0]
            done = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(watch_rss, peak, done)
                async with trio.open_nursery() as uploads:
                    for _ in range(40):
                        uploads.start_soon(upload, statuses)
                await trio.sleep(0.5)  # the RSS a few polls after the attack too
                done.set()
            refused = statuses.count(429)
            assert len(statuses) == 40 and refused >= 30, sorted(statuses)  # the condition: the share bound
            grown = peak[0] - rss0
            print(f"\nRSS {rss0 / 2**20:.0f} MB → peak {peak[0] / 2**20:.0f} MB; {refused}/40 refused 429")
            assert grown < 250 * 2**20, f"RSS grew {grown / 2**20:.0f} MB"

        await health_beside(url, attack, floor_s=FORTY_BODIES_HEALTH_FLOOR_S)
    finally:
        router.stop()


async def _quality_after(nursery, tmp_path, share: float) -> tuple[float, float]:
    """Bob's 4 reviews scored 0.5, then alice's 16 scored 1.0, through a router with
    credentials and ``learn_share``: lint.ruff's live quality (before alice, after)."""
    import yaml

    from tests.conftest import MECHANICS_RIB

    # Both tenants' feedback trains the shared statistics (clients.<t>.feedback: shared;
    # the default, "tenant", keeps a tenant's scores to its own routing).
    doc = yaml.safe_load((MECHANICS_RIB / "default.yaml").read_text())
    doc.setdefault("clients", {}).update({t: {"feedback": "shared"} for t in ("alice", "bob")})
    path = tmp_path / f"rib-{share}.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = await start_router(nursery, path, tokens_env=TOKENS, state_dir=tmp_path / f"state-{share}",
                             learn_share=share)
    task = {"task": {"task_type": "code_review"},
            "content": {"diff": "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = eval(input())\n",
                        "files": {"a.py": "x = eval(input())\n"}}}

    async def reviews(token: str, n: int, score: float) -> None:
        async with httpx.AsyncClient(base_url=env.url, timeout=60,
                                     headers={"Authorization": f"Bearer {token}"}) as h:
            for _ in range(n):
                sid = (await h.post("/v1/streams", json=task)).json()["stream_id"]
                async with h.stream("GET", f"/v1/streams/{sid}/events") as ev:
                    async for line in ev.aiter_lines():
                        if line.startswith(("event: FIN", "event: RST")):
                            break
                r = await h.post(f"/v1/streams/{sid}/feedback", json={"score": score})
                assert r.status_code == 200, r.text

    async def quality() -> float:
        async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": "Bearer tok-ops"}) as h:
            return (await h.get("/v1/fib")).json()["live"]["lint.ruff"]["quality"]

    await reviews("tok-bob", 4, 0.5)
    before = await quality()
    await reviews("tok-alice", 16, 1.0)
    return before, await quality()


async def test_one_tenants_feedback_moves_a_shared_score_by_at_most_its_share_over_the_wire(nursery, tmp_path):
    """The issue's finding over the wire: alice's own tasks (scored 1.0) moved an agent's
    shared quality 0.656 → 0.829 although bob had rated it lower. With two tenants on
    the agent (both trusted to train the shared statistics) she now holds at most half
    of its evidence: she moves it by at most half the way to her rating, where the same
    traffic without the rule moves it further."""
    before, capped = await _quality_after(nursery, tmp_path, 0.25)
    free_before, free = await _quality_after(nursery, tmp_path, 1.0)
    assert capped > before  # the condition: her feedback did move it
    assert capped - before <= 0.5 * (1.0 - before) + 1e-6, (before, capped)
    assert free - free_before > capped - before + 0.02, (free_before, free, before, capped)
