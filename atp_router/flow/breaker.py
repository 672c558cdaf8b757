"""Per-next-hop circuit breakers and bounded retries (spec §5.3 "circuit breakers:
open on repeated 5xx/timeouts; exponential backoff per agent", §10 ETIMEOUT,
EAGENTDOWN). Sans-IO.

A :class:`CircuitBreaker` guards one next-hop; a :class:`BreakerBoard` holds one
per agent name. Every transition is a row of :data:`TRANSITIONS`::

    CLOSED ──TRIP──────────────► OPEN        failure_threshold peer failures within window_s
    OPEN ──BACKOFF_ELAPSED─────► HALF_OPEN   after backoff_k = min(max, base·2^k) · (1 ± jitter)
    HALF_OPEN ──PROBE_SUCCEEDED► CLOSED      k := 0
    HALF_OPEN ──PROBE_FAILED───► OPEN        k := k + 1 (the backoff doubles)

    CLOSED | HALF_OPEN ──REMOTE_TRIP► OPEN   another router opened it: until its deadline

``k`` counts the openings since the breaker last closed. CLOSED admits every
call, OPEN none, HALF_OPEN at most ``half_open_probes`` calls at once. Only
failures that say something about the peer's health count (:data:`PEER_FAILURES`:
``ETIMEOUT``, ``EAGENTDOWN``, ``EPROTO`` from the peer, and an unclassified
failure such as a 5xx or a reset connection, given as ``code=None``); our own
limits (``EBUDGET``, ``EWINDOW``, ``EPREEMPT``, …) do not, and neither does a
failure the client's input caused (``client_fault=True``, from a
:class:`~atp_router.wire.errors.ClientInputError`: a refused file path, a task over a
size limit), whatever its code: one tenant's bad input must not take a next-hop
out of the FIB for every tenant.

**Faults are attributed** (issue 19; :func:`attribute`). A failed call is the
peer's (:attr:`Fault.PEER`: counted as above), the client's (:attr:`Fault.CLIENT`:
never counted) or **in doubt** (:attr:`Fault.DOUBT`): a timeout or a crash of a
*tenant-bound* next-hop — a local tool whose work is the task's own (its tests
sleep, its path is absurd): :attr:`ProviderAdapter.tenant_bound
<atp_router.adapters.base.ProviderAdapter.tenant_bound>` — that the adapter could not
judge itself: the caller's per-call deadline cut it, or it crashed outside its
contract (what an adapter raises is its own verdict). A failure in doubt is the
tenant's for the call (the caller reports it like a client fault: no count, no
AIMD decrease, no retry or reroute) and is never counted itself; instead
:meth:`CircuitBreaker.on_doubt` may ask for a **canary**: a small, well-formed,
in-limit task the router runs on the next-hop itself, at most one at a time per
next-hop and at most one every ``canary_interval_s`` started on a doubt (so
tenants cannot make the router spend more than that). Only the canary's outcome
speaks for the next-hop (:meth:`CircuitBreaker.on_canary`): a success is a
success (HALF_OPEN → CLOSED); a canary the next-hop refuses as input is
inconclusive (nothing counted); a failed canary is a peer failure, which asks
for another canary at once, and ``canary_confirm`` failed canaries in a row open
the breaker (``TRIP``; while HALF_OPEN the first one, as any failed probe). So a
next-hop that fails on well-formed input is still taken out — after
``canary_confirm`` canary runs — while tasks that fail it on their own input,
from one tenant or many, never open it for anyone. Failures that are certainly
the peer's (a tool missing, ``EAGENTDOWN`` it reports, a model endpoint's
timeouts or 5xx) count as before, whoever's task saw them: a next-hop down for
one tenant is down for all, and a router with one tenant must open its breakers
too, which a "failures from two tenants" rule would never do.

Every transition is also reported, as it happens, to the ``on_transition``
callback given (a :class:`BreakerTransition`; the router logs each one once).

**Several routers** (issue 12): :class:`BreakerShare` carries openings between
routers that share a store. A router whose breaker opens on its own evidence
(``TRIP``, ``PROBE_FAILED``) publishes ``{state: open, open_until_ms, owner,
reason}`` for the agent; the others force their breaker open until that
deadline (:meth:`CircuitBreaker.trip_remote`, ``REMOTE_TRIP``) and then probe
it themselves through the normal HALF_OPEN. A router whose probe succeeds
publishes ``closed``, which lets a breaker that was only *remotely* opened
half-open at once (:meth:`CircuitBreaker.release_remote`). Only peer failures
ever open a breaker, so a tenant's client-fault errors do not reach other
routers either.

Jitter comes from an injected :class:`random.Random`, so a seeded one makes
backoffs reproducible. Time is an argument (``now``, seconds, non-decreasing);
the OPEN → HALF_OPEN deadline is exposed by ``get_timer()`` and taken lazily
by whatever method runs next, so no timer task is needed.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Container, Mapping
from typing import Annotated, Any, TypedDict

from msgspec import Meta, Struct

from atp_router.wire.errors import ErrorCode


class BreakerState(enum.StrEnum):
    """States of a circuit breaker (spec §5.3)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(enum.StrEnum):
    """What moves a breaker: the rows of :data:`TRANSITIONS`."""

    TRIP = "trip"
    BACKOFF_ELAPSED = "backoff_elapsed"
    PROBE_SUCCEEDED = "probe_succeeded"
    PROBE_FAILED = "probe_failed"
    REMOTE_TRIP = "remote_trip"


