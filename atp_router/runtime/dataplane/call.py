"""One attempt of one next-hop call (spec §5, §10): prepare it, admit it through the
:class:`~atp_router.runtime.dataplane.gates.FlowGates`, stream the adapter's answer,
and release it (:mod:`~atp_router.runtime.dataplane.dispatch` module doc, 1-3).

:meth:`Caller.attempt` is what :class:`~atp_router.runtime.dataplane.dispatch.Dispatcher`
runs for every attempt of a leg; it sets the attempt's
:class:`~atp_router.runtime.dataplane.plan.LegOutcome` and never decides what happens next
(retry, reroute or report: the dispatcher's). Every attempt — refused, cancelled
while it waited, or run — ends with one :meth:`FlowGates.release
<atp_router.runtime.dataplane.gates.FlowGates.release>`, which commits what the call used
whatever its outcome and settles windows, slot and breaker. A failure is
attributed here (:func:`~atp_router.flow.breaker.attribute`): one in doubt becomes the
tenant's :class:`~atp_router.wire.errors.ClientInputError` and asks for a canary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import Fragment, Prompt, ProviderAdapter
from atp_router.consensus.types import AgentReport
from atp_router.flow.admission import Admit, Call, Outcome, Released, Wait
from atp_router.flow.breaker import LOCAL_WITHIN_S, Fault, Origin, attribute
from atp_router.flow.budget import Charge, PendingCharge, Refusal, usd_to_micros
from atp_router.flow.window import Estimate
from atp_router.runtime.dataplane.gates import FlowGates
from atp_router.runtime.dataplane.plan import (
    LegOutcome,
    StreamIO,
    TaskPlan,
    client_fault,
    leg_prompt,
)
from atp_router.runtime.loopstalls import LoopStalls
from atp_router.task.body import TaskBody
from atp_router.wire.errors import AgentError, ATPError, ClientInputError, ErrorCode
from atp_router.wire.frame import PayloadType

log = logging.getLogger("atp_router.runtime.dataplane.call")


@dataclass(slots=True)
class _Ready:
    """A call that passed the dispatcher's own checks: what to admit and run."""

    adapter: ProviderAdapter
    prompt: Prompt[TaskBody]
    estimate: Estimate


