"""A model's ``slots`` (issue 23 item 3; atp_router.policy.rib ``ModelSpec.slots``,
``agent_window``): the requests its server runs at once. llama-cpp-python's
server runs one and, by default, cuts a running request short for a new one: 8
of 10 escalations to the local model failed ``EAGENTDOWN`` with concurrent
streams. With ``slots: 1`` every agent on that model runs at most one call at a
time and the others wait in the next-hop's queue.

The in-process test's model is an OpenAI-compatible server on loopback HTTP
(tests.replay_server ``BillingModel``, the streaming shape of a real one) that
counts the calls it holds at once; the ``model`` test runs concurrent streams on
the real llama-cpp-python server (tests/peers.py, started as
``atp_router.adapters.local_model`` starts it).
"""

from __future__ import annotations

import json

import atp
import pytest
import trio

from atp_router.policy.loader import load_rib_text
from atp_router.policy.rib import agent_window
from atp_router.wire.frame import Window
from tests.helpers import golden, model_rib, start_router_on
from tests.replay_server import BillingModel, serve

DEFAULT = Window(max_parallel=8, max_tokens=100_000, max_usd_micros=50_000)


def _rib(slots: int | None, window: dict | None) -> str:
    model = {"provider": "openai_compat", "ctx": "8k", "cost": 1, "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    if slots is not None:
        model["slots"] = slots
    agent = {"layer": "L2", "p95_ms": 100, "model": "m"}
    if window is not None:
        agent["window"] = window
    return json.dumps({"models": {"m": model}, "agents": {"a": agent, "t": {"layer": "L1", "tool": "ruff", "p95_ms": 9}},
                       "policies": [{"name": "p", "match": {"task_type": "x"}, "fanout": ["a"]}]})


@pytest.mark.parametrize("slots, window, want", [
    (None, None, None),  # the router's default, unchanged
    (None, {"max_parallel": 4, "max_tokens": 10, "max_usd_micros": 10}, Window(4, 10, 10)),
    (1, None, Window(1, 100_000, 50_000)),  # the default, capped
    (2, {"max_parallel": 4, "max_tokens": 10, "max_usd_micros": 10}, Window(2, 10, 10)),
    (8, {"max_parallel": 4, "max_tokens": 10, "max_usd_micros": 10}, Window(4, 10, 10)),  # already below
])
def test_an_agents_window_is_capped_to_its_models_slots(slots, window, want):
    rib = load_rib_text(_rib(slots, window), "rib.yaml")
    assert agent_window(rib, "a", DEFAULT) == want
    assert agent_window(rib, "t", DEFAULT) is None and agent_window(rib, "nobody", DEFAULT) is None


def test_slots_must_be_positive():
    with pytest.raises(Exception, match="slots"):
        load_rib_text(_rib(0, None), "rib.yaml")


async def _concurrently(url: str, n: int, task: dict, content: dict, timeout_s: float) -> list[list[atp.Event]]:
    """``n`` streams of ``task`` opened at once on the router at ``url``, each
    followed to its end (within ``timeout_s``): their events."""
    results: list[list[atp.Event]] = []

    async def one() -> None:
        async with atp.Client(url) as c:
            _, st = await c.open_stream(task=task, content=content)
            with trio.fail_after(timeout_s):
                results.append([ev async for ev in c.events(st)])

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return results


class CountingModel(BillingModel):
    """A BillingModel that answers after ``delay_s`` and records the most calls it held at once."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(50)
        self.delay_s = delay_s
        self.now = 0
        self.most = 0

    async def respond(self, stream: trio.SocketStream) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await trio.sleep(self.delay_s)
            await super().respond(stream)
        finally:
            self.now -= 1


async def test_concurrent_streams_queue_for_a_single_slot_model_and_all_finish(nursery, tmp_path):
    model = await serve(nursery, CountingModel(0.2))
    doc = json.loads(_rib(1, None))
    doc["models"]["m"]["base_url"] = model.url
    doc["agents"]["a"]["timeout_ms"] = 30_000
    env = await start_router_on(nursery, tmp_path, doc)
    results = await _concurrently(env.url, 4, {"task_type": "x"}, {"text": "summarise this"}, 60)
    assert len(results) == 4
    for events in results:
        assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"]
        assert not [ev for ev in events if ev.type == "ERROR" and ev.payload["code"] != "EWINDOW"]
    assert len(model.requests) == 4 and model.most == 1  # one at a time at the model
    assert env.router.gates.agent_windows.limits_of("a").max_parallel == 1


@pytest.mark.model
async def test_concurrent_streams_on_the_real_single_slot_server_all_get_the_models_review(
        nursery, tmp_path, llama_base_url):
    doc = json.loads(model_rib(llama_base_url, max_out_tokens=32))
    doc["models"]["smollm2"]["slots"] = 1
    doc["policies"][0]["fanout"] = ["reviewer.local"]
    env = await start_router_on(nursery, tmp_path, doc)
    results = await _concurrently(env.url, 3, {"task_type": "code_review", "languages": ["py"]}, golden(), 300)
    for events in results:
        failed = [ev.payload for ev in events if ev.type == "ERROR" and ev.payload["code"] != "EWINDOW"]
        assert not failed and [ev.type for ev in events][-2:] == ["FINAL", "FIN"], failed
        reports = [ev.payload for ev in events if ev.type == "PARTIAL" and "report" in ev.payload]
        assert [r["agent"] for r in reports] == ["reviewer.local"] and reports[0]["usage"]["out_tokens"] > 0
    assert len(results) == 3
