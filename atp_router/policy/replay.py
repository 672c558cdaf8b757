"""Replay evaluation of weak/strong routing (spec §18), as RouteLLM measures it.

Data: one JSON object per line with ``prompt``, ``weak_correct``,
``strong_correct`` and optional ``subject`` and ``contaminated`` (rows with
``contaminated: true`` are dropped) — the format of
``../shared/routing-replay/mmlu.jsonl``.

Metrics (RouteLLM, Ong et al. 2024, §5): for a router that sends a share ``s``
of the prompts to the strong model and reaches accuracy ``acc``,
``PGR = (acc − weak) / (strong − weak)``; a router's curve is PGR against
``s``, linearly interpolated between its measured points and closed by the
two single-model routers (s = 0: all weak; s = 1: all strong);
**APGR** is the area under that curve for ``s`` in 0..1 (trapezoids);
**CPT(x)** the smallest ``s`` at which the curve reaches PGR = x (None if it
never does). A random router's expected curve is the diagonal (APGR 0.5).
The oracle sends first exactly the prompts the weak model fails and the strong
model answers, then (beyond that share) those both answer alike, and only
last those only the weak model answers.

:func:`run_bandit` replays the rows as an online stream through
:class:`atp_router.policy.bandit.Bandit` — the router's own code — learning from
zero and observing only the arm it called.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atp_router.policy.bandit import LAM_STEP, LAM_STEP_TAU, Bandit, Featurizer
from atp_router.policy.offline import fit_arm, gain_label
from atp_router.policy.textgain import TermVocab, TextGain

__all__ = ["Curve", "Row", "apgr", "cpt", "hindsight_subject_curve", "load_rows", "oracle_curve", "picks_curve",
           "random_curve", "run_bandit", "score_curve", "warm_bandit", "warm_fit", "warm_text_gain"]

WEAK, STRONG = "weak", "strong"


@dataclass(frozen=True, slots=True)
class Row:
    prompt: str
    weak: bool
    strong: bool
    subject: str | None = None


def load_rows(path: str | Path) -> list[Row]:
    """The clean rows of a replay file; raises ValueError naming the line of a
    malformed one."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                if o.get("contaminated"):
                    continue
                rows.append(Row(str(o["prompt"]), bool(o["weak_correct"]), bool(o["strong_correct"]),
                                o.get("subject")))
            except (KeyError, TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


@dataclass(frozen=True, slots=True)
class Curve:
    """A router's measured points: strong-call ``share`` (0..1) and ``accuracy``."""

    name: str
    share: tuple[float, ...]
    accuracy: tuple[float, ...]


def _pgr_points(curve: Curve, weak: float, strong: float) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted(zip(curve.share, curve.accuracy, strict=True))
    xs = [0.0] + [min(max(s, 0.0), 1.0) for s, _ in pts] + [1.0]
    ys = [weak] + [a for _, a in pts] + [strong]
    x = np.asarray(xs)
    y = (np.asarray(ys) - weak) / (strong - weak)
    return x, y


def apgr(curve: Curve, weak: float, strong: float) -> float:
    """Area under the PGR curve for strong-call share 0..1 (module doc)."""
    x, y = _pgr_points(curve, weak, strong)
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))


def cpt(curve: Curve, weak: float, strong: float, target: float) -> float | None:
    """Smallest strong-call share at which the interpolated PGR reaches
    ``target`` (e.g. 0.5 for CPT(50 %)); None if the curve never does."""
    x, y = _pgr_points(curve, weak, strong)
    if y[0] >= target:
        return 0.0
    for i in range(1, len(x)):
        if y[i] >= target:
            if y[i] == y[i - 1]:
                return float(x[i])
            return float(x[i - 1] + (target - y[i - 1]) * (x[i] - x[i - 1]) / (y[i] - y[i - 1]))
    return None


def oracle_curve(rows: Sequence[Row], shares: Iterable[float]) -> Curve:
    """The oracle's accuracy at each share (module doc)."""
    n = len(rows)
    weak_acc = sum(r.weak for r in rows) / n
    gain = sum((not r.weak) and r.strong for r in rows) / n
    loss = sum(r.weak and not r.strong for r in rows) / n
    shares = tuple(shares)
    acc = tuple(weak_acc + min(s, gain) - max(0.0, s - (1.0 - loss)) for s in shares)
    return Curve("oracle", shares, acc)


