#!/usr/bin/env bash
# GPU check of the memory model (ftlaunch.plan.memory): a few real `llamafactory-cli train` runs (3 steps each) with
# RECORD_VRAM=1, predicted vs measured peak memory, written to docs/gpu-check.md (and $OUT if set).
# Needs a CUDA GPU and a python with llamafactory (PYTHON=..., else .venv/bin/python, else python3).
# Nothing is downloaded: the models are made locally (see scripts/gpu_check.py).
#   bash scripts/gpu_check.sh            # all runs (~5 min on one H100/H200)
#   bash scripts/gpu_check.sh --quick    # three runs
#   bash scripts/gpu_check.sh --cpu-smoke  # no GPU: checks the plumbing with one tiny CPU run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in .venv/bin/python python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import llamafactory, yaml" >/dev/null 2>&1; then PY=$c; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "gpu_check: no python with llamafactory found; set PYTHON=/path/to/python" >&2
  exit 2
fi
export PATH="$(dirname "$PY"):$PATH"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DISABLE_VERSION_CHECK=1
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
exec "$PY" scripts/gpu_check.py "$@"
