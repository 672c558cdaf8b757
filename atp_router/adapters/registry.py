"""From RIB entries to live next-hops (spec §6.1, §14).

:func:`build_adapter` turns one ``agents.<name>`` entry (and its ``models.<key>``
entry, for model agents) into a :class:`ProviderAdapter`:

    tool: ruff | bandit                     → RuffAdapter / BanditAdapter
    tool: pylint | mypy | semgrep           → PylintAdapter / MypyAdapter / SemgrepAdapter
                                              (semgrep offline, with the rules shipped in
                                              atp_router/adapters/tools/semgrep_rules/)
    tool: pytest (alias tests)              → TestRunnerAdapter: the task's tests run in a
                                              sandbox without network (``allow_network``:
                                              the host's); failing tests are
                                              ``test_fail`` findings
    tool: retriever | summariser            → RetrieverAdapter / SummariserAdapter (in-process,
                                              in a worker thread; §15.3 / §15.2)
    model provider: openai_compat           → OpenAICompatAdapter at model.base_url (also
                                              Ollama's OpenAI-compatible /v1, vLLM, llama.cpp)
                    openai                  → same, base_url default https://api.openai.com/v1
                    ollama                  → OllamaAdapter (native /api/chat), base_url
                                              default http://127.0.0.1:11434
                    google                  → GeminiAdapter, base_url default
                                              https://generativelanguage.googleapis.com/v1beta
    remote protocol: mqtt2389 | a2a | agent_api | mcp
                                            → the adapter named in REMOTE_FACTORIES, imported
                                              on first use ("module:callable"); mcp is one
                                              tool (``options.tool``) of an MCP server at
                                              ``remote.url`` (streamable HTTP)

Every subprocess next-hop (the analysers, pytest) runs in the bubblewrap sandbox
of :mod:`atp_router.adapters.tools.sandbox`; where that sandbox cannot be made on this
host, building it is refused (``ValueError`` ``sandbox: <why>``), so the RIB
naming it is refused at load — never served without the sandbox.

``agent.options`` carries adapter settings; each factory accepts a fixed set and
refuses the rest. Every refusal is a ``ValueError`` whose message names the field
and the reason; the router reports it as ``PolicyError(file, "agents.<name>", …)``
and keeps the running RIB. :func:`register_tool` / :func:`register_provider` add
factories for further next-hop kinds.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from atp_router.adapters.base import ProviderAdapter
from atp_router.adapters.gemini import DEFAULT_BASE_URL as GEMINI_BASE_URL
from atp_router.adapters.gemini import GeminiAdapter
from atp_router.adapters.http import HTTPNextHop, RetryPolicy
from atp_router.adapters.ollama import DEFAULT_BASE_URL as OLLAMA_BASE_URL
from atp_router.adapters.ollama import OllamaAdapter
from atp_router.adapters.openai_compat import ChatModelAdapter, OpenAICompatAdapter
from atp_router.adapters.tools.bandit import BanditAdapter
from atp_router.adapters.tools.base import DEFAULT_LIMITS, LIMIT_OPTIONS, ToolLimits
from atp_router.adapters.tools.mypy import MypyAdapter
from atp_router.adapters.tools.pylint import PylintAdapter
from atp_router.adapters.tools.retriever import RetrieverAdapter, RetrieverLimits
from atp_router.adapters.tools.ruff import RuffAdapter
from atp_router.adapters.tools.semgrep import DEFAULT_SEMGREP_LIMITS, SemgrepAdapter
from atp_router.adapters.tools.summariser import SummariserAdapter, SummariserLimits
from atp_router.adapters.tools.testrunner import TestRunnerAdapter
from atp_router.policy.rib import AgentSpec, ModelSpec, TlsClientSpec
from atp_router.security.tls import client_context

__all__ = [
    "PROVIDER_FACTORIES",
    "REMOTE_FACTORIES",
    "TOOL_FACTORIES",
    "ProviderFactory",
    "ToolFactory",
    "build_adapter",
    "register_provider",
    "register_remote",
    "register_tool",
]

ToolFactory = Callable[[str, AgentSpec], ProviderAdapter]
ProviderFactory = Callable[[str, AgentSpec, ModelSpec], ProviderAdapter]

OPENAI_BASE_URL = "https://api.openai.com/v1"

_STR_LIST = (list, str)


def _options(agent: AgentSpec, allowed: Mapping[str, tuple[type, ...]], what: str) -> dict[str, Any]:
    """``agent.options`` checked against ``allowed`` (key → accepted types; a
    ``(list, str)`` entry means a list of strings)."""
    out: dict[str, Any] = {}
    for key, value in agent.options.items():
        types = allowed.get(key)
        if types is None:
            known = ", ".join(sorted(allowed)) or "none"
            raise ValueError(f"options.{key}: unknown option for {what} (known: {known})")
        if types == _STR_LIST:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            names = "list of strings" if types == _STR_LIST else " or ".join(t.__name__ for t in types)
            raise ValueError(f"options.{key}: expected {names}, got {value!r:.80}")
        out[key] = value
    return out


#: Resource limits every local tool takes in ``agent.options`` (:class:`ToolLimits`).
_LIMIT_TYPES: dict[str, tuple[type, ...]] = {
    k: ((int, float) if k == "timeout_s" else (int,)) for k in LIMIT_OPTIONS
}


def _tool_options(agent: AgentSpec, allowed: Mapping[str, tuple[type, ...]], what: str) -> tuple[dict[str, Any], ToolLimits]:
    """The tool's own options and its :class:`ToolLimits` (defaults, the agent's
    ``timeout_ms`` as the tool's wall-clock limit, then ``options`` overrides)."""
    opts = _options(agent, {**allowed, **_LIMIT_TYPES}, what)
    base = dataclasses.replace(DEFAULT_LIMITS, timeout_s=agent.timeout_ms / 1000)
    limits = ToolLimits.from_options(opts, base=base)
    return {k: v for k, v in opts.items() if k not in LIMIT_OPTIONS}, limits


