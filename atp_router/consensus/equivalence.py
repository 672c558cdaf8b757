"""Correlated analysers are one voter (spec §19 consensus poisoning: "require
independent sources; penalize correlated errors").

Several analysers implement the same check: ruff's ``F`` rules *are* pyflakes,
pylint has its own undefined-variable / unused-import checks, mypy reports an
undefined name as ``name-defined``; ruff's ``S`` rules are ports of bandit's
tests (``S602`` is bandit's ``B602``) and its ``PL`` rules ports of pylint's
messages (``PLE0604`` is pylint's ``E0604``). When two of them flag one place
with the same check, that is one observation made twice, not two independent
reviews: a K-of-N quorum, the noisy-OR confidence and the agreement score must
count it once.

The equivalence is declared here, per analyser and rule code, from each
analyser's own rule documentation (what the rule detects), never from where
the rules fire on an evaluation set:

* :data:`PYFLAKES_CLASSES` — the pyflakes-class checks (undefined name,
  unused import, …) and the code each of ruff, pylint and mypy gives them;
* :data:`PORTS` — rule families one analyser ports from another, code for code.

:func:`rule_class` names the class of one ``(analyser, rule)``;
:func:`voters` maps the sources that flagged one place to the voters they are:
two sources that reported a finding of the same class there become one voter
(transitively). The analyser of an agent is its source's tool
(``tool:<name>``, :func:`atp_router.policy.rib.independence_source`), or its
own name when it has no source. Pure functions, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["PORTS", "PYFLAKES_CLASSES", "analyser_of", "cluster_voters", "rule_class", "voters"]

#: Pyflakes-class checks: class name → analyser → the rule codes (ids and, for
#: pylint, the symbolic names) that report it. Sources: pyflakes' messages as ruff
#: documents its ``F`` rules; pylint's message list; mypy's error-code list.
PYFLAKES_CLASSES: dict[str, dict[str, frozenset[str]]] = {
    "undefined-name": {
        "ruff": frozenset({"F821", "F822"}),
        "pylint": frozenset({"E0602", "undefined-variable", "E0603", "undefined-all-variable"}),
        "mypy": frozenset({"name-defined"}),
    },
    "used-before-assignment": {
        "ruff": frozenset({"F823"}),
        "pylint": frozenset({"E0601", "used-before-assignment"}),
        "mypy": frozenset({"used-before-def", "possibly-undefined"}),
    },
    "unused-import": {
        "ruff": frozenset({"F401"}),
        "pylint": frozenset({"W0611", "unused-import"}),
    },
    "unused-variable": {
        "ruff": frozenset({"F841"}),
        "pylint": frozenset({"W0612", "unused-variable"}),
    },
    "redefinition": {
        "ruff": frozenset({"F811"}),
        "pylint": frozenset({"E0102", "function-redefined", "W0404", "reimported"}),
        "mypy": frozenset({"no-redef"}),
    },
    "import-star": {
        "ruff": frozenset({"F403", "F405"}),
        "pylint": frozenset({"W0401", "wildcard-import", "W0614", "unused-wildcard-import"}),
    },
    "is-literal": {
        "ruff": frozenset({"F632"}),
        "pylint": frozenset({"R0123", "literal-comparison"}),
    },
    "assert-on-tuple": {
        "ruff": frozenset({"F631"}),
        "pylint": frozenset({"W0199", "assert-on-tuple"}),
    },
    "duplicate-key": {
        "ruff": frozenset({"F601", "F602"}),
        "pylint": frozenset({"W0109", "duplicate-key"}),
    },
    "f-string-without-placeholder": {
        "ruff": frozenset({"F541"}),
        "pylint": frozenset({"W1309", "f-string-without-interpolation"}),
    },
    "outside-its-block": {  # break/continue outside a loop, return/yield outside a function
        "ruff": frozenset({"F701", "F702", "F704", "F706"}),
        "pylint": frozenset({"E0103", "not-in-loop", "E0104", "return-outside-function",
                             "E0105", "yield-outside-function"}),
    },
    "raise-not-implemented": {
        "ruff": frozenset({"F901"}),
        "pylint": frozenset({"E0711", "notimplemented-raised"}),
    },
}

#: Ported rule families: ``(analyser, code pattern, origin)``; a code matching the
#: pattern is the origin analyser's rule ``<origin>:<letter><digits>`` built from
#: the pattern's groups. ruff documents each ``S`` rule as flake8-bandit's port of
#: the bandit test with the same number, and each ``PL`` rule as the pylint
#: message with the same id; bandit's and pylint's own codes map to themselves.
PORTS: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("ruff", re.compile(r"^S(\d{3})$"), "bandit:B{0}"),
    ("bandit", re.compile(r"^B(\d{3})$"), "bandit:B{0}"),
    ("ruff", re.compile(r"^PL([CEFRW])(\d{4})$"), "pylint:{0}{1}"),
    ("pylint", re.compile(r"^([CEFRW])(\d{4})$"), "pylint:{0}{1}"),
)

_MEMBER: dict[tuple[str, str], str] = {
    (analyser, code): "pyflakes:" + name
    for name, members in PYFLAKES_CLASSES.items()
    for analyser, codes in members.items()
    for code in codes
}


def analyser_of(agent: str, source: str | None) -> str:
    """The analyser behind ``agent``: its source's tool (``"tool:ruff"`` →
    ``"ruff"``), else the agent's own name (an agent without a declared source)."""
    if source is not None and source.startswith("tool:"):
        return source[len("tool:"):]
    return agent


def rule_class(analyser: str, rule: str | None) -> str | None:
    """The declared class of ``analyser``'s rule ``rule`` (``"pyflakes:undefined-name"``,
    ``"bandit:B602"``, ``"pylint:E1101"``), or ``None`` when the rule is in no
    declared class (or there is no rule). A pyflakes class wins over a port."""
    if not rule:
        return None
    hit = _MEMBER.get((analyser, rule))
    if hit is not None:
        return hit
    for who, pattern, origin in PORTS:
        if who == analyser:
            m = pattern.match(rule)
            if m:
                return origin.format(*m.groups())
    return None


def voters(flags: Iterable[tuple[str, str | None]]) -> dict[str, str]:
    """Sources → the voter each is, for the findings merged at one place.

    ``flags``: one ``(source, rule class)`` per contributing finding (class from
    :func:`rule_class`, ``None`` when it has none). Sources that share a class
    are one voter, transitively (ruff and pylint both saying undefined-name, and
    pylint and mypy both saying undefined-name: ruff, pylint and mypy are one);
    the voter's name is its sources sorted and joined with ``"+"``. A source
    with no shared class is a voter by itself."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    sources: set[str] = set()
    for source, cls in flags:
        sources.add(source)
        a = find(source)
        if cls is not None:
            b = find("class\0" + cls)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[str, list[str]] = {}
    for s in sources:
        groups.setdefault(find(s), []).append(s)
    names = {root: "+".join(sorted(members)) for root, members in groups.items()}
    return {s: names[find(s)] for s in sources}


def cluster_voters(contributions: Iterable[tuple[str, str, str | None]],
                   sources: Mapping[str, str]) -> dict[str, str]:
    """:func:`voters` for contributions given as ``(agent, source, rule)``:
    ``sources`` is the agent → source map of :func:`atp_router.consensus.strategies.merge`
    (an agent not in it is its own analyser). Returns source → voter."""
    return voters((src, rule_class(analyser_of(agent, sources.get(agent)), rule))
                  for agent, src, rule in contributions)
