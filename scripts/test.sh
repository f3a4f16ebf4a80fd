#!/usr/bin/env bash
# Set up .venv (as scripts/setup.sh), then run the fast lane (unit and in-process CLI tests) and the
# end-to-end lane (the real llamafactory-cli on a tiny local model), printing the time of each.
#   bash scripts/test.sh            # both lanes
#   bash scripts/test.sh --fast     # the fast lane only
#   bash scripts/test.sh --e2e      # the end-to-end lane only (CI runs the two lanes as two steps)
# Any other arguments go to pytest (in both lanes).
set -euo pipefail
cd "$(dirname "$0")/.."
run_fast=1
run_e2e=1
args=()
for a in "$@"; do
  case "$a" in
    --fast) run_e2e=0 ;;
    --e2e) run_fast=0 ;;
    *) args+=("$a") ;;
  esac
done
bash scripts/setup.sh
lane() {  # lane NAME MARKER
  local name=$1 marker=$2 start end rc=0
  start=$(date +%s)
  echo "=== $name lane (-m \"$marker\") ==="
  .venv/bin/python -m pytest -q -p no:cacheprovider -m "$marker" ${args[@]+"${args[@]}"} || rc=$?
  end=$(date +%s)
  echo "=== $name lane: $((end - start)) s (exit $rc) ==="
  # 5: no tests were collected in this lane (e.g. a -k that selects only the other lane's tests).
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}
if [ "$run_fast" -eq 1 ]; then
  lane fast "not e2e and not bench"
fi
if [ "$run_e2e" -eq 1 ]; then
  lane e2e "e2e and not bench"
fi
