"""Circuit breakers per next-hop and bounded retries (spec §5.3, §10 ETIMEOUT / EAGENTDOWN)."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.flow.breaker import (
    PEER_FAILURES,
    TRANSITIONS,
    BreakerBoard,
    BreakerEvent,
    BreakerHealth,
    BreakerState,
    CircuitBreaker,
    Fault,
    Origin,
    RetryPolicy,
    attribute,
)
from atp_router.wire.errors import ErrorCode

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
LEGAL = {(s, new) for (s, _), new in TRANSITIONS.items()}


def trip(b: CircuitBreaker, now: float, code: ErrorCode | None = ErrorCode.ETIMEOUT) -> None:
    for _ in range(b.failure_threshold):
        b.on_failure(now, code)


def expected_backoffs(seed: int, base: float, cap: float, jitter: float, n: int) -> list[float]:
    """The backoffs a breaker seeded with ``seed`` must draw: min(cap, base·2^k)·(1 ± jitter), ≤ cap."""
    r = random.Random(seed)
    return [min(cap, min(cap, base * 2**k) * (1 + r.uniform(-jitter, jitter))) for k in range(n)]


def test_transition_table_is_the_documented_graph():
    assert TRANSITIONS == {
        (CLOSED, BreakerEvent.TRIP): OPEN,
        (OPEN, BreakerEvent.BACKOFF_ELAPSED): HALF_OPEN,
        (HALF_OPEN, BreakerEvent.PROBE_SUCCEEDED): CLOSED,
        (HALF_OPEN, BreakerEvent.PROBE_FAILED): OPEN,
        (CLOSED, BreakerEvent.REMOTE_TRIP): OPEN,
        (HALF_OPEN, BreakerEvent.REMOTE_TRIP): OPEN,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_threshold": 0},
        {"half_open_probes": 0},
        {"window_s": 0.0},
        {"base_backoff_s": 0.0},
        {"base_backoff_s": 10.0, "max_backoff_s": 5.0},
        {"jitter": 1.0},
        {"jitter": -0.1},
    ],
)
def test_invalid_configuration_is_refused(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)
    with pytest.raises(ValueError):
        BreakerBoard(**kwargs)


# --- CLOSED → OPEN -----------------------------------------------------------------------------


def test_closed_trips_on_threshold_failures_within_the_window():
    b = CircuitBreaker(failure_threshold=3, window_s=10.0, rng=random.Random(1))
    b.on_failure(0.0, ErrorCode.ETIMEOUT)
    b.on_failure(4.0, ErrorCode.EAGENTDOWN)
    assert b.state(4.0) is CLOSED and b.allow(4.0)
    b.on_failure(10.0, None)  # 5xx: unclassified, counts; 0.0 .. 10.0 is within 10 s
    assert b.state(10.0) is OPEN
    assert b.statistics().trips == 1


def test_failures_spread_wider_than_the_window_do_not_trip():
    b = CircuitBreaker(failure_threshold=3, window_s=10.0)
    for t in (0.0, 6.0, 10.5, 17.0, 21.0):  # any 3 consecutive span > 10 s
        b.on_failure(t, ErrorCode.ETIMEOUT)
        assert b.state(t) is CLOSED
    b.on_failure(25.0, ErrorCode.ETIMEOUT)  # 17, 21, 25
    assert b.state(25.0) is OPEN


def test_successes_do_not_reset_the_failure_window():
    b = CircuitBreaker(failure_threshold=2, window_s=5.0)
    b.on_failure(0.0, ErrorCode.ETIMEOUT)
    b.on_success(1.0)
    b.on_failure(2.0, ErrorCode.ETIMEOUT)
    assert b.state(2.0) is OPEN


@pytest.mark.parametrize("code", sorted(set(ErrorCode) - PEER_FAILURES))
def test_our_own_limits_do_not_count_against_the_peer(code):
    b = CircuitBreaker(failure_threshold=1)
    b.on_failure(0.0, code)
    assert b.state(0.0) is CLOSED
    assert (b.statistics().failures, b.statistics().ignored) == (0, 1)


@pytest.mark.parametrize("code", [ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN, ErrorCode.EPROTO, None])
def test_peer_failures_count(code):
    b = CircuitBreaker(failure_threshold=1)
    b.on_failure(0.0, code)
    assert b.state(0.0) is OPEN


@pytest.mark.parametrize("code", [ErrorCode.EPROTO, ErrorCode.EAGENTDOWN, ErrorCode.ETIMEOUT, None])
def test_client_faults_never_count_whatever_their_code(code):
    # Five tasks with a refused file path (issue 7): the client's input failed, not the peer.
    b = CircuitBreaker(failure_threshold=5, window_s=30.0)
    for i in range(50):
        b.on_failure(i * 0.1, code, client_fault=True)
    stats = b.statistics(5.0)
    assert (stats.state, stats.failures, stats.ignored, stats.trips, stats.error_rate) == (CLOSED, 0, 50, 0, 0.0)
    # A real peer fault still trips it, client faults interleaved or not.
    for i in range(5):
        b.on_failure(6.0 + i * 0.1, ErrorCode.EPROTO)
        b.on_failure(6.0 + i * 0.1, ErrorCode.EPROTO, client_fault=True)
    assert b.state(6.5) is OPEN and b.statistics().failures == 5


def test_client_fault_of_a_half_open_probe_frees_the_slot_without_a_transition():
    b = CircuitBreaker(failure_threshold=1, rng=random.Random(3))
    b.on_failure(0.0, ErrorCode.EAGENTDOWN)
    t = b.get_timer()
    assert b.allow(t) and not b.allow(t)
    b.on_failure(t, ErrorCode.EPROTO, client_fault=True)
    assert b.state(t) is HALF_OPEN and b.allow(t)  # the next probe may go
    b.on_failure(t, ErrorCode.EPROTO)  # the peer's own EPROTO: the probe failed
    assert b.state(t) is OPEN and b.statistics().openings == 2


def test_board_passes_client_faults_on():
    board = BreakerBoard(failure_threshold=2)
    for now in (0.0, 0.1, 0.2):
        board.on_result("ruff", now, ok=False, code=ErrorCode.EPROTO, client_fault=True)
    assert board.open_agents(0.3) == set() and board.health("ruff", 0.3).error_rate == 0.0
    board.on_result("ruff", 0.4, ok=False, code=ErrorCode.EPROTO)
    board.on_result("ruff", 0.5, ok=False, code=ErrorCode.EPROTO)
    assert board.open_agents(0.5) == {"ruff"}


# --- faults in doubt and canaries (issue 19) --------------------------------------------------


@pytest.mark.parametrize(("origin", "client_fault", "tenant_bound", "fault"), [
    (Origin.DEADLINE, False, True, Fault.DOUBT),  # cut by the hop's timeout: maybe the task's tests sleep
    (Origin.CRASH, False, True, Fault.DOUBT),  # an unclassified crash: maybe on the task's absurd path
    (Origin.ADAPTER, False, True, Fault.PEER),  # the tool adapter's own verdict (its canary failed too)
    (Origin.ADAPTER, True, True, Fault.CLIENT),  # ...or that it was the task's
    (Origin.DEADLINE, True, True, Fault.CLIENT),
    (Origin.ADAPTER, True, False, Fault.CLIENT),
    (Origin.DEADLINE, False, False, Fault.PEER),  # a model endpoint's slowness is its own
    (Origin.CRASH, False, False, Fault.PEER),
])
def test_attribute_puts_what_a_tenant_bound_adapter_could_not_judge_in_doubt(origin, client_fault, tenant_bound,
                                                                             fault):
    assert attribute(origin, client_fault=client_fault, tenant_bound=tenant_bound) is fault


def test_doubts_never_count_and_ask_for_one_canary_at_a_time_and_per_interval():
    b = CircuitBreaker(failure_threshold=1, canary_interval_s=5.0)
    assert b.on_doubt(0.0) is True  # first doubt: a canary
    assert [b.on_doubt(t) for t in (0.1, 0.2, 3.0)] == [False, False, False]  # one runs
    assert b.on_canary(4.0, ok=True) is False
    assert b.on_doubt(4.5) is False  # within canary_interval_s of the last start
    assert b.on_doubt(5.0) is True
    assert b.on_canary(5.5, ok=True) is False
    stats = b.statistics(6.0)
    # threshold 1: a single counted failure would have opened it.
    assert (stats.state, stats.failures, stats.doubts, stats.canaries, stats.successes) == (CLOSED, 0, 6, 2, 2)
    assert stats.canary_in_flight is False


def test_failed_canaries_confirm_and_open_the_breaker():
    b = CircuitBreaker(failure_threshold=5, canary_confirm=2, rng=random.Random(1))
    assert b.on_doubt(0.0)
    assert b.on_canary(1.0, ok=False, code=ErrorCode.ETIMEOUT) is True  # confirm at once
    assert b.state(1.0) is CLOSED and b.statistics().canary_in_flight
    assert b.on_canary(2.0, ok=False, code=None) is False  # the 2nd failed canary in a row trips it
    stats = b.statistics(2.0)
    assert (stats.state, stats.failures, stats.canaries, stats.canary_failures, stats.trips) == (OPEN, 2, 2, 2, 1)
    assert b.on_doubt(2.1) is False  # open: nothing to ask


def test_a_canary_success_between_failures_resets_the_confirmation():
    b = CircuitBreaker(failure_threshold=5, canary_confirm=2, canary_interval_s=0.0)
    assert b.on_doubt(0.0)
    assert b.on_canary(0.5, ok=False, code=ErrorCode.ETIMEOUT) is True
    assert b.on_canary(1.0, ok=True) is False
    assert b.on_doubt(2.0)
    assert b.on_canary(2.5, ok=False, code=ErrorCode.ETIMEOUT) is True
    assert b.state(2.5) is CLOSED


def test_a_canary_refused_as_input_gives_no_verdict():
    b = CircuitBreaker(failure_threshold=1)
    assert b.on_doubt(0.0)
    assert b.on_canary(0.1, ok=False, code=ErrorCode.EPROTO, client_fault=True) is False
    stats = b.statistics(0.2)
    assert (stats.state, stats.failures, stats.ignored, stats.canary_in_flight) == (CLOSED, 0, 1, False)


def test_a_canary_is_a_probe_while_half_open():
    b = CircuitBreaker(failure_threshold=1, canary_interval_s=0.0, rng=random.Random(2))
    b.on_failure(0.0, ErrorCode.EAGENTDOWN)
    t = b.get_timer()
    assert b.allow(t)  # a tenant's probe...
    b.on_failure(t, ErrorCode.ETIMEOUT, client_fault=True)  # ...failed in doubt: slot freed, nothing counted
    assert b.on_doubt(t) and b.state(t) is HALF_OPEN
    assert b.on_canary(t + 0.5, ok=True) is False
    assert b.state(t + 0.5) is CLOSED
    b.on_failure(t + 1, ErrorCode.EAGENTDOWN)
    t2 = b.get_timer()
    assert b.on_doubt(t2)
    assert b.on_canary(t2, ok=False, code=ErrorCode.ETIMEOUT) is False  # a failed probe: open again
    assert b.state(t2) is OPEN and b.statistics().openings == 2


def test_canary_misuse_and_cancel():
    b = CircuitBreaker()
    with pytest.raises(ValueError, match="no canary"):
        b.on_canary(0.0, ok=True)
    assert b.on_doubt(0.0)
    b.on_canary_cancel(0.1)  # the router stopped: nothing counted, the next doubt may ask again later
    stats = b.statistics(0.2)
    assert (stats.canary_in_flight, stats.failures, stats.successes) == (False, 0, 0)
    with pytest.raises(ValueError, match="canary_confirm"):
        CircuitBreaker(canary_confirm=0)
    with pytest.raises(ValueError, match="canary_interval_s"):
        BreakerBoard(canary_interval_s=-1.0)


def test_board_runs_doubts_and_canaries_per_agent():
    board = BreakerBoard(failure_threshold=1, canary_confirm=1)
    assert board.on_doubt("pytest", 0.0) and board.on_doubt("ruff", 0.0)
    assert board.on_canary("pytest", 1.0, ok=False, code=ErrorCode.ETIMEOUT) is False
    assert board.on_canary("ruff", 1.0, ok=True) is False
    assert board.open_agents(1.0) == {"pytest"}
    board.on_canary_cancel("unseen", 1.0)  # ignored


# --- OPEN → HALF_OPEN → CLOSED / OPEN ----------------------------------------------------------


def test_open_admits_nothing_and_half_opens_after_the_jittered_backoff():
    b = CircuitBreaker(failure_threshold=1, base_backoff_s=1.0, jitter=0.2, rng=random.Random(42))
    (d0,) = expected_backoffs(42, 1.0, 60.0, 0.2, 1)
    b.on_failure(100.0, ErrorCode.ETIMEOUT)
    assert b.get_timer() == 100.0 + d0
    assert not b.allow(100.0) and not b.allow(100.0 + d0 - 1e-6)
    assert b.retry_after_ms(100.0) == math.ceil(d0 * 1000)
    b.on_failure(100.5, ErrorCode.ETIMEOUT)  # while OPEN: counted, no extension
    assert b.get_timer() == 100.0 + d0
    assert b.state(100.0 + d0) is HALF_OPEN
    assert b.retry_after_ms(100.0 + d0) is None and b.get_timer() is None


def test_half_open_admits_at_most_the_probes_and_a_success_closes():
    b = CircuitBreaker(failure_threshold=1, half_open_probes=2, rng=random.Random(0))
    b.on_failure(0.0, ErrorCode.ETIMEOUT)
    t = b.get_timer()
    assert [b.allow(t), b.allow(t), b.allow(t)] == [True, True, False]
    assert b.statistics().probes_in_flight == 2
    b.on_success(t + 0.1)
    assert b.state(t + 0.1) is CLOSED and b.statistics().openings == 0
    assert all(b.allow(t + 0.2) for _ in range(10))


def test_failed_probe_reopens_with_a_doubled_backoff_capped_at_max():
    b = CircuitBreaker(failure_threshold=2, base_backoff_s=1.0, max_backoff_s=5.0, jitter=0.1, rng=random.Random(7))
    want = expected_backoffs(7, 1.0, 5.0, 0.1, 6)
    trip(b, 0.0)
    now, got = 0.0, []
    for _ in range(6):
        reopen = b.get_timer()
        got.append(reopen - now)
        now = reopen
        assert b.allow(now)  # the probe
        b.on_failure(now, ErrorCode.EAGENTDOWN)
        assert b.state(now) is OPEN
    assert got == pytest.approx(want)
    assert want[1] == pytest.approx(2.0, rel=0.1) and want[2] == pytest.approx(4.0, rel=0.1)
    assert all(4.5 - 1e-9 <= d <= 5.0 + 1e-9 for d in got[3:])  # capped: 5·(1-0.1) .. 5
    assert b.statistics().openings == 7  # the trip and six failed probes
    # A successful probe closes and resets the exponent: the next trip waits base again.
    now = b.get_timer()
    assert b.allow(now)
    b.on_success(now)
    trip(b, now + 1)
    assert b.get_timer() - (now + 1) == pytest.approx(1.0, rel=0.1)


def test_zero_jitter_gives_exact_powers_of_two():
    b = CircuitBreaker(failure_threshold=1, base_backoff_s=0.5, max_backoff_s=3.0, jitter=0.0)
    b.on_failure(0.0, None)
    delays = []
    now = 0.0
    for _ in range(5):
        nxt = b.get_timer()
        delays.append(nxt - now)
        now = nxt
        b.allow(now)
        b.on_failure(now, None)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_cancelled_or_ignored_probe_frees_its_slot_without_a_transition():
    b = CircuitBreaker(failure_threshold=1, rng=random.Random(3))
    b.on_failure(0.0, ErrorCode.ETIMEOUT)
    t = b.get_timer()
    assert b.allow(t) and not b.allow(t)
    b.on_cancel(t)
    assert b.state(t) is HALF_OPEN and b.allow(t)
    b.on_failure(t, ErrorCode.EBUDGET)  # our budget cut it: says nothing about the peer
    assert b.state(t) is HALF_OPEN and b.allow(t)


def test_error_rate_is_over_the_window_and_ages_out():
    b = CircuitBreaker(failure_threshold=100, window_s=10.0)
    for i in range(8):
        b.on_success(float(i))
    b.on_failure(8.0, ErrorCode.ETIMEOUT)
    b.on_failure(8.5, ErrorCode.ETIMEOUT)
    b.on_failure(9.0, ErrorCode.EWINDOW)  # not the peer's fault: not in the rate
    assert b.error_rate(9.0) == pytest.approx(0.2)
    assert b.error_rate(15.5) == pytest.approx(2 / 4)  # the successes at 0..5 are gone
    assert b.error_rate(30.0) == 0.0
    assert b.statistics(15.5).error_rate == pytest.approx(0.5)


# --- Hypothesis: the breaker follows the graph under any sequence ------------------------------

steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0, 0.01, 0.3, 1.0, 2.5, 7.0, 40.0]),
        st.sampled_from(["allow", "success", "failure", "cancel", "remote", "release"]),
        st.sampled_from([None, *ErrorCode]),
    ),
    max_size=200,
)


@settings(max_examples=400, deadline=None)
@given(
    threshold=st.integers(1, 4),
    probes=st.integers(1, 3),
    jitter=st.sampled_from([0.0, 0.2, 0.5]),
    seed=st.integers(0, 2**16),
    steps=steps,
)
def test_breaker_moves_only_along_the_legal_graph(threshold, probes, jitter, seed, steps):
    base, cap, window = 1.0, 8.0, 5.0
    b = CircuitBreaker(
        failure_threshold=threshold,
        window_s=window,
        base_backoff_s=base,
        max_backoff_s=cap,
        jitter=jitter,
        half_open_probes=probes,
        rng=random.Random(seed),
    )
    now = 0.0
    state = b.state(now)
    failures: list[float] = []  # the model: peer failures while CLOSED since it last closed
    out = 0  # probes admitted and not yet ended
    k = 0  # openings since the breaker last closed
    remote = False  # OPEN only because another router opened it
    for dt, action, code in steps:
        now += dt
        before = b.state(now)
        assert before == state or (state, before) in LEGAL
        if before is not state:
            out = 0
        counted = code is None or code in PEER_FAILURES
        match action:
            case "allow":
                admitted = b.allow(now)
                if before is CLOSED:
                    assert admitted
                elif before is OPEN:
                    assert not admitted
                else:
                    assert admitted == (out < probes)
                    out += admitted
            case "success":
                b.on_success(now)
            case "failure":
                b.on_failure(now, code)
            case "cancel":
                b.on_cancel(now)
            case "remote":  # another router opened it for dt + 0.5 s, at its opening number 3
                timer = b.get_timer()
                b.trip_remote(now, now + dt + 0.5, openings=3)
                if before is OPEN:
                    assert b.get_timer() == max(timer, now + dt + 0.5)
            case "release":
                b.release_remote(now)
        after = b.state(now)
        assert after == before or (before, after) in LEGAL, (before, after)
        # The model of each transition.
        if action == "remote":
            assert after is OPEN
        elif action == "release":
            assert after is (HALF_OPEN if before is OPEN and remote else before)
        elif before is CLOSED and action == "failure" and counted:
            failures.append(now)
            trips = len(failures) >= threshold and now - failures[-threshold] <= window
            assert (after is OPEN) == trips
        elif before is HALF_OPEN and action == "success":
            assert after is CLOSED
        elif before is HALF_OPEN and action == "failure" and counted:
            assert after is OPEN
        else:
            assert after is before
        if before is HALF_OPEN and (action == "cancel" or (action == "failure" and not counted)):
            out = max(0, out - 1)
        if action == "remote" and before is not OPEN:
            out = 0
            failures.clear()
            k = max(k, 3)
            remote = True
            assert b.get_timer() == now + dt + 0.5
        elif action == "remote":
            k = max(k, 3)
        elif after is not before:
            out = 0
            failures.clear()
            remote = False
            if after is OPEN:
                nominal = min(cap, base * 2**k)
                delay = b.get_timer() - now
                assert nominal * (1 - jitter) - 1e-9 <= delay <= min(cap, nominal * (1 + jitter)) + 1e-9
                assert b.retry_after_ms(now) == math.ceil(delay * 1000)
                k += 1
            elif after is CLOSED:
                k = 0
        assert b.statistics().openings == k
        assert 0 <= b.statistics().probes_in_flight <= probes
        if after is OPEN:
            assert not b.allow(now)
        state = after


# --- BreakerBoard ------------------------------------------------------------------------------


def test_board_keeps_one_breaker_per_agent_and_reports_health():
    board = BreakerBoard(failure_threshold=2, base_backoff_s=2.0, jitter=0.0, rng=random.Random(0))
    assert board.health("never-seen", 0.0) == BreakerHealth(up=True, error_rate=0.0, retry_after_ms=None)
    assert board.allow("ruff", 0.0) and board.allow("llm", 0.0)
    board.on_result("ruff", 0.5, ok=True)
    board.on_result("llm", 1.0, ok=False, code=ErrorCode.ETIMEOUT)
    board.on_result("llm", 1.5, ok=False)  # a 5xx
    assert board.open_agents(1.5) == {"llm"}
    assert not board.allow("llm", 2.0) and board.allow("ruff", 2.0)
    assert board.health("llm", 2.0) == BreakerHealth(up=False, error_rate=1.0, retry_after_ms=1500)
    assert board.health("ruff", 2.0) == BreakerHealth(up=True, error_rate=0.0, retry_after_ms=None)
    assert board.retry_after_ms("llm", 2.0) == 1500 and board.retry_after_ms("ruff", 2.0) is None
    assert board.get_timer() == 3.5
    # HALF_OPEN stays routable so that its probe can go; one probe only.
    assert board.open_agents(3.5) == set() and board.health("llm", 3.5).up
    assert board.allow("llm", 3.5) and not board.allow("llm", 3.5)
    board.on_cancel("llm", 3.6)
    assert board.allow("llm", 3.7)
    board.on_result("llm", 4.0, ok=True)
    assert board.breaker("llm").state(4.0) is CLOSED and board.get_timer() is None
    assert set(board.statistics(4.0)) == {"ruff", "llm"}
    board.forget("llm")
    board.forget("nobody")
    assert set(board.statistics()) == {"ruff"}


def test_board_jitter_is_deterministic_with_a_seeded_rng():
    def run(seed):
        board = BreakerBoard(failure_threshold=1, rng=random.Random(seed))
        for i, agent in enumerate(["a", "b", "c"]):
            board.on_result(agent, float(i), ok=False, code=ErrorCode.EAGENTDOWN)
        return [board.breaker(a).get_timer() for a in "abc"]

    assert run(5) == run(5)
    assert run(5) != run(6)


# --- RetryPolicy -------------------------------------------------------------------------------


def test_retry_policy_delays_are_bounded_jittered_and_reproducible():
    p = RetryPolicy(max_attempts=5, base_backoff_s=0.2, max_backoff_s=1.0, jitter=0.2)
    d = p.delays(random.Random(9))
    assert d == p.delays(random.Random(9)) and len(d) == 4
    for i, x in enumerate(d):
        nominal = min(1.0, 0.2 * 2**i)
        assert nominal * 0.8 <= x <= min(1.0, nominal * 1.2)
    assert RetryPolicy(max_attempts=1).delays(random.Random(0)) == []
    assert RetryPolicy(jitter=0.0).delays(random.Random(0)) == [0.2]
    assert p.delay(1, random.Random(0), retry_after_ms=900) == 0.9  # the peer's hint wins when longer


@pytest.mark.parametrize(
    ("code", "attempt", "retry_after_ms", "want"),
    [
        (ErrorCode.ETIMEOUT, 1, None, True),
        (ErrorCode.ETIMEOUT, 2, None, False),  # max_attempts = 2: the first try and one retry
        (ErrorCode.EAGENTDOWN, 1, None, False),  # no hint: reroute instead
        (ErrorCode.EAGENTDOWN, 1, 500, True),
        (ErrorCode.EAGENTDOWN, 1, 2001, False),  # longer than max_backoff_s: reroute instead
        (ErrorCode.EPROTO, 1, None, False),
        (ErrorCode.EBUDGET, 1, None, False),  # a budget that does not fit
        (ErrorCode.EBUDGET, 1, 1000, True),  # a reserve the shared store did not answer
        (ErrorCode.EBUDGET, 2, 1000, False),
        (ErrorCode.ESEC, 1, None, False),
        (ErrorCode.EPREEMPT, 1, None, False),
        (ErrorCode.EWINDOW, 1, 100, False),
        ("ETIMEOUT", 1, None, True),
    ],
)
def test_should_retry_table(code, attempt, retry_after_ms, want):
    assert RetryPolicy().should_retry(code, attempt, retry_after_ms=retry_after_ms) is want


@given(max_attempts=st.integers(1, 10), code=st.sampled_from(list(ErrorCode)), hint=st.none() | st.integers(0, 5000))
def test_retries_never_loop(max_attempts, code, hint):
    p = RetryPolicy(max_attempts=max_attempts)
    attempt = 1
    while p.should_retry(code, attempt, retry_after_ms=hint):
        attempt += 1
    assert attempt <= max_attempts


def test_retry_policy_is_a_strict_config_struct():
    assert msgspec.convert({"max_attempts": 3}, RetryPolicy) == RetryPolicy(max_attempts=3)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_attempts": 0}, RetryPolicy)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"retries": 3}, RetryPolicy)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"base_backoff_s": 5.0, "max_backoff_s": 1.0}, RetryPolicy)


def test_a_canary_ending_after_a_reload_removed_its_agent_is_ignored():
    """A reload forgets a removed agent's breaker while its canary runs; the canary's
    end must not raise (it ended the router's canary task and then the router)."""
    from atp_router.flow.breaker import BreakerBoard

    board = BreakerBoard()
    assert board.on_canary("gone", 0.0, False) is False
    assert board.on_canary("gone", 0.0, True) is False
