"""What a deployment mode hands the :class:`~atp_router.runtime.router.Router` it assembles.

The runtime never opens its own durable state, nor knows which store it runs on:
each mode of :mod:`atp_router.deploy` (``single``, ``workers``, ``cluster``) opens the
store, the audit chain and the budget ledger, and gives them to the router as
:class:`StateParts`, with the steps that restore the router from them once it is
built (streams a previous run left, the active RIB) and the one that closes them
at shutdown; its background services (:data:`Service`), the version a RIB
reload gets, and the hooks the SYN path calls at defined points.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atp_router.flow.budget import BudgetLedger
from atp_router.security.audit import AuditLog
from atp_router.security.authz import Refuse
from atp_router.security.identity import Identity
from atp_router.store import Store
from atp_router.task.meta import TaskMeta
from atp_router.wire.frame import Frame

if TYPE_CHECKING:
    from atp_router.runtime.dataplane.journal import CallJournal
    from atp_router.runtime.router import Router

__all__ = ["Service", "StateParts", "StoreCheck", "SynGate"]

#: A background service of a deployment mode (``Router(services=[...])``): called
#: with the router when it starts serving, before it reports started; returns the
#: loops the router's nursery runs until it stops.
Service = Callable[["Router"], Sequence[Callable[[], Awaitable[None]]]]
#: Whether a deployment's store can record spend now (:attr:`StateParts.store_check`):
#: None, or the reason it cannot.
StoreCheck = Callable[[], "str | None"]


@dataclass
class StateParts:
    """A router's durable state (spec §5 budgets, §8 streams, §11 audit), opened
    by its deployment mode.

    ``state_dir`` holds what is per process (the usage signing key, the audit
    key unless given, the lock); ``store`` the budget accounts, streams and their
    events, the active RIB and the audit chain (:class:`~atp_router.store.base.Store`);
    ``audit_log`` the audit chain's writer over it; ``ledger`` the budget ledger
    (a :class:`~atp_router.flow.budget.BudgetLedger`, or a shared one whose every step is
    the store's). ``restore`` runs in order once the router's control plane and
    stream table exist, before it takes a frame (what a step returns is
    ignored): e.g. the streams a previous run left reported interrupted, the
    RIB hot-reloaded before a restart put back.
    ``close`` checkpoints and closes it all at shutdown
    (:meth:`Router.close_state <atp_router.runtime.router.Router.close_state>`).
    ``store_check`` is the mode's readiness fact about its store (``GET /v1/ready``,
    :mod:`atp_router.runtime.admin.readiness`): None while the store can record
    spend, else why not, in words; called from a worker thread, so it must not
    touch trio (:data:`StoreCheck`).
    ``journal``: the call journal of streams re-run by their key on another
    router (:class:`~atp_router.runtime.dataplane.journal.CallJournal`; None: a
    stream is never re-run elsewhere, as on one router)."""

    state_dir: Path
    store: Store
    audit_log: AuditLog
    ledger: BudgetLedger
    close: Callable[[], None]
    store_check: StoreCheck
    restore: Sequence[Callable[[Router], object]] = ()
    journal: CallJournal | None = None


class SynGate:
    """A deployment mode's hook on the SYN path (``Router(syn_gates=[...])``),
    for what only it knows: where a stream of the same idempotency key runs when
    several router processes share a store. Both calls are synchronous, on the
    data plane; this base lets everything through.

    * :meth:`refuse` — called by :meth:`Router.receive_frame
      <atp_router.runtime.router.Router.receive_frame>` for every inbound SYN before
      anything else (before its session sees it, before it is counted): a
      :class:`~atp_router.security.authz.Refuse` is answered with a lone ERROR of its
      code, reason and ``retry_after_ms`` (spec §10, outside any stream: no
      RST), and the SYN goes no further. ``task`` is the SYN's meta decoded
      once where it was received (None: a malformed meta, which the SYN
      stages refuse): read the idempotency key there, not by key from ``frame.meta``.
    * :meth:`resumes` — called by :meth:`Router.resume_point
      <atp_router.runtime.router.Router.resume_point>` for a SYN (ttl not 0) naming
      ``idempotency_key`` ``key``: False, the SYN does not resume a stream here
      (it is a new stream, or :meth:`refuse` answers it); True, the stream
      table is asked (it may have been made ready to resume here)."""

    def refuse(self, frame: Frame, identity: Identity, task: TaskMeta | None) -> Refuse | None:
        return None

    def resumes(self, frame: Frame, identity: Identity, key: str) -> bool:
        return True
