"""Flow-control windows with AIMD (spec §5.1–§5.4, §9 gold minima, §10 EWINDOW). Sans-IO.

One :class:`Window` per stream and one per next-hop; a call goes out when every
window on its path admits it. A window holds the triplet limits (the wire form
is :class:`atp_router.wire.frame.Window`) and what is in flight, and — as h2's window
managers do — it *returns decisions* instead of acting:

* :meth:`Window.admit` → :class:`Admission` (refused: ``EWINDOW`` plus the
  WINDOW_UPDATE to send with the NACK);
* :meth:`Window.on_send` / :meth:`Window.on_complete` account a call and run AIMD
  (:meth:`Window.on_cancel` takes a call out without AIMD: an RST or a preemption
  says nothing about the next-hop's congestion);
* :meth:`Window.admit_when_idle` → could the call fit at all (else NACK without
  queueing: it would wait forever);
* :meth:`Window.update_due` → the WINDOW_UPDATE to send now, or ``None``.

:class:`WindowTable` keeps one window per next-hop agent, shared by every stream
that calls it, with the agent's own triplet (the RIB's ``agents.<name>.window``)
or a default, and survives RIB reloads (AIMD state is kept; limits are adopted).
Calls waiting for room in a next-hop window wait in its :class:`WindowQueue`
(spec §9): gold first, then silver and bronze by weighted fair queuing, handed
the room one at a time as it opens.

The *effective window* is ``(min(floor(cwnd), max_parallel), max_tokens,
max_usd_micros)``: limits on what may be outstanding, which is what a
WINDOW_UPDATE advertises. Tokens and USD are counted from preflight estimates
(spec §5.2) while a call is in flight.

AIMD on the concurrency window (``cwnd``, in calls):

* a timely successful completion (ACK) grows ``cwnd`` by 1 below ``ssthresh``
  (slow start) and by ``1/cwnd`` from there (congestion avoidance);
* a failure (5xx, ``ETIMEOUT``, ``EAGENTDOWN``: ``ok=False``) or a completion
  past its deadline (``timely=False``) sets ``ssthresh = cwnd = max(1, cwnd/2)``;
  calls already in flight at that moment cannot decrease it again (one
  reduction per window, as TCP NewReno), else a fan-out whose calls time out
  together would collapse the window to 1;
* ``1 <= cwnd <= max(1, max_parallel)`` always.

A fresh window starts at ``cwnd = max_parallel`` (the peer chose that window);
pass ``initial_cwnd=1`` to slow-start, e.g. when a circuit breaker half-opens.
Time is an argument (``now``, seconds); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from fractions import Fraction
from typing import Annotated, Generic, TypeVar

from msgspec import Meta, Struct

from atp_router.flow.budget import usd_to_micros
from atp_router.flow.qos import DEFAULT_WEIGHTS
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import CostEstimate, QoS, WindowUpdate
from atp_router.wire.frame import Window as WireWindow

NonNegInt = Annotated[int, Meta(ge=0)]
_EPS = 1e-9  # floor(cwnd) must not lose a call to float rounding (2.9999999 → 3)
_NOTHING_HELD = WireWindow(max_parallel=0, max_tokens=0, max_usd_micros=0)


class Estimate(Struct, frozen=True, forbid_unknown_fields=True):
    """A preflight estimate (spec §5.2): tokens (in+out) and USD micros."""

    tokens: NonNegInt
    usd_micros: NonNegInt

    @classmethod
    def from_cost(cls, cost: CostEstimate) -> Estimate:
        """From the wire ``payload.cost_est`` (float USD, rounded half-even)."""
        return cls(tokens=cost.in_tokens + cost.out_tokens, usd_micros=usd_to_micros(cost.usd))


class Admission(Struct, frozen=True):
    """Decision of :meth:`Window.admit`. When refused, ``code`` is ``EWINDOW``,
    ``reason`` names the exhausted axis, and ``window_update`` is the effective
    window to send with the NACK (spec §10: NACK + WINDOW_UPDATE)."""

    admitted: bool
    reason: str = ""
    code: ErrorCode | None = None
    window_update: WindowUpdate | None = None


_ADMITTED = Admission(admitted=True)


class InFlight(Struct, frozen=True):
    """A call accounted by :meth:`Window.on_send`; hand it to :meth:`Window.on_complete`."""

    seq: int
    est: Estimate


class WindowStatistics(Struct, frozen=True):
    """Snapshot of a window: AIMD state, in-flight use, and totals of completed
    calls (actual tokens and USD micros as reported to ``on_complete``)."""

    cwnd: float
    ssthresh: float
    effective: WireWindow
    in_flight: int
    tokens_in_flight: int
    usd_micros_in_flight: int
    completed: int
    used_tokens: int
    used_usd_micros: int


class Window:
    """Flow-control window of one stream or one next-hop (see the module docstring).

    ``limits``: the triplet (calls, tokens, USD micros). ``update_interval_ms``:
    period of WINDOW_UPDATE (spec §5.4 "every N ms") while the window changes;
    an unchanged window is re-sent only every ``update_keepalive_ms`` (default
    and minimum: ``update_interval_ms``, spec §5.4 to the letter), so a stalled call does not
    repeat the same update every period. ``update_delta``: relative
    move of any effective axis that makes an update due at once (§5.4: 20 %).
    ``initial_cwnd``: start of ``cwnd`` (default ``max_parallel``).
    ``gold_minimum``: headroom on each axis that only gold calls may use
    (spec §9 "gold has reserved minima"); other classes must leave it free.
    """

    def __init__(
        self,
        limits: WireWindow,
        *,
        update_interval_ms: int = 1000,
        update_delta: float = 0.2,
        initial_cwnd: float | None = None,
        gold_minimum: WireWindow | None = None,
        update_keepalive_ms: int | None = None,
    ) -> None:
        if update_interval_ms <= 0 or update_delta <= 0.0:
            raise ValueError("update_interval_ms and update_delta must be > 0")
        if update_keepalive_ms is not None and update_keepalive_ms < update_interval_ms:
            raise ValueError(f"update_keepalive_ms {update_keepalive_ms} < update_interval_ms {update_interval_ms}")
        self.limits = limits
        self.update_interval_ms = update_interval_ms
        self.update_keepalive_ms = update_interval_ms if update_keepalive_ms is None else update_keepalive_ms
        self.update_delta = update_delta
        self._delta = Fraction(repr(update_delta))  # exact: 20 % of 10 is 2, not 2.0000000000000004
        self.gold_minimum = gold_minimum
        self.cwnd = self._clamp(float(limits.max_parallel) if initial_cwnd is None else initial_cwnd)
        self.ssthresh = float(max(1, limits.max_parallel))
        self.in_flight = 0
        self.tokens_in_flight = 0
        self.usd_micros_in_flight = 0
        self._calls: dict[int, Estimate] = {}
        self._next_seq = 0
        self._recover_seq = 0  # calls sent before this seq saw the last decrease coming
        self._completed = 0
        self._used_tokens = 0
        self._used_usd = 0
        self._sent: WireWindow | None = None
        self._sent_at = 0.0
        self._ticked_at = 0.0  # the last periodic check (an update sent, or none due)

    def effective(self) -> WireWindow:
        """The window in force: AIMD's parallel allowance and the token/USD limits."""
        lim = self.limits
        return WireWindow(
            max_parallel=min(math.floor(self.cwnd + _EPS), lim.max_parallel),
            max_tokens=lim.max_tokens,
            max_usd_micros=lim.max_usd_micros,
        )

    def admit(self, est: Estimate, *, qos: QoS = QoS.SILVER) -> Admission:
        """Would a call of ``est`` fit now (spec §5.2 preflight)? Changes nothing.

        Admitted iff, after adding it, in-flight calls ≤ effective parallel,
        tokens in flight ≤ ``max_tokens`` and USD micros in flight ≤
        ``max_usd_micros`` — each less ``gold_minimum`` unless ``qos`` is gold.
        """
        eff = self.effective()
        held = self.gold_minimum if self.gold_minimum is not None and qos != QoS.GOLD else _NOTHING_HELD
        checks = (
            ("parallel", self.in_flight + 1, eff.max_parallel, held.max_parallel),
            ("tokens", self.tokens_in_flight + est.tokens, eff.max_tokens, held.max_tokens),
            ("usd_micros", self.usd_micros_in_flight + est.usd_micros, eff.max_usd_micros, held.max_usd_micros),
        )
        return self._decide(checks, eff)

    @staticmethod
    def _decide(checks: tuple[tuple[str, int, int, int], ...], eff: WireWindow) -> Admission:
        for axis, need, limit, reserve in checks:
            if need > limit - reserve:
                note = f" ({reserve} held for gold)" if reserve else ""
                return Admission(
                    admitted=False,
                    reason=f"{axis}: {need} would exceed window {limit}{note}",
                    code=ErrorCode.EWINDOW,
                    window_update=WindowUpdate(window=eff),
                )
        return _ADMITTED

    def on_send(self, est: Estimate, *, qos: QoS = QoS.SILVER) -> InFlight:
        """Account a call of ``est`` as in flight and return its handle.

        Re-checks admission so that a send never exceeds the window even if the
        state moved since :meth:`admit`; raises :class:`ATPError` (``EWINDOW``)
        if it does not fit.
        """
        decision = self.admit(est, qos=qos)
        if not decision.admitted:
            raise ATPError(ErrorCode.EWINDOW, decision.reason)
        call = InFlight(seq=self._next_seq, est=est)
        self._next_seq += 1
        self._calls[call.seq] = est
        self.in_flight += 1
        self.tokens_in_flight += est.tokens
        self.usd_micros_in_flight += est.usd_micros
        return call

    def on_complete(
        self, call: InFlight, actual_tokens: int, actual_usd_micros: int, *, ok: bool, timely: bool
    ) -> None:
        """Take ``call`` out of flight and run AIMD (see the module docstring).

        ``ok``: the next-hop answered successfully (``False`` on 5xx, ETIMEOUT,
        EAGENTDOWN). ``timely``: it finished before its deadline.
        ``actual_tokens`` / ``actual_usd_micros`` feed the statistics. Raises
        ``ValueError`` if ``call`` is not in flight on this window.
        """
        est = self._calls.pop(call.seq, None)
        if est is None:
            raise ValueError(f"call {call.seq} is not in flight on this window")
        self.in_flight -= 1
        self.tokens_in_flight -= est.tokens
        self.usd_micros_in_flight -= est.usd_micros
        self._completed += 1
        self._used_tokens += actual_tokens
        self._used_usd += actual_usd_micros
        if ok and timely:
            self.cwnd = self._clamp(self.cwnd + (1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd))
        elif call.seq >= self._recover_seq:
            self.ssthresh = self.cwnd = self._clamp(self.cwnd * 0.5)
            self._recover_seq = self._next_seq

    def on_cancel(self, call: InFlight) -> None:
        """Take ``call`` out of flight without AIMD: it was cancelled (RST, QoS
        preemption, stream deadline) and says nothing about congestion at the
        next-hop. Raises ``ValueError`` if ``call`` is not in flight here."""
        est = self._calls.pop(call.seq, None)
        if est is None:
            raise ValueError(f"call {call.seq} is not in flight on this window")
        self.in_flight -= 1
        self.tokens_in_flight -= est.tokens
        self.usd_micros_in_flight -= est.usd_micros

    def admit_when_idle(self, est: Estimate, *, qos: QoS = QoS.SILVER) -> Admission:
        """:meth:`admit` as if nothing were in flight, at the current limits and
        ``cwnd``. Refused means waiting cannot help (the estimate alone exceeds
        the window): NACK with EWINDOW at once instead of queueing."""
        eff = self.effective()
        held = self.gold_minimum if self.gold_minimum is not None and qos != QoS.GOLD else _NOTHING_HELD
        checks = (
            ("parallel", 1, eff.max_parallel, held.max_parallel),
            ("tokens", est.tokens, eff.max_tokens, held.max_tokens),
            ("usd_micros", est.usd_micros, eff.max_usd_micros, held.max_usd_micros),
        )
        return self._decide(checks, eff)

    def set_limits(self, limits: WireWindow) -> None:
        """Adopt new limits (a peer's new window, or a budget cap); ``cwnd`` is
        clamped into them. Calls in flight stay accounted."""
        self.limits = limits
        self.cwnd = self._clamp(self.cwnd)
        self.ssthresh = self._clamp(self.ssthresh)

    def update_due(self, now: float) -> WindowUpdate | None:
        """The WINDOW_UPDATE to send at ``now`` (seconds), or ``None`` (spec §5.4).

        Due when none was sent yet; when any effective axis moved by ≥
        ``update_delta`` relative to the last one sent (from 0, any move); at
        the periodic check (:meth:`next_update_at`, every ``update_interval_ms``)
        when the window differs at all from the last one sent, or when
        ``update_keepalive_ms`` passed since it. A returned update counts as
        sent at ``now``; the caller sets ``ack`` if it piggybacks one.
        """
        eff = self.effective()
        last = self._sent
        due = last is None or self._moved(last, eff)
        if not due and now >= self.next_update_at():
            self._ticked_at = now
            # (to the nanosecond: periodic checks a float sum of intervals apart land on it)
            due = eff != last or now + _EPS >= self._sent_at + self.update_keepalive_ms / 1000.0
        if due:
            self._sent, self._sent_at, self._ticked_at = eff, now, now
            return WindowUpdate(window=eff)
        return None

    def next_update_at(self) -> float:
        """Time (seconds, same clock as ``now``) of the next periodic check of
        :meth:`update_due`, ``update_interval_ms`` after the last one; ``-inf``
        before the first update, which is due at once."""
        if self._sent is None:
            return -math.inf
        return self._ticked_at + self.update_interval_ms / 1000.0

    def statistics(self) -> WindowStatistics:
        return WindowStatistics(
            cwnd=self.cwnd,
            ssthresh=self.ssthresh,
            effective=self.effective(),
            in_flight=self.in_flight,
            tokens_in_flight=self.tokens_in_flight,
            usd_micros_in_flight=self.usd_micros_in_flight,
            completed=self._completed,
            used_tokens=self._used_tokens,
            used_usd_micros=self._used_usd,
        )

    def _clamp(self, cwnd: float) -> float:
        return min(max(cwnd, 1.0), float(max(1, self.limits.max_parallel)))

    def _moved(self, old: WireWindow, new: WireWindow) -> bool:
        for a, b in (
            (old.max_parallel, new.max_parallel),
            (old.max_tokens, new.max_tokens),
            (old.max_usd_micros, new.max_usd_micros),
        ):
            if a != b and (a == 0 or abs(b - a) >= self._delta * a):
                return True
        return False


