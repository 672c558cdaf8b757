"""The live health of a next-hop, as the FIB scores it (spec §6.2).

Adapters report it (:meth:`~atp_router.adapters.base.ProviderAdapter.health`, from
:class:`~atp_router.adapters.base.CallStats`); the control plane merges it with the circuit
breakers' view; :meth:`atp_router.policy.fib.Fib.lookup` excludes a next-hop that is down
and ranks the others by its latency and error rate. Defined here, in the policy
layer, so that the FIB reads it without importing an adapter.
"""

from __future__ import annotations

from msgspec import Struct

__all__ = ["Health"]


class Health(Struct, forbid_unknown_fields=True):
    """Live health of a next-hop: p95 latency (ms) and error rate (0..1) over the
    recent calls, and whether it is reachable right now."""

    p95_ms: float = 0.0
    error_rate: float = 0.0
    up: bool = True
