#!/usr/bin/env bash
# Shared state store for several routers (issue 12, ../shared/PEERS.md): Debian's
# redis-server (7.x). Idempotent and quiet: nothing happens when it is installed. The
# tests start their own servers on free loopback ports (tests/peers.py start_redis);
# the packaged service is not used.
set -euo pipefail
have_redis() { command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; }
if have_redis; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "peers: redis-server missing; installing it needs root (apt-get install redis-server)" >&2
  exit 1
fi
echo "peers: installing redis-server with apt-get (~20 s)" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
# The package starts its own service on 6379 where an init system runs; the tests
# never use it (each starts a private server), so a failure to start it is fine.
