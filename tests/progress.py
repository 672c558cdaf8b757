"""A pytest plugin for runs that a person (or CI's log) watches (issue 20):

* **Progress that moves.** Every ``ATP_TEST_HEARTBEAT_S`` seconds (default 60; 0
  turns it off) one line on stderr says how long the run has taken and what it is
  doing: ``collecting: 41 files, 612 tests so far`` or ``812/1,856 done (3 failed),
  running tests/scale/test_cluster_load.py::test_x for 95 s``. A stretch of dots
  that stops, or 89 s of collection with nothing on screen, is no longer silent.
  Collection ends with ``collected N tests in S s``.
* **No silent skips.** A skip must say why: a test skipped with pytest's generic
  reason (``Skipped``, ``unconditional skip``, an empty one) is reported as a
  failure naming the rule. A skip in ``tests/security/`` is a failure too — a
  protection whose test cannot run here is not known to hold — unless the run
  opts out explicitly with ``ATP_ALLOW_SECURITY_SKIPS=<why>``, whose text is
  printed in the summary.

Under pytest-xdist (``scripts/test.sh`` runs ``-n``) the heartbeat runs in the
controller only: it counts what the workers report and names the longest-running
of the tests in flight; the skip rules run in the workers, whose (rewritten)
reports the controller prints.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

_GENERIC_SKIP_REASONS = {"", "skipped", "unconditional skip", "skipped: skipped"}


class _Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.phase = "starting"
        self.files = 0
        self.collected = 0
        self.total = 0
        self.done = 0
        self.failed = 0
        self.running: dict[str, float] = {}  # node id → when it started (several under xdist)
        self.workers = 0  # xdist workers that finished collecting (0: a serial run)
        self.stop = threading.Event()

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.t0)
        head = f"[tests {elapsed // 60}m{elapsed % 60:02d}s]"
        if self.phase == "collecting":
            return f"{head} collecting: {self.files:,} files, {self.collected:,} tests so far"
        if self.phase == "workers":
            return f"{head} starting workers: {self.workers} collected {self.total:,} tests"
        failed = f" ({self.failed} failed)" if self.failed else ""
        running = dict(self.running)  # the controller's reader thread may change it
        if not running:
            return f"{head} {self.done:,}/{self.total:,} done{failed}"
        nodeid, t0 = min(running.items(), key=lambda kv: kv[1])
        more = f" and {len(running) - 1} more" if len(running) > 1 else ""
        return (f"{head} {self.done:,}/{self.total:,} done{failed}, running {nodeid} for "
                f"{int(time.monotonic() - t0)} s{more}")

    def beat(self, every: float, fd: int) -> None:
        while not self.stop.wait(every):
            try:
                os.write(fd, ("\n" + self.line() + "\n").encode())
            except OSError:
                return


_progress = _Progress()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    every = float(os.environ.get("ATP_TEST_HEARTBEAT_S", "60") or 0)
    if _is_xdist_worker(session.config):
        return  # the controller beats for the whole run
    dist = getattr(session.config.option, "dist", "no")
    _progress.phase = "workers" if dist and dist != "no" else "collecting"
    if every > 0 and not session.config.option.collectonly:
        threading.Thread(target=_progress.beat, args=(every, _terminal_fd(session.config)), name="test-heartbeat",
                         daemon=True).start()


def _terminal_fd(config: pytest.Config) -> int:
    """The run's real stderr: while a test runs, pytest's fd-level capture has fd 2
    pointing at a temporary file and keeps the terminal's in a saved descriptor."""
    capman = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capman, "_global_capturing", None), "err", None)
    saved = getattr(err, "targetfd_save", None)
    return saved if isinstance(saved, int) else 2


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.nodeid.endswith(".py"):
        _progress.files += 1
    _progress.collected += sum(1 for r in report.result if isinstance(r, pytest.Item))


def pytest_collection_finish(session: pytest.Session) -> None:
    if _is_xdist_worker(session.config):
        return  # the controller says it once (pytest_xdist_node_collection_finished)
    _progress.total = len(session.items)
    _progress.phase = "running"
    elapsed = time.monotonic() - _progress.t0
    sys.stderr.write(f"collected {len(session.items):,} tests in {elapsed:.1f} s\n")
    sys.stderr.flush()


@pytest.hookimpl(optionalhook=True)  # defined by pytest-xdist
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """xdist's controller: a worker collected ``ids`` (every worker collects all)."""
    _progress.workers += 1
    _progress.total = len(ids)
    if _progress.phase == "workers":
        _progress.phase = "running"
        sys.stderr.write(f"collected {len(ids):,} tests in {time.monotonic() - _progress.t0:.1f} s (a worker)\n")
        sys.stderr.flush()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _progress.running[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _progress.done += 1
    _progress.running.pop(nodeid, None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Failures counted where reports arrive: the run's process, or xdist's controller."""
    if report.failed:
        _progress.failed += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report).strip()
    refusal = None
    if reason.lower() in _GENERIC_SKIP_REASONS:
        refusal = (f"{item.nodeid} was skipped without a reason ({reason or 'empty'!r}): every skip states why "
                   "(tests/progress.py)")
    elif item.nodeid.startswith("tests/security/") and not os.environ.get("ATP_ALLOW_SECURITY_SKIPS"):
        refusal = (f"security test skipped: {reason}. A protection whose test cannot run here is not known to "
                   "hold; fix the environment, or opt out with ATP_ALLOW_SECURITY_SKIPS=<why> (tests/progress.py)")
    if refusal is not None:
        report.outcome = "failed"
        report.longrepr = refusal


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(longrepr or "")


def pytest_terminal_summary(terminalreporter: object) -> None:
    _progress.stop.set()
    why = os.environ.get("ATP_ALLOW_SECURITY_SKIPS")
    if why:
        terminalreporter.write_line(f"security skips allowed by ATP_ALLOW_SECURITY_SKIPS: {why}")  # type: ignore[attr-defined]
