"""The ATP client (spec §22): open streams on a router and follow their events.

Works under trio and asyncio alike (httpx picks the running event loop)::

    async with atp.Client("http://127.0.0.1:7070", token) as c:
        sid, st = await c.open_stream(task={"task_type": "code_review", "diff_loc": 42},
                                      budget={"usd": 0.10, "tokens": 200_000},
                                      content={"diff": diff_text, "files": files})
        async for event in c.events(st):
            if event.type == "FINAL":
                return event.payload        # {"result": {...}, "telemetry": {...}} (§7.3)

Errors: :class:`ATPClientError` carries the router's error ``code`` (``EPROTO``,
``EBUDGET``, ``EAGENTDOWN``, … spec §10) and ``reason``; transport failures are
raised as ``ATPClientError(code="ETRANSPORT")`` after the SDK's retries.

Budgets and resumption (spec §4.3, §8)::

    await c.budget_update(st, usd=0.50)              # raise (or lower) the stream's budget live
    # after a crash or a dropped connection, in a new process:
    _, st = await c.open_stream(task=meta, content=body, idempotency_key="review-42")  # the same stream
    async for event in c.events(st, last_event_id=last_seen_id): ...                  # what was missed
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse

#: Event types a stream yields, in the order they usually come.
EVENT_TYPES = ("SYN_ACK", "ACK", "WINDOW_UPDATE", "PARTIAL", "ERROR", "FINAL", "FIN", "RST")
_TERMINAL = frozenset({"FIN", "RST"})


class ATPClientError(Exception):
    """An error reported by the router (``code`` is a spec §10 code) or the transport."""

    def __init__(self, code: str, reason: str, *, status: int | None = None, detail: Any = None):
        self.code = code
        self.reason = reason
        self.status = status
        self.detail = detail
        super().__init__(f"{code}: {reason}")


@dataclass(frozen=True, slots=True)
class StreamHandle:
    """An open stream: ids and the window the router granted at SYN-ACK."""

    session_id: str
    stream_id: str
    window: dict[str, int] = field(default_factory=dict)
    route: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.stream_id


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a stream. ``type`` is one of :data:`EVENT_TYPES`; ``payload`` is
    the frame's ``payload.content`` (the §7.3 result for FINAL, the ERROR body for
    ERROR/RST); ``frame`` is the whole frame as a dict; ``id`` orders events and is
    what ``events(..., last_event_id=)`` resumes after."""

    type: str
    payload: Any
    frame: dict[str, Any]
    id: int


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        body = resp.json()
        err = body.get("error", body)
        raise ATPClientError(err.get("code", "EPROTO"), err.get("reason", resp.text), status=resp.status_code, detail=err)
    except (ValueError, AttributeError):
        raise ATPClientError("EPROTO", f"HTTP {resp.status_code}: {resp.text[:200]}", status=resp.status_code) from None


