"""Redaction that normalises first (issue 19; spec §11, §19): recall on the bypass
corpus, false positives on ordinary code, and the scan's cost against the scan
as written, in the same run.

    .venv/bin/python bench/bench_redact.py [--repeat 3] [--golden /work/shared/golden/dev.jsonl]

* **recall**: the share of tests/security/redact_corpus.py cases none of whose
  secrets reaches an uncleared agent in any form (as written or in a normalised
  view), for the ``DEV`` half (the issue's bypasses and the variants it named)
  and the ``HELD_OUT`` half (written after the detectors, never tuned to);
  the same for the scan as written (``DataScopeGuard(normalise=False)``).
* **fp_rate**: the corpus' negatives redacted at all, and lines of ordinary code
  — the router's own ``atp_router/`` sources and the golden diffs — on which the
  normalised scan detects something the scan as written does not, per line.
* **µs per KiB**: CPU of :meth:`DataScopeGuard.inspect` on that code (best of
  ``--repeat``), normalised vs as written (the baseline).

The last line is one summary: ``REDACT recall=… (held-out …) fp_rate=…
us_per_kib=… baseline_us_per_kib=…``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atp_router.security.redact import DataScopeGuard, Pass
from tests.security.redact_corpus import DEV, HELD_OUT, NEGATIVES, leaks

LABELS = frozenset({"no_secrets"})


def recall(guard: DataScopeGuard, cases: list) -> tuple[float, list[str]]:
    missed = []
    for c in cases:
        d = guard.for_agent(guard.inspect(c.content, LABELS), None)
        if leaks(getattr(d, "content", None), c.secrets):
            missed.append(c.name)
    return 1 - len(missed) / len(cases), missed


def ordinary_code(golden: pathlib.Path) -> list[dict]:
    items = [{"files": {p.name: p.read_text()}} for p in sorted((ROOT / "atp_router").rglob("*.py"))]
    if golden.exists():
        for line in golden.read_text().splitlines():
            diff = json.loads(line).get("diff")
            if diff:
                items.append({"diff": diff})
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--golden", type=pathlib.Path, default=ROOT.parent / "shared" / "golden" / "dev.jsonl")
    args = ap.parse_args()
    new, old = DataScopeGuard(), DataScopeGuard(normalise=False)

    print(f"corpus: {len(DEV)} dev + {len(HELD_OUT)} held-out bypass cases, {len(NEGATIVES)} negatives")
    rows = {}
    for name, guard in (("normalised", new), ("as written", old)):
        dev, dev_missed = recall(guard, DEV)
        held, held_missed = recall(guard, HELD_OUT)
        rows[name] = (dev, held)
        print(f"  {name:<11} recall dev {dev:.3f}  held-out {held:.3f}"
              + (f"  missed: {', '.join(dev_missed + held_missed)}" if name == "normalised" and
                 (dev_missed or held_missed) else ""))
    neg_fp = [n for n, c in NEGATIVES if not isinstance(new.for_agent(new.inspect(c, LABELS), None), Pass)]
    print(f"  negatives redacted: {len(neg_fp)}/{len(NEGATIVES)} {neg_fp if neg_fp else ''}")

    items = ordinary_code(args.golden)
    chars = sum(len(s) for it in items for s in (it.get("diff"), *it.get("files", {}).values()) if s)
    lines = sum(s.count("\n") + 1 for it in items for s in (it.get("diff"), *it.get("files", {}).values()) if s)
    new_only = 0
    for it in items:
        seen = {(h.path, h.line) for h in old.inspect(it, LABELS).hits}
        new_only += len({(h.path, h.line) for h in new.inspect(it, LABELS).hits} - seen)
    fp_rate = new_only / lines
    print(f"ordinary code: {len(items)} texts, {lines} lines, {chars / 1024:.0f} KiB; "
          f"lines with a detection only the normalised scan makes: {new_only} ({fp_rate:.5f} per line)")

    best = {"normalised": float("inf"), "as written": float("inf")}
    for _ in range(args.repeat):
        for name, guard in (("as written", old), ("normalised", new)):
            t0 = time.process_time()
            for it in items:
                guard.inspect(it, LABELS)
            best[name] = min(best[name], time.process_time() - t0)
    us = {k: v * 1e6 / (chars / 1024) for k, v in best.items()}
    print(f"cost: normalised {us['normalised']:.0f} µs/KiB, as written {us['as written']:.0f} µs/KiB "
          f"(x{us['normalised'] / us['as written']:.2f}; best of {args.repeat})")
    dev, held = rows["normalised"]
    print(f"REDACT recall={dev:.3f} (held-out {held:.3f}; as written {rows['as written'][0]:.3f}/"
          f"{rows['as written'][1]:.3f}) fp_rate={fp_rate:.5f} negatives_fp={len(neg_fp)}/{len(NEGATIVES)} "
          f"us_per_kib={us['normalised']:.0f} baseline_us_per_kib={us['as written']:.0f}")


if __name__ == "__main__":
    main()
