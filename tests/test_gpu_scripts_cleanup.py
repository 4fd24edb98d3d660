"""A killed GPU check leaves no server behind (review finding 6), on CPU with real processes.

SGLang servers start in their own sessions (sglang_ssd/serving.py), so killing gpu_bench alone
orphans them.  gpu_bench turns SIGTERM into SystemExit and stops the server it is measuring;
gpu_check.sh stops whatever still carries the run's tag (SGLANG_SSD_GPU_CHECK_RUN) on exit.  The
servers here are real `sglang_ssd.launch_cpu` processes of a tiny synthetic pair, signalled while
they start up (the moment a GPU run's timeout is most likely to hit).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_plan  # noqa: E402



def tagged(run_id: str) -> set[int]:
    """Live processes whose environment carries this run's tag."""
    tag = f"{gpu_plan.RUN_ENV}={run_id}".encode()
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag in (d / "environ").read_bytes().split(b"\0"):
                pids.add(int(d.name))
        except OSError:
            pass
    return pids


def leaders(pids: set[int]) -> set[int]:
    """The process group leaders among pids (gone ones dropped)."""
    out = set()
    for p in pids:
        try:
            if os.getpgid(p) == p:
                out.add(p)
        except ProcessLookupError:
            pass
    return out


def wait_until(cond, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {limit_s}s: {what}")


def bench_cmd(synthetic_pair: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), synthetic_pair, "--out", str(out), "--only", "AR", *extra]


def bench_env(run_id: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), **{gpu_plan.RUN_ENV: run_id})


def start_bench(synthetic_pair: str, out: Path, run_id: str) -> tuple[subprocess.Popen, int]:
    """gpu_bench on the AR server; returns once that server process exists (it is then importing SGLang)."""
    bench = subprocess.Popen(bench_cmd(synthetic_pair, out), cwd=ROOT, env=bench_env(run_id), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        # the server is the leader of its own session (SGLangServer: start_new_session); a child caught
        # between fork and setsid carries the tag but is no leader yet, so wait for the leader itself
        servers = wait_until(lambda: bench.poll() is None and leaders(tagged(run_id) - {bench.pid})
                             or bench.poll() is not None, 120, "gpu_bench to start its server")
        assert bench.poll() is None, f"gpu_bench exited early ({bench.returncode}): {bench.communicate()[0]}"
        (server,) = servers
        return bench, server
    except BaseException:
        bench.kill()
        raise


def stop_leftovers(run_id: str) -> None:
    for pid in tagged(run_id):  # only processes this test started (they carry its fresh run id)
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_stops_the_server(synthetic_pair, tmp_path):
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    bench, server = start_bench(synthetic_pair, tmp_path / "out", run_id)
    try:
        os.kill(server, 0)  # alive when the signal comes: what follows is gpu_bench's doing
        bench.send_signal(signal.SIGTERM)
        out = bench.communicate(timeout=90)[0]
        assert bench.returncode == 128 + signal.SIGTERM, out
        assert "SIGTERM: stopping the servers" in out
        rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
        assert [(r["name"], r["b"]) for r in rows] == [("AR", 1), ("AR", 4), ("AR", 16)]
        assert all(r["error"].startswith("not measured: gpu_bench was stopped") for r in rows)
        wait_until(lambda: not tagged(run_id), 30, f"the server group of run {run_id} to be gone")
    finally:
        bench.kill()
        stop_leftovers(run_id)


def test_sigkill_orphans_the_server_and_kill_run_stops_it(synthetic_pair, tmp_path):
    """The negative control (no handler can run on SIGKILL: the server survives its parent) and the
    script's cleanup of what a killed run left behind."""
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    bench, server = start_bench(synthetic_pair, tmp_path / "out", run_id)
    try:
        bench.kill()
        bench.wait(30)
        os.kill(server, 0)  # still alive: orphaned, holding what it holds (on a GPU: the GPU)
        # its /proc environ reads empty for a moment while it execs: poll for the tag
        wait_until(lambda: server in tagged(run_id), 10, f"server {server} to carry run {run_id}'s tag")
        proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--kill-run", run_id], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"stopping leftover process group(s) of run {run_id}: {server}" in proc.stdout
        assert f"run {run_id}: nothing left running" in proc.stdout
        assert not tagged(run_id)
    finally:
        stop_leftovers(run_id)


def test_a_server_over_its_budget_is_stopped_and_recorded(synthetic_pair, tmp_path):
    """The per-server budget: a server still starting when its time is up is stopped, its cells say so,
    and gpu_bench goes on (here: to the end, exit 1 as a cell failed)."""
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    try:
        proc = subprocess.run(bench_cmd(synthetic_pair, tmp_path / "out", "--server-budget-s", "2"), cwd=ROOT,
                              env=bench_env(run_id), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "AR: over its 2 s budget, stopped" in proc.stderr
        rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
        assert [(r["name"], r["b"], r["error"]) for r in rows] == [("AR", b, "over its 2 s budget") for b in (1, 4, 16)]
        assert not tagged(run_id)
    finally:
        stop_leftovers(run_id)
