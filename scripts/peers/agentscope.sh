#!/usr/bin/env bash
# Real Agent API peer (../shared/PEERS.md "Agent API protocol"): agentscope-runtime 1.1
# in its own venv .peers/agentscope. tests/peer_servers/agentscope_server.py runs on it
# (tests/peers.py starts it on a free port). Idempotent: a stamp file records what was
# installed; pip's output is shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
SPEC="agentscope-runtime==1.1.*"
venv=.peers/agentscope
stamp="$venv/.atp-stamp"
[ "$(cat "$stamp" 2>/dev/null)" = "$SPEC" ] && exit 0
echo "peers: installing $SPEC into $venv" >&2
PY=${PYTHON:-python3}
rm -rf "$venv"  # a changed or half-done install starts clean
"$PY" -m venv "$venv"
log="$venv/install.log"
if ! "$venv/bin/python" -m pip --disable-pip-version-check -q install "$SPEC" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
echo "$SPEC" > "$stamp"
