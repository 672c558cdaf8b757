"""Per-frame cost of the router's trust checks (spec §11) beside the codec floor.

Run: ``python bench/bench_security.py [--repeat N] [--seconds S]``. Plain script, < 30 s.

Every row is one ~1.3 KB signed frame (``bench_codec.realistic_frame`` with
``meta.nonce``/``meta.ts``), or one request, through what the ingresses do with it:

* API-key authentication (``Authenticator.authenticate_headers``: sha256 of the
  token, dict look-up, ``hmac.compare_digest``) — once per HTTP request and once
  per WebSocket connection;
* JWT (RS256) verification — once per request/connection for OIDC callers;
* decode + checksums + HMAC with a two-key ring (key id in ``sig``);
* the replay check (:class:`~atp_router.security.signing.ReplayGuard`: nonce cache + ts window);
* the sum a frame posted to ``/v1/streams/{id}/frames`` pays: API key + decode +
  HMAC + replay.

The floor is ``msgspec`` decoding the same bytes into ``Frame`` (no checks at all),
measured in the same run; the ratio says what the trust checks cost on top of it.

Then the sandbox every local next-hop runs in (:mod:`atp_router.adapters.tools.sandbox`,
bubblewrap + cgroups): ``true`` and ``ruff --version`` run ``--sandbox-runs`` times
each directly (``subprocess``) and in a fresh sandbox (``Sandbox.run``: namespaces,
mounts, the copy of an empty work tree, the run's cgroups made and removed), medians
of the same run. The last line, ``SANDBOX startup_ms p50=… tool_ms p50=…``, is the
sandbox's start-up cost per run (sandboxed ``true`` − direct ``true``) beside the
tool's own run time (direct ``ruff --version``). ``--sandbox-runs 0`` skips it;
where no sandbox can be made it prints why.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import best_us, realistic_frame

from atp_router.security.authn import ApiKeySpec, AuthConfig, Authenticator, JwtSpec
from atp_router.security.signing import ReplayGuard, sign_outbound
from atp_router.wire.codec import FrameCodec, KeyRing
from atp_router.wire.frame import Frame


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="repeats per case; the best is reported")
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per case (s)")
    ap.add_argument("--sandbox-runs", type=int, default=20, help="runs per sandbox case (0: skip them)")
    ap.add_argument("--only-sandbox", action="store_true", help="only the sandbox cases")
    args = ap.parse_args(argv)
    if args.only_sandbox:
        return sandbox_costs(args.sandbox_runs)

    ring = KeyRing({"k2": secrets.token_bytes(32), "k1": secrets.token_bytes(32)})
    codec = FrameCodec("json", keyring=ring)
    now_ms = int(time.time() * 1000)
    # Distinct nonces so the replay guard sees fresh frames; the session key changes
    # every lap so a nonce is never seen twice for one key.
    wires = [codec.encode(sign_outbound(realistic_frame(), ring, now_ms), seal_frame=False) for _ in range(2048)]
    decoded = [codec.decode(w) for w in wires]
    floor_dec = msgspec.json.Decoder(Frame)

    api_secret = "atp_" + secrets.token_urlsafe(32)
    rsa = RSAKey.generate_key(2048, parameters={"kid": "bench"})
    jwks = Path(tempfile.gettempdir()) / f"atp-bench-jwks-{secrets.token_hex(4)}.json"
    jwks.write_text(msgspec.json.encode(KeySet([rsa]).as_dict(private=False)).decode())
    auth = Authenticator(AuthConfig(
        api_keys=(msgspec.convert({"id": "bench", "tenant": "alice", "roles": ["client"],
                                   "sha256": hashlib.sha256(api_secret.encode()).hexdigest()},
                                  type=ApiKeySpec),),
        jwt=JwtSpec(issuer="https://idp.example", audience="atp-router", jwks_file=str(jwks)),
    ), base_dir=jwks.parent)
    now = time.time()
    token = jwt.encode({"alg": "RS256", "kid": "bench"},
                       {"iss": "https://idp.example", "aud": "atp-router", "sub": "svc-ci", "tenant": "alice",
                        "roles": ["client"], "exp": int(now) + 3600, "iat": int(now)}, rsa)
    api_headers = [(b"host", b"127.0.0.1:7070"), (b"authorization", b"Bearer " + api_secret.encode()),
                   (b"content-type", b"application/json")]
    jwt_header = "Bearer " + token
    assert auth.authenticate_headers(api_headers, now=now).tenant == "alice"
    assert auth.authenticate(jwt_header, now=now).subject == "svc-ci"
    jwks.unlink()

    state = {"i": 0, "lap": 0}
    guard = ReplayGuard()

    def next_index() -> int:
        i = state["i"]
        state["i"] = i + 1
        if state["i"] == len(wires):
            state["i"] = 0
            state["lap"] += 1
        return i

    def floor() -> object:
        return floor_dec.decode(wires[0])

    def api_key() -> object:
        return auth.authenticate_headers(api_headers, now=now)

    def jwt_verify() -> object:
        return auth.authenticate(jwt_header, now=now)

    def decode_hmac() -> object:
        return codec.decode(wires[0])

    def replay() -> object:
        i = next_index()
        return guard.check(("alice", state["lap"]), decoded[i], now_ms)

    def http_frame() -> object:
        auth.authenticate_headers(api_headers, now=now)
        i = next_index()
        f = codec.decode(wires[i])
        guard.check(("bob", state["lap"]), f, now_ms)
        return f

    cases: list[tuple[str, Callable[[], object]]] = [
        ("API-key authentication (per request)", api_key),
        ("JWT RS256 verification (per request)", jwt_verify),
        ("decode + checksums + HMAC (2-key ring)", decode_hmac),
        ("replay check (nonce + ts window)", replay),
        ("HTTP frame: API key + decode + HMAC + replay", http_frame),
    ]
    print(f"frame: {len(wires[0])} B JSON, signed (kid {ring.signing_kid}); python {sys.version.split()[0]}")
    print(f"{'case':<46} {'µs':>8} {'per s':>10} {'floor µs':>9} {'ratio':>6}")
    for name, fn in cases:
        us, floor_us = best_us([fn, floor], repeat=args.repeat, budget_s=args.seconds)
        print(f"{name:<46} {us:>8.2f} {1e6 / us:>10,.0f} {floor_us:>9.2f} {us / floor_us:>6.2f}")
    return sandbox_costs(args.sandbox_runs) if args.sandbox_runs > 0 else 0


def sandbox_costs(runs: int) -> int:
    """The sandbox rows of the module docstring; prints why when no sandbox can be made."""
    import trio

    from atp_router.adapters.tools.base import DEFAULT_LIMITS, find_executable
    from atp_router.adapters.tools.sandbox import Sandbox, probe

    reason = probe()
    if reason is not None:
        print(f"SANDBOX unavailable: {reason}")
        return 1
    ruff = find_executable("ruff")
    commands = {"true": [shutil.which("true") or "/bin/true"]}
    if ruff is not None:
        commands["ruff --version"] = [ruff, "--version"]
    tree = tempfile.mkdtemp(prefix="atp-tool-bench-")
    results: dict[str, tuple[float, float]] = {}
    try:
        for name, argv in commands.items():
            box = Sandbox(tool=name, limits=DEFAULT_LIMITS, executables=argv[:1])
            direct, boxed = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                subprocess.run(argv, cwd=tree, stdout=subprocess.DEVNULL, check=True)
                direct.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                res = trio.run(lambda box=box, argv=argv: box.run(argv, tree=tree))
                boxed.append((time.perf_counter() - t0) * 1000)
                if res.returncode != 0:
                    print(f"SANDBOX {name} failed in the sandbox: {res.stderr[-300:]!r}")
                    return 1
            results[name] = statistics.median(direct), statistics.median(boxed)
            print(f"sandbox: {name:<16} direct p50 {results[name][0]:>7.1f} ms   sandboxed p50 "
                  f"{results[name][1]:>7.1f} ms   ({runs} runs each)")
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    startup = results["true"][1] - results["true"][0]
    tool = results.get("ruff --version", (float("nan"),))[0]
    print(f"SANDBOX startup_ms p50={startup:.1f} tool_ms p50={tool:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
