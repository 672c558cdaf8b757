"""Opening a stream: the SYN pipeline as a list of stages (spec §8 step 1–2, §10, §11).

A SYN the session accepted (:class:`~atp_router.wire.session.StreamOpened`) becomes an
:class:`OpenCtx` — who opens it, the tenant, its meta and task content, the QoS,
window and budget it asks for, and the router's clock reading ``now`` — and goes
through the router's stages in order, Envoy-filter style. Each stage is a small
named object built from the parts it needs and called as ``stage(o)``; it reads
what earlier stages decided from ``o``, writes its own decision there, and
returns :data:`CONTINUE` or a :class:`Refuse` (spec §10 ``code``, ``reason``,
``retry_after_ms`` or None). :func:`run_stages` stops at the first refusal and
returns it (None: every stage let the SYN through). No stage reads a clock or
awaits: time is ``o.now`` (trio seconds). A stage whose decision needs a store
round trip (a shared ledger's atomic OPEN) returns a :class:`StoreStep` — the
blocking call and what to decide from its outcome — that :func:`run_stages`
runs in one of the store's threads (or inline: :func:`run_inline`).

The default pipeline, :data:`DEFAULT_STAGES`, in order (``atp-router policy check
--stages`` prints it, :func:`describe`):

==================  ============================================================
``context_scope``   Agent Context Protocol (:mod:`atp_router.adapters.context`): a bad
                    ``meta.agent_context`` is ``EPROTO`` naming the field; its
                    policyContext labels join ``meta.data_scope``
``task_shape``      the task body decoded into its task type's Struct
                    (:func:`task_body`, :mod:`atp_router.task.body`; ``EPROTO``
                    naming the field), once: the prompt of every next-hop
                    carries it; ``meta.diff_loc`` counted from the diff (or its
                    parsed change)
``stream_slot``     the stream table's room and the stream id (``EWINDOW`` at
                    ``max_streams``, ``EPROTO`` for an id in use)
``task_meta``       the meta's typed fields
                    (:class:`~atp_router.task.meta.TaskMeta`: budget, idempotency
                    key, resume point, data scope, Agent Context, trace,
                    ``diff_loc``; ``EPROTO`` naming the field): decoded once,
                    where the SYN was received (:func:`syn_task`: resumption and
                    a deployment's SYN gates read it there), here only for a
                    SYN whose receiver did not
``tenant_admission`` spec §11 AuthZ (:class:`~atp_router.security.authz.StreamAdmission`):
                    role, task types, data categories (``ESEC``), stream quota
                    and open rate (``EWINDOW`` + ``retry_after_ms``); the QoS
                    served and the budget capped
``route``           the running generation's FIB lookup with live health
                    (``EAGENTDOWN``: no route)
``bandit``          the policy's bandit orders the route (its decision kept to
                    learn from)
``budget_open``     the stream's ledger account opened under the tenant's (last:
                    a shared ledger may refuse, ``EBUDGET``)
==================  ============================================================

A stage type is a class with a ``name``, a docstring whose first line says what
it checks, and ``of(parts: OpenParts) -> stage``; the router builds its pipeline
from a list of them (``Router(config, syn_stages=[...])``), so a deployment mode
or a test adds or replaces a stage with a list operation
(:func:`replace_stage`, :func:`insert_stage`), never by overriding the router's
SYN handling. A stage that holds something for the stream it admits (a
:class:`Holding`: the shared quota entry of routers on one store) releases it
when a later stage refuses the SYN and when the stream closes. What follows an accepted SYN (the stream context, SYN+ACK,
tracing, audit, task start) is the router's.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Protocol,
    TypeVar,
    cast,
    runtime_checkable,
)

import msgspec
import trio

from atp_router.adapters.context import with_context_scope
from atp_router.flow.budget import Allowance, min_budget, usd_to_micros
from atp_router.policy.fib import data_scope_labels
from atp_router.runtime.dataplane.stream import change_of_task, stream_account
from atp_router.security.authz import Refuse
from atp_router.security.identity import Identity
from atp_router.store.threads import off_loop
from atp_router.task.body import ERROR_FIELD, TaskBody, check_task, task_body
from atp_router.task.change import ParsedChange
from atp_router.task.diff import count_changed_lines
from atp_router.task.meta import TaskMeta, decode_meta
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import Budget, PayloadType, QoS, Window

if TYPE_CHECKING:
    from atp_router.flow.budget import BudgetLedger
    from atp_router.policy.fib import Route
    from atp_router.policy.learn import Decision
    from atp_router.policy.rib import ClientSpec, RateSpec
    from atp_router.runtime.controlplane.control import ControlPlane, Generation
    from atp_router.runtime.controlplane.learning import Learning
    from atp_router.runtime.dataplane.streams import StreamTable
    from atp_router.security.authz import StreamAdmission
    from atp_router.wire.session import StreamOpened

T = TypeVar("T")

__all__ = [
    "CONTINUE",
    "DEFAULT_STAGES",
    "Bandit",
    "BudgetOpen",
    "ContextScope",
    "Continue",
    "DecodeMeta",
    "FibLookup",
    "Holding",
    "OpenCtx",
    "OpenParts",
    "Refuse",
    "Stage",
    "StageType",
    "StoreStep",
    "StreamSlot",
    "TaskShape",
    "TenantAdmission",
    "check_task",
    "describe",
    "holding",
    "insert_stage",
    "min_budget",
    "open_ctx",
    "refusal",
    "replace_stage",
    "run_inline",
    "run_stages",
    "syn_task",
    "task_body",
]


class Continue:
    """A stage let the SYN through: the next stage runs (:data:`CONTINUE`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CONTINUE"


#: The one :class:`Continue` value.
CONTINUE: Final = Continue()


@dataclass(slots=True)
class OpenCtx:
    """One SYN being opened, and what the stages decided so far.

    Given: ``identity`` (its ``tenant``), ``session_id``, ``stream_id``, ``meta``
    (a copy of the SYN's meta: stages may add keys, e.g. ``diff_loc``),
    ``content`` (the SYN's task body, None without one), ``qos`` and ``window``
    asked for, ``now`` (trio seconds), ``change`` (the body's ``diff`` as the
    ingress that read it parsed it, None: not parsed yet), ``task`` (the meta's
    typed fields, :class:`~atp_router.task.meta.TaskMeta`, when the SYN's
    receiver decoded them already, :func:`syn_task`; else the ``task_meta``
    stage decodes them; the stages that add meta keys keep it in step). Decided:
    ``body`` (``task_shape`` decoded ``content`` into its task body Struct,
    :func:`task_body`: the stream does not check or decode it again when its
    task starts), ``task``, ``client_budget`` (the budget
    asked, then capped by admission), ``admitted_qos`` (None: the route's),
    ``gen`` (the RIB generation routed on), ``route``, ``decision`` (the
    bandit's, None without one), ``budget`` (the stream's: the tighter of the
    client's and the route's), ``shared_quota`` (``(max_streams, rate)`` of a
    tenant quota shared across routers that ``budget_open`` takes with the
    stream's account in one store step, :mod:`~atp_router.runtime.dataplane.quotas`;
    None: decided by ``tenant_admission``); ``qos_asked``: the class the SYN asked
    for when the router clamped it to the tenant's ``qos_max`` (else None)."""

    identity: Identity
    session_id: str
    stream_id: str
    meta: dict[str, Any]
    content: Any
    qos: QoS | None
    window: Window | None
    now: float
    change: ParsedChange | None = None
    body: TaskBody | None = None
    task: TaskMeta | None = None
    client_budget: Budget | None = None
    admitted_qos: QoS | None = None
    gen: Generation | None = None
    route: Route | None = None
    decision: Decision | None = None
    budget: Budget | None = None
    shared_quota: tuple[int, RateSpec] | None = None
    qos_asked: QoS | None = None

    @property
    def tenant(self) -> str:
        return self.identity.tenant

    @property
    def account(self) -> str:
        """The stream's budget-ledger account (:func:`~atp_router.runtime.dataplane.stream.stream_account`)."""
        return stream_account(self.identity.tenant, self.stream_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenParts:
    """What the stages are built from (the router's parts): the tenant
    admission, the stream table, learning (live view and bandits), the control
    plane (next-hop health), ``generation()`` (the running RIB generation),
    the budget ledger, ``client_spec(tenant)`` (its RIB ``clients`` entry) and
    ``client_account(tenant)`` (its ledger account)."""

    admission: StreamAdmission
    streams: StreamTable
    learning: Learning
    control: ControlPlane
    generation: Callable[[], Generation]
    ledger: BudgetLedger
    client_spec: Callable[[str], ClientSpec]
    client_account: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class StoreStep:
    """What a stage asks to be done before it decides (sans-IO): ``run()``, a
    blocking call of ``store`` that touches nothing else (one of the store's
    threads may run it: :func:`~atp_router.store.threads.off_loop`), then
    ``then(outcome)`` on the trio thread — ``outcome`` is what ``run`` returned
    or the :class:`Exception` it raised — giving the stage's :data:`CONTINUE` or
    :class:`Refuse`."""

    run: Callable[[], Any]
    then: Callable[[Any], Continue | Refuse]
    store: Any

    def outcome(self) -> Any:
        """``run()``'s result, or the exception it raised (not raised)."""
        try:
            return self.run()
        except Exception as e:  # noqa: BLE001 - handed to then(), which decides
            return e


class Stage(Protocol):
    """One step of the pipeline: ``stage(o)`` is :data:`CONTINUE`, a :class:`Refuse`
    or a :class:`StoreStep`."""

    name: ClassVar[str]

    def __call__(self, o: OpenCtx, /) -> Continue | Refuse | StoreStep: ...


@runtime_checkable
class Holding(Protocol):
    """A stage that holds something for each stream it lets through (a shared
    quota entry, :mod:`atp_router.runtime.dataplane.quotas`): ``release(tenant,
    stream_id)`` gives it back — called by :func:`run_stages` when a later
    stage refuses the SYN, and by the data plane when the stream closes
    (:meth:`DataPlane.stream_closed <atp_router.runtime.dataplane.plane.DataPlane.stream_closed>`).
    Releasing what it does not hold does nothing."""

    def release(self, tenant: str, stream_id: str, /) -> None: ...


class StageType(Protocol):
    """A stage's class: its ``name``, its docstring, and ``of(parts)`` building it."""

    @property
    def name(self) -> str: ...

    def of(self, parts: OpenParts, /) -> Stage: ...


def refusal(e: ATPError) -> Refuse:
    """The :class:`Refuse` of an error a stage's part raised: its code, reason and
    ``retry_after_ms``. Each stage catches what its parts raise and returns this,
    so a stage is called (and table-tested) as the :class:`Stage` it is."""
    return Refuse(e.code, e.reason, e.retry_after_ms)


# ------------------------------------------------------------------ stages
class ContextScope:
    """Agent Context (meta.agent_context) valid, its secrets registered, its labels joined to meta.data_scope."""

    name: ClassVar[str] = "context_scope"
    __slots__ = ()

    @classmethod
    def of(cls, parts: OpenParts) -> ContextScope:
        return cls()

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        before = o.meta
        try:
            o.meta = with_context_scope(before)
        except ATPError as e:
            return refusal(e)
        if o.task is not None and o.meta is not before:  # its labels joined data_scope
            o.task = msgspec.structs.replace(o.task, data_scope=o.meta.get("data_scope"))
        return CONTINUE


class TaskShape:
    """The task body decoded into its task type's Struct (EPROTO naming the field); meta.diff_loc counted from its diff."""

    name: ClassVar[str] = "task_shape"
    __slots__ = ()

    @classmethod
    def of(cls, parts: OpenParts) -> TaskShape:
        return cls()

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        if not isinstance(o.content, dict):  # none, or JSON text to reassemble: checked when the task starts
            return CONTINUE
        # The task type decides the body (a SYN whose meta is malformed: by its keys,
        # and the task_meta stage refuses it).
        try:
            o.body = body = task_body(o.task.task_type if o.task is not None else "", o.content)
        except ATPError as e:
            return refusal(e)
        diff = getattr(body, "diff", None)
        if diff is not None and "diff_loc" not in o.meta:
            # The ingress's parse when it made one, else a count at C speed: no stall at SYN.
            o.meta["diff_loc"] = loc = o.change.diff_loc if o.change is not None else count_changed_lines(diff)
            if o.task is not None:
                o.task = msgspec.structs.replace(o.task, diff_loc=loc)
        return CONTINUE


class StreamSlot:
    """Room in the stream table (EWINDOW at max_streams) and a stream id not in use (EPROTO)."""

    name: ClassVar[str] = "stream_slot"
    __slots__ = ("streams",)

    def __init__(self, streams: StreamTable) -> None:
        self.streams = streams

    @classmethod
    def of(cls, parts: OpenParts) -> StreamSlot:
        return cls(parts.streams)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        try:
            self.streams.admit(o.tenant, o.stream_id)
        except ATPError as e:
            return refusal(e)
        return CONTINUE


class DecodeMeta:
    """The meta's typed fields decoded once, if the SYN's receiver has not (TaskMeta: budget, idempotency key, trace; EPROTO)."""

    name: ClassVar[str] = "task_meta"
    __slots__ = ()

    @classmethod
    def of(cls, parts: OpenParts) -> DecodeMeta:
        return cls()

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        """``o.task``: ``o.meta`` decoded (:func:`~atp_router.task.meta.decode_meta`,
        after ``context_scope`` and ``task_shape`` added their keys) unless the
        SYN's receiver decoded it (:func:`syn_task`), and the budget the client
        asks for, ``o.client_budget``. A malformed field is ``EPROTO``
        ``meta.<field>: <what is wrong> - at `$.<field>…```."""
        task = o.task
        if task is None:
            try:
                o.task = task = decode_meta(o.meta)
            except msgspec.ValidationError as e:
                where = ERROR_FIELD.search(str(e))
                return Refuse(ErrorCode.EPROTO, f"meta.{where.group(1)}: {e}" if where else f"meta: {e}")
        o.client_budget = task.budget
        return CONTINUE


class TenantAdmission:
    """Spec §11 AuthZ: role, task types, data categories (ESEC), stream quota and rate (EWINDOW); QoS and budget capped."""

    name: ClassVar[str] = "tenant_admission"
    __slots__ = ("admission", "client_spec", "streams")

    def __init__(self, admission: StreamAdmission, client_spec: Callable[[str], ClientSpec],
                 streams: StreamTable) -> None:
        self.admission = admission
        self.client_spec = client_spec
        self.streams = streams

    @classmethod
    def of(cls, parts: OpenParts) -> TenantAdmission:
        return cls(parts.admission, parts.client_spec, parts.streams)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        tenant = o.tenant
        # After task_meta, its typed task type (a stage run on its own: the meta's).
        task_type = o.task.task_type if o.task is not None else str(o.meta.get("task_type", ""))
        decision = self.admission.decide(
            o.identity, self.client_spec(tenant), task_type=task_type, qos=o.qos,
            budget=o.client_budget, labels=data_scope_labels(o.meta),
            open_streams=self.streams.tenant_open[tenant], now=o.now)
        if isinstance(decision, Refuse):
            return decision
        o.client_budget, o.admitted_qos = decision.budget, decision.qos
        return CONTINUE


class FibLookup:
    """The running RIB generation's FIB lookup with live next-hop health (EAGENTDOWN: no route)."""

    name: ClassVar[str] = "route"
    __slots__ = ("control", "generation", "learning")

    def __init__(self, generation: Callable[[], Generation], learning: Learning, control: ControlPlane) -> None:
        self.generation = generation
        self.learning = learning
        self.control = control

    @classmethod
    def of(cls, parts: OpenParts) -> FibLookup:
        return cls(parts.generation, parts.learning, parts.control)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        o.gen = gen = self.generation()
        try:
            self.learning.sync(gen)
            o.route = gen.fib.lookup(o.meta, health=self.control.health(gen, o.now), live=self.learning.live_view())
        except ATPError as e:
            return refusal(e)
        return CONTINUE


class Bandit:
    """The policy's bandit orders the route's next-hops for this task (its decision kept to learn from)."""

    name: ClassVar[str] = "bandit"
    __slots__ = ("learning",)

    def __init__(self, learning: Learning) -> None:
        self.learning = learning

    @classmethod
    def of(cls, parts: OpenParts) -> Bandit:
        return cls(parts.learning)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        route, gen = o.route, o.gen
        assert route is not None and gen is not None, "bandit runs after route"
        policy_budget = min_budget(o.client_budget, route.budget)
        try:
            o.route, o.decision = self.learning.route(
                route, gen, o.meta, o.content, tenant=o.tenant,
                budget_usd_micros=usd_to_micros(policy_budget.usd) if policy_budget.usd is not None else None,
                qos=o.admitted_qos or route.qos)
        except ATPError as e:
            return refusal(e)
        return CONTINUE


class BudgetOpen:
    """The stream's ledger account opened under the tenant's, at the tighter of client and policy budget (EBUDGET)."""

    name: ClassVar[str] = "budget_open"
    __slots__ = ("client_account", "ledger")

    def __init__(self, ledger: BudgetLedger, client_account: Callable[[str], str]) -> None:
        self.ledger = ledger
        self.client_account = client_account

    @classmethod
    def of(cls, parts: OpenParts) -> BudgetOpen:
        return cls(parts.ledger, parts.client_account)

    def __call__(self, o: OpenCtx) -> Continue | Refuse:
        assert o.route is not None, "budget_open runs after route"
        o.budget = budget = min_budget(o.client_budget, o.route.budget)
        try:
            # A shared ledger may refuse (its store unreachable, EBUDGET; atp_router.deploy.cluster).
            self.ledger.open(o.account, Allowance.from_budget(budget), parent=self.client_account(o.tenant))
        except ATPError as e:
            return refusal(e)
        return CONTINUE


#: The router's SYN pipeline, in order (module docstring).
DEFAULT_STAGES: Final[tuple[StageType, ...]] = (
    ContextScope, TaskShape, StreamSlot, DecodeMeta, TenantAdmission, FibLookup, Bandit, BudgetOpen)


# ------------------------------------------------------------------ the pipeline
async def run_stages(stages: Sequence[Stage], o: OpenCtx, streams: StreamTable | None = None) -> Refuse | None:
    """Run ``stages`` on ``o`` in order; the first :class:`Refuse` stops them and
    is returned, and every :class:`Holding` stage that let the SYN through
    before it releases what it took for it. None: every stage continued (``o``
    holds their decisions). A :class:`StoreStep` runs in a store thread while
    the trio loop serves other streams (issue 22: no store round trip blocks
    it), the SYN counted open in ``streams`` meanwhile
    (:meth:`~atp_router.runtime.dataplane.streams.StreamTable.opening`) — only
    for a SYN on a session of its own, which no other frame reaches meanwhile;
    ``streams`` None: on this thread, nothing awaited (:func:`run_inline`)."""
    for i, stage in enumerate(stages):
        r = stage(o)
        if type(r) is StoreStep:
            if streams is None:
                r = r.then(r.outcome())
            else:
                with streams.opening(o.tenant, o.session_id):
                    outcome = await off_loop(r.store, r.outcome)
                r = r.then(outcome)
        if r is not CONTINUE:
            return _stopped(stages, i, o, r)
    return None


def run_inline(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on this thread: one that never suspends (each
    await in it returns without waiting, e.g. :func:`run_stages` without ``streams``)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise AssertionError(f"{coro!r} suspended: it was to run inline")


def _stopped(stages: Sequence[Stage], i: int, o: OpenCtx, r: object) -> Refuse:
    """Stage ``i`` refused ``o`` with ``r``: the :class:`Holding` stages before it release; ``r``."""
    assert isinstance(r, Refuse), f"stage {stages[i].name} returned {r!r}"
    for passed in holding(stages[:i]):
        passed.release(o.tenant, o.stream_id)
    return r


def holding(stages: Sequence[Stage]) -> list[Holding]:
    """The :class:`Holding` stages of ``stages``, in order."""
    return [s for s in stages if isinstance(s, Holding)]


def _index(stages: Sequence[StageType], name: str) -> int:
    for i, s in enumerate(stages):
        if s.name == name:
            return i
    raise KeyError(f"no SYN stage named {name!r} (stages: {', '.join(s.name for s in stages)})")


def replace_stage(stages: Sequence[StageType], name: str, new: StageType) -> list[StageType]:
    """``stages`` with the stage named ``name`` replaced by ``new`` (KeyError: none of that name)."""
    out = list(stages)
    out[_index(out, name)] = new
    return out


def insert_stage(stages: Sequence[StageType], new: StageType, *, before: str | None = None,
                 after: str | None = None) -> list[StageType]:
    """``stages`` with ``new`` inserted before or after the stage named so (at the end: neither)."""
    out = list(stages)
    if before is not None:
        out.insert(_index(out, before), new)
    elif after is not None:
        out.insert(_index(out, after) + 1, new)
    else:
        out.append(new)
    return out


def describe(stages: Sequence[StageType | Stage]) -> list[tuple[str, str]]:
    """``(name, first line of its docstring)`` of each stage (a stage type or a built stage), in order."""
    out = []
    for s in stages:
        doc = (type(s).__doc__ if not isinstance(s, type) else s.__doc__) or ""
        out.append((s.name, doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


# ------------------------------------------------------------------ helpers
def open_ctx(identity: Identity, session_id: str, ev: StreamOpened, *, change: ParsedChange | None,
             task: TaskMeta | None, qos_asked: QoS | None) -> OpenCtx:
    """The :class:`OpenCtx` of a SYN its session accepted (``ev``): its task content, if any."""
    content = ev.payload.content if ev.payload is not None and ev.payload.type is PayloadType.TASK else None
    return OpenCtx(identity, session_id, ev.stream_id, dict(ev.meta), content, ev.qos, ev.window,
                   trio.current_time(), change=change_of_task(content, change), task=task, qos_asked=qos_asked)


def syn_task(meta: Any) -> TaskMeta | None:
    """A SYN's ``meta`` decoded (:func:`~atp_router.task.meta.decode_meta`), once,
    where the SYN is received — what resumption (its idempotency key and resume
    point) and a deployment's SYN gates read — and carried into its
    :class:`OpenCtx`; None when a field is malformed (the ``task_meta`` stage
    refuses it, ``EPROTO`` naming the field)."""
    try:
        return decode_meta(meta)
    except msgspec.ValidationError:
        return None
