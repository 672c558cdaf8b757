"""TLS 1.3 on both ingresses (spec §4.1 baseline "WebSocket over TLS 1.3", §11
mTLS), with certificates reloadable without a restart.

* :class:`ServerTls` — the server's certificate, key and (for mTLS) client CA as
  ``ssl.SSLContext`` objects pinned to TLS 1.3; :meth:`ServerTls.reload` loads
  the files again into the *same* contexts, so every listener holding one serves
  the new certificate to its next handshake.
* :func:`serve_websocket_tls` — the WebSocket ingress over TLS: it does the
  handshake itself (a failed one only ends that connection) and hands the
  handler the verified client certificate with the trio-websocket request.
* :func:`hypercorn_ssl` — makes a hypercorn ``Config`` serve HTTPS (h2 and
  http/1.1 by ALPN) with a :class:`ServerTls` context.
* :func:`peer_cert_of`, :func:`san_names` — the verified peer certificate of a
  ``trio.SSLStream`` and its subjectAltNames as the ``mtls`` identity map of
  :mod:`atp_router.security.authn` spells them (``"DNS:agent-a.internal"``,
  ``"URI:spiffe://corp/router-b"``, ``"IP:10.0.0.7"``, ``"email:a@b.c"``).

hypercorn 0.18 does not put the client certificate in the ASGI scope, so an mTLS
identity is available on the WebSocket ingress (and to any listener built on
:func:`peer_cert_of`), not through hypercorn.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest
from wsproto import ConnectionType, WSConnection
from wsproto.utilities import LocalProtocolError as WsprotoLocalError

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig

__all__ = [
    "SAN_KINDS",
    "ServerTls",
    "WebSocketTlsServer",
    "hypercorn_ssl",
    "peer_cert_of",
    "san_names",
    "serve_websocket_tls",
]

log = logging.getLogger("atp_router.security.tls")

#: The SAN kinds an mTLS identity may name, as :func:`san_names` prefixes them.
SAN_KINDS = ("DNS", "URI", "IP", "email")
_SAN_PREFIX = {"DNS": "DNS", "URI": "URI", "IP Address": "IP", "email": "email"}

#: A TLS handshake must finish within this, s (then the connection is dropped).
HANDSHAKE_TIMEOUT_S = 10.0
#: The WebSocket opening handshake (HTTP upgrade) must finish within this, s.
WS_CONNECT_TIMEOUT_S = 60.0
#: The WebSocket closing handshake waits at most this, s.
WS_DISCONNECT_TIMEOUT_S = 60.0


def san_names(peer_cert: dict[str, Any] | None) -> list[str]:
    """The subjectAltNames of a ``getpeercert()`` dict as ``"DNS:x"``, ``"URI:y"``,
    ``"IP:a.b.c.d"``, ``"email:u@h"`` strings, in certificate order (other kinds
    skipped); ``[]`` for None or a certificate without SANs."""
    if not peer_cert:
        return []
    return [f"{_SAN_PREFIX[kind]}:{value}" for kind, value in peer_cert.get("subjectAltName", ())
            if kind in _SAN_PREFIX]


def peer_cert_of(stream: object) -> dict[str, Any] | None:
    """The verified client certificate (``getpeercert()`` dict) of a ``trio.SSLStream``
    whose handshake is done; None for another stream, a peer without a certificate,
    or a context that does not verify client certificates."""
    if not isinstance(stream, trio.SSLStream):
        return None
    try:
        cert = stream.getpeercert()
    except ValueError:  # handshake not done
        return None
    return cert or None


def _signature(paths: Sequence[Path]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for p in paths:
        st = p.stat()
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class ServerTls:
    """A TLS 1.3 server identity (spec §4.1, §11) from PEM files: ``cert_file``
    (certificate chain), ``key_file``, and for mTLS ``client_ca_file`` (the CAs
    client certificates must chain to; then a client *may* present one, and
    *must* when ``require_client_cert``).

    :attr:`context` (no ALPN) and :meth:`context_for` (with ALPN) give
    ``ssl.SSLContext`` objects that :meth:`reload` updates in place. Raises
    ``ValueError`` naming the file when a file cannot be loaded, or when
    ``require_client_cert`` is set without ``client_ca_file``.
    """

    def __init__(self, cert_file: str | Path, key_file: str | Path, *, client_ca_file: str | Path | None = None,
                 require_client_cert: bool = False):
        if require_client_cert and client_ca_file is None:
            raise ValueError("require_client_cert needs a client_ca_file")
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.client_ca_file = Path(client_ca_file) if client_ca_file is not None else None
        self.require_client_cert = require_client_cert
        self._contexts: dict[tuple[str, ...], ssl.SSLContext] = {}
        self._sig = self._current_signature()
        self.context = self.context_for(())

    @property
    def _files(self) -> list[Path]:
        return [self.cert_file, self.key_file] + ([self.client_ca_file] if self.client_ca_file else [])

    def _current_signature(self) -> tuple[tuple[int, int, int], ...]:
        try:
            return _signature(self._files)
        except OSError as e:
            raise ValueError(f"{e.filename}: cannot read: {e.strerror}") from None

    def _load(self, ctx: ssl.SSLContext) -> None:
        """Load the files into ``ctx``; ValueError naming the file on failure."""
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"{self.cert_file} / {self.key_file}: cannot load certificate and key: {e}") from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"{self.client_ca_file}: cannot load client CA: {e}") from None

    def _new_context(self, alpn: tuple[str, ...]) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        if self.client_ca_file is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        self._load(ctx)
        return ctx

    def context_for(self, alpn: Sequence[str] = ()) -> ssl.SSLContext:
        """The context offering ALPN protocols ``alpn`` (e.g. ``("h2", "http/1.1")``;
        ``()``: no ALPN), created once per tuple and kept up to date by :meth:`reload`."""
        key = tuple(alpn)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self._new_context(key)
        return ctx

    def reload(self) -> None:
        """Load certificate, key and client CA again into the same contexts: new
        handshakes use the new certificate, open connections keep theirs. The files
        are checked on a scratch context first, so a bad file raises ``ValueError``
        (naming it) and the running certificate stays. A reloaded CA file adds its
        certificates to the trusted ones; a CA is only removed by a restart."""
        sig = self._current_signature()
        self._new_context(())  # validate, raises ValueError
        for ctx in self._contexts.values():
            self._load(ctx)
        self._sig = sig
        log.info("TLS certificate reloaded from %s", self.cert_file)

    def maybe_reload(self) -> bool:
        """:meth:`reload` if a file's mtime, size or inode changed since the last
        load. Returns whether it reloaded; a failed reload is logged, the running
        certificate stays, and the same files are not retried until they change."""
        try:
            sig = self._current_signature()
        except ValueError as e:
            log.error("TLS reload skipped: %s", e)
            return False
        if sig == self._sig:
            return False
        try:
            self.reload()
        except ValueError as e:
            self._sig = sig
            log.error("TLS reload failed, keeping the running certificate: %s", e)
            return False
        return True

    async def watch(self, interval_s: float) -> NoReturn:
        """Call :meth:`maybe_reload` every ``interval_s`` (s) until cancelled."""
        while True:
            await trio.sleep(interval_s)
            self.maybe_reload()


def hypercorn_ssl(config: HypercornConfig, tls: ServerTls) -> None:
    """Make hypercorn serve HTTPS with ``tls``: TLS 1.3 only, ALPN ``h2`` and
    ``http/1.1``, the certificate reloadable by :meth:`ServerTls.reload`.
    hypercorn binds TLS sockets only when ``certfile``/``keyfile`` are set, then
    calls ``create_ssl_context()`` once: we set both and answer that call with
    our context (an instance attribute shadows the method)."""
    alpn = ("h2", "http/1.1")
    ctx = tls.context_for(alpn)
    config.certfile = str(tls.cert_file)
    config.keyfile = str(tls.key_file)
    config.alpn_protocols = list(alpn)
    config.create_ssl_context = lambda: ctx  # type: ignore[method-assign]


class WebSocketTlsServer:
    """What :func:`serve_websocket_tls` passes to ``task_status.started``:
    ``listeners`` (the TCP listeners) and ``port`` (the bound port of the first)."""

    def __init__(self, listeners: list[trio.SocketListener]):
        self.listeners = listeners

    @property
    def port(self) -> int:
        return int(self.listeners[0].socket.getsockname()[1])


async def _serve_connection(
    stream: trio.SocketStream,
    ctx: ssl.SSLContext,
    handler: Callable[[WebSocketRequest, dict[str, Any] | None], Awaitable[None]],
    *,
    max_message_size: int,
    handshake_timeout_s: float,
) -> None:
    """One connection of :func:`serve_websocket_tls` (its docstring): the TLS
    handshake under ``ctx``, the WebSocket opening handshake, ``handler``."""
    try:
        peer = stream.socket.getpeername()
    except OSError:
        peer = "?"
    tls_stream = trio.SSLStream(stream, ctx, server_side=True, https_compatible=True)
    try:
        with trio.fail_after(handshake_timeout_s):
            await tls_stream.do_handshake()
    except (trio.BrokenResourceError, trio.TooSlowError) as e:
        log.info("TLS handshake with %s failed: %s", peer, e.__cause__ or type(e).__name__)
        await trio.aclose_forcefully(tls_stream)
        return
    peer_cert = peer_cert_of(tls_stream)
    # As trio_websocket.WebSocketServer._handle_connection does (trio-websocket
    # is pinned <0.13): its public serve_websocket/wrap_server_stream hide either
    # the TLS stream (the peer certificate) or the connection (its close).
    async with trio.open_nursery() as nursery:
        ws = WebSocketConnection(tls_stream, WSConnection(ConnectionType.SERVER),
                                 max_message_size=max_message_size)
        nursery.start_soon(ws._reader_task)
        with trio.move_on_after(WS_CONNECT_TIMEOUT_S) as connect_scope:
            request = await ws._get_request()
        if connect_scope.cancelled_caught:
            nursery.cancel_scope.cancel()
            await trio.aclose_forcefully(tls_stream)
            return
        try:
            await handler(request, peer_cert)
        except Exception:
            log.exception("WebSocket handler for %s failed", peer)
            # A handler that failed before answering the upgrade leaves the
            # client waiting: refuse it (a no-op once accepted or rejected).
            with contextlib.suppress(WsprotoLocalError, ConnectionClosed, trio.BrokenResourceError):
                await request.reject(500)
        finally:
            with trio.move_on_after(WS_DISCONNECT_TIMEOUT_S):
                await ws.aclose()


async def serve_websocket_tls(
    handler: Callable[[WebSocketRequest, dict[str, Any] | None], Awaitable[None]],
    host: str | None,
    port: int,
    tls: ServerTls,
    *,
    max_message_size: int,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    listeners: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[WebSocketTlsServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve WebSocket over TLS 1.3 (spec §4.1) on ``host:port`` (port 0: any free
    port), or on ``listeners`` already bound (``atp-router --workers N``: the
    supervisor's socket), until cancelled; ``task_status.started`` gets a
    :class:`WebSocketTlsServer`.

    Each connection: the TLS handshake (ALPN ``http/1.1``) within
    ``handshake_timeout_s`` — a failed or slow one is logged and closes only that
    connection —, then the WebSocket opening handshake, then
    ``handler(request, peer_cert)`` with the verified client certificate
    (``getpeercert()`` dict, None without one). Messages over
    ``max_message_size`` (bytes or characters) close the connection with 1009. When
    the handler returns the WebSocket is closed; an exception from the handler is
    logged and ends only its connection (with HTTP 500 if it had not answered
    the upgrade).
    """
    ctx = tls.context_for(("http/1.1",))
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)

    async def connection(stream: trio.SocketStream) -> None:
        await _serve_connection(stream, ctx, handler, max_message_size=max_message_size,
                                handshake_timeout_s=handshake_timeout_s)

    server = WebSocketTlsServer(listeners)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, connection, listeners)
        log.info("WebSocket over TLS 1.3 on port %d", server.port)
        task_status.started(server)
        await trio.sleep_forever()


def client_context(*, ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None) -> ssl.SSLContext:
    """A TLS client context towards a next-hop (spec §4.1, §11): verifies the
    peer's certificate and host name against ``ca_file`` (None: the system's trust
    store); with ``cert_file``/``key_file`` it presents the router's client
    certificate (mutual TLS) and requires TLS 1.3, else TLS 1.2 at least (public
    model APIs). Raises ``ValueError`` naming the file when one cannot be loaded."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if cert_file else ssl.TLSVersion.TLSv1_2
        if cert_file is not None:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"TLS files cannot be loaded: {getattr(e, 'strerror', None) or e}") from None
    return ctx
