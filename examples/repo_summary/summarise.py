"""Summarise a repository through an ATP router (spec §15.2).

Uses only the client SDK (``atp.Client``), as any application would::

    python examples/repo_summary/summarise.py                      # this repository
    python examples/repo_summary/summarise.py --repo ../some/project
    python examples/repo_summary/summarise.py --json               # the FINAL as JSON

The router (``--router`` / ``ATP_ROUTER_URL``, token ``--token`` / ``ATP_TOKEN``)
must run ``examples/repo_summary/rib.yaml`` (or any RIB routing ``task_type:
repo_summary``). The task is ``{"repo", "instruction"}`` with ``repo`` the
absolute path of ``--repo`` (default: this repository; a relative path is the
caller's current directory's).

Prints the summariser's cited summary (every statement ends in
``[file:start-end]``), its confidence, the model's synthesis when the router
escalated (an ambiguous repository), and the cost (tokens and USD from the
FINAL's telemetry). Exit status: 0 summarised, 1 the router failed the task,
2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import atp
import trio

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTION = (
    "The evidence is an extractive summary of a software repository with citations [file:start-end]. "
    "Write a short overview of what the repository is for and how it is used, citing the evidence as "
    "[file:start-end]. Say what is unclear."
)


async def summarise(client: atp.Client, repo: Path, budget: dict[str, Any]) -> dict[str, Any]:
    """One summary through the router: ``{"final", "agents", "errors"}`` (the
    FINAL payload, the route's next-hops, the ERROR events). Raises
    ``atp.ATPClientError`` when the stream ends without a FINAL."""
    content = {"repo": str(repo), "instruction": INSTRUCTION}
    _, stream = await client.open_stream(task={"task_type": "repo_summary"}, budget=budget, content=content)
    final = None
    errors: list[dict[str, Any]] = []
    async for ev in client.events(stream):
        if ev.type == "FINAL":
            final = ev.payload
        elif ev.type in ("ERROR", "RST"):
            errors.append(ev.payload)
    if final is None:
        raise atp.ATPClientError(errors[-1]["code"] if errors else "EPROTO", json.dumps(errors))
    return {"final": final, "agents": list(stream.route.get("next_hops", [])), "errors": errors}


def render(repo: Path, out: dict[str, Any]) -> str:
    final = out["final"]
    result, tel = final["result"], final["telemetry"]
    cons = result["consensus"]
    answers = result.get("answers", [])
    escalated = next((u for u in cons.get("uncertainties", []) if u.startswith("escalated on ")), None)
    lines = [f"# Summary of {repo}"]
    for a in answers:
        if a["agent"] in out["agents"]:
            conf = a.get("confidence")
            lines.append(f"(by {a['agent']}, confidence {conf if conf is not None else 0:.2f}"
                         + (": ambiguous, escalated)" if escalated else ")"))
            lines.append(a["text"].strip())
    for a in answers:
        if a["agent"] not in out["agents"]:
            lines.append(f"\n## Synthesis by {a['agent']} ({escalated or 'escalated'})")
            lines.append(a["text"].strip())
    if escalated and not any(a["agent"] not in out["agents"] for a in answers):
        lines.append(f"\n({escalated}, but the model gave no answer: see the errors below)")
    lines.append(f"\n{len(result['findings'])} citation(s); consensus {cons['strategy']}")
    for e in out["errors"]:
        lines.append(f"error: {e.get('code')} {e.get('reason')}")
    lines.append(f"cost: tokens={tel['tokens']} usd={tel['usd']:.6f} latency_ms={tel['latency_ms']:.0f}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    budget = {"usd": args.budget_usd, "tokens": args.budget_tokens}
    async with atp.Client(args.router, args.token) as client:
        out = await summarise(client, args.repo, budget)
    print(json.dumps(out["final"], indent=1) if args.json else render(args.repo, out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(ROOT), help="the repository to summarise (default: this one)")
    ap.add_argument("--router", default=os.environ.get("ATP_ROUTER_URL", "http://127.0.0.1:7070"))
    ap.add_argument("--token", default=os.environ.get("ATP_TOKEN"))
    ap.add_argument("--json", action="store_true", help="print the FINAL payload as JSON")
    ap.add_argument("--budget-usd", type=float, default=0.01)
    ap.add_argument("--budget-tokens", type=int, default=50_000)
    args = ap.parse_args()
    repo = Path(args.repo).expanduser().resolve()
    if not repo.is_dir():
        print(f"summarise.py: --repo {args.repo}: not a directory", file=sys.stderr)
        return 2
    args.repo = repo
    try:
        return trio.run(main_async, args)
    except atp.ATPClientError as e:
        print(f"summary failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
