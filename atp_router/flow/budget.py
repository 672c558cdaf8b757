"""Budget governor: reserve → commit ledger in tokens and integer USD micros
(spec §5.1 budget window, §4.3 BUDGET_UPDATE, §10 EBUDGET). Sans-IO.

Money is integer USD micros (1 USD = 1_000_000) everywhere inside; float USD
is converted at the edge with :func:`usd_to_micros` (round half-even).

Accounts are hierarchical: a stream's account has its client's account as
parent, and so on up. Amounts held or spent by a child are also held or spent
by every ancestor, so a reservation must fit the whole chain.

The protocol for one agent call::

    r = ledger.reserve(stream, est_tokens, est_usd_micros)    # before the call
    if isinstance(r, Refusal): ...                             # EBUDGET → FIN
    ...stream the call; when its usage passes r:
    r = ledger.extend(r, more_tokens, more_usd_micros)         # hold more, or
    if isinstance(r, Refusal): ...cut the call...              # EBUDGET
    ledger.commit(r, actual_tokens, actual_usd_micros)         # after it
    # or ledger.release(r) when nothing was consumed

Why nobody can overspend: every method is synchronous and checks and applies
in one step (no checkpoint in between), so concurrent tasks cannot both pass a
check on the same headroom (the check-then-spend race of LLM gateways).
:meth:`BudgetLedger.reserve` holds the estimate up front against the whole
chain; the caller watches streamed usage and cuts the call before it passes
the reservation. :meth:`BudgetLedger.commit` then charges ``actual``, but
never more than the account chain can still take (its free headroom plus this
reservation); any excess — the tail that was already generated when the call
was cut, or a provider billing above its estimate — is recorded as
``overage`` and never charged. A call streaming past its estimate grows its
reservation with :meth:`BudgetLedger.extend` (checked and held in one step, so
two concurrent calls cannot both count on the same free headroom); the
overage of a cut call is then at most the one usage report that passed. Hence, for every account and axis, always::

    committed + reserved <= limit

Durability stays out of this module (no I/O): a :class:`LedgerJournal` given as
``BudgetLedger(journal=...)`` is told of every mutation right after it
succeeded in memory, so a store can persist it (``atp_router.store.StoreJournal``);
a journal that raises on :meth:`BudgetLedger.open` or :meth:`BudgetLedger.reserve`
(new spend the store could not take) leaves the ledger as it was before the call;
:meth:`BudgetLedger.snapshot` and :meth:`BudgetLedger.restore` rebuild a ledger
from what was persisted, committed spend included.

Several processes (``atp-router --workers N``) share a tenant's account through
:class:`SharedBudgetLedger`: the same API, each step decided atomically by a
:class:`SharedAccounts` (the state store) instead of in memory, so the
invariant above holds across processes too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Annotated, Any, Protocol

from msgspec import Meta, Struct

from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Budget

NonNegInt = Annotated[int, Meta(ge=0)]
_MICROS = Decimal(1_000_000)


@functools.lru_cache(maxsize=4096)  # pure; prices and budgets repeat (a miss costs the Decimal path, ~1 µs)
def usd_to_micros(usd: float | str | Decimal) -> int:
    """USD (float, int, decimal string or Decimal) → integer USD micros,
    rounded half-even. A float is read through its shortest repr, so
    ``0.91`` is exactly 910_000 and not 909_999. Raises ``ValueError`` for a
    negative, NaN or infinite amount."""
    try:
        d = Decimal(repr(usd)) if isinstance(usd, float) else Decimal(usd)
    except InvalidOperation:
        raise ValueError(f"not a USD amount: {usd!r}") from None
    if not d.is_finite() or d < 0:
        raise ValueError(f"USD amount must be finite and >= 0, got {usd!r}")
    return int((d * _MICROS).to_integral_value(rounding=ROUND_HALF_EVEN))


def micros_to_usd(micros: int) -> float:
    """Integer USD micros → float USD, for the wire fields that carry float USD
    (``telemetry.usd``, ``cost_est.usd``)."""
    return micros / 1_000_000


class Allowance(Struct, frozen=True, forbid_unknown_fields=True):
    """Tokens and USD micros on one account; ``None`` means unlimited on that axis."""

    tokens: NonNegInt | None = None
    usd_micros: NonNegInt | None = None

    @classmethod
    def from_budget(cls, budget: Budget) -> Allowance:
        """The wire :class:`~atp_router.wire.frame.Budget` (float USD) as an allowance."""
        return cls(tokens=budget.tokens, usd_micros=None if budget.usd is None else usd_to_micros(budget.usd))


class Reservation(Struct, frozen=True, forbid_unknown_fields=True):
    """Held headroom on ``key`` and its ancestors; settle it once with
    :meth:`BudgetLedger.commit` or :meth:`BudgetLedger.release`."""

    id: int
    key: str
    tokens: int
    usd_micros: int


class Refusal(Struct, frozen=True, forbid_unknown_fields=True):
    """A reservation (or limit change) that does not fit. ``key`` is the account
    that refused (the stream's or an ancestor's); ``remaining`` what it had.
    ``retry_after_ms`` is set only when nothing was decided — the shared store
    could not be reached (:class:`~atp_router.deploy.cluster.ClusterLedger`) —
    so the same reserve may be granted after it; a budget that does not fit
    has none."""

    key: str
    reason: str
    remaining: Allowance
    code: ErrorCode = ErrorCode.EBUDGET
    retry_after_ms: int | None = None


class CallRecord(Struct, frozen=True, forbid_unknown_fields=True):
    """The answer a commit pays for, stored by a shared store in the same
    atomic step as the charge (issue 22: a stream re-run on another router
    finds the answer iff it was charged, and does not call and charge again).
    ``key``: the call's name (JSON ``[tenant, idempotency key, agent, n]``);
    ``value``: the answer, opaque bytes; ``ttl_ms``: how long it is kept."""

    key: str
    value: bytes
    ttl_ms: int


class StoredCall(Struct, frozen=True, forbid_unknown_fields=True):
    """A :class:`CallRecord` as stored: its ``value`` and what its commit
    charged (``tokens``, ``usd_micros``)."""

    value: bytes
    tokens: int
    usd_micros: int


class Charge(Struct, frozen=True, forbid_unknown_fields=True):
    """What :meth:`BudgetLedger.commit` charged and what it could not (overage)."""

    tokens: int
    usd_micros: int
    overage_tokens: int = 0
    overage_usd_micros: int = 0


class PendingCharge:
    """A commit a ledger accepted but could not apply yet (a shared store that
    cannot be reached: ``atp_router.deploy.cluster.ClusterLedger``). Its
    :attr:`charge` is known once the ledger applies it (:meth:`resolve`);
    until then the call's FINAL must not report a charge — the runtime waits
    for it (``on_done`` callbacks; no I/O and no clock here)."""

    __slots__ = ("_callbacks", "charge")

    def __init__(self) -> None:
        #: The charge the ledger applied, once it did; None before.
        self.charge: Charge | None = None
        self._callbacks: list[Callable[[], None]] = []

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once :attr:`charge` is known (at once if it is)."""
        if self.charge is not None:
            fn()
        else:
            self._callbacks.append(fn)

    def resolve(self, charge: Charge) -> None:
        """The commit was applied (or found applied, or dropped: a charge of 0)."""
        self.charge = charge
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class AccountState(Struct, frozen=True, forbid_unknown_fields=True):
    """A snapshot of one account; ``limit`` axes of ``None`` are unlimited."""

    key: str
    parent: str | None
    limit: Allowance
    reserved_tokens: int
    reserved_usd_micros: int
    committed_tokens: int
    committed_usd_micros: int
    overage_tokens: int
    overage_usd_micros: int
    open_reservations: int


