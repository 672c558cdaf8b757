"""The pytest next-hop (atp_router.adapters.tools.testrunner): real pytest runs on small real
projects in the sandbox — passing, failing, endless, reaching for the network,
flooding its output — and a failing test escalating through a real router whose
policy escalates ``on: [test_fail]``."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
from pathlib import Path

import atp
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.adapters.tools.base import DEFAULT_LIMITS
from atp_router.adapters.tools.testrunner import TestRunnerAdapter
from atp_router.consensus.escalation import TEST_FAIL_RULE
from atp_router.consensus.types import AgentFinding, Severity
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from tests.helpers import start_router_on

CALC = "def add(a, b):\n    return a + b\n\n\ndef div(a, b):\n    return a / b\n"
PASSING = {
    "calc.py": CALC,
    "tests/test_calc.py": (
        "from calc import add, div\n"
        "\n"
        "\n"
        "def test_add():\n"
        "    assert add(1, 2) == 3\n"
        "\n"
        "\n"
        "def test_div():\n"
        "    assert div(6, 3) == 2\n"
    ),
}
# The failing test's def is line 5, its failing assert line 7.
FAILING = {
    "calc.py": CALC.replace("return a + b", "return a - b"),
    "tests/test_calc.py": (
        "from calc import add\n"
        "\n"
        "\n"
        "class TestAdd:\n"
        "    def test_add(self):\n"
        "        total = add(1, 2)\n"
        "        assert total == 3, 'add is broken'\n"
        "\n"
        "    def test_zero(self):\n"
        "        assert add(0, 0) == 0\n"
    ),
}

def runner(**limits) -> TestRunnerAdapter:
    return TestRunnerAdapter("tests.pytest", limits=dataclasses.replace(DEFAULT_LIMITS, **{"timeout_s": 60, **limits}))


async def review(adapter: TestRunnerAdapter, content: dict):
    with trio.fail_after(90):
        return await adapter.review(Prompt(task_type="code_review", content=content))


async def test_a_passing_project_has_no_findings_and_says_what_passed():
    report = await review(runner(), {"files": PASSING})
    assert report.findings == []
    assert report.summary == "2 passed, 0 failed"


async def test_a_failing_test_is_a_test_fail_finding_at_its_file_and_lines():
    report = await review(runner(), {"files": FAILING})
    assert report.summary == "1 passed, 1 failed"
    [f] = report.findings
    assert (f.file, f.start, f.end) == ("tests/test_calc.py", 5, 7)
    assert (f.rule, f.severity) == (TEST_FAIL_RULE, Severity.HIGH)
    assert f.claim.startswith("tests/test_calc.py::TestAdd::test_add failed: AssertionError: add is broken")
    assert f.tests == ["tests/test_calc.py::TestAdd::test_add"]


async def test_node_ids_and_allowed_flags_choose_what_runs():
    only_zero = {"files": FAILING, "tests": ["tests/test_calc.py::TestAdd::test_zero"]}
    assert (await review(runner(), only_zero)).summary == "1 passed, 0 failed"
    command = {"files": FAILING, "tests": {"command": ["python", "-m", "pytest", "-k", "zero", "-q"]}}
    assert (await review(runner(), command)).summary == "1 passed, 0 failed"
    for bad in ({"command": ["bash", "-c", "id"]}, {"command": ["pytest", "-p", "evil"]},
                {"command": ["pytest", "--junitxml=/tmp/x"]}, ["../outside.py"], ["/etc/passwd"]):
        with pytest.raises(ClientInputError):
            await review(runner(), {"files": FAILING, "tests": bad})


async def test_an_endless_test_is_killed_at_the_time_limit_and_is_the_tasks_fault():
    """The canary (a passing test run the same way) passes: the timeout is the
    task's — ClientInputError ETIMEOUT, which no breaker counts."""
    files = {"test_loop.py": "def test_forever():\n    while True:\n        pass\n"}
    adapter = runner(timeout_s=3)
    t0 = trio.current_time()
    with pytest.raises(ClientInputError) as e:
        await review(adapter, {"files": files})
    assert e.value.code is ErrorCode.ETIMEOUT and "timeout_s=3" in e.value.reason
    assert "canary" in e.value.reason and e.value.client_fault
    assert trio.current_time() - t0 < 30


