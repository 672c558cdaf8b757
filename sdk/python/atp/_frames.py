"""ATP frames on the client side (spec §4.2, §4.5, §11), without the router's code.

Frames are plain dicts here, in the wire shape of ``atp_router.wire.frame.Frame``.
What the router checks, the SDK produces byte for byte:

* **Canonical bytes** — compact JSON with sorted keys (object keys in code-point
  order), UTF-8 unescaped, of the frame without ``sig`` and ``checksum`` and
  without the fields at their default (``frag_seq`` 0, ``flags`` [], ``qos``
  ``"silver"``, ``ttl`` 8, ``meta`` {}, null ``window``/``payload``; in the
  payload null ``content``/``confidence``/``cost_est``; zero ``cost_est``
  token counters — a float is kept, ``cost_est.usd`` 0.0 too). Floats are
  written in their shortest round-trip digits, fixed notation for decimal
  exponents -5..15 and ``1e16`` / ``1e-7`` beyond; NaN and infinities are
  refused (``ValueError``).
* **Checksums** — ``payload.checksum`` = ``"sha256:" + hex`` of the payload's
  canonical bytes without its own checksum; ``checksum`` = that of the frame's
  canonical bytes (which include ``payload.checksum``).
* **Signatures** — ``sig = "<kid>:" + base64(HMAC-SHA256(key, canonical bytes))``
  (``"<base64>"`` alone for a single raw key), keyed by :class:`FrameKeys` — the
  router's ``ATP_HMAC_KEYS`` / ``ATP_HMAC_KEY``. A signed frame also carries
  ``meta.nonce`` (32 URL-safe characters, fresh) and ``meta.ts`` (unix ms): the
  router accepts each nonce once within ±120 s of its clock.

Encodings: ``json`` (text messages) and ``cbor`` (binary; :mod:`cbor2` is
imported on first use, so a JSON-only client does not need it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any, Literal

from atp._types import ATPClientError

Encoding = Literal["json", "cbor"]
ENCODINGS: tuple[Encoding, ...] = ("json", "cbor")
#: The WebSocket subprotocol of each encoding (spec §4.1).
SUBPROTOCOLS: dict[str, str] = {"json": "atp.v1.json", "cbor": "atp.v1.cbor"}
#: Stream id of session-level heartbeats and connection errors.
CONNECTION_STREAM = "0"

_FRAME_DEFAULTS: dict[str, Any] = {"frag_seq": 0, "flags": [], "qos": "silver", "ttl": 8, "window": None,
                                   "meta": {}, "payload": None}
_PAYLOAD_DEFAULTS: dict[str, Any] = {"content": None, "confidence": None, "cost_est": None}
#: A float equal to its default is kept: the router's msgspec omits a default by identity,
#: which a decoded float never has (``cost_est.usd`` 0.0 on the wire is in the canonical bytes).
_COST_DEFAULTS: dict[str, Any] = {"in_tokens": 0, "out_tokens": 0}
_SHA = "sha256:"


# ------------------------------------------------------------------ canonical JSON

def _float(v: float) -> str:
    if not math.isfinite(v):
        raise ValueError(f"non-finite float {v!r} cannot be sent in a frame (JSON data model)")
    r = repr(v)
    if "e" not in r:
        return r
    mant, exp = r.split("e")
    e = int(exp)
    if e == -5:  # the one exponent Python writes in scientific notation and msgspec in fixed
        sign = "-" if mant.startswith("-") else ""
        return sign + "0.0000" + mant.lstrip("-").replace(".", "")
    return f"{mant}e{e}"


def _encode(v: Any, out: list[str]) -> None:
    t = type(v)
    if t is str:
        out.append(json.dumps(v, ensure_ascii=False))
    elif v is None:
        out.append("null")
    elif t is bool:
        out.append("true" if v else "false")
    elif t is int:
        out.append(str(v))
    elif t is float:
        out.append(_float(v))
    elif isinstance(v, Mapping):
        out.append("{")
        for i, k in enumerate(sorted(v)):
            if type(k) is not str:
                raise TypeError(f"frame object key {k!r} is not a string")
            out.append("," if i else "")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _encode(v[k], out)
        out.append("}")
    elif isinstance(v, list | tuple):
        out.append("[")
        for i, item in enumerate(v):
            out.append("," if i else "")
            _encode(item, out)
        out.append("]")
    else:
        raise TypeError(f"{t.__name__} value cannot be sent in a frame (JSON data model only)")


def canonical_json(value: Any) -> bytes:
    """Compact sorted-key JSON of ``value`` as the router writes it (module doc).
    Raises ``ValueError`` (NaN, infinities) or ``TypeError`` (a value or key JSON
    cannot carry)."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode("utf-8")


