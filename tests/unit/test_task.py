"""atp_router.task: the task meta and bodies as strict Structs, and the change parsed once
per task (issue 21 item 1) — by the Structs' constraints, and on a real router whose
tool next-hops and consensus all read one parse of each task's diff."""

from __future__ import annotations

import collections
import json
import sys
from types import SimpleNamespace

import atp
import httpx
import msgspec
import pytest
import trio

import atp_router.runtime.dataplane.plane
import atp_router.task.body
import atp_router.task.diff
from atp_router.adapters.a2a import A2AAdapter
from atp_router.adapters.base import Prompt, change_of
from atp_router.adapters.context import forwarded_context
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.runtime.dataplane.plan import leg_prompt
from atp_router.security.identity import ANONYMOUS
from atp_router.task.body import (
    MAX_FILES,
    Chat,
    CodeReview,
    Opaque,
    RetrievalQA,
    Text,
    decode_body,
)
from atp_router.task.change import ParsedChange, parse_change
from atp_router.task.diff import count_changed_lines, diff_loc, parse_diff
from atp_router.task.meta import IDEMPOTENCY_KEY_CHARS, TaskMeta, TraceMeta, decode_meta
from atp_router.wire.errors import ClientInputError, ErrorCode
from atp_router.wire.frame import Budget, Frame, Payload, PayloadType, QoS
from tests.conftest import SHARED
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import scripted_agent

DIFF = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"


# ------------------------------------------------------------------ TaskMeta
def test_task_meta_reads_the_fields_the_router_acts_on_and_leaves_match_keys() -> None:
    meta = decode_meta({
        "task_type": "code_review", "languages": ["py"], "risk": "high", "qos": "gold",
        "budget": {"usd": 0.5, "tokens": 1000}, "idempotency_key": "k1", "resume_after": 3,
        "data_scope": ["pii"], "agent_context": {"version": "1"}, "trace": {"traceparent": "00-ab-cd-01"},
        "diff_loc": 2,
    })
    assert meta == TaskMeta(task_type="code_review", qos=QoS.GOLD, budget=Budget(usd=0.5, tokens=1000),
                            idempotency_key="k1", resume_after=3, data_scope=["pii"],
                            agent_context={"version": "1"}, trace=TraceMeta(traceparent="00-ab-cd-01"), diff_loc=2)
    assert decode_meta({}) == TaskMeta()
    assert decode_meta({"data_scope": "pii"}).data_scope == "pii"


