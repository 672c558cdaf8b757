"""Ask a question about a folder of documents through an ATP router (spec §15.3).

Uses only the client SDK (``atp.Client``), as any application would::

    python examples/retrieval_qa/ask.py "How are MQTT topics canonicalised?"
    python examples/retrieval_qa/ask.py --docs ~/notes "When is the next release?"
    python examples/retrieval_qa/ask.py --json "..."            # the FINAL as JSON

The router (``--router`` / ``ATP_ROUTER_URL``, token ``--token`` / ``ATP_TOKEN``)
must run ``examples/retrieval_qa/rib.yaml`` (or any RIB routing
``task_type: retrieval_qa``). The task is ``{"question", "docs", "instruction"}``:
``docs`` is the corpus folder (default ``../shared/specs`` beside the
repository; a relative ``--docs`` is the caller's current directory's), sent as
an absolute path.

Prints the answer — the local model's synthesis when the router escalated to
it (weak citations or retrievers disagreeing), with each ``[file:a-b]`` it
cites checked against the retrieved snippets; else the retrievers' extractive
answer — then the cited snippets (file:lines, strength, provenance), the
consensus and the cost (tokens and USD from the FINAL's telemetry).
Exit status: 0 answered, 1 the router failed the task, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import atp
import trio

ROOT = Path(__file__).resolve().parents[2]
#: The default corpus: the specifications beside the repository.
DEFAULT_DOCS = Path(os.environ.get("ATP_SHARED") or ROOT.parent / "shared") / "specs"
INSTRUCTION = (
    "Answer the question using only the evidence snippets below. After every statement cite the snippet "
    "it comes from as [file:start-end], using the file and line numbers given with the snippet. "
    "If the snippets do not answer the question, say so."
)
_CITE = re.compile(r"\[([^\[\]\s:]+):(\d+)(?:\s*-\s*(\d+))?\]")


def span(s: str) -> tuple[int, int]:
    a, _, b = s.partition("-")
    return int(a), int(b or a)


def ranked(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The FINAL's merged citations, best first: by confidence (noisy-OR over
    the retrievers that cited the place), then by the best rank any retriever
    gave it (the ``ref`` in its provenance)."""
    def best_rank(f: dict[str, Any]) -> int:
        ranks = [int(p.rsplit("#", 1)[1]) for p in f.get("provenance", []) if p.rsplit("#", 1)[-1].isdigit()]
        return min(ranks, default=99)
    return sorted(findings, key=lambda f: (-f["confidence"], best_rank(f), f["file"], span(f["span"])))


def cited_spans(text: str) -> list[tuple[str, int, int]]:
    """``[file:a-b]`` citations in an answer, as ``(file, a, b)``."""
    return [(m[1], int(m[2]), int(m[3] or m[2])) for m in _CITE.finditer(text)]


def supported(cite: tuple[str, int, int], findings: list[dict[str, Any]]) -> bool:
    """Whether a citation in an answer overlaps one of the retrieved snippets."""
    file, a, b = cite
    for f in findings:
        s, t = span(f["span"])
        if f["file"] == file and s <= b and t >= a:
            return True
    return False


async def ask(client: atp.Client, question: str, docs: Path, budget: dict[str, Any]) -> dict[str, Any]:
    """Run one question through the router. Returns ``{"final", "retrievers",
    "reports", "errors"}``: the FINAL payload (§7.3), the route's next-hops,
    each agent's own report (from its PARTIAL) and the ERROR events. Raises
    ``atp.ATPClientError`` when the stream ends without a FINAL."""
    content = {"question": question, "docs": str(docs), "instruction": INSTRUCTION}
    _, stream = await client.open_stream(task={"task_type": "retrieval_qa"}, budget=budget, content=content)
    final = None
    errors: list[dict[str, Any]] = []
    reports: dict[str, dict[str, Any]] = {}
    async for ev in client.events(stream):
        if ev.type == "FINAL":
            final = ev.payload
        elif ev.type in ("ERROR", "RST"):
            errors.append(ev.payload)
        elif ev.type == "PARTIAL" and isinstance(ev.payload, dict) and "report" in ev.payload:
            reports[ev.payload["agent"]] = ev.payload["report"]
    if final is None:
        raise atp.ATPClientError(errors[-1]["code"] if errors else "EPROTO", json.dumps(errors))
    return {"final": final, "retrievers": list(stream.route.get("next_hops", [])), "reports": reports,
            "errors": errors}


