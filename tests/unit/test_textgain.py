"""The text gain model (issue 23): the offline anchor's TF-IDF gain regression as
a model the router's featurizer and bandit compute and keep learning online."""

import numpy as np
import pytest

from atp_router.policy.bandit import Bandit, Featurizer
from atp_router.policy.offline import Tfidf, fit_logistic, gain_label
from atp_router.policy.textgain import TermVocab, TextGain


def _rows(n: int, seed: int = 0) -> list[tuple[str, str, bool, bool]]:
    """(prompt, subject, weak, strong): 'integral' prompts only the strong model answers."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "theta", "kappa"]
    out = []
    for i in range(n):
        hard = rng.random() < 0.4
        body = " ".join(rng.choice(words, size=6))
        prompt = f"q{i % 17} {body} {'evaluate the integral' if hard else 'name the capital'} of {words[i % 7]}"
        out.append((prompt, "m" if i % 3 else "g", bool(not hard and rng.random() < 0.9), bool(rng.random() < 0.9)))
    return out


def _featurizer(rows):
    vocab = TermVocab.fit([p for p, *_ in rows], [{"subject": s} for _, s, *_ in rows])
    feat = Featurizer(bits=10, text=True)
    feat.vocab = vocab
    return vocab, feat


def test_the_fit_is_the_offline_anchors_regression():
    """Same vocabulary, idf, sublinear tf, L2 rows, meta one-hots, C: the logits equal
    :func:`fit_logistic` on :class:`Tfidf` up to the optimiser's tolerance."""
    rows = _rows(300)
    vocab, feat = _featurizer(rows)
    ctx = [feat({"subject": s}, p) for p, s, *_ in rows]
    y = [gain_label(w, s) for _, _, w, s in rows]
    g = TextGain(vocab).fit(ctx, y, C=1.0)
    vec = Tfidf().fit([p for p, *_ in rows], [s for _, s, *_ in rows])
    assert len(vocab.keys) == len(vec.vocab) and len(vocab.meta) == len(vec.meta) == 2
    X = vec.transform([p for p, *_ in rows], [s for _, s, *_ in rows])
    lr = fit_logistic(X, np.array(y), C=1.0)
    np.testing.assert_allclose([g.logit(c) for c in ctx], lr.logit(X), atol=2e-3)
    # the Laplace precision: 1/C plus the curvature, the intercept ≈ unpenalised
    assert g.q[:-1].min() >= 1.0 and g.q[-1] > 1.0 and g.count == 300
    # 'integral' raises the gain, 'capital' lowers it
    hi = feat({"subject": "m"}, "evaluate the integral of beta")
    lo = feat({"subject": "m"}, "name the capital of beta")
    assert g.mean(hi) > 0.5 > g.mean(lo)


def test_unknown_terms_are_dropped_and_a_context_without_aux_learns_nothing():
    rows = _rows(60)
    vocab, feat = _featurizer(rows)
    ctx = feat({"subject": "nobody"}, "zzz yyy")
    assert ctx.aux is not None and ctx.aux.idx.tolist() == [vocab.n_cols - 1]  # the intercept alone
    g = TextGain(vocab)
    plain = Featurizer(bits=10, text=True)({"subject": "m"}, "evaluate the integral")
    assert plain.aux is None
    g.update(plain, 1.0)
    g.update(ctx, 1.0, only=3)  # tenant-scoped feedback: no tenant features here
    assert g.count == 0 and not g.m.any()
    g.update(ctx, 1.0)
    assert g.count == 1 and g.m[-1] > 0


def test_state_round_trip_and_malformed_states_refused():
    rows = _rows(120)
    vocab, feat = _featurizer(rows)
    ctx = [feat({"subject": s}, p) for p, s, *_ in rows]
    g = TextGain(vocab).fit(ctx, [gain_label(w, s) for _, _, w, s in rows], C=0.3)
    back = TextGain.from_state(g.state())
    assert [back.logit(c) for c in ctx] == [g.logit(c) for c in ctx]
    assert back.count == g.count
    bad = dict(g.state())
    bad["q"] = np.zeros(vocab.n_cols).tobytes()
    with pytest.raises(ValueError):
        TextGain.from_state(bad)
    bad = dict(g.state())
    bad["keys"] = bad["keys"][8:] + bad["keys"][:8]  # not sorted
    with pytest.raises(ValueError):
        TextGain.from_state(bad)
    bad = dict(g.state())
    bad["m"] = bad["m"][:-8]
    with pytest.raises(ValueError):
        TextGain.from_state(bad)


def test_the_bandit_averages_the_dear_arms_two_estimates():
    rows = _rows(200)
    vocab, feat = _featurizer(rows)
    ctx = [feat({"subject": s}, p) for p, s, *_ in rows]
    g = TextGain(vocab).fit(ctx, [gain_label(w, s) for _, _, w, s in rows])
    b = Bandit({"weak": 0.1, "strong": 1.0}, bits=10, explore=0.0, priors={"weak": 0.7, "strong": 0.6})
    c = feat({"subject": "m"}, "evaluate the integral of beta")
    rng = np.random.default_rng(0)
    before = b.choose(c, rng).sampled
    b.set_gain(g, 0.5)
    assert b.pair == ("weak", "strong")
    got = b.choose(c, rng).sampled
    expect = 0.5 * before["strong"] + 0.5 * (before["weak"] + 2 * g.mean(c) - 1)
    assert got["strong"] == pytest.approx(expect) and got["weak"] == pytest.approx(before["weak"])
    b.set_gain(g, 1.0, pair=("strong", "weak"))  # explicit pair: the gain of weak over strong
    assert b.pair == ("strong", "weak")
    with pytest.raises(ValueError):
        b.set_gain(g, 1.5)
    with pytest.raises(ValueError):
        b.set_gain(g, 0.5, pair=("weak", "other"))
    # online: an observed strong failure teaches the gain model, against the weak arm's estimate
    # (label (0 − 0.7 + 1)/2 = 0.15, under the model's σ(z))
    b.set_gain(g, 0.5)
    m0 = g.logit(c)
    assert g.mean(c) > 0.15
    b.update(c, {"strong": 0.0})
    assert g.logit(c) < m0 and g.count == 201


