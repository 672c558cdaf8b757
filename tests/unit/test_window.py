"""Flow-control windows with AIMD (spec §5, §9 gold minima, §10 EWINDOW)."""

from __future__ import annotations

import math

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

from atp_router.flow.window import Admission, Estimate, InFlight, Window
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import CostEstimate, QoS, WindowUpdate
from atp_router.wire.frame import Window as W


def est(tokens: int = 100, usd: int = 1_000) -> Estimate:
    return Estimate(tokens=tokens, usd_micros=usd)


def test_estimate_from_wire_cost():
    assert Estimate.from_cost(CostEstimate(in_tokens=3200, out_tokens=900, usd=0.012)) == Estimate(4100, 12_000)


@pytest.mark.parametrize(
    ("limits", "in_flight", "e", "reason"),
    [
        (W(2, 1000, 10_000), [], est(), None),
        (W(2, 1000, 10_000), [est(), est()], est(), "parallel: 3 would exceed window 2"),
        (W(4, 1000, 10_000), [est(900)], est(101), "tokens: 1001 would exceed window 1000"),
        (W(4, 1000, 10_000), [est(900)], est(100), None),
        (W(4, 1000, 10_000), [est(usd=9_000)], est(usd=1_001), "usd_micros: 10001 would exceed window 10000"),
        (W(4, 80, 10_000), [], est(81), "tokens: 81 would exceed window 80"),  # bigger than the whole window
        (W(0, 1000, 10_000), [], est(), "parallel: 1 would exceed window 0"),
    ],
)
def test_admit_table(limits, in_flight, e, reason):
    w = Window(limits)
    for x in in_flight:
        w.on_send(x)
    decision = w.admit(e)
    if reason is None:
        assert decision == Admission(admitted=True)
    else:
        assert decision == Admission(
            admitted=False, reason=reason, code=ErrorCode.EWINDOW, window_update=WindowUpdate(window=w.effective())
        )


def test_admit_changes_nothing_and_on_send_rechecks():
    w = Window(W(1, 1000, 10_000))
    assert w.admit(est()).admitted and w.admit(est()).admitted
    w.on_send(est())
    with pytest.raises(ATPError) as exc:
        w.on_send(est())
    assert exc.value.code is ErrorCode.EWINDOW
    assert (w.in_flight, w.tokens_in_flight, w.usd_micros_in_flight) == (1, 100, 1_000)


def test_gold_minimum_is_held_back_from_other_classes():
    w = Window(W(4, 1000, 10_000), gold_minimum=W(1, 200, 0))
    for _ in range(3):
        w.on_send(est(10), qos=QoS.BRONZE)
    refused = w.admit(est(10), qos=QoS.SILVER)
    assert not refused.admitted and refused.reason == "parallel: 4 would exceed window 4 (1 held for gold)"
    assert w.admit(est(10), qos=QoS.GOLD).admitted
    w2 = Window(W(4, 1000, 10_000), gold_minimum=W(0, 200, 0))
    assert not w2.admit(est(801), qos=QoS.BRONZE).admitted
    assert w2.admit(est(800), qos=QoS.BRONZE).admitted and w2.admit(est(1000), qos=QoS.GOLD).admitted


def complete(w: Window, call: InFlight, *, ok: bool = True, timely: bool = True) -> None:
    w.on_complete(call, call.est.tokens, call.est.usd_micros, ok=ok, timely=timely)


def test_slow_start_then_congestion_avoidance_exact():
    w = Window(W(8, 10**6, 10**6), initial_cwnd=1)
    assert (w.cwnd, w.ssthresh) == (1.0, 8.0)
    seen = []
    for _ in range(9):
        complete(w, w.on_send(est()))
        seen.append(w.cwnd)
    # slow start +1 per ACK up to ssthresh, then capped at max_parallel
    assert seen == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 8.0, 8.0]
    w.ssthresh = 2.0
    w.cwnd = 2.0
    complete(w, w.on_send(est()))
    assert w.cwnd == 2.5  # congestion avoidance: +1/cwnd
    complete(w, w.on_send(est()))
    assert w.cwnd == 2.9
    complete(w, w.on_send(est()))
    assert w.cwnd == pytest.approx(2.9 + 1 / 2.9)
    assert w.effective().max_parallel == 3


@pytest.mark.parametrize(("ok", "timely"), [(False, True), (True, False), (False, False)])
def test_multiplicative_decrease_on_failure_or_timeout(ok, timely):
    w = Window(W(8, 10**6, 10**6))
    assert w.cwnd == 8.0
    complete(w, w.on_send(est()), ok=ok, timely=timely)
    assert (w.cwnd, w.ssthresh) == (4.0, 4.0)
    complete(w, w.on_send(est()), ok=ok, timely=timely)
    complete(w, w.on_send(est()), ok=ok, timely=timely)
    complete(w, w.on_send(est()), ok=ok, timely=timely)
    assert (w.cwnd, w.ssthresh) == (1.0, 1.0)  # floor 1


def test_one_decrease_per_window_of_calls_in_flight():
    w = Window(W(8, 10**6, 10**6))
    calls = [w.on_send(est()) for _ in range(4)]
    for c in calls:  # a fan-out timing out together is one congestion event
        complete(w, c, timely=False)
    assert w.cwnd == 4.0
    later = w.on_send(est())
    complete(w, later, ok=False)  # sent after the decrease: counts again
    assert w.cwnd == 2.0


