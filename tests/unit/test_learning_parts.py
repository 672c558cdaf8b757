"""Learning (atp_router.runtime.controlplane.learning) built from the parts it
uses, with no Router (issue 21: the control plane is given the store, metrics
and audit it needs): a SQLite store, a budget ledger, the router metrics, a
control plane compiled from examples/learning/rib.yaml, an audit sink and each
tenant's learning limits. What it decides lands in those parts: the bandit's
choices in the metrics, the learned state in the store (read back by a new
Learning), the tenant's rate in the skip counter, the running generation of
the control plane in a shared sync."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from atp_router.flow.breaker import BreakerBoard, RetryPolicy
from atp_router.flow.budget import BudgetLedger
from atp_router.flow.qos import QosScheduler
from atp_router.flow.window import WindowTable
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.config import DEFAULT_AGENT_WINDOW
from atp_router.runtime.controlplane.control import ControlPlane
from atp_router.runtime.controlplane.learning import Learning, LearnLimits, has_tenants
from atp_router.runtime.dataplane.gates import FlowGates, SlotGate
from atp_router.security.identity import ANONYMOUS, Identity
from atp_router.store import SqliteStore
from atp_router.wire.errors import ATPError, ErrorCode
from tests.conftest import ROOT

LEARNING_RIB = ROOT / "examples" / "learning" / "rib.yaml"
META = {"task_type": "code_review", "languages": ["py"]}
LIMITS = LearnLimits(rate_per_s=10.0, burst=200, share=0.25)


@dataclass
class Parts:
    store: SqliteStore
    ledger: BudgetLedger
    metrics: RouterMetrics
    control: ControlPlane
    audited: list[tuple[str, Identity | None, dict[str, Any]]]

    def learning(self, *, limits: LearnLimits = LIMITS, tenants: bool = True, seed: int | None = 1) -> Learning:
        return Learning(self.store, ledger=self.ledger, metrics=self.metrics, control=self.control,
                        audit=lambda kind, who, detail: self.audited.append((kind, who, dict(detail))),
                        limits=limits, tenants=tenants, seed=seed)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    metrics, ledger = RouterMetrics(), BudgetLedger()
    gates = FlowGates(WindowTable(DEFAULT_AGENT_WINDOW), SlotGate(QosScheduler(4, gold_reserved=1), lambda _: None),
                      BreakerBoard(), RetryPolicy(), rng=random.Random(0))
    control = ControlPlane(LEARNING_RIB, ledger=ledger, gates=gates, metrics=metrics, on_leg=lambda _: None)
    with SqliteStore.open(tmp_path / "state") as store:
        yield Parts(store, ledger, metrics, control, [])


def _count(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_total", labels) or 0.0


def test_the_bandits_choice_is_counted_in_the_metrics_it_was_given(parts):
    learning = parts.learning()
    gen = parts.control.gen
    route, decision = learning.route(gen.fib.lookup(META), gen, META, {"diff": "+x = 1\n"}, tenant="acme",
                                     budget_usd_micros=None)
    assert route.policy == "review" and decision is not None
    chosen = decision.order[: decision.k]
    assert len(chosen) == 1  # fanout_k: 1
    assert _count(parts.metrics, "atp_bandit_choices", policy="review", agent=chosen[0]) == 1.0


def test_what_it_learned_is_saved_to_its_store_and_read_back_by_a_new_learning(parts):
    learning = parts.learning()
    for _ in range(5):
        learning.learner.observe_call("reviewer.small", policy="review", latency_ms=300, ok=True, timeout=False,
                                      tokens=1000, usd_micros=100)
    assert "reviewer.small" not in parts.learning().live_view()  # nothing saved yet
    learning.save()
    restored = parts.learning().live_view()["reviewer.small"]
    assert restored.calls == pytest.approx(learning.live_view()["reviewer.small"].calls)


async def test_a_tenant_over_its_learning_rate_is_skipped_and_counted_others_are_not(parts):
    learning = parts.learning(limits=LearnLimits(rate_per_s=1e-6, burst=2, share=0.25))
    plan = SimpleNamespace(attempts=[])  # no next-hop called: nothing to learn, but the task counts

    def ctx(tenant: str) -> Any:
        return SimpleNamespace(tenant=tenant, route=SimpleNamespace(policy="review"))

    for _ in range(3):
        learning.task_done(ctx("acme"), plan, None, None)
    learning.task_done(ctx("globex"), plan, None, None)
    assert _count(parts.metrics, "atp_learning_skipped", policy="review") == 1.0  # acme's third task


def test_a_shared_sync_follows_the_control_planes_running_generation(parts):
    a, b = parts.learning(), parts.learning()
    a.share()
    b.share()
    for _ in range(5):
        a.learner.observe_call("lint.ruff", policy="review", latency_ms=80, ok=True, timeout=False, tokens=0,
                               usd_micros=0)
    assert a.sync_shared()["pushed"] >= 1
    assert b.sync_shared()["pulled"] >= 1
    assert b.live_view()["lint.ruff"].calls == pytest.approx(a.live_view()["lint.ruff"].calls)
    parts.control.reload(version=7)
    a.sync_shared()
    assert a._version == 7  # the learner follows the generation the control plane runs


def test_tenants_decides_whether_one_tenant_may_hold_only_its_share():
    def refusing(authorization: None) -> Identity:
        raise ATPError(ErrorCode.ESEC, "missing credentials")

    assert has_tenants(refusing) is True
    assert has_tenants(lambda authorization: ANONYMOUS) is False


def test_the_learning_share_is_the_limits_only_on_a_router_that_tells_tenants_apart(parts):
    assert parts.learning(tenants=True).learner.shares.share == 0.25
    assert parts.learning(tenants=False).learner.shares.share == 1.0


GAIN_RIB = """
agents:
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200}
  sec.bandit: {layer: L1, tool: bandit, p95_ms: 200}
