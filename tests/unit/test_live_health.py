"""The FIB's live health view (``ControlPlane.health`` → ``LiveHealth``): a SYN's
lookup computes the health of the next-hops it reads, not of every agent of the
RIB; each next-hop's figure merges its adapter's and its breaker's as before."""

from __future__ import annotations

from atp_router.adapters.base import CallStats
from atp_router.flow.breaker import BreakerBoard
from atp_router.policy.health import Health
from atp_router.runtime.controlplane.control import LiveHealth


class _Adapter:
    live_health = False

    def __init__(self, up: bool = True) -> None:
        self.stats = CallStats()
        self.reads = 0
        self.up = up

    def health(self) -> Health:
        self.reads += 1
        h = self.stats.health()
        return Health(p95_ms=h.p95_ms, error_rate=h.error_rate, up=self.up)


def test_only_the_next_hops_looked_up_are_computed_once_each() -> None:
    adapters = {f"a{i}": _Adapter() for i in range(50)}
    adapters["a1"].stats.record(40.0, ok=False)
    view = LiveHealth(adapters, BreakerBoard(), 1.0)
    assert view.get("a1") == Health(p95_ms=40.0, error_rate=1.0, up=True)
    assert view.get("a1") is view["a1"]
    assert view.get("gone") is None
    assert [a.reads for a in adapters.values()] == [0, 1] + [0] * 48
    assert list(view) == list(adapters) and len(view) == 50


def test_an_adapter_down_flag_counts_only_when_it_recovers_by_itself() -> None:
    down = _Adapter(up=False)
    view = LiveHealth({"x": down}, BreakerBoard(), 1.0)
    assert view["x"].up  # nothing would call it again to find it back: the breaker decides
    down.live_health = True
    assert not LiveHealth({"x": down}, BreakerBoard(), 1.0)["x"].up
