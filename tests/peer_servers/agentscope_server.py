"""A real agentscope-runtime Agent API server that reviews Python code (the Agent API peer).

Runs inside the ``.peers/agentscope`` virtualenv (``scripts/peers/agentscope.sh``);
``tests/peers.py`` starts it as ``python agentscope_server.py --port P`` and waits
for ``GET /health``. Everything on the wire is agentscope-runtime's own: its
``AgentApp`` serves ``POST /process`` (SSE), ``/a2a`` and the agent card; this
file only supplies the ``Runner`` (``framework_type="text"``, a ``query_handler``
that yields strings).

The runner is deterministic and really reviews: the request's ATP task (a
DataContent ``{"atp": {"task_type", "content": {"diff", "files"}}}`` in the user
message) is checked file by file with ``compile`` and ``ast`` — syntax errors,
``eval``/``exec``, shell commands (``os.system``, ``shell=True``), bare
``except:``, mutable default arguments, ``== None`` — restricted to the lines the
diff adds. A request with text only (agentscope's ``/a2a`` passes just the text
parts on) is reviewed from the numbered diff in that text, as ATP adapters render
it (``### path (status)`` then ``  NN + code`` lines): the new files are rebuilt
from the numbered lines, and a file with gaps that does not compile is skipped
rather than blamed for the gaps. The answer is ``{"findings": [...], "summary": ...}`` streamed in
small text deltas; the summary names the SHA-256 of the Agent Context message it
received (canonical JSON) so a test can check the context arrived unchanged.
Usage is reported on the terminal response as agentscope's ``ChatUsage`` dict
(``input_tokens``/``output_tokens``, chars/4).

Failure paths, all through agentscope-runtime's own error handling:

* a file containing ``# atp-test: crash`` makes the handler raise after its
  first delta — agentscope answers ``status: failed`` with
  ``AGENT_UNKNOWN_ERROR`` (HTTP 200). The exception message carries the
  securityContext token, as a careless agent would echo it;
* a request without a task (no ATP data part, no text), or naming a ``model``
  other than ``ast-review``, is refused before the run starts — agentscope
  answers a single ``data: {"error": "..."}``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
from typing import Any

import uvicorn
from agentscope_runtime.engine import Runner
from agentscope_runtime.engine.app import AgentApp

MODEL = "ast-review"
CHUNK = 24  # characters per streamed delta: several deltas even for a short answer
CRASH_MARK = "# atp-test: crash"
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")
_RENDERED_FILE = re.compile(r"^### (\S.*?) \((added|modified|deleted|renamed)\b")
_RENDERED_LINE = re.compile(r"^ *(\d*) ([ +-]) (.*)$")


def _parts(request: Any) -> tuple[list[str], list[dict]]:
    """Texts and data parts of every input message (dicts or pydantic models)."""
    raw = request if isinstance(request, dict) else request.model_dump(mode="json")
    texts: list[str] = []
    datas: list[dict] = []
    for msg in raw.get("input") or []:
        for part in msg.get("content") or []:
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "data" and isinstance(part.get("data"), dict):
                datas.append(part["data"])
    return texts, datas


def _task(request: Any) -> tuple[dict, dict | None, str]:
    """(ATP task, Agent Context message or None, prompt text) of a request."""
    texts, datas = _parts(request)
    task = next((d["atp"] for d in datas if isinstance(d.get("atp"), dict)), None)
    ctx = next((d for d in datas if "agentContext" in d), None)
    if task is None and not "".join(texts).strip():
        raise ValueError("request carries no review task: no ATP data part and no text")
    return task or {"task_type": "text", "content": {}}, ctx, "\n".join(texts)


def _added_lines(diff: str) -> dict[str, set[int]]:
    """Path -> line numbers (new file) the unified diff adds."""
    added: dict[str, set[int]] = {}
    path, line = None, 0
    for row in diff.splitlines():
        if row.startswith("+++ "):
            target = row[4:].strip()
            path = None if target == "/dev/null" else target.removeprefix("b/")
            if path is not None:
                added.setdefault(path, set())
        elif (m := _HUNK.match(row)) is not None:
            line = int(m[1])
        elif path is not None and row.startswith("+"):
            added[path].add(line)
            line += 1
        elif path is not None and row.startswith(" "):
            line += 1
    return added


def _from_rendered(text: str) -> tuple[dict[str, str], dict[str, set[int]], set[str]]:
    """(new files, added lines, files with gaps) rebuilt from a numbered diff."""
    lines: dict[str, dict[int, str]] = {}
    added: dict[str, set[int]] = {}
    path = None
    for row in text.splitlines():
        if (m := _RENDERED_FILE.match(row)) is not None:
            path = None if m[2] == "deleted" else m[1]
            if path is not None:
                lines.setdefault(path, {})
                added.setdefault(path, set())
        elif path is not None and (m := _RENDERED_LINE.match(row)) is not None and m[1]:
            lines[path][int(m[1])] = m[3]
            if m[2] == "+":
                added[path].add(int(m[1]))
    files, gappy = {}, set()
    for p, numbered in lines.items():
        top = max(numbered, default=0)
        if len(numbered) != top:
            gappy.add(p)
        files[p] = "".join(numbered.get(n, "") + "\n" for n in range(1, top + 1))
    return files, added, gappy


class _Checks(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[dict] = []

    def _add(self, node: ast.AST, severity: str, claim: str, confidence: float) -> None:
        self.found.append(
            {"file": self.path, "line": node.lineno, "severity": severity, "claim": claim, "confidence": confidence}
        )

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
        if isinstance(fn, ast.Name) and name in ("eval", "exec"):
            self._add(node, "high", f"{name}() executes arbitrary code from its argument", 0.9)
        elif owner == "os" and name in ("system", "popen"):
            self._add(node, "high", f"os.{name}() runs its argument through a shell (command injection)", 0.9)
        elif any(k.arg == "shell" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords):
            self._add(node, "high", f"{owner + '.' if owner else ''}{name}(shell=True) runs a shell command", 0.85)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is None:
            self._add(node, "medium", "bare except: swallows every exception, KeyboardInterrupt included", 0.7)
        self.generic_visit(node)

    def _defaults(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            if isinstance(default, (ast.List, ast.Dict, ast.Set)):
                self._add(default, "medium", f"mutable default argument in {node.name}() is shared between calls", 0.75)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _defaults

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(right, ast.Constant) and right.value is None:
                self._add(node, "low", "comparison to None with ==/!= instead of is/is not", 0.6)
        self.generic_visit(node)


def review(content: dict, prompt: str = "") -> list[dict]:
    """Findings on the Python files of ``content`` (``{"diff", "files"}``), on added
    lines; without files, on those rebuilt from the numbered diff in ``prompt``."""
    files = content.get("files") or {}
    added = _added_lines(content.get("diff") or "")
    gappy: set[str] = set()
    if not files:
        files, added, gappy = _from_rendered(prompt)
    findings: list[dict] = []
    for path, text in sorted(files.items()):
        if not path.endswith(".py") or not isinstance(text, str):
            continue
        try:
            tree = ast.parse(compile(text, path, "exec", ast.PyCF_ONLY_AST, dont_inherit=True))
        except SyntaxError as e:
            if path in gappy:
                continue
            findings.append(
                {"file": path, "line": e.lineno or 1, "severity": "high", "claim": f"syntax error: {e.msg}", "confidence": 1.0}
            )
            continue
        checks = _Checks(path)
        checks.visit(tree)
        lines = added.get(path)
        findings += [f for f in checks.found if lines is None or f["line"] in lines]
    return findings


def _token_of(ctx: dict | None) -> str:
    auth = ((ctx or {}).get("agentContext", {}).get("securityContext") or {}).get("authenticationInfo") or {}
    return str(auth.get("token", ""))


def _tokens(chars: int) -> int:
    return -(-chars // 4)


class ReviewRunner(Runner):
    """Reviews the ATP task of each request; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.framework_type = "text"

    async def query_handler(self, request: Any = None, **kwargs: Any):
        task, ctx, prompt = _task(request)
        content = task.get("content") or {}
        findings = review(content, prompt)
        digest = "none"
        if ctx is not None:
            digest = hashlib.sha256(json.dumps(ctx, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        summary = f"{len(findings)} finding(s) by ast checks; agent_context sha256:{digest}"
        answer = json.dumps({"findings": findings, "summary": summary})
        crash = any(CRASH_MARK in t for t in (content.get("files") or {}).values() if isinstance(t, str))
        for i in range(0, len(answer), CHUNK):
            yield answer[i : i + CHUNK]
            if crash:
                raise RuntimeError(f"reviewer crashed while authorising with token {_token_of(ctx)}")

    async def stream_query(self, request: Any, **kwargs: Any):
        # Refuse a request without a task, or for another model, before the run
        # starts: agentscope then answers its in-band {"error": ...} (HTTP 200).
        _task(request)
        model = request.get("model") if isinstance(request, dict) else getattr(request, "model", None)
        if model not in (None, MODEL):
            raise ValueError(f"unknown model {model!r}: this agent serves {MODEL!r}")
        texts, datas = _parts(request)
        in_chars = sum(map(len, texts)) + sum(len(json.dumps(d)) for d in datas)
        async for event in super().stream_query(request, **kwargs):
            if getattr(event, "object", None) == "response" and event.status in ("completed", "failed"):
                out = "".join(
                    c.text or ""
                    for m in event.output or []
                    for c in m.content or []
                    if getattr(c, "type", None) == "text"
                )
                event.usage = {"input_tokens": _tokens(in_chars), "output_tokens": _tokens(len(out)), "type": "chat"}
            yield event


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    app = AgentApp(app_name="atp-review", app_description="Python review by ast checks", runner=ReviewRunner())
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