def _drop(d: Mapping[str, Any], defaults: Mapping[str, Any], *also: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in also and not (k in defaults and v == defaults[k])}


def _canonical_payload(payload: Mapping[str, Any], *, with_checksum: bool) -> dict[str, Any]:
    p = _drop(payload, _PAYLOAD_DEFAULTS, *(() if with_checksum else ("checksum",)))
    if p.get("checksum", "") is None:
        del p["checksum"]
    cost = p.get("cost_est")
    if isinstance(cost, Mapping):
        p["cost_est"] = _drop(cost, _COST_DEFAULTS)
    return p


def frame_canonical(frame: Mapping[str, Any]) -> bytes:
    """The bytes ``checksum`` and ``sig`` cover (module doc)."""
    f = _drop(frame, _FRAME_DEFAULTS, "sig", "checksum")
    if isinstance(f.get("payload"), Mapping):
        f["payload"] = _canonical_payload(f["payload"], with_checksum=True)
    return canonical_json(f)


def payload_checksum(payload: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the payload's canonical bytes without its own checksum."""
    return _SHA + hashlib.sha256(canonical_json(_canonical_payload(payload, with_checksum=False))).hexdigest()


# ------------------------------------------------------------------ keys

#: A key id: letters, digits and ``._-``, at most 32 characters.
KID_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
#: Shortest key :meth:`FrameKeys.parse` accepts (bytes): 128 bits, as the router's ``ATP_HMAC_KEYS``.
MIN_KEY_BYTES = 16


def _mac(key: bytes, raw: bytes) -> str:
    return binascii.b2a_base64(hmac.digest(key, raw, "sha256"), newline=False).decode("ascii")


class FrameKeys:
    """HMAC-SHA256 frame keys by key id (spec §11), as the router's key ring.

    ``keys`` maps kid → key bytes; ``signing_kid`` (default: the first) signs,
    every key verifies the router's frames. ``sig`` values are ``"<kid>:<base64>"``,
    or ``"<base64>"`` alone with ``kid_in_sig=False`` (:meth:`single`: the router's
    ``ATP_HMAC_KEY``). Raises ``ValueError`` for no keys, a bad kid, an empty key
    or an unknown ``signing_kid``; its ``repr`` names kids only.
    """

    __slots__ = ("_keys", "_prefix", "signing_kid")

    def __init__(self, keys: Mapping[str, bytes], signing_kid: str | None = None, *, kid_in_sig: bool = True):
        if not keys:
            raise ValueError("FrameKeys needs at least one key")
        for kid, key in keys.items():
            if not isinstance(kid, str) or not KID_RE.match(kid):
                raise ValueError(f"key id {kid!r:.40}: expected 1-32 of letters, digits and ._-")
            if not key:
                raise ValueError(f"key {kid!r}: empty key")
        self.signing_kid = signing_kid if signing_kid is not None else next(iter(keys))
        if self.signing_kid not in keys:
            raise ValueError(f"signing key id {self.signing_kid!r} is not among the keys ({', '.join(keys)})")
        self._keys = {kid: bytes(key) for kid, key in keys.items()}
        self._prefix = self.signing_kid + ":" if kid_in_sig else ""

    @classmethod
    def single(cls, key: bytes) -> FrameKeys:
        """One raw key (the router's ``ATP_HMAC_KEY``, or ``RouterConfig(hmac_key=)``):
        kid ``k0``, ``sig`` written without a kid."""
        return cls({"k0": key}, kid_in_sig=False)

    @classmethod
    def parse(cls, text: str) -> FrameKeys:
        """The keys of ``ATP_HMAC_KEYS`` text ``"kid1:base64key,kid2:base64key"``
        (standard or URL-safe base64, each key at least :data:`MIN_KEY_BYTES`
        bytes; the first signs). Raises ``ValueError`` naming the entry, never a key."""
        ring: dict[str, bytes] = {}
        for i, entry in enumerate(e.strip() for e in text.split(",")):
            if not entry:
                continue
            kid, sep, b64 = entry.partition(":")
            if not sep or not KID_RE.match(kid):
                raise ValueError(f"entry {i + 1}: expected 'kid:base64key' with a kid of 1-32 of [A-Za-z0-9._-]")
            try:
                b64 = b64.strip()
                key = base64.b64decode(b64.replace("-", "+").replace("_", "/") + "=" * (-len(b64) % 4), validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"entry {i + 1} ({kid}): the key is not base64") from None
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"entry {i + 1} ({kid}): key of {len(key)} bytes, at least {MIN_KEY_BYTES} needed")
            if kid in ring:
                raise ValueError(f"entry {i + 1}: key id {kid!r} given twice")
            ring[kid] = key
        if not ring:
            raise ValueError("no keys in the text: expected 'kid:base64key,...'")
        return cls(ring)

    @property
    def kids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def sign(self, raw: bytes) -> str:
        """The ``sig`` value of canonical bytes ``raw`` under the signing key."""
        return self._prefix + _mac(self._keys[self.signing_kid], raw)

    def check(self, sig: Any, raw: bytes) -> None:
        """Verify the router's ``sig`` over ``raw`` in constant time; raises
        :class:`ATPClientError` ``ESEC`` (missing sig, unknown kid, mismatch)."""
        if not isinstance(sig, str):
            raise ATPClientError("ESEC", "frame from the router without sig: the router signs with no key of ours")
        kid, sep, mac = sig.partition(":")
        key = self._keys.get(kid) if sep else self._keys[self.signing_kid]
        if key is None:
            raise ATPClientError("ESEC", f"frame from the router signed with key id {kid[:32]!r}, not one of ours")
        if not (mac if sep else sig).isascii() or not hmac.compare_digest(mac if sep else sig, _mac(key, raw)):
            raise ATPClientError("ESEC", "frame from the router with a bad sig: HMAC-SHA256 does not match")

    def __repr__(self) -> str:
        return f"FrameKeys(kids={self.kids!r}, signing_kid={self.signing_kid!r})"