@pytest.mark.parametrize(("meta", "message"), [
    ({"resume_after": "5"}, "Expected `int | null`, got `str` - at `$.resume_after`"),
    ({"resume_after": -1}, "Expected `int` >= 0 - at `$.resume_after`"),
    ({"idempotency_key": ""}, "Expected `str` of length >= 1 - at `$.idempotency_key`"),
    ({"idempotency_key": "k" * (IDEMPOTENCY_KEY_CHARS + 1)},
     f"Expected `str` of length <= {IDEMPOTENCY_KEY_CHARS} - at `$.idempotency_key`"),
    ({"budget": {"usd": -1}}, "Expected `float` >= 0.0 - at `$.budget.usd`"),
    ({"budget": {"dollars": 1}}, "Object contains unknown field `dollars` - at `$.budget`"),
    ({"qos": "platinum"}, "Invalid enum value 'platinum' - at `$.qos`"),
    ({"diff_loc": 1.5}, "Expected `int | null`, got `float` - at `$.diff_loc`"),
])
def test_task_meta_is_strict_and_names_the_field(meta: dict, message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as e:
        decode_meta(meta)
    assert str(e.value) == message
    assert decode_meta({"idempotency_key": "k" * IDEMPOTENCY_KEY_CHARS}).idempotency_key == "k" * IDEMPOTENCY_KEY_CHARS


# ------------------------------------------------------------------ bodies
def test_each_task_type_has_its_body_and_other_keys_pass_through() -> None:
    body = decode_body("code_review", {"diff": DIFF, "files": {"calc.py": "x\n"}, "extra": 1})
    assert body == CodeReview(diff=DIFF, files={"calc.py": "x\n"})
    assert decode_body("retrieval_qa", {"question": "why?"}) == RetrievalQA(question="why?")
    assert decode_body("summarize", {"messages": [{"role": "user", "content": "hi"}]}).messages[0].content == "hi"
    assert isinstance(decode_body("summarize", {"messages": [{"role": "user", "content": "hi"}]}), Chat)
    assert decode_body("chat", {"text": "hello"}) == Text(text="hello")
    # An operator's own task type: a review by its keys, else any object the router does not read.
    assert decode_body("public_review", {"diff": DIFF}) == CodeReview(diff=DIFF)
    assert decode_body("summarize", {"prompt": "x"}) == Opaque()
    # A review's file count and paths are each next-hop's limits (max_files, safe paths), not the body's.
    many = {f"f{i}.py": "" for i in range(MAX_FILES + 1)}
    assert decode_body("code_review", {"files": many}).files == many
    assert decode_body("code_review", {"files": {"": "x"}}).files == {"": "x"}


@pytest.mark.parametrize(("task_type", "content", "message"), [
    ("code_review", {"diff": 7}, "Expected `str | null`, got `int` - at `$.diff`"),
    ("code_review", {"files": {"a.py": 1}}, "Expected `str`, got `int` - at `$.files[...]`"),
    ("code_review", {"files": ["a.py"]}, "Expected `object | null`, got `array` - at `$.files`"),
    ("retrieval_qa", {"question": ""}, "Expected `str` of length >= 1 - at `$.question`"),
    ("summarize", {"messages": []}, "Expected `array` of length >= 1 - at `$.messages`"),
    ("summarize", {"messages": [{"role": "robot", "content": "x"}]},
     "Invalid enum value 'robot' - at `$.messages[0].role`"),
    ("public_review", {"diff": 7}, "Expected `str | null`, got `int` - at `$.diff`"),
])
def test_a_body_is_strict_and_names_the_field(task_type: str, content: dict, message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as e:
        decode_body(task_type, content)
    assert str(e.value) == message


# ------------------------------------------------------------------ ParsedChange
def test_a_parsed_change_is_the_diffs_files_changed_lines_and_diff_loc() -> None:
    c = parse_change(DIFF)
    assert [f.path for f in c.files] == ["calc.py"]
    assert dict(c.changed) == {"calc.py": frozenset({2})}
    assert c.diff_loc == 2
    with pytest.raises(TypeError):
        c.changed["calc.py"] = frozenset()  # type: ignore[index]
    assert parse_change("") == ParsedChange(files=(), changed={}, diff_loc=0)


def test_the_change_agrees_with_the_count_the_router_routes_on() -> None:
    """``ParsedChange.diff_loc`` is the ``meta.diff_loc`` counted at SYN, on the golden set's real diffs."""
    diffs = [d for line in (SHARED / "golden" / "dev.jsonl").read_text().splitlines() if (d := json.loads(line).get("diff"))]
    assert len(diffs) >= 20
    for d in diffs:
        c = parse_change(d)
        assert c.diff_loc == count_changed_lines(d) == diff_loc(parse_diff(d))


def test_a_prompt_carries_its_change_or_an_adapter_parses_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    change = parse_change(DIFF)
    assert change_of(Prompt("code_review", {"diff": DIFF}, change=change)) is change
    assert change_of(Prompt("code_review", {"diff": DIFF})) == change
    assert change_of(Prompt("chat", {"text": "x"})) is None


def test_a_prompts_body_is_its_content_typed_and_follows_a_replaced_content() -> None:
    """Adapters read ``Prompt.body``: the content decoded into its task type's
    Struct, once per prompt (or seeded with the SYN's decode). A prompt whose
    content is replaced — a data-scope redaction for one leg — decodes its own,
    so no leg reads the body of content it was not given."""
    files = {"calc.py": "def add(a, b):\n    return a + b\n"}
    prompt: Prompt[CodeReview] = Prompt("code_review", {"diff": DIFF, "files": files})
    assert prompt.body == CodeReview(diff=DIFF, files=files)
    assert prompt.body is prompt.body  # decoded once
    seeded = Prompt("code_review", {"diff": DIFF, "files": files}).with_body(body := CodeReview(diff=DIFF, files=files))
    assert seeded.body is body
    redacted = DIFF.replace("a + b", "[REDACTED]")
    leg = msgspec.structs.replace(seeded, content={"diff": redacted, "files": {}})
    assert leg.body == CodeReview(diff=redacted, files={}) and leg.body is not body
    assert Prompt("summarize", {"prompt": "x"}).body == Opaque()
    with pytest.raises(ClientInputError) as e:
        _ = Prompt("code_review", {"diff": 3}).body
    assert e.value.code is ErrorCode.EPROTO and e.value.reason == "task content: Expected `str | null`, got `int` - at `$.diff`"


def test_every_leg_gets_the_tasks_change_unless_its_diff_was_rewritten() -> None:
    """The data-scoped prompt of a leg carries the task's change when its diff is the
    task's; a redaction that rewrote the diff leaves that leg to parse its own."""
    change = parse_change(DIFF)
    task = Prompt("code_review", {"diff": DIFF, "files": {}}, change=change)
    redacted = DIFF.replace("a - b", "[REDACTED]")
    seen = {"same": Prompt("code_review", {"diff": DIFF, "files": {}}),
            "redacted": Prompt("code_review", {"diff": redacted, "files": {}}),
            "stale": Prompt("code_review", {"diff": redacted}, change=change)}
    plan = SimpleNamespace(prompt=task, prompt_for=seen.__getitem__)
    assert leg_prompt(plan, "same").change is change  # type: ignore[arg-type]
    assert leg_prompt(plan, "redacted").change is None  # type: ignore[arg-type]
    assert leg_prompt(plan, "stale").change is None  # type: ignore[arg-type]
    assert leg_prompt(SimpleNamespace(prompt=task, prompt_for=None), "any") is task  # type: ignore[arg-type]


# ------------------------------------------------------------------ once per task, on a real router
RUFF = {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"], "scope": "changed"}
BANDIT = {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"], "scope": "changed"}


def _task(i: int) -> dict:
    """A small clean change of its own (a distinct diff per task)."""
    return {
        "diff": f"--- a/calc{i}.py\n+++ b/calc{i}.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n"
                f"+    return a + b + {i}\n",
        "files": {f"calc{i}.py": f"def add(a, b):\n    return a + b + {i}\n"},
    }


async def test_each_tasks_diff_is_parsed_once_for_every_leg_and_the_consensus(nursery, tmp_path, monkeypatch) -> None:
    """Six code-review tasks at once, each with its own diff, through a real
    in-process router whose route fans out to two ``scope: changed`` tool next-hops
    (ruff and bandit: each filters its findings by the changed lines and plans the
    change's own suppressions) and merges them with the evidence scorer: every
    parse of a diff anywhere in the router (``parse_diff``, wherever it is bound) is
    counted, and each task's diff is parsed exactly once. (Before, each task asked
    for its diff's lines five times, and a process-wide cache of four diffs made
    them one parse only while at most four diffs were in flight.)"""
    parsed: collections.Counter[str] = collections.Counter()
    original = atp_router.task.diff.parse_diff

    def counting(text: str) -> list:
        parsed[text] += 1
        return original(text)

    bound = [m for name, m in list(sys.modules.items())
             if name.startswith("atp_router.") and getattr(m, "parse_diff", None) is original]
    assert atp_router.task.diff in bound and len(bound) >= 2
    for module in bound:
        monkeypatch.setattr(module, "parse_diff", counting)
    doc = {"agents": {"lint.ruff": RUFF, "sec.bandit": BANDIT},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["lint.ruff", "sec.bandit"]}]}
    env = await start_router_on(nursery, tmp_path, doc)
    finals: dict[int, dict] = {}

    async def review(i: int) -> None:
        async with atp.Client(env.url) as c:
            _, st = await c.open_stream(task={"task_type": "code_review", "languages": ["py"]}, content=_task(i))
            with trio.fail_after(120):
                events = [ev async for ev in c.events(st)]
        assert [ev.type for ev in events][-2:] == ["FINAL", "FIN"], [ev.type for ev in events]
        reported = {ev.payload["agent"] for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}
        assert reported == {"lint.ruff", "sec.bandit"}
        finals[i] = events[-2].payload

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(review, i)
    assert sorted(finals) == list(range(6))
    assert parsed == collections.Counter({_task(i)["diff"]: 1 for i in range(6)})


async def test_an_ingress_that_reads_the_diff_parses_it_once_for_the_whole_task(nursery, tmp_path,
                                                                                  monkeypatch) -> None:
    """The OpenAI ingress (a ``code_review`` whose last user message is a diff,
    its files in ``atp.files``) and the A2A server (a text-only diff whose files
    the router reads from ``--repo``) read the diff themselves — is it a diff,
    which files does it touch, its ``diff_loc`` — and open the stream with that
    parse: the two ``scope: changed`` tool next-hops and the consensus use it,
    so each task's diff is parsed exactly once in the router. (Before, the
    ingress parsed it and the dispatcher parsed it again: twice per task.)"""
    parsed: collections.Counter[str] = collections.Counter()
    original = atp_router.task.diff.parse_diff

    def counting(text: str) -> list:
        parsed[text] += 1
        return original(text)

    for module in [m for name, m in list(sys.modules.items())
                   if name.startswith("atp_router.") and getattr(m, "parse_diff", None) is original]:
        monkeypatch.setattr(module, "parse_diff", counting)
    repo = tmp_path / "repo"
    repo.mkdir()
    by_openai, by_a2a = _task(1), _task(2)
    (repo / "calc2.py").write_text(by_a2a["files"]["calc2.py"])
    doc = {"agents": {"lint.ruff": RUFF, "sec.bandit": BANDIT},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["lint.ruff", "sec.bandit"]}]}
    env = await start_router_on(nursery, tmp_path, doc, repo=repo)
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(env.url + "/v1/chat/completions", json={
            "model": "code_review", "messages": [{"role": "user", "content": by_openai["diff"]}],
            "atp": {"files": by_openai["files"]}})
        assert r.status_code == 200, r.text
        assert r.json()["atp"]["policy"] == "p"
        message = {"role": "user", "messageId": "m-1", "kind": "message",
                   "parts": [{"kind": "text", "text": by_a2a["diff"]}], "metadata": {"task_type": "code_review"}}
        r = await http.post(env.url + "/a2a", json={"jsonrpc": "2.0", "id": "r1", "method": "message/send",
                                                    "params": {"message": message}})
        assert r.json()["result"]["status"]["state"] == "completed", r.text
    ctx = next(c for c in env.router.streams.values() if c.idempotency_key == "a2a:m-1")
    reported = {ev.frame.payload.content["agent"] for ev in ctx.log.events
                if ev.type == "PARTIAL" and "report" in ev.frame.payload.content}
    assert reported == {"lint.ruff", "sec.bandit"}  # both legs ran on the files read from --repo
    assert parsed == collections.Counter({by_openai["diff"]: 1, by_a2a["diff"]: 1})


