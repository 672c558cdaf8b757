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

``--split 0.5 --validate`` prints, instead, the figures the split run's choices
(warm-start prior precision, the λ step, the features) were made on: 5-fold
cross-validation inside seed 0's train half, never its test half.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from atp_router.policy.bandit import Bandit, Context, Featurizer
from atp_router.policy.offline import (
    Tfidf,
    fit_arm,
    fit_logistic,
    gain_label,
    gain_table,
)
from atp_router.policy.replay import (
    STRONG,
    WEAK,
    Curve,
    Row,
    apgr,
    cpt,
    hindsight_subject_curve,
    load_rows,
    oracle_curve,
    picks_curve,
    random_curve,
    run_bandit,
    score_curve,
    warm_bandit,
    warm_fit,
    warm_text_gain,
)
from atp_router.policy.textgain import TermVocab, TextGain

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
    ap.add_argument("--split", type=float, default=None,
                    help="train share (e.g. 0.5): anchors trained on it, every router scored on the rest")
    ap.add_argument("--validate", nargs="?", const="all", choices=("all", "gain"), default=None,
                    help="with --split: 5-fold cross-validation inside seed 0's TRAIN half only (the figures "
                         "the bench's choices were made on); the test half is not read. 'gain': only the "
                         "text-gain warm start's candidates")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be ≥ 1")
    if args.split is not None:
        if not 0.0 < args.split < 1.0:
            ap.error("--split must be in (0, 1)")
        return validate_main(args) if args.validate else split_main(args)
    if args.validate:
        ap.error("--validate needs --split")

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


