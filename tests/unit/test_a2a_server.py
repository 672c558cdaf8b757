"""The router as an A2A server (atp_router.runtime.ingress.a2a), spoken to by real A2A clients.

The router runs on loopback with the control API and the A2A routes mounted side by
side (``build_app(router).routes + a2a_routes(router)``), real ruff and bandit as
its code-review next-hops. Clients:

* a2a-sdk 1.3's own client (``ClientFactory``), run as a subprocess in the
  ``.peers/a2a-sdk`` venv, once over A2A 1.0 and once over its v0.3 compatibility
  transport: card discovery, message/send, message/stream, tasks/get, tasks/cancel
  and the errors it maps to its exception types;
* httpx, asserting the exact v0.3 / JAF wire shapes (``kind``, ``final``) and the
  JSON-RPC errors;
* the router's own A2A adapter (atp_router.adapters.a2a), so routers chain over A2A.

A next-hop that must run long (to be cancelled) or fail on cue is a
:class:`~atp_router.adapters.testing.ScriptedAdapter` (RIB ``tool: scripted``): no real
analyser can be made to take a chosen time.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve
from peers import a2a_peer_python

from atp_router.adapters.a2a import A2AAdapter
from atp_router.adapters.base import Prompt
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Severity
from atp_router.deploy import single
from atp_router.deploy.cli import _parser, config_from_args
from atp_router.review.repo import files_after
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.dataplane.stream import StreamCtx
from atp_router.runtime.ingress.a2a import a2a_routes, agent_card
from atp_router.runtime.ingress.http_api import build_app
from atp_router.runtime.router import Router
from atp_router.task.diff import parse_diff
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import PayloadType
from tests.helpers import serve_scripted

CONTEXT_EXAMPLE = Path(__file__).resolve().parents[3] / "shared" / "specs" / "agent-context-message.example.json"
TOKEN = "a2a-test-token"

RIB = """
agents:
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}
  sec.bandit: {layer: L1, tool: bandit, p95_ms: 900, strengths: [code_review, security]}
  review.hang: {layer: L2, tool: scripted, p95_ms: 300, timeout_ms: 3600000}
  review.down: {layer: L2, tool: scripted, p95_ms: 300}
  review.echo: {layer: L2, tool: scripted, p95_ms: 300}
policies:
  - match: {task_type: code_review}
    fanout: [lint.ruff, sec.bandit]
  - match: {task_type: slow_review}
    fanout: [review.hang]
    deadline_ms: 3600000
  - match: {task_type: down_review}
    fanout: [review.down]
  - match: {task_type: echo_review}
    fanout: [review.echo]
