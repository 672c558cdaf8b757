"""What the router tells its operators (spec §12): traces
(:mod:`~atp.observability.tracing`, OpenTelemetry), logs
(:mod:`~atp.observability.logs`, structlog, one format and one scrubber) and
metrics (:mod:`~atp.observability.metrics`, Prometheus).

Imported by the adapters and the router; imports neither of them (what it reads
of a stream or a leg it names as a protocol, and the log scrubber is handed to
:func:`~atp.observability.logs.configure` by its caller).
"""
