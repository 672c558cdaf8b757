#!/usr/bin/env bash
# The main job: start `atp-router --policies policies/` on its embedded default RIB
# and review a real diff through it with the code-review example. Extra arguments
# go to the example (default: a labelled security task from shared/golden).
set -euo pipefail
caller=$(pwd)  # relative paths in the arguments (a diff file, --repo) are the caller's
cd "$(dirname "$0")/.."
root=$(pwd)
scripts/setup.sh
port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP=${ATP_HTTP_PORT:-$(port)}; WS=${ATP_WS_PORT:-$(port)}
log=$(mktemp -t atp-router.XXXXXX.log)
.venv/bin/atp-router --policies policies/ --http-port "$HTTP" --ws-port "$WS" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  grep -q "listening" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
grep -m1 listening "$log"
export ATP_ROUTER_URL="http://127.0.0.1:$HTTP"
if [ $# -gt 0 ]; then
  (cd "$caller" && "$root/.venv/bin/python" "$root/examples/code_review/review.py" "$@")
else
  # A labelled real defect (BugsInPy thefuck#23) that both agents flag, then a real
  # security advisory (CVE-2023-30608), then this repository's own last commit.
  .venv/bin/python examples/code_review/review.py --golden bugsinpy-thefuck-23
  .venv/bin/python examples/code_review/review.py --golden cve-intro-e75e35869473
  if git rev-parse -q --verify HEAD~1 >/dev/null; then
    git diff HEAD~1 HEAD | .venv/bin/python examples/code_review/review.py - --repo . --rev HEAD
  fi
fi
