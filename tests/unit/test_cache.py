"""The content-addressed response cache (spec §13; atp_router.policy.cache, atp_router.runtime.dataplane.cache).

Three layers, each against the real thing below it:

* the keys and values (sans-IO): what a key holds and what it leaves out;
* the SQLite store's cache table: TTL, the byte bound (least recently used
  first), totals, a restart;
* a real router on real ruff and bandit (and a scripted paid next-hop for the
  budget ledger): the same diff reviewed twice is served from the cache the
  second time — the same findings marked cached, 0 tokens and 0 USD charged,
  the ledger unchanged, hits in ``/v1/metrics`` — for the same tenant only,
  unless the policy shares; a different data-scope label misses; no ``cache``
  key, no cache; entries survive a restart and expire with their TTL.
"""

from __future__ import annotations

import json

import atp
import msgspec
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import (
    ANSWER_CHARS,
    AgentFinding,
    AgentReport,
    FinalResult,
    Severity,
    Usage,
)
from atp_router.policy.cache import (
    VOLATILE_META,
    CacheEntry,
    agent_fingerprint,
    cache_key,
    cacheable,
    compile_cache,
    decode_entry,
    encode_entry,
    fresh,
)
from atp_router.policy.check import render_fib
from atp_router.policy.fib import compile_fib
from atp_router.policy.loader import load_rib_text
from atp_router.store import SqliteStore
from atp_router.wire.errors import AgentError, ErrorCode, PolicyError
from tests.conftest import start_router

