#!/usr/bin/env bash
# Set up .venv (as scripts/setup.sh), then run the fast lane (unit and in-process CLI tests), the
# end-to-end lane (the real llamafactory-cli on a tiny local model) and the Slurm lane (a real
# two-node Slurm cluster on this machine, scripts/slurm_local.sh), printing the time of each.
#   bash scripts/test.sh            # all three lanes
#   bash scripts/test.sh --fast     # the fast lane only
#   bash scripts/test.sh --e2e      # the end-to-end lane only
#   bash scripts/test.sh --slurm    # the Slurm lane only (CI runs the lanes as separate steps)
#   bash scripts/test.sh --ray      # the Ray lane only (not part of the default run)
# The Slurm lane needs root and apt (to install slurm-wlm and munge) or both already installed; a
# machine without them skips it and says why. It starts the cluster, runs the tests marked `slurm`,
# and stops exactly the daemons it started. The Ray lane installs the ray extra into .venv when it is
# missing, and runs the tests marked `ray`: each module starts its own Ray head on 127.0.0.1 (free
# ports, its own temp dir) and ends only that head's processes. Any other arguments go to pytest (in
# every lane). The fast lane runs in 4 pytest-xdist workers, a whole test file to a worker (its module
# fixtures computed once; the longest first, tests/conftest.py); `-n 0` after --fast runs it in one
# process (for --pdb, or to time one test).
set -euo pipefail
cd "$(dirname "$0")/.."
run_fast=1
run_e2e=1
run_slurm=1
run_ray=0
args=()
for a in "$@"; do
  case "$a" in
    --fast) run_e2e=0; run_slurm=0 ;;
    --e2e) run_fast=0; run_slurm=0 ;;
    --slurm) run_fast=0; run_e2e=0 ;;
    --ray) run_fast=0; run_e2e=0; run_slurm=0; run_ray=1 ;;
    *) args+=("$a") ;;
  esac
done
bash scripts/setup.sh
lane() {  # lane NAME MARKER [PYTEST ARGS...]
  local name=$1 marker=$2 start end rc=0
  shift 2
  start=$(date +%s)
  echo "=== $name lane (-m \"$marker\") ==="
  .venv/bin/python -m pytest -q -p no:cacheprovider -m "$marker" "$@" ${args[@]+"${args[@]}"} || rc=$?
  end=$(date +%s)
  echo "=== $name lane: $((end - start)) s (exit $rc) ==="
  # 5: no tests were collected in this lane (e.g. a -k that selects only the other lane's tests).
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}
if [ "$run_fast" -eq 1 ]; then
  # Mostly waits on child processes and sleeps (scripted trainers): 4 workers beat 3 on a 2-core machine.
  lane fast "not e2e and not bench and not slurm and not ray" -n 4 --dist loadfile
fi
if [ "$run_e2e" -eq 1 ]; then
  lane e2e "e2e and not bench and not slurm and not ray"
fi
if [ "$run_slurm" -eq 1 ]; then
  if ! why=$(bash scripts/slurm_local.sh check); then
    echo "=== slurm lane: SKIPPED: $why ==="
  else
    start=$(date +%s)
    bash scripts/slurm_local.sh start
    trap 'bash scripts/slurm_local.sh stop' EXIT
    eval "$(bash scripts/slurm_local.sh env)"
    echo "=== slurm lane: cluster up in $(($(date +%s) - start)) s ==="
    lane slurm "slurm and not bench"
  fi
fi
if [ "$run_ray" -eq 1 ]; then
  if ! .venv/bin/python -c "import ray.job_submission" 2>/dev/null || [ ! -x .venv/bin/ray ]; then
    start=$(date +%s)
    .venv/bin/python -m pip install -q -e '.[ray]' 2>&1 | grep -v "^WARNING: Location" || true
    echo "=== ray lane: the ray extra installed in $(($(date +%s) - start)) s ==="
  fi
  lane ray "ray and not bench"
fi
