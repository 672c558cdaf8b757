"""``atp-router routes [--diagram]``: the control API's route table
(:data:`atp_router.runtime.ingress.http_api.ROUTES`), one line a route, and with
``--diagram`` a task's path through the router (issue 21 item 7) — the routes
that open a stream, the SYN stages (:data:`atp_router.runtime.dataplane.opening.DEFAULT_STAGES`,
as ``atp-router policy check --stages`` prints them), the dispatch and the FINAL
back to the client by the routes that follow a stream. Both are generated from
the table and the stage list, never typed: the README's copy is this command's
output (``tests/unit/test_taskpath.py`` checks it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.runtime.dataplane.dispatch import Dispatcher
from atp_router.runtime.dataplane.opening import DEFAULT_STAGES, describe
from atp_router.runtime.dataplane.plane import DataPlane
from atp_router.runtime.ingress.http_api import ROUTES
from atp_router.runtime.ingress.http_types import ApiRoute

__all__ = ["render_routes", "routes_main", "task_path"]


def _served_by(r: ApiRoute) -> str:
    """``module.function`` of a route's handler, or the ingress that serves it."""
    if r.handler is None:
        return f"{r.by} ingress"
    return f"{r.handler.__module__.rsplit('.', 1)[-1]}.{r.handler.__qualname__}"


def _rows(table: Sequence[ApiRoute]) -> list[str]:
    cols = [(f"{r.method} {r.path}", r.action or ("public" if r.public else "(its own)"), _served_by(r))
            for r in table]
    w0 = max((len(c[0]) for c in cols), default=0)
    w1 = max((len(c[1]) for c in cols), default=0)
    return [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in cols]


def render_routes(table: Sequence[ApiRoute] = ROUTES) -> str:
    """The route table, one line a route: method and path, the action it is
    authorized for (``public``: none; ``(its own)``: the handler authenticates),
    and its handler or the ingress serving it."""
    return "".join(line + "\n" for line in _rows(table))


def _mod(obj: object) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def task_path(table: Sequence[ApiRoute] = ROUTES,
              stages: Sequence[tuple[str, str]] | None = None) -> str:
    """A task's path (module docstring) as text; ``stages``: ``(name, doc)`` in
    order (default: :data:`DEFAULT_STAGES` described)."""
    stages = describe(DEFAULT_STAGES) if stages is None else stages
    opening = [r for r in table if r.task == "opens"]
    following = [r for r in table if r.task == "follows"]
    width = max((len(name) for name, _ in stages), default=0)
    out = ["client", *(f"  │ {line}" for line in _rows(opening)), "  ▼",
           f"{_mod(DataPlane.open_stream_async)}: the SYN", "  │",
           "┌─ SYN stages (each Continue or Refuse; the first Refuse stops them)"]
    out += [f"│ {i}. {name:<{width}}  {doc}" for i, (name, doc) in enumerate(stages, 1)]
    out += ["└─", "  │ a Refuse: the stream reset (RST) with its spec §10 code; the opening route answers that error",
            "  ▼ every stage continued: SYN-ACK, the task started",
            f"{_mod(Dispatcher)}: fan-out to the route's next-hops, their reports merged (consensus)",
            "  │ PARTIAL …", "  ▼",
            "FINAL to the client: in the opening route's response, or by"]
    out += [f"  {line}" for line in _rows(following)]
    return "\n".join(out) + "\n"


def routes_main(argv: Sequence[str]) -> int:
    """``atp-router routes [--diagram]`` (module docstring); exit status 0."""
    ap = argparse.ArgumentParser(prog="atp-router routes", formatter_class=DefaultsHelpFormatter,
                                 description="The control API's route table, or (--diagram) a task's path "
                                             "through the router: the routes that open a stream, the SYN "
                                             "stages, the dispatch and the FINAL.")
    ap.add_argument("--diagram", action="store_true", help="print a task's path instead of the route table")
    args = ap.parse_args(list(argv))
    print(task_path() if args.diagram else render_routes(), end="")
    return 0