def hindsight_subject_curve(rows: Sequence[Row], shares: Iterable[float]) -> Curve:
    """A router that knows each subject's true strong − weak gain in
    hindsight and sends the subjects with the largest gain to the strong model
    first: the ceiling of any router that sees only the subject."""
    by: dict[str | None, list[int]] = {}
    for r in rows:
        by.setdefault(r.subject, []).append(int(r.strong) - int(r.weak))
    gain = {k: sum(v) / len(v) for k, v in by.items()}
    return score_curve("subject in hindsight", rows, [gain[r.subject] for r in rows], shares)


def score_curve(name: str, rows: Sequence[Row], scores: Sequence[float] | np.ndarray,
                shares: Iterable[float]) -> Curve:
    """An offline router that scores every prompt (higher: more worth the
    strong model) and, at share ``s``, sends the ``round(s·n)`` best-scored
    prompts to the strong model (ties: row order)."""
    sc = np.asarray(scores, dtype=np.float64)
    if sc.shape != (len(rows),):
        raise ValueError("score_curve: one score per row")
    order = np.argsort(-sc, kind="stable")
    weak = np.fromiter((r.weak for r in rows), dtype=bool)
    strong = np.fromiter((r.strong for r in rows), dtype=bool)
    out_s, out_a = [], []
    for s in shares:
        k = round(s * len(rows))
        pick = np.zeros(len(rows), dtype=bool)
        pick[order[:k]] = True
        out_s.append(k / len(rows))
        out_a.append(float(np.where(pick, strong, weak).mean()))
    return Curve(name, tuple(out_s), tuple(out_a))


def random_curve(rows: Sequence[Row], shares: Iterable[float], rng: np.random.Generator) -> Curve:
    """A router that calls strong with probability ``s`` (one pass per share)."""
    weak = np.fromiter((r.weak for r in rows), dtype=bool)
    strong = np.fromiter((r.strong for r in rows), dtype=bool)
    out_s, out_a = [], []
    for s in shares:
        pick = rng.random(len(rows)) < s
        out_s.append(float(pick.mean()))
        out_a.append(float(np.where(pick, strong, weak).mean()))
    return Curve("random", tuple(out_s), tuple(out_a))


def run_bandit(
    rows: Sequence[Row],
    target_share: float,
    *,
    text: bool,
    seed: int,
    explore: float = 1.0,
    lam_step: float = LAM_STEP,
    bits: int = 14,
    contexts: Sequence | None = None,
    warm: Bandit | None = None,
    gain: bool = False,
    lam_tau: float = LAM_STEP_TAU,
    picks: list[bool] | None = None,
) -> tuple[float, float]:
    """One online pass of the router's :class:`~atp_router.policy.bandit.Bandit` over
    ``rows`` (in the given order) with strong-call spend target
    ``target_share``: returns (strong-call share, accuracy). Each row's meta is
    ``{"task_type": "qa", "subject": ...}``; with ``text`` the prompt's hashed
    words too. ``contexts`` may pass the featurized rows (same order) to skip
    featurizing again. ``warm``: start from (a copy of) this bandit's learned
    arms instead of from zero (:func:`warm_bandit`); ``gain``: from zero with
    a gain model (:class:`~atp_router.policy.bandit.Bandit`'s ``gain``); ``lam_step``, ``lam_tau``: λ's
    dual-ascent step and its decay (:class:`~atp_router.policy.bandit.Bandit`);
    ``picks``: a list the pass appends each row's choice to (True: the strong
    model), for scoring part of the stream (:func:`picks_curve`)."""
    rng = np.random.default_rng(seed)
    if warm is not None:
        bandit = copy.deepcopy(warm)
        bandit.explore, bandit.target_cost, bandit.lam_step, bandit.lam = explore, target_share, lam_step, 0.0
        bandit.lam_tau, bandit.choices, bandit.spent = lam_tau, 0, 0.0
    else:
        bandit = Bandit({WEAK: 0.0, STRONG: 1.0}, bits=bits, explore=explore, target_cost=target_share,
                        lam_step=lam_step, gain=gain, lam_tau=lam_tau)
    if contexts is None:
        feat = Featurizer(bits=bits, text=text)
        contexts = [feat({"task_type": "qa", "subject": r.subject}, r.prompt) for r in rows]
    strong_calls = correct = 0
    for r, ctx in zip(rows, contexts, strict=True):
        arm = bandit.choose(ctx, rng).order[0]
        bandit.charge((arm,))
        ok = r.strong if arm == STRONG else r.weak
        strong_calls += arm == STRONG
        correct += ok
        if picks is not None:
            picks.append(arm == STRONG)
        bandit.update(ctx, {arm: 1.0 if ok else 0.0})
    return strong_calls / len(rows), correct / len(rows)


