"""Helpers shared by the router tests: golden tasks, scripted next-hops, a router on a RIB.

* :func:`golden` — a task of ``shared/golden/dev.jsonl`` as stream content;
* :func:`serve_scripted` — RIB agents ``tool: scripted`` served by
  :class:`~atp_router.adapters.testing.ScriptedAdapter` s (a module's ``scripted``
  fixture returns ``serve_scripted(monkeypatch)``);
* :func:`start_router_on` — :func:`tests.conftest.start_router` on a RIB written
  to ``tmp_path / "rib.yaml"``;
* :func:`router_process` — ``atp-router --policies … --state-dir …`` as a process;
* :class:`RouterProcess` — ``atp-router ARGS`` as a child process a test kills,
  restarts or runs several of (its ``listening`` URLs, its output);
* :func:`router_metric` — one metric's samples from a router's ``/v1/metrics``;
* :func:`durable_db` — a stopped or killed router's ``state.db`` with its redo log
  replayed (what the next start reads), for a test that reads the file itself;
* :func:`model_rib` — the model tests' RIB: SmolLM2 at the session's llama
  server (the ``llama_base_url`` fixture of tests/conftest.py) beside ruff.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import atp_router.policy.rib
from atp_router.adapters.registry import TOOL_FACTORIES
from atp_router.adapters.testing import ScriptedAdapter
from tests.conftest import SHARED, RouterEnv, start_router

__all__ = ["GOLDEN", "MODEL_COST_IN", "MODEL_COST_OUT", "ROUTER", "RouterProcess", "golden", "model_rib",
           "router_metric", "router_process", "serve_scripted", "start_router_on"]

GOLDEN = SHARED / "golden" / "dev.jsonl"


def golden(task_id: str = "bugsinpy-thefuck-23") -> dict[str, Any]:
    """``{"diff", "files"}`` of golden task ``task_id``; LookupError if there is none."""
    for line in GOLDEN.read_text().splitlines():
        t = json.loads(line)
        if t["id"] == task_id:
            return {"diff": t["diff"], "files": t["files"]}
    raise LookupError(task_id)


def serve_scripted(
    monkeypatch: pytest.MonkeyPatch, adapters: dict[str, ScriptedAdapter] | None = None
) -> dict[str, ScriptedAdapter]:
    """Make ``tool: scripted`` a RIB tool whose agents are served by the adapter
    stored in the returned dict (``adapters``, or a new one) under the agent's name,
    built by the adapter registry like any tool next-hop."""
    adapters = {} if adapters is None else adapters
    monkeypatch.setattr(atp_router.policy.rib, "TOOLS", atp_router.policy.rib.TOOLS | {"scripted"})
    monkeypatch.setitem(TOOL_FACTORIES, "scripted", lambda name, agent: adapters[name])
    return adapters


async def start_router_on(nursery: trio.Nursery, tmp_path: Path, rib: str | dict[str, Any], **config: Any) -> RouterEnv:
    """A router on the RIB ``rib`` (YAML text, or a dict written as JSON, which is
    YAML) in ``tmp_path / "rib.yaml"``; ``config`` as for ``start_router``."""
    path = tmp_path / "rib.yaml"
    path.write_text(rib if isinstance(rib, str) else json.dumps(rib))
    return await start_router(nursery, path, **config)


@contextlib.contextmanager
def router_process(policies: Path, state_dir: Path, *, cwd: Path | None = None,
                   timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``atp-router --policies POLICIES --state-dir STATE_DIR`` as a user
    does (a process, from ``cwd``, the venv's ``atp-router`` beside
    ``sys.executable``) on free loopback ports; yield its HTTP URL once it logs
    ``listening``; stop it on exit. Fails the test with the router's log when
    it exits first or does not listen within ``timeout_s`` seconds."""
    from tests.peers import free_port, stop_process, wait_until_up

    http, ws = free_port(), free_port()
    log = state_dir.parent / f"{state_dir.name}.router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*ROUTER, "--policies", str(policies), "--state-dir", str(state_dir), "--http-port", str(http),
             "--ws-port", str(ws), "--no-watch"],
            cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        try:
            wait_until_up(proc, lambda: b"listening" in log.read_bytes(), name="atp-router",
                          where="not listening", timeout_s=timeout_s, poll_s=0.1,
                          log=lambda: log.read_text(errors="replace"), log_on_timeout=True)
            yield f"http://127.0.0.1:{http}"
        finally:
            stop_process(proc)


#: ``atp-router`` as a command line: its CLI module run by this interpreter
#: (``python -m``, as the worker supervisor starts its workers), the same
#: ``main`` the installed ``atp-router`` script calls but found by import, so it
#: runs the tree under test even while the venv's script names an older module.
ROUTER: list[str] = [sys.executable, "-m", "atp_router.deploy.cli"]
_ROOT = Path(__file__).resolve().parents[1]


