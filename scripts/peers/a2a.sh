#!/usr/bin/env bash
# Real A2A peers (../shared/PEERS.md "JAF A2A v0.3.0 and official A2A"), each in its
# own venv: .peers/jaf (jaf-py 2.6, JAF A2A v0.3.0; large: it pulls litellm) and
# .peers/a2a-sdk (a2a-sdk 1.3: A2A 1.0 with v0.3 compatibility, its client too).
# tests/peer_servers/{jaf,a2a_sdk}_server.py run on them (tests/peers.py starts
# them on free ports). Idempotent: a stamp file records what was installed; pip's
# output is shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

install_peer() {
  local name=$1; shift
  local venv=.peers/$name stamp="$*"
  [ "$(cat "$venv/.atp-stamp" 2>/dev/null)" = "$stamp" ] && return 0
  echo "peers: installing $* into $venv" >&2
  rm -rf "$venv"  # a changed or half-done install starts clean
  "$PY" -m venv "$venv"
  local log="$venv/install.log"
  if ! "$venv/bin/python" -m pip --disable-pip-version-check -q install "$@" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
  fi
  echo "$stamp" >"$venv/.atp-stamp"
}

install_peer jaf "jaf-py==2.6.*"
install_peer a2a-sdk "a2a-sdk[http-server]==1.3.*" "uvicorn==0.*"
