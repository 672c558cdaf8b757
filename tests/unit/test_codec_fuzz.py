"""Property tests of the frame codec (spec §4, §10, §11) with Hypothesis.

* Hostile input (random bytes, mutated valid frames, arbitrary chunking through
  :class:`StreamDecoder`) never raises anything but ``LocalProtocolError``.
* ``decode(encode(f))`` is the identity (up to sealing) for every valid ``Frame``,
  in both encodings and across them.
* A sealed frame with any single byte changed either fails verification or decodes
  to the very same frame (e.g. ``1e16`` → ``1E16``): the signature covers meaning.

Frames are drawn by :func:`strategy_for`, which reads the msgspec Struct types
(constraints included), so a field added to ``Frame`` is fuzzed without touching
this file. ``bench/fuzz_codec.py`` runs the same properties for longer.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from atp_router.wire.codec import (
    FrameCodec,
    StreamDecoder,
    canonical_bytes,
    seal,
    verify,
)
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Frame

KEY = b"fuzz-hmac-key"
ENCODINGS = ("json", "cbor")

settings.register_profile("codec", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODEC = settings.get_profile("codec")

# --- strategies from the Struct types ---

_INT_LIMIT = 1 << 80  # beyond 64 bits on purpose: CBOR carries these as bignums

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-_INT_LIMIT, _INT_LIMIT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _bounds(t: Any, lo: float | None, hi: float | None) -> tuple[Any, Any]:
    if t.ge is not None:
        lo = t.ge
    if t.gt is not None:
        lo = t.gt + (1 if isinstance(t.gt, int) else 0)
    if t.le is not None:
        hi = t.le
    if t.lt is not None:
        hi = t.lt - (1 if isinstance(t.lt, int) else 0)
    return lo, hi


def strategy_for(t: mi.Type) -> st.SearchStrategy[Any]:
    """A strategy for valid values of a msgspec type (as ``msgspec.inspect`` sees it)."""
    match t:
        case mi.AnyType():
            return json_values
        case mi.NoneType():
            return st.none()
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            lo, hi = _bounds(t, -_INT_LIMIT, _INT_LIMIT)
            return st.integers(lo, hi)
        case mi.FloatType():
            lo, hi = _bounds(t, None, None)
            return st.floats(
                lo,
                hi,
                allow_nan=False,
                allow_infinity=False,
                exclude_min=t.gt is not None,
                exclude_max=t.lt is not None,
            )
        case mi.StrType():
            return st.text(min_size=t.min_length or 0, max_size=t.max_length if t.max_length is not None else 40)
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.EnumType():
            return st.sampled_from(list(t.cls))
        case mi.ListType():
            return st.lists(strategy_for(t.item_type), max_size=4)
        case mi.DictType():
            return st.dictionaries(strategy_for(t.key_type), strategy_for(t.value_type), max_size=4)
        case mi.UnionType():
            return st.one_of([strategy_for(u) for u in t.types])
        case mi.StructType():
            required = {f.name: strategy_for(f.type) for f in t.fields if f.required}
            optional = {f.name: strategy_for(f.type) for f in t.fields if not f.required}
            return st.fixed_dictionaries(required, optional=optional).map(lambda kw: t.cls(**kw))
    raise TypeError(f"no strategy for {t!r}")


#: Unsealed frames (sig and checksums cleared): the encode∘decode domain.
frames = strategy_for(mi.type_info(Frame)).map(
    lambda f: msgspec.structs.replace(
        f,
        sig=None,
        checksum=None,
        payload=None if f.payload is None else msgspec.structs.replace(f.payload, checksum=None),
    )
)
#: Frames with whatever sig/checksum strings Hypothesis picks (they rarely verify).
any_frames = strategy_for(mi.type_info(Frame))


def _codec(encoding: str, **kw: Any) -> FrameCodec:
    return FrameCodec(encoding, **kw)  # type: ignore[arg-type]


def decode_or_protocol_error(codec: FrameCodec, data: bytes | str) -> Frame | None:
    """Decode; a LocalProtocolError is the only acceptable failure."""
    try:
        return codec.decode(data)
    except LocalProtocolError as e:
        assert e.code in (ErrorCode.EPROTO, ErrorCode.ESEC)
        assert e.reason
        return None


def drain(sd: StreamDecoder) -> list[Frame | None]:
    """Every outcome of ``next_frame`` until it wants more bytes or the stream broke."""
    out: list[Frame | None] = []
    while True:
        try:
            f = sd.next_frame()
        except LocalProtocolError as e:
            out.append(None)
            if e.reason.startswith("announced frame length"):  # the byte stream is unusable now
                with pytest.raises(LocalProtocolError, match="announced frame length"):
                    sd.next_frame()
                return out
            continue
        if f is None:
            return out
        out.append(f)


# --- properties ---


def check_random_bytes(data: bytes) -> None:
    for enc in ENCODINGS:
        for key in (None, KEY):
            decode_or_protocol_error(_codec(enc, hmac_key=key), data)
            decode_or_protocol_error(_codec(enc, hmac_key=key, require_checksum=False), data)
    decode_or_protocol_error(_codec("json"), data.decode("utf-8", "replace"))


@CODEC
@given(st.binary(max_size=512))
@example(b"\xa1av\x01")
@example(b"\x9f" * 300 + b"\xff" * 300)
@example(b"[" * 5000)
def test_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    check_random_bytes(data)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, byte in ops:
        if not buf and op != "insert":
            continue
        i = pos % (len(buf) + (op == "insert"))
        if op == "flip":
            buf[i] ^= 1 << (byte % 8)
        elif op == "set":
            buf[i] = byte
        elif op == "insert":
            buf[i:i] = bytes([byte])
        else:
            del buf[i]
    return bytes(buf)


def check_mutated_frame(frame: Frame, ops: list[tuple[str, int, int]], truncate: int) -> None:
    for enc in ENCODINGS:
        codec = _codec(enc, hmac_key=KEY)
        data = mutate(codec.encode(frame), ops)
        decode_or_protocol_error(codec, data)
        decode_or_protocol_error(codec, data[: truncate % (len(data) + 1)])
        decode_or_protocol_error(_codec(enc, require_checksum=False), data)


@CODEC
@given(frames, mutations, st.integers(0, 1 << 16))
def test_mutated_frames_only_raise_protocol_errors(frame: Frame, ops: list, truncate: int) -> None:
    check_mutated_frame(frame, ops, truncate)


def check_stream_chunks(frames_: list[Frame], garbage: list[bytes], cuts: list[int]) -> None:
    for enc in ENCODINGS:
        codec = _codec(enc, hmac_key=KEY)
        pieces = [StreamDecoder.frame_bytes(codec.encode(f)) for f in frames_]
        for i, g in enumerate(garbage):
            pieces.insert(i * 2 % (len(pieces) + 1), g)
        stream = b"".join(pieces)
        sd = StreamDecoder(codec)
        got: list[Frame | None] = []
        start = 0
        for cut in sorted(c % (len(stream) + 1) for c in cuts) + [len(stream)]:
            sd.receive_data(stream[start:cut])
            start = cut
            got.extend(drain(sd))
        if not garbage:
            assert got == [seal(f, KEY) for f in frames_]
            assert sd.buffered == 0


@CODEC
@given(
    st.lists(frames, max_size=3),
    st.lists(st.binary(max_size=24), max_size=2),
    st.lists(st.integers(0, 1 << 16), max_size=6),
)
def test_stream_decoder_chunking_and_garbage(frames_: list[Frame], garbage: list[bytes], cuts: list[int]) -> None:
    check_stream_chunks(frames_, garbage, cuts)


def check_round_trip(frame: Frame) -> None:
    sealed = seal(frame, KEY)
    for enc in ENCODINGS:
        signed = _codec(enc, hmac_key=KEY)
        assert signed.decode(signed.encode(frame)) == sealed
        raw = _codec(enc, require_checksum=False)
        assert raw.decode(raw.encode(frame, seal_frame=False)) == frame
    # Across encodings without resealing: integrity holds (canonical bytes are JSON).
    via_cbor = _codec("cbor", hmac_key=KEY).decode(_codec("cbor").encode(sealed, seal_frame=False))
    via_json = _codec("json", hmac_key=KEY).decode(_codec("json").encode(via_cbor, seal_frame=False))
    assert via_json == sealed
    assert canonical_bytes(via_json) == canonical_bytes(sealed)


@CODEC
@given(frames)
def test_encode_decode_identity(frame: Frame) -> None:
    check_round_trip(frame)


def check_single_byte_mutation(frame: Frame, pos: int, delta: int) -> None:
    for enc in ENCODINGS:
        codec = _codec(enc, hmac_key=KEY)
        data = bytearray(codec.encode(frame))
        i = pos % len(data)
        data[i] = (data[i] + delta) % 256
        got = decode_or_protocol_error(codec, bytes(data))
        # Either detected, or the change carried no meaning (same frame, same sig).
        assert got is None or got == seal(frame, KEY)


@CODEC
@given(frames, st.integers(0, 1 << 16), st.integers(1, 255))
def test_sig_detects_every_single_byte_mutation(frame: Frame, pos: int, delta: int) -> None:
    check_single_byte_mutation(frame, pos, delta)


def check_verify_arbitrary(frame: Frame) -> None:
    for key in (None, KEY):
        for require in (True, False):
            try:
                verify(frame, hmac_key=key, require_checksum=require)
            except LocalProtocolError as e:
                assert e.code in (ErrorCode.EPROTO, ErrorCode.ESEC)


@CODEC
@given(any_frames)
def test_verify_arbitrary_sig_and_checksum_strings(frame: Frame) -> None:
    check_verify_arbitrary(frame)


def test_strategy_reaches_every_field() -> None:
    """The Struct-driven strategy does produce each optional field and each enum."""
    seen: set[str] = set()
    flags: set[enum.Enum] = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(frames)
    def collect(frame: Frame) -> None:
        seen.update(msgspec.to_builtins(frame))
        flags.update(frame.flags)

    collect()
    assert seen >= {"frag_seq", "flags", "qos", "ttl", "window", "meta", "payload"}
    assert len(flags) >= 5