_CLASSES = (QoS.GOLD, QoS.SILVER, QoS.BRONZE)

#: The key a call waits under in a :class:`WindowQueue` (admission's ``Call``).
K = TypeVar("K", bound=Hashable)


class WindowQueue(Generic[K]):
    """Calls waiting for room in one :class:`Window`, admitted in class order
    (spec §9): **gold first**; silver and bronze by weighted fair queuing (virtual
    finish tags with ``weights``, as :class:`~atp_router.flow.qos.QosScheduler`: a class
    that becomes backlogged starts at the virtual time, so idle time earns no
    credit and neither class starves); FIFO within a class.

    A hand-off, not a wake-up: :meth:`pump` accounts each call it admits on the
    window itself (:meth:`Window.on_send`) and returns it, so the waiter it names
    already holds its room and nobody else can take it first — one waiter per
    freed room, no thundering herd. The pump stops at the first head that does
    not fit, so a large call is not overtaken forever by smaller ones.
    Call :meth:`pump` whenever room may have opened (a call completed or was
    cancelled, the limits moved) and after :meth:`enqueue`. Generic in the key
    type ``K``: :meth:`pump` hands back the keys :meth:`enqueue` was given.
    """

    def __init__(self, window: Window, *, weights: Mapping[QoS, float] = DEFAULT_WEIGHTS) -> None:
        self.window = window
        self._cost = {c: 1.0 / float(weights[c]) for c in _CLASSES}
        self._finish = dict.fromkeys(_CLASSES, 0.0)
        self._vtime = 0.0
        self._queues: dict[QoS, OrderedDict[K, Estimate]] = {c: OrderedDict() for c in _CLASSES}
        self._class_of: dict[K, QoS] = {}

    def __len__(self) -> int:
        return len(self._class_of)

    def waiting(self, qos: QoS) -> int:
        """Calls of class ``qos`` waiting now."""
        return len(self._queues[qos])

    def enqueue(self, key: K, est: Estimate, qos: QoS) -> None:
        """Queue a call of ``est`` in class ``qos`` under ``key`` (unique among the
        waiting ones; raises ``ValueError`` if it waits already). It is admitted
        by a later :meth:`pump`."""
        if key in self._class_of:
            raise ValueError(f"{key!r} is already waiting")
        qos = QoS(qos)
        queue = self._queues[qos]
        if not queue:
            self._finish[qos] = max(self._finish[qos], self._vtime)
        queue[key] = est
        self._class_of[key] = qos

    def cancel(self, key: K) -> bool:
        """Withdraw a waiting call; ``False`` if ``key`` is not waiting (admitted
        already, or unknown)."""
        qos = self._class_of.pop(key, None)
        if qos is None:
            return False
        del self._queues[qos][key]
        self._advance_vtime()
        return True

    def pump(self) -> list[tuple[K, InFlight]]:
        """Admit waiting calls in class order while the head fits the window;
        each is accounted on the window (its :class:`InFlight` returned with its
        key, in admission order)."""
        out: list[tuple[K, InFlight]] = []
        while (c := self._pick()) is not None:
            queue = self._queues[c]
            key, est = next(iter(queue.items()))
            if not self.window.admit(est, qos=c).admitted:
                break
            del queue[key]
            del self._class_of[key]
            if c is not QoS.GOLD:
                self._finish[c] += self._cost[c]
            out.append((key, self.window.on_send(est, qos=c)))
        self._advance_vtime()
        return out

    def _pick(self) -> QoS | None:
        if self._queues[QoS.GOLD]:
            return QoS.GOLD
        best: QoS | None = None
        best_tag = math.inf
        for c in (QoS.SILVER, QoS.BRONZE):
            if self._queues[c] and (tag := self._finish[c] + self._cost[c]) < best_tag:
                best, best_tag = c, tag
        return best

    def _advance_vtime(self) -> None:
        self._vtime = min((self._finish[c] for c in (QoS.SILVER, QoS.BRONZE) if self._queues[c]),
                          default=self._vtime)


