"""Data scope (spec §11) with the real detectors — Yelp's detect-secrets,
phonenumbers, email-validator — and the one scrubber of every adapter error path
(atp_router.security.redact). The issue's attack: ``meta.data_scope: [no_secrets]`` with
an AWS key and a private-key block in the content must not reach an agent that is
not cleared for secrets."""

from __future__ import annotations

import difflib
import threading
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_router.policy.labels import ScopeLabel, clearance_of, is_covered, parse_label
from atp_router.security.redact import (
    MAX_SCRUB_CHARS,
    REDACTED,
    DataScopeGuard,
    Pass,
    Redacted,
    Redaction,
    Refused,
    register_secrets,
    scrub,
)
from atp_router.task.diff import parse_diff
from atp_router.wire.errors import AgentError, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
PEM_LINES = ["MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun",
             "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK"]
PEM = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(PEM_LINES) + "\n-----END RSA PRIVATE KEY-----\n"
PHONE, EMAIL = "(415) 555-2671", "alice.smith@corp.com"
BEFORE = "import os\n\n\ndef connect():\n    return os.environ['X']\n"
AFTER = (f'import os\n\nAWS_ACCESS_KEY_ID = "{AWS_KEY}"\nKEY = """{PEM}"""\n# owner: {EMAIL}, {PHONE}\n\n\n'
         "def connect():\n    return os.environ['X']\n")
DIFF = "".join(difflib.unified_diff(BEFORE.splitlines(True), AFTER.splitlines(True), "a/app.py", "b/app.py"))
CONTENT = {"diff": DIFF, "files": {"app.py": AFTER}}
GUARD = DataScopeGuard()


def leaks(content: object) -> list[str]:
    text = repr(content)
    return [s for s in (AWS_KEY, *PEM_LINES, PHONE, EMAIL) if s in text]


# ------------------------------------------------------------------ label grammar

def test_label_grammar():
    assert parse_label("no_secrets") == ScopeLabel("no_secrets", "secrets", "redact", "secrets")
    assert parse_label("secrets:forbidden") == ScopeLabel("secrets:forbidden", "secrets", "forbidden", "secrets")
    assert parse_label("us_personal_data:forbidden") == ScopeLabel(
        "us_personal_data:forbidden", "us_personal_data", "forbidden", "personal_data", "US")
    assert parse_label("eu_personal_data").region is None  # not a phone region: international numbers only
    assert parse_label("personal_data").category == "pii" and parse_label("no_pii:redact").mode == "redact"
    # A suffix that is not a mode is part of an opaque category.
    assert parse_label("acp.policy:P001") == ScopeLabel("acp.policy:P001", "acp.policy:P001")
    assert parse_label("acp.policy:P001:forbidden").category == "acp.policy:P001"
    assert [is_covered(x) for x in ("no_secrets", "pii", "de_personal_data", "public", "_personal_data")] == [
        True, True, True, False, False]
    assert clearance_of(["no_secrets", "us_personal_data:forbidden", "public"]) == {
        "secrets", "us_personal_data", "public"}
    assert clearance_of(None) is None


# ------------------------------------------------------------------ the attack

def test_no_secrets_redacts_the_aws_key_and_the_private_key_block_for_an_uncleared_agent():
    scan = GUARD.inspect(CONTENT, frozenset({"no_secrets"}))
    assert scan.complete and scan.categories() == {"secrets"}
    for clearance in (None, frozenset(), frozenset({"public"})):
        d = GUARD.for_agent(scan, clearance)
        assert isinstance(d, Redacted), clearance
        assert not [s for s in leaks(d.content) if s not in (PHONE, EMAIL)]  # no secret left
        assert PHONE in d.content["files"]["app.py"]  # not asked for: personal data stays
    # The shape, the line count and the diff's structure are kept; the rest of each line too.
    assert set(d.content) == {"diff", "files"} and set(d.content["files"]) == {"app.py"}
    assert len(d.content["diff"].splitlines()) == len(DIFF.splitlines())
    assert len(d.content["files"]["app.py"].splitlines()) == len(AFTER.splitlines())
    [orig], [red] = parse_diff(DIFF), parse_diff(d.content["diff"])
    assert (red.path, red.status, [h.new_range for h in red.hunks]) == (
        orig.path, orig.status, [h.new_range for h in orig.hunks])
    lines = d.content["files"]["app.py"].splitlines()
    assert lines[2] == 'AWS_ACCESS_KEY_ID = "[REDACTED:AWS Access Key]"'
    assert lines[3:6] == ['KEY = """-----[REDACTED:Private Key]-----', "[REDACTED:Private Key]",
                          "[REDACTED:Private Key]"]
    assert lines[6] == "-----END RSA PRIVATE KEY-----"
    # Every redaction is located, never quoted.
    assert Redaction("secrets", "AWS Access Key", 'files["app.py"]', 3) in d.redactions
    assert Redaction("secrets", "AWS Access Key", "diff", 6) in d.redactions
    assert {r.line for r in d.redactions if r.path == 'files["app.py"]' and r.detector == "Private Key"} == {4, 5, 6}
    assert not leaks(repr(d.redactions))
    # Deterministic: the same task gives the same content and the same records.
    again = GUARD.for_agent(GUARD.inspect(CONTENT, frozenset({"no_secrets"})), None)
    assert again == d
    # A cleared agent gets the task's own content.
    cleared = GUARD.for_agent(scan, frozenset({"secrets"}))
    assert isinstance(cleared, Pass) and cleared.content is CONTENT


