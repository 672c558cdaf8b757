"""The HTTP transport of :class:`atp.Client`: the router's control API (spec §22),
``POST /v1/streams``, frames by ``POST /v1/streams/{id}/frames`` and events as
Server-Sent Events (``httpx`` + ``httpx-sse``; trio or asyncio)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from atp._frames import FrameKeys, budget_frame, flags_of, seal
from atp._types import TERMINAL, ATPClientError, Event, StreamHandle


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        body = resp.json()
        err = body.get("error", body)
        raise ATPClientError(err.get("code", "EPROTO"), err.get("reason", resp.text), status=resp.status_code, detail=err)
    except (ValueError, AttributeError):
        raise ATPClientError("EPROTO", f"HTTP {resp.status_code}: {resp.text[:200]}", status=resp.status_code) from None


class HttpTransport:
    """Requests to the router's control API at ``url`` with ``Authorization:
    Bearer <token>``; ``timeout`` (s) bounds each request, not the events stream.
    With ``keys`` the frames it posts are signed (spec §11)."""

    def __init__(self, url: str, token: str | None, *, timeout: float,
                 transport: httpx.AsyncBaseTransport | None, keys: FrameKeys | None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)
        self.keys = keys
        #: stream_id → msg_seq of the client's next message on it (the SYN was 0).
        self._next_seq: dict[str, int] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ATPClientError("ETRANSPORT", f"{type(e).__name__}: {e}") from e
        _raise_for(resp)
        return resp

    async def open_stream(self, task: Mapping[str, Any], budget: Mapping[str, Any] | None, *,
                          content: Mapping[str, Any] | None, qos: str | None, window: Mapping[str, int] | None,
                          idempotency_key: str | None) -> StreamHandle:
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
        data = (await self.request("POST", "/v1/streams", json=body)).json()
        handle = StreamHandle(data["session_id"], data["stream_id"], data.get("window") or {}, data.get("route") or {})
        self._next_seq.setdefault(handle.stream_id, 1)
        return handle

    async def send_frame(self, stream: StreamHandle | str, frame: Mapping[str, Any]) -> list[dict[str, Any]]:
        sid = str(stream)
        body = seal(frame, self.keys) if self.keys is not None else dict(frame)
        frames: list[dict[str, Any]] = (await self.request("POST", f"/v1/streams/{sid}/frames", json=body)).json()["frames"]
        if not flags_of(frame) & {"SYN", "ACK", "FIN", "RST", "HB", "MORE"} and isinstance(frame.get("msg_seq"), int):
            self._seen_message(sid, frame["msg_seq"])
        for f in frames:
            self._note_ack(sid, f)
        return frames

    async def budget_update(self, stream: StreamHandle, *, usd: float | None, tokens: int | None,
                            msg_seq: int | None) -> list[dict[str, Any]]:
        sid = stream.stream_id
        seq = msg_seq if msg_seq is not None else self._next_seq.get(sid, 1)
        return await self.send_frame(stream, budget_frame(stream.session_id, sid, seq, usd, tokens))

    def _seen_message(self, stream_id: str, msg_seq: int) -> None:
        self._next_seq[stream_id] = max(self._next_seq.get(stream_id, 1), msg_seq + 1)

    def _note_ack(self, stream_id: str, frame: Mapping[str, Any]) -> None:
        """A router ACK names the last client message it delivered (cumulative, §4.4)."""
        flags = flags_of(frame)
        if "ACK" in flags and "SYN" not in flags and isinstance(frame.get("msg_seq"), int):
            self._seen_message(stream_id, frame["msg_seq"])

    def discard(self, stream: StreamHandle | str) -> None:
        self._next_seq.pop(str(stream), None)

    async def events(self, stream: StreamHandle | str, *, last_event_id: int | None = None) -> AsyncIterator[Event]:
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
                    if ev.type in TERMINAL:
                        return
        except httpx.TransportError as e:
            raise ATPClientError("ETRANSPORT", f"{type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ control API
    async def feedback(self, stream: StreamHandle | str, score: float, labels: Sequence[str]) -> dict[str, Any]:
        sid = stream.stream_id if isinstance(stream, StreamHandle) else stream
        resp = await self.request("POST", f"/v1/streams/{sid}/feedback",
                                  json={"score": float(score), "labels": list(labels)})
        out: dict[str, Any] = resp.json()
        return out

    async def reload_policies(self, rib_yaml: str | None) -> dict[str, Any]:
        if rib_yaml is None:
            resp = await self.request("POST", "/v1/policies/reload")
        else:
            resp = await self.request(
                "POST", "/v1/policies/reload", content=rib_yaml, headers={"Content-Type": "application/yaml"}
            )
        out: dict[str, Any] = resp.json()
        return out
