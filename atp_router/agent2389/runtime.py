"""The 2389 agent runtime: any ProviderAdapter as a conformant 2389 agent over MQTT.

Lifecycle (§7.1-§7.3)::

    load agent.toml ─► connect (MQTT 5; LWT = retained "unavailable"; TLS for mqtts://;
    credentials from env) ─► SUBSCRIBE input (wait for SUBACK) ─► initialize [tools]
    ─► verify [adapter] (health().up, and the [probe] call when configured)
    ─► publish retained "available" (QoS 1, message expiry, re-published at half of it)
    ─► process tasks ... ─► on shutdown: a retained "unavailable" (§7.2 FR-003: it
    replaces the retained "available", so a later subscriber learns the agent left;
    the reference publishes it unretained), DISCONNECT (so no LWT), tools shut down.

A hard kill leaves the broker to publish the LWT: a retained "unavailable".

Each message on ``/control/agents/{id}/input`` goes through the nine steps of §7.4:
steps 2-6 are :func:`~atp_router.mqtt.agent_protocol.screen_task` (retained ignored, topic
canonicalized and matched, duplicate ``task_id`` discarded, more than 16 nested
``next`` objects refused with ``pipeline_depth_exceeded``, envelope parsed); step 7
maps ``input`` to a tool call —
``{"tool": name, "parameters": {...}}`` or, for any other object, the default tool
(the ``[adapter]``) with ``input`` as its parameters — checked against the allow-list
and the tool's JSON Schema, then executed under ``task_timeout_s``; step 8 forwards
``next`` (a new UUID v4 ``task_id``, ``input`` = the result as a JSON string, as the
reference does); step 9 publishes ``{"response", "task_id"}`` to
``/conversations/{conversation_id}/{agent_id}`` unless the task was forwarded.
Failures publish the §6.3 error there instead, sanitized (no stack traces, paths or
secrets), and processing goes on (FR-011).

Delivery: the session is persistent by default (``clean_start = false``) and
messages are acknowledged only once their task is finished (its reply published
with a PUBACK), so a task in progress when the agent or the broker goes down is
delivered again; the idempotency cache then discards copies of tasks already done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import ProviderAdapter
from atp_router.adapters.registry import build_adapter
from atp_router.agent2389.config import AgentConfig, ConfigError
from atp_router.agent2389.tools import (
    TOOL_IMPLS,
    AdapterTool,
    ParameterError,
    SchemaError,
    TaskContext,
    Tool,
    ToolError,
    check_schema,
    validate,
)
from atp_router.mqtt import agent_protocol as P
from atp_router.mqtt.client import (
    Message,
    MQTTClient,
    MQTTError,
    Will,
    parse_broker_url,
    tls_context,
)
from atp_router.security.redact import scrub

__all__ = ["AgentRuntime", "RuntimeStats", "StartupError"]

log = logging.getLogger("atp_router.agent2389")

_GRACE_S = 2.0


class StartupError(Exception):
    """The agent could not become available (broker unreachable, credentials
    missing, a tool failed to initialize, the adapter failed verification)."""


@dataclass
class RuntimeStats:
    """Counters since start: messages received on the input topic and what became
    of them (§7.4 outcomes)."""

    received: int = 0
    processed: int = 0
    forwarded: int = 0
    errors: int = 0
    retained_ignored: int = 0
    mismatched: int = 0
    duplicates: int = 0
    unroutable: int = 0


@dataclass
class _Slot:
    limiter: trio.CapacityLimiter
    token: object = field(default_factory=object)


class AgentRuntime:
    """One 2389 agent. ``adapter`` overrides the one built from ``[adapter]``
    (for embedding); ``env`` is where secrets are read (default ``os.environ``);
    ``clock`` gives seconds since the epoch for status timestamps.

    Raises :class:`ConfigError` at construction when ``[tools]`` cannot be built.
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        adapter: ProviderAdapter | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.agent_id = config.agent.id
        self.env = os.environ if env is None else env
        self.clock = clock
        self.stats = RuntimeStats()
        #: Startup milestones in order: connected, subscribed, tools_initialized,
        #: adapter_verified, available.
        self.startup: list[str] = []
        self.cache = P.IdempotencyCache(config.agent.idempotency_cache)
        self.input_topic = P.input_topic(self.agent_id)
        self.status_topic = P.status_topic(self.agent_id)
        engine = adapter or build_adapter(self.agent_id, config.adapter, config.model)
        probe = None
        if config.probe is not None:
            probe = {"task_type": config.probe.task_type, "content": config.probe.content}
            if config.probe.instruction:
                probe["instruction"] = config.probe.instruction
        self.engine = AdapterTool(
            config.agent.default_tool,
            engine,
            description=config.agent.description,
            failure_code="llm_error" if config.adapter.model else "tool_execution_failed",
            probe=probe,
            probe_timeout_s=config.probe.timeout_s if config.probe else 60.0,
        )
        self.tools: dict[str, Tool] = {}
        self._tool_config: dict[str, dict[str, Any]] = {}
        for name, entry in config.tool_entries().items():
            factory = TOOL_IMPLS.get(entry.impl)
            if factory is None:
                raise ConfigError("agent.toml", f"tools.{name}.impl",
                                  f"unknown tool implementation {entry.impl!r} (known: {sorted(TOOL_IMPLS)})")
            try:
                self.tools[name] = factory(name, entry.config)
            except ValueError as e:
                raise ConfigError("agent.toml", f"tools.{name}.config", str(e)) from None
            self._tool_config[name] = entry.config
        self.tools[config.agent.default_tool] = self.engine
        for name, tool in self.tools.items():
            try:
                check_schema(tool.describe()["parameters"])
            except SchemaError as e:
                raise ConfigError("agent.toml", f"tools.{name}", f"parameter schema: {e}") from None
        allowed = config.agent.allowed_tools
        self.allowed: frozenset[str] = frozenset(self.tools if allowed is None else allowed)
        self.client: MQTTClient | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._announced = False

    # ------------------------------------------------------------------ lifecycle
    def _client(self) -> MQTTClient:
        m = self.config.mqtt
        addr = parse_broker_url(m.broker_url)
        username = self._secret(m.username_env) if m.username_env else None
        password = self._secret(m.password_env) if m.password_env else None
        tls = None
        if addr.tls:
            try:
                tls = tls_context(ca_file=m.ca_file, cert_file=m.cert_file, key_file=m.key_file)
            except OSError as e:
                raise StartupError(f"TLS files cannot be loaded: {e.strerror or e}") from None
        will = Will(self.status_topic, P.encode_status(self.agent_id, "unavailable", self.clock()), qos=1,
                    retain=True)
        return MQTTClient(
            addr.host, addr.port,
            client_id=m.client_id or f"atp2389-{self.agent_id}",
            clean_start=m.clean_start,
            session_expiry_s=m.session_expiry_s,
            keepalive_s=m.keepalive_s,
            will=will,
            username=username,
            password=password,
            tls=tls,
            # Up to twice the message limit is read, so an oversized task still gets
            # its invalid_input error; beyond that the broker does not deliver it.
            max_packet_bytes=2 * self.config.agent.max_message_bytes,
            queue_size=max(16, 4 * self.config.agent.max_concurrency),
            manual_ack=True,
            connect_timeout_s=m.connect_timeout_s,
        )  # fmt: skip

    def _secret(self, name: str) -> str:
        value = self.env.get(name)
        if value is None:
            raise StartupError(f"environment variable {name} is not set")
        return value

    async def run(self, *, task_status: trio.TaskStatus[AgentRuntime] = trio.TASK_STATUS_IGNORED) -> None:
        """Start (§7.1), serve until cancelled or :meth:`shutdown`, stop gracefully
        (§7.2). ``task_status.started`` is called once "available" is published.
        Raises :class:`StartupError` when the agent cannot become available."""
        client = self.client = self._client()
        self._announced = False

        async def client_task(task_status: trio.TaskStatus[MQTTClient]) -> None:
            # Shielded: the connection must outlive a cancellation of run() long
            # enough to say "unavailable"; disconnect() in the finally below ends it.
            with trio.CancelScope(shield=True):
                await client.run(task_status=task_status)

        failure: StartupError | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(client_task)
            try:
                await self._start(client)
                task_status.started(self)
                with trio.CancelScope() as self._serve_scope:
                    await self._serve(client)
            except StartupError as e:
                # Raised after the nursery, so callers see it bare (not in a group).
                failure = e
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop(client, self._announced)
        if failure is not None:
            raise failure

    async def _start(self, client: MQTTClient) -> None:
        """§7.1 steps 2-7; "available" only after SUBACK, tools and adapter check."""
        with trio.move_on_after(self.config.mqtt.connect_timeout_s) as timer:
            await client.wait_connected()
        if timer.cancelled_caught:
            raise StartupError(client.last_error or f"no connection to {self.config.mqtt.broker_url}")
        self._milestone("connected")
        # Retain-As-Published keeps the retain flag on live retained publishes too,
        # so every retained task is recognised and ignored (FR-005).
        await client.subscribe(self.input_topic, qos=1, retain_as_published=True)
        self._milestone("subscribed")
        for name, tool in self.tools.items():
            if tool is not self.engine and not await tool.initialize(self._tool_config.get(name, {})):
                raise StartupError(f"tool {name!r} failed to initialize")
        self._milestone("tools_initialized")
        if not await self.engine.initialize({}):
            raise StartupError(f"the adapter failed verification: {self.engine.failure}")
        self._milestone("adapter_verified")
        # Set before the PUBLISH: if we are stopped while waiting for its PUBACK, the
        # broker may hold our "available" already and the shutdown must withdraw it.
        self._announced = True
        await self._announce()
        self._milestone("available")

    def shutdown(self) -> None:
        """Ask a running agent to stop gracefully (returns at once)."""
        if self._serve_scope is not None:
            self._serve_scope.cancel()

    async def _stop(self, client: MQTTClient, announced: bool) -> None:
        try:
            if announced and client.connected:
                with trio.move_on_after(_GRACE_S):
                    # Retained (§7.2 FR-003), as the LWT is (§7.3): a later subscriber
                    # finds "unavailable", not the "available" it replaces.
                    await client.publish(self.status_topic,
                                         P.encode_status(self.agent_id, "unavailable", self.clock()),
                                         qos=1, retain=True)
        except MQTTError as e:
            log.warning("agent %s: could not publish its unavailable status: %s", self.agent_id, e)
        finally:
            await client.disconnect(_GRACE_S)
            for tool in self.tools.values():
                with trio.move_on_after(_GRACE_S):
                    await tool.shutdown()

    def _milestone(self, name: str) -> None:
        self.startup.append(name)
        log.info("agent %s: %s", self.agent_id, name)

    async def _announce(self) -> None:
        """Publish the retained "available" status (§6.2, with the reference's
        message expiry, capabilities and description)."""
        assert self.client is not None
        caps = self.config.agent.capabilities or list(self.engine.adapter.capabilities().skills)
        expiry = self.config.agent.status_expiry_s or None
        payload = P.encode_status(self.agent_id, "available", self.clock(), capabilities=caps,
                                  description=self.config.agent.description or None)
        await self.client.publish(self.status_topic, payload, qos=1, retain=True, message_expiry_s=expiry)

    async def _refresh_status(self) -> None:
        """Re-publish "available" at half its expiry, so discovery never lapses."""
        with contextlib.suppress(MQTTError):  # the client is closing
            while True:
                await trio.sleep(self.config.agent.status_expiry_s / 2)
                await self._announce()

    async def _reannounce(self, client: MQTTClient) -> None:
        """Re-publish "available" after every reconnection: while the connection was
        down the broker may have published our LWT (mosquitto also sends the wills of
        its clients when it shuts down), and we are still here."""
        seen = client.statistics().connections
        with contextlib.suppress(MQTTError):  # the client is closing
            while True:
                seen = await client.wait_connected(newer_than=seen)
                await self._announce()
                log.info("agent %s: reconnected, available again", self.agent_id)

    # ------------------------------------------------------------------ §7.4
    async def _serve(self, client: MQTTClient) -> None:
        limiter = trio.CapacityLimiter(self.config.agent.max_concurrency)
        a = self.config.agent
        async with trio.open_nursery() as tasks:
            tasks.start_soon(self._reannounce, client)
            if a.status_expiry_s:
                tasks.start_soon(self._refresh_status)
            async for msg in client.messages:
                if P.canonicalize(msg.topic) != self.input_topic:
                    msg.ack()
                    continue
                self.stats.received += 1
                decision = P.screen_task(msg.payload, received_topic=msg.topic, retained=msg.retain,
                                         cache=self.cache, max_depth=a.max_pipeline_depth,
                                         max_bytes=a.max_message_bytes)
                match decision:
                    case P.Ignore(step=step, reason=reason):
                        self._count_ignored(step, reason)
                        msg.ack()
                    case P.Reject():
                        tasks.start_soon(self._reject, decision, msg)
                    case P.Accept(envelope=env):
                        slot = _Slot(limiter)
                        await limiter.acquire_on_behalf_of(slot.token)
                        tasks.start_soon(self._process, env, msg, slot)

    def _count_ignored(self, step: int, reason: str) -> None:
        if step == 2:
            self.stats.retained_ignored += 1
        elif step == 3:
            self.stats.mismatched += 1
        elif step == 4 and reason.startswith("duplicate"):
            self.stats.duplicates += 1
        else:
            self.stats.unroutable += 1
        # Not P.sanitize (which is for the wire and turns topics into "<path>"): the
        # log keeps both topics of a mismatch, with only secret-looking parts masked.
        log.info("agent %s: discarded a message (step %d): %s", self.agent_id, step, scrub(reason, max_chars=1024))

    async def _reject(self, r: P.Reject, msg: Message) -> None:
        if await self._publish_error(r.conversation_id, r.task_id, r.code, r.message):
            msg.ack()

    async def _publish_error(self, conversation_id: str, task_id: str, code: str, message: str) -> bool:
        """Publish a §6.3 error; False if the broker could not be told (then the task
        message stays unacknowledged and comes back)."""
        assert self.client is not None
        self.stats.errors += 1
        log.info("agent %s: task %s failed: %s: %s", self.agent_id, task_id, code, P.sanitize(message))
        try:
            await self.client.publish(P.conversation_topic(conversation_id, self.agent_id),
                                      P.encode_error(task_id, code, message), qos=1)  # type: ignore[arg-type]
        except MQTTError as e:
            log.warning("agent %s: could not publish an error: %s", self.agent_id, e)
            return False
        return True

    async def _process(self, env: P.TaskEnvelope, msg: Message, slot: _Slot) -> None:
        """Steps 7-9 for one accepted envelope; never raises but Cancelled."""
        assert self.client is not None
        done = False
        try:
            try:
                with trio.fail_after(self.config.agent.task_timeout_s):
                    text = await self._execute(env)
                if env.next is not None:
                    await self._forward(env, text)
                    self.stats.forwarded += 1
                else:
                    reply = P.encode_response(env.task_id, text)
                    if len(reply) > self.config.agent.max_message_bytes:
                        raise ToolError("tool_execution_failed", f"the result of {len(reply)} bytes exceeds the "
                                        f"{self.config.agent.max_message_bytes}-byte message limit")
                    await self.client.publish(P.conversation_topic(env.conversation_id, self.agent_id), reply, qos=1)
                self.stats.processed += 1
                done = True
            except ToolError as e:
                done = await self._publish_error(env.conversation_id, env.task_id, e.code, e.message)
            except trio.TooSlowError:
                done = await self._publish_error(env.conversation_id, env.task_id, "tool_execution_failed",
                                                 f"the task did not finish within {self.config.agent.task_timeout_s} s")
            except MQTTError as e:
                log.warning("agent %s: task %s: %s", self.agent_id, env.task_id, e)
            except Exception:
                # FR-011: never crash on a task; the details stay in our log only.
                log.exception("agent %s: task %s: internal error", self.agent_id, env.task_id)
                done = await self._publish_error(env.conversation_id, env.task_id, "internal_error",
                                                 "internal error while processing the task")
        finally:
            slot.limiter.release_on_behalf_of(slot.token)
            if done:
                msg.ack()

    def _call_of(self, env: P.TaskEnvelope) -> tuple[str, dict[str, Any]]:
        """Step 7's tool call: (tool name, parameters) from ``input``."""
        data = env.input
        if isinstance(data, str):
            # A pipeline stage forwards its output as a JSON string (the reference's shape).
            try:
                decoded = msgspec.json.decode(data)
            except msgspec.DecodeError:
                decoded = None
            if isinstance(decoded, dict):
                data = decoded
        if not isinstance(data, dict):
            raise ToolError("invalid_input", "input must be a JSON object: the parameters of a tool call")
        if "tool" in data:
            name, params = data.get("tool"), data.get("parameters", {})
            if not isinstance(name, str) or not isinstance(params, dict) or set(data) - {"tool", "parameters"}:
                raise ToolError("invalid_input", 'a tool call is {"tool": <name>, "parameters": {...}}')
        else:
            name, params = self.config.agent.default_tool, data
        if name not in self.allowed:
            raise ToolError("invalid_input", f"tool {name[:64]!r} is not allowed on this agent")
        return name, params

    async def _execute(self, env: P.TaskEnvelope) -> str:
        name, params = self._call_of(env)
        tool = self.tools[name]
        try:
            validate(tool.describe()["parameters"], params)
        except ParameterError as e:
            raise ToolError("invalid_input", f"parameters of {name}: {e.path}: {e.reason}") from None
        ctx = TaskContext(task_id=env.task_id, conversation_id=env.conversation_id, instruction=env.instruction,
                          agent_context=env.context)
        result = await tool.execute(params, ctx)
        return result if isinstance(result, str) else msgspec.json.encode(result).decode()

    async def _forward(self, env: P.TaskEnvelope, text: str) -> None:
        """Step 8: publish ``next`` with ``input`` = this agent's result."""
        assert self.client is not None and env.next is not None
        nxt = env.next
        target = P.canonicalize(nxt.topic)
        trace = None
        if env.version is not None:
            trace = list(env.routing_trace or [])
            trace.append({"from_agent": self.agent_id, "to_agent": P.agent_of_input_topic(target),
                          "reason": "static routing from the next field", "timestamp": P.rfc3339(self.clock()),
                          "step_number": len(trace) + 1})
        fwd = P.TaskEnvelope(task_id=str(uuid.uuid4()), conversation_id=env.conversation_id, topic=target,
                             instruction=nxt.instruction, input=text, next=nxt.next, version=env.version,
                             context=env.context, routing_trace=trace, traceparent=env.traceparent,
                             tracestate=env.tracestate)
        payload = P.encode_task(fwd)
        if len(payload) > self.config.agent.max_message_bytes:
            raise ToolError("tool_execution_failed", f"the forwarded task of {len(payload)} bytes exceeds the "
                            f"{self.config.agent.max_message_bytes}-byte message limit")
        await self.client.publish(target, payload, qos=1)