def test_forbidden_refuses_with_esec_only_when_the_data_is_there():
    scan = GUARD.inspect(CONTENT, frozenset({"secrets:forbidden"}))
    d = GUARD.for_agent(scan, frozenset({"public"}))
    assert isinstance(d, Refused) and d.code is ErrorCode.ESEC and d.label == "secrets:forbidden"
    assert "AWS Access Key" in d.reason and 'files["app.py"] line 3' in d.reason and not leaks(d.reason)
    assert {r.detector for r in d.findings} == {"AWS Access Key", "Private Key"}
    assert isinstance(GUARD.for_agent(scan, frozenset({"no_secrets"})), Pass)  # the alias clears too
    clean = {"diff": "", "files": {"app.py": BEFORE}}
    assert isinstance(GUARD.for_agent(GUARD.inspect(clean, frozenset({"secrets:forbidden"})), None), Pass)


def test_personal_data_with_phonenumbers_and_email_validator():
    labels = frozenset({"us_personal_data", "no_secrets"})
    scan = GUARD.inspect(CONTENT, labels)
    d = GUARD.for_agent(scan, frozenset({"secrets"}))
    assert isinstance(d, Redacted) and AWS_KEY in d.content["files"]["app.py"]  # cleared for secrets
    assert d.content["files"]["app.py"].splitlines()[8] == (
        "# owner: [REDACTED:Email Address], [REDACTED:Phone Number]")
    assert {r.category for r in d.redactions} == {"us_personal_data"}
    assert isinstance(GUARD.for_agent(scan, frozenset({"secrets", "pii"})), Pass)  # pii clears every region
    refused = GUARD.for_agent(GUARD.inspect(CONTENT, frozenset({"us_personal_data:forbidden"})),
                              frozenset({"eu_personal_data"}))
    assert isinstance(refused, Refused) and "Phone Number" in refused.reason and not leaks(refused.reason)
    # The spec's example scope: both at once, for an agent cleared for neither.
    spec = GUARD.for_agent(GUARD.inspect(CONTENT, frozenset({"no_secrets", "us_personal_data:forbidden"})), None)
    assert isinstance(spec, Refused) and spec.label == "us_personal_data:forbidden"


def test_opaque_labels_fail_closed_and_unscanned_content_never_passes():
    scan = GUARD.inspect(CONTENT, frozenset({"acp.policy:P001"}))
    assert scan.scanned_chars == 0  # no detector asked for: nothing scanned
    assert isinstance(GUARD.for_agent(scan, frozenset({"public"})), Refused)
    assert isinstance(GUARD.for_agent(scan, frozenset({"acp.policy:P001"})), Pass)
    assert isinstance(GUARD.for_agent(scan, None), Pass)  # the RIB's "no data_scope: any opaque label"
    small = DataScopeGuard(max_scan_chars=100)
    big = small.inspect(CONTENT, frozenset({"no_secrets"}))
    assert not big.complete
    d = small.for_agent(big, None)
    assert isinstance(d, Refused) and d.code is ErrorCode.ESEC and "scan limit of 100" in d.reason
    assert isinstance(small.for_agent(big, frozenset({"secrets"})), Pass)


