"""The sans-IO budget lease (:mod:`atp_router.flow.lease`, issue 22 item 2): what
a router may decide alone about its slice of a tenant's budget. Its one rule —
the slice as seen here never holds more than the store holds for it — is what
makes a call's charge known without the store's answer (:meth:`BudgetLease.certain`)
equal to the charge the store applies later.

The regression here: a slice given back (a shrink: the tenant near its limit,
or an idle slice trimmed) whose answer was slow or lost — a Redis restarted
mid-run — used to stay in :attr:`BudgetLease.hold` until answered, so a call
committed meanwhile was charged from budget the store had already taken back:
its FINAL reported more than the ledger charged, and a later commit's cap went
below 0 (a 3-router run on a restarted Redis, tests/scale/test_cluster_load.py)."""

from __future__ import annotations

from atp_router.flow.lease import BudgetLease


def _slice(tokens: int = 1_000) -> BudgetLease:
    lease = BudgetLease("client:t", limited=(True, False), aim=(tokens, 0))
    lease.ask("take-1", tokens, 0)
    lease.answered(7, tokens, 0)
    return lease


def test_a_grow_counts_once_answered_and_no_call_reserves_while_it_is_in_flight():
    lease = BudgetLease("client:t", limited=(True, False), aim=(1_000, 0))
    lease.ask("take-1", 1_000, 0)
    assert lease.free == (0, 0) and not lease.covers(10, 0)
    lease.answered(7, 600, 0)  # the store had only 600 free
    assert (lease.id, lease.take, lease.free) == (7, None, (600, 0))
    assert lease.covers(600, 0) and not lease.covers(601, 0)
    assert lease.covers(600, 10**12)  # the USD axis is not limited: every call fits on it


def test_a_shrink_leaves_the_slice_when_sent_not_when_answered():
    lease = _slice()
    lease.carve(100, 0, now=0.0)
    lease.ask("take-2", -900, 0)  # give back all that is free
    assert lease.free == (0, 0) and lease.hold_t == 100
    # A call committed while the shrink is unanswered: only its own reservation is the
    # router's to charge; its usage past it is the store's to decide (not certain).
    assert not lease.certain((100, 0), (101, 0)) and lease.certain((100, 0), (100, 0))
    assert lease.cap((100, 0)) == (100, 0)
    lease.answered(7, -900, 0)
    assert (lease.hold_t, lease.free, lease.take) == (100, (0, 0), None)


def test_a_shrink_the_store_applied_in_part_gives_the_rest_back_to_the_slice():
    lease = _slice()
    lease.ask("take-2", -900, 0)
    lease.answered(7, -400, 0)  # the store held less than was asked back: 500 stay in the slice
    assert (lease.hold_t, lease.free) == (600, (600, 0))


def test_a_cap_never_goes_below_the_calls_own_reservation():
    lease = _slice(100)
    lease.carve(100, 0, now=0.0)
    lease.alloc_t += 50  # books gone wrong: more held than the slice has
    assert lease.free == (-50, 0)
    assert lease.cap((100, 0)) == (100, 0) and not lease.certain((100, 0), (120, 0))


def test_a_certain_commit_takes_its_charge_off_the_slice_and_its_reservation_off_the_calls():
    lease = _slice()
    lease.carve(100, 0, now=0.0)
    assert lease.certain((100, 0), (900, 0))  # 800 past the reservation, 900 free
    cap = lease.cap((100, 0))
    lease.settle((100, 0), cap, (900, 0))
    assert (lease.hold_t, lease.alloc_t, lease.free) == (100, 0, (100, 0))


def test_a_slice_retires_between_calls_once_the_tenant_is_near_its_limit():
    """A router with no call to make gives its slice back as soon as it sees the
    tenant near its limit (a slice's free part is not another router's): the
    same rule that sizes a slice, checked on every tick of the lease service."""
    lease = _slice()
    lease.call = (100, 0)
    inf = float("inf")
    # 3 routers, 100-token calls: a slice pays while a quarter of a third of the free
    # budget holds 8 calls, i.e. from 9,600 tokens free.
    assert not lease.resize((9_600.0, inf), 3) and not lease.retired
    assert lease.resize((9_599.0, inf), 3) and lease.retired and not lease.covers(1, 0)
    assert not lease.resize((0.0, inf), 3)  # once
    fresh = BudgetLease("client:t", limited=(True, False), aim=(1_000, 0), call=(100, 0))
    assert not fresh.resize((0.0, inf), 3)  # not taken yet: nothing to give back
