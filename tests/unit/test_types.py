"""`mypy --strict` on the sans-IO packages (issue 21), as CI runs it: ``python -m mypy``
from the repository root, everything else from the ``[tool.mypy]`` section of
pyproject.toml (the packages in ``files``, ``strict``, atp.* resolved from the tree and
not from the SDK's installed ``atp/__init__.py``). The cache is the repository's
``.mypy_cache``: about 1 s cold, 0.1 s warm."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The packages held to ``--strict``.
PACKAGES = ("atp/wire", "atp/flow", "atp/consensus")
#: Strict errors the check reports; the canary below hides one of each in every package.
_CANARY = '''\
def untyped(x):  # disallow_untyped_defs
    return x


def loose() -> list:  # disallow_any_generics
    return []
'''


def _mypy(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )


def _source_files(root: Path) -> int:
    return sum(1 for p in PACKAGES for _ in (root / p).rglob("*.py"))


def test_the_config_checks_the_sans_io_packages_strictly() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert tuple(config["files"]) == PACKAGES
    assert config["strict"] is True
    assert config["explicit_package_bases"] is True and config["mypy_path"] == "."


def test_the_sans_io_packages_are_strict_clean() -> None:
    r = _mypy(ROOT)
    assert r.returncode == 0, f"mypy --strict on {', '.join(PACKAGES)}:\n{r.stdout}{r.stderr}"
    # Every module of the packages was checked: none missed by the config or found elsewhere.
    assert f"Success: no issues found in {_source_files(ROOT)} source files" in r.stdout, r.stdout


def test_the_check_reports_a_strict_error_in_every_package(tmp_path: Path) -> None:
    """A copy of the packages and the config, with one module in each package that only
    ``--strict`` rejects: each error is reported at the copy's path, and nothing else."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for p in PACKAGES:
        shutil.copytree(ROOT / p, tmp_path / p, ignore=shutil.ignore_patterns("__pycache__"))
        (tmp_path / p / "canary.py").write_text(_CANARY)
    r = _mypy(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = sorted(line for line in r.stdout.splitlines() if ": error: " in line)
    assert errors == sorted(
        e
        for p in PACKAGES
        for e in (
            f"{p}/canary.py:1: error: Function is missing a type annotation  [no-untyped-def]",
            f'{p}/canary.py:5: error: Missing type arguments for generic type "list"  [type-arg]',
        )
    ), r.stdout
    assert r.stdout.rstrip().endswith(f"in {len(PACKAGES)} files (checked {_source_files(tmp_path)} source files)")