def test_every_string_of_the_task_is_scanned_long_lines_included():
    jwt = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
           "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U")
    minified = "var a=1;" * 2000 + f'var k="{AWS_KEY}";' + "var b=2;" * 10
    content = {"diff": "", "files": {"app.min.js": minified}, "notes": [{"text": f"use {jwt} to log in"}], "n": 3}
    d = GUARD.for_agent(GUARD.inspect(content, frozenset({"no_secrets"})), None)
    assert isinstance(d, Redacted)
    assert d.content["notes"][0]["text"] == "use [REDACTED:JSON Web Token] to log in"  # the signature too
    assert AWS_KEY not in d.content["files"]["app.min.js"] and len(d.content["files"]["app.min.js"]) > 16000
    assert d.content["n"] == 3
    assert {r.path for r in d.redactions} == {'files["app.min.js"]', 'notes[0]["text"]'}


def test_ordinary_code_passes_untouched():
    """The router's own sources under ``secrets``: nothing to redact (no false
    positive that would garble a review)."""
    files = {p.name: p.read_text() for p in (ROOT / "atp_router" / "policy").glob("*.py")}
    d = GUARD.for_agent(GUARD.inspect({"diff": "", "files": files}, frozenset({"no_secrets"})), None)
    assert isinstance(d, Pass), d.redactions if isinstance(d, Redacted) else d


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40), max_size=12),
       st.integers(min_value=0, max_value=12))
def test_redaction_keeps_every_line_and_removes_the_key(lines, at):
    lines.insert(min(at, len(lines)), f'key = "{AWS_KEY}"')
    text = "\n".join(lines)
    d = GUARD.for_agent(GUARD.inspect({"files": {"f.py": text}}, frozenset({"no_secrets"})), None)
    assert isinstance(d, Redacted)
    out = d.content["files"]["f.py"]
    assert AWS_KEY not in out and len(out.splitlines()) == len(text.splitlines())


async def test_inspect_is_thread_safe_off_the_event_loop():
    """The dispatcher runs inspect in worker threads: concurrent scans agree."""
    labels = frozenset({"no_secrets", "us_personal_data"})
    want = GUARD.for_agent(GUARD.inspect(CONTENT, labels), None)
    results: list[object] = []
    lock = threading.Lock()

    def one() -> None:
        d = GUARD.for_agent(GUARD.inspect(CONTENT, labels), None)
        with lock:
            results.append(d)

    async with trio.open_nursery() as n:
        for _ in range(4):
            n.start_soon(trio.to_thread.run_sync, one)
    assert results == [want] * 4


# ------------------------------------------------------------------ the scrubber

def test_scrub_masks_registered_given_and_detected_secrets():
    token = "ctx-" + "q7Zr9" * 6
    register_secrets([token])
    text = f'agent failed: bearer {token}, key {AWS_KEY}, password = "hunter2hunter2", other s3cr3t-value'
    out = scrub(text, secrets=["s3cr3t-value"])
    assert out == (f"agent failed: bearer {REDACTED}, key [REDACTED:AWS Access Key], "
                   f'password = "[REDACTED:Secret Keyword]", other {REDACTED}')
    assert scrub("nothing to hide: 42 findings in app.py:3") == "nothing to hide: 42 findings in app.py:3"


def test_scrub_bounds_the_text_without_leaving_a_secret_prefix():
    long = "x " * 2000 + AWS_KEY + " tail"
    out = scrub(long)
    assert len(out) <= MAX_SCRUB_CHARS and out.endswith("…") and "AKIA" not in out
    cut_inside = "a" * (MAX_SCRUB_CHARS - 10) + " " + AWS_KEY
    assert "AKIA" not in scrub(cut_inside)
    assert scrub("y" * 100_000, max_chars=None) == "y" * 100_000
    assert len(scrub("z" * 10_000_000)) <= MAX_SCRUB_CHARS


def test_scrub_error_is_what_the_adapters_raise_with():
    from atp_router.security.redact import scrub_error

    e = AgentError(ErrorCode.EAGENTDOWN, f"peer answered 401: {AWS_KEY}", agent="a")
    assert scrub_error(e) is e and AWS_KEY not in str(e) and "[REDACTED:AWS Access Key]" in e.reason


def test_refusals_are_esec_with_a_reason_fit_for_the_wire():
    d = GUARD.for_agent(GUARD.inspect(CONTENT, frozenset({"secrets:forbidden"})), None)
    assert isinstance(d, Refused)
    with pytest.raises(AgentError) as ei:
        raise AgentError(d.code, d.reason)
    assert ei.value.code is ErrorCode.ESEC and scrub(ei.value.reason) == ei.value.reason
