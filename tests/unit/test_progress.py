"""tests/progress.py (issue 20) in a real pytest run of its own, serial and under
pytest-xdist as scripts/test.sh runs it: the heartbeat names elapsed time, counts
and the test in flight; a reasonless skip, and any skip under tests/security/, fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SLOW = """
import time
def test_slow():
    time.sleep(4)  # several 1 s heartbeats, even on a loaded machine
def test_quick():
    pass
"""
_SKIPS = """
import pytest
def test_no_reason():
    pytest.skip()
def test_a_reason():
    pytest.skip("needs a thing this machine lacks")
"""
_SECURITY = """
import pytest
def test_protection():
    pytest.skip("no sandbox here")
"""


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p tests.progress -p no:cacheprovider -ra\n")
    (tmp_path / "tests" / "security").mkdir(parents=True)
    (tmp_path / "test_slow.py").write_text(_SLOW)
    (tmp_path / "test_skips.py").write_text(_SKIPS)
    (tmp_path / "tests" / "security" / "test_protection.py").write_text(_SECURITY)
    p = subprocess.run([sys.executable, "-m", "pytest", "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"),
                        str(tmp_path), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "ATP_TEST_HEARTBEAT_S": "1", **env}, check=False)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("workers", ["0", "2"])
def test_heartbeat_counts_and_names_the_test_in_flight(tmp_path, workers):
    code, out = _run(tmp_path, "-n", workers)
    assert code == 1, out
    assert len(re.findall(r"collected 5 tests in [\d.]+ s", out)) == 1, out  # once, not once per worker
    # While test_slow sleeps: elapsed time, what is done of how many, and the test with its time.
    beat = re.search(r"\[tests \d+m\d\ds\] (\d)/5 done(?: \((\d) failed\))?, running \S*test_slow.py::test_slow for "
                     r"\d s", out)
    assert beat, out
    # The two rules: no reason, and a security skip, are failures with the rule named.
    assert "test_no_reason was skipped without a reason ('Skipped')" in out
    assert "security test skipped: no sandbox here" in out
    assert re.search(r"2 failed, 2 passed, 1 skipped", out), out
    assert "SKIPPED [1] test_skips.py:6: needs a thing this machine lacks" in out


def test_an_explicit_opt_out_lets_a_security_skip_stand_and_says_why(tmp_path):
    code, out = _run(tmp_path, "-n", "2", ATP_ALLOW_SECURITY_SKIPS="this CI has no user namespaces")
    assert code == 1 and re.search(r"1 failed, 2 passed, 2 skipped", out), out
    assert "security skips allowed by ATP_ALLOW_SECURITY_SKIPS: this CI has no user namespaces" in out
