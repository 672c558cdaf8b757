"""Structured logs (spec §12, :mod:`atp_router.observability.logs`): one format and one
scrubber for the router's lines and its libraries', JSON or console, with the
current span's trace ids; and, through real routers, exactly one line for each
refused reload, ESEC, preemption and circuit-breaker transition.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections.abc import Iterator

import atp
import httpx
import pytest
import structlog
import trio
from opentelemetry.sdk.trace import TracerProvider

from atp_router.adapters.context import (
    REDACTED,
    install_log_redaction,
    with_context_scope,
)
from atp_router.adapters.testing import ScriptedAdapter
from atp_router.observability import logs
from atp_router.wire.codec import FrameCodec
from atp_router.wire.errors import ErrorCode
from atp_router.wire.frame import QoS
from tests.conftest import MECHANICS_RIB, SHARED, start_router
from tests.helpers import router_process, start_router_on
from tests.unit.test_router_dispatch import CLEAN, META, scripted_agent
from tests.unit.test_router_flow import QOS_DOC, drain, errs, open_inproc, serving
from tests.unit.test_router_ws import KEY, WINDOW, connect, task_payload

#: An AWS access key id of the documentation (detect-secrets recognises its shape).
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
CONTEXT_EXAMPLE = SHARED / "specs" / "agent-context-message.example.json"


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    """What :func:`logs.configure` renders, into a buffer; the root logger and
    structlog are put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    try:
        yield buf
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
        structlog.reset_defaults()


def lines(buf: io.StringIO) -> list[dict]:
    """Every line of ``buf`` as JSON (each must parse)."""
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def context_secret() -> str:
    """A ``securityContext`` secret of the draft's example Agent Context message,
    registered with the scrubber as a SYN carrying it registers it."""
    message = json.loads(CONTEXT_EXAMPLE.read_text())
    with_context_scope({"agent_context": message})
    token = message["agentContext"]["securityContext"]["authenticationInfo"]["token"]
    assert len(token) >= 8
    return token


def _emit_everything(secret: str) -> None:
    """A stdlib record with %-args and extras, a structlog event, and both kinds
    of exception, each carrying ``secret`` and an AWS key."""
    std = logging.getLogger("atp.test")
    std.warning("client sent %s and %s", secret, AWS_KEY, extra={"agent": "a.one", "header": secret})
    structlog.get_logger("atp.test.struct").info("token seen", token=secret, key=AWS_KEY, n=3)
    try:
        raise RuntimeError(f"upstream echoed {secret} {AWS_KEY}")
    except RuntimeError:
        std.exception("call failed")
        structlog.get_logger("atp.test.struct").exception("call failed too")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_secrets_and_agent_context_values_are_redacted_in_both_formats(logged, fmt):
    secret = context_secret()
    logs.configure(redaction=install_log_redaction, level="INFO", fmt=fmt, stream=logged)
    _emit_everything(secret)
    out = logged.getvalue()
    assert secret not in out and AWS_KEY not in out
    assert out.count(REDACTED) >= 5 and out.count("[REDACTED:AWS Access Key]") >= 4
    assert "upstream echoed" in out and "Traceback" in out  # the exceptions are there, scrubbed
    if fmt == "json":
        std, struct, exc, exc2 = lines(logged)
        assert std["event"] == f"client sent {REDACTED} and [REDACTED:AWS Access Key]"
        assert (std["level"], std["logger"], std["agent"], std["header"]) == ("warning", "atp.test", "a.one", REDACTED)
        assert (struct["event"], struct["token"], struct["n"]) == ("token seen", REDACTED, 3)
        assert exc["exception"].startswith("Traceback") and exc2["exception"].startswith("Traceback")
        assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", x["timestamp"]) for x in (std, struct))
    else:
        first = out.splitlines()[0]
        assert "warning" in first and "atp.test" in first and f"client sent {REDACTED}" in first
        assert "{" not in first  # not JSON


