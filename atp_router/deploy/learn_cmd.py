"""``atp-router learn``: warm-start a policy's contextual bandit from labelled
outcomes (issue 23; spec §6.2, §18), into the router's learned state.

    atp-router learn --from FILE --policy NAME [--policies DIR] [--state-dir D | --store URL]
                     [--arms WEAK,STRONG] [--method update|fit|gain] [--gain-heads 1|2]

``FILE``: JSON lines, the replay format (``../shared/routing-replay``): ``prompt``,
``weak_correct``/``strong_correct`` (booleans, or qualities in 0..1) and optional
``subject``, ``meta`` (an object: the task meta the router's featurizer reads) and
``contaminated`` (true: the row is skipped); or ``outcomes``: ``{agent: quality}``
for any arm set. ``--arms`` names the agents of the weak and the strong outcome
(default: the policy's cheapest and dearest fanout agents by price).

Each row is featurized as the live router featurizes a task of that policy
(:class:`~atp_router.policy.bandit.Featurizer` with the policy's ``bits`` and
``text_features``; no tenant or QoS token) and learned by ``--method``:
``update`` — :meth:`~atp_router.policy.bandit.Bandit.update`, the live router's
own learning step, one observation per row and arm; ``fit`` — a batch fit
(:func:`~atp_router.policy.offline.fit_arm`: the MAP under the arm's current
posterior and its Laplace precision; ``--prior-precision`` sets that prior's
precision for arms that have learned nothing yet); ``gain`` — the arms as ``fit``,
and the policy's text gain model (:class:`~atp_router.policy.textgain.TextGain`:
a TF-IDF vocabulary of the rows' prompts + meta and, on the rows with both
outcomes, L2 logistic regressions, ``--gain-c``: ``--gain-heads 2`` (default)
one of each arm's correctness, the gain their difference, each learning only its
own arm's outcomes online; ``1`` one of ``(strong − weak + 1)/2``) that the
bandit then chooses by, the dear arm's estimate averaged ``--gain-weight`` : 1 − w
between the cheap arm plus the gain and its own arm (default 1 with 2 heads, ½
with 1; both keep learning online). The arms start from what the store holds
for them (same agent fingerprint), so running ``learn`` again adds to it; the
gain model is fitted afresh (an entry ``gain/<policy>`` replaced whole; routers
sharing a store adopt it at their next sync and merge their online updates into it).

Written to the store the router reads at start: ``--state-dir``'s SQLite store
(one router's save format), or with ``--store redis://…`` the store several
routers share, merged into each arm's shared entry as one more router's push
(:func:`~atp_router.runtime.controlplane.learn_entries.push_arm`). Run it with
the router stopped (SQLite) or at any time (shared: the routers adopt the
merged arms at their next sync). Prints one line per arm and
``LEARN policy=<name> rows=<n> arms=<a,b>``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from atp_router import store as _stores
from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.policy.bandit import Context
from atp_router.policy.learn import RoutingLearner, SharedArm
from atp_router.policy.loader import load_rib
from atp_router.policy.offline import fit_arm
from atp_router.policy.textgain import TermVocab, TextGain
from atp_router.runtime.controlplane.learn_entries import (
    ARM_PREFIX,
    GAIN_PREFIX,
    SEQ_KEY,
    bump_index,
    decode_arm,
    push_arm,
)
from atp_router.store.base import Store
from atp_router.store.sqlite import SqliteStore
from atp_router.wire.errors import PolicyError

__all__ = ["learn_main", "read_outcomes"]


def read_outcomes(path: Path, weak: str, strong: str) -> list[tuple[dict[str, Any], str, dict[str, float]]]:
    """``(meta, prompt, {agent: quality})`` per usable row of ``path`` (module
    doc); raises ValueError naming the line of a malformed one."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                if not isinstance(o, dict):
                    raise TypeError("not an object")
                if o.get("contaminated"):
                    continue
                meta = dict(o["meta"]) if isinstance(o.get("meta"), dict) else {}
                if o.get("subject") is not None:
                    meta.setdefault("subject", o["subject"])
                if isinstance(o.get("outcomes"), dict):
                    q = {str(a): float(v) for a, v in o["outcomes"].items()}
                else:
                    q = {weak: float(o["weak_correct"]), strong: float(o["strong_correct"])}
                if not all(0.0 <= v <= 1.0 for v in q.values()):
                    raise ValueError("a quality outside 0..1")
                out.append((meta, str(o.get("prompt", "")), q))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


