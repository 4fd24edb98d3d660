"""Every server command line the GPU scripts build is accepted by SGLang 0.5.23's own parser (CPU only).

scripts/gpu_plan.server_plan is the one place gpu_bench.py gets its servers from; check_entry runs
what `python -m sglang.launch_server` runs before it touches a device (plugins, prepare_server_args,
saguaro's launch-time validation).  The negative controls show the check rejects what SGLang rejects.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_plan  # noqa: E402



@pytest.fixture(scope="module")
def loaded():
    gpu_plan.check_plan([])  # loads SGLang's plugins (saguaro) once, as launch_server does


def _entry(plan, name):
    return copy.deepcopy(next(e for e in plan if e["name"] == name))


@pytest.mark.parametrize("n_gpu", [1, 2])
def test_every_planned_server_parses(synthetic_pair, n_gpu):
    plan = gpu_plan.server_plan(synthetic_pair, k=4, n_gpu=n_gpu, out="results")
    results = gpu_plan.check_plan(plan)
    assert results == {e["name"]: None for e in plan}
    # the plan covers AR, SD and SSD (the noisy draft), SSD with the equal one (acceptance ~1), and SSD
    # on the two custom-mask backends
    cells = {(e["label"], e["draft"], e["backend"]) for e in plan}
    assert {("AR", None, None), ("SSD", "draft_equal", None),
            ("SD", "draft_noisy", None), ("SSD", "draft_noisy", None),
            ("SSD", "draft_noisy", "flashinfer"), ("SSD", "draft_noisy", "triton")} <= cells
    draft_dev = "cuda:0" if n_gpu == 1 else "cuda:1"
    for e in plan:
        assert "--cuda-graph-max-bs-decode" in e["args"]
        if e["draft"]:
            assert json.loads(e["env"][gpu_plan.CONFIG_ENV])["draft_device"] == draft_dev


def test_the_old_cuda_graph_flag_is_rejected(synthetic_pair, loaded):
    """Review finding 1: `--cuda-graph-max-bs 16` stops SGLang 0.5.23's argparse (exit 2)."""
    e = _entry(gpu_plan.server_plan(synthetic_pair), "AR")
    e["args"][e["args"].index("--cuda-graph-max-bs-decode")] = "--cuda-graph-max-bs"
    msg = gpu_plan.check_entry(e)
    assert msg is not None and "exit 2" in msg and "ambiguous option: --cuda-graph-max-bs" in msg


@pytest.mark.parametrize("bad, expect", [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                                         (["--attention-backend", "fa9"], "invalid choice: 'fa9'")])
def test_other_bad_flags_are_rejected(synthetic_pair, loaded, bad, expect):
    e = _entry(gpu_plan.server_plan(synthetic_pair), "SSD_noisy")
    e["args"] += bad
    msg = gpu_plan.check_entry(e)
    assert msg is not None and expect in msg


def test_saguaro_validation_runs(synthetic_pair, loaded):
    """A saguaro server whose config the plugin refuses at launch fails the check, naming the key / flag."""
    e = _entry(gpu_plan.server_plan(synthetic_pair), "SSD_equal")
    e["env"][gpu_plan.CONFIG_ENV] = json.dumps({"mode": "asink"})
    msg = gpu_plan.check_entry(e)
    assert msg is not None and "'mode'" in msg
    e = _entry(gpu_plan.server_plan(synthetic_pair), "SD_noisy")
    i = e["args"].index("--speculative-draft-model-path")
    e["args"][i + 1] = str(Path(synthetic_pair) / "no_such_draft")
    msg = gpu_plan.check_entry(e)
    assert msg is not None and "--speculative-draft-model-path" in msg and "not a directory" in msg


def test_extra_server_args_reach_every_server(synthetic_pair, loaded):
    plan = gpu_plan.server_plan(synthetic_pair, extra_args=["--disable-cuda-graph"])
    assert all(e["args"][-1] == "--disable-cuda-graph" for e in plan)
    assert gpu_plan.check_plan(plan) == {e["name"]: None for e in plan}


def test_budgets_fit_ten_minutes():
    plan = gpu_plan.server_plan("PAIR")
    total = sum(s for _, s, _ in gpu_plan.budget_rows(plan))
    assert total <= gpu_plan.TOTAL_S == 600
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_plan.py"), "budgets"], capture_output=True,
                         text=True, check=True).stdout.split()
    got = dict(kv.split("=") for kv in out)
    assert int(got["BENCH_S"]) == gpu_plan.bench_budget_s(plan)
    assert sum(int(got[f"{k.upper()}_S"]) for k in gpu_plan.STEP_S) + int(got["BENCH_S"]) == total
