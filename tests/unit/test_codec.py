"""Frame codec (spec §4, §10, §11): vector tables both ways, byte-at-a-time framing,
every rejection path, the control payload union and HMAC against the standard library.

The vectors (``vectors/frames.json``) pin the canonical bytes, checksums, sig and the
exact wire bytes. They are checked twice: against the codec, and against
``oracle_canonical`` below, an independent spelling of the canonical form written
from ``proto/cbor.md`` with the standard library only (json, hashlib, hmac).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest

from atp_router.wire import codec as codec_mod
from atp_router.wire.codec import (
    LEGACY_KID,
    MAX_CBOR_DEPTH,
    FrameCodec,
    KeyRing,
    StreamDecoder,
    canonical_bytes,
    decode_frame,
    payload_checksum,
    seal,
    verify,
)
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import (
    Budget,
    BudgetUpdate,
    Capabilities,
    Control,
    CostEstimate,
    ErrorPayload,
    Flag,
    Frame,
    Payload,
    PayloadType,
    RouteEntry,
    RouteUpdate,
    Window,
    WindowUpdate,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
KEY = VECTORS["hmac_key_utf8"].encode()
CASES = VECTORS["vectors"]
IDS = [v["name"] for v in CASES]


# --- an independent canonical encoder (proto/cbor.md, "Canonical bytes") ---


def oracle_float(x: float) -> str:
    """Shortest round-trip digits; plain decimal for 1e-5 <= |x| < 1e16, else
    ``d.ddde<exp>`` with no ``+`` and no leading zeros in the exponent."""
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if x == 0:
        return sign + "0.0"
    t = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    sci = len(digits) - 1 + t.exponent
    if -5 <= sci < 16:
        if sci >= 0:
            whole, frac = digits[: sci + 1].ljust(sci + 1, "0"), digits[sci + 1 :] or "0"
        else:
            whole, frac = "0", "0" * (-sci - 1) + digits
        return f"{sign}{whole}.{frac}"
    return f"{sign}{digits[0]}{'.' + digits[1:] if len(digits) > 1 else ''}e{sci}"


def oracle_canonical(obj: Any) -> str:
    """Sorted-key compact JSON, UTF-8 unescaped, floats as msgspec writes them."""
    if obj is None or obj is True or obj is False:
        return json.dumps(obj)
    if isinstance(obj, int):
        return str(obj)
    if isinstance(obj, float):
        return oracle_float(obj)
    if isinstance(obj, str):
        return json.dumps(obj, ensure_ascii=False)
    if isinstance(obj, list):
        return "[" + ",".join(oracle_canonical(v) for v in obj) + "]"
    assert isinstance(obj, dict)
    return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{oracle_canonical(obj[k])}" for k in sorted(obj)) + "}"


def oracle_frame_bytes(frame: Frame) -> bytes:
    """Canonical bytes of ``frame``: its fields (defaults omitted) minus sig/checksum."""
    obj = msgspec.to_builtins(frame)
    obj.pop("sig", None)
    obj.pop("checksum", None)
    return oracle_canonical(obj).encode("utf-8")


def sealed_of(case: dict) -> Frame:
    return seal(msgspec.convert(case["frame"], Frame, strict=True), KEY)


# --- vectors, encode direction ---


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vector_encode(case: dict) -> None:
    frame = msgspec.convert(case["frame"], Frame, strict=True)
    sealed = seal(frame, KEY)
    assert canonical_bytes(sealed).decode() == case["canonical"]
    assert sealed.checksum == case["checksum"]
    assert sealed.sig == case["sig"]
    if "payload_checksum" in case:
        assert sealed.payload.checksum == case["payload_checksum"] == payload_checksum(sealed.payload)
    assert FrameCodec("json", hmac_key=KEY).encode(frame) == case["wire_json"].encode()
    assert FrameCodec("cbor", hmac_key=KEY).encode(frame).hex() == case["wire_cbor"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vector_decode(case: dict) -> None:
    expected = sealed_of(case)
    for codec, data in [
        (FrameCodec("json", hmac_key=KEY), case["wire_json"].encode()),
        (FrameCodec("json", hmac_key=KEY), case["wire_json"]),  # a WebSocket text message
        (FrameCodec("cbor", hmac_key=KEY), bytes.fromhex(case["wire_cbor"])),
        (FrameCodec("cbor", hmac_key=KEY), bytes.fromhex(case["wire_cbor_canonical"])),
    ]:
        got = codec.decode(data)
        assert got == expected
        assert msgspec.to_builtins(got) == msgspec.to_builtins(expected)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vector_matches_independent_oracle(case: dict) -> None:
    """The vectors are what the definition says, not merely what the codec does."""
    sealed = sealed_of(case)
    canonical = case["canonical"].encode()
    assert oracle_frame_bytes(sealed) == canonical
    assert case["checksum"] == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert case["sig"] == base64.b64encode(hmac.new(KEY, canonical, hashlib.sha256).digest()).decode()
    if "payload_checksum" in case:
        obj = msgspec.to_builtins(sealed.payload)
        obj.pop("checksum")
        assert oracle_canonical(obj) == case["payload_canonical"]
        assert case["payload_checksum"] == "sha256:" + hashlib.sha256(case["payload_canonical"].encode()).hexdigest()
    # The wire JSON is ordinary JSON: any parser reads the same frame back.
    assert msgspec.convert(json.loads(case["wire_json"]), Frame, strict=True) == sealed


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_checksums_survive_reencoding(case: dict) -> None:
    """JSON -> CBOR -> JSON without resealing: checksum and sig still verify (§4.1)."""
    sealed = FrameCodec("json", hmac_key=KEY).decode(case["wire_json"].encode())
    as_cbor = FrameCodec("cbor").encode(sealed, seal_frame=False)
    back = FrameCodec("cbor", hmac_key=KEY).decode(as_cbor)
    as_json = FrameCodec("json").encode(back, seal_frame=False)
    assert FrameCodec("json", hmac_key=KEY).decode(as_json) == sealed


def test_seal_is_idempotent_and_covers_mutation() -> None:
    sealed = sealed_of(CASES[2])
    assert seal(sealed, KEY) == sealed
    verify(sealed, hmac_key=KEY)
    sealed.msg_seq += 1
    with pytest.raises(LocalProtocolError, match=r"frame checksum mismatch at `\$\.checksum`"):
        verify(sealed, hmac_key=KEY)
    verify(seal(sealed, KEY), hmac_key=KEY)


def test_seal_does_not_mutate_its_argument() -> None:
    frame = msgspec.convert(CASES[1]["frame"], Frame, strict=True)
    before = msgspec.to_builtins(frame)
    seal(frame, KEY)
    FrameCodec("json", hmac_key=KEY).encode(frame)
    assert msgspec.to_builtins(frame) == before


def test_canonical_payload_splice_is_exact() -> None:
    """The sealed payload bytes spliced into the frame equal a fresh sorted encoding."""
    for case in CASES:
        frame = msgspec.convert(case["frame"], Frame, strict=True)
        sealed, praw = codec_mod._seal(frame, None)
        if frame.payload is None:
            assert praw is None
        else:
            assert praw == msgspec.json.encode(sealed.payload, order="sorted")


def test_checksum_only_and_unsigned_modes() -> None:
    frame = msgspec.convert(CASES[2]["frame"], Frame, strict=True)
    plain = FrameCodec("json").encode(frame, seal_frame=False)
    assert FrameCodec("json", require_checksum=False).decode(plain) == frame
    sealed_no_key = FrameCodec("json").encode(frame)
    assert FrameCodec("json").decode(sealed_no_key).sig is None
    # require_checksum=False with a key: the sig is still required and checked.
    signed = msgspec.structs.replace(seal(frame, KEY), checksum=None)
    codec = FrameCodec("json", hmac_key=KEY, require_checksum=False)
    assert codec.decode(FrameCodec("json").encode(signed, seal_frame=False)) == signed
    # A payload without its own checksum is accepted when the frame checksum holds.
    bare = msgspec.structs.replace(frame, payload=Payload(type=PayloadType.LOG, content="x"))
    raw = canonical_bytes(bare)
    bare.checksum = "sha256:" + hashlib.sha256(raw).hexdigest()
    assert FrameCodec("json").decode(FrameCodec("json").encode(bare, seal_frame=False)) == bare


def test_hmac_key_can_change_on_a_codec() -> None:
    codec = FrameCodec("json", hmac_key=b"old")
    data = codec.encode(sealed_of(CASES[0]))
    codec.hmac_key = b"new"
    with pytest.raises(LocalProtocolError) as e:
        codec.decode(data)
    assert e.value.code is ErrorCode.ESEC
    codec.hmac_key = None
    assert codec.decode(data).sig is not None


@pytest.mark.parametrize("key", [b"", b"k", b"x" * 63, b"y" * 64, b"z" * 65, bytes(range(256)) * 2])
def test_hmac_matches_stdlib(key: bytes) -> None:
    for msg in [b"", b"a", CASES[1]["canonical"].encode(), bytes(range(256)) * 20]:
        want = base64.b64encode(hmac.new(key, msg, hashlib.sha256).digest()).decode()
        assert codec_mod._HmacSha256(key).sig(msg) == want


def test_untyped_locations_match_the_schema() -> None:
    """The CBOR JSON-model check covers every field the schema leaves open: ``Any``
    values and floats without an upper bound. A new such field fails here."""
    from msgspec import inspect as mi

    found: set[str] = set()

    def walk(t: mi.Type, path: str, seen: frozenset[type]) -> None:
        if isinstance(t, mi.AnyType):
            found.add(path)
        elif isinstance(t, mi.FloatType):
            if t.le is None and t.lt is None:
                found.add(path)
        elif isinstance(t, mi.UnionType):
            for u in t.types:
                walk(u, path, seen)
        elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            walk(t.item_type, path + "[]", seen)
        elif isinstance(t, mi.DictType):
            walk(t.value_type, path + "{}", seen)
        elif isinstance(t, mi.StructType) and t.cls not in seen:
            for f in t.fields:
                walk(f.type, f"{path}.{f.encode_name}", seen | {t.cls})

    walk(mi.type_info(Frame), "$", frozenset())
    assert found == {"$.meta{}", "$.payload.content", "$.payload.cost_est.usd"}


# --- byte-at-a-time framing ---


@pytest.mark.parametrize("encoding", ["json", "cbor"])
def test_stream_decoder_byte_at_a_time(encoding: str) -> None:
    codec = FrameCodec(encoding, hmac_key=KEY)
    wires = [case["wire_json"].encode() if encoding == "json" else bytes.fromhex(case["wire_cbor"]) for case in CASES]
    stream = b"".join(StreamDecoder.frame_bytes(w) for w in wires)
    sd = StreamDecoder(codec)
    got: list[Frame] = []
    for i in range(len(stream)):
        sd.receive_data(stream[i : i + 1])
        while (f := sd.next_frame()) is not None:
            got.append(f)
    assert got == [sealed_of(case) for case in CASES]
    assert sd.buffered == 0
    assert sd.next_frame() is None


@pytest.mark.parametrize("encoding", ["json", "cbor"])
def test_stream_decoder_whole_batch_and_memoryview(encoding: str) -> None:
    codec = FrameCodec(encoding, hmac_key=KEY)
    wire = codec.encode(sealed_of(CASES[3]))
    sd = StreamDecoder(codec)
    sd.receive_data(memoryview(StreamDecoder.frame_bytes(wire) * 3 + StreamDecoder.frame_bytes(wire)[:7]))
    assert [sd.next_frame() for _ in range(3)] == [sealed_of(CASES[3])] * 3
    assert sd.next_frame() is None
    assert sd.buffered == 7


@pytest.mark.parametrize("encoding", ["json", "cbor"])
def test_bad_frame_then_good_frame_on_one_stream(encoding: str) -> None:
    codec = FrameCodec(encoding, hmac_key=KEY)
    good = codec.encode(sealed_of(CASES[1]))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    other = StreamDecoder(codec)  # another stream sharing the codec, mid-frame
    other.receive_data(StreamDecoder.frame_bytes(good)[:10])

    sd = StreamDecoder(codec)
    sd.receive_data(StreamDecoder.frame_bytes(bytes(bad)) + StreamDecoder.frame_bytes(good))
    with pytest.raises(LocalProtocolError) as e:
        sd.next_frame()
    assert e.value.code in (ErrorCode.EPROTO, ErrorCode.ESEC)
    assert sd.next_frame() == sealed_of(CASES[1])
    assert sd.next_frame() is None

    other.receive_data(StreamDecoder.frame_bytes(good)[10:])
    assert other.next_frame() == sealed_of(CASES[1])


def test_stream_decoder_oversize_announcement_breaks_the_stream() -> None:
    sd = StreamDecoder(FrameCodec("json", max_frame_bytes=100))
    sd.receive_data((101).to_bytes(4, "big") + b"x" * 101)
    for _ in range(2):
        with pytest.raises(LocalProtocolError, match="announced frame length 101 exceeds the limit of 100") as e:
            sd.next_frame()
        assert e.value.code is ErrorCode.EPROTO
    sd.receive_data(b"more")
    assert sd.buffered == 0


# --- rejections ---


def base_obj() -> dict:
    """A sealed frame with payload, as builtins (the starting point of each bad case)."""
    return msgspec.to_builtins(sealed_of(CASES[2]))


def with_(**changes: Any) -> dict:
    obj = base_obj()
    obj.update(changes)
    return obj


def without(field: str) -> dict:
    obj = base_obj()
    del obj[field]
    return obj


def reseal_raw(obj: dict) -> dict:
    """Recompute the frame checksum and sig over ``obj`` as it is (payload untouched)."""
    frame = msgspec.convert(obj, Frame, strict=True)
    raw = canonical_bytes(frame)
    obj["checksum"] = "sha256:" + hashlib.sha256(raw).hexdigest()
    obj["sig"] = base64.b64encode(hmac.new(KEY, raw, hashlib.sha256).digest()).decode()
    return obj


def payload_checksum_wrong() -> dict:
    obj = base_obj()
    obj["payload"]["checksum"] = "sha256:" + "0" * 64
    return reseal_raw(obj)


def nested(levels: int) -> list:
    x: list = []
    for _ in range(levels - 1):
        x = [x]
    return x


# (name, builder of the frame object, error code, text the reason must contain)
SCHEMA_CASES = [
    ("msg_seq-wrong-type", lambda: with_(msg_seq="12"), ErrorCode.EPROTO, "Expected `int`, got `str` - at `$.msg_seq`"),
    ("msg_seq-negative", lambda: with_(msg_seq=-1), ErrorCode.EPROTO, "Expected `int` >= 0 - at `$.msg_seq`"),
    ("unknown-field", lambda: with_(colour="red"), ErrorCode.EPROTO, "unknown field `colour`"),
    (
        "unknown-nested-field",
        lambda: with_(window={"max_parallel": 1, "max_tokens": 1, "max_usd_micros": 1, "x": 1}),
        ErrorCode.EPROTO,
        "unknown field `x` - at `$.window`",
    ),
    ("missing-session_id", lambda: without("session_id"), ErrorCode.EPROTO, "missing required field `session_id`"),
    ("version-2", lambda: with_(v=2), ErrorCode.EPROTO, "unsupported protocol version"),
    ("bad-flag", lambda: with_(flags=["MORE", "URG"]), ErrorCode.EPROTO, "Invalid enum value 'URG' - at `$.flags[1]`"),
    ("bad-qos", lambda: with_(qos="platinum"), ErrorCode.EPROTO, "at `$.qos`"),
    ("ttl-over-255", lambda: with_(ttl=256), ErrorCode.EPROTO, "at `$.ttl`"),
    ("empty-session_id", lambda: with_(session_id=""), ErrorCode.EPROTO, "at `$.session_id`"),
    ("bool-as-int", lambda: with_(msg_seq=True), ErrorCode.EPROTO, "got `bool` - at `$.msg_seq`"),
    (
        "bad-payload-type",
        lambda: with_(payload={"type": "agent.result.bogus"}),
        ErrorCode.EPROTO,
        "at `$.payload.type`",
    ),
    (
        "confidence-over-1",
        lambda: with_(payload={"type": "agent.result.log", "confidence": 1.5}),
        ErrorCode.EPROTO,
        "at `$.payload.confidence`",
    ),
    ("not-an-object", lambda: [1, 2], ErrorCode.EPROTO, "Expected `object`, got `array`"),
    ("missing-checksum", lambda: without("checksum"), ErrorCode.EPROTO, "missing frame checksum at `$.checksum`"),
    (
        "bad-checksum",
        lambda: with_(checksum="sha256:" + "f" * 64),
        ErrorCode.EPROTO,
        "frame checksum mismatch at `$.checksum`",
    ),
    ("checksum-not-sha256", lambda: with_(checksum="md5:abc"), ErrorCode.EPROTO, "`$.checksum` must be 'sha256:<hex>'"),
    ("checksum-non-ascii", lambda: with_(checksum="sha256:é"), ErrorCode.EPROTO, "frame checksum mismatch"),
    (
        "payload-checksum-mismatch",
        payload_checksum_wrong,
        ErrorCode.EPROTO,
        "payload checksum mismatch at `$.payload.checksum`",
    ),
    ("bad-sig", lambda: with_(sig=base64.b64encode(b"\0" * 32).decode()), ErrorCode.ESEC, "bad sig at `$.sig`"),
    ("non-ascii-sig", lambda: with_(sig="ü" * 44), ErrorCode.ESEC, "bad sig at `$.sig`"),
    ("missing-sig", lambda: without("sig"), ErrorCode.ESEC, "missing sig at `$.sig`"),
    # Key ids (§11 rotation): the codec's ring is KeyRing.single(KEY), kid k0.
    ("unknown-kid", lambda: with_(sig="k9:" + base_obj()["sig"]), ErrorCode.ESEC, "unknown key id 'k9' at `$.sig`"),
    ("malformed-kid", lambda: with_(sig="no such kid!:" + base_obj()["sig"]), ErrorCode.ESEC, "malformed key id"),
    ("empty-kid", lambda: with_(sig=":" + base_obj()["sig"]), ErrorCode.ESEC, "malformed key id"),
    ("kid-bad-mac", lambda: with_(sig="k0:" + base64.b64encode(b"\0" * 32).decode()), ErrorCode.ESEC, "bad sig"),
    ("kid-twice", lambda: with_(sig="k0:k0:" + base_obj()["sig"]), ErrorCode.ESEC, "bad sig at `$.sig`"),
]


@pytest.mark.parametrize("encoding", ["json", "cbor"])
@pytest.mark.parametrize(("name", "build", "code", "reason"), SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_rejections_both_encodings(encoding: str, name: str, build: Any, code: ErrorCode, reason: str) -> None:
    obj = build()
    data = json.dumps(obj).encode() if encoding == "json" else cbor2.dumps(obj)
    with pytest.raises(LocalProtocolError) as e:
        FrameCodec(encoding, hmac_key=KEY).decode(data)
    assert e.value.code is code
    assert reason in e.value.reason


def test_sig_not_required_without_key_but_checked_with_one() -> None:
    data = json.dumps(without("sig")).encode()
    assert FrameCodec("json").decode(data).sig is None


def cbor_with(**changes: Any) -> bytes:
    return cbor2.dumps(with_(**changes))


def cbor_payload_content(content: Any) -> bytes:
    obj = base_obj()
    obj["payload"]["content"] = content
    return cbor2.dumps(obj)


GOOD_CBOR = cbor2.dumps(base_obj())


def deep_json(levels: int) -> bytes:
    head = json.dumps(with_(meta={"x": None})).encode()
    return head.replace(b'"x": null', b'"x": ' + b"[" * levels + b"]" * levels)


def deep_cbor(levels: int) -> bytes:
    head = cbor2.dumps(with_(meta={"x": None}))
    return head.replace(b"ax\xf6", b"ax" + b"\x81" * (levels - 1) + b"\x80")


# (name, encoding, raw message, code, text the reason must contain)
RAW_CASES = [
    ("oversize-json", "json", b" " * 2000, ErrorCode.EPROTO, "frame of 2000 bytes exceeds the limit of 1024"),
    ("oversize-cbor", "cbor", b"\0" * 1025, ErrorCode.EPROTO, "frame of 1025 bytes exceeds the limit of 1024"),
    ("oversize-text-by-utf8-bytes", "json", "é" * 600, ErrorCode.EPROTO, "frame of 1200 bytes exceeds"),
    ("malformed-json", "json", b'{"v":1,', ErrorCode.EPROTO, "malformed json"),
    ("json-trailing-garbage", "json", json.dumps(base_obj()).encode() + b"x", ErrorCode.EPROTO, "trailing characters"),
    (
        "json-invalid-utf8",
        "json",
        json.dumps(base_obj()).encode().replace(b"sess_7c1f", b"sess_\xff\xfe"),
        ErrorCode.EPROTO,
        "invalid UTF-8",
    ),
    ("json-lone-surrogate", "json", json.dumps(with_(stream_id="\ud800")).encode(), ErrorCode.EPROTO, "malformed json"),
    ("json-nan", "json", json.dumps(with_(meta={"x": float("nan")})).encode(), ErrorCode.EPROTO, "malformed json"),
    ("text-on-cbor", "cbor", "not bytes", ErrorCode.EPROTO, "CBOR connection received a text message"),
    ("truncated-cbor", "cbor", GOOD_CBOR[:-5], ErrorCode.EPROTO, "malformed cbor"),
    ("empty-cbor", "cbor", b"", ErrorCode.EPROTO, "malformed cbor"),
    ("cbor-trailing-bytes", "cbor", GOOD_CBOR + b"\x00", ErrorCode.EPROTO, "trailing bytes after the frame"),
    ("cbor-trailing-bytestring", "cbor", GOOD_CBOR + cbor2.dumps(b"\0" * 16), ErrorCode.EPROTO, "trailing bytes"),
    ("json-deep-nesting", "json", deep_json(100_000), ErrorCode.EPROTO, "malformed json: nested too deeply"),
    (
        "cbor-deep-nesting",
        "cbor",
        cbor_with(meta={"x": nested(MAX_CBOR_DEPTH - 1)}),
        ErrorCode.EPROTO,
        f"containers nested deeper than {MAX_CBOR_DEPTH}",
    ),
    (
        "cbor-very-deep-nesting",
        "cbor",
        deep_cbor(100_000),
        ErrorCode.EPROTO,
        f"containers nested deeper than {MAX_CBOR_DEPTH}",
    ),
    (
        "cbor-duplicate-key",
        "cbor",
        bytes.fromhex("a2") + cbor2.dumps("v")[0:] + b"\x01" + cbor2.dumps("v") + b"\x01",
        ErrorCode.EPROTO,
        "Duplicate map key",
    ),
    (
        "cbor-tag-datetime",
        "cbor",
        cbor2.dumps(with_(meta={"t": cbor2.CBORTag(1, 1700000000)})),
        ErrorCode.EPROTO,
        "tags are not allowed",
    ),
    (
        "cbor-tag-unknown",
        "cbor",
        cbor2.dumps(with_(meta={"t": cbor2.CBORTag(9999, "x")})),
        ErrorCode.EPROTO,
        "tags are not allowed",
    ),
    ("cbor-shared-ref", "cbor", bytes.fromhex("d81c81d81d00"), ErrorCode.EPROTO, "tags are not allowed"),
    (
        "cbor-bytes-content",
        "cbor",
        cbor_payload_content({"blob": [b"\x00"]}),
        ErrorCode.EPROTO,
        "bytes value is not allowed (JSON data model only) - at `$.payload.content.blob[0]`",
    ),
    ("cbor-bytes-typed", "cbor", cbor_with(session_id=b"sess"), ErrorCode.EPROTO, "got `bytes` - at `$.session_id`"),
    (
        "cbor-nan",
        "cbor",
        cbor_with(meta={"x": [1.0, float("nan")]}),
        ErrorCode.EPROTO,
        "non-finite float nan - at `$.meta.x[1]`",
    ),
    (
        "cbor-inf-usd",
        "cbor",
        cbor_with(payload={"type": "task", "cost_est": {"usd": float("inf")}}),
        ErrorCode.EPROTO,
        "non-finite float inf - at `$.payload.cost_est.usd`",
    ),
    ("cbor-int-key", "cbor", cbor_payload_content({"a": {1: "x"}}), ErrorCode.EPROTO, "malformed cbor"),
    (
        "cbor-bytes-key",
        "cbor",
        cbor_payload_content({b"k": 1}),
        ErrorCode.EPROTO,
        "map key b'k' is not a text string - at `$.payload.content`",
    ),
    ("cbor-undefined", "cbor", cbor_payload_content(cbor2.undefined), ErrorCode.EPROTO, "at `$.payload.content`"),
    ("cbor-simple-value", "cbor", cbor_with(meta={"s": cbor2.CBORSimpleValue(99)}), ErrorCode.EPROTO, "at `$.meta.s`"),
    ("cbor-huge-bignum", "cbor", cbor_with(meta={"n": 1 << (8 * 1785)}), ErrorCode.EPROTO, "bignum of 1786 bytes"),
    (
        "cbor-invalid-utf8",
        "cbor",
        GOOD_CBOR.replace(b"sess_7c1f", b"sess_\xff\xfe\xfd\xfc"),
        ErrorCode.EPROTO,
        "malformed cbor",
    ),
]


@pytest.mark.parametrize(("name", "encoding", "data", "code", "reason"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_rejections(name: str, encoding: str, data: bytes | str, code: ErrorCode, reason: str) -> None:
    with pytest.raises(LocalProtocolError) as e:
        FrameCodec(encoding, hmac_key=KEY, max_frame_bytes=1024 if name.startswith("oversize") else 1 << 20).decode(
            data
        )
    assert e.value.code is code
    assert reason in e.value.reason, e.value.reason


def test_deep_nesting_helpers_build_what_they_say() -> None:
    assert decode_frame(deep_json(50), "json").meta["x"] == nested(50)
    assert decode_frame(deep_cbor(50), "cbor").meta["x"] == nested(50)


def test_cbor_depth_limit_is_exact() -> None:
    # frame map + meta map + (MAX_CBOR_DEPTH - 2) arrays: exactly at the limit.
    ok = cbor_with(meta={"x": nested(MAX_CBOR_DEPTH - 2)})
    assert decode_frame(ok, "cbor").meta["x"] == nested(MAX_CBOR_DEPTH - 2)
    with pytest.raises(LocalProtocolError):
        decode_frame(cbor_with(meta={"x": nested(MAX_CBOR_DEPTH - 1)}), "cbor")


def test_cbor_accepts_what_json_accepts_for_numbers() -> None:
    """Bignums (tags 2/3) are integers, so they pass; the JSON twin decodes alike."""
    obj = with_(meta={"big": [1 << 70, -(1 << 70) - 1], "f16": 1.5})
    assert decode_frame(cbor2.dumps(obj, canonical=True), "cbor") == decode_frame(json.dumps(obj), "json")
    largest = (1 << (8 * codec_mod.MAX_BIGNUM_BYTES)) - 1  # 4299 decimal digits
    frame = decode_frame(cbor_with(meta={"n": -largest - 1}), "cbor")
    assert decode_frame(FrameCodec("json").encode(frame), "json").meta["n"] == -largest - 1


def test_unknown_encoding_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown encoding"):
        FrameCodec("msgpack")  # type: ignore[arg-type]


# --- control payloads (spec §4.3) through the Control tagged union ---

CONTROLS: list[Any] = [
    Capabilities(
        agent="ruff",
        skills=["lint", "py"],
        max_ctx=8192,
        tools=["ruff"],
        safety_domains=["no_secrets"],
        encodings=["json", "cbor"],
    ),
    Capabilities(),
    WindowUpdate(window=Window(max_parallel=2, max_tokens=40_000, max_usd_micros=250_000), ack=12),
    WindowUpdate(window=Window(max_parallel=0, max_tokens=0, max_usd_micros=0)),
    BudgetUpdate(budget=Budget(usd=0.25, tokens=50_000)),
    BudgetUpdate(budget=Budget()),
    RouteUpdate(
        version=7,
        routes=[RouteEntry(task_type="code_review", next_hops=["ruff", "bandit"], weights=[0.5, 0.5])],
        withdrawn=["repo_summary"],
    ),
    ErrorPayload(code=ErrorCode.ESEQ_RETRY, reason="missing fragment", retry_after_ms=250, msg_seq=4, frag_seq=1),
    ErrorPayload(code=ErrorCode.EPROTO, reason="bad frame"),
]


@pytest.mark.parametrize("encoding", ["json", "cbor"])
@pytest.mark.parametrize("ctrl", CONTROLS, ids=lambda c: type(c).__name__)
def test_control_payload_round_trip(encoding: str, ctrl: Any) -> None:
    frame = Frame(
        v=1,
        session_id="s",
        stream_id="t",
        msg_seq=3,
        flags=[Flag.CTRL],
        payload=Payload(type=PayloadType.CONTROL, content=msgspec.to_builtins(ctrl)),
    )
    codec = FrameCodec(encoding, hmac_key=KEY)
    got = codec.decode(codec.encode(frame))
    assert got.payload.content["kind"] == type(ctrl).__struct_config__.tag
    assert msgspec.convert(got.payload.content, Control, strict=True) == ctrl
    assert msgspec.json.decode(msgspec.json.encode(ctrl), type=Control) == ctrl


def test_control_union_rejects_unknown_kind_and_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'REBOOT' - at `\\$.kind`"):
        msgspec.convert({"kind": "REBOOT"}, Control)
    with pytest.raises(msgspec.ValidationError, match="unknown field `colour`"):
        msgspec.convert({"kind": "ERROR", "code": "EPROTO", "reason": "x", "colour": 1}, Control)


def test_cost_estimate_floats_in_payload_round_trip() -> None:
    frame = Frame(
        v=1,
        session_id="s",
        stream_id="t",
        msg_seq=0,
        payload=Payload(
            type=PayloadType.PARTIAL, content="x", confidence=1.0, cost_est=CostEstimate(in_tokens=1, usd=1e-7)
        ),
    )
    for encoding in ("json", "cbor"):
        codec = FrameCodec(encoding, hmac_key=KEY)
        assert codec.decode(codec.encode(frame)) == seal(frame, KEY)


# --- key ids and rotation (§11): "<kid>:<base64>", several keys verify, one signs ---

K1 = b"k1-key-0123456789abcdef"
K2 = b"k2-key-fedcba9876543210"


def std_sig(key: bytes, raw: bytes) -> str:
    return base64.b64encode(hmac.new(key, raw, hashlib.sha256).digest()).decode()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_keyring_sig_is_kid_and_stdlib_hmac(case: dict) -> None:
    """A ring writes ``<signing kid>:`` + the same HMAC the vectors pin, in both encodings."""
    frame = msgspec.convert(case["frame"], Frame, strict=True)
    ring = KeyRing({"k1": KEY, "k2": K2})
    sealed = seal(frame, keyring=ring)
    assert sealed.sig == "k1:" + case["sig"] == "k1:" + std_sig(KEY, case["canonical"].encode())
    for enc in ("json", "cbor"):
        codec = FrameCodec(enc, keyring=ring)
        assert codec.decode(codec.encode(frame)) == sealed
    # The vector's kid-less wire bytes verify against the signing key (frames before key ids).
    assert FrameCodec("json", keyring=ring).decode(case["wire_json"]) == sealed_of(case)


def test_rotation_old_kid_verifies_new_kid_signs() -> None:
    frame = msgspec.convert(CASES[2]["frame"], Frame, strict=True)
    before = FrameCodec("json", keyring=KeyRing({"k1": K1}))
    during = FrameCodec("json", keyring=KeyRing({"k2": K2, "k1": K1}))
    after = FrameCodec("json", keyring=KeyRing({"k2": K2}))
    old_data = before.encode(frame)
    assert json.loads(old_data)["sig"].startswith("k1:")
    assert during.decode(old_data).sig.startswith("k1:")  # the old kid still verifies
    new_data = during.encode(frame)
    assert json.loads(new_data)["sig"] == "k2:" + std_sig(K2, canonical_bytes(seal(frame)))
    assert after.decode(new_data) == during.decode(new_data)
    with pytest.raises(LocalProtocolError) as e:
        after.decode(old_data)  # k1 retired
    assert (e.value.code, e.value.reason) == (ErrorCode.ESEC, "unknown key id 'k1' at `$.sig`")


def test_sig_without_kid_checks_the_signing_key_only() -> None:
    frame = msgspec.convert(CASES[1]["frame"], Frame, strict=True)
    ring = KeyRing({"k2": K2, "k1": K1})
    bare_k2 = seal(frame, K2)  # a single-key ring: sig without kid
    bare_k1 = seal(frame, K1)
    assert ":" not in bare_k2.sig
    verify(bare_k2, keyring=ring)
    with pytest.raises(LocalProtocolError, match="bad sig at"):
        verify(bare_k1, keyring=ring)  # k1 verifies only when named
    verify(msgspec.structs.replace(bare_k1, sig="k1:" + bare_k1.sig), keyring=ring)
    assert KeyRing({"k2": K2, "k1": K1}, signing_kid="k1").sign(b"x") == "k1:" + std_sig(K1, b"x")


def test_single_key_ring_is_kid_k0_written_without_kid() -> None:
    """``hmac_key=`` keeps today's frames: kid-less sigs out, both spellings in."""
    frame = msgspec.convert(CASES[2]["frame"], Frame, strict=True)
    codec = FrameCodec("json", hmac_key=KEY)
    assert codec.keyring.kids == (LEGACY_KID,) and codec.hmac_key == KEY
    sealed = codec.decode(codec.encode(frame))
    assert sealed.sig == CASES[2]["sig"]
    with_kid = msgspec.structs.replace(sealed, sig="k0:" + sealed.sig)
    assert codec.decode(FrameCodec("json").encode(with_kid, seal_frame=False)) == with_kid
    with pytest.raises(ValueError, match="not both"):
        FrameCodec("json", hmac_key=KEY, keyring=KeyRing({"k1": K1}))
    with pytest.raises(ValueError, match="not both"):
        seal(frame, KEY, keyring=KeyRing({"k1": K1}))


