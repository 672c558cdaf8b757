"""Routing that learns, end to end on a real router (spec §6.2, §18): the bandit
chooses next-hops and learns from client feedback and consensus, the learned
state survives a restart on the same state directory, live metrics overwrite
the RIB's priors, feedback is the stream tenant's only, and a shadow
challenger runs on its own budget without touching the client's result.

The next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` tools (RIB
``tool: scripted``): the test needs agents whose answers it chooses, which no
real analyser gives on demand.
"""

from __future__ import annotations

import atp
import httpx
import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, Severity, Usage
from tests.helpers import golden, start_router_on
from tests.unit.test_router_dispatch import scripted_agent

META = {"task_type": "code_review", "languages": ["py"]}
TOKENS = "alice:tok-alice-0000,bob:tok-bob-0000,ops:tok-ops-0000:admin+operator"


def _finding(line: int) -> AgentFinding:
    return AgentFinding(file="thefuck/utils.py", start=line, end=line, severity=Severity.HIGH,
                        claim=f"finding at {line}", confidence=0.9)


def _bandit_rib(feedback: str = "shared", **bandit) -> dict:
    """Two arms; the anonymous client's feedback is ``feedback``-scoped."""
    return {
        "agents": {"good": {**scripted_agent(), "win30d": 0.5}, "bad": {**scripted_agent(), "win30d": 0.5}},
        "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": ["good", "bad"],
                      "fanout_k": 1, "bandit": {"explore": 0.5, "text_features": False, **bandit}}],
        "clients": {"anonymous": {"feedback": feedback}},
    }


@pytest.fixture
def two_reviewers(scripted):
    scripted["good"] = ScriptedAdapter.returning("good", [_finding(183)])
    scripted["bad"] = ScriptedAdapter.returning("bad", [_finding(7)])
    return scripted


async def _train(c: atp.Client, n: int) -> list[str]:
    """``n`` streams scored by the client: 1 for ``good``, 0 for ``bad``."""
    chosen = []
    for _ in range(n):
        _, st = await c.open_stream(task=META, content=golden())
        await c.result(st)
        agent = st.route["next_hops"][0]
        chosen.append(agent)
        out = await c.feedback(st, 1.0 if agent == "good" else 0.0, labels=["test"])
        assert out["agents"] == [agent] and out["bandit"] is True and out["scope"] in ("tenant", "shared")
    return chosen


async def test_the_bandit_learns_from_feedback_and_keeps_it_across_a_restart(nursery, tmp_path, two_reviewers):
    state = tmp_path / "state"
    async with trio.open_nursery() as first:
        env = await start_router_on(first, tmp_path, _bandit_rib(), state_dir=state, seed=1)
        async with atp.Client(env.url) as c:
            chosen = await _train(c, 40)
            fib = await c.fib()
        first.cancel_scope.cancel()
    assert chosen[-15:].count("good") >= 12, chosen
    arms = fib["bandits"]["review"]["arms"]
    assert arms["good"]["mean"] > 0.7 and arms["bad"]["mean"] < 0.3
    # Each stream: one consensus observation and the client's feedback (weight 2).
    assert arms["good"]["count"] + arms["bad"]["count"] == pytest.approx(3 * 40)
    assert fib["live"]["review|good"]["quality"] > fib["live"]["review|bad"]["quality"]
    assert fib["live"]["good"]["calls"] > 0

    # Same state directory: the learned arms come back, and route as learned.
    env = await start_router_on(nursery, tmp_path, _bandit_rib(), state_dir=state, seed=2)
    async with atp.Client(env.url) as c:
        again = await c.fib()
        assert again["bandits"]["review"]["arms"]["good"]["count"] == pytest.approx(arms["good"]["count"])
        picks = []
        for _ in range(10):
            _, st = await c.open_stream(task=META, content=golden())
            await c.result(st)
            picks.append(st.route["next_hops"][0])
    assert picks.count("good") >= 8, picks


async def test_a_changed_arm_starts_over_and_an_unchanged_one_keeps_its_state(nursery, tmp_path, two_reviewers):
    env = await start_router_on(nursery, tmp_path, _bandit_rib(), seed=3)
    async with atp.Client(env.url) as c:
        await _train(c, 12)
        before = (await c.fib())["bandits"]["review"]["arms"]
        rib = _bandit_rib()
        rib["agents"]["bad"]["tool"] = "ruff"  # a different next-hop under the same name
        import json
        await c.reload_policies(json.dumps(rib))
        after = (await c.fib())["bandits"]["review"]["arms"]
    assert after["good"]["count"] == before["good"]["count"] > 0
    assert after["bad"]["count"] == 0 and after["bad"]["mean"] == pytest.approx(0.5, abs=1e-3)


