"""Frame signatures with key ids, the replay window, and signed usage summaries
(spec §11 "HMAC on frames; nonces to prevent replay", §19 billing abuse).

Real components only: frames go through the real codec in both encodings, keys
are real Ed25519 keys in real files, and usage tokens are checked with plain
joserfc as a client would.
"""

from __future__ import annotations

import base64
import json
import os
import stat

import msgspec
import pytest
from joserfc import jws
from joserfc.errors import BadSignatureError
from joserfc.jwk import OKPKey

from atp_router.security.signing import (
    KeyRing,
    ReplayGuard,
    UsageSignatureError,
    UsageSigner,
    sign_outbound,
    verify_usage,
)
from atp_router.wire.codec import FrameCodec, seal
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Flag, Frame, Payload, PayloadType

NOW = 1_760_000_000_000  # unix ms
RING = KeyRing({"k2": b"k2-key-0123456789abcdef", "k1": b"k1-key-0123456789abcdef"})
NONCE = "n" * 16


def frame(**meta: object) -> Frame:
    return Frame(v=1, session_id="sess_1", stream_id="st_1", msg_seq=0, flags=[Flag.SYN], meta=dict(meta),
                 payload=Payload(type=PayloadType.TASK, content={"diff": "x"}))


def refused(guard: ReplayGuard, key: object, f: Frame, now: int) -> str:
    with pytest.raises(LocalProtocolError) as e:
        guard.check(key, f, now)
    assert e.value.code is ErrorCode.ESEC
    return e.value.reason


# (name, meta, router now, reason the refusal must contain)
REFUSALS = [
    ("no-nonce", {"ts": NOW}, NOW, "missing or malformed meta.nonce"),
    ("nonce-too-short", {"nonce": "a" * 15, "ts": NOW}, NOW, "missing or malformed meta.nonce"),
    ("nonce-too-long", {"nonce": "a" * 129, "ts": NOW}, NOW, "missing or malformed meta.nonce"),
    ("nonce-not-urlsafe", {"nonce": "a" * 15 + "+", "ts": NOW}, NOW, "missing or malformed meta.nonce"),
    ("nonce-not-str", {"nonce": 1234567890123456789, "ts": NOW}, NOW, "missing or malformed meta.nonce"),
    ("no-ts", {"nonce": NONCE}, NOW, "missing or malformed meta.ts"),
    ("ts-float", {"nonce": NONCE, "ts": float(NOW)}, NOW, "missing or malformed meta.ts"),
    ("ts-bool", {"nonce": NONCE, "ts": True}, NOW, "missing or malformed meta.ts"),
    ("ts-str", {"nonce": NONCE, "ts": str(NOW)}, NOW, "missing or malformed meta.ts"),
    ("stale", {"nonce": NONCE, "ts": NOW - 120_001}, NOW, "stale frame: meta.ts is 120001 ms old"),
    ("future", {"nonce": NONCE, "ts": NOW + 120_001}, NOW, "meta.ts is 120001 ms ahead"),
]