class Client:
    """Async client for the router's control API.

    ``url`` is the router's HTTP base (e.g. ``http://127.0.0.1:7070``); ``token`` is
    sent as ``Authorization: Bearer``. ``timeout`` (s) bounds each request, not the
    events stream. Pass ``transport`` to use a custom httpx transport in tests.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )
        #: stream_id → msg_seq of the client's next message on it (the SYN was 0).
        self._next_seq: dict[str, int] = {}

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ATPClientError("ETRANSPORT", f"{type(e).__name__}: {e}") from e
        _raise_for(resp)
        return resp

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
        is the task body (for ``code_review``: ``{"diff": str, "files": {path: text}}``).
        Re-sending the same ``idempotency_key`` returns the same stream — also
        from another ``Client`` after a crash or a dropped connection (spec §8):
        the task is not run twice nor charged twice; follow it with
        ``events(handle, last_event_id=...)`` to get what was missed.
        Raises :class:`ATPClientError` (``EPROTO`` bad request, ``EAGENTDOWN`` no
        route, ``ESEC`` bad token).
        """
        body: dict[str, Any] = {"task": dict(task)}
        if budget is not None:
            body["budget"] = dict(budget)
        if content is not None:
            body["content"] = dict(content)
        if qos is not None:
            body["qos"] = qos
        if window is not None:
            body["window"] = dict(window)
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        data = (await self._request("POST", "/v1/streams", json=body)).json()
        handle = StreamHandle(data["session_id"], data["stream_id"], data.get("window") or {}, data.get("route") or {})
        self._next_seq.setdefault(handle.stream_id, 1)
        return handle.session_id, handle

    async def send_frame(self, stream: StreamHandle | str, frame: Mapping[str, Any]) -> list[dict[str, Any]]:
        """POST one frame on a stream (HTTP fallback to WebSocket, §22); returns the
        frames the router answered with (ACK, ERROR, …)."""
        sid = str(stream)
        frames = (await self._request("POST", f"/v1/streams/{sid}/frames", json=dict(frame))).json()["frames"]
        flags = set(frame.get("flags") or ())
        if not flags & {"SYN", "ACK", "FIN", "RST", "HB", "MORE"} and isinstance(frame.get("msg_seq"), int):
            self._seen_message(sid, frame["msg_seq"])
        for f in frames:
            self._note_ack(sid, f)
        return frames

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
        ACKs (pass it after resuming from another process). Returns the router's
        answer frames (an ACK)."""
        sid = stream.stream_id
        seq = msg_seq if msg_seq is not None else self._next_seq.get(sid, 1)
        budget: dict[str, Any] = {}
        if usd is not None:
            budget["usd"] = usd
        if tokens is not None:
            budget["tokens"] = tokens
        frame = {
            "v": 1, "session_id": stream.session_id, "stream_id": sid, "msg_seq": seq, "flags": ["CTRL"],
            "payload": {"type": "control", "content": {"kind": "BUDGET_UPDATE", "budget": budget}},
        }
        return await self.send_frame(stream, frame)

    def _seen_message(self, stream_id: str, msg_seq: int) -> None:
        self._next_seq[stream_id] = max(self._next_seq.get(stream_id, 1), msg_seq + 1)

    def _note_ack(self, stream_id: str, frame: Mapping[str, Any]) -> None:
        """A router ACK names the last client message it delivered (cumulative, §4.4)."""
        flags = frame.get("flags") or ()
        if "ACK" in flags and "SYN" not in flags and isinstance(frame.get("msg_seq"), int):
            self._seen_message(stream_id, frame["msg_seq"])

    async def events(self, stream: StreamHandle | str, *, last_event_id: int | None = None) -> AsyncIterator[Event]:
        """Follow a stream's events over SSE until FIN or RST.

        Events already sent are replayed first, so subscribing late loses nothing;
        ``last_event_id`` resumes after that event (spec §8 resumption).
        """
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        url = f"/v1/streams/{stream}/events"
        try:
            async with aconnect_sse(self._http, "GET", url, headers=headers, timeout=None) as source:
                if not source.response.is_success:
                    await source.response.aread()
                    _raise_for(source.response)
                async for sse in source.aiter_sse():
                    if not sse.data:
                        continue
                    frame = json.loads(sse.data)
                    payload = (frame.get("payload") or {}).get("content")
                    ev = Event(type=sse.event or "message", payload=payload, frame=frame, id=int(sse.id or 0))
                    self._note_ack(str(stream), frame)
                    yield ev
                    if ev.type in _TERMINAL:
                        return
        except httpx.TransportError as e:
            raise ATPClientError("ETRANSPORT", f"{type(e).__name__}: {e}") from e

    async def result(self, stream: StreamHandle | str) -> dict[str, Any]:
        """Wait for the stream's FINAL and return its payload (the §7.3 result).
        Raises :class:`ATPClientError` with the router's code if the stream ends in
        RST or FIN without a FINAL (``EBUDGET``, ``EAGENTDOWN``, …)."""
        last_error: Any = None
        async for ev in self.events(stream):
            if ev.type == "FINAL":
                return ev.payload
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
        sid = stream.stream_id if isinstance(stream, StreamHandle) else stream
        resp = await self._request("POST", f"/v1/streams/{sid}/feedback",
                                   json={"score": float(score), "labels": list(labels)})
        return resp.json()

    async def fib(self) -> dict[str, Any]:
        """``GET /v1/fib`` (admin): bandit arms and live next-hop metrics."""
        return (await self._request("GET", "/v1/fib")).json()

    async def reload_policies(self, rib_yaml: str | None = None) -> dict[str, Any]:
        """Hot-reload the RIB (§22): from the router's policy path, or from ``rib_yaml``
        text. Raises ``ATPClientError`` with ``detail={"file","key","reason"}`` if the
        router refused it (the running RIB stays)."""
        if rib_yaml is None:
            resp = await self._request("POST", "/v1/policies/reload")
        else:
            resp = await self._request(
                "POST", "/v1/policies/reload", content=rib_yaml, headers={"Content-Type": "application/yaml"}
            )
        return resp.json()

    async def metrics(self) -> str:
        """The Prometheus exposition text of ``GET /v1/metrics``."""
        return (await self._request("GET", "/v1/metrics")).text
