# shellcheck shell=bash
# Progress output for the long set-up steps (sourced by scripts/setup.sh and
# scripts/peers/*.sh). A step says what it does and roughly how long it takes; while
# pip runs, a heartbeat every $ATP_SETUP_HEARTBEAT_S seconds (default 30) gives the
# elapsed time and the latest sign of progress (a build's "[12/193]" or "[ NN%]",
# else pip's last Collecting/Downloading/Building/Installing line); pip's full output
# goes to a log whose tail is shown on failure. Set PROGRESS_PREFIX (default "setup")
# before sourcing.
PROGRESS_PREFIX=${PROGRESS_PREFIX:-setup}
HEARTBEAT_S=${ATP_SETUP_HEARTBEAT_S:-30}
done_steps=()

# hms SECONDS: "42s", "8m05s".
hms() { if [ "$1" -ge 60 ]; then printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); else printf '%ds' "$1"; fi; }

# step LABEL WHAT ESTIMATE: announce a step ("setup: WHAT (~ESTIMATE)"); step_done
# records its time under LABEL for steps_summary.
step() { step_label=$1 step_what=$2 step_t0=$SECONDS; echo "$PROGRESS_PREFIX: $2 (~$3)" >&2; }
step_done() { done_steps+=("$step_label $(hms $((SECONDS - step_t0)))"); }
# step_report [EXTRA]: "PREFIX: LABEL done in TIME (EXTRA)" for a script of one step.
step_report() { echo "$PROGRESS_PREFIX: $step_label done in $(hms $((SECONDS - step_t0)))${1:+ ($1)}" >&2; }

# steps_summary TOTAL_SECONDS [EXTRA]: one line, the time of each step that ran
# (nothing when none ran).
steps_summary() {
  [ ${#done_steps[@]} -gt 0 ] || return 0
  local s; s=$(printf '%s, ' "${done_steps[@]}")
  echo "$PROGRESS_PREFIX: done in $(hms "$1") (${s%, })${2:+; $2}" >&2
}

# progress LOG: copy stdin to LOG, with the heartbeat on stderr.
progress() {
  local log=$1 t0=$SECONDS next=$((SECONDS + HEARTBEAT_S)) chunk line partial="" last="" pct="" rc
  local lines=0 lines_seen=0 shown="" shown_t=$SECONDS what
  while :; do
    if IFS= read -r -t 2 chunk; then
      line=$partial$chunk partial=""
      printf '%s\n' "$line" >>"$log"
      lines=$((lines + 1))
      if [[ $line =~ ^\ *\[([0-9]+)/([0-9]+)\]\  ]]; then  # ninja
        pct="compiling: $((100 * BASH_REMATCH[1] / BASH_REMATCH[2]))% (${BASH_REMATCH[1]}/${BASH_REMATCH[2]} files)"
      elif [[ $line =~ ^\ *\[\ *([0-9]+)%\]\  ]]; then  # make
        pct="compiling: ${BASH_REMATCH[1]}%"
      elif [[ $line =~ ^\ *(Collecting|Downloading|Building\ wheel|Installing\ collected|Successfully\ built) ]]; then
        last=${line#"${line%%[![:space:]]*}"} pct=""
        last=${last:0:90}
      fi
    else
      rc=$?
      partial+=$chunk  # a timeout (> 128) keeps the part of a line read so far
      if [ "$rc" -le 128 ]; then  # end of input
        [ -z "$partial" ] || printf '%s\n' "$partial" >>"$log"
        return 0
      fi
    fi
    if [ "$SECONDS" -ge "$next" ]; then
      # What changed since the last beat: a new step, or how many lines of output the
      # current one wrote (a step that only prints nothing for minutes says so).
      what=${pct:-$last}
      if [ "$what" != "$shown" ]; then
        shown=$what shown_t=$SECONDS
        echo "$PROGRESS_PREFIX:   … $(hms $((SECONDS - t0))) ${what:-working}" >&2
      else
        echo "$PROGRESS_PREFIX:   … $(hms $((SECONDS - t0))) still: ${what:-working} ($(hms $((SECONDS - shown_t))) so far, +$((lines - lines_seen)) log lines)" >&2
      fi
      lines_seen=$lines
      next=$((SECONDS + HEARTBEAT_S))
    fi
  done
}

# pip_install VENV LOG ARGS…: `pip install ARGS…` in VENV, its output to LOG through
# progress; on failure the log's tail and the failed step on stderr, then exit 1.
pip_install() {
  local venv=$1 log=$2; shift 2
  echo "=== $(date -u +%FT%TZ) $venv: pip install $*" >>"$log"
  if ! "$venv/bin/python" -m pip --disable-pip-version-check install --progress-bar off "$@" 2>&1 | progress "$log"; then
    tail -n 60 "$log" | cut -c1-600 >&2  # a compiler's command lines run to kilobytes
    echo "$PROGRESS_PREFIX: FAILED: $step_what after $(hms $((SECONDS - step_t0))) (full log: $log)" >&2
    exit 1
  fi
}
