#!/usr/bin/env bash
# The main job: start `atp-router --policies policies/` on its embedded default RIB
# and review real diffs through it with the code-review example. Extra arguments
# go to the example. Without arguments: (1) a realistic change that brings in four
# defects, reviewed by four analysers whose findings consensus merges; (2) one
# labelled real defect from shared/golden; (3) the same change through the
# escalating pipeline (cheap analysers, then the local model: tokens and USD),
# when the local model server could be installed (scripts/setup.sh --model).
set -euo pipefail
caller=$(pwd)  # relative paths in the arguments (a diff file, --repo) are the caller's
cd "$(dirname "$0")/.."
root=$(pwd)
model=1
scripts/setup.sh --model || { model=0; scripts/setup.sh; echo "demo: WARNING: the local model server could not be installed; section 3 is skipped" >&2; }
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
  # Bold headings on a terminal only: piped or logged output gets no escape codes.
  if [ -t 1 ]; then section() { printf '\n\033[1m== %s\033[0m\n' "$1"; }; else section() { printf '\n== %s\n' "$1"; }; fi
  section "1. A realistic change: four analysers review it, consensus merges what they agree on"
  .venv/bin/python examples/code_review/review.py examples/code_review/demo/change.diff --repo examples/code_review/demo/repo
  section "2. A labelled real defect (BugsInPy thefuck#23): is the expected line caught?"
  .venv/bin/python examples/code_review/review.py --golden bugsinpy-thefuck-23
  if [ $model = 1 ]; then
    section "3. The same change, escalating: cheap analysers first, the local model only when they disagree"
    MP=$(port); H2=$(port); W2=$(port)
    rib=$(mktemp -t atp-escalating.XXXXXX.yaml)
    sed "s#127.0.0.1:8089#127.0.0.1:$MP#" examples/eval/policies/escalating.yaml > "$rib"
    mlog=$(mktemp -t atp-model.XXXXXX.log); log2=$(mktemp -t atp-router2.XXXXXX.log)
    .venv/bin/atp-router model-server --port "$MP" >"$mlog" 2>&1 &
    mpid=$!
    .venv/bin/atp-router --policies "$rib" --http-port "$H2" --ws-port "$W2" --no-watch \
      --state-dir "$(mktemp -d -t atp-state.XXXXXX)" >"$log2" 2>&1 &
    pid2=$!
    trap 'kill $pid $pid2 $mpid 2>/dev/null; wait $pid $pid2 $mpid 2>/dev/null || true' EXIT
    for _ in $(seq 100); do grep -q "listening" "$log2" && break; kill -0 $pid2 2>/dev/null || break; sleep 0.1; done
    for _ in $(seq 600); do grep -q "model server:" "$mlog" && break; kill -0 $mpid 2>/dev/null || break; sleep 0.2; done
    if grep -q "model server:" "$mlog"; then
      ATP_ROUTER_URL="http://127.0.0.1:$H2" .venv/bin/python examples/code_review/review.py \
        examples/code_review/demo/change.diff --repo examples/code_review/demo/repo
    else
      echo "demo: WARNING: the local model server did not start: $(tail -3 "$mlog")" >&2
    fi
  fi
fi
