"""The shared-quota decision (:mod:`atp_router.flow.quota`, issue 22 item 3) as a table:
the tenant's state in the store (its open entries, whether this stream holds one,
its open-rate GCRA time) and one SYN's ask → the grant and the rate time to store.
Plus GCRA against the router's own token bucket: the same opens pass."""

from __future__ import annotations

import pytest

from atp_router.flow.quota import QuotaAsk, QuotaGrant, decide, gcra
from atp_router.policy.rib import RateSpec
from atp_router.security.authz import StreamAdmission

NOW = 1_000_000.0

# (open_now, held, tat_ms, max_streams, per_s, burst) -> (grant, tat stored)
CASES = [
    # room and a full bucket: admitted, one interval (20 ms at 50/s) on the clock
    ((0, False, None, 4, 50.0, 10), (QuotaGrant(True, 1), NOW + 20)),
    ((3, False, None, 4, 50.0, 10), (QuotaGrant(True, 4), NOW + 20)),
    # at the quota: refused for the streams, the rate untouched
    ((4, False, None, 4, 50.0, 10), (QuotaGrant(False, 4, "streams"), None)),
    ((9, False, NOW + 500, 4, 50.0, 10), (QuotaGrant(False, 9, "streams"), None)),
    # a tat in the past counts from now (the bucket refilled)
    ((0, False, NOW - 5_000, 4, 50.0, 10), (QuotaGrant(True, 1), NOW + 20)),
    # burst 10 at 50/s: a tat 180 ms ahead leaves one more (200 ms = 10 intervals) ...
    ((0, False, NOW + 180, 4, 50.0, 10), (QuotaGrant(True, 1), NOW + 200)),
    # ... 200 ms ahead is empty: refused with the wait for one interval
    ((0, False, NOW + 200, 4, 50.0, 10), (QuotaGrant(False, 0, "rate", 20), None)),
    ((0, False, NOW + 210.5, 4, 50.0, 10), (QuotaGrant(False, 0, "rate", 31), None)),
    # a stream it already holds (a retried ask): admitted, counted once, no rate taken
    ((4, True, NOW + 999_999, 4, 50.0, 10), (QuotaGrant(True, 4), None)),
    # max_streams 0: nothing opens
    ((0, False, None, 0, 50.0, 10), (QuotaGrant(False, 0, "streams"), None)),
    # burst 1 at 1/s: one, then a second's wait
    ((0, False, NOW + 1_000, 8, 1.0, 1), (QuotaGrant(False, 0, "rate", 1_000), None)),
]


@pytest.mark.parametrize(("state", "expected"), CASES)
def test_decide(state, expected):
    open_now, held, tat, max_streams, per_s, burst = state
    got = decide(open_now=open_now, held=held, tat_ms=tat, now_ms=NOW,
                 ask=QuotaAsk("alice", "s1", max_streams, per_s, burst))
    assert got == expected


@pytest.mark.parametrize(("per_s", "burst"), [(50.0, 100), (2.0, 3), (0.5, 1), (1_000.0, 5)])
def test_gcra_passes_what_the_routers_token_bucket_passes(per_s, burst):
    """Over a run of opens at uneven times, the shared GCRA admits exactly the
    opens the single router's token bucket (StreamAdmission) admits."""
    rate = RateSpec(per_s=per_s, burst=burst)
    bucket = StreamAdmission()
    tat: float | None = None
    times = [i * 0.37 / per_s * (1 + (i % 3)) / 2 for i in range(60)] + [100 / per_s + i * 0.01 for i in range(20)]
    times.sort()
    for t in times:
        now_ms = t * 1000.0
        new, wait = gcra(tat, now_ms, per_s, burst)
        local = bucket._take("alice", rate, t)
        assert (new is not None) == (local is None), (t, tat)
        if new is not None:
            tat = new
        else:
            assert wait is not None and wait >= 1
            assert abs(wait - local * 1000) <= 1.0 + 1e-6  # the same wait, rounded up to whole ms
