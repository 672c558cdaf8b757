"""Helpers shared by the router tests: golden tasks, scripted next-hops, a router on a RIB.

* :func:`golden` — a task of ``shared/golden/dev.jsonl`` as stream content;
* :func:`serve_scripted` — RIB agents ``tool: scripted`` served by
  :class:`~atp.adapters.testing.ScriptedAdapter` s (a module's ``scripted``
  fixture returns ``serve_scripted(monkeypatch)``);
* :func:`start_router_on` — :func:`tests.conftest.start_router` on a RIB written
  to ``tmp_path / "rib.yaml"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

import atp.policy.rib
from atp.adapters.registry import TOOL_FACTORIES
from atp.adapters.testing import ScriptedAdapter
from tests.conftest import SHARED, RouterEnv, start_router

__all__ = ["GOLDEN", "golden", "serve_scripted", "start_router_on"]

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
