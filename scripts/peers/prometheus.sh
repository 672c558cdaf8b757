#!/usr/bin/env bash
# Prometheus for the Grafana dashboard test (tests/ops/test_grafana_dashboard.py):
# Debian's prometheus 2.x scrapes a real router and runs every query of
# deploy/grafana/atp-router.json. Idempotent and quiet: nothing happens when it is
# installed. The test starts its own server on a free port; the packaged service
# is not used.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "peers: prometheus missing; installing it needs root (apt-get install prometheus)" >&2
  exit 1
fi
echo "peers: installing prometheus with apt-get (~20 s, ~100 MB)" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