def render(question: str, out: dict[str, Any], *, show: int = 5) -> str:
    """The human-readable answer (module docstring)."""
    final = out["final"]
    result, tel = final["result"], final["telemetry"]
    findings = ranked(result["findings"])
    cons = result["consensus"]
    escalated = next((u for u in cons.get("uncertainties", []) if u.startswith("escalated on ")), None)
    answers = {a["agent"]: a for a in result.get("answers", [])}
    model = next((a for name, a in answers.items() if name not in out["retrievers"] and a["text"].strip()), None)
    lines = [f"Q: {question}"]
    if model is not None:
        lines.append(f"Answer ({model['agent']}, {escalated or 'escalated'}):")
        lines.append("  " + model["text"].strip().replace("\n", "\n  "))
        cites = cited_spans(model["text"])
        if cites:
            for c in cites:
                ok = "among the retrieved snippets" if supported(c, findings) else "NOT among the retrieved snippets"
                lines.append(f"  cites {c[0]}:{c[1]}-{c[2]}: {ok}")
        else:
            lines.append("  (the model cited no snippet: check it against the snippets below)")
    primary = next((answers[r] for r in out["retrievers"] if r in answers), None)
    if primary is not None:  # the retrievers' extractive answer, also beside a synthesis
        head = "Extractive answer" if model is not None else "Answer"
        lines.append(f"{head} ({primary['agent']}, strength {primary.get('confidence') or 0:.2f}):")
        lines.append("  " + primary["text"].strip().replace("\n", "\n  "))
    if escalated and model is None:
        lines.append(f"  ({escalated}, but the synthesiser gave no answer: see the errors below)")
    lines.append(f"Cited snippets ({len(findings)}):")
    for i, f in enumerate(findings[:show], 1):
        lines.append(f"  [{i}] {f['file']}:{f['span']}  strength {f['confidence']:.2f}  from {', '.join(f['provenance'])}")
        claim = f["claim"]
        lines.append(f"      {claim[:300]}{'…' if len(claim) > 300 else ''}")
    lines.append(f"consensus: {cons['strategy']} agreement={cons['agreement']:.2f}"
                 + (f" uncertainties={cons['uncertainties']}" if cons.get("uncertainties") else ""))
    for e in out["errors"]:
        lines.append(f"error: {e.get('code')} {e.get('reason')}")
    lines.append(f"cost: tokens={tel['tokens']} usd={tel['usd']:.6f} latency_ms={tel['latency_ms']:.0f}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    budget = {"usd": args.budget_usd, "tokens": args.budget_tokens}
    async with atp.Client(args.router, args.token) as client:
        out = await ask(client, args.question, args.docs, budget)
    if args.json:
        print(json.dumps(out["final"], indent=1))
    else:
        print(render(args.question, out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("question")
    ap.add_argument("--docs", default=str(DEFAULT_DOCS), help=f"corpus folder (default {DEFAULT_DOCS})")
    ap.add_argument("--router", default=os.environ.get("ATP_ROUTER_URL", "http://127.0.0.1:7070"))
    ap.add_argument("--token", default=os.environ.get("ATP_TOKEN"))
    ap.add_argument("--json", action="store_true", help="print the FINAL payload as JSON")
    ap.add_argument("--budget-usd", type=float, default=0.01)
    ap.add_argument("--budget-tokens", type=int, default=50_000)
    args = ap.parse_args()
    docs = Path(args.docs).expanduser().resolve()
    if not docs.is_dir():
        print(f"ask.py: --docs {args.docs}: not a directory", file=sys.stderr)
        return 2
    args.docs = docs
    try:
        return trio.run(main_async, args)
    except atp.ATPClientError as e:
        print(f"ask failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
