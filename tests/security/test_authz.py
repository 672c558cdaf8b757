"""Authorization (spec §11 AuthZ, §19 resource abuse): the role → action table,
and stream admission against tenant scopes as tables, with time passed in."""

from __future__ import annotations

import pytest

from atp_router.policy.loader import load_rib_text
from atp_router.policy.rib import Budget, ClientSpec, RateSpec
from atp_router.security.authz import (
    DEFAULT_MAX_STREAMS,
    DEFAULT_RATE,
    GRANTS,
    QUOTA_RETRY_MS,
    Action,
    Admit,
    Forbidden,
    Refuse,
    StreamAdmission,
    authorize,
    clamp_budget,
    clamp_qos,
    is_allowed,
    roles_for,
)
from atp_router.security.identity import ANONYMOUS, Identity, Role
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import QoS

A = Action


def ident(*roles: Role, tenant: str = "alice") -> Identity:
    return Identity(tenant, frozenset(roles), f"key:{tenant}", "api_key")


ADMIN, OPERATOR, CLIENT = ident(Role.ADMIN), ident(Role.OPERATOR), ident(Role.CLIENT)

# The whole matrix, written out: (action, admin, operator, client).
MATRIX = [
    (A.STREAM_OPEN, False, False, True),
    (A.STREAM_ACCESS, False, False, True),
    (A.POLICY_RELOAD, True, False, False),
    (A.POLICY_READ, True, False, False),
    (A.ROUTES_READ, True, False, False),
    (A.AUDIT_READ, True, False, False),
    (A.TENANT_ADMIN, True, False, False),
    (A.METRICS_READ, True, True, False),
    (A.HEALTH_READ, True, True, True),
]


def test_matrix_covers_every_action() -> None:
    assert {row[0] for row in MATRIX} == set(Action)
    assert set(GRANTS) == set(Role)


@pytest.mark.parametrize(("action", "admin", "operator", "client"), MATRIX, ids=[r[0].value for r in MATRIX])
def test_role_grants(action: Action, admin: bool, operator: bool, client: bool) -> None:
    for identity, allowed in ((ADMIN, admin), (OPERATOR, operator), (CLIENT, client)):
        assert is_allowed(identity, action) is allowed
        if allowed:
            authorize(identity, action)
        else:
            with pytest.raises(Forbidden) as e:
                authorize(identity, action)
            err = e.value
            assert isinstance(err, ATPError) and err.code is ErrorCode.ESEC and err.status == 403
            needed = " or ".join(r.value for r in roles_for(action))
            assert f"{action.value} needs the {needed} role" in err.reason
            assert "key:alice" in err.reason
    authorize(ANONYMOUS, action)  # authentication off: a local appliance, every role


def test_roles_combine_and_no_role_is_refused() -> None:
    both = ident(Role.ADMIN, Role.CLIENT)
    for action in Action:
        authorize(both, action)
    with pytest.raises(Forbidden, match="has no role"):
        authorize(ident(), A.HEALTH_READ)
    with pytest.raises(Forbidden, match="policy.reload needs the admin role; 'key:alice' .* has client"):
        authorize(CLIENT, A.POLICY_RELOAD)


# ------------------------------------------------------------------ admission

T0 = 1000.0
SCOPED = ClientSpec(
    qos_max=QoS.SILVER,
    task_types=["code_review", "summarize"],
    max_stream_budget=Budget(usd=0.5, tokens=10_000),
    max_streams=2,
    rate=RateSpec(per_s=1.0, burst=2),
    data_categories=["public", "internal"],
)


def decide(adm: StreamAdmission, spec: ClientSpec = SCOPED, *, identity: Identity = CLIENT, task_type="code_review",
           qos: QoS | None = QoS.GOLD, budget: Budget | None = None, labels=frozenset(), open_streams=0,
           now=T0) -> Admit | Refuse:
    return adm.decide(identity, spec, task_type=task_type, qos=qos, budget=budget, labels=frozenset(labels),
                      open_streams=open_streams, now=now)


