"""Who is calling (spec §11 AuthN): one authenticator for the HTTP API, the
WebSocket ingress and the A2A server.

A caller proves who it is in one of three ways, tried in this order:

1. **mTLS** — a verified client certificate (see :mod:`atp_router.security.tls`) whose
   subjectAltName (``"DNS:agent-a.internal"``, ``"URI:spiffe://corp/router-b"``)
   the ``mtls.identities`` map names;
2. **JWT / OIDC** — ``Authorization: Bearer <header.payload.signature>``, verified
   with joserfc against the issuer's JWKS (a file, or a URL fetched by
   :meth:`Authenticator.run`): signature, algorithm allow-list, ``iss``, ``aud``,
   ``exp`` and ``nbf``/``iat`` with a bounded leeway; the tenant and roles come
   from claims, the subject from ``sub``;
3. **API key** — ``Authorization: Bearer <secret>``: the router keeps only
   ``sha256(secret)`` and confirms a match with :func:`hmac.compare_digest`.

Keys come from the ``--auth FILE`` YAML (:class:`AuthConfig`)::

    api_keys:
      - {id: alice-ci, tenant: alice, roles: [client], sha256: "<64 hex of sha256(secret)>"}
    jwt:                          # optional
      issuer: "https://idp.example"
      audience: "atp-router"
      jwks_file: "jwks.json"      # exactly one of jwks_file (relative to FILE) / jwks_url
      jwks_refresh_s: 300
      leeway_s: 30                # at most 300
      algorithms: [RS256, ES256, EdDSA]
      tenant_claim: tenant
      roles_claim: roles
    mtls:                         # optional
      identities:
        - {san: "URI:spiffe://corp/router-b", tenant: routerb, roles: [client]}

and from the legacy ``ATP_ROUTER_TOKENS`` (:func:`parse_tokens_env`). A refusal is
:class:`AuthError` (``ESEC``, HTTP 401); its reason never contains the credential.

Everything but :meth:`Authenticator.run` (the JWKS refresher) and the JWKS file
reads is sans-IO: time is passed in as ``now`` (unix time, s).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import msgspec
import trio
import yaml
from joserfc import jwt
from joserfc.errors import (
    BadSignatureError,
    ClaimError,
    ExpiredTokenError,
    InvalidKeyIdError,
    JoseError,
    MissingClaimError,
    UnsupportedAlgorithmError,
)
from joserfc.jwk import KeySet
from joserfc.jws import JWSRegistry
from msgspec import Meta, Struct

from atp_router.security.identity import ANONYMOUS, TENANT_RE, Identity, Role
from atp_router.security.tls import SAN_KINDS, san_names
from atp_router.wire.errors import ATPError, ErrorCode

__all__ = [
    "ASYMMETRIC_ALGORITHMS",
    "ApiKeySpec",
    "AuthConfig",
    "AuthConfigError",
    "AuthError",
    "AuthStatistics",
    "Authenticator",
    "JwtSpec",
    "MtlsIdentitySpec",
    "MtlsSpec",
    "load_auth_config",
    "new_api_key",
    "parse_tokens_env",
]

log = logging.getLogger("atp_router.security.authn")

#: JWS algorithms a JWKS may verify: asymmetric only (an ``HS*`` token "signed"
#: with a public key as the HMAC secret must never verify; ``none`` never).
ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
     "ES256", "ES384", "ES512", "ES256K", "EdDSA", "Ed25519", "Ed448"}
)
#: A bearer credential longer than this (bytes) is refused unread.
MAX_TOKEN_BYTES = 8192
#: A JWKS document (file or URL) larger than this is refused (1 MiB).
MAX_JWKS_BYTES = 1 << 20
#: How long one JWKS URL fetch may take, s.
JWKS_FETCH_TIMEOUT_S = 10.0
#: A failed JWKS fetch is retried after at most this long, s.
JWKS_RETRY_S = 30.0
#: An unknown ``kid`` triggers an early JWKS refresh at most this often, s.
KID_REFRESH_MIN_S = 30.0

_HEX64 = r"^[0-9a-fA-F]{64}\Z"
_KEY_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}\Z"
_PATTERN_HINTS = {
    "sha256": "expected 64 hex digits (the sha256 of the secret)",
    "id": "expected a key id of letters, digits and ._:@- (at most 128)",
}
_MSG_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)

Roles = Annotated[tuple[Role, ...], Meta(min_length=1)]
NonEmpty = Annotated[str, Meta(min_length=1)]


# ---------------------------------------------------------------------- errors


class AuthError(ATPError):
    """The caller could not be authenticated (spec §11): code ``ESEC``, HTTP
    ``status`` 401. ``reason`` says why without echoing the credential;
    ``www_authenticate`` is the ``WWW-Authenticate`` header value to answer with."""

    status = 401

    def __init__(self, reason: str, *, invalid_token: bool = True):
        super().__init__(ErrorCode.ESEC, reason)
        self.www_authenticate = 'Bearer realm="atp", error="invalid_token"' if invalid_token else 'Bearer realm="atp"'


class AuthConfigError(ValueError):
    """An auth configuration was refused: ``file`` and ``key`` (a dotted path such
    as ``api_keys[1].sha256``) locate the fault; ``str()`` reads
    ``<file>: <key>: <detail>``."""

    def __init__(self, file: str, key: str, detail: str):
        self.file = file
        self.key = key
        self.detail = detail
        super().__init__(f"{file}: {key}: {detail}")


# ---------------------------------------------------------------------- config


class ApiKeySpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One API key: ``id`` names it in the audit trail (letters, digits, ``._:@-``,
    at most 128); ``tenant`` the RIB client it acts for; ``roles`` (default
    ``[client]``); ``sha256`` the 64 hex digits of sha256(secret) — the secret
    itself is never stored."""

    id: Annotated[str, Meta(pattern=_KEY_ID)]
    tenant: str
    roles: Roles = (Role.CLIENT,)
    sha256: Annotated[str, Meta(pattern=_HEX64)]


class JwtSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """OIDC bearer tokens: accepted when signed by a key of the JWKS (exactly one of
    ``jwks_file`` — relative to the auth file — or ``jwks_url``: https, or http on
    a loopback host) with an algorithm of ``algorithms`` (asymmetric only), ``iss``
    equal to ``issuer``, ``aud`` naming ``audience``, ``exp`` present and not past,
    ``nbf``/``iat`` not in the future, each with ``leeway_s`` (int s, 0-300) of clock
    skew (``algorithms`` default: RS256, ES256, Ed25519, EdDSA — joserfc warns that
    RFC 9864 deprecates ``EdDSA`` for ``Ed25519``). ``tenant_claim`` names the
    claim holding the tenant, ``roles_claim`` the list of role names. The JWKS is re-read every ``jwks_refresh_s`` (s, ≥ 1)."""

    issuer: NonEmpty
    audience: NonEmpty
    jwks_file: str | None = None
    jwks_url: str | None = None
    jwks_refresh_s: Annotated[float, Meta(ge=1.0, le=86400.0)] = 300.0
    leeway_s: Annotated[int, Meta(ge=0, le=300)] = 30
    algorithms: Annotated[tuple[str, ...], Meta(min_length=1)] = ("RS256", "ES256", "Ed25519", "EdDSA")
    tenant_claim: NonEmpty = "tenant"
    roles_claim: NonEmpty = "roles"


class MtlsIdentitySpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A client-certificate subjectAltName (``DNS:…``, ``URI:…``, ``IP:…``,
    ``email:…``, as :func:`atp_router.security.tls.san_names` spells them) and the
    identity it proves."""

    san: NonEmpty
    tenant: str
    roles: Roles = (Role.CLIENT,)


class MtlsSpec(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    identities: Annotated[tuple[MtlsIdentitySpec, ...], Meta(min_length=1)]


class AuthConfig(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The ``--auth FILE`` document (see the module docstring). Empty: no
    credential from the file."""

    api_keys: tuple[ApiKeySpec, ...] = ()
    jwt: JwtSpec | None = None
    mtls: MtlsSpec | None = None


