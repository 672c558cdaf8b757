"""Bypass corpus of the data-scope redaction (spec §11, §19; issue 19): task
contents that carry a secret in a form meant to slip past a pattern, each with the
secrets that must not reach an uncleared agent in any form, and negatives
(ordinary code and text) that must reach it unchanged.

Two halves. ``DEV`` holds the issue's five bypasses and the variants the issue
named; the detectors were written from general principles with these in view.
``HELD_OUT`` was written after the detectors were finished and was not used to
change them: its recall is the honest estimate (``bench/bench_redact.py`` prints
both). A case whose secret survives is a miss, not a test to tune rules to.

A secret "reaches" the agent when it is in the redacted content as written or
in any normalised view of it (:func:`leaks`), so a secret only recoverable by
joining, unescaping or folding still counts as a leak.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization as ser
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from atp_router.security.normalise import views

__all__ = ["DEV", "HELD_OUT", "NEGATIVES", "Case", "leaks"]


@dataclass(frozen=True)
class Case:
    """``content`` (a task's) holds ``secrets``; none may reach an uncleared agent."""

    name: str
    content: dict[str, Any]
    secrets: tuple[str, ...]


def leaks(content: Any, secrets: tuple[str, ...]) -> list[str]:
    """The ``secrets`` found in ``content``'s strings as written or in one of
    their normalised views (diff prefixes dropped, characters folded, literals
    joined)."""
    texts: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            texts.append(v)
            for diff in (False, True):
                texts.extend(x.text for x in views(v, diff=diff))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(content)
    return [s for s in secrets if any(s in t for t in texts)]


_rnd = random.Random(19)
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _tok(n: int, alphabet: str = _ALNUM) -> str:
    return "".join(_rnd.choice(alphabet) for _ in range(n))


AWS_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GITHUB = "ghp_" + _tok(36)
GITHUB_FINE = "github_pat_" + _tok(22) + "_" + _tok(59)
SLACK = "xoxb-" + _tok(12, "0123456789") + "-" + _tok(13, "0123456789") + "-" + _tok(24)
STRIPE = "sk_live_" + _tok(24)
JWT = ".".join(base64.urlsafe_b64encode(json.dumps(p).encode()).decode().rstrip("=") for p in (
    {"alg": "HS256", "typ": "JWT"}, {"sub": "alice", "admin": True, "iat": 1700000000})) + "." + _tok(43, _ALNUM + "-_")
PASSWORD = "S3cr3t-Passw0rd-" + _tok(8)
RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC = ec.generate_private_key(ec.SECP256R1())
ED = ed25519.Ed25519PrivateKey.generate()


def _pem(key: Any, fmt: ser.PrivateFormat = ser.PrivateFormat.PKCS8) -> str:
    return key.private_bytes(ser.Encoding.PEM, fmt, ser.NoEncryption()).decode()


def _der(key: Any, fmt: ser.PrivateFormat = ser.PrivateFormat.PKCS8) -> bytes:
    return key.private_bytes(ser.Encoding.DER, fmt, ser.NoEncryption())


def _body(pem: str) -> list[str]:
    return [ln for ln in pem.splitlines() if ln and not ln.startswith("-----")]


def _key_probes(lines: list[str]) -> tuple[str, ...]:
    """Secrets that stand for a key body: 24 characters from each line."""
    return tuple(ln[8:32] for ln in lines if len(ln) >= 32)


RSA_LINES = _body(_pem(RSA, ser.PrivateFormat.TraditionalOpenSSL))
RSA8_LINES = _body(_pem(RSA))
EC_LINES = _body(_pem(EC, ser.PrivateFormat.TraditionalOpenSSL))


def _diff(path: str, text: str) -> str:
    lines = text.splitlines()
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{ln}\n" for ln in lines)


def _py(text: str, name: str = "settings.py") -> dict[str, Any]:
    return {"diff": _diff(name, text), "files": {name: text}}


def _cyr(s: str) -> str:
    """Latin letters swapped for their Cyrillic look-alikes."""
    return s.translate(str.maketrans("AEKMHOPCTXaeopcxy", "АЕКМНОРСТХаеорсху"))


def _fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)