"""

LINES = ["import os", "x = eval(input())", "os.system(x)"]
CONTENT = {
    "diff": "--- a/app.py\n+++ b/app.py\n@@ -1,2 +1,3 @@\n import os\n-x = 1\n+x = eval(input())\n+os.system(x)\n",
    "files": {"app.py": "\n".join(LINES) + "\n"},
}


@pytest.fixture
def scripted(monkeypatch) -> dict[str, ScriptedAdapter]:
    """Agents ``tool: scripted`` are served by the ScriptedAdapter in this dict."""
    adapters = {
        "review.hang": ScriptedAdapter.returning("review.hang", [], delay_s=3600),
        "review.down": ScriptedAdapter("review.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="model host gone"),
        "review.echo": ScriptedAdapter.returning("review.echo", [], summary="echo"),
    }
    return serve_scripted(monkeypatch, adapters)


async def start_a2a_router(nursery: trio.Nursery, tmp_path: Path, **config: Any) -> tuple[Router, str]:
    """A router serving the control API and the A2A routes on a free port; returns
    it and its base URL. This is how ``atp-router`` mounts them (api.build_app +
    a2a_routes)."""
    rib = tmp_path / "rib.yaml"
    rib.write_text(RIB)
    router = single.build(RouterConfig(policies=rib, http_port=0, ws_port=0, **config))
    await nursery.start(router.serve)
    app = build_app(router)
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 1.0
    binds = await nursery.start(functools.partial(hyper_serve, app, hc))
    return router, binds[0]


@pytest.fixture
def keep_reset_streams(monkeypatch) -> None:
    """Streams that end without a result (cancelled) stay in the router's table
    for the test, as closed streams with a result do (``retain_closed_s``):
    without this they leave after REFUSED_RETAIN_S (1 s), which a loaded machine
    can spend between the cancel and the test's :func:`stream_of`. The A2A side
    does not depend on it (its task answers for ``retain_closed_s``)."""
    monkeypatch.setattr("atp_router.runtime.dataplane.streams.REFUSED_RETAIN_S", 3600.0)


@pytest.fixture
async def env(nursery, tmp_path, scripted) -> tuple[Router, str]:
    return await start_a2a_router(nursery, tmp_path, tokens=frozenset({TOKEN, "other-token"}))


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stream_of(router: Router, task_id: str, token: str = TOKEN) -> StreamCtx:
    """The ATP stream behind A2A task ``task_id`` of ``token``'s tenant. A stream
    reset before any result (a cancelled task) leaves the router's table
    :data:`~atp_router.runtime.dataplane.streams.REFUSED_RETAIN_S` after its close, however long
    its A2A task still answers: a test that reads such a stream afterwards uses
    the ``keep_reset_streams`` fixture, or a loaded machine's delay between the
    cancel and the read removes it first."""
    ctx = router.streams.find(router.authenticate(f"Bearer {token}").tenant, task_id)
    assert ctx is not None, task_id
    return ctx


def user_message(atp_type: str | None = "code_review", *, kind: bool = True, message_id: str = "m-1",
                 **metadata: Any) -> dict[str, Any]:
    """A v0.3 user message carrying the ATP task (of type ``atp_type``) as a data
    part, as the ATP adapter sends it; ``atp_type=None`` sends the diff as plain text
    instead. ``metadata`` becomes the message's."""
    if atp_type is None:
        parts = [{"kind": "text", "text": CONTENT["diff"]}]
    else:
        parts = [{"kind": "text", "text": "review this"},
                 {"kind": "data", "data": {"atp": {"task_type": atp_type, "content": CONTENT}}}]
    msg: dict[str, Any] = {"role": "user", "messageId": message_id, "contextId": "ctx-1", "parts": parts}
    if kind:
        msg["kind"] = "message"
    if metadata:
        msg["metadata"] = metadata
    return msg


async def rpc(base: str, method: str, params: Any, *, token: str = TOKEN, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"jsonrpc": "2.0", "id": "r1", "method": method, "params": params}
        return await http.post(base + "/a2a", json=body, headers={**auth(token), **(headers or {})})


async def sse(base: str, method: str, params: Any, *, on_first=None) -> list[dict[str, Any]]:
    """The JSON-RPC results of a streaming call; ``on_first(result)`` runs after the
    first event (e.g. to cancel the task)."""
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"jsonrpc": "2.0", "id": "s1", "method": method, "params": params}
        async with http.stream("POST", base + "/a2a", json=body, headers=auth()) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    obj = json.loads(line[6:])
                    assert obj["id"] == "s1" and "error" not in obj
                    out.append(obj["result"])
                    if len(out) == 1 and on_first is not None:
                        await on_first(obj["result"])
    return out


# ----------------------------------------------------------------------------- card