def test_json_lines_carry_the_current_spans_trace_ids_and_the_configured_fields(logged):
    logs.configure(redaction=install_log_redaction, level="DEBUG", fmt="json", stream=logged, fields={"worker": 2})
    log = logging.getLogger("atp.test")
    log.info("outside")
    with TracerProvider().get_tracer("test").start_as_current_span("stream") as span:
        log.debug("inside")
        structlog.get_logger("atp.test").info("inside too")
    outside, inside, inside2 = lines(logged)
    sc = span.get_span_context()
    ids = {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}
    assert "trace_id" not in outside and "span_id" not in outside
    assert {k: inside[k] for k in ids} == ids == {k: inside2[k] for k in ids}
    assert outside["worker"] == inside["worker"] == 2


def test_levels_below_the_configured_one_are_not_rendered_and_bad_settings_are_refused(logged):
    logs.configure(redaction=install_log_redaction, level="warning", fmt="json", stream=logged)
    logging.getLogger("atp.test").info("routine")
    structlog.get_logger("atp.test").info("routine too")
    logging.getLogger("atp.test").warning("kept")
    assert [x["event"] for x in lines(logged)] == ["kept"]
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.configure(redaction=install_log_redaction, fmt="xml", stream=logged)
    with pytest.raises(ValueError, match="log level 'LOUD'"):
        logs.configure(redaction=install_log_redaction, level="LOUD", stream=logged)


def test_the_default_format_is_console_on_a_terminal_and_json_elsewhere():
    main, replica = os.openpty()
    try:
        with os.fdopen(replica, "w", closefd=False) as tty:
            assert tty.isatty() and logs.default_format(tty) == "console"
    finally:
        os.close(main)
        os.close(replica)
    assert logs.default_format(io.StringIO()) == "json"


# ------------------------------------------------------------------ one line per event, real routers


def router_lines(buf: io.StringIO, at_least: int = logging.INFO) -> list[dict]:
    """The router's lines at ``at_least`` or above."""
    names = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
    return [x for x in lines(buf) if names[x["level"]] >= at_least]


@pytest.mark.slow  # the policy watcher takes ~5 s to stop
async def test_a_refused_reload_is_logged_once_whether_posted_or_watched(logged, nursery, tmp_path, scripted):
    logs.configure(redaction=install_log_redaction, level="INFO", fmt="json", stream=logged)
    scripted["gen.a"] = ScriptedAdapter.returning("gen.a")
    good = json.dumps({"agents": {"gen.a": scripted_agent()},
                       "policies": [{"name": "review", "match": {"task_type": "code_review"}, "fanout": ["gen.a"]}]})
    bad = good.replace('"fanout": ["gen.a"]', '"fanout": ["ghost"]')
    env = await start_router_on(nursery, tmp_path, good, watch_policies=True, watch_debounce_ms=50)
    await trio.sleep(0.3)  # the watcher is up
    async with atp.Client(env.url) as c:
        with pytest.raises(atp.ATPClientError):
            await c.reload_policies(bad)
    env.policies.write_text(bad)
    with trio.fail_after(10):
        while sum("RIB refused" in x["event"] for x in lines(logged)) < 2:
            await trio.sleep(0.02)
    await trio.sleep(0.3)  # nothing more comes
    refused = [x for x in router_lines(logged) if "ghost" in json.dumps(x)]
    assert [(x["level"], x["event"].split(":\n")[0]) for x in refused] == [
        ("error", "RIB refused (reload by anonymous@anonymous), generation 1 stays"),
        ("error", "policy watch: rib.yaml changed; RIB refused (reload by router), generation 1 stays")]
    assert all("policies[0].fanout[0]: unknown agent 'ghost'" in x["event"] for x in refused)
    assert env.router.gen.version == 1