class RouterProcess:
    """``atp-router ARGS`` as a child process, run from the repository root with
    ``env`` added to the environment; its stdout and stderr (merged) are kept in
    :attr:`lines`. After :meth:`wait_listening`: :attr:`url` (HTTP), :attr:`ws_url`
    and, for a router on a shared store, :attr:`owner` (its ``router=`` name).
    :meth:`kill9` is a crash, :meth:`stop` a SIGTERM (SIGKILL after ``timeout``)."""

    def __init__(self, *args: str | Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*ROUTER, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, text=True,
                                     cwd=_ROOT)
        self.lines: list[str] = []
        self.url = self.ws_url = ""
        self.owner: str | None = None

    async def wait_listening(self, timeout: float = 90) -> str:
        """The HTTP URL once the router printed ``listening``; fails the test
        with its output when it exits first. Its later output is drained (kept)."""
        def read() -> str:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening (https?://\S+) (wss?://\S+) .*?(?:router=(\S+))?$", line.rstrip())
                if m:
                    self.url, self.ws_url, self.owner = m[1], m[2], m[3]
                    return self.url
            raise AssertionError("router exited:\n" + "".join(self.lines))

        with trio.fail_after(timeout):
            await trio.to_thread.run_sync(read)
        threading.Thread(target=self._drain, daemon=True).start()  # the pipe never fills
        return self.url

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, and a second one after 1 s (a router still draining running
        streams then stops at once: a test's teardown does not wait ``--drain-s``);
        SIGKILL after ``timeout`` s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        return self.proc.returncode


async def router_metric(url: str, name: str, token: str) -> dict[str, float]:
    """``labels → value`` of metric ``name`` in ``GET /v1/metrics`` of the router
    at ``url`` (asked with bearer ``token``: an operator's): one entry per sample,
    keyed by its label text (``'op="open"'``; ``""`` for none)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        r = await h.get("/v1/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return {m[1] or "": float(m[2]) for m in re.finditer(rf"^{name}(?:{{(.*)}})? (\S+)$", r.text, re.MULTILINE)}


#: The price of :func:`model_rib`'s model, USD per 1M tokens in and out (i.e. USD micros a token).
MODEL_COST_IN, MODEL_COST_OUT = 0.5, 1.5


def model_rib(base_url: str, *, max_out_tokens: int = 64, **policy: Any) -> str:
    """A RIB (JSON text, which is YAML) for the real-model tests: model
    ``smollm2`` — SmolLM2 served at ``base_url`` (the ``llama_base_url``
    fixture), ``openai_compat``, priced :data:`MODEL_COST_IN` /
    :data:`MODEL_COST_OUT`, temperature 0, at most ``max_out_tokens`` tokens out
    — as agent ``reviewer.local``, fanned out beside real ruff (``lint.ruff``)
    by policy ``review_with_model`` for ``task_type: code_review`` with a
    budget of 0.05 USD and 200,000 tokens; ``policy``: more keys of that policy
    (e.g. ``window``, ``cache``)."""
    from tests.peers import MODEL_ALIAS

    return json.dumps({
        "models": {"smollm2": {
            "provider": "openai_compat", "base_url": base_url, "model": MODEL_ALIAS, "ctx": "2k",
            "cost_in": MODEL_COST_IN, "cost_out": MODEL_COST_OUT, "max_out_tokens": max_out_tokens,
            "temperature": 0, "strengths": ["code_review"],
        }},
        "agents": {
            "reviewer.local": {"layer": "L2", "model": "smollm2", "p95_ms": 4000, "timeout_ms": 120_000},
            "lint.ruff": {"layer": "L1", "tool": "ruff", "p95_ms": 200, "strengths": ["code_review"]},
        },
        "policies": [{
            "name": "review_with_model", "match": {"task_type": "code_review"},
            "fanout": ["reviewer.local", "lint.ruff"],
            "budget": {"usd": 0.05, "tokens": 200_000},
            **policy,
        }],
    })


#: The ``roots`` the shipped example RIBs (repo summary, retrieval QA) allow.
SHIPPED_ROOTS = 'roots: [".", "../shared"]'


def rib_with_root(rib: Path, tmp_path: Path) -> Path:
    """A copy of the shipped example RIB ``rib`` with ``tmp_path`` added to its
    ``roots`` (the tests' folders live there; the shipped RIB allows only this
    repository and ../shared)."""
    text = rib.read_text()
    assert SHIPPED_ROOTS in text
    out = tmp_path / "example-rib.yaml"
    out.write_text(text.replace(SHIPPED_ROOTS, f'roots: [".", "../shared", {str(tmp_path)!r}]'))
    return out


def durable_db(db: Path) -> Path:
    """``db`` — the ``state.db`` of a router that stopped or was killed — with what its
    redo log holds replayed into it (:mod:`atp_router.store.redo`: a kill -9 leaves a
    single router's latest transactions in ``state.db.redo`` until the store is opened
    again), as the next start would; returns ``db``. A test reading the file itself
    with :mod:`sqlite3` calls this first."""
    from atp_router.store import SqliteStore

    log = db.with_name(db.name + ".redo")
    if log.exists() and log.stat().st_size > 0:
        SqliteStore.open(db.parent, create=False, check_s=0).close()
    return db
