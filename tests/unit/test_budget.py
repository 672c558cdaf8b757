"""Budget governor: reserve → commit ledger (spec §5.1, §4.3 BUDGET_UPDATE, §10 EBUDGET)."""

from __future__ import annotations

from decimal import Decimal

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from atp_router.flow.budget import (
    AccountState,
    Allowance,
    BudgetLedger,
    Charge,
    LedgerSnapshot,
    Refusal,
    Reservation,
    micros_to_usd,
    usd_to_micros,
)
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Budget


@pytest.mark.parametrize(
    ("usd", "micros"),
    [
        (0, 0),
        (0.0, 0),
        (-0.0, 0),
        (1, 1_000_000),
        (2.5, 2_500_000),
        (0.91, 910_000),  # float read through repr: not 909_999
        (0.1 + 0.2, 300_000),  # 0.30000000000000004
        (0.0000005, 0),  # half-even: ties go to the even micro
        (0.0000015, 2),
        (0.0000025, 2),
        (0.0000035, 4),
        (0.00000051, 1),
        ("0.0000045", 4),
        (Decimal("12.3456785"), 12_345_678),
        (1e-7, 0),
    ],
)
def test_usd_to_micros_round_half_even(usd, micros):
    assert usd_to_micros(usd) == micros


@pytest.mark.parametrize("bad", [-0.01, float("nan"), float("inf"), "abc", Decimal(-1)])
def test_usd_to_micros_refuses(bad):
    with pytest.raises(ValueError):
        usd_to_micros(bad)


def test_micros_to_usd():
    assert micros_to_usd(910_000) == 0.91
    assert micros_to_usd(0) == 0.0


def test_allowance_from_wire_budget():
    assert Allowance.from_budget(Budget(usd=2.5, tokens=800_000)) == Allowance(tokens=800_000, usd_micros=2_500_000)
    assert Allowance.from_budget(Budget()) == Allowance()


def ledger() -> BudgetLedger:
    lg = BudgetLedger()
    lg.open("client", Allowance(tokens=1000, usd_micros=10_000))
    lg.open("s1", Allowance(tokens=600, usd_micros=8_000), parent="client")
    lg.open("s2", Allowance(usd_micros=8_000), parent="client")
    return lg


def test_reserve_commit_release_roundtrip():
    lg = ledger()
    r = lg.reserve("s1", 100, 1_000)
    assert isinstance(r, Reservation)
    assert lg.remaining("s1") == Allowance(tokens=500, usd_micros=7_000)
    assert lg.remaining("client") == Allowance(tokens=900, usd_micros=9_000)
    assert lg.commit(r, 80, 700) == Charge(tokens=80, usd_micros=700)
    assert lg.remaining("s1") == Allowance(tokens=520, usd_micros=7_300)
    st_ = lg.state("client")
    assert (st_.committed_tokens, st_.committed_usd_micros, st_.reserved_tokens, st_.reserved_usd_micros) == (
        80,
        700,
        0,
        0,
    )
    r2 = lg.reserve("s2", 10, 10)
    lg.release(r2)
    assert lg.state("s2").reserved_usd_micros == 0 and lg.state("s2").committed_usd_micros == 0


def test_reserve_must_fit_the_whole_chain_atomically():
    lg = ledger()
    a = lg.reserve("s1", 0, 6_000)
    assert isinstance(a, Reservation)
    # s2 alone has 8_000, but the client has only 4_000 left.
    refused = lg.reserve("s2", 0, 5_000)
    assert isinstance(refused, Refusal)
    assert refused.code is ErrorCode.EBUDGET and refused.key == "client"
    assert refused.remaining == Allowance(tokens=1000, usd_micros=4_000)
    assert "client" in refused.reason and "4000 usd_micros" in refused.reason
    # Nothing was held on s2 by the refused attempt.
    assert lg.state("s2").reserved_usd_micros == 0
    assert lg.remaining("s2") == Allowance(tokens=1000, usd_micros=4_000)  # s2 has no own token limit


def test_refusal_names_the_nearest_account_first():
    lg = ledger()
    refused = lg.reserve("s1", 700, 0)
    assert isinstance(refused, Refusal) and refused.key == "s1"