def _ruff(name: str, agent: AgentSpec) -> ProviderAdapter:
    opts, limits = _tool_options(
        agent, {"select": _STR_LIST, "ignore": _STR_LIST, "target_version": (str,), "context": (int,),
                "allow_suppressions": (bool,)}, "tool ruff"
    )
    return RuffAdapter(name, scope=agent.scope, strengths=agent.strengths or None, limits=limits, **opts)


def _bandit(name: str, agent: AgentSpec) -> ProviderAdapter:
    opts, limits = _tool_options(agent, {"skip": _STR_LIST, "context": (int,), "allow_suppressions": (bool,)},
                                 "tool bandit")
    return BanditAdapter(name, scope=agent.scope, strengths=agent.strengths or None, limits=limits, **opts)


def _analyser(cls: type, allowed: Mapping[str, tuple[type, ...]]) -> ToolFactory:
    """Factory of ``tool: <cls.tool>``: ``scope`` from the agent, ``context``, the
    :class:`ToolLimits` fields and ``allowed`` from ``options``. A value the
    adapter refuses is a ``ValueError`` naming ``options.<key>``."""

    def factory(name: str, agent: AgentSpec) -> ProviderAdapter:
        opts, limits = _tool_options(agent, {**allowed, "context": (int,), "allow_suppressions": (bool,)},
                                     f"tool {cls.tool}")
        if cls is SemgrepAdapter and "address_space_bytes" not in agent.options:
            limits = dataclasses.replace(limits, address_space_bytes=DEFAULT_SEMGREP_LIMITS.address_space_bytes)
        try:
            return cls(name, scope=agent.scope, strengths=agent.strengths or None, limits=limits, **opts)
        except ValueError as e:
            key = str(e).partition(":")[0]
            raise ValueError(f"options.{e}" if key in opts else str(e)) from None

    return factory


#: ``tool: pylint``: ``enable`` / ``disable`` (message ids, symbols or classes).
_pylint = _analyser(PylintAdapter, {"enable": _STR_LIST, "disable": _STR_LIST})
#: ``tool: mypy``: ``disable_error_codes``, ``check_untyped_defs``, ``python_version``.
_mypy = _analyser(
    MypyAdapter, {"disable_error_codes": _STR_LIST, "check_untyped_defs": (bool,), "python_version": (str,)}
)
#: ``tool: semgrep``: ``rules`` (rule packs), ``exclude_rules`` (rule ids); its
#: address-space limit defaults to 4 GiB (:data:`DEFAULT_SEMGREP_LIMITS`).
_semgrep = _analyser(SemgrepAdapter, {"rules": _STR_LIST, "exclude_rules": _STR_LIST})


