"""The draft-side GPU check without CUDA: scripts/gpu_draft_check.sh skips cleanly, and
scripts/gpu_draft_bench.py (which reuses scripts/profile_draft.py's profile) runs end to end on the CPU
and writes its report, so neither script rots between the rare runs on a lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_draft_check_skips_without_cuda(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", "scripts/gpu_draft_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA device" in proc.stdout


def test_draft_bench_runs_on_cpu_and_reports(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_draft_bench.py", "--device", "cpu", "--batches", "1,2",
                           "--rounds", "3", "--reps", "1", "--ctx", "16", "--backends", "sdpa", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_draft_bench.json").read_text())
    assert [(r["batch"], r["temperature"]) for r in res["draft"]] == [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
    for r in res["draft"]:
        assert r["backend"] == "sdpa" and r["build_ms"] > 0 and len(r["tree_depth_ms"]) == res["k"]
        assert r["tree_tokens_per_depth"] == r["batch"] * (res["k"] + 1) * res["fan_out"]
    assert [r["batch"] for r in res["target"]] == [1, 2]
    assert all(r["decode_ms"] > 0 and r["chain4_ms"] > 0 for r in res["target"])
    assert "| sdpa (sdpa) | 2 | 1 |" in (tmp_path / "gpu_draft_bench.md").read_text()


def test_draft_bench_rejects_an_unknown_backend(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_draft_bench.py", "--device", "cpu", "--backends", "fa3",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown backend variant" in proc.stderr
