#!/usr/bin/env bash
# The official SARIF 2.1.0 JSON schema, for the review command's SARIF test
# (tests/unit/test_review_command.py validates every log it writes against it with
# jsonschema). The OASIS schema ships inside Microsoft's SARIF Multitool npm package
# (@microsoft/sarif-multitool-linux, MIT; its `sarif validate` uses it): the package is
# fetched with `npm pack` (pinned), only `sarif-2.1.0.json` is kept, checked against its
# sha256, in .peers/sarif/. Idempotent and quiet: nothing happens when it is there.
set -euo pipefail
cd "$(dirname "$0")/../.."
pkg="@microsoft/sarif-multitool-linux@5.7.0"
sha="1c49a0f2b60444c71bb14878e21e0d882198eff4c539861b133093ad89ed798c"
dest=.peers/sarif/sarif-2.1.0.json
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "peers: the SARIF schema needs npm (Debian's npm package)" >&2; exit 1; }
echo "peers: fetching the SARIF 2.1.0 schema from $pkg with npm pack (~45 MB download, ~15 s)" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && npm pack --silent "$pkg" >pack.log 2>&1); then
  cat "$tmp/pack.log" >&2
  exit 1
fi
tar -xzf "$tmp"/*.tgz -C "$tmp" package/sarif-2.1.0.json
if ! echo "$sha  $tmp/package/sarif-2.1.0.json" | sha256sum -c --status; then
  echo "peers: $pkg's sarif-2.1.0.json does not have the pinned sha256 $sha" >&2
  exit 1
fi
mkdir -p .peers/sarif
mv "$tmp/package/sarif-2.1.0.json" "$dest"
