#!/usr/bin/env bash
# Packs what scripts/gpu_draft_check.sh needs on a GPU machine that reaches no package registry and has
# torch but no FlashInfer: flashinfer-python 0.7.2 (SGLang 0.5.23's pin) trimmed to the sources its JIT
# compiles for the draft (batch prefill + packbits: the python package, data/csrc's top-level files,
# include/, spdlog/, cutlass/, cccl/; 457 MB unpacked -> ~12 MB xz) and apache-tvm-ffi's wheel for the
# GPU machine's Python.  Runs here, where pip reaches PyPI.
#
#   bash scripts/gpu_bundle.sh [DIR] [PYVER]    DIR default .gpu_bundle (git-ignored), PYVER default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_bundle}
PYVER=${2:-3.12}
mkdir -p "$DIR"
TMP=$(mktemp -d /tmp/gpu-bundle-XXXX)
trap 'rm -rf "$TMP"' EXIT
PLAT="--only-binary=:all: --python-version $PYVER --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps $PLAT -d "$DIR" apache-tvm-ffi==0.1.11
python3 -m pip download -q --no-deps --only-binary=:all: -d "$TMP" flashinfer-python==0.7.2
(cd "$TMP" && python3 -m zipfile -e flashinfer_python-*.whl x)
(cd "$TMP/x" && { find flashinfer -type f -name '*.py' ! -path 'flashinfer/data/*'
                  find flashinfer/data/csrc -maxdepth 1 -type f
                  find flashinfer/data/include flashinfer/data/spdlog flashinfer/data/cutlass/include \
                       flashinfer/data/cccl -type f; } | tar -cJf "$OLDPWD/$DIR/flashinfer-0.7.2-trimmed.txz" -T -)
ls -la "$DIR"