# (name, decide keyword arguments, expected code, reason fragment, retry_after_ms)
REFUSALS = [
    ("admin-only", {"identity": ADMIN}, ErrorCode.ESEC, "needs the client role", None),
    ("operator", {"identity": OPERATOR}, ErrorCode.ESEC, "has operator", None),
    ("task-type", {"task_type": "deploy"}, ErrorCode.ESEC,
     "task_type 'deploy' is outside the scope of tenant 'alice' (allowed: code_review, summarize)", None),
    ("data-category", {"labels": {"public", "pii", "secrets"}}, ErrorCode.ESEC,
     "data_scope label(s) 'pii', 'secrets' outside the data categories of tenant 'alice'", None),
    ("max-streams", {"open_streams": 2}, ErrorCode.EWINDOW, "tenant 'alice' is at its limit of 2 open streams",
     QUOTA_RETRY_MS),
]


@pytest.mark.parametrize(("name", "kw", "code", "reason", "retry"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals(name: str, kw: dict, code: ErrorCode, reason: str, retry: int | None) -> None:
    adm = StreamAdmission()
    got = decide(adm, **kw)
    assert got == Refuse(code, got.reason, retry)
    assert reason in got.reason
    assert adm.statistics()["tenants"] == 0  # a refused SYN takes no token


# (name, asked qos, asked budget, cap spec, expected Admit)
ADMITS = [
    ("gold-served-at-silver", QoS.GOLD, None, SCOPED, Admit(QoS.SILVER, Budget(usd=0.5, tokens=10_000))),
    ("bronze-kept", QoS.BRONZE, Budget(usd=0.1), SCOPED, Admit(QoS.BRONZE, Budget(usd=0.1, tokens=10_000))),
    ("budget-capped-each-axis", QoS.SILVER, Budget(usd=9.0, tokens=5), SCOPED,
     Admit(QoS.SILVER, Budget(usd=0.5, tokens=5))),
    ("qos-none-left-to-route", None, None, SCOPED, Admit(None, Budget(usd=0.5, tokens=10_000))),
    ("no-scopes-today's-behaviour", QoS.GOLD, Budget(tokens=7), ClientSpec(), Admit(QoS.GOLD, Budget(tokens=7))),
    ("no-budget-no-cap", QoS.GOLD, None, ClientSpec(), Admit(QoS.GOLD, None)),
]


@pytest.mark.parametrize(("name", "qos", "budget", "spec", "want"), ADMITS, ids=[a[0] for a in ADMITS])
def test_admits(name: str, qos: QoS | None, budget: Budget | None, spec: ClientSpec, want: Admit) -> None:
    assert decide(StreamAdmission(), spec, qos=qos, budget=budget, labels={"public"}) == want


def test_unscoped_tenant_accepts_any_task_type_and_label() -> None:
    got = decide(StreamAdmission(), ClientSpec(), task_type="anything", labels={"pii", "secrets"})
    assert isinstance(got, Admit)


def test_rate_token_bucket_with_retry_hint() -> None:
    adm = StreamAdmission()
    assert isinstance(decide(adm, now=T0), Admit)
    assert isinstance(decide(adm, now=T0), Admit)  # burst 2
    got = decide(adm, now=T0 + 0.25)
    assert got == Refuse(ErrorCode.EWINDOW, got.reason, 750)  # 0.25 of a token back at 1/s: 750 ms to go
    assert "exceeds its rate of 1 stream opens/s (burst 2)" in got.reason
    assert isinstance(decide(adm, now=T0 + 1.0), Admit)  # one token refilled
    assert isinstance(decide(adm, now=T0 + 1.0), Refuse)
    # Buckets are per tenant.
    assert isinstance(decide(adm, identity=ident(Role.CLIENT, tenant="bob"), now=T0 + 1.0), Admit)


def test_router_defaults_bound_tenants_absent_from_the_rib() -> None:
    """One tenant can never take every stream slot, even without a RIB entry."""
    adm = StreamAdmission(default_max_streams=3, default_rate=RateSpec(per_s=10.0, burst=4))
    spec = ClientSpec()
    got = decide(adm, spec, open_streams=3)
    assert isinstance(got, Refuse) and got.code is ErrorCode.EWINDOW and "limit of 3" in got.reason
    results = [decide(adm, spec, now=T0) for _ in range(5)]
    assert [type(r) for r in results] == [Admit] * 4 + [Refuse]
    assert results[4].retry_after_ms == 100
    assert (DEFAULT_MAX_STREAMS, DEFAULT_RATE) == (1000, RateSpec(per_s=50.0, burst=100))
    defaults = StreamAdmission()
    assert isinstance(decide(defaults, spec, open_streams=999), Admit)
    assert isinstance(decide(defaults, spec, open_streams=1000), Refuse)
    # The RIB's own limit overrides the default, both ways.
    fresh = StreamAdmission(default_max_streams=3)
    assert isinstance(decide(fresh, ClientSpec(max_streams=50), open_streams=10), Admit)
    assert isinstance(decide(defaults, ClientSpec(max_streams=1), open_streams=1), Refuse)


def test_idle_tenants_are_forgotten_and_tenant_count_bounded() -> None:
    adm = StreamAdmission(max_tenants=3, default_rate=RateSpec(per_s=1.0, burst=1))
    for i in range(3):
        decide(adm, ClientSpec(), identity=ident(Role.CLIENT, tenant=f"t{i}"), now=T0)
    assert adm.statistics()["tenants"] == 3
    # t0..t2 refilled by now: a new tenant's arrival forgets them.
    decide(adm, ClientSpec(), identity=ident(Role.CLIENT, tenant="t3"), now=T0 + 5)
    assert adm.statistics()["tenants"] == 1
    for i in range(4, 8):  # none idle: the cap holds by dropping the least recently used
        decide(adm, ClientSpec(), identity=ident(Role.CLIENT, tenant=f"t{i}"), now=T0 + 5)
    assert adm.statistics()["tenants"] == 3


def test_rate_change_on_reload_applies_to_the_live_bucket() -> None:
    adm = StreamAdmission()
    slow = ClientSpec(rate=RateSpec(per_s=0.1, burst=1))
    assert isinstance(decide(adm, slow, now=T0), Admit)
    assert decide(adm, slow, now=T0 + 1).retry_after_ms == 9000
    fast = ClientSpec(rate=RateSpec(per_s=10.0, burst=1))
    assert isinstance(decide(adm, fast, now=T0 + 1.1), Admit)


def test_clamp_helpers() -> None:
    assert [clamp_qos(q, QoS.SILVER) for q in QoS] == [QoS.SILVER, QoS.SILVER, QoS.BRONZE]
    assert clamp_budget(None, None) is None
    assert clamp_budget(Budget(usd=1.0), None) == Budget(usd=1.0)
    assert clamp_budget(None, Budget(tokens=3)) == Budget(tokens=3)
    assert clamp_budget(Budget(usd=1.0, tokens=9), Budget(usd=2.0, tokens=3)) == Budget(usd=1.0, tokens=3)


def test_scopes_load_from_yaml_into_admission() -> None:
    rib = load_rib_text("""
agents: {lint.ruff: {layer: L0, tool: ruff, p95_ms: 100}}
policies: [{match: {task_type: code_review}, fanout: [lint.ruff]}]
clients:
  alice:
    qos_max: bronze
    task_types: [code_review]
    max_stream_budget: {usd: 0.01}
    max_streams: 1
    rate: {per_s: 0.5, burst: 1}
    data_categories: [public]
""", file="scopes.yaml")
    spec = rib.clients["alice"]
    assert decide(StreamAdmission(), spec, labels={"public"}) == Admit(QoS.BRONZE, Budget(usd=0.01))
    assert decide(StreamAdmission(), spec, labels={"internal"}).code is ErrorCode.ESEC
