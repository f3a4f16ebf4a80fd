#!/usr/bin/env bash
# The README's test command on a fresh clone of this repository's HEAD, twice: once with a TMPDIR
# over 100 characters (every temp path then folds inside piped messages) and once with COLUMNS=60
# (a narrow terminal for click's help and rich). Tests must not depend on either (issue 36).
#   bash scripts/ci_stress.sh            # both runs, all lanes (about twice the CI time)
#   bash scripts/ci_stress.sh --fast     # both runs, the fast lane only (any scripts/test.sh args pass on)
#   bash scripts/ci_stress.sh --once     # one run with both at once (half the time)
#   bash scripts/ci_stress.sh --load ... # any of the above with two CPU spinners beside it (a busy
#                                        # machine, as CI machines often are: issue 41); --load=N spins N
# Prints the time of each run; exits non-zero on the first run that fails. Leaves nothing behind.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/ftlaunch-stress.XXXXXX")
spinners=()
stop_spinners() { for p in ${spinners[@]+"${spinners[@]}"}; do kill "$p" 2>/dev/null || true; done; }
trap 'stop_spinners; rm -rf "$work"' EXIT
git clone -q "$src" "$work/clone"
long="$work/a-temp-folder-whose-path-is-longer-than-the-hundred-columns-of-piped-output/and-deeper-still"
mkdir -p "$long"
echo "=== fresh clone of $(git -C "$src" rev-parse --short HEAD) in $work/clone; long TMPDIR is ${#long} characters ==="
run() {  # run LABEL VAR=VALUE
  local label=$1 start rc=0
  shift
  start=$(date +%s)
  echo "=== stress run: $label ==="
  (cd "$work/clone" && env "$@" bash scripts/test.sh ${ARGS[@]+"${ARGS[@]}"}) || rc=$?
  echo "=== stress run: $label: $(($(date +%s) - start)) s (exit $rc) ==="
  [ "$rc" -eq 0 ] || exit "$rc"
}
ARGS=()
once=0
load=0
for a in "$@"; do
  case "$a" in
    --once) once=1 ;;
    --load) load=2 ;;
    --load=*) load=${a#--load=} ;;
    *) ARGS+=("$a") ;;
  esac
done
for _ in $(seq 1 "$load"); do
  (while :; do :; done) &  # a busy loop of the shell: one core's worth of load, ended by the trap
  spinners+=($!)
done
[ "$load" -eq 0 ] || echo "=== $load CPU spinner(s) beside the runs: pids ${spinners[*]} ==="
if [ "$once" -eq 1 ]; then
  run "long TMPDIR and COLUMNS=60" TMPDIR="$long" COLUMNS=60
else
  run "long TMPDIR" TMPDIR="$long"
  run "COLUMNS=60" COLUMNS=60
fi
