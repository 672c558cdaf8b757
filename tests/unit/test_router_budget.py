"""Budget governor through the real router (spec §5.1 budget window, §4.3
BUDGET_UPDATE, §10 EBUDGET, DESIGN principle 4 "cost is bandwidth").

The invariant under test: the committed spend of a stream, and of a client across
all its streams, never exceeds its budget — under any interleaving of concurrent
calls, streamed usage, failures, cuts and live budget updates. It is checked on a
real :class:`~atp_router.runtime.router.Router` (FIB, dispatcher, ledger, windows, QoS) run
in process under trio's autojump clock, with many concurrent streams and, with
Hypothesis, randomized schedules of next-hop delays, usages, estimates, failures
and BUDGET_UPDATEs.

Next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` s (a ``tool:
scripted`` RIB agent) playing per-stream scripts in the shape of a model adapter:
PARTIALs carrying cumulative usage, then a FINAL or an ``AgentError``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator

import atp
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atp_router.adapters.base import Fragment, Prompt
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentReport, Usage
from atp_router.policy.loader import load_rib_text
from atp_router.runtime.router import Router
from atp_router.security.authn import parse_tokens_env
from atp_router.security.identity import ANONYMOUS, Role
from atp_router.wire.errors import AgentError, ErrorCode, PolicyError
from atp_router.wire.frame import (
    Budget,
    BudgetUpdate,
    CostEstimate,
    Flag,
    Frame,
    Payload,
    PayloadType,
    QoS,
)
from tests.helpers import serve_scripted, start_router_on

#: These tests are about the ledger under hundreds of streams of one tenant, not
#: the tenant's open rate and stream quota (tests/security/test_attacks.py).
UNTHROTTLED = {"tenant_rate_per_s": 1e6, "tenant_rate_burst": 1_000_000, "tenant_max_streams": 1_000_000}
from tests.unit.test_router_dispatch import CLEAN, META, scripted_agent
from tests.unit.test_router_flow import (
    content_of,
    drain,
    errs,
    open_inproc,
    serving,
    types,
)

BIG_WINDOW = {"max_parallel": 64, "max_tokens": 100_000_000, "max_usd_micros": 1_000_000_000}


# ------------------------------------------------------------------ per-stream scripts

class Call(msgspec.Struct, frozen=True):
    """One scripted next-hop call: cumulative usage per PARTIAL (tokens; USD
    micros = 2 per token), a pause before each, the estimate, and how it ends."""

    steps: tuple[int, ...]
    delay_s: float
    estimate: int
    ends: str  # "final" | "EAGENTDOWN" | "EPROTO"


class Planned(ScriptedAdapter):
    """Plays ``scripts[content["script"]]``: each stream its own call, whatever
    order trio runs them in."""

    def __init__(self, name: str, scripts: dict[int, Call]):
        super().__init__(name)
        self.scripts = scripts

    def estimate(self, prompt: Prompt) -> CostEstimate:
        c = self.scripts[prompt.content["script"]]
        return CostEstimate(in_tokens=c.estimate, usd=c.estimate * 2 / 1_000_000)

    async def stream(self, prompt: Prompt) -> AsyncIterator[Fragment]:
        self.calls.append(prompt)
        c = self.scripts[prompt.content["script"]]
        usage = Usage()
        for i, t in enumerate(c.steps):
            await trio.sleep(c.delay_s)
            usage = Usage(in_tokens=t, usd_micros=2 * t)
            yield Fragment(type=PayloadType.PARTIAL, content=f"{self.name} {i}", usage=usage)
        await trio.sleep(c.delay_s)
        if c.ends != "final":
            raise AgentError(c.ends, "scripted failure", agent=self.name)
        yield Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=usage)


def calls() -> st.SearchStrategy[Call]:
    return st.builds(
        Call,
        steps=st.lists(st.integers(1, 150), min_size=1, max_size=5).map(lambda xs: tuple(
            sum(xs[: i + 1]) for i in range(len(xs)))),
        delay_s=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
        estimate=st.integers(0, 300),
        ends=st.sampled_from(["final", "final", "final", "EAGENTDOWN", "EPROTO"]),
    )


class Schedule(msgspec.Struct, frozen=True):
    streams: int
    client_of: tuple[int, ...]
    client_budgets: tuple[int | None, ...]  # tokens
    stream_budgets: tuple[int | None, ...]
    updates: tuple[tuple[int, float, int], ...]  # (stream, at s, new tokens)
    a: tuple[Call, ...]
    b: tuple[Call, ...]


@st.composite
def schedules(draw, streams: int = 200) -> Schedule:
    """Small drawn pools (call scripts, budgets) spread over the streams by a
    drawn ``Random``: large schedules from small examples."""
    n_clients = draw(st.integers(1, 4))
    pool_a = draw(st.lists(calls(), min_size=1, max_size=6))
    pool_b = draw(st.lists(calls(), min_size=1, max_size=6))
    budgets = draw(st.lists(st.one_of(st.none(), st.integers(0, 600)), min_size=1, max_size=6))
    rnd = draw(st.randoms(use_true_random=False))
    return Schedule(
        streams=streams,
        client_of=tuple(rnd.randrange(n_clients) for _ in range(streams)),
        client_budgets=tuple(draw(st.lists(st.one_of(st.none(), st.integers(0, 20_000)),
                                           min_size=n_clients, max_size=n_clients))),
        stream_budgets=tuple(rnd.choice(budgets) for _ in range(streams)),
        updates=tuple(draw(st.lists(st.tuples(st.integers(0, streams - 1), st.floats(0, 0.5), st.integers(0, 800)),
                                    max_size=20))),
        a=tuple(rnd.choice(pool_a) for _ in range(streams)),
        b=tuple(rnd.choice(pool_b) for _ in range(streams)),
    )


def _check_account(router: Router, key: str) -> None:
    s = router.ledger.state(key)
    if s.limit.tokens is not None:
        assert s.committed_tokens + s.reserved_tokens <= s.limit.tokens, s
    if s.limit.usd_micros is not None:
        assert s.committed_usd_micros + s.reserved_usd_micros <= s.limit.usd_micros, s


async def _play(tmp_path, schedule: Schedule) -> None:
    a = Planned("m.a", dict(enumerate(schedule.a)))
    b = Planned("m.b", dict(enumerate(schedule.b)))
    adapters = {"m.a": a, "m.b": b}
    doc = {
        "agents": {n: {**scripted_agent(timeout_ms=5_000), "window": BIG_WINDOW} for n in adapters},
        "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.a", "m.b"],
                      "window": BIG_WINDOW, "deadline_ms": 60_000}],
        "clients": {f"c{i}": ({"budget": {"tokens": t, "usd": t * 2 / 1_000_000}} if t is not None else {})
                    for i, t in enumerate(schedule.client_budgets)},
    }
    with pytest.MonkeyPatch.context() as mp:
        serve_scripted(mp, adapters)
        # Streams that end without a result (EBUDGET) would leave the table after
        # REFUSED_RETAIN_S, closing their accounts before the checks read them.
        mp.setattr("atp_router.runtime.dataplane.streams.REFUSED_RETAIN_S", 3600.0)
        async with serving(tmp_path, doc, slots=32, gold_reserved=4, **UNTHROTTLED) as router:
            results: dict[int, list] = {}
            ctxs = {}
            done = trio.Event()

            async def one(i: int) -> None:
                t = schedule.stream_budgets[i]
                ctx = ctxs[i] = open_inproc(
                    router, client=f"c{schedule.client_of[i]}", content={**CLEAN, "script": i},
                    budget=Budget(tokens=t, usd=t * 2 / 1_000_000) if t is not None else None)
                results[i] = await drain(ctx)

            async def update(i: int, at: float, tokens: int) -> None:
                await trio.sleep(at)
                ctx = ctxs.get(i)
                if ctx is None or ctx.log.closed:
                    return
                frame = Frame(v=1, session_id=ctx.session_id, stream_id=ctx.stream_id, msg_seq=1, flags=[Flag.CTRL],
                              payload=Payload(type=PayloadType.CONTROL,
                                              content=BudgetUpdate(budget=Budget(tokens=tokens))))
                router.receive_frame(frame, identity=ctx.identity, now=trio.current_time())

            async def monitor() -> None:
                # The invariant at every step the clock takes, not only at the end.
                while not done.is_set():
                    for ctx in list(ctxs.values()):
                        _check_account(router, ctx.account)
                    for c in range(len(schedule.client_budgets)):
                        if router.ledger.has(f"client:c{c}"):
                            _check_account(router, f"client:c{c}")
                    await trio.sleep(0.01)

            async with trio.open_nursery() as n:
                n.start_soon(monitor)
                async with trio.open_nursery() as streams:
                    for i in range(schedule.streams):
                        streams.start_soon(one, i)
                    for i, at, tokens in schedule.updates:
                        streams.start_soon(update, i, at, tokens)
                done.set()

            per_client: dict[str, tuple[int, int]] = {}
            for i, ctx in ctxs.items():
                s = router.ledger.state(ctx.account)
                _check_account(router, ctx.account)
                assert s.reserved_tokens == 0 and s.open_reservations == 0
                t, u = per_client.get(ctx.tenant, (0, 0))
                per_client[ctx.tenant] = (t + s.committed_tokens, u + s.committed_usd_micros)
                evs = results[i]
                assert evs[-1].type in ("FIN", "RST"), types(evs)
                if any(e["code"] == "EBUDGET" for e in errs(evs)):
                    assert evs[-1].type == "FIN", types(evs)  # EBUDGET → FIN, never RST
                # No call is made once the budget is spent: what the adapters were
                # asked to do for this stream is what the ledger saw.
            for client, (tokens, usd) in per_client.items():
                c = router.ledger.state(f"client:{client}")
                assert (c.committed_tokens, c.committed_usd_micros) == (tokens, usd)
                assert c.reserved_tokens == c.reserved_usd_micros == 0
                _check_account(router, f"client:{client}")


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedule=schedules())
def test_committed_spend_never_exceeds_stream_or_client_budgets_under_random_schedules(tmp_path, schedule):
    """200 concurrent streams of 1-4 clients, two next-hops each with random
    delays, usages (often past the estimate), failures mid-stream, random
    stream and client budgets (tokens and USD) and random BUDGET_UPDATEs: at
    every step and at the end, committed + reserved ≤ limit for every stream
    and client account, the client's spend is exactly its streams' spend, and
    an EBUDGET stream ends with FIN."""
    trio.run(_play, tmp_path, schedule, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_200_concurrent_streams_spend_a_client_budget_exactly_never_more(tmp_path, scripted, autojump_clock):
    """Oversubscribed: 200 streams of one client, each next-hop streaming 100
    tokens at a time up to 500 (estimate 50), against a client budget of
    10_000 tokens. The client's committed spend reaches its budget exactly and
    never passes it; calls that cannot hold more are cut (EBUDGET → FIN)."""
    frags = [Fragment(type=PayloadType.PARTIAL, content=f"p{i}", usage=Usage(in_tokens=100 * (i + 1)))
             for i in range(5)]
    frags.append(Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=Usage(in_tokens=500)))
    scripted["m.hog"] = ScriptedAdapter("m.hog", frags, delay_s=0.01, estimate=CostEstimate(in_tokens=50))
    doc = {"agents": {"m.hog": {**scripted_agent(), "window": BIG_WINDOW}},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.hog"],
                         "window": BIG_WINDOW}],
           "clients": {"alice": {"budget": {"tokens": 10_000}}}}
    async with serving(tmp_path, doc, slots=256, gold_reserved=1, **UNTHROTTLED) as router:
        outcomes: list[list] = []

        async def one() -> None:
            outcomes.append(await drain(open_inproc(router, client="alice")))

        async with trio.open_nursery() as n:
            for _ in range(200):
                n.start_soon(one)
        alice = router.ledger.state("client:alice")
    assert (alice.committed_tokens, alice.reserved_tokens) == (10_000, 0)
    assert all(evs[-1].type == "FIN" for evs in outcomes)
    finals = sum(types(evs)[-2:] == ["FINAL", "FIN"] for evs in outcomes)
    cut = sum(any(e["code"] == "EBUDGET" and "call cut" in e["reason"] for e in errs(evs)) for evs in outcomes)
    not_called = sum(any("not called" in e["reason"] for e in errs(evs)) for evs in outcomes)
    # A call streaming past its estimate holds more budget before going on, so a
    # completed call is charged in full and a cut call's overage is at most the
    # one 100-token report that did not fit; once the client's budget is spent
    # the streams still queued are not called at all.
    assert finals <= 10_000 // 500 and cut > 0 and finals + cut + not_called == 200
    assert 0 < alice.overage_tokens <= 100 * cut


# ------------------------------------------------------------------ streamed usage is committed

async def test_agent_failing_mid_stream_has_its_streamed_usage_committed(tmp_path, scripted, autojump_clock):
    """An agent that streams 3 PARTIALs (usage 100, 200, 300 tokens) and then fails:
    exactly 300 tokens are committed, not the estimate, not zero."""
    frags = [Fragment(type=PayloadType.PARTIAL, content=f"p{i}", usage=Usage(in_tokens=100 * (i + 1),
                                                                             usd_micros=10 * (i + 1)))
             for i in range(3)]
    scripted["m.flaky"] = ScriptedAdapter("m.flaky", frags, delay_s=0.1, fail_with=ErrorCode.EAGENTDOWN,
                                          estimate=CostEstimate(in_tokens=1000, usd=0.001))
    doc = {"agents": {"m.flaky": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.flaky"]}]}
    async with serving(tmp_path, doc) as router:
        ctx = open_inproc(router)
        events = await drain(ctx)
        s = router.ledger.state(ctx.account)
    assert types(events)[-1] == "RST" and content_of(events[-1])["code"] == "EAGENTDOWN"
    assert (s.committed_tokens, s.committed_usd_micros, s.reserved_tokens) == (300, 30, 0)


async def test_client_rst_mid_stream_commits_what_was_streamed(nursery, tmp_path, scripted):
    """The client resets the stream (RST over the HTTP frames endpoint) while the
    call streams: the call stops and exactly what it streamed is committed."""
    frags = [Fragment(type=PayloadType.PARTIAL, content=f"p{i}", usage=Usage(in_tokens=100 * (i + 1)))
             for i in range(50)]
    frags.append(Fragment(type=PayloadType.FINAL, content=AgentReport(), usage=Usage(in_tokens=5000)))
    slow = scripted["m.slow"] = ScriptedAdapter("m.slow", frags, delay_s=0.05)
    env = await start_router_on(nursery, tmp_path, {"agents": {"m.slow": scripted_agent()},
                                                    "policies": [{"name": "p", "match": {"task_type": "code_review"},
                                                                  "fanout": ["m.slow"]}]})
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=CLEAN)
        partials = 0
        async for ev in c.events(st):
            partials += ev.type == "PARTIAL"
            if partials == 3:
                break
        rst = {"v": 1, "session_id": st.session_id, "stream_id": st.stream_id, "msg_seq": 0, "flags": ["RST", "CTRL"],
               "payload": {"type": "control", "content": {"kind": "ERROR", "code": "EPROTO", "reason": "user"}}}
        await c.send_frame(st, rst)
    ctx = env.router.streams.find("anonymous", st.stream_id)
    state = env.router.ledger.state(ctx.account)
    with trio.fail_after(5):
        while state.open_reservations:
            await trio.sleep(0.01)
            state = env.router.ledger.state(ctx.account)
    streamed = ctx.log.events
    deltas = [ev for ev in streamed if ev.type == "PARTIAL"]
    assert 3 <= len(deltas) < 50 and len(slow.calls) == 1
    assert state.committed_tokens == 100 * len(deltas)


# ------------------------------------------------------------------ clients: tokens, RIB, reload

def test_atp_router_tokens_names_clients():
    def ids(value: str) -> list[tuple[str, frozenset[Role]]]:
        return [(t.identity.tenant, t.identity.roles) for t in parse_tokens_env(value)]

    c = frozenset({Role.CLIENT})
    bare = "tok_" + hashlib.sha256(b"bare-token").hexdigest()[:12]
    assert ids("alice:tok-a, bob:tok-b,bare-token,") == [("alice", c), ("bob", c), (bare, c)]
    assert ids("alice:tok-a,ops:tok:o:admin+operator,both:tok-b:client+admin,carol:has:colon") == [
        ("alice", c), ("ops", frozenset({Role.ADMIN, Role.OPERATOR})), ("both", frozenset({Role.CLIENT, Role.ADMIN})),
        ("carol", c)]
    for bad, words in [("alice:", "expected name:token"), (":tok", "expected name:token"),
                       ("a b:tok", "expected name:token"), ("alice:x,alice:y", "client 'alice' given twice"),
                       ("alice:x,bob:x", "the same token is given twice")]:
        with pytest.raises(ValueError, match=words):
            parse_tokens_env(bad)


CLIENT_CASES = {
    "unknown_field": ("clients: {alice: {budgets: {usd: 1}}}",
                      "clients.alice.budgets", "unknown field 'budgets' (known: budget, qos_max"),
    "bad_qos": ("clients: {alice: {qos_max: platinum}}",
                "clients.alice.qos_max", "invalid value 'platinum' (expected one of: gold, silver, bronze)"),
    "negative_usd": ("clients: {alice: {budget: {usd: -1}}}", "clients.alice.budget.usd", "Expected float >= 0.0"),
    "bad_name": ("clients: {'al ice': {}}", "clients.al ice", "invalid client name 'al ice'"),
    "not_a_mapping": ("clients: [alice]", "clients", "expected a mapping of names, got list"),
}


@pytest.mark.parametrize("case", sorted(CLIENT_CASES))
def test_clients_section_refusals_name_the_key(case):
    text, key, reason = CLIENT_CASES[case]
    rib = "agents: {a: {layer: L1, tool: ruff, p95_ms: 1}}\npolicies: [{match: {}, fanout: [a]}]\n" + text
    with pytest.raises(PolicyError) as ei:
        load_rib_text(rib, file="rib.yaml")
    assert ei.value.key == key and reason in ei.value.detail


def test_duplicate_client_across_files_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("agents: {a: {layer: L1, tool: ruff, p95_ms: 1}}\n"
                                     "policies: [{match: {}, fanout: [a]}]\nclients: {alice: {}}\n")
    (tmp_path / "b.yaml").write_text("clients: {alice: {qos_max: bronze}}\n")
    from atp_router.policy.loader import load_rib

    with pytest.raises(PolicyError) as ei:
        load_rib(tmp_path)
    assert (ei.value.file, ei.value.key) == (str(tmp_path / "b.yaml"), "clients.alice")
    assert ei.value.detail == f"duplicate client 'alice' (also defined in {tmp_path / 'a.yaml'})"


async def test_named_tokens_get_their_rib_budget_and_qos_max_and_reload_raises_it(nursery, tmp_path, scripted):
    """``name:token`` authenticates as the RIB client ``name``: its streams are
    capped at its ``qos_max`` (a gold SYN is confirmed as silver) and charged to
    its budget; a RIB reload (by an admin) raises the budget of the live client account."""
    scripted["m.cost"] = ScriptedAdapter.returning("m.cost", usage=Usage(in_tokens=400),
                                                   estimate=CostEstimate(in_tokens=400))
    rib = {"agents": {"m.cost": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.cost"]}],
           "clients": {"alice": {"budget": {"tokens": 500}, "qos_max": "silver"}}}
    env = await start_router_on(nursery, tmp_path, rib, client_tokens={"alice": "tok-a", "ops": "tok-ops"},
                                client_roles={"ops": frozenset({Role.ADMIN})})
    async with atp.Client(env.url, "tok-a") as c:
        _, st = await c.open_stream(task=META, content=CLEAN, qos="gold")
        events = [ev async for ev in c.events(st)]
        assert events[0].type == "SYN_ACK" and events[0].frame.get("qos", "silver") == "silver"  # silver: the default
        assert events[-2].type == "FINAL"
        _, st2 = await c.open_stream(task=META, content=CLEAN)
        with pytest.raises(atp.ATPClientError) as ei:
            await c.result(st2)
        assert ei.value.code == "EBUDGET"
        rib["clients"]["alice"]["budget"]["tokens"] = 2000
        with pytest.raises(atp.ATPClientError) as ei:
            await c.reload_policies(json.dumps(rib))
        assert (ei.value.code, ei.value.status) == ("ESEC", 403)  # a client may not rewrite the policy
        async with atp.Client(env.url, "tok-ops") as admin:
            assert (await admin.reload_policies(json.dumps(rib)))["version"] == 2
        _, st3 = await c.open_stream(task=META, content=CLEAN)
        await c.result(st3)
    alice = env.router.ledger.state("client:alice")
    assert (alice.limit.tokens, alice.committed_tokens) == (2000, 800)
    async with atp.Client(env.url, "wrong") as c:
        with pytest.raises(atp.ATPClientError) as ei:
            await c.open_stream(task=META, content=CLEAN)
        assert (ei.value.code, ei.value.status) == ("ESEC", 401)


async def test_budget_update_cannot_raise_past_the_policy_budget(tmp_path, scripted, autojump_clock):
    """BUDGET_UPDATE raises the stream's budget only up to the policy's on each
    axis (the operator's cap); an axis the update leaves out becomes the policy's."""
    scripted["m.a"] = ScriptedAdapter.returning("m.a", delay_s=1.0)
    doc = {"agents": {"m.a": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.a"],
                         "budget": {"tokens": 1000, "usd": 0.5}}]}
    async with serving(tmp_path, doc) as router:
        ctx = open_inproc(router, budget=Budget(tokens=100, usd=0.01))
        frame = Frame(v=1, session_id=ctx.session_id, stream_id=ctx.stream_id, msg_seq=1, flags=[Flag.CTRL],
                      payload=Payload(type=PayloadType.CONTROL, content=BudgetUpdate(budget=Budget(tokens=50_000))))
        router.receive_frame(frame, identity=ANONYMOUS, now=trio.current_time())
        limit = router.ledger.state(ctx.account).limit
        await drain(ctx)
    assert (limit.tokens, limit.usd_micros) == (1000, 500_000)
    assert ctx.qos is QoS.SILVER


# ------------------------------------------------------------------ the ledger additions (sans-IO)

def test_ledger_extend_holds_more_all_or_nothing_and_exhausted_names_the_account():
    from atp_router.flow.budget import Allowance, BudgetLedger, Refusal

    lg = BudgetLedger()
    lg.open("client:a", Allowance(tokens=1000))
    lg.open("stream:1", Allowance(tokens=800), parent="client:a")
    lg.open("stream:2", Allowance(), parent="client:a")
    r1 = lg.reserve("stream:1", 300, 0)
    r2 = lg.reserve("stream:2", 300, 0)
    grown = lg.extend(r1, 400, 0)
    assert not isinstance(grown, Refusal) and (grown.id, grown.tokens) == (r1.id, 700)
    refused = lg.extend(r2, 1, 0)  # the client has 1000 - 700 - 300 = 0 left
    assert isinstance(refused, Refusal) and refused.key == "client:a"
    assert lg.state("stream:2").reserved_tokens == 300  # unchanged by the refusal
    with pytest.raises(ValueError):
        lg.extend(r1, 1, 0)  # r1 was replaced by ``grown``
    assert lg.exhausted("stream:1") is None
    lg.commit(grown, 700, 0)
    lg.commit(r2, 300, 0)
    assert lg.exhausted("stream:2") == "'client:a' tokens 1000/1000"
    assert lg.exhausted("stream:1") == "'client:a' tokens 1000/1000"


def test_ledger_set_limit_clamp_lowers_to_what_is_held_never_below():
    from atp_router.flow.budget import Allowance, BudgetLedger

    lg = BudgetLedger()
    lg.open("s", Allowance(tokens=1000, usd_micros=1000))
    r = lg.reserve("s", 200, 100)
    lg.commit(lg.reserve("s", 100, 0), 100, 0)
    assert lg.set_limit("s", Allowance(tokens=0, usd_micros=0)) is not None  # refused without clamp
    assert lg.set_limit("s", Allowance(tokens=0, usd_micros=None), clamp=True) is None
    assert lg.state("s").limit == Allowance(tokens=300, usd_micros=None)
    lg.commit(r, 150, 50)
    assert lg.remaining("s").tokens == 50  # settled below its reservation: 300 - 250 committed