def _pytest(name: str, agent: AgentSpec) -> ProviderAdapter:
    """``tool: pytest`` / ``tests`` (:mod:`atp_router.adapters.tools.testrunner`): ``repos``
    (checkout roots a task's ``content.repo`` may name), ``allow_network`` (the
    sandbox keeps the host's network instead of an empty network namespace; only
    when the RIB says so), ``max_write_bytes`` and the tool limits."""
    opts, limits = _tool_options(
        agent, {"repos": _STR_LIST, "allow_network": (bool,), "max_write_bytes": (int,)}, "tool pytest"
    )
    return TestRunnerAdapter(name, strengths=agent.strengths or None, limits=limits, **opts)


#: ``agent.options`` every chat-model provider accepts; ``retries`` (429/5xx answers
#: retried with backoff) only where the adapter retries.
_CHAT_OPTIONS: dict[str, tuple[type, ...]] = {"json_mode": (bool,), "context_in_prompt": (bool,)}


def _chat(
    default_base_url: str | None, cls: type[ChatModelAdapter] = OpenAICompatAdapter, *, retries: bool = False
) -> ProviderFactory:
    allowed = {**_CHAT_OPTIONS, "retries": (int,)} if retries else _CHAT_OPTIONS

    def factory(name: str, agent: AgentSpec, model: ModelSpec) -> ProviderAdapter:
        opts = _options(agent, allowed, f"provider {model.provider}")
        base_url = model.base_url or default_base_url
        if base_url is None:
            raise ValueError(f"base_url: required for provider {model.provider}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r}")
        if "retries" in opts:
            if opts["retries"] < 0:
                raise ValueError("options.retries: must be >= 0")
            opts["retry"] = RetryPolicy(retries=opts.pop("retries"))
        return cls(
            name,
            base_url=base_url,
            model=model.model or agent.model or name,
            api_key_env=model.api_key_env,
            cost_in_per_mtok=model.usd_per_mtok_in,
            cost_out_per_mtok=model.usd_per_mtok_out,
            max_out_tokens=model.max_out_tokens,
            temperature=model.temperature,
            timeout_ms=agent.timeout_ms,
            ctx_tokens=int(model.ctx),
            strengths=agent.strengths or model.strengths,
            **opts,
        )

    return factory


_RETRIEVER_LIMITS = {f.name: (int,) for f in dataclasses.fields(RetrieverLimits)}


def _retriever(name: str, agent: AgentSpec) -> ProviderAdapter:
    """``tool: retriever`` (:mod:`atp_router.adapters.tools.retriever`): ``docs`` (required),
    ``roots``, ``k``, ``chunk_lines``, ``overlap``, ``min_score``, ``suffixes`` and
    the :class:`RetrieverLimits` fields."""
    opts = _options(agent, {"docs": (str,), "roots": _STR_LIST, "k": (int,), "chunk_lines": (int,),
                            "overlap": (int,), "min_score": (int, float), "suffixes": _STR_LIST,
                            **_RETRIEVER_LIMITS}, "tool retriever")
    if "docs" not in opts:
        raise ValueError("options.docs: required for tool retriever (the corpus directory)")
    limits = RetrieverLimits(**{k: opts.pop(k) for k in list(opts) if k in _RETRIEVER_LIMITS})
    return RetrieverAdapter(name, strengths=agent.strengths or None, limits=limits, **opts)


_SUMMARISER_LIMITS = {f.name: (int,) for f in dataclasses.fields(SummariserLimits)}


def _summariser(name: str, agent: AgentSpec) -> ProviderAdapter:
    """``tool: summariser`` (:mod:`atp_router.adapters.tools.summariser`): ``repo`` (required),
    ``roots`` and the :class:`SummariserLimits` fields."""
    opts = _options(agent, {"repo": (str,), "roots": _STR_LIST, **_SUMMARISER_LIMITS}, "tool summariser")
    if "repo" not in opts:
        raise ValueError("options.repo: required for tool summariser (the default repository directory)")
    limits = SummariserLimits(**{k: opts.pop(k) for k in list(opts) if k in _SUMMARISER_LIMITS})
    return SummariserAdapter(name, strengths=agent.strengths or None, limits=limits, **opts)


TOOL_FACTORIES: dict[str, ToolFactory] = {"ruff": _ruff, "bandit": _bandit, "retriever": _retriever,
                                          "summariser": _summariser}
