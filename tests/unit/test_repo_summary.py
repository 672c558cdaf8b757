"""Repository summaries (spec §15.2): the summariser next-hop and
examples/repo_summary run as a user runs it through a real ``atp-router`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.summariser import (
    SummariserAdapter,
    SummariserLimits,
    scan_repo,
    summarise,
)
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import ClientInputError
from tests.helpers import rib_with_root, router_process
from tests.peers import start_llama_server

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "repo_summary"

PYPROJECT = """[build-system]
requires = ["setuptools"]

[project]
name = "tinytool"
description = "Counts words in files"

[project.scripts]
tinytool = "tinytool.cli:main"
"""
README = """# Tinytool

Tinytool counts the words
in your files.

## Install

pip install tinytool

## Usage
"""
CLI = '''"""Command line of tinytool. Reads files and prints counts."""

import sys


def main():
    print(len(sys.argv))


def _helper():
    pass


class Counter:
    pass


if __name__ == "__main__":
    main()
'''


def documented(tmp_path: Path) -> Path:
    repo = tmp_path / "tiny"
    (repo / "tinytool").mkdir(parents=True)
    (repo / "pyproject.toml").write_text(PYPROJECT)
    (repo / "README.md").write_text(README)
    (repo / "tinytool" / "__init__.py").write_text('"""Tinytool: word counting."""\n')
    (repo / "tinytool" / "cli.py").write_text(CLI)
    (repo / ".venv").mkdir()
    (repo / ".venv" / "junk.py").write_text('"""ignored"""\n')
    return repo


def ambiguous(tmp_path: Path) -> Path:
    repo = tmp_path / "mystery"
    repo.mkdir()
    (repo / "a.py").write_text("def f(x):\n    return x * 2\n")
    (repo / "b.py").write_text("import a\nprint(a.f(3))\n")
    return repo


def test_summary_cites_each_statement_with_true_lines(tmp_path):
    rep = summarise(scan_repo(str(documented(tmp_path))))
    cites = {(f.file, f.start, f.end): f.claim for f in rep.findings}
    assert cites[("pyproject.toml", 5, 5)] == "Name: tinytool."
    assert cites[("pyproject.toml", 6, 6)] == "Description: Counts words in files."
    assert cites[("pyproject.toml", 9, 9)] == "`tinytool` runs `tinytool.cli:main`."
    assert cites[("README.md", 3, 4)] == "README says: Tinytool counts the words in your files."
    assert ("README.md", 6, 6) in cites and ("README.md", 10, 10) in cites  # headings
    assert cites[("tinytool/cli.py", 18, 18)] == "`tinytool/cli.py` has a `__main__` block."
    mod = cites[("tinytool/cli.py", 1, 1)]
    assert mod.startswith("`tinytool/cli.py`: Command line of tinytool.") and "main, Counter" in mod
    assert "_helper" not in rep.summary and ".venv" not in rep.summary
    assert "[pyproject.toml:9-9]" in rep.summary
    assert rep.confidence is not None and rep.confidence >= 0.9


def test_an_undocumented_repo_is_ambiguous(tmp_path):
    rep = summarise(scan_repo(str(ambiguous(tmp_path))))
    assert rep.confidence is not None and rep.confidence < 0.5
    assert "unclear" in rep.summary
    assert {(f.file, f.start) for f in rep.findings} == {("a.py", 1)}  # its one public function


def test_walk_is_bounded_and_never_follows_symlinks(tmp_path):
    repo = documented(tmp_path)
    outside = tmp_path / "outside.py"
    outside.write_text('"""Secret module."""\n')
    (repo / "link.py").symlink_to(outside)
    facts = scan_repo(str(repo))
    assert "link.py" not in {m.path for m in facts.modules}
    (repo / "tinytool" / "big.py").write_text('"""Big."""\n' + "x = 1\n" * 400)
    facts = scan_repo(str(repo), SummariserLimits(max_file_bytes=1000))
    assert "tinytool/big.py" not in {m.path for m in facts.modules}
    assert any(s.startswith("tinytool/big.py:") and "max_file_bytes" in s for s in facts.skipped)
    few = scan_repo(str(repo), SummariserLimits(max_files=2))
    assert few.files_seen == 2 and few.truncated and "max_files=2" in few.truncated
    assert "covers part of the repository" in summarise(few).summary
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.py").write_text("def (:\n")
    assert scan_repo(str(broken)).unparsable == ["bad.py"]


def test_repo_paths_must_stay_inside_the_roots(tmp_path):
    repo = documented(tmp_path)
    s = SummariserAdapter("s", repo=str(repo))
    assert s.report({}).confidence >= 0.9
    for bad in (str(tmp_path), str(repo / ".." / "mystery"), "tiny", "/etc"):
        with pytest.raises(ClientInputError, match="outside the summariser's roots|absolute path"):
            s.report({"repo": bad})
    wide = SummariserAdapter("s", repo=str(repo), roots=[str(tmp_path)])
    assert wide.report({"repo": str(ambiguous(tmp_path))}).confidence < 0.5


def test_registry_validates_summariser_options(tmp_path):
    repo = str(documented(tmp_path))
    spec = dict(layer="L1", p95_ms=100, tool="summariser")
    ok = build_adapter("s", AgentSpec(**spec, options={"repo": repo, "max_files": 10}))
    assert isinstance(ok, SummariserAdapter) and ok.limits.max_files == 10
    for options, err in [({}, "options.repo: required"), ({"repo": repo, "max_bytes": 0}, "options.max_bytes"),
                         ({"repo": repo, "depth": 3}, "options.depth: unknown option"),
                         ({"repo": str(tmp_path / "nope")}, "options.repo: not a directory")]:
        with pytest.raises(ValueError, match=err):
            build_adapter("s", AgentSpec(**spec, options=options))


# ------------------------------------------------------- the example, as a user runs it


def _run(args: list[str], url: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE / "summarise.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "ATP_ROUTER_URL": url})


@pytest.fixture
def example_router(tmp_path) -> Iterator[str]:
    with router_process(rib_with_root(EXAMPLE / "rib.yaml", tmp_path), tmp_path / "state", cwd=ROOT) as url:
        yield url


def test_summarise_this_repository(example_router, tmp_path):
    r = _run([], example_router, tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Name: atp-router. [pyproject.toml:" in out
    assert "`atp-router` runs `atp_router.deploy.cli:main`." in out
    # A package's largest modules are cited (their docstrings, from line 1): the runtime's largest surely.
    largest = max((ROOT / "atp_router" / "runtime").glob("*.py"), key=lambda p: len(p.read_text().splitlines()))
    assert f"[atp_router/runtime/{largest.name}:1-" in out, out
    assert "escalated" not in out  # a documented repository needs no model
    assert "cost: tokens=0 usd=0.000000" in out


def test_summarise_a_repo_relative_to_the_callers_directory(example_router, tmp_path):
    documented(tmp_path)
    r = _run(["--repo", "tiny", "--json"], example_router, tmp_path)
    assert r.returncode == 0, r.stderr
    final = json.loads(r.stdout)
    [answer] = final["result"]["answers"]
    assert answer["agent"] == "summariser.local" and "Tinytool" in answer["text"]
    files = {f["file"] for f in final["result"]["findings"]}
    assert {"README.md", "pyproject.toml", "tinytool/cli.py"} <= files
    bad = _run(["--repo", "nowhere"], example_router, tmp_path)
    assert bad.returncode == 2 and "not a directory" in bad.stderr


def test_an_ambiguous_repo_escalates_even_without_the_model(tmp_path):
    ambiguous(tmp_path)
    rib = rib_with_root(EXAMPLE / "rib.yaml", tmp_path).read_text().replace("http://127.0.0.1:8080/v1", "http://127.0.0.1:9/v1")
    (tmp_path / "rib.yaml").write_text(rib)  # a model endpoint nothing listens on
    with router_process(tmp_path / "rib.yaml", tmp_path / "state", cwd=ROOT) as url:
        r = _run(["--repo", "mystery"], url, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ambiguous, escalated" in r.stdout and "escalated on low_conf" in r.stdout
    assert "error: EAGENTDOWN" in r.stdout  # no model server on port 8080 here


@pytest.fixture(scope="module")
def llama_url() -> Iterator[str]:
    with start_llama_server(n_ctx=4096) as url:
        yield url


@pytest.mark.model
def test_ambiguous_repo_gets_the_models_synthesis(llama_url, tmp_path):
    rib = rib_with_root(EXAMPLE / "rib.yaml", tmp_path).read_text()
    (tmp_path / "rib.yaml").write_text(rib.replace("http://127.0.0.1:8080/v1", llama_url))
    ambiguous(tmp_path)
    with router_process(tmp_path / "rib.yaml", tmp_path / "state", cwd=ROOT) as url:
        r = _run(["--repo", "mystery"], url, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "## Synthesis by planner.local (escalated on low_conf)" in r.stdout
    tokens = int(r.stdout.split("cost: tokens=")[1].split()[0])
    assert tokens > 0


def test_the_shipped_rib_refuses_a_folder_outside_its_roots(tmp_path):
    """A client cannot have an arbitrary folder of the router's machine read: the
    shipped RIB's roots are this repository and ../shared only."""
    documented(tmp_path)
    with router_process(EXAMPLE / "rib.yaml", tmp_path / "state", cwd=ROOT) as url:
        r = _run(["--repo", "tiny"], url, tmp_path)
    assert r.returncode != 0
    assert "outside the summariser's roots" in (r.stdout + r.stderr)
    assert "Tinytool" not in r.stdout
