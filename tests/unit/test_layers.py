"""The packages under ``atp_router/`` are layered (issue 21 items 4 and 5): an ``ast`` walk
over every module reads its ``atp_router`` imports — module-level ones (``if
TYPE_CHECKING:`` and ``try:`` blocks included) and function-level ones — and
checks that

* every package imports only packages of a lower layer (:data:`LAYERS`): the
  sans-IO core (``wire``, ``task``, ``flow``, ``policy``, ``consensus``) imports
  nothing above it;
* the adapters never import the runtime (``runtime`` and ``deploy``), and
  ``observability`` imports neither the runtime nor the adapters;
* the package graph (module- and function-level imports alike) has no cycle;
* an ``atp_router`` import inside a function is one of :data:`FUNCTION_LEVEL_IMPORTS`, each
  with its reason; a new one fails, and so does an entry that no longer matches.

A package is the first path component under ``atp_router/`` (``atp_router/policy/fib.py`` is in
``policy``). The tree checked is this repository's, or the one whose root
``ATP_LAYERS_ROOT`` names (``ATP_LAYERS_ROOT=/path/to/checkout pytest
tests/unit/test_layers.py``: the same rules against another checkout).
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("ATP_LAYERS_ROOT") or Path(__file__).resolve().parents[2]).resolve()

#: The layers, lowest first; a package imports only packages of the layers below
#: its own. A name not in the tree is skipped; a package in the tree and in no
#: layer fails :func:`test_every_package_has_a_layer`.
LAYERS: list[frozenset[str]] = [
    # The frame, its codecs and errors; the --help formatter every command shares.
    frozenset({"wire", "cliutil"}),
    # Sans-IO on the frame: consensus (findings, strategies), flow control and
    # budgets; the typed task (meta, bodies, its diff parsed once).
    frozenset({"consensus", "flow", "task"}),
    # Sans-IO policy (RIB, FIB, data-scope labels, bandits, cache keys); review-task
    # helpers (diffs, paths, and the eval harness, its router and model servers
    # passed in by its caller).
    frozenset({"policy", "review"}),
    # The first I/O: durable state (SQLite, Redis); the MQTT client and the 2389
    # Agent Protocol.
    frozenset({"store", "mqtt"}),
    # Who may do what, redaction, the audit chain (over the store).
    frozenset({"security"}),
    # Traces, logs, metrics: imported by the adapters and the runtime.
    frozenset({"observability"}),
    # The next-hops.
    frozenset({"adapters"}),
    # The 2389 agent runtime: an adapter exposed as a 2389 agent.
    frozenset({"agent2389"}),
    # The router's runtime: ingress, data plane, control plane, admin (issue 21).
    frozenset({"runtime"}),
    # Deployment modes assembled from the runtime.
    frozenset({"deploy"}),
    # Generators of proto/ from every layer's Structs.
    frozenset({"protogen"}),
]
LEVEL: dict[str, int] = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
#: The sans-IO core that no I/O layer may leak into.
CORE = ("wire", "flow", "policy", "consensus", "task")
#: What the next-hops may never import.
RUNTIME = frozenset({"runtime", "deploy"})

#: The function-level ``atp_router`` imports that remain, as ``(file, function,
#: imported module)`` → why it is not at module level. Everything else is
#: imported at the top of its module.
FUNCTION_LEVEL_IMPORTS: dict[tuple[str, str, str], str] = {
    # protogen's documented design (its module docstring): each artefact imports
    # its source when it is produced, so the generator stays cheap to import and
    # a missing optional source is a Skip, not an ImportError at import.
    ("atp_router/protogen/__init__.py", "_frame_schema", "atp_router.wire.frame"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_control_schema", "atp_router.wire.frame"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_result_schema", "atp_router.consensus.types"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_task_schema", "atp_router.task.body"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_task_schema", "atp_router.task.meta"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_rib_schema", "atp_router.policy.rib"): "protogen: an ImportError is a Skip",
    ("atp_router/protogen/__init__.py", "_mcp_tools", "atp_router.runtime.ingress.mcp_tools"):
        "protogen: imported when produced (it imports the MCP SDK)",
    ("atp_router/protogen/__init__.py", "_cbor_md", "atp_router.wire.codec"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_cbor_md", "atp_router.wire.frame"): "protogen: imported when produced",
    ("atp_router/protogen/__init__.py", "_openapi", "atp_router.runtime.admin.openapi"): "protogen: imported when produced",
    # Optional dependency: the SDK (``import atp``; atp.Client), which only
    # ``atp-router eval`` needs; the router starts without it.
    ("atp_router/deploy/cli.py", "_eval_main", "atp_router.review.eval"): "optional dependency: the SDK, for eval only",
    # Optional dependency: redis-py, imported only by a router on a shared store.
    ("atp_router/deploy/cluster.py", "open_store", "atp_router.store.redis"): "optional dependency: redis-py",
    ("atp_router/store/__init__.py", "__getattr__", "atp_router.store.redis"): "optional dependency: redis-py (lazy attribute)",
    # A module cycle inside adapters/tools: base imports the sandbox at load
    # (Sandbox, SandboxUnavailable); the sandbox's host probe needs base's limits.
    ("atp_router/adapters/tools/sandbox.py", "_probe", "atp_router.adapters.tools.base"): "intra-package: base imports sandbox",
}


@dataclass(frozen=True, slots=True)
class Import:
    """One ``atp_router`` import: where (``file``, ``line``, the enclosing ``function``'s
    qualified name or None at module level) and what (``module``, resolved to the
    submodule for ``from atp_router.x import y`` when ``y`` is a module)."""

    file: str
    line: int
    function: str | None
    module: str

    @property
    def source(self) -> str:
        return self.file.split("/")[1]

    @property
    def target(self) -> str | None:
        parts = self.module.split(".")
        return parts[1] if len(parts) > 1 else None


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_name(rel: Path) -> list[str]:
    parts = list(rel.with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports_of(root: Path) -> list[Import]:
    """Every ``atp_router.*`` import of every module under ``root/atp_router`` (``import atp``,
    the SDK's name, is not one)."""
    out: list[Import] = []
    for path in sorted((root / "atp_router").rglob("*.py")):
        rel = path.relative_to(root)
        here = _module_name(rel)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))

        def visit(node: ast.AST, scope: list[str], in_function: bool, rel: Path = rel, here: list[str] = here,
                  path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                names: list[str] = []
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        package = here if path.name == "__init__.py" else here[:-1]
                        base = ".".join(package[: len(package) - child.level + 1] + ([child.module] if child.module else []))
                    else:
                        base = child.module or ""
                    subs = [f"{base}.{a.name}" for a in child.names if _is_module(root, f"{base}.{a.name}")]
                    names = subs or [base]
                for name in names:
                    if name.startswith("atp_router."):
                        out.append(Import(str(rel), child.lineno, ".".join(scope) if in_function else None, name))
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    label = child.name if not isinstance(child, ast.Lambda) else "<lambda>"
                    visit(child, [*scope, label], True)
                elif isinstance(child, ast.ClassDef):
                    visit(child, [*scope, child.name], in_function)
                else:
                    visit(child, scope, in_function)

        visit(tree, [], False)
    return out


def packages_of(root: Path) -> set[str]:
    return {p.relative_to(root / "atp_router").parts[0] for p in (root / "atp_router").rglob("*.py")
            if p.parent != root / "atp_router"}


def graph_of(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """Package → imported package → the imports that make the edge."""
    edges: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports:
        if imp.target is not None and imp.target != imp.source:
            edges[imp.source][imp.target].append(imp)
    return edges


def cycles_of(edges: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            connect(v)
    return found


def _where(imps: list[Import]) -> str:
    return ", ".join(f"{i.file}:{i.line} ({i.module})" for i in imps[:4]) + (" …" if len(imps) > 4 else "")


IMPORTS = imports_of(ROOT)
EDGES = graph_of(IMPORTS)
PACKAGES = packages_of(ROOT)


def test_the_walk_sees_the_tree() -> None:
    """The walk found the packages and their imports (a wrong root fails here, not
    by passing every rule vacuously)."""
    assert {"wire", "policy", "adapters"} <= PACKAGES, ROOT
    assert any(i.source == "adapters" and i.target == "wire" for i in IMPORTS)


def test_every_package_has_a_layer() -> None:
    unplaced = sorted(PACKAGES - LEVEL.keys())
    assert not unplaced, f"packages in no layer of LAYERS: {unplaced}"


@pytest.mark.parametrize("package", sorted(LEVEL))
def test_a_package_imports_nothing_above_its_layer(package: str) -> None:
    if package not in PACKAGES:
        pytest.skip(f"atp_router/{package} does not exist (yet)")
    above = {target: imps for target, imps in EDGES.get(package, {}).items() if LEVEL.get(target, -1) >= LEVEL[package]}
    assert not above, f"{package} (layer {LEVEL[package]}) imports " + "; ".join(
        f"{t} (layer {LEVEL.get(t, '?')}): {_where(imps)}" for t, imps in sorted(above.items()))


def test_the_core_is_at_the_bottom() -> None:
    """The sans-IO core sits below every I/O layer (the order itself is checked)."""
    io = ("store", "mqtt", "security", "observability", "adapters", "runtime", "deploy")
    assert max(LEVEL[p] for p in CORE) < min(LEVEL[p] for p in io)


def test_adapters_never_import_the_runtime() -> None:
    wrong = {t: imps for t, imps in EDGES.get("adapters", {}).items() if t in RUNTIME}
    assert not wrong, "; ".join(f"adapters import {t}: {_where(imps)}" for t, imps in sorted(wrong.items()))


def test_observability_imports_neither_the_runtime_nor_the_adapters() -> None:
    assert "observability" in PACKAGES, "atp_router/observability is missing"
    wrong = {t: imps for t, imps in EDGES.get("observability", {}).items() if t in RUNTIME | {"adapters"}}
    assert not wrong, "; ".join(f"observability imports {t}: {_where(imps)}" for t, imps in sorted(wrong.items()))


def test_the_package_graph_has_no_cycle() -> None:
    cycles = cycles_of(EDGES)
    detail = []
    for component in cycles:
        members = set(component)
        for src in component:
            for dst, imps in sorted(EDGES[src].items()):
                if dst in members:
                    detail.append(f"  {src} -> {dst}: {_where(imps)}")
    assert not cycles, f"package cycles: {cycles}\n" + "\n".join(detail)


def test_function_level_imports_are_exactly_the_listed_ones() -> None:
    found: dict[tuple[str, str, str], list[Import]] = defaultdict(list)
    for imp in IMPORTS:
        if imp.function is not None:
            found[(imp.file, imp.function, imp.module)].append(imp)
    new = sorted(key for key in found if key not in FUNCTION_LEVEL_IMPORTS)
    stale = sorted(key for key in FUNCTION_LEVEL_IMPORTS if key not in found)
    problems = [f"new function-level import {m} in {f}:{found[(f, fn, m)][0].line} ({fn}): import it at module "
                "level, inject it, or move what it needs down a layer" for f, fn, m in new]
    problems += [f"stale FUNCTION_LEVEL_IMPORTS entry {key}: no such import any more" for key in stale]
    assert not problems, f"{len(new)} new, {len(stale)} stale:\n" + "\n".join(problems)
