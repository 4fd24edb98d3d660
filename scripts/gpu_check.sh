#!/usr/bin/env bash
# GPU check for the saguaro GPU path, within 10 minutes on one H200; installs nothing.
#
#   bash scripts/gpu_check.sh              the check (no CUDA device: prints "skipped: no CUDA device", exit 0)
#   bash scripts/gpu_check.sh --dry-run    without CUDA, everything that needs none (CI runs it via pytest)
#   bash scripts/gpu_check.sh --kill-run ID   stop what a killed run (ID printed at its start) left behind
#
# Set-up, once, on the GPU machine: `bash scripts/setup.sh` (its GPU recipe: pip install -e ".[test]" into
# .venv, i.e. SGLang 0.5.23 with its CUDA stack, flashinfer-python, pytest).  This script uses
# $PYTHON, else $SGLANG_SSD_VENV/bin/python (default .venv), else python3; a missing package stops it
# with a message naming that command.
#
# Steps (budgets in scripts/gpu_plan.py, each enforced with `timeout`; the dry run prints the table):
#   1 preflight  packages, CUDA devices, nvcc / flashinfer-jit-cache / flashinfer-cubin (gpu_env.py)
#   2 synth      synthetic Llama target + equal / noisy drafts (make_synthetic_pair.py, on CPU)
#   3 plan       every server's command line parsed by SGLang's own parser + saguaro's validation
#   4 warm       the draft's FlashInfer kernels JIT-compiled once, as a served draft does (gpu_warm.py)
#   5 tests      the GPU tests (FlashInfer vs SDPA, CUDA-graph replay vs eager, verify input)
#   6 bench      AR / SD / SSD servers and the flashinfer / triton SSD cells (gpu_bench.py)
# -> results/gpu_check.{json,md} (+ gpu_check_env.json, gpu_check_pytest.txt, one log per server).
# With one GPU the draft shares it with the target and the results say so (SSD is a lower bound).
# Environment: GPU_CHECK_OUT (default results), GPU_CHECK_PAIR (keep the synthetic pair there; default
# a temporary dir, removed), GPU_CHECK_SERVER_ARGS (extra flags for every server, e.g. --disable-cuda-graph).
# Every process of a run carries SGLANG_SSD_GPU_CHECK_RUN=<run id>; on exit, error, timeout, Ctrl-C
# or SIGTERM the script stops the running step and then any process group still carrying the tag
# (SGLang servers run in their own sessions, and their drafts in the servers' process groups).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=run
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --kill-run) MODE=kill; KILL_ID=${2:-} ;;
  -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
  *) echo "gpu_check: unknown option '$1' (options: --dry-run, --kill-run ID, --help)"; exit 2 ;;
esac

