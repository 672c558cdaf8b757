"""What the real-process scale tests share (tests/scale/): the tenants and their
tokens, the task they send, and the RIB of one ``summarize`` policy over one
billing model (:class:`tests.replay_server.BillingModel`)."""

from __future__ import annotations

import redis as redis_py

TOKENS = {"alice": "tok-alice-0123456789", "bob": "tok-bob-0123456789", "ops": "tok-ops-0123456789"}
TASK = {"task_type": "summarize"}
CONTENT = {"text": "summarise this"}
#: alice's token budget: a few calls' worth (tokens).
ALICE_TOKENS = 6_000
#: What the billing model reports a call used (tokens): far above the estimate.
BILLED = 1_000
#: Store URL options for routers whose test checks accounting, quotas or settling, not
#: the fast fail: their store calls wait up to 5 s (redis-py's URL options) instead of
#: the default 0.5 s. On a busy machine Redis' fsync at every write stalls past 0.5 s
#: at times (CI: a burst of 12 opens all refused "budget store unavailable", the first
#: timed out and the fast fail refused the rest at once) and that would break such a
#: test's premise. The fast fail, and a call that timed out but ran, are tested on their
#: own (tests/store/test_redis_store.py, tests/scale/test_cluster.py,
#: tests/scale/test_ready_cluster.py) with short timeouts.
PATIENT_STORE = "?socket_timeout=5&socket_connect_timeout=5"
#: The environment of a cluster router (tests/scale/test_cluster*.py): the tenants' and the
#: operator's bearer tokens, and the audit log's key.
CLUSTER_ENV = {"ATP_ROUTER_TOKENS": ",".join([f"alice:{TOKENS['alice']}", f"bob:{TOKENS['bob']}",
                                              f"ops:{TOKENS['ops']}:admin+operator"]),
               "ATP_AUDIT_KEY": "cluster-test-audit-key-0123456789"}


def auth(tenant: str) -> dict[str, str]:
    """The ``Authorization`` header of ``tenant`` (a key of :data:`TOKENS`)."""
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


def summarize_rib(model_url: str, extra: str = "") -> str:
    """A RIB: model ``m`` at ``model_url`` (OpenAI-compatible), agent
    ``summarizer`` on it, policy ``summarize``, ``extra`` YAML before the clients
    alice (:data:`ALICE_TOKENS`) and bob (10M tokens)."""
    return (
        "models:\n"
        f"  m: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{model_url}', model: m, max_out_tokens: 64}}\n"
        "agents:\n"
        "  summarizer: {layer: L2, p95_ms: 500, model: m, timeout_ms: 60000}\n"
        "policies:\n"
        "  - {name: summarize, match: {task_type: summarize}, fanout: [summarizer], deadline_ms: 60000}\n"
        f"{extra}"
        "clients:\n"
        f"  alice: {{budget: {{tokens: {ALICE_TOKENS}}}, max_streams: 500, rate: {{per_s: 500, burst: 500}}}}\n"
        "  bob: {budget: {tokens: 10000000}, max_streams: 500, rate: {per_s: 500, burst: 500}}\n"
    )


#: The reserved tokens on ``client:<tenant>`` and every open reservation (account, tokens,
#: owner), read in one script (atomic: a router's take or return of a slice between two
#: reads would look like a leak). KEYS: the store's prefix; ARGV: the tenant's account key.
_HELD_LUA = """
local out = {redis.call('HGET', KEYS[1] .. 'a:' .. ARGV[1], 'rt') or '0'}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1] .. 'rs', 0, -1)) do
  local h = redis.call('HMGET', KEYS[1] .. 'r:' .. id, 'a', 't', 'w')
  if h[1] then out[#out + 1] = {h[1], h[2], h[3] or ''} end
end
return out
"""


def held(redis_url: str, tenant: str, namespace: str = "atp") -> tuple[int, list[tuple[str, int, str]]]:
    """The tokens ``client:<tenant>`` holds reserved in the store at ``redis_url``
    and every open reservation there (account, tokens, owner), read at one instant."""
    raw = redis_py.Redis.from_url(redis_url, socket_timeout=10.0)
    try:
        reserved, *rows = raw.eval(_HELD_LUA, 1, namespace + ":", f"client:{tenant}")
    finally:
        raw.close()
    return int(reserved), [(a.decode(), int(t), w.decode()) for a, t, w in rows]


def leases_only(redis_url: str, tenant: str, live: set[str | None], namespace: str = "atp") -> int:
    """The tokens ``client:<tenant>`` holds reserved, checked to be exactly budget
    leases (issue 22 item 2: reservations on the tenant's own account) of the
    routers ``live`` — a call's reservation left over on a stream account, or a
    slice of a router that is gone, fails here."""
    reserved, rows = held(redis_url, tenant, namespace)
    mine = [r for r in rows if r[0] == f"client:{tenant}"]
    assert reserved == sum(t for _, t, _ in mine) and {w for _, _, w in mine} <= live, (reserved, rows, live)
    return reserved
