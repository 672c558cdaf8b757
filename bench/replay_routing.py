"""Replay real weak/strong model outcomes through the router's bandit (spec §18).

    .venv/bin/python bench/replay_routing.py [--data FILE] [--seeds N] [--png PATH]

Replays ``--data`` (default ``../shared/routing-replay/mmlu.jsonl``: 14,037 clean
MMLU prompts with Mixtral-8x7B (weak) and GPT-4 (strong) correctness, from
RouteLLM) as an online stream through :class:`atp_router.policy.bandit.Bandit` — the
code the router runs — learning from zero and observing only the arm it called,
once per spend target (share of strong calls, the bandit's ``target_cost``) and
per shuffle (``--seeds``). Two featurizations: meta only (task type, subject,
prompt-length bucket) and meta + hashed prompt words. Baselines in the same
run: a random router, the oracle, and the subject-level router in hindsight
(the ceiling of meta-only routing) (:mod:`atp_router.policy.replay`).

Prints the quality vs strong-call-share curve of each router, then APGR,
CPT(50 %) and CPT(80 %) (mean ± std over the shuffles), writes the curves to
``--png``, and ends with exactly ``APGR bandit=<x> random=<y> oracle=<z>``
(bandit = meta + text features, the router's full featurizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from atp_router.policy.bandit import Featurizer
from atp_router.policy.replay import (
    Curve,
    apgr,
    cpt,
    hindsight_subject_curve,
    load_rows,
    oracle_curve,
    random_curve,
    run_bandit,
)

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "routing-replay" / "mmlu.jsonl"
TARGETS = tuple(round(0.05 * i, 2) for i in range(1, 20))
#: The bandit's configuration in this bench (also the router's policy defaults).
EXPLORE = 0.25
BITS = 14


def _fmt_cpt(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if len(got) < len(values):
        return "never" if not got else f"{100 * statistics.mean(got):.1f} % ({len(values) - len(got)} never)"
    sd = statistics.pstdev(got) if len(got) > 1 else 0.0
    return f"{100 * statistics.mean(got):5.1f} % ± {100 * sd:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--png", default=str(HERE / "results" / "replay_routing.png"))
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be ≥ 1")

    t0 = time.perf_counter()
    rows = load_rows(args.data)
    n = len(rows)
    weak = sum(r.weak for r in rows) / n
    strong = sum(r.strong for r in rows) / n
    if strong <= weak:
        print(f"{args.data}: the strong model ({strong:.3f}) is not better than the weak ({weak:.3f})", file=sys.stderr)
        return 2
    print(f"replay: {n} prompts from {args.data}; weak accuracy {weak:.3f}, strong {strong:.3f}; "
          f"{args.seeds} shuffles × {len(TARGETS)} spend targets; explore={EXPLORE}, 2**{BITS} weights per arm")

    curves: dict[str, list[Curve]] = {"bandit (meta)": [], "bandit (meta+text)": [], "random": []}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        order = [rows[i] for i in rng.permutation(n)]
        for name, text in (("bandit (meta)", False), ("bandit (meta+text)", True)):
            feat = Featurizer(bits=BITS, text=text)
            contexts = [feat({"task_type": "qa", "subject": r.subject}, r.prompt) for r in order]
            pts = [run_bandit(order, t, text=text, seed=seed, explore=EXPLORE, bits=BITS, contexts=contexts)
                   for t in TARGETS]
            curves[name].append(Curve(name, tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
        curves["random"].append(random_curve(order, TARGETS, rng))
    oracle = oracle_curve(rows, [i / 100 for i in range(101)])
    hindsight = hindsight_subject_curve(rows, [i / 50 for i in range(51)])

    print("\nquality vs strong-call share (mean over shuffles): target → share / accuracy")
    print(f"{'target':>6}  " + "  ".join(f"{k:>20}" for k in curves))
    for i, t in enumerate(TARGETS):
        cells = []
        for cs in curves.values():
            s = statistics.mean(c.share[i] for c in cs)
            a = statistics.mean(c.accuracy[i] for c in cs)
            cells.append(f"{100 * s:8.1f} % / {a:.3f}")
        print(f"{100 * t:5.0f}%  " + "  ".join(f"{c:>20}" for c in cells))

    print(f"\n{'router':<20} {'APGR':>14} {'CPT(50%)':>18} {'CPT(80%)':>18}")
    summary: dict[str, float] = {}
    for name, cs in {**curves, "oracle": [oracle], "subject (hindsight)": [hindsight]}.items():
        a = [apgr(c, weak, strong) for c in cs]
        summary[name] = statistics.mean(a)
        sd = statistics.pstdev(a) if len(a) > 1 else 0.0
        print(f"{name:<20} {summary[name]:8.3f} ± {sd:.3f} "
              f"{_fmt_cpt([cpt(c, weak, strong, 0.5) for c in cs]):>18} "
              f"{_fmt_cpt([cpt(c, weak, strong, 0.8) for c in cs]):>18}")

    png = Path(args.png)
    _plot(png, curves, oracle, weak, strong)
    print(f"\ncurves: {png}; {time.perf_counter() - t0:.0f} s")
    print(f"APGR bandit={summary['bandit (meta+text)']:.3f} random={summary['random']:.3f} "
          f"oracle={summary['oracle']:.3f}")
    return 0


def _plot(png: Path, curves: dict[str, list[Curve]], oracle: Curve, weak: float, strong: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5), dpi=110)
    for name, cs in {**curves, "oracle": [oracle]}.items():
        xs = [0.0, *(statistics.mean(c.share[i] for c in cs) for i in range(len(cs[0].share))), 1.0]
        ys = [weak, *(statistics.mean(c.accuracy[i] for c in cs) for i in range(len(cs[0].share))), strong]
        pts = sorted(zip(xs, ys, strict=True))
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="." if name != "oracle" else None,
                label=f"{name} (APGR {statistics.mean(apgr(c, weak, strong) for c in cs):.3f})")
    ax.axhline(weak, color="grey", ls=":", lw=0.8)
    ax.axhline(strong, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("strong-model calls (%)")
    ax.set_ylabel("accuracy")
    ax.set_title("Online routing replay (learning from zero)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