#: Offline logistic regression's inverse regularisation, fixed a priori (scikit-learn's default).
LR_C = 1.0
#: Prior precision of the offline-fitted warm start (``atp-router learn --method fit --prior-precision``),
#: and which warm start the last line's ``warm=`` reports: chosen on a validation split (70/30) of seed 0's
#: TRAIN half, never the test half. Ranking by the fitted gain model (2**14 hashed features), precision
#: 0.3 / 1 / 3 / 10 / 30: APGR 0.661 / 0.672 / 0.682 / 0.689 / 0.688 (TF-IDF LR: 0.712). Online on the
#: validation stream (9 spend targets): warm by update() 0.629, by update() with a gain model 0.613,
#: fitted (precision 10) 0.661, fitted with a gain model 0.639 (precision 1: 0.614) → warm = fitted arms.
#: Re-checked by ``--validate`` (5 folds of the same train half, less noisy than that one 70/30 split):
#: precision 3 / 10 / 30 rank the folds at 0.668 / 0.672 / 0.673 (10 kept, within noise); the features rank as
#: well as TF-IDF (0.672 vs 0.668), so the warm start's loss is the online choice (the λ step:
#: :data:`atp_router.policy.bandit.LAM_STEP`), not the features.
WARM_PRIOR_PRECISION = 10.0
#: The posterior-draw scale (the policy's ``explore``) of the bandit warm-started by that fit (``warm=``): 0,
#: greedy on the posterior means (exploring only where a draw would flip the choice costs more than it
#: teaches once the arms start from 7,000 labelled rows). Chosen by ``--validate`` (5 folds of seed 0's TRAIN
#: half, never the test half), online APGR of the fitted warm start, paired against its own offline ranking
#: (0.672): explore 0.25 / 0.1 / 0: 0.667 / 0.670 / 0.674 (0 − 0.25: +0.007); on a second fold assignment
#: (folds and draws reseeded) 0.1 / 0.05 / 0: 0.660 / 0.662 / 0.662. Rejected on the same folds: starting λ at
#: the train scores' quantile of the spend target (0.672 vs 0.674 at λ = 0), no λ decay (0.674); prior
#: precision by feature kind (meta 10, text 3 / 1 / 0.3: 0.669 / 0.664 / 0.647), IDF prior at text precision
#: 3 / 1 (0.670 / 0.664), 2**18 weights (0.672; text 1: 0.669), text slots seen in < 2 rows frozen (±0.000).
WARM_EXPLORE = 0.0
#: The text-gain warm start (``warm=``, :func:`~atp_router.policy.replay.warm_text_gain`; ``atp-router learn
#: --method gain``): the arms fitted as above plus the offline anchor's model — a logistic regression of the gain on
#: TF-IDF word 1–2-grams + meta (:class:`~atp_router.policy.textgain.TextGain`) — with inverse regularisation
#: ``WARM_GAIN_C`` and the dear arm's estimate averaged ``WARM_GAIN_WEIGHT_1HEAD`` : 1 − w between (cheap arm + gain) and
#: its own arm, both learning online, explore 0. Chosen by ``--validate gain`` (seed 0's TRAIN half only; README):
#: C 0.1 / 0.3 / 1 ranked 0.6726 / 0.6726 / 0.6670 on 5 folds (the arms 0.6720); online (C 0.3) w = 1 / ½ vs the
#: fitted arms alone: 5 folds −0.0024 / +0.0011, 2 × 2 halves +0.0049 / +0.0061 (frozen gain: −0.0072 / −0.0032 and
#: +0.0031 / +0.0094): w = ½ learning is the one candidate at or above the arms alone on both.
WARM_GAIN_C = 0.3
#: Rejected in session 19 on the same folds (seed 0's TRAIN half; paired against the TF-IDF + subject anchor ranking
#: each fold; this warm start online: +0.0070 on the 5 folds, +0.0061 on the 2 × 2 halves, each ± 0.010–0.015):
#: λ started at the quantile of the spend target over out-of-fold train margins +0.0068 / +0.0079 (and with the
#: step already at its floor +0.0068 / +0.0077); a step floor of 0.002 / 0.001 +0.0104 / +0.0107 on the folds but
#: +0.0056 / +0.0046 on the halves (with that λ start +0.0097 / +0.0104 and +0.0071 / +0.0068); choosing by λ
#: averaged over the last 100 / 500 choices +0.0038 / −0.0268 and −0.0045 / −0.0083. None is above the warm start
#: on both fold sets by more than the noise. Features (scikit-learn, ranked, vs word 1–2-grams + subject at C 1):
#: + character 2–5-grams −0.0063 (C 0.3) / −0.0238 (C 1), characters alone −0.0111, + log prompt length +0.0020 ±
#: 0.0079; C 0.3 alone +0.0028 ± 0.0061 (kept above).
WARM_GAIN_WEIGHT_1HEAD = 0.5
#: The warm start's gain model since session 20 (``warm=``; ``atp-router learn --method gain`` by default): 2 heads —
#: the offline anchor's TF-IDF + meta logistic regression of EACH ARM's correctness (C ``WARM_GAIN_C``), the gain
#: their difference, each head learning online only from its own arm's observed outcome (the 1-head model learns a
#: label whose unseen half the hashed arms fill in) — chosen by with weight 1 (the hashed arms keep learning but
#: do not choose). Chosen on seed 0's TRAIN half: ``--validate gain`` (bench/results/replay_routing_validate_gain.txt)
#: ranks it first on both its protocols, online 0.6779 on the 5 folds and 0.6749 on the 2 × 2 halves (the 1-head
#: start above: 0.6749 / 0.6691); a script with two fold assignments of 5 folds (paired against the 1-head
#: warm start, online): 2 heads C 0.3 +0.0030 ± 0.0020 / +0.0049 ± 0.0035 (se), C 1
#: +0.0029 / −0.0063, 2 heads with the 1-head gain at ½ +0.0013 / +0.0002. First seen offline with scikit-learn
#: (ranked, same folds, vs the gain-label regression at C 1): P(strong) − P(weak) +0.0096 ± 0.0019, P(+1) −
#: P(−1) +0.0084, multinomial E[gain] +0.0077, ridge on the gain −0.0055.
WARM_GAIN_HEADS = 2
WARM_GAIN_WEIGHT = 1.0
#: Share points the offline (score-ranking) routers are evaluated at in ``--validate`` (ranked against ranked).
SHARES = tuple(i / 100 for i in range(101))
#: Share points every router of the ``--split`` table is scored at: the online routers' spend targets, so each
#: curve is the same trapezoid rule over the same grid. Scored on a finer grid than the online routers can be, a
#: concave curve's area comes out larger (the offline anchor's by 0.0007–0.0017 per seed on 101 points vs these
#: 19): not like for like.
GRID = TARGETS

