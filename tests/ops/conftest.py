"""Operations tests: the status page in real headless Chromium, the Grafana dashboard.

Chromium is Debian's package (``scripts/peers/chromium.sh`` installs it), driven
by Playwright for Python with the system browser (``executable_path``): no
browser is downloaded. A missing Chromium or Playwright skips the browser
tests, unless ``ATP_REQUIRE_PEERS=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # The tiers of `scripts/test.sh --fast` (tests/conftest.py); registered here
    # too so these tests can name them whatever the ini file holds.
    config.addinivalue_line("markers", "peers: needs a real external peer (scripts/peers/)")
    config.addinivalue_line("markers", "slow: seconds or more per test")


CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser")


def _unavailable(reason: str) -> None:
    if os.environ.get("ATP_REQUIRE_PEERS") == "1":
        pytest.fail(f"ATP_REQUIRE_PEERS=1 but headless Chromium cannot run: {reason}", pytrace=False)
    pytest.skip(f"headless Chromium unavailable: {reason}")


@pytest.fixture
def chromium() -> Path:
    """Debian's Chromium binary, with Playwright importable; skips (fails under
    ATP_REQUIRE_PEERS=1) when either is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    found = shutil.which("chromium") or next((p for p in CHROMIUM_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        _unavailable("no chromium binary (run scripts/peers/chromium.sh)")
    return Path(found)