def _parser(default_state_dir: Path | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atp-router learn", description=(__doc__ or "").splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--from", dest="src", type=Path, required=True, metavar="FILE",
                    help="labelled outcomes, JSON lines (prompt, meta/subject, weak_correct, strong_correct)")
    ap.add_argument("--policy", required=True, help="the RIB policy (with bandit:) whose arms learn")
    ap.add_argument("--policies", type=Path, default=Path("policies"), help="RIB file or directory of *.yaml")
    ap.add_argument("--state-dir", type=Path, default=default_state_dir, required=default_state_dir is None,
                    metavar="DIR", help="the router's state directory (its SQLite store)")
    ap.add_argument("--store", metavar="URL", help="the shared store of routers run with --store (redis://…)")
    ap.add_argument("--store-namespace", default="atp", metavar="NS", help="the routers' --store-namespace")
    ap.add_argument("--arms", metavar="WEAK,STRONG",
                    help="agents of weak_correct and strong_correct (default: cheapest, dearest of the fanout)")
    ap.add_argument("--method", choices=("update", "fit", "gain"), default="update",
                    help="update: the live router's online step per row; fit: one batch MAP fit (Laplace); "
                         "gain: fit, plus a TF-IDF gain model (strong − weak) the bandit chooses by")
    ap.add_argument("--gain-c", type=float, default=0.3, metavar="C",
                    help="with --method gain: the gain regression's inverse regularisation "
                         "(bench/replay_routing.py --validate gain chose 0.3 on MMLU)")
    ap.add_argument("--gain-heads", type=int, choices=(1, 2), default=2,
                    help="with --method gain: 2 — one TF-IDF regression per arm's correctness, the gain their "
                         "difference, each learning its own arm's outcomes online; 1 — one regression of the gain "
                         "label (strong − weak + 1)/2 (bench/replay_routing.py --validate gain chose 2 on MMLU)")
    ap.add_argument("--gain-weight", type=float, default=None, metavar="W",
                    help="with --method gain: the gain's share of the dear arm's estimate, 0..1 "
                         "(default, validated on MMLU: 1 with 2 heads, 0.5 with 1)")
    ap.add_argument("--prior-precision", type=float, default=None, metavar="Q",
                    help="with --method fit or gain: the prior precision of arms that have learned nothing yet "
                         "(bench/replay_routing.py chose 10 on MMLU; default: the router's, 1)")
    return ap


def _open(args: argparse.Namespace) -> Store:
    if args.store in (None, "sqlite"):
        return SqliteStore.open(args.state_dir, create=True)
    if args.store.split("://", 1)[0].lower() not in ("redis", "rediss", "unix"):
        raise ValueError(f"--store {args.store!r}: give sqlite or a redis://, rediss:// or unix:// URL")
    return _stores.RedisStore.open(args.store, namespace=args.store_namespace)


def _learn(bandit: Any, ctxs: list[Context], rows: list[tuple[dict[str, Any], str, dict[str, float]]],
           args: argparse.Namespace) -> None:
    """Learn ``rows`` (their contexts ``ctxs``) into ``bandit``: through its
    ``update`` (``--method update``) or one batch fit per arm (``fit``)."""
    if args.method == "update":  # fit and gain: the batch fit
        for ctx, (_, _, q) in zip(ctxs, rows, strict=True):
            bandit.update(ctx, {a: v for a, v in q.items() if a in bandit.arms})
        return
    for a, arm in bandit.arms.items():
        if args.prior_precision is not None and arm.count == 0:
            arm.q[:] = args.prior_precision
        mine: list[Context] = [c for c, (_, _, q) in zip(ctxs, rows, strict=True) if a in q]
        fit_arm(arm, mine, [q[a] for _, _, q in rows if a in q])


def _fit_gain(bandit: Any, featurizer: Any, rows: list[tuple[dict[str, Any], str, dict[str, float]]],
              pair: tuple[str, str], args: argparse.Namespace) -> tuple[TextGain, list[Context]]:
    """The text gain model of ``rows`` with both of ``pair``'s outcomes (cheap,
    dear; ``--gain-heads``); sets ``featurizer``'s vocabulary and returns the model and every
    row's context (with the gain columns). Raises ValueError without such rows."""
    cheap, dear = pair
    both = [(m, t, q) for m, t, q in rows if cheap in q and dear in q]
    if not both:
        raise ValueError(f"--method gain: no row has both {cheap} and {dear} outcomes")
    featurizer.vocab = TermVocab.fit([t for _, t, _ in both], [m for m, _, _ in both])
    ctxs = [featurizer(meta, text) for meta, text, _ in rows]
    labels: list[Any] = ([(q[dear] - q[cheap] + 1.0) / 2.0 for _, _, q in both] if args.gain_heads == 1
                         else [(q[cheap], q[dear]) for _, _, q in both])
    model = TextGain(featurizer.vocab, heads=args.gain_heads).fit(
        [c for c, (_, _, q) in zip(ctxs, rows, strict=True) if cheap in q and dear in q], labels, C=args.gain_c)
    bandit.set_gain(model, args.gain_weight, pair=pair)
    return model, ctxs