class LedgerSnapshot(Struct, frozen=True, forbid_unknown_fields=True):
    """Everything needed to rebuild a :class:`BudgetLedger`: its open accounts in
    canonical order (by depth, then key: every parent before its children), its
    open reservations by id, and the next reservation id to hand out. The
    ``reserved_*`` and ``open_reservations`` fields of each account are what its
    reservations hold (checked by :meth:`BudgetLedger.restore`)."""

    accounts: tuple[AccountState, ...]
    reservations: tuple[Reservation, ...]
    next_id: Annotated[int, Meta(ge=1)] = 1


class LedgerJournal(Protocol):
    """Observer of ledger mutations, for durable state (issue 7). Each method is
    called by :class:`BudgetLedger` after the change succeeded in memory, never
    for a refusal or an error; an exception it raises propagates to the
    ledger's caller: :meth:`on_open` and :meth:`on_reserve`'s after the ledger
    undid the change, the others' with the in-memory change made."""

    def on_open(self, key: str, parent: str | None, limit: Allowance) -> None:
        """Account ``key`` was opened under ``parent`` with ``limit``."""

    def on_close(self, key: str) -> None:
        """Account ``key`` was closed (its spend stays in its ancestors)."""

    def on_reserve(self, reservation: Reservation) -> None:
        """``reservation`` now holds its tokens / USD micros on its chain."""

    def on_extend(self, reservation: Reservation) -> None:
        """Open reservation ``reservation.id`` grew to these totals."""

    def on_commit(self, reservation: Reservation, charge: Charge) -> None:
        """``reservation`` was settled and ``charge`` (with its overage) applied
        to its account and every ancestor."""

    def on_release(self, reservation: Reservation) -> None:
        """``reservation`` was settled with no usage."""

    def on_set_limit(self, key: str, limit: Allowance) -> None:
        """``key``'s own limit is now ``limit`` (after any clamp)."""


