"""``atp-router review`` (issue 24 item 2; atp_router/deploy/review_cmd.py), run as a user
runs it: the real command in a real git repository made here, reviewed by a real
router — one the command starts on the default RIB (the real analysers: ruff,
bandit, semgrep, mypy in their sandbox), or a running one given by ``--url`` — and
the examples that use it: the pre-commit hook (a real ``git commit``) and the CI
job script.

The planted defect is ``subprocess.call(cmd, shell=True)`` on a parameter: a
command built at run time runs through a shell (OS command injection), which the
analysers report as high. Every SARIF log written is validated against the official
SARIF 2.1.0 JSON schema with ``jsonschema`` (the OASIS schema, installed by
``scripts/peers/sarif-schema.sh`` from Microsoft's SARIF Multitool package), then
checked for what the command promises beyond it (:func:`check_sarif`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import trio

from atp_router.deploy.review_cmd import SEVERITIES, failing, render_sarif
from tests.conftest import start_router
from tests.peers import _peer_unavailable

ROOT = Path(__file__).resolve().parents[2]
ATP = str(Path(sys.executable).parent / "atp-router")
CLEAN = 'import subprocess\n\n\ndef run(cmd):\n    return subprocess.call(["ls", cmd])\n'
DEFECT = 'import subprocess\n\n\ndef run(cmd):\n    return subprocess.call(cmd, shell=True)\n'
SARIF_SCHEMA = ROOT / ".peers" / "sarif" / "sarif-2.1.0.json"
CLEAN_CHANGE = 'import subprocess\n\n\ndef run(cmd):\n    return subprocess.call(["ls", "-l", cmd])\n'


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    """A repository whose ``main`` has app.py without the defect."""
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "dev@example.invalid")
    git(path, "config", "user.name", "dev")
    (path / "app.py").write_text(CLEAN)
    git(path, "add", "app.py")
    git(path, "commit", "-qm", "init")
    return path


def review(repo: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ATP, "review", *args], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def sarif_schema_errors(doc: dict) -> list[str]:
    """Where ``doc`` breaks the official SARIF 2.1.0 JSON schema (draft 2020-12),
    one line an error; a missing schema skips the test (fails under
    ``ATP_REQUIRE_PEERS=1``, as CI runs)."""
    if not SARIF_SCHEMA.is_file():
        _peer_unavailable("the SARIF 2.1.0 schema", f"{SARIF_SCHEMA} is missing (run scripts/peers/sarif-schema.sh)")
    schema = json.loads(SARIF_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def check_sarif(doc: dict) -> list[dict]:
    """``doc`` valid against the official SARIF 2.1.0 schema, and what SARIF 2.1.0
    requires beyond the schema of the objects :func:`render_sarif` writes
    (§3.13 sarifLog, §3.14 run, §3.19 toolComponent, §3.27 result, §3.28
    location, §3.30 region, §3.49 reportingDescriptor); returns the results."""
    assert sarif_schema_errors(doc) == []
    assert doc["version"] == "2.1.0" and isinstance(doc["runs"], list) and len(doc["runs"]) == 1
    run = doc["runs"][0]
    driver = run["tool"]["driver"]
    assert isinstance(driver["name"], str) and driver["name"]
    rule_ids = [r["id"] for r in driver["rules"]]
    assert len(rule_ids) == len(set(rule_ids))
    for r in run["results"]:
        assert isinstance(r["message"]["text"], str) and r["message"]["text"]
        assert r["level"] in ("none", "note", "warning", "error")
        assert r["ruleId"] in rule_ids
        for loc in r["locations"]:
            phys = loc["physicalLocation"]
            assert not phys["artifactLocation"]["uri"].startswith("/")  # relative to the repository
            region = phys["region"]
            assert isinstance(region["startLine"], int) and 1 <= region["startLine"] <= region["endLine"]
    return run["results"]


def test_the_working_tree_with_a_planted_defect_exits_1_with_sarif_and_a_clean_one_exits_0(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "app.py").write_text(DEFECT)
    out = review(repo, "--format", "sarif", "--output", str(tmp_path / "r.sarif"))
    assert out.returncode == 1, out.stderr
    assert "at or above high" in out.stderr and "cost:" in out.stderr and out.stdout == ""
    results = check_sarif(json.loads((tmp_path / "r.sarif").read_text()))
    shell = [r for r in results if r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "app.py"
             and r["locations"][0]["physicalLocation"]["region"]["startLine"] == 5]
    assert shell and shell[0]["level"] == "error" and shell[0]["properties"]["severity"] in ("high", "critical")
    text = review(repo)  # the default format: a line a finding, then the cost
    assert text.returncode == 1 and "app.py:5" in text.stdout and text.stdout.rstrip().splitlines()[-1].startswith(
        "cost:")
    (repo / "app.py").write_text(CLEAN_CHANGE)
    clean = review(repo, "--format", "json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["final"]["result"]["findings"] == []
    git(repo, "checkout", "-q", "app.py")
    nothing = review(repo)
    assert nothing.returncode == 0 and "nothing to review" in nothing.stderr


def test_the_pre_commit_hook_refuses_a_commit_with_the_defect_and_lets_a_clean_one_in(tmp_path):
    repo = make_repo(tmp_path / "repo")
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text((ROOT / "examples" / "review" / "pre-commit").read_text())
    hook.chmod(0o755)
    env = {**os.environ, "ATP_ROUTER": ATP}
    (repo / "app.py").write_text(DEFECT)
    git(repo, "add", "app.py")
    refused = subprocess.run(["git", "-C", str(repo), "commit", "-qm", "shell"], capture_output=True, text=True,
                             env=env, timeout=300)
    assert refused.returncode != 0 and "app.py:5" in refused.stdout + refused.stderr, refused
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "1"  # not committed
    (repo / "app.py").write_text(CLEAN_CHANGE)
    git(repo, "add", "app.py")
    ok = subprocess.run(["git", "-C", str(repo), "commit", "-qm", "clean"], capture_output=True, text=True,
                        env=env, timeout=300)
    assert ok.returncode == 0, ok
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "2"


def test_the_ci_job_reviews_the_branch_since_its_base_and_writes_sarif(tmp_path):
    repo = make_repo(tmp_path / "repo")
    git(repo, "checkout", "-qb", "feature")
    (repo / "app.py").write_text(DEFECT)
    git(repo, "commit", "-qam", "shell")
    (repo / "app.py").write_text(CLEAN)  # an uncommitted fix is not what the branch brings
    job = subprocess.run(["bash", str(ROOT / "examples" / "review" / "ci-review.sh")], cwd=repo, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "ATP_ROUTER": ATP, "ATP_BASE": "main"})
    assert job.returncode == 1, job
    assert "findings at or above high" in job.stdout
    results = check_sarif(json.loads((repo / "atp-review.sarif").read_text()))
    assert any(r["locations"][0]["physicalLocation"]["region"]["startLine"] == 5 for r in results)


async def test_a_diff_file_through_a_running_router_and_the_errors_exit_2(nursery, policies_dir, tmp_path):
    env = await start_router(nursery, policies_dir)
    repo = make_repo(tmp_path / "repo")
    (repo / "app.py").write_text(DEFECT)
    (tmp_path / "change.diff").write_text(git(repo, "diff"))
    out = await trio.to_thread.run_sync(lambda: review(repo, "--diff", str(tmp_path / "change.diff"), "--url", env.url,
                                                       "--fail-on", "critical", "--format", "json"))
    assert out.returncode in (0, 1), out.stderr
    found = json.loads(out.stdout)["final"]["result"]["findings"]
    assert any(f["file"] == "app.py" and f["span"].startswith("5") for f in found)
    assert out.returncode == (1 if failing(found, "critical") else 0)
    outside = await trio.to_thread.run_sync(lambda: review(tmp_path))  # not a repository
    assert outside.returncode == 2 and "not inside a git repository" in outside.stderr
    down = await trio.to_thread.run_sync(lambda: review(repo, "--url", "http://127.0.0.1:9"))
    assert down.returncode == 2 and "cannot be reached" in down.stderr
    bad_base = await trio.to_thread.run_sync(lambda: review(repo, "--base", "no-such-ref"))
    assert bad_base.returncode == 2 and "git diff" in bad_base.stderr


@pytest.mark.parametrize(("span", "lines"), [("5-5", (5, 5)), ("3-9", (3, 9)), ("7", (7, 7)), ("0-2", (1, 2))])
def test_sarif_regions_and_levels(span, lines):
    final = {"result": {"findings": [{"id": "F-1", "severity": "medium", "file": "a.py", "span": span,
                                      "claim": "c", "confidence": 0.5, "provenance": ["sec.bandit#1", "lint.ruff#2"]}]},
             "telemetry": {"tokens": 3, "usd": 0.0}}
    results = check_sarif(render_sarif({"stream_id": "s", "final": final}, "0"))
    region = results[0]["locations"][0]["physicalLocation"]["region"]
    assert (region["startLine"], region["endLine"]) == lines
    assert results[0]["level"] == "warning" and results[0]["ruleId"] == "sec.bandit"


def test_the_schema_check_catches_what_breaks_sarif():
    final = {"result": {"findings": [{"id": "F-1", "severity": "high", "file": "a.py", "span": "2-3",
                                      "claim": "c", "confidence": 0.5, "provenance": ["sec.bandit#1"]}]},
             "telemetry": {"tokens": 3, "usd": 0.0}}
    good = render_sarif({"stream_id": "s", "final": final}, "0")
    assert sarif_schema_errors(good) == []
    bad_level = json.loads(json.dumps(good))
    bad_level["runs"][0]["results"][0]["level"] = "fatal"
    no_version = {k: v for k, v in good.items() if k != "version"}
    zero_line = json.loads(json.dumps(good))
    zero_line["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    unknown = {**good, "atp_cost": 1}
    for broken, where in ((bad_level, "runs/0/results/0/level"), (no_version, ""),
                          (zero_line, "runs/0/results/0/locations/0/physicalLocation/region/startLine"),
                          (unknown, "")):
        errors = sarif_schema_errors(broken)
        assert errors and any(e.startswith(f"{where}: ") for e in errors), errors


def test_fail_on_counts_the_severities_at_or_above():
    found = [{"severity": s} for s in SEVERITIES]
    assert [len(failing(found, s)) for s in SEVERITIES] == [5, 4, 3, 2, 1]


def test_a_diff_file_cannot_make_it_read_outside_the_repository(tmp_path):
    """--diff FILE names the paths: one outside the repository (``..``, absolute,
    a symlink out of it, inside .git) is not read — what is read goes to the router."""
    from atp_router.deploy.review_cmd import collect_change, parse_args

    repo = make_repo(tmp_path / "repo")
    (tmp_path / "secret.txt").write_text("TOKEN=hunter2\n")
    (repo / "link.py").symlink_to(tmp_path / "secret.txt")
    diff = "".join(f"--- a/{p}\n+++ b/{p}\n@@ -0,0 +1 @@\n+x\n" for p in (
        "../secret.txt", str(tmp_path / "secret.txt"), "link.py", ".git/config", "app.py"))
    (tmp_path / "evil.diff").write_text(diff)
    change = collect_change(parse_args(["--diff", str(tmp_path / "evil.diff")]), repo)
    assert change.files == {"app.py": CLEAN}
