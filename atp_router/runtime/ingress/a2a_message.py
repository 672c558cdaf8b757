"""An A2A user message → the ATP task it asks for (task meta, content, budget;
the rules are in :mod:`atp_router.runtime.ingress.a2a`'s docstring), and the JSON-RPC
error the A2A server answers with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from atp_router.adapters.a2a import parts_of, restore_ints
from atp_router.runtime.router import Router
from atp_router.wire.frame import Budget

__all__ = ["RpcError", "task_of"]


class RpcError(Exception):
    """A JSON-RPC error: ``code`` and ``message`` (``data`` when not None), answered
    with HTTP ``status`` (and ``Retry-After: retry_after_s`` s when set)."""

    def __init__(self, code: int, message: str, data: Any = None, *, status: int = 200,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.status = status
        self.retry_after_s = retry_after_s


def _looks_like_diff(text: str) -> bool:
    return text.startswith(("diff --git", "--- ")) or "\n+++ " in text or "\n@@ " in text


def task_of(router: Router, message: Mapping[str, Any],
            params_meta: Any) -> tuple[dict[str, Any], dict[str, Any], Budget | None, bool]:
    """Task meta, task content and budget of a user message (the module docstring
    of :mod:`atp_router.runtime.ingress.a2a`), and whether the content came from the
    message's text alone (no data part). Raises :class:`RpcError` ``-32602`` for a
    message that asks for no valid task."""
    parts = [(k, restore_ints(v)) if k == "data" else (k, v) for k, v in parts_of(message.get("parts"))]
    if not parts:
        raise RpcError(-32602, "message.parts must hold at least one text or data part")
    meta_in = message.get("metadata") if isinstance(message.get("metadata"), dict) else {}
    md = {**(params_meta if isinstance(params_meta, dict) else {}), **meta_in}
    atp = next((v["atp"] for k, v in parts if k == "data" and isinstance(v, dict) and isinstance(v.get("atp"), dict)),
               None)
    extra: Any = {}
    text_only = False
    budget_raw: Any = md.get("budget")
    if atp is not None:
        task_type = atp.get("task_type")
        content = atp.get("content")
        extra = atp.get("meta") or {}
        budget_raw = atp.get("budget", budget_raw)
    else:
        task_type = md.get("task_type") or md.get("skill")
        content = next((v for k, v in parts if k == "data" and isinstance(v, dict)), None)
        if content is None:
            text = "\n".join(v for k, v in parts if k == "text")
            content = {"diff": text} if _looks_like_diff(text) else {"text": text}
            text_only = True
    if not isinstance(content, dict):
        raise RpcError(-32602, "the task content must be an object")
    if not isinstance(extra, dict):
        raise RpcError(-32602, "atp.meta must be an object")
    if task_type is None:
        routes = router.gen.fib.routes()
        task_type = routes[0].task_type if routes else None
    if not isinstance(task_type, str) or not task_type:
        raise RpcError(-32602, "no task type: set metadata.task_type (one of the card's skills)")
    meta = {**extra, "task_type": task_type}
    if "agent_context" in meta_in:
        meta["agent_context"] = message["metadata"]["agent_context"]  # unchanged, as received
    budget = None
    if budget_raw is not None:
        try:
            budget = msgspec.convert(budget_raw, Budget)
        except msgspec.ValidationError as e:
            raise RpcError(-32602, f"budget: {e}") from None
    return meta, content, budget, text_only
