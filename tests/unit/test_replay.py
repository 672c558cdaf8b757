"""Replay evaluation (spec §18): APGR / CPT as RouteLLM computes them, pinned on
hand-made data, and the online replay through the router's bandit."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atp_router.policy.replay import (
    Curve,
    Row,
    apgr,
    cpt,
    load_rows,
    oracle_curve,
    picks_curve,
    random_curve,
    run_bandit,
)

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, rows):
    p = tmp_path / "tiny.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


# gain, gain, both right, loss (only weak right), none: weak 0.4, strong 0.6.
TINY = [
    {"prompt": "q1", "weak_correct": False, "strong_correct": True, "subject": "a"},
    {"prompt": "q2", "weak_correct": False, "strong_correct": True, "subject": "a"},
    {"prompt": "q3", "weak_correct": True, "strong_correct": True, "subject": "b"},
    {"prompt": "q4", "weak_correct": True, "strong_correct": False, "subject": "b"},
    {"prompt": "q5", "weak_correct": False, "strong_correct": False, "subject": "b"},
    {"prompt": "dropped", "weak_correct": False, "strong_correct": True, "contaminated": True},
]


def test_load_rows_drops_contaminated_and_names_bad_lines(tmp_path):
    rows = load_rows(_write(tmp_path, TINY))
    assert [r.prompt for r in rows] == ["q1", "q2", "q3", "q4", "q5"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "weak_correct": true, "strong_correct": false}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_rows(bad)


def test_apgr_and_cpt_pinned_on_hand_curves():
    weak, strong = 0.4, 0.6
    diagonal = Curve("d", (0.5,), (0.5,))
    assert apgr(diagonal, weak, strong) == pytest.approx(0.5)
    assert cpt(diagonal, weak, strong, 0.5) == pytest.approx(0.5)
    assert cpt(diagonal, weak, strong, 0.8) == pytest.approx(0.8)
    # PGR 0.75 at 25 % strong calls: area 0.25·0.75/2 + 0.75·(0.75+1)/2.
    good = Curve("g", (0.25,), (0.55,))
    assert apgr(good, weak, strong) == pytest.approx(0.75)
    assert cpt(good, weak, strong, 0.5) == pytest.approx(0.25 * 0.5 / 0.75)
    assert cpt(good, weak, strong, 0.8) == pytest.approx(0.4)
    # A curve below the weak model never reaches PGR 0.5 before the end point.
    bad = Curve("b", (0.5, 0.9), (0.3, 0.3))
    assert cpt(bad, weak, strong, 0.5) == pytest.approx(0.9 + 0.1 * (0.5 + 0.5) / (1 + 0.5))


def test_oracle_on_the_tiny_file(tmp_path):
    rows = load_rows(_write(tmp_path, TINY))
    o = oracle_curve(rows, [i / 100 for i in range(101)])
    # Gains first (40 %: PGR 2), then neutral prompts, the loss last (PGR 1 at 100 %):
    # 0.4·2/2 + 0.4·2 + 0.2·(2+1)/2 = 1.5.
    assert apgr(o, 0.4, 0.6) == pytest.approx(1.5)
    assert cpt(o, 0.4, 0.6, 0.5) == pytest.approx(0.1)
    assert o.accuracy[40] == pytest.approx(0.8) and o.accuracy[100] == pytest.approx(0.6)


def test_random_router_is_near_the_diagonal():
    rng = np.random.default_rng(0)
    rows = [Row(f"q{i}", bool(rng.random() < 0.6), bool(rng.random() < 0.8)) for i in range(4000)]
    weak = sum(r.weak for r in rows) / len(rows)
    strong = sum(r.strong for r in rows) / len(rows)
    c = random_curve(rows, [0.1 * i for i in range(1, 10)], np.random.default_rng(1))
    assert apgr(c, weak, strong) == pytest.approx(0.5, abs=0.06)


def test_online_bandit_beats_random_where_subjects_differ():
    """Subject ``hard``: only the strong model answers; ``easy``: both do. The
    bandit learns from zero, seeing only the arm it calls, to spend its strong
    calls on ``hard``."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(3000):
        hard = rng.random() < 0.3
        rows.append(Row(f"question {i}", weak=not hard and rng.random() < 0.9, strong=rng.random() < 0.95,
                        subject="hard" if hard else "easy"))
    weak = sum(r.weak for r in rows) / len(rows)
    strong = sum(r.strong for r in rows) / len(rows)
    share, acc = run_bandit(rows, 0.3, text=False, seed=0, explore=0.25, bits=10)
    assert share == pytest.approx(0.3, abs=0.03)
    pgr = (acc - weak) / (strong - weak)
    assert pgr > 0.75  # a random router at 30 % strong calls gets PGR ≈ 0.3


def test_picks_score_a_part_of_the_stream_as_the_pass_scored_all_of_it():
    """``run_bandit(picks=...)`` records each row's choice: over the whole stream they
    give the pass's own share and accuracy; over a part, that part's."""
    rows = [Row(f"q{i}", weak=i % 3 != 0, strong=i % 5 != 0, subject="a" if i % 2 else "b") for i in range(600)]
    picks: list[bool] = []
    share, acc = run_bandit(rows, 0.4, text=False, seed=1, explore=0.25, bits=10, picks=picks)
    assert len(picks) == len(rows)
    whole = picks_curve("w", rows, [picks], slice(None))
    assert whole.share == (pytest.approx(share),) and whole.accuracy == (pytest.approx(acc),)
    late = picks_curve("w", rows, [picks], slice(300, None))
    expect = [r.strong if p else r.weak for r, p in zip(rows[300:], picks[300:], strict=True)]
    assert late.share == (pytest.approx(sum(picks[300:]) / 300),)
    assert late.accuracy == (pytest.approx(sum(expect) / 300),)


