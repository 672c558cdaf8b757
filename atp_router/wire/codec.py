"""Frame codecs (sans-IO): JSON and CBOR, checksums and HMAC signatures (spec §4).

* **Canonical encoding.** A frame's integrity bytes are its JSON encoding with
  keys sorted, ``sig`` and ``checksum`` removed (both omitted when ``None``).
  They are the same whatever the wire encoding, so a frame re-encoded from JSON to
  CBOR keeps its checksum and signature. ``proto/cbor.md`` states the exact rules.
* **Whole-frame checksum** ``"sha256:<hex>"`` of the canonical bytes (§4.2, §4.5).
* **Payload checksum** ``"sha256:<hex>"`` of the canonical encoding of the payload
  without its own ``checksum``: lets a receiver verify the payload before anything
  else (§4.5).
* **Signature** ``sig = "<kid>:" + base64(HMAC-SHA256(key, canonical bytes))`` (§11),
  keyed by a :class:`KeyRing`: several keys verify (rotation), one signs. A ``sig``
  without ``<kid>:`` is verified against the signing key, and a ring made from one
  raw key (``hmac_key=``, ``ATP_HMAC_KEY``) writes its sigs without a kid — exactly
  the frames of routers before key ids. Replay protection (``meta.nonce``,
  ``meta.ts``) sits above the codec: :class:`atp_router.security.signing.ReplayGuard`.

:class:`FrameCodec` works on whole messages (one WebSocket message = one frame).
:class:`StreamDecoder` adds length-prefixed framing for byte streams (TCP, stdio,
fuzzing): ``receive_data(bytes)`` then ``next_frame()`` until it returns ``None``.

Every rejection raises :class:`~atp_router.wire.errors.LocalProtocolError` with code ``EPROTO``
(``ESEC`` for a missing or bad signature) and a reason naming what was wrong, with the
field path where there is one (``$.msg_seq``); the codec holds no per-stream state, so
a bad frame cannot disturb any other stream.

How the checks stay cheap: the payload is encoded once (sorted keys). Its
``checksum`` is the first key in sorted order, so the bytes without it are a slice of
that encoding; the same bytes are spliced into the frame's canonical encoding as
:class:`msgspec.Raw`, so no byte of the payload is encoded twice. HMAC-SHA256 keeps
each key's inner and outer pad states and copies them per frame (RFC 2104); the key
id picks the state, so a ring of many keys costs one HMAC per frame.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

import cbor2
import msgspec

from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Frame, Payload

Encoding = Literal["json", "cbor"]
ENCODINGS: tuple[Encoding, ...] = ("json", "cbor")

#: Largest encoded frame accepted (bytes). Larger messages must be fragmented (§4.5).
DEFAULT_MAX_FRAME_BYTES = 1 << 20

#: Deepest container nesting accepted in a CBOR frame (the frame object is level 1).
#: JSON frames are bounded by the decoder's recursion limit (about 1000 levels), so
#: every CBOR frame accepted here can be re-encoded as JSON and accepted there too.
MAX_CBOR_DEPTH = 200

_json_encoder = msgspec.json.Encoder(order="sorted")
_json_wire_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Frame)
_SHA_PREFIX = "sha256:"
_sha256 = hashlib.sha256
_Raw = msgspec.Raw
_replace = msgspec.structs.replace

# _strip_checksum and _seal rely on "checksum" sorting first among the payload's
# fields (a required field, ``type``, always follows it).
if min(Payload.__struct_fields__) != "checksum":
    raise RuntimeError("atp_router.wire.codec assumes `checksum` is the first field of Payload in sorted order")
_CHECKSUM_KEY_LEN = len(b'{"checksum":')


def _strip_checksum(encoded: bytes, checksum: str | None) -> bytes:
    """``encoded`` (sorted keys) without its leading ``"checksum":...,`` member."""
    if checksum is None:
        return encoded
    return b"{" + encoded[_CHECKSUM_KEY_LEN + len(_json_encoder.encode(checksum)) + 1 :]


def canonical_bytes(frame: Frame) -> bytes:
    """The bytes that ``checksum`` and ``sig`` cover: sorted-key compact JSON of the
    frame with ``sig`` and ``checksum`` absent (fields at their default omitted)."""
    return _json_encoder.encode(_replace(frame, sig=None, checksum=None))


def payload_checksum(payload: Payload) -> str:
    """``sha256:<hex>`` of the payload's canonical encoding without its own checksum."""
    return _SHA_PREFIX + _sha256(_strip_checksum(_json_encoder.encode(payload), payload.checksum)).hexdigest()


