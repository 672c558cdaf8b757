"""The stream table without a router (issue 21 "lower layers never call back
up"): it is built from its metrics, its bounds and the budget ledger alone;
closing a stream returns a :class:`~atp_router.runtime.dataplane.stream.Closed`
to the caller (the stream's last frame, its spend, whether its generation hold
is the caller's to end), the streams its timers reset come back from
:meth:`~atp_router.runtime.dataplane.streams.StreamTable.handle_timer`, and a
stream leaves memory only once its ledger account could be closed."""

from __future__ import annotations

import inspect

import trio

from atp_router.flow.budget import Allowance, BudgetLedger, Reservation
from atp_router.observability.metrics import RouterMetrics
from atp_router.runtime.dataplane.stream import Closed, StreamCtx, stream_account
from atp_router.runtime.dataplane.streams import StreamTable
from atp_router.security.identity import Identity, Role
from atp_router.wire import session as S
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import Budget, Flag, Frame, QoS, Window

ALICE = Identity("alice", frozenset({Role.CLIENT}), "key-a", "api_key")
WINDOW = Window(max_parallel=1, max_tokens=1000, max_usd_micros=1000)


class _Route:
    policy = "p"
    next_hops: tuple[object, ...] = ()


def _table(ledger: BudgetLedger, *, retain_closed_max: int = 100) -> StreamTable:
    return StreamTable(RouterMetrics(), max_streams=10, retain_closed_s=60.0, retain_closed_max=retain_closed_max,
                       resume_grace_s=5.0, idle_task_s=3.0, hb_interval_s=15.0, accounts=ledger)


def _open(table: StreamTable, ledger: BudgetLedger, stream_id: str) -> StreamCtx:
    """Open ``stream_id`` as the router does: the SYN through the session, its
    ledger account, the table, the SYN+ACK pushed."""
    now = trio.current_time()
    sess = table.session(ALICE.tenant, "sess_1", now=now)
    syn = Frame(v=1, session_id="sess_1", stream_id=stream_id, msg_seq=0, flags=[Flag.SYN], qos=QoS.SILVER)
    assert any(isinstance(ev, S.StreamOpened) for ev in sess.receive_frame(syn, now))
    account = stream_account(ALICE.tenant, stream_id)
    ledger.open(account, Allowance(tokens=1000, usd_micros=1000))
    table.admit(ALICE.tenant, stream_id)
    ctx = StreamCtx(table, sess, stream_id, ALICE, {}, QoS.SILVER, WINDOW, Budget(), _Route(), now, account=account)
    table.insert(ctx)
    assert ctx.push(sess.accept(stream_id, WINDOW)) is None  # a SYN+ACK closes nothing
    return ctx


def test_the_table_takes_no_router_callback():
    params = inspect.signature(StreamTable).parameters
    assert "on_closed" not in params and "release" not in params
    assert params["accounts"].kind is inspect.Parameter.KEYWORD_ONLY


async def test_closing_returns_closed_to_the_caller_once():
    ledger = BudgetLedger()
    table = _table(ledger)
    ctx = _open(table, ledger, "task_1")
    r = ledger.reserve(ctx.account, 10, 20)
    assert isinstance(r, Reservation)
    ledger.commit(r, 7, 9)
    closed = ctx.reset(ErrorCode.EPROTO, "bad")
    assert isinstance(closed, Closed)
    assert closed.ctx is ctx and closed.last is not None and Flag.RST in closed.last.flags
    assert closed.spent is not None and (closed.spent.committed_tokens, closed.spent.committed_usd_micros) == (7, 9)
    assert closed.release_gen  # no task was started: its generation hold is the caller's to end
    assert table.open_count == 0 and ctx.closed_at is not None
    # Closed already: nothing more to act on.
    assert ctx.reset(ErrorCode.EPROTO, "again") is None
    assert ctx.finish(None) is None and ctx.stop(ErrorCode.ETIMEOUT, "x") is None and ctx.peer_reset() is None


async def test_finish_and_peer_reset_return_closed():
    ledger = BudgetLedger()
    table = _table(ledger)
    done = _open(table, ledger, "task_1")
    done.task_started = True
    fin = done.finish(None)
    assert fin is not None and fin.last is not None and Flag.FIN in fin.last.flags
    assert not fin.release_gen  # its task ends the hold when it ends
    gone = _open(table, ledger, "task_2")
    reset = gone.peer_reset()
    assert reset is not None and reset.ctx is gone and reset.last is not None and Flag.SYN in reset.last.flags


async def test_handle_timer_returns_the_streams_it_reset():
    ledger = BudgetLedger()
    table = _table(ledger)
    ctx = _open(table, ledger, "task_1")  # no task: reset after idle_task_s
    assert table.handle_timer(ctx.started + 1.0) == []
    (closed,) = table.handle_timer(ctx.started + 3.0)
    assert closed.ctx is ctx and closed.last is not None and Flag.RST in closed.last.flags
    assert ctx.log.events[-1].type == "RST"


async def test_a_closed_stream_leaves_memory_once_its_account_closes():
    ledger = BudgetLedger()
    table = _table(ledger, retain_closed_max=0)
    held = _open(table, ledger, "task_1")
    r = ledger.reserve(held.account, 1, 1)  # a call not yet settled: its account cannot close
    assert isinstance(r, Reservation)
    assert held.reset(ErrorCode.EPROTO, "bad") is not None
    assert table.find(ALICE.tenant, "task_1") is held and ledger.has(held.account)
    ledger.release(r)
    free = _open(table, ledger, "task_2")
    assert free.reset(ErrorCode.EPROTO, "bad") is not None
    # Over retain_closed_max: both leave memory now, their accounts closed by the table.
    assert table.find(ALICE.tenant, "task_1") is None and table.find(ALICE.tenant, "task_2") is None
    assert not ledger.has(held.account) and not ledger.has(free.account)
