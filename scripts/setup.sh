#!/usr/bin/env bash
# Creates the virtual environment with the right recipe for this machine; idempotent.
#   GPU machine (nvidia-smi finds a GPU): plain install, SGLang with its CUDA stack.
#   CPU machine: the light recipe of shared/notes/sglang-on-cpu.md ("Recipe A"): the local CPU
#   torch wheel, SGLang's runtime deps without its GPU kernels, SGLang itself with --no-deps, and
#   our import stand-ins (sglang_ssd/cpu/stubs) put on sys.path by a .pth file in this venv only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_SSD_VENV:-.venv}
PY=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then KIND=gpu; else KIND=cpu; fi
STAMP="$KIND $(cat pyproject.toml scripts/requirements-cpu.txt scripts/constraints-cpu.txt | sha256sum | cut -c1-16)"
if [ -f "$VENV/.sglang-ssd-setup" ] && [ "$(cat "$VENV/.sglang-ssd-setup")" = "$STAMP" ]; then
  exit 0
fi

start=$(date +%s)
echo "[setup] installing into $VENV ($KIND recipe)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/setup.log"
: > "$LOG"
pip_install() {  # quiet unless it fails; the full log stays in $LOG
  "$VENV/bin/python" -m pip install -q "$@" >>"$LOG" 2>&1 || { tail -40 "$LOG"; echo "[setup] pip install $* failed (log: $LOG)"; exit 1; }
}
pip_install -U pip
if [ "$KIND" = gpu ]; then
  pip_install -e ".[test]"
else
  pip_install -c scripts/constraints-cpu.txt -r scripts/requirements-cpu.txt
  pip_install --no-deps sglang==0.5.23 xgrammar==0.2.7
  pip_install --no-deps --no-build-isolation -e .
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$(pwd)/sglang_ssd/cpu/stubs" > "$site/sglang_ssd_cpu_stubs.pth"
fi
echo "$STAMP" > "$VENV/.sglang-ssd-setup"
echo "[setup] done in $(( $(date +%s) - start ))s; venv size $(du -sh "$VENV" | cut -f1)"
