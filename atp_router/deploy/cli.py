"""``atp-router``: run the ATP router appliance.

    atp-router --policies policies/ [--host 127.0.0.1] [--http-port 7070] [--ws-port 7071]

Flow control, liveness and resumption (defaults: :class:`~atp_router.runtime.config.RouterConfig`'s;
spec §4.4, §5, §8, §9, §10):

=============================  =======  ==================================================
flag                           default  what
=============================  =======  ==================================================
``--window-update-ms N``       1000     WINDOW_UPDATE check period while the window changes (§5.4), ms
``--window-update-delta F``    0.2      …or at once when the window moved by this fraction
``--window-keepalive-ms N``    10000    an unchanged window is re-sent this often, ms
``--hb-interval-s S``          10       HB period on every WebSocket (§4.4), s
``--hb-timeout-s S``           30       a WebSocket silent this long is dead (streams detached), s
``--resume-grace-s S``         60       a detached stream stays resumable this long (§8), s
``--breaker-failures N``       5        failures within the breaker window that open a circuit
``--breaker-window-s S``       30       the breaker's failure-counting window, s
``--breaker-backoff-s S``      1        first open → half-open backoff, s (doubles, jittered)
``--breaker-max-backoff-s S``  60       cap of that backoff, s
``--retry-attempts N``         2        attempts per next-hop call, the first included (§10)
``--retry-backoff-s S``        0.2      first retry backoff, s
``--retry-max-backoff-s S``    2        cap of the retry backoff, s
``--slots N``                  64       next-hop calls in flight across all streams (§9)
``--gold-reserved N``          8        slots only gold may use (``< --slots``)
``--preempt-after-ms N``       250      gold kept waiting this long preempts bronze (EPREEMPT)
``--gold-sla-ms N``            2000     gold's queueing SLA, ms (``>= --preempt-after-ms``)
``--max-streams N``            10000    open streams router-wide (more: SYN refused, EWINDOW)
``--idle-task-s S``            30       a stream opened without a task gets one within this, s
``--retain-closed-s S``        300      a closed stream stays in memory this long, s
``--retain-closed-max N``      1000     …and at most this many closed streams per tenant
``--retain-closed-bytes N``    16 MiB   …and this many bytes of closed logs router-wide
=============================  =======  ==================================================

A closed stream that left memory (the three ``--retain-closed-*`` bounds, the
oldest first) is still read and resumed: from the state store, the same events.
When no stream is open the router gives freed memory back to the OS (a full
garbage collection and glibc's ``malloc_trim``, at most every 10 s);
``--no-idle-trim`` turns that off.

The conformance suite run against a remote ``atp-router`` needs the timings it
is told with ``ATP_CONFORMANCE_*`` (tests/conformance/README.md), e.g. its local
profile: ``--window-update-ms 300 --hb-interval-s 0.3 --hb-timeout-s 1.5
--breaker-failures 3 --breaker-backoff-s 0.5 --breaker-max-backoff-s 2
--retry-attempts 2 --retry-backoff-s 0.05 --retry-max-backoff-s 0.5 --slots 6
--gold-reserved 1 --preempt-after-ms 100 --gold-sla-ms 500 --resume-grace-s 10``.

Identities (spec §11): ``--auth FILE`` (API-key hashes, JWT/JWKS, mTLS SAN map;
:mod:`atp_router.security.authn`) and ``ATP_ROUTER_TOKENS`` (comma-separated
``name:token``, ``name:token:admin+operator`` or bare tokens); with neither,
authentication is off (a local appliance only). Frame keys come from
``ATP_HMAC_KEYS`` (``kid:base64key,…``, the first signs) or ``ATP_HMAC_KEY`` —
never from the command line, so they stay out of ``ps``. TLS 1.3 on both
ingresses with ``--tls-cert/--tls-key``; plain HTTP/WS only on a loopback host or
with ``--plaintext``.

Logs (:mod:`atp_router.observability.logs`) go to stderr, every line — the router's and its
libraries' — through one scrubber (Agent Context secrets and what detect-secrets
recognises are masked) and one format: ``--log-format json`` (one JSON object a
line: ``timestamp``, ``level``, ``logger``, ``event``, extra fields, ``trace_id``
/ ``span_id`` inside a traced stream) or ``console`` (human, aligned); the
default is ``console`` when stderr is a terminal, else ``json``. Traces
(:mod:`atp_router.observability.tracing`, spec §12) are exported over OTLP/HTTP only when the
standard ``OTEL_*`` variables configure an exporter (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_TRACES_EXPORTER``, ``OTEL_SERVICE_NAME``, ``OTEL_SDK_DISABLED``, …); off
otherwise, at no cost.

Diff-only tasks (the A2A server's plain-text diffs): ``--repo PATH`` names a local
checkout the after-diff text of the touched files is read from (confined to PATH:
no ``..``, absolute paths, ``.git`` or symlinks leading out; 1 MiB a file, 8 MiB
and 2,000 files in all; the lines must be the diff's after side). Without it, or
when a file cannot be read, the diff is reviewed alone only if every routed agent
can work from a diff alone; otherwise the A2A task is ``rejected`` naming why.

Every core: ``--workers N`` (default 1, one process) runs a supervisor that
binds the sockets once, recovers the state directory once and starts N worker
processes accepting on them; budgets stay exact across workers through the
state store, a request about a stream reaches the worker that runs it, a
worker that dies is settled and restarted (:mod:`atp_router.deploy.workers`).

Several routers, one state (issue 12): ``--store redis://host:6379/0`` (or
``ATP_STORE_URL``, which keeps a password out of ``ps``) on each (its own
``--state-dir`` and ports; the same ``ATP_AUDIT_KEY``) makes them one
router — budgets exact across them, a request about a stream reaches the
router running it, a reload reaches all, a router killed is settled by the
others after ``--lease-ms`` and its streams re-run when their idempotency key
is re-opened; while the store cannot be reached new spend is refused
(:mod:`atp_router.deploy.cluster`).

Subcommands: ``atp-router keys new KEY_ID TENANT [ROLES]`` (a new API key) and
``atp-router audit verify|show|keygen`` (:func:`atp_router.security.audit.audit_main`; the
router's default ``--state-dir``). The audit chain's checkpoints also go to
``--audit-anchor FILE`` / ``--audit-syslog ADDR`` outside the state directory,
its key comes from ``ATP_AUDIT_KEY`` or ``--audit-key-file`` (production) or the
state directory (development: warned once).
Prints one ``listening`` line when ready; SIGINT/SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import trio
import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs (types-PyYAML is not a dependency)

from atp_router.adapters import local_model
from atp_router.adapters.context import install_log_redaction
from atp_router.adapters.registry import build_adapter
from atp_router.adapters.tools.semgrep import rule_sources
from atp_router.cliutil.helpfmt import DefaultsHelpFormatter
from atp_router.deploy import cluster, single
from atp_router.deploy.cluster import is_cluster_store
from atp_router.deploy.http_serve import serve_http, settle_heap, track_requests
from atp_router.deploy.learn_cmd import learn_main
from atp_router.deploy.review_cmd import main as review_main
from atp_router.deploy.workers import WorkerSpec, supervise, worker_main
from atp_router.flow.breaker import RetryPolicy
from atp_router.observability import logs, tracing
from atp_router.policy.check import policy_main
from atp_router.runtime.admin.taskpath import routes_main
from atp_router.runtime.config import RouterConfig, build_authenticator
from atp_router.runtime.controlplane.drain import drain, stop_signal_receiver
from atp_router.runtime.dataplane.opening import DEFAULT_STAGES, describe
from atp_router.runtime.ingress.http_api import build_app
from atp_router.runtime.ingress.ws import serve_ws
from atp_router.runtime.router import Router
from atp_router.security.audit import (
    DEFAULT_SPOOL_BYTES,
    DEFAULT_SPOOL_RECORDS,
    AuditOptions,
    audit_main,
)
from atp_router.security.authn import new_api_key
from atp_router.security.policy_guard import PolicySecrets
from atp_router.security.tls import ServerTls
from atp_router.store import StoreError
from atp_router.wire.codec import KeyRing
from atp_router.wire.errors import PolicyError


async def run(config: RouterConfig, *,
              task_status: trio.TaskStatus[tuple[Router, int, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run router, HTTP control API and WebSocket ingress until cancelled.

    ``task_status.started`` receives ``(router, http_port, ws_port)`` with the bound
    ports (useful with port 0). Raises :class:`PolicyError` if the initial RIB is bad.
    """
    deployed = single.deploy(config) if config.store == "sqlite" else cluster.deploy(config)
    router = deployed.router
    app = build_app(router)
    # Several routers on one store (atp_router.deploy.cluster): requests about another router's streams are forwarded.
    middleware = deployed.http_middleware
    forwarding = middleware(app) if middleware is not None else None
    try:
        served: Any = app if forwarding is None else forwarding  # an ASGI app (ClosingApp declares only aclose)
        # Requests in progress are waited for by the drain at a stop (atp_router.runtime.controlplane.drain).
        await _serve(deployed, track_requests(served, router.drain), config, task_status)
    finally:
        if forwarding is not None:  # the forwarding clients
            with trio.CancelScope(shield=True):
                await forwarding.aclose()