def _translate(err: msgspec.ValidationError, file: str) -> AuthConfigError:
    m = _MSG_RE.match(str(err))
    assert m is not None  # the pattern matches any string
    msg, path = m.group("msg"), (m.group("path") or "").lstrip(".")
    if field := re.match(r"Object (?:contains unknown|missing required) field `(.+)`$", msg):
        path = f"{path}.{field.group(1)}" if path else field.group(1)
    elif msg.startswith("Expected `str` matching regex"):
        msg = _PATTERN_HINTS.get(path.rpartition(".")[2], msg)
    return AuthConfigError(file, path or "$", msg.replace("`", ""))


def _check_tenant(tenant: str, file: str, key: str) -> None:
    if not TENANT_RE.fullmatch(tenant):
        raise AuthConfigError(file, key, f"invalid tenant name {tenant!r} (letters, digits and ._-, at most 64)")


def _check_san(san: str, file: str, key: str) -> None:
    kind, sep, value = san.partition(":")
    if not sep or kind not in SAN_KINDS or not value:
        raise AuthConfigError(file, key, f"expected one of {', '.join(k + ':…' for k in SAN_KINDS)}, got {san!r}")


def _check_jwks_url(url: str, file: str, key: str) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "https" and not (parts.scheme == "http" and loopback):
        raise AuthConfigError(file, key, "expected an https:// URL (http:// only on a loopback host)")


def validate_auth_config(config: AuthConfig, file: str = "<auth>") -> AuthConfig:
    """Check what the schema cannot: tenant names, SAN forms, duplicate key ids,
    hashes and SANs, one JWKS source, the algorithm allow-list. Returns ``config``;
    raises :class:`AuthConfigError` naming ``file`` and the key."""
    ids: set[str] = set()
    hashes: set[str] = set()
    for i, k in enumerate(config.api_keys):
        _check_tenant(k.tenant, file, f"api_keys[{i}].tenant")
        if k.id in ids:
            raise AuthConfigError(file, f"api_keys[{i}].id", f"key id {k.id!r} given twice")
        if k.sha256.lower() in hashes:
            raise AuthConfigError(file, f"api_keys[{i}].sha256", "the same key hash is given twice")
        ids.add(k.id)
        hashes.add(k.sha256.lower())
    if (j := config.jwt) is not None:
        if (j.jwks_file is None) == (j.jwks_url is None):
            raise AuthConfigError(file, "jwt", "expected exactly one of jwks_file and jwks_url")
        if j.jwks_url is not None:
            _check_jwks_url(j.jwks_url, file, "jwt.jwks_url")
        for i, alg in enumerate(j.algorithms):
            if alg not in ASYMMETRIC_ALGORITHMS:
                raise AuthConfigError(file, f"jwt.algorithms[{i}]", f"algorithm {alg!r} not allowed "
                                      f"(expected one of: {', '.join(sorted(ASYMMETRIC_ALGORITHMS))})")
    if config.mtls is not None:
        sans: set[str] = set()
        for i, m in enumerate(config.mtls.identities):
            _check_san(m.san, file, f"mtls.identities[{i}].san")
            _check_tenant(m.tenant, file, f"mtls.identities[{i}].tenant")
            if m.san in sans:
                raise AuthConfigError(file, f"mtls.identities[{i}].san", f"SAN {m.san!r} given twice")
            sans.add(m.san)
    return config