class WindowTable(Generic[K]):
    """One :class:`Window` per next-hop agent (spec §5.1 "per agent next-hop"),
    shared by every stream that calls it.

    ``default``: the triplet of an agent without its own; ``limits``: agent
    name → its own triplet (RIB ``agents.<name>.window``), ``None`` for the
    default. Windows are created on first use and keep their AIMD state
    (``cwnd``, ``ssthresh``) and calls in flight across :meth:`configure`,
    which only adopts new limits. ``K``: the key of the calls waiting in the
    windows' :class:`WindowQueue`.
    """

    def __init__(
        self,
        default: WireWindow,
        limits: Mapping[str, WireWindow | None] | None = None,
        *,
        update_interval_ms: int = 1000,
        update_delta: float = 0.2,
    ) -> None:
        self.default = default
        self._limits: dict[str, WireWindow | None] = dict(limits or {})
        self._interval = update_interval_ms
        self._delta = update_delta
        self._windows: dict[str, Window] = {}
        self._queues: dict[str, WindowQueue[K]] = {}

    def limits_of(self, agent: str) -> WireWindow:
        """The triplet ``agent``'s window uses (its own, else the default)."""
        return self._limits.get(agent) or self.default

    def window(self, agent: str) -> Window:
        """The window of ``agent`` (created with its limits on first use)."""
        w = self._windows.get(agent)
        if w is None:
            w = self._windows[agent] = Window(
                self.limits_of(agent), update_interval_ms=self._interval, update_delta=self._delta
            )
        return w

    def queue(self, agent: str) -> WindowQueue[K]:
        """The :class:`WindowQueue` of ``agent``'s window (created on first use)."""
        q = self._queues.get(agent)
        if q is None:
            q = self._queues[agent] = WindowQueue(self.window(agent))
        return q

    def configure(self, limits: Mapping[str, WireWindow | None]) -> None:
        """Adopt a new RIB: ``limits`` names every agent (value ``None``: the
        default triplet). Existing windows keep their AIMD state, in-flight calls
        and waiting calls (``cwnd`` is clamped into the new limits); idle windows
        of agents gone from the RIB are dropped. Pump the queues afterwards: the
        new limits may admit waiting calls."""
        self._limits = dict(limits)
        for agent, w in list(self._windows.items()):
            q = self._queues.get(agent)
            if agent not in self._limits and w.in_flight == 0 and not q:
                del self._windows[agent]
                self._queues.pop(agent, None)
            else:
                w.set_limits(self.limits_of(agent))

    def agents(self) -> list[str]:
        """Agents whose window exists now."""
        return list(self._windows)

    def statistics(self) -> dict[str, WindowStatistics]:
        """:meth:`Window.statistics` of every agent window in use, by name."""
        return {a: w.statistics() for a, w in self._windows.items()}
