"""``atp-agent2389 --config agent.toml``: run one 2389 agent until SIGINT/SIGTERM.

Exit status: 0 after a graceful stop, 1 when the agent could not become available
(broker unreachable, credential env var missing, tool or adapter check failed),
2 when ``agent.toml`` is invalid. ``--check`` validates the file and exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio

from atp_router.agent2389.config import ConfigError, load_config
from atp_router.agent2389.runtime import AgentRuntime, StartupError

__all__ = ["main"]


async def _amain(runtime: AgentRuntime) -> None:
    failure: StartupError | None = None
    async with trio.open_nursery() as nursery:

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    # run() says "unavailable" and disconnects in its shielded cleanup.
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(stop_on_signal)
        try:
            await runtime.run()
        except StartupError as e:
            failure = e
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atp-agent2389", description="Run an ATP next-hop as a 2389 MQTT agent.")
    parser.add_argument("--config", required=True, help="path to agent.toml")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--check", action="store_true", help="validate the configuration and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        runtime = AgentRuntime(load_config(args.config))
    except ConfigError as e:
        print(f"atp-agent2389: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"atp-agent2389: {args.config}: adapter: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"atp-agent2389: {args.config}: agent {runtime.agent_id!r} OK, tools: {', '.join(sorted(runtime.tools))}")
        return 0
    try:
        trio.run(_amain, runtime)
    except StartupError as e:
        print(f"atp-agent2389: agent {runtime.agent_id!r} could not start: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
