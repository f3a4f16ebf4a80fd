#!/usr/bin/env bash
# The embedded default: a real LLaMA-Factory training run of a tiny model made locally.
# Sets up .venv, makes the model and data under .demo/, then trains a config written for 8 GPUs
# (train prints its plan for this machine once, then the run is detached and its log followed),
# prints the run's status and says where the demo's runs are kept and how to see them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
where="its own FTLAUNCH_HOME"
[ -n "${FTLAUNCH_HOME:-}" ] && where="the FTLAUNCH_HOME you set"
export FTLAUNCH_HOME=${FTLAUNCH_HOME:-$PWD/.demo/home}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ ! -f .demo/model/config.json ]; then
  .venv/bin/python scripts/make_tiny.py .demo --rows 512
fi
rm -rf .demo/saves/tiny-full-sft
echo "== train: a config written for 8 GPUs with bf16 and ZeRO-2, planned for this machine, then run detached"
.venv/bin/ftlaunch train templates/demo/tiny_full_sft.yaml --source-gpus 8 --follow
echo "== status"
.venv/bin/ftlaunch status
cat <<MSG
== where the demo's runs are
The demo keeps its runs in $where, $FTLAUNCH_HOME (not the default
~/.local/state/ftlaunch), so \`ftlaunch runs\` without it does not list them. To see them:
  FTLAUNCH_HOME=$FTLAUNCH_HOME .venv/bin/ftlaunch runs
  FTLAUNCH_HOME=$FTLAUNCH_HOME .venv/bin/ftlaunch status
  FTLAUNCH_HOME=$FTLAUNCH_HOME .venv/bin/ftlaunch logs
MSG
