"""The router's control plane (spec §6, §22): the running RIB compiled into a FIB,
its generations, hot reload, and the next-hop adapters they use.

A :class:`Generation` is one compiled RIB — FIB, adapters, dispatcher, response
cache plan (:mod:`atp_router.policy.cache`) — swapped atomically on
:meth:`ControlPlane.reload`. A stream is routed by the generation
running at its SYN and its task runs on it to the end, even after a reload:
streams *hold* their generation (:meth:`ControlPlane.hold` /
:meth:`ControlPlane.release`), and a replaced generation is retired when its last
stream releases it. Adapters are cached by their spec (an edit of an agent's
window or fallback keeps its live adapter and connections); an adapter no live
generation uses is closed when the last generation using it retires (a removed
2389 agent drops its broker connection, a changed model its HTTP pool).

The control plane also applies a generation to the router-wide flow state: the
per-next-hop windows, the tenants' client budgets (``clients.<name>.budget``,
ledger account ``client:<name>``) and the circuit breakers of agents still in
the RIB.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio

from atp_router.adapters.base import ProviderAdapter
from atp_router.adapters.registry import build_adapter
from atp_router.flow.breaker import BreakerBoard
from atp_router.flow.budget import Allowance, BudgetLedger
from atp_router.observability.metrics import RouterMetrics
from atp_router.policy.cache import CachePlan, compile_cache
from atp_router.policy.fib import Fib, compile_fib
from atp_router.policy.health import Health
from atp_router.policy.loader import load_rib, load_rib_text
from atp_router.policy.rib import ClientSpec, Rib, agent_window, independence_source
from atp_router.runtime.dataplane.dispatch import Dispatcher
from atp_router.runtime.dataplane.gates import FlowGates
from atp_router.runtime.dataplane.plan import LegOutcome
from atp_router.security.policy_guard import PolicySecrets
from atp_router.wire.errors import PolicyError

__all__ = ["ControlPlane", "GenUser", "Generation"]

log = logging.getLogger("atp_router.runtime")

_NO_CLIENT_SPEC = ClientSpec()


@dataclass(frozen=True)
class Generation:
    """One compiled RIB with its adapters and dispatcher (swapped atomically on reload)."""

    version: int
    rib: Rib
    fib: Fib
    adapters: dict[str, ProviderAdapter]
    dispatcher: Dispatcher
    source: str
    #: The YAML it was loaded from, as read at load: ``((file, text), ...)`` — the
    #: ``--policies`` files in load order, or ``(("<request body>", text),)``.
    texts: tuple[tuple[str, str], ...] = ()
    #: What the RIB says about the response cache (spec §13): each policy's
    #: ``cache`` and each agent's config fingerprint (:mod:`atp_router.policy.cache`).
    cache: CachePlan | None = None


class GenUser(Protocol):
    """What holds a generation (a stream): the generation it runs on, and whether
    it is counted among that generation's users."""

    gen: Generation | None
    holds_gen: bool


#: The ``source`` of a RIB posted to ``/v1/policies/reload`` (restored after a restart).
BODY_SOURCE = "<request body>"


