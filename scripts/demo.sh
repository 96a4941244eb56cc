#!/usr/bin/env bash
# The main job: set up .venv, then the end-to-end FP8 training demo (examples/train_gpt.py).
# Extra args go to the demo (e.g. --help, or the GPU size flags it lists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --cuda-if-gpu
exec .venv/bin/python examples/train_gpt.py "$@"
