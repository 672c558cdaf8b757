"""A trio-native MQTT 5 client: paho-mqtt 2.x driven by trio's socket waits.

paho does the protocol (packets, packet ids, QoS 1 retransmission, session state);
this module does the I/O. paho's socket callbacks (``on_socket_open`` /
``on_socket_close`` / ``on_socket_register_write`` / ``on_socket_unregister_write``)
tell us which socket to watch and when it has bytes to send; per connection three
trio tasks call ``loop_read`` after ``trio.lowlevel.wait_readable``, ``loop_write``
after ``wait_writable`` and ``loop_misc`` (keepalive) once a second. Every paho call
after the TCP/TLS connect happens in the trio thread, so paho's callbacks run there
too and may touch trio objects. The connect itself (``socket.create_connection`` and
the TLS handshake, both blocking in paho) runs in a worker thread; the callbacks it
triggers there only set plain attributes (they check the thread), and no other paho
call is made while it runs. Before paho closes a socket, ``notify_closing`` wakes the
tasks waiting on it.

Use :func:`open_mqtt_client` (owns its nursery) or ``await nursery.start(client.run)``::

    async with open_mqtt_client(host, port, client_id="a", will=Will(...)) as c:
        await c.subscribe("/control/agents/a/input")          # returns after SUBACK
        await c.publish("/t", b"{}", qos=1)                     # returns after PUBACK
        async for msg in c.messages:                            # Message(topic, payload, ...)
            ...

Sessions: ``clean_start=False`` with ``session_expiry_s > 0`` keeps the broker-side
session (subscriptions and queued QoS 1 messages) across reconnects; the client
reconnects by itself with exponential backoff, re-subscribes when the broker did not
keep the session, and paho re-sends QoS 1 messages that were not yet acknowledged, so
:meth:`MQTTClient.publish` returns only once the PUBACK arrived, whatever happened
in between.

Back-pressure: received messages go to a bounded trio memory channel
(``queue_size``). When it is full, the messages already decoded from the current
read wait in order in a small overflow list and the reader stops reading the socket
until the consumer takes them; the broker then holds further messages (TCP flow
control, and with ``manual_ack`` the MQTT 5 receive maximum). Nothing is dropped and
the read loop never fails because of a slow consumer. A consumer stalled for longer
than the keepalive lets the connection time out (the PINGRESP stays unread); the
client then reconnects and, with a persistent session, the broker re-delivers what
was not acknowledged.

Errors::

    MQTTError            a refused operation (SUBACK/PUBACK failure code, payload too large)
    └── ConnectError     could not connect (refused, TLS failure, CONNACK failure code)

Also :func:`first_of`, which returns as soon as one of several ``trio.Event`` s is set.
"""

from __future__ import annotations

import contextlib
import logging
import math
import ssl
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as paho
import trio
import trio.lowlevel
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

__all__ = [
    "BrokerAddress",
    "ClientStatistics",
    "ConnectError",
    "MQTTClient",
    "MQTTError",
    "Message",
    "Will",
    "first_of",
    "open_mqtt_client",
    "parse_broker_url",
    "tls_context",
]

log = logging.getLogger("atp_router.mqtt")

#: Largest MQTT packet the protocol can carry (remaining length of 268,435,455 bytes).
MQTT_MAX_PACKET = 268_435_455
_MISC_INTERVAL_S = 1.0


class MQTTError(Exception):
    """An MQTT operation was refused. ``reason`` is the broker's reason code name
    (``"Not authorized"``) or our own reason."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class ConnectError(MQTTError):
    """The client could not connect: TCP or TLS failure, or a CONNACK failure code."""


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """Where the broker listens; ``tls`` for ``mqtts://``."""

    host: str
    port: int
    tls: bool = False


