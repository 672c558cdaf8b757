"""The 2389 Agent Protocol agent runtime (``specs/agent-protocol-2389-mqtt.txt``):
exposes any ATP next-hop (:class:`~atp_router.adapters.base.ProviderAdapter`) as a
conformant 2389 agent over MQTT.

* :mod:`atp_router.mqtt.agent_protocol` — topics, messages, steps 2-6 of §7.4 (sans-IO; in
  :mod:`atp_router.mqtt`, since the router's adapter speaks it too);
* :mod:`atp_router.agent2389.config` — ``agent.toml``;
* :mod:`atp_router.agent2389.tools` — the §8 tool interface and schema validation;
* :mod:`atp_router.agent2389.runtime` — the agent (:class:`AgentRuntime`);
* :mod:`atp_router.agent2389.cli` — ``atp-agent2389 --config agent.toml``.
"""
