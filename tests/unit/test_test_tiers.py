"""The test tiers of tests/conftest.py: which tests `scripts/test.sh --fast` leaves
out (``peers``, ``model``, ``slow``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, SLOW_TESTS, _read_slow_tests, _tiers_reached
from tests.peers import free_port


def _needs_broker() -> None:
    if os.environ.get("ATP_REQUIRE_PEERS") == "1":
        pytest.fail("no broker")


def _needs_model() -> None:
    if os.environ.get("ATP_REQUIRE_MODEL") == "1":
        pytest.fail("no model")


@contextlib.contextmanager
def _start_broker() -> Iterator[int]:
    _needs_broker()
    yield free_port()


def _broker_fixture() -> Iterator[int]:
    with _start_broker() as port:
        yield port


def _model_and_broker_test() -> None:
    _needs_model()
    helper = lambda: _broker_fixture()  # reached from nested code too
    helper()


def _plain_test() -> None:
    assert free_port() > 0


def _recursive(n: int) -> int:
    return 0 if n == 0 else _recursive(n - 1)


def test_a_test_reaching_a_peer_check_through_helpers_gets_its_tier():
    assert _tiers_reached(_needs_broker) == {"peers"}
    assert _tiers_reached(_broker_fixture) == {"peers"}  # through a @contextmanager
    assert _tiers_reached(_model_and_broker_test) == {"peers", "model"}


def test_a_test_reaching_no_peer_check_stays_in_the_fast_tier():
    assert _tiers_reached(_plain_test) == set()
    assert _tiers_reached(_recursive) == set()


PRINT_MARKERS = """
def pytest_collection_finish(session):
    for item in session.items:
        print("TIER", item.nodeid.split("[", 1)[0], *sorted({m.name for m in item.iter_markers()}))
"""


def _tiers(tmp_path, *files: str) -> dict[str, set[str]]:
    """Each test of ``files`` → its markers, as a separate pytest collects them."""
    (tmp_path / "print_markers.py").write_text(PRINT_MARKERS)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "print_markers", *files], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout
    tiers: dict[str, set[str]] = {}
    for line in out.splitlines():
        if line.startswith("TIER "):
            test, *markers = line.split()[1:]
            tiers.setdefault(test, set()).update(markers)
    return tiers


@pytest.mark.slow
def test_the_fast_tier_leaves_out_peer_model_and_listed_slow_tests(tmp_path):
    tiers = _tiers(tmp_path, "tests/unit/test_mqtt_client.py", "tests/unit/test_openai_compat.py",
                   "tests/unit/test_codec.py", "tests/unit/test_tools_analysers.py")
    # tests that start mosquitto: through the module's `broker` fixture, or in their body
    assert "peers" in tiers["tests/unit/test_mqtt_client.py::test_qos1_publish_waits_for_puback_and_messages_arrive_in_order"]
    assert "peers" in tiers["tests/unit/test_mqtt_client.py::test_password_authentication"]
    assert not tiers["tests/unit/test_mqtt_client.py::test_broker_urls"] & {"peers", "model", "slow"}
    assert "model" in tiers["tests/unit/test_openai_compat.py::test_streams_partials_then_a_priced_final"]
    codec = {t: m for t, m in tiers.items() if t.startswith("tests/unit/test_codec.py")}
    assert codec and not any(m & {"peers", "model", "slow"} for m in codec.values())  # sans-IO
    slow = _read_slow_tests()
    assert "slow" in tiers["tests/unit/test_tools_analysers.py::test_semgrep_known_defects_packs_and_exclusions"]
    assert all("slow" in m for t, m in tiers.items() if t in slow)


def test_the_slow_list_names_tests_that_exist():
    listed = _read_slow_tests()
    assert listed, SLOW_TESTS
    missing = sorted(t for t in listed if not (ROOT / t.split("::", 1)[0]).exists())
    assert not missing, f"{SLOW_TESTS} names files that are gone: {missing}"