_PAD_36 = bytes(b ^ 0x36 for b in range(256))
_PAD_5C = bytes(b ^ 0x5C for b in range(256))


class _HmacSha256:
    """HMAC-SHA256 (RFC 2104) with the padded-key states computed once per key:
    ``hmac.digest`` re-derives them (and fetches the algorithm) on every call."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes):
        key = bytes(key)
        if len(key) > 64:
            key = _sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = _sha256(key.translate(_PAD_36))
        self._outer = _sha256(key.translate(_PAD_5C))

    def sig(self, raw: bytes) -> str:
        """``base64(HMAC-SHA256(key, raw))``, the ``sig`` field's value."""
        inner = self._inner.copy()
        inner.update(raw)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return binascii.b2a_base64(outer.digest(), newline=False).decode("ascii")


#: A key id: letters, digits and ``._-``, at most 32 (no ``:``, which ends it in ``sig``).
KID_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
#: The key id of a ring made from one raw key (``hmac_key=``, ``ATP_HMAC_KEY``).
LEGACY_KID = "k0"
#: Shortest key accepted from ``ATP_HMAC_KEYS`` (bytes): 128 bits.
MIN_KEY_BYTES = 16


class KeyRing:
    """HMAC-SHA256 keys by key id, one of them signing (spec §11 frame signatures).

    ``keys`` maps kid → key bytes; ``signing_kid`` (default: the first kid) signs,
    every key verifies. ``sign(raw)`` gives the ``sig`` value ``"<kid>:<base64>"``
    (``"<base64>"`` alone when ``kid_in_sig`` is false, the single-key rings of
    :meth:`single`); ``check(sig, raw)`` verifies one in constant time, a ``sig``
    without a kid against the signing key. Immutable; its ``repr`` names kids only.

    Raises ``ValueError`` for no keys, a bad kid, an empty key or an unknown
    ``signing_kid``.
    """

    __slots__ = ("_keys", "_macs", "_prefix", "_signer", "signing_kid")

    def __init__(self, keys: Mapping[str, bytes], signing_kid: str | None = None, *, kid_in_sig: bool = True):
        if not keys:
            raise ValueError("a key ring needs at least one key")
        for kid, key in keys.items():
            if not isinstance(kid, str) or not KID_RE.match(kid):
                raise ValueError(f"key id {kid!r:.40}: expected 1-32 of letters, digits and ._-")
            if not key:
                raise ValueError(f"key {kid!r}: empty key")
        if signing_kid is None:
            signing_kid = next(iter(keys))
        if signing_kid not in keys:
            raise ValueError(f"signing key id {signing_kid!r} is not in the ring ({', '.join(keys)})")
        self._keys = {kid: bytes(key) for kid, key in keys.items()}
        self._macs = {kid: _HmacSha256(key) for kid, key in self._keys.items()}
        self.signing_kid = signing_kid
        self._signer = self._macs[signing_kid]
        self._prefix = signing_kid + ":" if kid_in_sig else ""

    @classmethod
    def single(cls, key: bytes) -> KeyRing:
        """The ring of one raw key, kid :data:`LEGACY_KID`, signing without a kid in
        ``sig`` (frames as before key ids); ``"k0:<base64>"`` sigs verify too."""
        return cls({LEGACY_KID: key}, kid_in_sig=False)

    @classmethod
    def from_env(cls, keys: str | None, legacy_key: str | None = None) -> KeyRing | None:
        """The ring of ``ATP_HMAC_KEYS`` (``keys``: ``"kid1:base64key,kid2:base64key"``,
        standard or URL-safe base64, each key at least :data:`MIN_KEY_BYTES` bytes;
        the first signs, all verify) and/or ``ATP_HMAC_KEY`` (``legacy_key``: a raw
        UTF-8 key, kid :data:`LEGACY_KID`). Only the legacy key: :meth:`single`. Both:
        the legacy key verifies as ``k0`` beside the others. Neither (unset or
        blank): None. Raises ``ValueError`` naming the entry (never a key).
        """
        legacy = legacy_key.encode() if legacy_key else None
        if keys is None or not keys.strip():
            return None if legacy is None else cls.single(legacy)
        ring: dict[str, bytes] = {}
        for i, entry in enumerate(e.strip() for e in keys.split(",")):
            if not entry:
                continue
            kid, sep, b64 = entry.partition(":")
            if not sep or not KID_RE.match(kid):
                raise ValueError(f"ATP_HMAC_KEYS entry {i}: expected kid:base64key with a kid of 1-32 letters, "
                                 "digits and ._-")
            if kid in ring:
                raise ValueError(f"ATP_HMAC_KEYS: key id {kid!r} given twice")
            try:
                key = base64.b64decode(b64.replace("-", "+").replace("_", "/") + "=" * (-len(b64) % 4),
                                       validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"ATP_HMAC_KEYS: key {kid!r} is not base64") from None
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"ATP_HMAC_KEYS: key {kid!r} has {len(key)} bytes; at least {MIN_KEY_BYTES} needed")
            ring[kid] = key
        if not ring:
            return None if legacy is None else cls.single(legacy)
        if legacy is not None:
            if LEGACY_KID in ring:
                raise ValueError(f"ATP_HMAC_KEYS names key id {LEGACY_KID!r}, which ATP_HMAC_KEY also is")
            ring[LEGACY_KID] = legacy
        return cls(ring)

    @property
    def kids(self) -> tuple[str, ...]:
        """Every key id, the signing one included."""
        return tuple(self._keys)

    @property
    def signing_key(self) -> bytes:
        return self._keys[self.signing_kid]

    def sign(self, raw: bytes) -> str:
        """The ``sig`` value of canonical bytes ``raw`` under the signing key."""
        return self._prefix + self._signer.sig(raw)

    def check(self, sig: str | None, raw: bytes) -> None:
        """Verify ``sig`` over canonical bytes ``raw`` in constant time (spec §11).

        Raises ``LocalProtocolError(ESEC)``: missing sig, unknown key id (named when
        it is a valid kid), or a mismatch."""
        if sig is None:
            raise LocalProtocolError(
                ErrorCode.ESEC, "missing sig at `$.sig`: this connection requires HMAC-SHA256 signatures"
            )
        kid, sep, mac_b64 = sig.partition(":")
        if sep:
            mac = self._macs.get(kid)
            if mac is None:
                if KID_RE.match(kid):
                    raise LocalProtocolError(ErrorCode.ESEC, f"unknown key id {kid!r} at `$.sig`")
                raise LocalProtocolError(ErrorCode.ESEC, "malformed key id at `$.sig`: expected '<kid>:<base64>'")
        else:
            mac, mac_b64 = self._signer, sig
        # Constant-time compare; compare_digest refuses non-ASCII str, which cannot match anyway.
        if not (mac_b64.isascii() and hmac.compare_digest(mac_b64, mac.sig(raw))):
            raise LocalProtocolError(ErrorCode.ESEC, "bad sig at `$.sig`: HMAC-SHA256 does not match")

    def __repr__(self) -> str:
        return f"KeyRing(kids={self.kids!r}, signing_kid={self.signing_kid!r})"


