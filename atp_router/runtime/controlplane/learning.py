"""The trio side of routing that learns (spec §6.2, §18): carries out what the
sans-IO :class:`~atp_router.policy.learn.RoutingLearner` decides.

* :meth:`Learning.route` — a FIB route re-ordered by its policy's bandit at SYN;
  the :class:`~atp_router.policy.learn.Decision` is kept with the stream (and in the
  store, for feedback after a restart).
* :meth:`Learning.task_done` — every call of a finished task feeds the live
  metrics (client-caused failures excluded: a tenant's bad input never lowers an
  agent's figures for everyone); the merged result's verdict on each called
  next-hop (:func:`~atp_router.policy.learn.consensus_quality`) feeds the bandit.
* :meth:`Learning.feedback` — ``POST /v1/streams/{id}/feedback``: the client's
  score (0..1) for the arms that served its stream, once per stream.
* :meth:`Learning.shadow` — a policy's shadow challenger (spec §18) on bronze,
  after the client's FINAL, on its own ledger account (``shadow:<policy>``,
  the policy's shadow budget), never the client's; its regret against the
  served result is ``atp_shadow_regret``.
* :meth:`Learning.run` — saves changed arms and live statistics to the store
  every :data:`SAVE_INTERVAL_S` (and at shutdown): learned weights survive a
  restart; a kill -9 loses at most that interval of learning.
* :meth:`Learning.sync_shared` — instead of that, for routers that share their
  store (``--workers N``, a shared store; :mod:`atp_router.runtime.controlplane.shared_state` runs
  it every :data:`SHARED_SYNC_S` and at shutdown): each bandit arm's
  :class:`~atp_router.policy.bandit.ArmDelta` since its last sync is merged into
  ``bandit/<policy>/<arm>`` and the live statistics' contributions into
  ``live/stats`` (one atomic ``Store.update`` each;
  :func:`~atp_router.policy.learn.merge_arm_entry`,
  :func:`~atp_router.policy.learn.merge_live_state`), and the merged result is
  adopted; what other routers pushed meanwhile is read back when the index
  ``learn/seqs`` (key → sequence number) says it changed. Every router
  learns from every router's traffic; a kill -9 loses at most one interval.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import trio

from atp_router.consensus.escalation import TEST_FAIL_RULE
from atp_router.flow.budget import Allowance
from atp_router.flow.window import Window as FlowWindow
from atp_router.policy.fib import Route
from atp_router.policy.learn import (
    CHEAP,
    ESCALATE,
    KEY_SEP,
    MIN_OBS,
    Decision,
    RoutingLearner,
    consensus_quality,
    live_stats_of,
    result_quality,
)
from atp_router.policy.rib import PolicySpec
from atp_router.runtime.controlplane.learn_entries import (
    ARM_PREFIX,
    GAIN_PREFIX,
    LIVE_KEY,
    SEQ_KEY,
    bump_index,
    decode_arm,
    decode_gain,
    decode_live,
    push_arm,
    push_gain,
    push_live,
)
from atp_router.runtime.controlplane.shadow import ShadowIO, agreement_quality
from atp_router.runtime.dataplane.plan import TaskPlan, client_fault
from atp_router.security.identity import Identity
from atp_router.store.base import StoreUnavailable
from atp_router.wire.errors import AgentError, ATPError, ErrorCode
from atp_router.wire.frame import QoS, Window

if TYPE_CHECKING:
    from atp_router.flow.budget import BudgetLedger
    from atp_router.observability.metrics import RouterMetrics
    from atp_router.runtime.controlplane.control import ControlPlane, Generation
    from atp_router.runtime.dataplane.stream import StreamCtx
    from atp_router.store import Store

__all__ = ["SAVE_INTERVAL_S", "SHARED_SYNC_S", "AuditSink", "FeedbackRefused", "LearnLimits", "Learning",
           "has_tenants", "prompt_text"]

log = logging.getLogger("atp_router.runtime.controlplane.learning")

#: How often changed bandit arms and live statistics are written to the store (s).
SAVE_INTERVAL_S = 5.0
#: How often a router sharing its store merges its learning with the others' (s).
SHARED_SYNC_S = 1.0
#: Every this many shared syncs, arms are read back even if the index says unchanged.
_FULL_PULL_EVERY = 30
_FEEDBACK_PREFIX = "feedback/"
#: Content keys whose text the bandit's featurizer reads (first ones first).
TEXT_KEYS = ("prompt", "question", "text", "input", "diff", "query")


def prompt_text(content: Any, limit: int = 4_000) -> str:
    """The task's prompt text for the featurizer: the string values of
    :data:`TEXT_KEYS` in ``content``, joined, at most ``limit`` characters."""
    if isinstance(content, str):
        return content[:limit]
    if not isinstance(content, Mapping):
        return ""
    parts, size = [], 0
    for k in TEXT_KEYS:
        v = content.get(k)
        if isinstance(v, str) and v:
            parts.append(v[: limit - size])
            size += len(parts[-1])
            if size >= limit:
                break
    return "\n".join(parts)


def has_tenants(authenticate: Callable[[None], object]) -> bool:
    """Does a router whose ingresses call ``authenticate`` (its
    :meth:`Router.authenticate <atp_router.runtime.router.Router.authenticate>`)
    tell callers apart (a caller without credentials is refused)?"""
    try:
        authenticate(None)
    except ATPError:
        return True
    return False


#: One record of the security audit trail: ``(kind, identity, detail)``
#: (:meth:`Router.audit_event <atp_router.runtime.router.Router.audit_event>`).
AuditSink = Callable[[str, Identity | None, Mapping[str, Any]], None]


@dataclass(frozen=True)
class LearnLimits:
    """How much one tenant may teach the shared routing state (spec §6.2): at
    most ``rate_per_s`` finished tasks per second with bursts of ``burst`` (a
    token bucket, ``RouterConfig.learn_rate_per_s``/``learn_burst``), and at
    most ``share`` of a shared statistic's quality weight
    (:class:`~atp_router.policy.learn.TenantShares`, ``RouterConfig.learn_share``;
    1.0: no cap)."""

    rate_per_s: float
    burst: int
    share: float


class FeedbackRefused(Exception):
    """Feedback that cannot be taken: ``status`` (404/409/422) and ``reason``."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _GenHold:
    """Holds a generation for a shadow run (its adapters stay open meanwhile)."""

    def __init__(self, gen: Generation):
        self.gen: Generation | None = gen
        self.holds_gen = False