async def test_every_next_hop_gets_the_tasks_meta_decoded_once_at_syn(nursery, tmp_path, scripted) -> None:
    """A task opened with a budget, an idempotency key and an Agent Context: the
    SYN's ``task_meta`` stage decodes its meta once, and each next-hop's prompt
    carries that typed view (:attr:`Prompt.task`) — the budget a ``Budget``, the
    data scope with the context's labels joined, the ``diff_loc`` counted — while
    ``Prompt.meta`` still passes the meta through as sent. The A2A adapter reads
    the Agent Context it forwards from there."""
    context = json.loads((SHARED / "specs" / "agent-context-message.example.json").read_text())
    scripted["m.one"] = ScriptedAdapter.returning("m.one")
    doc = {"agents": {"m.one": {**scripted_agent(), "data_scope": ["acp.policy:P001", "acp.policy:P002"]}},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.one"]}]}
    env = await start_router_on(nursery, tmp_path, doc)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review", "languages": ["py"], "agent_context": context},
                                    content={"diff": DIFF}, budget={"usd": 0.5, "tokens": 9000},
                                    idempotency_key="typed-1")
        with trio.fail_after(60):
            assert [ev.type async for ev in c.events(st)][-2:] == ["FINAL", "FIN"]
    [prompt] = scripted["m.one"].calls
    assert prompt.task == TaskMeta(task_type="code_review", budget=Budget(usd=0.5, tokens=9000),
                                   idempotency_key="typed-1", data_scope=["acp.policy:P001", "acp.policy:P002"],
                                   agent_context=context, diff_loc=count_changed_lines(DIFF))
    assert prompt.meta["agent_context"] == context and prompt.meta["languages"] == ["py"]
    ctx = next(iter(env.router.streams.values()))
    assert ctx.task is prompt.task and ctx.idempotency_key == "typed-1"
    a2a = A2AAdapter("remote", url="http://127.0.0.1:9")
    params = a2a.message_params(prompt, forwarded_context(prompt.task)[0])
    assert params["message"]["metadata"]["agent_context"] == context