@pytest.mark.parametrize(("name", "meta", "now", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_replay_guard_refusals(name: str, meta: dict, now: int, reason: str) -> None:
    guard = ReplayGuard()
    assert reason in refused(guard, ("alice", "s1"), frame(**meta), now)
    assert guard.statistics().nonces == 0  # a refused frame leaves nothing behind
    assert guard.statistics().refused == 1


@pytest.mark.parametrize("ts", [NOW - 120_000, NOW, NOW + 120_000])
def test_window_edges_are_accepted(ts: int) -> None:
    ReplayGuard().check(("alice", "s1"), frame(nonce=NONCE, ts=ts), NOW)


def test_replay_is_refused_per_session_only() -> None:
    guard = ReplayGuard()
    f = frame(nonce=NONCE, ts=NOW)
    guard.check(("alice", "s1"), f, NOW)
    assert "replayed frame" in refused(guard, ("alice", "s1"), f, NOW + 5)
    # The same nonce in another session (or another tenant's same session id) is its own.
    guard.check(("alice", "s2"), f, NOW)
    guard.check(("bob", "s1"), f, NOW)
    assert guard.statistics().sessions == 3


def test_full_session_cache_keeps_refusing_forgotten_nonces() -> None:
    """Past max_nonces, dropped nonces stay unreplayable: the session's floor rises."""
    guard = ReplayGuard(max_nonces=8)
    sent = [frame(nonce=f"nonce-{i:011d}", ts=NOW + i) for i in range(9)]
    for f in sent:
        guard.check("s", f, NOW)
    stats = guard.statistics()
    assert stats.nonces <= 8
    for f in sent:  # every one of them, kept or dropped, is refused again
        reason = refused(guard, "s", f, NOW + 10)
        assert "replayed frame" in reason or "older than this session's replay cache" in reason
    guard.check("s", frame(nonce="nonce-fresh-000000", ts=NOW + 20), NOW + 20)


def test_expired_nonces_are_dropped_first() -> None:
    guard = ReplayGuard(window_ms=1000, max_nonces=4)
    for i in range(4):
        guard.check("s", frame(nonce=f"old-nonce-{i:07d}", ts=NOW), NOW)
    guard.check("s", frame(nonce="new-nonce-0000000", ts=NOW + 5000), NOW + 5000)
    assert guard.statistics().nonces == 1
    # The old ones are outside the window now: stale, whatever the cache holds.
    assert "stale frame" in refused(guard, "s", frame(nonce="old-nonce-0000000", ts=NOW), NOW + 5000)


def test_sessions_are_bounded_idle_ones_dropped_first() -> None:
    guard = ReplayGuard(window_ms=1000, max_sessions=3)
    for i in range(3):
        guard.check(f"s{i}", frame(nonce=NONCE, ts=NOW), NOW)
    # Two windows later every session is idle: room is made without dropping a live one.
    guard.check("s3", frame(nonce=NONCE, ts=NOW + 2001), NOW + 2001)
    assert guard.statistics().sessions == 1 and guard.statistics().evicted_live == 0
    for i in range(4, 6):
        guard.check(f"s{i}", frame(nonce=NONCE, ts=NOW + 2001), NOW + 2001)
    guard.check("s6", frame(nonce=NONCE, ts=NOW + 2001), NOW + 2001)  # all live: the LRU one goes
    stats = guard.statistics()
    assert (stats.sessions, stats.evicted_live) == (3, 1)
    assert guard.expire(NOW + 10_000) == 3


def test_guard_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        ReplayGuard(window_ms=0)
    with pytest.raises(ValueError):
        ReplayGuard(max_sessions=0)


@pytest.mark.parametrize("encoding", ["json", "cbor"])
def test_sign_outbound_through_codec_and_guard(encoding: str) -> None:
    """What a client sends: nonce + ts under the signature; a replay of the exact
    bytes is refused; editing ts breaks the signature (meta is covered)."""
    codec = FrameCodec(encoding, keyring=RING)
    signed = sign_outbound(frame(), RING, NOW)
    assert signed.sig.startswith("k2:")
    assert set(signed.meta) == {"nonce", "ts"} and signed.meta["ts"] == NOW
    data = FrameCodec(encoding).encode(signed, seal_frame=False)
    guard = ReplayGuard()
    got = codec.decode(data)
    guard.check(("alice", got.session_id), got, NOW + 50)
    again = codec.decode(data)  # the signature still holds for a byte-exact replay...
    assert "replayed frame" in refused(guard, ("alice", again.session_id), again, NOW + 60)  # ...the guard does not
    forged = msgspec.structs.replace(signed, meta={**signed.meta, "ts": NOW + 100})
    with pytest.raises(LocalProtocolError, match="checksum mismatch|bad sig"):
        codec.decode(FrameCodec(encoding).encode(forged, seal_frame=False))
    # Two calls give two nonces.
    assert sign_outbound(frame(), RING, NOW).meta["nonce"] != signed.meta["nonce"]


def test_sign_outbound_keeps_meta_and_checks_nonce() -> None:
    out = sign_outbound(frame(task_type="code_review"), RING, NOW, nonce="fixed-nonce-123456")
    assert out.meta == {"task_type": "code_review", "nonce": "fixed-nonce-123456", "ts": NOW}
    assert out == seal(msgspec.structs.replace(out, sig=None, checksum=None), keyring=RING)
    with pytest.raises(ValueError, match="nonce"):
        sign_outbound(frame(), RING, NOW, nonce="short")


# ------------------------------------------------------------------ usage summaries

SUMMARY = {
    "tenant": "alice", "session_id": "sess_1", "stream_id": "st_1", "tokens": 1234, "usd_micros": 5678,
    "calls": 3, "rib_version": 2, "closed_at_ms": NOW,
}


def test_usage_key_file_created_0600_and_reloaded(tmp_path) -> None:
    path = tmp_path / "usage.pem"
    signer = UsageSigner.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    again = UsageSigner.load_or_create(path)
    assert again.public_jwk() == signer.public_jwk()
    jwk = signer.public_jwk()
    assert (jwk["kty"], jwk["crv"], jwk["alg"], jwk["use"], jwk["kid"]) == ("OKP", "Ed25519", "Ed25519", "sig",
                                                                             signer.kid)
    assert "d" not in jwk  # the private part never leaves


def test_usage_signature_verifies_with_plain_joserfc(tmp_path) -> None:
    signer = UsageSigner.load_or_create(tmp_path / "usage.pem")
    token = signer.sign(SUMMARY)
    assert verify_usage(token, signer.public_jwk()) == SUMMARY
    # What the module docstring tells a client to do:
    obj = jws.deserialize_compact(token, OKPKey.import_key(signer.public_jwk()), algorithms=["Ed25519"])
    assert json.loads(obj.payload) == SUMMARY
    assert obj.payload == json.dumps(SUMMARY, sort_keys=True, separators=(",", ":")).encode()  # canonical JSON
    assert obj.headers() == {"alg": "Ed25519", "kid": signer.kid, "typ": "atp-usage+json"}


def _tamper(token: str, **changes: object) -> str:
    header, payload, sig = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=="))
    body.update(changes)
    enc = base64.urlsafe_b64encode(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).rstrip(b"=")
    return f"{header}.{enc.decode()}.{sig}"


def test_edited_or_foreign_usage_is_refused(tmp_path) -> None:
    signer = UsageSigner.load_or_create(tmp_path / "usage.pem")
    token = signer.sign(SUMMARY)
    lowered = _tamper(token, usd_micros=1)  # the over-billing dispute: someone edits the bill
    with pytest.raises(UsageSignatureError, match="does not verify"):
        verify_usage(lowered, signer.public_jwk())
    with pytest.raises(BadSignatureError):
        jws.deserialize_compact(lowered, OKPKey.import_key(signer.public_jwk()), algorithms=["Ed25519"])
    other = UsageSigner.generate()
    with pytest.raises(UsageSignatureError):
        verify_usage(other.sign(SUMMARY), signer.public_jwk())  # another key, with the kid check too
    foreign_jwk = {k: v for k, v in other.public_jwk().items() if k != "kid"}
    with pytest.raises(UsageSignatureError, match="does not verify"):
        verify_usage(token, foreign_jwk)
    with pytest.raises(UsageSignatureError):
        verify_usage("not.a.jws", signer.public_jwk())


def test_usage_summary_shape_is_strict() -> None:
    signer = UsageSigner.generate()
    for bad in ({**SUMMARY, "tokens": -1}, {**SUMMARY, "extra": 1}, {k: v for k, v in SUMMARY.items() if k != "calls"},
                {**SUMMARY, "usd_micros": 1.5}):
        with pytest.raises(ValueError, match="usage summary"):
            signer.sign(bad)
    # A validly signed payload that is not a summary is refused by the verifier too.
    key = OKPKey.generate_key("Ed25519")
    token = jws.serialize_compact({"alg": "Ed25519"}, b'{"tenant":"x"}', key, algorithms=["Ed25519"])
    with pytest.raises(UsageSignatureError, match="not a usage summary"):
        verify_usage(token, key.as_dict(private=False))


def test_usage_key_file_refusals(tmp_path) -> None:
    loose = tmp_path / "loose.pem"
    UsageSigner.load_or_create(loose)
    os.chmod(loose, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        UsageSigner.load_or_create(loose)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ValueError, match="not an Ed25519 private key"):
        UsageSigner.load_or_create(junk)