def as_keys(keys: FrameKeys | bytes | str | Mapping[str, bytes] | None) -> FrameKeys | None:
    """``keys`` as :class:`FrameKeys`: raw ``bytes`` (:meth:`FrameKeys.single`),
    ``ATP_HMAC_KEYS`` text (:meth:`FrameKeys.parse`) or a kid → key mapping."""
    if keys is None or isinstance(keys, FrameKeys):
        return keys
    if isinstance(keys, bytes | bytearray):
        return FrameKeys.single(bytes(keys))
    if isinstance(keys, str):
        return FrameKeys.parse(keys)
    return FrameKeys(keys)


# ------------------------------------------------------------------ sealing and checking

def seal(frame: Mapping[str, Any], keys: FrameKeys | None = None, *, now_ms: int | None = None) -> dict[str, Any]:
    """A copy of ``frame`` with payload checksum and checksum, and with ``keys``
    also ``meta.nonce`` (fresh), ``meta.ts`` (``now_ms``, default now; unix ms)
    and ``sig``. Raises ``ValueError``/``TypeError`` for values JSON cannot carry."""
    out = {k: v for k, v in frame.items() if k not in ("sig", "checksum")}
    if keys is not None:
        ts = now_ms if now_ms is not None else int(time.time() * 1000)
        out["meta"] = {**(out.get("meta") or {}), "nonce": secrets.token_urlsafe(24), "ts": ts}
    if isinstance(out.get("payload"), Mapping):
        p = {k: v for k, v in out["payload"].items() if k != "checksum"}
        out["payload"] = {**p, "checksum": payload_checksum(p)}
    raw = frame_canonical(out)
    out["checksum"] = _SHA + hashlib.sha256(raw).hexdigest()
    if keys is not None:
        out["sig"] = keys.sign(raw)
    return out


