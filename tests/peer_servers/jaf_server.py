"""A real jaf-py A2A server (JAF A2A v0.3.0) that reviews diffs: the JAF peer.

Runs inside the ``.peers/jaf`` virtualenv (``scripts/peers/a2a.sh``);
``tests/peers.py`` starts it as ``python jaf_server.py --port P`` and waits for
``GET /a2a/health``. Everything on the wire is jaf-py's own (``create_a2a_server``:
``/.well-known/agent-card``, ``POST /a2a`` and ``/a2a/agents/reviewer``); this file
only supplies the agent and, in place of an LLM, a model provider that reviews
deterministically.

jaf-py hands the agent only the text parts of the A2A message, so the reviewer
reads what the ATP adapter renders there: the numbered diff (``### path (status)``
headers, ``  42 + code`` for added lines). It flags risky patterns on added lines
(``eval``/``exec``, ``shell=True``, ``os.system``, bare ``except:``, ``== None``) and
answers ``{"findings": [{"file", "line", "severity", "claim", "confidence"}],
"summary"}`` as text. Markers on an added line drive the other paths, all through
jaf-py's own handling:

* ``# atp-test: slow`` — the provider sleeps 30 s first (cancellation tests);
* ``# atp-test: fail`` — the provider raises; jaf answers a failed task
  (``message/send``: JSON-RPC ``-32603``; ``message/stream``: status ``failed``);
* ``# atp-test: plain`` — the answer is plain prose, no JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from typing import Any

# litellm (imported by jaf) fetches a model price list from the network at import
# time unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from jaf.a2a import create_a2a_agent, create_a2a_server, create_server_config

_FILE = re.compile(r"^### (\S+) \(")
_ADDED = re.compile(r"^\s*(\d+) \+ (.*)$")
RULES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"\b(eval|exec)\s*\("), "high", "eval/exec of a runtime string can run arbitrary code"),
    (re.compile(r"shell\s*=\s*True|\bos\.system\s*\("), "high", "shell command built at run time (injection risk)"),
    (re.compile(r"^\s*except\s*:"), "medium", "bare except swallows every error, KeyboardInterrupt included"),
    (re.compile(r"[!=]=\s*None\b"), "low", "comparison to None with ==/!= instead of is/is not"),
]


def review(text: str) -> tuple[str, str]:
    """The answer to one prompt (``text`` = the user message) and the mode marker seen."""
    path = None
    findings: list[dict[str, Any]] = []
    mode = ""
    for line in text.splitlines():
        m = _FILE.match(line)
        if m:
            path = m.group(1)
            continue
        m = _ADDED.match(line)
        if m is None or path is None:
            continue
        number, code = int(m.group(1)), m.group(2)
        if "# atp-test:" in code:
            mode = code.split("# atp-test:", 1)[1].strip()
        for pattern, severity, claim in RULES:
            if pattern.search(code):
                findings.append(
                    {"file": path, "line": number, "severity": severity, "claim": claim, "confidence": 0.8}
                )
    if mode == "plain":
        return f"Looked at the diff: {len(findings)} risky line(s), nothing more to say.", mode
    summary = f"pattern review: {len(findings)} finding(s)"
    return json.dumps({"findings": findings, "summary": summary}), mode


class ReviewProvider:
    """jaf's ModelProvider protocol, answered by :func:`review` instead of an LLM."""

    async def get_completion(self, state: Any, agent: Any, config: Any) -> dict[str, Any]:
        last = state.messages[-1]
        text = last.content if isinstance(last.content, str) else getattr(last, "text_content", "")
        answer, mode = review(text)
        if mode == "slow":
            await asyncio.sleep(30)
        if mode == "fail":
            raise RuntimeError("reviewer crashed on request (# atp-test: fail)")
        return {"message": {"content": answer, "tool_calls": None}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    agent = create_a2a_agent(
        "reviewer", "Deterministic pattern reviewer of numbered diffs", "Review the diff.", []
    )
    config = create_server_config(
        agents={"reviewer": agent}, name="jaf-reviewer", description="JAF A2A review peer",
        port=args.port, host="127.0.0.1",
    )
    config["model_provider"] = ReviewProvider()
    server = create_a2a_server(config)
    asyncio.run(server["start"]())


if __name__ == "__main__":
    main()