#: Every router of the split run: name → the features it sees.
SPLIT_ROUTERS = {
    "LR prompt": "prompt TF-IDF (1-2 grams), trained offline on the train half",
    "LR prompt+subject": "prompt TF-IDF + subject one-hot, trained offline",
    "subject gain table": "subject only, mean gain on the train half",
    "bandit zero": "meta (subject) + hashed prompt words, online from zero on the test half",
    "bandit warm update": "same, after update() over the train half (both outcomes), then online",
    "bandit fit, ranked": "same arms fitted, not online: test prompts ranked by mean(strong) − mean(weak)",
    "bandit warm fit .25": "same, arms fitted to the train half (MAP + Laplace, prior precision 10), then online",
    "bandit warm fit": "same fit, then online with explore 0 (greedy on the posterior means)",
    "text gain, ranked": "prompt TF-IDF + meta, the router's TextGain (2 heads) fitted on the train half (C 0.3), "
                         "not online",
    "bandit warm text gain": "TF-IDF + meta: each arm's fitted regression (C 0.3, TextGain 2 heads) chooses, "
                             "then online (each head its own arm's outcomes), explore 0",
    "bandit warm gain label": "hashed words + meta (arms) and TF-IDF + meta (gain label): fitted arms + TextGain "
                              "1 head, ½ : ½, then online, explore 0 (the warm start before session 20)",
    "bandit zero+gain": "same features, online from zero, with a gain model (strong − weak)",
    "bandit warm+gain": "same as warm fit, plus a fitted gain model it chooses by, then online",
    "random": "nothing",
    "oracle": "both outcomes (the ceiling)",
}


def _meta(r: Row) -> dict[str, object]:
    return {"task_type": "qa", "subject": r.subject}


