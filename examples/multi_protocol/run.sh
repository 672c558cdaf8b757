#!/usr/bin/env bash
# One code-review task fanned out over three protocols at once (issue #4):
#
#   router A ──tool──────────► lint.ruff        (local analyser)
#            ──MQTT 2389─────► sec.mqtt         (atp-agent2389 running bandit, via mosquitto)
#            ──A2A JSON-RPC──► review.a2a       (router B answering as an A2A server,
#                                                itself fanning out to ruff + bandit)
#
# and the FINAL result carries provenance from all three. Everything runs on
# 127.0.0.1 on free ports and is stopped on exit. Arguments go to the code-review
# example (default: the golden task BugsInPy thefuck#23, whose pickle line all three flag).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
scripts/setup.sh
bash scripts/peers/mosquitto.sh
py=.venv/bin/python
port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d -t atp-multi.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
wait_for() {  # wait_for FILE PATTERN PID WHAT
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { echo "$4 exited:" >&2; cat "$1" >&2; exit 1; }
    sleep 0.1
  done
  echo "$4 did not start:" >&2; cat "$1" >&2; exit 1
}

# 1. An MQTT 5 broker (mosquitto drops root to its own user: give it a directory it owns).
MQTT=$(port)
mkdir -p "$work/mqtt"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\nlog_type all\n' "$MQTT" > "$work/mqtt/mosquitto.conf"
[ "$(id -u)" = 0 ] && chown -R mosquitto:mosquitto "$work/mqtt"
mosquitto -c "$work/mqtt/mosquitto.conf" > "$work/mqtt.log" 2>&1 & pids+=($!)
wait_for "$work/mqtt.log" "running" $! mosquitto

# 2. bandit as a 2389 agent on that broker (examples/agent2389/agent.toml, broker port rewritten).
sed "s#mqtt://127.0.0.1:1883#mqtt://127.0.0.1:$MQTT#" examples/agent2389/agent.toml > "$work/agent.toml"
.venv/bin/atp-agent2389 --config "$work/agent.toml" > "$work/agent.log" 2>&1 & pids+=($!)
wait_for "$work/agent.log" "available" $! atp-agent2389

# 3. Router B: the default RIB, reached as an A2A agent at /a2a.
B_HTTP=$(port); B_WS=$(port)
.venv/bin/atp-router --policies policies/ --state-dir "$work/state-b" --http-port "$B_HTTP" --ws-port "$B_WS" > "$work/router-b.log" 2>&1 & pids+=($!)
wait_for "$work/router-b.log" "listening" $! "router B"

# 4. Router A: one policy fanning out over the three protocols.
A_HTTP=$(port); A_WS=$(port)
mkdir -p "$work/policies"
sed -e "s#@MQTT_URL@#mqtt://127.0.0.1:$MQTT#" -e "s#@A2A_URL@#http://127.0.0.1:$B_HTTP/a2a#" \
  examples/multi_protocol/rib.yaml.in > "$work/policies/rib.yaml"
.venv/bin/atp-router --policies "$work/policies" --state-dir "$work/state-a" --http-port "$A_HTTP" --ws-port "$A_WS" > "$work/router-a.log" 2>&1 & pids+=($!)
wait_for "$work/router-a.log" "listening" $! "router A"
grep -m1 listening "$work/router-a.log"

export ATP_ROUTER_URL="http://127.0.0.1:$A_HTTP"
if [ $# -gt 0 ]; then
  $py examples/code_review/review.py "$@"
else
  $py examples/code_review/review.py --golden bugsinpy-thefuck-23
fi