def _ring(hmac_key: bytes | None, keyring: KeyRing | None) -> KeyRing | None:
    if hmac_key is not None:
        if keyring is not None:
            raise ValueError("give hmac_key or keyring, not both")
        return KeyRing.single(hmac_key)
    return keyring


def _seal(frame: Frame, ring: KeyRing | None) -> tuple[Frame, bytes | None]:
    """Sealed copy of ``frame`` and its payload's sorted encoding (with checksum)."""
    p = frame.payload
    praw = None
    if p is not None:
        canon = _strip_checksum(_json_encoder.encode(p), p.checksum)
        pcs = _SHA_PREFIX + _sha256(canon).hexdigest()
        praw = b'{"checksum":"' + pcs.encode("ascii") + b'",' + canon[1:]
        p = _replace(p, checksum=pcs)
    sealed = _replace(frame, payload=None if praw is None else _Raw(praw), sig=None, checksum=None)
    raw = _json_encoder.encode(sealed)
    sealed.payload = p
    sealed.checksum = _SHA_PREFIX + _sha256(raw).hexdigest()
    if ring is not None:
        sealed.sig = ring.sign(raw)
    return sealed, praw


def seal(frame: Frame, hmac_key: bytes | None = None, *, keyring: KeyRing | None = None) -> Frame:
    """Return a copy of ``frame`` with payload checksum, whole-frame checksum and
    (when a key is given) ``sig`` filled in (spec §4.5, §11). Call again after any
    mutation, e.g. a ttl decrement. ``hmac_key`` is a raw key (a
    :meth:`KeyRing.single` ring: ``sig`` without a kid); ``keyring`` signs with its
    signing kid.

    Raises ``msgspec.EncodeError``/``TypeError`` if ``content`` or ``meta`` holds a
    value JSON cannot carry (the frame is ours, so that is a programming error), and
    ``ValueError`` when both ``hmac_key`` and ``keyring`` are given.
    """
    return _seal(frame, _ring(hmac_key, keyring))[0]


