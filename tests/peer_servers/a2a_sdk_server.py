"""A real a2a-sdk server (official A2A 1.0, v0.3 compatibility on) that reviews Python files.

Runs inside the ``.peers/a2a-sdk`` virtualenv (``scripts/peers/a2a.sh``);
``tests/peers.py`` starts it as ``python a2a_sdk_server.py --port P`` and waits for
the agent card. Everything on the wire is a2a-sdk's own: ``DefaultRequestHandler``
with an in-memory task store behind ``create_jsonrpc_routes(...,
enable_v0_3_compat=True)`` at ``POST /`` (``message/send`` … for v0.3,
``SendMessage`` … with ``A2A-Version: 1.0``) and ``create_agent_card_routes`` at
``/.well-known/agent-card.json`` (1.0 card with ``supportedInterfaces``). The card
advertises ``http://agent.invalid/`` as its URL on purpose: clients must use the
address they were configured with.

The executor really reviews, deterministically: the ATP task arrives as a data part
``{"atp": {"task_type", "content": {"diff", "files"}}}``; each ``.py`` file is
compiled (``compile(..., "exec")``, what ``py_compile`` does) and a syntax error is
a ``high`` finding at its line; ``eval(``/``exec(`` on a line is a ``high`` one.
It streams a ``progress`` artifact (one text chunk per file, ``append`` after the
first, ``lastChunk`` on the last) and ends with a ``findings`` artifact of a text
part (the summary) and a data part ``{"findings": [...]}``, whose metadata carries
``usage`` (``input_tokens``/``output_tokens``, chars/4). The summary names the
SHA-256 of ``message.metadata.agent_context`` (canonical JSON) when one was sent.

Markers in a file drive the other result shapes and failures:

* ``# atp-test: slow`` — 0.5 s per step for 60 steps before finishing, so a test
  can cancel it (``cancel`` publishes state ``canceled``);
* ``# atp-test: fail`` — the task ends ``failed`` with an agent message;
* ``# atp-test: message`` — the answer is a single Message, no task.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
from typing import Any

import uvicorn
from a2a.helpers import (
    new_data_part,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
)
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette

_EVAL = re.compile(r"\b(eval|exec)\s*\(")
_MARK = re.compile(r"#\s*atp-test:\s*(\w+)")


def _task_of(context: RequestContext) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ATP content of the request's data part and its Agent Context, if any."""
    msg = MessageToDict(context.message) if context.message is not None else {}
    content: dict[str, Any] = {}
    for part in msg.get("parts", []):
        data = part.get("data")
        if isinstance(data, dict) and isinstance(data.get("atp"), dict):
            content = data["atp"].get("content") or {}
    ctx = (msg.get("metadata") or {}).get("agent_context")
    return content, ctx if isinstance(ctx, dict) else None


def review(files: dict[str, str]) -> list[dict[str, Any]]:
    """Findings for ``files``: syntax errors by ``compile`` and eval/exec calls."""
    findings: list[dict[str, Any]] = []
    for path in sorted(files):
        text = files[path]
        if not path.endswith(".py"):
            continue
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            findings.append({"file": path, "line": e.lineno or 1, "severity": "high",
                             "claim": f"SyntaxError: {e.msg}", "confidence": 1.0})
        for n, line in enumerate(text.splitlines(), 1):
            if _EVAL.search(line):
                findings.append({"file": path, "line": n, "severity": "high",
                                 "claim": "eval/exec of a runtime string can run arbitrary code", "confidence": 0.9})
    return findings


class Reviewer(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        content, agent_context = _task_of(context)
        files = {p: t for p, t in (content.get("files") or {}).items() if isinstance(t, str)}
        marks = {m for t in [*files.values(), content.get("diff") or ""] for m in _MARK.findall(t)}
        findings = review(files)
        summary = f"compile review of {len(files)} file(s): {len(findings)} finding(s)"
        if agent_context is not None:
            canonical = json.dumps(agent_context, sort_keys=True, separators=(",", ":"))
            summary += f"; agent_context sha256={hashlib.sha256(canonical.encode()).hexdigest()}"
        answer = json.dumps({"findings": findings, "summary": summary})
        if "message" in marks:
            await event_queue.enqueue_event(new_text_message(answer, context_id=context.context_id))
            return
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        steps = sorted(files) or ["(no files)"]
        if "slow" in marks:
            steps = [f"step {i}" for i in range(60)]
        for i, step in enumerate(steps):
            if "slow" in marks:
                await asyncio.sleep(0.5)
            await updater.add_artifact([new_text_part(f"checked {step}\n")], artifact_id="progress",
                                       name="progress", append=i > 0, last_chunk=i == len(steps) - 1)
        if "fail" in marks:
            await updater.failed(updater.new_agent_message([new_text_part("reviewer failed: # atp-test: fail")]))
            return
        chars = sum(len(t) for t in files.values())
        await updater.add_artifact(
            [new_text_part(summary), new_data_part({"findings": findings})],
            artifact_id="findings", name="findings", last_chunk=True,
            metadata={"usage": {"input_tokens": -(-chars // 4), "output_tokens": -(-len(answer) // 4)}},
        )
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel()


def card() -> AgentCard:
    return AgentCard(
        name="a2a-sdk-reviewer",
        description="Compiles the Python files of a diff and reports syntax errors and eval/exec",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url="http://agent.invalid/", protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url="http://agent.invalid/", protocol_binding="JSONRPC", protocol_version="0.3"),
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[AgentSkill(id="code_review", name="code review", description="py compile review",
                           tags=["code_review", "python"])],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    agent_card = card()
    handler = DefaultRequestHandler(agent_executor=Reviewer(), task_store=InMemoryTaskStore(), agent_card=agent_card)
    routes = create_agent_card_routes(agent_card) + create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True)
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