RUN_ENV=SGLANG_SSD_GPU_CHECK_RUN
pgid_of() {  # from /proc/PID/stat: "pid (comm) state ppid pgrp ..."
  local s
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  s=${s##*) }
  set -- $s
  echo "$3"
}
MY_PGID=$(pgid_of $$)
[ -n "$MY_PGID" ] || { echo "gpu_check: FAILED: cannot read this script's process group from /proc"; exit 2; }
tagged_pgids() {  # process groups (other than this script's) of the live processes tagged with run id $1
  local f pg
  grep -lsxzF "$RUN_ENV=$1" /proc/[0-9]*/environ | while read -r f; do
    f=${f#/proc/}
    pg=$(pgid_of "${f%/environ}")
    [ -n "$pg" ] && [ "$pg" != "$MY_PGID" ] && echo "$pg"
  done | sort -u
}
kill_run() {  # SIGTERM the tagged process groups, SIGKILL what is left after 10 s
  local pgs pg
  pgs=$(tagged_pgids "$1")
  [ -z "$pgs" ] && return 0
  echo "[gpu_check] stopping leftover process group(s) of run $1:" $pgs
  for pg in $pgs; do kill -TERM -- "-$pg" 2>/dev/null; done
  for _ in $(seq 20); do [ -z "$(tagged_pgids "$1")" ] && return 0; sleep 0.5; done
  for pg in $(tagged_pgids "$1"); do kill -KILL -- "-$pg" 2>/dev/null; done
}
if [ "$MODE" = kill ]; then
  [ -n "$KILL_ID" ] || { echo "gpu_check: --kill-run needs the run id that run printed at its start"; exit 2; }
  kill_run "$KILL_ID"
  left=$(tagged_pgids "$KILL_ID")
  [ -z "$left" ] || { echo "gpu_check: FAILED: process group(s) still running:" $left; exit 1; }
  echo "[gpu_check] run $KILL_ID: nothing left running"
  exit 0
fi

if [ "$MODE" = run ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: skipped: no CUDA device (nvidia-smi finds no GPU)"
    exit 0
  fi
fi
VENV=${SGLANG_SSD_VENV:-.venv}
PY=${PYTHON:-$VENV/bin/python}
[ -x "$PY" ] || PY=python3
if [ "$MODE" = run ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False for $PY)"
  exit 0
fi
budgets=$("$PY" scripts/gpu_plan.py budgets) || { echo "gpu_check: FAILED: scripts/gpu_plan.py budgets ($PY)"; exit 2; }
eval "$budgets"  # PREFLIGHT_S SYNTH_S PLAN_S WARM_S TESTS_S BENCH_S TOTAL_S

RUN_ID="$(date +%Y%m%d-%H%M%S)-$$"
export "$RUN_ENV=$RUN_ID"
STEP_PID= CLEANED= PAIR_TMP=
cleanup() {
  [ -n "$CLEANED" ] && return
  CLEANED=1
  if [ -n "$STEP_PID" ] && kill -0 "$STEP_PID" 2>/dev/null; then
    kill -TERM "$STEP_PID" 2>/dev/null  # timeout passes it on; gpu_bench then stops its server
    for _ in $(seq 90); do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 0.5; done
  fi
  kill_run "$RUN_ID"
  [ -n "$PAIR_TMP" ] && rm -rf "$PAIR_TMP"
}
trap cleanup EXIT
trap 'echo "[gpu_check] interrupted: stopping"; cleanup; exit 130' INT
trap 'echo "[gpu_check] terminated: stopping"; cleanup; exit 143' TERM
run_step() {  # run_step SECONDS CMD...: `timeout` in the background, so a signal here is handled at once
  local secs=$1 rc
  shift
  timeout -k 20 "$secs" "$@" &
  STEP_PID=$!
  wait "$STEP_PID"
  rc=$?
  STEP_PID=
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "[gpu_check] step over its ${secs}s budget: $*"
  return "$rc"
}
secs_since() { echo $(( $(date +%s) - $1 )); }

start=$(date +%s)
OUT=${GPU_CHECK_OUT:-results}
if [ -n "${GPU_CHECK_PAIR:-}" ]; then PAIR=$GPU_CHECK_PAIR; else PAIR_TMP=$(mktemp -d /tmp/sglang-ssd-pair-XXXX); PAIR=$PAIR_TMP; fi
SERVER_ARGS=${GPU_CHECK_SERVER_ARGS:-}  # extra flags for every server, e.g. --disable-cuda-graph
GPU_TESTS="tests/test_flashinfer_gpu.py tests/test_flashinfer_plan.py tests/test_gpu_verify_input.py"
echo "[gpu_check] run $RUN_ID ($MODE), python $PY; stop leftovers with: bash scripts/gpu_check.sh --kill-run $RUN_ID"

if [ "$MODE" = dry ]; then
  echo "[gpu_check] dry run: no CUDA used; package and toolchain findings are reported, not fatal"
  X=4  # timeouts here: the H200 budgets x $X (this may be a slow, shared CPU machine; no GPU step runs)
  t=$(date +%s); run_step $(( PREFLIGHT_S * X )) "$PY" scripts/gpu_env.py
  echo "[gpu_check] 1/4 preflight: rc=$? in $(secs_since "$t")s (budget ${PREFLIGHT_S}s)"
  t=$(date +%s); run_step $(( SYNTH_S * X )) "$PY" scripts/make_synthetic_pair.py "$PAIR"
  synth_rc=$?
  echo "[gpu_check] 2/4 synth -> $PAIR: rc=$synth_rc in $(secs_since "$t")s (budget ${SYNTH_S}s)"
  [ "$synth_rc" -eq 0 ] || { echo "gpu_check: FAILED: make_synthetic_pair (rc $synth_rc)"; exit 1; }
  t=$(date +%s); run_step $(( PLAN_S * X )) "$PY" scripts/gpu_plan.py check "$PAIR" --out "$OUT" \
    --server-args="$SERVER_ARGS"
  plan_rc=$?
  echo "[gpu_check] 3/4 plan: rc=$plan_rc in $(secs_since "$t")s (budget ${PLAN_S}s)"
  [ "$plan_rc" -eq 0 ] || { echo "gpu_check: FAILED: a planned server command line is rejected (see above)"; exit 1; }
  t=$(date +%s); run_step $(( WARM_S * X )) "$PY" scripts/gpu_warm.py "$PAIR" --device cpu >"$PAIR/warm.txt" 2>&1
  warm_rc=$?
  grep "\[gpu_warm\]" "$PAIR/warm.txt" || tail -20 "$PAIR/warm.txt"
  echo "[gpu_check] warm-up script on the CPU (SDPA; the real run compiles FlashInfer): rc=$warm_rc in $(secs_since "$t")s"
  [ "$warm_rc" -eq 0 ] || { echo "gpu_check: FAILED: scripts/gpu_warm.py (rc $warm_rc)"; exit 1; }
  t=$(date +%s); run_step $(( PLAN_S * X )) "$PY" -m pytest --collect-only -q -p no:cacheprovider $GPU_TESTS \
    >"$PAIR/collect.txt" 2>&1
  collect_rc=$?
  [ "$collect_rc" -eq 0 ] && grep -E "collected|deselected|skipped" "$PAIR/collect.txt" | tail -1 || tail -30 "$PAIR/collect.txt"
  echo "[gpu_check] 4/4 GPU tests collect: rc=$collect_rc in $(secs_since "$t")s (real run budget ${TESTS_S}s)"
  echo "[gpu_check] dry run done in $(secs_since "$start")s: plan rc=$plan_rc, collect rc=$collect_rc"
  [ "$collect_rc" -eq 0 ]
  exit $?
fi

mkdir -p "$OUT"
echo "[gpu_check] $(nvidia-smi -L | head -4 | tr '\n' ';')"
echo "[gpu_check] 1/6 preflight (budget ${PREFLIGHT_S}s)"
run_step "$PREFLIGHT_S" "$PY" scripts/gpu_env.py --require --out "$OUT/gpu_check_env.json"
rc=$?
[ "$rc" -eq 0 ] || { echo "gpu_check: FAILED: preflight (rc $rc; see above)"; exit 2; }
echo "[gpu_check] 2/6 synthetic pair -> $PAIR (budget ${SYNTH_S}s)"
run_step "$SYNTH_S" "$PY" scripts/make_synthetic_pair.py "$PAIR" || { echo "gpu_check: FAILED: make_synthetic_pair"; exit 1; }
n_gpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
echo "[gpu_check] 3/6 server command lines (budget ${PLAN_S}s)"
run_step "$PLAN_S" "$PY" scripts/gpu_plan.py check "$PAIR" --n-gpu "$n_gpu" --out "$OUT" --server-args="$SERVER_ARGS" \
  || { echo "gpu_check: FAILED: a planned server command line is rejected (see above)"; exit 1; }

echo "[gpu_check] 4/6 draft FlashInfer warm-up / JIT compile (budget ${WARM_S}s)"
run_step "$WARM_S" "$PY" scripts/gpu_warm.py "$PAIR" --out "$OUT/gpu_check_warm.json" \
  || echo "[gpu_check] warm-up failed or over budget: the first FlashInfer use will compile (see above)"

echo "[gpu_check] 5/6 GPU tests (budget ${TESTS_S}s)"
run_step "$TESTS_S" "$PY" -m pytest -q -rs -p no:cacheprovider $GPU_TESTS >"$OUT/gpu_check_pytest.txt" 2>&1
test_rc=$?
tail -25 "$OUT/gpu_check_pytest.txt"
summary=$(tail -1 "$OUT/gpu_check_pytest.txt")

echo "[gpu_check] 6/6 AR / SD / SSD servers (budget ${BENCH_S}s)"
run_step "$BENCH_S" "$PY" scripts/gpu_bench.py "$PAIR" --out "$OUT" --env-json "$OUT/gpu_check_env.json" \
  --server-args="$SERVER_ARGS" \
  --pytest-rc "$test_rc" --pytest-summary "$summary"
bench_rc=$?
echo "[gpu_check] done in $(secs_since "$start")s (limit ${TOTAL_S}s): tests rc=$test_rc, bench rc=$bench_rc; see $OUT/gpu_check.md"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
