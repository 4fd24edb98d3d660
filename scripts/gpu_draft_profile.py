"""Where a draft round's host time goes on a GPU: torch.profiler over 6 all-miss SSD rounds (answer + the next
cache build) of the real DraftEngine (default draft shape, FlashInfer + CUDA graphs, b = 4, T = 1 and 0).
Prints the op table, sync / launch counts per round, and each runtime call (kernel launch, memcpy, stream sync,
graph launch) attributed to the innermost sglang_ssd function around it, from the exported trace.
Run from the repository root with FlashInfer importable; traces go to $OUT (default /tmp).
Result of the 2026-12-04 H200 run: results/gpu_draft/profile_b4.md."""
import os, sys, time, logging, torch
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
from torch.profiler import profile as tprof, ProfilerActivity
from gpu_draft_bench import random_model
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate
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
    eng = DraftEngine(runner, seed=0, max_batch=256)
    k, fan = 3, 4
    eng.hello(Hello(PROTOCOL_VERSION, "p", k, "async", [fan] * (k + 1), runner.vocab_size, [], [fan] * (k + 1), "neural", False))
    g = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(b)]
    eng.prefill(Prefill(rids, [torch.randint(0, 8000, (48,), generator=g).tolist() for _ in rids], [temp] * b, [1.0] * b))
    ks = [-1] * b
    def rnd(r):
        eng.speculate(Speculate(r + 1, rids, ks, torch.randint(0, 8000, (b,), generator=g).tolist(), [temp] * b))
        eng.build_cache()
    for r in range(4): rnd(r); ks = [0] * b
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
    rows = [e for e in p.key_averages(group_by_stack_n=6) if e.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "aten::nonzero", "aten::to", "aten::copy_")]
    rows.sort(key=lambda e: -e.cpu_time_total)
    for e in rows[:25]:
        st = [f for f in e.stack if "sglang_ssd" in f or "scripts" in f][:4]
        print(f"{e.key} x{e.count / 6:.1f}/round {e.cpu_time_total / 6 / 1e3:.3f} ms/round :: " + " <- ".join(st))

