"""scripts/gpu_check.sh without CUDA: a quick, clear skip with exit status 0; and its --dry-run.

The dry run is how CI runs the GPU check's CUDA-free parts (scripts/test.sh runs pytest over tests/):
the preflight report, the synthetic pair, every planned server's command line through SGLang's own
parser and saguaro's validation (scripts/gpu_plan.py, the function gpu_bench.py starts its servers
from), collecting the GPU tests, and the budget table.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_plan  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu_check would run")


def _run(env: dict) -> subprocess.CompletedProcess:
    # the skip must come before any work (no synthetic pair, no results): the output dir stays absent
    return subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@no_cuda
def test_skips_without_nvidia_smi(tmp_path):
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", GPU_CHECK_OUT=str(tmp_path / "out"))
    proc = _run(env)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout
    assert not (tmp_path / "out").exists()


@no_cuda
def test_skips_when_torch_sees_no_cuda(tmp_path):
    fake = tmp_path / "nvidia-smi"  # a driver tool that claims a GPU, while torch (CPU build) has none
    fake.write_text("#!/bin/sh\necho 'GPU 0: Fake'\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", PYTHON=sys.executable,
               GPU_CHECK_OUT=str(tmp_path / "out"))
    proc = _run(env)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout and "torch.cuda.is_available() is False" in proc.stdout
    assert not (tmp_path / "out").exists()


def _dry_run(tmp_path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, GPU_CHECK_OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _pair_dir(stdout: str) -> str:
    (line,) = [ln for ln in stdout.splitlines() if "2/4 synth -> " in ln]
    return line.split("2/4 synth -> ")[1].split(":")[0]


def test_dry_run_parses_every_planned_server(tmp_path):
    proc = _dry_run(tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for e in gpu_plan.server_plan("PAIR"):
        assert re.search(rf"\[plan\] server {e['name']} +parsed OK$", out, re.M), f"{e['name']} not parsed OK:\n{out}"
        assert f"| server {e['name']} | {e['budget_s']} |" in out
    assert re.search(r"^\| total \| (\d+) \| limit 600", out, re.M)
    assert "[env] nvcc: " in out and "[env] => flashinfer kernels: " in out  # the toolchain report
    assert "2/4 synth -> " in out and " rc=0 " in out.split("2/4 synth -> ")[1].splitlines()[0]
    assert "4/4 GPU tests collect: rc=0" in out
    assert not os.path.exists(_pair_dir(out)), "the temporary synthetic pair was not removed"
    assert not (tmp_path / "out").exists(), "the dry run wrote results"


def test_dry_run_fails_when_a_server_command_line_is_rejected(tmp_path):
    proc = _dry_run(tmp_path, GPU_CHECK_SERVER_ARGS="--cuda-graph-max-bs 16")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    n = len(gpu_plan.server_plan("PAIR"))
    assert out.count("FAILED: argparse exit 2: sglang serve: error: ambiguous option: --cuda-graph-max-bs") == n, out
    assert f"{n} of {n} server command lines rejected" in out
    assert "gpu_check: FAILED: a planned server command line is rejected" in out
    assert "4/4" not in out  # stops at the first failing step


def _tagged(run_id: str, cmd_part: str = "") -> set[int]:
    """Live pids carrying this run's tag (and cmd_part in their command line, when given)."""
    tag = f"{gpu_plan.RUN_ENV}={run_id}".encode()
    pids = set()
    for d in os.listdir("/proc"):
        try:
            if (d.isdigit() and tag in open(f"/proc/{d}/environ", "rb").read().split(b"\0")
                    and cmd_part.encode() in open(f"/proc/{d}/cmdline", "rb").read()):
                pids.add(int(d))
        except OSError:
            pass
    return pids


def test_sigterm_stops_the_running_step_and_cleans_up(tmp_path):
    """gpu_check.sh's trap: a SIGTERM (an outer timeout) mid-step ends the step's processes at once and
    removes the temporary pair; it does not wait for the step to finish."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, GPU_CHECK_OUT=str(tmp_path / "out"))
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = [proc.stdout.readline()]
        run_id = re.search(r"run (\S+) \(dry\)", lines[0]).group(1)
        while "2/4 synth -> " not in lines[-1]:  # the plan step (SGLang's parser) starts next
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        pair = _pair_dir(lines[-1])
        deadline = time.monotonic() + 60  # the plan step's own python (not the synth step's last exits)
        while not _tagged(run_id, "gpu_plan.py") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _tagged(run_id, "gpu_plan.py"), "the plan step never started"
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=120)[0]
        assert proc.returncode == 143, out
        assert "[gpu_check] terminated: stopping" in out and "3/4 plan" not in out
        assert not _tagged(run_id)  # (a zombie reads as untagged: its environ is empty)
        assert not os.path.exists(pair)
    finally:
        proc.kill()
