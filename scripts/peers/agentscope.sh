#!/usr/bin/env bash
# Real Agent API peer (../shared/PEERS.md "Agent API protocol"): agentscope-runtime 1.1
# in its own venv .peers/agentscope. tests/peer_servers/agentscope_server.py runs on it
# (tests/peers.py starts it on a free port). Idempotent: a stamp file records what was
# installed; pip's output goes to the venv's install.log, with a heartbeat on the
# terminal (scripts/lib/progress.sh) and the log's tail on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
SPEC="agentscope-runtime==1.1.*"
venv=.peers/agentscope
stamp="$venv/.atp-stamp"
[ "$(cat "$stamp" 2>/dev/null)" = "$SPEC" ] && exit 0
PY=${PYTHON:-python3}
PROGRESS_PREFIX=peers
. scripts/lib/progress.sh
step agentscope "installing $SPEC into $venv" "1.5 min, 550 MB"
rm -rf "$venv"  # a changed or half-done install starts clean
"$PY" -m venv "$venv"
# --no-compile: Python compiles what the test server imports on first use, not every module now
pip_install "$venv" "$venv/install.log" --no-compile "$SPEC"
echo "$SPEC" > "$stamp"
step_report "$(du -sh "$venv" | cut -f1) in $venv"
