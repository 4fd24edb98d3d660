"""scripts/gpu_check.sh on a machine without CUDA: a quick, clear skip with exit status 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check would run")


def _run(env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, time.monotonic() - t0


def test_skips_without_nvidia_smi(tmp_path):
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", GPU_CHECK_OUT=str(tmp_path / "out"))
    proc, took = _run(env)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout
    assert took < 10 and not (tmp_path / "out").exists()


def test_skips_when_torch_sees_no_cuda(tmp_path):
    fake = tmp_path / "nvidia-smi"  # a driver tool that claims a GPU, while torch (CPU build) has none
    fake.write_text("#!/bin/sh\necho 'GPU 0: Fake'\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", PYTHON=sys.executable,
               GPU_CHECK_OUT=str(tmp_path / "out"))
    proc, took = _run(env)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout and "torch.cuda.is_available() is False" in proc.stdout
    assert took < 30 and not (tmp_path / "out").exists()
