"""One import name per distribution (issue 21 item 6): the client SDK (``atp-sdk``,
sdk/python) alone owns the top-level ``atp``; the router (``atp-router``, this
repository's root) is ``atp_router``. So both install side by side in any order,
editable or not, and ``import atp; atp.Client`` is the SDK's wherever the router is.

Before, the router was a namespace portion of ``atp`` (``atp/`` without an
``__init__.py``): with the SDK installed editable (setuptools' finder, which the
import system asks only after the path finder) and the router's tree on
``sys.path``, ``import atp`` was the router's namespace package, without
``Client``. The probe below runs in a fresh interpreter without site-packages
(``-I -S``: the venv's own installed copy of the SDK would hide what is checked)
and resolves the names as the import system does, without executing the modules,
over a mirror of the two directories: the root's top-level directories that hold
Python sources (a directory left holding only ``__pycache__`` is no install's).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "sdk" / "python"

#: Run with ``-I -S``: argv = sdk dir, repository root, mode. ``finder``: the SDK as
#: an editable install maps it (a meta-path finder after the path finder), the root
#: on sys.path; ``sdk-first`` / ``root-first``: both directories on sys.path, in
#: that order (an install that puts each distribution's directory on sys.path).
_PROBE = r"""
import importlib.abc, importlib.util, json, sys

sdk, root, mode = sys.argv[1:4]


class SdkEditableFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "atp":
            return importlib.util.spec_from_file_location(
                "atp", f"{sdk}/atp/__init__.py", submodule_search_locations=[f"{sdk}/atp"])
        return None


if mode == "finder":
    sys.path.insert(0, root)
    sys.meta_path.append(SdkEditableFinder())
else:
    sys.path[:0] = [sdk, root] if mode == "sdk-first" else [root, sdk]


def where(name):
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as e:
        return {"error": repr(e)}
    if spec is None:
        return None
    return {"origin": spec.origin, "path": list(spec.submodule_search_locations or [])}


print(json.dumps({name: where(name) for name in ("atp", "atp_router", "atp_router.wire.frame")}))
"""

#: With the interpreter's packages (the SDK needs httpx): both directories first on
#: sys.path, in the order given; ``import atp`` and the router's frame module.
_IMPORT = r"""
import json, sys

sdk, root, order = sys.argv[1:4]
sys.path[:0] = [sdk, root] if order == "sdk-first" else [root, sdk]
import atp
import atp_router.wire.frame

print(json.dumps({"atp": atp.__file__, "client": atp.Client.__module__, "path": list(atp.__path__),
                  "frame": atp_router.wire.frame.__file__, "Frame": hasattr(atp_router.wire.frame, "Frame")}))
"""


def _run(code: str, sdk: Path, root: Path, mode: str, *flags: str) -> dict:
    r = subprocess.run([sys.executable, *flags, "-c", code, str(sdk), str(root), mode],
                       capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _has_sources(d: Path) -> bool:
    return any(d.glob("*.py")) or any(d.glob("*/*.py"))


def _mirror(src: Path, dst: Path) -> Path:
    """``dst`` with a link to each top-level directory and module of ``src`` that holds
    Python sources (no hidden ones: not the .venv)."""
    dst.mkdir()
    for child in src.iterdir():
        if not child.name.startswith(".") and (child.suffix == ".py" or (child.is_dir() and _has_sources(child))):
            (dst / child.name).symlink_to(child)
    return dst


@pytest.mark.parametrize("mode", ["finder", "sdk-first", "root-first"])
def test_atp_is_the_sdk_and_atp_router_the_router_however_both_are_installed(mode: str, tmp_path: Path) -> None:
    sdk, root = _mirror(SDK, tmp_path / "sdk"), _mirror(ROOT, tmp_path / "root")
    assert (sdk / "atp").is_dir()
    found = _run(_PROBE, sdk, root, mode, "-I", "-S")
    assert found["atp"] == {"origin": str(sdk / "atp" / "__init__.py"), "path": [str(sdk / "atp")]}, found
    assert found["atp_router"] == {"origin": str(root / "atp_router" / "__init__.py"),
                                   "path": [str(root / "atp_router")]}, found
    assert found["atp_router.wire.frame"]["origin"] == str(root / "atp_router" / "wire" / "frame.py"), found


@pytest.mark.parametrize("order", ["sdk-first", "root-first"])
def test_import_atp_gives_the_client_beside_the_router(order: str) -> None:
    out = _run(_IMPORT, SDK, ROOT, order)
    assert out["atp"] == str(SDK / "atp" / "__init__.py") and out["client"] == "atp._client", out
    assert out["path"] == [str(SDK / "atp")], out  # a plain package: nothing extends it
    assert out["frame"] == str(ROOT / "atp_router" / "wire" / "frame.py") and out["Frame"], out


def _setuptools_wheels() -> Path | None:
    """A directory holding a setuptools wheel new enough for pyproject.toml's
    ``[build-system]`` (>= 68) in pip's cache, so the build needs no index; None
    when the cache has none."""
    r = subprocess.run([sys.executable, "-m", "pip", "cache", "list", "setuptools", "--format", "abspath"],
                       capture_output=True, text=True, timeout=60, check=False)
    best: tuple[tuple[int, ...], Path] | None = None
    for line in r.stdout.splitlines():
        wheel = Path(line.strip())
        version = wheel.name.split("-")[1] if wheel.name.count("-") >= 2 else ""
        key = tuple(int(p) for p in version.split(".") if p.isdigit())
        if wheel.is_file() and key >= (68,) and (best is None or key > best[0]):
            best = (key, wheel.parent)
    return None if best is None else best[1]


@pytest.mark.parametrize("first", ["sdk", "router"])
def test_editable_installs_of_both_in_either_order(first: str, tmp_path: Path) -> None:
    """``pip install -e`` of the SDK and of the router (copies of both, so the
    repository gets no build files) into a new venv, in the order given: ``atp``
    is the SDK's package and ``atp_router.wire.frame`` the router's module (looked
    up, not imported: the venv has no dependencies, ``--no-deps``)."""
    wheels = _setuptools_wheels()
    if wheels is None:
        pytest.skip("pip's cache has no setuptools >= 68 wheel: the editable builds would need the index")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "atp_router", src / "atp_router", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SDK, src / "sdk" / "python", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    projects = [src / "sdk" / "python", src] if first == "sdk" else [src, src / "sdk" / "python"]
    for project in projects:
        r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                            "--find-links", str(wheels), "--no-deps", "-e", str(project)],
                           capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
    probe = ("import importlib.util as u, json; s = u.find_spec('atp'); "
             "print(json.dumps([s.origin, list(s.submodule_search_locations), u.find_spec('atp_router.wire.frame').origin]))")
    r = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sdk = src / "sdk" / "python" / "atp"
    assert json.loads(r.stdout) == [str(sdk / "__init__.py"), [str(sdk)], str(src / "atp_router" / "wire" / "frame.py")]