@dataclass(slots=True)
class _Account:
    key: str
    parent: _Account | None
    limit_tokens: int | None
    limit_usd: int | None
    reserved_tokens: int = 0
    reserved_usd: int = 0
    committed_tokens: int = 0
    committed_usd: int = 0
    overage_tokens: int = 0
    overage_usd: int = 0
    open: int = 0
    children: int = 0
    chain: list[_Account] = field(default_factory=list)

    def free_tokens(self) -> float:
        if self.limit_tokens is None:
            return math.inf
        return self.limit_tokens - self.committed_tokens - self.reserved_tokens

    def free_usd(self) -> float:
        if self.limit_usd is None:
            return math.inf
        return self.limit_usd - self.committed_usd - self.reserved_usd

    def chain_free(self) -> tuple[float, float]:
        """What this account could still take (tokens, USD micros): per axis the
        smallest free headroom along its chain (``inf``: unlimited)."""
        return min(a.free_tokens() for a in self.chain), min(a.free_usd() for a in self.chain)


class BudgetLedger:
    """Hierarchical reserve/commit ledger (see the module docstring).

    Keys are opaque strings (e.g. a client id and its stream ids). Errors in
    *use* (unknown key, settling a reservation twice, negative amounts) raise
    ``ValueError``; a budget that does not fit is a :class:`Refusal`, not an
    exception, because it is an ordinary outcome (spec §10 EBUDGET → FIN).
    """

    def __init__(self, *, journal: LedgerJournal | None = None) -> None:
        self._accounts: dict[str, _Account] = {}
        self._open: dict[int, Reservation] = {}
        self._next_id = 1
        #: Told of every successful mutation (see :class:`LedgerJournal`); may be set later.
        self.journal = journal

    def open(self, key: str, limit: Allowance, *, parent: str | None = None) -> None:
        """Create account ``key`` with ``limit`` under ``parent`` (which must exist).
        Raises ``ValueError`` if ``key`` exists or ``parent`` does not."""
        if key in self._accounts:
            raise ValueError(f"budget account {key!r} already open")
        up = self._get(parent) if parent is not None else None
        acct = _Account(key, up, limit.tokens, limit.usd_micros)
        acct.chain = [acct, *(up.chain if up is not None else [])]
        if up is not None:
            up.children += 1
        self._accounts[key] = acct
        if self.journal is not None:
            try:
                self.journal.on_open(key, parent, limit)
            except BaseException:
                # Not journaled, not opened: the ledger is as it was (the caller refuses the stream).
                del self._accounts[key]
                if up is not None:
                    up.children -= 1
                raise

    def close(self, key: str) -> AccountState:
        """Forget account ``key`` (its spend stays in its ancestors) and return its
        final state. Raises ``ValueError`` while it has open reservations or
        child accounts."""
        acct = self._get(key)
        if acct.open or acct.children:
            raise ValueError(
                f"budget account {key!r} has {acct.open} open reservation(s) and {acct.children} child account(s)"
            )
        state = self.state(key)
        if acct.parent is not None:
            acct.parent.children -= 1
        del self._accounts[key]
        if self.journal is not None:
            self.journal.on_close(key)
        return state

    def reserve(self, key: str, tokens: int, usd_micros: int) -> Reservation | Refusal:
        """Hold ``tokens`` and ``usd_micros`` on ``key`` and every ancestor, all or
        nothing (spec §5.2 preflight). Returns a :class:`Refusal` (``EBUDGET``)
        naming the first account in the chain (nearest first) that cannot take
        it. Raises ``ValueError`` on an unknown key or a negative amount."""
        _check_amounts(tokens, usd_micros)
        acct = self._get(key)
        for a in acct.chain:
            if tokens > a.free_tokens() or usd_micros > a.free_usd():
                return self._refusal(a, f"reserve {tokens} tokens / {usd_micros} usd_micros on {key!r}")
        for a in acct.chain:
            a.reserved_tokens += tokens
            a.reserved_usd += usd_micros
        acct.open += 1
        r = Reservation(id=self._next_id, key=key, tokens=tokens, usd_micros=usd_micros)
        self._next_id += 1
        self._open[r.id] = r
        if self.journal is not None:
            try:
                self.journal.on_reserve(r)
            except BaseException:
                # Not journaled, not held: the call must not run on it.
                del self._open[r.id]
                self._next_id -= 1  # never stored: the id is free again
                acct.open -= 1
                for a in acct.chain:
                    a.reserved_tokens -= tokens
                    a.reserved_usd -= usd_micros
                raise
        return r

    def commit(self, reservation: Reservation, actual_tokens: int, actual_usd_micros: int) -> Charge:
        """Settle ``reservation`` with the call's actual usage and return the
        :class:`Charge`. The charge on each axis is ``min(actual, what the chain
        can take)`` once the reservation's hold is lifted — at least the
        reserved amount, so usage within the reservation is always charged in
        full. The rest is recorded as overage on the account and its ancestors.
        Raises ``ValueError`` if the reservation is not open or an amount is
        negative."""
        _check_amounts(actual_tokens, actual_usd_micros)
        acct = self._settle(reservation)
        room_t = min(a.free_tokens() for a in acct.chain)
        room_u = min(a.free_usd() for a in acct.chain)
        charge_t = int(min(actual_tokens, room_t))
        charge_u = int(min(actual_usd_micros, room_u))
        over_t, over_u = actual_tokens - charge_t, actual_usd_micros - charge_u
        for a in acct.chain:
            a.committed_tokens += charge_t
            a.committed_usd += charge_u
            a.overage_tokens += over_t
            a.overage_usd += over_u
        charge = Charge(charge_t, charge_u, over_t, over_u)
        if self.journal is not None:
            self.journal.on_commit(reservation, charge)
        return charge

    def extend(self, reservation: Reservation, tokens: int, usd_micros: int) -> Reservation | Refusal:
        """Hold ``tokens`` and ``usd_micros`` more on an open ``reservation`` (a
        streaming call whose usage passed its estimate), all or nothing along
        the account chain. Returns the grown reservation (same id: settle that
        one from now on) or a :class:`Refusal` (``EBUDGET``: cut the call);
        a refusal leaves the reservation as it was. Raises ``ValueError`` if
        the reservation is not open or an amount is negative."""
        _check_amounts(tokens, usd_micros)
        if self._open.get(reservation.id) != reservation:
            raise ValueError(f"reservation {reservation.id} on {reservation.key!r} is not open")
        acct = self._accounts[reservation.key]
        for a in acct.chain:
            if tokens > a.free_tokens() or usd_micros > a.free_usd():
                return self._refusal(a, f"extend by {tokens} tokens / {usd_micros} usd_micros on {reservation.key!r}")
        for a in acct.chain:
            a.reserved_tokens += tokens
            a.reserved_usd += usd_micros
        grown = Reservation(id=reservation.id, key=reservation.key, tokens=reservation.tokens + tokens,
                            usd_micros=reservation.usd_micros + usd_micros)
        self._open[grown.id] = grown
        if self.journal is not None:
            self.journal.on_extend(grown)
        return grown

    def release(self, reservation: Reservation) -> None:
        """Settle ``reservation`` with no usage (the call never ran or consumed
        nothing). Raises ``ValueError`` if it is not open."""
        self._settle(reservation)
        if self.journal is not None:
            self.journal.on_release(reservation)

    def pending_charge(self, reservation_id: int) -> PendingCharge | None:
        """The commit of reservation ``reservation_id`` if it was accepted but
        not applied yet (its :meth:`commit` returned only what it will charge at
        least); None when it was applied (this ledger: always)."""
        return None

    def remaining(self, key: str) -> Allowance:
        """What ``key`` could still reserve right now: per axis the smallest free
        headroom along its chain (``limit - committed - reserved``); ``None``
        where no account in the chain has a limit."""
        acct = self._get(key)
        t = min(a.free_tokens() for a in acct.chain)
        u = min(a.free_usd() for a in acct.chain)
        return Allowance(tokens=None if t == math.inf else int(t), usd_micros=None if u == math.inf else int(u))

    def set_limit(self, key: str, limit: Allowance, *, clamp: bool = False) -> Refusal | None:
        """Change ``key``'s own limit (BUDGET_UPDATE, spec §4.3; raising it is the
        client's answer to EBUDGET). A limit below what the account already
        holds (committed + reserved) is refused and nothing changes — unless
        ``clamp``, which sets that axis to exactly what is held instead (a
        live "lower": calls in flight finish within their reservations,
        nothing more can be reserved) and never refuses."""
        acct = self._get(key)
        held_t = acct.committed_tokens + acct.reserved_tokens
        held_u = acct.committed_usd + acct.reserved_usd
        tokens, usd = limit.tokens, limit.usd_micros
        if clamp:
            tokens = None if tokens is None else max(tokens, held_t)
            usd = None if usd is None else max(usd, held_u)
        elif (tokens is not None and tokens < held_t) or (usd is not None and usd < held_u):
            return self._refusal(acct, f"limit {tokens} tokens / {usd} usd_micros below use")
        acct.limit_tokens, acct.limit_usd = tokens, usd
        if self.journal is not None:
            self.journal.on_set_limit(key, Allowance(tokens=tokens, usd_micros=usd))
        return None

    def exhausted(self, key: str) -> str | None:
        """Why ``key`` can spend nothing more, or ``None``: the first account of
        its chain (nearest first) whose *committed* spend reached a positive
        limit on an axis, as ``"<account> <axis> <committed>/<limit>"``.
        Reservations do not count (they may still be settled below the
        estimate). This is the spec §10 EBUDGET condition that ends a stream.
        Raises ``ValueError`` on an unknown key."""
        for a in self._get(key).chain:
            if a.limit_tokens and a.committed_tokens >= a.limit_tokens:
                return f"{a.key!r} tokens {a.committed_tokens}/{a.limit_tokens}"
            if a.limit_usd and a.committed_usd >= a.limit_usd:
                return f"{a.key!r} usd_micros {a.committed_usd}/{a.limit_usd}"
        return None

    def has(self, key: str) -> bool:
        """Whether account ``key`` is open."""
        return key in self._accounts

    def state(self, key: str) -> AccountState:
        """Snapshot of account ``key``. Raises ``ValueError`` on an unknown key."""
        a = self._get(key)
        return AccountState(
            key=a.key,
            parent=a.parent.key if a.parent is not None else None,
            limit=Allowance(tokens=a.limit_tokens, usd_micros=a.limit_usd),
            reserved_tokens=a.reserved_tokens,
            reserved_usd_micros=a.reserved_usd,
            committed_tokens=a.committed_tokens,
            committed_usd_micros=a.committed_usd,
            overage_tokens=a.overage_tokens,
            overage_usd_micros=a.overage_usd,
            open_reservations=a.open,
        )

    def snapshot(self) -> LedgerSnapshot:
        """The whole ledger as a :class:`LedgerSnapshot` (accounts by depth then
        key, reservations by id): what :meth:`restore` rebuilds from."""
        accts = sorted(self._accounts.values(), key=lambda a: (len(a.chain), a.key))
        return LedgerSnapshot(
            accounts=tuple(self.state(a.key) for a in accts),
            reservations=tuple(self._open[i] for i in sorted(self._open)),
            next_id=self._next_id,
        )

    def restore(self, snapshot: LedgerSnapshot) -> None:
        """Rebuild this (empty) ledger from ``snapshot``: accounts with their
        limits, committed spend and overage, and the open reservations held on
        their chains. The journal is not told (nothing changed). Raises
        ``ValueError`` if the ledger is not empty, an account's parent is not
        before it, a reservation names an unknown account or reuses an id, or
        an account's ``reserved_*`` / ``open_reservations`` differ from what
        its reservations hold — then the ledger is left empty."""
        if self._accounts or self._open:
            raise ValueError("restore needs an empty ledger")
        try:
            self._restore(snapshot)
        except ValueError:
            self._accounts.clear()
            self._open.clear()
            self._next_id = 1
            raise

    def _restore(self, snapshot: LedgerSnapshot) -> None:
        for s in snapshot.accounts:
            if s.key in self._accounts:
                raise ValueError(f"snapshot: budget account {s.key!r} appears twice")
            if s.parent is not None and s.parent not in self._accounts:
                raise ValueError(f"snapshot: parent {s.parent!r} of {s.key!r} is not before it")
            up = self._accounts[s.parent] if s.parent is not None else None
            acct = _Account(s.key, up, s.limit.tokens, s.limit.usd_micros,
                            committed_tokens=s.committed_tokens, committed_usd=s.committed_usd_micros,
                            overage_tokens=s.overage_tokens, overage_usd=s.overage_usd_micros)
            acct.chain = [acct, *(up.chain if up is not None else [])]
            if up is not None:
                up.children += 1
            self._accounts[s.key] = acct
        for r in snapshot.reservations:
            _check_amounts(r.tokens, r.usd_micros)
            if r.id in self._open:
                raise ValueError(f"snapshot: reservation id {r.id} appears twice")
            if r.key not in self._accounts:
                raise ValueError(f"snapshot: reservation {r.id} names unknown account {r.key!r}")
            acct = self._accounts[r.key]
            for a in acct.chain:
                a.reserved_tokens += r.tokens
                a.reserved_usd += r.usd_micros
            acct.open += 1
            self._open[r.id] = r
        for s in snapshot.accounts:
            a = self._accounts[s.key]
            if (a.reserved_tokens, a.reserved_usd, a.open) != (
                s.reserved_tokens, s.reserved_usd_micros, s.open_reservations
            ):
                raise ValueError(f"snapshot: account {s.key!r} holds other reservations than it lists")
        self._next_id = max(snapshot.next_id, max(self._open, default=0) + 1)

    def _get(self, key: str) -> _Account:
        try:
            return self._accounts[key]
        except KeyError:
            raise ValueError(f"no budget account {key!r}") from None

    def _settle(self, reservation: Reservation) -> _Account:
        if self._open.get(reservation.id) != reservation:
            raise ValueError(f"reservation {reservation.id} on {reservation.key!r} is not open")
        del self._open[reservation.id]
        acct = self._accounts[reservation.key]
        for a in acct.chain:
            a.reserved_tokens -= reservation.tokens
            a.reserved_usd -= reservation.usd_micros
        acct.open -= 1
        return acct

    def _refusal(self, a: _Account, what: str) -> Refusal:
        return refusal(a.key, what, self.remaining(a.key))


