"""``atp-router policy check PATH [--json]``: validate a RIB and print the FIB it
compiles to (spec §6, §22), before a reload or in CI. ``--stages`` prints the
router's SYN pipeline, one stage a line (``N. name  what it checks``,
:mod:`atp_router.runtime.dataplane.opening`), after the FIB when a PATH is given too.

Exit status 0 with the compiled FIB on standard output; 1 with every fault, one
per line as ``file:line: key: reason``, on standard error; 2 on a usage error.
Faults include the local next-hops (``tool:`` agents) this host cannot serve:
each is built as the router would at load (with the ``build_adapter`` the caller
passes: ``atp-router`` passes :func:`~atp_router.adapters.registry.build_adapter`), so a tool whose sandbox cannot be made here (no bubblewrap, no user namespaces,
no process-count limit: :mod:`atp_router.adapters.tools.sandbox`) or whose options are
refused is reported as ``file: agents.<name>: <reason>`` — the same refusal the
router gives at load.
The text form is stable (snapshot-tested for every policy file shipped):

* the RIB's models and agents, one line each;
* each policy in lookup order: its match, its fanout with the ECMP weights a task
  of its task type gets with no live data (best first; ``fanout_k`` cuts, the
  rest are alternates), escalation, budget, window, QoS, deadline, consensus,
  and its ``bandit`` / ``shadow`` / ``cache`` keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.policy.fib import Fib, compile_fib
from atp_router.policy.loader import load_rib
from atp_router.policy.rib import AgentSpec
from atp_router.wire.errors import PolicyError

__all__ = ["AdapterBuilder", "check_main", "fib_summary", "policy_main", "render_fib", "render_stages"]

#: Builds one RIB agent's adapter as the router does at load, raising
#: ``ValueError`` / ``KeyError`` when this host cannot serve it
#: (:func:`atp_router.adapters.registry.build_adapter`; the policy layer imports no adapter).
AdapterBuilder = Callable[[str, AgentSpec], object]


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def fib_summary(fib: Fib) -> dict[str, Any]:
    """The compiled FIB as a JSON-ready dict (``--json``)."""
    rib = fib.rib
    policies = []
    entries = {e.policy: e for e in fib.routes()}
    for i, p in enumerate(rib.policies):
        name = p.name or f"policy[{i}]"
        e = entries.get(name)
        hops = list(zip(e.next_hops, e.weights, strict=True)) if e is not None else []
        order = sorted(p.fanout, key=lambda a: [h for h, _ in hops].index(a) if a in [h for h, _ in hops] else 1e9)
        policies.append({
            "name": name,
            "match": dict(p.match),
            "next_hops": [{"agent": a, "weight": round(w, 6)} for a, w in hops],
            "alternates": [a for a in order if a not in {h for h, _ in hops}],
            "fanout_k": p.fanout_k,
            "escalation": msgspec.to_builtins(p.escalation),
            "budget": msgspec.to_builtins(p.budget),
            "window": msgspec.to_builtins(p.window),
            "qos": str(p.qos) if p.qos is not None else None,
            "deadline_ms": p.deadline_ms,
            "consensus": p.consensus,
            "bandit": msgspec.to_builtins(p.bandit),
            "shadow": msgspec.to_builtins(p.shadow),
            "cache": msgspec.to_builtins(p.cache),
        })
    return {
        "version": fib.version,
        "models": {n: {"provider": m.provider, "usd_per_mtok": m.usd_per_mtok} for n, m in rib.models.items()},
        "agents": {n: {"model": a.model, "tool": a.tool, "qos": str(a.qos), "p95_ms": a.p95_ms,
                       "win30d": a.win30d, "timeout_ms": a.timeout_ms, "fallback": a.fallback}
                   for n, a in rib.agents.items()},
        "policies": policies,
        "clients": sorted(rib.clients),
    }


def render_fib(fib: Fib) -> str:
    """The compiled FIB as stable text (see the module doc)."""
    s = fib_summary(fib)
    out = [(f"RIB: {len(s['models'])} models, {len(s['agents'])} agents, {len(s['policies'])} policies, "
            f"{len(s['clients'])} clients")]
    for name, m in s["models"].items():
        out.append(f"model {name}: {m['provider']}, {m['usd_per_mtok']:g} USD/Mtok")
    for name, a in s["agents"].items():
        what = f"model {a['model']}" if a["model"] else f"tool {a['tool']}"
        fb = f", fallback {a['fallback']}" if a["fallback"] else ""
        out.append(f"agent {name}: {what}, {a['qos']}, p95 {a['p95_ms']:g} ms, win30d {a['win30d']:g}, "
                   f"timeout {a['timeout_ms']} ms{fb}")
    for i, p in enumerate(s["policies"], 1):
        out.append(f"policy {i} {p['name']}: match {_fmt(p['match'])}")
        hops = ", ".join(f"{h['agent']} ({h['weight']:.6f})" for h in p["next_hops"])
        out.append(f"  next-hops: {hops}" + (f" (fanout_k {p['fanout_k']})" if p["fanout_k"] else ""))
        if p["alternates"]:
            out.append(f"  alternates: {', '.join(p['alternates'])}")
        if p["escalation"]:
            e = p["escalation"]
            out.append(f"  escalation: on {_fmt(e['on'])} to {e['to']} (threshold {e['threshold']:g})")
        out.append(f"  budget {_fmt(p['budget']) if p['budget'] else 'router default'}; "
                   f"window {_fmt(p['window']) if p['window'] else 'router default'}; "
                   f"qos {p['qos'] or 'stream'}; deadline {p['deadline_ms']} ms; consensus {p['consensus']}")
        if p["bandit"]:
            out.append(f"  bandit: {_fmt(p['bandit'])}")
        if p["shadow"]:
            out.append(f"  shadow: {_fmt(p['shadow'])}")
        if p["cache"]:
            out.append(f"  cache: {_fmt(p['cache'])}")
    return "\n".join(out) + "\n"


def _check_local_next_hops(rib: Any, source: str, build_adapter: AdapterBuilder) -> None:
    """Build every ``tool:`` agent as the router would at load; raise
    :class:`PolicyError` (one fault per refused agent, as in the router:
    ``agents.<name>: <reason>``) when any is refused. Model and remote agents
    are not built here (they need no local set-up)."""
    faults: list[PolicyError] = []
    for name, agent in rib.agents.items():
        if agent.tool is None or agent.remote is not None:
            continue
        try:
            build_adapter(name, agent)
        except (ValueError, KeyError) as e:
            faults.append(PolicyError(source, f"agents.{name}", str(e)))
    if faults:
        faults[0].errors = faults
        raise faults[0]


def render_stages(stages: list[tuple[str, str]]) -> str:
    """The SYN pipeline as text: ``N. name  doc`` a line, in order."""
    width = max((len(name) for name, _ in stages), default=0)
    return "".join(f"{i}. {name:<{width}}  {doc}\n" for i, (name, doc) in enumerate(stages, 1))


def check_main(argv: list[str], *, build_adapter: AdapterBuilder,
               stages: Callable[[], list[tuple[str, str]]] | None = None) -> int:
    """``build_adapter``: as :data:`AdapterBuilder`. ``stages()``: the router's SYN
    stages as ``(name, doc)`` (the caller's: this package imports nothing of the
    router); None: no ``--stages``."""
    ap = argparse.ArgumentParser(prog="atp-router policy check", formatter_class=DefaultsHelpFormatter,
                                 description="Validate a RIB (file or directory) and print its compiled FIB.")
    ap.add_argument("path", nargs="?", help="a RIB YAML file or a directory of *.yaml (optional with --stages)")
    ap.add_argument("--json", action="store_true", help="print the compiled FIB as JSON")
    if stages is not None:
        ap.add_argument("--stages", action="store_true",
                        help="print the router's SYN pipeline: each stage's name and what it checks, in order")
    args = ap.parse_args(argv)
    show_stages = getattr(args, "stages", False)
    if args.path is None:
        if not show_stages:
            ap.error("the following arguments are required: path")
        assert stages is not None
        sys.stdout.write(render_stages(stages()))
        return 0
    try:
        rib = load_rib(args.path)
        fib = compile_fib(rib, version=1)
        _check_local_next_hops(rib, args.path, build_adapter)
    except PolicyError as e:
        for x in e.errors:
            print(x.where(), file=sys.stderr)
        print(f"{args.path}: refused ({len(e.errors)} fault{'s' if len(e.errors) != 1 else ''})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(fib_summary(fib), indent=2, sort_keys=False))
    else:
        sys.stdout.write(render_fib(fib))
    if show_stages:
        assert stages is not None
        sys.stdout.write("\nSYN stages:\n" + render_stages(stages()))
    return 0


def policy_main(argv: list[str], *, build_adapter: AdapterBuilder,
                stages: Callable[[], list[tuple[str, str]]] | None = None) -> int:
    """``atp-router policy <subcommand>``; ``build_adapter`` builds the local
    next-hops ``check`` tries (:data:`AdapterBuilder`), ``stages`` as in
    :func:`check_main`."""
    if not argv or argv[0] != "check":
        print("usage: atp-router policy check PATH [--json] [--stages]", file=sys.stderr)
        return 2
    return check_main(argv[1:], build_adapter=build_adapter, stages=stages)
