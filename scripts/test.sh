#!/usr/bin/env bash
# Set up everything the tests need (test tools, real peers) and run the whole suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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