def load_auth_config(path: str | Path) -> AuthConfig:
    """Read and validate the ``--auth`` YAML file. Raises :class:`AuthConfigError`
    (a ``ValueError``) naming the file and the key on any fault."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AuthConfigError(file, "$", f"cannot read: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AuthConfigError(file, "$", f"invalid YAML: {e}") from None
    try:
        config = msgspec.convert({} if data is None else data, AuthConfig)
    except msgspec.ValidationError as e:
        raise _translate(e, file) from None
    return validate_auth_config(config, file)


def new_api_key(key_id: str, tenant: str, roles: Iterable[Role | str] = (Role.CLIENT,)) -> tuple[str, dict[str, Any]]:
    """A fresh API key: ``(secret, entry)`` where ``secret`` is ``atp_`` + 43
    url-safe characters (256 random bits), shown once to the operator, and
    ``entry`` the ``api_keys`` YAML item holding only its sha256. Raises
    ``ValueError`` on a bad id, tenant or role."""
    entry = {"id": key_id, "tenant": tenant, "roles": [str(Role(r)) for r in roles], "sha256": ""}
    secret = "atp_" + secrets.token_urlsafe(32)
    entry["sha256"] = hashlib.sha256(secret.encode()).hexdigest()
    try:
        validate_auth_config(msgspec.convert({"api_keys": [entry]}, AuthConfig), "<new key>")
    except msgspec.ValidationError as e:
        raise _translate(e, "<new key>") from None
    return secret, entry


@dataclass(frozen=True, slots=True)
class EnvToken:
    """One ``ATP_ROUTER_TOKENS`` entry, hashed: ``digest`` is sha256(token)."""

    identity: Identity
    digest: bytes


def parse_tokens_env(value: str) -> list[EnvToken]:
    """``ATP_ROUTER_TOKENS``: comma-separated entries, each ``name:token`` (tenant
    ``name``), ``name:token:role+role`` (roles among admin, operator, client; the
    default is client) or a bare token (tenant ``tok_<first 12 hex of sha256>``).
    A token may contain ``:``; a last ``:``-part made only of role names is the
    role list. Only sha256(token) is kept. Raises ``ValueError`` (never quoting a
    token) on a bad or repeated name, an empty token, or a token given twice."""
    out: list[EnvToken] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for n, entry in enumerate((e.strip() for e in value.split(",")), 1):
        if not entry:
            continue
        name, sep, token = entry.partition(":")
        roles = frozenset({Role.CLIENT})
        if not sep:
            token, name = entry, ""
        else:
            head, sep2, tail = token.rpartition(":")
            parts = tail.split("+")
            if sep2 and head and all(p in Role._value2member_map_ for p in parts):
                token, roles = head, frozenset(Role(p) for p in parts)
            if not TENANT_RE.fullmatch(name) or not token:
                raise ValueError(f"ATP_ROUTER_TOKENS entry {n}: expected name:token[:role+role] with a name of "
                                 "letters, digits and ._- (at most 64)")
            if name in names:
                raise ValueError(f"ATP_ROUTER_TOKENS: client {name!r} given twice")
            names.add(name)
        digest = hashlib.sha256(token.encode()).digest()
        if digest in digests:
            raise ValueError("ATP_ROUTER_TOKENS: the same token is given twice")
        digests.add(digest)
        tenant = name or "tok_" + digest.hex()[:12]
        out.append(EnvToken(Identity(tenant, roles, f"env:{tenant}", "api_key"), digest))
    return out


# ------------------------------------------------------------------------ JWKS


def _parse_jwks(data: bytes, source: str) -> KeySet:
    """A JWKS document → its asymmetric keys. Raises ``ValueError`` naming ``source``."""
    if len(data) > MAX_JWKS_BYTES:
        raise ValueError(f"{source}: JWKS over {MAX_JWKS_BYTES} bytes")
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            # a bad document, not a bad argument:
            raise ValueError("expected a JSON object with a 'keys' list")  # noqa: TRY004
        # An HMAC ("oct") key in a public key set could only serve algorithm confusion.
        keys = [k for k in doc["keys"] if isinstance(k, dict) and k.get("kty") != "oct"]
        return KeySet.import_key_set({"keys": keys})
    except (ValueError, TypeError, KeyError, JoseError) as e:
        raise ValueError(f"{source}: invalid JWKS: {e}") from None


def _file_signature(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return (st.st_mtime_ns, st.st_size, st.st_ino)


@dataclass(frozen=True, slots=True)
class AuthStatistics:
    """JWKS counters: ``jwks_loads`` successful (re)loads, ``jwks_failures`` failed
    fetches or reads, ``jwks_keys`` keys in the current set, ``kid_misses`` tokens
    naming a key id the set lacks."""

    jwks_loads: int
    jwks_failures: int
    jwks_keys: int
    kid_misses: int


class _Jwt:
    """Verification of OIDC bearer tokens against a cached JWKS (sans-IO but for
    the file reads of :meth:`check_file`)."""

    def __init__(self, spec: JwtSpec, base_dir: Path, file: str):
        self.spec = spec
        self.registry = JWSRegistry(algorithms=list(spec.algorithms))
        self.file = (base_dir / spec.jwks_file) if spec.jwks_file is not None else None
        self.keys: KeySet | None = None
        self.loads = self.failures = self.kid_misses = 0
        self.kid_missed = trio.Event()
        self._sig: tuple[int, int, int] | None = None
        self._checked_at = -math.inf
        if self.file is not None:
            try:
                self.check_file(force=True, strict=True)
            except ValueError as e:
                raise AuthConfigError(file, "jwt.jwks_file", str(e)) from None

    def check_file(self, *, force: bool, now: float = 0.0, strict: bool = False) -> bool:
        """Re-read the JWKS file if it changed (at most every ``jwks_refresh_s`` of
        unix time ``now``, s, unless ``force``). Returns whether a new key set was loaded; a bad file
        keeps the last good set (logged) unless ``strict`` (then ``ValueError``)."""
        assert self.file is not None
        if not force:
            if now - self._checked_at < self.spec.jwks_refresh_s:
                return False
            self._checked_at = now
        try:
            sig = _file_signature(self.file)
            if sig == self._sig:
                return False
            with self.file.open("rb") as f:
                data = f.read(MAX_JWKS_BYTES + 1)
            keys = _parse_jwks(data, str(self.file))
        except (OSError, ValueError) as e:
            self.failures += 1
            if strict:
                raise ValueError(str(e)) from None
            log.error("JWKS reload failed, keeping the last good key set: %s", e)
            return False
        self._sig, self.keys = sig, keys
        self.loads += 1
        log.info("JWKS loaded from %s: %d key(s)", self.file, len(keys.keys))
        return True

    def install(self, keys: KeySet) -> None:
        self.keys = keys
        self.loads += 1

    def verify(self, token: str, now: float) -> Identity:
        """The identity a JWT proves at unix time ``now`` (s). Raises AuthError."""
        spec = self.spec
        if self.keys is None:
            raise AuthError("no JWKS loaded yet")
        try:
            tok = jwt.decode(token, self.keys, registry=self.registry)
        except InvalidKeyIdError:
            self.kid_misses += 1
            self.kid_missed.set()
            raise AuthError("JWT signed by an unknown key id") from None
        except UnsupportedAlgorithmError:
            raise AuthError("JWT algorithm not allowed") from None
        except BadSignatureError:
            raise AuthError("JWT signature invalid") from None
        except (JoseError, ValueError, TypeError, KeyError):
            raise AuthError("malformed JWT") from None
        claims = tok.claims
        registry = jwt.JWTClaimsRegistry(
            now=int(now),
            leeway=spec.leeway_s,
            iss={"essential": True, "value": spec.issuer},
            aud={"essential": True, "value": spec.audience},
            exp={"essential": True},
            sub={"essential": True},
        )
        try:
            registry.validate(claims)
        except ExpiredTokenError:
            raise AuthError("JWT expired") from None
        except MissingClaimError as e:
            raise AuthError(f"JWT claim missing: {e.claim}") from None
        except ClaimError as e:
            detail = ": not yet valid" if e.claim == "nbf" else ""
            raise AuthError(f"JWT claim {e.claim!r} invalid{detail}") from None
        sub = claims["sub"]
        if len(sub) > 256:
            raise AuthError("JWT claim 'sub' over 256 characters")
        tenant = claims.get(spec.tenant_claim)
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise AuthError(f"JWT claim {spec.tenant_claim!r} missing or not a tenant name")
        names = claims.get(spec.roles_claim)
        if not isinstance(names, list) or not names or not all(isinstance(r, str) for r in names):
            raise AuthError(f"JWT claim {spec.roles_claim!r} missing or not a list of role names")
        for r in names:
            if r not in Role._value2member_map_:
                raise AuthError(f"JWT claim {spec.roles_claim!r}: unknown role {r[:32]!r}")
        return Identity(tenant, frozenset(Role(r) for r in names), sub, "jwt")


# --------------------------------------------------------------- authenticator


@dataclass(frozen=True, slots=True)
class _Key:
    digest: bytes
    identity: Identity


class Authenticator:
    """The one authenticator every ingress calls (spec §11 AuthN).

    Build it with :meth:`from_sources`; ``enabled`` is ``False`` when no credential
    is configured and no auth file was given (every caller is then
    :data:`~atp_router.security.identity.ANONYMOUS`). An auth file with every credential
    removed (``required=True``) keeps authentication on and refuses everyone: an
    operator who revoked the last key gets a closed router, never an open one.
    When a ``jwt`` section is configured, run :meth:`run` in a nursery
    (``await nursery.start(auth.run)``): it keeps the JWKS fresh.
    ``kid_refresh_min_s`` (s) bounds how often an unknown ``kid`` forces an early
    JWKS refresh (default :data:`KID_REFRESH_MIN_S`).
    """

    def __init__(self, config: AuthConfig | None = None, *, env_tokens: Iterable[EnvToken] = (),
                 base_dir: Path = Path("."), file: str = "<auth>", required: bool = False):
        config = validate_auth_config(config or AuthConfig(), file)
        self._keys: dict[bytes, _Key] = {}
        for k in config.api_keys:
            digest = bytes.fromhex(k.sha256)
            self._keys[digest] = _Key(digest, Identity(k.tenant, frozenset(k.roles), k.id, "api_key"))
        for t in env_tokens:
            if t.digest in self._keys:
                raise AuthConfigError(file, "ATP_ROUTER_TOKENS", "a token is also an api_keys entry of the file")
            self._keys[t.digest] = _Key(t.digest, t.identity)
        self._mtls: dict[str, Identity] = {}
        if config.mtls is not None:
            for m in config.mtls.identities:
                self._mtls[m.san] = Identity(m.tenant, frozenset(m.roles), m.san, "mtls")
        self._jwt = _Jwt(config.jwt, base_dir, file) if config.jwt is not None else None
        self.enabled = bool(required or self._keys or self._mtls or self._jwt)
        self.kid_refresh_min_s = KID_REFRESH_MIN_S

    @classmethod
    def from_sources(cls, *, auth_file: Path | None, tokens_env: str | None) -> Authenticator:
        """Load ``auth_file`` (``--auth``; None: none) and ``tokens_env`` (the value
        of ``ATP_ROUTER_TOKENS``; None or empty: none). Raises ``ValueError``
        (:class:`AuthConfigError` for the file) on any fault, naming the source and key."""
        config = load_auth_config(auth_file) if auth_file is not None else AuthConfig()
        env = parse_tokens_env(tokens_env) if tokens_env else []
        base = auth_file.parent if auth_file is not None else Path(".")
        return cls(config, env_tokens=env, base_dir=base, file=str(auth_file or "<auth>"),
                   required=auth_file is not None)

    # ------------------------------------------------------------- per request
    def authenticate(self, authorization: str | None, *, now: float, peer_cert: dict | None = None) -> Identity:
        """The identity of a caller: ``authorization`` is the ``Authorization``
        header value (or None), ``now`` unix time in s, ``peer_cert`` the verified
        client certificate (``SSLSocket.getpeercert()`` shape; see
        :func:`atp_router.security.tls.peer_cert_of`) or None. A certificate whose SAN
        the ``mtls`` map names wins; then a bearer JWT (three dot-separated parts,
        when ``jwt`` is configured) or API key. Raises :class:`AuthError`."""
        if not self.enabled:
            return ANONYMOUS
        if peer_cert and self._mtls:
            for san in san_names(peer_cert):
                ident = self._mtls.get(san)
                if ident is not None:
                    return ident
        if authorization is None:
            raise AuthError("missing credentials: expected Authorization: Bearer", invalid_token=False)
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise AuthError("unsupported authorization scheme: expected Bearer", invalid_token=False)
        token = token.strip()
        if not token:
            raise AuthError("empty bearer token")
        if len(token) > MAX_TOKEN_BYTES:
            raise AuthError(f"bearer token over {MAX_TOKEN_BYTES} bytes")
        digest = hashlib.sha256(token.encode()).digest()
        key = self._keys.get(digest)
        # The lookup is keyed by the hash (nothing to learn about the secret from
        # its timing); compare_digest confirms the match in constant time.
        if key is not None and hmac.compare_digest(key.digest, digest):
            return key.identity
        if self._jwt is not None and token.count(".") == 2:
            return self._jwt.verify(token, now)
        raise AuthError("unknown bearer token")

    def authenticate_headers(self, headers: Iterable[tuple[bytes | str, bytes | str]], *, now: float,
                             peer_cert: dict | None = None) -> Identity:
        """:meth:`authenticate` from request headers: (name, value) pairs as bytes
        (ASGI ``scope["headers"]``, trio-websocket ``request.headers``) or str."""
        authorization: str | None = None
        for name, value in headers:
            n = name.decode("latin-1") if isinstance(name, bytes) else name
            if n.lower() == "authorization":
                authorization = value.decode("latin-1") if isinstance(value, bytes) else value
                break
        return self.authenticate(authorization, now=now, peer_cert=peer_cert)

    # -------------------------------------------------------------------- JWKS
    def maybe_reload(self, now: float) -> bool:
        """Re-read the JWKS file if ``jwks_refresh_s`` passed since the last check
        (``now``: unix time, s) and its mtime, size or inode changed. Returns
        whether a new key set is in use; a bad file keeps the old set (logged).
        False without a ``jwks_file``."""
        if self._jwt is None or self._jwt.file is None:
            return False
        return self._jwt.check_file(force=False, now=now)

    def statistics(self) -> AuthStatistics:
        j = self._jwt
        if j is None:
            return AuthStatistics(0, 0, 0, 0)
        return AuthStatistics(j.loads, j.failures, len(j.keys.keys) if j.keys else 0, j.kid_misses)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the JWKS fresh until cancelled: re-read the file or fetch the URL
        (httpx; at most :data:`MAX_JWKS_BYTES`, :data:`JWKS_FETCH_TIMEOUT_S`) every
        ``jwks_refresh_s``, and early — at most once per ``kid_refresh_min_s`` —
        when a token named an unknown ``kid``. A failed fetch keeps the last good
        set, is logged and retried within :data:`JWKS_RETRY_S`. With a URL,
        ``task_status.started()`` comes after the first fetch (successful or
        not). Returns at once when no ``jwt`` section is configured."""
        j = self._jwt
        if j is None:
            task_status.started()
            return
        async with httpx.AsyncClient(follow_redirects=False) as client:
            ok = await self._refresh(client, force=True)
            task_status.started()
            last_early = -math.inf
            while True:
                interval = j.spec.jwks_refresh_s if ok else min(j.spec.jwks_refresh_s, JWKS_RETRY_S)
                with trio.move_on_after(interval):
                    await j.kid_missed.wait()
                if j.kid_missed.is_set():
                    wait = last_early + self.kid_refresh_min_s - trio.current_time()
                    if wait > 0:
                        await trio.sleep(wait)
                    last_early = trio.current_time()
                    j.kid_missed = trio.Event()  # misses during the wait are served by this refresh
                ok = await self._refresh(client, force=True)

    async def _refresh(self, client: httpx.AsyncClient, *, force: bool) -> bool:
        j = self._jwt
        assert j is not None
        if j.file is not None:
            j.check_file(force=force)
            return True
        url = j.spec.jwks_url
        assert url is not None
        try:
            with trio.fail_after(JWKS_FETCH_TIMEOUT_S):
                async with client.stream("GET", url, headers={"accept": "application/json"}) as resp:
                    if resp.status_code != 200:
                        raise ValueError(f"{url}: HTTP {resp.status_code}")
                    buf = bytearray()
                    async for chunk in resp.aiter_bytes():
                        buf += chunk
                        if len(buf) > MAX_JWKS_BYTES:
                            raise ValueError(f"{url}: JWKS over {MAX_JWKS_BYTES} bytes")
            keys = _parse_jwks(bytes(buf), url)
        except (httpx.HTTPError, trio.TooSlowError, ValueError, OSError) as e:
            j.failures += 1
            log.error("JWKS fetch failed, keeping the last good key set: %s", e or type(e).__name__)
            return False
        j.install(keys)
        log.info("JWKS fetched from %s: %d key(s)", url, len(keys.keys))
        return True