def test_commit_above_reservation_charges_only_what_the_chain_can_take():
    lg = ledger()
    other = lg.reserve("s2", 0, 3_000)  # another stream's hold must survive
    r = lg.reserve("s1", 100, 5_000)
    assert isinstance(other, Reservation) and isinstance(r, Reservation)
    # s1 may take up to 8_000, the client has 10_000 - 3_000 held = 7_000 for it.
    charge = lg.commit(r, 100, 9_500)
    assert charge == Charge(tokens=100, usd_micros=7_000, overage_tokens=0, overage_usd_micros=2_500)
    c = lg.state("client")
    assert c.committed_usd_micros + c.reserved_usd_micros == 10_000
    assert c.overage_usd_micros == 2_500 and lg.state("s1").overage_usd_micros == 2_500
    assert lg.commit(other, 0, 3_000) == Charge(tokens=0, usd_micros=3_000)


def test_commit_within_reservation_is_always_charged_in_full():
    lg = ledger()
    r = lg.reserve("s1", 600, 8_000)
    assert isinstance(r, Reservation)
    assert lg.commit(r, 600, 8_000) == Charge(tokens=600, usd_micros=8_000)
    assert lg.remaining("s1") == Allowance(tokens=0, usd_micros=0)
    assert isinstance(lg.reserve("s1", 0, 1), Refusal)
    assert isinstance(lg.reserve("s1", 0, 0), Reservation)  # zero always fits


def test_settling_twice_or_forged_is_an_error():
    lg = ledger()
    r = lg.reserve("s1", 1, 1)
    assert isinstance(r, Reservation)
    lg.release(r)
    with pytest.raises(ValueError, match="not open"):
        lg.commit(r, 1, 1)
    with pytest.raises(ValueError, match="not open"):
        lg.release(r)
    r2 = lg.reserve("s1", 1, 1)
    assert isinstance(r2, Reservation)
    with pytest.raises(ValueError, match="not open"):
        lg.release(Reservation(id=r2.id, key="s1", tokens=0, usd_micros=0))


