"""The SYN pipeline as a list of stages (atp_router.runtime.dataplane.opening; spec §8 steps 1–2, §10,
§11). Each stage alone, table-tested like admission (tests/unit/test_admission.py):
the cases it lets through with what it decides, the cases it refuses with their
spec §10 code, reason and retry hint. Stages are built from a real router's parts
(stream table, admission, learning, control plane, ledger); none reads a clock —
``now`` is the OpenCtx's. Then the pipeline (first refusal stops it, order as
shipped), a stage given through ``Router(syn_stages=…)`` running in its place in
a real router, and ``atp-router policy check --stages``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from atp_router.deploy import single
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.policy.rib import ClientSpec, RateSpec
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.dataplane.opening import (
    CONTINUE,
    DEFAULT_STAGES,
    Bandit,
    BudgetOpen,
    ContextScope,
    Continue,
    DecodeMeta,
    FibLookup,
    OpenCtx,
    OpenParts,
    Refuse,
    StreamSlot,
    TaskShape,
    TenantAdmission,
    describe,
    insert_stage,
    replace_stage,
    run_inline,
    run_stages,
)
from atp_router.runtime.router import Router
from atp_router.security.authz import QUOTA_RETRY_MS, StreamAdmission
from atp_router.security.identity import ANONYMOUS, Identity, Role
from atp_router.task.body import CodeReview, Opaque, RetrievalQA
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, QoS
from tests.conftest import MECHANICS_RIB, ROOT
from tests.helpers import ROUTER
from tests.unit.test_context import EXAMPLE
from tests.unit.test_router_dispatch import CLEAN

LEARNING_RIB = ROOT / "examples" / "learning" / "rib.yaml"
CLIENT = Identity("acme", frozenset({Role.CLIENT}), "key:acme", "api_key")
META = {"task_type": "code_review", "languages": ["py"]}


def syn(meta: dict[str, Any] | None = None, content: Any = None, *, identity: Identity = CLIENT,
        stream_id: str = "s1", qos: QoS | None = QoS.SILVER, now: float = 100.0, **decided: Any) -> OpenCtx:
    o = OpenCtx(identity, "sess1", stream_id, dict(META if meta is None else meta), content, qos, None, now)
    for k, v in decided.items():
        setattr(o, k, v)
    return o


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    r = single.build(RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / "state", max_streams=2))
    yield r
    r.close_state()


@pytest.fixture
def learning_router(tmp_path: Path) -> Iterator[Router]:
    r = single.build(RouterConfig(policies=LEARNING_RIB, state_dir=tmp_path / "learning-state"))
    yield r
    r.close_state()


def refused(r: Continue | Refuse) -> tuple[ErrorCode, str, int | None]:
    assert isinstance(r, Refuse), r
    return r.code, r.reason, r.retry_after_ms


# ------------------------------------------------------------------ context_scope
def test_context_scope_joins_the_agent_context_labels_to_data_scope():
    o = syn({"task_type": "code_review", "data_scope": ["no_secrets"], "agent_context": EXAMPLE})
    assert ContextScope()(o) is CONTINUE
    assert o.meta["data_scope"] == ["no_secrets", "acp.policy:P001", "acp.policy:P002"]
    plain = syn()
    assert ContextScope()(plain) is CONTINUE and plain.meta == META


@pytest.mark.parametrize("bad, reason", [
    ("{not json", "agent_context: not JSON"),
    ([1, 2], "agent_context: expected an object, got list"),
])
def test_context_scope_refuses_a_bad_agent_context_with_eproto_naming_the_field(bad, reason):
    o = syn({**META, "agent_context": bad})
    code, why, retry = refused(ContextScope()(o))
    assert code is ErrorCode.EPROTO and why.startswith(reason) and retry is None
    assert o.meta["agent_context"] == bad  # meta as the SYN had it (the RST's trace sees it)


# ------------------------------------------------------------------ task_shape
@pytest.mark.parametrize("content, diff_loc", [
    (None, None),  # no task at SYN: nothing to check
    (CLEAN, 2),  # one line removed, one added
    ({"files": {"a.py": "x = 1\n"}}, None),
])
def test_task_shape_lets_documented_shapes_through_and_counts_the_diff(content, diff_loc):
    o = syn(content=content)
    assert TaskShape()(o) is CONTINUE
    assert o.meta.get("diff_loc") == diff_loc


def test_task_shape_keeps_a_diff_loc_the_client_gave():
    o = syn({**META, "diff_loc": 7}, CLEAN)
    assert TaskShape()(o) is CONTINUE and o.meta["diff_loc"] == 7


@pytest.mark.parametrize("content, reason", [
    ({"diff": 3}, "task content.diff must be a string (a unified diff)"),
    ({"files": {"a.py": 1}}, "task content.files must map paths to file text"),
    ({"files": ["a.py"]}, "task content.files must map paths to file text"),
])
def test_task_shape_refuses_other_shapes_with_eproto(content, reason):
    o = syn(content=content)
    assert refused(TaskShape()(o)) == (ErrorCode.EPROTO, reason, None)
    assert "diff_loc" not in o.meta


def test_task_shape_decodes_the_body_its_task_type_names_once():
    """The body is decoded into its task type's Struct (the SYN's typed meta
    names the type; without it, by its keys), kept on the OpenCtx for the
    prompt of every next-hop; a field of the wrong shape is EPROTO naming it."""
    o = syn(content=CLEAN, task=TaskMeta(task_type="code_review"))
    assert TaskShape()(o) is CONTINUE
    assert isinstance(o.body, CodeReview) and o.body.diff == CLEAN["diff"] and o.body.files == CLEAN["files"]
    assert o.task is not None and o.task.diff_loc == o.meta["diff_loc"]  # the typed meta kept in step
    o = syn({"task_type": "retrieval_qa"}, {"question": "why?"}, task=TaskMeta(task_type="retrieval_qa"))
    assert TaskShape()(o) is CONTINUE and o.body == RetrievalQA(question="why?")
    o = syn({"task_type": "retrieval_qa"}, {"question": ""}, task=TaskMeta(task_type="retrieval_qa"))
    assert refused(TaskShape()(o)) == (
        ErrorCode.EPROTO, "task content.question: Expected `str` of length >= 1 - at `$.question`", None)
    o = syn({"task_type": "summarize"}, {"messages": [{"role": "robot", "content": "x"}]},
            task=TaskMeta(task_type="summarize"))
    assert refused(TaskShape()(o)) == (
        ErrorCode.EPROTO, "task content.messages: Invalid enum value 'robot' - at `$.messages[0].role`", None)
    o = syn({"task_type": "summarize"}, {"prompt": "an operator's own shape"}, task=TaskMeta(task_type="summarize"))
    assert TaskShape()(o) is CONTINUE and o.body == Opaque()


# ------------------------------------------------------------------ stream_slot
def test_stream_slot_admits_new_ids_until_the_table_is_full(router):
    stage = StreamSlot.of(router.open_parts)
    assert stage(syn(stream_id="a")) is CONTINUE
    router.streams.open_count = 2  # as max_streams open streams make it
    assert refused(stage(syn(stream_id="b"))) == (
        ErrorCode.EWINDOW, "router is at its limit of 2 open streams", None)


async def test_stream_slot_refuses_an_id_the_tenant_has_open(router):
    ctx = router.open_stream(task=META, content=None, budget=None, qos=None, window=None, idempotency_key=None,
                             identity=CLIENT)
    stage = StreamSlot.of(router.open_parts)
    assert refused(stage(syn(stream_id=ctx.stream_id))) == (
        ErrorCode.EPROTO, f"stream_id {ctx.stream_id!r} is already in use", None)
    # Another tenant's stream of the same id is another stream (spec §11).
    other = Identity("other", frozenset({Role.CLIENT}), "key:other", "api_key")
    assert stage(syn(identity=other, stream_id=ctx.stream_id)) is CONTINUE


# ------------------------------------------------------------------ task_meta
@pytest.mark.parametrize("meta_budget, budget", [
    (None, None),
    ({"usd": 0.5}, Budget(usd=0.5)),
    ({"usd": 0.25, "tokens": 1000}, Budget(usd=0.25, tokens=1000)),
])
def test_task_meta_decodes_meta_budget(meta_budget, budget):
    meta = {**META, **({"budget": meta_budget} if meta_budget is not None else {})}
    o = syn(meta)
    assert DecodeMeta()(o) is CONTINUE and o.client_budget == budget
    assert o.task == TaskMeta(task_type="code_review", budget=budget)


@pytest.mark.parametrize("meta_budget", [{"usd": "lots"}, {"tokens": 1.5}, "0.5"])
def test_task_meta_refuses_a_malformed_budget_with_eproto(meta_budget):
    code, reason, retry = refused(DecodeMeta()(syn({**META, "budget": meta_budget})))
    assert code is ErrorCode.EPROTO and reason.startswith("meta.budget: ") and retry is None


def test_task_meta_decodes_the_typed_fields_once_after_the_stages_that_add_to_the_meta():
    """What context_scope and task_shape added (the Agent Context's labels, the
    counted ``diff_loc``) is in the typed view; the match keys are not."""
    o = syn({**META, "data_scope": ["no_secrets"], "agent_context": EXAMPLE, "idempotency_key": "k1",
             "resume_after": 3}, CLEAN)
    assert run_inline(run_stages([ContextScope(), TaskShape(), DecodeMeta()], o)) is None
    assert o.task == TaskMeta(task_type="code_review", idempotency_key="k1", resume_after=3, diff_loc=2,
                              data_scope=["no_secrets", "acp.policy:P001", "acp.policy:P002"],
                              agent_context=EXAMPLE)


@pytest.mark.parametrize("meta, reason", [
    ({"idempotency_key": ""}, "meta.idempotency_key: Expected `str` of length >= 1 - at `$.idempotency_key`"),
    ({"resume_after": -1}, "meta.resume_after: Expected `int` >= 0 - at `$.resume_after`"),
    ({"trace": "00-ab-cd-01"}, "meta.trace: Expected `object | null`, got `str` - at `$.trace`"),
])
def test_task_meta_refuses_a_malformed_typed_field_with_eproto_naming_it(meta, reason):
    assert refused(DecodeMeta()(syn({**META, **meta}))) == (ErrorCode.EPROTO, reason, None)


# ------------------------------------------------------------------ tenant_admission
def admission_stage(spec: ClientSpec, open_streams: int = 0) -> tuple[TenantAdmission, StreamAdmission]:
    class Table:  # the stream table's per-tenant open count, the only thing the stage reads of it
        tenant_open: ClassVar[dict[str, int]] = {CLIENT.tenant: open_streams}

    adm = StreamAdmission()
    return TenantAdmission(adm, lambda tenant: spec, Table()), adm  # type: ignore[arg-type]


@pytest.mark.parametrize("spec, asked_qos, asked_budget, qos, budget", [
    (ClientSpec(), QoS.GOLD, None, QoS.GOLD, None),
    (ClientSpec(qos_max=QoS.SILVER), QoS.GOLD, None, QoS.SILVER, None),
    (ClientSpec(max_stream_budget=Budget(usd=0.1)), None, Budget(usd=1.0, tokens=5), None, Budget(usd=0.1, tokens=5)),
    (ClientSpec(max_stream_budget=Budget(tokens=100)), QoS.BRONZE, None, QoS.BRONZE, Budget(tokens=100)),
])
def test_tenant_admission_serves_the_clamped_qos_and_capped_budget(spec, asked_qos, asked_budget, qos, budget):
    stage, _ = admission_stage(spec)
    o = syn(qos=asked_qos, client_budget=asked_budget)
    assert stage(o) is CONTINUE
    assert (o.admitted_qos, o.client_budget) == (qos, budget)


def test_tenant_admission_refusals_keep_code_reason_and_retry_hint():
    stage, _ = admission_stage(ClientSpec(task_types=["repo_summary"]))
    assert refused(stage(syn())) == (
        ErrorCode.ESEC, "task_type 'code_review' is outside the scope of tenant 'acme' (allowed: repo_summary)", None)
    no_role = Identity("acme", frozenset({Role.ADMIN}), "key:adm", "api_key")
    code, reason, _ = refused(stage(syn(identity=no_role)))
    assert code is ErrorCode.ESEC and reason.startswith("opening a stream needs the client role")
    stage, _ = admission_stage(ClientSpec(data_categories=["public"]), 0)
    code, reason, _ = refused(stage(syn({**META, "data_scope": ["pii"]})))
    assert code is ErrorCode.ESEC and "'pii'" in reason
    stage, _ = admission_stage(ClientSpec(max_streams=3), open_streams=3)
    assert refused(stage(syn())) == (
        ErrorCode.EWINDOW, "tenant 'acme' is at its limit of 3 open streams", QUOTA_RETRY_MS)


def test_tenant_admission_rate_uses_the_ctx_clock_not_its_own():
    stage, _ = admission_stage(ClientSpec(rate=RateSpec(per_s=2.0, burst=1)))
    assert stage(syn(now=10.0)) is CONTINUE
    assert refused(stage(syn(now=10.25))) == (
        ErrorCode.EWINDOW, "tenant 'acme' exceeds its rate of 2 stream opens/s (burst 1)", 250)
    assert stage(syn(now=10.5)) is CONTINUE  # a token is due 0.5 s after the first open


# ------------------------------------------------------------------ route, bandit
def test_route_looks_up_the_running_generation(router):
    o = syn()
    assert FibLookup.of(router.open_parts)(o) is CONTINUE
    assert o.gen is router.gen and o.route is not None and o.route.policy
    assert [h.agent for h in o.route.next_hops]


def test_route_refuses_a_task_no_policy_matches_with_eagentdown(router):
    o = syn({"task_type": "poetry"})
    assert refused(FibLookup.of(router.open_parts)(o)) == (ErrorCode.EAGENTDOWN, "no route for task_type='poetry'", None)
    assert o.route is None


def test_bandit_leaves_a_route_without_bandit_and_decides_one_with(router, learning_router):
    o = syn()
    FibLookup.of(router.open_parts)(o)
    before = o.route
    assert Bandit.of(router.open_parts)(o) is CONTINUE
    assert o.route == before and o.decision is None
    o = syn(content=CLEAN)
    FibLookup.of(learning_router.open_parts)(o)
    assert Bandit.of(learning_router.open_parts)(o) is CONTINUE
    assert o.route.policy == "review" and o.decision is not None
    assert len(o.decision.order[: o.decision.k]) == 1  # fanout_k: 1 picks one cheap next-hop


# ------------------------------------------------------------------ budget_open
def test_budget_open_opens_the_stream_account_at_the_tighter_budget(router):
    o = syn(client_budget=Budget(usd=0.01))
    FibLookup.of(router.open_parts)(o)
    assert BudgetOpen.of(router.open_parts)(o) is CONTINUE
    assert o.budget.usd == 0.01
    assert router.ledger.has(o.account) and o.account == "stream:acme:s1"


class DownLedger(BudgetLedger):
    """A shared ledger whose store cannot be reached (atp_router.deploy.cluster.ClusterLedger.open's refusal)."""

    def open(self, key: str, limit: Allowance, *, parent: str | None = None) -> None:
        raise ATPError(ErrorCode.EBUDGET, "budget store unavailable: down; retry", retry_after_ms=250)


def test_budget_open_refusal_of_a_shared_ledger_keeps_its_retry_hint(router):
    o = syn()
    FibLookup.of(router.open_parts)(o)
    stage = BudgetOpen(DownLedger(), router.client_account)
    assert refused(stage(o)) == (ErrorCode.EBUDGET, "budget store unavailable: down; retry", 250)


# ------------------------------------------------------------------ the pipeline
class Recorder:
    def __init__(self, name: str, ran: list[str], answer: Continue | Refuse = CONTINUE) -> None:
        self.name, self.ran, self.answer = name, ran, answer

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        self.ran.append(self.name)
        return self.answer


def test_the_pipeline_stops_at_the_first_refusal():
    ran: list[str] = []
    no = Refuse(ErrorCode.ESEC, "no")
    stages = [Recorder("a", ran), Recorder("b", ran, no), Recorder("c", ran, Refuse(ErrorCode.EPROTO, "late"))]
    assert run_inline(run_stages(stages, syn())) is no
    assert ran == ["a", "b"]
    ran.clear()
    assert run_inline(run_stages([Recorder("a", ran), Recorder("c", ran)], syn())) is None and ran == ["a", "c"]


def test_the_default_pipeline_checks_in_the_shipped_order():
    assert [s.name for s in DEFAULT_STAGES] == [
        "context_scope", "task_shape", "stream_slot", "task_meta", "tenant_admission", "route", "bandit",
        "budget_open"]
    assert all(doc and "\n" not in doc for _, doc in describe(DEFAULT_STAGES))


def test_an_earlier_refusal_wins_over_a_later_one(router):
    # A bad agent_context, a bad task body and a bad budget together: context_scope speaks first.
    o = syn({**META, "agent_context": "{x", "budget": {"usd": "x"}}, {"diff": 1})
    r = run_inline(run_stages(router.syn_stages, o))
    assert r is not None and r.code is ErrorCode.EPROTO and r.reason.startswith("agent_context: not JSON")
    o = syn({**META, "budget": {"usd": "x"}}, {"diff": 1})
    assert run_inline(run_stages(router.syn_stages, o)) == Refuse(
        ErrorCode.EPROTO, "task content.diff must be a string (a unified diff)")


def test_list_operations_replace_and_insert_by_name():
    class Extra:
        """An extra check."""

        name: ClassVar[str] = "extra"

    assert [s.name for s in replace_stage(DEFAULT_STAGES, "bandit", Extra)][5:7] == ["route", "extra"]
    assert [s.name for s in insert_stage(DEFAULT_STAGES, Extra, before="route")][4:7] == [
        "tenant_admission", "extra", "route"]
    assert [s.name for s in insert_stage(DEFAULT_STAGES, Extra, after="budget_open")][-1] == "extra"
    with pytest.raises(KeyError, match="no SYN stage named 'nope'"):
        replace_stage(DEFAULT_STAGES, "nope", Extra)


# ------------------------------------------------------------------ in a real router
class OnlyGold:
    """Refuses every SYN not asking for gold (a stage a deployment would add)."""

    name: ClassVar[str] = "only_gold"
    seen: ClassVar[list[str]] = []

    @classmethod
    def of(cls, parts: OpenParts) -> OnlyGold:
        return cls()

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        OnlyGold.seen.append(o.stream_id)
        if o.qos is not QoS.GOLD:
            return Refuse(ErrorCode.EWINDOW, "gold only here", 1234)
        return CONTINUE


def open_http(router: Router, qos: QoS) -> Any:
    return router.open_stream(task=META, content=None, budget=None, qos=qos, window=None, idempotency_key=None,
                              identity=ANONYMOUS)


async def test_a_stage_given_to_the_router_runs_in_its_place(tmp_path):
    OnlyGold.seen.clear()
    stages = replace_stage(DEFAULT_STAGES, "tenant_admission", OnlyGold)
    router = single.build(RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / "state"), syn_stages=stages)
    try:
        assert [s.name for s in router.syn_stages] == [s.name for s in stages]
        with pytest.raises(ATPError) as e:
            open_http(router, QoS.SILVER)
        assert (e.value.code, e.value.reason, e.value.retry_after_ms) == (ErrorCode.EWINDOW, "gold only here", 1234)
        assert router.metrics.errors.labels("EWINDOW")._value.get() == 1
        ctx = open_http(router, QoS.GOLD)
        assert router.streams.get(ANONYMOUS.tenant, ctx.session_id, ctx.stream_id) is ctx
        assert len(OnlyGold.seen) == 2
        # tenant_admission did not run: its stream-open token bucket was never taken from.
        assert router.admission.statistics() == {"tenants": 0}
    finally:
        router.close_state()
    default = single.build(RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / "state2"))
    try:
        ctx = open_http(default, QoS.SILVER)
        assert ctx.qos is QoS.SILVER and default.admission.statistics() == {"tenants": 1}
    finally:
        default.close_state()
    await trio.lowlevel.checkpoint()


