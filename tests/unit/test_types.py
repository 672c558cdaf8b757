"""`mypy --strict` on the sans-IO packages, the router's data plane and its deployment modes (issue 21), as
CI runs it: ``python -m mypy`` from the repository root, everything else from the
``[tool.mypy]`` section of pyproject.toml (the packages and modules in ``files``,
``strict``, atp_router.* resolved from the tree and not from an installed copy). The cache is the repository's ``.mypy_cache``: about 15 s cold
(the data plane's and deploy's imports, the runtime's and the adapters', are followed for their types), 0.5 s warm."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The packages and modules held to ``--strict``.
PACKAGES = ("atp_router/wire", "atp_router/task", "atp_router/flow", "atp_router/consensus", "atp_router/runtime/dataplane",
            "atp_router/deploy")
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
    return sum(1 if p.endswith(".py") else sum(1 for _ in (root / p).rglob("*.py")) for p in PACKAGES)


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
    """A copy of the tree and the config, with code that only ``--strict`` rejects in each
    entry — a module ``canary.py`` in each package, appended to each module: each error
    is reported at the copy's path, and nothing else."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "atp_router", tmp_path / "atp_router", ignore=shutil.ignore_patterns("__pycache__"))
    expected = []
    for p in PACKAGES:
        if p.endswith(".py"):
            module, offset = tmp_path / p, len((ROOT / p).read_text().splitlines())
            module.write_text(module.read_text() + _CANARY)
            where = p
        else:
            (tmp_path / p / "canary.py").write_text(_CANARY)
            where, offset = f"{p}/canary.py", 0
        expected += [f"{where}:{1 + offset}: error: Function is missing a type annotation  [no-untyped-def]",
                     f'{where}:{5 + offset}: error: Missing type arguments for generic type "list"  [type-arg]']
    r = _mypy(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = sorted(line for line in r.stdout.splitlines() if ": error: " in line)
    assert errors == sorted(expected), r.stdout
    assert r.stdout.rstrip().endswith(f"in {len(PACKAGES)} files (checked {_source_files(tmp_path)} source files)")
