"""Citation accuracy of retrieval QA through an ATP router, on labelled questions.

    python examples/retrieval_qa/evaluate.py                       # questions.jsonl over ../shared/specs
    python examples/retrieval_qa/evaluate.py --questions my.jsonl --docs DIR -v

Each line of the questions file is ``{"id", "question", "file", "start", "end",
"quote"}``: the document (relative to the corpus folder) and the 1-based
inclusive lines that answer the question (``quote`` is a piece of them). Every
question runs through the router as ``ask.py`` runs it; a citation *hits* when
its file is the expected one and its line range overlaps the expected lines.

Printed per question (with ``-v``) and in total:

* ``top-1``: the best merged citation of the FINAL (ask.py's ranking) hits;
* ``top-k``: any of the FINAL's first ``k`` citations hits (``--k``, default 5);
* the same two for each retriever's own report (its PARTIAL), best first;
* the mean width in lines of the cited spans (wide spans hit more easily),
  how many questions were escalated, and the cost from the FINALs' telemetry.

Exit status 0 (1 when a question failed at the router, 2 for a usage error).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ask import DEFAULT_DOCS, ask, ranked, span  # noqa: E402

QUESTIONS = Path(__file__).resolve().parent / "questions.jsonl"


def hit(cite: tuple[str, int, int], q: dict[str, Any]) -> bool:
    file, a, b = cite
    return file == q["file"] and a <= q["end"] and b >= q["start"]


def score(cites: list[tuple[str, int, int]], q: dict[str, Any], k: int) -> tuple[bool, bool]:
    """(top-1 hit, top-k hit) of ``cites`` (best first) for question ``q``."""
    return (bool(cites) and hit(cites[0], q), any(hit(c, q) for c in cites[:k]))


async def main_async(args: argparse.Namespace) -> int:
    questions = [json.loads(line) for line in args.questions.read_text().splitlines() if line.strip()]
    budget = {"usd": args.budget_usd, "tokens": args.budget_tokens}
    totals: dict[str, list[int]] = {}
    widths: list[int] = []
    escalated = failed = tokens = 0
    usd = 0.0
    async with atp.Client(args.router, args.token) as client:
        for q in questions:
            try:
                out = await ask(client, q["question"], args.docs, budget)
            except atp.ATPClientError as e:
                failed += 1
                print(f"{q['id']}: FAILED {e}")
                continue
            final = out["final"]
            merged = [(f["file"], *span(f["span"])) for f in ranked(final["result"]["findings"])]
            widths += [b - a + 1 for _, a, b in merged[: args.k]]
            rows = {"router": score(merged, q, args.k)}
            for agent, report in sorted(out["reports"].items()):
                if agent in out["retrievers"]:
                    own = [(f["file"], f["start"], f["end"]) for f in report.get("findings", [])]
                    rows[agent] = score(own, q, args.k)
            for name, (t1, tk) in rows.items():
                acc = totals.setdefault(name, [0, 0, 0])
                acc[0] += t1
                acc[1] += tk
                acc[2] += 1
            esc = any(u.startswith("escalated on ") for u in final["result"]["consensus"].get("uncertainties", []))
            escalated += esc
            tokens += final["telemetry"]["tokens"]
            usd += final["telemetry"]["usd"]
            if args.verbose:
                t1, tk = rows["router"]
                top = f"{merged[0][0]}:{merged[0][1]}-{merged[0][2]}" if merged else "-"
                print(f"{q['id']}: top1={'hit ' if t1 else 'miss'} top{args.k}={'hit ' if tk else 'miss'} "
                      f"expected {q['file']}:{q['start']}-{q['end']} got {top}{'  (escalated)' if esc else ''}")
    n = len(questions) - failed
    print(f"\n{n} question(s) answered through the router ({failed} failed), corpus {args.docs}")
    for name, (t1, tk, m) in totals.items():
        print(f"  {name:<22} top-1 {t1}/{m} = {t1 / m:.0%}   top-{args.k} {tk}/{m} = {tk / m:.0%}")
    if widths:
        print(f"  mean cited span: {sum(widths) / len(widths):.1f} lines (router's top-{args.k})")
    print(f"  escalated: {escalated}/{n}   cost: tokens={tokens} usd={usd:.6f}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--docs", default=str(DEFAULT_DOCS))
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--router", default=os.environ.get("ATP_ROUTER_URL", "http://127.0.0.1:7070"))
    ap.add_argument("--token", default=os.environ.get("ATP_TOKEN"))
    ap.add_argument("--budget-usd", type=float, default=0.01)
    ap.add_argument("--budget-tokens", type=int, default=50_000)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.docs = Path(args.docs).expanduser().resolve()
    if not args.docs.is_dir() or not args.questions.is_file():
        print(f"evaluate.py: need a corpus folder ({args.docs}) and a questions file ({args.questions})",
              file=sys.stderr)
        return 2
    return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