def test_usage_errors():
    lg = ledger()
    with pytest.raises(ValueError, match="no budget account"):
        lg.reserve("nope", 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        lg.reserve("s1", -1, 0)
    with pytest.raises(ValueError, match="already open"):
        lg.open("s1", Allowance())
    with pytest.raises(ValueError, match="no budget account"):
        lg.open("s3", Allowance(), parent="ghost")


def test_close_keeps_spend_in_the_parent():
    lg = ledger()
    r = lg.reserve("s1", 10, 100)
    assert isinstance(r, Reservation)
    with pytest.raises(ValueError, match="open reservation"):
        lg.close("s1")
    with pytest.raises(ValueError, match="child account"):
        lg.close("client")
    lg.commit(r, 10, 100)
    final = lg.close("s1")
    assert (final.committed_tokens, final.committed_usd_micros, final.parent) == (10, 100, "client")
    assert lg.state("client").committed_usd_micros == 100
    lg.close("s2")
    lg.close("client")
    with pytest.raises(ValueError):
        lg.state("client")


def test_set_limit_raise_and_refused_lowering():
    lg = ledger()
    r = lg.reserve("s1", 0, 8_000)
    assert isinstance(r, Reservation)
    assert isinstance(lg.reserve("s1", 0, 1), Refusal)
    assert lg.set_limit("s1", Allowance(tokens=600, usd_micros=9_000)) is None
    assert isinstance(lg.reserve("s1", 0, 1_000), Reservation)
    refused = lg.set_limit("s1", Allowance(tokens=600, usd_micros=8_999))
    assert isinstance(refused, Refusal) and refused.key == "s1"
    assert lg.state("s1").limit == Allowance(tokens=600, usd_micros=9_000)
    assert lg.set_limit("s1", Allowance()) is None  # unlimited: only the client caps it now
    assert lg.remaining("s1") == Allowance(tokens=1000, usd_micros=1_000)


def test_unlimited_chain():
    lg = BudgetLedger()
    lg.open("c", Allowance())
    lg.open("s", Allowance(), parent="c")
    assert lg.remaining("s") == Allowance()
    r = lg.reserve("s", 10**12, 10**12)
    assert isinstance(r, Reservation)
    assert lg.commit(r, 2 * 10**12, 1) == Charge(tokens=2 * 10**12, usd_micros=1)


class RecordingJournal:
    """A LedgerJournal that keeps the calls it got, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_open(self, key, parent, limit):
        self.calls.append(("open", key, parent, limit))

    def on_close(self, key):
        self.calls.append(("close", key))

    def on_reserve(self, reservation):
        self.calls.append(("reserve", reservation))

    def on_extend(self, reservation):
        self.calls.append(("extend", reservation))

    def on_commit(self, reservation, charge):
        self.calls.append(("commit", reservation, charge))

    def on_release(self, reservation):
        self.calls.append(("release", reservation))

    def on_set_limit(self, key, limit):
        self.calls.append(("set_limit", key, limit))


def test_journal_sees_every_successful_mutation_in_order():
    j = RecordingJournal()
    lg = BudgetLedger(journal=j)
    lg.open("c", Allowance(tokens=100))
    lg.open("s", Allowance(), parent="c")
    r = lg.reserve("s", 10, 5)
    g = lg.extend(r, 5, 0)
    ch = lg.commit(g, 12, 3)
    r2 = lg.reserve("s", 1, 0)
    lg.release(r2)
    assert lg.set_limit("c", Allowance(tokens=5), clamp=True) is None  # clamped to what is held
    lg.close("s")
    assert j.calls == [
        ("open", "c", None, Allowance(tokens=100)),
        ("open", "s", "c", Allowance()),
        ("reserve", r),
        ("extend", Reservation(id=r.id, key="s", tokens=15, usd_micros=5)),
        ("commit", g, ch),
        ("reserve", r2),
        ("release", r2),
        ("set_limit", "c", Allowance(tokens=12)),
        ("close", "s"),
    ]


def test_journal_not_told_of_refusals_or_errors():
    j = RecordingJournal()
    lg = BudgetLedger()
    lg.open("c", Allowance(tokens=10))
    lg.journal = j  # may be attached later
    r = lg.reserve("c", 10, 0)
    n = len(j.calls)
    assert isinstance(lg.reserve("c", 1, 0), Refusal)
    assert isinstance(lg.extend(r, 1, 0), Refusal)
    assert isinstance(lg.set_limit("c", Allowance(tokens=1)), Refusal)
    with pytest.raises(ValueError):
        lg.open("c", Allowance())
    with pytest.raises(ValueError):
        lg.close("c")
    lg.release(r)
    with pytest.raises(ValueError):
        lg.commit(r, 1, 0)
    assert j.calls[n:] == [("release", r)]


def test_snapshot_restore_roundtrip():
    lg = BudgetLedger()
    lg.open("client:b", Allowance(tokens=1_000, usd_micros=9_000))
    lg.open("stream:z", Allowance(tokens=500), parent="client:b")
    lg.open("stream:a", Allowance(), parent="client:b")
    lg.commit(lg.reserve("stream:z", 100, 100), 400, 50)
    open1 = lg.reserve("stream:a", 30, 3)
    open2 = lg.extend(lg.reserve("stream:z", 20, 2), 5, 0)
    snap = lg.snapshot()
    assert [a.key for a in snap.accounts] == ["client:b", "stream:a", "stream:z"]  # depth, then key
    assert snap.reservations == (open1, open2) and snap.next_id == 4
    # It survives an encode/decode, as a store would do.
    snap = msgspec.json.decode(msgspec.json.encode(snap), type=LedgerSnapshot)
    back = BudgetLedger()
    back.restore(snap)
    assert back.snapshot() == snap
    assert back.remaining("stream:z") == lg.remaining("stream:z")
    back.commit(open2, 25, 2)  # the restored reservations settle
    assert back.reserve("stream:a", 1, 0).id == 4  # ids are not reused
    with pytest.raises(ValueError, match="empty ledger"):
        back.restore(snap)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: msgspec.structs.replace(s, accounts=s.accounts[::-1]), "not before it"),
        (lambda s: msgspec.structs.replace(s, accounts=(s.accounts[0], s.accounts[0])), "appears twice"),
        (lambda s: msgspec.structs.replace(s, reservations=(*s.reservations, s.reservations[0])), "appears twice"),
        (lambda s: msgspec.structs.replace(
            s, reservations=(Reservation(id=9, key="nobody", tokens=1, usd_micros=0),)), "unknown account"),
        (lambda s: msgspec.structs.replace(s, reservations=()), "other reservations"),
        (lambda s: msgspec.structs.replace(
            s, reservations=(Reservation(id=1, key="s", tokens=-1, usd_micros=0),)), ">= 0"),
    ],
)
def test_restore_refuses_inconsistent_snapshots(edit, match):
    lg = BudgetLedger()
    lg.open("c", Allowance(tokens=10))
    lg.open("s", Allowance(), parent="c")
    lg.reserve("s", 3, 0)
    back = BudgetLedger()
    with pytest.raises(ValueError, match=match):
        back.restore(edit(lg.snapshot()))
    assert back.snapshot() == LedgerSnapshot(accounts=(), reservations=(), next_id=1)  # left empty
    back.restore(lg.snapshot())
    assert isinstance(back.state("c"), AccountState)


class LedgerMachine(RuleBasedStateMachine):
    """Random interleavings of reserve/commit/release over many streams under one
    client: the limits are never passed and nothing leaks."""

    @initialize(
        client_t=st.integers(0, 5_000),
        client_u=st.integers(0, 50_000),
        streams=st.lists(
            st.tuples(st.none() | st.integers(0, 3_000), st.none() | st.integers(0, 30_000)), min_size=1, max_size=6
        ),
    )
    def setup(self, client_t, client_u, streams):
        self.lg = BudgetLedger()
        self.lg.open("client", Allowance(tokens=client_t, usd_micros=client_u))
        self.streams = []
        for i, (t, u) in enumerate(streams):
            self.lg.open(f"s{i}", Allowance(tokens=t, usd_micros=u), parent="client")
            self.streams.append(f"s{i}")
        self.open: list[Reservation] = []
        self.charged: dict[str, list[int]] = {k: [0, 0] for k in ["client", *self.streams]}

    @rule(data=st.data(), tokens=st.integers(0, 2_000), usd=st.integers(0, 20_000))
    def reserve(self, data, tokens, usd):
        key = data.draw(st.sampled_from(self.streams))
        before = self.lg.remaining(key)
        r = self.lg.reserve(key, tokens, usd)
        fits = (before.tokens is None or tokens <= before.tokens) and (
            before.usd_micros is None or usd <= before.usd_micros
        )
        assert isinstance(r, Reservation) == fits
        if isinstance(r, Reservation):
            self.open.append(r)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), scale=st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]))
    def commit(self, data, scale):
        r = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        actual_t, actual_u = int(r.tokens * scale) + (scale > 1), int(r.usd_micros * scale)
        charge = self.lg.commit(r, actual_t, actual_u)
        assert charge.tokens + charge.overage_tokens == actual_t
        assert charge.usd_micros + charge.overage_usd_micros == actual_u
        assert charge.tokens >= min(actual_t, r.tokens) and charge.usd_micros >= min(actual_u, r.usd_micros)
        for k in (r.key, "client"):
            self.charged[k][0] += charge.tokens
            self.charged[k][1] += charge.usd_micros

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def release(self, data):
        self.lg.release(self.open.pop(data.draw(st.integers(0, len(self.open) - 1))))

    @invariant()
    def within_limits(self):
        held_t = held_u = 0
        for key in ["client", *self.streams]:
            s = self.lg.state(key)
            assert (s.committed_tokens, s.committed_usd_micros) == tuple(self.charged[key])
            if s.limit.tokens is not None:
                assert s.committed_tokens <= s.limit.tokens
                assert s.committed_tokens + s.reserved_tokens <= s.limit.tokens
            if s.limit.usd_micros is not None:
                assert s.committed_usd_micros <= s.limit.usd_micros
                assert s.committed_usd_micros + s.reserved_usd_micros <= s.limit.usd_micros
            if key != "client":
                held_t += s.reserved_tokens
                held_u += s.reserved_usd_micros
        c = self.lg.state("client")
        assert (c.reserved_tokens, c.reserved_usd_micros) == (held_t, held_u)
        assert c.open_reservations == 0
        assert sum(self.lg.state(k).open_reservations for k in self.streams) == len(self.open)

    @invariant()
    def snapshot_restores_the_same_ledger(self):
        back = BudgetLedger()
        back.restore(self.lg.snapshot())
        assert back.snapshot() == self.lg.snapshot()

    def teardown(self):
        for r in self.open:
            self.lg.release(r)
        for key in ["client", *self.streams]:
            s = self.lg.state(key)
            assert (s.reserved_tokens, s.reserved_usd_micros, s.open_reservations) == (0, 0, 0)
        for key in self.streams:
            self.lg.close(key)
        self.lg.close("client")


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
