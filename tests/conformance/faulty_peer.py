"""A fault-injecting next-hop: a real HTTP/1.1 server on loopback that reproduces the
**OpenAI-compatible chat-completions streaming shape** (``POST /v1/chat/completions``
with ``stream: true`` answered by Server-Sent Events of ``chat.completion.chunk``
objects, a ``usage`` chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``; errors as ``{"error": {...}}`` with their HTTP status) — the shape
of OpenAI, vLLM, Ollama's ``/v1`` and llama-cpp-python's server.

The conformance suite points model agents of its RIB (``policies/conformance.yaml``)
at this server, so ``ETIMEOUT``, ``EAGENTDOWN`` and ``EBUDGET`` are reachable over
the wire for *any* ATP implementation whose RIB can name an OpenAI-compatible model.

What the server does is told per request by the **model name**: a label, then
``+key=value`` options, e.g. ``down+status=500`` or ``slow+delay_ms=3000``::

    delay_ms=N        wait N ms before answering at all (a slow or hung agent)
    chunk_delay_ms=N  wait N ms before each content chunk (a slow stream)
    status=S          answer with HTTP status S and an error body (500, 503, 429 …)
    retry_after=SEC   with ``status``: a ``Retry-After: SEC`` header
    fail_first=N      ``status`` applies to the first N calls of this model only
    drop_after=K      close the TCP connection after K content chunks (mid-stream)
    usage=IN/OUT      report exactly IN prompt and OUT completion tokens
    finding=F:L:SEV   the answer reports one finding at file F, line L, severity SEV
    chunks=N          split the answer text into N content chunks (default 4)
    conf=X            confidence of the finding (default 0.9)

Without ``usage`` the reported usage is prompt characters / 4 and answer characters
/ 4. The answer text is ``{"findings": [...]}`` (the review reply shape the router's
adapters parse).

Bookkeeping for tests (not part of the OpenAI shape): ``GET /stats`` →
``{model: {calls, ok, failed, dropped, disconnected, in_flight, max_in_flight,
log: [[start_s, end_s, outcome], …]}}`` (times in seconds on the server's clock);
``POST /reset`` clears it.

Run standalone (for testing an implementation on another port or host)::

    python -m tests.conformance.faulty_peer --port 18099
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11
import trio

MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Behaviour:
    """The options parsed from a model name (see the module docstring)."""

    label: str
    delay_ms: int = 0
    chunk_delay_ms: int = 0
    status: int | None = None
    retry_after: float | None = None
    fail_first: int | None = None
    drop_after: int | None = None
    usage: tuple[int, int] | None = None
    finding: tuple[str, int, str] | None = None
    chunks: int = 4
    conf: float = 0.9

    @classmethod
    def parse(cls, model: str) -> Behaviour:
        """Raises ValueError on an unknown key or a malformed value."""
        label, *opts = model.split("+")
        kw: dict[str, Any] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep:
                raise ValueError(f"option {opt!r}: expected key=value")
            if key in ("delay_ms", "chunk_delay_ms", "status", "fail_first", "drop_after", "chunks"):
                kw[key] = int(value)
            elif key in ("retry_after", "conf"):
                kw[key] = float(value)
            elif key == "usage":
                i, o = value.split("/")
                kw[key] = (int(i), int(o))
            elif key == "finding":
                f, line, sev = value.rsplit(":", 2)
                kw[key] = (f, int(line), sev)
            else:
                raise ValueError(f"unknown option {key!r}")
        return cls(label, **kw)


@dataclass
class ModelStats:
    calls: int = 0
    ok: int = 0
    failed: int = 0
    dropped: int = 0
    disconnected: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    log: list[list[Any]] = field(default_factory=list)


class FaultyPeer:
    """The server's state: per-model statistics. :meth:`serve` runs it."""

    def __init__(self) -> None:
        self.stats: dict[str, ModelStats] = {}
        self.port: int | None = None

    def of(self, label: str) -> ModelStats:
        """The statistics of the model whose name starts with ``label`` (zeros if never called)."""
        for model, st in self.stats.items():
            if model.split("+", 1)[0] == label:
                return st
        return ModelStats()

    async def serve(self, host: str = "127.0.0.1", port: int = 0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (0: a free port, then in :attr:`port`) until cancelled."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._connection, listeners)

    # --- HTTP/1.1 on h11 (keep-alive, as the router's httpx client uses it) ---

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            while True:
                request, body = await self._read_request(conn, stream)
                if request is None:
                    return
                keep = await self._handle(conn, stream, request, body)
                if not keep or conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    @staticmethod
    async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> tuple[h11.Request | None, bytes]:
        request = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and request is None:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BYTES:
                    raise h11.RemoteProtocolError("request body too large")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    @staticmethod
    async def _send(conn: h11.Connection, stream: trio.SocketStream, *events: Any) -> None:
        for ev in events:
            data = conn.send(ev)
            if data:
                await stream.send_all(data)

    async def _json(self, conn, stream, status: int, obj: Any, headers: list[tuple[str, str]] = ()) -> None:
        body = json.dumps(obj).encode()
        hdrs = [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
        await self._send(conn, stream, h11.Response(status_code=status, headers=hdrs, reason=_phrase(status)),
                         h11.Data(data=body), h11.EndOfMessage())

    async def _handle(self, conn, stream, request: h11.Request, body: bytes) -> bool:
        path = request.target.decode().split("?")[0]
        if request.method == b"GET" and path == "/stats":
            await self._json(conn, stream, 200, {m: vars(s) for m, s in self.stats.items()})
            return True
        if request.method == b"POST" and path == "/reset":
            self.stats.clear()
            await self._json(conn, stream, 200, {"ok": True})
            return True
        if request.method == b"GET" and path.rstrip("/") == "/v1/models":
            await self._json(conn, stream, 200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "faulty-peer"} for m in self.stats]})
            return True
        if request.method != b"POST" or path.rstrip("/") != "/v1/chat/completions":
            await self._json(conn, stream, 404, _error(f"no route {request.method.decode()} {path}", "not_found"))
            return True
        try:
            req = json.loads(body)
            model = req["model"]
            behaviour = Behaviour.parse(model)
        except (ValueError, KeyError, TypeError) as e:
            await self._json(conn, stream, 400, _error(f"bad request: {e}", "invalid_request_error"))
            return True
        return await self._complete(conn, stream, req, model, behaviour)

    async def _complete(self, conn, stream, req: dict[str, Any], model: str, b: Behaviour) -> bool:
        st = self.stats.setdefault(model, ModelStats())
        st.calls += 1
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        entry = [time.monotonic(), None, "running"]
        st.log.append(entry)
        outcome = "disconnected"
        try:
            if b.delay_ms:
                await _sleep_watching(stream, b.delay_ms / 1000)
            if b.status is not None and (b.fail_first is None or st.calls <= b.fail_first):
                headers = [("retry-after", f"{b.retry_after:g}")] if b.retry_after is not None else []
                await self._json(conn, stream, b.status, _error(f"{b.label}: injected HTTP {b.status}", "server_error"),
                                 headers)
                outcome = "failed"
                return True
            text = _answer(b)
            if req.get("stream") is not True:
                pin, pout = self._usage(b, req, text)
                await self._json(conn, stream, 200, {
                    "id": "chatcmpl-faulty", "object": "chat.completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": pin, "completion_tokens": pout, "total_tokens": pin + pout},
                })
                outcome = "ok"
                return True
            await self._send(conn, stream, h11.Response(status_code=200, reason=b"OK", headers=[
                ("content-type", "text/event-stream"), ("cache-control", "no-cache")]))
            n = max(1, b.chunks)
            size = -(-len(text) // n)
            pieces = [text[i : i + size] for i in range(0, len(text), size)]
            for i, piece in enumerate(pieces):
                if b.drop_after is not None and i >= b.drop_after:
                    outcome = "dropped"
                    return False  # the caller closes the socket: no terminating chunk
                if b.chunk_delay_ms:
                    await _sleep_watching(stream, b.chunk_delay_ms / 1000)
                delta = {"content": piece} if i else {"role": "assistant", "content": piece}
                await self._sse(conn, stream, _chunk(model, delta, None))
            if b.drop_after is not None and b.drop_after >= len(pieces):
                outcome = "dropped"
                return False
            await self._sse(conn, stream, _chunk(model, {}, "stop"))
            if (req.get("stream_options") or {}).get("include_usage"):
                pin, pout = self._usage(b, req, text)
                await self._sse(conn, stream, {
                    "id": "chatcmpl-faulty", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [],
                    "usage": {"prompt_tokens": pin, "completion_tokens": pout, "total_tokens": pin + pout},
                })
            await self._send(conn, stream, h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())
            outcome = "ok"
            return True
        finally:
            st.in_flight -= 1
            entry[1], entry[2] = time.monotonic(), outcome
            if outcome == "ok":
                st.ok += 1
            elif outcome == "failed":
                st.failed += 1
            elif outcome == "dropped":
                st.dropped += 1
            else:
                st.disconnected += 1

    async def _sse(self, conn, stream, obj: dict[str, Any]) -> None:
        await self._send(conn, stream, h11.Data(data=b"data: " + json.dumps(obj).encode() + b"\n\n"))

    @staticmethod
    def _usage(b: Behaviour, req: dict[str, Any], text: str) -> tuple[int, int]:
        if b.usage is not None:
            return b.usage
        chars = sum(len(m.get("content", "")) for m in req.get("messages", []) if isinstance(m, dict))
        return -(-chars // 4), -(-len(text) // 4)


async def _sleep_watching(stream: trio.SocketStream, seconds: float) -> None:
    """Sleep, but notice at once when the client hangs up (the router cancelled the
    call): raises BrokenResourceError then, so the call is logged ``disconnected``.
    The request was read whole and httpx does not pipeline, so any byte here is EOF."""
    with trio.move_on_after(seconds):
        if not await stream.receive_some(1):
            raise trio.BrokenResourceError("client closed the connection")
        await trio.sleep_forever()  # a stray byte: ignore it, keep the delay


def _answer(b: Behaviour) -> str:
    findings = []
    if b.finding is not None:
        f, line, sev = b.finding
        findings.append({"file": f, "line": line, "severity": sev, "claim": f"conformance finding from {b.label}",
                         "confidence": b.conf})
    return json.dumps({"findings": findings})


def _chunk(model: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-faulty", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18099)
    args = ap.parse_args(argv)

    async def run() -> None:
        peer = FaultyPeer()
        async with trio.open_nursery() as n:
            await n.start(peer.serve, args.host, args.port)
            print(f"faulty peer listening http://{args.host}:{peer.port}/v1", flush=True)

    trio.run(run)


if __name__ == "__main__":
    main()