#: Every legal (state, event) → new state. An event absent for a state does
#: not move the breaker (e.g. a failure while OPEN, a success while CLOSED).
TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (BreakerState.CLOSED, BreakerEvent.TRIP): BreakerState.OPEN,
    (BreakerState.OPEN, BreakerEvent.BACKOFF_ELAPSED): BreakerState.HALF_OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.PROBE_SUCCEEDED): BreakerState.CLOSED,
    (BreakerState.HALF_OPEN, BreakerEvent.PROBE_FAILED): BreakerState.OPEN,
    (BreakerState.CLOSED, BreakerEvent.REMOTE_TRIP): BreakerState.OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.REMOTE_TRIP): BreakerState.OPEN,
}

#: Failure codes that count against a next-hop's health.
PEER_FAILURES: frozenset[ErrorCode] = frozenset({ErrorCode.ETIMEOUT, ErrorCode.EAGENTDOWN, ErrorCode.EPROTO})


class Origin(enum.StrEnum):
    """Who gave a failed call its error: the adapter (its own verdict, raised as an
    :class:`~atp_router.wire.errors.ATPError`), the caller's per-call deadline cutting
    the call short (the adapter could not say why it was slow), or an exception
    outside the adapter's contract (a crash it did not classify)."""

    ADAPTER = "adapter"
    DEADLINE = "deadline"
    CRASH = "crash"


class Fault(enum.StrEnum):
    """Whose a failed next-hop call is (module doc, "Faults are attributed")."""

    #: The next-hop's: counted by its breaker, AIMD decrease, retried or rerouted by code.
    PEER = "peer"
    #: The client's input's: the stream's error; nothing counted, no retry, no reroute.
    CLIENT = "client"
    #: Maybe the task's, maybe the next-hop's: the client's for the call, and a
    #: canary (:meth:`CircuitBreaker.on_doubt`) speaks for the next-hop.
    DOUBT = "doubt"
    #: The router's own: the wait timed out while its event loop was stalled
    #: (:mod:`atp_router.runtime.loopstalls`): nothing counted, no AIMD decrease, retried.
    LOCAL = "local"


#: A timeout is the router's own (:attr:`Fault.LOCAL`) when its event loop had a stall
#: at least this long (s) that ended at most :data:`LOCAL_WITHIN_S` before the failure
#: was seen: the deadline passed while the loop was not running, so the peer's answer
#: may have been waiting unread. Shorter stalls leave the peer's verdict alone.
LOCAL_STALL_S = 2.0
LOCAL_WITHIN_S = 1.0


def attribute(origin: Origin, *, client_fault: bool, tenant_bound: bool, timed_out: bool = False,
              stall_s: float = 0.0) -> Fault:
    """Whose a failed call is: its :class:`Origin`, ``client_fault`` as the
    adapter said (:class:`~atp_router.wire.errors.ClientInputError`), ``tenant_bound``
    the next-hop's :attr:`~atp_router.adapters.base.ProviderAdapter.tenant_bound`.

    What the adapter raised is its verdict: the client's when it says so, else
    the peer's (a tool adapter attributes its own timeouts and abnormal exits
    with a canary of its own before it raises, atp_router.adapters.tools.base). What it
    could not judge — the caller's deadline cut it, or it crashed outside its
    contract — is in doubt at a tenant-bound next-hop (the task's tests may
    sleep, its path may be absurd) and the peer's anywhere else (a model
    endpoint's slowness is its own). A wait that ran out (``timed_out``: a
    connect or read timeout, or the caller's deadline) right after the router's
    own loop stalled for ``stall_s`` ≥ :data:`LOCAL_STALL_S` s is the router's
    (:attr:`Fault.LOCAL`), whichever next-hop it was. Pure."""
    if client_fault:
        return Fault.CLIENT
    if timed_out and stall_s >= LOCAL_STALL_S:
        return Fault.LOCAL
    if tenant_bound and origin is not Origin.ADAPTER:
        return Fault.DOUBT
    return Fault.PEER

_BUCKETS = 10  # error-rate window resolution: window_s / 10
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]


def _backoff(base: float, cap: float, k: int, jitter: float, rng: random.Random) -> float:
    """``min(cap, base·2^k)`` scaled by ``1 + U(-jitter, +jitter)``, never above ``cap``."""
    nominal = min(cap, base * 2.0 ** min(k, 1000))  # 2.0**1024 would raise; by then the cap rules anyway
    return min(cap, nominal * (1.0 + rng.uniform(-jitter, jitter)))


