#!/usr/bin/env bash
# Create (or reuse) the project venv .venv and install scalerl-zoo into it, editable.
# torch is pinned to 2.13.0: on CPU machines that is the local CPU wheel; any other spec
# pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SCALERL_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.scalerl-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 and scalerl-zoo[test,bench,track] into $VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[test,bench,track]"
  touch "$stamp"
fi
