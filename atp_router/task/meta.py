"""The task meta the router itself reads (issue 21 item 1): :class:`TaskMeta`.

A SYN's ``meta`` (spec §4.2) is open: besides the fields below it carries the
policy's match keys (``languages``, ``risk``, ``repo``, …), which the FIB matches
and every next-hop receives unchanged. :class:`TaskMeta` is the typed view of the
fields the router acts on; :func:`decode_meta` reads them from a meta mapping
strictly (no coercion: ``"5"`` is not a ``resume_after``), leaving the match keys
alone.

=====================  ====================================================
``task_type``          the task's type (``code_review``, ``repo_summary``,
                       ``retrieval_qa``, …): the FIB's first match key and the
                       tag of the task body (:mod:`atp_router.task.body`)
``qos``                the QoS class asked for (spec §9)
``budget``             the client's budget, float USD and tokens (spec §5)
``idempotency_key``    1..128 characters: the same key (per tenant) re-opens
                       the stream it opened (spec §8)
``resume_after``       the last router ``msg_seq`` the client received (≥ 0)
``data_scope``         data-scope labels, one or a list (spec §11)
``agent_context``      an Agent Context Protocol message as received: an
                       object or its JSON text (validated by
                       :mod:`atp_router.adapters.context`)
``trace``              the caller's trace context (:class:`TraceMeta`)
``diff_loc``           added plus removed lines of a code-review diff (≥ 0;
                       counted by the router when absent)
``max_out_tokens``     the client's cap on each model next-hop's output
                       tokens (≥ 1): sent to the model with the tighter of
                       it and the RIB model's ``max_out_tokens``, and what the
                       preflight estimate reserves (OpenAI's ``max_tokens``)
=====================  ====================================================

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from atp_router.wire.frame import Budget, QoS

__all__ = ["IDEMPOTENCY_KEY_CHARS", "TaskMeta", "TraceMeta", "decode_meta"]

#: The longest ``idempotency_key`` (characters), as the OpenAI ingress's ``atp.idempotency_key``.
IDEMPOTENCY_KEY_CHARS = 128


class TraceMeta(Struct, kw_only=True, frozen=True, omit_defaults=True):
    """``meta.trace``: a W3C ``traceparent`` (and ``tracestate``), or ATP's own
    ``trace_id`` (32 hex digits) with ``parent_span`` (16 hex digits, ``spn_``
    prefix allowed) and ``sampled`` (:mod:`atp_router.observability.tracing`)."""

    traceparent: str | None = None
    tracestate: str | None = None
    trace_id: str | None = None
    parent_span: str | None = None
    sampled: bool | None = None


class TaskMeta(Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The SYN meta fields the router acts on (module docstring); other keys of
    the meta are the policy's match keys and are not part of it."""

    task_type: str = ""
    qos: QoS | None = None
    budget: Budget | None = None
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=IDEMPOTENCY_KEY_CHARS)] | None = None
    resume_after: Annotated[int, Meta(ge=0)] | None = None
    data_scope: str | list[str] | None = None
    agent_context: dict[str, Any] | str | None = None
    trace: TraceMeta | None = None
    diff_loc: Annotated[int, Meta(ge=0)] | None = None
    max_out_tokens: Annotated[int, Meta(ge=1)] | None = None


def decode_meta(meta: Mapping[str, Any]) -> TaskMeta:
    """The :class:`TaskMeta` of a SYN's ``meta``, strictly typed; keys it does not
    name are ignored. Raises :class:`msgspec.ValidationError` naming the field
    (``Expected `int` >= 0 - at `$.resume_after```)."""
    return msgspec.convert(meta, TaskMeta, strict=True)
