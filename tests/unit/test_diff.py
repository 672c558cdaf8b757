"""atp_router.task.diff against real diffs: the golden tasks, real ``git diff`` output in
its many shapes, and difflib's unified diffs under Hypothesis."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.task.diff import FileDiff, changed_lines, diff_loc, parse_diff

GOLDEN = Path("/work/shared/golden/dev.jsonl")


def _lines(text: str) -> list[str]:
    # str.splitlines also splits on \f, \x1c, \u2028 ..., which git does not.
    return re.split(r"\r?\n", text)


def _check_against(fd: FileDiff, after: str | None, before: str | None = None) -> None:
    """Every body line sits at its number in the after (and before) text."""
    new_lines = _lines(after) if after is not None else None
    old_lines = _lines(before) if before is not None else None
    for h in fd.hunks:
        for dl in h.lines:
            if dl.new is not None and new_lines is not None:
                assert new_lines[dl.new - 1].rstrip("\r") == dl.text, (fd.path, dl)
            if dl.old is not None and old_lines is not None:
                assert old_lines[dl.old - 1].rstrip("\r") == dl.text, (fd.path, dl)
        assert sum(dl.kind != "-" for dl in h.lines) == h.new_count
        assert sum(dl.kind != "+" for dl in h.lines) == h.old_count


def _golden() -> list[dict]:
    return [json.loads(line) for line in GOLDEN.read_text().splitlines()]


@pytest.mark.parametrize("task", _golden(), ids=lambda t: t["id"])
def test_golden_diff_matches_after_files(task: dict) -> None:
    diffs = parse_diff(task["diff"])
    assert diffs and {d.path for d in diffs} == set(task["files"])
    for fd in diffs:
        assert fd.status == "modified"
        _check_against(fd, task["files"][fd.path])
        assert fd.added == {dl.new for h in fd.hunks for dl in h.lines if dl.kind == "+"}
    # diff_loc counts body lines, independently of the parser's bookkeeping.
    body = [ln for ln in task["diff"].split("\n") if ln[:1] in ("+", "-") and not ln.startswith(("+++ ", "--- "))]
    assert diff_loc(diffs) == len(body)
    # Every labelled defect lies within ±3 lines of what the diff touched, omissions
    # included: that is what the deletion anchors are for.
    touched = changed_lines(diffs)
    for exp in task["expected"]:
        assert any(exp["start"] - 3 <= n <= exp["end"] + 3 for n in touched[exp["file"]]), exp


def test_golden_deletion_anchors() -> None:
    task = next(t for t in _golden() if t["id"] == "cve-9c528670c455")
    by_path = {d.path: d for d in parse_diff(task["diff"])}
    # Two imports deleted between lines 11 and 12: the anchor is the line now there.
    assert 12 in by_path["jwt/algorithms.py"].deleted_at
    # 60 lines deleted at end of file: the anchor is the last surviving line.
    utils = by_path["jwt/utils.py"]
    assert max(utils.deleted_at) == len(task["files"]["jwt/utils.py"].rstrip("\n").split("\n")) == 99
    assert utils.removed == 61 and not utils.added


# --- real git output ----------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "core.quotePath=true", *args], cwd=repo, check=True, capture_output=True
    ).stdout.decode("utf-8", "surrogateescape")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.invalid")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "keep.py").write_text("".join(f"line {i}\n" for i in range(1, 31)))
    (tmp_path / "gone.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "old name.py").write_text("".join(f"r{i}\n" for i in range(1, 21)))
    (tmp_path / "crlf.py").write_bytes(b"a = 1\r\nb = 2\r\nc = 3\r\n")
    (tmp_path / "nonl.py").write_text("p = 1\nq = 2")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    (tmp_path / "mode.sh").write_text("echo hi\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "base")
    keep = [f"line {i}" for i in range(1, 31)]
    keep[4] = "line 5 changed"
    del keep[19:21]  # old lines 20-21 deleted, nothing added there
    keep.insert(0, "# header")
    (tmp_path / "keep.py").write_text("\n".join(keep) + "\n")
    (tmp_path / "gone.py").unlink()
    (tmp_path / "new dir").mkdir()
    (tmp_path / "new dir" / "fresh é.py").write_text("import os\nprint(os.sep)\n")
    (tmp_path / "old name.py").rename(tmp_path / "new name.py")
    (tmp_path / "new name.py").write_text("".join(f"r{i}\n" for i in range(1, 21)).replace("r10\n", "r10 edited\n"))
    (tmp_path / "crlf.py").write_bytes(b"a = 1\r\nb = 20\r\nc = 3\r\n")
    (tmp_path / "nonl.py").write_text("p = 1\nq = 3")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x03\x02" * 10)
    (tmp_path / "mode.sh").chmod(0o755)
    _git(tmp_path, "add", "-A")
    return tmp_path


def _after(repo: Path, fd: FileDiff) -> str:
    return (repo / fd.path).read_bytes().decode("utf-8")


def _before(repo: Path, fd: FileDiff) -> str | None:
    if fd.old_path is None:
        return None
    return _git(repo, "show", f"HEAD:{fd.old_path}")


@pytest.mark.parametrize(
    "opts",
    [
        [],
        ["--no-prefix"],
        ["-c", "diff.mnemonicPrefix=true"],
        ["--src-prefix=c/", "--dst-prefix=i/"],
        ["-U0"],
        ["-U10"],
        ["--no-renames"],
    ],
    ids=["default", "no-prefix", "mnemonic", "c-i", "U0", "U10", "no-renames"],
)
def test_real_git_diff_shapes(repo: Path, opts: list[str]) -> None:
    config = [o for o in opts if o.startswith("diff.")]
    flags = [o for o in opts if o != "-c" and not o.startswith("diff.")]
    text = _git(repo, *(["-c", config[0]] if config else []), "diff", "--cached", *flags)
    diffs = {d.path: d for d in parse_diff(text)}
    assert "blob.bin" not in diffs  # binary skipped
    for fd in diffs.values():
        after = None if fd.status == "deleted" else _after(repo, fd)
        _check_against(fd, after, _before(repo, fd))
    assert diffs["gone.py"].status == "deleted" and diffs["gone.py"].old_path == "gone.py"
    assert diffs["new dir/fresh é.py"].status == "added" and diffs["new dir/fresh é.py"].added == {1, 2}
    assert diffs["mode.sh"].status == "modified" and not diffs["mode.sh"].hunks
    keep = diffs["keep.py"]
    assert keep.added == {1, 6}
    assert keep.deleted_at == ({20} if "-U0" in flags else {21})
    assert diffs["crlf.py"].added == {2} and diffs["crlf.py"].hunks[0].lines[-1].text in ("c = 3", "b = 20")
    assert diffs["nonl.py"].added == {2} and diffs["nonl.py"].removed == 1
    if "--no-renames" in flags:
        assert diffs["new name.py"].status == "added" and diffs["old name.py"].status == "deleted"
    else:
        assert diffs["new name.py"].status == "renamed" and diffs["new name.py"].old_path == "old name.py"
        assert diffs["new name.py"].added == {10}
    touched = changed_lines(diffs.values())
    assert "gone.py" not in touched and touched["keep.py"] == keep.changed


def test_pure_rename_and_quoted_paths(repo: Path) -> None:
    _git(repo, "commit", "-q", "-m", "step")
    (repo / "keep.py").rename(repo / 'we"ird\tname.py')
    _git(repo, "add", "-A")
    [fd] = parse_diff(_git(repo, "diff", "--cached", "-M100%"))
    assert (fd.path, fd.old_path, fd.status, fd.hunks) == ('we"ird\tname.py', "keep.py", "renamed", ())


def test_crlf_diff_and_no_newline_markers() -> None:
    text = (
        "diff --git a/w.py b/w.py\r\n--- a/w.py\r\n+++ b/w.py\r\n@@ -1,2 +1,2 @@\r\n x\r\n-y\r\n"
        "\\ No newline at end of file\r\n+y2\r\n\\ No newline at end of file\r\n"
    )
    [fd] = parse_diff(text)
    assert (fd.path, sorted(fd.added), fd.removed) == ("w.py", [2], 1)
    assert [dl.text for dl in fd.hunks[0].lines] == ["x", "y", "y2"]


def test_plain_diff_u_with_timestamps_and_dev_null() -> None:
    text = (
        "diff -ruN old/a.py new/a.py\n"
        "--- a.py\t2024-01-01 00:00:00.000000000 +0000\n"
        "+++ a.py\t2024-01-02 00:00:00.000000000 +0000\n"
        "@@ -1 +1,2 @@\n-x\n+x = 1\n+y = 2\n"
        "--- /dev/null\t1970-01-01 00:00:00.000000000 +0000\n"
        "+++ b/new.py\t2024-01-02 00:00:00.000000000 +0000\n"
        "@@ -0,0 +1 @@\n+-- not a header\n"
        "Binary files old/i.png and new/i.png differ\n"
    )
    a, b = parse_diff(text)
    assert (a.path, a.status, sorted(a.added)) == ("a.py", "modified", [1, 2])
    assert (b.path, b.status, b.old_path, sorted(b.added)) == ("new.py", "added", None, [1])
    assert b.hunks[0].lines[0].text == "-- not a header"


def test_removed_line_that_looks_like_a_header() -> None:
    # "--- x" inside a hunk is a removed "-- x" line, not a new file: the hunk
    # counts say so.
    text = "--- a/s.sql\n+++ b/s.sql\n@@ -1,3 +1,2 @@\n--- comment\n+++ plus\n-x\n y\n"
    [fd] = parse_diff(text)
    assert fd.removed == 2 and fd.added == {1}
    assert [dl.kind + dl.text for dl in fd.hunks[0].lines] == ["--- comment", "+++ plus", "-x", " y"]


def test_truncated_and_garbage_input_never_raises() -> None:
    assert parse_diff("") == []
    assert parse_diff("hello\nworld\n@@ -1 +1 @@\n") == []
    [fd] = parse_diff("--- a/t.py\n+++ b/t.py\n@@ -1,5 +1,5 @@\n a\n-b\n+B\n")
    assert fd.added == {2} and len(fd.hunks[0].lines) == 3
    [fd] = parse_diff("--- a/t.py\n+++ b/t.py\n@@ -1,2 +1,2 @@\n a\n\n")  # stripped context space
    assert [dl.kind for dl in fd.hunks[0].lines] == [" ", " "]


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.sampled_from(["a", "b", "c", "", "  d", "-e", "+f", "--- g", "@@ h"]), max_size=25),
    edits=st.lists(
        st.tuples(st.integers(0, 30), st.sampled_from(["del", "ins", "rep"]), st.text("xyz-+ ", max_size=4))
    ),
    context=st.integers(0, 4),
)
def test_difflib_round_trip(before: list[str], edits: list[tuple[int, str, str]], context: int) -> None:
    after = list(before)
    for pos, op, txt in edits:
        pos = min(pos, len(after))
        if op == "del" and pos < len(after):
            del after[pos]
        elif op == "ins":
            after.insert(pos, txt)
        elif pos < len(after):
            after[pos] = txt + "!"
    text = "".join(
        line + "\n" for line in difflib.unified_diff(before, after, "a/f.py", "b/f.py", n=context, lineterm="")
    )
    diffs = parse_diff(text)
    if before == after:
        assert diffs == []
        return
    [fd] = diffs
    _check_against(fd, "\n".join(after), "\n".join(before))
    removed = sum(1 for h in fd.hunks for dl in h.lines if dl.kind == "-")
    assert fd.removed == removed and diff_loc(diffs) == len(fd.added) + removed
    assert all(1 <= n <= max(len(after), 1) for n in fd.changed)


def test_count_changed_lines_equals_diff_loc_of_the_parsed_diff():
    """The router counts ``diff_loc`` at SYN without parsing (C speed); it must be
    the parsed diff's added + removed lines on real diffs (the golden set)."""
    import json

    from atp_router.task.diff import count_changed_lines, diff_loc, parse_diff
    from tests.conftest import SHARED

    diffs = [json.loads(line).get("diff") for line in (SHARED / "golden" / "dev.jsonl").read_text().splitlines()]
    diffs = [d for d in diffs if d]
    assert len(diffs) >= 20
    for d in diffs:
        assert count_changed_lines(d) == diff_loc(parse_diff(d))
    assert count_changed_lines("") == 0
