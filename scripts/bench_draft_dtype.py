#!/usr/bin/env python
"""The draft's forward in float32 vs bfloat16 on one CPU core, and the target's forward beside it (interference).

    taskset -c 1 python scripts/bench_draft_dtype.py draft f32|bf16|bf16p ROWS SECONDS   # draft forwards in a loop
                                                          # (bf16p: linears on oneDNN-packed weights, cpu_linear)
    taskset -c 0 python scripts/bench_draft_dtype.py target [TOKENS]              # target forward, median ms
Run the target alone, then with a draft loop on the other core (results/draft_cpu_dtype.md).
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.model import load_model  # noqa: E402

torch.set_num_threads(1)
role = sys.argv[1]
if role == "target":
    m = load_model(paths.target_path(), dtype=torch.float32).eval()
    x = torch.randint(0, 49000, (1, int(sys.argv[2]) if len(sys.argv) > 2 else 4))
    ts = []
    with torch.no_grad():
        for i in range(60):
            t = time.perf_counter(); h = m.forward_padded(x); m.logits(h[:, -1]); ts.append(time.perf_counter() - t)
    ts = ts[10:]
    print(f"target fwd ms median {statistics.median(ts)*1e3:.2f} p10 {sorted(ts)[len(ts)//10]*1e3:.2f}", flush=True)
else:
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "bf16p": torch.bfloat16}[sys.argv[2]]
    rows = int(sys.argv[3])
    m = load_model(paths.draft_path(), dtype=dt).eval()
    if sys.argv[2] == "bf16p":
        import os
        from sglang_ssd.draft.cpu_linear import ENV, route_linears
        os.environ[ENV] = "packed"
        route_linears(m, dt)
    x = torch.randint(0, 8000, (rows, 4))
    n = 0; t0 = time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - t0 < float(sys.argv[4]):
            h = m.forward_padded(x); m.logits(h[:, -1]); n += 1
    print(f"draft {sys.argv[2]} rows {rows}: {n} fwd, {(time.perf_counter()-t0)/n*1e3:.2f} ms each", flush=True)
