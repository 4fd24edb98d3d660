#!/usr/bin/env bash
# Sets up (if needed), prepares the model pair (cached), and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SGLANG_SSD_VENV:-.venv}
"$VENV/bin/python" scripts/prepare_models.py
exec "$VENV/bin/python" -m pytest -q -rs --durations=15 tests "$@"
