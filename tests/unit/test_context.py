"""Agent Context Protocol: the schema, secrets, logs, data-scope labels, and a request
carrying secrets through the router to a real agentscope-runtime Agent API peer.

The schema is tested on the draft's Figure 2 as transcribed in
``../shared/specs/agent-context-message.example.json``. The end-to-end test starts a
real router (HTTP control API) whose RIB routes a code review to the agentscope
review server (tests/peers.py), sends a context with a fresh secret token, makes the
agent fail with that token in its error message, and captures every log record at
DEBUG: the secret appears in no record, no exception text and no ERROR/RST reason.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import atp
import msgspec
import pytest
import trio
from peers import start_agentscope_server  # tests/peers.py (on sys.path via conftest)

from atp_router.adapters.context import (
    REDACTED,
    AgentContext,
    RedactingFilter,
    data_scope_labels,
    forwarded_context,
    install_log_redaction,
    parse_context,
    prompt_context,
    redact_context,
    redact_event,
    register_secrets,
    scrub,
    scrub_error,
    secret_values,
    with_context_scope,
)
from atp_router.policy.match import compile_match
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import AgentError, ErrorCode, LocalProtocolError
from tests.conftest import start_router

EXAMPLE_TEXT = Path("/work/shared/specs/agent-context-message.example.json").read_text()
EXAMPLE = json.loads(EXAMPLE_TEXT)
TOKEN = EXAMPLE["agentContext"]["securityContext"]["authenticationInfo"]["token"]


def with_token(token: str) -> dict[str, Any]:
    ctx = copy.deepcopy(EXAMPLE)
    ctx["agentContext"]["securityContext"]["authenticationInfo"]["token"] = token
    return ctx


# --- schema -----------------------------------------------------------------------------


def test_example_is_accepted_exactly_and_round_trips() -> None:
    ctx = parse_context(EXAMPLE)
    assert parse_context(EXAMPLE_TEXT) == parse_context(EXAMPLE_TEXT.encode()) == ctx
    assert ctx.task_context.task_id == "T123456" and ctx.task_context.todo_items[1].item_id == "1002"
    assert [s.service_name for s in ctx.mcp_context.mcp_service_list] == ["DataFetcher", "DataProcessor"]
    assert ctx.policy_context.policies[0].policy_id == "P001"
    assert ctx.resource_context.available_resources[1] == {"resourceType": "Network", "bandwidth": "1 Gbps"}
    assert ctx.security_context.access_control.permissions == ["read:data", "write:reports"]
    assert ctx.security_context.data_protection.encryption_enabled is True
    # Nothing lost or renamed: the Struct encodes back to the draft's JSON.
    assert msgspec.to_builtins(ctx) == EXAMPLE["agentContext"]
    assert parse_context({"agentContext": {}}) == AgentContext()


@pytest.mark.parametrize(
    "path, value, where",
    [
        (("securityContex",), {}, r"unknown field `securityContex` - at `\$.agentContext`"),
        (("taskContext", "owner"), "x", r"unknown field `owner` - at `\$.agentContext.taskContext`"),
        (("taskContext", "todoItems", 0, "due"), "x", r"`due` - at `\$.agentContext.taskContext.todoItems\[0\]`"),
        (("policyContext", "policies", 0, "policyId"), "", r"length >= 1 - at `\$.agentContext.policyContext"),
        (("securityContext", "accessControl", "tokens"), ["t"], r"`tokens` - at `\$.agentContext.securityContext"),
        (("taskContext", "goals"), "one goal", r"Expected `array`, got `str`"),
        (("resourceContext", "requiredResources", 0, "resourceType"), None, r"resourceType .* is required"),
    ],
    ids=["subcontext", "task-field", "todo-field", "empty-id", "access-field", "type", "resource-type"],
)
def test_strict_schema_refuses_with_the_path(path: tuple[Any, ...], value: Any, where: str) -> None:
    msg = copy.deepcopy(EXAMPLE)
    target = msg["agentContext"]
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    elif path == ("securityContex",):
        msg["agentContext"]["securityContex"] = msg["agentContext"].pop("securityContext")
    else:
        target[path[-1]] = value
    with pytest.raises(LocalProtocolError, match=where) as e:
        parse_context(msg)
    assert e.value.code is ErrorCode.EPROTO and TOKEN not in str(e.value)


def test_open_places_are_the_ones_figure_2_varies() -> None:
    msg = copy.deepcopy(EXAMPLE)
    msg["agentContext"]["resourceContext"]["availableResources"].append({"resourceType": "GPU", "count": 2})
    msg["agentContext"]["securityContext"]["authenticationInfo"] = {"apiKey": "k-123456", "scheme": "Bearer"}
    ctx = parse_context(msg)
    assert ctx.resource_context.available_resources[-1] == {"resourceType": "GPU", "count": 2}
    assert secret_values(ctx) == {"k-123456", "Bearer"}
    with pytest.raises(LocalProtocolError, match="envelope|unknown field `context`|agentContext"):
        parse_context({"context": {}})
    with pytest.raises(LocalProtocolError, match="expected an object"):
        parse_context([EXAMPLE])


# --- secrets ----------------------------------------------------------------------------


def test_secrets_and_redaction() -> None:
    assert secret_values(EXAMPLE) == {TOKEN} == secret_values(parse_context(EXAMPLE))
    red = redact_context(EXAMPLE)
    sec = red["agentContext"]["securityContext"]
    assert sec["authenticationInfo"] == {"token": REDACTED}
    assert sec["accessControl"] == EXAMPLE["agentContext"]["securityContext"]["accessControl"]  # not a secret
    assert red["agentContext"]["taskContext"] == EXAMPLE["agentContext"]["taskContext"]
    assert EXAMPLE["agentContext"]["securityContext"]["authenticationInfo"]["token"] == TOKEN  # copy, not in place
    assert redact_context(parse_context(EXAMPLE)) == red
    # An invalid message is redacted all the same: unknown security members count as secret.
    raw = {"agentContext": {"securityContext": {"session": {"cookie": "c00kie-value"}, "accessControl": {
        "role": "r", "password": "hunter22"}}}}  # fmt: skip
    assert secret_values(raw) == {"c00kie-value", "hunter22"}
    assert redact_context(raw)["agentContext"]["securityContext"] == {
        "session": {"cookie": REDACTED}, "accessControl": {"role": "r", "password": REDACTED}}  # fmt: skip
    # Too short to be a credential: not masked everywhere.
    assert secret_values({"agentContext": {"securityContext": {"authenticationInfo": {"pin": 42}}}}) == frozenset()


def test_scrub_and_scrub_error() -> None:
    """The adapters' scrubber is atp_router.security.redact's, re-exported here."""
    from atp_router.security import redact

    assert scrub is redact.scrub and scrub_error is redact.scrub_error and REDACTED == redact.REDACTED
    assert scrub(f"bad token {TOKEN}!", secrets=[TOKEN]) == f"bad token {REDACTED}!"
    e = AgentError(ErrorCode.EAGENTDOWN, f"peer said: invalid {TOKEN}", agent="a")
    assert scrub_error(e, [TOKEN]) is e
    assert TOKEN not in e.reason and TOKEN not in str(e) and REDACTED in str(e)


def test_the_log_filter_also_masks_what_detect_secrets_finds() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    install_log_redaction(handler)
    log = logging.getLogger("test.context.detect")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("peer echoed %s", 'aws_key = "AKIAIOSFODNN7EXAMPLE"')
    finally:
        log.removeHandler(handler)
    assert out.getvalue() == 'peer echoed aws_key = "[REDACTED:AWS Access Key]"\n'


def test_forwarded_context_for_adapters() -> None:
    assert forwarded_context(TaskMeta()) == (None, frozenset())
    raw, found = forwarded_context(TaskMeta(agent_context=EXAMPLE))
    assert raw is EXAMPLE and found == {TOKEN}
    with pytest.raises(AgentError) as e:
        forwarded_context(TaskMeta(agent_context={"agentContext": {"securityContext": {"authenticationInfo": "s3cret-x"}}}))
    assert e.value.code is ErrorCode.EPROTO and "s3cret-x" not in str(e.value)


# --- logs ---------------------------------------------------------------------------------


@pytest.fixture
def filtered(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    filt = RedactingFilter()
    caplog.handler.addFilter(filt)
    yield caplog
    caplog.handler.removeFilter(filt)


def test_log_filter_masks_every_place_a_secret_can_hide(filtered: pytest.LogCaptureFixture) -> None:
    secret = "sk-" + secrets.token_hex(12)
    msg = with_token(secret)
    parse_context(msg)  # registers the secret
    log = logging.getLogger("atp.test.context")
    log.debug("meta %s", {"agent_context": msg})  # a whole context in %-args
    log.info("token was %(t)s", {"t": secret})  # mapping args
    log.warning(msg)  # a dict as the message
    log.info("call", extra={"ctx": msg, "peer_reply": f"denied for {secret}"})
    try:
        raise RuntimeError(f"upstream refused {secret}")
    except RuntimeError:
        log.exception("call failed")
    log.debug("stack", stack_info=True)
    assert len(filtered.records) == 6
    assert secret not in filtered.text
    for r in filtered.records:
        assert secret not in r.getMessage() and secret not in str(r.__dict__)
    assert REDACTED in filtered.records[0].getMessage() and "DataAnalyst" in filtered.records[0].getMessage()
    assert "upstream refused [REDACTED]" in filtered.records[4].exc_text


def test_log_filter_leaves_ordinary_records_alone(filtered: pytest.LogCaptureFixture) -> None:
    logging.getLogger("atp.test.context").info("routed %d next-hops for %s", 3, "code_review")
    assert filtered.records[0].getMessage() == "routed 3 next-hops for code_review"


def test_install_log_redaction_on_a_real_handler() -> None:
    secret = "xoxb-" + secrets.token_hex(10)
    register_secrets([secret])
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("atp.test.install")
    log.addHandler(handler)
    log.propagate = False
    try:
        first = install_log_redaction(handler)
        install_log_redaction(handler)  # idempotent
        assert handler.filters == [first]
        log.error("peer answered %s", f"401 for {secret}")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    assert out.getvalue() == f"ERROR peer answered 401 for {REDACTED}\n"


def test_structlog_style_processor() -> None:
    secret = "ghp_" + secrets.token_hex(10)
    register_secrets([secret])
    out = redact_event(None, "info", {"event": f"auth {secret}", "ctx": with_token(secret), "n": 3})
    assert secret not in json.dumps(out) and out["n"] == 3
    assert out["ctx"]["agentContext"]["securityContext"]["authenticationInfo"]["token"] == REDACTED


# --- prompts and data scope ------------------------------------------------------------------


def test_prompt_context_never_shows_the_security_context() -> None:
    shown = json.loads(prompt_context(EXAMPLE))
    assert set(shown["agentContext"]) == {"taskContext", "mcpContext", "policyContext", "resourceContext"}
    assert TOKEN not in prompt_context(EXAMPLE)


def test_policy_context_feeds_data_scope_rules() -> None:
    ctx = parse_context(EXAMPLE)
    assert data_scope_labels(ctx) == ["acp.policy:P001", "acp.policy:P002"]
    assert data_scope_labels(AgentContext()) == []
    meta = with_context_scope({"task_type": "code_review", "data_scope": ["no_secrets"], "agent_context": EXAMPLE})
    assert meta["data_scope"] == ["no_secrets", "acp.policy:P001", "acp.policy:P002"]
    # A RIB policy matches on the label like on any data-scope tag (spec §11).
    restricted = compile_match({"task_type": "code_review", "data_scope": "acp.policy:P001"})
    assert restricted(meta) and not restricted(with_context_scope({"task_type": "code_review", "data_scope": []}))


# --- end to end: a request carrying secrets, through the router ----------------------------


@pytest.fixture(scope="module")
def agentscope() -> Iterator[str]:
    with start_agentscope_server() as base:
        yield base


DIFF = """\
diff --git a/svc/auth.py b/svc/auth.py
--- a/svc/auth.py
+++ b/svc/auth.py
@@ -1,2 +1,3 @@
 def check(token):
