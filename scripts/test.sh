#!/usr/bin/env bash
# scripts/test.sh [PYTEST ARGS…]: set up everything the tests need (test tools, the
# local model server, real peers) and run the whole suite — what .ci/run runs. The
# first run on a fresh 2-core machine takes about 27 minutes and 2.5 GB of disk
# (README "Time and disk").
#
# scripts/test.sh --fast [PYTEST ARGS…]: the fast tier, in about a minute: the sans-IO and
# in-process router tests, without real peers, the model server or slow tests (the
# markers peers, model and slow, given by tests/conftest.py). Its set-up is
# `scripts/setup.sh --test-tools` (no llama-cpp-python build, no peer venvs).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  shift
  scripts/setup.sh --test-tools
  exec .venv/bin/python -m pytest -m "not peers and not model and not slow" "$@"
fi
scripts/setup.sh --test
# Real peers for the adapter tests (brokers, A2A / Agent API servers): each script
# installs one peer, idempotently, into .peers/ or from Debian, and prints what it did.
for peer in scripts/peers/*.sh; do
  [ -e "$peer" ] && bash "$peer"
done
export ATP_REQUIRE_MODEL=${ATP_REQUIRE_MODEL:-1}
# Peers installed above must be there: a missing one fails its tests instead of skipping.
export ATP_REQUIRE_PEERS=${ATP_REQUIRE_PEERS:-1}
exec .venv/bin/python -m pytest "$@"