async def test_agent_card_has_one_skill_per_routed_task_type(env):
    router, base = env
    async with httpx.AsyncClient() as http:
        cards = [(await http.get(base + path)).json() for path in ("/.well-known/agent-card.json",
                                                                    "/.well-known/agent-card")]
    card = cards[0]
    assert cards[1] == card
    assert [s["id"] for s in card["skills"]] == ["code_review", "slow_review", "down_review", "echo_review"]
    assert card["skills"][0]["tags"] == ["atp", "code_review", "lint.ruff", "sec.bandit"]
    assert card["supportedInterfaces"] == [
        {"url": base + "/a2a", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
        {"url": base + "/a2a", "protocolBinding": "JSONRPC", "protocolVersion": "0.3"},
    ]
    assert (card["url"], card["protocolVersion"], card["capabilities"]["streaming"]) == (base + "/a2a", "0.3.0", True)
    assert "securitySchemes" in card  # tokens are configured
    # The card follows the running FIB: a reload that routes a new task type adds its skill.
    router.reload(RIB + "  - match: {task_type: [summarize, triage]}\n    fanout: [review.echo]\n")
    ids = [s["id"] for s in agent_card(router, base)["skills"]]
    assert ids[-2:] == ["summarize", "triage"]


# --------------------------------------------------------- a2a-sdk's client, for real

CLIENT = r'''
"""a2a-sdk's own client against the router: prints one JSON object."""
import asyncio, json, sys, uuid
import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import CancelTaskRequest, GetTaskRequest, Message, Part, Role, SendMessageRequest
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict


def request(task_type, content, agent_context):
    data = ParseDict({"atp": {"task_type": task_type, "content": content}}, struct_pb2.Value())
    msg = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text="review this"), Part(data=data)])
    msg.metadata.update({"agent_context": agent_context})
    return SendMessageRequest(message=msg)


async def main(base, token, version, task):
    task = json.loads(task)
    out = {}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        card = await A2ACardResolver(http, base).get_agent_card()
        keep = [i for i in card.supported_interfaces if i.protocol_version == version]
        del card.supported_interfaces[:]
        card.supported_interfaces.extend(keep)
        out["card"] = MessageToDict(card)
        for streaming in (False, True):
            client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
            req = request("code_review", task["content"], task["agent_context"])
            out["stream" if streaming else "send"] = [MessageToDict(e) async for e in client.send_message(req)]
        out["get"] = MessageToDict(await client.get_task(GetTaskRequest(id=out["send"][0]["task"]["id"])))
        poller = ClientFactory(ClientConfig(streaming=False, polling=True, httpx_client=http)).create(card)
        req = request("slow_review", task["content"], task["agent_context"])
        out["slow"] = [MessageToDict(e) async for e in poller.send_message(req)]
        slow_id = out["slow"][0]["task"]["id"]
        out["cancel"] = MessageToDict(await poller.cancel_task(CancelTaskRequest(id=slow_id)))
        out["after_cancel"] = MessageToDict(await poller.get_task(GetTaskRequest(id=slow_id)))
        for name, call in (("cancel_again", poller.cancel_task(CancelTaskRequest(id=slow_id))),
                           ("get_unknown", poller.get_task(GetTaskRequest(id="task_0000")))):
            try:
                await call
            except Exception as e:
                out[name] = type(e).__name__
    print(json.dumps(out))


asyncio.run(main(*sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def a2a_sdk_python() -> Path:
    return a2a_peer_python("a2a-sdk")


def state(obj: dict[str, Any]) -> str:
    return obj["status"]["state"]


@pytest.mark.parametrize("version", ["1.0", "0.3"])
async def test_a2a_sdk_client(keep_reset_streams, env, scripted, tmp_path, a2a_sdk_python, version):
    """a2a-sdk's client resolves the card, sends (blocking and streaming), gets and
    cancels tasks over A2A 1.0 and over its v0.3 transport (which speaks
    message/send, message/stream, tasks/get, tasks/cancel on the wire)."""
    router, base = env
    ctx = json.loads(CONTEXT_EXAMPLE.read_text())
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    task = json.dumps({"content": CONTENT, "agent_context": ctx})
    with trio.fail_after(60):
        done = await trio.run_process([str(a2a_sdk_python), str(script), base, TOKEN, version, task],
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout)
    assert [i["protocolVersion"] for i in out["card"]["supportedInterfaces"]] == [version]
    assert [s["id"] for s in out["card"]["skills"]][:2] == ["code_review", "slow_review"]

    [sent] = out["send"]
    assert state(sent["task"]) == "TASK_STATE_COMPLETED"
    arts = {a["artifactId"]: a for a in sent["task"]["artifacts"]}
    assert set(arts) == {"agent:lint.ruff", "agent:sec.bandit", "result"}
    text, data = arts["result"]["parts"]
    assert text["text"].startswith("2 finding(s)\napp.py:3-3 high: ")
    assert {f["span"]: f["severity"] for f in data["data"]["result"]["findings"]} == {"2-2": "medium", "3-3": "high"}
    assert sent["task"]["history"][0]["metadata"]["agent_context"] == ctx

    kinds = [next(iter(e)) for e in out["stream"]]
    assert kinds[0] == "task" and state(out["stream"][0]["task"]) == "TASK_STATE_SUBMITTED"
    assert kinds[1] == "statusUpdate" and state(out["stream"][1]["statusUpdate"]) == "TASK_STATE_WORKING"
    assert sorted(e["artifactUpdate"]["artifact"]["artifactId"] for e in out["stream"] if "artifactUpdate" in e) == [
        "agent:lint.ruff", "agent:sec.bandit", "result"]
    assert kinds[-1] == "statusUpdate" and state(out["stream"][-1]["statusUpdate"]) == "TASK_STATE_COMPLETED"

    assert state(out["get"]) == "TASK_STATE_COMPLETED" and out["get"]["id"] == sent["task"]["id"]
    assert state(out["slow"][0]["task"]) in ("TASK_STATE_SUBMITTED", "TASK_STATE_WORKING")
    assert state(out["cancel"]) == state(out["after_cancel"]) == "TASK_STATE_CANCELED"
    assert (out["cancel_again"], out["get_unknown"]) == ("TaskNotCancelableError", "TaskNotFoundError")

    # Router side: the cancel was an RST of the ATP stream; the hanging call stopped.
    slow = stream_of(router, out["slow"][0]["task"]["id"])
    assert slow.log.closed and slow.cancel_scope is not None and slow.cancel_scope.cancel_called
    hang = scripted["review.hang"]
    assert len(hang.calls) == 1 and hang.calls[0].meta["agent_context"] == ctx
    assert hang.calls[0].content == CONTENT


# ------------------------------------------------------------ v0.3 / JAF wire shapes


async def test_v03_shapes_send_get_and_stream(env):
    """What a v0.3 or JAF client sees: objects keyed on ``kind``, lowercase states,
    status-updates with ``final`` (true only on the last)."""
    _, base = env
    result = (await rpc(base, "message/send", {"message": user_message()})).json()["result"]
    assert (result["kind"], result["status"]["state"], result["contextId"]) == ("task", "completed", "ctx-1")
    assert [a["artifactId"] for a in result["artifacts"]][-1] == "result"
    assert [p["kind"] for p in result["artifacts"][-1]["parts"]] == ["text", "data"]
    assert result["history"][0]["kind"] == "message" and result["history"][0]["role"] == "user"
    got = (await rpc(base, "tasks/get", {"id": result["id"], "historyLength": 0})).json()["result"]
    assert got["kind"] == "task" and got["status"]["state"] == "completed" and got["history"] == []
    assert got["artifacts"] == result["artifacts"]

    events = await sse(base, "message/stream", {"message": user_message(message_id="m-2")})
    assert events[0]["kind"] == "task" and events[0]["status"]["state"] == "submitted"
    updates = events[1:]
    assert {e["kind"] for e in updates} == {"status-update", "artifact-update"}
    assert [e["final"] for e in updates if e["kind"] == "status-update"] == [False, True]
    assert updates[0]["status"]["state"] == "working" and updates[-1]["status"]["state"] == "completed"
    assert all(e["taskId"] == events[0]["id"] for e in updates)
    final = [e for e in updates if e["kind"] == "artifact-update" and e["artifact"]["artifactId"] == "result"]
    assert final[0]["lastChunk"] is True and final[0]["append"] is False


async def test_message_send_is_idempotent_on_message_id(env):
    _, base = env
    a = (await rpc(base, "message/send", {"message": user_message(message_id="same")})).json()["result"]
    b = (await rpc(base, "message/send", {"message": user_message(message_id="same")})).json()["result"]
    assert a["id"] == b["id"]


async def test_text_only_message_and_default_task_type(env, scripted, caplog):
    """Without an ATP data part: the text is the task (a diff → ``{"diff"}``) and
    ``metadata.task_type`` picks the route."""
    router, base = env
    msg = user_message(None, task_type="echo_review")
    result = (await rpc(base, "message/send", {"message": msg})).json()["result"]
    assert result["status"]["state"] == "completed"
    assert scripted["review.echo"].calls[0].content == {"diff": CONTENT["diff"]}
    assert scripted["review.echo"].calls[0].task_type == "echo_review"
    # No task type at all: the card's first skill, code_review, whose real tools
    # need the files too, and this router has no --repo to read them from: the
    # task is rejected at once (EPROTO), no stream opened, nothing "found".
    result = (await rpc(base, "message/send", {"message": user_message(None, message_id="m-9")})).json()["result"]
    assert result["status"]["state"] == "rejected" and result["artifacts"] == []
    reason = result["status"]["message"]["parts"][0]["text"]
    assert reason.startswith("EPROTO: lint.ruff, sec.bandit need the files the diff touches") and "--repo" in reason
    assert result["status"]["message"]["metadata"]["atp_error"]["code"] == "EPROTO"
    assert router.streams.resumable("anonymous", "a2a:m-9") is None
    assert all(ctx.meta.get("idempotency_key") != "a2a:m-9" for ctx in router.streams.values())
    got = (await rpc(base, "tasks/get", {"id": result["id"]})).json()["result"]
    assert got["status"]["state"] == "rejected"
    assert (await rpc(base, "tasks/cancel", {"id": result["id"]})).json()["error"]["code"] == -32002
    # The refusal is in the audit trail and the error metric, like any other.
    assert any(r.name == "atp.audit" and r.getMessage().startswith("refusal by ") and '"ingress":"a2a"' in
               r.getMessage() and result["id"] in r.getMessage() for r in caplog.records)


async def test_cancel_ends_a_running_stream_with_canceled(keep_reset_streams, env, scripted):
    """tasks/cancel during message/stream: the stream's SSE ends with a
    status-update ``canceled``, ``final: true``; the ATP stream was reset."""
    router, base = env

    async def cancel(first: dict[str, Any]) -> None:
        with trio.fail_after(5):
            while not scripted["review.hang"].calls:
                await trio.sleep(0.01)
        answer = (await rpc(base, "tasks/cancel", {"id": first["id"]})).json()["result"]
        assert answer["status"]["state"] == "canceled"

    with trio.fail_after(10):
        events = await sse(base, "message/stream", {"message": user_message("slow_review")}, on_first=cancel)
    last = events[-1]
    assert (last["kind"], last["status"]["state"], last["final"]) == ("status-update", "canceled", True)
    assert stream_of(router, events[0]["id"]).log.closed


async def test_failed_stream_is_a_failed_task(env):
    """Every next-hop failed: the router resets the stream (RST EAGENTDOWN); A2A 1.0
    sees TASK_STATE_FAILED with the reason, after the leg's ERROR as a working update."""
    _, base = env
    msg = user_message("down_review")
    msg.pop("kind")
    msg["role"] = "ROLE_USER"
    msg["parts"] = [{"data": p["data"]} if p["kind"] == "data" else {"text": p["text"]} for p in msg["parts"]]
    answer = (await rpc(base, "SendMessage", {"message": msg}, headers={"A2A-Version": "1.0"})).json()["result"]
    task = answer["task"]
    assert task["status"]["state"] == "TASK_STATE_FAILED"
    assert task["status"]["message"]["role"] == "ROLE_AGENT"
    assert task["status"]["message"]["parts"][0]["text"].startswith("EAGENTDOWN: no next-hop produced a result")


async def test_non_blocking_send_poll_and_resubscribe(env, scripted):
    """``blocking: false`` answers at once; tasks/get polls; tasks/resubscribe
    follows the running task (first the Task snapshot) until it ends."""
    _, base = env
    params = {"message": user_message("slow_review"), "configuration": {"blocking": False}}
    with trio.fail_after(5):
        task = (await rpc(base, "message/send", params)).json()["result"]
    assert task["status"]["state"] in ("submitted", "working")
    got = (await rpc(base, "tasks/get", {"id": task["id"]})).json()["result"]
    assert got["status"]["state"] in ("submitted", "working")

    async def cancel(first: dict[str, Any]) -> None:
        assert first["kind"] == "task" and first["id"] == task["id"]
        assert (await rpc(base, "tasks/cancel", {"id": task["id"]})).json()["result"]["status"]["state"] == "canceled"

    with trio.fail_after(10):
        events = await sse(base, "tasks/resubscribe", {"id": task["id"]}, on_first=cancel)
    assert (events[-1]["status"]["state"], events[-1]["final"]) == ("canceled", True)


# ---------------------------------------------------------------------- errors


async def test_json_rpc_errors(env):
    _, base = env
    async with httpx.AsyncClient() as http:
        bad_json = (await http.post(base + "/a2a", content=b"{nope", headers=auth())).json()
        batch = (await http.post(base + "/a2a", json=[{"jsonrpc": "2.0", "id": 1, "method": "tasks/get"}],
                                 headers=auth())).json()
        no_token = await http.post(base + "/a2a", json={"jsonrpc": "2.0", "id": 1, "method": "tasks/get",
                                                        "params": {"id": "x"}})
    assert bad_json["error"]["code"] == -32700 and batch["error"]["code"] == -32600
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"
    assert no_token.json()["error"]["code"] == -32600

    async def code(method: str, params: Any, **kw: Any) -> int:
        return (await rpc(base, method, params, **kw)).json()["error"]["code"]

    assert await code("tasks/list", {}) == -32601
    assert await code("message/send", {}) == -32602
    assert await code("message/send", {"message": {**user_message(), "role": "agent"}}) == -32602
    assert await code("message/send", {"message": {**user_message(), "parts": []}}) == -32602
    assert await code("message/send", {"message": user_message()}, headers={"A2A-Version": "2.0"}) == -32009
    assert await code("tasks/get", {"id": "task_0000"}) == -32001
    routed_nowhere = (await rpc(base, "message/send", {"message": user_message("no_such_type")})).json()["error"]
    assert routed_nowhere["code"] == -32603 and routed_nowhere["data"]["code"] == "EAGENTDOWN"
    mine = (await rpc(base, "message/send", {"message": user_message("echo_review", message_id="m-x")})).json()
    # Not theirs: another tenant's task id answers exactly like one that never existed.
    theirs = (await rpc(base, "tasks/get", {"id": mine["result"]["id"]}, token="other-token")).json()["error"]
    never = (await rpc(base, "tasks/get", {"id": mine["result"]["id"][:-4] + "zzzz"})).json()["error"]
    assert theirs["code"] == never["code"] == -32001
    assert theirs["message"].replace(mine["result"]["id"], "?") == never["message"].replace(
        mine["result"]["id"][:-4] + "zzzz", "?")
    assert await code("tasks/cancel", {"id": mine["result"]["id"]}) == -32002  # finished


# --------------------------------------------------- routers chained over A2A


@pytest.mark.parametrize("dialect", ["0.3", "1.0", "jaf"])
async def test_the_a2a_adapter_against_the_router(env, monkeypatch, dialect):
    """Another router's A2A adapter using this router as an agent: the merged
    findings (``span``) come back as findings, the FINAL's summary as the summary."""
    _, base = env
    monkeypatch.setenv("UPSTREAM_ATP_TOKEN", TOKEN)
    for streaming in (False, True):
        adapter = A2AAdapter("upstream", url=base + "/a2a", dialect=dialect, stream=streaming,
                             auth_env="UPSTREAM_ATP_TOKEN", agent_id="atp-router")
        with trio.fail_after(20):
            frags = [f async for f in adapter.stream(Prompt(task_type="code_review", content=CONTENT))]
        report = frags[-1].content
        assert frags[-1].type is PayloadType.FINAL
        assert {(f.start, f.severity) for f in report.findings} == {(2, Severity.MEDIUM), (3, Severity.HIGH)}
        assert report.summary.startswith("2 finding(s)")
        if streaming:
            assert [f.content["state"] for f in frags if f.type is PayloadType.LOG] == [
                "submitted", "working", "completed"]
        await adapter.aclose()


def test_routes_are_mounted_in_the_control_api(tmp_path, scripted):
    rib = tmp_path / "rib.yaml"
    rib.write_text(RIB)
    router = single.build(RouterConfig(policies=rib))
    paths = [r.path for r in a2a_routes(router)]
    assert paths == ["/.well-known/agent-card.json", "/.well-known/agent-card", "/a2a"]
    served = [r.path for r in build_app(router).routes]
    assert set(paths) <= set(served) and len(served) == len(set(served))


# ------------------------------------- plain-text diffs: a real atp-router with --repo

PROC_RIB = """
agents:
  lint.ruff: {layer: L1, tool: ruff, p95_ms: 200, strengths: [code_review]}
  sec.bandit: {layer: L1, tool: bandit, p95_ms: 900, strengths: [code_review, security]}
policies:
  - match: {task_type: code_review}
    fanout: [lint.ruff, sec.bandit]
"""

MISSING_DIFF = "--- a/gone.py\n+++ b/gone.py\n@@ -1 +1,2 @@\n import os\n+os.system(input())\n"

TEXT_CLIENT = r'''
"""a2a-sdk's client sends plain-text messages (no data part): prints one JSON object."""
import asyncio, json, sys, uuid
import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import Message, Part, Role, SendMessageRequest
from google.protobuf.json_format import MessageToDict


async def main(base, token, version, texts):
    out = {}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        card = await A2ACardResolver(http, base).get_agent_card()
        keep = [i for i in card.supported_interfaces if i.protocol_version == version]
        del card.supported_interfaces[:]
        card.supported_interfaces.extend(keep)
        for name, text in json.loads(texts).items():
            for streaming in (False, True):
                client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
                msg = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)])
                key = name + ("_stream" if streaming else "")
                try:
                    out[key] = [MessageToDict(e) async for e in client.send_message(SendMessageRequest(message=msg))]
                except Exception as e:
                    out[key] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