async def serve_private(policies: Path, state_dir: Path, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
                        **config: Any) -> None:
    """A private router (``atp-router eval``'s, :data:`atp_router.review.eval.ServeRouter`):
    the RIB at ``policies``, its state in ``state_dir``, free loopback ports and
    ``config`` (other :class:`RouterConfig` fields). ``task_status.started``
    receives its HTTP port; it serves until cancelled. Raises
    :class:`PolicyError` if the RIB is refused."""
    router_config = RouterConfig(policies=policies, http_port=0, ws_port=0, state_dir=state_dir, **config)
    async with trio.open_nursery() as nursery:
        _, http_port, _ = await nursery.start(run, router_config)
        task_status.started(http_port)


async def _serve(deployed: single.Deployed, app: Any, config: RouterConfig,
                 task_status: trio.TaskStatus[tuple[Router, int, int]]) -> None:
    router = deployed.router
    async with trio.open_nursery() as nursery:
        await nursery.start(router.serve)
        await nursery.start(router.authenticator.run)  # JWKS refresh (returns at once without JWT)
        if config.tls is not None:
            nursery.start_soon(config.tls.watch, 30.0)
        binds = await nursery.start(lambda task_status: serve_http(  # lean or hypercorn (--http-server)
            app, config, [f"{config.host}:{config.http_port}"], task_status=task_status))
        ws_server = await nursery.start(lambda task_status: serve_ws(router, config.host, config.ws_port, task_status=task_status))
        http_port = int(binds[0].rsplit(":", 1)[1])
        if deployed.advertise is not None:
            deployed.advertise(config.advertise_url or _advertised(config, http_port))
        settle_heap()  # the SSE backend imported, start-up objects frozen, the GC's thresholds raised
        task_status.started((router, http_port, ws_server.port))