META = {"task_type": "code_review", "languages": ["py"]}
RUFF = {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"]}
BANDIT = {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"]}

SOURCE = (
    "import os\n"
    "import subprocess\n"
    "\n"
    "\n"
    "def run(cmd):\n"
    "    return subprocess.call(cmd, shell=True)\n"
)


def _diff(path: str, text: str) -> str:
    lines = text.splitlines()
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{ln}\n" for ln in lines)


TASK = {"diff": _diff("runner.py", SOURCE), "files": {"runner.py": SOURCE}}
OTHER = {"diff": _diff("other.py", SOURCE.replace("cmd", "command")),
         "files": {"other.py": SOURCE.replace("cmd", "command")}}

ADMIN = "tok-ops"
TOKENS = f"alice:tok-alice,bob:tok-bob,ops:{ADMIN}:admin+operator"


def rib(*, cache: dict | None = None, agents: dict | None = None, clients: dict | None = None) -> dict:
    policy = {"name": "review", "match": {"task_type": "code_review"},
              "fanout": list(agents or {"lint.ruff": RUFF, "sec.bandit": BANDIT}),
              "budget": {"usd": 1.0, "tokens": 100_000}}
    if cache is not None:
        policy["cache"] = cache
    doc = {"agents": agents or {"lint.ruff": RUFF, "sec.bandit": BANDIT}, "policies": [policy]}
    if clients:
        doc["clients"] = clients
    return doc


# ============================================================ keys and values (sans-IO)

def _prompt(content=None, **meta) -> Prompt:
    return Prompt(task_type="code_review", content=content if content is not None else TASK,
                  meta={**META, **meta})


def _key(prompt: Prompt, *, tenant: str | None = "alice", agent: str = "lint.ruff", fp: str = "f" * 64) -> bytes:
    return cache_key(agent=agent, fingerprint=fp, prompt=prompt, tenant=tenant)


def test_key_leaves_out_the_volatile_meta_and_keeps_everything_else():
    base = _key(_prompt())
    assert len(base) == 32
    volatile = {"ttl": 3, "ts": 1_700_000_000_000, "nonce": "n-1", "trace": {"parent_span": "ab"},
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "x=1",
                "idempotency_key": "k-1", "budget": {"usd": 2.0}, "resume_after": 4, "subscribe": True,
                "route": {"policy": "p"}, "usage": {"tokens": 1}}
    assert set(volatile) == VOLATILE_META
    assert _key(_prompt(**volatile)) == base
    for k, v in (("languages", ["go"]), ("risk", "high"), ("data_scope", ["no_secrets"]), ("diff_loc", 6),
                 ("agent_context", {"agentContext": {}}), ("some_new_field", 1)):
        assert _key(_prompt(**{k: v})) != base, k  # an unknown field is assumed to change the answer
    # dict order is not part of the key (canonical JSON, sorted keys)
    assert _key(_prompt(content=dict(reversed(list(TASK.items()))))) == base


def test_key_is_the_tenants_unless_shared_and_follows_agent_config_and_content():
    p = _prompt()
    assert _key(p, tenant="alice") != _key(p, tenant="bob")
    assert _key(p, tenant=None) not in (_key(p, tenant="alice"), _key(p, tenant=""))
    assert _key(p, agent="sec.bandit") != _key(p)
    assert _key(p, fp="e" * 64) != _key(p)
    assert _key(_prompt(content=OTHER)) != _key(p)
    assert _key(msgspec.structs.replace(p, instruction="be brief")) != _key(p)
    redacted = {**TASK, "files": {"runner.py": SOURCE.replace("cmd", "[REDACTED:x]")}}
    assert _key(_prompt(content=redacted)) != _key(p)


def test_agent_fingerprint_follows_what_shapes_the_answer_not_what_steers_the_router():
    base = rib(agents={"m.review": {"layer": "L2", "model": "m", "p95_ms": 500}})
    base["models"] = {"m": {"provider": "openai_compat", "base_url": "http://127.0.0.1:9/v1", "ctx": "4k",
                            "cost": 1.0, "temperature": 0}}

    def fp(agent: dict | None = None, model: dict | None = None) -> str:
        doc = json.loads(json.dumps(base))
        doc["agents"]["m.review"].update(agent or {})
        doc["models"]["m"].update(model or {})
        return agent_fingerprint(load_rib_text(json.dumps(doc)), "m.review")

    same = fp()
    for steer in ({"window": {"max_parallel": 1, "max_tokens": 10, "max_usd_micros": 10}}, {"win30d": 0.9},
                  {"p95_ms": 9000}, {"qos": "gold"}, {"timeout_ms": 1000}, {"strengths": ["x"]}):
        assert fp(agent=steer) == same, steer
    assert fp(model={"cost": 9.0}) == same and fp(model={"speed": "slow"}) == same
    for shape in ({"options": {"prompt": "other"}}, {"scope": "file"}, {"data_scope": ["secrets"]}):
        assert fp(agent=shape) != same, shape
    for shape in ({"temperature": 0.7}, {"model": "other-model"}, {"base_url": "http://127.0.0.1:10/v1"},
                  {"max_out_tokens": 64}):
        assert fp(model=shape) != same, shape
    plan = compile_cache(load_rib_text(json.dumps(rib(cache={"ttl_s": 60, "shared": True}))))
    assert plan.spec("review").ttl_s == 60 and plan.spec("review").shared and plan.spec("other") is None
    assert set(plan.fingerprints) == {"lint.ruff", "sec.bandit"}
    assert compile_cache(load_rib_text(json.dumps(rib()))).policies == {}


@pytest.mark.parametrize("cache, fault", [
    ({"ttl_s": 0}, "policies[0].cache.ttl_s: Expected float > 0.0"),
    ({"ttl_s": 31 * 86_400}, "policies[0].cache.ttl_s: Expected float <= 2592000.0"),
    ({"share": True}, "policies[0].cache.share: unknown field 'share' (known: ttl_s, shared)"),
    ({"shared": "yes"}, "policies[0].cache.shared: Expected bool, got str"),
])
def test_a_bad_cache_key_is_refused_naming_it(cache, fault):
    with pytest.raises(PolicyError) as e:
        load_rib_text(json.dumps(rib(cache=cache)), file="rib.yaml")
    assert [x.where() for x in e.value.errors] == [f"rib.yaml:1: {fault}"]  # JSON is one line of YAML


def test_policy_check_shows_the_cache():
    fib = compile_fib(load_rib_text(json.dumps(rib(cache={"ttl_s": 600, "shared": True}))), version=1)
    assert "  cache: {ttl_s: 600, shared: true}\n" in render_fib(fib)
    assert "cache" not in render_fib(compile_fib(load_rib_text(json.dumps(rib())), version=1))


def test_entries_round_trip_and_anything_else_is_a_miss():
    report = AgentReport(findings=[AgentFinding(file="a.py", start=1, end=2, severity=Severity.HIGH, claim="x")],
                         summary="one", confidence=0.7)
    entry = CacheEntry(report=report, created_ms=1_000, text="hello", usage=Usage(10, 5, 42))
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_entry(b"") is None and decode_entry(b"\x81\xa1x\x01") is None
    bad = msgspec.msgpack.encode({"report": {"findings": [{"file": "a.py", "start": 0, "end": 1,
                                                           "severity": "high", "claim": "x"}]}, "created_ms": 1})
    assert decode_entry(bad) is None  # line 0: not a valid finding
    too_long = msgspec.msgpack.encode({"report": {}, "created_ms": 1, "text": "x" * (ANSWER_CHARS + 2)})
    assert decode_entry(too_long) is None
    assert fresh(entry, now_ms=60_999, ttl_s=60) and not fresh(entry, now_ms=61_000, ttl_s=60)
    assert cacheable(report=report, error=None, cancelled=False)
    assert not cacheable(report=None, error=None, cancelled=False)
    assert not cacheable(report=report, error=AgentError(ErrorCode.EBUDGET, "call cut"), cancelled=False)
    assert not cacheable(report=report, error=None, cancelled=True)


# ============================================================ the store's cache table

def test_store_keeps_values_until_expiry_within_the_byte_bound_least_recently_used_first(tmp_path):
    store = SqliteStore.open(tmp_path / "state")
    k = [bytes([i]) * 32 for i in range(5)]
    put = store.cache_put(k[0], b"a" * 100, tenant="alice", now_ms=1_000, expires_ms=5_000, max_bytes=300)
    assert put.stored and (put.expired, put.evicted) == (0, 0) and put.stats.entries == 1 and put.stats.bytes == 100
    store.cache_put(k[1], b"b" * 100, tenant=None, now_ms=1_001, expires_ms=9_000, max_bytes=300)
    store.cache_put(k[2], b"c" * 100, tenant="bob", now_ms=1_002, expires_ms=9_000, max_bytes=300)
    assert store.cache_get(k[0], now_ms=2_000) == b"a" * 100  # k[0] used last now: k[1] is the LRU
    assert store.cache_get(k[3], now_ms=2_000) is None
    put = store.cache_put(k[3], b"d" * 100, tenant="alice", now_ms=2_001, expires_ms=9_000, max_bytes=300)
    assert put.stored and put.evicted == 1 and put.stats.bytes == 300
    assert store.cache_get(k[1], now_ms=2_002) is None and store.cache_get(k[0], now_ms=2_002) == b"a" * 100
    # expiry: not served at its expiry, and dropped by the next write
    assert store.cache_get(k[0], now_ms=5_000) is None
    put = store.cache_put(k[4], b"e" * 50, tenant="alice", now_ms=5_001, expires_ms=9_000, max_bytes=300)
    assert put.expired == 1 and put.stats.entries == 3 and put.stats.bytes == 250
    # replacing a key moves the totals by the difference; a value over the bound is not stored
    put = store.cache_put(k[4], b"E" * 80, tenant="alice", now_ms=5_002, expires_ms=9_000, max_bytes=300)
    assert put.stats.bytes == 280 and store.cache_get(k[4], now_ms=5_003) == b"E" * 80
    put = store.cache_put(k[2], b"x" * 301, tenant="bob", now_ms=5_004, expires_ms=9_000, max_bytes=300)
    assert not put.stored and put.stats.entries == 2 and put.stats.bytes == 180
    store.cache_drop(k[3])
    assert store.cache_stats().entries == 1
    store.close()
    # a restart keeps the entries and their totals
    again = SqliteStore.open(tmp_path / "state")
    assert again.cache_get(k[4], now_ms=6_000) == b"E" * 80
    assert (again.cache_stats().entries, again.cache_stats().bytes) == (1, 80)
    again.close()


# ============================================================ a real router

async def _review(env, token: str | None, content: dict = TASK, **meta) -> tuple[dict, list[atp.Event], str]:
    async with atp.Client(env.url, token) as c:
        _, st = await c.open_stream(task={**META, **meta}, content=content)
        with trio.fail_after(60):
            events = [ev async for ev in c.events(st)]
    finals = [ev.payload for ev in events if ev.type == "FINAL"]
    assert len(finals) == 1 and events[-1].type == "FIN", [(ev.type, ev.payload) for ev in events]
    msgspec.convert(finals[0], FinalResult)  # the FINAL is the §7.3 schema, cached marks included
    return finals[0], events, st.stream_id


async def _metrics(env) -> str:
    async with atp.Client(env.url, ADMIN) as c:
        return await c.metrics()


def _sample(metrics: str, name: str) -> float:
    """The value of Prometheus sample ``name`` (with its labels), 0 when absent."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _start(nursery, tmp_path, doc: dict, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rib.yaml"
    path.write_text(json.dumps(doc))
    return await start_router(nursery, path, tokens_env=TOKENS, state_dir=tmp_path / "state", **config)


async def test_the_same_diff_reviewed_twice_is_served_from_the_cache_the_second_time(nursery, tmp_path):
    env = await _start(nursery, tmp_path, rib(cache={"ttl_s": 3600}))
    first, _, _ = await _review(env, "tok-alice")
    assert first["result"]["findings"], "ruff and bandit find the unused import and shell=True"
    assert "cached" not in first["telemetry"] and not any(f.get("cached") for f in first["result"]["findings"])
    m1 = await _metrics(env)
    assert _sample(m1, 'atp_cache_lookups_total{agent="lint.ruff",result="miss"}') == 1
    assert _sample(m1, 'atp_cache_stores_total{result="stored"}') == 2
    assert _sample(m1, "atp_cache_entries") == 2 and _sample(m1, "atp_cache_bytes") > 0
    calls = _sample(m1, 'atp_agent_calls_total{agent="lint.ruff",outcome="ok"}')

    second, events2, sid = await _review(env, "tok-alice", ts=123, nonce="other")  # volatile meta differs
    assert second["result"]["findings"] == [{**f, "cached": True} for f in first["result"]["findings"]]
    assert second["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]
    assert second["telemetry"]["tokens"] == 0 and second["telemetry"]["usd"] == 0
    reports = [ev.payload for ev in events2 if ev.type == "PARTIAL" and "report" in ev.payload]
    assert {r["agent"] for r in reports} == {"lint.ruff", "sec.bandit"} and all(r["cached"] for r in reports)
    assert not any(ev.type == "ERROR" for ev in events2)
    m2 = await _metrics(env)
    for agent in ("lint.ruff", "sec.bandit"):
        assert _sample(m2, f'atp_cache_lookups_total{{agent="{agent}",result="hit"}}') == 1
    assert _sample(m2, 'atp_agent_calls_total{agent="lint.ruff",outcome="ok"}') == calls  # not called again
    state = env.router.ledger.state(f"stream:alice:{sid}")
    assert (state.committed_tokens, state.committed_usd_micros, state.reserved_tokens) == (0, 0, 0)

    # another diff is another key
    third, _, _ = await _review(env, "tok-alice", content=OTHER)
    assert "cached" not in third["telemetry"]


async def test_no_cache_key_no_cache(nursery, tmp_path):
    env = await _start(nursery, tmp_path, rib())
    for _ in range(2):
        final, _, _ = await _review(env, "tok-alice")
        assert "cached" not in final["telemetry"]
    m = await _metrics(env)
    assert "atp_cache_lookups_total{" not in m
    assert _sample(m, 'atp_agent_calls_total{agent="lint.ruff",outcome="ok"}') == 2
    assert env.router.store.cache_stats().entries == 0


async def test_tenants_do_not_share_entries_unless_the_policy_says_shared(nursery, tmp_path):
    env = await _start(nursery, tmp_path / "own", rib(cache={"ttl_s": 3600}))
    await _review(env, "tok-alice")
    bob, _, _ = await _review(env, "tok-bob")
    assert "cached" not in bob["telemetry"]  # alice's entry is alice's
    again, _, _ = await _review(env, "tok-bob")
    assert again["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]  # bob's own entry now

    shared = await _start(nursery, tmp_path / "shared", rib(cache={"ttl_s": 3600, "shared": True}))
    await _review(shared, "tok-alice")
    bob, _, _ = await _review(shared, "tok-bob")
    assert bob["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]


async def test_a_different_data_scope_label_is_a_different_key(nursery, tmp_path):
    """A task first sent without a label is cached; the same content with
    ``data_scope: [no_secrets]`` is what the agents receive redacted (spec §11):
    it must be a miss — the earlier, unredacted call's answer is never served
    for it — and then it is cached on its own."""
    secret = 'AWS_ACCESS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"\n' + SOURCE
    content = {"diff": _diff("runner.py", secret), "files": {"runner.py": secret}}
    env = await _start(nursery, tmp_path, rib(cache={"ttl_s": 3600}))
    await _review(env, "tok-alice", content=content)
    labelled, _, _ = await _review(env, "tok-alice", content=content, data_scope=["no_secrets"])
    assert "cached" not in labelled["telemetry"]
    m = await _metrics(env)
    assert _sample(m, 'atp_cache_lookups_total{agent="lint.ruff",result="miss"}') == 2
    labelled, _, _ = await _review(env, "tok-alice", content=content, data_scope=["no_secrets"])
    assert labelled["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]


async def test_entries_survive_a_restart_and_expire_with_their_ttl(tmp_path):
    now = [1_700_000_000.0]
    doc = rib(cache={"ttl_s": 60})

    async def review_once(check) -> None:
        async with trio.open_nursery() as nursery:
            env = await _start(nursery, tmp_path, doc)
            env.router.cache.clock = lambda: now[0]
            final, _, _ = await _review(env, "tok-alice")
            check(final, await _metrics(env))
            nursery.cancel_scope.cancel()

    await review_once(lambda f, m: "cached" not in f["telemetry"])
    now[0] += 30

    def hit(final, m):
        assert final["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]
        assert _sample(m, "atp_cache_entries") == 2  # the gauge starts from the store's totals

    await review_once(hit)  # a new router process state on the same state directory
    now[0] += 31  # 61 s after the answers were stored: expired

    def expired(final, m):
        assert "cached" not in final["telemetry"]
        assert _sample(m, 'atp_cache_evictions_total{reason="expired"}') >= 1

    await review_once(expired)


async def test_the_byte_bound_evicts_least_recently_used(nursery, tmp_path):
    env = await _start(nursery, tmp_path, rib(cache={"ttl_s": 3600}))
    await _review(env, "tok-alice")
    one = env.router.store.cache_stats().bytes
    env.router.cache.max_bytes = one + 200  # room for one review's two entries, not for two reviews'
    await _review(env, "tok-alice", content=OTHER)
    m = await _metrics(env)
    assert _sample(m, 'atp_cache_evictions_total{reason="size"}') == 2
    assert env.router.store.cache_stats().entries == 2 and env.router.store.cache_stats().bytes <= one + 200
    again, _, _ = await _review(env, "tok-alice", content=OTHER)  # the newest stayed
    assert again["telemetry"]["cached"] == ["lint.ruff", "sec.bandit"]
    first, _, _ = await _review(env, "tok-alice")  # the least recently used went
    assert "cached" not in first["telemetry"]


# ------------------------------------------------ a paid next-hop: the ledger is charged once

@pytest.fixture
def paid(scripted):
    used = Usage(in_tokens=1_200, out_tokens=300, usd_micros=4_500)
    # medium: the consensus cost scorer penalises it by what the agent cost
    finding = AgentFinding(file="runner.py", start=5, end=6, severity=Severity.MEDIUM, claim="run() passes its "
                           "argument to a shell unchecked", confidence=0.8, ref="1")
    scripted["m.review"] = ScriptedAdapter.returning("m.review", [finding], usage=used, partials=["Looks ", "risky"],
                                                     summary="shell injection")
    return scripted["m.review"], used


async def test_a_paid_review_costs_once(nursery, tmp_path, paid):
    adapter, used = paid
    agents = {"m.review": {"layer": "L2", "tool": "scripted", "p95_ms": 300, "strengths": ["code_review"]}}
    env = await _start(nursery, tmp_path, rib(cache={"ttl_s": 3600}, agents=agents,
                                              clients={"alice": {"budget": {"usd": 1.0}}}))
    first, _, _ = await _review(env, "tok-alice")
    assert first["telemetry"]["tokens"] == used.tokens and first["telemetry"]["usd"] == used.usd_micros / 1e6
    spent = env.router.ledger.state("client:alice")
    assert spent.committed_usd_micros == used.usd_micros

    second, events, _ = await _review(env, "tok-alice")
    assert len(adapter.calls) == 1  # the model was called once
    assert second["telemetry"]["tokens"] == 0 and second["telemetry"]["usd"] == 0
    # the same result: the consensus ranks the cached answer at what it cost when made
    assert second["result"]["findings"] == [{**f, "cached": True} for f in first["result"]["findings"]]
    answers = {a["agent"]: a for a in second["result"]["answers"]}
    assert answers["m.review"]["text"] == "shell injection" and answers["m.review"]["cached"]
    deltas = [ev.payload for ev in events if ev.type == "PARTIAL" and "delta" in ev.payload]
    assert [d["delta"] for d in deltas] == ["Looks risky"] and deltas[0]["cached"]
    assert env.router.ledger.state("client:alice").committed_usd_micros == used.usd_micros  # unchanged
    m = await _metrics(env)
    assert _sample(m, 'atp_cache_saved_usd_micros_total{agent="m.review"}') == used.usd_micros
    assert _sample(m, 'atp_usd_micros_total{agent="m.review"}') == used.usd_micros