def policy_texts(policies: Path) -> tuple[tuple[str, str], ...]:
    """``((file, text), ...)``: the YAML files of the RIB at ``policies`` as
    :func:`~atp_router.policy.loader.load_rib` reads them (a file, or a directory's
    ``*.yaml``/``*.yml`` in sorted order, dotfiles skipped), read just after it
    loaded them (``GET /v1/policies``). A file gone meanwhile is left out."""
    p = Path(policies)
    files = sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and not f.name.startswith(".")
                   and f.is_file()) if p.is_dir() else [p]
    texts = []
    for f in files:
        try:
            texts.append((str(f), f.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return tuple(texts)


class LiveHealth(Mapping[str, Health]):
    """:meth:`ControlPlane.health` of one generation at one instant, each next-hop's
    computed when first looked up (a SYN's FIB lookup reads only its policy's
    next-hops, not every agent of the RIB), then kept."""

    __slots__ = ("_adapters", "_breakers", "_now", "_seen")

    def __init__(self, adapters: Mapping[str, ProviderAdapter], breakers: BreakerBoard, now: float) -> None:
        self._adapters = adapters
        self._breakers = breakers
        self._now = now
        self._seen: dict[str, Health] = {}

    def __getitem__(self, name: str) -> Health:
        got = self._seen.get(name)
        if got is None:
            adapter = self._adapters[name]
            h = adapter.health()
            b = self._breakers.health(name, self._now)
            up = b.up and (h.up or not adapter.live_health)
            got = self._seen[name] = Health(p95_ms=h.p95_ms, error_rate=max(h.error_rate, b.error_rate), up=up)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)


class ControlPlane:
    """RIB → FIB + adapters, generations and reload (module docstring).

    Built synchronously from the RIB at ``policies`` (raises :class:`PolicyError`
    if it is refused); :meth:`serve` closes retired adapters and, when
    cancelled, every live one. ``ledger`` and ``gates`` are the router's flow
    state the generations configure; ``on_leg`` receives every next-hop call's
    outcome (metrics).
    """

    def __init__(self, policies: Path, *, ledger: BudgetLedger, gates: FlowGates, metrics: RouterMetrics,
                 on_leg: Callable[[LegOutcome], None], secrets: PolicySecrets | None = None):
        self.policies = policies
        #: The env vars a RIB may reference (spec §11): never the router's own.
        self.secrets = secrets if secrets is not None else PolicySecrets()
        self.ledger = ledger
        self.gates = gates
        self.metrics = metrics
        self._on_leg = on_leg
        self._nursery: trio.Nursery | None = None
        self._adapter_cache: dict[tuple[str, bytes], ProviderAdapter] = {}
        self._clients: set[str] = set()
        #: Generations not yet retired (the running one and older ones streams still
        #: run on), and how many streams use each.
        self._gens: dict[int, Generation] = {}
        self._gen_users: dict[int, int] = {}
        self._unclosed: list[tuple[str, ProviderAdapter]] = []  # dropped while not serving
        rib = load_rib(policies)
        self.secrets.check(rib, file=str(policies))
        self.gen = self._compile(rib, version=1, source=str(policies), texts=policy_texts(policies))
        #: Set (and replaced) each time a new generation becomes the running one.
        self.fib_changed = trio.Event()
        self._gens[1] = self.gen
        self._activate(self.gen)
        metrics.rib_version.set(1)

    # ------------------------------------------------------------------ tenants
    def client_spec(self, tenant: str) -> ClientSpec:
        """The RIB's ``clients.<tenant>`` entry (defaults when absent)."""
        return self.gen.rib.clients.get(tenant, _NO_CLIENT_SPEC)

    def client_account(self, tenant: str) -> str:
        """The ledger account of ``tenant`` (``client:<tenant>``, opened with its
        RIB budget on first use; a reload moves its limit)."""
        key = "client:" + tenant
        if tenant not in self._clients:
            budget = self.client_spec(tenant).budget
            limit = Allowance.from_budget(budget) if budget is not None else Allowance()
            if self.ledger.has(key):
                # Restored from the state store with its spend: only the limit is the RIB's.
                self.ledger.set_limit(key, limit, clamp=True)
            else:
                self.ledger.open(key, limit)
            self._clients.add(tenant)
        return key

    # ------------------------------------------------------------------ generations
    def _compile(self, rib: Rib, *, version: int, source: str, texts: tuple[tuple[str, str], ...] = ()) -> Generation:
        """RIB → FIB + adapters. Raises PolicyError without touching the running state."""
        fib = compile_fib(rib, version=version)
        adapters: dict[str, ProviderAdapter] = {}
        keys: dict[str, tuple[str, bytes]] = {}
        for name, agent in rib.agents.items():
            model = rib.models.get(agent.model) if agent.model else None
            # The window and fallback are the router's, not the adapter's: an edit
            # of them keeps the live adapter (and its connections).
            adapter_spec = msgspec.structs.replace(agent, window=None, fallback=None, data_scope=None)
            key = keys[name] = (name, msgspec.json.encode([adapter_spec, model]))
            adapter = self._adapter_cache.get(key)
            if adapter is None:
                try:
                    adapter = build_adapter(name, agent, model)
                except (ValueError, KeyError) as e:
                    raise PolicyError(source, f"agents.{name}", str(e)) from None
            adapters[name] = adapter
        for key, adapter in list(self._adapter_cache.items()):
            if adapters.get(key[0]) is not adapter:
                del self._adapter_cache[key]
        for name, adapter in adapters.items():
            self._adapter_cache[keys[name]] = adapter
        dispatcher = Dispatcher(
            adapters, self.ledger, win_rates={n: a.win30d for n, a in rib.agents.items()},
            sources={n: independence_source(rib, n) for n in rib.agents},
            calibration={n: a.calibration.apply for n, a in rib.agents.items() if a.calibration is not None},
            gates=self.gates, on_leg=self._on_leg,
        )
        return Generation(version, rib, fib, adapters, dispatcher, source, texts, cache=compile_cache(rib))

    def _activate(self, gen: Generation) -> None:
        """Adopt ``gen``'s per-agent windows, client budgets and agent set."""
        default = self.gates.agent_windows.default
        self.gates.agent_windows.configure({n: agent_window(gen.rib, n, default) for n in gen.rib.agents})
        self.gates.wake_all()  # wider limits may admit calls waiting at a next-hop
        for client in self._clients:
            budget = gen.rib.clients.get(client, _NO_CLIENT_SPEC).budget
            # clamp: a budget lowered below what the client already spent stops it, never fails.
            self.ledger.set_limit("client:" + client, Allowance.from_budget(budget) if budget else Allowance(),
                                  clamp=True)
        for agent in self.gates.breakers.statistics():
            if agent not in gen.rib.agents:
                self.gates.breakers.forget(agent)

    def reload(self, text: str | None = None, *, version: int | None = None) -> dict[str, Any]:
        """Hot-reload the RIB from ``policies`` or from YAML ``text`` (§22) as
        generation ``version`` (default: the running one's + 1; router workers
        sharing a store number generations alike, ``atp_router.deploy.workers``).

        Returns :meth:`rib_summary`. Raises :class:`PolicyError` (file, key,
        reason) and keeps the running RIB when the new one is refused. Streams
        already running finish on the generation they started with; an adapter
        the new RIB dropped (or rebuilt) is closed once no stream runs on a
        generation that uses it.
        """
        try:
            rib = load_rib_text(text, file=BODY_SOURCE) if text is not None else load_rib(self.policies)
            self.secrets.check(rib, file=BODY_SOURCE if text is not None else str(self.policies))
            gen = self._compile(rib, version=self.gen.version + 1 if version is None else version,
                                source=BODY_SOURCE if text else str(self.policies),
                                texts=((BODY_SOURCE, text),) if text is not None else policy_texts(self.policies))
        except PolicyError:
            self.metrics.policy_reloads.labels("refused").inc()
            raise
        self.gen = gen
        self._gens[gen.version] = gen
        self._activate(gen)
        # Wake ROUTE_UPDATE subscribers (§4.3): they send the delta themselves.
        self.fib_changed.set()
        self.fib_changed = trio.Event()
        for old in [v for v in self._gens if v != gen.version and not self._gen_users.get(v)]:
            self._retire(old)
        self.metrics.policy_reloads.labels("ok").inc()
        self.metrics.rib_version.set(gen.version)
        log.info("RIB generation %d loaded from %s", gen.version, gen.source)
        return self.rib_summary()

    def hold(self, user: GenUser) -> None:
        """``user`` runs on ``user.gen``: the generation stays until it releases it."""
        if user.gen is not None and not user.holds_gen:
            user.holds_gen = True
            self._gen_users[user.gen.version] = self._gen_users.get(user.gen.version, 0) + 1

    def release(self, user: GenUser) -> None:
        """``user`` no longer uses its generation (its task ended, or it closed
        without one); the last user of a replaced generation retires it."""
        if not user.holds_gen or user.gen is None:
            return
        user.holds_gen = False
        v = user.gen.version
        left = self._gen_users[v] = self._gen_users[v] - 1
        if left == 0:
            del self._gen_users[v]
            if v != self.gen.version:
                self._retire(v)

    def _retire(self, version: int) -> None:
        """Forget a replaced generation nobody runs on and close its adapters
        that no live generation uses."""
        gen = self._gens.pop(version, None)
        if gen is None:
            return
        live = {id(a) for g in self._gens.values() for a in g.adapters.values()}
        for name, adapter in gen.adapters.items():
            if id(adapter) in live:
                continue
            live.add(id(adapter))  # close once, even if two names shared it
            log.info("agent %s dropped by RIB generation %d: adapter closed", name, self.gen.version)
            if self._nursery is not None:
                self._nursery.start_soon(_close_adapter, name, adapter)
            else:
                self._unclosed.append((name, adapter))

    def health(self, gen: Generation, now: float) -> Mapping[str, Health]:
        """Live next-hop health for the FIB (spec §5.3, §6.2) at trio time ``now``:
        the adapter's p95 and the worse of its and the breaker's error rate score
        the next-hop; the circuit breaker decides that it is down (open), and so
        does the adapter's own flag when it is ``live_health`` (it recovers by
        itself, e.g. a 2389 agent re-announcing); other adapters' "unreachable"
        flags are not used: nothing would ever call them again to find them
        back, whereas an open breaker half-opens for a probe."""
        return LiveHealth(gen.adapters, self.gates.breakers, now)

    def rib_summary(self) -> dict[str, Any]:
        """``{"version": int, "policies": int, "agents": [name, ...]}`` of the running RIB."""
        g = self.gen
        return {"version": g.version, "policies": len(g.rib.policies), "agents": sorted(g.rib.agents)}

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Close adapters retired meanwhile, and when cancelled every live one."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name, adapter in self._unclosed:
                nursery.start_soon(_close_adapter, name, adapter)
            self._unclosed.clear()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                with trio.CancelScope(shield=True):
                    live = {id(a): (n, a) for g in self._gens.values() for n, a in g.adapters.items()}
                    for name, adapter in live.values():
                        await _close_adapter(name, adapter)


async def _close_adapter(name: str, adapter: ProviderAdapter) -> None:
    try:
        await adapter.aclose()
    except Exception:
        # A failing close must not take the router down; the adapter is gone anyway.
        log.exception("agent %s: closing its adapter failed", name)
