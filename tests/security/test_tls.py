"""TLS 1.3 (spec §4.1) and mTLS (§11) over real sockets with a trustme PKI:
ServerTls, its reload, client-certificate identities, WSS via
serve_websocket_tls, HTTPS via hypercorn_ssl."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from cryptography import x509
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from trio_websocket import ConnectionRejected, WebSocketRequest, open_websocket_url

from atp_router.security.authn import (
    AuthConfig,
    Authenticator,
    MtlsIdentitySpec,
    MtlsSpec,
)
from atp_router.security.identity import Role
from atp_router.security.tls import (
    ServerTls,
    hypercorn_ssl,
    peer_cert_of,
    san_names,
    serve_websocket_tls,
)

NOW = 1_750_000_000.0


async def start_tls_server(nursery: trio.Nursery, tls: ServerTls) -> tuple[int, list]:
    """A real TLS listener: each connection does the handshake and answers with
    its peer's SAN names, one line. Returns (port, list of server-side handshake
    failures)."""
    failures: list[BaseException] = []

    async def handle(stream: trio.SocketStream) -> None:
        s = trio.SSLStream(stream, tls.context, server_side=True)
        try:
            await s.do_handshake()
            await s.send_all((",".join(san_names(peer_cert_of(s))) + "\n").encode())
            await s.aclose()
        except trio.BrokenResourceError as e:
            failures.append(e)

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return listeners[0].socket.getsockname()[1], failures


async def connect(port: int, ctx: ssl.SSLContext) -> tuple[bytes, bytes, str | None]:
    """Handshake with localhost:port and read the server's line: (server certificate
    DER, line, TLS version)."""
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    s = trio.SSLStream(tcp, ctx, server_hostname="localhost")
    with trio.fail_after(5):
        await s.do_handshake()
        data = b""
        while not data.endswith(b"\n"):
            chunk = await s.receive_some()
            if not chunk:
                break
            data += chunk
    der = s.getpeercert(binary_form=True)
    version = s.version()
    await trio.aclose_forcefully(s)
    return der, data, version


async def refused(port: int, ctx: ssl.SSLContext) -> None:
    """The server refuses the session: the client's first read fails (the TLS alert)
    or ends (the connection closed), and no line was served."""
    try:
        _, line, _ = await connect(port, ctx)
    except trio.BrokenResourceError:
        return
    assert line == b"", line


def client_ctx(ca: trustme.CA, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(ctx)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def serial(der: bytes) -> int:
    return x509.load_der_x509_certificate(der).serial_number


async def test_tls13_handshake_ok_and_tls12_client_refused(nursery, tls_server_files, tls_client_context) -> None:
    tls = ServerTls(tls_server_files.cert, tls_server_files.key)
    assert tls.context.minimum_version is ssl.TLSVersion.TLSv1_3
    port, failures = await start_tls_server(nursery, tls)
    _, line, version = await connect(port, tls_client_context)
    assert version == "TLSv1.3" and line == b"\n"  # no client certificate

    old = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    old.load_verify_locations(cadata=tls_server_files.ca.read_text())
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(trio.BrokenResourceError) as ei:
        await connect(port, old)
    assert isinstance(ei.value.__cause__, ssl.SSLError)
    # the listener still serves
    assert (await connect(port, tls_client_context))[2] == "TLSv1.3"
    assert len(failures) == 1


async def test_reload_swaps_certificate_for_new_clients(nursery, tls_ca, tls_leaf, tls_client_context) -> None:
    first = tls_leaf(tls_ca, "srv", "localhost")
    tls = ServerTls(first.cert, first.key)
    port, _ = await start_tls_server(nursery, tls)
    der1, _, _ = await connect(port, tls_client_context)

    second = tls_leaf(tls_ca, "srv2", "localhost")
    expected = x509.load_pem_x509_certificate(second.cert.read_bytes()).serial_number
    os.replace(second.cert, first.cert)
    os.replace(second.key, first.key)
    assert serial((await connect(port, tls_client_context))[0]) == serial(der1)  # not reloaded yet
    assert tls.maybe_reload()  # files changed (new inode)
    assert not tls.maybe_reload()  # and not again
    der2, _, _ = await connect(port, tls_client_context)
    assert serial(der2) == expected != serial(der1)

    # a bad file: reload raises and the running certificate stays
    first.key.write_text("not a key")
    with pytest.raises(ValueError, match="cannot load certificate and key"):
        tls.reload()
    assert not tls.maybe_reload()  # logged, kept
    assert serial((await connect(port, tls_client_context))[0]) == serial(der2)
    with pytest.raises(ValueError, match="cannot read"):
        ServerTls(first.cert, first.cert.parent / "missing.key")
    with pytest.raises(ValueError, match="client_ca_file"):
        ServerTls(first.cert, first.key, require_client_cert=True)


async def test_watch_picks_up_a_new_certificate(nursery, tls_ca, tls_leaf, tls_client_context) -> None:
    first = tls_leaf(tls_ca, "w", "localhost")
    tls = ServerTls(first.cert, first.key)
    port, _ = await start_tls_server(nursery, tls)
    der1, _, _ = await connect(port, tls_client_context)
    nursery.start_soon(tls.watch, 0.05)
    second = tls_leaf(tls_ca, "w2", "localhost")
    os.replace(second.cert, first.cert)
    os.replace(second.key, first.key)
    with trio.fail_after(5):
        while serial(der := (await connect(port, tls_client_context))[0]) == serial(der1):
            await trio.sleep(0.05)
    assert serial(der) != serial(der1)


async def test_mtls_identity_from_client_certificate(nursery, tls_ca, tls_other_ca, tls_server_files,
                                                     tls_leaf, tls_uri_leaf) -> None:
    tls = ServerTls(tls_server_files.cert, tls_server_files.key, client_ca_file=tls_server_files.ca,
                    require_client_cert=True)
    port, failures = await start_tls_server(nursery, tls)
    auth = Authenticator(AuthConfig(mtls=MtlsSpec(identities=(
        MtlsIdentitySpec(san="URI:spiffe://corp/router-b", tenant="routerb"),
        MtlsIdentitySpec(san="DNS:agent-a.internal", tenant="agents", roles=(Role.CLIENT, Role.OPERATOR)),
    ))))

    agent = tls_leaf(tls_ca, "agent", "agent-a.internal")
    _, line, _ = await connect(port, client_ctx(tls_ca, agent.cert, agent.key))
    assert line == b"DNS:agent-a.internal\n"

    router_b = tls_uri_leaf(tls_ca, "router-b", "spiffe://corp/router-b")
    _, line, _ = await connect(port, client_ctx(tls_ca, router_b.cert, router_b.key))
    assert line == b"URI:spiffe://corp/router-b\n"

    # no client certificate: TLS 1.3 fails it at the server's handshake (the client
    # notices at its first read: the server's alert, or — with some Python builds'
    # ssl — the connection's end); either way no identity line is served
    await refused(port, client_ctx(tls_ca))
    # a certificate from another CA
    stranger = tls_leaf(tls_other_ca, "stranger", "agent-a.internal")
    await refused(port, client_ctx(tls_ca, stranger.cert, stranger.key))
    with trio.fail_after(5):
        while len(failures) < 2:
            await trio.sleep(0.01)

    # the verified peer certificate of a real handshake resolves to the identity
    seen: list = []

    async def handle(stream: trio.SocketStream) -> None:
        s = trio.SSLStream(stream, tls.context, server_side=True)
        await s.do_handshake()
        seen.append(auth.authenticate(None, now=NOW, peer_cert=peer_cert_of(s)))
        await s.send_all(b"\n")
        await s.aclose()

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    await connect(listeners[0].socket.getsockname()[1], client_ctx(tls_ca, router_b.cert, router_b.key))
    await connect(listeners[0].socket.getsockname()[1], client_ctx(tls_ca, agent.cert, agent.key))
    assert [(i.tenant, i.subject, i.method) for i in seen] == [
        ("routerb", "URI:spiffe://corp/router-b", "mtls"), ("agents", "DNS:agent-a.internal", "mtls")]
    assert seen[1].roles == frozenset({Role.CLIENT, Role.OPERATOR})


def test_peer_cert_of_other_streams_and_san_names() -> None:
    assert peer_cert_of(object()) is None
    assert san_names(None) == []
    cert = {"subjectAltName": (("DNS", "a"), ("IP Address", "10.0.0.7"), ("email", "u@h"),
                               ("URI", "spiffe://x/y"), ("othername", "<unsupported>"))}
    assert san_names(cert) == ["DNS:a", "IP:10.0.0.7", "email:u@h", "URI:spiffe://x/y"]


async def test_websocket_over_tls_echo_with_peer_cert(nursery, tls_ca, tls_server_files, tls_leaf) -> None:
    tls = ServerTls(tls_server_files.cert, tls_server_files.key, client_ca_file=tls_server_files.ca)
    seen: list = []

    async def handler(request: WebSocketRequest, peer_cert: dict | None) -> None:
        seen.append(san_names(peer_cert))
        if request.path == "/boom":
            raise RuntimeError("handler fault")
        ws = await request.accept()
        msg = await ws.get_message()
        await ws.send_message(f"echo:{msg}")

    server = await nursery.start(
        lambda task_status: serve_websocket_tls(handler, "127.0.0.1", 0, tls, max_message_size=1024,
                                                task_status=task_status))
    url = f"wss://localhost:{server.port}/ws"
    agent = tls_leaf(tls_ca, "agent", "agent-a.internal")

    # failed handshakes (a TLS 1.2-only client, a peer that hangs up) do not end the listener
    old = client_ctx(tls_ca)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(trio.BrokenResourceError):
        await connect(server.port, old)
    await (await trio.open_tcp_stream("127.0.0.1", server.port)).aclose()

    with trio.fail_after(10):
        async with open_websocket_url(url, ssl_context=client_ctx(tls_ca, agent.cert, agent.key)) as ws:
            await ws.send_message("hello")
            assert await ws.get_message() == "echo:hello"
        # a handler exception ends only its connection; without a client certificate
        # (optional here) the handler sees None
        with pytest.raises(ConnectionRejected) as ei:
            async with open_websocket_url(url.replace("/ws", "/boom"), ssl_context=client_ctx(tls_ca)):
                pass
        assert ei.value.status_code == 500
        async with open_websocket_url(url, ssl_context=client_ctx(tls_ca)) as ws:
            await ws.send_message("again")
            assert await ws.get_message() == "echo:again"
    assert seen == [["DNS:agent-a.internal"], [], []]


async def test_hypercorn_serves_tls13_h2_and_http11(nursery, tls_ca, tls_server_files) -> None:
    tls = ServerTls(tls_server_files.cert, tls_server_files.key)

    async def hello(request):
        return PlainTextResponse(request.scope["http_version"])

    config = HyperConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    hypercorn_ssl(config, tls)
    binds = await nursery.start(lambda task_status: hyper_serve(Starlette(routes=[Route("/", hello)]), config,
                                                                task_status=task_status))
    assert binds[0].startswith("https://")
    port = int(binds[0].rsplit(":", 1)[1])
    url = f"https://localhost:{port}/"
    async with httpx.AsyncClient(verify=client_ctx(tls_ca), http2=True) as client:
        r = await client.get(url)
        assert (r.status_code, r.http_version, r.text) == (200, "HTTP/2", "2")
    async with httpx.AsyncClient(verify=client_ctx(tls_ca)) as client:
        r = await client.get(url)
        assert (r.status_code, r.http_version, r.text) == (200, "HTTP/1.1", "1.1")
    old = client_ctx(tls_ca)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    async with httpx.AsyncClient(verify=old) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url)
