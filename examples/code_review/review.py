"""Review a real diff through an ATP router and print the merged findings.

Uses only the client SDK (``atp.Client``), as any application would::

    git diff HEAD~1 | python examples/code_review/review.py -            # working tree files
    python examples/code_review/review.py change.diff --repo ../proj --rev HEAD
    python examples/code_review/review.py --golden cve-2d4a3fee6de2       # a labelled task
    python examples/code_review/review.py --golden all --summary           # the whole dev set

The router URL and token come from ``--router``/``--token`` or ``ATP_ROUTER_URL`` /
``ATP_TOKEN``. For a diff, the full text of each touched file after the diff is
read from ``--repo`` (the working tree, or ``git show REV:path`` with ``--rev``).
A golden task carries its files; its expected defects are matched with the rule of
``shared/golden/README.md`` (same file, line ranges overlapping within ±3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import atp
import trio

#: The golden set: ``$ATP_SHARED/golden/dev.jsonl``, by default ``../shared`` beside the repository.
SHARED = Path(os.environ.get("ATP_SHARED") or Path(__file__).resolve().parents[2].parent / "shared")
GOLDEN = SHARED / "golden" / "dev.jsonl"
_PLUS = re.compile(r"^\+\+\+ (?:b/)?(.+?)\s*$")


def touched_paths(diff: str) -> list[str]:
    out = []
    for line in diff.splitlines():
        m = _PLUS.match(line)
        if m and m.group(1) != "/dev/null":
            out.append(m.group(1))
    return out


def files_after(diff: str, repo: Path, rev: str | None) -> dict[str, str]:
    """The text after the diff of each file it touches, from ``repo`` (working
    tree, or ``git show REV:path``). A file that cannot be read is a loud
    warning on stderr: the analysers then see only the diff's lines of it."""
    files: dict[str, str] = {}
    for path in touched_paths(diff):
        if rev:
            r = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], capture_output=True, text=True)
            if r.returncode == 0:
                files[path] = r.stdout
            else:
                print(f"WARNING: {path}: not readable at {rev} in {repo} ({r.stderr.strip() or 'git show failed'}); "
                      "the analysers cannot review it (they need the whole file)", file=sys.stderr)
        else:
            p = repo / path
            try:
                files[path] = p.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                print(f"WARNING: {path}: cannot read {p} ({e.strerror or e}); the analysers cannot "
                      f"review it without its text (is --repo {repo} the repository the diff is from?)", file=sys.stderr)
    return files


def _span(span: str) -> tuple[int, int]:
    a, _, b = span.partition("-")
    return int(a), int(b or a)


def caught(expected: list[dict[str, Any]], findings: list[dict[str, Any]], slack: int = 3) -> list[bool]:
    hits = []
    for e in expected:
        hit = False
        for f in findings:
            s, t = _span(f["span"])
            if f["file"] == e["file"] and s <= e["end"] + slack and t >= e["start"] - slack:
                hit = True
                break
        hits.append(hit)
    return hits


#: Characters of a model's answer printed (the rest is counted, not shown).
ANSWER_CHARS = 2_000


def print_result(title: str, result: dict[str, Any], agents: list[str]) -> None:
    findings = result["result"]["findings"]
    cons = result["result"]["consensus"]
    tel = result["telemetry"]
    print(f"\n== {title}: {len(findings)} finding(s) from next-hops {', '.join(agents)}")
    for f in findings:
        print(f"  {f['file']}:{f['span']:<9} {f['severity']:<8} {f['claim']}")
        print(f"  {'':<{len(f['file']) + 10}} confidence {f['confidence']:.2f}  provenance {', '.join(f['provenance'])}")
    for a in result["result"].get("answers", []):
        # The model's whole answer (bounded), indented under its name.
        text = a["text"].strip() or "(empty answer)"
        if len(text) > ANSWER_CHARS:
            text = text[:ANSWER_CHARS] + f" … ({len(a['text']):,} characters in all)"
        print(f"  {a['agent']} says:")
        for line in text.splitlines():
            print(textwrap.fill(line, width=100, initial_indent="    ", subsequent_indent="    ") if line else "")
    print(f"  consensus: {cons['strategy']} agreement={cons['agreement']:.2f}"
          + (f" uncertainties={cons['uncertainties']}" if cons.get("uncertainties") else ""))
    print("    (agreement: how often two next-hops flagged the same places, 0..1 — the mean over pairs of"
          " places both flagged / places either flagged; uncertainties: what the merge could not confirm —"
          " findings without a quorum or a valid citation, next-hops that failed or were skipped)")
    print(f"  telemetry: tokens={tel['tokens']} usd={tel['usd']:.6f} latency_ms={tel['latency_ms']:.1f}")