-    return verify(token)
+    print("checking")  # atp-test: crash
+    return eval(token)
"""
FILES = {"svc/auth.py": 'def check(token):\n    print("checking")  # atp-test: crash\n    return eval(token)\n'}


async def test_secrets_never_reach_logs_errors_or_events(nursery: trio.Nursery, tmp_path: Path, agentscope: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)  # every logger, no redaction filter installed
    secret = "eyJ" + secrets.token_urlsafe(24)
    rib = tmp_path / "rib.yaml"
    rib.write_text(json.dumps({
        "agents": {"review.as": {"layer": "L2", "p95_ms": 2000, "timeout_ms": 30_000, "strengths": ["code_review"],
                                 "remote": {"protocol": "agent_api", "url": agentscope}}},
        "policies": [{"match": {"task_type": "code_review"}, "fanout": ["review.as"]}],
    }))  # fmt: skip
    env = await start_router(nursery, rib)
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review", "agent_context": with_token(secret)},
                                    content={"diff": DIFF, "files": FILES})  # fmt: skip
        with trio.fail_after(60):
            events = [ev async for ev in c.events(st)]
    errors = [ev.payload for ev in events if ev.type == "ERROR"]
    # The agent failed in-band, quoting the token; the router reports the failure without it.
    assert errors and any("AGENT_UNKNOWN_ERROR" in json.dumps(p) and REDACTED in json.dumps(p) for p in errors)
    assert events[-1].type == "RST"
    assert secret not in json.dumps([ev.frame for ev in events])  # no event echoes it, whole frames included
    assert caplog.records, "DEBUG capture recorded nothing: the test would prove nothing"
    for r in caplog.records:
        assert secret not in r.getMessage(), r.name
        assert secret not in (r.exc_text or "") and secret not in str(r.args)
    assert secret not in caplog.text