def _u_escape(s: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in s)


# ------------------------------------------------------------------ DEV: the issue's findings and named variants
DEV: list[Case] = [
    # the five bypasses of issue 19
    Case("split-literals", _py(f'AWS_ACCESS_KEY_ID = "{AWS_ID[:4]}" "{AWS_ID[4:]}"\n'), (AWS_ID,)),
    Case("cyrillic-lookalikes", _py(f'AWS_ACCESS_KEY_ID = "{_cyr(AWS_ID)}"\n'), (AWS_ID, _cyr(AWS_ID))),
    Case("zero-width-space", _py(f'AWS_ACCESS_KEY_ID = "{AWS_ID[:4]}\u200b{AWS_ID[4:]}"\n'),
         (AWS_ID, AWS_ID[4:])),
    Case("pem-body-without-armour", _py('SIGNING_KEY = """\n' + "\n".join(RSA_LINES) + '\n"""\n'),
         _key_probes(RSA_LINES)),
    Case("aws-secret-on-comment-line", _py(f"# aws secret key: {AWS_SECRET}\nREGION = 'eu-west-1'\n"),
         (AWS_SECRET,)),
    # split forms
    Case("plus-concatenation", _py(f"TOKEN = '{GITHUB[:10]}' + '{GITHUB[10:]}'\n"), (GITHUB,)),
    Case("js-plus-across-lines", {"files": {"cfg.js": f'const key = "{STRIPE[:12]}" +\n  "{STRIPE[12:]}";\n'}},
         (STRIPE,)),
    Case("c-adjacent-with-continuation", {"files": {"key.c": f'const char *k = "{AWS_ID[:8]}" \\\n    "{AWS_ID[8:]}";\n'}},
         (AWS_ID,)),
    Case("python-implicit-in-parens", _py(f'KEY = (\n    "{SLACK[:15]}"\n    "{SLACK[15:]}"\n)\n'), (SLACK,)),
    Case("shell-line-continuation", {"files": {"deploy.sh": f"export AWS_ACCESS_KEY_ID={AWS_ID[:10]}\\\n{AWS_ID[10:]}\n"}},
         (AWS_ID,)),
    # character tricks
    Case("fullwidth-key", _py(f'KEY = "{_fullwidth(AWS_ID)}"\n'), (AWS_ID, _fullwidth(AWS_ID))),
    Case("mixed-confusables-github", _py(f'T = "{_cyr(GITHUB[:12])}{_fullwidth(GITHUB[12:20])}{GITHUB[20:]}"\n'),
         (GITHUB, GITHUB[20:])),
    Case("escaped-unicode", _py(f'KEY = "{_u_escape(AWS_ID[:4])}{AWS_ID[4:]}"\n'), (AWS_ID, AWS_ID[4:])),
    Case("escaped-cyrillic-u0410", _py(f'KEY = "\\u0410KI\\u0410{AWS_ID[4:]}"\n'), (AWS_ID, AWS_ID[4:])),
    Case("html-entities", {"files": {"page.html": f'<meta name="k" content="&#65;&#x4b;IA{AWS_ID[4:]}">\n'}},
         (AWS_ID, AWS_ID[4:])),
    Case("bidi-controls", _py(f'KEY = "{AWS_ID[:6]}\u202e\u202c{AWS_ID[6:]}"\n'), (AWS_ID, AWS_ID[6:])),
    # token families
    Case("github-token-in-yaml", {"files": {"ci.yml": f"env:\n  GH_TOKEN: {GITHUB}\n"}}, (GITHUB,)),
    Case("slack-token", _py(f'SLACK = "{SLACK}"\n'), (SLACK,)),
    Case("stripe-key", _py(f'stripe.api_key = "{STRIPE}"\n'), (STRIPE,)),
    Case("jwt-in-header", {"question": f"why does `Authorization: Bearer {JWT}` give 401?"}, (JWT,)),
    Case("gcp-service-account-fragment", {"files": {"sa.json": json.dumps({
        "type": "service_account", "project_id": "demo",
        "private_key": "\n".join(RSA8_LINES) + "\n", "client_email": "x@demo.iam.gserviceaccount.com"})}},
         _key_probes(RSA8_LINES)),
    Case("pkcs8-body-in-string-with-escapes",
         _py('KEY = "' + "\\n".join(RSA8_LINES) + '"\n'), _key_probes(RSA8_LINES)),
    Case("ec-key-body-in-comment", {"files": {"notes.py": "".join(f"# {ln}\n" for ln in EC_LINES) + "x = 1\n"}},
         _key_probes(EC_LINES)),
    Case("der-key-as-one-base64-line",
         _py(f'KEY_B64 = "{base64.b64encode(_der(EC)).decode()}"\n'), (base64.b64encode(_der(EC)).decode()[10:40],)),
    Case("der-key-as-hex", _py(f'KEY_HEX = "{_der(ED).hex()}"\n'), (_der(ED).hex()[8:40],)),
    Case("base64-wrapped-aws-key", _py(f'BLOB = "{base64.b64encode(f"aws_key={AWS_ID}".encode()).decode()}"\n'),
         (base64.b64encode(f"aws_key={AWS_ID}".encode()).decode(),)),
    Case("url-password", _py(f'DB = "postgres://admin:{PASSWORD}@db.internal:5432/app"\n'), (PASSWORD,)),
    Case("url-password-percent-encoded",
         _py(f'DB = "postgres://admin:{PASSWORD.replace("-", "%2D")}@db.internal/app"\n'),
         (PASSWORD, PASSWORD.replace("-", "%2D"))),
    Case("aws-secret-in-prose", {"notes": [f"the old secret was {AWS_SECRET}, rotate it"]}, (AWS_SECRET,)),
    Case("keyword-password-split", _py(f'password = "{PASSWORD[:6]}" + "{PASSWORD[6:]}"\n'), (PASSWORD,)),
]