def verify(frame: Mapping[str, Any], keys: FrameKeys | None) -> None:
    """Check a router frame's payload checksum, checksum and (with ``keys``) sig.
    Raises :class:`ATPClientError` ``EPROTO`` (checksum) or ``ESEC`` (signature)."""
    payload = frame.get("payload")
    if isinstance(payload, Mapping) and payload.get("checksum") is not None:
        if payload["checksum"] != payload_checksum(payload):
            raise ATPClientError("EPROTO", "frame from the router: payload checksum mismatch")
    try:
        raw = frame_canonical(frame)
    except (TypeError, ValueError) as e:
        raise ATPClientError("EPROTO", f"frame from the router cannot be checked: {e}") from None
    if frame.get("checksum") != _SHA + hashlib.sha256(raw).hexdigest():
        raise ATPClientError("EPROTO", "frame from the router: missing checksum or checksum mismatch")
    if keys is not None:
        keys.check(frame.get("sig"), raw)


def encode(frame: Mapping[str, Any], encoding: Encoding) -> str | bytes:
    """One WebSocket message: JSON text, or CBOR bytes."""
    if encoding == "json":
        return json.dumps(frame, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    import cbor2  # only CBOR clients need it

    return bytes(cbor2.dumps(frame))


def decode(message: str | bytes, encoding: Encoding) -> dict[str, Any]:
    """The frame dict of one WebSocket message. Raises :class:`ATPClientError`
    ``EPROTO`` for a message that is not one frame object of the encoding."""
    try:
        if encoding == "json":
            obj = json.loads(message)
        else:
            if isinstance(message, str):
                raise ValueError("a text message on a CBOR connection")
            import cbor2

            obj = cbor2.loads(message)
    except Exception as e:  # json, cbor2 and their many decode errors alike
        raise ATPClientError("EPROTO", f"undecodable {encoding} message from the router: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("stream_id"), str):
        raise ATPClientError("EPROTO", f"{encoding} message from the router is not a frame")
    return obj


# ------------------------------------------------------------------ reading frames

def flags_of(frame: Mapping[str, Any]) -> frozenset[str]:
    flags = frame.get("flags")
    return frozenset(f for f in flags if isinstance(f, str)) if isinstance(flags, list) else frozenset()


def control_of(frame: Mapping[str, Any]) -> dict[str, Any] | None:
    """The control payload's content (``{"kind": ..., ...}``), or None."""
    p = frame.get("payload")
    if isinstance(p, Mapping) and p.get("type") == "control":
        content = p.get("content")
        if isinstance(content, dict):
            return content
    return None


def event_type(frame: Mapping[str, Any]) -> str:
    """The event name of a router frame, as the router's SSE names it."""
    flags = flags_of(frame)
    if "RST" in flags:
        return "RST"
    if "SYN" in flags:
        return "SYN_ACK"
    p = frame.get("payload")
    if isinstance(p, Mapping):
        t = p.get("type")
        if t in ("agent.result.final", "agent.result.partial"):
            return "FINAL" if t == "agent.result.final" else "PARTIAL"
        if t == "control":
            kind = (control_of(frame) or {}).get("kind")
            return kind if kind in ("ERROR", "WINDOW_UPDATE") else "CONTROL"
        if t == "agent.result.log":
            return "LOG"
    for flag in ("FIN", "HB", "ACK"):
        if flag in flags:
            return flag
    return "DATA"


def public_frame(frame: Mapping[str, Any]) -> dict[str, Any]:
    """``frame`` without its integrity fields (``sig``, ``checksum``, ``payload.checksum``)."""
    out = {k: v for k, v in frame.items() if k not in ("sig", "checksum")}
    p = out.get("payload")
    if isinstance(p, Mapping) and "checksum" in p:
        out["payload"] = {k: v for k, v in p.items() if k != "checksum"}
    return out


def budget_frame(session_id: str, stream_id: str, msg_seq: int, usd: float | None,
                 tokens: int | None) -> dict[str, Any]:
    """A BUDGET_UPDATE control message (spec §4.3): ``usd`` float USD, ``tokens``."""
    budget: dict[str, Any] = {}
    if usd is not None:
        budget["usd"] = usd
    if tokens is not None:
        budget["tokens"] = tokens
    return {"v": 1, "session_id": session_id, "stream_id": stream_id, "msg_seq": msg_seq, "flags": ["CTRL"],
            "payload": {"type": "control", "content": {"kind": "BUDGET_UPDATE", "budget": budget}}}