def _advertised(config: RouterConfig, http_port: int) -> str:
    """The URL other routers reach this one's HTTP API on when ``--advertise-url``
    is not given: the bound host (this host's name when it is a wildcard) and port."""
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if config.tls is not None else 'http'}://{host}:{http_port}"


def _parser() -> argparse.ArgumentParser:
    """The ``atp-router`` (serve) command line: the general options, then one
    argument group per concern (each added by its own function below)."""
    d = RouterConfig(policies=Path("policies"))
    ap = argparse.ArgumentParser(prog="atp-router", description="ATP router appliance (Agent Transport Protocol v0.1)",
                                 formatter_class=DefaultsHelpFormatter,
                                 epilog="subcommands: 'atp-router keys new', 'atp-router policy check PATH|--stages', "
                                        "'atp-router routes [--diagram]', "
                                        "'atp-router audit …', 'atp-router eval --tasks FILE [--policies RIB …] "
                                        "[--url URL]', 'atp-router review [--base REF | --staged | --diff FILE]', "
                                        "'atp-router model-server [--port N]' (each with --help)")
    _general_args(ap, d)
    sec = ap.add_argument_group("security (spec §4.1, §11): identities, TLS, policy secrets, tenant quotas, limits")
    _security_args(sec, d)
    _state_args(sec, d)
    _limit_args(sec, d)
    ap.add_argument("--no-ws-deflate", action="store_true",
                    help="do not negotiate permessage-deflate (RFC 7692) on the WebSocket ingress "
                         "(by default it is used when a client offers it)")
    _flow_args(ap, d)
    _stream_table_args(ap, d)
    return ap


