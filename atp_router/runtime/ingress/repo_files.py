"""A text-only code-review task completed from the router's ``--repo`` checkout:
the after-diff text of each file a unified diff touches, for the next-hops that
cannot review from a diff alone. Both the A2A server (:mod:`atp_router.runtime.ingress.a2a`)
and the OpenAI-compatible ingress (:mod:`atp_router.runtime.ingress.openai`) use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from atp_router.review.repo import files_after
from atp_router.runtime.router import Router
from atp_router.task.change import ParsedChange
from atp_router.wire.errors import ATPError

__all__ = ["complete_from_repo"]


def _agents_needing_files(router: Router, meta: Mapping[str, Any]) -> list[str]:
    """The next-hops the running FIB routes ``meta`` to that cannot review from
    a diff alone (:attr:`ProviderAdapter.needs_files
    <atp_router.adapters.base.ProviderAdapter.needs_files>`); ``[]`` when it routes
    nowhere (the SYN then refuses the task with the routing error)."""
    gen = router.gen
    try:
        route = gen.fib.lookup(meta)
    except ATPError:
        return []
    hops = [h.agent for h in route.next_hops]
    return [a for a in hops if getattr(gen.adapters.get(a), "needs_files", False)]


#: Problems quoted in a refusal (one line per unreadable file).
_MAX_PROBLEMS = 10


async def complete_from_repo(router: Router, meta: Mapping[str, Any], content: dict[str, Any],
                             change: ParsedChange | None) -> str | None:
    """Complete a text-only task (``{"diff"}`` or ``{"text"}``) in place: a diff
    (``change``: ``content["diff"]`` as the ingress parsed it, None for a text
    that is no diff) gets ``files``, the after-diff text of each file it touches, read from the
    router's ``--repo`` (:func:`atp_router.review.repo.files_after`: bounded, confined to
    the checkout). Returns ``None`` when the task can be reviewed, else the
    reason to reject it: the text is not a unified diff, or the files cannot be
    had (no ``--repo``, a file missing, refused or not at the diff's after side)
    while a routed next-hop needs them. Next-hops that work from a diff alone
    review it without ``files`` when those cannot be read."""
    needs = _agents_needing_files(router, meta)
    who = ", ".join(needs)
    diffs = list(change.files) if change is not None and isinstance(content.get("diff"), str) else []
    if not diffs:
        if needs:
            return (f"the message text is not a unified diff, and the agents of task type {meta.get('task_type')!r} "
                    f"({who}) review a code change: send `git diff` output as the text, or a data part "
                    "{\"diff\": ..., \"files\": {path: text}}")
        return None
    repo = router.config.repo
    if repo is None:
        if needs:
            return (f"{who} need the files the diff touches, and this router has no --repo to read them from: "
                    "send a data part {\"diff\": ..., \"files\": {path: text}}, or start atp-router with --repo")
        return None
    try:
        got = await trio.to_thread.run_sync(files_after, repo, diffs)
    except OSError as e:
        return f"the router's --repo cannot be read ({e.strerror or e})" if needs else None
    if got.problems:
        if needs:
            shown = "; ".join(got.problems[:_MAX_PROBLEMS])
            more = f" (and {len(got.problems) - _MAX_PROBLEMS} more)" if len(got.problems) > _MAX_PROBLEMS else ""
            return (f"{len(got.problems)} file(s) the diff touches cannot be read from the router's --repo, "
                    f"and {who} need them: {shown}{more}")
        return None  # reviewed on the diff alone
    content["files"] = got.files
    return None