def _verify(frame: Frame, ring: KeyRing | None, require_checksum: bool) -> None:
    cs = frame.checksum
    if cs is None and require_checksum:
        raise LocalProtocolError(ErrorCode.EPROTO, "missing frame checksum at `$.checksum`")
    p = frame.payload
    try:
        if p is None:
            praw = None
        else:
            pcs = p.checksum
            if pcs is None and cs is None and ring is None:
                return
            praw = _json_encoder.encode(p)
            if pcs is not None and pcs != _SHA_PREFIX + _sha256(_strip_checksum(praw, pcs)).hexdigest():
                raise LocalProtocolError(ErrorCode.EPROTO, "payload checksum mismatch at `$.payload.checksum`")
        if cs is None and ring is None:
            return
        raw = _json_encoder.encode(
            _replace(frame, payload=None if praw is None else _Raw(praw), sig=None, checksum=None)
        )
    except RecursionError:
        raise LocalProtocolError(ErrorCode.EPROTO, "frame nested too deeply to encode canonically") from None
    if cs is not None and cs != _SHA_PREFIX + _sha256(raw).hexdigest():
        if not cs.startswith(_SHA_PREFIX):
            raise LocalProtocolError(ErrorCode.EPROTO, "`$.checksum` must be 'sha256:<hex>'")
        raise LocalProtocolError(ErrorCode.EPROTO, "frame checksum mismatch at `$.checksum`")
    if ring is not None:
        ring.check(frame.sig, raw)


def verify(
    frame: Frame, *, hmac_key: bytes | None = None, keyring: KeyRing | None = None, require_checksum: bool = True
) -> None:
    """Check payload checksum, whole-frame checksum and signature (spec §4.5, §11).

    Raises ``LocalProtocolError(EPROTO)`` on a mismatch or a missing checksum (when
    ``require_checksum``), and ``LocalProtocolError(ESEC)`` on a missing or bad
    signature or an unknown key id when ``hmac_key`` (a one-key ring) or
    ``keyring`` is set.
    """
    _verify(frame, _ring(hmac_key, keyring), require_checksum)