NEGATIVES: list[tuple[str, dict[str, Any]]] = [
    ("plain-function", _py("def add(a, b):\n    return a + b\n", "calc.py")),
    ("implicit-concat-message", _py('raise ValueError("the budget is spent: " "reserve less or wait")\n', "e.py")),
    ("format-strings", _py('log.info("%s took %2d ms", name, ms)\nurl = f"{base}/v1/streams/{sid}"\n', "l.py")),
    ("sha-in-comment", _py("# fixed in 3f2a9b1c7d4e5f60718293a4b5c6d7e8f9012345 upstream\nx = 1\n", "s.py")),
    ("uuid", _py('REQUEST_ID = "123e4567-e89b-12d3-a456-426614174000"\n', "u.py")),
    ("cyrillic-prose", {"notes": ["Привет, это обычный текст о коде и тестах."]}),
    ("cjk-comment", _py("# 计算两个数的和\ndef add(a, b):\n    return a + b\n", "c.py")),
    ("emoji-and-accents", {"question": "Café résumé naïve 🎉 — does this parse?"}),
    ("long-identifiers-in-comment",
     _py("# see HTTPServerRequestHandlerFactory2 and test_redact_bypass_corpus_file\nx = 1\n", "i.py")),
    ("url-without-password", _py('URL = "https://example.com/v1/items?page=2&size=50"\n', "w.py")),
    ("public-key-pem", {"files": {"pub.pem": RSA.public_key().public_bytes(
        ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo).decode()}}),
    ("base64-of-prose", _py(f'GREETING = "{base64.b64encode(b"hello world, this is a test").decode()}"\n', "g.py")),
    ("js-string-concat", {"files": {"m.js": 'const msg = "Hello, " + "world" + "!";\n'}}),
    ("html-entities-prose", {"files": {"p.html": "<p>Tom &amp; Jerry &lt;3 &#169; 2024</p>\n"}}),
    ("sql-concat", {"files": {"q.sql": "SELECT 'a' || 'b' AS ab FROM t WHERE id = 42;\n"}}),
    ("escaped-newlines", _py('print("line one\\nline two\\tend")\n', "p.py")),
    ("list-of-words-join", _py('", ".join(["alpha", "beta", "gamma", "delta"])\n', "j.py")),
    ("markdown-readme", {"files": {"README.md": "# Project\n\nRun `make test` to test. See docs/architecture.md.\n"}}),
    ("diff-with-version-hashes", {"diff": "diff --git a/x.py b/x.py\nindex 2720cda..75fcc7c 100644\n--- a/x.py\n"
                                          "+++ b/x.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"}),
    ("path-like-comment", _py("# moved from src/main/java/com/example/Service.java\nx = 1\n", "m.py")),
]

