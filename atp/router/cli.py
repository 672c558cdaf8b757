"""``atp-router``: run the ATP router appliance.

    atp-router --policies policies/ [--host 127.0.0.1] [--http-port 7070] [--ws-port 7071]

Bearer tokens come from ``ATP_ROUTER_TOKENS`` (comma-separated; each entry
``name:token`` — the client ``name`` whose budget and ``qos_max`` the RIB's
``clients`` section sets — or a bare token; unset means authentication off, for
a local appliance), the frame HMAC key from ``ATP_HMAC_KEY`` (never from the
command line, so they stay out of ``ps``).
Prints one ``listening`` line per ingress when ready; SIGINT/SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve

from atp.router.api import build_app
from atp.router.core import Router, RouterConfig, parse_tokens_env
from atp.router.ws import serve_ws
from atp.wire.errors import PolicyError


async def run(config: RouterConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run router, HTTP control API and WebSocket ingress until cancelled.

    ``task_status.started`` receives ``(router, http_port, ws_port)`` with the bound
    ports (useful with port 0). Raises :class:`PolicyError` if the initial RIB is bad.
    """
    router = Router(config)
    hc = HyperConfig()
    hc.bind = [f"{config.host}:{config.http_port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        await nursery.start(router.serve)
        binds = await nursery.start(lambda task_status: hyper_serve(build_app(router), hc, task_status=task_status))
        ws_server = await nursery.start(lambda task_status: serve_ws(router, config.host, config.ws_port, task_status=task_status))
        http_port = int(binds[0].rsplit(":", 1)[1])
        task_status.started((router, http_port, ws_server.port))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="atp-router", description="ATP router appliance (Agent Transport Protocol v0.1)")
    ap.add_argument("--policies", type=Path, default=Path("policies"), help="RIB file or directory of *.yaml")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=7070, help="control API (0 = any free port)")
    ap.add_argument("--ws-port", type=int, default=7071, help="WebSocket ingress (0 = any free port)")
    ap.add_argument("--slots", type=int, default=64,
                    help="next-hop calls in flight across all streams (QoS capacity, spec §9)")
    ap.add_argument("--gold-reserved", type=int, default=8, help="slots only gold streams may use")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    if not 0 <= args.gold_reserved < args.slots:
        ap.error(f"need 0 <= --gold-reserved < --slots, got {args.gold_reserved} and {args.slots}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        tokens, client_tokens = parse_tokens_env(os.environ.get("ATP_ROUTER_TOKENS", ""))
    except ValueError as e:
        print(f"atp-router: {e}", file=sys.stderr)
        return 2
    key = os.environ.get("ATP_HMAC_KEY")
    config = RouterConfig(
        policies=args.policies, host=args.host, http_port=args.http_port, ws_port=args.ws_port,
        tokens=tokens, client_tokens=client_tokens, hmac_key=key.encode() if key else None,
        slots=args.slots, gold_reserved=args.gold_reserved,
    )
    if not tokens and not client_tokens:
        logging.getLogger("atp.router").warning("ATP_ROUTER_TOKENS is unset: authentication is off")

    async def main_async() -> None:
        async with trio.open_nursery() as nursery:
            router, http_port, ws_port = await nursery.start(run, config)
            print(f"atp-router listening http://{config.host}:{http_port} ws://{config.host}:{ws_port} "
                  f"(RIB generation {router.gen.version}: {', '.join(router.rib_summary()['agents'])})", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main_async)
    except PolicyError as e:
        print(f"atp-router: policy refused: {e.reason}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
