#!/usr/bin/env bash
# The README's test command: sets up what is missing (idempotent), then runs the whole suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_vllm.sh
if [ "$(id -u)" = 0 ]; then
  bash scripts/setup_slurm.sh   # idempotent: installs what is missing, starts any daemon that is down
elif ! command -v sbatch >/dev/null 2>&1; then
  echo "[test] no Slurm and not root: the Slurm tests will skip"
fi
export SCALERL_VLLM_PYTHON="${SCALERL_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}"
exec .venv/bin/python -m pytest "$@"