def test_keyring_can_be_swapped_on_a_codec() -> None:
    frame = msgspec.convert(CASES[0]["frame"], Frame, strict=True)
    codec = FrameCodec("cbor", keyring=KeyRing({"k1": K1}))
    data = codec.encode(frame)
    codec.keyring = KeyRing({"k2": K2})
    with pytest.raises(LocalProtocolError, match="unknown key id 'k1'"):
        codec.decode(data)
    codec.keyring = KeyRing({"k2": K2, "k1": K1})
    assert codec.decode(data).sig.startswith("k1:")


def b64(key: bytes, urlsafe: bool = False) -> str:
    return (base64.urlsafe_b64encode(key).decode().rstrip("=") if urlsafe else base64.b64encode(key).decode())


def test_keyring_from_env() -> None:
    assert KeyRing.from_env(None) is None
    assert KeyRing.from_env("  ", "") is None
    ring = KeyRing.from_env(f"k2:{b64(K2)}, k1:{b64(K1, urlsafe=True)}")
    assert (ring.kids, ring.signing_kid, ring.signing_key) == (("k2", "k1"), "k2", K2)
    assert ring.sign(b"m") == "k2:" + std_sig(K2, b"m")
    legacy = KeyRing.from_env(None, "raw legacy key")
    assert (legacy.kids, legacy.sign(b"m")) == (("k0",), std_sig(b"raw legacy key", b"m"))
    both = KeyRing.from_env(f"k2:{b64(K2)}", "raw legacy key")
    assert (both.kids, both.signing_kid) == (("k2", "k0"), "k2")
    both.check("k0:" + std_sig(b"raw legacy key", b"m"), b"m")


