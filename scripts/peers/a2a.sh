#!/usr/bin/env bash
# Real A2A peers (../shared/PEERS.md "JAF A2A v0.3.0 and official A2A"), each in its
# own venv: .peers/jaf (jaf-py 2.6, JAF A2A v0.3.0; large: it pulls litellm) and
# .peers/a2a-sdk (a2a-sdk 1.3: A2A 1.0 with v0.3 compatibility, its client too).
# tests/peer_servers/{jaf,a2a_sdk}_server.py run on them (tests/peers.py starts
# them on free ports). Idempotent: a stamp file records what was installed; pip's
# output goes to the venv's install.log, with a heartbeat on the terminal
# (scripts/lib/progress.sh) and the log's tail on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PROGRESS_PREFIX=peers
. scripts/lib/progress.sh

# install_peer NAME ESTIMATE SPEC…
install_peer() {
  local name=$1 estimate=$2; shift 2
  local venv=.peers/$name stamp="$*"
  [ "$(cat "$venv/.atp-stamp" 2>/dev/null)" = "$stamp" ] && return 0
  step "$name" "installing $* into $venv" "$estimate"
  rm -rf "$venv"  # a changed or half-done install starts clean
  "$PY" -m venv "$venv"
  # --no-compile: Python compiles what a test server imports on first use, not all of litellm now
  pip_install "$venv" "$venv/install.log" --no-compile "$@"
  echo "$stamp" >"$venv/.atp-stamp"
  step_report "$(du -sh "$venv" | cut -f1) in $venv"
}

install_peer jaf "1 min, 650 MB: it pulls litellm" "jaf-py==2.6.*"
install_peer a2a-sdk "15 s, 85 MB" "a2a-sdk[http-server]==1.3.*" "uvicorn==0.*"
