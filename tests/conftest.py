"""Shared fixtures: a real router (HTTP control API + WebSocket ingress) on free ports."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from atp.router.cli import run
from atp.router.core import Router, RouterConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@dataclass
class RouterEnv:
    router: Router
    url: str
    ws_url: str
    policies: Path


async def start_router(nursery, policies: Path, **config) -> RouterEnv:
    cfg = RouterConfig(policies=policies, http_port=0, ws_port=0, **config)
    router, http_port, ws_port = await nursery.start(run, cfg)
    return RouterEnv(router, f"http://127.0.0.1:{http_port}", f"ws://127.0.0.1:{ws_port}", policies)


#: The RIB the router-mechanics tests run on: ruff and bandit only (fast, stable);
#: the shipped default (``policies/``, four analysers) is tested as such by
#: tests/golden_tasks and tests/unit/test_policy_load.py.
MECHANICS_RIB = ROOT / "tests" / "fixtures" / "rib_ruff_bandit"


@pytest.fixture
def policies_dir(tmp_path: Path) -> Path:
    d = tmp_path / "policies"
    shutil.copytree(MECHANICS_RIB, d)
    return d


@pytest.fixture
async def router_env(nursery, policies_dir: Path) -> RouterEnv:
    return await start_router(nursery, policies_dir)


@pytest.fixture
def scripted(monkeypatch):
    """RIB agents ``tool: scripted`` are served by the ScriptedAdapter stored in the
    returned dict under the agent's name (built by the adapter registry like any
    tool next-hop); see :func:`tests.helpers.serve_scripted`."""
    from tests.helpers import serve_scripted

    return serve_scripted(monkeypatch)
