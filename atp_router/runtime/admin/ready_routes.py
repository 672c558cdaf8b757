"""The readiness routes (``GET /v1/ready``, issue 22 item 4): the I/O around
:mod:`atp_router.runtime.admin.readiness`' sans-IO decision — the deployment's
store check and a small write in the state directory, off the event loop and
within :data:`READY_PROBE_S` — and the two answers: every check with its reason
for an authenticated caller, names and verdicts for a load balancer's probe."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import trio
from starlette.requests import Request
from starlette.responses import Response

from atp_router.runtime.admin.readiness import (
    RETRY_AFTER_S,
    Readiness,
    ReadyFacts,
    decide,
)
from atp_router.runtime.ingress.authorized import json_response
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity

#: How long ``GET /v1/ready`` waits for its probes (s) before calling them failed.
READY_PROBE_S = 3.0
#: Bytes ``GET /v1/ready`` writes (and fsyncs, and removes) in the state directory.
_STATE_PROBE_BYTES = 4096


def _state_dir_fault(state_dir: Path) -> str | None:
    """None when ``state_dir`` takes a small write (a file written, fsync'd and
    removed; per process: ``--workers`` probe at once), else why not."""
    probe = state_dir / f".ready-probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if os.write(fd, bytes(_STATE_PROBE_BYTES)) != _STATE_PROBE_BYTES:
                return f"state directory {state_dir}: a write was cut short (a full disk)"
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as e:
        return f"state directory {state_dir} takes no write: {e.strerror or e}"
    return None


async def _readiness(router: Router) -> Readiness:
    """Gather the facts of ``router``'s readiness — the deployment's store check
    and the state directory's write, off the event loop and within
    :data:`READY_PROBE_S`; the RIB; the audit spool; a drain — and decide
    (:func:`~atp_router.runtime.admin.readiness.decide`)."""
    def probe() -> tuple[str | None, str | None]:
        return router.state.store_check(), _state_dir_fault(router.state_dir)

    store: str | None = f"the state store did not answer within {READY_PROBE_S:g} s"
    state_dir: str | None = f"state directory {router.state_dir}: no answer within {READY_PROBE_S:g} s"
    with trio.move_on_after(READY_PROBE_S):
        store, state_dir = await trio.to_thread.run_sync(probe, abandon_on_cancel=True)
    spool = router.audit_log.spool
    gen = router.gen
    return decide(ReadyFacts(store=store, rib_version=gen.version, rib_policies=len(gen.rib.policies),
                             state_dir=state_dir, audit_spooled=len(spool), audit_spool_max=spool.max_records,
                             audit_dropped=spool.dropped,
                             draining=router.open_count if router.drain.draining else None))


def _ready_response(verdict: Readiness) -> Response:
    if verdict.ready:
        return json_response(verdict)
    response = json_response(verdict, 503)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def ready(router: Router, request: Request, identity: Identity) -> Response:
    """``GET /v1/ready`` of an authenticated caller: 200 or 503 + ``Retry-After``,
    every check with its reason (:mod:`atp_router.runtime.admin.readiness`)."""
    return _ready_response(await _readiness(router))


async def readiness(router: Router, request: Request) -> Response:
    """``GET /v1/ready`` without a credential the router needs (a load balancer's
    probe): the same status, the checks' names and verdicts without reasons."""
    return _ready_response((await _readiness(router)).public())