policies:
  - name: qa
    match: {task_type: qa}
    fanout: [lint.ruff, sec.bandit]
    fanout_k: 1
    bandit: {text_features: true, bits: 10, explore: 0}
"""


def test_routers_sharing_a_store_merge_the_text_gain_models_online_updates(tmp_path):
    """``atp-router learn --method gain`` into the store two routers share: both route by the
    stored model; what one learns online is pushed, merged and adopted by the other, and a router
    started afterwards reads the merged model."""
    import json

    import msgspec
    import numpy as np

    from atp_router.deploy.learn_cmd import learn_main
    from atp_router.policy.learn import Decision
    from atp_router.runtime.controlplane.learn_entries import GAIN_PREFIX, decode_gain

    rib = tmp_path / "rib.yaml"
    rib.write_text(GAIN_RIB)
    data = tmp_path / "o.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{'prove the integral' if i % 2 else 'name the capital'} {i}",
                                        "subject": "math" if i % 2 else "geo", "weak_correct": not i % 2,
                                        "strong_correct": bool(i % 2)}) + "\n" for i in range(40)))
    assert learn_main(["--from", str(data), "--policy", "qa", "--policies", str(rib), "--state-dir",
                       str(tmp_path / "state"), "--arms", "lint.ruff,sec.bandit", "--method", "gain"]) == 0
    metrics, ledger = RouterMetrics(), BudgetLedger()
    gates = FlowGates(WindowTable(DEFAULT_AGENT_WINDOW), SlotGate(QosScheduler(4, gold_reserved=1), lambda _: None),
                      BreakerBoard(), RetryPolicy(), rng=random.Random(0))
    control = ControlPlane(rib, ledger=ledger, gates=gates, metrics=metrics, on_leg=lambda _: None)
    with SqliteStore.open(tmp_path / "state") as store:
        parts = Parts(store, ledger, metrics, control, [])
        a, b = parts.learning(), parts.learning()
        for x in (a, b):
            x.share()
            x.sync_shared()
        ga = a.learner.policy_bandit("qa")[0].gain
        gb = b.learner.policy_bandit("qa")[0].gain
        assert ga is not None and gb is not None and ga.count == gb.count == 40
        assert ga.heads == gb.heads == 2  # learn's default: one head per arm
        feat = a.learner.policy_bandit("qa")[1]
        ctx = feat({"task_type": "qa", "subject": "math"}, "prove the integral 7")
        before = gb.logit(ctx)
        for _ in range(5):
            a.learner.observe(Decision("qa", ("sec.bandit", "lint.ruff"), 1, ctx, 0.0, called=["sec.bandit"]),
                              {"sec.bandit": 0.0})
        assert a.sync_shared()["pushed"] >= 1
        assert b.sync_shared()["pulled"] >= 1
        assert gb.count == 45 and gb.logit(ctx) == pytest.approx(ga.logit(ctx)) and gb.logit(ctx) < before
        stored = decode_gain(store.get(f"{GAIN_PREFIX}qa"))
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(stored))["state"]["count"] == 45
        c = parts.learning()
        c.sync(control.gen)
        assert c.learner.policy_bandit("qa")[0].gain.count == 45
        assert np.isfinite(c.learner.policy_bandit("qa")[0].gain.logit(ctx))
