"""The OpenAI-compatible ingress (issue 10 item 1; ``atp_router/runtime/ingress/openai.py``),
driven with the official ``openai`` package against a real router in process.

The next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter` tools (RIB
``tool: scripted``): a "writer" that streams prose like a model, and a "linter"
that reports a finding. The sync ``OpenAI`` client runs in a worker thread
(``trio.to_thread.run_sync``); automatic retries are off so each status is seen
as the router sent it.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import atp
import httpx
import openai
import pytest
import trio
from openai import OpenAI

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import AgentFinding, Severity, Usage
from atp_router.wire.frame import CostEstimate
from tests.helpers import start_router_on
from tests.replay_server import BillingModel, serve
from tests.unit.test_router_dispatch import scripted_agent

KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key", "dave": "dave-key"}
DIFF = """--- a/app.py
+++ b/app.py
@@ -1,1 +1,2 @@
 import os
+value = eval(input())
"""
WRITER_USAGE = Usage(in_tokens=30, out_tokens=12, usd_micros=420)

RIB = {
    "agents": {"writer": scripted_agent(), "linter": scripted_agent()},
    "policies": [
        {"name": "review.large", "match": {"task_type": "code_review", "diff_loc": ">400"}, "fanout": ["linter"]},
        {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["linter", "writer"]},
        {"name": "chat", "match": {"task_type": "chat"}, "fanout": ["writer"]},
    ],
    "clients": {
        "alice": {},
        "bob": {"task_types": ["chat"]},
        "carol": {"rate": {"per_s": 0.001, "burst": 1}},
        "dave": {"qos_max": "silver"},
    },
}


@pytest.fixture
async def env(nursery, tmp_path, scripted):
    scripted["writer"] = ScriptedAdapter.returning("writer", partials=["Hello", ", ", "world."],
                                                   summary="Hello, world.", usage=WRITER_USAGE)
    scripted["linter"] = ScriptedAdapter.returning("linter", [AgentFinding(
        file="app.py", start=2, end=2, severity=Severity.HIGH, claim="eval of user input", rule="S307")],
        summary="linter: 1 finding")
    return await start_router_on(nursery, tmp_path, RIB, client_tokens=KEYS, max_body_bytes=64 * 1024)


def client(env, key: str = KEYS["alice"]) -> OpenAI:
    return OpenAI(base_url=env.url + "/v1", api_key=key, max_retries=0, timeout=30)


async def call(fn, *args: Any, **kw: Any) -> Any:
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kw))


async def refused(fn, *args: Any, **kw: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        await call(fn, *args, **kw)
    return info.value


async def final_of(env, stream_id: str, key: str = KEYS["alice"]) -> dict[str, Any]:
    """The stream's FINAL as the ATP events endpoint gives it."""
    async with atp.Client(env.url, key) as c:
        return await c.result(stream_id)


USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


async def test_non_streaming_completion_through_a_policy(env, scripted):
    oa = client(env)
    resp = await call(oa.chat.completions.create, model="policy:chat", messages=USER)
    assert resp.object == "chat.completion" and resp.model == "policy:chat"
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "Hello, world."
    assert choice.finish_reason == "stop"
    ext = resp.model_extra["atp"]
    assert ext["policy"] == "chat" and resp.id == "chatcmpl-" + ext["stream_id"]
    # The messages are the task content; the policy's next-hop got them.
    assert scripted["writer"].calls[0].content == {"messages": USER}
    assert scripted["writer"].calls[0].task_type == "chat"
    # usage and cost are the FINAL's telemetry.
    final = await final_of(env, ext["stream_id"])
    t = final["telemetry"]
    assert resp.usage.total_tokens == t["tokens"] == WRITER_USAGE.tokens
    assert resp.usage.completion_tokens == WRITER_USAGE.out_tokens
    assert resp.usage.prompt_tokens == t["tokens"] - WRITER_USAGE.out_tokens
    assert ext["usd"] == t["usd"] == pytest.approx(420 / 1e6)
    assert ext["latency_ms"] == t["latency_ms"] and ext["usage"] == t["usage"]
    assert ext["answers"] == final["result"]["answers"] and ext["consensus"] == final["result"]["consensus"]


