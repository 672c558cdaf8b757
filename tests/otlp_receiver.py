"""An OTLP/HTTP trace receiver built on the official ``opentelemetry-proto``
messages — the real wire shape an OpenTelemetry Collector accepts, for tests and
benches (Debian packages no Collector, and none can be downloaded here).

``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (gzip or not,
``Content-Type: application/x-protobuf``) is decoded with
``opentelemetry.proto.collector.trace.v1.trace_service_pb2`` and answered with an
``ExportTraceServiceResponse``; anything else is 404 / 400 / 415 as the OTLP
specification says. :meth:`OtlpReceiver.spans` returns what arrived as
:class:`ReceivedSpan` records (ids in lower-case hex, attributes decoded from
their ``AnyValue``).

    with OtlpReceiver() as rx:           # a thread serving 127.0.0.1:<free port>
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}
        ...
        spans = rx.wait_for(lambda spans: any(s.name == "atp.consensus" for s in spans))
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass
class ReceivedSpan:
    """One span as the receiver decoded it."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    links: list[tuple[str, str]]  # (trace_id, span_id)
    resource: dict[str, Any]
    scope: str
    raw: Any = field(repr=False, default=None)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    """OTLP/HTTP (protobuf) trace receiver on ``127.0.0.1`` (module docstring).
    ``endpoint`` is the base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT``; the
    exporter posts to ``<endpoint>/v1/traces``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/x-protobuf":
                    self._answer(415, b"")
                    return
                if self.headers.get("Content-Encoding", "").lower() == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                try:
                    req.ParseFromString(body)
                except DecodeError:
                    self._answer(400, b"")
                    return
                receiver._add(req)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        got: list[ReceivedSpan] = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes), status_code=s.status.code,
                        status_message=s.status.message, links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        resource=resource, scope=ss.scope.name, raw=s))
        with self._lock:
            self.requests += 1
            self._spans.extend(got)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans once ``done(spans)`` holds; raises ``TimeoutError`` with what
        arrived when it does not within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"OTLP receiver: condition not met within {timeout_s} s; got "
                                   f"{[(s.name, s.attributes.get('agent')) for s in spans]}")
            time.sleep(0.05)