async def test_the_network_is_off_even_to_a_listener_on_loopback():
    """A server listens on 127.0.0.1 in this process; the sandboxed test cannot reach
    it (a network namespace of its own: its loopback is not the host's), so it
    fails, and the listener never sees a connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        files = {"test_net.py": (
            "import socket\n"
            "\n"
            "\n"
            "def test_reach_the_network():\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n"
        )}
        report = await review(runner(), {"files": files})
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert report.summary == "0 passed, 1 failed"
    [f] = report.findings
    assert (f.file, f.start, f.end) == ("test_net.py", 4, 5)
    assert "ConnectionRefusedError" in f.claim or "Network is unreachable" in f.claim, f.claim


async def test_a_test_flooding_its_output_is_stopped_at_the_output_limit():
    files = {"test_flood.py": "def test_flood():\n    for _ in range(100_000):\n        print('x' * 1000)\n"}
    with pytest.raises(ClientInputError, match="output limit output_bytes=262,144"):
        await review(runner(output_bytes=256 * 1024), {"files": files})


async def test_a_test_writing_a_huge_file_is_stopped_at_the_file_size_limit():
    """RLIMIT_FSIZE: the write past max_write_bytes fails (Python ignores SIGXFSZ,
    so it is an EFBIG OSError in the test), and the test is reported failing."""
    files = {"test_disk.py": "def test_fill(tmp_path):\n    (tmp_path / 'big').write_bytes(b'x' * (8 << 20))\n"}
    adapter = TestRunnerAdapter("t", max_write_bytes=1 << 20, limits=dataclasses.replace(DEFAULT_LIMITS, timeout_s=60))
    report = await review(adapter, {"files": files})
    [f] = report.findings
    assert report.summary == "0 passed, 1 failed" and (f.file, f.start, f.end) == ("test_disk.py", 1, 2)
    assert "File too large" in f.claim, f.claim


async def test_refusals_name_the_problem():
    with pytest.raises(ClientInputError, match="no test files"):
        await review(runner(), {"files": {"calc.py": CALC}})
    with pytest.raises(ClientInputError, match="refused file path"):
        await review(runner(), {"files": {"../test_x.py": "def test_x(): pass\n"}})
    with pytest.raises(ClientInputError, match="collected no tests"):
        await review(runner(), {"files": {"test_empty.py": "x = 1\n"}})
    with pytest.raises(ClientInputError, match="not a checkout this router's operator allowed"):
        await review(runner(), {"files": PASSING, "repo": "/etc"})


async def test_a_repo_inside_an_allowed_root_is_copied_and_files_overlay_it(tmp_path):
    checkout = tmp_path / "proj"
    for rel, text in PASSING.items():
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(text)
    (checkout / "leak.py").symlink_to("/etc/hostname")  # never copied
    adapter = TestRunnerAdapter("t", repos=[str(tmp_path)], limits=dataclasses.replace(DEFAULT_LIMITS, timeout_s=60))
    assert (await review(adapter, {"repo": str(checkout)})).summary == "2 passed, 0 failed"
    broken = await review(adapter, {"repo": str(checkout), "files": {"calc.py": FAILING["calc.py"]}})
    assert broken.summary == "1 passed, 1 failed"
    assert broken.findings[0].file == "tests/test_calc.py"
    assert (checkout / "calc.py").read_text() == CALC  # the checkout itself is untouched


def test_registry_builds_it_as_tool_pytest_and_tests():
    for tool in ("pytest", "tests"):
        agent = AgentSpec(layer="L1", tool=tool, p95_ms=5000, timeout_ms=20_000,
                          options={"repos": ["/srv/checkouts"], "max_write_bytes": 1 << 20})
        adapter = build_adapter("t", agent)
        assert isinstance(adapter, TestRunnerAdapter) and adapter.needs_files
        assert adapter.limits.timeout_s == 20 and adapter.repos == ["/srv/checkouts"]
    with pytest.raises(ValueError, match="options.shell"):
        build_adapter("t", AgentSpec(layer="L1", tool="pytest", p95_ms=1, options={"shell": True}))


async def test_test_fail_escalates_through_a_router(nursery, tmp_path, monkeypatch):
    """A policy escalating ``on: [test_fail]``: the pytest next-hop's failing test
    fires the trigger and the escalation target is called; passing tests do not."""
    deep = ScriptedAdapter.returning("review.deep", [AgentFinding(
        file="calc.py", start=2, end=2, severity=Severity.HIGH, claim="add subtracts", confidence=0.9)])
    from tests.helpers import serve_scripted

    serve_scripted(monkeypatch, {"review.deep": deep})
    rib = {
        "agents": {
            "tests.pytest": {"layer": "L1", "tool": "pytest", "p95_ms": 3000, "timeout_ms": 60_000,
                             "strengths": ["code_review"]},
            "review.deep": {"layer": "L2", "tool": "scripted", "p95_ms": 300, "strengths": ["code_review"]},
        },
        "policies": [{"name": "tests", "match": {"task_type": "code_review"}, "fanout": ["tests.pytest"],
                      "deadline_ms": 120_000, "escalation": {"on": ["test_fail"], "to": "review.deep"}}],
    }
    env = await start_router_on(nursery, tmp_path, rib)

    async def run(files: dict) -> tuple[list[atp.Event], dict]:
        async with atp.Client(env.url) as c:
            _, st = await c.open_stream(task={"task_type": "code_review"}, content={"files": files})
            with trio.fail_after(120):
                events = [ev async for ev in c.events(st)]
        [final] = [ev.payload for ev in events if ev.type == "FINAL"]
        return events, final

    _, final = await run(PASSING)
    assert deep.calls == [] and final["result"]["findings"] == []
    assert [a["text"] for a in final["result"]["answers"]] == ["2 passed, 0 failed"]

    events, final = await run(FAILING)
    assert len(deep.calls) == 1
    assert "escalated on test_fail" in final["result"]["consensus"]["uncertainties"]
    spans = {(f["file"], f["span"]) for f in final["result"]["findings"]}
    assert ("tests/test_calc.py", "5-7") in spans and ("calc.py", "2-2") in spans
    reports = {ev.payload["agent"] for ev in events if ev.type == "PARTIAL" and "report" in ev.payload}
    assert reports == {"tests.pytest", "review.deep"}
    async with atp.Client(env.url) as c:
        assert 'atp_escalations_total{trigger="test_fail"} 1.0' in await c.metrics()


def test_no_sandbox_means_no_adapter(monkeypatch):
    """Where no sandbox can be made (here: no bwrap on PATH) the runner is refused
    at construction — the RIB naming it at load — rather than run the tests
    with the router's privileges."""
    from atp_router.adapters.tools import sandbox

    monkeypatch.setattr(sandbox, "_probed", [])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="bubblewrap is not installed"):
        TestRunnerAdapter("t")
    with pytest.raises(ValueError, match="sandbox: bubblewrap is not installed"):
        build_adapter("t", AgentSpec(layer="L1", tool="pytest", p95_ms=1))


