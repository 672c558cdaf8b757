"""The README is true (issue 20): its commands, run as a newcomer would against a fresh
router started the README's way, give the outputs the README quotes.

Each test reads what it runs from README.md itself (a command in backticks, a fenced
block), so an edit to the README that stops being true fails here."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest
import trio

from tests.helpers import ROUTER, RouterProcess
from tests.peers import free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title_start: str) -> str:
    """The README's text from the heading starting with ``title_start`` to the next heading of its level."""
    m = re.search(rf"^(#+) {re.escape(title_start)}.*$", README, re.MULTILINE)
    assert m, f"README has no section {title_start!r}"
    level = len(m[1])
    rest = README[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _router_command() -> list[str]:
    """The README's way to start the router (its first ``atp-router --policies`` line)."""
    line = next(ln for ln in _blocks(_section("Running the router"), "sh")[0].splitlines() if "atp-router" in ln)
    return line.split()[1:]


def test_keys_new_prints_the_line_the_readme_shows():
    sharing = _section("Sharing the router")
    command = re.search(r"`atp-router (keys new [^`]+)`", sharing)
    assert command, "the README names a keys new command"
    shown = next(ln.strip() for ln in _blocks(sharing, "yaml")[0].splitlines() if "id: alice-ci" in ln)
    out = subprocess.run([*ROUTER, *command[1].split()], capture_output=True, text=True, timeout=60, check=True)
    printed = next(ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("- {"))
    # The README elides the hash as "…": every other character is what is printed.
    pattern = re.escape(shown).replace(re.escape('"…"'), '"?[0-9a-f]{64}"?')
    assert re.fullmatch(pattern, printed), (shown, printed)


def _start(*extra: str, env: dict[str, str] | None = None) -> RouterProcess:
    args = _router_command()
    http, ws = free_port(), free_port()
    args[args.index("--http-port") + 1] = str(http)
    args[args.index("--ws-port") + 1] = str(ws)
    return RouterProcess(*args, *extra, env=env)


async def test_the_openai_example_runs_against_the_router_the_readme_starts(tmp_path):
    block = _blocks(_section("OpenAI-compatible ingress"), "python")[0]
    router = _start("--state-dir", str(tmp_path / "state"), env={"ATP_ROUTER_TOKENS": ""})
    try:
        url = await router.wait_listening()
        code = block.replace("http://127.0.0.1:7070", url)
        out = io.StringIO()

        def run() -> None:
            cwd = os.getcwd()
            os.chdir(ROOT)
            try:
                with redirect_stdout(out):
                    exec(compile(code, "README.md (OpenAI example)", "exec"), {})  # noqa: S102 - the README's own block
            finally:
                os.chdir(cwd)

        await trio.to_thread.run_sync(run)
    finally:
        router.stop()
    text = out.getvalue()
    # The non-streamed answer lists the demo change's findings, then tokens and USD;
    # the streamed one ends with the same findings.
    assert "finding(s):" in text and "inventory/sync.py" in text, text[:2000]
    assert re.search(r"^\d+ \d+(\.\d+)?(e-?\d+)?$", text, re.MULTILINE), text[:2000]
    assert text.count("finding(s):") == 2, text[:2000]


async def test_health_answers_any_caller_as_the_readme_says(tmp_path):
    assert re.search(r"`GET /v1/health` \| liveness for any caller", README)
    auth = tmp_path / "auth.yaml"
    auth.write_text("api_keys: []\n")
    router = _start("--state-dir", str(tmp_path / "state"), "--auth", str(auth))
    try:
        url = await router.wait_listening()
        async with httpx.AsyncClient() as client:
            health = await client.get(f"{url}/v1/health")
            refused = await client.get(f"{url}/v1/routes")
    finally:
        router.stop()
    assert health.status_code == 200, health.text
    assert refused.status_code == 401  # everything else still needs a credential


@pytest.mark.parametrize("command", ["audit verify", "audit show"])
async def test_audit_commands_use_the_routers_default_state_dir(tmp_path, command):
    sharing = _section("Sharing the router")
    assert f"atp-router {command}" in sharing
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg"), "ATP_ROUTER_TOKENS": ""}
    router = _start(env=env)  # no --state-dir: the default
    try:
        await router.wait_listening()
    finally:
        router.stop()
    done = subprocess.run([*ROUTER, *command.split()], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "xdg" / "atp-router").is_dir()


def test_the_readme_types_no_test_counts():
    """Counts typed into the README go stale (issue 20 found 1,493 of 1,852 where it
    said ~1,460 of ~1,770); it says how to count instead."""
    quick = _section("Quick start")
    typed = re.search(r"(about|~)\s*[\d,]+\s+(of the\s+~?[\d,]+\s+)?tests", quick)
    assert not typed, f"the quick start types a test count: {typed and typed[0]!r}"
    assert "--collect-only" in quick


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="the router's sandbox and state paths are Linux-only")
