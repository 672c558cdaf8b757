"""2389 Agent Protocol agents over MQTT as router next-hops (spec §14; 2389 §5-§7).

RIB entry (``atp_router.policy.rib.RemoteSpec``)::

    agents:
      sec.bandit.mqtt:
        layer: L1
        p95_ms: 1500
        remote:
          protocol: mqtt2389
          url: mqtt://127.0.0.1:1883          # mqtts:// for TLS (host name verified)
          agent_id: sec-bandit-2389           # default: the RIB agent name
          auth_env: MQTT_PASSWORD             # env var holding the broker password
          cost_usd_per_call: 0.0              # flat price when the agent reports no cost
          options:
            pipeline: [triage, {agent: summarizer, instruction: "..."}]   # the `next` chain
            max_depth: 16                     # most nested `next` objects this policy may send (0..16)
            instruction: "..."                # the first agent's `instruction`
            username: router | username_env: MQTT_USERNAME
            ca_file / cert_file / key_file    # TLS trust anchors, client certificate
            client_id, session_expiry_s (300), keepalive_s (60), discovery_timeout_ms (5000),
            down_grace_ms (3000)

Discovery: the adapter keeps one MQTT connection (started on first use, in trio's
system nursery because adapters have no start hook; :meth:`Mqtt2389Adapter.aclose`
ends it), subscribed to the retained ``/control/agents/+/status``. An agent is
available while its last status says ``available``; ``unavailable`` (graceful or
the LWT of a crashed agent) or a cleared retained status makes it down:
:meth:`~Mqtt2389Adapter.health` then reports ``up=False`` at once (the FIB excludes
the next-hop) and new calls fail with ``EAGENTDOWN``. A call already waiting fails
with ``EAGENTDOWN`` when an agent of its chain stays down for ``down_grace_ms``: a
broker restart makes every agent look dead for a moment (mosquitto publishes the
wills of its clients when it stops; the agents announce themselves again when they
reconnect).

A call: a fresh ``conversation_id``; SUBSCRIBE ``/conversations/{conversation_id}/+``
(SUBACK awaited); the task envelope (UUID v4 ``task_id``, canonical ``topic``,
``instruction``, ``input = {"task_type", "content"}``, ``next`` chain; a v2 envelope
whose ``context`` is ``prompt.task.agent_context`` unchanged when present;
with tracing on, the leg's W3C ``traceparent``, which agents forward down the
chain) published at QoS 1, not retained, to ``/control/agents/{agent_id}/input`` (PUBACK
awaited); then the first §6.3 error from any agent of the chain, or the success
message of its last agent (the reference's ``{"response", "task_id"}``; agents that
forward do not reply, and mint a new ``task_id``, so replies are matched by
conversation and agent). The session is persistent across reconnects (``clean_start``
off, ``session_expiry_s``), so a broker restart loses neither the task nor the reply.
Pipeline depth is the spec's (§2): the number of nested ``next`` objects, at most 16.

Results: the spec defines no success shape; :func:`~atp_router.mqtt.agent_protocol.decode_reply`
takes the reference's ``response`` or ``result``/``output``/``content``/``text``/``answer``,
a findings object or a bare list. JSON ``{"findings": [...], "summary"?, "confidence"?,
"usage"?}`` (what :mod:`atp_router.agent2389` agents send; a bare list is the findings)
becomes that :class:`~atp_router.consensus.types.AgentReport`: findings in the ATP schema are
taken as they are, others through the parser the A2A path uses
(:func:`~atp_router.adapters.openai_compat.parse_review`: ``line`` or ``start``/``end``,
``path``, ``message``, … with cited lines checked against the task's content); any
other text (an LLM agent's prose) is an empty report whose ``summary`` is the text.
Usage: the tokens and USD micros the agent reported, else ``cost_usd_per_call`` as a
flat price.

Errors (``AgentError``)::

    agent down / not announced / broker unreachable   EAGENTDOWN
    invalid_input, pipeline_depth_exceeded             EPROTO
    tool_execution_failed, llm_error, internal_error   EAGENTDOWN
    a reply of no known shape, unreadable findings     EPROTO
    envelope larger than 256 KB                        EPROTO

Every error reason goes through :func:`atp_router.security.redact.scrub` (with the Agent
Context secrets of the task): an agent that echoes the ``securityContext`` token, or
any credential, in its error text does not reach the client's ERROR with it.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from atp_router.adapters.base import CallStats, Fragment, Prompt, ProviderAdapter
from atp_router.adapters.context import scrub_error, secret_values
from atp_router.adapters.http import secret_value
from atp_router.adapters.openai_compat import parse_review
from atp_router.consensus.types import AgentFinding, AgentReport, Usage
from atp_router.mqtt import agent_protocol as P
from atp_router.mqtt.client import (
    MQTTClient,
    MQTTError,
    first_of,
    parse_broker_url,
    tls_context,
)
from atp_router.observability import tracing
from atp_router.policy.health import Health
from atp_router.policy.rib import AgentSpec
from atp_router.task.change import ParsedChange
from atp_router.wire.errors import AgentError, ErrorCode
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

__all__ = ["ERROR_MAP", "Mqtt2389Adapter", "Stage", "from_spec", "parse_report"]

log = logging.getLogger("atp_router.adapters.mqtt2389")

#: §6.3 error codes → ATP error codes (spec §10).
ERROR_MAP: dict[str, ErrorCode] = {
    "invalid_input": ErrorCode.EPROTO,
    "pipeline_depth_exceeded": ErrorCode.EPROTO,
    "tool_execution_failed": ErrorCode.EAGENTDOWN,
    "llm_error": ErrorCode.EAGENTDOWN,
    "internal_error": ErrorCode.EAGENTDOWN,
}

STATUS_FILTER = "/control/agents/+/status"
_MAX_SUMMARY = 2000


@dataclass(frozen=True, slots=True)
class Stage:
    """One later agent of a pipeline: its id and the ``instruction`` it gets."""

    agent_id: str
    instruction: str | None = None


@dataclass(eq=False)
class _Call:
    conversation_id: str
    chain: tuple[str, ...]
    done: trio.Event = field(default_factory=trio.Event)
    #: Set (and replaced) whenever the status of an agent of the chain changes.
    changed: trio.Event = field(default_factory=trio.Event)
    reply: P.Reply | P.ErrorReply | None = None
    replier: str = ""
    failure: AgentError | None = None

    def finish(self, *, reply: P.Reply | P.ErrorReply | None = None, replier: str = "",
               failure: AgentError | None = None) -> None:
        if not self.done.is_set():
            self.reply, self.replier, self.failure = reply, replier, failure
            self.done.set()


class _Link:
    """The adapter's MQTT connection: agent discovery and the calls in flight."""

    def __init__(self, client: MQTTClient, name: str):
        self.client = client
        self.name = name
        self.token = trio.lowlevel.current_trio_token()
        self.statuses: dict[str, P.AgentStatus | None] = {}
        self.calls: dict[str, _Call] = {}
        self.synced = trio.Event()
        self.scope = trio.CancelScope()
        self.dead = False

    async def run(self) -> None:
        """The link's task (a system task: it must never raise)."""
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.client.run)
                    nursery.start_soon(self._discover)
                    async for msg in self.client.messages:
                        self._on_message(msg.topic, msg.payload, msg.retain)
        except Exception:
            log.exception("%s: MQTT link failed", self.name)
        finally:
            self.dead = True
            for call in list(self.calls.values()):
                call.finish(failure=AgentError(ErrorCode.EAGENTDOWN, "the MQTT link was closed", agent=self.name))

    async def _discover(self) -> None:
        await self.client.subscribe(STATUS_FILTER, qos=1)
        # The retained statuses follow the SUBACK; after one more round trip they
        # have all been read, so "no status" then means "never announced".
        await self.client.round_trip()
        self.synced.set()

    def available(self, agent_id: str) -> bool:
        st = self.statuses.get(agent_id)
        return st is not None and st.status == "available"

    def describe(self, agent_id: str) -> str:
        st = self.statuses.get(agent_id)
        if st is None:
            return "has not announced itself" if agent_id not in self.statuses else "has left (status cleared)"
        return f"is {st.status} since {st.timestamp}"

    def _on_message(self, topic: str, payload: bytes, retained: bool) -> None:
        agent = P.agent_of_status_topic(topic)
        if agent is not None:
            self._on_status(agent, payload)
            return
        parts = P.canonicalize(topic).split("/")
        if len(parts) == 4 and parts[1] == "conversations":
            call = self.calls.get(parts[2])
            if call is None or retained or parts[3] not in call.chain:
                return  # a stale or foreign message (retained replies are never trusted)
            try:
                reply = P.decode_reply(payload)
            except ValueError as e:
                if parts[3] == call.chain[-1]:
                    call.finish(failure=AgentError(ErrorCode.EPROTO, f"2389 agent {parts[3]!r} sent a reply "
                                                   f"of no known shape: {e}", agent=self.name))
                return
            if isinstance(reply, P.ErrorReply) or parts[3] == call.chain[-1]:
                call.finish(reply=reply, replier=parts[3])

    def _on_status(self, agent: str, payload: bytes) -> None:
        if not payload:
            self.statuses[agent] = None  # retained status cleared: the agent has left
        else:
            try:
                st = P.decode_status(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.info("%s: ignored a malformed status of %s", self.name, agent)
                return
            if st.agent_id != agent:
                log.info("%s: ignored a status for %r on the topic of %r", self.name, st.agent_id, agent)
                return
            self.statuses[agent] = st
        for call in list(self.calls.values()):
            if agent in call.chain:
                ev, call.changed = call.changed, trio.Event()
                ev.set()


class Mqtt2389Adapter(ProviderAdapter):
    """A 2389 agent (or pipeline of agents) reached through an MQTT broker (see
    the module docstring). ``pipeline`` are the later stages of the ``next``
    chain; ``max_depth`` bounds its nested ``next`` objects, i.e. ``len(pipeline)``
    (0..16, ValueError otherwise);
    ``cost_usd_per_call`` is float USD; ``discovery_timeout_s`` how long a call
    waits for the broker connection and the retained statuses."""

    live_health = True  # retained status / LWT: down and back up are announced by the agent

    def __init__(
        self,
        name: str,
        *,
        host: str,
        port: int,
        agent_id: str,
        tls: Any = None,
        username: str | None = None,
        password_env: str | None = None,
        pipeline: Sequence[Stage] = (),
        max_depth: int = P.MAX_DEPTH,
        instruction: str | None = None,
        cost_usd_per_call: float = 0.0,
        client_id: str | None = None,
        session_expiry_s: int = 300,
        keepalive_s: int = 60,
        discovery_timeout_s: float = 5.0,
        down_grace_s: float = 3.0,
        strengths: Sequence[str] = (),
    ):
        self.name = name
        self.host, self.port, self.tls = host, port, tls
        self.agent_id = P.check_agent_id(agent_id)
        self.pipeline = tuple(pipeline)
        for st in self.pipeline:
            P.check_agent_id(st.agent_id)
        if not 0 <= max_depth <= P.MAX_DEPTH:
            raise ValueError(f"max_depth must be in 0..{P.MAX_DEPTH}, got {max_depth}")
        if len(self.pipeline) > max_depth:
            raise ValueError(f"a pipeline of {len(self.pipeline)} nested next objects exceeds max_depth {max_depth}")
        self.chain = (self.agent_id, *(s.agent_id for s in self.pipeline))
        self.max_depth = max_depth
        self.instruction = instruction
        self.cost_usd_per_call = cost_usd_per_call
        self.username = username
        self.password_env = password_env
        self.client_id = client_id
        self.session_expiry_s = session_expiry_s
        self.keepalive_s = keepalive_s
        self.discovery_timeout_s = discovery_timeout_s
        self.down_grace_s = down_grace_s
        self.strengths = list(strengths)
        self._stats = CallStats()
        self._link: _Link | None = None

    # ------------------------------------------------------------------ the link
    def _ensure_link(self) -> _Link:
        """The running link, started if needed. Raises RuntimeError outside trio."""
        token = trio.lowlevel.current_trio_token()
        link = self._link
        if link is None or link.dead or link.token is not token:
            password = None
            if self.password_env is not None:
                password = secret_value(self.password_env)
            client = MQTTClient(
                self.host, self.port,
                client_id=self.client_id or f"atp-router-{uuid.uuid4().hex[:12]}",
                clean_start=False,
                session_expiry_s=self.session_expiry_s,
                keepalive_s=self.keepalive_s,
                username=self.username,
                password=password,
                tls=self.tls,
                max_packet_bytes=2 * P.MAX_MESSAGE_BYTES,
            )  # fmt: skip
            link = self._link = _Link(client, self.name)
            trio.lowlevel.spawn_system_task(link.run, name=f"mqtt2389:{self.name}")
        return link

    async def _ready(self, link: _Link) -> None:
        with trio.move_on_after(self.discovery_timeout_s):
            await link.synced.wait()
            await link.client.wait_connected()
            return
        why = link.client.last_error or "no connection"
        raise AgentError(ErrorCode.EAGENTDOWN, f"MQTT broker {self.host}:{self.port} unreachable: {why}",
                         agent=self.name)

    def agents(self) -> dict[str, P.AgentStatus]:
        """The 2389 agents discovered on the broker and their last status."""
        link = self._link
        if link is None:
            return {}
        return {a: st for a, st in link.statuses.items() if st is not None}

    # ------------------------------------------------------------------ ProviderAdapter
    def capabilities(self) -> Capabilities:
        """Skills: the RIB strengths, else the capabilities the agent announced."""
        skills = list(self.strengths)
        link = self._link
        st = link.statuses.get(self.agent_id) if link is not None else None
        if not skills and st is not None and st.capabilities:
            skills = list(st.capabilities)
        return Capabilities(agent=self.name, skills=skills)

    def estimate(self, prompt: Prompt) -> CostEstimate:
        """The flat ``cost_usd_per_call`` (no token estimate: the agent's model is not known)."""
        return CostEstimate(usd=self.cost_usd_per_call)

    def health(self) -> Health:
        """Recent latency and errors; ``up`` is False while the broker is unreachable
        or an agent of the chain is not available (known once the retained statuses
        have been read; before that the agent counts as up)."""
        try:
            link = self._ensure_link()
        except RuntimeError:  # not inside trio: report what is known
            link = self._link
        h = self._stats.health()
        up = h.up
        if link is not None and link.synced.is_set():
            up = link.client.connected and all(link.available(a) for a in self.chain)
        return Health(p95_ms=h.p95_ms, error_rate=h.error_rate, up=up)

    async def aclose(self) -> None:
        link, self._link = self._link, None
        if link is None or link.dead:
            return
        try:
            same_run = link.token is trio.lowlevel.current_trio_token()
        except RuntimeError:
            same_run = False
        if same_run:
            with trio.CancelScope(shield=True):
                await link.client.disconnect(1.0)
            link.scope.cancel()

    async def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """One task through the broker; yields one FINAL fragment (module docstring)."""
        t0 = trio.current_time()
        try:
            report, usage = await self._call(prompt)
        except AgentError as e:
            e.agent = e.agent or self.name
            ctx = prompt.task.agent_context
            scrub_error(e, secret_values(ctx) if ctx is not None else ())
            self._stats.record((trio.current_time() - t0) * 1000, ok=False, down=e.code is ErrorCode.EAGENTDOWN)
            raise
        self._stats.record((trio.current_time() - t0) * 1000, ok=True)
        yield Fragment(type=PayloadType.FINAL, content=report, confidence=report.confidence, usage=usage)

    def envelope(self, prompt: Prompt, *, task_id: str, conversation_id: str) -> P.TaskEnvelope:
        """The task envelope this adapter sends for ``prompt`` (§6.1)."""
        nxt: P.NextTask | None = None
        for st in reversed(self.pipeline):
            nxt = P.NextTask(topic=P.input_topic(st.agent_id), instruction=st.instruction, input=None, next=nxt)
        ctx = prompt.task.agent_context
        carrier = tracing.outbound(self.name)  # W3C trace context of this leg (spec §12)
        return P.TaskEnvelope(
            task_id=task_id,
            conversation_id=conversation_id,
            topic=P.input_topic(self.agent_id),
            instruction=self.instruction or prompt.instruction or None,
            input={"task_type": prompt.task_type, "content": prompt.content},
            next=nxt,
            version="2.0" if ctx is not None else None,
            context=ctx,
            routing_trace=[] if ctx is not None else None,
            traceparent=carrier.get("traceparent"),
            tracestate=carrier.get("tracestate"),
        )

    async def _wait(self, link: _Link, call: _Call) -> None:
        """Wait for the call's reply. An agent of the chain that turns unavailable
        ends the call with EAGENTDOWN unless it is available again within
        ``down_grace_s``: a broker restart publishes every agent's LWT (mosquitto
        sends wills when it shuts down) and the agents announce themselves again on
        reconnecting, and a restarted agent gets its unacknowledged task again."""
        down_since: float | None = None
        while not call.done.is_set():
            down = next((a for a in call.chain if not link.available(a)), None)
            if down is None:
                down_since, deadline = None, math.inf
            else:
                down_since = trio.current_time() if down_since is None else down_since
                deadline = down_since + self.down_grace_s
                if trio.current_time() >= deadline:
                    raise AgentError(ErrorCode.EAGENTDOWN, f"2389 agent {down!r} {link.describe(down)}",
                                     agent=self.name)
            with trio.move_on_at(deadline):
                await first_of(call.done, call.changed)

    async def _call(self, prompt: Prompt) -> tuple[AgentReport, Usage]:
        try:
            link = self._ensure_link()
        except RuntimeError:
            raise AgentError(ErrorCode.EAGENTDOWN, "the 2389 adapter runs inside trio only", agent=self.name) from None
        await self._ready(link)
        for agent in self.chain:
            if not link.available(agent):
                raise AgentError(ErrorCode.EAGENTDOWN, f"2389 agent {agent!r} {link.describe(agent)}", agent=self.name)
        conv = f"atp-{uuid.uuid4().hex}"
        task_id = str(uuid.uuid4())
        payload = P.encode_task(self.envelope(prompt, task_id=task_id, conversation_id=conv))
        if len(payload) > P.MAX_MESSAGE_BYTES:
            raise AgentError(ErrorCode.EPROTO, f"task envelope of {len(payload)} bytes exceeds the 2389 "
                             f"{P.MAX_MESSAGE_BYTES}-byte message limit", agent=self.name)
        call = link.calls[conv] = _Call(conv, self.chain)
        replies = f"/conversations/{conv}/+"
        try:
            try:
                await link.client.subscribe(replies, qos=1)
                await link.client.publish(P.input_topic(self.agent_id), payload, qos=1, retain=False)
            except MQTTError as e:
                raise AgentError(ErrorCode.EAGENTDOWN, f"MQTT: {e.reason}", agent=self.name) from None
            await self._wait(link, call)
        finally:
            del link.calls[conv]
            with trio.move_on_after(1.0, shield=True):
                try:
                    await link.client.unsubscribe(replies)
                except MQTTError:
                    pass
        if call.failure is not None:
            raise call.failure
        reply = call.reply
        if isinstance(reply, P.ErrorReply):
            code = ERROR_MAP.get(reply.code, ErrorCode.EAGENTDOWN)
            raise AgentError(code, f"2389 agent {call.replier!r}: {reply.code}: {P.sanitize(reply.message)}",
                             agent=self.name)
        assert isinstance(reply, P.Reply)
        report, reported = parse_report(reply.response, prompt.content, change=prompt.change)
        flat = round(self.cost_usd_per_call * 1_000_000)
        usage = reported or Usage()
        if usage.usd_micros == 0 and flat:
            usage = Usage(usage.in_tokens, usage.out_tokens, flat)
        return report, usage


_FINDING_SHAPE = ("expected the ATP findings schema {file, start, end, severity, claim, ...} or what the A2A "
                  "path accepts ({file|path, line|start[, end], claim|message|issue|description, severity}), "
                  "citing a line of the reviewed content")


def parse_report(text: str, content: Mapping[str, Any] | None = None, *,
                 change: ParsedChange | None = None) -> tuple[AgentReport, Usage | None]:
    """A 2389 answer as an AgentReport and the usage it reported (see the module
    docstring); ``content`` is the task's (``{"diff", "files"}``), against which
    findings in a non-ATP shape are checked (``change``: its diff parsed, when the
    caller has it). Raises AgentError(EPROTO) naming the expected shape when a
    finding fits neither."""
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        data = {"findings": data}
    if not (isinstance(data, dict) and isinstance(data.get("findings"), list)):
        return AgentReport(summary=text.strip()[:_MAX_SUMMARY]), None
    findings = [_finding(entry, i, content or {}, change) for i, entry in enumerate(data["findings"])]
    summary = data.get("summary") if isinstance(data.get("summary"), str) else ""
    conf = data.get("confidence")
    ok_conf = isinstance(conf, int | float) and not isinstance(conf, bool) and 0.0 <= conf <= 1.0
    usage = None
    if isinstance(data.get("usage"), dict):
        try:
            usage = msgspec.convert(data["usage"], Usage)
        except msgspec.ValidationError:
            usage = None
    return AgentReport(findings=findings, summary=summary[:_MAX_SUMMARY], confidence=conf if ok_conf else None), usage


def _finding(entry: Any, i: int, content: Mapping[str, Any], change: ParsedChange | None) -> AgentFinding:
    try:
        return msgspec.convert(entry, AgentFinding)
    except msgspec.ValidationError as e:
        strict = str(e)
    found, _ = parse_review(msgspec.json.encode({"findings": [entry]}).decode(), content, change=change)
    if not found:
        raise AgentError(ErrorCode.EPROTO, f"finding [{i}] ({strict}): {_FINDING_SHAPE}")
    f = found[0]
    extra = {k: entry[k] for k in ("rule", "cwe", "patch") if isinstance(entry.get(k), str)}
    ref = entry.get("ref")
    return msgspec.structs.replace(f, ref=ref if isinstance(ref, str) and ref else str(i + 1), **extra)


# ---------------------------------------------------------------------- from the RIB
_STR_OPTS = ("instruction", "client_id", "ca_file", "cert_file", "key_file", "username", "username_env")
_INT_OPTS = {"max_depth": (0, P.MAX_DEPTH), "session_expiry_s": (0, 2**32 - 1), "keepalive_s": (5, 65535),
             "discovery_timeout_ms": (1, 600_000), "down_grace_ms": (0, 600_000)}


def _stages(value: Any) -> list[Stage]:
    if not isinstance(value, list):
        raise ValueError(  # noqa: TRY004 (registry callers catch ValueError)
            "remote.options.pipeline: expected a list of agent ids or {agent, instruction}")
    out = []
    for i, item in enumerate(value):
        where = f"remote.options.pipeline[{i}]"
        if isinstance(item, str):
            agent, instr = item, None
        elif isinstance(item, Mapping) and set(item) <= {"agent", "instruction"} and isinstance(item.get("agent"), str):
            agent, instr = item["agent"], item.get("instruction")
            if instr is not None and not isinstance(instr, str):
                raise ValueError(f"{where}.instruction: expected a string")
        else:
            raise ValueError(f"{where}: expected an agent id or {{agent, instruction}}, got {item!r:.80}")
        try:
            P.check_agent_id(agent)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(Stage(agent, instr))
    return out


def _check_options(opts: Mapping[str, Any]) -> Sequence[Stage]:
    """Check ``remote.options`` (``pipeline``, the string and the integer options
    in range); the pipeline's stages (none without ``pipeline``). Raises
    ValueError ``remote.options.<key>: <reason>``."""
    pipeline: Sequence[Stage] = ()
    for key, value in opts.items():
        if key == "pipeline":
            pipeline = _stages(value)
        elif key in _STR_OPTS:
            if not isinstance(value, str) or not value:
                raise ValueError(f"remote.options.{key}: expected a non-empty string")
        elif key in _INT_OPTS:
            lo, hi = _INT_OPTS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"remote.options.{key}: expected an integer in {lo}..{hi}, got {value!r:.40}")
        else:
            known = ", ".join(sorted(["pipeline", *_STR_OPTS, *_INT_OPTS]))
            raise ValueError(f"remote.options.{key}: unknown option for mqtt2389 (known: {known})")
    return pipeline