async def test_tests_cannot_read_what_the_router_keeps_to_itself(tmp_path):
    """The tests see none of the router's files: a secret readable by the router
    alone, a world-readable file outside what the sandbox mounts, the router's
    environment and processes — whoever the router runs as (root here too)."""
    secret = Path(tempfile.mkdtemp(prefix="atp-secret-", dir="/tmp")) / "key"
    try:
        secret.write_text("hunter2")
        secret.chmod(0o600)
        os.chmod(secret.parent, 0o755)
        files = {"test_peek.py": (
            "import os\n"
            "\n"
            "\n"
            "def test_peek():\n"
            f"    assert open({str(secret)!r}).read() == 'hunter2'\n"
            "\n"
            "\n"
            "def test_environ():\n"
            f"    assert os.environ.get('ATP_TEST_SECRET') == 'hunter3'\n"
            "\n"
            "\n"
            "def test_router_process():\n"
            f"    assert os.path.exists('/proc/{os.getpid()}/environ') and os.getpid() != 2\n"
        )}
        os.environ["ATP_TEST_SECRET"] = "hunter3"
        try:
            report = await review(runner(), {"files": files})
        finally:
            del os.environ["ATP_TEST_SECRET"]
        assert report.summary == "0 passed, 3 failed", report.summary
        claims = {f.claim.split(" ")[0]: f.claim for f in report.findings}
        assert "FileNotFoundError" in claims["test_peek.py::test_peek"], claims
        assert all(f.rule == "test_fail" for f in report.findings)
    finally:
        shutil.rmtree(secret.parent, ignore_errors=True)