# ------------------------------------------------------------------ HELD_OUT: written after the detectors were done
SSH_LINES = _body(ED.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()).decode())
ENC_LINES = _body(EC.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                   ser.BestAvailableEncryption(b"correct horse")).decode())
ED_LINES = _body(_pem(ED))
GITHUB2 = "ghp_" + _tok(36)
STRIPE2 = "sk_live_" + _tok(24)
BEARER = _tok(40, _ALNUM + "-_")
BASIC = base64.b64encode(f"deploy:{PASSWORD}".encode()).decode()
JWK_D = base64.urlsafe_b64encode(EC.private_numbers().private_value.to_bytes(32, "big")).decode().rstrip("=")
_GREEK = str.maketrans("ABEHIKMNOPTXYZ", "ΑΒΕΗΙΚΜΝΟΡΤΧΥΖ")


def _math_bold(s: str) -> str:
    return "".join(chr(0x1D400 + ord(c) - 65) if "A" <= c <= "Z" else c for c in s)


HELD_OUT: list[Case] = [
    Case("php-dot-concat", {"files": {"c.php": f"<?php $k = '{AWS_ID[:4]}' . '{AWS_ID[4:]}';\n"}}, (AWS_ID,)),
    Case("lua-dotdot-concat", {"files": {"c.lua": f'local k = "{GITHUB2[:9]}" .. "{GITHUB2[9:]}"\n'}}, (GITHUB2,)),
    Case("go-raw-strings-plus", {"files": {"c.go": f"var k = `{STRIPE2[:10]}` + `{STRIPE2[10:]}`\n"}}, (STRIPE2,)),
    Case("java-plus-multiline", {"files": {"C.java": f'String k = "{STRIPE2[:8]}"\n    + "{STRIPE2[8:16]}"\n'
                                                      f'    + "{STRIPE2[16:]}";\n'}}, (STRIPE2,)),
    Case("greek-capitals", _py(f'KEY = "{AWS_ID.translate(_GREEK)}"\n'), (AWS_ID, AWS_ID.translate(_GREEK))),
    Case("zwj-and-word-joiner", _py(f'T = "{GITHUB2[:8]}\u200d{GITHUB2[8:20]}\u2060{GITHUB2[20:]}"\n'),
         (GITHUB2, GITHUB2[20:])),
    Case("soft-hyphen", _py(f'stripe.api_key = "{STRIPE2[:12]}\u00ad{STRIPE2[12:]}"\n'), (STRIPE2, STRIPE2[12:])),
    Case("combining-accent", _py(f'KEY = "A\u0301{AWS_ID[1:]}"\n'), (AWS_ID, AWS_ID[1:])),
    Case("math-bold-letters", _py(f'KEY = "{_math_bold(AWS_ID)}"\n'), (AWS_ID, _math_bold(AWS_ID))),
    Case("percent-encoded-in-url", {"question": f"GET /cb?k=%41%4B%49%41{AWS_ID[4:]} returns 500"}, (AWS_ID, AWS_ID[4:])),
    Case("json-u-escapes", {"files": {"k.json": json.dumps({"key": AWS_ID}).replace("AK", "\\u0041\\u004b")}},
         (AWS_ID, AWS_ID[2:])),
    Case("python-x-escapes", _py(f'KEY = "\\x41\\x4b{AWS_ID[2:]}"\n'), (AWS_ID, AWS_ID[2:])),
    Case("c-octal-escapes", {"files": {"k.c": f'char *k = "\\101\\113{AWS_ID[2:]}";\n'}}, (AWS_ID, AWS_ID[2:])),
    Case("decimal-entities-slack", {"files": {"p.html": "<code>" + "".join(f"&#{ord(c)};" for c in SLACK[:5])
                                              + SLACK[5:] + "</code>\n"}}, (SLACK, SLACK[5:])),
    Case("double-encoded-entity", {"files": {"p.html": f"<p>&amp;#65;KIA{AWS_ID[4:]}</p>\n"}}, (AWS_ID, AWS_ID[4:])),
    Case("ed25519-body-in-yaml-block", {"files": {"k.yaml": "signing:\n  key: |\n" + "".join(
        f"    {ln}\n" for ln in ED_LINES)}}, tuple(ln[4:28] for ln in ED_LINES)),
    Case("openssh-body-without-armour", {"files": {"id": "\n".join(SSH_LINES) + "\n"}}, _key_probes(SSH_LINES)),
    Case("encrypted-pkcs8-body", _py('K = """\n' + "\n".join(ENC_LINES) + '\n"""\n'), _key_probes(ENC_LINES)),
    Case("js-array-join-key-body", {"files": {"k.js": "const key = [\n" + "".join(f'  "{ln}",\n' for ln in RSA8_LINES)
                                              + '].join("\\n");\n'}}, _key_probes(RSA8_LINES)),
    Case("go-comment-aws-secret", {"files": {"m.go": f"package m\n\n// secret: {AWS_SECRET}\nvar x = 1\n"}},
         (AWS_SECRET,)),
    Case("sql-comment-aws-secret", {"files": {"q.sql": f"-- creds {AWS_SECRET}\nSELECT 1;\n"}}, (AWS_SECRET,)),
    Case("token-in-markdown", {"files": {"NOTES.md": f"Use the token {GITHUB2} for the bot.\n"}}, (GITHUB2,)),
    Case("opaque-bearer-in-curl", {"files": {"call.sh": f'curl -H "Authorization: Bearer {BEARER}" https://api\n'}},
         (BEARER,)),
    Case("basic-auth-header", {"question": f"Authorization: Basic {BASIC} is rejected"}, (BASIC, PASSWORD)),
    Case("urlsafe-base64-wrapped-github", _py(
        f'X = "{base64.urlsafe_b64encode(f"token={GITHUB2}".encode()).decode()}"\n'),
         (base64.urlsafe_b64encode(f"token={GITHUB2}".encode()).decode(), GITHUB2)),
    Case("zero-width-in-prose-secret", {"notes": [f"old: {AWS_SECRET[:20]}\u200b{AWS_SECRET[20:]}"]},
         (AWS_SECRET, AWS_SECRET[20:])),
    Case("jwk-private-member", {"files": {"jwk.json": json.dumps({"kty": "EC", "crv": "P-256", "d": JWK_D,
                                                                 "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
                                                                 "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"})}},
         (JWK_D,)),
    Case("pem-body-lines-in-diff", {"diff": _diff("deploy/key.pem", "\n".join(RSA_LINES))}, _key_probes(RSA_LINES)),
    Case("cyrillic-and-split", _py(f'KEY = "{_cyr(AWS_ID[:4])}" "{AWS_ID[4:]}"\n'), (AWS_ID, AWS_ID[4:])),
    Case("jwt-split-plus-js", {"files": {"t.js": f'const t = "{JWT[:30]}" + "{JWT[30:]}";\n'}}, (JWT, JWT[30:])),
    Case("fstring-literal-pieces", _py(f'KEY = f"{AWS_ID[:4]}" f"{AWS_ID[4:]}"\n'), (AWS_ID,)),
    Case("env-file-secret", {"files": {".env": f"STRIPE_SECRET={STRIPE2}\nDEBUG=1\n"}}, (STRIPE2,)),
]
