"""The ``model`` of an OpenAI-compatible request → the stream's task meta, and the
models a tenant may use (``GET /v1/models``), from the running FIB's policies
(the rules: :mod:`atp_router.runtime.ingress.openai`'s docstring, "Models").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atp_router.policy.match import CompiledMatch, compile_match
from atp_router.runtime.ingress.openai_schema import (
    IngressError,
    ModelAtp,
    ModelCard,
    ModelList,
)
from atp_router.wire.errors import ErrorCode

__all__ = ["POLICY_PREFIX", "TASK_PREFIX", "RibView", "Target", "model_list", "resolve_model", "unknown_model", "visible_policies"]

POLICY_PREFIX = "policy:"
TASK_PREFIX = "task:"


@dataclass
class Target:
    """What a ``model`` resolved to: the stream's task ``meta`` and, for a
    policy, the ``policy`` that must route it."""

    model: str
    meta: dict[str, Any]
    policy: str | None = None


@dataclass
class RibView:
    """The running FIB's policies with their compiled matches (per generation)."""

    fib: Any = None
    policies: list[tuple[str, Any, CompiledMatch]] = field(default_factory=list)
    task_types: dict[str, list[str]] = field(default_factory=dict)  # task type → policies pinning it
    #: Unix s when this ingress first saw the generation (``created`` of the models).
    seen_at: int = 0

    def refresh(self, fib: Any) -> RibView:
        if fib is not self.fib:
            policies = [(name, spec, compile_match(spec.match)) for name, spec in zip(fib.policy_names,
                                                                                      fib.rib.policies)]
            task_types: dict[str, list[str]] = {}
            for name, _, cm in policies:
                for tt in cm.equals_values("task_type") or []:
                    if isinstance(tt, str):
                        task_types.setdefault(tt, []).append(name)
            self.fib, self.policies, self.task_types = fib, policies, task_types
            self.seen_at = int(time.time())
        return self

    def policy(self, name: str) -> tuple[str, Any, CompiledMatch] | None:
        return next((p for p in self.policies if p[0] == name), None)

    def first_match(self, meta: Mapping[str, Any]) -> str | None:
        return next((name for name, _, cm in self.policies if cm(meta)), None)


def unknown_model(model: str) -> IngressError:
    """The 404 of a model id this ingress does not serve (an OpenAI error object)."""
    return IngressError(ErrorCode.EPROTO, f"unknown model {model[:256]!r}: GET /v1/models lists the models this key "
                        "may use (task types and policy:<name>); task:<type> names any task type",
                        status=404, param="model")


def resolve_model(model: str, view: RibView, allowed: list[str] | None) -> Target:
    """``model`` → the stream's task meta (:mod:`atp_router.runtime.ingress.openai`'s
    docstring, "Models"). ``allowed``
    is the tenant's ``task_types`` scope (None: any), used to pick a policy's
    task type; the scope itself is enforced by the router at SYN (403).
    Raises :class:`IngressError` 404 for an unknown model."""
    if model.startswith(TASK_PREFIX):
        task_type = model[len(TASK_PREFIX):]
        if not task_type:
            raise unknown_model(model)
        return Target(model, {"task_type": task_type})
    if model.startswith(POLICY_PREFIX):
        name = model[len(POLICY_PREFIX):]
    elif model in view.task_types:
        return Target(model, {"task_type": model})
    else:
        name = model
    found = view.policy(name)
    if found is None:
        raise unknown_model(model)
    meta: dict[str, Any] = {}
    for key, _ in found[2].items:
        values = found[2].equals_values(key)
        if not values:
            continue  # compared numerically: from the task (diff_loc from the diff)
        if key == "task_type" and allowed is not None:
            values = [v for v in values if v in allowed] or values
        meta[key] = values[0]
    return Target(model, meta, policy=name)


def visible_policies(view: RibView, allowed: list[str] | None) -> list[tuple[str, CompiledMatch, list[str]]]:
    """The policies a tenant whose ``task_types`` scope is ``allowed`` (None: any)
    can reach, in RIB order, as ``(name, match, task types it pins that the tenant
    may use)``: one pinning such a task type, or (for a tenant without a scope)
    one pinning none."""
    out: list[tuple[str, CompiledMatch, list[str]]] = []
    for name, _, cm in view.policies:
        pinned = [v for v in cm.equals_values("task_type") or [] if isinstance(v, str)]
        may = [t for t in pinned if allowed is None or t in allowed]
        if may or (not pinned and allowed is None):
            out.append((name, cm, may))
    return out


def model_list(view: RibView, allowed: list[str] | None, created: int) -> ModelList:
    """The body of ``GET /v1/models`` for a tenant whose ``task_types`` scope is
    ``allowed`` (None: any); ``created`` (unix s) is every card's."""
    cards = [ModelCard(tt, "model", created, "atp-router", ModelAtp("task_type", policies, [tt]))
             for tt, policies in view.task_types.items() if allowed is None or tt in allowed]
    cards += [ModelCard(POLICY_PREFIX + name, "model", created, "atp-router", ModelAtp("policy", [name], may))
              for name, _, may in visible_policies(view, allowed)]
    return ModelList("list", cards)