def _write_gain(store: Store, policy: str, model: TextGain, pair: tuple[str, str], fps: Mapping[str, str],
                weight: float, *, shared: bool) -> None:
    """Store the gain model whole (a shared store's index bumped: the routers adopt it at their next sync)."""
    seq = int(time.time() * 1000)
    key = f"{GAIN_PREFIX}{policy}"
    store.put(key, msgspec.msgpack.encode(
        {"policy": policy, "arms": list(pair), "fingerprints": [fps[pair[0]], fps[pair[1]]], "weight": weight,
         "state": model.state(), "seq": seq}))
    if shared:
        store.update(SEQ_KEY, functools.partial(bump_index, {key: seq}))
    print(f"gain {pair[1]} over {pair[0]}: {len(model.vocab.keys)} terms, {len(model.vocab.meta)} meta values, "
          f"{model.count:g} rows")


def _write(store: Store, policy: str, learned: list[str], bandit: Any, bases: dict[str, Any],
           fps: Mapping[str, str], *, shared: bool) -> None:
    """Store the ``learned`` arms as the router saves them: merged as one more
    router's contribution on a shared store, else the arm's whole state."""
    seq = int(time.time() * 1000)
    written: dict[str, int] = {}
    for a in learned:
        key = f"{ARM_PREFIX}{policy}/{a}"
        if shared:
            pushed = SharedArm(policy, a, fps[a], bandit.arms[a], bases[a])
            store.update(key, functools.partial(push_arm, pushed, bandit.arms[a].delta(bases[a]), 0, seq))
            written[key] = seq
        else:
            store.put(key, msgspec.msgpack.encode({"policy": policy, "arm": a, "fingerprint": fps[a],
                                                   "state": bandit.arms[a].state()}))
        est = bandit.arms[a]
        print(f"arm {a}: {est.count - bases[a].count:g} observations learned, {est.count:g} in all")
    if written:
        store.update(SEQ_KEY, functools.partial(bump_index, written))


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--gain-weight``'s default for ``--gain-heads``; exits (usage, 2) on a bad value."""
    if args.prior_precision is not None and not (args.prior_precision > 0 and args.method in ("fit", "gain")):
        ap.error("--prior-precision: a positive number, with --method fit or gain")
    if args.gain_weight is None:
        args.gain_weight = 1.0 if args.gain_heads == 2 else 0.5
    if not (args.gain_c > 0 and 0.0 <= args.gain_weight <= 1.0):
        ap.error("--gain-c: a positive number; --gain-weight: in 0..1")
    return args


def learn_main(argv: list[str], *, default_state_dir: Path | None = None) -> int:
    """The ``learn`` subcommand (module doc); returns the exit status."""
    ap = _parser(default_state_dir)
    args = _checked(ap, ap.parse_args(argv))
    try:
        rib = load_rib(args.policies)
    except PolicyError as e:
        ap.error(f"--policies: {e}")
    learner = RoutingLearner(seed=0)
    shared = args.store not in (None, "sqlite")
    try:
        store = _open(args)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    with store:
        saved = []
        for _key, raw in store.items(f"{ARM_PREFIX}{args.policy}/"):
            obj = decode_arm(raw)
            if obj is not None and obj.get("policy") == args.policy:
                saved.append((obj["policy"], obj["arm"], obj["fingerprint"], obj["state"]))
        learner.load_arms(saved)
        learner.sync(rib)
        got = learner.policy_bandit(args.policy)
        if got is None:
            ap.error(f"--policy {args.policy!r}: no such policy with a bandit in {args.policies}")
        bandit, featurizer = got
        if args.arms:
            pair = [a.strip() for a in args.arms.split(",")]
            if len(pair) != 2 or not all(a in bandit.arms for a in pair):
                ap.error(f"--arms: two of the policy's arms, weak first ({', '.join(bandit.arms)})")
            weak, strong = pair
        else:
            weak, strong = min(bandit.cost, key=lambda a: (bandit.cost[a], a)), \
                max(bandit.cost, key=lambda a: (bandit.cost[a], a))
        try:
            rows = read_outcomes(args.src, weak, strong)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        bases = {a: m.copy() for a, m in bandit.arms.items()}
        gain = None
        if args.method == "gain":
            try:
                gain, ctxs = _fit_gain(bandit, featurizer, rows, (weak, strong), args)
            except ValueError as e:
                ap.error(str(e))
        else:
            ctxs = [featurizer(meta, text) for meta, text, _ in rows]
        _learn(bandit, ctxs, rows, args)
        learned = [a for a in bandit.arms if bandit.arms[a].count != bases[a].count]
        _write(store, args.policy, learned, bandit, bases, learner.fingerprints(args.policy), shared=shared)
        if gain is not None:
            _write_gain(store, args.policy, gain, (weak, strong), learner.fingerprints(args.policy), args.gain_weight,
                        shared=shared)
    print(f"LEARN policy={args.policy} rows={len(rows)} arms={','.join(learned)}")
    return 0


