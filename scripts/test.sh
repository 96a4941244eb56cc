#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup_env.sh), then run the whole pytest suite.
# GPU tests are marked `gpu` and skip cleanly on a machine without one. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
