"""Budget leases (issue 22 item 2): a router's slice of a tenant's remaining
budget, so most of its calls reserve without a store round trip — the
distributed rate-limiter pattern applied to spend. Sans-IO: the decisions and
the bookkeeping of one slice; the store steps (take, commit inside it, return)
are the caller's (:class:`atp_router.deploy.cluster.ClusterLedger`).

A slice is held in the shared store as a reservation of its router on the
tenant's account (``client:<tenant>``): the sum of all routers' slices and
reservations never exceeds the limit (the store's reserve rule), and a lost
router's slice is released with its other reservations. Inside it the router
reserves a call (:meth:`BudgetLease.carve`) and releases one locally; a
call's commit is a store step carrying the most the slice may give it
(:meth:`BudgetLease.settle`): when the slice covers the call's actual usage the
charge is known here (:meth:`BudgetLease.certain`) — the same number the store's
commit rule gives — and needs no answer before the call's FINAL.

Sizes (tokens and USD micros, per limited axis; an unlimited axis holds
nothing): a slice aims at :data:`LEASE_SHARE` of the free budget divided by the
live routers, and is only used while that is at least :data:`LEASE_MIN_CALLS`
calls' reservations; below (near the limit) each call reserves in the store
as before, exact to the last token. It is refilled when less than half its aim
is free, and returned when idle for :data:`LEASE_IDLE_S` or when leases stop
paying. The constants are chosen a priori (the learning-rate slices' quarter),
not fitted to a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LEASE_IDLE_S", "LEASE_MIN_CALLS", "LEASE_SHARE", "BudgetLease", "lease_aim"]

#: A slice aims at this share of the free budget, divided by the live routers.
LEASE_SHARE = 0.25
#: Leases are used only while a slice's aim holds at least this many calls' reservations.
LEASE_MIN_CALLS = 8
#: A slice no call used for this long is returned to the tenant's budget, s.
LEASE_IDLE_S = 2.0


def lease_aim(free: tuple[float, float], routers: int, call: tuple[int, int]) -> tuple[int, int] | None:
    """The slice to aim at (tokens, USD micros; 0 on an unlimited axis) for a
    tenant whose chain has ``free`` budget (``inf``: unlimited), shared by
    ``routers`` live routers, for calls reserving ``call``; None when a slice
    that size would hold fewer than :data:`LEASE_MIN_CALLS` calls (reserve in
    the store instead)."""
    aim = []
    for f, c in zip(free, call, strict=True):
        if f == float("inf"):
            aim.append(0)
            continue
        a = int(max(0.0, f) * LEASE_SHARE / max(1, routers))
        if a < LEASE_MIN_CALLS * max(1, c):
            return None
        aim.append(a)
    return aim[0], aim[1]


@dataclass(slots=True)
class BudgetLease:
    """One router's slice of account ``parent`` (a tenant's), as this router
    knows it: ``hold`` what the store holds for it (never more than the store
    does: grants are added when answered, charges taken when made), ``alloc``
    what its open calls reserved inside it, per axis (tokens, USD micros);
    ``limited`` the axes the parent's chain limits (an unlimited axis holds
    nothing and every call fits)."""

    parent: str
    limited: tuple[bool, bool]
    id: int | None = None
    hold_t: int = 0
    hold_u: int = 0
    alloc_t: int = 0
    alloc_u: int = 0
    aim: tuple[int, int] = (0, 0)
    #: The last call's reservation the slice was sized for (tokens, USD micros): what
    #: :meth:`resize` checks the aim against between calls.
    call: tuple[int, int] = (0, 0)
    #: A take or a return is in flight (no other is started).
    busy: bool = False
    #: A take sent and not answered yet, or whose answer was lost (the store timed out: it
    #: may have run, or run late): (its request name, tokens, USD micros), sent again under
    #: that name — applied once — before anything else is done with the slice. No call
    #: reserves in the slice meanwhile (what the store holds is not known); a shrink is
    #: already off :attr:`hold` (:meth:`ask`). A take the store refused is dropped with its
    #: shrink kept off: the store then holds more than seen here, released with the slice.
    take: tuple[str, int, int] | None = None
    #: A return sent whose answer was lost: sent again; no call reserves in the slice.
    returning: bool = False
    #: When a call last reserved in it (the caller's monotonic clock, s).
    used_at: float = 0.0

    @property
    def free(self) -> tuple[int, int]:
        """What no open call holds, per axis."""
        return self.hold_t - self.alloc_t, self.hold_u - self.alloc_u

    def covers(self, tokens: int, usd_micros: int) -> bool:
        """Whether a call of ``tokens`` / ``usd_micros`` fits in what is free
        (never while a store step on the slice is in flight or unanswered, nor
        once retired)."""
        ft, fu = self.free
        return (self.id is not None and not self.busy and not self.retired and self.take is None
                and not self.returning
                and (not self.limited[0] or tokens <= ft) and (not self.limited[1] or usd_micros <= fu))

    @property
    def retired(self) -> bool:
        """No longer worth it (the tenant near its limit, aim 0): to be returned."""
        return self.aim == (0, 0) and self.limited != (False, False)

    def carve(self, tokens: int, usd_micros: int, now: float) -> None:
        """Hold a call's reservation inside the slice (:meth:`covers` first)."""
        if self.limited[0]:
            self.alloc_t += tokens
        if self.limited[1]:
            self.alloc_u += usd_micros
        self.used_at = now

    def uncarve(self, tokens: int, usd_micros: int) -> None:
        """A call's reservation given back to the slice (a release)."""
        if self.limited[0]:
            self.alloc_t -= tokens
        if self.limited[1]:
            self.alloc_u -= usd_micros

    def certain(self, reserved: tuple[int, int], actual: tuple[int, int]) -> bool:
        """Whether the slice covers a call's ``actual`` usage beyond its
        ``reserved`` amount: its charge is then ``min(actual, the stream's room)``,
        known without the store's answer."""
        ft, fu = self.free
        return ((not self.limited[0] or actual[0] - reserved[0] <= ft)
                and (not self.limited[1] or actual[1] - reserved[1] <= fu))

    def cap(self, reserved: tuple[int, int]) -> tuple[int, int]:
        """The most the slice may give a call holding ``reserved``: its own
        reservation and all that is free (0 on an unlimited axis)."""
        ft, fu = self.free
        return (reserved[0] + max(0, ft) if self.limited[0] else 0, reserved[1] + max(0, fu) if self.limited[1] else 0)

    def settle(self, held: tuple[int, int], cap: tuple[int, int], charged: tuple[int, int]) -> None:
        """A call's commit made: what it ``held`` in the slice (its reservation,
        or the whole ``cap`` while an uncertain commit was answered:
        :meth:`hold_for`) leaves ``alloc``; the part of ``charged`` the slice
        gave (at most ``cap``) leaves ``hold``."""
        if self.limited[0]:
            self.alloc_t -= held[0]
            self.hold_t -= min(charged[0], cap[0])
        if self.limited[1]:
            self.alloc_u -= held[1]
            self.hold_u -= min(charged[1], cap[1])

    def hold_for(self, reserved: tuple[int, int], cap: tuple[int, int]) -> None:
        """An uncertain commit sent: the slice's free part held for it until answered."""
        if self.limited[0]:
            self.alloc_t += cap[0] - reserved[0]
        if self.limited[1]:
            self.alloc_u += cap[1] - reserved[1]

    def want(self) -> tuple[int, int] | None:
        """What to ask the store for now (per axis, up to the aim), or None:
        nothing while a step is in flight or unanswered, or more than half the aim is free."""
        if self.busy or self.take is not None or self.returning:
            return None
        ft, fu = self.free
        low = any(lim and f * 2 < a for lim, f, a in zip(self.limited, (ft, fu), self.aim, strict=True))
        if self.id is not None and not low:
            return None
        return (max(0, self.aim[0] - ft) if self.limited[0] else 0, max(0, self.aim[1] - fu) if self.limited[1] else 0)

    def ask(self, request: str, tokens: int, usd_micros: int) -> None:
        """A take sent to the store under the name ``request``: grow the slice
        by ``tokens`` / ``usd_micros``, or shrink it (negative amounts: given
        back). A shrink leaves :attr:`hold` at once — from the moment it is sent
        the part given back is not this router's to use, whether the store has
        applied it yet or not (its answer may come late, or be lost and the
        take sent again by name) —, so no call's charge is decided on it
        (:meth:`certain`, :meth:`cap`); a grow counts only once answered
        (:meth:`answered`). ``hold`` is thus never more than the store holds."""
        self.take = (request, tokens, usd_micros)
        self.hold_t += min(0, tokens)
        self.hold_u += min(0, usd_micros)

    def answered(self, lease_id: int, tokens: int, usd_micros: int) -> None:
        """The store's answer to the take in flight (:meth:`ask`): the slice
        ``lease_id`` changed by ``tokens`` / ``usd_micros`` (negative: given
        back; a shrink was already taken off :attr:`hold` when sent)."""
        assert self.take is not None
        _, wt, wu = self.take
        self.take = None
        self.id = lease_id
        self.hold_t += tokens - min(0, wt)
        self.hold_u += usd_micros - min(0, wu)

    def resize(self, free: tuple[float, float], routers: int) -> bool:
        """Retire the slice when the tenant's ``free`` budget (as last seen:
        tokens, USD micros; ``inf`` unlimited), shared by ``routers``, no longer
        pays for one (:func:`lease_aim` None for the last call's size): called
        between calls too, so a router that has no call to make gives its
        slice back as soon as it sees the tenant near its limit, not only once
        idle — a slice's free part is not another router's. True when it was
        retired now."""
        if self.retired or self.id is None or lease_aim(free, routers, self.call) is not None:
            return False
        self.aim = (0, 0)
        return True

    def idle(self, now: float) -> bool:
        """Whether the slice is unused (no open call in it) for :data:`LEASE_IDLE_S`."""
        return (self.id is not None and not self.busy and self.take is None and self.alloc_t == 0
                and self.alloc_u == 0 and now - self.used_at >= LEASE_IDLE_S)
