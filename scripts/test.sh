#!/usr/bin/env bash
# The README's test command: sets up what is missing (idempotent), then runs the whole suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_vllm.sh
if ! command -v sbatch >/dev/null 2>&1 || ! sinfo -h >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then bash scripts/setup_slurm.sh; else echo "[test] no Slurm and not root: Slurm tests will skip"; fi
fi
export SCALERL_VLLM_PYTHON="${SCALERL_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}"
exec .venv/bin/python -m pytest "$@"