TOOL_FACTORIES["pytest"] = TOOL_FACTORIES["tests"] = _pytest
TOOL_FACTORIES.update(pylint=_pylint, mypy=_mypy, semgrep=_semgrep)
PROVIDER_FACTORIES: dict[str, ProviderFactory] = {
    "openai_compat": _chat(None),
    "openai": _chat(OPENAI_BASE_URL),
    "ollama": _chat(OLLAMA_BASE_URL, OllamaAdapter, retries=True),
    "google": _chat(GEMINI_BASE_URL, GeminiAdapter, retries=True),
}


RemoteFactory = Callable[[str, AgentSpec], ProviderAdapter]

#: Remote agent adapters by protocol, as ``"module:callable"`` imported on first use
#: so a RIB without remote agents never imports their client libraries. The callable
#: takes ``(agent_name, agent)`` and reads ``agent.remote``.
REMOTE_FACTORIES: dict[str, str | RemoteFactory] = {
    "mqtt2389": "atp_router.adapters.mqtt2389:from_spec",
    "a2a": "atp_router.adapters.a2a:from_spec",
    "agent_api": "atp_router.adapters.agent_api:from_spec",
    "mcp": "atp_router.adapters.mcp:from_spec",
}


def register_remote(protocol: str, factory: str | RemoteFactory) -> None:
    """Make ``agents.<x>.remote.protocol: <protocol>`` build with ``factory``."""
    REMOTE_FACTORIES[protocol] = factory


def _remote_factory(protocol: str) -> RemoteFactory:
    factory = REMOTE_FACTORIES.get(protocol)
    if factory is None:
        raise ValueError(f"remote.protocol: no adapter for {protocol!r} (available: {', '.join(sorted(REMOTE_FACTORIES))})")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"remote.protocol: the {protocol} adapter is not available in this build ({e})") from None
        REMOTE_FACTORIES[protocol] = factory
    return factory


def register_tool(tool: str, factory: ToolFactory) -> None:
    """Make ``agents.<x>.tool: <tool>`` build with ``factory(agent_name, agent)``."""
    TOOL_FACTORIES[tool] = factory


def register_provider(provider: str, factory: ProviderFactory) -> None:
    """Make ``models.<x>.provider: <provider>`` build with
    ``factory(agent_name, agent, model)``."""
    PROVIDER_FACTORIES[provider] = factory


def build_adapter(agent_name: str, agent: AgentSpec, model: ModelSpec | None = None) -> ProviderAdapter:
    """The next-hop for RIB agent ``agent_name``.

    ``model`` is the agent's ``models.<agent.model>`` entry (``None`` for tool
    agents). Raises ``ValueError`` with ``<field>: <reason>`` when the entry cannot
    be served: unknown tool, provider without an adapter,
    missing ``base_url``, unknown or mistyped ``options``, ``max_out_tokens`` not
    below ``ctx``. Reads no secrets: API keys are read from ``api_key_env`` per call.
    """
    if agent.remote is not None:
        return _with_tls(_remote_factory(agent.remote.protocol)(agent_name, agent), agent.remote.tls, "remote.tls")
    if agent.tool is not None:
        tool_factory = TOOL_FACTORIES.get(agent.tool)
        if tool_factory is None:
            raise ValueError(
                f"tool: no adapter for tool {agent.tool!r} (available: {', '.join(sorted(TOOL_FACTORIES))})"
            )
        return tool_factory(agent_name, agent)
    if model is None:
        raise ValueError(f"model: agent names model {agent.model!r} but no model entry was given")
    factory = PROVIDER_FACTORIES.get(model.provider)
    if factory is None:
        raise ValueError(
            f"model: provider {model.provider!r} of model {agent.model!r} has no adapter yet "
            f"(available: {', '.join(sorted(PROVIDER_FACTORIES))})"
        )
    return _with_tls(factory(agent_name, agent, model), model.tls, "model.tls")


def _with_tls(adapter: ProviderAdapter, tls: TlsClientSpec | None, key: str) -> ProviderAdapter:
    """``adapter`` talking TLS as ``tls`` says (CA, client certificate for mTLS);
    a next-hop that is not reached over HTTP takes its TLS elsewhere (the 2389
    adapter reads ``remote.tls`` itself)."""
    if tls is None or not isinstance(adapter, HTTPNextHop):
        return adapter
    try:
        ctx = client_context(ca_file=tls.ca_file, cert_file=tls.cert_file, key_file=tls.key_file)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    adapter.use_tls(ctx)
    return adapter