@pytest.mark.parametrize(
    ("keys", "legacy", "reason"),
    [
        ("k1", None, "entry 0: expected kid:base64key"),
        (f"k1:{b64(K1)},bad kid:{b64(K2)}", None, "entry 1: expected kid:base64key"),
        (f"k1:{b64(K1)},k1:{b64(K2)}", None, "key id 'k1' given twice"),
        ("k1:not*base64", None, "key 'k1' is not base64"),
        (f"k1:{b64(b'short')}", None, "key 'k1' has 5 bytes; at least 16 needed"),
        (f"k0:{b64(K1)}", "legacy", "names key id 'k0', which ATP_HMAC_KEY also is"),
    ],
)
def test_keyring_from_env_refusals_name_the_entry_never_the_key(keys: str, legacy: str | None, reason: str) -> None:
    with pytest.raises(ValueError) as e:
        KeyRing.from_env(keys, legacy)
    assert reason in str(e.value)
    for secret in (b64(K1), b64(K2), "not*base64"):
        assert secret not in str(e.value)


def test_keyring_refuses_bad_construction_and_hides_keys() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        KeyRing({})
    with pytest.raises(ValueError, match="key id 'a:b'"):
        KeyRing({"a:b": K1})
    with pytest.raises(ValueError, match="empty key"):
        KeyRing({"k1": b""})
    with pytest.raises(ValueError, match="signing key id 'k3' is not in the ring"):
        KeyRing({"k1": K1}, signing_kid="k3")
    assert "k1-key" not in repr(KeyRing({"k1": K1})) and "k1" in repr(KeyRing({"k1": K1}))