async def test_each_esec_is_logged_once(logged, nursery, tmp_path, scripted):
    """401 (unknown key), 403 (a role the action needs), a SYN whose data scope no
    next-hop is cleared for, and a task whose secrets an agent may not see (its
    refusal; the stream's ESEC reset adds no line): one WARNING line each."""
    logs.configure(redaction=install_log_redaction, level="INFO", fmt="json", stream=logged)
    scripted["m.public"] = ScriptedAdapter.returning("m.public")
    doc = {"agents": {"m.public": {**scripted_agent(), "data_scope": ["public"]}},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["m.public"]}]}
    env = await start_router_on(nursery, tmp_path, doc, tokens_env="alice:tok-alice-0000")
    async with httpx.AsyncClient(base_url=env.url) as http:
        assert (await http.get("/v1/routes", headers={"authorization": "Bearer nope"})).status_code == 401
        assert (await http.get("/v1/routes", headers={"authorization": "Bearer tok-alice-0000"})).status_code == 403
    async with atp.Client(env.url, token="tok-alice-0000") as c:
        with pytest.raises(atp.ATPClientError) as uncleared:
            await c.open_stream(task={**META, "data_scope": ["export_controlled"]}, content=CLEAN)
        leaky = {"diff": CLEAN["diff"].replace("+", f"+KEY = '{AWS_KEY}'\n+", 1), "files": CLEAN.get("files", {})}
        _, st = await c.open_stream(task={**META, "data_scope": ["public", "secrets:forbidden"]}, content=leaky)
        events = [ev async for ev in c.events(st)]
    assert uncleared.value.code == "ESEC"
    assert events[-1].type == "RST" and events[-1].payload["code"] == "ESEC"
    warned = router_lines(logged, logging.WARNING)
    esec = [x for x in warned if x["logger"] == "atp.audit"]
    assert [x["event"].split(" ")[0] for x in esec] == ["esec", "esec", "esec", "refusal"], esec
    assert "authentication" in esec[0]["event"] and "routes_read" in esec[1]["event"]
    assert "export_controlled" in esec[2]["event"] and "m.public" in esec[3]["event"]
    assert all(x["audit"] in ("esec", "refusal") for x in esec)
    assert AWS_KEY not in logged.getvalue()
    # The reset that followed the refusal is in the trail, at DEBUG only.
    assert not [x for x in warned if x["event"].startswith("error by")]


async def test_a_frame_with_a_bad_signature_is_one_esec_line(logged, nursery, policies_dir):
    """A router that requires signed frames (§11) refuses an unsigned SYN on a
    WebSocket with ERROR ESEC: one audit line; the signed SYN that follows runs
    and adds none."""
    logs.configure(redaction=install_log_redaction, level="INFO", fmt="json", stream=logged)
    env = await start_router(nursery, policies_dir, hmac_key=KEY)
    async with connect(env.ws_url, "json", "sess-hmac", hmac_key=KEY) as peer:
        await peer.send(peer.session.open_stream("t1", META, WINDOW, payload=task_payload()),
                        codec=FrameCodec("json"))
        await peer.pump_until(lambda: bool(peer.raw_errors("t1")))
        await peer.send(peer.session.open_stream("t2", META, WINDOW, payload=task_payload()))
        await peer.pump_until(lambda: peer.closed("t2"))
    esec = [x for x in router_lines(logged, logging.WARNING) if x.get("audit") == "esec"]
    assert len(esec) == 1 and "missing sig" in esec[0]["event"], esec


