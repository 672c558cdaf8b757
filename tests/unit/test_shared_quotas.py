"""A tenant's quotas shared by the routers on one store (issue 22 item 3,
atp_router.runtime.dataplane.quotas), on real routers (``single.build``) whose
``tenant_admission`` stage is the shared one (``with_shared_quotas``), each with its
own owner name, over one real SQLite store (as ``--workers N`` share theirs): the
quota and the open rate hold across routers with the single router's codes and
reasons; a stream's close, and a later stage's refusal, free its entry (a close the
store could not take is retried at the next renewal, which also drops an entry the
router does not hold); the store away, each router falls back to its own limit
(logged once, counted); the
learning rate is one bucket across routers. (Across real processes on Redis:
tests/scale/test_cluster_quotas.py.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atp_router.deploy import single
from atp_router.flow.quota import QuotaAsk, QuotaGrant
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.dataplane.opening import (
    DEFAULT_STAGES,
    Continue,
    OpenCtx,
    Refuse,
    insert_stage,
)
from atp_router.runtime.dataplane.quotas import (
    SharedQuotas,
    SharedTenantAdmission,
    with_shared_quotas,
)
from atp_router.runtime.router import Router
from atp_router.security.authz import QUOTA_RETRY_MS
from atp_router.security.identity import ANONYMOUS
from atp_router.store import SqliteStore, StoreUnavailable
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import QoS
from tests.conftest import MECHANICS_RIB

META = {"task_type": "code_review", "languages": ["py"]}


class Unreachable(SqliteStore):
    """A store whose quota calls find it unreachable (a Redis that stopped answering)."""

    def quota_open(self, ask: QuotaAsk, *, owner: str, now_ms: int, ttl_ms: int) -> QuotaGrant:
        raise StoreUnavailable("redis at redis://127.0.0.1:1 unavailable: Connection refused")

    def rate_take(self, key: str, *, per_s: float, burst: int, now_ms: int) -> int | None:
        raise StoreUnavailable("redis at redis://127.0.0.1:1 unavailable: Connection refused")


class RefuseAfter:
    """A stage after tenant_admission refusing every SYN (as a route that is down)."""

    name = "refuse_after"

    @classmethod
    def of(cls, parts: Any) -> RefuseAfter:
        return cls()

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        return Refuse(ErrorCode.EAGENTDOWN, "no route")


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[SqliteStore]:
    store = SqliteStore.open(tmp_path / "shared", multiprocess=True)
    yield store
    store.close()


def build(tmp_path: Path, name: str, store: SqliteStore, stages: Any = DEFAULT_STAGES,
          **config: Any) -> tuple[Router, SharedQuotas]:
    """A router on its own state directory whose tenant quotas are shared in ``store``
    under the owner ``name`` (as a worker's), and its :class:`SharedQuotas`."""
    metrics = RouterMetrics()
    quotas = SharedQuotas(store, owner=name, metrics=metrics)
    cfg = RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / name, **{"tenant_max_streams": 2, **config})
    return single.build(cfg, syn_stages=with_shared_quotas(stages, quotas), metrics=metrics), quotas


def open_http(router: Router) -> Any:
    return router.open_stream(task=META, content=None, budget=None, qos=QoS.SILVER, window=None,
                              idempotency_key=None, identity=ANONYMOUS)


def refused(router: Router) -> tuple[ErrorCode, str, int | None]:
    with pytest.raises(ATPError) as e:
        open_http(router)
    return e.value.code, e.value.reason, e.value.retry_after_ms


async def test_the_quota_holds_across_routers_and_a_close_frees_its_slot(tmp_path, shared):
    (r1, q1), (r2, q2) = build(tmp_path, "w0.1", shared), build(tmp_path, "w1.2", shared)
    try:
        assert [s.name for s in r1.syn_stages] == [s.name for s in DEFAULT_STAGES]
        assert isinstance(r1.syn_stages[[s.name for s in DEFAULT_STAGES].index("tenant_admission")],
                          SharedTenantAdmission)
        one, two = open_http(r1), open_http(r2)
        # Each router holds one stream: alone, each would admit another.
        assert refused(r1) == (ErrorCode.EWINDOW, "tenant 'anonymous' is at its limit of 2 open streams",
                               QUOTA_RETRY_MS)
        assert refused(r2)[0] is ErrorCode.EWINDOW
        assert shared.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 2
        assert r1.metrics.quota_refused.labels("streams")._value.get() == 1
        r2.stream_closed(two.stop(ErrorCode.EPREEMPT, "cancelled"))
        assert shared.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 1
        three = open_http(r1)
        assert refused(r2)[0] is ErrorCode.EWINDOW
        for ctx in (one, three):
            r1.stream_closed(ctx.stop(ErrorCode.EPREEMPT, "cancelled"))
        assert shared.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 0
        assert q1.held == set() and q2.held == set()
    finally:
        r1.close_state()
        r2.close_state()