class FrameCodec:
    """Encode and decode whole frames in one encoding, chosen per connection at the
    handshake (§4.1, §8 step 2).

    ``encode(frame) -> bytes`` seals the frame (checksums, sig) unless ``seal_frame=False``.
    ``decode(bytes) -> Frame`` validates the schema, then checksums and signature.
    Signatures: ``keyring`` (a :class:`KeyRing`: one kid signs, all verify) or
    ``hmac_key`` (one raw key, :meth:`KeyRing.single`); neither: unsigned.
    Raises :class:`LocalProtocolError` (``EPROTO``, or ``ESEC`` for signatures).
    """

    __slots__ = ("_ring", "encoding", "max_frame_bytes", "require_checksum")

    def __init__(
        self,
        encoding: Encoding = "json",
        *,
        hmac_key: bytes | None = None,
        keyring: KeyRing | None = None,
        require_checksum: bool = True,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}; expected one of {ENCODINGS}")
        self.encoding: Encoding = encoding
        self._ring = _ring(hmac_key, keyring)
        self.require_checksum = require_checksum
        self.max_frame_bytes = max_frame_bytes

    @property
    def keyring(self) -> KeyRing | None:
        """The keys; when set, every decoded frame must carry a valid ``sig``.
        Assigning a new ring rotates keys for the frames that follow."""
        return self._ring

    @keyring.setter
    def keyring(self, ring: KeyRing | None) -> None:
        self._ring = ring

    @property
    def hmac_key(self) -> bytes | None:
        """The signing key; assigning a raw key makes a :meth:`KeyRing.single` ring."""
        return None if self._ring is None else self._ring.signing_key

    @hmac_key.setter
    def hmac_key(self, key: bytes | None) -> None:
        self._ring = None if key is None else KeyRing.single(key)

    def encode(self, frame: Frame, *, seal_frame: bool = True) -> bytes:
        """Encode one frame for the wire, sealed (payload checksum, checksum, ``sig``
        under the signing key when the codec has keys) unless ``seal_frame=False``."""
        if self.encoding == "json":
            if not seal_frame:
                return _json_wire_encoder.encode(frame)
            sealed, praw = _seal(frame, self._ring)
            if praw is not None:
                # The payload's sorted encoding is already at hand: splice it in.
                sealed = _replace(sealed, payload=_Raw(praw))
            return _json_wire_encoder.encode(sealed)
        if seal_frame:
            frame = _seal(frame, self._ring)[0]
        return cbor2.dumps(msgspec.to_builtins(frame))

    def decode(self, data: bytes | bytearray | memoryview | str) -> Frame:
        """Decode, schema-validate and integrity-check one frame.

        ``data`` is one whole message (``str`` only for JSON text messages). Raises
        ``LocalProtocolError``: ``EPROTO`` for size, syntax, schema, version and
        checksum problems, ``ESEC`` for a missing or bad ``sig`` or an unknown key id.
        """
        n = len(data)
        if type(data) is not bytes:
            if isinstance(data, str):
                if n * 4 > self.max_frame_bytes:  # at most 4 UTF-8 bytes a character
                    n = len(data.encode("utf-8", "surrogatepass"))
            elif isinstance(data, memoryview):
                n = data.nbytes
        if n > self.max_frame_bytes:
            raise LocalProtocolError(
                ErrorCode.EPROTO, f"frame of {n} bytes exceeds the limit of {self.max_frame_bytes}; fragment it"
            )
        frame = decode_frame(data, self.encoding)
        _verify(frame, self._ring, self.require_checksum)
        return frame


def _reject_tag(*_: object) -> Any:
    raise cbor2.CBORDecodeError("CBOR tags are not allowed in ATP frames (JSON data model only)")


#: Largest bignum (CBOR tags 2/3) accepted, in bytes: 256**1785 has 4299 decimal
#: digits, within the 4300 that Python (``sys.int_max_str_digits``) and msgspec
#: convert, so the integer still has a canonical JSON spelling.
MAX_BIGNUM_BYTES = 1785


def _bignum(value: object, negative: bool) -> int:
    if type(value) is not bytes:
        raise cbor2.CBORDecodeError("bignum content must be a byte string")
    if len(value) > MAX_BIGNUM_BYTES:
        raise cbor2.CBORDecodeError(f"bignum of {len(value)} bytes exceeds {MAX_BIGNUM_BYTES}")
    n = int.from_bytes(value, "big")
    return -1 - n if negative else n


