#!/usr/bin/env bash
# A CI job: review the commits of the branch under test since it forked from
# $ATP_BASE (default: origin/main) through the ATP router, write the findings as
# SARIF 2.1.0 to $ATP_SARIF (default: atp-review.sarif, for the code host to
# ingest) and fail the job when a finding at or above $ATP_FAIL_ON (default:
# high) is reported. Exit status: atp-router review's (0 clean, 1 findings,
# 2 an error).
#
# With ATP_ROUTER_URL set (its token in ATP_TOKEN, a CI secret) the review goes to
# that shared router, under its tenant's budget; without it, `atp-router review`
# starts one on its default RIB. ATP_ROUTER: the atp-router command. The
# checkout needs the base's history (a full clone, or fetch depth 0).
# github-workflow.yml beside this file runs it on every pull request.
set -uo pipefail
atp=${ATP_ROUTER:-atp-router}
base=${ATP_BASE:-origin/main}
sarif=${ATP_SARIF:-atp-review.sarif}
args=(review --base "$base" --format sarif --output "$sarif" --fail-on "${ATP_FAIL_ON:-high}")
[ -n "${ATP_ROUTER_URL:-}" ] && args+=(--url "$ATP_ROUTER_URL")
"$atp" "${args[@]}"
rc=$?
case $rc in
  0) echo "atp-review: no finding at or above ${ATP_FAIL_ON:-high}; SARIF in $sarif" ;;
  1) echo "atp-review: findings at or above ${ATP_FAIL_ON:-high}; SARIF in $sarif" ;;
  *) echo "atp-review: the review did not run (exit $rc)" ;;
esac
exit $rc
