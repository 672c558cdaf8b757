#!/usr/bin/env bash
# scripts/test.sh [PYTEST ARGS…]: set up everything the tests need (test tools, the
# local model server, real peers) and run the whole suite — what .ci/run runs. The
# run ends with one line of where its time went (set-up, peers, tests); the tests
# print a progress line every minute (tests/progress.py). First-run times are in the
# README ("Time and disk").
#
# scripts/test.sh --fast [PYTEST ARGS…]: the fast tier, in about a minute: the sans-IO and
# in-process router tests, without real peers, the model server or slow tests (the
# markers peers, model and slow, given by tests/conftest.py). Its set-up is
# `scripts/setup.sh --test-tools` (no llama-cpp-python build, no peer venvs).
#
# scripts/test.sh --under-load[=N] [--fast] [PYTEST ARGS…]: the same with N busy
# processes (default 8) running beside it for the whole run, to keep timing-sensitive
# tests honest on a loaded machine (issue 20); they stop with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=0
case "${1:-}" in
  --under-load) hogs=8; shift ;;
  --under-load=*) hogs=${1#--under-load=}; shift ;;
esac
if [ "$hogs" -gt 0 ]; then
  hog_pids=()
  for _ in $(seq "$hogs"); do ( while :; do :; done ) & hog_pids+=($!); done
  trap 'kill "${hog_pids[@]}" 2>/dev/null || true' EXIT
  echo "test.sh: $hogs busy processes run beside the tests (load ≥ $hogs)"
fi
# Tests run side by side in ATP_TEST_WORKERS pytest-xdist processes (default: cores + 1, as
# many tests wait on real processes — routers, peers, sandboxes), a file to a worker so
# each file's fixtures start once. ATP_TEST_WORKERS=0 runs serially, and so does
# ATP_UPDATE_SLOW_TESTS=1 (it records serial times into tests/slow_tests.txt).
workers=${ATP_TEST_WORKERS:-$(( $(nproc) + 1 ))}
[ "${ATP_UPDATE_SLOW_TESTS:-}" = 1 ] && workers=0
xdist=(-n "$workers")
[ "$workers" != 0 ] && xdist+=(--dist loadfile)
t0=$SECONDS
if [ "${1:-}" = "--fast" ]; then
  shift
  scripts/setup.sh --test-tools
  t1=$SECONDS
  rc=0; .venv/bin/python -m pytest "${xdist[@]}" -m "not peers and not model and not slow" "$@" || rc=$?
  echo "test.sh --fast: set-up $((t1 - t0)) s, tests $((SECONDS - t1)) s (${workers} workers), in all $((SECONDS - t0)) s"
  exit $rc
fi
# The router and the test tools first (a minute); then the local model server (on a
# fresh machine a from-source build of llama-cpp-python: the longest step) in the
# background while the peers install, each into its own venv or from Debian.
scripts/setup.sh --test-tools
scripts/setup.sh --model > >(sed -u 's/^/[model] /' >&2) 2>&1 &
model_pid=$!
t1=$SECONDS
# Real peers for the adapter tests (brokers, A2A / Agent API servers): each script
# installs one peer, idempotently, into .peers/ or from Debian, and prints what it did.
# The ones with their own venv under .peers/ (pip: mostly download and unpack) install
# side by side; the Debian ones in turn (apt-get holds one lock).
venv_peers=(scripts/peers/a2a.sh scripts/peers/agentscope.sh)
venv_pids=()
for peer in "${venv_peers[@]}"; do
  bash "$peer" & venv_pids+=($!)
done
for peer in scripts/peers/*.sh; do
  case " ${venv_peers[*]} " in *" $peer "*) continue ;; esac
  [ -e "$peer" ] && bash "$peer"
done
for pid in "${venv_pids[@]}"; do
  wait "$pid" || { echo "test.sh: a peer's set-up failed (above, peers: lines)" >&2; exit 1; }
done
t2=$SECONDS
wait "$model_pid" || { echo "test.sh: the model server's set-up failed (above, [model] lines)" >&2; exit 1; }
scripts/setup.sh --test  # nothing left to do: every stamp matches
t3=$SECONDS
export ATP_REQUIRE_MODEL=${ATP_REQUIRE_MODEL:-1}
# Peers installed above must be there: a missing one fails its tests instead of skipping.
export ATP_REQUIRE_PEERS=${ATP_REQUIRE_PEERS:-1}
rc=0; .venv/bin/python -m pytest "${xdist[@]}" "$@" || rc=$?
echo "test.sh: set-up $((t1 - t0)) s, peers $((t2 - t1)) s (the model server beside them, then $((t3 - t2)) s more)," \
     "tests $((SECONDS - t3)) s (${workers} workers), in all $((SECONDS - t0)) s"
exit $rc