@dataclass(frozen=True, slots=True)
class Caller:
    """Runs attempts of next-hop calls: ``adapters`` maps agent names to live
    adapters, ``gates`` admits and releases every call, ``on_leg`` is called
    after every attempt that was admitted (metrics)."""

    adapters: Mapping[str, ProviderAdapter]
    gates: FlowGates
    on_leg: Callable[[LegOutcome], None] | None = None

    async def attempt(self, io: StreamIO, plan: TaskPlan, hop: Any, out: LegOutcome, turn: int | None) -> None:
        """One call to ``hop``: admit it (:mod:`~atp_router.runtime.dataplane.gates`
        a-e), run it, and end it with one :meth:`FlowGates.release
        <atp_router.runtime.dataplane.gates.FlowGates.release>` whatever happened —
        refused, cancelled while it waited, or run — which commits what it used and
        settles windows, slot and breaker. Sets ``out.error`` on any refusal or failure (the
        caller reports it)."""
        agent = hop.agent
        gates = self.gates
        flow = plan.flow
        assert flow is not None, "Dispatcher.run opens the stream's flow before any attempt"
        ready = self._prepare(plan, agent, out)
        # An answer charged in an earlier run of the stream's key, or a cache hit, is the
        # attempt's answer: nothing to admit, call or charge (issue 22; spec §13).
        if ready is None or (plan.journal is not None and plan.journal.serve(io, agent, out)) or (
                plan.cache is not None and await plan.cache.serve(io, agent, ready.prompt, out)):
            gates.wake(gates.admission.skip_turn(flow, turn))
            return
        call = gates.admission.begin(flow, agent, ready.estimate, turn=turn)
        t0 = 0.0
        timely = False
        try:
            if not await self._admit(io, call, out):
                return
            out.called = True
            t0 = trio.current_time()
            origin = Origin.ADAPTER
            crash = ""
            try:
                with trio.fail_after(hop.timeout_ms / 1000):
                    await self._pump(io, agent, ready, call, out)
                timely = True
            except trio.TooSlowError:
                origin = Origin.DEADLINE
                out.error = AgentError(ErrorCode.ETIMEOUT, f"no answer within {hop.timeout_ms} ms", agent=agent)
            except ATPError as e:
                out.error = e
            except trio.Cancelled:
                out.cancelled = True
                raise
            except Exception as e:
                # An adapter that breaks its contract fails its own call, not the stream.
                log.exception("next-hop %s: adapter raised", agent)
                origin, crash = Origin.CRASH, type(e).__name__
                out.error = AgentError(ErrorCode.EAGENTDOWN, f"adapter error: {crash}", agent=agent)
            except BaseExceptionGroup as eg:
                # A cancellation that crossed a nursery inside the adapter (the
                # sandbox's pipe readers) arrives as a group of Cancelled.
                if is_cancellation(eg):
                    out.cancelled = True
                raise
            if out.error is not None:
                _attribute(out, ready.adapter, origin, crash, gates.stalls)
            if timely and plan.cache is not None:
                plan.cache.record(agent, ready.prompt, out)
        finally:
            if plan.journal is not None and timely:
                plan.journal.attach(agent, call.reservation, out)  # stored with the commit, in one step
            if await self._end(io, plan, call, out, timely, t0):
                gates.canary(agent, ready.adapter, hop.timeout_ms / 1000)

    async def _end(self, io: StreamIO, plan: TaskPlan, call: Call, out: LegOutcome, timely: bool,
                   t0: float) -> bool:
        """Release ``call`` (:meth:`_release`) and account its charge on ``out``
        (:meth:`_account`); a commit the store could not take yet is waited for
        first, so the leg — and the FINAL — reports what it charged (issue 22).
        Returns whether to run a canary on the next-hop now."""
        assert plan.flow is not None
        rid = call.reservation.id if call.reservation is not None else None
        released = self._release(call, out, timely)
        charge = released.charge
        try:
            if charge is not None:
                out.latency_ms = (trio.current_time() - t0) * 1000
                pending = plan.flow.ledger.pending_charge(rid) if rid is not None else None
                if pending is not None and not out.cancelled:
                    charge = await _settled(pending)
        finally:
            canary = self._account(io, call, out, released, charge)
        return canary

    def _release(self, call: Call, out: LegOutcome, timely: bool) -> Released:
        """The one release of ``call``: what it used is committed even on failure
        or cancellation (§5, DESIGN principle 4); AIMD and the breaker see the
        outcome (a cancelled call and one the client's input failed leave both
        alone). A call that never ran just gives back what it held."""
        err = out.error
        return self.gates.release(call, Outcome(
            tokens=out.usage.tokens, usd_micros=out.usage.usd_micros, error=err.code if err is not None else None,
            cancelled=out.cancelled, client_fault=client_fault(err), doubt=out.doubt, local=out.local, timely=timely,
        ))

    def _account(self, io: StreamIO, call: Call, out: LegOutcome, released: Released, charge: Charge | None) -> bool:
        """The leg's ``charge`` (what its commit charged) on ``out``, an overage
        said (``EBUDGET``), the stream's window update sent. Returns whether to
        run a canary on the next-hop now (it failed in doubt)."""
        err = out.error
        if charge is None:
            return False  # never admitted: nothing ran, nothing to account
        out.charged_tokens, out.charged_usd_micros = charge.tokens, charge.usd_micros
        if (charge.overage_tokens or charge.overage_usd_micros) and err is None and not out.cancelled:
            # It answered, but billed past what the budget could still take (its
            # FINAL's usage is not checked before it arrives): say so.
            io.emit_error(
                ErrorCode.EBUDGET,
                f"{call.agent}: usage {out.usage.tokens} tokens / {out.usage.usd_micros} usd_micros passes what "
                f"the budget can take: {charge.tokens} / {charge.usd_micros} charged, the rest not",
                agent=call.agent,
            )
        if released.stream_update is not None:
            io.emit_window_update(released.stream_update)
        if self.on_leg is not None:
            self.on_leg(out)
        return released.canary

    def _prepare(self, plan: TaskPlan, agent: str, out: LegOutcome) -> _Ready | None:
        """The dispatcher's own checks before admission: ``agent`` has an adapter,
        the budget is not exhausted, and the preflight estimate (spec §5.2) of
        the prompt it may see. ``None`` with ``out.error`` set when one fails."""
        adapter = self.adapters.get(agent)
        if adapter is None:
            out.error = AgentError(ErrorCode.EAGENTDOWN, "next-hop has no adapter in the running RIB", agent=agent)
            return None
        assert plan.flow is not None, "Dispatcher.run opens the stream's flow before any attempt"
        why = plan.flow.check_exhausted()
        if why is not None:
            out.error = AgentError(ErrorCode.EBUDGET, f"{agent} not called: budget exhausted ({why})", agent=agent)
            return None
        try:
            prompt = leg_prompt(plan, agent)
            est = adapter.estimate(prompt)
        except ATPError as e:
            out.error = e
            return None
        return _Ready(adapter, prompt, Estimate(tokens=est.in_tokens + est.out_tokens, usd_micros=usd_to_micros(est.usd)))

    async def _admit(self, io: StreamIO, call: Call, out: LegOutcome) -> bool:
        """Step ``call`` through the gates (:mod:`~atp_router.runtime.dataplane.gates` a-e) until it is admitted
        or refused: send the stream's WINDOW_UPDATE and the NACK a decision
        carries, wait where it says, step again. ``False`` with ``out.error``
        (and ``out.window_update``) set when refused; the caller releases."""
        gates = self.gates
        agent = call.agent
        while True:
            d = gates.step(call)
            if d.stream_update is not None:
                io.emit_window_update(d.stream_update)
            if isinstance(d, Wait):
                if d.nack is not None:
                    # Spec §10 EWINDOW: NACK + WINDOW_UPDATE, then wait visibly.
                    io.emit_error(ErrorCode.EWINDOW, d.nack.reason, agent=agent)
                    if d.nack.window_update is not None:
                        io.emit_window_update(d.nack.window_update)
                await gates.wait(call)
            elif isinstance(d, Admit):
                return True
            else:
                out.error = AgentError(d.code, d.reason, agent=agent, retry_after_ms=d.retry_after_ms)
                out.window_update = d.window_update
                return False

    async def _pump(self, io: StreamIO, agent: str, ready: _Ready, call: Call, out: LegOutcome) -> None:
        """Iterate the adapter's fragments as one reassembled leg message.

        When the cumulative usage of a PARTIAL passes the call's reservation, the
        reservation is extended by the difference (held on the whole account
        chain at once, so concurrent calls never count on the same headroom);
        when the budget cannot take it, raises AgentError(EBUDGET): the call is
        cut (§5 / DESIGN principle 4) and the stream's budget is exhausted."""
        texts: list[str] = []
        final: Fragment | None = None
        async with aclosing(ready.adapter.stream(ready.prompt)) as fragments:
            async for frag in fragments:
                if frag.usage is not None:
                    out.usage = frag.usage
                if frag.usage is not None and frag.type is not PayloadType.FINAL:
                    # A FINAL means the call is over: its spend is committed as is.
                    r = call.reservation
                    assert r is not None
                    more_t = max(0, out.usage.tokens - r.tokens)
                    more_u = max(0, out.usage.usd_micros - r.usd_micros)
                    if (more_t or more_u) and isinstance(self.gates.admission.extend(call, more_t, more_u), Refusal):
                        raise AgentError(
                            ErrorCode.EBUDGET,
                            f"call cut: usage {out.usage.tokens} tokens / {out.usage.usd_micros} usd_micros "
                            "passes what the budget can take",
                            agent=agent,
                        )
                if frag.type is PayloadType.FINAL:
                    final = frag
                    break
                if frag.type is PayloadType.PARTIAL and isinstance(frag.content, str):
                    texts.append(frag.content)
                    io.emit_partial(agent, {"agent": agent, "delta": frag.content}, confidence=frag.confidence)
        if final is None:
            raise AgentError(ErrorCode.EPROTO, "next-hop ended without a FINAL fragment", agent=agent)
        out.text = "".join(texts)
        try:
            out.report = (
                final.content if isinstance(final.content, AgentReport) else msgspec.convert(final.content, AgentReport)
            )
        except msgspec.ValidationError as e:
            raise AgentError(ErrorCode.EPROTO, f"FINAL is not a review report: {e}", agent=agent) from None
        io.emit_partial(
            agent,
            {"agent": agent, "report": msgspec.to_builtins(out.report), "usage": msgspec.to_builtins(out.usage)},
            confidence=final.confidence,
        )


