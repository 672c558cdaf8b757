"""The router's logs (spec §12 "structured JSON with redaction"): one format and
one scrubber for every line, the router's own and its libraries'.

:func:`configure` replaces the root logger's handlers with one stderr handler:

* **one scrubber**: the caller's ``redaction`` (the router's is
  :func:`~atp_router.adapters.context.install_log_redaction`, which attaches a
  :class:`~atp_router.adapters.context.RedactingFilter`) masks registered Agent
  Context secrets and whatever detect-secrets recognises
  (:func:`atp_router.security.redact.scrub`) in the message and its ``%``-args, the
  ``extra`` fields, the exception text — and, for a structlog event, in every
  value of its event dict — before anything is rendered, in both formats;
* **one format**: stdlib records (the router's ``logging`` loggers, httpx,
  hypercorn, …) and structlog events alike go through structlog's
  ``ProcessorFormatter``: ``timestamp`` (ISO 8601, UTC), ``level``, ``logger``,
  ``event`` (the message), the record's ``extra`` fields, ``exception`` (its
  traceback, scrubbed), ``trace_id`` / ``span_id`` (32 / 16 hex digits) whenever
  an OpenTelemetry span is current (a stream's task runs inside its stream span,
  :mod:`atp_router.observability.tracing`), and the static ``fields`` given (a worker's
  ``worker`` slot);
* **two renderings**: ``json`` — one JSON object per line, for collectors;
  ``console`` — structlog's aligned, human ``ConsoleRenderer`` (colours on a
  terminal). ``atp-router --log-format json|console``; the default is
  ``console`` when stderr is a terminal, else ``json``.

Cost: scanning a line for secrets takes ~0.1 ms per 100 characters
(detect-secrets), so per-task lines stay at DEBUG (the default level is INFO)
and a level check happens before any processing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import IO, Any

import structlog
from opentelemetry import trace

__all__ = ["FORMATS", "add_trace_ids", "configure", "default_format"]

#: The renderings :func:`configure` knows.
FORMATS = ("json", "console")


def default_format(stream: IO[str] | None = None) -> str:
    """``"console"`` when ``stream`` (default stderr) is a terminal, else ``"json"``."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def add_trace_ids(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: ``trace_id`` and ``span_id`` (lower-case hex) of the
    OpenTelemetry span current where the line was logged, when there is one."""
    sc = trace.get_current_span().get_span_context()
    if sc.is_valid:
        event_dict["trace_id"] = format(sc.trace_id, "032x")
        event_dict["span_id"] = format(sc.span_id, "016x")
    return event_dict


def _foreign_exception(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A stdlib record's traceback as the redaction filter left it (``exc_text``,
    scrubbed; the exception object itself may still hold the secret). Drops the
    ``message`` / ``asctime`` another handler's formatter may have stored on the
    record before the filter ran: unscrubbed copies of what ``event`` holds."""
    event_dict.pop("message", None)
    event_dict.pop("asctime", None)
    record = event_dict.get("_record")
    text = getattr(record, "exc_text", None)
    if text:
        event_dict.pop("exc_info", None)
        event_dict["exception"] = text
    return event_dict


class _Handler(logging.StreamHandler):
    """The handler :func:`configure` installs (found again and replaced on a
    second call)."""


def configure(*, redaction: Callable[[logging.Handler], object], level: str | int = "INFO",
              fmt: str | None = None, stream: IO[str] | None = None,
              fields: Mapping[str, Any] | None = None) -> logging.Handler:
    """Route every log line of the process through one handler on ``stream``
    (default stderr) at ``level`` (name or number), rendered as ``fmt``
    (:data:`FORMATS`; default :func:`default_format`), with ``fields`` added to
    every line; configure structlog to log through it. ``redaction(handler)``
    attaches the one scrubber to the handler before it is installed (the
    router passes :func:`atp_router.adapters.context.install_log_redaction`: this
    package imports no adapter). Replaces the root
    logger's handlers (idempotent). Returns the handler. Raises ``ValueError``
    for an unknown format or level."""
    stream = sys.stderr if stream is None else stream
    fmt = default_format(stream) if fmt is None else fmt
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if isinstance(level, str):
        level = _level_number(level)
    handler = _handler(stream, fmt, dict(fields or {}))
    # The one scrubber, before any rendering (it also cleans a structlog event's dict).
    redaction(handler)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _Handler) or type(h) is logging.StreamHandler:
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    _configure_structlog()
    return handler


def _level_number(level: str) -> int:
    """The number of log level name ``level`` (any case); ValueError if unknown."""
    try:
        return logging.getLevelNamesMapping()[level.upper()]
    except KeyError:
        raise ValueError(f"log level {level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL") from None


def _handler(stream: IO[str], fmt: str, static: Mapping[str, Any]) -> _Handler:
    """:func:`configure`'s handler on ``stream``: structlog's formatter rendering
    ``fmt`` (``json`` or console), with level, logger, UTC time, trace ids and the
    ``static`` fields (not overriding a line's own) on every line."""

    def add_fields(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        for k, v in static.items():
            event_dict.setdefault(k, v)
        return event_dict

    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=default_format(stream) == "console")
    handler = _Handler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), _foreign_exception],
        processors=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_trace_ids,
            add_fields,
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            renderer,
        ],
    ))
    return handler


def _configure_structlog() -> None:
    """Make structlog log through the standard library (so through the root
    handler), exceptions rendered before the handler's scrubber sees them."""
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.StackInfoRenderer(),
            # Rendered before the handler's filter, so the traceback is scrubbed too.
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