def picks_curve(name: str, rows: Sequence[Row], picks: Sequence[Sequence[bool]], part: slice) -> Curve:
    """The curve of online passes (one ``picks`` list per spend target, as
    :func:`run_bandit` fills it) scored on ``rows[part]`` only: each pass's
    strong-call share and accuracy over those rows."""
    sub = rows[part]
    weak = np.fromiter((r.weak for r in sub), dtype=bool)
    strong = np.fromiter((r.strong for r in sub), dtype=bool)
    out_s, out_a = [], []
    for p in picks:
        pick = np.asarray(p[part], dtype=bool)
        out_s.append(float(pick.mean()))
        out_a.append(float(np.where(pick, strong, weak).mean()))
    return Curve(name, tuple(out_s), tuple(out_a))


def warm_bandit(rows: Sequence[Row], contexts: Sequence, *, bits: int = 14, explore: float = 1.0) -> Bandit:
    """A weak/strong bandit that has learned from labelled ``rows`` (both
    models' outcomes known) through :meth:`Bandit.update`, the live router's
    learning step, one observation per row and arm, in the given order."""
    bandit = Bandit({WEAK: 0.0, STRONG: 1.0}, bits=bits, explore=explore)
    for r, ctx in zip(rows, contexts, strict=True):
        bandit.update(ctx, {WEAK: 1.0 if r.weak else 0.0, STRONG: 1.0 if r.strong else 0.0})
    return bandit


def warm_fit(rows: Sequence[Row], contexts: Sequence, *, bits: int = 14, explore: float = 1.0,
             prior_precision: float = 10.0, gain: bool = True) -> Bandit:
    """A weak/strong bandit whose posteriors are an offline fit to labelled
    ``rows`` (:func:`atp_router.policy.offline.fit_arm`: the MAP and its Laplace
    precision, the prior the online bandit then keeps updating): each arm on
    its correctness and, with ``gain``, the gain model on ``(strong − weak + 1)/2``."""
    bandit = Bandit({WEAK: 0.0, STRONG: 1.0}, bits=bits, explore=explore, prior_precision=prior_precision, gain=gain)
    fit_arm(bandit.arms[WEAK], contexts, [float(r.weak) for r in rows])
    fit_arm(bandit.arms[STRONG], contexts, [float(r.strong) for r in rows])
    if bandit.gain is not None:
        fit_arm(bandit.gain, contexts, [gain_label(r.weak, r.strong) for r in rows])
    return bandit


def warm_text_gain(rows: Sequence[Row], contexts: Sequence, vocab: TermVocab, *, bits: int = 14,
                   explore: float = 0.0, prior_precision: float = 10.0, C: float = 0.3,
                   weight: float = 1.0, heads: int = 2) -> Bandit:
    """The warm start ``atp-router learn --method gain`` writes: the arms fitted
    as :func:`warm_fit` (without its hashed gain model) and a
    :class:`~atp_router.policy.textgain.TextGain` over ``vocab``, C = ``C``, that
    the bandit chooses by with ``weight`` (:meth:`Bandit.set_gain
    <atp_router.policy.bandit.Bandit.set_gain>`): ``heads`` 2 — the offline
    anchor's TF-IDF logistic regression of each arm's correctness (the gain their
    difference; each learns its own arm's outcomes online); 1 — of the gain label
    ``(strong − weak + 1)/2``. ``contexts`` must carry ``aux`` (a featurizer
    holding ``vocab``)."""
    bandit = warm_fit(rows, contexts, bits=bits, explore=explore, prior_precision=prior_precision, gain=False)
    labels: list[Any] = ([gain_label(r.weak, r.strong) for r in rows] if heads == 1
                         else [(float(r.weak), float(r.strong)) for r in rows])
    bandit.set_gain(TextGain(vocab, heads=heads).fit(contexts, labels, C=C), weight)
    return bandit
