"""Shared fixtures: a real router (HTTP control API + WebSocket ingress) on free ports."""

from __future__ import annotations

import inspect
import os
import shutil
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from atp_router.deploy.cli import run
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.router import Router
from tests.peers import start_llama_server

#: Progress lines and the skip rules (tests/progress.py).
pytest_plugins = ["tests.progress"]

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
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


@pytest.fixture(scope="session")
def llama_base_url() -> Iterator[str]:
    """The OpenAI base URL (``http://127.0.0.1:<port>/v1``) of one llama-cpp-python
    server with SmolLM2 (:func:`tests.peers.start_llama_server`, default context)
    for the whole session: the model tests share it (a RIB on it:
    :func:`tests.helpers.model_rib`). Skips, or fails under ``ATP_REQUIRE_MODEL=1``,
    when the model cannot run here."""
    with start_llama_server() as url:
        yield url


# ------------------------------------------------------------------- test tiers
# `scripts/test.sh --fast` runs `-m "not peers and not model and not slow"`: the
# sans-IO and in-process router tests, in about a minute; `scripts/test.sh` runs all.
# The markers are given here at collection, so a new test lands in its tier without
# being marked by hand:
#
# * peers / model: the test's code — its own, its fixtures', or that of a function
#   of tests/ they call — reads ATP_REQUIRE_PEERS / ATP_REQUIRE_MODEL, the variables
#   that make a missing peer or model server fail its tests instead of skipping
#   them (tests/peers.py and every other peer fixture check them);
# * slow: the test is listed in tests/slow_tests.txt, the tests that took SLOW_S or
#   more in a full run. `ATP_UPDATE_SLOW_TESTS=1 scripts/test.sh` rewrites the list
#   from the run's times; any run names the tests outside it that took SLOW_REPORT_S
#   or more.

#: The variable a peer's fixture reads → the marker of the tests that use it.
REQUIRE_VARIABLES = {"ATP_REQUIRE_PEERS": "peers", "ATP_REQUIRE_MODEL": "model"}
SLOW_TESTS = TESTS / "slow_tests.txt"
#: A test (setup, call and teardown; its slowest parameter set) this long is slow, s.
SLOW_S = 0.5
#: ...and one this long outside the list is named at the end of the run, s.
SLOW_REPORT_S = 2.0


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _code_objects(const)


_tiers_memo: dict[types.CodeType, frozenset[str]] = {}


def _tiers_reached(func: object) -> frozenset[str]:
    """The REQUIRE_VARIABLES markers ``func`` reaches: the variable names among the
    constants of its code, and of the functions of tests/ it refers to by name."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None:
        return frozenset()
    if code in _tiers_memo:
        return _tiers_memo[code]
    _tiers_memo[code] = frozenset()  # a cycle back here adds nothing
    found: set[str] = set()
    namespace = getattr(func, "__globals__", {})
    for c in _code_objects(code):
        found.update(REQUIRE_VARIABLES[k] for k in c.co_consts if isinstance(k, str) and k in REQUIRE_VARIABLES)
        for name in c.co_names:
            target = namespace.get(name)
            if isinstance(target, types.FunctionType):
                target = inspect.unwrap(target)  # through @contextmanager and the like
                if target.__code__.co_filename.startswith(str(TESTS)):
                    found |= _tiers_reached(target)
    _tiers_memo[code] = frozenset(found)
    return _tiers_memo[code]


def _test_id(nodeid: str) -> str:
    """A test's id in tests/slow_tests.txt: its node id without parameters."""
    return nodeid.split("[", 1)[0]