async def test_the_open_rate_holds_across_routers(tmp_path, shared):
    kw = {"tenant_max_streams": 100, "tenant_rate_per_s": 0.01, "tenant_rate_burst": 3}
    (r1, _), (r2, _) = build(tmp_path, "w0.1", shared, **kw), build(tmp_path, "w1.2", shared, **kw)
    try:
        for r in (r1, r2, r1):
            open_http(r)
        code, reason, retry = refused(r2)
        assert (code, reason) == (ErrorCode.EWINDOW, ("tenant 'anonymous' exceeds its rate of 0.01 stream opens/s "
                                                     "(burst 3)"))
        assert retry is not None and 99_000 <= retry <= 100_000
    finally:
        r1.close_state()
        r2.close_state()


async def test_a_later_stage_refusing_the_syn_frees_its_entry(tmp_path, shared):
    r, quotas = build(tmp_path, "w0.1", shared, insert_stage(DEFAULT_STAGES, RefuseAfter, after="tenant_admission"))
    try:
        for _ in range(3):  # never held: a refused SYN never counts against the tenant
            assert refused(r) == (ErrorCode.EAGENTDOWN, "no route", None)
        assert shared.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 0 and quotas.held == set()
    finally:
        r.close_state()


async def test_the_store_away_each_router_falls_back_to_its_own_limit(tmp_path, caplog):
    down = Unreachable.open(tmp_path / "down")
    r, quotas = build(tmp_path, "w0.1", down)
    try:
        with caplog.at_level(logging.ERROR, logger="atp_router.runtime.quotas"):
            open_http(r)
            open_http(r)  # this router's own limit of 2: not refused for the store, not unlimited
            assert refused(r) == (ErrorCode.EWINDOW, "tenant 'anonymous' is at its limit of 2 open streams",
                                  QUOTA_RETRY_MS)
        assert r.metrics.quota_fallback.labels("streams")._value.get() == 3
        assert [m for m in caplog.messages if "shared tenant quotas" in m] == [
            ("shared tenant quotas: the store cannot be reached (open: redis at redis://127.0.0.1:1 unavailable: "
            "Connection refused): each router enforces its own limits until it answers")]
        assert quotas.held == set()
    finally:
        r.close_state()
        down.close()


def test_the_learning_rate_is_one_bucket_across_routers(tmp_path, shared):
    (r1, q1), (r2, q2) = (build(tmp_path, o, shared, learn_rate_per_s=0.001, learn_burst=3) for o in ("w0.1", "w1.2"))
    try:
        for r, q in ((r1, q1), (r2, q2)):
            r.learning.shared_rate = q.may_learn  # as deploy.workers and deploy.cluster set it
        learned = [r.learning._may_learn("acme", 100.0) for r in (r1, r2, r1, r2, r1)]
        assert learned == [True, True, True, False, False]
        # The store away: each router's own bucket (full: nothing was taken from it).
        r1.learning.shared_rate = SharedQuotas(Unreachable.open(tmp_path / "down"), owner="w0.1",
                                               metrics=r1.metrics).may_learn
        assert [r1.learning._may_learn("acme", 100.0) for _ in range(4)] == [True, True, True, False]
        assert r1.metrics.quota_fallback.labels("learn")._value.get() == 4
    finally:
        r1.close_state()
        r2.close_state()


def test_a_stage_list_without_tenant_admission_is_left_as_it_is(shared):
    quotas = SharedQuotas(shared, owner="w0.1", metrics=RouterMetrics())
    stages = [s for s in DEFAULT_STAGES if s.name != "tenant_admission"]
    assert with_shared_quotas(stages, quotas) == stages


class Flaky(SqliteStore):
    """A store whose quota closes find it unreachable while ``down``."""

    down = False

    def quota_close(self, tenant: str, stream_id: str, *, owner: str) -> bool:
        if self.down:
            raise StoreUnavailable("redis at redis://127.0.0.1:1 unavailable: Connection refused")
        return super().quota_close(tenant, stream_id, owner=owner)


async def test_a_renewal_retries_a_failed_close_and_drops_what_the_router_does_not_hold(tmp_path):
    store = Flaky.open(tmp_path / "flaky")
    r, quotas = build(tmp_path, "w0.1", store)
    try:
        one, two = open_http(r), open_http(r)
        # An entry of this owner it does not hold: an open that timed out and ran later in the store.
        late = store.quota_open(QuotaAsk(ANONYMOUS.tenant, "late", 5, 50.0, 100), owner="w0.1",
                                now_ms=int(time.time() * 1000), ttl_ms=60_000)
        assert late.admitted and store.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 3
        store.down = True
        r.stream_closed(one.stop(ErrorCode.EPREEMPT, "cancelled"))  # its close cannot reach the store
        assert quotas.unreleased == {(ANONYMOUS.tenant, one.stream_id)}
        assert store.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 3
        store.down = False
        assert quotas.renew() == 1  # two's entry, renewed; one's close retried; the late one dropped
        assert quotas.unreleased == set() and store.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 1
        r.stream_closed(two.stop(ErrorCode.EPREEMPT, "cancelled"))
        assert store.quota_open_count(ANONYMOUS.tenant, now_ms=0) == 0
    finally:
        r.close_state()
        store.close()