# cbor2 decodes these tags itself (dates, decimals, shared references, sets, regexes,
# ...); overriding every one keeps frames inside the JSON data model. Bignums stay:
# they are integers, and how cbor2 writes integers beyond 64 bits.
_CBOR_BUILTIN_TAGS = (0, 1, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 55799, 43000)
_CBOR_SEMANTIC_DECODERS: dict[int, Any] = {tag: _reject_tag for tag in _CBOR_BUILTIN_TAGS}
_CBOR_SEMANTIC_DECODERS[2] = lambda value, _immutable: _bignum(value, False)
_CBOR_SEMANTIC_DECODERS[3] = lambda value, _immutable: _bignum(value, True)


_SCALARS = frozenset({str, int, bool, type(None)})


class _NotJson(Exception):
    def __init__(self, reason: str):
        self.reason = reason
        self.path: list[str] = []


def _check_json_model(obj: Any) -> None:
    """Raise :class:`_NotJson` unless ``obj`` uses only JSON's data model: maps with
    text keys, arrays, text, integers, finite floats, booleans and null."""
    t = type(obj)
    if t is dict:
        for k, v in obj.items():
            if type(k) is not str:
                raise _NotJson(f"map key {k!r} is not a text string")
            if type(v) not in _SCALARS:
                try:
                    _check_json_model(v)
                except _NotJson as e:
                    e.path.append(f".{k}")
                    raise
    elif t is list:
        for i, v in enumerate(obj):
            if type(v) not in _SCALARS:
                try:
                    _check_json_model(v)
                except _NotJson as e:
                    e.path.append(f"[{i}]")
                    raise
    elif t is float:
        if obj - obj != 0.0:  # NaN and ±inf: JSON has no spelling for them
            raise _NotJson(f"non-finite float {obj!r}")
    elif t not in _SCALARS:
        raise _NotJson(f"{t.__name__} value is not allowed (JSON data model only)")


def _check_untyped(frame: Frame) -> None:
    """CBOR can carry what JSON cannot (byte strings, undefined, simple values,
    non-text keys, NaN/±inf). The schema already types every field but these:
    ``meta`` values and ``payload.content`` are ``Any`` and ``cost_est.usd`` has no
    upper bound (tests/unit/test_codec.py checks this list against ``Frame``)."""
    try:
        for k, v in frame.meta.items():
            if type(v) not in _SCALARS:
                try:
                    _check_json_model(v)
                except _NotJson as e:
                    e.path.append(f".meta.{k}")
                    raise
        p = frame.payload
        if p is not None:
            if type(p.content) not in _SCALARS:
                try:
                    _check_json_model(p.content)
                except _NotJson as e:
                    e.path.append(".payload.content")
                    raise
            ce = p.cost_est
            if ce is not None and ce.usd - ce.usd != 0.0:
                bad = _NotJson(f"non-finite float {ce.usd!r}")
                bad.path.append(".payload.cost_est.usd")
                raise bad
    except _NotJson as e:
        path = "$" + "".join(reversed(e.path))
        raise LocalProtocolError(ErrorCode.EPROTO, f"invalid frame: {e.reason} - at `{path}`") from None


# A CBOR message must hold exactly one data item, but cbor2.loads stops after the
# first and ignores the rest. Decoding ``[message, SENTINEL]`` instead costs nothing
# extra: any trailing item becomes the second element, which then cannot equal a
# random byte string the peer never sees (a streaming CBORDecoder costs ~1.5 µs more).
_CBOR_SENTINEL = os.urandom(16)
_CBOR_SENTINEL_ITEM = b"\x50" + _CBOR_SENTINEL  # major type 2 (byte string), length 16


def _decode_cbor(data: bytes | bytearray | memoryview) -> Frame:
    wrapped = cbor2.loads(
        b"\x82" + data + _CBOR_SENTINEL_ITEM,  # array of two items
        tag_hook=_reject_tag,
        semantic_decoders=_CBOR_SEMANTIC_DECODERS,
        max_depth=MAX_CBOR_DEPTH,  # cbor2 counts from 0, so this admits the wrapper plus MAX_CBOR_DEPTH
        allow_duplicate_keys=False,
        strict_hashable_types=True,
    )
    if wrapped[1] != _CBOR_SENTINEL:
        raise LocalProtocolError(ErrorCode.EPROTO, "malformed cbor: trailing bytes after the frame")
    frame = msgspec.convert(wrapped[0], Frame, strict=True)
    _check_untyped(frame)
    return frame