# ------------------------------------------------------------------ atp-router policy check --stages
def test_policy_check_stages_prints_each_stage_and_what_it_checks():
    out = subprocess.run([*ROUTER, "policy", "check", "--stages"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == [s.name for s in DEFAULT_STAGES]
    for i, (line, (name, doc)) in enumerate(zip(lines, describe(DEFAULT_STAGES), strict=True), 1):
        assert line.startswith(f"{i}. {name}") and line.endswith(doc)
    assert lines[4].startswith("5. tenant_admission  Spec §11 AuthZ: role, task types, data categories (ESEC)")
    # With a RIB: its FIB first, as without --stages, then the stages.
    both = subprocess.run([*ROUTER, "policy", "check", str(MECHANICS_RIB), "--stages"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    fib = subprocess.run([*ROUTER, "policy", "check", str(MECHANICS_RIB)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert both == fib + "\nSYN stages:\n" + out
    # Neither a RIB nor --stages: a usage error, as before.
    none = subprocess.run([*ROUTER, "policy", "check"], capture_output=True, text=True, timeout=60, check=False)
    assert none.returncode == 2 and "required: path" in none.stderr
    json.loads(subprocess.run([*ROUTER, "policy", "check", "--json", str(MECHANICS_RIB)], capture_output=True,
                              text=True, timeout=60, check=True).stdout)