class AccountTotals(Struct, frozen=True, forbid_unknown_fields=True):
    """One account as a :class:`SharedAccounts` holds it after an operation:
    its own ``limit`` and what it has committed, holds (``reserved_*``, every
    process's reservations under it) and could not charge (``overage_*``), in
    tokens and USD micros."""

    key: str
    limit: Allowance
    committed_tokens: int
    committed_usd_micros: int
    reserved_tokens: int
    reserved_usd_micros: int
    overage_tokens: int = 0
    overage_usd_micros: int = 0


class SharedResult(Struct, frozen=True, forbid_unknown_fields=True):
    """What a :class:`SharedAccounts` operation did: the account chain it
    touched, nearest first, as it now stands (``totals``), and — by operation —
    the new or grown ``reservation``, the ``charge`` of a commit, or the
    ``refusal`` that left everything as it was."""

    totals: tuple[AccountTotals, ...] = ()
    reservation: Reservation | None = None
    charge: Charge | None = None
    refusal: Refusal | None = None


class SharedAccounts(Protocol):
    """Budget accounts held where several ledgers — several router processes —
    see them (``atp_router.store.Store`` implements it: ``*_shared`` methods). Every
    method checks and applies in one atomic step *across processes*, along the
    account's whole chain (the account and its ancestors), with the same rules
    as :class:`BudgetLedger`; so ``committed + reserved <= limit`` holds for
    every account however many processes reserve against it. Reservation ids
    are handed out here (unique across processes). ``owner`` names the process
    an account or reservation belongs to: when it dies, its reservations are
    committed at their reserved amount and its accounts closed (the crash rule;
    ``atp_router.store.Store.recover``)."""

    def open_shared(self, key: str, parent: str | None, limit: Allowance, *, owner: str | None) -> SharedResult:
        """Open account ``key`` under ``parent``. A root account (no parent) is
        shared: when it is already open it is adopted as it stands, spend
        kept, and its limit set to ``limit`` (clamped to what it holds). A child
        account is created from zero (error when it is open already)."""

    def close_shared(self, key: str) -> None:
        """Close child account ``key`` (its spend stays in its ancestors)."""

    def reserve_shared(self, key: str, tokens: int, usd_micros: int, *, owner: str,
                       request: str = "") -> SharedResult:
        """Hold ``tokens`` / ``usd_micros`` on ``key``'s chain if every account of
        it can take them: ``reservation`` (a new id), else ``refusal`` naming the
        nearest account that cannot. ``request`` (unique per call, or ``""``)
        names this call for :meth:`cancel_reserve_shared`."""

    def cancel_reserve_shared(self, request: str) -> bool:
        """Undo the :meth:`reserve_shared` call named ``request`` whose answer
        never came (a timeout: it may have been applied, or may still be, later):
        its reservation released if it was made, and the call refused if it
        runs after this. True when a reservation was released."""

    def extend_shared(self, reservation: Reservation, tokens: int, usd_micros: int) -> SharedResult:
        """Grow an open reservation by ``tokens`` / ``usd_micros`` if the chain can
        take them: the grown ``reservation``, else ``refusal``."""

    def commit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                      request: str = "") -> SharedResult:
        """Settle ``reservation`` with the actual usage: ``charge`` is per axis
        ``min(actual, what the chain can take once this hold is lifted)``, the
        rest overage (:meth:`BudgetLedger.commit`'s rule). ``request`` (unique,
        or ``""``) names the call for :meth:`recommit_shared`."""

    def recommit_shared(self, reservation: Reservation, tokens: int, usd_micros: int, *,
                        request: str) -> SharedResult:
        """Settle again, at the actual usage ``tokens`` / ``usd_micros``, a commit
        whose first attempt, named ``request``, lost its answer: if that attempt
        was applied, its charge stands (nothing is applied twice); otherwise this
        one applies by :meth:`commit_shared`'s rule and the first attempt is
        refused if it runs later. ``charge`` is what the ledger holds for it."""

    def release_shared(self, reservation: Reservation) -> SharedResult:
        """Settle ``reservation`` with no usage."""

    def set_limit_shared(self, key: str, limit: Allowance, *, clamp: bool) -> SharedResult:
        """:meth:`BudgetLedger.set_limit` on the shared account: ``refusal`` when
        ``limit`` is below what it holds and not ``clamp``."""

    def shared_totals(self, key: str) -> SharedResult:
        """``key``'s chain as it stands now (no change)."""