async def test_feedback_is_the_stream_tenants_once_and_after_final(nursery, tmp_path, scripted):
    scripted["slow"] = ScriptedAdapter.returning("slow", [_finding(183)], delay_s=0.5)
    rib = {"agents": {"slow": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["slow"]}]}
    env = await start_router_on(nursery, tmp_path, rib, tokens_env=TOKENS)
    async with atp.Client(env.url, "tok-alice-0000") as alice, atp.Client(env.url, "tok-bob-0000") as bob:
        _, st = await alice.open_stream(task=META, content=golden())
        with pytest.raises(atp.ATPClientError) as e:
            await alice.feedback(st, 1.0)
        assert e.value.status == 409 and "still running" in e.value.reason
        await alice.result(st)
        with pytest.raises(atp.ATPClientError) as e:
            await bob.feedback(st, 0.0)  # bob cannot score alice's stream, nor learn it exists
        assert e.value.status == 404
        async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": "Bearer tok-alice-0000"}) as h:
            for bad in ({"score": 1.5}, {"score": "x"}, {"score": 1, "labels": ["a"] * 17}, {"score": 1, "x": 1}):
                r = await h.post(f"/v1/streams/{st.stream_id}/feedback", json=bad)
                assert r.status_code == 400 and r.json()["error"]["code"] == "EPROTO", r.text
            r = await h.get("/v1/fib")
            assert r.status_code == 403
        out = await alice.feedback(st, 0.25, labels=["false_positive"])
        assert out == {"stream_id": st.stream_id, "agents": ["slow"], "score": 0.25, "labels": ["false_positive"],
                       "bandit": False, "scope": "tenant"}
        with pytest.raises(atp.ATPClientError) as e:
            await alice.feedback(st, 1.0)
        assert e.value.status == 409 and "already" in e.value.reason
    live = env.router.learning.learner.live.view()["p|slow"]
    # Alice's feedback is hers (clients.alice.feedback defaults to "tenant"): only the
    # router's own consensus verdict moved the shared live quality.
    assert live.quality_obs == pytest.approx(1.0)
    with trio.move_on_after(5):  # audit records are written behind, in the next group commit
        while "feedback" not in (kinds := [r.kind for r in env.router.store.audit_records()]):
            await trio.sleep(0.02)
    assert "feedback" in kinds


async def test_live_quality_overwrites_the_rib_prior(nursery, tmp_path, two_reviewers):
    """No bandit: the FIB's score uses the live win rate. ``bad`` starts ahead
    on its RIB ``win30d``; after clients score it down, ``good`` leads."""
    rib = {"agents": {"good": {**scripted_agent(), "win30d": 0.6}, "bad": {**scripted_agent(), "win30d": 0.8}},
           "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": ["good", "bad"],
                         "fanout_k": 1}],
           "clients": {"anonymous": {"feedback": "shared"}}}  # a trusted QA client
    env = await start_router_on(nursery, tmp_path, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        assert st.route["next_hops"] == ["bad"]
        await c.result(st)
        await c.feedback(st, 0.0)
        for _ in range(4):
            _, st = await c.open_stream(task=META, content=golden())
            await c.result(st)
            if st.route["next_hops"] == ["good"]:
                break
            await c.feedback(st, 0.0)
        assert st.route["next_hops"] == ["good"]
        live = (await c.fib())["live"]
    # The consensus tie-break (§7.2) ranks by the same live win rates.
    rates = env.router.learning.win_rates(env.router.gen.fib.lookup(META))
    assert rates["bad"] < 0.6  # below its RIB win30d of 0.8
    assert live["bad"]["quality"] < 0.6 and live["bad"]["p95_ms"] is None or live["bad"]["calls"] >= 1


async def test_shadow_runs_on_its_own_budget_and_never_touches_the_client(nursery, tmp_path, scripted):
    scripted["cheap"] = ScriptedAdapter.returning("cheap", [_finding(183)], usage=Usage(in_tokens=10))
    scripted["challenger"] = ScriptedAdapter.returning("challenger", [_finding(183), _finding(400)],
                                                       usage=Usage(in_tokens=60))
    rib = {"agents": {"cheap": scripted_agent(), "challenger": scripted_agent()},
           "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": ["cheap"],
                         "shadow": {"agent": "challenger", "rate": 1.0, "budget": {"tokens": 100}}}]}
    env = await start_router_on(nursery, tmp_path, rib)
    async with atp.Client(env.url) as c:
        for _ in range(4):
            _, st = await c.open_stream(task=META, content=golden(), budget={"tokens": 50})
            final = await c.result(st)
            assert {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]} == {"cheap"}
            assert final["telemetry"]["tokens"] == 10
        with trio.fail_after(5):
            while len(scripted["challenger"].calls) < 2:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        metrics = await c.metrics()
    # 60 tokens a run against a 100-token shadow budget: the third run finds it spent.
    assert len(scripted["challenger"].calls) == 2
    assert 'atp_shadow_runs_total{agent="challenger",outcome="budget",policy="review"}' in metrics
    assert "atp_shadow_regret_bucket" in metrics
    assert env.router.ledger.state("client:anonymous").committed_tokens == 40


