"""Helpers shared by the router tests: golden tasks, scripted next-hops, a router on a RIB.

* :func:`golden` — a task of ``shared/golden/dev.jsonl`` as stream content;
* :func:`serve_scripted` — RIB agents ``tool: scripted`` served by
  :class:`~atp.adapters.testing.ScriptedAdapter` s (a module's ``scripted``
  fixture returns ``serve_scripted(monkeypatch)``);
* :func:`start_router_on` — :func:`tests.conftest.start_router` on a RIB written
  to ``tmp_path / "rib.yaml"``;
* :func:`router_process` — ``atp-router --policies … --state-dir …`` as a process.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import atp.policy.rib
from atp.adapters.registry import TOOL_FACTORIES
from atp.adapters.testing import ScriptedAdapter
from tests.conftest import SHARED, RouterEnv, start_router

__all__ = ["GOLDEN", "golden", "router_process", "serve_scripted", "start_router_on"]

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
    monkeypatch.setattr(atp.policy.rib, "TOOLS", atp.policy.rib.TOOLS | {"scripted"})
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

    exe = Path(sys.executable).parent / "atp-router"
    http, ws = free_port(), free_port()
    log = state_dir.parent / f"{state_dir.name}.router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(exe), "--policies", str(policies), "--state-dir", str(state_dir), "--http-port", str(http),
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
