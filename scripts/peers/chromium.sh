#!/usr/bin/env bash
# Headless browser for the status page test (tests/ops/test_status_page.py):
# Debian's chromium, driven by Playwright for Python (the test extra) through
# executable_path — Playwright's own browser download is never used — and the
# DejaVu fonts the screenshots are drawn with. Idempotent and quiet: nothing
# happens when both are installed.
set -euo pipefail
have_chromium() { command -v chromium >/dev/null 2>&1 || [ -x /usr/lib/chromium/chromium ]; }
have_fonts() { [ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]; }
if have_chromium && have_fonts; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "peers: chromium missing; installing it needs root (apt-get install chromium fonts-dejavu-core)" >&2
  exit 1
fi
echo "peers: installing chromium and fonts-dejavu-core with apt-get (~1 min, ~450 MB)" >&2
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
