"""The TypeScript client (``sdk/typescript``, issue 24 item 4) against a real router.

A router runs in process (the real ``bandit`` analyser reviews code in its sandbox; a
:class:`~atp_router.adapters.testing.ScriptedAdapter` writer answers chat as a model
streams); the client is built with its own ``tsc`` and its tests run with Node.js's
test runner (``node --test``), which gets the router's URL and two tenants' keys in its
environment. ``scripts/setup.sh --test`` installs its dev dependencies (``npm ci``).

``test/ws.test.ts`` speaks the WebSocket ingress (its token in the ``atp.bearer.``
subprotocol) with Node's own ``WebSocket`` (``--experimental-websocket`` below Node 22);
a ``slow_chat`` task (a scripted next-hop streaming five PARTIALs 0.2 s apart) gives it
time to lose frames in flight and cut the connection mid-stream.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from atp_router.consensus.types import Usage
from tests.helpers import start_router_on
from tests.unit.test_router_dispatch import scripted_agent

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript"
KEYS = {"alice": "alice-key", "bob": "bob-key"}
RIB = {
    "agents": {"bandit": {"layer": "L1", "tool": "bandit", "p95_ms": 900, "strengths": ["code_review"]},
               "writer": scripted_agent(), "slowpoke": scripted_agent()},
    "policies": [
        {"name": "review", "match": {"task_type": "code_review"}, "fanout": ["bandit"]},
        {"name": "chat", "match": {"task_type": "chat"}, "fanout": ["writer"]},
        {"name": "slow", "match": {"task_type": "slow_chat"}, "fanout": ["slowpoke"]},
    ],
    "clients": {"alice": {}, "bob": {"task_types": ["chat"]}},
}


def _node_tools() -> tuple[str, str]:
    """``(node, npx)``; fails (never skips) when Node.js or the client's dev
    dependencies are missing: the set-up installs them."""
    node, npx = shutil.which("node"), shutil.which("npx")
    if node is None or npx is None:
        pytest.fail("Node.js (node, npx) is not on PATH: the TypeScript client cannot be tested; "
                    "install Node.js >= 20 (Debian: apt-get install nodejs npm)")
    if not (SDK / "node_modules" / "typescript").is_dir():
        pytest.fail(f"{SDK}/node_modules lacks typescript: run scripts/setup.sh --test (npm ci in sdk/typescript)")
    return node, npx


async def test_the_typescript_client_passes_its_tests_against_a_real_router(nursery, tmp_path, scripted):
    node, npx = _node_tools()
    scripted["writer"] = ScriptedAdapter.returning("writer", partials=["Hello", ", ", "world."],
                                                   summary="Hello, world.",
                                                   usage=Usage(in_tokens=30, out_tokens=12, usd_micros=420))
    scripted["slowpoke"] = ScriptedAdapter.returning("slowpoke", partials=["one", "two", "three", "four", "five"],
                                                     summary="slow: done", delay_s=0.2)
    env = await start_router_on(nursery, tmp_path, RIB, client_tokens=KEYS)
    built = await trio.run_process([npx, "tsc", "-p", "."], cwd=SDK, capture_stdout=True, capture_stderr=True,
                                   check=False)
    assert built.returncode == 0, (built.stdout + built.stderr).decode(errors="replace")
    run_env = {**os.environ, "ATP_URL": env.url, "ATP_WS_URL": env.ws_url, "ATP_TOKEN": KEYS["alice"],
               "ATP_TOKEN_CHAT": KEYS["bob"]}
    version = await trio.run_process([node, "--version"], capture_stdout=True)
    major = int(version.stdout.decode().strip().lstrip("v").split(".")[0])
    flags = ["--experimental-websocket"] if major < 22 else []  # a global WebSocket from Node 22 on
    ran = await trio.run_process([node, *flags, "--test", "--test-reporter=tap", "dist/test/"], cwd=SDK, env=run_env,
                                 capture_stdout=True, stderr=subprocess.STDOUT, check=False)
    out = ran.stdout.decode(errors="replace")
    assert ran.returncode == 0, out
    assert "# pass 10" in out and "# fail 0" in out, out
