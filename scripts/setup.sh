#!/usr/bin/env bash
# Create .venv and install ftlaunch with the trainer (llamafactory) and test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Reinstall only when the project's requirements changed since the last install.
stamp=.venv/.ftlaunch-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -e '.[train,dev]' 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import ftlaunch, llamafactory" 2>/dev/null || .venv/bin/python -c "import ftlaunch"
  test -x .venv/bin/llamafactory-cli
  echo "$want" > "$stamp"
fi
