"""Readiness (``GET /v1/ready``, issue 22 item 4): may a load balancer send this
router new work? ``GET /v1/health`` stays liveness (the process answers).

The decision is sans-IO: :func:`decide` takes the facts a handler gathered
(:class:`ReadyFacts`) and returns the verdict (:class:`Readiness`), one
:class:`Check` per fact, failing ones first:

=============  ================================================================
``store``      the state store can record spend: the embedded SQLite store
               takes writes (not in its full-disk state, no budget settlement
               kept waiting for it, room on its file system; ``--workers``
               share it), a cluster's shared store (Redis) answered this
               router's last lease renewal (:attr:`ClusterNode.store_ok
               <atp_router.deploy.cluster.ClusterNode.store_ok>`)
``rib``        a RIB with at least one policy is loaded (nothing else routes)
``state_dir``  the state directory takes a write (a small file written,
               fsync'd and removed): usage keys, the audit head, the lock live there
``audit``      no audit record waits in the spool for the store
               (:class:`~atp_router.security.audit.AuditSpool`): the chain is current
``drain``      the router is not draining before it stops (SIGTERM:
               :mod:`atp_router.runtime.controlplane.drain`): its running streams
               finish, new ones are refused
=============  ================================================================

Ready is every check passing: 200 ``{"status": "ready", "checks": [...]}``.
Otherwise 503 ``{"status": "not_ready", "checks": [...]}`` with ``Retry-After``
:data:`RETRY_AFTER_S`: spend cannot be recorded, or what a router needs to serve
is missing. Each check carries ``reason`` (a file, a store URL, counts) for an
authenticated caller only; a caller without a credential gets the names and
verdicts (:meth:`Readiness.public`), as ``/v1/health`` gives it liveness only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

__all__ = ["RETRY_AFTER_S", "Check", "Readiness", "ReadyFacts", "decide"]

#: ``Retry-After`` (s) of a 503 from ``/v1/ready``: how soon asking again is useful.
RETRY_AFTER_S = 2


class Check(msgspec.Struct, omit_defaults=True):
    """One readiness check: its ``name`` (``store``, ``rib``, ``state_dir``,
    ``audit``), whether it passed, and in words why it failed (or what it saw)."""

    name: str
    ok: bool
    reason: str = ""


class Readiness(msgspec.Struct):
    """``GET /v1/ready``'s body: ``status`` ``ready`` (HTTP 200) or ``not_ready``
    (503 + ``Retry-After``) and every check, failing ones first."""

    status: Literal["ready", "not_ready"]
    checks: list[Check]

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def failing(self) -> list[str]:
        """The names of the checks that failed."""
        return [c.name for c in self.checks if not c.ok]

    def public(self) -> Readiness:
        """The verdict for a caller without a credential: names and verdicts, no reasons."""
        return Readiness(status=self.status, checks=[Check(c.name, c.ok) for c in self.checks])


@dataclass(frozen=True, slots=True)
class ReadyFacts:
    """What the handler found. ``store``: None when the store can record spend,
    else why not; ``rib_version`` / ``rib_policies`` the running RIB's
    generation and policy count; ``state_dir``: None when the state directory
    took a write, else why not; ``audit_spooled`` audit records waiting for the
    store, ``audit_spool_max`` the spool's record bound, ``audit_dropped``
    records dropped since start (the spool was full); ``draining``: None, or the
    streams still running while the router drains before it stops."""

    store: str | None
    rib_version: int
    rib_policies: int
    state_dir: str | None
    audit_spooled: int = 0
    audit_spool_max: int = 0
    audit_dropped: int = 0
    draining: int | None = None


def decide(facts: ReadyFacts) -> Readiness:
    """The verdict on ``facts`` (module docstring): ready iff every check passes."""
    checks = [
        Check("store", facts.store is None, facts.store or "records spend"),
        Check("rib", facts.rib_policies > 0,
              f"generation {facts.rib_version}, {facts.rib_policies} policies" if facts.rib_policies
              else f"generation {facts.rib_version} has no policy: nothing can be routed"),
        Check("state_dir", facts.state_dir is None, facts.state_dir or "writable"),
        Check("audit", facts.audit_spooled == 0, _audit_reason(facts)),
        Check("drain", facts.draining is None, "serving" if facts.draining is None
              else f"draining before a stop: {facts.draining} streams still running, new ones refused"),
    ]
    checks.sort(key=lambda c: c.ok)  # stable: failing first, each group in the table's order
    return Readiness(status="ready" if all(c.ok for c in checks) else "not_ready", checks=checks)


def _audit_reason(facts: ReadyFacts) -> str:
    dropped = f"; {facts.audit_dropped} dropped since start (the spool was full)" if facts.audit_dropped else ""
    if facts.audit_spooled:
        return (f"{facts.audit_spooled} audit records wait for the store (spool bound {facts.audit_spool_max})"
                + dropped)
    return "chain current" + dropped
