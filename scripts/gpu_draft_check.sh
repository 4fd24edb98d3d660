#!/usr/bin/env bash
# The draft side of the GPU check, for a GPU machine with torch but without SGLang's GPU stack and
# without a package registry (this workplace's lent H200: torch 2.11, no network; sglang-kernel 0.4.10
# needs torch 2.14.1, see results/gpu_draft_check.md).  Installs .gpu_bundle (scripts/gpu_bundle.sh)
# into /tmp/site, then, each step under its own timeout, output under $OUT (default results/gpu_draft):
#   1 preflight   scripts/gpu_env.py (nvcc, flashinfer, devices)
#   2 bench       scripts/gpu_draft_bench.py (draft engine + target-shaped forwards; FlashInfer JIT on first use)
#   3 tests       tests/test_flashinfer_gpu.py tests/test_flashinfer_plan.py (FlashInfer vs SDPA, graphs vs eager)
# FlashInfer JIT-compiles the draft's kernels on first use: ~50 s on the H200 (16 cores), in the bench's
# first FlashInfer start-up.
#   bash scripts/gpu_draft_check.sh            (no CUDA device: prints "skipped" and exits 0)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_draft}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_draft_check: skipped: no CUDA device"; exit 0
fi
if [ -d .gpu_bundle ]; then
  mkdir -p /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_bundle/*.whl || exit 2
  tar -xJf .gpu_bundle/flashinfer-0.7.2-trimmed.txz -C /tmp/site || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp}
export PYTHONUNBUFFERED=1
rc=0
step() { local secs=$1 name=$2; shift 2; local t=$(date +%s)
  timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1; local r=$?
  echo "[gpu_draft_check] $name: rc=$r in $(( $(date +%s) - t ))s (budget ${secs}s)"; tail -25 "$OUT/$name.log"
  [ "$r" -eq 0 ] || rc=1; }
nvidia-smi -L
step 60 preflight "$PY" scripts/gpu_env.py --out "$OUT/env.json"
step ${BENCH_S:-300} bench "$PY" scripts/gpu_draft_bench.py --out "$OUT" ${BENCH_ARGS:-}
step ${TESTS_S:-150} tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_flashinfer_gpu.py tests/test_flashinfer_plan.py
exit $rc
