"""``atp-router review``: review a git change through a router and exit non-zero on
findings (issue 24 item 2) — for a pre-commit hook or a CI job.

::

    atp-router review [--base REF | --staged | --diff FILE] [--format text|json|sarif]
                      [--output FILE] [--fail-on info|low|medium|high|critical]
                      [--url URL] [--policies RIB] [--budget-usd USD] [--budget-tokens N]

Run inside a git repository. What is reviewed:

* default: the working tree against ``HEAD`` (``git diff HEAD``: staged and
  unstaged changes to tracked files; an untracked file is not part of it until
  it is added), each touched file's text read from the working tree;
* ``--staged``: what the next commit would contain (``git diff --cached``), files
  as the index has them (``git show :path``);
* ``--base REF``: the commits of ``HEAD`` since it forked from ``REF``
  (``git diff REF...HEAD``), files as ``HEAD`` has them;
* ``--diff FILE`` (``-``: standard input): a unified diff, files from the working
  tree of the repository it is run in (none outside one).

The change goes as one ``code_review`` task (spec §15) to the router at ``--url``
(token in ``ATP_TOKEN``), or, without ``--url``, to a router started in this
process on ``--policies`` (default: the repository's default RIB,
``policies/``): bound to loopback on a free port for the review's duration,
with a fresh random token and a temporary state directory, so no other process
can use it and nothing of it is left behind.

Output (stdout, or ``--output FILE``): ``text`` (one line a finding, then the
cost), ``json`` (the stream id and the router's FINAL: spec §7.3) or ``sarif``
(SARIF 2.1.0, what code hosts ingest: one result a finding, its severity as
the level, the contributing agents as properties). The cost — tokens and USD —
is also printed on stderr for ``json`` and ``sarif``, so stdout stays the
document alone.

Exit status: 1 when a finding at or above ``--fail-on`` (default ``high``) was
reported, 0 when none was (also for an empty change), 2 on a usage error, a git
error or a router error (its code and reason on stderr).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import atp  # type: ignore[import-untyped]  # the SDK (no py.typed yet): the review goes as any client's task
import trio

from atp_router.review.paths import safe_relpath
from atp_router.security import audit as audit_log
from atp_router.store import StoreError
from atp_router.task.change import languages_of
from atp_router.wire.errors import ClientInputError, PolicyError

#: Serves a private router (:func:`atp_router.deploy.cli.serve_private`'s signature):
#: ``(policies, state_dir, *, task_status, **config)``; it reports its HTTP port.
ServePrivate = Callable[..., Any]

__all__ = ["SEVERITIES", "Change", "ReviewError", "failing", "main", "render_sarif", "render_text"]

#: Severities from least to most severe (spec §7.3 findings).
SEVERITIES = ("info", "low", "medium", "high", "critical")
_LEVEL = {"critical": "error", "high": "error", "medium": "warning", "low": "note", "info": "note"}
_PLUS = re.compile(r"^\+\+\+ (?:b/)?(.+?)\s*$")
#: The default RIB beside the package (an editable install or a checkout).
DEFAULT_POLICIES = Path(__file__).resolve().parents[2] / "policies"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


class ReviewError(Exception):
    """A usage, git or router error: exit status 2, the message on stderr."""


@dataclass(frozen=True)
class Change:
    """What is reviewed: the unified ``diff``, the text after it of each file it
    touches (``files``: path → text) and what it is (``label``, for messages)."""

    diff: str
    files: dict[str, str]
    label: str


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="atp-router review", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--base", metavar="REF", help="review the commits since HEAD forked from REF (REF...HEAD)")
    which.add_argument("--staged", action="store_true", help="review the staged changes (git diff --cached)")
    which.add_argument("--diff", metavar="FILE", help="review a unified diff file ('-': standard input)")
    ap.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    ap.add_argument("--output", metavar="FILE", type=Path, help="write the report here instead of stdout")
    ap.add_argument("--fail-on", choices=SEVERITIES, default="high",
                    help="exit 1 when a finding at or above this severity is reported")
    ap.add_argument("--url", help="a running router's base URL (token: ATP_TOKEN); without it, one is started here")
    ap.add_argument("--policies", type=Path, default=DEFAULT_POLICIES, help="the RIB of the router started here")
    ap.add_argument("--budget-usd", type=float, default=None, help="the review's budget, USD")
    ap.add_argument("--budget-tokens", type=int, default=None, help="the review's budget, tokens")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ the change

def _git(root: Path, *args: str, stdin: str | None = None) -> str:
    """``git -C root ARGS`` (no pager, colour or external diff) → stdout; raises
    :class:`ReviewError` with git's message when it fails."""
    try:
        r = subprocess.run(["git", "-C", str(root), "-c", "core.quotepath=off", *args], input=stdin,
                           capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ReviewError("git is not installed") from None
    if r.returncode != 0:
        raise ReviewError(f"git {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def touched_paths(diff: str) -> list[str]:
    """The paths a unified diff leaves in place (``+++ b/<path>``; deletions out)."""
    return [m.group(1) for line in diff.splitlines() if (m := _PLUS.match(line)) and m.group(1) != "/dev/null"]


def collect_change(args: argparse.Namespace, cwd: Path) -> Change:
    """The :class:`Change` ``args`` name, from the repository around ``cwd``.
    Raises :class:`ReviewError` outside a repository (but for ``--diff``) or
    when git fails."""
    root: Path | None
    try:
        root = Path(_git(cwd, "rev-parse", "--show-toplevel").strip())
    except ReviewError:
        if args.diff is None:
            raise ReviewError(f"{cwd} is not inside a git repository (give --diff FILE to review a diff file)") \
                from None
        root = None
    diff_args = ("diff", "--no-color", "--no-ext-diff", "--no-renames")
    if args.diff is not None:
        diff = sys.stdin.read() if args.diff == "-" else _read(Path(args.diff))
        label = "standard input" if args.diff == "-" else args.diff
        read: Callable[[str], str | None] = (lambda p: _read_inside(root, p)) if root is not None else (lambda p: None)
    else:
        assert root is not None
        if args.staged:
            diff, label = _git(root, *diff_args, "--cached"), "the staged changes"
            read = lambda p: _git_show(root, f":{p}")  # noqa: E731
        elif args.base:
            diff, label = _git(root, *diff_args, f"{args.base}...HEAD"), f"{args.base}...HEAD"
            read = lambda p: _git_show(root, f"HEAD:{p}")  # noqa: E731
        else:
            diff, label = _git(root, *diff_args, "HEAD"), "the working tree against HEAD"
            read = lambda p: _read_inside(root, p)  # noqa: E731
    files = {p: text for p in touched_paths(diff) if (text := read(p)) is not None}
    return Change(diff=diff, files=files, label=label)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ReviewError(f"{path}: {e}") from None


def _read_inside(root: Path, rel: str) -> str | None:
    """The working-tree text of ``rel`` when it is a normal relative path that
    stays inside ``root`` (no ``..``, no absolute path, not in ``.git``, no
    symlink out of it: a diff file may name any path, and what is read goes to
    the router); else None (the analysers then see the diff's lines only)."""
    try:
        safe_relpath(rel)
    except ClientInputError:
        return None
    if ".git" in rel.split("/"):
        return None
    real = (root / rel).resolve()
    if not real.is_relative_to(root.resolve()):
        return None
    return _read_file(real)


def _read_file(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # binary or unreadable: the analysers see the diff's lines only


def _git_show(root: Path, spec: str) -> str | None:
    try:
        return _git(root, "show", spec)
    except ReviewError:
        return None


# ------------------------------------------------------------------ the review

async def review_through(url: str, token: str | None, change: Change, budget: dict[str, Any]) -> dict[str, Any]:
    """The change reviewed by the router at ``url``: ``{"stream_id", "final",
    "errors"}`` (the FINAL's content, spec §7.3; the ERRORs on the way). Raises
    :class:`ReviewError` when the stream ends without a FINAL or the router
    cannot be reached."""
    task = {"task_type": "code_review", "languages": languages_of(change.files)}
    try:
        async with atp.Client(url, token) as client:
            _, stream = await client.open_stream(task=task, budget=budget or None,
                                                 content={"diff": change.diff, "files": change.files})
            final, errors = None, []
            async for ev in client.events(stream):
                if ev.type == "FINAL":
                    final = ev.payload
                elif ev.type in ("ERROR", "RST"):
                    errors.append(ev.payload)
    except atp.ATPClientError as e:
        if e.code == "ETRANSPORT":  # the SDK's code for a connection that failed
            raise ReviewError(f"the router at {url} cannot be reached: {e.reason}") from None
        raise ReviewError(f"the router refused the review: {e.code}: {e.reason}") from None
    except OSError as e:
        raise ReviewError(f"the router at {url} cannot be reached: {e}") from None
    if final is None:
        last = errors[-1] if errors else {}
        raise ReviewError(f"the review ended without a result: {last.get('code', '?')}: {last.get('reason', '')}")
    return {"stream_id": stream.stream_id, "final": final, "errors": errors}


async def review_embedded(serve_private: ServePrivate, policies: Path, change: Change,
                          budget: dict[str, Any]) -> dict[str, Any]:
    """:func:`review_through` a router ``serve_private`` starts in this process on
    ``policies`` (module doc: loopback, a free port, a random token, a temporary
    state directory), stopped afterwards."""
    if not policies.exists():
        raise ReviewError(f"no RIB at {policies}: give --policies or the --url of a running router")
    token = secrets.token_urlsafe(32)
    # Its audit log lives in the temporary state directory, gone with it: the warning that
    # its key sits beside it (the development setting) says nothing about this review.
    logging.getLogger(audit_log.__name__).setLevel(logging.ERROR)
    out: dict[str, Any] | None = None
    error: ReviewError | None = None
    with tempfile.TemporaryDirectory(prefix="atp-review-") as state:
        serve = functools.partial(serve_private, policies, Path(state), host="127.0.0.1",
                                  client_tokens={"review": token})
        async with trio.open_nursery() as nursery:
            # Errors are kept, not raised, in here: out of the nursery they would come wrapped in a group.
            try:
                http_port = await nursery.start(serve)
                out = await review_through(f"http://127.0.0.1:{http_port}", token, change, budget)
            except PolicyError as e:
                error = ReviewError(f"policy refused: {e.reason}")
            except (RuntimeError, StoreError, OSError, ValueError) as e:
                error = ReviewError(f"the router could not start: {e}")
            except ReviewError as e:
                error = e
            finally:
                nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    assert out is not None
    return out


# ------------------------------------------------------------------ reports

def findings_of(final: dict[str, Any]) -> list[dict[str, Any]]:
    return list(final.get("result", {}).get("findings", []))


def failing(findings: list[dict[str, Any]], fail_on: str) -> list[dict[str, Any]]:
    """The findings at or above severity ``fail_on``."""
    floor = SEVERITIES.index(fail_on)
    return [f for f in findings if SEVERITIES.index(f.get("severity", "info")) >= floor]


def _span(span: str) -> tuple[int, int]:
    start, _, end = str(span).partition("-")
    a = max(1, int(start)) if start.isdigit() else 1
    return a, max(a, int(end)) if end.isdigit() else a


def cost_line(final: dict[str, Any]) -> str:
    tel = final.get("telemetry", {})
    return f"cost: {tel.get('tokens', 0)} tokens, {tel.get('usd', 0.0):.6f} USD, {tel.get('latency_ms', 0.0):.0f} ms"


def render_text(out: dict[str, Any], change: Change) -> str:
    """One line a finding (``file:start-end severity: claim [provenance]``),
    the failed next-hops, then the cost."""
    final = out["final"]
    found = findings_of(final)
    lines = [f"atp-router review of {change.label}: {len(found)} finding(s) (stream {out['stream_id']})"]
    for f in sorted(found, key=lambda f: (-SEVERITIES.index(f.get("severity", "info")), f["file"], _span(f["span"]))):
        lines.append(f"{f['file']}:{f['span']} {f['severity']}: {f['claim']} [{', '.join(f.get('provenance', []))}]")
    for u in final.get("result", {}).get("consensus", {}).get("uncertainties", []):
        if str(u).startswith("next-hop failed"):
            lines.append(f"incomplete: {u}")
    lines.append(cost_line(final))
    return "\n".join(lines) + "\n"


def render_sarif(out: dict[str, Any], version: str) -> dict[str, Any]:
    """The FINAL's findings as one SARIF 2.1.0 run: a result a finding (ruleId:
    its first contributing agent), level by severity (critical/high:
    ``error``, medium: ``warning``, low/info: ``note``), its place as a region."""
    final = out["final"]
    rules: dict[str, dict[str, Any]] = {}
    results = []
    for f in findings_of(final):
        rule = (f.get("provenance") or ["atp-router"])[0].split("#")[0]  # the first contributing agent
        rules.setdefault(rule, {"id": rule, "shortDescription": {"text": rule}})
        start, end = _span(f["span"])
        results.append({
            "ruleId": rule, "level": _LEVEL.get(f.get("severity", "info"), "note"),
            "message": {"text": f["claim"]},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": f["file"]},
                                                "region": {"startLine": start, "endLine": end}}}],
            "partialFingerprints": {"atpFindingId/v1": str(f.get("id", ""))},
            "properties": {"severity": f.get("severity"), "confidence": f.get("confidence"),
                           "provenance": f.get("provenance", [])},
        })
    tel = final.get("telemetry", {})
    driver = {"name": "atp-router", "version": version, "rules": list(rules.values())}
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [{
        "tool": {"driver": driver}, "results": results,
        "properties": {"stream_id": out["stream_id"], "tokens": tel.get("tokens"), "usd": tel.get("usd")},
    }]}