async def test_streaming_completion_sends_deltas_then_the_final(env):
    oa = client(env)

    def run() -> list[Any]:
        return list(oa.chat.completions.create(model="chat", messages=USER, stream=True,
                                               stream_options={"include_usage": True}))

    chunks = await trio.to_thread.run_sync(run)
    assert all(c.object == "chat.completion.chunk" and c.model == "chat" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas[:3] == ["Hello", ", ", "world."]  # live, as the next-hop streamed them
    assert "".join(deltas) == "Hello, world."  # = the non-streaming content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    ext = finish[0].model_extra["atp"]
    assert ext["policy"] == "chat"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    t = (await final_of(env, ext["stream_id"]))["telemetry"]
    assert usage.usage.total_tokens == t["tokens"] and ext["usd"] == t["usd"]


async def test_streaming_sse_ends_with_done(env):
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    body = {"model": "chat", "messages": USER, "stream": True}
    async with httpx.AsyncClient(base_url=env.url, headers=auth) as h, \
            h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


async def test_code_review_diff_goes_through_fanout_and_consensus(env, scripted):
    oa = client(env)
    resp = await call(oa.chat.completions.create, model="code_review",
                      messages=[{"role": "user", "content": DIFF}])
    ext = resp.model_extra["atp"]
    assert ext["policy"] == "review"
    assert scripted["linter"].calls[0].content == {"diff": DIFF}
    assert [f["file"] for f in ext["findings"]] == ["app.py"]
    content = resp.choices[0].message.content
    # Two answers (writer's prose, linter's summary) and the finding: blocks.
    assert "writer: Hello, world." in content and "linter: linter: 1 finding" in content
    assert "1 finding(s):\n- app.py:2-2 high: eval of user input [linter#" in content


async def test_models_lists_what_the_tenant_may_use(env):
    alice = await call(client(env).models.list)
    ids = [m.id for m in alice.data]
    assert ids == ["code_review", "chat", "policy:review.large", "policy:review", "policy:chat"]
    by_id = {m.id: m for m in alice.data}
    assert by_id["code_review"].model_extra["atp"] == {"kind": "task_type", "policies": ["review.large", "review"],
                                                       "task_types": ["code_review"]}
    assert by_id["policy:chat"].owned_by == "atp-router"
    bob = await call(client(env, KEYS["bob"]).models.list)
    assert [m.id for m in bob.data] == ["chat", "policy:chat"]


async def test_a_model_is_retrieved_by_id_as_the_list_shows_it(env):
    """``client.models.retrieve`` (``GET /v1/models/{id}``, issue 24): the card the
    list shows, for the tenant's own models only; any other id is a 404 in OpenAI's shape."""
    card = await call(client(env).models.retrieve, "policy:review")
    listed = {m.id: m for m in (await call(client(env).models.list)).data}["policy:review"]
    assert card == listed and card.model_extra["atp"]["kind"] == "policy"
    e = await refused(client(env, KEYS["bob"]).models.retrieve, "code_review")  # outside bob's scope
    assert isinstance(e, openai.NotFoundError) and e.body["param"] == "model"
    e = await refused(client(env).models.retrieve, "gpt-4o")
    assert isinstance(e, openai.NotFoundError) and "unknown model 'gpt-4o'" in e.body["message"]


async def test_wrong_key_is_401_in_openai_shape(env):
    e = await refused(client(env, "not-a-key").chat.completions.create, model="chat", messages=USER)
    assert isinstance(e, openai.AuthenticationError) and e.status_code == 401
    assert e.body["code"] == "ESEC" and e.body["type"] == "authentication_error" and "message" in e.body
    assert "not-a-key" not in e.response.text
    e = await refused(client(env, "not-a-key").models.list)
    assert e.status_code == 401


async def test_task_type_outside_the_tenant_scope_is_403(env, scripted):
    e = await refused(client(env, KEYS["bob"]).chat.completions.create, model="code_review",
                      messages=[{"role": "user", "content": DIFF}])
    assert isinstance(e, openai.PermissionDeniedError) and e.status_code == 403
    assert e.body["code"] == "ESEC" and "outside the scope" in e.body["message"]
    assert not scripted["linter"].calls


async def test_over_budget_is_ebudget(env, scripted):
    scripted["writer"]._estimate = CostEstimate(in_tokens=5_000)
    e = await refused(client(env).chat.completions.create, model="chat", messages=USER,
                      extra_body={"atp": {"budget": {"tokens": 100}}})
    assert e.status_code == 402 and e.body["code"] == "EBUDGET" and e.body["type"] == "insufficient_quota"
    assert e.response.headers["x-should-retry"] == "false"
    assert not scripted["writer"].calls
    # The extension budget is validated strictly.
    e = await refused(client(env).chat.completions.create, model="chat", messages=USER,
                      extra_body={"atp": {"budget": {"usd": -1}}})
    assert e.status_code == 400 and e.body["param"] == "atp.budget.usd"


async def test_a_budget_cut_stream_finishes_with_length(env, scripted):
    scripted["linter"]._estimate = CostEstimate(in_tokens=5_000)  # cannot be admitted under the cap
    resp = await call(client(env).chat.completions.create, model="code_review",
                      messages=[{"role": "user", "content": DIFF}], extra_body={"atp": {"budget": {"tokens": 1_000}}})
    assert resp.choices[0].finish_reason == "length"
    # The answer that fit, and the next-hop the budget left out: never a silent "complete".
    head, incomplete = resp.choices[0].message.content.split("\n\n")
    assert head == "writer: Hello, world."
    assert incomplete.startswith("incomplete:\n- next-hop failed: linter: EBUDGET: linter not called")
    assert not scripted["linter"].calls and resp.usage.total_tokens == WRITER_USAGE.tokens


async def test_max_tokens_is_the_models_output_cap_not_the_budget(nursery, tmp_path):
    """Issue 24: ``max_tokens`` is what OpenAI clients mean — an output cap. The
    model next-hop (a real OpenAI-compatible adapter on a loopback server that
    records its requests) is asked for at most that many tokens, and the call
    reserves its prompt plus that cap: under a 300-token budget a request capped at
    50 output tokens runs, while the same request without a cap (the model's 1,024
    reserved) is refused 402 before any call — and a 50-token request is no longer
    a 402 for its own cap."""
    model = await serve(nursery, BillingModel(billed=60))
    rib = {"models": {"m": {"provider": "openai_compat", "base_url": model.url, "model": "m", "ctx": "8k",
                            "cost": 1, "max_out_tokens": 1024}},
           "agents": {"talker": {"layer": "L2", "p95_ms": 500, "model": "m"}},
           "policies": [{"name": "chat", "match": {"task_type": "chat"}, "fanout": ["talker"]}],
           "clients": {"alice": {}}}
    env = await start_router_on(nursery, tmp_path, rib, client_tokens={"alice": KEYS["alice"]})
    oa = client(env)
    small = {"atp": {"budget": {"tokens": 300}}}
    resp = await call(oa.chat.completions.create, model="chat", messages=USER, max_tokens=50, extra_body=small)
    assert resp.choices[0].finish_reason == "stop" and resp.usage.total_tokens == 60
    assert [body["max_tokens"] for _, body in model.requests] == [50]
    resp = await call(oa.chat.completions.create, model="chat", messages=USER, max_completion_tokens=20)
    assert model.requests[-1][1]["max_tokens"] == 20
    e = await refused(oa.chat.completions.create, model="chat", messages=USER, extra_body=small)
    assert e.status_code == 402 and e.body["code"] == "EBUDGET"
    assert len(model.requests) == 2  # refused before the call: 1,024 output tokens do not fit in 300


async def test_a_model_next_hop_gets_the_clients_conversation(nursery, tmp_path):
    """The client's system prompt and turns reach an OpenAI-compatible model next-hop as
    chat messages in order (its system and developer messages as the one system prompt
    first, as chat templates require), not rendered as JSON text."""
    model = await serve(nursery, BillingModel(billed=60))
    rib = {"models": {"m": {"provider": "openai_compat", "base_url": model.url, "model": "m", "ctx": "8k",
                            "cost": 1, "max_out_tokens": 64}},
           "agents": {"talker": {"layer": "L2", "p95_ms": 500, "model": "m"}},
           "policies": [{"name": "chat", "match": {"task_type": "chat"}, "fanout": ["talker"]}],
           "clients": {"alice": {}}}
    env = await start_router_on(nursery, tmp_path, rib, client_tokens={"alice": KEYS["alice"]})
    turns = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Salut"}, {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": "And you?"}]
    resp = await call(client(env).chat.completions.create, model="chat", messages=turns)
    assert resp.choices[0].message.content == "done"
    sent = model.requests[-1][1]["messages"]
    assert sent == [{"role": "system", "content": "Answer in French.\n\nBe brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "And you?"}]


async def test_router_level_404_and_405_are_json_error_objects(env):
    """Issue 24: a path the router does not serve and a method a route does not
    take answer the JSON error object OpenAI clients parse (the official client's
    NotFoundError with the message), which also carries the control API's code
    and reason; the 405 keeps its Allow header."""
    oa = client(env)
    e = await refused(oa.completions.create, model="chat", prompt="hi")  # the legacy endpoint: not served
    assert isinstance(e, openai.NotFoundError)
    assert e.body["type"] == "not_found_error" and "/v1/completions" in e.body["message"]
    assert e.body["code"] == "EPROTO" and e.body["reason"] == e.body["message"]
    async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {KEYS['alice']}"}) as h:
        r = await h.get("/v1/chat/completions")
        assert r.status_code == 405 and "POST" in r.headers["allow"]
        assert r.json()["error"]["type"] == "invalid_request_error" and "allowed: " in r.json()["error"]["message"]
        r = await h.delete("/nowhere")
        assert r.status_code == 404 and r.headers["content-type"] == "application/json"


async def test_a_qos_above_the_tenants_qos_max_is_served_lower_and_says_so(env):
    """Issue 24: a class the tenant may not have is lowered to its ``qos_max`` —
    visibly: the OpenAI answer's and the control API's ``x-atp-qos`` /
    ``x-atp-qos-asked`` headers, the SYN+ACK's ``qos_clamped`` and the FINAL's
    telemetry; a class within the tenant's right is not marked."""
    raw = client(env, KEYS["dave"]).chat.completions.with_raw_response
    r = await call(raw.create, model="chat", messages=USER, extra_body={"atp": {"qos": "gold"}})
    assert (r.headers["x-atp-qos"], r.headers["x-atp-qos-asked"]) == ("silver", "gold")
    sid = r.parse().model_extra["atp"]["stream_id"]
    telemetry = (await final_of(env, sid, KEYS["dave"]))["telemetry"]
    assert (telemetry["qos_asked"], telemetry["qos_served"]) == ("gold", "silver")
    async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {KEYS['dave']}"}) as h:
        opened = await h.post("/v1/streams", json={"task": {"task_type": "chat"}, "content": {"messages": USER},
                                                   "qos": "gold"})
        assert opened.status_code == 201 and opened.headers["x-atp-qos-asked"] == "gold"
        async with atp.Client(env.url, KEYS["dave"]) as c:
            events = [e async for e in c.events(opened.json()["stream_id"])]
        synack = next(e for e in events if e.type == "SYN_ACK")
        assert synack.frame["meta"]["qos_clamped"] == {"asked": "gold", "served": "silver",
                                                       "reason": "the tenant's qos_max"}
    within = await call(raw.create, model="chat", messages=USER, extra_body={"atp": {"qos": "bronze"}})
    assert within.headers["x-atp-qos"] == "bronze" and "x-atp-qos-asked" not in within.headers
    sid = within.parse().model_extra["atp"]["stream_id"]
    assert "qos_asked" not in (await final_of(env, sid, KEYS["dave"]))["telemetry"]


async def test_unknown_model_is_404(env):
    e = await refused(client(env).chat.completions.create, model="gpt-4o", messages=USER)
    assert isinstance(e, openai.NotFoundError)
    assert e.body["param"] == "model" and "unknown model 'gpt-4o'" in e.body["message"]
    assert "GET /v1/models" in e.body["message"]


async def test_a_shadowed_policy_is_refused_not_rerouted(env, scripted):
    e = await refused(client(env).chat.completions.create, model="policy:review.large",
                      messages=[{"role": "user", "content": DIFF}])
    assert e.status_code == 400 and e.body["param"] == "model" and e.body["code"] == "EPROTO"
    assert "review.large" in e.body["message"] and not scripted["linter"].calls


async def test_oversize_body_is_413(env):
    e = await refused(client(env).chat.completions.create, model="chat",
                      messages=[{"role": "user", "content": "x" * (65 * 1024)}])
    assert e.status_code == 413 and e.body["code"] == "EPROTO"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": []}, "tools"),
    ({"n": 2}, "n"),
    ({"atp": {"bogus": 1}}, "atp.bogus"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
])
async def test_strict_validation_names_the_field(env, extra, param):
    body = {"model": "chat", "messages": USER, **extra}
    async with httpx.AsyncClient(base_url=env.url, headers={"Authorization": f"Bearer {KEYS['alice']}"}) as h:
        r = await h.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "EPROTO" and err["type"] == "invalid_request_error" and err["param"] == param


async def test_open_rate_is_429_with_retry_after(env):
    oa = client(env, KEYS["carol"])
    await call(oa.chat.completions.create, model="chat", messages=USER)
    e = await refused(oa.chat.completions.create, model="chat", messages=USER)
    assert isinstance(e, openai.RateLimitError) and e.body["code"] == "EWINDOW"
    assert int(e.response.headers["retry-after"]) >= 1


async def test_idempotency_key_reuses_the_stream(env, scripted):
    oa = client(env)
    kw = {"model": "chat", "messages": USER, "extra_body": {"atp": {"idempotency_key": "req-1"}}}
    first = await call(oa.chat.completions.create, **kw)
    again = await call(oa.chat.completions.create, **kw)
    assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
    assert len(scripted["writer"].calls) == 1  # run and charged once


async def test_idempotency_key_reused_with_other_messages_is_a_409_conflict(env, scripted):
    """Issue 24: the same key with a different request is not answered with the
    first request's completion: openai.ConflictError (409) naming the key, and
    nothing more is run."""
    oa = client(env)
    kw = {"model": "chat", "messages": USER, "extra_body": {"atp": {"idempotency_key": "req-2"}}}
    await call(oa.chat.completions.create, **kw)
    other = [{"role": "user", "content": "Something else entirely."}]
    e = await refused(oa.chat.completions.create, **{**kw, "messages": other})
    assert isinstance(e, openai.ConflictError) and e.body["code"] == "EPROTO" and "'req-2'" in e.body["message"]
    assert e.body["type"] == "conflict_error"
    assert len(scripted["writer"].calls) == 1


async def test_a_streaming_client_that_goes_away_resets_its_stream(env, scripted):
    slow = ScriptedAdapter.returning("writer", partials=["a"] * 50, summary="a" * 50)
    scripted["writer"].fragments, scripted["writer"].delay_s = slow.fragments, 0.1  # the running adapter
    oa = client(env)

    def first_two() -> None:
        with oa.chat.completions.create(model="chat", messages=USER, stream=True) as s:
            for i, _ in enumerate(s):
                if i == 2:
                    return

    await trio.to_thread.run_sync(first_two)
    sid = None
    with trio.fail_after(10):
        while sid is None:
            sid = next((ctx.stream_id for ctx in env.router.streams.values() if ctx.log.closed), None)
            await trio.sleep(0.05)
    async with atp.Client(env.url, KEYS["alice"]) as c:
        events = [e async for e in c.events(sid)]
    assert events[-1].type == "RST" and events[-1].payload["code"] == "EPREEMPT"
    assert "went away" in events[-1].payload["reason"]
    assert len([e for e in events if e.type == "PARTIAL"]) < 50  # stopped, not run to its end
    assert len(scripted["writer"].calls) == 1


async def test_a_client_that_leaves_a_silent_stream_resets_it_at_once(env, scripted):
    """The model silent for seconds between two chunks: a client that leaves meanwhile
    has its stream reset within a second (the HTTP server's disconnect watch), not at
    the model's next chunk — the call stops spending."""
    slow = ScriptedAdapter.returning("writer", partials=["a", "b", "c"], summary="abc")
    scripted["writer"].fragments, scripted["writer"].delay_s = slow.fragments, 2.0
    oa = client(env)

    def first_content() -> float:
        with oa.chat.completions.create(model="chat", messages=USER, stream=True) as s:
            for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    return time.monotonic()  # gone: the stream is closed here
        raise AssertionError("no content")

    left = await trio.to_thread.run_sync(first_content)
    with trio.fail_after(10):
        while not (done := [ctx for ctx in env.router.streams.values() if ctx.log.closed]):
            await trio.sleep(0.02)
    reset_after = time.monotonic() - left
    events = done[0].log.events
    assert events[-1].type == "RST" and "went away" in events[-1].frame.payload.content["reason"]
    assert reset_after < 1.5, reset_after  # the next chunk was 2 s away
    assert [e.type for e in events].count("PARTIAL") == 1


async def test_code_review_with_real_analysers(router_env):
    """The mechanics RIB (real ruff and bandit): the diff and its files in, their
    merged finding out, at file:line."""
    files = {"app.py": "import os\nvalue = eval(input())\n"}
    oa = OpenAI(base_url=router_env.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    resp = await call(oa.chat.completions.create, model="code_review",
                      messages=[{"role": "user", "content": DIFF}], extra_body={"atp": {"files": files}})
    ext = resp.model_extra["atp"]
    [finding] = ext["findings"]
    assert (finding["file"], finding["span"]) == ("app.py", "2-2")
    assert sorted(p.split("#")[0] for p in finding["provenance"]) == ["lint.ruff", "sec.bandit"]
    assert resp.choices[0].message.content.endswith(
        f"1 finding(s):\n- app.py:2-2 {finding['severity']}: {finding['claim']} [{', '.join(finding['provenance'])}]")
    assert resp.usage.total_tokens == ext["tokens"] == 0  # local tools cost nothing
    # Without the files, the analysers that need them cannot run: refused up front.
    e = await refused(oa.chat.completions.create, model="code_review", messages=[{"role": "user", "content": DIFF}])
    assert e.status_code == 400 and e.body["code"] == "EPROTO" and "--repo" in e.body["message"]


def test_streamed_text_ending_in_whitespace_is_not_repeated():
    """A model's live deltas end in a space or newline while the answer text is
    trimmed: the client gets the rest, never the whole answer a second time
    (found by bench/bench_gateway.py)."""
    from atp_router.runtime.ingress.openai import remaining_text

    assert remaining_text("tok0 tok1", "tok0 tok1 ") == ""
    assert remaining_text("tok0 tok1\n\nF-1 x.py:3", "tok0 tok1 ") == "\n\nF-1 x.py:3"
    assert remaining_text("tok0 tok1\n\nF-1", "tok0 tok1\n") == "\nF-1"
    assert remaining_text("abc def", "abc") == " def"
    assert remaining_text("other answer", "tok0 ") == "\n\nother answer"
    assert remaining_text("all", "") == "all"


def test_a_budget_store_that_cannot_record_spend_is_503_with_retry_after_not_402() -> None:
    """EBUDGET with a retry hint means the budget store could not take the spend
    (unreachable, or its disk full): the OpenAI ingress answers as the control
    API does, 503 + ``Retry-After`` (OpenAI clients retry a 503), not 402, which
    a client reads as "the budget is spent" and never retries."""
    from atp_router.runtime.ingress.openai_schema import error_response
    from atp_router.wire.errors import ATPError, ErrorCode

    unavailable = error_response(ATPError(ErrorCode.EBUDGET, "state store full: state.db", retry_after_ms=1500))
    assert (unavailable.status_code, unavailable.headers.get("retry-after")) == (503, "2")
    spent = error_response(ATPError(ErrorCode.EBUDGET, "budget exhausted"))
    assert (spent.status_code, spent.headers.get("retry-after")) == (402, None)



def test_an_undecided_reserve_is_not_a_budget_cut():
    """Issue 20/22: an ERROR EBUDGET with retry_after_ms (a reserve the shared store
    did not answer, retried) before the FINAL does not make finish_reason "length";
    an EBUDGET without one (the budget cut a call) does."""
    from atp_router.runtime.ingress.openai import StreamOutcome
    from atp_router.wire.errors import ErrorCode
    from atp_router.wire.frame import ErrorPayload, Frame, Payload, PayloadType

    def error(retry_after_ms):
        return Frame(v=1, session_id="s", stream_id="t", msg_seq=1, flags=[],
                     payload=Payload(type=PayloadType.CONTROL, content=ErrorPayload(
                         code=ErrorCode.EBUDGET, reason="r", retry_after_ms=retry_after_ms)))

    class Ev:
        def __init__(self, frame):
            self.type, self.frame = "ERROR", frame

    undecided, cut = StreamOutcome(), StreamOutcome()
    undecided.see(Ev(error(1000)))
    cut.see(Ev(error(None)))
    assert (undecided.finish_reason, cut.finish_reason) == ("stop", "length")
    # The stream ended (ERROR with the hint, then FIN) because no next-hop could reserve:
    # 503 + Retry-After, not 402.
    fin = Ev(Frame(v=1, session_id="s", stream_id="t", msg_seq=2, flags=[]))
    fin.type = "FIN"
    undecided.see(Ev(error(2000)))
    undecided.see(fin)
    e = undecided.failure()
    assert (e.code, e.retry_after_ms) == (ErrorCode.EBUDGET, 2000)
    from atp_router.runtime.ingress.openai_schema import error_response
    r = error_response(e, after_run=False)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"


async def test_a_draining_router_answers_503_with_retry_after_and_calls_nothing(env, scripted):
    """While the router drains before a stop (atp_router.runtime.controlplane.drain),
    a completion is refused in OpenAI's shape — 503, ``Retry-After``, EAGENTDOWN — so
    the OpenAI SDK retries elsewhere; no next-hop is called."""
    env.router.drain.begin()
    err = await refused(client(env).chat.completions.create, model="policy:chat", messages=USER)
    assert err.status_code == 503 and err.response.headers["retry-after"] == "1"
    assert "draining" in err.message and err.code == "EAGENTDOWN"
    assert scripted["writer"].calls == []
