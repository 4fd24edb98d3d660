"""`python -m sglang_ssd.launch_cpu` on huge pages: the pure decision (`huge_page_env`) and, on a real saguaro
server of a tiny synthetic pair, that the launcher, its scheduler and the draft it spawns all run with
glibc's hugetlb tunable and (where the kernel's THP mode is madvise) hold anonymous memory on huge pages, and
that `SGLANG_SSD_HUGEPAGES=0` turns it off."""

from __future__ import annotations

import json
import uuid

import pytest

from sglang_ssd.launch_cpu import _glibc_version, _thp_mode, cpu_args, huge_page_env
from sglang_ssd.serving import SGLangServer


def test_huge_page_env_decision():
    base = {"PATH": "/bin"}
    env = huge_page_env(base, "madvise", (2, 36))
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == "/bin"
    assert "GLIBC_TUNABLES" not in base  # the caller's dict is not changed
    kept = huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36))
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert huge_page_env(base, "always", (2, 36)) is None      # the kernel gives them without asking
    assert huge_page_env(base, "never", (2, 36)) is None
    assert huge_page_env(base, "", (2, 36)) is None            # no THP setting readable
    assert huge_page_env(base, "madvise", (2, 34)) is None     # glibc without the tunable
    assert huge_page_env({"SGLANG_SSD_HUGEPAGES": "0"}, "madvise", (2, 36)) is None
    # the caller's own choice wins, also an explicit 0; and the re-executed launcher does not loop
    assert huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36)) is None
    assert huge_page_env(env, "madvise", (2, 36)) is None


def test_cpu_args_keep_callers_flags():
    out = cpu_args(["--device=cpu", "--max-total-tokens", "4096"])
    assert out.count("--max-total-tokens") == 1 and "--device" not in out
    assert "--attention-backend" in out and "--disable-cuda-graph" in out


@pytest.mark.server
@pytest.mark.parametrize("opt_out", [False, True], ids=["default", "opted_out"])
def test_server_processes_on_huge_pages(synthetic_pair, tmp_path, opt_out):
    if _glibc_version() < (2, 35):
        pytest.skip("glibc < 2.35 has no glibc.malloc.hugetlb")
    cfg = {"draft_endpoint": f"ipc://{tmp_path}/d-{uuid.uuid4().hex[:6]}.sock", "round_deadline_s": 10.0}
    env = {"SGLANG_SSD_CONFIG": json.dumps(cfg), "SGLANG_SSD_HUGEPAGES": "0" if opt_out else "1"}
    env["GLIBC_TUNABLES"] = ""  # whatever the test runner has, the launcher decides
    args = ["--dtype", "float32", "--speculative-algorithm", "saguaro", "--speculative-draft-model-path",
            f"{synthetic_pair}/draft_noisy", "--speculative-num-steps", "2", "--context-length", "256"]
    with SGLangServer(f"{synthetic_pair}/target", args, env=env, log_path=str(tmp_path / "server.log")) as srv:
        out = srv.generate(input_ids=[1, 2, 3, 4], sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert len(out["output_ids"]) == 8
        procs = srv.huge_pages()
    drafts = [p for p in procs.values() if "sglang_ssd.draft" in p["cmd"]]
    assert len(procs) >= 3 and len(drafts) == 1, procs  # launcher, scheduler(s), draft
    want_on = not opt_out and _thp_mode() == "madvise"
    for p in procs.values():
        assert ("glibc.malloc.hugetlb=1" in p["tunables"]) == want_on, procs
    if want_on:  # the scheduler (model weights, KV pool) and the draft hold huge pages
        assert max(p["anon_huge_kb"] for p in procs.values()) > 0 and drafts[0]["anon_huge_kb"] > 0, procs