async def test_a_syns_task_body_is_checked_once(nursery, tmp_path, scripted, monkeypatch) -> None:
    """The shape of a task the SYN carries is checked by its ``task_shape`` stage
    and not again when the task starts; a task sent after the SYN (a fragmented
    body, a message of its own) is checked when it arrives. (Before, a SYN's
    body was checked twice.)"""
    checked: list[object] = []
    original = atp_router.task.body.check_task

    def counting(content: object) -> None:
        checked.append(content)
        original(content)

    monkeypatch.setattr(atp_router.task.body, "check_task", counting)
    scripted["m.one"] = ScriptedAdapter.returning("m.one")
    doc = {"agents": {"m.one": scripted_agent()},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.one"]}]}
    env = await start_router_on(nursery, tmp_path, doc)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content={"diff": DIFF})
        with trio.fail_after(60):
            assert [ev.type async for ev in c.events(st)][-2:] == ["FINAL", "FIN"]
    assert checked == [{"diff": DIFF}]
    bad = env.router.open_stream(task={"task_type": "code_review"}, content=None, budget=None, qos=None, window=None,
                                 idempotency_key=None, identity=ANONYMOUS)
    env.router.receive_frame(Frame(v=1, session_id=bad.session_id, stream_id=bad.stream_id, msg_seq=1, flags=[],
                                   payload=Payload(type=PayloadType.TASK, content={"diff": 3})),
                             identity=ANONYMOUS, now=trio.current_time())
    assert checked[1:] == [{"diff": 3}]
    rst = bad.log.events[-1].frame
    assert rst.payload.content["code"] == "EPROTO" and "content.diff must be a string" in rst.payload.content["reason"]