class SharedBudgetLedger(BudgetLedger):
    """A :class:`BudgetLedger` whose accounts live in a :class:`SharedAccounts`
    that several processes use at once (``atp-router --workers N``): the same
    public API, but every reserve, extend, commit, release and limit change is
    decided atomically by ``shared`` along the whole account chain, so a
    tenant's account spent from N processes is exactly as tight as from one —
    no overshoot, no double use of the same headroom.

    Root accounts (no parent, e.g. ``client:<tenant>``) are shared: :meth:`open`
    adopts one another process opened, and :meth:`close` forgets it here
    without closing it. Child accounts and reservations belong to this process
    (``owner``): a child ``key`` is held in ``shared`` as ``key@owner``
    (:meth:`store_key`), so two processes may both have a stream account of
    the same name (a client reusing a stream id on two connections) without
    colliding; keys, reservations and refusals seen by the caller are the
    local ones.

    The ledger keeps a mirror of the accounts this process opened (and the
    roots above them) as of its last operation on them: :meth:`remaining`,
    :meth:`exhausted` and :meth:`state` read that mirror, which other
    processes' spend since may have made stale — a stale "not exhausted" is
    harmless (the next reserve is refused by ``shared``), and
    :meth:`refresh` reads the chain again.

    Calls into ``shared`` are synchronous (like a :class:`LedgerJournal`'s);
    its errors propagate. :meth:`restore` is not supported: a shared ledger is
    rebuilt by opening accounts again (roots are adopted with their spend)."""

    def __init__(self, shared: SharedAccounts, *, owner: str) -> None:
        super().__init__()
        self.shared = shared
        self.owner = owner
        self._requests = 0  # reserve calls named (new_request)
        self._skeys: dict[str, str] = {}  # local key → key in shared
        self._lkeys: dict[str, str] = {}  # key in shared → local key

    def store_key(self, key: str) -> str:
        """The name account ``key`` has in ``shared``. Raises ``ValueError`` on an
        unknown key."""
        self._get(key)
        return self._skeys[key]

    def open(self, key: str, limit: Allowance, *, parent: str | None = None) -> None:
        skey, pkey = self.open_keys(key, parent)
        self.opened(key, parent, limit, self.shared.open_shared(skey, pkey, limit,
                                                                owner=None if parent is None else self.owner))

    def open_keys(self, key: str, parent: str | None) -> tuple[str, str | None]:
        """The store keys of account ``key`` about to be opened under ``parent``
        (its own, its parent's or None). Raises ValueError when ``key`` is open
        already or ``parent`` is not."""
        if key in self._accounts:
            raise ValueError(f"budget account {key!r} already open")
        pkey = self._skeys[self._get(parent).key] if parent is not None else None
        return self._new_store_key(key, parent), pkey

    def _new_store_key(self, key: str, parent: str | None) -> str:
        """The store key account ``key`` is opened under: a root's own, a child's this ledger's (``key@owner``)."""
        return key if parent is None else f"{key}@{self.owner}"

    def opened(self, key: str, parent: str | None, limit: Allowance, out: SharedResult) -> None:
        """Account ``key`` (:meth:`open_keys`) was opened in the store with ``out``: opened here too."""
        up = self._get(parent) if parent is not None else None
        skey = self._new_store_key(key, parent)
        acct = _Account(key, up, limit.tokens, limit.usd_micros)
        acct.chain = [acct, *(up.chain if up is not None else [])]
        if up is not None:
            up.children += 1
        self._accounts[key] = acct
        self._skeys[key], self._lkeys[skey] = skey, key
        self._mirror(out)

    def close(self, key: str) -> AccountState:
        acct = self._get(key)
        if acct.open or acct.children:
            raise ValueError(
                f"budget account {key!r} has {acct.open} open reservation(s) and {acct.children} child account(s)"
            )
        state = self.state(key)
        if acct.parent is not None:
            self.shared.close_shared(self._skeys[key])
            acct.parent.children -= 1
        del self._accounts[key]
        del self._lkeys[self._skeys.pop(key)]
        return state

    def new_request(self) -> str:
        """A name for one reserve call, unique across processes (``<owner>/<n>``:
        owners are unique per process), for
        :meth:`SharedAccounts.cancel_reserve_shared`."""
        self._requests += 1
        return f"{self.owner}/{self._requests}"

    def reserve(self, key: str, tokens: int, usd_micros: int) -> Reservation | Refusal:
        return self.reserve_as(key, tokens, usd_micros, request=self.new_request())

    def reserve_as(self, key: str, tokens: int, usd_micros: int, *, request: str) -> Reservation | Refusal:
        """:meth:`reserve`, the call to the shared accounts named ``request``
        (:meth:`new_request`)."""
        _check_amounts(tokens, usd_micros)
        acct = self._get(key)
        out = self.shared.reserve_shared(self._skeys[key], tokens, usd_micros, owner=self.owner, request=request)
        self._mirror(out)
        if out.refusal is not None:
            return self._local_refusal(out.refusal)
        assert out.reservation is not None
        r = Reservation(id=out.reservation.id, key=key, tokens=out.reservation.tokens,
                        usd_micros=out.reservation.usd_micros)
        acct.open += 1
        self._open[r.id] = r
        return r

    def extend(self, reservation: Reservation, tokens: int, usd_micros: int) -> Reservation | Refusal:
        _check_amounts(tokens, usd_micros)
        if self._open.get(reservation.id) != reservation:
            raise ValueError(f"reservation {reservation.id} on {reservation.key!r} is not open")
        out = self.shared.extend_shared(self._stored(reservation), tokens, usd_micros)
        self._mirror(out)
        if out.refusal is not None:
            return self._local_refusal(out.refusal)
        assert out.reservation is not None
        grown = Reservation(id=reservation.id, key=reservation.key, tokens=out.reservation.tokens,
                            usd_micros=out.reservation.usd_micros)
        self._open[grown.id] = grown
        return grown

    def commit(self, reservation: Reservation, actual_tokens: int, actual_usd_micros: int) -> Charge:
        _check_amounts(actual_tokens, actual_usd_micros)
        acct = self._forget(reservation)
        out = self.shared.commit_shared(self._stored(reservation), actual_tokens, actual_usd_micros)
        acct.open -= 1
        self._mirror(out)
        assert out.charge is not None
        return out.charge

    def release(self, reservation: Reservation) -> None:
        acct = self._forget(reservation)
        out = self.shared.release_shared(self._stored(reservation))
        acct.open -= 1
        self._mirror(out)

    def set_limit(self, key: str, limit: Allowance, *, clamp: bool = False) -> Refusal | None:
        self._get(key)
        out = self.shared.set_limit_shared(self._skeys[key], limit, clamp=clamp)
        self._mirror(out)
        return None if out.refusal is None else self._local_refusal(out.refusal)

    def refresh(self, key: str) -> None:
        """Read ``key``'s chain from ``shared`` again (other processes' spend)."""
        self._get(key)
        self._mirror(self.shared.shared_totals(self._skeys[key]))

    def restore(self, snapshot: LedgerSnapshot) -> None:
        raise ValueError("a shared ledger is not restored from a snapshot: open its accounts again")

    def _stored(self, r: Reservation) -> Reservation:
        return Reservation(id=r.id, key=self._skeys[r.key], tokens=r.tokens, usd_micros=r.usd_micros)

    def _local_refusal(self, r: Refusal) -> Refusal:
        reason = r.reason
        for skey, key in self._lkeys.items():
            if skey != key:
                reason = reason.replace(repr(skey), repr(key))
        return Refusal(key=self._lkeys.get(r.key, r.key), reason=reason, remaining=r.remaining, code=r.code)

    def _forget(self, reservation: Reservation) -> _Account:
        if self._open.get(reservation.id) != reservation:
            raise ValueError(f"reservation {reservation.id} on {reservation.key!r} is not open")
        del self._open[reservation.id]
        return self._accounts[reservation.key]

    def _mirror(self, out: SharedResult) -> None:
        for t in out.totals:
            a = self._accounts.get(self._lkeys.get(t.key, ""))
            if a is not None:
                a.limit_tokens, a.limit_usd = t.limit.tokens, t.limit.usd_micros
                a.committed_tokens, a.committed_usd = t.committed_tokens, t.committed_usd_micros
                a.reserved_tokens, a.reserved_usd = t.reserved_tokens, t.reserved_usd_micros
                a.overage_tokens, a.overage_usd = t.overage_tokens, t.overage_usd_micros


