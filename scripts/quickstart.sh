#!/usr/bin/env bash
# The README's main command: set up .venv (idempotent), then train the embedded tiny CPU run:
# warm-start a tiny model on arithmetic (cached), RL-train it with the ScaleRL recipe, evaluate,
# fit the sigmoid law and write a figure of held-out pass rate against compute.
#   bash scripts/quickstart.sh [extra `scalerl train` args, e.g. --gin 'train.total_steps = 10']
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/scalerl train experiments/configs/tiny_cpu.gin "$@"