def _policy_spec(gen: Generation, name: str) -> PolicySpec | None:
    for i, p in enumerate(gen.rib.policies):
        if (p.name or f"policy[{i}]") == name:
            return p
    return None


class Learning:
    """Learning state of one router (see the module doc), built from the parts
    it uses: the ``store`` its state is saved in (and feedback recorded in), the
    budget ``ledger`` shadow runs are charged to, the router's ``metrics``, the
    ``control`` plane (the running generation, a tenant's RIB ``clients``
    entry, the hold on a generation a shadow call runs on), the ``audit`` trail,
    each tenant's learning ``limits`` and whether the router ``tenants`` tells
    callers apart (:func:`has_tenants`), and the bandits' ``seed``."""

    def __init__(self, store: Store, *, ledger: BudgetLedger, metrics: RouterMetrics, control: ControlPlane,
                 audit: AuditSink, limits: LearnLimits, tenants: bool, seed: int | None = None):
        self.store = store
        self.ledger = ledger
        self.metrics = metrics
        self.control = control
        self.audit = audit
        self.limits = limits
        # Each tenant's share of the shared quality evidence (TenantShares): on a
        # router with credentials; one without (every caller the one tenant
        # "anonymous", a local appliance) has no other tenant to share with.
        self.learner = RoutingLearner(seed=seed, share=limits.share if tenants else 1.0)
        self._version: int | None = None
        #: Per tenant (tokens, last refill): how much more it may teach the shared state.
        self._buckets: dict[str, tuple[float, float]] = {}
        #: Learning merged with other routers' through the store (:meth:`share`).
        self.shared = False
        #: A tenant's learning rate shared by the routers on one store, set by the
        #: deployment mode: ``(tenant, rate_per_s, burst) -> may it learn`` (None:
        #: the store could not say; this router's bucket decides).
        #: :meth:`SharedQuotas.may_learn <atp_router.runtime.dataplane.quotas.SharedQuotas.may_learn>`.
        self.shared_rate: Callable[[str, float, int], bool | None] | None = None
        self._live_seq: int | None = None
        #: Each gain entry's ``seq`` as this router last adopted it.
        self._gain_seq: dict[str, Any] = {}
        self._live_raw: bytes | None = None
        self._syncs = 0
        self._load()

    def _may_learn(self, tenant: str, now: float) -> bool:
        """The tenant's learning token bucket (:class:`LearnLimits` ``rate_per_s``,
        ``burst``): the one shared by the routers on a store (:attr:`shared_rate`)
        while it answers, else this router's own."""
        lim = self.limits
        if self.shared_rate is not None:
            shared = self.shared_rate(tenant, lim.rate_per_s, lim.burst)
            if shared is not None:
                return shared
        tokens, last = self._buckets.get(tenant, (float(lim.burst), now))
        tokens = min(float(lim.burst), tokens + (now - last) * lim.rate_per_s)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            return False
        self._buckets[tenant] = (tokens - 1.0, now)
        return True

    # ----------------------------------------------------------- store
    def _load(self) -> None:
        store = self.store
        rows = []
        for key, raw in store.items(ARM_PREFIX):
            try:
                obj = decode_arm(raw)
                if obj is None:
                    raise TypeError(key)
                rows.append((obj["policy"], obj["arm"], obj["fingerprint"], obj["state"]))
            except (KeyError, TypeError):
                log.warning("learning: unreadable arm state %s skipped", key)
        self.learner.load_arms(rows)
        self.learner.load_gain(e for _, raw in store.items(GAIN_PREFIX) if (e := decode_gain(raw)) is not None)
        live_raw = store.get(LIVE_KEY)
        if live_raw:
            try:
                n = self.learner.live.load(json.loads(live_raw))
                log.info("learning: %d live statistics and %d bandit arms restored", n, len(rows))
            except (ValueError, AttributeError):
                log.warning("learning: unreadable live statistics skipped")

    def save(self) -> None:
        """Write changed arms and live statistics to the store."""
        store = self.store
        for policy, arm, fp, state in self.learner.dirty_arms():
            store.put(f"{ARM_PREFIX}{policy}/{arm}",
                      msgspec.msgpack.encode({"policy": policy, "arm": arm, "fingerprint": fp, "state": state}))
        for entry in self.learner.dirty_gains():
            store.put(f"{GAIN_PREFIX}{entry['policy']}", msgspec.msgpack.encode(entry))
        live = self.learner.live
        if live.changed:
            live.changed.clear()
            store.put(LIVE_KEY, json.dumps(live.state()).encode())

    async def run(self) -> None:
        """Save every :data:`SAVE_INTERVAL_S`; once more when cancelled. A
        router that :meth:`share` s its learning returns at once (its syncs
        replace the saves: a save would overwrite what the others merged)."""
        if self.shared:
            return
        try:
            while not self.shared:
                await trio.sleep(SAVE_INTERVAL_S)
                if self.shared:
                    return
                try:
                    self.save()
                except StoreUnavailable as e:
                    # A full disk or a store away is a known state (the store's own metrics
                    # and /v1/ready say so): one line, saved again at the next interval.
                    log.warning("learning: the learned state is not saved now (%s); tried again in %g s", e,
                                SAVE_INTERVAL_S)
                except Exception:
                    log.exception("learning: saving the learned state failed")
        finally:
            if not self.shared:
                try:
                    self.save()
                except StoreUnavailable as e:
                    log.error("learning: the learned state was not saved at shutdown (%s)", e)
                except Exception:
                    log.exception("learning: saving the learned state at shutdown failed")

    # ----------------------------------------------------------- shared store
    def share(self) -> None:
        """Merge this router's learning with the other routers' on its store
        from now on (:meth:`sync_shared`, the module doc) instead of saving it
        (last writer wins). Call before traffic: the arms as they are now are
        the base of the first push."""
        self.shared = True
        self.learner.share()

    def sync_shared(self, index_raw: bytes | None | Literal[False] = False) -> dict[str, int]:
        """One merge with the shared store (the module doc): push every arm and
        the live statistics that learned since their last sync, adopt the merged
        results, read back what the index says others changed. Synchronous
        (store calls); raises :class:`~atp_router.store.StoreError` (e.g.
        ``StoreUnavailable``) — what was not pushed is pushed by the next
        call: nothing is lost. (A push the store applied but whose answer
        was lost — the connection cut at that instant — is pushed again, so
        that interval of this router's learning counts twice.) Returns
        ``{"pushed": n, "pulled": n}`` (arms, gain models and the live document).
        ``index_raw``: the index (:data:`SEQ_KEY`) as read off the loop (False: read here)."""
        store = self.store
        self.sync(self.control.gen)
        rib = self._version or 0
        self._syncs += 1
        full = self._syncs % _FULL_PULL_EVERY == 1
        raw = store.get(SEQ_KEY) if index_raw is False else index_raw
        try:
            index = json.loads(raw) if raw else {}
        except ValueError:
            index = {}
        if not isinstance(index, dict):
            index = {}
        seq = int(time.time() * 1000)  # sequence numbers above any a restart forgot
        written: dict[str, int] = {}
        pulled = 0
        try:
            for arm in self.learner.shared_arms():
                key = f"{ARM_PREFIX}{arm.policy}/{arm.arm}"
                delta = arm.model.delta(arm.base)
                if not delta.empty:
                    new = store.update(key, functools.partial(push_arm, arm, delta, rib, seq))
                    entry = decode_arm(new)
                    if entry is not None and arm.synced(entry):
                        written[key] = arm.seq or 0
                elif full or index.get(key) != arm.seq:
                    entry = decode_arm(store.get(key))
                    if entry is not None and entry.get("seq") != arm.seq and arm.synced(entry):
                        pulled += 1
            live = self.learner.live
            priors = self.learner.priors
            deltas = live.deltas()
            if deltas:
                new = store.update(LIVE_KEY, functools.partial(push_live, deltas, rib, tuple(priors), seq))
                doc = decode_live(new)
                if doc is not None:
                    live.adopt(live_stats_of(doc), priors, pushed=True)
                    self._live_seq, self._live_raw = doc.get("seq"), new
                    written[LIVE_KEY] = int(doc.get("seq", 0))
            elif full or index.get(LIVE_KEY) != self._live_seq:
                new = store.get(LIVE_KEY)
                if new is not None and new != self._live_raw and (doc := decode_live(new)) is not None:
                    live.adopt(live_stats_of(doc), priors, pushed=False)
                    self._live_seq, self._live_raw = doc.get("seq"), new
                    pulled += 1
            pulled += self._sync_gains(index, seq, full, written)
        finally:
            if written:
                store.update(SEQ_KEY, functools.partial(bump_index, written))
        return {"pushed": len(written), "pulled": pulled}

    def _sync_gains(self, index: Mapping[str, Any], seq: int, full: bool, written: dict[str, int]) -> int:
        """The gain models' part of :meth:`sync_shared`: push what each learned
        (:func:`push_gain`), adopt the merged entry; pull one another changed."""
        pulled = 0
        gains = {policy: (model, base) for policy, model, base in self.learner.shared_gains()}
        # a gain entry ``learn`` wrote for a policy that routes without one yet
        fresh = [k[len(GAIN_PREFIX):] for k, s in index.items() if k.startswith(GAIN_PREFIX)
                 and k[len(GAIN_PREFIX):] not in gains and s != self._gain_seq.get(k[len(GAIN_PREFIX):])]
        for policy in [*gains, *fresh]:
            key = f"{GAIN_PREFIX}{policy}"
            delta = gains[policy][0].delta(gains[policy][1]) if policy in gains else None
            if delta is not None and not delta.empty:
                entry = decode_gain(self.store.update(key, functools.partial(push_gain, delta, seq)))
                if entry is not None and self.learner.adopt_gain(policy, entry):
                    self._gain_seq[policy] = entry.get("seq")
                    written[key] = int(entry.get("seq") or seq)
            elif full or policy in fresh or index.get(key) != self._gain_seq.get(policy):
                entry = decode_gain(self.store.get(key))
                if entry is not None and entry.get("seq") != self._gain_seq.get(policy) \
                        and self.learner.adopt_gain(policy, entry):
                    self._gain_seq[policy] = entry.get("seq")
                    pulled += 1
        return pulled

    # ----------------------------------------------------------- decisions
    def sync(self, gen: Generation) -> None:
        """Follow the running RIB generation (after any reload path)."""
        if self._version != gen.version:
            self.learner.sync(gen.rib)
            self._version = gen.version

    def live_view(self) -> Mapping[str, Any]:
        return self.learner.live.view()

    def win_rates(self, route: Route) -> dict[str, float]:
        """The live quality (win rate) of the route's agents, for the consensus
        tie-break (§7.2): per policy once the policy has observed the agent,
        else per agent; agents never observed are left to the RIB's ``win30d``."""
        view = self.learner.live.view()
        agents = [h.agent for h in (*route.next_hops, *route.alternates)]
        if route.escalation_hop is not None:
            agents.append(route.escalation_hop.agent)
        out: dict[str, float] = {}
        for a in agents:
            pv = view.get(f"{route.policy}{KEY_SEP}{a}")
            v = pv if pv is not None and pv.quality_obs >= MIN_OBS else view.get(a)
            if v is not None and v.quality_obs > 0:
                out[a] = v.quality
        return out

    def route(self, route: Route, gen: Generation, meta: Mapping[str, Any], content: Any, *, tenant: str,
              budget_usd_micros: int | None, qos: Any = None) -> tuple[Route, Decision | None]:
        """``route`` ordered by its policy's bandit for this task (meta, prompt
        text of ``content``, tenant, QoS class), with the decision to learn from."""
        self.sync(gen)
        if not self.learner.has_bandit(route.policy):
            return route, None
        new, decision = self.learner.route(route, meta, prompt_text(content), tenant=tenant,
                                           budget_usd_micros=budget_usd_micros,
                                           qos=str(qos) if qos is not None else None)
        if decision is not None:
            for a in decision.order[: decision.k]:
                self.metrics.bandit_choices.labels(route.policy, a).inc()
        return new, decision

    def task_done(self, ctx: StreamCtx, plan: TaskPlan, final: Any | None, escalated_to: str | None) -> dict[str, float]:
        """Feed the live metrics and the bandit from one finished task (``final``
        None: no next-hop produced a result), within the tenant's learning rate.
        Returns each called agent's quality ({} when nothing was learned)."""
        if not self._may_learn(ctx.tenant, trio.current_time()):
            self.metrics.learning_skipped.labels(ctx.route.policy).inc()
            return {}
        policy = ctx.route.policy
        called: list[str] = []
        failed: set[str] = set()
        ok_agents: set[str] = set()
        for o in plan.attempts:
            if not o.called or client_fault(o.error):
                continue
            timeout = o.error is not None and o.error.code is ErrorCode.ETIMEOUT
            self.learner.observe_call(o.agent, policy=policy, latency_ms=o.latency_ms, ok=o.error is None,
                                      timeout=timeout, tokens=o.usage.tokens, usd_micros=o.usage.usd_micros)
            if o.agent not in called:
                called.append(o.agent)
            if o.error is None and not o.cancelled:
                ok_agents.add(o.agent)
            else:
                failed.add(o.agent)
        failed -= ok_agents
        if not called:
            return {}
        tests: list[tuple[str, int, int]] = []
        if final is None:
            qualities = {a: 0.0 for a in called if a in failed}
        else:
            tests = [(f.file, f.start, f.end) for o in plan.attempts if o.report is not None
                     for f in o.report.findings if f.rule == TEST_FAIL_RULE]
            qualities = consensus_quality(final.result, called, failed, confirmer=escalated_to,
                                          failing_tests=tests)
        decision = ctx.decision if isinstance(ctx.decision, Decision) else None
        if decision is not None:
            decision.called = called
            decision.escalated = escalated_to is not None
            self.learner.observe(decision, qualities, tenant=ctx.tenant)
            if decision.escalate is not None and final is not None:
                cheap = [a for a in called if a != escalated_to]
                outcome = {CHEAP: result_quality(final.result, cheap, confirmer=escalated_to, failing_tests=tests)}
                if escalated_to is not None:
                    # The escalation target's verdict is the reference the cheap answer is scored against.
                    outcome[ESCALATE] = 1.0 if escalated_to not in failed else outcome[CHEAP]
                self.learner.observe_escalation(decision, outcome)
        else:
            for a, q in qualities.items():
                self.learner.observe_quality(a, q, policy=policy, tenant=ctx.tenant)
        return qualities

    # ----------------------------------------------------------- feedback
    def feedback(self, ctx: StreamCtx, score: float, labels: list[str]) -> dict[str, Any]:
        """The client's ``score`` (0..1) for its finished stream ``ctx`` (live or
        read back from the store): each next-hop that answered it learns the
        score (weight 2: the client knows best), the bandit too when the
        stream's policy chose by bandit. Once per stream. Raises
        :class:`FeedbackRefused`."""
        if not ctx.log.closed:
            raise FeedbackRefused(409, "the stream is still running: send feedback after its FINAL")
        key = f"{_FEEDBACK_PREFIX}{ctx.tenant}/{ctx.stream_id}"
        store = self.store
        if store.get(key) is not None:
            raise FeedbackRefused(409, "feedback for this stream was already given")
        decision = ctx.decision
        if isinstance(decision, Mapping):  # read back from the store
            bits = self.learner.bits(str(decision.get("policy")))
            try:
                decision = Decision.from_json(decision, bits) if bits is not None else None
            except (KeyError, TypeError, ValueError):
                decision = None
        policy = ctx.route.policy or None
        served = list(decision.called) if isinstance(decision, Decision) else []
        if not served:
            served = sorted({ev.frame.payload.content.get("agent") for ev in ctx.log.events
                             if ev.type == "PARTIAL" and isinstance(ev.frame.payload.content, dict)
                             and "report" in ev.frame.payload.content
                             and isinstance(ev.frame.payload.content.get("agent"), str)})
        if not served:
            raise FeedbackRefused(409, "no next-hop answered this stream: nothing to learn from")
        if isinstance(decision, Decision) and not decision.called:
            # Read back from the store (saved at SYN): the escalation target is never in the fanout.
            decision.escalated = any(a not in decision.order for a in served)
        store.put(key, json.dumps({"score": score, "labels": labels}).encode())
        qualities = {a: score for a in served}
        # An untrusted tenant's scores train only its own routing (RIB clients.<t>.feedback).
        shared = self.control.client_spec(ctx.tenant).feedback == "shared"
        learned = isinstance(decision, Decision) and self.learner.has_bandit(decision.policy)
        if learned:
            self.learner.observe(decision, qualities, weight=2.0, tenant_only=not shared, tenant=ctx.tenant)
            if decision.escalate is not None:
                self.learner.observe_escalation(decision, {ESCALATE if decision.escalated else CHEAP: score},
                                                weight=2.0, tenant_only=not shared)
        elif shared:
            for a in served:
                self.learner.observe_quality(a, score, policy=policy, weight=2.0, tenant=ctx.tenant)
        self.metrics.feedback.labels(policy or "").inc()
        return {"stream_id": ctx.stream_id, "agents": served, "score": score, "labels": labels, "bandit": learned,
                "scope": "shared" if shared else "tenant"}

    # ----------------------------------------------------------- shadow
    def shadow_due(self, ctx: StreamCtx, gen: Generation, called: list[str]) -> Any | None:
        """The shadow next-hop to run after ``ctx``'s FINAL, or None."""
        spec = _policy_spec(gen, ctx.route.policy)
        if spec is None or spec.shadow is None or spec.shadow.agent in called:
            return None
        if spec.shadow.agent not in gen.adapters or not self.learner.shadow(spec.shadow.rate):
            return None
        return gen.fib.next_hop(spec.shadow.agent, ctx.meta)  # None: not cleared for the data scope

    async def shadow(self, ctx: StreamCtx, plan: TaskPlan, final: Any, gen: Generation, hop: Any,
                     served_quality: float) -> None:
        """Run ``hop`` on the task in the shadow (see the module doc)."""
        policy = ctx.route.policy
        spec = _policy_spec(gen, policy)
        assert spec is not None and spec.shadow is not None
        parent = f"shadow:{policy}"
        limit = Allowance.from_budget(spec.shadow.budget)
        ledger = self.ledger
        if ledger.has(parent):
            ledger.set_limit(parent, limit, clamp=True)
        else:
            ledger.open(parent, limit)
        if ledger.exhausted(parent):
            self.metrics.shadow_runs.labels(policy, hop.agent, "budget").inc()
            return
        account = f"{parent}:{ctx.tenant}:{ctx.stream_id}"
        ledger.open(account, Allowance.from_budget(ctx.budget), parent=parent)
        now = trio.current_time()
        route = Route(policy=policy, next_hops=[msgspec.structs.replace(hop, qos=QoS.BRONZE)], escalation=None,
                      escalation_hop=None, budget=None, window=None, consensus=ctx.route.consensus,
                      qos=QoS.BRONZE, deadline_ms=ctx.route.deadline_ms)
        splan = TaskPlan(prompt=plan.prompt, route=route,
                         window=FlowWindow(Window(max_parallel=1, max_tokens=ctx.window.max_tokens,
                                                  max_usd_micros=ctx.window.max_usd_micros)),
                         ledger_key=account, stream_id=account, qos=QoS.BRONZE, started=now,
                         deadline=now + ctx.route.deadline_ms / 1000, fib=gen.fib, prompt_for=plan.prompt_for)
        io = ShadowIO(account)
        outcome = "ok"
        hold = _GenHold(gen)
        self.control.hold(hold)  # a reload meanwhile must not close the challenger's adapter
        try:
            shadow_final = await gen.dispatcher.run(io, splan)
            findings = [f for f in shadow_final.result.findings]
            q = agreement_quality(findings, list(final.result.findings))
        except AgentError as e:
            outcome = str(e.code)
            q = 0.0
        finally:
            self.control.release(hold)
            try:
                ledger.close(account)
            except ValueError:
                pass
        regret = q - served_quality
        self.metrics.shadow_runs.labels(policy, hop.agent, outcome).inc()
        self.metrics.shadow_regret.labels(policy, hop.agent).observe(regret)
        decision = ctx.decision if isinstance(ctx.decision, Decision) else None
        if outcome != str(ErrorCode.EBUDGET):  # a spent shadow budget says nothing of the agent
            if decision is not None:
                self.learner.observe(decision, {hop.agent: q})
            else:
                self.learner.observe_quality(hop.agent, q, policy=policy)
        self.audit("shadow", ctx.identity, {"session_id": ctx.session_id, "stream_id": ctx.stream_id,
                                            "agent": hop.agent, "outcome": outcome,
                                            "quality": round(q, 4), "regret": round(regret, 4)})
