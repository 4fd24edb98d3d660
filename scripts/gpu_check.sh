#!/usr/bin/env bash
# GPU check for the saguaro GPU path (issue 8), under 8 minutes on one H200; installs nothing.
#
# Needs (from `bash scripts/setup.sh` on the GPU machine, i.e. `pip install -e ".[test]"` with SGLang's
# CUDA stack): torch with CUDA, sglang 0.5.23, flashinfer (flashinfer-python), safetensors, pytest.
# Missing any of them: fails fast with a message naming it.  No CUDA device: prints
# "skipped: no CUDA device" and exits 0.
#
# Steps: (1) synthetic Llama target + equal / noisy drafts (scripts/make_synthetic_pair.py, same seed);
# (2) the GPU-only tests (FlashInfer tree attention vs SDPA, CUDA-graph replay vs eager) and the CPU
# tests of the same code; (3) AR / SD / SSD at b = 1, 4, 16 (scripts/gpu_bench.py) ->
# results/gpu_check.json and results/gpu_check.md.  With one GPU the draft shares it with the target
# and the results say so (SSD numbers are then a lower bound).
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: skipped: no CUDA device (nvidia-smi finds no GPU)"
  exit 0
fi
VENV=${SGLANG_SSD_VENV:-.venv}
PY=${PYTHON:-$VENV/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False for $PY)"
  exit 0
fi
missing=$("$PY" - <<'PY'
import importlib
need = {"sglang": "sglang==0.5.23 (scripts/setup.sh GPU recipe)", "flashinfer": "flashinfer-python",
        "safetensors": "safetensors", "pytest": "pytest", "requests": "requests"}
print(" ".join(f"{m} ({pkg})" for m, pkg in need.items() if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: FAILED: missing packages: $missing -- run scripts/setup.sh on this GPU machine (no network install here)"
  exit 2
fi

start=$(date +%s)
OUT=${GPU_CHECK_OUT:-results}
PAIR=${GPU_CHECK_PAIR:-$(mktemp -d /tmp/sglang-ssd-pair-XXXX)}
mkdir -p "$OUT"
echo "[gpu_check] $(nvidia-smi -L | head -4 | tr '\n' ';')"
echo "[gpu_check] 1/3 synthetic pair -> $PAIR"
timeout 120 "$PY" scripts/make_synthetic_pair.py "$PAIR" || { echo "gpu_check: FAILED: make_synthetic_pair"; exit 1; }

echo "[gpu_check] 2/3 GPU tests"
timeout 170 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_flashinfer_gpu.py tests/test_flashinfer_plan.py \
  tests/test_gpu_verify_input.py 2>&1 | tee "$OUT/gpu_check_pytest.txt" | tail -25
test_rc=${PIPESTATUS[0]}
summary=$(tail -1 "$OUT/gpu_check_pytest.txt")

budget=$(( 330 - ($(date +%s) - start) ))   # servers start while under budget; hard stop 120 s later
[ "$budget" -lt 60 ] && budget=60
echo "[gpu_check] 3/3 AR / SD / SSD (budget ${budget}s)"
timeout $(( budget + 120 )) "$PY" scripts/gpu_bench.py "$PAIR" --out "$OUT" --budget-s "$budget" \
  --pytest-rc "$test_rc" --pytest-summary "$summary"
bench_rc=$?
echo "[gpu_check] done in $(( $(date +%s) - start ))s: tests rc=$test_rc, bench rc=$bench_rc; see $OUT/gpu_check.md"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
