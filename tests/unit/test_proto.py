"""proto/ is generated from the Structs (DESIGN principle 3): fail on drift, and check
that what the generated files say holds."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from atp_router import protogen
from atp_router.protogen import PROTO_DIR, Artefact, check, write
from atp_router.wire.codec import FrameCodec
from atp_router.wire.frame import CONTROL_TYPES, Frame


def test_proto_has_not_drifted() -> None:
    outcome = check()
    assert outcome.changed == [], f"proto/ drifted: {outcome.changed}; run `python -m atp_router.protogen`"


def test_check_cli_reports_drift_and_write_fixes_it(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "atp_router.protogen", *args], capture_output=True, text=True, check=False, timeout=120
        )

    assert cli("--check").returncode == 0
    out = tmp_path / "proto"
    missing = cli("--check", "--out", str(out))
    assert missing.returncode == 1
    reported = {line.split(" (run")[0] for line in missing.stdout.splitlines()}
    assert {f"drifted: {out / a.filename}" for a in protogen.artefacts()} <= reported
    assert cli("--out", str(out)).returncode == 0
    assert cli("--check", "--out", str(out)).returncode == 0
    (out / "frame.schema.json").write_text("{}\n")
    drifted = cli("--check", "--out", str(out))
    assert drifted.returncode == 1
    assert drifted.stdout.splitlines() == [f"drifted: {out / 'frame.schema.json'} (run `python -m atp_router.protogen`)"]


def test_registry_is_extensible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = Artefact("extra.json", "An added artefact.", "tests", lambda: protogen.json_text({"b": 1, "a": [2]}))
    monkeypatch.setattr(protogen, "REGISTRY", [*protogen.REGISTRY, extra])
    assert "extra.json" in write(tmp_path).changed
    assert (tmp_path / "extra.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert "| `extra.json` | An added artefact. | tests |" in (tmp_path / "README.md").read_text()
    assert write(tmp_path).changed == []


def test_skipped_producer_is_reported_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> str:
        raise protogen.Skip("source not importable")

    monkeypatch.setattr(protogen, "REGISTRY", [Artefact("gone.json", "x", "y", unavailable)])
    outcome = write(tmp_path)
    assert outcome.skipped == [("gone.json", "source not importable")]
    assert not (tmp_path / "gone.json").exists()


def load(name: str) -> dict:
    return json.loads((PROTO_DIR / name).read_text("utf-8"))


def test_frame_schema_matches_the_struct() -> None:
    schema = load("frame.schema.json")
    assert schema["$schema"] == protogen.JSON_SCHEMA_DIALECT
    frame = schema["$defs"]["Frame"]
    assert set(frame["properties"]) == set(Frame.__struct_fields__)
    assert set(frame["required"]) == {"v", "session_id", "stream_id", "msg_seq"}
    assert frame["additionalProperties"] is False
    assert frame["properties"]["msg_seq"] == {"minimum": 0, "type": "integer"}


def test_control_schema_is_the_tagged_union() -> None:
    schema = load("control.schema.json")
    mapping = schema["discriminator"]["mapping"]
    assert schema["discriminator"]["propertyName"] == "kind"
    assert set(mapping) == {t.__struct_config__.tag for t in CONTROL_TYPES}
    assert len(schema["anyOf"]) == len(CONTROL_TYPES)


def test_result_and_rib_schemas_exist_with_their_roots() -> None:
    assert load("result.schema.json")["$ref"] == "#/$defs/FinalResult"
    assert load("rib.schema.json")["$ref"] == "#/$defs/Rib"


def test_cbor_md_example_is_what_it_claims() -> None:
    """Recompute the worked example of cbor.md from the bytes it shows."""
    text = (PROTO_DIR / "cbor.md").read_text("utf-8")
    key = re.search(r"Key `([^`]+)`", text).group(1).encode()
    blocks = re.findall(r"```(?:json)?\n(.*?)\n```", text, re.DOTALL)
    payload_canon, frame_canon, cbor_hex = blocks[0].encode(), blocks[1].encode(), blocks[2].replace("\n", "")
    value = dict(re.findall(r"- `(payload\.checksum|checksum|sig)` = `([^`]+)`", text))
    assert value["payload.checksum"] == "sha256:" + hashlib.sha256(payload_canon).hexdigest()
    assert value["checksum"] == "sha256:" + hashlib.sha256(frame_canon).hexdigest()
    assert value["sig"] == base64.b64encode(hmac.new(key, frame_canon, hashlib.sha256).digest()).decode()
    frame = FrameCodec("cbor", hmac_key=key).decode(bytes.fromhex(cbor_hex))
    assert msgspec.json.encode(msgspec.structs.replace(frame, sig=None, checksum=None), order="sorted") == frame_canon


def test_openapi_paths_match_the_control_api_routes(tmp_path):
    """Every route the Starlette app serves is in proto/openapi.json and vice versa."""
    from starlette.routing import Route

    from atp_router.runtime.admin.openapi import openapi_document
    from atp_router.runtime.ingress.http_api import build_app

    app = build_app(_single_router(tmp_path))
    served = {(r.path, m.lower()) for r in app.routes if isinstance(r, Route) for m in r.methods if m != "HEAD"}
    documented = {(p, m) for p, ops in openapi_document()["paths"].items() for m in ops}
    assert served == documented


def _single_router(tmp_path):
    import shutil

    from atp_router.deploy import single
    from atp_router.runtime.config import RouterConfig

    policies = tmp_path / "policies"
    shutil.copytree(Path(__file__).resolve().parents[2] / "policies", policies)
    return single.build(RouterConfig(policies=policies))


def test_the_app_and_the_openapi_document_are_both_the_route_table(tmp_path):
    """Issue 21 item 2: one route table. The app serves exactly its entries, each
    entry's operation is the document's, and each authenticated route sits behind
    the action its entry names."""
    from starlette.routing import Route

    from atp_router.runtime.admin.openapi import openapi_document, operation
    from atp_router.runtime.ingress.http_api import ROUTES, build_app

    app = build_app(_single_router(tmp_path))
    served = [(r.path, m) for r in app.routes if isinstance(r, Route) for m in sorted(r.methods) if m != "HEAD"]
    table = [(e.path, e.method) for e in ROUTES]
    assert served == table and len(set(table)) == len(table)
    doc = openapi_document()["paths"]
    assert sum(len(ops) for ops in doc.values()) == len(ROUTES)
    for e in ROUTES:
        assert doc[e.path][e.method.lower()] == operation(e)
        assert ("security" in doc[e.path][e.method.lower()]) == e.public


def test_a_route_outside_the_route_table_is_refused(tmp_path):
    """An ingress's route the table lacks, a table entry no ingress serves, and an
    ingress authorizing a route for another action than its entry's: each stops
    the app from being built (ValueError naming it)."""
    import dataclasses

    from atp_router.runtime.ingress.http_api import ROUTES, served_routes

    router = _single_router(tmp_path)
    models = next(e for e in ROUTES if e.operation_id == "listModels")
    with pytest.raises(ValueError, match=r"outside the route table: \[\('GET', '/v1/models'\)\]"):
        served_routes(router, [e for e in ROUTES if e is not models])
    ghost = dataclasses.replace(models, path="/v1/models/ghost")
    with pytest.raises(ValueError, match="openai serves no GET /v1/models/ghost"):
        served_routes(router, [*ROUTES, ghost])
    other = [dataclasses.replace(e, action="tenant_admin") if e is models else e for e in ROUTES]
    with pytest.raises(ValueError, match="authorizes GET /v1/models otherwise"):
        served_routes(router, other)
    with pytest.raises(ValueError, match="two route table entries for GET /v1/models"):
        from atp_router.runtime.admin.openapi import openapi_document

        openapi_document([*ROUTES, models])

