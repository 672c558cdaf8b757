"""The shipped examples keep working: each runs as a user would run it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_multi_protocol_example_merges_provenance_from_three_protocols():
    """examples/multi_protocol/run.sh: a local tool, a 2389 agent over a real mosquitto
    and an A2A agent (a second router) review one task; the merged finding on the
    pickle line of thefuck#23 carries provenance from all three."""
    if shutil.which("mosquitto") is None and os.environ.get("ATP_REQUIRE_PEERS") != "1":
        pytest.skip("mosquitto is not installed (scripts/peers/mosquitto.sh)")
    r = subprocess.run(
        ["bash", str(ROOT / "examples/multi_protocol/run.sh")],
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    prov = next(line for line in r.stdout.splitlines() if "provenance" in line)
    assert {"lint.ruff#", "sec.mqtt#", "review.a2a#"} <= {p.split("#")[0] + "#" for p in prov.split("provenance", 1)[1].replace(",", " ").split()}
    assert "CAUGHT" in r.stdout
