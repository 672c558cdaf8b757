"""The lease decisions of a cluster router (atp_router.deploy.cluster.LeaseClock, sans-IO):
its lease thread renews while the trio loop ticks — also when the loop is busy
for many leases —, stops when the loop has not ticked for ``stall_s`` (the router
cannot serve: the others settle it), and a renewal after a gap of 0.8 lease or
more makes a fence due, during which queued writes wait (issue 12, finding 3)."""

from __future__ import annotations

import pytest

from atp_router.deploy.cluster import LeaseClock
from atp_router.store import StoreUnavailable

LEASE_MS = 1500


def _renew_every_period(clock: LeaseClock, start: float, until: float) -> float:
    """The thread renewing every period from ``start`` to ``until`` (the loop not ticking); the last time."""
    t = start
    while t + clock.period_s <= until:
        t += clock.period_s
        assert clock.should_renew(t)
        assert clock.renewed(t, {}) is None
    return t


def test_a_busy_loop_keeps_its_lease_and_writes_flow():
    clock = LeaseClock(LEASE_MS, now=0.0)
    assert clock.stall_s == 30.0 and clock.period_s == pytest.approx(0.3)
    # The trio loop blocked for over 10 leases (16 s): the thread renews all along, no fence is due.
    t = _renew_every_period(clock, 0.0, 16.0)
    assert t > 10 * clock.lease_s and not clock.fence_due
    assert clock.writes_allowed(t + 0.1)
    clock.tick(t + 0.1)
    assert clock.should_renew(t + 0.2)


def test_a_wedged_loop_lets_the_lease_lapse_and_fences_when_it_runs_again():
    clock = LeaseClock(LEASE_MS, now=0.0)
    t = _renew_every_period(clock, 0.0, clock.stall_s - 0.01)
    assert not clock.should_renew(clock.stall_s)  # not ticked for stall_s: the thread stops renewing
    assert clock.writes_allowed(t + 0.8 * clock.lease_s - 0.01)
    assert not clock.writes_allowed(t + 0.8 * clock.lease_s + 0.01)  # the lease may be lapsing: writes wait
    later = clock.stall_s + 20.0
    clock.tick(later)  # the loop runs again
    assert clock.should_renew(later)
    gap = clock.renewed(later + 0.3, {"r.x": {"url": "http://x"}})
    assert gap == pytest.approx(later + 0.3 - t)
    assert clock.fence_due and not clock.writes_allowed(later + 0.3)
    seq = clock.fence_seq
    clock.fenced(seq)
    assert not clock.fence_due and clock.writes_allowed(later + 0.4)
    assert clock.peers == {"r.x": {"url": "http://x"}}


def test_a_store_outage_past_0_8_lease_makes_a_fence_due():
    clock = LeaseClock(LEASE_MS, now=0.0)
    clock.renewed(0.3, {})
    err = StoreUnavailable("redis down")
    for i in range(1, 5):
        clock.failed(0.3 + 0.3 * i, err)
    assert clock.failures == 4 and clock.error is err and clock.error_at == pytest.approx(1.5)
    assert not clock.fence_due
    assert clock.renewed(1.8, {}) == pytest.approx(1.5)  # 1.5 s >= 0.8 × 1.5 s
    assert clock.fence_due
    # A short outage (under 0.8 lease) makes none.
    clock.fenced(clock.fence_seq)
    clock.failed(2.1, err)
    assert clock.renewed(2.4, {}) is None and not clock.fence_due


def test_a_fence_requested_while_one_runs_is_not_lost():
    clock = LeaseClock(LEASE_MS, now=0.0)
    clock.request_fence()
    seq = clock.fence_seq  # the trio side starts fencing for this one
    clock.request_fence()  # the ledger finds another settled account meanwhile
    clock.fenced(seq)
    assert clock.fence_due and not clock.writes_allowed(0.1)
    clock.fenced(clock.fence_seq)
    assert not clock.fence_due and clock.writes_allowed(0.1)


def test_bad_lease():
    with pytest.raises(ValueError, match="lease_ms"):
        LeaseClock(0, now=0.0)
    assert LeaseClock(10_000, now=0.0).stall_s == 60.0  # 6 leases when longer than 30 s


def test_a_new_lease_epoch_makes_a_fence_due_and_is_adopted_after_it():
    """Another router settled this one (the store's lease epoch grew) while its
    renewals never had a gap: a fence is due all the same, writes wait, and the
    new epoch is adopted once the fence is done — not before."""
    clock = LeaseClock(LEASE_MS, now=0.0)
    assert clock.renewed(0.3, {}, 0) is None and clock.adopted == 0
    assert clock.adopt() is None
    gap = clock.renewed(0.6, {}, 1)  # no gap: only the epoch says so
    assert gap == pytest.approx(0.3)
    assert clock.fence_due and not clock.writes_allowed(0.61) and clock.adopted == 0
    clock.renewed(0.9, {}, 1)  # renewed again before the fence ran: one more fence due, same epoch
    clock.fenced(clock.fence_seq)
    assert clock.adopt() == 1 and clock.adopted == 1
    assert not clock.fence_due and clock.writes_allowed(1.0)
    assert clock.renewed(1.2, {}, 1) is None and clock.adopt() is None
