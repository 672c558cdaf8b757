"""Frame signatures, replay protection and signed usage (spec §11, §19).

* **Keys with ids and rotation.** :class:`KeyRing` (from :mod:`atp_router.wire.codec`, where
  the codec uses it): ``ATP_HMAC_KEYS="k2:<base64>,k1:<base64>"`` — the first key
  signs, every key verifies, so a rotation is: add the new key second, then move it
  first, then drop the old one. ``sig`` is ``"<kid>:<base64 HMAC-SHA256>"``; a sig
  without a kid is checked against the signing key. ``ATP_HMAC_KEY`` (one raw key)
  is kid ``k0`` and signs without a kid, as before key ids.
* **Replay window.** A signed inbound frame carries ``meta.nonce`` (16-128 URL-safe
  characters) and ``meta.ts`` (unix time, ms); the signature covers both (``meta``
  is part of the canonical bytes). :class:`ReplayGuard` refuses a frame whose ``ts``
  is outside ±``window_ms`` of the router's clock or whose nonce it has seen in the
  same session, with ``ESEC``. :func:`sign_outbound` adds both and seals a frame
  (SDK, test clients, downstream routers).
* **Replay across restarts, workers and routers** (issue 19).
  :class:`DurableReplayGuard` keeps the in-memory :class:`ReplayGuard` as a fast
  first filter and makes the router's store the authority: each frame it lets
  through costs one atomic :meth:`Store.record_nonce <atp_router.store.base.Store.record_nonce>`
  of ``(tenant, key id, meta.nonce)`` — the key id that verified the ``sig``
  (:func:`frame_kid`) — kept until ``meta.ts + window_ms + slack_ms`` (``slack_ms``:
  the clock difference tolerated between routers sharing the store, default
  :data:`DEFAULT_CLOCK_SLACK_MS`). So a signed frame replayed after a kill -9 and
  restart, on another ``--workers`` process or on another router of a Redis
  cluster is refused with ``ESEC``, like one replayed on its own connection.
  A nonce is single-use per tenant and key, across sessions. Each tenant holds
  at most ``max_per_tenant`` unexpired nonces (default
  :data:`DEFAULT_MAX_NONCES_PER_TENANT`, about 370 signed frames a second
  sustained with the default window); past it its frames are refused with
  ``ESEC`` until some expire, so no tenant fills the store. While the store
  cannot be reached (or fails) a signed frame is **refused** (``ESEC``, "replay
  check unavailable"), never accepted unchecked.
* **Signed usage summaries** (§19 billing abuse). :class:`UsageSigner` signs each
  stream's usage — ``{tenant, session_id, stream_id, tokens, usd_micros, calls,
  rib_version, closed_at_ms}`` — as a compact JWS (EdDSA with Ed25519: JWS ``alg``
  ``Ed25519``, RFC 9864) over its canonical
  JSON (sorted keys, no whitespace); ``GET /v1/keys`` serves :meth:`UsageSigner.public_jwk`.
  A client checks one with :func:`verify_usage`, or with joserfc alone::

      from joserfc import jws
      from joserfc.jwk import OKPKey
      key = OKPKey.import_key(jwk)                      # the dict from GET /v1/keys
      obj = jws.deserialize_compact(token, key, algorithms=["Ed25519"])
      usage = json.loads(obj.payload)                   # raises BadSignatureError if forged

  (or any JOSE library: RFC 7515 compact serialization, RFC 8037 OKP keys; a library
  predating RFC 9864 knows the algorithm as ``EdDSA``: verify the same signature bytes
  with ``Ed25519`` keys under that name).

:class:`ReplayGuard` is sans-IO: time is passed in (``now_ms``);
:class:`DurableReplayGuard` adds one synchronous store call per frame (SQLite
about a kv write, Redis one round trip: ``bench/bench_replay.py``).
:class:`UsageSigner` reads or creates its key file once, in
:meth:`UsageSigner.load_or_create`.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from joserfc import jws
from joserfc.errors import JoseError
from joserfc.jwk import OKPKey
from msgspec import Meta

from atp_router.store.base import StoreError, StoreLimitError, StoreUnavailable
from atp_router.wire.codec import LEGACY_KID, KeyRing, seal
from atp_router.wire.errors import ErrorCode, LocalProtocolError
from atp_router.wire.frame import Frame

__all__ = [
    "DEFAULT_CLOCK_SLACK_MS",
    "DEFAULT_MAX_NONCES_PER_TENANT",
    "LEGACY_KID",
    "NONCE_RE",
    "DurableReplayGuard",
    "KeyRing",
    "NonceStore",
    "ReplayGuard",
    "ReplayStats",
    "UsageSignatureError",
    "UsageSigner",
    "UsageSummary",
    "frame_kid",
    "sign_outbound",
    "verify_usage",
]

#: ``meta.nonce``: 16 to 128 URL-safe base64 characters.
NONCE_RE = re.compile(r"^[A-Za-z0-9_-]{16,128}$")

#: The default replay window: ``meta.ts`` within ±120 s of the router's clock (ms).
DEFAULT_WINDOW_MS = 120_000
#: How long a nonce stays in the store past its frame's window (ms): routers sharing
#: a store whose clocks differ by less than this never accept a frame whose nonce
#: record another one already dropped.
DEFAULT_CLOCK_SLACK_MS = 30_000
#: Unexpired nonces one tenant may hold in the store (with the default window and
#: slack, a nonce lives at most 270 s: about 370 signed frames a second sustained).
DEFAULT_MAX_NONCES_PER_TENANT = 100_000

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """``sessions`` held, ``nonces`` held over all sessions, ``refused`` frames so
    far, ``evicted_live`` sessions dropped while their nonces could still be
    replayed (only when more than ``max_sessions`` were active within 2 windows).
    A :class:`DurableReplayGuard` also counts the frames its store refused:
    ``store_replayed`` (a nonce recorded before: a restart, another worker or
    router), ``store_full`` (the tenant at its bound) and ``store_unavailable``
    (the store failed: refused unchecked)."""

    sessions: int
    nonces: int
    refused: int
    evicted_live: int
    store_replayed: int = 0
    store_full: int = 0
    store_unavailable: int = 0


class _Seen:
    __slots__ = ("floor", "last_ms", "nonces")

    def __init__(self, now_ms: int):
        self.nonces: dict[str, int] = {}  # nonce -> meta.ts, in arrival order
        self.floor = -(1 << 63)  # a frame with meta.ts <= floor is refused (its nonce may be forgotten)
        self.last_ms = now_ms


class ReplayGuard:
    """Per-session replay cache of signed frames (spec §11 "nonces to prevent
    replay"), sans-IO.

    ``check(key, frame, now_ms)`` accepts a frame once: its ``meta.ts`` (unix ms)
    must be within ±``window_ms`` of ``now_ms`` and its ``meta.nonce`` unseen for
    ``key`` (any hashable; the router uses ``(tenant, session_id)``). Call it after
    the signature verified (the codec's ``decode``), so only frames that the key
    holder sent are remembered.

    Bounded memory: at most ``max_nonces`` nonces per session — past that, nonces
    whose ``ts`` left the window are dropped, then the oldest quarter, and the
    session then refuses any frame with a ``ts`` at or below the newest dropped one
    (so a forgotten nonce still cannot be replayed); at most ``max_sessions``
    sessions, least recently used dropped first (a session idle for two windows
    holds nothing replayable; dropping an active one is counted in
    :meth:`statistics` as ``evicted_live``).
    """

    __slots__ = ("_evicted_live", "_refused", "_sessions", "max_nonces", "max_sessions", "window_ms")

    def __init__(self, *, window_ms: int = DEFAULT_WINDOW_MS, max_nonces: int = 4096, max_sessions: int = 100_000):
        if window_ms < 1 or max_nonces < 4 or max_sessions < 1:
            raise ValueError("window_ms >= 1, max_nonces >= 4 and max_sessions >= 1 are required")
        self.window_ms = window_ms
        self.max_nonces = max_nonces
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[Hashable, _Seen] = OrderedDict()
        self._refused = 0
        self._evicted_live = 0

    def _refuse(self, reason: str) -> LocalProtocolError:
        self._refused += 1
        return LocalProtocolError(ErrorCode.ESEC, reason)

    def check(self, key: Hashable, frame: Frame, now_ms: int) -> None:
        """Accept ``frame`` for session ``key`` at router time ``now_ms`` (unix ms) and
        remember its nonce. Raises ``LocalProtocolError(ESEC)`` — and remembers
        nothing — for a missing or malformed ``meta.nonce`` or ``meta.ts``, a ``ts``
        more than ``window_ms`` in the past (stale) or the future, a ``ts`` older
        than what the session's cache still covers, or a nonce already seen."""
        meta = frame.meta
        nonce = meta.get("nonce")
        if type(nonce) is not str or not NONCE_RE.match(nonce):
            raise self._refuse("missing or malformed meta.nonce: a signed frame needs 16-128 URL-safe "
                               "characters ([A-Za-z0-9_-]) at `$.meta.nonce`")
        ts = meta.get("ts")
        if type(ts) is not int:
            raise self._refuse("missing or malformed meta.ts: a signed frame needs the unix time in ms "
                               "(an integer) at `$.meta.ts`")
        skew = ts - now_ms
        if skew < -self.window_ms:
            raise self._refuse(f"stale frame: meta.ts is {-skew} ms old, outside the replay window of "
                               f"±{self.window_ms} ms")
        if skew > self.window_ms:
            raise self._refuse(f"frame from the future: meta.ts is {skew} ms ahead, outside the replay window "
                               f"of ±{self.window_ms} ms")
        sessions = self._sessions
        seen = sessions.get(key)
        if seen is None:
            self._make_room(now_ms)
            seen = sessions[key] = _Seen(now_ms)
        else:
            sessions.move_to_end(key)
            seen.last_ms = max(seen.last_ms, now_ms)
        if ts <= seen.floor:
            raise self._refuse("stale frame: meta.ts is older than this session's replay cache covers; "
                               "sign the frame again with a fresh nonce and ts")
        if nonce in seen.nonces:
            raise self._refuse("replayed frame: meta.nonce was already used in this session")
        seen.nonces[nonce] = ts
        if len(seen.nonces) > self.max_nonces:
            self._shrink(seen, now_ms)

    def forget(self, key: Hashable, nonce: str) -> None:
        """Drop ``nonce`` from session ``key`` (a frame accepted here that a later
        check refused for another reason than a replay, so that the same frame
        is judged again when it is sent again); nothing if it is not held."""
        seen = self._sessions.get(key)
        if seen is not None:
            seen.nonces.pop(nonce, None)

    def _shrink(self, seen: _Seen, now_ms: int) -> None:
        """Drop nonces outside the window, then (still full) the oldest quarter by
        ``ts``, raising the session's floor to the newest ``ts`` dropped."""
        horizon = now_ms - self.window_ms
        kept = {n: t for n, t in seen.nonces.items() if t >= horizon}
        if len(kept) > self.max_nonces * 3 // 4:
            by_ts = sorted(kept.items(), key=lambda item: item[1])
            cut = len(kept) - self.max_nonces * 3 // 4
            seen.floor = max(seen.floor, by_ts[cut - 1][1])
            kept = {n: t for n, t in kept.items() if t > seen.floor}
        seen.nonces = kept

    def _make_room(self, now_ms: int) -> None:
        sessions = self._sessions
        self.expire(now_ms)
        while len(sessions) >= self.max_sessions:
            sessions.popitem(last=False)
            self._evicted_live += 1

    def expire(self, now_ms: int) -> int:
        """Forget sessions idle for more than two windows (nothing they saw can pass
        the ``ts`` check any more); returns how many. Called on demand when full;
        the router may also call it from a timer."""
        sessions = self._sessions
        limit = now_ms - 2 * self.window_ms
        n = 0
        while sessions:
            key, seen = next(iter(sessions.items()))
            if seen.last_ms >= limit:
                break
            del sessions[key]
            n += 1
        return n

    def statistics(self) -> ReplayStats:
        return ReplayStats(
            sessions=len(self._sessions),
            nonces=sum(len(s.nonces) for s in self._sessions.values()),
            refused=self._refused,
            evicted_live=self._evicted_live,
        )


def frame_kid(frame: Frame, keyring: KeyRing) -> str:
    """The id of the key of ``keyring`` that verified ``frame``'s ``sig``: its
    ``<kid>:`` prefix, or the ring's signing kid for a sig without one (what
    :meth:`KeyRing.check` checks such a sig against). Call it after the codec
    verified the frame."""
    kid, sep, _ = (frame.sig or "").partition(":")
    return kid if sep else keyring.signing_kid


class NonceStore(Protocol):
    """What :class:`DurableReplayGuard` needs of a store: :meth:`Store.record_nonce
    <atp_router.store.base.Store.record_nonce>` (every :class:`~atp_router.store.base.Store` has it)."""

    def record_nonce(self, tenant: str, kid: str, nonce: str, *, now_ms: int, expires_ms: int,
                     max_per_tenant: int) -> bool: ...


class DurableReplayGuard:
    """The replay check of the router's signed inbound frames (spec §11, issue 19):
    ``memory`` (a :class:`ReplayGuard`, per ``(tenant, session_id)``) first, then
    one :meth:`NonceStore.record_nonce` of ``(tenant, key id, meta.nonce)`` in
    ``store``, the authority shared by every process on it and kept across
    restarts (module docstring).

    ``check(tenant, frame, now_ms)`` accepts a frame once, after the codec
    verified its signature with ``keyring``. Raises ``LocalProtocolError(ESEC)``
    for what :meth:`ReplayGuard.check` refuses, a nonce the store holds (a
    replay: "recorded before"), a tenant holding ``max_per_tenant`` nonces, and a
    store that failed (:class:`~atp_router.store.base.StoreError`: refused, never
    accepted unchecked; logged with the error, which the client is not told). A frame refused for
    one of the last two reasons is forgotten by ``memory`` and may be sent again
    (a store write that timed out may have recorded it: then sign it anew).
    Raises ``ValueError`` for ``slack_ms < 1`` or ``max_per_tenant < 1``.
    """

    __slots__ = ("_full", "_replayed", "_unavailable", "keyring", "max_per_tenant", "memory", "slack_ms", "store")

    def __init__(self, store: NonceStore, keyring: KeyRing, *, memory: ReplayGuard | None = None,
                 slack_ms: int = DEFAULT_CLOCK_SLACK_MS, max_per_tenant: int = DEFAULT_MAX_NONCES_PER_TENANT):
        if slack_ms < 1 or max_per_tenant < 1:
            raise ValueError("slack_ms >= 1 and max_per_tenant >= 1 are required")
        self.store = store
        self.keyring = keyring
        self.memory = memory if memory is not None else ReplayGuard()
        self.slack_ms = slack_ms
        self.max_per_tenant = max_per_tenant
        self._replayed = self._full = self._unavailable = 0

    @property
    def window_ms(self) -> int:
        """The timestamp window (ms), the in-memory guard's."""
        return self.memory.window_ms

    def check(self, tenant: str, frame: Frame, now_ms: int) -> None:
        """Accept ``frame`` of ``tenant`` at router time ``now_ms`` (unix ms), or
        raise ``LocalProtocolError(ESEC)`` (see the class docstring)."""
        key = (tenant, frame.session_id)
        self.memory.check(key, frame, now_ms)  # malformed, outside the window, replayed in this session
        nonce: str = frame.meta["nonce"]
        kid = frame_kid(frame, self.keyring)
        try:
            fresh = self.store.record_nonce(tenant, kid, nonce, now_ms=now_ms,
                                            expires_ms=frame.meta["ts"] + self.memory.window_ms + self.slack_ms,
                                            max_per_tenant=self.max_per_tenant)
        except StoreLimitError:
            self.memory.forget(key, nonce)
            self._full += 1
            raise LocalProtocolError(ErrorCode.ESEC, f"too many signed frames: this tenant already holds "
                                     f"{self.max_per_tenant} nonces within the replay window; send again once "
                                     f"some expired (at most {(2 * self.window_ms + self.slack_ms) // 1000} s)") \
                from None
        except StoreError as e:  # StoreUnavailable, or any other failure of the store
            self.memory.forget(key, nonce)
            self._unavailable += 1
            log.warning("replay check of a signed frame of %s failed, frame refused: %s", tenant, e)
            what = "cannot be reached" if isinstance(e, StoreUnavailable) else "failed"
            raise LocalProtocolError(ErrorCode.ESEC, f"replay check unavailable: the router's nonce store {what}; "
                                     "the signed frame is refused rather than accepted unchecked — send it again "
                                     "later") from None
        if not fresh:
            self._replayed += 1
            raise LocalProtocolError(ErrorCode.ESEC, "replayed frame: meta.nonce was already used with this key "
                                     "(recorded by this router before a restart, another worker or another router)")

    def statistics(self) -> ReplayStats:
        """The in-memory guard's :class:`ReplayStats` with the store's refusals."""
        m = self.memory.statistics()
        return ReplayStats(sessions=m.sessions, nonces=m.nonces, refused=m.refused + self._replayed + self._full
                           + self._unavailable, evicted_live=m.evicted_live, store_replayed=self._replayed,
                           store_full=self._full, store_unavailable=self._unavailable)


def sign_outbound(frame: Frame, keyring: KeyRing, now_ms: int, *, nonce: str | None = None) -> Frame:
    """``frame`` with ``meta.nonce`` (fresh, 32 URL-safe characters, unless given)
    and ``meta.ts = now_ms`` (unix ms), sealed and signed with ``keyring``'s signing
    key (spec §4.5, §11): what a :class:`ReplayGuard` accepts once. Raises
    ``ValueError`` for a malformed ``nonce``."""
    if nonce is None:
        nonce = secrets.token_urlsafe(24)
    elif not NONCE_RE.match(nonce):
        raise ValueError("nonce: expected 16-128 URL-safe characters ([A-Za-z0-9_-])")
    return seal(msgspec.structs.replace(frame, meta={**frame.meta, "nonce": nonce, "ts": now_ms}), keyring=keyring)


# ------------------------------------------------------------------ usage summaries

NonNegInt = Annotated[int, Meta(ge=0)]
NonEmptyStr = Annotated[str, Meta(min_length=1, max_length=256)]

#: The JWS algorithm of usage summaries: EdDSA over Ed25519, under its fully
#: specified name (RFC 9864, which deprecates the polymorphic ``EdDSA``).
USAGE_ALG = "Ed25519"
#: The JWS ``typ`` header of usage summaries.
USAGE_TYP = "atp-usage+json"


class UsageSummary(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What a stream cost (spec §19): ``tokens`` (in + out), ``usd_micros`` (USD
    micros), ``calls`` (next-hop calls charged), ``rib_version`` (the RIB generation
    that routed it), ``closed_at_ms`` (unix ms), for ``tenant``'s stream
    ``session_id``/``stream_id``."""

    tenant: NonEmptyStr
    session_id: NonEmptyStr
    stream_id: NonEmptyStr
    tokens: NonNegInt
    usd_micros: NonNegInt
    calls: NonNegInt
    rib_version: NonNegInt
    closed_at_ms: NonNegInt


class UsageSignatureError(ValueError):
    """A usage JWS does not verify, or its payload is not a usage summary."""


def _canonical_usage(summary: dict[str, Any] | UsageSummary) -> bytes:
    if not isinstance(summary, UsageSummary):
        try:
            summary = msgspec.convert(summary, UsageSummary, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"usage summary: {e}") from None
    return msgspec.json.encode(summary, order="sorted")


class UsageSigner:
    """Signs usage summaries with an Ed25519 key (spec §19 billing abuse).

    ``sign(summary) -> str`` is a compact JWS, header ``{"alg": "Ed25519", "kid",
    "typ": "atp-usage+json"}``, payload the canonical JSON of a
    :class:`UsageSummary` (sorted keys, compact). ``kid`` is the key's RFC 7638
    thumbprint, also in :meth:`public_jwk`.
    """

    __slots__ = ("_key", "kid")

    def __init__(self, key: OKPKey):
        if not isinstance(key, OKPKey) or key.curve_name != "Ed25519" or not key.is_private:
            raise ValueError("UsageSigner needs a private Ed25519 OKPKey")
        self._key = key
        self.kid: str = key.thumbprint()

    @classmethod
    def generate(cls) -> UsageSigner:
        """A signer with a fresh key (nothing written)."""
        return cls(OKPKey.generate_key("Ed25519"))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> UsageSigner:
        """The signer whose private key is the PEM (PKCS #8) file ``path``, created
        with mode 0600 holding a fresh key if missing.

        Raises ``PermissionError`` when an existing file is readable or writable by
        group or others, ``ValueError`` when it is not an Ed25519 private key, and
        ``OSError`` from the file system.
        """
        p = Path(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            mode = p.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise PermissionError(f"usage key {p} has mode {stat.S_IMODE(mode):04o}: it must be readable by its "
                                      f"owner only (chmod 600 {p})") from None
            pem = p.read_bytes()
        else:
            pem = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
        try:
            return cls(OKPKey.import_key(pem))
        except (JoseError, ValueError, TypeError):
            raise ValueError(f"usage key {p}: not an Ed25519 private key in PEM") from None

    def public_jwk(self) -> dict[str, Any]:
        """The public key as a JWK (RFC 8037): ``{kty: "OKP", crv: "Ed25519", x, kid,
        alg: "Ed25519", use: "sig"}`` — what ``GET /v1/keys`` serves."""
        jwk = self._key.as_dict(private=False)
        jwk.update(kid=self.kid, alg=USAGE_ALG, use="sig")
        return jwk

    def sign(self, summary: dict[str, Any] | UsageSummary) -> str:
        """A compact JWS over ``summary``'s canonical JSON. Raises ``ValueError`` when
        ``summary`` is not a :class:`UsageSummary` shape (fields, types, ≥ 0)."""
        header = {"alg": USAGE_ALG, "kid": self.kid, "typ": USAGE_TYP}
        return jws.serialize_compact(header, _canonical_usage(summary), self._key, algorithms=[USAGE_ALG])


def verify_usage(token: str, jwk: dict[str, Any]) -> dict[str, Any]:
    """The usage summary ``token`` (a compact JWS from a FINAL's telemetry) signs,
    after checking it against the router's public ``jwk`` (``GET /v1/keys``).

    Returns ``{tenant, session_id, stream_id, tokens, usd_micros, calls,
    rib_version, closed_at_ms}``. Raises :class:`UsageSignatureError` for a bad
    signature, another algorithm or key id, or a payload that is not a summary.
    """
    try:
        key = OKPKey.import_key(jwk)
        obj = jws.deserialize_compact(token, key, algorithms=[USAGE_ALG])
    except (JoseError, ValueError, TypeError) as e:
        raise UsageSignatureError(f"usage signature does not verify: {type(e).__name__}: {e}") from None
    if obj.headers().get("alg") != USAGE_ALG:
        raise UsageSignatureError(f"usage signature: expected alg {USAGE_ALG}")
    kid = jwk.get("kid")
    if kid is not None and obj.headers().get("kid") != kid:
        raise UsageSignatureError("usage signature: signed by another key id than the JWK's")
    try:
        return msgspec.to_builtins(msgspec.json.decode(obj.payload, type=UsageSummary))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise UsageSignatureError(f"usage payload is not a usage summary: {e}") from None

