"""``atp-router routes [--diagram]`` (issue 21 item 7, :mod:`atp_router.runtime.admin.taskpath`):
the route table and a task's path, generated from the table and the SYN stage list;
the README's copy of the diagram is the command's output."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from atp_router.runtime.admin.taskpath import render_routes, task_path
from atp_router.runtime.dataplane.opening import DEFAULT_STAGES, describe
from atp_router.runtime.ingress.http_api import ROUTES
from tests.helpers import ROUTER

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _run(*args: str) -> str:
    return subprocess.run([*ROUTER, "routes", *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def test_the_readme_diagram_is_the_commands_output():
    out = _run("--diagram")
    layout = README[README.index("## Layout"):]
    blocks = re.findall(r"^```text\n(client\n.*?)^```", layout, re.MULTILINE | re.DOTALL)
    assert blocks == [out]


def test_the_diagram_is_made_from_the_route_table_and_the_stage_list():
    out = task_path()
    opening = [line for line in out.splitlines() if line.startswith("  │ ") and " /" in line]
    assert [line.split()[1:3] for line in opening] == [[r.method, r.path] for r in ROUTES if r.task == "opens"]
    assert ["POST", "/v1/streams"] in [line.split()[1:3] for line in opening]
    stages = re.findall(r"^│ (\d+)\. (\S+) +(.*)$", out, re.MULTILINE)
    assert [(int(i), n, d) for i, n, d in stages] == [(i, n, d) for i, (n, d) in
                                                      enumerate(describe(DEFAULT_STAGES), 1)]
    assert out.rstrip().endswith("GET /v1/streams/{id}/events  stream_access  http_api.stream_events")
    # Another table or stage list, another diagram: nothing in it is typed.
    extra = dataclasses.replace(next(r for r in ROUTES if r.operation_id == "listModels"), task="opens")
    other = task_path([*ROUTES, extra], [("quota_gate", "A tenant's quota."), *describe(DEFAULT_STAGES)])
    assert "│ GET /v1/models" in other and "│ 1. quota_gate" in other and "│ 9. budget_open" in other


def test_routes_lists_every_route_of_the_table_in_order():
    lines = _run().splitlines()
    assert lines == render_routes().splitlines()
    assert [line.split()[:2] for line in lines] == [[r.method, r.path] for r in ROUTES]
    assert lines[0].split() == ["POST", "/v1/streams", "stream_open", "http_api.open_stream"]
    by_path = {line.split()[1]: line.split()[2:] for line in lines}
    assert by_path["/v1/health"] == ["health_read", "http_api.health"]
    assert by_path["/a2a"] == ["(its", "own)", "a2a", "ingress"]
    assert by_path["/status"] == ["public", "status", "ingress"]