async def test_champion_challenger_learns_when_escalating_pays(nursery, tmp_path, scripted):
    """The escalation bandit ("cheap only" vs "cheap then escalate"): no policy
    trigger can fire (threshold 0), so every escalation is the bandit's; with a
    spend target of 30 % it escalates about that often, and learns that the
    escalated answers (the target confirms what the cheap one found and adds
    one) beat the cheap one alone."""
    scripted["cheap"] = ScriptedAdapter.returning("cheap", [_finding(183)])
    scripted["dear"] = ScriptedAdapter.returning("dear", [_finding(183), _finding(400)])
    rib = {"agents": {"cheap": scripted_agent(), "dear": {**scripted_agent(), "win30d": 0.5}},
           "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": ["cheap"],
                         "escalation": {"on": ["low_conf"], "to": "dear", "threshold": 0.0},
                         "bandit": {"explore": 0.5, "target_cost": 0.3, "text_features": False}}]}
    env = await start_router_on(nursery, tmp_path, rib, seed=5)
    async with atp.Client(env.url) as c:
        for _ in range(40):
            _, st = await c.open_stream(task=META, content=golden())
            final = await c.result(st)
            assert final["result"]["findings"]
        fib = await c.fib()
        metrics = await c.metrics()
    dear_calls = len(scripted["dear"].calls)
    assert 4 <= dear_calls <= 30, dear_calls  # λ rises by dual ascent: not all at once
    esc = fib["bandits"]["review#escalation"]
    assert esc["choices"] == 40 and esc["arms"]["escalate"]["count"] == dear_calls
    # Every task shows the cheap arm (escalated ones score it against the target's verdict).
    assert esc["arms"]["cheap"]["count"] == 40
    assert esc["arms"]["escalate"]["mean"] > esc["arms"]["cheap"]["mean"]
    assert 'atp_escalations_total{trigger="bandit"}' in metrics


async def test_one_tenants_feedback_never_steers_another_tenants_routing(nursery, tmp_path, two_reviewers):
    """Mallory scores ``good`` 0 and ``bad`` 1 on every stream; her feedback is
    tenant-scoped (the default), so only her own routing learns it: Alice's
    choices, learned from her (trusted, shared) feedback, stay on ``good``."""
    rib = _bandit_rib()
    rib["clients"] = {"alice": {"feedback": "shared"}, "mallory": {}}
    env = await start_router_on(nursery, tmp_path, rib, seed=11, tokens_env="alice:tok-alice-0000,mallory:tok-mal-0000")
    async with atp.Client(env.url, "tok-alice-0000") as alice, atp.Client(env.url, "tok-mal-0000") as mallory:
        await _train(alice, 20)
        picks = []
        for _ in range(30):
            _, st = await mallory.open_stream(task=META, content=golden())
            await mallory.result(st)
            agent = st.route["next_hops"][0]
            picks.append(agent)
            out = await mallory.feedback(st, 0.0 if agent == "good" else 1.0)
            assert out["scope"] == "tenant"
        alice_picks = []
        for _ in range(10):
            _, st = await alice.open_stream(task=META, content=golden())
            await alice.result(st)
            alice_picks.append(st.route["next_hops"][0])
    assert picks[-10:].count("bad") >= 7, picks  # her own routing follows her scores
    assert alice_picks.count("good") >= 8, alice_picks  # everyone else's does not
