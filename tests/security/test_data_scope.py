"""Data scope at dispatch (spec §11, §19 exfiltration) through a real router over HTTP.

The issue's attack: ``meta.data_scope: [no_secrets]`` with an AWS key and a
private-key block in the content reached the model agent verbatim, with no ESEC
and no audit. Here the next-hops are :class:`~atp_router.adapters.testing.ScriptedAdapter`
s (RIB ``tool: scripted``), which record exactly the prompt a provider adapter
would have put on the wire — the thing under test is what the router hands them.
"""

from __future__ import annotations

import logging

import atp
import pytest
import trio

from atp_router.adapters.testing import ScriptedAdapter
from tests.unit.test_router_dispatch import META, router_with, scripted_agent

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PRIVATE_KEY = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEA0Z3VS5JJcds3xfn/ygWyF8PbnGy0AHB7MhgHcTz6sE2I2yPB\n"
    "aFDrBz9vFqU4yN2NoxkRR6kzGyO0bTe9m4qT5c1hVFmQ4HlPbH2xG8Jc0E5kF7Gb\n"
    "-----END RSA PRIVATE KEY-----\n"
)
CONFIG = (
    f'AWS_ACCESS_KEY_ID = "{AWS_KEY}"\n'
    f'aws_secret_access_key = "{AWS_SECRET}"\n'
    f'SIGNING_KEY = """\n{PRIVATE_KEY}"""\n'
    "def handler(event):\n    return event\n"
)


def _diff(path: str, text: str) -> str:
    lines = text.splitlines()
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{ln}\n" for ln in lines)


SECRET_TASK = {"diff": _diff("settings.py", CONFIG), "files": {"settings.py": CONFIG}}
PHONE_TASK = {"diff": _diff("contacts.py", 'OWNER = "+1 415 555 0132"\n'),
              "files": {"contacts.py": 'OWNER = "+1 415 555 0132"\n'}}


def _seen(adapter: ScriptedAdapter) -> str:
    return repr(adapter.calls[0].content)


async def test_no_secrets_label_redacts_before_an_uncleared_agent_and_audits(nursery, tmp_path, scripted, caplog):
    """The model agent (no ``data_scope`` clearance) gets the task with the AWS key
    pair and the private-key block masked — the rest of each line and the diff's
    shape intact; an agent cleared for ``secrets`` gets it unchanged; each
    redaction is audited with its location, never the value."""
    scripted["m.public"] = ScriptedAdapter.returning("m.public")
    scripted["m.vault"] = ScriptedAdapter.returning("m.vault")
    env = await router_with(nursery, tmp_path, {
        "m.public": scripted_agent(),
        "m.vault": {**scripted_agent(), "data_scope": ["secrets"]},
    }, fanout=["m.public", "m.vault"])
    caplog.set_level(logging.WARNING, logger="atp.audit")
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={**META, "data_scope": ["no_secrets"]}, content=SECRET_TASK)
        with trio.fail_after(30):
            await c.result(st)
    public = _seen(scripted["m.public"])
    for secret in (AWS_KEY, AWS_SECRET, "MIIEowIBAAKCAQEA0Z3VS5JJcds3xfn"):
        assert secret not in public
    assert "[REDACTED:" in public and "def handler(event):" in public and "AWS_ACCESS_KEY_ID = " in public
    got = scripted["m.public"].calls[0].content
    assert got["diff"].count("\n") == SECRET_TASK["diff"].count("\n")  # the diff keeps its lines
    assert scripted["m.vault"].calls[0].content == SECRET_TASK  # cleared: the content as sent
    records = [r.getMessage() for r in caplog.records if r.name == "atp.audit" and "redaction" in r.getMessage()]
    assert len(records) == 1 and "m.public" in records[0] and 'files[\\"settings.py\\"]' in records[0]
    assert AWS_KEY not in records[0] and AWS_SECRET not in records[0]


async def test_forbidden_category_found_is_esec_and_the_agent_is_never_called(nursery, tmp_path, scripted, caplog):
    """``us_personal_data:forbidden`` with a US phone number in the content: no
    uncleared next-hop is called; the stream is reset with ESEC (a client-caused
    refusal: no breaker counts it) and the refusal is audited. Without personal
    data in the content the same label lets the task run."""
    scripted["m.public"] = ScriptedAdapter.returning("m.public")
    env = await router_with(nursery, tmp_path, {"m.public": scripted_agent()}, fanout=["m.public"])
    caplog.set_level(logging.WARNING, logger="atp.audit")
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={**META, "data_scope": ["us_personal_data:forbidden"]}, content=PHONE_TASK)
        with pytest.raises(atp.ATPClientError) as ei, trio.fail_after(30):
            await c.result(st)
        assert ei.value.code == "ESEC"
        assert "+1 415 555 0132" not in ei.value.reason
        _, st = await c.open_stream(task={**META, "data_scope": ["us_personal_data:forbidden"]},
                                    content={"diff": SECRET_TASK["diff"][:60], "files": {}})
        with trio.fail_after(30):
            await c.result(st)
    assert len(scripted["m.public"].calls) == 1  # only the clean task
    assert any(r.name == "atp.audit" and "refusal" in r.getMessage() for r in caplog.records)
    stats = env.router.gates.breakers.statistics().get("m.public")
    assert stats is None or stats.state == "closed"