def _general_args(ap: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Where the router listens, its RIB, logs, worker processes and ``--repo``."""
    ap.add_argument("--policies", type=Path, default=Path("policies"), help="RIB file or directory of *.yaml")
    ap.add_argument("--no-watch", action="store_true",
                    help="do not reload the RIB when a --policies file changes (POST /v1/policies/reload still does)")
    ap.add_argument("--host", default=d.host, help="address to listen on (HTTP and WebSocket)")
    ap.add_argument("--http-port", type=int, default=d.http_port, help="control API (0 = any free port)")
    ap.add_argument("--ws-port", type=int, default=d.ws_port, help="WebSocket ingress (0 = any free port)")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    ap.add_argument("--log-format", choices=logs.FORMATS, default=None,
                    help="json: one JSON object a line; console: for a human at a terminal "
                         "(default: console when stderr is a terminal, else json)")
    ap.add_argument("--workers", type=_positive(int), default=1,
                    help="router processes sharing the listening sockets and the state directory (one a core); "
                         "budgets stay exact across them (atp_router.deploy.workers)")
    ap.add_argument("--worker-spec", help=argparse.SUPPRESS)  # set by the supervisor for its workers
    ap.add_argument("--repo", type=Path, metavar="PATH",
                    help="a local checkout: an A2A client sending only a diff (plain text) gets the after-diff "
                         "text of the files it touches read from here (confined to PATH, bounded: 1 MiB a file, "
                         "8 MiB in all); without it such a diff is reviewed alone only when every routed agent "
                         "can work from a diff alone, else the task is rejected")


def _security_args(sec: argparse._ArgumentGroup, d: RouterConfig) -> None:
    """Identities, TLS, policy secrets, tenant quotas and body limits (spec §4.1, §11)."""
    sec.add_argument("--auth", type=Path, metavar="FILE",
                     help="YAML: api_keys (sha256 hashes), jwt (issuer, audience, JWKS), mtls (SAN → identity)")
    sec.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve HTTPS and WSS (TLS 1.3) with this certificate")
    sec.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key")
    sec.add_argument("--tls-client-ca", type=Path, metavar="FILE", help="CA bundle verifying client certificates")
    sec.add_argument("--require-client-cert", action="store_true", help="mutual TLS: refuse clients without one")
    sec.add_argument("--plaintext", action="store_true",
                     help="allow plain HTTP/WS on a non-loopback --host (loopback needs no flag)")
    sec.add_argument("--policy-secret", action="append", default=[], metavar="NAME",
                     help="an env var policies may reference (api_key_env, auth_env); repeatable; never ATP_*")
    sec.add_argument("--policy-secrets-file", type=Path, metavar="FILE", help="NAME=value lines for policies")
    sec.add_argument("--tenant-max-streams", type=_positive(int), default=d.tenant_max_streams,
                     help="open streams per tenant without clients.<t>.max_streams")
    sec.add_argument("--tenant-rate-per-s", type=_positive(float), default=d.tenant_rate_per_s,
                     help="stream opens per second per tenant without clients.<t>.rate")
    sec.add_argument("--tenant-rate-burst", type=_positive(int), default=d.tenant_rate_burst,
                     help="burst of that rate: stream opens a tenant may make at once")
    sec.add_argument("--max-body-bytes", type=_positive(int), default=d.max_body_bytes,
                     help="HTTP request body limit (413 above)")
    sec.add_argument("--max-policy-bytes", type=_positive(int), default=d.max_policy_bytes,
                     help="policy reload body limit (413 above)")
    sec.add_argument("--http-server", choices=("auto", "lean", "hypercorn"), default=d.http_server,
                     help="the HTTP API's server: lean (HTTP/1.1, httptools), hypercorn (+ HTTP/2 under TLS); "
                          "auto: lean without --tls-cert, hypercorn with it")
    sec.add_argument("--http-conns-per-peer", type=_positive(int), default=d.http_conns_per_peer,
                     help="the lean HTTP server's connections from one IP address at once (more: 429 EWINDOW at accept); "
                          "raise it behind a load balancer whose clients share its address")
    sec.add_argument("--drain-s", type=_non_negative(float), default=d.drain_s,
                     help="on SIGTERM/SIGINT, seconds to let running streams finish while new ones are refused "
                          "(EAGENTDOWN, 503) and /v1/ready fails; a second signal stops at once; 0: stop at once")


def _state_args(sec: argparse._ArgumentGroup, d: RouterConfig) -> None:
    """The durable state: its directory and store, the audit chain, the response cache."""
    sec.add_argument("--state-dir", type=Path, default=_default_state_dir(), metavar="DIR",
                     help="durable state: ledgers, streams, RIB, audit (default: $XDG_STATE_HOME/atp-router)")
    sec.add_argument("--store", metavar="URL",
                     help="where budgets, streams, the RIB and the audit chain live: sqlite (embedded, in "
                          "--state-dir, this router alone) or redis://[:password@]host:port/db (also rediss://, "
                          "unix://): several routers share it (atp_router.deploy.cluster). Default: $ATP_STORE_URL "
                          "(keeps a password out of ps), else sqlite")
    sec.add_argument("--store-namespace", default=d.store_namespace, metavar="NAME",
                     help="prefix of every key in a shared store (several clusters on one Redis)")
    sec.add_argument("--lease-ms", type=_positive(int), default=d.lease_ms, metavar="MS",
                     help="with a shared store: a router silent this long is settled by the others (its "
                          "reservations released, its streams re-run when re-opened); renewed every fifth of it")
    sec.add_argument("--advertise-url", metavar="URL",
                     help="with a shared store: the URL the other routers forward requests about this router's "
                          "streams to (default: the bound host and --http-port)")
    sec.add_argument("--audit-key-file", type=Path, metavar="PATH",
                     help="the audit chain's MAC key, outside the state directory (production; make one with "
                          "'atp-router audit keygen PATH'); default: $ATP_AUDIT_KEY, else STATE_DIR/audit.key "
                          "(development: whoever can rewrite the log can re-sign it)")
    sec.add_argument("--audit-anchor", type=Path, metavar="FILE",
                     help="also append every audit checkpoint to FILE (O_APPEND, fsync'd), outside the state "
                          "directory; 'atp-router audit verify --anchor FILE' then catches a rewritten, re-signed "
                          "or cut log. The router refuses to start if FILE cannot be appended to")
    sec.add_argument("--audit-syslog", metavar="ADDR",
                     help="also send every audit checkpoint to syslog (facility authpriv): a Unix socket such as "
                          "/dev/log, or udp://host:port or tcp://host:port")
    sec.add_argument("--audit-spool-records", type=_positive(int), default=DEFAULT_SPOOL_RECORDS, metavar="N",
                     help="audit records kept in memory while the state store cannot take them (chained in order "
                          "when it can); beyond it, or --audit-spool-bytes, a record is dropped: counted in "
                          "atp_audit_dropped_total and logged")
    sec.add_argument("--audit-spool-bytes", type=_positive(int), default=DEFAULT_SPOOL_BYTES, metavar="N",
                     help="bytes (of their JSON) of the audit records kept while the state store cannot take them")
    sec.add_argument("--state-sync", choices=["normal", "full"], default="normal",
                     help="normal survives a process crash; full also an OS crash (fsync per commit)")
    sec.add_argument("--cache-max-bytes", type=_non_negative(int), default=d.cache_max_bytes, metavar="N",
                     help="bytes of answers the response cache of policies with a `cache` key keeps in the state "
                          "directory (spec §13; least recently used dropped first; 0: no policy caches)")


def _limit_args(sec: argparse._ArgumentGroup, d: RouterConfig) -> None:
    """Per-tenant and per-connection limits, and the learning share."""
    sec.add_argument("--max-ws-message-bytes", type=_positive(int), default=d.max_ws_message_bytes,
                     help="WebSocket message limit (close 1009 above)")
    sec.add_argument("--tenant-body-bytes", type=_positive(int), metavar="N",
                     help="bytes of request bodies one tenant may have in flight at once, every ingress together "
                          "(429 EWINDOW above, the body unread; default: twice the larger body limit)")
    sec.add_argument("--cache-tenant-max-bytes", type=_positive(int), metavar="N",
                     help="bytes of the response cache one tenant's answers may hold (its own least recently "
                          "used go first, never another tenant's; default: a quarter of --cache-max-bytes)")
    sec.add_argument("--learn-share", type=float, default=d.learn_share, metavar="F",
                     help="most of a shared quality statistic's weight one tenant's tasks may hold (0 < F <= 1)")
    sec.add_argument("--ws-handshake-timeout-s", type=_positive(float), default=d.ws_handshake_timeout_s,
                     metavar="S", help="a WebSocket connection not upgraded within S s is closed")


def _flow_args(ap: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Flow control, liveness and resumption (spec §4.4, §5, §8, §9, §10): windows, HB, breakers, retries, QoS slots."""
    f = ap.add_argument_group("flow control, liveness, resumption (spec §4.4, §5, §8, §9, §10)")
    f.add_argument("--window-update-ms", type=_positive(int), default=d.window_update_interval_ms,
                   help="WINDOW_UPDATE period while the window changes, ms")
    f.add_argument("--window-keepalive-ms", type=_positive(int), default=d.window_update_keepalive_ms,
                   help="...an unchanged window re-sent every this many ms (at least the period)")
    f.add_argument("--window-update-delta", type=_positive(float), default=d.window_update_delta,
                   help="...or when the window moved by this fraction")
    f.add_argument("--hb-interval-s", type=_positive(float), default=d.hb_interval_s, help="HB period, s")
    f.add_argument("--hb-timeout-s", type=_positive(float), default=d.hb_timeout_s,
                   help="a WebSocket silent this long is dead, s")
    f.add_argument("--resume-grace-s", type=_positive(float), default=d.resume_grace_s,
                   help="a detached stream stays resumable this long, s")
    f.add_argument("--breaker-failures", type=_positive(int), default=d.breaker_failures,
                   help="failures within --breaker-window-s that open a circuit")
    f.add_argument("--breaker-window-s", type=_positive(float), default=d.breaker_window_s,
                   help="the breaker's failure-counting window, s")
    f.add_argument("--breaker-backoff-s", type=_positive(float), default=d.breaker_backoff_s,
                   help="first open → half-open backoff, s")
    f.add_argument("--breaker-max-backoff-s", type=_positive(float), default=d.breaker_max_backoff_s,
                   help="cap of that backoff, s")
    f.add_argument("--retry-attempts", type=_positive(int), default=d.retry.max_attempts,
                   help="attempts per next-hop call, the first included")
    f.add_argument("--retry-backoff-s", type=_non_negative(float), default=d.retry.base_backoff_s,
                   help="first retry backoff, s")
    f.add_argument("--retry-max-backoff-s", type=_non_negative(float), default=d.retry.max_backoff_s,
                   help="cap of the retry backoff, s")
    f.add_argument("--slots", type=_positive(int), default=d.slots,
                   help="next-hop calls in flight across all streams (QoS capacity)")
    f.add_argument("--gold-reserved", type=_non_negative(int), default=d.gold_reserved,
                   help="slots only gold streams may use")
    f.add_argument("--preempt-after-ms", type=_non_negative(float), default=d.preempt_after_ms,
                   help="gold kept waiting this long preempts a bronze call (RST EPREEMPT)")
    f.add_argument("--gold-sla-ms", type=_non_negative(float), default=d.gold_sla_ms,
                   help="gold's queueing SLA, ms")


def _stream_table_args(ap: argparse.ArgumentParser, d: RouterConfig) -> None:
    """The stream table (spec §8): open streams and closed ones kept in memory."""
    t = ap.add_argument_group("stream table (spec §8): open streams, closed streams kept in memory "
                              "(reads of the others come from the state store)")
    t.add_argument("--max-streams", type=_positive(int), default=d.max_streams,
                   help="open streams router-wide")
    t.add_argument("--idle-task-s", type=_positive(float), default=d.idle_task_s,
                   help="a stream opened without a task is reset (ETIMEOUT) after this, s")
    t.add_argument("--retain-closed-s", type=_non_negative(float), default=d.retain_closed_s,
                   help="a closed stream stays in memory this long, s")
    t.add_argument("--retain-closed-max", type=_non_negative(int), default=d.retain_closed_max,
                   help="closed streams kept in memory per tenant (the oldest go first)")
    t.add_argument("--retain-closed-bytes", type=_non_negative(int), default=d.retain_closed_bytes,
                   help="bytes of closed stream logs kept in memory router-wide (the oldest go first)")
    t.add_argument("--no-idle-trim", action="store_true",
                   help="do not give freed memory back to the OS when no stream is open (gc + malloc_trim)")


#: The number type an argparse converter below parses.
_Num = TypeVar("_Num", int, float)


def _positive(kind: type[_Num]) -> Callable[[str], _Num]:
    def convert(text: str) -> _Num:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in its error
    return convert


def _non_negative(kind: type[_Num]) -> Callable[[str], _Num]:
    def convert(text: str) -> _Num:
        value = kind(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


def config_from_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The :class:`RouterConfig` of an ``atp-router`` command line (module
    docstring) and environment (``ATP_ROUTER_TOKENS``, ``ATP_HMAC_KEY``;
    default ``os.environ``). Exits with status 2 (argparse) on a bad flag or
    token list."""
    return _parse(argv, os.environ if environ is None else environ)[1]


def _parse(argv: list[str] | None, env: Mapping[str, str]) -> tuple[argparse.Namespace, RouterConfig]:
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.gold_reserved < args.slots:
        ap.error(f"need 0 <= --gold-reserved < --slots, got {args.gold_reserved} and {args.slots}")
    if args.preempt_after_ms > args.gold_sla_ms:
        ap.error(f"need --preempt-after-ms <= --gold-sla-ms, got {args.preempt_after_ms:g} and {args.gold_sla_ms:g}")
    if args.retry_backoff_s > args.retry_max_backoff_s:
        ap.error("need --retry-backoff-s <= --retry-max-backoff-s")
    if (args.tls_cert is None) != (args.tls_key is None):
        ap.error("give --tls-cert and --tls-key together")
    if args.tls_cert is None and (args.tls_client_ca or args.require_client_cert):
        ap.error("--tls-client-ca / --require-client-cert need --tls-cert and --tls-key")
    args.store = args.store or env.get("ATP_STORE_URL") or RouterConfig.store
    if args.store != "sqlite":
        if not is_cluster_store(args.store):
            ap.error("--store: give sqlite or a redis://, rediss:// or unix:// URL")
        if args.workers > 1:
            ap.error("--workers N with a shared --store: run N routers on the store instead (each its own "
                     "--state-dir and ports); --workers shares the embedded sqlite store only")
    elif args.advertise_url is not None:
        ap.error("--advertise-url needs a shared --store (redis://…)")
    if args.repo is not None and not args.repo.is_dir():
        ap.error(f"--repo {args.repo}: not a directory")
    if args.tls_cert is None and not args.plaintext and not _loopback(args.host):
        ap.error(f"--host {args.host} is not a loopback address: serve TLS (--tls-cert, --tls-key) "
                 "or ask for plain HTTP/WS with --plaintext")
    try:
        tls = None
        if args.tls_cert is not None:
            tls = ServerTls(args.tls_cert, args.tls_key, client_ca_file=args.tls_client_ca,
                            require_client_cert=args.require_client_cert)
        keyring = KeyRing.from_env(env.get("ATP_HMAC_KEYS"), env.get("ATP_HMAC_KEY"))
        secrets = PolicySecrets.load(args.policy_secret, args.policy_secrets_file, environ=env)
        config = RouterConfig(
            policies=args.policies, host=args.host, http_port=args.http_port, ws_port=args.ws_port,
            auth_file=args.auth, tokens_env=env.get("ATP_ROUTER_TOKENS") or None, keyring=keyring, tls=tls,
            policy_secrets=secrets, tenant_max_streams=args.tenant_max_streams,
            tenant_rate_per_s=args.tenant_rate_per_s, tenant_rate_burst=args.tenant_rate_burst,
            max_body_bytes=args.max_body_bytes, max_policy_bytes=args.max_policy_bytes,
            max_ws_message_bytes=args.max_ws_message_bytes,
            ws_deflate=not args.no_ws_deflate, http_server=args.http_server, drain_s=args.drain_s,
            http_conns_per_peer=args.http_conns_per_peer,
            repo=args.repo.resolve() if args.repo is not None else None,
            state_dir=args.state_dir, state_sync=args.state_sync.upper(), watch_policies=not args.no_watch,
            cache_max_bytes=args.cache_max_bytes, store=args.store, store_namespace=args.store_namespace,
            tenant_body_bytes=args.tenant_body_bytes, cache_tenant_max_bytes=args.cache_tenant_max_bytes,
            learn_share=args.learn_share, ws_handshake_timeout_s=args.ws_handshake_timeout_s,
            lease_ms=args.lease_ms, advertise_url=args.advertise_url,
            audit=AuditOptions(key_file=args.audit_key_file, anchor=args.audit_anchor, syslog=args.audit_syslog,
                               spool_records=args.audit_spool_records, spool_bytes=args.audit_spool_bytes),
            **_flow_config(args),
        )
        build_authenticator(config)  # refuse a bad --auth file or token list now, with its message
    except (ValueError, OSError) as e:
        ap.error(str(e))
    return args, config


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "atp-router"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flow_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "window_update_interval_ms": args.window_update_ms, "window_update_delta": args.window_update_delta,
        "window_update_keepalive_ms": args.window_keepalive_ms,
        "hb_interval_s": args.hb_interval_s, "hb_timeout_s": args.hb_timeout_s, "resume_grace_s": args.resume_grace_s,
        "breaker_failures": args.breaker_failures, "breaker_window_s": args.breaker_window_s,
        "breaker_backoff_s": args.breaker_backoff_s, "breaker_max_backoff_s": args.breaker_max_backoff_s,
        "retry": RetryPolicy(max_attempts=args.retry_attempts, base_backoff_s=args.retry_backoff_s,
                          max_backoff_s=args.retry_max_backoff_s),
        "slots": args.slots, "gold_reserved": args.gold_reserved,
        "preempt_after_ms": args.preempt_after_ms, "gold_sla_ms": args.gold_sla_ms,
        "max_streams": args.max_streams, "idle_task_s": args.idle_task_s, "retain_closed_s": args.retain_closed_s,
        "retain_closed_max": args.retain_closed_max, "retain_closed_bytes": args.retain_closed_bytes,
        "idle_trim": not args.no_idle_trim,
    }


def keys_main(argv: list[str]) -> int:
    """``atp-router keys new KEY_ID TENANT [ROLE …]``: a fresh API key. Prints
    the secret once (give it to the caller) and the ``api_keys`` entry for the
    ``--auth`` file (only its sha256 is stored)."""
    ap = argparse.ArgumentParser(prog="atp-router keys", description=keys_main.__doc__.splitlines()[0] if keys_main.__doc__ else None,
                                 formatter_class=DefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    new = sub.add_parser("new", help="make an API key", formatter_class=DefaultsHelpFormatter)
    new.add_argument("key_id")
    new.add_argument("tenant")
    new.add_argument("roles", nargs="*", default="client",
                     help="client, operator, admin: comma- or space-separated (admin,operator or admin operator)")
    args = ap.parse_args(argv)
    given = [args.roles] if isinstance(args.roles, str) else args.roles  # the default is one string
    roles = [r.strip() for arg in given for r in arg.split(",") if r.strip()]
    try:
        secret, entry = new_api_key(args.key_id, args.tenant, roles)
    except ValueError as e:
        ap.error(str(e))
    print(f"secret (shown once): {secret}")
    print("api_keys entry for the --auth file (paste under api_keys:):")
    # One block-list item in flow style: the `- {id: …}` line the README shows.
    print("  - " + yaml.safe_dump(entry, sort_keys=False, default_flow_style=True, width=1 << 16).strip())
    return 0


def _eval_main(argv: list[str]) -> int:
    from atp_router.review.eval import (
        main as eval_main,  # it imports the SDK (atp.Client): only eval needs it
    )

    return eval_main(argv, serve_router=serve_private, model_servers=local_model, rule_sources=rule_sources)


def _learn_main(argv: list[str]) -> int:
    return learn_main(argv, default_state_dir=_default_state_dir())


#: ``atp-router NAME ARGS…``: the subcommands (the module doc), each ``main(ARGS)`` → exit status.
_SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "keys": keys_main,
    "model-server": lambda argv: local_model.model_server_main(argv),
    "eval": _eval_main,
    "policy": lambda argv: policy_main(argv, build_adapter=build_adapter, stages=lambda: describe(DEFAULT_STAGES)),
    "audit": lambda argv: audit_main(argv, default_state_dir=_default_state_dir()),
    "routes": routes_main,
    "learn": lambda argv: _learn_main(argv),
    "review": lambda argv: review_main(argv, serve_private=serve_private),
}


def main(argv: list[str] | None = None) -> int:
    """``atp-router`` (the module doc): a subcommand, else the router — one
    process, the ``--workers`` supervisor, or one of its workers. Returns the
    exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _SUBCOMMANDS:
        return _SUBCOMMANDS[argv[0]](argv[1:])
    args, config = _parse(argv, os.environ)
    spec = None
    if args.worker_spec is not None:
        spec = WorkerSpec.from_json(args.worker_spec)
    try:
        logs.configure(redaction=install_log_redaction, level=args.log_level, fmt=args.log_format,
                       fields={"worker": spec.slot} if spec is not None else None)
        tracing.configure_from_env()  # an SDK TracerProvider only when OTEL_* configure an exporter
    except ValueError as e:  # a bad --log-level, or OTEL_* naming what cannot be exported
        print(f"atp-router: {e}", file=sys.stderr)
        return 2
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # httpx logs an INFO line for every next-hop request: noise, and ~2 % of the
        # hot path's CPU (issue 10); its warnings and errors still show.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    install_log_redaction()  # Agent Context secrets never reach any log handler's output
    if spec is not None:
        return worker_main(config, spec)
    if not build_authenticator(config).enabled:
        logging.getLogger("atp_router.deploy").warning("no --auth file and no ATP_ROUTER_TOKENS: authentication is off")
    if args.workers > 1:
        return supervise(config, args.workers, argv)
    return _serve_main(config)


def _serve_main(config: RouterConfig) -> int:
    """One router in this process (:func:`run`) until SIGINT or SIGTERM: prints
    the ``listening`` line once it serves; 2 when it refuses to start (its RIB,
    its state store: the reason on stderr), else 0."""
    refused: Exception | None = None

    async def main_async() -> None:
        nonlocal refused
        async with trio.open_nursery() as nursery:
            try:
                router, http_port, ws_port = await nursery.start(run, config)
            except (PolicyError, RuntimeError, StoreError, OSError, ValueError) as e:
                # Caught here: out of the nursery it would come wrapped in an ExceptionGroup. Every
                # start-up refusal (a state directory or key file that cannot be used) is one line.
                refused = e
                nursery.cancel_scope.cancel()
                return
            http, ws = ("https", "wss") if config.tls is not None else ("http", "ws")
            owner = router.streams.persistence.owner  # a router on a shared store names itself (its streams' owner)
            # The handler is in place before "listening": a supervisor's SIGTERM right after it is a clean stop;
            # once the block is left, a later signal is ignored: the shutdown is not cut by it.
            with stop_signal_receiver() as signals:
                print(f"atp-router listening {http}://{config.host}:{http_port} {ws}://{config.host}:{ws_port} "
                      f"(RIB generation {router.gen.version}: {', '.join(router.rib_summary()['agents'])})"
                      + (f" router={owner}" if owner else ""), flush=True)
                async for _ in signals:
                    break
                # Running streams finish first (--drain-s; a second signal stops at once).
                why = await drain(router.drain, lambda: router.open_count, config.drain_s, signals)
                logging.getLogger("atp_router.deploy").warning("stopping: %s", why)
                nursery.cancel_scope.cancel()

    trio.run(main_async)
    if refused is not None:
        what = f"policy refused: {refused.reason}" if isinstance(refused, PolicyError) else str(refused)
        print(f"atp-router: {what}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
