"""Data-scope labels (spec §11): their grammar and what an agent is cleared for.

Pure and sans-IO: the FIB (:mod:`atp_router.policy.fib`) excludes agents not cleared for
a task's opaque labels with it, and the data-scope guard
(:class:`atp_router.security.redact.DataScopeGuard`) decides redaction or refusal per
agent with it. Defined in the policy layer, so that the FIB needs no security
module.

Label grammar (``meta.data_scope``: a string or a list; Agent Context ``policyContext``
labels join it, :func:`atp_router.adapters.context.with_context_scope`)::

    label    := category [":" mode]
    mode     := "redact" (default) | "forbidden"

A suffix that is not a mode belongs to the category (``acp.policy:P001`` is the
category ``acp.policy:P001``, mode ``redact``). Categories a detector covers
(:data:`SECRETS`, personal data) are normalised; every other label is *opaque*::

    secrets, no_secrets                    -> "secrets"   detect-secrets plugins
    pii, no_pii, personal_data             -> "pii"       personal data, phone numbers
                                                          in international form
    <cc>_personal_data (us_, de_, ...)     -> itself      personal data, phone numbers
                                                          also in <cc>'s national form
    <anything>_personal_data (eu_, ...)    -> itself      personal data, international form
    anything else                          -> itself      opaque: no detector

Clearance (:func:`clearance_of`): an agent is cleared for a category when its
``agents.<name>.data_scope`` lists it (aliases and ``:mode`` suffixes are
normalised the same way; ``pii`` clears every personal-data category). An agent
without ``data_scope`` (``clearance=None``) is cleared for every *opaque* label
(the RIB's historical "None: any", which the FIB keeps) and for no
detector-covered category: it gets redacted content.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "FORBIDDEN",
    "PII",
    "REDACT",
    "SECRETS",
    "Mode",
    "ScopeLabel",
    "clearance_of",
    "is_covered",
    "parse_label",
]

REDACT: Final = "redact"
FORBIDDEN: Final = "forbidden"
Mode = Literal["redact", "forbidden"]
#: (``Final`` also keeps the keyword detector from reading ``SECRETS = "…"`` in
#: this file as a password assignment when the router's sources are reviewed.)
SECRETS: Final = "secrets"
PII: Final = "pii"
_PERSONAL_DATA = "personal_data"
_ALIASES = {"no_secrets": SECRETS, "no_pii": PII, "personal_data": PII}


@dataclass(frozen=True, slots=True)
class ScopeLabel:
    """One parsed data-scope label: ``category`` (normalised), ``mode``, and the
    ``detector`` family that covers it (``"secrets"``, ``"personal_data"``, or None
    for an opaque label); ``region`` is the ISO 3166 region whose national phone
    formats are also recognised (``us_personal_data`` → ``"US"``)."""

    label: str
    category: str
    mode: Mode = REDACT
    detector: Literal["secrets", "personal_data"] | None = None
    region: str | None = None


@functools.lru_cache(maxsize=4096)
def parse_label(label: str) -> ScopeLabel:
    """``label`` per the module's grammar. Never raises: any string is a label."""
    category, mode = label, REDACT
    head, sep, tail = label.rpartition(":")
    if sep and head and tail in (REDACT, FORBIDDEN):
        category, mode = head, tail
    category = _ALIASES.get(category, category)
    if category == SECRETS:
        return ScopeLabel(label, category, mode, "secrets")  # type: ignore[arg-type]
    if category == PII:
        return ScopeLabel(label, category, mode, "personal_data")  # type: ignore[arg-type]
    if category.endswith("_" + _PERSONAL_DATA) and len(category) > len(_PERSONAL_DATA) + 1:
        prefix = category[: -len(_PERSONAL_DATA) - 1].upper()
        return ScopeLabel(label, category, mode, "personal_data", prefix if _phone_region(prefix) else None)  # type: ignore[arg-type]
    return ScopeLabel(label, category, mode)  # type: ignore[arg-type]


def is_covered(label: str) -> bool:
    """Does a detector cover ``label``'s category (so an uncleared agent can get
    redacted content instead of being excluded)?"""
    return parse_label(label).detector is not None


def clearance_of(data_scope: Iterable[str] | None) -> frozenset[str] | None:
    """The categories an agent's ``agents.<name>.data_scope`` clears (normalised
    like task labels); None when the agent has no ``data_scope``."""
    if data_scope is None:
        return None
    return frozenset(parse_label(s).category for s in data_scope)


@functools.cache
def _phone_region(code: str) -> bool:
    import phonenumbers

    return code in phonenumbers.SUPPORTED_REGIONS
