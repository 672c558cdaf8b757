"""The ATP client (spec §22): open streams on a router and follow their events.

One client, two transports, one API. Works under trio and asyncio alike (httpx
and anyio pick the running event loop). Over the router's HTTP control API
(``http://`` / ``https://``: SSE events)::

    async with atp.Client("http://127.0.0.1:7070", token) as c:
        sid, st = await c.open_stream(task={"task_type": "code_review", "diff_loc": 42},
                                      budget={"usd": 0.10, "tokens": 200_000},
                                      content={"diff": diff_text, "files": files})
        async for event in c.events(st):
            if event.type == "FINAL":
                return event.payload        # {"result": {...}, "telemetry": {...}} (§7.3)

Over the router's WebSocket ingress (``ws://`` / ``wss://``, spec §4.1), JSON
(text) or CBOR (binary) frames, signed when given the router's frame keys::

    async with atp.Client("ws://127.0.0.1:7071", token, encoding="cbor",
                          keys=os.environ.get("ATP_HMAC_KEYS")) as c:
        sid, st = await c.open_stream(task=meta, budget=budget, content=body)
        result = await c.result(st)

The WebSocket client connects in ``async with`` (a refused handshake raises
there: ``ESEC`` with ``status`` 401/403), heartbeats, and on a dropped or silent
connection reconnects and resumes every open stream (``meta.resume_after``),
so ``events()`` goes on with no duplicate and no gap; event ids are the
router's, the same as the SSE ids (see :mod:`atp._ws`).

Errors: :class:`ATPClientError` carries the router's error ``code`` (``EPROTO``,
``EBUDGET``, ``EAGENTDOWN``, ``ESEC``, … spec §10) and ``reason``; transport
failures are raised as ``ATPClientError(code="ETRANSPORT")`` after the SDK's
retries (HTTP: per request; WebSocket: after ``reconnect_s`` of reconnecting).

Budgets and resumption (spec §4.3, §8)::

    await c.budget_update(st, usd=0.50)              # raise (or lower) the stream's budget live
    # after a crash or a dropped connection, in a new process (either transport):
    _, st = await c.open_stream(task=meta, content=body, idempotency_key="review-42")  # the same stream
    async for event in c.events(st, last_event_id=last_seen_id): ...                  # what was missed
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import httpx

from atp._frames import Encoding, FrameKeys, as_keys
from atp._http import HttpTransport
from atp._types import EVENT_TYPES, ATPClientError, Event, StreamHandle

if TYPE_CHECKING:
    from atp._ws import WsTransport

__all__ = ["EVENT_TYPES", "ATPClientError", "Client", "Event", "StreamHandle"]


class _Streams(Protocol):
    async def open_stream(self, task: Mapping[str, Any], budget: Mapping[str, Any] | None, *,
                          content: Mapping[str, Any] | None, qos: str | None, window: Mapping[str, int] | None,
                          idempotency_key: str | None) -> StreamHandle: ...

    def events(self, stream: StreamHandle | str, *, last_event_id: int | None = None) -> AsyncIterator[Event]: ...

    async def send_frame(self, stream: StreamHandle | str, frame: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    async def budget_update(self, stream: StreamHandle, *, usd: float | None, tokens: int | None,
                            msg_seq: int | None) -> list[dict[str, Any]]: ...

    def discard(self, stream: StreamHandle | str) -> None: ...

    async def aclose(self) -> None: ...


class Client:
    """Async client of an ATP router.

    ``url``: the router's HTTP base (``http://127.0.0.1:7070``) or its WebSocket
    ingress (``ws://127.0.0.1:7071``, ``wss://…``). ``token`` is sent as
    ``Authorization: Bearer``. ``timeout`` (s) bounds each request — over
    WebSocket the handshake, a SYN's SYN-ACK and a message's ACK — not the events.
    ``keys``: the router's frame keys (spec §11) to sign the frames the client
    sends and check the router's: :class:`FrameKeys`, ``ATP_HMAC_KEYS`` text
    (``"kid:base64key,…"``, the first signs) or raw ``bytes`` (``ATP_HMAC_KEY``).

    WebSocket only: ``encoding`` ``"json"`` or ``"cbor"``; ``hb_interval_s``
    between heartbeats; ``hb_timeout_s`` of silence that makes the connection
    dead; ``reconnect_s`` of reconnecting before giving up; ``http_url`` the
    router's HTTP base for the control-API calls (:meth:`feedback`, :meth:`fib`,
    :meth:`reload_policies`, :meth:`metrics`). HTTP only: ``transport`` (a custom
    httpx transport, in tests). Raises ``ValueError`` for another URL scheme, a
    bad encoding or bad keys.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        encoding: Encoding = "json",
        keys: FrameKeys | bytes | str | Mapping[str, bytes] | None = None,
        http_url: str | None = None,
        hb_interval_s: float = 10.0,
        hb_timeout_s: float = 30.0,
        reconnect_s: float = 60.0,
    ):
        scheme = urlsplit(url).scheme
        ring = as_keys(keys)
        self._ws: WsTransport | None = None
        self._http: HttpTransport | None = None
        if scheme in ("ws", "wss"):
            from atp._ws import WsTransport

            self._ws = WsTransport(url, token, encoding=encoding, keys=ring, timeout=timeout,
                                   hb_interval_s=hb_interval_s, hb_timeout_s=hb_timeout_s, reconnect_s=reconnect_s)
            if http_url is not None:
                self._http = HttpTransport(http_url, token, timeout=timeout, transport=transport, keys=ring)
            self._streams: _Streams = self._ws
        elif scheme in ("http", "https"):
            self._http = HttpTransport(url, token, timeout=timeout, transport=transport, keys=ring)
            self._streams = self._http
        else:
            raise ValueError(f"router URL {url!r}: expected http://, https://, ws:// or wss://")

    @property
    def transport(self) -> str:
        """``"websocket"`` or ``"http"``."""
        return "websocket" if self._ws is not None else "http"

    async def __aenter__(self) -> Client:
        if self._ws is not None:
            await self._ws.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections. Streams go on on the router (resumable by key)."""
        if self._ws is not None:
            await self._ws.aclose()
        if self._http is not None:
            await self._http.aclose()

    def _control(self) -> HttpTransport:
        if self._http is None:
            raise ATPClientError("EPROTO", "the control API needs the router's HTTP URL: "
                                 "atp.Client(ws_url, token, http_url='http://…')")
        return self._http

    async def open_stream(
        self,
        task: Mapping[str, Any],
        budget: Mapping[str, Any] | None = None,
        *,
        content: Mapping[str, Any] | None = None,
        qos: str | None = None,
        window: Mapping[str, int] | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[str, StreamHandle]:
        """SYN a stream (spec §8 step 1) and return ``(session_id, handle)`` once the
        router answered SYN-ACK.

        ``task`` is the task meta (``task_type`` plus match keys such as ``diff_loc``,
        ``languages``); ``budget`` is ``{"usd": float, "tokens": int}``; ``content``
        is the task body (for ``code_review``: ``{"diff": str, "files": {path: text}}``);
        ``qos`` ``"gold"``/``"silver"``/``"bronze"``; ``window``
        ``{"max_parallel", "max_tokens", "max_usd_micros"}`` (the router grants at
        most that). Re-sending the same ``idempotency_key`` returns the same
        stream — also from another ``Client``, over either transport, after a
        crash or a dropped connection (spec §8): the task is not run twice nor
        charged twice; follow it with ``events(handle, last_event_id=...)`` to
        get what was missed. Over WebSocket a stream without a key gets a
        random one (so a dropped connection can resume it).
        Raises :class:`ATPClientError` (``EPROTO`` bad request or a key re-used
        with another task, ``EAGENTDOWN`` no route, ``ESEC`` bad token or frame
        signature, ``ETRANSPORT`` no answer within ``timeout``); ``ValueError`` /
        ``TypeError`` for a task JSON cannot carry (WebSocket).
        """
        handle = await self._streams.open_stream(task, budget, content=content, qos=qos, window=window,
                                                 idempotency_key=idempotency_key)
        return handle.session_id, handle

    async def send_frame(self, stream: StreamHandle | str, frame: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Send one frame (a dict in the §4.2 shape) on a stream and return the
        frames the router answered it with (its ACK or NACK, an ERROR; ``[]`` when
        none: a frame that is not a message, or a stream that had ended). The SDK
        seals it (and signs it with ``keys``). Raises :class:`ATPClientError`."""
        return await self._streams.send_frame(stream, frame)

    async def budget_update(
        self,
        stream: StreamHandle,
        *,
        usd: float | None = None,
        tokens: int | None = None,
        msg_seq: int | None = None,
    ) -> list[dict[str, Any]]:
        """Raise or lower the stream's budget while it runs (BUDGET_UPDATE, spec
        §4.3): ``usd`` (float USD) and ``tokens`` are the new limits of the
        stream, ``None`` meaning no limit of the stream's own on that axis (the
        policy's and the client's budgets still cap it). A limit below what the
        stream already spent stops further calls. Sent as a control message on
        the stream's sequence; ``msg_seq`` is this client's next message number,
        tracked by the SDK from ``open_stream``/``send_frame`` and the router's
        ACKs (pass it after resuming from another process over HTTP). Returns
        the router's answer frames (an ACK)."""
        return await self._streams.budget_update(stream, usd=usd, tokens=tokens, msg_seq=msg_seq)

    def events(self, stream: StreamHandle | str, *, last_event_id: int | None = None) -> AsyncIterator[Event]:
        """Follow a stream's events until FIN or RST (an async iterator of :class:`Event`).

        Events already sent are replayed first, so subscribing late loses nothing;
        ``last_event_id`` resumes after that event (spec §8 resumption). Over HTTP
        an SSE request; over WebSocket the events this client received on the
        stream (it must have opened it: ``EPROTO`` otherwise). Raises
        :class:`ATPClientError` (``ETRANSPORT``; over WebSocket ``EPROTO``/``ESEC``
        for a router frame that failed its checks)."""
        return self._streams.events(stream, last_event_id=last_event_id)

    def discard(self, stream: StreamHandle | str) -> None:
        """Forget what this client holds of a stream (over WebSocket its events,
        and it is no longer resumed on reconnection)."""
        self._streams.discard(stream)

    async def result(self, stream: StreamHandle | str) -> dict[str, Any]:
        """Wait for the stream's FINAL and return its payload (the §7.3 result).
        Raises :class:`ATPClientError` with the router's code if the stream ends in
        RST or FIN without a FINAL (``EBUDGET``, ``EAGENTDOWN``, …)."""
        last_error: Any = None
        async for ev in self.events(stream):
            if ev.type == "FINAL":
                final: dict[str, Any] = ev.payload
                return final
            if ev.type in ("ERROR", "RST") and isinstance(ev.payload, dict):
                last_error = ev.payload
        if last_error:
            raise ATPClientError(last_error.get("code", "EPROTO"), last_error.get("reason", ""), detail=last_error)
        raise ATPClientError("EPROTO", "stream ended without FINAL")

    async def feedback(self, stream: StreamHandle | str, score: float,
                       labels: Sequence[str] = ()) -> dict[str, Any]:
        """Score a finished stream's result (spec §6.2 quality signal):
        ``score`` from 0 (wrong or useless) to 1 (right and useful), ``labels``
        up to 16 short tags (``"false_positive"``, ``"missed_bug"``, …). The
        next-hops that served the stream learn it; once per stream. Returns
        ``{stream_id, agents, score, labels, bandit}``. Raises
        :class:`ATPClientError` (HTTP 409: still running, already scored, or
        nothing answered; 404: not the caller's stream)."""
        return await self._control().feedback(stream, score, labels)

    async def fib(self) -> dict[str, Any]:
        """``GET /v1/fib`` (admin): bandit arms and live next-hop metrics."""
        out: dict[str, Any] = (await self._control().request("GET", "/v1/fib")).json()
        return out

    async def reload_policies(self, rib_yaml: str | None = None) -> dict[str, Any]:
        """Hot-reload the RIB (§22): from the router's policy path, or from ``rib_yaml``
        text. Raises ``ATPClientError`` with ``detail={"file","key","reason"}`` if the
        router refused it (the running RIB stays)."""
        return await self._control().reload_policies(rib_yaml)

    async def metrics(self) -> str:
        """The Prometheus exposition text of ``GET /v1/metrics``."""
        return (await self._control().request("GET", "/v1/metrics")).text
