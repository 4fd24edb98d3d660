"""Diagnostic run on the lent H200 (results/gpu_draft/probe.log): SDPA time per call with a new KV length
every call (cuDNN on / off), and device memory per draft CUDA-graph capture (a new side stream per capture vs
one).  Run from the repository root with FlashInfer importable: python scripts/gpu_draft_probe.py"""
import os, sys, time, json, logging, torch
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
dev = "cuda:0"
out = {}
# 1. SDPA: a new kv length every call, as a growing cache gives
def sdpa_times(backends, L0, n=12, b=1, q=1):
    ts = []
    for i in range(n):
        L = L0 + i
        qq = torch.randn(b, 9, q, 64, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, 3, L, 64, device=dev, dtype=torch.bfloat16)
        m = torch.ones(b, 1, q, L, dtype=torch.bool, device=dev)
        torch.cuda.synchronize(); t = time.perf_counter()
        if backends is None:
            F.scaled_dot_product_attention(qq, k, k, attn_mask=m, enable_gqa=True)
        else:
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(qq, k, k, attn_mask=m, enable_gqa=True)
        torch.cuda.synchronize(); ts.append(round((time.perf_counter() - t) * 1e3, 3))
    return ts
out["cudnn_sdp_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
out["sdpa_default"] = sdpa_times(None, 500)
out["sdpa_default_repeat_shapes"] = sdpa_times(None, 500)
out["sdpa_no_cudnn"] = sdpa_times([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], 600)
out["sdpa_no_cudnn_b4q16"] = sdpa_times([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], 700, b=4, q=16)
out["sdpa_default_b4q16"] = sdpa_times(None, 800, b=4, q=16)
try:
    out["sdpa_efficient_only"] = sdpa_times([SDPBackend.EFFICIENT_ATTENTION], 900)
except Exception as e:
    out["sdpa_efficient_only"] = repr(e)[:300]
print(json.dumps(out), flush=True)
# 2. graph memory per capture
from gpu_draft_bench import random_model
from sglang_ssd.draft.runner import DraftRunner
import sglang_ssd.draft.cuda_graphs as cg
r = DraftRunner(random_model("draft", dev, torch.bfloat16), dev, "flashinfer", False)
def mem(): torch.cuda.synchronize(); return torch.cuda.memory_reserved(dev) / 2**20, torch.cuda.memory_allocated(dev) / 2**20
orig_init, orig_cap = cg._Graph.__init__, cg.GraphRunner._capture
log = []
def init(self, nb, tb, runner):
    a = mem(); orig_init(self, nb, tb, runner); b = mem(); log.append(("wrapper", nb, tb, round(b[0]-a[0],1), round(b[1]-a[1],1)))
def cap(self, g):
    a = mem(); orig_cap(self, g); b = mem(); log.append(("warmup+capture", g.nb, g.tb, round(b[0]-a[0],1), round(b[1]-a[1],1)))
cg._Graph.__init__, cg.GraphRunner._capture = init, cap
g = cg.GraphRunner(r.model, r.pool, dev)
a = mem(); keys = g.capture_startup(1 << 30); b = mem()
print("capture_startup 1 GiB budget:", len(keys), "graphs", keys[-1] if keys else None, "reserved +%.1f MiB allocated +%.1f MiB" % (b[0]-a[0], b[1]-a[1]), flush=True)
for row in log[:16]: print(row)
# same with one side stream for every capture
shared = torch.cuda.Stream(dev)
torch_Stream = torch.cuda.Stream
torch.cuda.Stream = lambda *a, **k: shared
log.clear()
g2 = cg.GraphRunner(r.model, r.pool, dev)
a = mem(); keys = g2.capture_startup(1 << 30); b = mem()
torch.cuda.Stream = torch_Stream
print("ONE side stream, capture_startup 1 GiB budget:", len(keys), "graphs", keys[-1] if keys else None, "reserved +%.1f MiB allocated +%.1f MiB" % (b[0]-a[0], b[1]-a[1]), flush=True)
for row in log[:16]: print(row)
