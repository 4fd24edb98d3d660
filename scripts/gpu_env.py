"""The GPU check's preflight: required packages, CUDA devices, and whether FlashInfer can get kernels.

flashinfer-python 0.7.2 (SGLang 0.5.23's pin) compiles its kernels at first use unless
flashinfer-jit-cache (or flashinfer-cubin, for the cubins) is installed; SGLang pulls neither.  The
compile needs nvcc, found the way flashinfer.jit.cpp_ext.get_cuda_path finds it: $CUDA_HOME /
$CUDA_PATH, else `nvcc` on PATH, else /usr/local/cuda.  Without nvcc and without the JIT cache the
GPU tests and every FlashInfer call (draft attention, the flashinfer target backend) fail.

  python scripts/gpu_env.py [--out FILE.json] [--require]

Prints one line per item; --require exits 2 naming the set-up command when a package is missing.
A toolchain without nvcc or JIT cache is reported (WARNING), never fatal: what still runs is worth
measuring, and the results record why the rest failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

SETUP_CMD = "bash scripts/setup.sh"  # on a GPU machine: the GPU recipe, pip install -e ".[test]" into .venv
REQUIRED = {"torch": None, "sglang": "0.5.23", "flashinfer-python": None, "safetensors": None,
            "pytest": None, "requests": None}
JIT_PACKAGES = ("flashinfer-jit-cache", "flashinfer-cubin", "nvidia-cuda-nvcc")


def _version(dist: str) -> str | None:
    try:  # by distribution, not import name: the CPU recipe's import stand-ins have no metadata
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def find_nvcc() -> dict:
    """The CUDA toolkit as flashinfer 0.7.2 picks it (jit/cpp_ext.py get_cuda_path: no symlink or
    wrapper resolution), the nvcc and headers it will use from there, and nvcc's release."""
    home, source = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), "CUDA_HOME/CUDA_PATH"
    if home is None and shutil.which("nvcc"):
        home, source = os.path.dirname(os.path.dirname(shutil.which("nvcc"))), "nvcc on PATH"
    if home is None and os.path.exists("/usr/local/cuda"):
        home, source = "/usr/local/cuda", "default /usr/local/cuda"
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    info = {"cuda_home": home, "source": source if home else None, "nvcc": None, "release": None,
            "headers": bool(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))}
    if nvcc and os.access(nvcc, os.X_OK):
        info["nvcc"] = nvcc
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
            m = re.search(r"release (\d+\.\d+)", out)
            info["release"] = m.group(1) if m else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def kernels_status(jit_cache: bool, nvcc: dict) -> str:
    if jit_cache:
        return "prebuilt (flashinfer-jit-cache)"
    if nvcc["nvcc"] and nvcc["headers"]:
        return f"JIT with {nvcc['nvcc']} (the first use of each kernel compiles; may take minutes)"
    if nvcc["nvcc"]:  # nvcc adds its own include/lib dirs, but flashinfer also passes -I/-L under this home
        return (f"JIT with {nvcc['nvcc']}, but its CUDA home {nvcc['cuda_home']} ({nvcc['source']}) has no "
                "include/cuda_runtime.h: if the compile or link fails, set CUDA_HOME to the toolkit root")
    return "NONE: no nvcc (CUDA_HOME/CUDA_PATH unset, none on PATH, no /usr/local/cuda) and no flashinfer-jit-cache"


def flashinfer_cache() -> dict:
    base = pathlib.Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", pathlib.Path.home()))
    cache = base / ".cache" / "flashinfer"
    return {"dir": str(cache), "compiled_modules": len(list(cache.rglob("*.so"))) if cache.is_dir() else 0}


def cuda_devices() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch_cuda": None, "available": False, "devices": []}
    ok = torch.cuda.is_available()
    return {"torch_cuda": torch.version.cuda, "available": ok,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}


def report() -> dict:
    pkgs = {d: _version(d) for d in (*REQUIRED, *JIT_PACKAGES)}
    missing = [d for d, want in REQUIRED.items() if pkgs[d] is None]
    wrong = [f"{d}=={pkgs[d]} (need {want})" for d, want in REQUIRED.items() if want and pkgs[d] not in (None, want)]
    nvcc = find_nvcc()
    jit_cache = pkgs["flashinfer-jit-cache"] is not None
    rep = {"python": sys.executable, "packages": pkgs, "missing": missing, "wrong_version": wrong,
           "nvcc": nvcc, "flashinfer_cache": flashinfer_cache(), "cuda": cuda_devices(),
           "flashinfer_kernels": kernels_status(jit_cache, nvcc)}
    return rep


def lines(rep: dict) -> list[str]:
    pk, nv = rep["packages"], rep["nvcc"]
    out = [f"python: {rep['python']}",
           "packages: " + ", ".join(f"{d} {pk[d] or 'MISSING'}" for d in REQUIRED),
           "flashinfer kernels: " + ", ".join(f"{d} {pk[d] or 'no'}" for d in JIT_PACKAGES),
           f"nvcc: {nv['nvcc'] or 'not found'}" + (f" (release {nv['release']}; CUDA home {nv['cuda_home']} via "
                                                    f"{nv['source']}, headers {'yes' if nv['headers'] else 'NO'})"
                                                    if nv["nvcc"] else ""),
           f"flashinfer JIT cache: {rep['flashinfer_cache']['dir']} ({rep['flashinfer_cache']['compiled_modules']} "
           "compiled modules)",
           f"=> flashinfer kernels: {rep['flashinfer_kernels']}",
           f"cuda: torch {rep['cuda']['torch_cuda'] or 'without CUDA'}, devices {rep['cuda']['devices'] or 'none'}"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the report as JSON here")
    ap.add_argument("--require", action="store_true", help="exit 2 when a required package is missing")
    args = ap.parse_args(argv)
    rep = report()
    for ln in lines(rep):
        print(f"[env] {ln}")
    if rep["flashinfer_kernels"].startswith("NONE"):
        print("[env] WARNING: FlashInfer has no kernels here: install flashinfer-jit-cache==0.7.2 for your CUDA, or "
              "a CUDA toolkit (set CUDA_HOME to its root); until then the GPU tests and the FlashInfer paths fail")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rep, fh, indent=1)
    bad = rep["missing"] + rep["wrong_version"]
    if bad:
        print(f"[env] {'FAILED' if args.require else 'would fail'}: missing or wrong packages: {', '.join(bad)} "
              f"-- run `{SETUP_CMD}` on this GPU machine (its GPU recipe: pip install -e \".[test]\" into .venv), "
              "then run gpu_check again")
        return 2 if args.require else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
