"""Issue 11 item 5 done-when, with a real priced model (``-m model``): reviewing the
same diff twice costs once. llama-cpp-python's OpenAI-compatible server with
SmolLM2-135M (tests/peers.py) is an ``openai_compat`` next-hop priced per token,
beside real ruff, under a policy with ``cache: {ttl_s: 3600}``.

The first review is charged what the model used (FINAL telemetry, the stream's
and the tenant's ledger accounts, ``atp_usd_micros``); the second is served
from the cache: the same findings and answers, marked cached, 0 tokens and 0
USD in its FINAL, nothing more committed on the tenant's account, the model
not called again (its server sees one completion request), and the hit and
what it saved in ``/v1/metrics``.
"""

from __future__ import annotations

import atp
import pytest
import trio

from tests.helpers import golden, model_rib, start_router_on

META = {"task_type": "code_review", "languages": ["py"]}


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _review(c: atp.Client) -> tuple[dict, list[atp.Event], str]:
    _, st = await c.open_stream(task=META, content=golden())
    with trio.fail_after(180):
        events = [ev async for ev in c.events(st)]
    finals = [ev.payload for ev in events if ev.type == "FINAL"]
    assert len(finals) == 1 and "ERROR" not in [ev.type for ev in events], [ev.payload for ev in events]
    return finals[0], events, st.stream_id


@pytest.mark.model
async def test_reviewing_the_same_diff_twice_costs_once(nursery, tmp_path, llama_base_url):
    rib = model_rib(llama_base_url, max_out_tokens=48, cache={"ttl_s": 3600})
    env = await start_router_on(nursery, tmp_path, rib)
    async with atp.Client(env.url) as c:
        first, _, sid1 = await _review(c)
        m1 = await c.metrics()
        second, events2, sid2 = await _review(c)
        m2 = await c.metrics()

    ledger = env.router.ledger
    usd1 = first["telemetry"]["usd"]
    assert first["telemetry"]["tokens"] > 0 and usd1 > 0 and "cached" not in first["telemetry"]
    s1 = ledger.state(f"stream:anonymous:{sid1}")
    assert s1.committed_usd_micros == round(usd1 * 1_000_000) > 0
    tenant_after_first = ledger.state("client:anonymous").committed_usd_micros

    assert second["telemetry"]["tokens"] == 0 and second["telemetry"]["usd"] == 0
    assert second["telemetry"]["cached"] == ["lint.ruff", "reviewer.local"]
    assert ledger.state(f"stream:anonymous:{sid2}").committed_usd_micros == 0
    assert ledger.state("client:anonymous").committed_usd_micros == tenant_after_first  # charged once
    assert second["result"]["findings"] == [{**f, "cached": True} for f in first["result"]["findings"]]
    answers1 = {a["agent"]: a["text"] for a in first["result"]["answers"]}
    answers2 = {a["agent"]: (a["text"], a.get("cached")) for a in second["result"]["answers"]}
    assert answers2 == {a: (t, True) for a, t in answers1.items()} and "reviewer.local" in answers2
    deltas = [ev.payload for ev in events2 if ev.type == "PARTIAL" and ev.payload.get("agent") == "reviewer.local"
              and "delta" in ev.payload]
    assert deltas and all(d["cached"] for d in deltas)

    model_usd = _sample(m1, 'atp_usd_micros_total{agent="reviewer.local"}')
    assert model_usd == s1.committed_usd_micros  # ruff costs nothing
    assert _sample(m2, 'atp_usd_micros_total{agent="reviewer.local"}') == model_usd  # no second charge
    assert _sample(m2, 'atp_agent_calls_total{agent="reviewer.local",outcome="ok"}') == 1  # called once
    assert _sample(m2, 'atp_cache_lookups_total{agent="reviewer.local",result="hit"}') == 1
    assert _sample(m2, 'atp_cache_lookups_total{agent="reviewer.local",result="miss"}') == 1
    assert _sample(m2, 'atp_cache_saved_usd_micros_total{agent="reviewer.local"}') == model_usd
