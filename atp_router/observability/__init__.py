"""What the router tells its operators (spec §12): traces
(:mod:`~atp_router.observability.tracing`, OpenTelemetry), logs
(:mod:`~atp_router.observability.logs`, structlog, one format and one scrubber) and
metrics (:mod:`~atp_router.observability.metrics`, Prometheus).

Imported by the adapters and the router; imports neither of them (what it reads
of a stream or a leg it names as a protocol, and the log scrubber is handed to
:func:`~atp_router.observability.logs.configure` by its caller).
"""
