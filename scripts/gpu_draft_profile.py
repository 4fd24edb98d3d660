"""Where a draft round's host time goes on a GPU: torch.profiler over 6 all-miss SSD rounds (answer + the next
cache build) of the real DraftEngine (default draft shape, FlashInfer + CUDA graphs, b = 4, T = 1 and 0).
Prints the op table, sync / launch counts per round, and each runtime call (kernel launch, memcpy, stream sync,
graph launch) attributed to the innermost sglang_ssd function around it, from the exported trace.
Run from the repository root with FlashInfer importable; traces go to $OUT (default /tmp).
Result of the 2026-12-04 H200 run: results/gpu_draft/profile_b4.md."""
import os, sys, time, torch
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
from torch.profiler import profile as tprof, ProfilerActivity
from gpu_draft_bench import random_model
from profile_draft import all_miss_engine, miss_round
from sglang_ssd.draft.runner import DraftRunner
dev = "cuda:0"


def attribute(path, prof, rounds=6):
    """Export the trace, then count runtime calls per innermost sglang_ssd Python frame, and inclusive time."""
    import collections, json
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    py = [e for e in ev if e.get("cat") == "python_function" and "dur" in e and "sglang_ssd" in e["name"]]
    rt = [e for e in ev if e.get("cat") == "cuda_runtime" and e.get("name") in
          ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch")]
    name = lambda p: p["name"].split("sglang_ssd/")[-1]
    calls = collections.Counter()
    for e in rt:
        inner = [p for p in py if p["tid"] == e["tid"] and p["ts"] <= e["ts"] <= p["ts"] + p["dur"]]
        calls[(e["name"], name(min(inner, key=lambda p: p["dur"])) if inner else "?")] += 1
    for (n, o), k in calls.most_common(22):
        print(f"{k / rounds:7.1f}/round {n:22s} {o}")
    incl, cnt = collections.Counter(), collections.Counter()
    for p in py:
        incl[name(p)] += p["dur"]
        cnt[name(p)] += 1
    for n, d in incl.most_common(20):
        print(f"{d / rounds / 1e3:7.2f} ms/round inclusive {cnt[n] / rounds:5.1f}x {n}")
runner = DraftRunner(random_model("draft", dev, torch.bfloat16), dev, "flashinfer", True)
for b, temp in ((4, 1.0), (4, 0.0)):
    eng, rids, g = all_miss_engine(runner, b, 3, 4, temp, 1.0)
    def rnd(r):
        miss_round(eng, rids, g, r, temp)
        eng.build_cache()
    for r in range(4): rnd(r)
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as p:
        t = time.perf_counter()
        for r in range(4, 10): rnd(r)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 6 * 1e3
    print(f"=== b={b} T={temp}: {wall:.2f} ms per round (answer + build), 6 rounds", flush=True)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60), flush=True)
    ka = {e.key: e for e in p.key_averages()}
    for name in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense", "cudaGraphLaunch", "cudaLaunchKernel", "aten::nonzero"):
        if name in ka: print(f"{name}: {ka[name].count / 6:.1f} per round, {ka[name].cpu_time_total / 6 / 1e3:.2f} ms CPU per round")
    attribute(os.path.join(os.environ.get("OUT", "/tmp"), f"trace_b{b}_t{int(temp)}.json"), p)

