"""CUDA graphs for the draft's small forwards (glue, tree depths, just-in-time decode steps).

Why: a tree depth is one forward of a few dozen tokens through a small model -- on a GPU its cost
is kernel-launch latency, not math, and the cache build (glue + K depths) must fit inside the
target's verify window.  Replaying a captured graph turns each forward into one launch.

A graph is captured per BUCKET (requests N_b, tokens T_b): FlashInfer's CUDA-graph wrapper fixes
the number of requests, and the token count fixes every activation shape.  A batch of N requests
and T tokens runs in the smallest bucket that fits after padding: N_b - N pad requests carry the
T_b - T pad tokens (at least one each); a pad request attends to one slot of a reserved scratch
page and writes its K/V there, so padding never touches a real request's cache.

CPU-testable: ``default_buckets``, ``choose_bucket``, ``pad_q_lens`` (pure functions).
GPU only, UNVERIFIED (no GPU was available): ``GraphRunner`` -- capture with torch.cuda.CUDAGraph
against FlashInfer's ``use_cuda_graph=True`` wrapper (plan() refreshes its index/mask buffers
outside the graph before each replay, as SGLang's own FlashInfer backend does), replay, and
re-capture when the KV pool was reallocated.  tests/test_flashinfer_attention.py checks replay ==
eager on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_ssd.draft.flashinfer_attention import WORKSPACE_BYTES, plan_batch

logger = logging.getLogger(__name__)


def default_buckets(max_value: int, small: Sequence[int] = (1, 2, 4, 8, 16, 24, 32, 48, 64)) -> list[int]:
    """Sizes to capture: the small list, then powers of two, up to and including max_value."""
    out = [s for s in small if s < max_value]
    nxt = 128
    while nxt < max_value:
        out.append(nxt)
        nxt *= 2
    return sorted(set(out + [max_value]))


def choose_bucket(n_req: int, n_tok: int, req_buckets: Sequence[int],
                  tok_buckets: Sequence[int]) -> Optional[tuple[int, int]]:
    """Smallest (N_b, T_b) holding n_req requests and n_tok tokens once padded, or None (run eager).

    Padding rule: N_b - n_req pad requests carry the T_b - n_tok pad tokens, at least one each, so
    T_b >= n_tok + (N_b - n_req), and T_b > n_tok needs at least one pad request."""
    if n_req < 1 or n_tok < n_req:
        raise ValueError(f"need n_tok >= n_req >= 1, got n_req={n_req}, n_tok={n_tok}")
    for nb in sorted(req_buckets):
        if nb < n_req:
            continue
        fits = [tb for tb in sorted(tok_buckets) if tb >= n_tok + (nb - n_req)]
        if not fits:
            continue
        tb = fits[0]
        if tb > n_tok and nb == n_req:
            continue  # pad tokens but no pad request to carry them: try a bigger N_b
        return nb, tb
    return None


def pad_q_lens(q_lens: Sequence[int], n_req_b: int, n_tok_b: int) -> list[int]:
    """q lengths of the pad requests: N_b - N of them, >= 1 each, summing to T_b - T."""
    n_pad, t_pad = n_req_b - len(q_lens), n_tok_b - sum(q_lens)
    if n_pad < 0 or t_pad < n_pad or (t_pad > 0 and n_pad == 0):
        raise ValueError(f"cannot pad {len(q_lens)} requests / {sum(q_lens)} tokens to ({n_req_b}, {n_tok_b})")
    if n_pad == 0:
        return []
    return [t_pad - (n_pad - 1)] + [1] * (n_pad - 1)


@dataclass
class _PadSeq:  # what plan_batch needs of a pad request
    pages: list[int]
    slots: torch.Tensor
    kv_len: int
    mask: torch.Tensor


class _Graph:
    def __init__(self, nb: int, tb: int, runner: "GraphRunner"):
        import flashinfer

        dev, pool = runner.device, runner.pool
        self.nb, self.tb = nb, tb
        i32 = dict(dtype=torch.int32, device=dev)
        self.ids = torch.zeros(tb, dtype=torch.long, device=dev)
        self.pos = torch.zeros(tb, dtype=torch.long, device=dev)
        self.loc = torch.full((tb,), runner.scratch_loc, dtype=torch.long, device=dev)
        self.mask_bytes = tb * runner.max_kv // 8 + nb
        self.max_pages = nb * (-(-runner.max_kv // pool.page_size))
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            runner.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(nb + 1, **i32), paged_kv_indptr_buf=torch.zeros(nb + 1, **i32),
            paged_kv_indices_buf=torch.zeros(self.max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(nb, **i32),
            custom_mask_buf=torch.zeros(self.mask_bytes, dtype=torch.uint8, device=dev),
            mask_indptr_buf=torch.zeros(nb + 1, **i32))
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[torch.Tensor] = None

    def attn(self, pool):
        wrapper, loc = self.wrapper, self.loc

        def call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.write_flat(layer, loc, k, v)
            return wrapper.run(q.contiguous(), (pool.k[layer], pool.v[layer]))
        return call


class GraphRunner:
    """Captures and replays ``model(ids, positions, attention)`` per bucket.  GPU only, UNVERIFIED."""

    def __init__(self, model, pool, device: torch.device | str, max_tokens: int = 256,
                 max_requests: int = 64, max_kv: int = 8192):
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_kv = max_kv
        self.tok_buckets = default_buckets(max_tokens)
        self.req_buckets = default_buckets(max_requests)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.scratch_page = pool.alloc(1)[0]
        self.scratch_loc = self.scratch_page * pool.page_size
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.generation = pool.generation
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.captures = 0

    def _pad(self, seqs: Sequence, nb: int, tb: int) -> list:
        pads = [_PadSeq([self.scratch_page], torch.zeros(q, dtype=torch.long), 1,
                        torch.ones(q, 1, dtype=torch.bool)) for q in pad_q_lens([len(s.slots) for s in seqs], nb, tb)]
        return list(seqs) + pads

    def _load(self, g: _Graph, seqs: Sequence, ids: torch.Tensor, pos: torch.Tensor) -> bool:
        """plan() + static inputs for this batch; False when it does not fit the buffers."""
        plan = plan_batch([s.kv.pages if hasattr(s, "kv") else s.pages for s in seqs],
                          [s.slots for s in seqs], [s.kv_len for s in seqs], [s.mask for s in seqs],
                          self.pool.page_size)
        if plan.packed_mask.numel() > g.mask_bytes or plan.kv_indices.numel() > g.max_pages:
            return False
        dev, cfg = self.device, self.model.cfg
        _, hkv, hd = self.pool.shape
        g.wrapper.plan(plan.qo_indptr.to(dev), plan.kv_indptr.to(dev), plan.kv_indices.to(dev),
                       plan.last_page_len.to(dev), cfg.num_heads, hkv, hd, self.pool.page_size,
                       custom_mask=plan.custom_mask.to(dev), q_data_type=self.pool.dtype,
                       kv_data_type=self.pool.dtype)
        t = ids.numel()
        g.ids[:t].copy_(ids)
        g.pos[:t].copy_(pos)
        g.ids[t:].zero_()
        g.pos[t:].zero_()
        g.loc.copy_(plan.write_loc.to(dev))
        return True

    def _capture(self, g: _Graph) -> None:
        attn = g.attn(self.pool)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                self.model(g.ids, g.pos, attn)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.mempool):
            g.out = self.model(g.ids, g.pos, attn)
        self.captures += 1
        logger.info("draft CUDA graph captured: %d requests x %d tokens", g.nb, g.tb)

    @torch.no_grad()
    def run(self, seqs: Sequence, ids: torch.Tensor, pos: torch.Tensor) -> Optional[torch.Tensor]:
        """Hidden states [T, D] of a graphed forward, or None when no bucket fits (caller runs eager).
        seqs: AttnSeq-like items (kv: PagedRequestKV, slots, kv_len, mask); ids/pos on the device."""
        if self.pool.generation != self.generation:  # the pool storage moved: old graphs are stale
            self.graphs.clear()
            self.generation = self.pool.generation
        n_tok = ids.numel()
        if any(len(s.slots) == 0 for s in seqs):
            return None
        key = choose_bucket(len(seqs), n_tok, self.req_buckets, self.tok_buckets)
        if key is None:
            return None
        g = self.graphs.get(key)
        fresh = g is None
        if fresh:
            g = self.graphs[key] = _Graph(*key, runner=self)
        padded = self._pad(seqs, *key)
        if not self._load(g, padded, ids, pos):
            return None
        if fresh or g.graph is None:
            self._capture(g)  # the warm-up runs write this batch's own K/V: harmless, replay rewrites it
        g.graph.replay()
        self.replays += 1
        return g.out[:n_tok]
