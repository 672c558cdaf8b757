"""A real language model through the router (``-m model``): llama-cpp-python's
OpenAI-compatible server with SmolLM2-135M (tests/peers.py) as an
``openai_compat`` next-hop of the RIB, fanned out beside real ruff.

It proves the plumbing end to end: the model's streamed text deltas reach the
client as PARTIAL events, and the FINAL's telemetry carries its tokens and its
price at the RIB's configured cost, the same amounts the budget ledger committed
and the metrics count. (The model's review quality is not the point.)
"""

from __future__ import annotations

import math
from fractions import Fraction

import atp
import msgspec
import pytest
import trio

from atp_router.consensus.types import FinalResult
from tests.helpers import (
    MODEL_COST_IN,
    MODEL_COST_OUT,
    golden,
    model_rib,
    start_router_on,
)

META = {"task_type": "code_review", "languages": ["py"]}


@pytest.mark.model
async def test_model_next_hop_streams_partials_and_is_priced(nursery, tmp_path, llama_base_url):
    window = {"max_parallel": 2, "max_tokens": 200_000, "max_usd_micros": 50_000}
    env = await start_router_on(nursery, tmp_path, model_rib(llama_base_url, window=window))
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task=META, content=golden())
        assert set(st.route["next_hops"]) == {"reviewer.local", "lint.ruff"}
        with trio.fail_after(180):
            events = [ev async for ev in c.events(st)]
        metrics = await c.metrics()

    types = [ev.type for ev in events]
    assert types[0] == "SYN_ACK" and types[-2:] == ["FINAL", "FIN"] and "ERROR" not in types, [
        ev.payload for ev in events if ev.type == "ERROR"
    ]
    deltas = [ev.payload["delta"] for ev in events
              if ev.type == "PARTIAL" and ev.payload["agent"] == "reviewer.local" and "delta" in ev.payload]
    assert len(deltas) >= 2 and "".join(deltas).strip()
    reports = {ev.payload["agent"]: ev.payload for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}
    assert set(reports) == {"reviewer.local", "lint.ruff"}
    # The deltas come before the model's report, as it streamed them.
    last_delta = max(ev.id for ev in events if ev.type == "PARTIAL" and "delta" in ev.payload)
    model_report = next(ev.id for ev in events if ev.type == "PARTIAL" and ev.payload.get("agent") == "reviewer.local"
                        and "report" in ev.payload)
    assert last_delta < model_report

    usage = reports["reviewer.local"]["usage"]
    in_tok, out_tok = usage["in_tokens"], usage["out_tokens"]
    assert in_tok > 0 and 0 < out_tok
    expected_micros = math.ceil(in_tok * Fraction(str(MODEL_COST_IN)) + out_tok * Fraction(str(MODEL_COST_OUT)))
    assert usage["usd_micros"] == expected_micros > 0

    final = msgspec.convert(events[-2].payload, FinalResult)
    assert final.telemetry.tokens == in_tok + out_tok > 0  # ruff costs nothing
    assert final.telemetry.usd == expected_micros / 1_000_000
    assert final.telemetry.latency_ms > 0

    state = env.router.ledger.state(f"stream:anonymous:{st.stream_id}")
    assert (state.committed_tokens, state.committed_usd_micros) == (in_tok + out_tok, expected_micros)
    assert state.overage_tokens == 0 and state.reserved_tokens == 0
    assert f'atp_tokens_total{{agent="reviewer.local"}} {float(in_tok + out_tok)}' in metrics
    assert f'atp_usd_micros_total{{agent="reviewer.local"}} {float(expected_micros)}' in metrics
    assert 'atp_agent_calls_total{agent="reviewer.local",outcome="ok"} 1.0' in metrics
