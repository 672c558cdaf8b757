"""Fixtures of tests/security (names prefixed by the test module family:
``authn_*``, ``tls_*``)."""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from joserfc.jwk import ECKey, OKPKey, RSAKey

# ------------------------------------------------------------------------- TLS


@dataclass
class TlsFiles:
    cert: Path
    key: Path
    ca: Path


@pytest.fixture(scope="session")
def tls_ca() -> trustme.CA:
    """The test PKI: a trustme CA that signs the server's and the clients' certificates."""
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_other_ca() -> trustme.CA:
    """A CA the server does not trust."""
    return trustme.CA()


def tls_write_leaf(ca: trustme.CA, directory: Path, name: str, *identities: str) -> TlsFiles:
    """Issue a leaf for ``identities`` and write ``<name>.crt`` (chain), ``<name>.key``
    and ``ca.pem`` (the CA certificate) under ``directory``."""
    leaf = ca.issue_cert(*identities)
    cert, key, ca_file = directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.pem"
    cert.write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    ca_file.write_bytes(ca.cert_pem.bytes())
    return TlsFiles(cert, key, ca_file)


def tls_write_uri_leaf(ca: trustme.CA, directory: Path, name: str, uri: str) -> TlsFiles:
    """Like :func:`tls_write_leaf` for a certificate whose only SAN is the URI ``uri``
    (a SPIFFE id); trustme issues DNS/IP/email SANs only, so it is built here with
    cryptography and signed by the CA's key."""
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    files.ca.write_bytes(ca.cert_pem.bytes())
    return files


@pytest.fixture
def tls_server_files(tmp_path: Path, tls_ca: trustme.CA) -> TlsFiles:
    """The server's certificate (localhost, 127.0.0.1) and key, and the CA, as files."""
    d = tmp_path / "server"
    d.mkdir()
    return tls_write_leaf(tls_ca, d, "server", "localhost", "127.0.0.1")


@pytest.fixture
def tls_client_context(tls_ca: trustme.CA) -> ssl.SSLContext:
    """A client context trusting the test CA (no client certificate)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    tls_ca.configure_trust(ctx)
    return ctx


# ------------------------------------------------------------------------- JWT


@dataclass
class AuthnKeys:
    rsa: RSAKey
    ec: ECKey
    okp: OKPKey


@pytest.fixture(scope="session")
def authn_keys() -> AuthnKeys:
    """Signing keys of a test identity provider (kids ``rsa-1``, ``ec-1``, ``ed-1``)."""
    return AuthnKeys(
        RSAKey.generate_key(2048, parameters={"kid": "rsa-1"}),
        ECKey.generate_key("P-256", parameters={"kid": "ec-1"}),
        OKPKey.generate_key("Ed25519", parameters={"kid": "ed-1"}),
    )


@pytest.fixture
def tls_leaf(tmp_path: Path):
    """``tls_leaf(ca, name, *identities) -> TlsFiles``: issue a certificate (DNS/IP
    SANs) from ``ca`` and write it, its key and the CA under ``tmp_path/<name>/``."""

    def issue(ca: trustme.CA, name: str, *identities: str) -> TlsFiles:
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        return tls_write_leaf(ca, d, name, *identities)

    return issue


@pytest.fixture
def tls_uri_leaf(tmp_path: Path):
    """``tls_uri_leaf(ca, name, uri) -> TlsFiles``: a client certificate whose SAN is ``uri``."""

    def issue(ca: trustme.CA, name: str, uri: str) -> TlsFiles:
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        return tls_write_uri_leaf(ca, d, name, uri)

    return issue