def test_two_heads_are_the_anchors_regression_of_each_arm():
    """2 heads: each is :func:`fit_logistic` of its arm's correctness on the same TF-IDF
    columns; the gain is σ(z_dear) − σ(z_cheap)."""
    rows = _rows(300)
    vocab, feat = _featurizer(rows)
    ctx = [feat({"subject": s}, p) for p, s, *_ in rows]
    g = TextGain(vocab, heads=2).fit(ctx, [(float(w), float(s)) for _, _, w, s in rows], C=0.3)
    vec = Tfidf().fit([p for p, *_ in rows], [s for _, s, *_ in rows])
    X = vec.transform([p for p, *_ in rows], [s for _, s, *_ in rows])
    pc = 1 / (1 + np.exp(-fit_logistic(X, np.array([float(w) for _, _, w, _ in rows]), C=0.3).logit(X)))
    pd = 1 / (1 + np.exp(-fit_logistic(X, np.array([float(s) for _, _, _, s in rows]), C=0.3).logit(X)))
    np.testing.assert_allclose([2 * g.mean(c) - 1 for c in ctx], pd - pc, atol=2e-3)
    assert len(g.m) == len(g.q) == 2 * vocab.n_cols and g.count == 300
    hi = feat({"subject": "m"}, "evaluate the integral of beta")
    lo = feat({"subject": "m"}, "name the capital of beta")
    # 'integral': only the strong model answers (gain ≈ 0.9); 'capital': both do, 9 times in 10 (gain ≈ 0)
    assert g.mean(hi) > 0.85 and abs(g.mean(lo) - 0.5) < 0.05
    assert g.logit(hi) > 1 and g.std(hi) > 0
    with pytest.raises(ValueError):  # one label per row is a 1-head fit
        TextGain(vocab, heads=2).fit(ctx, [gain_label(w, s) for _, _, w, s in rows])
    with pytest.raises(ValueError):
        TextGain(vocab, heads=3)


def test_two_heads_learn_each_arms_own_outcome_only():
    """Online, each head learns only its own arm's observed outcome: no label is
    filled in from the other arm's estimate (the bandit's partial feedback)."""
    rows = _rows(200)
    vocab, feat = _featurizer(rows)
    ctx = [feat({"subject": s}, p) for p, s, *_ in rows]
    g = TextGain(vocab, heads=2).fit(ctx, [(float(w), float(s)) for _, _, w, s in rows])
    b = Bandit({"weak": 0.1, "strong": 1.0}, bits=10, explore=0.0)
    b.set_gain(g, 1.0)
    c = feat({"subject": "m"}, "evaluate the integral of beta")
    n = vocab.n_cols
    got = b.choose(c, np.random.default_rng(0)).sampled
    assert got["strong"] - got["weak"] == pytest.approx(2 * g.mean(c) - 1)
    cheap, dear = g.m[:n].copy(), g.m[n:].copy()
    b.update(c, {"strong": 0.0})
    assert np.array_equal(g.m[:n], cheap) and not np.array_equal(g.m[n:], dear) and g.count == 201
    dear = g.m[n:].copy()
    b.update(c, {"weak": 1.0})
    assert not np.array_equal(g.m[:n], cheap) and np.array_equal(g.m[n:], dear)
    g.observe(c, 1.0, 1.0, only=3)  # tenant-scoped: nothing
    assert g.count == 202
    with pytest.raises(ValueError):
        g.update(c, 0.5)
    with pytest.raises(ValueError):
        TextGain(vocab).observe(c, 1.0, None)
    # state: both heads round-trip; a delta against a 1-head base is refused; an old state reads as 1 head
    back = TextGain.from_state(g.state())
    assert back.heads == 2 and [back.mean(x) for x in ctx] == [g.mean(x) for x in ctx]
    base = g.copy()
    g.observe(c, 0.0, 1.0)
    merged = base.copy()
    merged.merge(g.delta(base))
    np.testing.assert_allclose(merged.m, g.m)
    one = TextGain(vocab)
    with pytest.raises(ValueError):
        g.delta(one)
    with pytest.raises(ValueError):
        one.merge(g.delta(base))
    old = one.state()
    del old["heads"]
    assert TextGain.from_state(old).heads == 1
    bad = dict(g.state(), heads=3)
    with pytest.raises(ValueError):
        TextGain.from_state(bad)
    bad = dict(g.state(), heads=1)  # 2 heads' arrays under 1 head
    with pytest.raises(ValueError):
        TextGain.from_state(bad)


def test_featurizer_cost_stays_bounded_with_a_large_vocabulary():
    """The gain columns of a 2 KB prompt: one searchsorted, whatever the vocabulary's size."""
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 1 << 34, size=200_000, dtype=np.uint64))
    vocab = TermVocab(keys, np.ones(len(keys)), np.zeros(0, np.uint64))
    feat = Featurizer(bits=12, text=True)
    feat.vocab = vocab
    ctx = feat({"subject": "x"}, "word " * 500)
    assert ctx.aux is not None and len(ctx.aux.idx) <= 2  # at most one known term + the intercept
