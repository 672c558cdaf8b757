"""ATP error model (spec §10) and the exception tree.

Every failure the router reports on the wire carries one of the spec's codes::

    EPROTO      bad frame / schema / version          -> RST
    ESEQ_RETRY  missing or late fragment              -> request retransmit
    EWINDOW     window exceeded (tokens/$/parallel)   -> NACK + WINDOW_UPDATE
    EBUDGET     budget exhausted                      -> FIN
    ETIMEOUT    agent timeout                         -> retry + AIMD decrease
    EAGENTDOWN  next-hop unhealthy                    -> circuit break, reroute
    ESEC        data-scope / authentication violation -> RST, audit
    ECONSENSUS  no quorum                             -> escalate
    EPREEMPT    bronze stream preempted (spec §9)     -> RST

Exception tree (ours versus theirs, as h11 and httpx draw it)::

    ATPError(code, reason)
    ├── LocalProtocolError   the peer sent us something invalid; we answer with ERROR/RST
    ├── RemoteProtocolError  the peer told us (an ERROR payload) that *we* erred
    ├── PolicyError          a RIB document was refused (file, key, reason)
    └── AgentError           a next-hop failed (ETIMEOUT, EAGENTDOWN, ...)
        └── ClientInputError the call failed because of the client's input, not the next-hop

Client faults (spec §10, §11 "bounded resources"): a next-hop refusing the task
itself — a refused file path, a task over a size limit, content that is not what
the task type needs, an analyser driven past its resource limits by that input — is
a :class:`ClientInputError` (``client_fault`` is ``True``; an ``AgentError``'s is
``False``). The same input would fail on every next-hop, so the dispatcher neither
counts it toward the next-hop's circuit breaker or error rate, nor halves an AIMD
window for it, nor retries or reroutes it: the stream gets the error.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(enum.StrEnum):
    """The error codes of spec §10 (plus EPREEMPT of §9)."""

    EPROTO = "EPROTO"
    ESEQ_RETRY = "ESEQ_RETRY"
    EWINDOW = "EWINDOW"
    EBUDGET = "EBUDGET"
    ETIMEOUT = "ETIMEOUT"
    EAGENTDOWN = "EAGENTDOWN"
    ESEC = "ESEC"
    ECONSENSUS = "ECONSENSUS"
    EPREEMPT = "EPREEMPT"


#: What the router does on each code (spec §10 "Router action").
ROUTER_ACTION: dict[ErrorCode, str] = {
    ErrorCode.EPROTO: "RST",
    ErrorCode.ESEQ_RETRY: "request retransmit",
    ErrorCode.EWINDOW: "NACK + WINDOW_UPDATE",
    ErrorCode.EBUDGET: "FIN",
    ErrorCode.ETIMEOUT: "retries + AIMD decrease",
    ErrorCode.EAGENTDOWN: "circuit break, reroute",
    ErrorCode.ESEC: "RST, audit",
    ErrorCode.ECONSENSUS: "escalate",
    ErrorCode.EPREEMPT: "RST",
}


class ATPError(Exception):
    """Base of every ATP error: a spec code plus a human-readable reason.

    ``retry_after_ms`` is the backoff hint sent in the ERROR payload, if any.
    """

    def __init__(self, code: ErrorCode | str, reason: str, *, retry_after_ms: int | None = None):
        self.code = ErrorCode(code)
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        super().__init__(f"{self.code}: {reason}")


class IdempotencyConflict(ATPError):
    """An ``idempotency_key`` re-used with a different task (spec §8: the key
    names one task): ``EPROTO``, HTTP ``status`` 409 naming the key. The stream
    the key opened is left as it is; nothing is run or charged."""

    status = 409

    def __init__(self, key: str) -> None:
        super().__init__(ErrorCode.EPROTO, f"idempotency_key {key!r} was used before with a different task: "
                                           "re-send that task to resume its stream, or use a new key")
        self.key = key


class LocalProtocolError(ATPError):
    """The peer sent a frame we cannot accept (we detected it)."""


class RemoteProtocolError(ATPError):
    """The peer reported an error about what we sent."""


class PolicyError(ATPError):
    """A RIB document was refused. ``file`` and ``key`` locate the fault.

    ``reason`` reads ``<file>: <key>: <detail>``; ``key`` is a dotted path
    such as ``policies[1].match.diff_loc``; ``detail`` is the bare reason.
    """

    def __init__(self, file: str, key: str, reason: str, *, line: int | None = None):
        self.file = file
        self.key = key
        self.detail = reason
        #: 1-based line of ``key`` in ``file`` when the loader could find it.
        self.line = line
        #: Every fault the loader found in the RIB, this one first (it keeps
        #: going past a bad entry; see :func:`atp_router.policy.loader.load_rib`).
        self.errors: list[PolicyError] = [self]
        super().__init__(ErrorCode.EPROTO, f"{file}: {key}: {reason}")

    def where(self) -> str:
        """``file:line: key: reason`` (``file: key: reason`` without a line)."""
        at = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{at}: {self.key}: {self.detail}"


class AgentError(ATPError):
    """A next-hop (provider adapter) failed; ``agent`` names it.

    ``client_fault`` is ``False``: the failure says something about the next-hop's
    health (see :class:`ClientInputError` for the other kind). ``timed_out``: a
    wait for the next-hop ran out (a connect or read timeout; every ``ETIMEOUT``):
    a stall of the router's own loop can cause one
    (:attr:`~atp_router.flow.breaker.Fault.LOCAL`)."""

    client_fault: ClassVar[bool] = False

    def __init__(self, code: ErrorCode | str, reason: str, *, agent: str = "", retry_after_ms: int | None = None,
                 timed_out: bool = False):
        self.agent = agent
        super().__init__(code, reason, retry_after_ms=retry_after_ms)
        self.timed_out = timed_out or self.code is ErrorCode.ETIMEOUT


class ClientInputError(AgentError):
    """A next-hop call failed because of the client's input, not the next-hop: a
    refused file path, a task over a size limit (the reason names the limit),
    content the task type cannot take. ``code`` is ``EPROTO`` unless given.

    ``client_fault`` is ``True``: never counted toward a circuit breaker or an
    adapter's error rate, no AIMD decrease, no retry or reroute (module docstring).
    """

    client_fault: ClassVar[bool] = True

    def __init__(
        self, reason: str, *, code: ErrorCode | str = ErrorCode.EPROTO, agent: str = "",
        retry_after_ms: int | None = None,
    ):
        super().__init__(code, reason, agent=agent, retry_after_ms=retry_after_ms)