def split_main(args: argparse.Namespace) -> int:
    """``--split``: per seed, a random ``split`` share trains the anchors and
    everything is scored on the rest (module doc)."""
    t0 = time.perf_counter()
    rows = load_rows(args.data)
    n = len(rows)
    print(f"replay --split {args.split}: {n} prompts from {args.data}; {args.seeds} seeds; "
          f"bandit explore={EXPLORE} (warm={WARM_EXPLORE}), 2**{BITS} weights per arm, {len(TARGETS)} spend targets; "
          f"LR C={LR_C} (fixed a priori), gain target (strong − weak + 1)/2")
    curves: dict[str, list[Curve]] = {k: [] for k in SPLIT_ROUTERS}
    halves_apgr: dict[str, list[list[float]]] = {}
    feat = Featurizer(bits=BITS, text=True)
    contexts_all = [feat(_meta(r), r.prompt) for r in rows]
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        perm = rng.permutation(n)
        k = round(args.split * n)
        tr, te = perm[:k], perm[k:]
        train = [rows[i] for i in tr]
        test = [rows[i] for i in te]
        wk = sum(r.weak for r in test) / len(test)
        st = sum(r.strong for r in test) / len(test)
        y = np.array([gain_label(r.weak, r.strong) for r in train])
        ranked: dict[str, np.ndarray] = {}  # the offline routers' test scores, for the stream halves
        for name, meta in (("LR prompt", False), ("LR prompt+subject", True)):
            vec = Tfidf().fit([r.prompt for r in train], [r.subject for r in train] if meta else None)
            model = fit_logistic(vec.transform([r.prompt for r in train], [r.subject for r in train]), y, C=LR_C)
            scores = model.logit(vec.transform([r.prompt for r in test], [r.subject for r in test]))
            ranked[name] = np.asarray(scores)
            curves[name].append(score_curve(name, test, scores, GRID))
        table = gain_table([r.subject for r in train], [2 * g - 1 for g in y])
        curves["subject gain table"].append(
            score_curve("subject gain table", test, [table.get(r.subject, 0.0) for r in test], GRID))
        ctx_tr = [contexts_all[i] for i in tr]
        ctx_te = [contexts_all[i] for i in te]
        warm = warm_bandit(train, ctx_tr, bits=BITS, explore=EXPLORE)
        fitted = warm_fit(train, ctx_tr, bits=BITS, explore=EXPLORE, prior_precision=WARM_PRIOR_PRECISION, gain=False)
        fitted_gain = warm_fit(train, ctx_tr, bits=BITS, explore=EXPLORE, prior_precision=WARM_PRIOR_PRECISION)
        curves["bandit fit, ranked"].append(score_curve("bandit fit, ranked", test, _arm_gain(fitted, ctx_te), GRID))
        text_warm, label_warm, ctx_te_aux = _text_gain_starts(train, test)
        ranked["text gain, ranked"] = np.array([text_warm.gain.mean(c) for c in ctx_te_aux])
        curves["text gain, ranked"].append(score_curve("text gain, ranked", test, ranked["text gain, ranked"], GRID))
        picks: list[list[bool]] = [[] for _ in TARGETS]
        pts = [run_bandit(test, t, text=True, seed=seed, explore=WARM_EXPLORE, bits=BITS, contexts=ctx_te_aux,
                          warm=text_warm, picks=p) for t, p in zip(TARGETS, picks, strict=True)]
        curves["bandit warm text gain"].append(Curve("w", tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
        pts = [run_bandit(test, t, text=True, seed=seed, explore=WARM_EXPLORE, bits=BITS, contexts=ctx_te_aux,
                          warm=label_warm) for t in TARGETS]
        curves["bandit warm gain label"].append(Curve("l", tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
        _stream_halves(halves_apgr, test, ranked, picks)
        for name, start, gain, ex in (("bandit zero", None, False, EXPLORE),
                                      ("bandit warm update", warm, False, EXPLORE),
                                      ("bandit warm fit .25", fitted, False, EXPLORE),
                                      ("bandit warm fit", fitted, False, WARM_EXPLORE),
                                      ("bandit zero+gain", None, True, EXPLORE),
                                      ("bandit warm+gain", fitted_gain, True, EXPLORE)):
            pts = [run_bandit(test, t, text=True, seed=seed, explore=ex, bits=BITS, contexts=ctx_te, warm=start,
                              gain=gain) for t in TARGETS]
            curves[name].append(Curve(name, tuple(p[0] for p in pts), tuple(p[1] for p in pts)))
        curves["random"].append(random_curve(test, TARGETS, rng))
        curves["oracle"].append(oracle_curve(test, GRID))
        print(f"  seed {seed}: " + ", ".join(f"{k} {apgr(v[-1], wk, st):.3f}" for k, v in curves.items())
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)

    # weak/strong accuracy of each seed's test half, for its curves
    halves = []
    for seed in range(args.seeds):
        perm = np.random.default_rng(seed).permutation(n)
        test = [rows[i] for i in perm[round(args.split * n):]]
        halves.append((sum(r.weak for r in test) / len(test), sum(r.strong for r in test) / len(test)))
    print(f"\n{'router':<22} {'APGR':>14} {'CPT(50%)':>18} {'CPT(80%)':>18}  features")
    summary: dict[str, float] = {}
    for name, cs in curves.items():
        a = [apgr(c, *halves[i]) for i, c in enumerate(cs)]
        summary[name] = statistics.mean(a)
        sd = statistics.pstdev(a) if len(a) > 1 else 0.0
        print(f"{name:<22} {summary[name]:8.3f} ± {sd:.3f} "
              f"{_fmt_cpt([cpt(c, *halves[i], 0.5) for i, c in enumerate(cs)]):>18} "
              f"{_fmt_cpt([cpt(c, *halves[i], 0.8) for i, c in enumerate(cs)]):>18}  {SPLIT_ROUTERS[name]}")
    _print_halves(halves_apgr)
    best = max(("LR prompt", "LR prompt+subject"), key=lambda k: summary[k])
    print(f"\noffline = {best} (the better offline LR anchor); {time.perf_counter() - t0:.0f} s")
    print(f"APGR bandit={summary['bandit zero']:.3f} warm={summary['bandit warm text gain']:.3f} "
          f"offline={summary[best]:.3f} "
          f"random={summary['random']:.3f} oracle={summary['oracle']:.3f}")
    return 0


def _stream_halves(out: dict[str, list[list[float]]], test: list[Row], ranked: dict[str, np.ndarray],
                   picks: list[list[bool]]) -> None:
    """One seed's APGR on each half of the test stream, in the order the online routers saw it: the
    warm-started bandit (its choices on those rows, made while it learned from the rows before) against the
    offline routers ranking the same rows (fixed: they learn nothing from the stream)."""
    m = len(test) // 2
    for h, part in enumerate((slice(0, m), slice(m, None))):
        sub = test[part]
        wk, st = sum(r.weak for r in sub) / len(sub), sum(r.strong for r in sub) / len(sub)
        for name in ("LR prompt+subject", "text gain, ranked"):
            out.setdefault(name, [[], []])[h].append(apgr(score_curve(name, sub, ranked[name][part], GRID), wk, st))
        out.setdefault("bandit warm text gain", [[], []])[h].append(
            apgr(picks_curve("w", test, picks, part), wk, st))


def _print_halves(out: dict[str, list[list[float]]]) -> None:
    """The stream-halves table (:func:`_stream_halves`): mean ± std over the seeds, and warm − offline paired."""
    print("\nthe test stream in halves (online routers learn from the first half before the second; the offline "
          "ones are fixed)")
    print(f"{'router':<22} {'APGR 1st half':>16} {'APGR 2nd half':>16}")
    for name, (a, b) in out.items():
        sd = [statistics.pstdev(x) if len(x) > 1 else 0.0 for x in (a, b)]
        print(f"{name:<22} {statistics.mean(a):9.3f} ± {sd[0]:.3f} {statistics.mean(b):9.3f} ± {sd[1]:.3f}")
    w, o = out["bandit warm text gain"], out["LR prompt+subject"]
    d = [[x - y for x, y in zip(w[h], o[h], strict=True)] for h in (0, 1)]
    print(f"{'warm − offline, paired':<22} " + " ".join(
        f"{statistics.mean(x):+9.3f} ± {statistics.pstdev(x) if len(x) > 1 else 0.0:.3f}" for x in d))


def _text_gain_starts(train: list[Row], test: list[Row]) -> tuple[Bandit, Bandit, list[Context]]:
    """The text-gain warm starts fitted on ``train`` (as ``atp-router learn --method gain``): 2 heads (``warm=``)
    and 1 head (session 19's), over one vocabulary, and the test rows' contexts from the policy featurizer
    holding it."""
    vocab = TermVocab.fit([r.prompt for r in train], [_meta(r) for r in train])
    feat = Featurizer(bits=BITS, text=True)
    feat.vocab = vocab
    ctx_tr = [feat(_meta(r), r.prompt) for r in train]
    two, one = (warm_text_gain(train, ctx_tr, vocab, bits=BITS, explore=WARM_EXPLORE,
                               prior_precision=WARM_PRIOR_PRECISION, C=WARM_GAIN_C, heads=heads, weight=weight)
                for heads, weight in ((WARM_GAIN_HEADS, WARM_GAIN_WEIGHT), (1, WARM_GAIN_WEIGHT_1HEAD)))
    return two, one, [feat(_meta(r), r.prompt) for r in test]


def _arm_gain(bandit: Bandit, contexts: list[Context]) -> np.ndarray:
    """Each context's posterior-mean quality of the strong arm minus the weak arm's."""
    return np.array([bandit.arms[STRONG].mean(c) - bandit.arms[WEAK].mean(c) for c in contexts])


def _idf_precision(rows: list[Row], q0: float) -> np.ndarray:
    """A candidate (``--validate``): IDF as the arms' prior scale. Scaling feature j by s_j under prior
    precision q is the same model as the unscaled feature under q / s_j² (the diagonal Laplace update too),
    so the text slots get q0 / (idf_j / c)², idf_j = ln((1+n)/(1+df_j)) + 1 of the hashed slot (c: the
    RMS idf over the training text values, keeping the text's overall scale), meta slots q0."""
    text, meta = Featurizer(bits=BITS, text=True), Featurizer(bits=BITS)
    df = np.zeros(1 << BITS)
    meta_slots: set[int] = set()
    pairs = []
    for r in rows:
        c, m = text(_meta(r), r.prompt), meta(_meta(r), r.prompt)
        meta_slots.update(m.idx.tolist())
        t = ~np.isin(c.idx, m.idx)
        df[c.idx[t]] += 1
        pairs.append((c.idx[t], c.val[t]))
    idf = np.log((1 + len(rows)) / (1 + df)) + 1.0
    num = sum(float((v * v) @ (idf[i] ** 2)) for i, v in pairs)
    den = sum(float(v @ v) for _, v in pairs)
    scale = idf / math.sqrt(num / den)
    scale[list(meta_slots)] = 1.0
    return q0 / (scale * scale)


def _online(rows: list[Row], contexts: list[Context], warm: Bandit | None, step: tuple[float, float], wk: float,
            st: float, explore: float = EXPLORE) -> float:
    pts = [run_bandit(rows, t, text=True, seed=0, explore=explore, bits=BITS, contexts=contexts, warm=warm,
                      lam_step=step[0], lam_tau=step[1]) for t in TARGETS]
    return apgr(Curve("o", tuple(p[0] for p in pts), tuple(p[1] for p in pts)), wk, st)


#: λ step schedules ``--validate`` compares: name → (floor ``lam_step``, decay ``lam_tau``); the step starts at
#: :data:`~atp_router.policy.bandit.LAM_STEP_START` = 0.02 (τ ≈ 0: the floor from the first choice).
LAM_CANDIDATES = (("step 0.02", (0.02, 1e-9)), ("step 0.01", (0.01, 1e-9)), ("step 0.005", (0.005, 1e-9)),
                  ("0.02→0.005 τ=10", (0.005, 10.0)), ("0.02→0.005 τ=30", (0.005, 30.0)),
                  ("0.02→0.005 τ=100", (0.005, 100.0)), ("0.02→0.005 τ=1000", (0.005, 1000.0)))


def _lr_ranked(fit_rows: list[Row], val: list[Row], wk: float, st: float) -> float:
    """APGR on ``val`` of the offline anchor (TF-IDF + subject gain regression) fitted on ``fit_rows``."""
    y = np.array([gain_label(r.weak, r.strong) for r in fit_rows])
    vec = Tfidf().fit([r.prompt for r in fit_rows], [r.subject for r in fit_rows])
    lr = fit_logistic(vec.transform([r.prompt for r in fit_rows], [r.subject for r in fit_rows]), y, C=LR_C)
    return apgr(score_curve(
        "lr", val, lr.logit(vec.transform([r.prompt for r in val], [r.subject for r in val])), SHARES), wk, st)


def _validate_fold(train: list[Row], ctx: list[Context], fold: np.ndarray) -> dict[str, float]:
    """One fold's candidates: fitted on the rest of the train half, scored on ``fold``."""
    rest = np.setdiff1d(np.arange(len(train)), fold)
    fit_rows, val = [train[i] for i in rest], [train[i] for i in fold]
    cf, cv = [ctx[i] for i in rest], [ctx[i] for i in fold]
    wk, st = sum(r.weak for r in val) / len(val), sum(r.strong for r in val) / len(val)
    out: dict[str, float] = {}
    out["LR TF-IDF + subject, ranked"] = _lr_ranked(fit_rows, val, wk, st)
    fits = {}
    for name, q in (("fit q=10, ranked", WARM_PRIOR_PRECISION), ("fit q=3, ranked", 3.0), ("fit q=30, ranked", 30.0),
                    ("fit q=10 + IDF prior, ranked", None)):
        b = Bandit({WEAK: 0.0, STRONG: 1.0}, bits=BITS, explore=EXPLORE, prior_precision=q or WARM_PRIOR_PRECISION)
        if q is None:
            idf_q = _idf_precision(fit_rows, WARM_PRIOR_PRECISION)
            for arm in b.arms.values():
                arm.q[:] = idf_q
        for arm, label in ((b.arms[WEAK], [float(r.weak) for r in fit_rows]),
                           (b.arms[STRONG], [float(r.strong) for r in fit_rows])):
            fit_arm(arm, cf, label)
        fits[name] = b
        out[name] = apgr(score_curve(name, val, _arm_gain(b, cv), SHARES), wk, st)
    for start, steps in (("fit q=10", LAM_CANDIDATES), ("from zero", LAM_CANDIDATES[:1] + LAM_CANDIDATES[3:])):
        for name, step in steps:
            out[f"{start}, online, λ {name}"] = _online(val, cv, fits["fit q=10, ranked"] if start != "from zero"
                                                       else None, step, wk, st)
    for ex in (0.1, WARM_EXPLORE):
        out[f"fit q=10, online, explore {ex}"] = _online(val, cv, fits["fit q=10, ranked"], LAM_CANDIDATES[3][1], wk,
                                                         st, explore=ex)
    return out


def _online_quantile(rows: list[Row], contexts: list[Context], warm: Bandit, window: int, wk: float,
                     st: float) -> float:
    """A candidate (``--validate gain``): the warm start online, but the strong call decided by a threshold at the
    ``1 − target`` quantile of the last ``window`` margins (strong − weak estimate) instead of the dual-ascent λ
    (its random walk is the jitter the warm start loses to; the dual λ serves the first 50 choices)."""
    pts = []
    for t in TARGETS:
        b = copy.deepcopy(warm)
        b.explore, b.target_cost, b.lam, b.choices, b.spent = 0.0, t, 0.0, 0, 0.0
        rng, margins = np.random.default_rng(0), collections.deque(maxlen=window)
        strong_calls = correct = 0
        for r, c in zip(rows, contexts, strict=True):
            ch = b.choose(c, rng)
            arm, m = ch.order[0], ch.sampled[STRONG] - ch.sampled[WEAK]
            if len(margins) >= 50:
                arm = STRONG if m > float(np.quantile(np.fromiter(margins, float), 1.0 - t)) else WEAK
            margins.append(m)
            b.charge((arm,))
            ok = r.strong if arm == STRONG else r.weak
            strong_calls, correct = strong_calls + (arm == STRONG), correct + ok
            b.update(c, {arm: 1.0 if ok else 0.0})
        pts.append((strong_calls / len(rows), correct / len(rows)))
    return apgr(Curve("q", tuple(p[0] for p in pts), tuple(p[1] for p in pts)), wk, st)


class _FrozenGain(TextGain):
    """A candidate (``--validate gain``): the text gain model that never learns online."""

    __slots__ = ()

    def update(self, ctx: Context, label: float, weight: float = 1.0, *, only: int | None = None) -> None:
        return


def _validate_gain_fold(train: list[Row], ctx: list[Context], fold: np.ndarray) -> dict[str, float]:
    """One fold's text-gain candidates (:func:`warm_text_gain`), fitted on the rest of the train half."""
    rest = np.setdiff1d(np.arange(len(train)), fold)
    fit_rows, val = [train[i] for i in rest], [train[i] for i in fold]
    wk, st = sum(r.weak for r in val) / len(val), sum(r.strong for r in val) / len(val)
    vocab = TermVocab.fit([r.prompt for r in fit_rows], [_meta(r) for r in fit_rows])
    feat = Featurizer(bits=BITS, text=True)
    feat.vocab = vocab
    cf, cv = [feat(_meta(r), r.prompt) for r in fit_rows], [feat(_meta(r), r.prompt) for r in val]
    out: dict[str, float] = {}
    out["LR TF-IDF + subject, ranked"] = _lr_ranked(fit_rows, val, wk, st)
    y = np.array([gain_label(r.weak, r.strong) for r in fit_rows])
    b = warm_fit(fit_rows, cf, bits=BITS, explore=0.0, prior_precision=WARM_PRIOR_PRECISION, gain=False)
    out["fit q=10, ranked"] = apgr(score_curve("a", val, _arm_gain(b, cv), SHARES), wk, st)
    step = LAM_CANDIDATES[3][1]
    out["fit q=10, online, explore 0"] = _online(val, cv, b, step, wk, st, 0.0)
    for c in (0.1, 1.0, WARM_GAIN_C):
        g = TextGain(vocab).fit(cf, y, C=c)
        out[f"text gain C={c}, ranked"] = apgr(score_curve("g", val, [g.logit(x) for x in cv], SHARES), wk, st)
    for w in (1.0, WARM_GAIN_WEIGHT_1HEAD):
        for frozen in (False, True):
            gm = (_FrozenGain if frozen else TextGain)(vocab)
            gm.m, gm.q = g.m.copy(), g.q.copy()
            b.set_gain(gm, w)
            out[f"text gain C={WARM_GAIN_C} w={w}{' frozen' if frozen else ''}, online"] = _online(
                val, cv, b, step, wk, st, explore=0.0)
    for c in (1.0, WARM_GAIN_C):
        two = TextGain(vocab, heads=2).fit(cf, [(float(r.weak), float(r.strong)) for r in fit_rows], C=c)
        out[f"text gain 2 heads C={c}, ranked"] = apgr(score_curve("2", val, [two.mean(x) for x in cv], SHARES), wk, st)
        b.set_gain(two, 1.0)
        out[f"text gain 2 heads C={c} w=1, online"] = _online(val, cv, b, step, wk, st, explore=0.0)
    b.set_gain(g, WARM_GAIN_WEIGHT_1HEAD)
    for window in (500, 2000):
        out[f"same w={WARM_GAIN_WEIGHT_1HEAD}, quantile threshold W={window}"] = _online_quantile(val, cv, b, window, wk, st)
    return out


def validate_main(args: argparse.Namespace) -> int:
    """``--split --validate``: the candidates of each choice, by 5-fold cross-validation of seed 0's
    train half (the split :func:`split_main` uses for seed 0); the test half is never read."""
    t0 = time.perf_counter()
    rows = load_rows(args.data)
    perm = np.random.default_rng(0).permutation(len(rows))
    train = [rows[i] for i in perm[:round(args.split * len(rows))]]
    feat = Featurizer(bits=BITS, text=True)
    ctx = [feat(_meta(r), r.prompt) for r in train]
    folds = np.array_split(np.random.default_rng(1).permutation(len(train)), 5)
    if args.validate == "gain":  # also as the split run scores: fit on one half, online over the other (2 × 2)
        halves = [np.random.default_rng(10 + s).permutation(len(train)) for s in range(2)]
        folds += [h for p in halves for h in (p[:len(p) // 2], p[len(p) // 2:])]
    print(f"validate: 5 folds of seed 0's train half ({len(train)} of {len(rows)} prompts); explore={EXPLORE}, "
          f"2**{BITS} weights, {len(TARGETS)} spend targets online")
    res: dict[str, list[float]] = {}
    for i, fold in enumerate(folds):
        for k, v in (_validate_gain_fold if args.validate == "gain" else _validate_fold)(train, ctx, fold).items():
            res.setdefault(k, []).append(v)
        print(f"  fold {i} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.validate == "gain":
        _report(res, "fit q=10, online, explore 0", slice(0, 5), "5 folds")
        _report(res, "fit q=10, online, explore 0", slice(5, 9), "2 × 2 halves (fit on one, online over the other)")
    else:
        _report(res, "fit q=10, ranked", slice(0, 5), "5 folds")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


def _report(res: dict[str, list[float]], base_key: str, sl: slice, title: str) -> None:
    base = res[base_key][sl]
    print(f"\n{title}\n{'candidate':<40} {'APGR':>7}  paired − '{base_key}' (mean ± s.e.)")
    for k, v in res.items():
        d = [a - b for a, b in zip(v[sl], base, strict=True)]
        print(f"{k:<40} {statistics.mean(v[sl]):7.4f}  {statistics.mean(d):+.4f} ± "
              f"{statistics.stdev(d) / math.sqrt(len(d)):.4f}")


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