def _learnable_rows(seed: int) -> list[dict]:
    """400 replay rows where the subject tells when only the strong model is right (40 % hard)."""
    rows = []
    rng = np.random.default_rng(seed)
    for i in range(400):
        hard = rng.random() < 0.4
        rows.append({"prompt": f"p{i} {'integral' if hard else 'capital'}", "subject": "m" if hard else "g",
                     "weak_correct": bool(not hard and rng.random() < 0.9), "strong_correct": bool(rng.random() < 0.9)})
    return rows


def test_bench_last_line(tmp_path):
    data = _write(tmp_path, _learnable_rows(5))
    png = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "replay_routing.py"), "--data", str(data),
                          "--seeds", "2", "--png", str(png)], capture_output=True, text=True, timeout=300, check=True)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("APGR bandit=") and " random=" in last and " oracle=" in last
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert all(len(v.split(".")[1]) == 3 for v in fields.values())
    assert float(fields["bandit"]) > float(fields["random"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_bench_last_line_names_every_router(tmp_path):
    """``--split``: the anchors train on one half, every router is scored on the other; the last line is
    exactly ``APGR bandit=<x> warm=<w> offline=<o> random=<r> oracle=<z>`` and the warm start (the fit on the
    train half, then online) routes better than random on a learnable stream."""
    data = _write(tmp_path, _learnable_rows(7))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "replay_routing.py"), "--data", str(data),
                          "--split", "0.5", "--seeds", "1"], capture_output=True, text=True, timeout=300, check=True)
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"APGR bandit=\d\.\d{3} warm=\d\.\d{3} offline=\d\.\d{3} random=\d\.\d{3} oracle=\d\.\d{3}",
                        last), last
    fields = {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}
    assert fields["warm"] > fields["random"] + 0.1
    assert fields["oracle"] >= fields["offline"]
    halves = out.stdout[out.stdout.index("the test stream in halves"):]
    assert re.search(r"warm − offline, paired\s+[+-]\d\.\d{3} ± \d\.\d{3}\s+[+-]\d\.\d{3} ± \d\.\d{3}", halves), halves


def test_hindsight_subject_router_sends_the_best_subject_first(tmp_path):
    from atp_router.policy.replay import hindsight_subject_curve

    rows = load_rows(_write(tmp_path, TINY))
    c = hindsight_subject_curve(rows, [0.0, 0.4, 1.0])
    # Subject "a" (both prompts gain) goes strong first: 40 % strong calls reach 0.8.
    assert c.accuracy == pytest.approx((0.4, 0.8, 0.6))


@pytest.mark.parametrize("heads", [1, 2])
def test_the_text_gain_warm_start_starts_as_the_offline_anchor_and_routes_online(heads):
    """``warm_text_gain`` (the split bench's ``warm=``, ``atp-router learn --method gain``): its gain
    model ranks held-out prompts as the offline TF-IDF regression with the same C does (1 head: of the
    gain label; 2 heads: of each arm's correctness, the gain their difference), and the warm bandit
    replayed online (explore 0) spends its strong calls where the gain is."""
    from atp_router.policy.bandit import Featurizer
    from atp_router.policy.offline import Tfidf, fit_logistic, gain_label
    from atp_router.policy.replay import score_curve, warm_text_gain
    from atp_router.policy.textgain import TermVocab

    rows = [Row(r["prompt"], r["weak_correct"], r["strong_correct"], r["subject"]) for r in _learnable_rows(11)]
    train, test = rows[:200], rows[200:]
    meta = [{"task_type": "qa", "subject": r.subject} for r in rows]
    vocab = TermVocab.fit([r.prompt for r in train], meta[:200])
    feat = Featurizer(bits=10, text=True)
    feat.vocab = vocab
    ctx = [feat(m, r.prompt) for m, r in zip(meta, rows, strict=True)]
    bandit = warm_text_gain(train, ctx[:200], vocab, bits=10, C=0.3, weight=0.5 if heads == 1 else 1.0, heads=heads)
    vec = Tfidf().fit([r.prompt for r in train], [r.subject for r in train])
    X, Xt = (vec.transform([r.prompt for r in part], [r.subject for r in part]) for part in (train, test))

    def lr(y: list[float]) -> np.ndarray:
        return fit_logistic(X, np.array(y, dtype=float), C=0.3).logit(Xt)

    if heads == 1:
        ours = [bandit.gain.logit(c) for c in ctx[200:]]
        theirs = lr([gain_label(r.weak, r.strong) for r in train])
    else:
        ours = [2 * bandit.gain.mean(c) - 1 for c in ctx[200:]]
        theirs = 1 / (1 + np.exp(-lr([float(r.strong) for r in train]))) - 1 / (1 + np.exp(-lr(
            [float(r.weak) for r in train])))
    np.testing.assert_allclose(ours, theirs, atol=2e-3)
    weak = sum(r.weak for r in test) / len(test)
    strong = sum(r.strong for r in test) / len(test)
    shares = [i / 20 for i in range(21)]
    assert apgr(score_curve("g", test, ours, shares), weak, strong) > 0.7  # random: 0.5
    share, acc = run_bandit(test, 0.4, text=True, seed=0, explore=0.0, bits=10, contexts=ctx[200:], warm=bandit)
    assert share == pytest.approx(0.4, abs=0.1)
    assert (acc - weak) / (strong - weak) > 0.8  # random at 40 % strong calls: PGR ≈ 0.4
