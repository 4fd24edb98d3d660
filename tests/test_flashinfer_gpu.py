"""GPU-only: FlashInfer tree attention and draft CUDA graphs against the SDPA path.

Skipped without a CUDA device or without flashinfer (scripts/gpu_check.sh runs these on the GPU
machine).  NOT RUN YET: written without access to a GPU.

Runs that are compared are driven with the SAME tokens (a fixed schedule, never each run's own
argmax): graph mode forces split-kv, so its bf16 numerics differ from eager in the last bits, and
one flipped argmax in a self-fed run would make every later logit diverge past any tolerance.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft.attention import AttnSeq, BatchAttention
from sglang_ssd.draft.flashinfer_attention import (FlashInferAttention, FlashInferWorkspace, flashinfer_available,
                                                   segment_packbits_little, warm_up_flashinfer)
from sglang_ssd.draft.paged_kv import PagedKVPool
from sglang_ssd.draft.runner import DraftRunner, ForwardItem
from sglang_ssd.draft.tree import fork_indices, tree_kv_len, tree_mask, tree_positions, tree_slots
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not flashinfer_available(),
                                reason="needs a CUDA device and flashinfer")
DEV = "cuda:0"
# FlashInfer prefill kernels need head_dim 64/128/256: a tiny model with 64-wide heads
GPU_MODEL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, std=0.05)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def test_segment_packbits_matches_flashinfer():
    import flashinfer

    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 8, 9, 100, 333]
    flat = torch.rand(sum(sizes), generator=g) < 0.5
    indptr = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    ours, ours_ptr = segment_packbits_little(flat, indptr)
    ref, ref_ptr = flashinfer.segment_packbits(flat.to(DEV), indptr.to(DEV), bitorder="little")
    assert ours.tolist() == ref.cpu().tolist() and ours_ptr.tolist() == ref_ptr.cpu().tolist()


@pytest.mark.parametrize("page", [1, 16])
def test_flashinfer_tree_attention_matches_sdpa(page):
    torch.manual_seed(0)
    hkv, h, d, k, dt = 2, 8, 64, 3, torch.bfloat16
    pool = PagedKVPool(1, hkv, d, dt, DEV, page_size=page, num_pages=8)
    ws = FlashInferWorkspace(DEV)
    prefixes, fans, depth = [6, 70, 2, 33], [[2, 1, 0, 1], [1, 0, 2, 0], [1, 1, 1, 1], [4, 0, 0, 0]], 2
    seqs = []
    for p, f in zip(prefixes, fans):
        b = sum(f)
        kv = pool.new_request(tree_kv_len(p, k, b, depth))
        hist = torch.arange(tree_kv_len(p, k, b, depth - 1), device=DEV)
        kv.write(0, hist, torch.randn(len(hist), hkv, d, device=DEV, dtype=dt),
                 torch.randn(len(hist), hkv, d, device=DEV, dtype=dt))
        seqs.append(AttnSeq(kv, tree_slots(p, k, b, depth), tree_kv_len(p, k, b, depth),
                            tree_mask(p, k, fork_indices(f), depth)))
    t = sum(len(s.slots) for s in seqs)
    q = torch.randn(t, h, d, device=DEV, dtype=dt)
    kn, vn = torch.randn(t, hkv, d, device=DEV, dtype=dt), torch.randn(t, hkv, d, device=DEV, dtype=dt)
    ref = BatchAttention(seqs, torch.device(DEV))(0, q, kn, vn)
    out = FlashInferAttention(seqs, pool, ws, h, dt)(0, q, kn, vn)
    assert out.shape == ref.shape
    assert _rel_err(out, ref) < 2e-2


def _tree_build(runner, prompts, fans, k=3):
    """Prefill, glue, K tree depths (the engine's forward sequence) -> every forward's logits.
    Tree inputs follow a fixed schedule (module docstring), the same for every runner."""
    kvs = [runner.new_kv(8) for _ in prompts]
    res = runner.forward([ForwardItem.extend(kv, p, 0, 1) for kv, p in zip(kvs, prompts)])
    res += runner.forward([ForwardItem.extend(kv, [5, 6, 7, 8][: k + 1], len(p), k + 1)
                           for kv, p in zip(kvs, prompts)])
    x = [torch.arange(sum(f)) % 96 for f in fans]
    for depth in range(k):
        items = [ForwardItem(kv, xi, tree_positions(len(p), fork_indices(f), depth),
                             tree_slots(len(p), k, sum(f), depth), tree_kv_len(len(p), k, sum(f), depth),
                             tree_mask(len(p), k, fork_indices(f), depth), sum(f))
                 for kv, p, f, xi in zip(kvs, prompts, fans, x)]
        res += runner.forward(items)
        x = [(xi * 7 + depth + 1) % 96 for xi in x]
    return res


def _prompts_and_fans():
    torch.manual_seed(4)
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (9, 40, 3)]
    return prompts, [[2, 1, 0, 1], [1, 1, 1, 1], [3, 0, 1, 0]]


def test_runner_flashinfer_matches_sdpa_through_a_tree_build():
    path = make_tiny_model(**GPU_MODEL)
    fi = DraftRunner.from_dir(path, DEV, "bfloat16", attention="flashinfer", cuda_graphs=False)
    sd = DraftRunner.from_dir(path, DEV, "bfloat16", attention="sdpa")
    assert fi.backend == "flashinfer" and sd.backend == "sdpa", fi.backend_fallback
    prompts, fans = _prompts_and_fans()
    for a, b in zip(_tree_build(fi, prompts, fans), _tree_build(sd, prompts, fans)):
        assert _rel_err(a, b) < 3e-2


def test_cuda_graph_replay_equals_eager():
    path = make_tiny_model(**GPU_MODEL)
    graphed = DraftRunner.from_dir(path, DEV, "bfloat16", attention="flashinfer", cuda_graphs=True)
    eager = DraftRunner.from_dir(path, DEV, "bfloat16", attention="flashinfer", cuda_graphs=False)
    assert graphed.backend == "flashinfer", graphed.backend_fallback
    captured = graphed.graphs.captures
    assert captured > 0 and set(graphed.graphs.graphs) == graphed.graphs.allowed  # captured before any round
    prompts, fans = _prompts_and_fans()
    for _ in range(2):
        outs_g = _tree_build(graphed, prompts, fans)
    outs_e = _tree_build(eager, prompts, fans)
    # glue and tree depths (3 requests, 12 tokens) replay the start-up graphs; nothing is captured live
    assert graphed.graphs.replays > 0 and graphed.graphs.captures == captured
    for a, b in zip(outs_g, outs_e):
        assert _rel_err(a, b) < 1e-2


def test_warm_up_checks_both_variants_against_sdpa():
    pool = PagedKVPool(2, 2, 64, torch.bfloat16, DEV, page_size=16, num_pages=16)
    used = pool.used_pages
    assert warm_up_flashinfer(pool, FlashInferWorkspace(DEV), 4) < 5e-2
    assert pool.used_pages == used  # the dummy requests' pages went back


def test_all_extend_batch_runs_causal_and_matches_sdpa():
    torch.manual_seed(1)
    hkv, h, d, dt = 2, 8, 64, torch.bfloat16
    pool = PagedKVPool(1, hkv, d, dt, DEV, page_size=16, num_pages=8)
    seqs = []
    for start, q in ((0, 40), (17, 3), (70, 1)):
        kv = pool.new_request(start + q)
        if start:
            kv.write(0, torch.arange(start, device=DEV), torch.randn(start, hkv, d, device=DEV, dtype=dt),
                     torch.randn(start, hkv, d, device=DEV, dtype=dt))
        seqs.append(AttnSeq(kv, torch.arange(start, start + q), start + q, None))
    t = sum(len(s.slots) for s in seqs)
    q = torch.randn(t, h, d, device=DEV, dtype=dt)
    kn, vn = torch.randn(t, hkv, d, device=DEV, dtype=dt), torch.randn(t, hkv, d, device=DEV, dtype=dt)
    attn = FlashInferAttention(seqs, pool, FlashInferWorkspace(DEV), h, dt)
    assert attn.plan.causal
    out = attn(0, q, kn, vn)
    assert _rel_err(out, BatchAttention(seqs, torch.device(DEV))(0, q, kn, vn)) < 2e-2


def test_graph_budget_zero_captures_nothing_and_runs_eager(monkeypatch):
    monkeypatch.setenv("SGLANG_SSD_DRAFT_GRAPH_MB", "0")
    path = make_tiny_model(**GPU_MODEL)
    runner = DraftRunner.from_dir(path, DEV, "bfloat16", attention="flashinfer", cuda_graphs=True)
    assert runner.graphs.allowed == set() and not runner.graphs.graphs
    prompts, fans = _prompts_and_fans()
    _tree_build(runner, prompts, fans)
    assert runner.graphs.replays == 0 and runner.graphs.captures == 0