def _read_slow_tests() -> set[str]:
    if not SLOW_TESTS.exists():
        return set()
    return {line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip() and line[0] != "#"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test ``peers`` / ``model`` when it reaches a REQUIRE_VARIABLES
    check, ``slow`` when tests/slow_tests.txt lists it."""
    slow = _read_slow_tests()
    for item in items:
        tiers = set()
        if isinstance(item, pytest.Function):
            tiers |= _tiers_reached(item.obj)
            for defs in item._fixtureinfo.name2fixturedefs.values():
                for fixturedef in defs:
                    tiers |= _tiers_reached(fixturedef.func)
        if _test_id(item.nodeid) in slow:
            tiers.add("slow")
        for tier in sorted(tiers - {m.name for m in item.iter_markers()}):
            item.add_marker(tier)
        _markers[_test_id(item.nodeid)] = {m.name for m in item.iter_markers()}


#: This session's tests: id → marker names, and node id → seconds spent (all phases).
_markers: dict[str, set[str]] = {}
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.skipped:
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    # Under pytest-xdist the controller never collects: a report carries its test's markers.
    _markers.setdefault(_test_id(report.nodeid), set()).update(
        k for k in report.keywords if k in {"peers", "model", "slow"})


def _test_times() -> dict[str, float]:
    """Each test that ran (passed or failed) → its slowest parameter set's time, s."""
    times: dict[str, float] = {}
    for nodeid, seconds in _durations.items():
        test = _test_id(nodeid)
        times[test] = max(times.get(test, 0.0), seconds)
    return times


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the tests outside the slow tier that took SLOW_REPORT_S or more; with
    ``ATP_UPDATE_SLOW_TESTS=1``, rewrite tests/slow_tests.txt from this run's times."""
    times, tiers = _test_times(), _markers
    fast = {t: s for t, s in times.items() if not tiers.get(t, set()) & {"peers", "model", "slow"}}
    late = sorted((t for t, s in fast.items() if s >= SLOW_REPORT_S), key=lambda t: -fast[t])
    parallel = getattr(terminalreporter.config.option, "numprocesses", None)
    if parallel and times:
        # Tests running side by side take longer each: their times are not the serial ones
        # tests/slow_tests.txt holds, so neither compare nor rewrite.
        terminalreporter.write_line(f"(times under {parallel} xdist workers: `scripts/test.sh -n 0` compares them "
                                    "with tests/slow_tests.txt; ATP_UPDATE_SLOW_TESTS=1 runs serially)")
        return
    if late and os.environ.get("ATP_UPDATE_SLOW_TESTS") != "1":
        terminalreporter.write_sep("-", f"{len(late)} test{'s' * (len(late) != 1)} outside tests/slow_tests.txt "
                                      f"took {SLOW_REPORT_S:g} s or more")
        for t in late:
            terminalreporter.write_line(f"{fast[t]:6.2f}s {t}")
        terminalreporter.write_line("(ATP_UPDATE_SLOW_TESTS=1 scripts/test.sh rewrites the list from a full run's times)")
    if os.environ.get("ATP_UPDATE_SLOW_TESTS") == "1" and times:
        peers = {t for t, m in tiers.items() if m & {"peers", "model"}}
        # a test that did not run keeps its line unless it is gone (its file, or itself
        # from its collected file); one that ran is placed by its time
        collected_files = {t.split("::")[0] for t in tiers}
        kept = {t for t in _read_slow_tests() - times.keys() if (ROOT / t.split("::")[0]).exists()
                and (t in tiers or t.split("::")[0] not in collected_files)}
        slow = kept | {t for t, s in times.items() if s >= SLOW_S}
        SLOW_TESTS.write_text(
            "# Tests that took SLOW_S (tests/conftest.py) or more in a full run on 2 cores: the\n"
            "# `slow` marker, left out of `scripts/test.sh --fast`. Written by\n"
            "# `ATP_UPDATE_SLOW_TESTS=1 scripts/test.sh` (tests that did not run keep their line).\n"
            + "".join(f"{t}\n" for t in sorted(slow - peers)))
        terminalreporter.write_line(f"tests/slow_tests.txt: {len(slow - peers)} slow tests")


@pytest.fixture
def scripted(monkeypatch):
    """RIB agents ``tool: scripted`` are served by the ScriptedAdapter stored in the
    returned dict under the agent's name (built by the adapter registry like any
    tool next-hop); see :func:`tests.helpers.serve_scripted`."""
    from tests.helpers import serve_scripted

    return serve_scripted(monkeypatch)
