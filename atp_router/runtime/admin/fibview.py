"""The learning FIB as the router shows it (spec §6.2): one schema for the body
of ``GET /v1/fib`` (:class:`FibView`, :mod:`atp_router.runtime.ingress.http_api`) and the bandits of
the status snapshot (``fib.bandits``, :mod:`atp_router.runtime.admin.snapshot`).

Pure data (msgspec Structs), filled from
:meth:`atp_router.policy.learn.RoutingLearner.fib_view`. Its own module because
:mod:`atp_router.runtime.ingress.http_api` imports :mod:`atp_router.runtime.admin.snapshot`: both import it,
neither imports the other for it.
"""

from __future__ import annotations

import msgspec

__all__ = ["FibArm", "FibBandit", "FibLive", "FibView"]


class FibArm(msgspec.Struct):
    """One bandit arm: posterior-mean quality (bias context), the logit's
    standard deviation, observations and normalised cost."""

    mean: float
    std: float
    count: float
    cost: float


class FibBandit(msgspec.Struct):
    """One bandit policy: its arms by agent, λ, exploration, the cost target
    and quality bar it was given, decisions made (``choices``) and its
    featurizer (``text_features``, hashed to ``bits`` bits)."""

    arms: dict[str, FibArm]
    #: λ in force (cost weight; adaptive when ``target_cost`` is set).
    lam: float = msgspec.field(name="lambda")
    explore: float
    target_cost: float | None
    bar: float
    choices: int
    text_features: bool
    bits: int


class FibLive(msgspec.Struct):
    """Decayed live figures of a next-hop (key ``agent``) or of a next-hop
    within a policy (key ``policy|agent``); None: too few observations, the
    RIB's figure is used."""

    calls: float
    p50_ms: float | None
    p95_ms: float | None
    error_rate: float | None
    timeout_rate: float | None
    tokens_per_call: float | None
    usd_micros_per_call: float | None
    quality: float
    quality_obs: float


class FibView(msgspec.Struct):
    """Body of ``GET /v1/fib`` (spec §6.2): the running generation, each
    bandit policy's arms and the live metrics the FIB scores with."""

    version: int
    bandits: dict[str, FibBandit]
    live: dict[str, FibLive]
