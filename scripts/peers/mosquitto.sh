#!/usr/bin/env bash
# MQTT broker for the 2389 adapter and agent-runtime tests (../shared/PEERS.md):
# Debian's mosquitto 2.0.x, plus openssl for the tests' throw-away TLS certificates.
# Idempotent and quiet: nothing happens when both are installed. The tests start
# their own brokers on free ports (tests/peers.py); the packaged service is not used.
set -euo pipefail
have_mosquitto() { command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; }
if have_mosquitto && command -v openssl >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "peers: mosquitto/openssl missing; installing them needs root (apt-get install mosquitto openssl)" >&2
  exit 1
fi
echo "peers: installing mosquitto and openssl with apt-get (~30 s)" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends mosquitto openssl; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