def test_cwnd_never_exceeds_max_parallel_and_set_limits_clamps():
    w = Window(W(3, 10**6, 10**6))
    for _ in range(10):
        complete(w, w.on_send(est()))
    assert w.cwnd == 3.0
    w.set_limits(W(2, 500, 5_000))
    assert (w.cwnd, w.effective()) == (2.0, W(2, 500, 5_000))
    w.set_limits(W(0, 500, 5_000))
    assert w.cwnd == 1.0 and w.effective().max_parallel == 0


def test_on_complete_unknown_call():
    w = Window(W(2, 1000, 10_000))
    c = w.on_send(est())
    complete(w, c)
    with pytest.raises(ValueError, match="not in flight"):
        complete(w, c)
    with pytest.raises(ValueError, match="not in flight"):
        Window(W(2, 1000, 10_000)).on_complete(c, 0, 0, ok=True, timely=True)


def test_statistics_counts_actuals():
    w = Window(W(2, 1000, 10_000))
    c = w.on_send(est(100, 1_000))
    w.on_complete(c, 130, 1_200, ok=True, timely=True)
    s = w.statistics()
    assert (s.in_flight, s.tokens_in_flight, s.completed, s.used_tokens, s.used_usd_micros) == (0, 0, 1, 130, 1_200)


def test_window_update_cadence_timer():
    w = Window(W(4, 1000, 10_000), update_interval_ms=1000)
    assert w.next_update_at() == -math.inf
    assert w.update_due(10.0) == WindowUpdate(window=W(4, 1000, 10_000))  # first one at once
    assert w.update_due(10.5) is None
    assert w.next_update_at() == 11.0
    assert w.update_due(10.999) is None
    assert w.update_due(11.0) == WindowUpdate(window=W(4, 1000, 10_000))  # periodic, even unchanged
    assert w.next_update_at() == 12.0


def test_window_update_unchanged_waits_for_the_keepalive():
    """An unchanged window is re-sent only every update_keepalive_ms (issue 24: 40
    identical updates during one stalled call); any change, even below
    update_delta, goes out at the next periodic check."""
    w = Window(W(10, 1000, 10_000), update_interval_ms=1000, update_keepalive_ms=5000)
    assert w.update_due(0.0) is not None
    for t in (1.0, 2.0, 3.0, 4.0):
        assert w.next_update_at() == t
        assert w.update_due(t) is None  # checked, unchanged: nothing sent, the next check a period on
    assert w.update_due(4.5) is None
    assert w.update_due(5.0) == WindowUpdate(window=W(10, 1000, 10_000))  # the keep-alive
    w.cwnd = 9.0  # 10 %: below the delta that sends at once
    assert w.update_due(5.5) is None
    assert w.update_due(6.0) == WindowUpdate(window=W(9, 1000, 10_000))  # but sent at the next check
    assert w.update_due(7.0) is None
    with pytest.raises(ValueError, match="keepalive"):
        Window(W(1, 1, 1), update_interval_ms=1000, update_keepalive_ms=999)


def test_window_update_on_20_percent_delta():
    w = Window(W(10, 1000, 10_000))
    w.update_due(0.0)
    w.cwnd = 9.0  # 10 → 9: 10 %, not yet
    assert w.update_due(0.1) is None
    w.cwnd = 8.0  # 10 → 8: exactly 20 % of what was last sent
    assert w.update_due(0.2) == WindowUpdate(window=W(8, 1000, 10_000))
    w.set_limits(W(10, 1000, 8_001))  # usd moved 19.99 %
    assert w.update_due(0.3) is None
    w.set_limits(W(10, 1000, 12_000))  # +20 %
    assert w.update_due(0.4) is not None


def test_window_update_from_zero_is_due():
    w = Window(W(0, 1000, 0))
    w.update_due(0.0)
    w.set_limits(W(0, 1000, 1))
    assert w.update_due(0.1) == WindowUpdate(window=W(0, 1000, 1))


def test_window_update_after_decrease():
    w = Window(W(4, 1000, 10_000))
    w.update_due(0.0)
    complete(w, w.on_send(est()), ok=False)
    assert w.update_due(0.01) == WindowUpdate(window=W(2, 1000, 10_000))


class WindowMachine(RuleBasedStateMachine):
    @initialize(
        par=st.integers(0, 8), toks=st.integers(0, 2000), usd=st.integers(0, 20_000), start=st.sampled_from([None, 1])
    )
    def setup(self, par, toks, usd, start):
        self.w = Window(W(par, toks, usd), initial_cwnd=start)
        self.calls: list[InFlight] = []

    @rule(tokens=st.integers(0, 800), usd=st.integers(0, 8_000), qos=st.sampled_from(list(QoS)))
    def send(self, tokens, usd, qos):
        e = est(tokens, usd)
        if self.w.admit(e, qos=qos).admitted:
            self.calls.append(self.w.on_send(e, qos=qos))
        else:
            with pytest.raises(ATPError):
                self.w.on_send(e, qos=qos)

    @precondition(lambda self: self.calls)
    @rule(data=st.data(), ok=st.booleans(), timely=st.booleans())
    def complete(self, data, ok, timely):
        before = self.w.cwnd
        call = self.calls.pop(data.draw(st.integers(0, len(self.calls) - 1)))
        complete(self.w, call, ok=ok, timely=timely)
        assert (self.w.cwnd >= before) if ok and timely else (self.w.cwnd <= before)

    @invariant()
    def within_window(self):
        w, lim = self.w, self.w.limits
        assert 1.0 <= w.cwnd <= max(1, lim.max_parallel)
        assert w.in_flight == len(self.calls) <= max(lim.max_parallel, 0)
        assert w.tokens_in_flight == sum(c.est.tokens for c in self.calls) <= lim.max_tokens
        assert w.usd_micros_in_flight == sum(c.est.usd_micros for c in self.calls) <= lim.max_usd_micros


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