def from_spec(agent_name: str, agent: AgentSpec) -> ProviderAdapter:
    """The adapter for RIB agent ``agent_name`` with ``remote.protocol: mqtt2389``.
    Raises ValueError ``<field>: <reason>`` for a bad URL, agent id, option or TLS
    file; reads no secret (the password is read from ``auth_env`` at connect time)."""
    remote = agent.remote
    if remote is None or remote.protocol != "mqtt2389":
        raise ValueError("remote.protocol: expected mqtt2389")
    if agent.options:
        raise ValueError("options: a mqtt2389 agent takes its settings in remote.options")
    try:
        addr = parse_broker_url(remote.url)
    except ValueError as e:
        raise ValueError(f"remote.url: {e}") from None
    agent_id = remote.agent_id or agent_name
    try:
        P.check_agent_id(agent_id)
    except ValueError as e:
        raise ValueError(f"remote.agent_id: {e}") from None
    opts = dict(remote.options)
    pipeline = _check_options(opts)
    if "username" in opts and "username_env" in opts:
        raise ValueError("remote.options.username_env: give username or username_env, not both")
    username = opts.get("username")
    if "username_env" in opts:
        username = secret_value(opts["username_env"])
    tls = None
    if remote.tls is not None:
        if any(k in opts for k in ("ca_file", "cert_file", "key_file")):
            raise ValueError("remote.tls: give the TLS files in remote.tls or in remote.options, not both")
        opts = {**opts, **{k: v for k, v in msgspec.structs.asdict(remote.tls).items() if v is not None}}
    if any(k in opts for k in ("ca_file", "cert_file", "key_file")) and not addr.tls:
        raise ValueError("remote.url: TLS files are given but the URL is not mqtts://")
    if addr.tls:
        try:
            tls = tls_context(ca_file=opts.get("ca_file"), cert_file=opts.get("cert_file"), key_file=opts.get("key_file"))
        except OSError as e:
            raise ValueError(f"remote.options: TLS files cannot be loaded: {e.strerror or e}") from None
    try:
        return Mqtt2389Adapter(
            agent_name,
            host=addr.host,
            port=addr.port,
            agent_id=agent_id,
            tls=tls,
            username=username,
            password_env=remote.auth_env,
            pipeline=pipeline,
            max_depth=opts.get("max_depth", P.MAX_DEPTH),
            instruction=opts.get("instruction"),
            cost_usd_per_call=remote.cost_usd_per_call,
            client_id=opts.get("client_id"),
            session_expiry_s=opts.get("session_expiry_s", 300),
            keepalive_s=opts.get("keepalive_s", 60),
            discovery_timeout_s=opts.get("discovery_timeout_ms", 5000) / 1000,
            down_grace_s=opts.get("down_grace_ms", 3000) / 1000,
            strengths=agent.strengths,
        )
    except ValueError as e:
        raise ValueError(f"remote.options: {e}") from None