class BreakerStatistics(Struct, frozen=True):
    """Snapshot of a breaker. ``openings``: consecutive openings since it last
    closed (the ``k`` of the backoff). ``reopen_at``: OPEN → HALF_OPEN deadline
    (s), ``None`` unless OPEN. ``error_rate``: peer failures / outcomes over the
    last ``window_s`` (0..1). Counts are since creation; ``ignored``: failures
    whose code does not count against the peer, or that the client caused (a
    failure in doubt among them), and inconclusive canaries. ``doubts``: failures
    in doubt; ``canaries``: canaries started; ``canary_failures``: those that
    failed (each also in ``failures``); ``canary_in_flight``: one runs now."""

    state: BreakerState
    openings: int
    reopen_at: float | None
    probes_in_flight: int
    error_rate: float
    successes: int
    failures: int
    ignored: int
    trips: int
    doubts: int = 0
    canaries: int = 0
    canary_failures: int = 0
    canary_in_flight: bool = False


class BreakerTransition(Struct, frozen=True, kw_only=True):
    """One row of :data:`TRANSITIONS` taken: ``agent`` (empty for a breaker not
    on a :class:`BreakerBoard`) went from ``old`` to ``new`` on ``event`` at
    ``at`` (the ``now`` given, s); ``reopen_at`` is the OPEN → HALF_OPEN
    deadline (s) when ``new`` is OPEN, else ``None``; ``openings`` as in
    :class:`BreakerStatistics`, after the transition."""

    agent: str
    old: BreakerState
    event: BreakerEvent
    new: BreakerState
    at: float
    reopen_at: float | None
    openings: int


class BreakerHealth(Struct, frozen=True):
    """Health of a next-hop as breakers see it (feeds FIB health exclusion):
    ``up`` unless OPEN; ``error_rate`` over the breaker window (0..1);
    ``retry_after_ms`` until the next probe may go, ``None`` unless OPEN."""

    up: bool
    error_rate: float
    retry_after_ms: int | None


class _Rolling:
    """Outcome counts over the last ``window_s`` in ``_BUCKETS`` buckets: O(1)
    memory per breaker whatever the call rate."""

    __slots__ = ("_epochs", "_fail", "_ok", "_width")

    def __init__(self, window_s: float) -> None:
        self._width = window_s / _BUCKETS
        self._epochs = [-1] * _BUCKETS
        self._ok = [0] * _BUCKETS
        self._fail = [0] * _BUCKETS

    def add(self, now: float, ok: bool) -> None:
        epoch = math.floor(now / self._width)
        i = epoch % _BUCKETS
        if self._epochs[i] != epoch:
            self._epochs[i], self._ok[i], self._fail[i] = epoch, 0, 0
        if ok:
            self._ok[i] += 1
        else:
            self._fail[i] += 1

    def error_rate(self, now: float) -> float:
        oldest = math.floor(now / self._width) - _BUCKETS + 1
        ok = fail = 0
        for i in range(_BUCKETS):
            if self._epochs[i] >= oldest:
                ok += self._ok[i]
                fail += self._fail[i]
        return fail / (ok + fail) if ok + fail else 0.0