async def test_each_preemption_is_logged_once(logged, tmp_path, scripted, autojump_clock):
    """Bronze streams hold the shared slots; gold kept waiting past
    ``preempt_after_ms`` RSTs them with EPREEMPT: one line per preempted stream,
    and no second line for its reset."""
    logs.configure(redaction=install_log_redaction, level="INFO", fmt="json", stream=logged)
    scripted["g.fast"] = ScriptedAdapter.returning("g.fast", delay_s=0.2)
    scripted["s.slow"] = ScriptedAdapter.returning("s.slow", delay_s=3.0)
    scripted["b.slow"] = ScriptedAdapter.returning("b.slow", delay_s=3.0)
    config = {"slots": 3, "gold_reserved": 1, "preempt_after_ms": 250, "gold_sla_ms": 2000}
    async with serving(tmp_path, QOS_DOC, **config) as router:
        bronze: list = []

        async def one(kind: str, out: list | None = None) -> None:
            events = await drain(open_inproc(router, task={"task_type": f"{kind}_task"}, qos=QoS(kind)))
            if out is not None:
                out.append(events)

        async with trio.open_nursery() as n:
            for _ in range(2):
                n.start_soon(one, "bronze", bronze)
            await trio.sleep(0.05)
            for _ in range(3):
                n.start_soon(one, "gold")
    preempted = [evs for evs in bronze if any(e["code"] == "EPREEMPT" for e in errs(evs))]
    assert preempted
    stream_ids = sorted(evs[0].frame.stream_id for evs in preempted)
    said = [x for x in router_lines(logged) if "preempted" in x["event"]]
    assert sorted(x["stream_id"] for x in said) == stream_ids
    assert all(x["code"] == str(ErrorCode.EPREEMPT) for x in said)
    assert not [x for x in router_lines(logged) if x["event"].startswith("error by")]


async def test_each_breaker_transition_is_logged_once(logged, tmp_path, scripted, autojump_clock):
    """closed → open (WARNING), open → half_open and half_open → closed (INFO):
    three transitions, three lines, each naming the agent."""
    logs.configure(redaction=install_log_redaction, level="INFO", fmt="json", stream=logged)
    down = scripted["a.down"] = ScriptedAdapter("a.down", fail_with=ErrorCode.EAGENTDOWN, fail_reason="HTTP 502")
    scripted["b.ok"] = ScriptedAdapter.returning("b.ok")
    doc = {"agents": {"a.down": {**scripted_agent(), "p95_ms": 100}, "b.ok": {**scripted_agent(), "p95_ms": 900}},
           "policies": [{"name": "p", "match": {"task_type": "code_review"}, "fanout": ["a.down", "b.ok"],
                         "fanout_k": 1}]}
    async with serving(tmp_path, doc, breaker_failures=1, breaker_window_s=2.0, breaker_backoff_s=5.0,
                       breaker_max_backoff_s=5.0) as router:
        await drain(open_inproc(router))  # a.down fails: open; rerouted to b.ok
        await drain(open_inproc(router))  # routed to b.ok: a.down is out of the FIB
        await trio.sleep(6.0)
        down.fail_with = None
        down.fragments = ScriptedAdapter.returning("a.down").fragments
        await drain(open_inproc(router))  # the half-open probe succeeds: closed
        assert router.gates.breakers.statistics()["a.down"].state == "closed"
    said = [x for x in router_lines(logged) if x["logger"] == "atp_router.runtime" and "circuit breaker" in x["event"]]
    assert [(x["level"], x["agent"], x["breaker"], x["breaker_event"]) for x in said] == [
        ("warning", "a.down", "open", "trip"),
        ("info", "a.down", "half_open", "backoff_elapsed"),
        ("info", "a.down", "closed", "probe_succeeded"),
    ]
    assert "next probe in" in said[0]["event"]


@pytest.mark.slow
def test_atp_router_writes_json_lines_when_stderr_is_not_a_terminal(tmp_path):
    """The ``atp-router`` process (stderr to a file): every log line is JSON, a
    refused reload among them once."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "default.yaml").write_text((MECHANICS_RIB / "default.yaml").read_text())
    with router_process(policies, tmp_path / "state") as url:
        r = httpx.post(url + "/v1/policies/reload", content="agents: {}\npolicies: [{fanout: [ghost]}]\n",
                       timeout=30)
        assert r.status_code == 422
    out = (tmp_path / "state.router.log").read_text().splitlines()
    logged = [json.loads(line) for line in out if not line.startswith("atp-router listening")]
    assert logged and all({"timestamp", "level", "logger", "event"} <= set(x) for x in logged)
    assert sum("RIB refused" in x["event"] for x in logged) == 1