def _report(args: argparse.Namespace, out: dict[str, Any], change: Change) -> str:
    if args.format == "text":
        return render_text(out, change)
    doc = render_sarif(out, version("atp-router")) if args.format == "sarif" else out
    print(cost_line(out["final"]), file=sys.stderr)
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str], *, serve_private: ServePrivate) -> int:
    """``atp-router review ARGS`` (module doc) → exit status 0, 1 or 2;
    ``serve_private`` starts the router of a review without ``--url``."""
    args = parse_args(argv)
    budget = {k: v for k, v in (("usd", args.budget_usd), ("tokens", args.budget_tokens)) if v is not None}
    try:
        change = collect_change(args, Path.cwd())
        if not change.diff.strip():
            print(f"atp-router review: nothing to review in {change.label}", file=sys.stderr)
            return 0
        if args.url:
            out = trio.run(review_through, args.url, os.environ.get("ATP_TOKEN"), change, budget)
        else:
            out = trio.run(review_embedded, serve_private, args.policies, change, budget)
        text = _report(args, out, change)
        if args.output is not None:
            args.output.write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
    except ReviewError as e:
        print(f"atp-router review: {e}", file=sys.stderr)
        return 2
    bad = failing(findings_of(out["final"]), args.fail_on)
    if bad:
        print(f"atp-router review: {len(bad)} finding(s) at or above {args.fail_on}", file=sys.stderr)
        return 1
    return 0