def decode_frame(data: bytes | bytearray | memoryview | str, encoding: Encoding = "json") -> Frame:
    """Decode and schema-validate one frame without integrity checks.

    Raises ``LocalProtocolError(EPROTO)`` with the decoder's reason (which names the
    offending field path, e.g. ``Expected `int`, got `str` - at `$.msg_seq```).
    """
    try:
        if encoding == "json":
            return _json_decoder.decode(data)
        if isinstance(data, str):
            raise LocalProtocolError(ErrorCode.EPROTO, "CBOR connection received a text message")
        return _decode_cbor(data)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.endswith("at `$.v`"):
            raise LocalProtocolError(
                ErrorCode.EPROTO, f"unsupported protocol version: {msg} (this router speaks ATP v1)"
            ) from None
        raise LocalProtocolError(ErrorCode.EPROTO, f"invalid frame: {msg}") from None
    except msgspec.DecodeError as e:
        if "utf-8" in str(e).lower():  # one reason across msgspec versions (its wording changed in 0.23)
            raise LocalProtocolError(ErrorCode.EPROTO, f"malformed json: invalid UTF-8 ({e})") from None
        raise LocalProtocolError(ErrorCode.EPROTO, f"malformed json: {e}") from None
    except UnicodeDecodeError as e:
        raise LocalProtocolError(ErrorCode.EPROTO, f"malformed {encoding}: invalid UTF-8 ({e.reason})") from None
    except RecursionError:
        raise LocalProtocolError(ErrorCode.EPROTO, f"malformed {encoding}: nested too deeply") from None
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, MemoryError) as e:
        if "nesting depth" in str(e):
            raise LocalProtocolError(
                ErrorCode.EPROTO, f"malformed cbor: containers nested deeper than {MAX_CBOR_DEPTH}"
            ) from None
        raise LocalProtocolError(ErrorCode.EPROTO, f"malformed cbor: {e}") from None


class StreamDecoder:
    """Length-prefixed framing for byte streams: each frame is a 4-byte big-endian
    length followed by that many bytes of encoded frame.

    ``receive_data(data)`` buffers bytes; ``next_frame()`` returns the next
    :class:`Frame` or ``None`` when more bytes are needed. A bad frame raises
    ``LocalProtocolError`` and is consumed, so decoding continues with the next one.
    An announced length above ``max_frame_bytes`` is fatal for the byte stream
    (there is no way to resynchronise) and raises ``EPROTO`` on every call.
    """

    __slots__ = ("_broken", "_buf", "codec")

    def __init__(self, codec: FrameCodec):
        self.codec = codec
        self._buf = bytearray()
        self._broken: str | None = None

    @staticmethod
    def frame_bytes(encoded: bytes) -> bytes:
        """Prefix an encoded frame with its length for a byte stream."""
        return len(encoded).to_bytes(4, "big") + encoded

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes from the stream (ignored once the stream is broken)."""
        if self._broken is None:
            self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return len(self._buf)

    def next_frame(self) -> Frame | None:
        """The next whole frame, or ``None`` until more bytes arrive.

        Raises ``LocalProtocolError`` for a bad frame (consumed) or a broken stream.
        """
        if self._broken is not None:
            raise LocalProtocolError(ErrorCode.EPROTO, self._broken)
        buf = self._buf
        if len(buf) < 4:
            return None
        n = int.from_bytes(buf[:4], "big")
        if n > self.codec.max_frame_bytes:
            self._broken = f"announced frame length {n} exceeds the limit of {self.codec.max_frame_bytes}"
            buf.clear()
            raise LocalProtocolError(ErrorCode.EPROTO, self._broken)
        end = 4 + n
        if len(buf) < end:
            return None
        body = bytes(memoryview(buf)[4:end])  # one copy; the view is gone before the resize below
        del buf[:end]
        return self.codec.decode(body)
