#!/usr/bin/env bash
# The main job: set up, prepare the real SmolLM2 pair, serve it with SGLang on CPU, run prompts
# with no speculation (AR), plain speculative decoding (SD: saguaro sync mode) and SSD (saguaro
# async mode), and print the outputs and the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${SGLANG_SSD_VENV:-.venv}
"$VENV/bin/python" scripts/prepare_models.py
exec "$VENV/bin/python" -m sglang_ssd.demo "$@"
