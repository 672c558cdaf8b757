"""Every policy shipped compiles to the FIB its snapshot says (issue 8 item 6):
``atp-router policy check`` text for ``policies/`` (the router's default),
``examples/learning/rib.yaml`` and the spec's RIB examples. A changed compiler or
policy shows here as a diff; ``ATP_UPDATE_SNAPSHOTS=1`` rewrites the snapshots.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from atp_router.policy.check import render_fib
from atp_router.policy.fib import compile_fib
from atp_router.policy.loader import load_rib
from tests.helpers import ROUTER

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "snapshots"
SHIPPED = {
    "default": ROOT / "policies",
    # atp-router eval's variants: each file is a RIB of its own.
    **{f"eval_{p.stem}": p for p in sorted((ROOT / "examples" / "eval" / "policies").glob("*.yaml"))},
    "learning": ROOT / "examples" / "learning" / "rib.yaml",
    "repo_summary": ROOT / "examples" / "repo_summary" / "rib.yaml",
    "retrieval_qa": ROOT / "examples" / "retrieval_qa" / "rib.yaml",
    "spec_6_1": ROOT / "tests" / "unit" / "policy_cases" / "spec_6_1.yaml",
    "spec_23_1": ROOT / "tests" / "unit" / "policy_cases" / "spec_23_1",
    "spec_23_2": ROOT / "tests" / "unit" / "policy_cases" / "spec_23_2",
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_policy_compiles_to_its_snapshot(name):
    text = render_fib(compile_fib(load_rib(SHIPPED[name]), version=1))
    snap = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("ATP_UPDATE_SNAPSHOTS") == "1":
        snap.write_text(text)
    assert snap.exists(), f"no snapshot {snap}: run with ATP_UPDATE_SNAPSHOTS=1"
    assert text == snap.read_text()


def _is_rib(path) -> bool:
    """A YAML file with a RIB section at its top (not, e.g., a CI workflow)."""
    doc = yaml.safe_load(path.read_text())
    return isinstance(doc, dict) and bool({"models", "agents", "policies", "clients"} & set(doc))


def test_every_yaml_policy_in_the_repo_has_a_snapshot():
    shipped = {p.resolve() for p in SHIPPED.values()}
    found = {p.resolve() for p in (ROOT / "policies").glob("*.y*ml")} | {
        p.resolve() for p in (ROOT / "examples").rglob("*.y*ml") if _is_rib(p)}
    assert (ROOT / "examples" / "review" / "github-workflow.yml").resolve() not in found  # a workflow, not a RIB
    covered = {f for f in found if f in shipped or f.parent in shipped}
    assert covered == found, f"policy files without a snapshot: {sorted(map(str, found - covered))}"


def test_policy_check_cli(tmp_path):
    ok = subprocess.run([*ROUTER, "policy", "check", str(SHIPPED["default"])], capture_output=True, text=True,
                        timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout == (SNAPSHOTS / "default.txt").read_text()
    js = subprocess.run([*ROUTER, "policy", "check", "--json", str(SHIPPED["learning"])], capture_output=True,
                        text=True, timeout=60, check=False)
    assert js.returncode == 0 and '"target_cost": 0.3' in js.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents:\n  a: {layer: L2, tool: ruff, p95_ms: 1, bogus: 2}\n"
                   "policies:\n  - {match: {task_type: x}, fanout: [ghost]}\n")
    out = subprocess.run([*ROUTER, "policy", "check", str(bad)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[0] == f"{bad}:2: agents.a.bogus: unknown field 'bogus' (known: layer, p95_ms, model, tool, " \
                       "remote, qos, win30d, strengths, timeout_ms, scope, options, window, fallback, data_scope, calibration)"
    assert lines[1] == f"{bad}:4: policies[0].fanout[0]: unknown agent 'ghost' (known: none defined)"
    assert lines[2] == f"{bad}: refused (2 faults)"