def _attribute(out: LegOutcome, adapter: ProviderAdapter, origin: Origin, crash: str, stalls: LoopStalls) -> None:
    """Attribute ``out``'s failure, given its ``origin`` (and ``crash``: the
    exception's type name), dispatch module doc 3, :func:`~atp_router.flow.breaker.attribute`:
    a wait that ran out just after the router's own loop stalled (``stalls``)
    sets ``out.local`` (its reason says so); in doubt, it becomes the tenant's
    ``ClientInputError`` — ``ETIMEOUT`` for a deadline, ``EPROTO`` for a crash —
    with a reason saying so, and ``out.doubt`` is set."""
    err = out.error
    assert err is not None
    timed_out = origin is Origin.DEADLINE or bool(getattr(err, "timed_out", False))
    stall_s = stalls.recent_stall_s(LOCAL_WITHIN_S) if timed_out else 0.0
    fault = attribute(origin, client_fault=client_fault(err), tenant_bound=adapter.tenant_bound,
                      timed_out=timed_out, stall_s=stall_s)
    if fault is Fault.LOCAL:
        stalls.local_faults += 1
        out.local = True
        out.error = AgentError(err.code, f"{err.reason} (this router's event loop had stalled {stall_s:.1f} s: "
                               "not counted against the next-hop)", agent=out.agent, timed_out=True)
        return
    if fault is not Fault.DOUBT:
        return
    what = f"failed on this task ({crash})" if origin is Origin.CRASH else err.reason
    out.error = ClientInputError(
        f"{what}; a local tool's run is the task's own: not retried, not counted against the next-hop",
        code=ErrorCode.EPROTO if origin is Origin.CRASH else ErrorCode.ETIMEOUT, agent=out.agent,
    )
    out.doubt = True


def is_cancellation(e: BaseException) -> bool:
    """Whether ``e`` is a cancellation: ``trio.Cancelled``, or a group of only
    ``Cancelled`` (what a nursery the cancellation crossed raises — a tool
    adapter's sandbox reads its pipes in one)."""
    if isinstance(e, trio.Cancelled):
        return True
    return isinstance(e, BaseExceptionGroup) and e.split(trio.Cancelled)[1] is None


async def _settled(pending: PendingCharge) -> Charge:
    """Wait until the ledger applied ``pending`` (the store answered again); its charge."""
    done = trio.Event()
    pending.on_done(done.set)
    await done.wait()
    assert pending.charge is not None
    return pending.charge