def refusal(key: str, what: str, remaining: Allowance) -> Refusal:
    """The :class:`Refusal` of account ``key`` that had ``remaining`` (the
    smallest free headroom along its chain) when ``what`` did not fit; the one
    wording for every ledger and store."""
    return Refusal(
        key=key,
        reason=f"{what}: budget {key!r} has {_fmt(remaining.tokens)} tokens / {_fmt(remaining.usd_micros)} "
               "usd_micros left",
        remaining=remaining,
    )


def _fmt(v: int | None) -> str:
    return "unlimited" if v is None else str(v)


def _check_amounts(tokens: int, usd_micros: int) -> None:
    if tokens < 0 or usd_micros < 0:
        raise ValueError(f"amounts must be >= 0, got {tokens} tokens / {usd_micros} usd_micros")


def min_budget(client: Budget | None, policy: Any) -> Budget:
    """The tighter of the client's and the policy's budget (anything with ``usd`` and
    ``tokens``: a RIB policy's) on each axis."""
    pu = getattr(policy, "usd", None) if policy is not None else None
    pt = getattr(policy, "tokens", None) if policy is not None else None
    cu = client.usd if client is not None else None
    ct = client.tokens if client is not None else None
    usd = min((x for x in (pu, cu) if x is not None), default=None)
    tokens = min((x for x in (pt, ct) if x is not None), default=None)
    return Budget(usd=usd, tokens=tokens)