asyncio.run(main(*sys.argv[1:]))
'''


async def start_router_process(tmp_path: Path, *extra: str) -> tuple[trio.Process, str]:
    """``atp-router`` as a process (``python -m atp_router.deploy.cli``) on free ports with
    PROC_RIB and ``extra`` flags; returns it and its HTTP base URL."""
    env = {**os.environ, "ATP_ROUTER_TOKENS": TOKEN, "PYTHONUNBUFFERED": "1"}
    for k in ("ATP_HMAC_KEY", "ATP_HMAC_KEYS"):
        env.pop(k, None)
    rib = tmp_path / "proc-rib.yaml"
    rib.write_text(PROC_RIB)
    argv = [sys.executable, "-m", "atp_router.deploy.cli", "--policies", str(rib), "--no-watch",
            "--state-dir", str(tmp_path / "state"), "--http-port", "0", "--ws-port", "0", "--log-level", "WARNING",
            *extra]
    proc = await trio.lowlevel.open_process(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(1)
            assert chunk, "atp-router exited before listening"
            line += chunk
    match = re.search(rb"listening (http://\S+) ws://", line)
    assert match, line
    return proc, match.group(1).decode()


async def stop_router_process(proc: trio.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await proc.wait() == 0


def rejected_reason(events: list[dict[str, Any]]) -> str:
    """The reason of a rejected task as a2a-sdk's client returned it (its Task
    first, for message/send and streaming alike)."""
    task = events[0]["task"]
    assert state(task) == "TASK_STATE_REJECTED", task
    assert task.get("artifacts", []) == []
    return task["status"]["message"]["parts"][0]["text"]


@pytest.mark.parametrize("version", ["1.0", "0.3"])
async def test_plain_text_diffs_from_a2a_sdk_against_a_router_process_with_repo(tmp_path, a2a_sdk_python, version):
    """A generic A2A client (a2a-sdk's) sends a bare unified diff as text to a real
    ``atp-router --repo CHECKOUT``: the router reads the touched file from the
    checkout and its tools review it (findings at file:line). Text that is not a
    diff, and a diff of a file the checkout lacks, are rejected tasks naming why —
    never a completed "no findings"."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "app.py").write_text(CONTENT["files"]["app.py"])
    script = tmp_path / "text_client.py"
    script.write_text(TEXT_CLIENT)
    texts = {"diff": CONTENT["diff"], "prose": "Please review my change, it adds a login form.",
             "missing": MISSING_DIFF}
    proc, base = await start_router_process(tmp_path, "--repo", str(checkout))
    try:
        with trio.fail_after(120):
            done = await trio.run_process([str(a2a_sdk_python), str(script), base, TOKEN, version, json.dumps(texts)],
                                          capture_stdout=True, capture_stderr=True, check=False)
    finally:
        await stop_router_process(proc)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout)

    [sent] = out["diff"]
    assert state(sent["task"]) == "TASK_STATE_COMPLETED", sent
    arts = {a["artifactId"]: a for a in sent["task"]["artifacts"]}
    text, data = arts["result"]["parts"]
    assert text["text"].startswith("2 finding(s)\napp.py:3-3 high: ")
    found = {(f["file"], f["span"]): f["severity"] for f in data["data"]["result"]["findings"]}
    assert found == {("app.py", "2-2"): "medium", ("app.py", "3-3"): "high"}
    assert state(out["diff_stream"][-1]["statusUpdate"]) == "TASK_STATE_COMPLETED"

    for name in ("prose", "missing"):
        assert isinstance(out[name], list) and isinstance(out[name + "_stream"], list), out
        reason = rejected_reason(out[name])
        assert reason == rejected_reason(out[name + "_stream"])
        if len(out[name + "_stream"]) > 1:
            assert state(out[name + "_stream"][-1]["statusUpdate"]) == "TASK_STATE_REJECTED"
        assert reason.startswith("EPROTO: ")
        if name == "prose":
            assert "the message text is not a unified diff" in reason
        else:
            assert "gone.py: not in the repository" in reason and "lint.ruff, sec.bandit need them" in reason
            assert str(checkout) not in reason  # the router's paths stay its own


async def test_a_next_hop_failing_beside_an_empty_review_fails_the_task(env, scripted):
    """ruff finds nothing in a clean file while the other next-hop is down: the FINAL
    names the failure (consensus.uncertainties) and the A2A task is failed, not a
    completed "no findings"; with findings it completes, its summary naming the gap."""
    router, base = env
    router.reload(RIB + "  - match: {task_type: mixed_review}\n    fanout: [lint.ruff, review.down]\n")
    clean = {"diff": "--- a/ok.py\n+++ b/ok.py\n@@ -0,0 +1 @@\n+x = 1\n", "files": {"ok.py": "x = 1\n"}}
    msg = user_message("mixed_review")
    msg["parts"][1]["data"]["atp"]["content"] = clean
    result = (await rpc(base, "message/send", {"message": msg})).json()["result"]
    assert result["status"]["state"] == "failed"
    reason = result["status"]["message"]["parts"][0]["text"]
    assert reason.startswith("EAGENTDOWN: no findings, and the review is incomplete: review.down: EAGENTDOWN")
    summary = result["artifacts"][-1]["parts"][0]["text"]
    assert summary.startswith("no findings — incomplete: 1 next-hop(s) failed\nfailed: review.down: EAGENTDOWN")

    result = (await rpc(base, "message/send", {"message": user_message("mixed_review", message_id="m-2")})).json()
    result = result["result"]
    assert result["status"]["state"] == "completed"
    summary = result["artifacts"][-1]["parts"][0]["text"]
    assert summary.startswith("2 finding(s) — incomplete: 1 next-hop(s) failed\n")
    assert "\nfailed: review.down: EAGENTDOWN: model host gone\n" in summary
    final = result["artifacts"][-1]["parts"][1]["data"]
    assert any(u.startswith("next-hop failed: review.down: EAGENTDOWN")
               for u in final["result"]["consensus"]["uncertainties"])


async def test_a_tool_given_none_of_the_changed_files_refuses_rather_than_find_nothing(env):
    """A data part whose diff changes app.py but whose files lack it: ruff and bandit
    would review nothing; they refuse, and the task fails naming the missing file."""
    _, base = env
    msg = user_message()
    msg["parts"][1]["data"]["atp"]["content"] = {"diff": CONTENT["diff"], "files": {"README.md": "x\n"}}
    result = (await rpc(base, "message/send", {"message": msg})).json()["result"]
    assert result["status"]["state"] == "failed"
    reason = result["status"]["message"]["parts"][0]["text"]
    assert reason.startswith("EPROTO: task refused: ") and "content.files lacks" in reason and "'app.py'" in reason


# -------------------------------------------------- reading files from --repo


def test_files_after_reads_the_after_side_confined_to_the_repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "app.py").write_text(CONTENT["files"]["app.py"])
    (repo / "pkg" / "inner.py").write_text("a = 1\n")
    (repo / "pkg" / "link.py").symlink_to(repo / "pkg" / "inner.py")  # inside: followed
    secret = tmp_path / "secret.py"
    secret.write_text("a = 1\n")
    (repo / "out.py").symlink_to(secret)  # leads outside: refused
    (repo / "big.py").write_text("a = 1\n" + "#" * 2000 + "\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "config.py").write_text("a = 1\n")

    def diff_of(path: str) -> str:
        return f"--- a/{path}\n+++ b/{path}\n@@ -0,0 +1 @@\n+a = 1\n"

    got = files_after(repo, parse_diff(CONTENT["diff"] + diff_of("pkg/link.py")))
    assert got.problems == [] and set(got.files) == {"app.py", "pkg/link.py"}
    assert got.files["app.py"] == CONTENT["files"]["app.py"]
    for path, problem in [("out.py", "a symlink leads outside the repository"),
                          ("../secret.py", "refused path"), ("/etc/passwd", "refused path"),
                          (".git/config.py", "inside .git"), ("nope.py", "not in the repository"),
                          ("pkg", "not a regular file")]:
        got = files_after(repo, parse_diff(diff_of(path)))
        assert got.files == {} and len(got.problems) == 1 and problem in got.problems[0], (path, got.problems)
    got = files_after(repo, parse_diff(diff_of("big.py")), max_file_bytes=1000)
    assert "over the per-file limit" in got.problems[0]
    # A checkout at another revision: the diff's after side is not what is there.
    stale = "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-import os\n+import sys\n"
    assert "line 1 in the repository is not the diff's after side" in files_after(repo, parse_diff(stale)).problems[0]


def test_cli_repo_option(tmp_path):
    assert "--repo PATH" in _parser().format_help()
    config = config_from_args(["--policies", str(tmp_path), "--repo", str(tmp_path)], environ={})
    assert config.repo == tmp_path.resolve()
    with pytest.raises(SystemExit):
        config_from_args(["--repo", str(tmp_path / "nope")], environ={})