def parse_broker_url(url: str) -> BrokerAddress:
    """``mqtt://host[:1883]`` or ``mqtts://host[:8883]`` (also ``tcp://``, ``ssl://``).

    Raises ValueError naming what is wrong; credentials in the URL are refused
    (secrets come from the environment only)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("mqtt", "tcp", "mqtts", "ssl"):
        raise ValueError(f"expected an mqtt:// or mqtts:// URL, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("credentials must not be written in the broker URL; name environment variables instead")
    if not parts.hostname:
        raise ValueError(f"no host in broker URL {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"a broker URL has no path or query: {url!r}")
    tls = scheme in ("mqtts", "ssl")
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"bad port in broker URL {url!r}") from None
    return BrokerAddress(parts.hostname, port, tls)


def tls_context(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client TLS context that verifies the broker's certificate and host name
    (``ca_file`` or the system's trust store); ``cert_file``/``key_file`` add a
    client certificate (mutual TLS). Raises OSError / ssl.SSLError on bad files."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


@dataclass(frozen=True, slots=True)
class Will:
    """Last Will and Testament: published by the broker when the connection ends
    without a DISCONNECT (crash, kill, network loss)."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True, slots=True)
class Message:
    """A received PUBLISH. ``retain`` is True for a retained message sent because of
    a new subscription (a live subscriber sees ``retain=False`` unless it asked for
    Retain-As-Published). ``ack()`` sends the PUBACK of a QoS 1 message when the
    client was made with ``manual_ack=True`` (a no-op otherwise)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool = False
    _ack: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def ack(self) -> None:
        if self._ack is not None:
            self._ack()


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    """A snapshot of the client: connection state, connections made, whether the
    broker kept the session at the last CONNACK, messages received, messages waiting
    for the consumer (channel + overflow), publishes waiting for their PUBACK."""

    connected: bool
    connections: int
    session_present: bool
    received: int
    queued: int
    overflow: int
    pending_publishes: int
    last_error: str | None


@dataclass(slots=True)
class _Waiter:
    """One PUBACK / SUBACK / UNSUBACK we wait for. ``result`` is the reason code(s);
    ``lost`` means the connection dropped before the answer."""

    event: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    lost: bool = False


@dataclass(frozen=True, slots=True)
class _Sub:
    qos: int
    no_local: bool
    retain_as_published: bool


class MQTTClient:
    """An MQTT 5 client on trio (see the module docstring).

    ``client_id`` empty → a random one (``atp-<hex>``); a persistent session needs a
    stable id. ``session_expiry_s`` is how long (s) the broker keeps the session after
    a disconnect (0: ends with the connection; ``math.inf``: never). ``keepalive_s``
    in seconds. ``max_packet_bytes`` is announced to the broker (it will not send us
    larger packets) and bounds what :meth:`publish` accepts. ``queue_size`` bounds the
    received-message channel. ``tls`` is an ``ssl.SSLContext`` (see :func:`tls_context`).
    ``reconnect_delay_s`` is the (first, max) backoff between connection attempts.
    """

    def __init__(
        self,
        host: str,
        port: int = 1883,
        *,
        client_id: str = "",
        clean_start: bool = True,
        session_expiry_s: float = 0,
        keepalive_s: int = 60,
        will: Will | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        max_packet_bytes: int = MQTT_MAX_PACKET,
        queue_size: int = 256,
        manual_ack: bool = False,
        connect_timeout_s: float = 10.0,
        reconnect_delay_s: tuple[float, float] = (0.1, 5.0),
    ):
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        if not 0 < max_packet_bytes <= MQTT_MAX_PACKET:
            raise ValueError(f"max_packet_bytes must be in 1..{MQTT_MAX_PACKET}")
        self.host = host
        self.port = port
        self.client_id = client_id or f"atp-{uuid.uuid4().hex[:16]}"
        self.clean_start = clean_start
        self.session_expiry_s = session_expiry_s
        self.keepalive_s = keepalive_s
        self.max_packet_bytes = max_packet_bytes
        self.manual_ack = manual_ack
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_delay_s = reconnect_delay_s
        self.queue_size = queue_size

        self._paho = self._make_paho(will, username, password, tls)

        self._send, self.messages = trio.open_memory_channel[Message](queue_size)
        self._overflow: deque[Message] = deque()
        self._trio_thread: int | None = None
        self._sock: Any = None
        self._write_event: trio.Event | None = None
        self._conn_lost: trio.Event | None = None
        self._connack: trio.Event | None = None
        self._connack_rc: ReasonCode | None = None
        self._connected = trio.Event()
        self._new_connection = trio.Event()
        self._closed = trio.Event()
        self._closing = False
        self._run_scope: trio.CancelScope | None = None
        self._subs: dict[str, _Sub] = {}
        self._pub_waiters: dict[int, _Waiter] = {}
        self._sub_waiters: dict[int, _Waiter] = {}
        self._connections = 0
        self._session_present = False
        self._received = 0
        self.last_error: str | None = None

    def _make_paho(self, will: Will | None, username: str | None, password: str | None,
                   tls: ssl.SSLContext | None) -> paho.Client:
        """The paho client behind this one (MQTT v5, our ``client_id``,
        ``manual_ack`` and ``connect_timeout_s``) with ``will``, the credentials
        and ``tls`` set and every paho callback routed to this object."""
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=paho.MQTTv5,
                        manual_ack=self.manual_ack)
        c.connect_timeout = self.connect_timeout_s
        # QoS 1 messages beyond this many in flight wait inside paho (not dropped).
        c.max_inflight_messages_set(100)
        if will is not None:
            c.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        if username is not None:
            c.username_pw_set(username, password)
        if tls is not None:
            c.tls_set_context(tls)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_subscribe = self._on_subscribe
        c.on_unsubscribe = self._on_unsubscribe
        c.on_socket_open = self._on_socket_open
        c.on_socket_close = self._on_socket_close
        c.on_socket_register_write = self._on_socket_register_write
        c.on_socket_unregister_write = self._on_socket_unregister_write
        return c

    # ------------------------------------------------------------------ public API
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, *, newer_than: int = 0) -> int:
        """Return once connected (CONNACK success) on a connection numbered above
        ``newer_than`` (connections count from 1; pass the number returned before to
        wait for the next reconnection); returns the connection's number. Raises
        MQTTError if the client closed."""
        while not (self._connected.is_set() and self._connections > newer_than):
            if self._closing:
                raise MQTTError("client is closed")
            await first_of(self._connected if not self._connected.is_set() else self._new_connection, self._closed)
        return self._connections

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(
            connected=self.connected,
            connections=self._connections,
            session_present=self._session_present,
            received=self._received,
            queued=self._send.statistics().current_buffer_used,
            overflow=len(self._overflow),
            pending_publishes=len(self._pub_waiters),
            last_error=self.last_error,
        )

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        message_expiry_s: int | None = None,
    ) -> None:
        """Publish ``payload`` (bytes) on ``topic``.

        QoS 1 returns after the broker's PUBACK, across reconnects (paho re-sends
        unacknowledged messages); QoS 0 returns once the message is queued. Waits for a
        connection first. ``message_expiry_s`` sets the MQTT 5 Message Expiry
        Interval. Raises MQTTError when the payload exceeds ``max_packet_bytes``, the
        PUBACK carries a failure reason code, or the client closes first.
        """
        if len(payload) > self.max_packet_bytes:
            raise MQTTError(f"payload of {len(payload)} bytes exceeds the {self.max_packet_bytes}-byte packet limit")
        props = None
        if message_expiry_s is not None:
            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = int(message_expiry_s)
        await self.wait_connected()
        info = self._paho.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            raise MQTTError(f"publish refused by the client: {paho.error_string(info.rc)}")
        if qos == 0:
            return
        waiter = self._pub_waiters[info.mid] = _Waiter()
        try:
            await waiter.event.wait()
        finally:
            self._pub_waiters.pop(info.mid, None)
        if waiter.lost:
            raise MQTTError("client closed before the PUBACK arrived")
        rc: ReasonCode | None = waiter.result
        if rc is not None and rc.is_failure:
            raise MQTTError(f"publish to {topic!r} refused: {rc.getName()}")

    async def subscribe(
        self, topic: str, *, qos: int = 1, no_local: bool = False, retain_as_published: bool = False
    ) -> int:
        """Subscribe to the filter ``topic``; returns the granted QoS after the SUBACK.

        The subscription is remembered and renewed after a reconnect when the broker
        did not keep the session. Raises MQTTError on a SUBACK failure code."""
        sub = _Sub(qos, no_local, retain_as_published)
        self._subs[topic] = sub
        waiter = await self._acked(lambda: self._paho.subscribe(topic, options=self._options(sub)))
        code: ReasonCode = waiter.result[0]
        if code.is_failure:
            self._subs.pop(topic, None)
            raise MQTTError(f"subscription to {topic!r} refused: {code.getName()}")
        return int(code.value)

    async def unsubscribe(self, topic: str) -> None:
        """Remove the subscription ``topic``; returns after the UNSUBACK."""
        self._subs.pop(topic, None)
        await self._acked(lambda: self._paho.unsubscribe(topic))

    async def round_trip(self) -> None:
        """One request/answer exchange with the broker (an UNSUBSCRIBE of a filter
        never subscribed). The broker handles a connection's packets in order, so when
        this returns every message it sent before — e.g. the retained messages that
        follow a SUBACK — has been read and queued for :attr:`messages`."""
        topic = f"atp/round-trip/{uuid.uuid4().hex}"
        await self._acked(lambda: self._paho.unsubscribe(topic))

    async def disconnect(self, timeout_s: float = 2.0) -> None:
        """Graceful close: send DISCONNECT (the broker then drops the Will), stop the
        connection tasks, end :attr:`messages`. Idempotent."""
        if self._trio_thread is None:  # never ran
            self._closing = True
            self._send.close()
            self._closed.set()
            return
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        lost = self._conn_lost
        if self._paho.socket() is not None and lost is not None:
            self._paho.disconnect()  # the writer sends it; paho then closes the socket
            with trio.move_on_after(timeout_s):
                await lost.wait()
        self._shutdown()
        await self._closed.wait()

    aclose = disconnect

    def abort(self) -> None:
        """Close the socket without DISCONNECT, like a crash: the broker publishes the
        Will. The client then reconnects unless it is closing."""
        sock = self._paho.socket()
        if sock is not None:
            self._paho._sock_close()
            self._signal_lost()

    # ------------------------------------------------------------------ the I/O loop
    async def run(self, *, task_status: trio.TaskStatus[MQTTClient] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, reconnect with backoff, and serve the connection until
        :meth:`disconnect` or cancellation. ``task_status.started`` is called at once:
        wait for the first connection with :meth:`wait_connected`."""
        self._trio_thread = threading.get_ident()
        first = True
        delay = self.reconnect_delay_s[0]
        try:
            with trio.CancelScope() as self._run_scope:
                task_status.started(self)
                while not self._closing:
                    try:
                        await self._serve_connection(first)
                        delay = self.reconnect_delay_s[0]
                    except ConnectError as e:
                        self.last_error = e.reason
                        log.info("mqtt %s:%d: %s", self.host, self.port, e.reason)
                    first = False
                    if self._closing:
                        break
                    await trio.sleep(delay)
                    delay = min(delay * 2, self.reconnect_delay_s[1])
        finally:
            self._shutdown()
            self._fail_waiters(lost=True)
            self._send.close()
            self._closed.set()

    async def _serve_connection(self, first: bool) -> None:
        c = self._paho
        self._connack = trio.Event()
        self._connack_rc = None
        self._conn_lost = trio.Event()
        self._sock = None
        props = Properties(PacketTypes.CONNECT)
        expiry = self.session_expiry_s
        props.SessionExpiryInterval = 0xFFFFFFFF if math.isinf(expiry) else int(expiry)
        props.MaximumPacketSize = self.max_packet_bytes
        if self.manual_ack:
            # Without our PUBACKs the broker sends at most this many QoS 1 messages.
            props.ReceiveMaximum = min(self.queue_size, 65535)
        try:
            if first:
                await trio.to_thread.run_sync(
                    lambda: c.connect(self.host, self.port, self.keepalive_s, clean_start=self.clean_start,
                                      properties=props)
                )
            else:
                await trio.to_thread.run_sync(c.reconnect)
        except (OSError, ssl.SSLError, ValueError) as e:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {_describe(e)}") from None
        sock = c.socket()
        if sock is None:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: no socket")
        self._sock = sock
        failure: ConnectError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reader, sock)
                nursery.start_soon(self._writer, sock)
                nursery.start_soon(self._misc, sock)
                with trio.move_on_after(self.connect_timeout_s) as timer:
                    await first_of(self._connack, self._conn_lost)
                rc = self._connack_rc
                if rc is None or rc.is_failure:
                    why = rc.getName() if rc is not None else ("no CONNACK in time" if timer.cancelled_caught
                                                               else "connection closed before the CONNACK")
                    # Raised after the nursery, so run() sees it bare (not in a group).
                    failure = ConnectError(f"broker {self.host}:{self.port} refused the connection: {why}")
                else:
                    self._connections += 1
                    self.last_error = None
                    if not self._session_present:
                        for topic, sub in self._subs.items():
                            c.subscribe(topic, options=self._options(sub))
                    self._connected.set()
                    self._new_connection.set()
                    self._new_connection = trio.Event()
                    await self._conn_lost.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self._connected.is_set():
                self._connected = trio.Event()
            self._fail_waiters(lost=True, publishes=False)
            if c.socket() is not None:
                c._sock_close()
        if failure is not None:
            raise failure

    async def _reader(self, sock: Any) -> None:
        c = self._paho
        try:
            while c.socket() is sock:
                while self._overflow:
                    # Back-pressure: read nothing more until the consumer has room.
                    await self._send.send(self._overflow[0])
                    self._overflow.popleft()
                await trio.lowlevel.wait_readable(sock)
                c.loop_read()
                # TLS may hold decrypted bytes that the socket no longer signals.
                while c.socket() is sock and getattr(sock, "pending", lambda: 0)() > 0:
                    c.loop_read()
        except (trio.ClosedResourceError, OSError, ValueError):
            pass
        except trio.BrokenResourceError:
            return  # consumer closed the channel: client is going away
        self._signal_lost()

    async def _writer(self, sock: Any) -> None:
        c = self._paho
        try:
            while c.socket() is sock:
                if not c.want_write():
                    self._write_event = trio.Event()
                    await self._write_event.wait()
                    continue
                await trio.lowlevel.wait_writable(sock)
                c.loop_write()
        except (trio.ClosedResourceError, OSError, ValueError):
            pass
        self._signal_lost()

    async def _misc(self, sock: Any) -> None:
        c = self._paho
        while c.socket() is sock:
            await trio.sleep(min(_MISC_INTERVAL_S, max(self.keepalive_s / 4, 0.05)))
            c.loop_misc()
        self._signal_lost()

    # ------------------------------------------------------------------ helpers
    def _in_trio(self) -> bool:
        return threading.get_ident() == self._trio_thread

    def _signal_lost(self) -> None:
        if self._conn_lost is not None and self._in_trio():
            self._conn_lost.set()

    def _shutdown(self) -> None:
        self._closing = True
        if self._run_scope is not None:
            self._run_scope.cancel()

    def _fail_waiters(self, *, lost: bool, publishes: bool = True) -> None:
        """Wake SUBACK/UNSUBACK waiters (their operation is retried on the next
        connection) and, when the client closes, PUBACK waiters too."""
        for w in self._sub_waiters.values():
            w.lost = lost
            w.event.set()
        self._sub_waiters.clear()
        if publishes:
            for w in self._pub_waiters.values():
                w.lost = lost
                w.event.set()

    async def _acked(self, send: Callable[[], tuple[MQTTErrorCode, int | None]]) -> _Waiter:
        """Send a SUBSCRIBE or UNSUBSCRIBE with ``send`` once connected and return
        the waiter its SUBACK / UNSUBACK answered; sent again on the next connection
        when the connection drops before the answer."""
        while True:
            await self.wait_connected()
            rc, mid = send()
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
                await trio.lowlevel.checkpoint()
                continue
            waiter = await self._await_ack(self._sub_waiters, mid)
            if not waiter.lost:
                return waiter

    async def _await_ack(self, table: dict[int, _Waiter], mid: int) -> _Waiter:
        waiter = table.setdefault(mid, _Waiter())
        try:
            await waiter.event.wait()
        finally:
            if table.get(mid) is waiter:
                del table[mid]
        return waiter

    @staticmethod
    def _options(sub: _Sub) -> SubscribeOptions:
        return SubscribeOptions(qos=sub.qos, noLocal=sub.no_local, retainAsPublished=sub.retain_as_published)

    def _deliver(self, msg: Message) -> None:
        self._received += 1
        if self._overflow:
            self._overflow.append(msg)
            return
        # A closed channel means nobody consumes any more: the client is closing.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            try:
                self._send.send_nowait(msg)
            except trio.WouldBlock:
                self._overflow.append(msg)

    # ------------------------------------------------------------------ paho callbacks
    # All but the socket ones run in the trio thread (inside loop_read/loop_write/
    # loop_misc); on_socket_open / register_write can also run in the connect thread.
    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        self._sock = sock

    def _on_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        if self._in_trio():
            trio.lowlevel.notify_closing(sock)
            self._signal_lost()

    def _on_socket_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        ev = self._write_event
        if ev is not None and self._in_trio():
            ev.set()

    def _on_socket_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        """Nothing to do: the writer re-checks ``want_write()`` itself."""

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: ReasonCode, properties: Any) -> None:
        self._connack_rc = rc
        self._session_present = bool(getattr(flags, "session_present", False)) and not rc.is_failure
        if self._connack is not None:
            self._connack.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any) -> None:
        if rc is not None and getattr(rc, "is_failure", False):
            self.last_error = f"disconnected: {rc.getName()}"
        self._signal_lost()

    def _on_message(self, client: Any, userdata: Any, m: Any) -> None:
        ack = None
        if self.manual_ack and m.qos > 0:
            mid, qos = m.mid, m.qos
            ack = lambda: self._paho.ack(mid, qos)
        try:
            topic = m.topic
        except UnicodeDecodeError:
            return  # not a valid MQTT topic: nothing can subscribe to it meaningfully
        self._deliver(Message(topic, bytes(m.payload), m.qos, bool(m.retain), bool(m.dup), ack))

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: ReasonCode, properties: Any) -> None:
        # Registered synchronously right after paho's publish(): the PUBACK can only
        # be read later, by the reader task. QoS 0 publishes have no waiter.
        w = self._pub_waiters.get(mid)
        if w is not None:
            w.result = rc
            w.event.set()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: list[ReasonCode], properties: Any) -> None:
        w = self._sub_waiters.get(mid)
        if w is not None:
            w.result = codes
            w.event.set()

    _on_unsubscribe = _on_subscribe


async def first_of(*events: trio.Event) -> None:
    """Return as soon as any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for ev in events:
            async def wait(ev: trio.Event = ev) -> None:
                await ev.wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(wait)


def _describe(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed ({e.verify_message})"
    if isinstance(e, ssl.SSLError):
        return f"TLS error ({e.reason or e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


@asynccontextmanager
async def open_mqtt_client(host: str, port: int = 1883, **kwargs: Any) -> AsyncIterator[MQTTClient]:
    """An :class:`MQTTClient` connected for the duration of the block (keyword
    arguments as for the class). Raises ConnectError when the first connection does
    not succeed within ``connect_timeout_s``; on exit sends DISCONNECT. An exception
    from the block comes out as itself, not inside an exception group."""
    client = MQTTClient(host, port, **kwargs)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            try:
                with trio.move_on_after(client.connect_timeout_s) as timer:
                    await client.wait_connected()
                if timer.cancelled_caught:
                    raise ConnectError(client.last_error or f"no connection to {host}:{port} "
                                       f"within {client.connect_timeout_s} s")
                yield client
            finally:
                with trio.CancelScope(shield=True):
                    await client.disconnect()
    except BaseExceptionGroup as group:
        raise _single(group) from None


def _single(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside nested single-member groups, else the group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