async def review(client: atp.Client, diff: str, files: dict[str, str], budget: dict[str, Any]) -> tuple[dict, list[str], list[dict]]:
    languages = sorted({Path(p).suffix.lstrip(".") for p in files if Path(p).suffix})
    task = {"task_type": "code_review", "languages": languages}
    _, stream = await client.open_stream(task=task, budget=budget, content={"diff": diff, "files": files})
    final = None
    errors = []
    async for ev in client.events(stream):
        if ev.type == "FINAL":
            final = ev.payload
        elif ev.type in ("ERROR", "RST"):
            errors.append(ev.payload)
    if final is None:
        raise atp.ATPClientError(errors[-1]["code"] if errors else "EPROTO", json.dumps(errors))
    return final, stream.route.get("next_hops", []), errors


async def main_async(args: argparse.Namespace) -> int:
    budget = {"usd": args.budget_usd, "tokens": args.budget_tokens}
    async with atp.Client(args.router, args.token) as client:
        if args.golden:
            if not GOLDEN.is_file():
                print(f"no golden set at {GOLDEN} (set ATP_SHARED to the shared/ folder)", file=sys.stderr)
                return 2
            tasks = [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]
            if args.golden != "all":
                tasks = [t for t in tasks if t["id"] == args.golden]
                if not tasks:
                    print(f"no golden task {args.golden!r} in {GOLDEN}", file=sys.stderr)
                    return 2
            caught_tasks = 0
            for t in tasks:
                final, agents, errors = await review(client, t["diff"], t["files"], budget)
                hits = caught(t["expected"], final["result"]["findings"])
                caught_tasks += any(hits)
                if not args.summary:
                    print_result(t["id"], final, agents)
                    for e, h in zip(t["expected"], hits):
                        print(f"  expected {e['file']}:{e['start']}-{e['end']} ({e['claim'][:60]}): {'CAUGHT' if h else 'missed'}")
                    for e in errors:
                        print(f"  error: {e.get('code')} {e.get('reason')}")
                else:
                    tel = final["telemetry"]
                    print(f"{t['id']:<28} findings={len(final['result']['findings']):<3} caught={'yes' if any(hits) else 'no ':<3} "
                          f"latency_ms={tel['latency_ms']:.0f}")
            print(f"\ngolden: {caught_tasks}/{len(tasks)} tasks caught")
            return 0
        try:
            diff = sys.stdin.read() if args.diff in (None, "-") else Path(args.diff).read_text()
        except (OSError, UnicodeDecodeError) as e:
            print(f"review.py: cannot read the diff {args.diff}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 2
        if not diff.strip():
            print("empty diff", file=sys.stderr)
            return 2
        files = files_after(diff, Path(args.repo), args.rev)
        final, agents, errors = await review(client, diff, files, budget)
        print_result("review", final, agents)
        for e in errors:
            print(f"  error: {e.get('code')} {e.get('reason')}")
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("diff", nargs="?", help="unified diff file, or - for stdin")
    ap.add_argument("--router", default=os.environ.get("ATP_ROUTER_URL", "http://127.0.0.1:7070"))
    ap.add_argument("--token", default=os.environ.get("ATP_TOKEN"))
    ap.add_argument("--repo", default=".", help="repository holding the files after the diff")
    ap.add_argument("--rev", help="read files with git show REV:path instead of the working tree")
    ap.add_argument("--golden", help="a task id of shared/golden/dev.jsonl, or 'all'")
    ap.add_argument("--summary", action="store_true", help="with --golden all: one line per task")
    ap.add_argument("--budget-usd", type=float, default=0.10)
    ap.add_argument("--budget-tokens", type=int, default=200_000)
    args = ap.parse_args()
    try:
        return trio.run(main_async, args)
    except atp.ATPClientError as e:
        print(f"review failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