class CircuitBreaker:
    """Circuit breaker of one next-hop (see the module docstring).

    ``failure_threshold``: peer failures within ``window_s`` (s) that open it.
    ``base_backoff_s`` / ``max_backoff_s``: first OPEN period and its cap (s).
    ``jitter``: relative spread of each backoff, ``0 <= jitter < 1``.
    ``half_open_probes``: calls admitted at once while HALF_OPEN. ``rng``:
    source of jitter (default: a fresh ``random.Random()``). ``on_transition``:
    called with each :class:`BreakerTransition` as it is taken, naming
    ``agent``. ``canary_interval_s``: least time (s) between two canaries started
    on a doubt; ``canary_confirm``: failed canaries in a row that open the
    breaker (module doc). Raises ``ValueError`` on an invalid configuration.

    Every call that :meth:`allow` admitted must end in exactly one of
    :meth:`on_success`, :meth:`on_failure` or :meth:`on_cancel`, or a
    HALF_OPEN probe slot stays taken. Every ``True`` of :meth:`on_doubt` and of
    :meth:`on_canary` starts a canary that must end in exactly one
    :meth:`on_canary` or :meth:`on_canary_cancel`.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        window_s: float = 30.0,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        jitter: float = 0.2,
        half_open_probes: int = 1,
        rng: random.Random | None = None,
        on_transition: Callable[[BreakerTransition], None] | None = None,
        agent: str = "",
        canary_interval_s: float = 5.0,
        canary_confirm: int = 2,
    ) -> None:
        if failure_threshold < 1 or half_open_probes < 1 or canary_confirm < 1:
            raise ValueError("failure_threshold, half_open_probes and canary_confirm must be >= 1")
        if not (window_s > 0 and 0 < base_backoff_s <= max_backoff_s and 0 <= jitter < 1):
            raise ValueError("need window_s > 0, 0 < base_backoff_s <= max_backoff_s and 0 <= jitter < 1")
        if not canary_interval_s >= 0:
            raise ValueError("need canary_interval_s >= 0")
        self.failure_threshold = failure_threshold
        self.window_s = window_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self.half_open_probes = half_open_probes
        # Jitter only de-synchronises probes: no cryptographic randomness needed.
        self._rng = rng if rng is not None else random.Random()  # nosec B311
        self._state = BreakerState.CLOSED
        # Only the newest failure_threshold failure times can decide a trip.
        self._recent: list[float] = []
        self._openings = 0
        self._reopen_at: float | None = None
        self._probes = 0
        self._rolling = _Rolling(window_s)
        self._successes = 0
        self._failures = 0
        self._ignored = 0
        self._trips = 0
        self._last_at = 0.0  # latest `now` seen, to age the error rate in statistics()
        self._on_transition = on_transition
        self._agent = agent
        self._remote = False  # OPEN only because another router opened it
        self._remote_until = 0.0
        self.canary_interval_s = canary_interval_s
        self.canary_confirm = canary_confirm
        self._canary_out = False  # a canary runs now
        self._canary_at: float | None = None  # when the last one started on a doubt
        self._canary_failed = 0  # failed canaries in a row
        self._doubts = 0
        self._canaries = 0
        self._canary_failures = 0

    def state(self, now: float) -> BreakerState:
        """The state at ``now`` (takes OPEN → HALF_OPEN once the backoff elapsed)."""
        self._last_at = max(self._last_at, now)
        if self._state is BreakerState.OPEN and self._reopen_at is not None and now >= self._reopen_at:
            self._fire(BreakerEvent.BACKOFF_ELAPSED, now)
        return self._state

    def allow(self, now: float) -> bool:
        """May a call go to this next-hop at ``now``? CLOSED: yes. OPEN: no
        (answer ``EAGENTDOWN`` with :meth:`retry_after_ms`, reroute).
        HALF_OPEN: yes while fewer than ``half_open_probes`` probes are out;
        a ``True`` here takes a probe slot."""
        match self.state(now):
            case BreakerState.CLOSED:
                return True
            case BreakerState.HALF_OPEN if self._probes < self.half_open_probes:
                self._probes += 1
                return True
            case _:
                return False

    def on_success(self, now: float) -> None:
        """A call to this next-hop succeeded at ``now``. HALF_OPEN → CLOSED (any
        outcome while HALF_OPEN is taken as the probe's)."""
        self._successes += 1
        self._canary_failed = 0
        self._rolling.add(now, True)
        if self.state(now) is BreakerState.HALF_OPEN:
            self._fire(BreakerEvent.PROBE_SUCCEEDED, now)

    def on_failure(self, now: float, code: ErrorCode | None = None, *, client_fault: bool = False) -> None:
        """A call to this next-hop failed at ``now`` with ``code`` (``None``: an
        unclassified failure such as HTTP 5xx or a reset connection). Codes
        outside :data:`PEER_FAILURES`, and any failure with ``client_fault``
        (the client's input caused it), are counted as ``ignored`` and only give
        back a probe slot. A peer
        failure trips CLOSED → OPEN when it is the ``failure_threshold``-th
        within ``window_s``, and sends HALF_OPEN → OPEN with a doubled backoff;
        while OPEN it is only counted."""
        state = self.state(now)
        if client_fault or (code is not None and ErrorCode(code) not in PEER_FAILURES):
            self._ignored += 1
            self.on_cancel(now)
            return
        self._peer_failure(now, state)

    def _peer_failure(self, now: float, state: BreakerState) -> None:
        self._failures += 1
        self._rolling.add(now, False)
        if state is BreakerState.HALF_OPEN:
            self._fire(BreakerEvent.PROBE_FAILED, now)
        elif state is BreakerState.CLOSED:
            recent = self._recent
            recent.append(now)
            if len(recent) > self.failure_threshold:
                del recent[0]
            if len(recent) == self.failure_threshold and now - recent[0] <= self.window_s:
                self._fire(BreakerEvent.TRIP, now)

    def on_cancel(self, now: float) -> None:
        """An admitted call ended without telling anything about the peer
        (cancelled by RST, cut by our budget): frees its HALF_OPEN probe slot."""
        if self.state(now) is BreakerState.HALF_OPEN and self._probes:
            self._probes -= 1

    def on_doubt(self, now: float) -> bool:
        """A call failed in doubt at ``now`` (:attr:`Fault.DOUBT`; the caller
        settled the call itself as a client fault with :meth:`on_failure`): not
        counted. Returns ``True`` when a canary is to start now — the breaker is
        not OPEN, no canary runs, and none started on a doubt within
        ``canary_interval_s`` — and then counts it as running."""
        self._doubts += 1
        if self._canary_out or self.state(now) is BreakerState.OPEN:
            return False
        if self._canary_at is not None and now - self._canary_at < self.canary_interval_s:
            return False
        self._canary_at = now
        self._start_canary()
        return True

    def on_canary(self, now: float, ok: bool, code: ErrorCode | None = None, *, client_fault: bool = False) -> bool:
        """The running canary ended at ``now``: ``ok`` (it answered), else it
        failed with ``code`` (``None``: crashed), ``client_fault`` when the
        next-hop refused the router's canary as input. ``ok`` is a success
        (HALF_OPEN → CLOSED); a refusal is inconclusive (``ignored``); any other
        failure is a peer failure (counted as in :meth:`on_failure`), and the
        ``canary_confirm``-th failed canary in a row trips CLOSED → OPEN.
        Returns ``True`` when another canary is to start now (a failure to
        confirm), counted as running. Raises ``ValueError`` when no canary runs."""
        if not self._canary_out:
            raise ValueError("no canary is running")
        self._canary_out = False
        if ok:
            self.on_success(now)
            return False
        if client_fault:
            self._ignored += 1
            return False
        self._canary_failures += 1
        self._canary_failed += 1
        state = self.state(now)
        self._peer_failure(now, state)
        if self._state is not BreakerState.CLOSED:
            self._canary_failed = 0  # opened (or already open): probes decide from here
            return False
        if self._canary_failed >= self.canary_confirm:
            self._canary_failed = 0
            self._fire(BreakerEvent.TRIP, now)
            return False
        self._start_canary()
        return True

    def on_canary_cancel(self, now: float) -> None:
        """The running canary was cancelled (the router stops) or could not
        start: nothing is counted. No-op when none runs."""
        self._canary_out = False

    def _start_canary(self) -> None:
        self._canary_out = True
        self._canaries += 1

    def trip_remote(self, now: float, until: float, *, openings: int = 1) -> bool:
        """Another router opened this next-hop's breaker until ``until`` (s, on
        this breaker's clock): CLOSED or HALF_OPEN → OPEN (``REMOTE_TRIP``,
        a probe in flight is forgotten as on ``PROBE_FAILED``) with the
        OPEN → HALF_OPEN deadline at ``until``; already OPEN: the deadline
        moves out to ``until`` if that is later. Afterwards the normal HALF_OPEN
        probing runs here. ``openings``: the other router's count; this
        breaker's becomes at least that, so a failed probe here backs off as
        long as it would have there. Returns whether the state changed
        (False also when ``until <= now``)."""
        state = self.state(now)
        if until <= now:
            return False
        self._openings = max(self._openings, openings)
        if state is BreakerState.OPEN:
            if self._reopen_at is None or until > self._reopen_at:
                self._reopen_at = until
            return False
        self._remote_until = until
        self._fire(BreakerEvent.REMOTE_TRIP, now)
        return True

    def release_remote(self, now: float) -> bool:
        """Another router's probe succeeded: a breaker OPEN only because of
        :meth:`trip_remote` half-opens now (its own probe decides). One OPEN on
        this router's own evidence is left alone. Returns whether it moved."""
        if self.state(now) is BreakerState.OPEN and self._remote:
            self._reopen_at = now
            return self.state(now) is BreakerState.HALF_OPEN
        return False

    def retry_after_ms(self, now: float) -> int | None:
        """Milliseconds until the next probe may go (the ``retry_after_ms`` of an
        ``EAGENTDOWN``, spec §10), ``None`` unless OPEN."""
        if self.state(now) is not BreakerState.OPEN or self._reopen_at is None:
            return None
        return max(0, math.ceil((self._reopen_at - now) * 1000.0))

    def get_timer(self) -> float | None:
        """The OPEN → HALF_OPEN deadline (s), ``None`` unless OPEN."""
        return self._reopen_at if self._state is BreakerState.OPEN else None

    def error_rate(self, now: float) -> float:
        """Peer failures / outcomes over the last ``window_s`` to a tenth of it
        (0..1, 0 with no calls)."""
        return self._rolling.error_rate(now)

    def statistics(self, now: float | None = None) -> BreakerStatistics:
        """Snapshot; pass ``now`` to take a due OPEN → HALF_OPEN first and to age
        the error rate (without it: as of the latest ``now`` seen)."""
        if now is not None:
            self.state(now)
        return BreakerStatistics(
            state=self._state,
            openings=self._openings,
            reopen_at=self.get_timer(),
            probes_in_flight=self._probes,
            error_rate=self._rolling.error_rate(self._last_at),
            successes=self._successes,
            failures=self._failures,
            ignored=self._ignored,
            trips=self._trips,
            doubts=self._doubts,
            canaries=self._canaries,
            canary_failures=self._canary_failures,
            canary_in_flight=self._canary_out,
        )

    def _fire(self, event: BreakerEvent, now: float) -> None:
        new = TRANSITIONS[(self._state, event)]
        match event:
            case BreakerEvent.TRIP | BreakerEvent.PROBE_FAILED:
                delay = _backoff(self.base_backoff_s, self.max_backoff_s, self._openings, self.jitter, self._rng)
                self._openings += 1
                self._trips += 1
                self._reopen_at = now + delay
                self._recent.clear()
            case BreakerEvent.PROBE_SUCCEEDED:
                self._openings = 0
                self._reopen_at = None
            case BreakerEvent.BACKOFF_ELAPSED:
                self._reopen_at = None
            case BreakerEvent.REMOTE_TRIP:
                self._reopen_at = self._remote_until
                self._recent.clear()
        self._remote = event is BreakerEvent.REMOTE_TRIP
        self._probes = 0
        old, self._state = self._state, new
        if self._on_transition is not None:
            self._on_transition(BreakerTransition(agent=self._agent, old=old, event=event, new=new, at=now,
                                                  reopen_at=self._reopen_at, openings=self._openings))


class _BoardSettings(TypedDict):
    """The keywords a :class:`BreakerBoard` passes to each :class:`CircuitBreaker`."""

    failure_threshold: int
    window_s: float
    base_backoff_s: float
    max_backoff_s: float
    jitter: float
    half_open_probes: int
    canary_interval_s: float
    canary_confirm: int


class BreakerBoard:
    """One :class:`CircuitBreaker` per next-hop agent name, created on first use
    with the same settings (keywords as :class:`CircuitBreaker`) and one
    shared ``rng``; ``on_transition`` gets every transition of every breaker,
    named by its agent. Memory: one breaker per agent seen; :meth:`forget` drops
    agents removed from the RIB."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        window_s: float = 30.0,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        jitter: float = 0.2,
        half_open_probes: int = 1,
        rng: random.Random | None = None,
        on_transition: Callable[[BreakerTransition], None] | None = None,
        canary_interval_s: float = 5.0,
        canary_confirm: int = 2,
    ) -> None:
        self._on_transition = on_transition
        self._listeners: list[Callable[[BreakerTransition], None]] = []
        self._settings: _BoardSettings = {
            "failure_threshold": failure_threshold,
            "window_s": window_s,
            "base_backoff_s": base_backoff_s,
            "max_backoff_s": max_backoff_s,
            "jitter": jitter,
            "half_open_probes": half_open_probes,
            "canary_interval_s": canary_interval_s,
            "canary_confirm": canary_confirm,
        }
        # Jitter only de-synchronises probes: no cryptographic randomness needed.
        self._rng = rng if rng is not None else random.Random()  # nosec B311
        CircuitBreaker(**self._settings, rng=self._rng)  # validate now, not at first use
        self._breakers: dict[str, CircuitBreaker] = {}

    def breaker(self, agent: str) -> CircuitBreaker:
        """The breaker of ``agent`` (created CLOSED on first use)."""
        b = self._breakers.get(agent)
        if b is None:
            b = self._breakers[agent] = CircuitBreaker(**self._settings, rng=self._rng,
                                                       on_transition=self._notify, agent=agent)
        return b

    def add_listener(self, listener: Callable[[BreakerTransition], None]) -> None:
        """Call ``listener`` too with every transition (after ``on_transition``),
        e.g. a :class:`BreakerShare`'s."""
        self._listeners.append(listener)

    def _notify(self, t: BreakerTransition) -> None:
        if self._on_transition is not None:
            self._on_transition(t)
        for listener in self._listeners:
            listener(t)

    def trip_remote(self, agent: str, now: float, until: float, *, openings: int = 1) -> bool:
        """:meth:`CircuitBreaker.trip_remote` of ``agent`` (created if unseen)."""
        return self.breaker(agent).trip_remote(now, until, openings=openings)

    def release_remote(self, agent: str, now: float) -> bool:
        """:meth:`CircuitBreaker.release_remote` of ``agent`` (False if unseen)."""
        b = self._breakers.get(agent)
        return b.release_remote(now) if b is not None else False

    def allow(self, agent: str, now: float) -> bool:
        """:meth:`CircuitBreaker.allow` of ``agent``."""
        return self.breaker(agent).allow(now)

    def on_result(
        self, agent: str, now: float, ok: bool, code: ErrorCode | None = None, *, client_fault: bool = False
    ) -> None:
        """Report a call's outcome: ``ok`` → success; else a failure with ``code``
        (``None``: unclassified, e.g. a 5xx) that ``client_fault`` says the
        client's input caused (then ignored), see :meth:`CircuitBreaker.on_failure`."""
        b = self.breaker(agent)
        if ok:
            b.on_success(now)
        else:
            b.on_failure(now, code, client_fault=client_fault)

    def on_cancel(self, agent: str, now: float) -> None:
        """:meth:`CircuitBreaker.on_cancel` of ``agent``."""
        self.breaker(agent).on_cancel(now)

    def on_doubt(self, agent: str, now: float) -> bool:
        """:meth:`CircuitBreaker.on_doubt` of ``agent``: start a canary on it now?"""
        return self.breaker(agent).on_doubt(now)

    def on_canary(self, agent: str, now: float, ok: bool, code: ErrorCode | None = None, *,
                  client_fault: bool = False) -> bool:
        """:meth:`CircuitBreaker.on_canary` of ``agent``: start another canary now?
        ``False`` for an agent without a running canary — one a reload removed
        while its canary ran (its breaker was forgotten): nothing to count."""
        b = self._breakers.get(agent)
        if b is None or not b._canary_out:
            return False
        return b.on_canary(now, ok, code, client_fault=client_fault)

    def on_canary_cancel(self, agent: str, now: float) -> None:
        """:meth:`CircuitBreaker.on_canary_cancel` of ``agent`` (ignored if unseen)."""
        b = self._breakers.get(agent)
        if b is not None:
            b.on_canary_cancel(now)

    def open_agents(self, now: float) -> set[str]:
        """Agents whose breaker is OPEN at ``now``: exclude them from the FIB.
        HALF_OPEN agents stay in, so that probes can reach them; :meth:`allow`
        limits how many."""
        return {a for a, b in self._breakers.items() if b.state(now) is BreakerState.OPEN}

    def health(self, agent: str, now: float) -> BreakerHealth:
        """:class:`BreakerHealth` of ``agent`` (up with no errors if never seen)."""
        b = self._breakers.get(agent)
        if b is None:
            return BreakerHealth(up=True, error_rate=0.0, retry_after_ms=None)
        return BreakerHealth(
            up=b.state(now) is not BreakerState.OPEN, error_rate=b.error_rate(now), retry_after_ms=b.retry_after_ms(now)
        )

    def retry_after_ms(self, agent: str, now: float) -> int | None:
        """:meth:`CircuitBreaker.retry_after_ms` of ``agent`` (``None`` if never seen)."""
        b = self._breakers.get(agent)
        return b.retry_after_ms(now) if b is not None else None

    def get_timer(self) -> float | None:
        """The earliest OPEN → HALF_OPEN deadline (s) of any agent, or ``None``."""
        return min((t for b in self._breakers.values() if (t := b.get_timer()) is not None), default=None)

    def forget(self, agent: str) -> None:
        """Drop ``agent``'s breaker (it left the RIB). Unknown agents are ignored."""
        self._breakers.pop(agent, None)

    def statistics(self, now: float | None = None) -> dict[str, BreakerStatistics]:
        """:meth:`CircuitBreaker.statistics` of every agent seen, by name."""
        return {a: b.statistics(now) for a, b in self._breakers.items()}


class BreakerShare:
    """Circuit-breaker openings shared between routers on one store (issue 12;
    the module doc). Sans-IO: the router stores what :meth:`take` gives under
    ``breaker/<agent>`` (through :meth:`merge`, an atomic read-modify-write),
    and feeds :meth:`follow` what it reads back every poll.

    A record: ``{"state": "open" | "closed", "open_until_ms": wall-clock ms
    (open only), "owner": the publishing router, "reason", "openings",
    "at_ms": when it was published (wall clock)}``. Wall-clock ms, because
    routers on several machines share no monotonic clock: openings are off by
    the routers' clock skew (NTP keeps it to milliseconds).

    **Bound**: a router publishes as soon as its breaker opens (one store
    write); the others read every poll interval P; so every router's breaker
    is open within ``P + 2 store round trips`` of the opening (P = 0.5 s in
    :mod:`atp_router.runtime.controlplane.shared_state`), or immediately for a router starting
    while the record is in force. ``owner``: this router's name in the store."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        #: agent → the record to publish (the latest transition wins).
        self.pending: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, tuple[str, int]] = {}

    def on_transition(self, t: BreakerTransition, now_ms: int) -> bool:
        """Record what ``t`` (a local transition at wall-clock ``now_ms``) must
        publish: an opening on this router's evidence (``TRIP``,
        ``PROBE_FAILED``) → open until ``now_ms`` + the backoff; a successful
        probe → closed. A ``REMOTE_TRIP`` or ``BACKOFF_ELAPSED`` publishes
        nothing. Returns whether something is to publish."""
        if t.event in (BreakerEvent.TRIP, BreakerEvent.PROBE_FAILED) and t.reopen_at is not None:
            until = now_ms + max(0, math.ceil((t.reopen_at - t.at) * 1000.0))
            reason = ("a probe failed" if t.event is BreakerEvent.PROBE_FAILED
                      else "repeated peer failures (timeouts, agent down, 5xx)")
            self.pending[t.agent] = {"state": str(BreakerState.OPEN), "open_until_ms": until, "owner": self.owner,
                                     "reason": reason, "openings": t.openings, "at_ms": now_ms}
            return True
        if t.event is BreakerEvent.PROBE_SUCCEEDED:
            self.pending[t.agent] = {"state": str(BreakerState.CLOSED), "owner": self.owner,
                                     "reason": "a probe succeeded", "openings": 0, "at_ms": now_ms}
            return True
        return False

    def take(self) -> dict[str, dict[str, Any]]:
        """The records to publish, by agent (cleared; :meth:`restore` puts back
        those the store did not take)."""
        out, self.pending = self.pending, {}
        return out

    def restore(self, records: Mapping[str, dict[str, Any]]) -> None:
        """Put back records that failed to publish (a newer one for the agent wins)."""
        for agent, rec in records.items():
            self.pending.setdefault(agent, rec)

    @staticmethod
    def merge(existing: Mapping[str, Any] | None, record: Mapping[str, Any], now_ms: int) -> dict[str, Any]:
        """The stored record after publishing ``record`` over ``existing``: an
        opening wins, keeping the later ``open_until_ms`` of the two when the
        existing one is still in force; a closing does not overwrite another
        router's opening still in force (its evidence is newer than our probe
        or it would have expired). Pure."""
        rec = dict(record)
        old = existing if isinstance(existing, Mapping) else {}
        old_until = old.get("open_until_ms")
        in_force = old.get("state") == str(BreakerState.OPEN) and isinstance(old_until, int) and old_until > now_ms
        if rec.get("state") == str(BreakerState.OPEN):
            if in_force and isinstance(old_until, int):
                rec["open_until_ms"] = max(int(rec["open_until_ms"]), old_until)
            return rec
        if in_force and old.get("owner") != rec.get("owner"):
            return dict(old)
        return rec

    def follow(self, board: BreakerBoard, records: Mapping[str, Mapping[str, Any]], *, now: float, now_ms: int,
               agents: Container[str]) -> list[tuple[str, Mapping[str, Any]]]:
        """Apply the stored ``records`` (agent → record) of other routers to
        ``board`` at ``now`` (the board's clock, s) / ``now_ms`` (wall clock):
        an opening in force trips the agent's breaker until its deadline
        (:meth:`BreakerBoard.trip_remote`), a closing releases a remotely
        opened one (:meth:`BreakerBoard.release_remote`). Each record is
        applied once; this router's own and agents not in ``agents`` (the
        running RIB) are skipped. Returns the ``(agent, record)`` that moved a
        breaker."""
        moved = []
        for agent, rec in records.items():
            if agent not in agents or not isinstance(rec, Mapping):
                continue
            owner, at = rec.get("owner"), rec.get("at_ms")
            if not isinstance(owner, str) or not isinstance(at, int) or self._seen.get(agent) == (owner, at):
                continue
            self._seen[agent] = (owner, at)
            if owner == self.owner:
                continue
            state, until = rec.get("state"), rec.get("open_until_ms")
            if state == str(BreakerState.OPEN) and isinstance(until, int) and until > now_ms:
                openings = rec.get("openings")
                if board.trip_remote(agent, now, now + (until - now_ms) / 1000.0,
                                     openings=openings if isinstance(openings, int) and openings > 0 else 1):
                    moved.append((agent, rec))
            elif state == str(BreakerState.CLOSED) and board.release_remote(agent, now):
                moved.append((agent, rec))
        return moved


class RetryPolicy(Struct, frozen=True, forbid_unknown_fields=True):
    """Bounded retries of one agent call (spec §10: ``ETIMEOUT`` → retries + AIMD
    decrease; ``EAGENTDOWN`` → circuit break, reroute).

    ``max_attempts`` counts every attempt, the first included, so a call is
    tried at most ``max_attempts`` times and then given up: this policy never
    loops. Backoff before retry ``i`` (1-based) is
    ``min(max_backoff_s, base_backoff_s·2^(i-1)) · (1 ± jitter)``, never above
    ``max_backoff_s``. Only ``ETIMEOUT``, and ``EAGENTDOWN`` or ``EBUDGET`` that
    carries a ``retry_after_ms`` no longer than ``max_backoff_s`` (a peer's short
    outage; a reserve the shared store did not answer), are retried on the same
    next-hop; every other code (``EPROTO``, ``EBUDGET`` without one, ``ESEC``,
    ``EPREEMPT``, …) is final. Rerouting to the next FIB candidate is the dispatcher's, and a
    cyclic fallback graph is refused when the policy loads.
    """

    max_attempts: PositiveInt = 2
    base_backoff_s: NonNegFloat = 0.2
    max_backoff_s: NonNegFloat = 2.0
    jitter: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.2

    def __post_init__(self) -> None:
        if self.base_backoff_s > self.max_backoff_s:
            raise ValueError(f"base_backoff_s {self.base_backoff_s} > max_backoff_s {self.max_backoff_s}")

    def delays(self, rng: random.Random) -> list[float]:
        """The ``max_attempts - 1`` backoffs (s) before each retry, jittered by ``rng``."""
        return [self.delay(i, rng) for i in range(1, self.max_attempts)]

    def delay(self, attempt: int, rng: random.Random, *, retry_after_ms: int | None = None) -> float:
        """Backoff (s) after failed attempt ``attempt`` (1-based), at least the
        peer's ``retry_after_ms`` when it sent one."""
        d = _backoff(self.base_backoff_s, self.max_backoff_s, attempt - 1, self.jitter, rng)
        return max(d, retry_after_ms / 1000.0) if retry_after_ms is not None else d

    def should_retry(self, code: ErrorCode, attempt: int, *, retry_after_ms: int | None = None) -> bool:
        """Retry after attempt ``attempt`` (1-based) failed with ``code``? True
        only while ``attempt < max_attempts`` and for ``ETIMEOUT``, or
        ``EAGENTDOWN`` with a ``retry_after_ms`` ≤ ``max_backoff_s``."""
        if attempt >= self.max_attempts:
            return False
        match ErrorCode(code):
            case ErrorCode.ETIMEOUT:
                return True
            case ErrorCode.EAGENTDOWN | ErrorCode.EBUDGET:
                # EBUDGET with a retry_after_ms: a reserve the shared store did not
                # answer (nothing decided, nothing called), never a budget that does not fit.
                return retry_after_ms is not None and retry_after_ms <= self.max_backoff_s * 1000.0
            case _:
                return False
