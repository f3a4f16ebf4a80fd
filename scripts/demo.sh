#!/usr/bin/env bash
# The embedded default: a real LLaMA-Factory training run of a tiny model made locally.
# Sets up .venv, makes the model and data under .demo/, shows the plan for a cluster config,
# trains it detached while following the log, then prints the run's status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export FTLAUNCH_HOME=${FTLAUNCH_HOME:-$PWD/.demo/home}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ ! -f .demo/model/config.json ]; then
  .venv/bin/python scripts/make_tiny.py .demo --rows 512
fi
rm -rf .demo/saves/tiny-full-sft
echo "== plan: a config written for 8 GPUs with bf16 and ZeRO-2, adapted to this machine"
.venv/bin/ftlaunch plan templates/demo/tiny_full_sft.yaml --source-gpus 8
echo "== train (detached, following the log)"
.venv/bin/ftlaunch train templates/demo/tiny_full_sft.yaml --source-gpus 8 --follow
echo "== status"
.venv/bin/ftlaunch status
