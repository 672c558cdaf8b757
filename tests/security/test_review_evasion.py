"""Review evasion (issue 19, "Medium — review evasion"; item 4 "Suppressions
belong to the operator, not the change"), over the wire.

The attack: a change adds dangerous code and silences its reviewers with inline
``# noqa``, ``# nosec``, ``# nosemgrep``, ``# type: ignore``, ``# pylint:
disable`` and file-level ``# ruff: noqa``, ``# mypy: ignore-errors``,
``# pylint: skip-file``; the issue saw the merged findings drop from 7 to 1.

A real router (``tests.conftest.start_router``) with every analyser next-hop
(ruff, bandit, semgrep, pylint, mypy: the real binaries, in their sandbox)
reviews the hostile change and its twin without the comments (same lines): the
FINAL has the same findings for both, each of the hostile change's marked
``suppressed_by_change: true`` and none of the twin's. A RIB whose analysers
say ``allow_suppressions: true`` honours the comments: the findings they hide
are gone.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import atp
import trio

from tests.helpers import start_router_on

META = {"task_type": "code_review", "languages": ["py"]}
ANALYSERS = {"lint.ruff": "ruff", "sec.bandit": "bandit", "rules.semgrep": "semgrep", "lint.pylint": "pylint",
             "types.mypy": "mypy"}

BEFORE = '''\
"""Maintenance helpers."""
import subprocess


def run(cmd: list[str]) -> int:
    return subprocess.call(cmd)
'''

#: The change: shell injection, an unsafe YAML load, eval of input, a missing
#: attribute and a wrong return type, each reviewer silenced.
HOSTILE = '''\
# ruff: noqa
# mypy: ignore-errors
# pylint: skip-file
"""Maintenance helpers."""
import subprocess

import yaml


def run(cmd: str) -> int:
    return subprocess.call(cmd, shell=True)  # nosec


def load(data: str, n: int) -> str:
    config = yaml.load(data)  # nosemgrep
    value = eval(data)  # noqa
    n.missing  # type: ignore
    return n  # pylint: disable=eval-used
'''

_INLINE = re.compile(r"  # (nosec|nosemgrep|noqa|type: ignore|pylint: disable=\S+)$")


def _bare(text: str) -> str:
    """``text`` without its suppression comments, every line where it was."""
    lines = [_INLINE.sub("", line) for line in text.split("\n")]
    return "\n".join("# header" if re.match(r"# (ruff|mypy|pylint):", line) else line for line in lines)


def _content(after: str) -> dict:
    diff = "".join(difflib.unified_diff(BEFORE.splitlines(True), after.splitlines(True), "a/ops.py", "b/ops.py"))
    return {"diff": diff, "files": {"ops.py": after}}


def _rib(allow: bool) -> dict:
    options = {"allow_suppressions": True} if allow else {}
    agents = {name: {"layer": "L1", "tool": tool, "p95_ms": 1000, "timeout_ms": 120_000, "scope": "changed",
                     "options": dict(options)} for name, tool in ANALYSERS.items()}
    return {"agents": agents,
            "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": list(ANALYSERS),
                          "window": {"max_parallel": 5, "max_tokens": 200_000, "max_usd_micros": 50_000},
                          "consensus": "union_tiebreak", "deadline_ms": 300_000}]}


async def _final(url: str, content: dict) -> dict:
    async with atp.Client(url) as c:
        _, stream = await c.open_stream(task=META, content=content)
        with trio.fail_after(300):
            return await c.result(stream)


def _places(final: dict) -> list[tuple]:
    """Each merged finding's place, severity and reviewers (the claim is the
    tie-break of win rates, which the first FINAL moves)."""
    return [(f["file"], f["span"], f["severity"], sorted(p.split("#")[0] for p in f["provenance"]))
            for f in final["result"]["findings"]]


def _agents(final: dict) -> set[str]:
    return {p.split("#")[0] for f in final["result"]["findings"] for p in f["provenance"]}


async def test_a_change_cannot_silence_its_reviewers(nursery, tmp_path: Path) -> None:
    assert _bare(HOSTILE).count("\n") == HOSTILE.count("\n") and "noqa" not in _bare(HOSTILE)
    (tmp_path / "off").mkdir()
    env = await start_router_on(nursery, tmp_path / "off", _rib(allow=False))
    hostile = await _final(env.url, _content(HOSTILE))
    bare = await _final(env.url, _content(_bare(HOSTILE)))
    # The count stays: the same findings, at the same places, from every analyser.
    assert _places(hostile) == _places(bare)
    assert len(hostile["result"]["findings"]) >= 4, hostile
    assert _agents(hostile) == set(ANALYSERS), hostile
    # ... and the reviewer sees the author silenced each one.
    assert all(f.get("suppressed_by_change") is True for f in hostile["result"]["findings"]), hostile
    assert not any("suppressed_by_change" in f for f in bare["result"]["findings"]), bare
    # The shell injection and eval are there whatever the comments said.
    lines = {int(f["span"].split("-")[0]) for f in hostile["result"]["findings"]}
    assert {11, 15, 16, 17} <= lines, hostile

    # The operator allows suppressions: the comments are honoured again.
    (tmp_path / "allow").mkdir()
    env = await start_router_on(nursery, tmp_path / "allow", _rib(allow=True))
    allowed = await _final(env.url, _content(HOSTILE))
    assert len(allowed["result"]["findings"]) < len(hostile["result"]["findings"]), allowed
    assert not any("suppressed_by_change" in f for f in allowed["result"]["findings"]), allowed
    # ruff, pylint and mypy were silenced for the whole file, bandit's nosec and
    # semgrep's nosemgrep hid their own lines; what is left is what nothing hid.
    assert _agents(allowed) == {"sec.bandit", "rules.semgrep"}, allowed
    got = {(int(f["span"].split("-")[0]), p.split("#")[0]) for f in allowed["result"]["findings"]
           for p in f["provenance"]}
    assert (11, "sec.bandit") not in got and (15, "rules.semgrep") not in got, allowed
    assert 17 not in {line for line, _ in got}, allowed
