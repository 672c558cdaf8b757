#!/usr/bin/env bash
# Set up everything the tests need (test tools, real peers) and run the whole suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
export ATP_REQUIRE_MODEL=${ATP_REQUIRE_MODEL:-1}
exec .venv/bin/python -m pytest "$@"
