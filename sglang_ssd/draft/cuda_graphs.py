"""CUDA graphs for the draft's small forwards (glue, tree depths, just-in-time decode steps).

Why: a tree depth is one forward of a few dozen tokens through a small model -- on a GPU its cost
is kernel-launch latency, not math, and the cache build (glue + K depths) must fit inside the
target's verify window.  Replaying a captured graph turns each forward into one launch.

A graph is captured per BUCKET (requests N_b, tokens T_b): FlashInfer's CUDA-graph wrapper fixes
the number of requests, and the token count fixes every activation shape.  A batch of N requests
and T tokens runs in the smallest bucket that fits after padding: N_b - N pad requests carry the
T_b - T pad tokens (at least one each); a pad request attends to one slot of a reserved scratch
page and writes its K/V there, so padding never touches a real request's cache.

Start-up capture (before the draft reports READY, so no capture stalls a live round): the buckets
``startup_buckets`` picks -- fewest tokens first, since the smallest forwards are the most
launch-bound -- while their estimated memory (``graph_bytes``) fits the budget
``SGLANG_SSD_DRAFT_GRAPH_MB`` (default 256 MiB of device memory; each graph also pins 8 MiB of host
memory, FlashInfer's int workspace mirror).  A batch no captured bucket holds runs EAGER: no lazy
capture in serving, so the draft's graph memory stays within the budget.  Only after a KV pool
growth (stale graphs dropped) are the start-up buckets re-captured, lazily, on their next use.

CPU-testable: ``default_buckets``, ``choose_bucket``, ``pad_q_lens``, ``graph_bytes``,
``startup_buckets`` (pure functions).
GPU only (checked on an H200: results/gpu_draft_check.md): ``GraphRunner`` -- capture with torch.cuda.CUDAGraph
against FlashInfer's ``use_cuda_graph=True`` wrapper (plan() refreshes its index/mask buffers
outside the graph before each replay, as SGLang's own FlashInfer backend does), replay, and
re-capture when the KV pool was reallocated.  tests/test_flashinfer_gpu.py checks replay ==
eager on a GPU.

A graph wrapper always runs in custom-mask mode (flashinfer's run() picks CUSTOM whenever its
custom_mask_buf exists, and the captured kernel is fixed), so graphed batches are planned with a
mask even when every request is a causal extend (plan_batch(need_mask=True)).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_ssd.config import env_number
from sglang_ssd.draft.flashinfer_attention import WORKSPACE_BYTES, plan_batch, plan_wrapper

logger = logging.getLogger(__name__)

GRAPH_MB_ENV = "SGLANG_SSD_DRAFT_GRAPH_MB"
DEFAULT_GRAPH_MB = 256
FI_INT_WORKSPACE = 8 * 1024 * 1024  # flashinfer 0.7.2's int workspace: ONE, shared by every graph wrapper
FI_WRAPPER_BYTES = 32768 * 4  # what each flashinfer 0.7.2 graph wrapper still holds of its own (kv_lens buffer)


def default_buckets(max_value: int, small: Sequence[int] = (1, 2, 4, 8, 16, 24, 32, 48, 64)) -> list[int]:
    """Sizes to capture: the small list, then powers of two, up to and including max_value."""
    out = [s for s in small if s < max_value]
    nxt = 128
    while nxt < max_value:
        out.append(nxt)
        nxt *= 2
    return sorted(set(out + [max_value]))


def choose_bucket(n_req: int, n_tok: int, req_buckets: Sequence[int], tok_buckets: Sequence[int],
                  allowed: Optional[set] = None) -> Optional[tuple[int, int]]:
    """Smallest (N_b, T_b) holding n_req requests and n_tok tokens once padded, or None (run eager);
    with `allowed`, only among those (N_b, T_b) pairs (the captured ones).

    Padding rule: N_b - n_req pad requests carry the T_b - n_tok pad tokens, at least one each, so
    T_b >= n_tok + (N_b - n_req), and T_b > n_tok needs at least one pad request."""
    if n_req < 1 or n_tok < n_req:
        raise ValueError(f"need n_tok >= n_req >= 1, got n_req={n_req}, n_tok={n_tok}")
    for nb in sorted(req_buckets):
        if nb < n_req:
            continue
        fits = [tb for tb in sorted(tok_buckets) if tb >= n_tok + (nb - n_req)
                and not (tb > n_tok and nb == n_req) and (allowed is None or (nb, tb) in allowed)]
        if not fits:
            continue
        return nb, fits[0]  # (tb > n_tok needs a pad request to carry the pad tokens: nb > n_req)
    return None


def pad_q_lens(q_lens: Sequence[int], n_req_b: int, n_tok_b: int) -> list[int]:
    """q lengths of the pad requests: N_b - N of them, >= 1 each, summing to T_b - T."""
    n_pad, t_pad = n_req_b - len(q_lens), n_tok_b - sum(q_lens)
    if n_pad < 0 or t_pad < n_pad or (t_pad > 0 and n_pad == 0):
        raise ValueError(f"cannot pad {len(q_lens)} requests / {sum(q_lens)} tokens to ({n_req_b}, {n_tok_b})")
    if n_pad == 0:
        return []
    return [t_pad - (n_pad - 1)] + [1] * (n_pad - 1)


def mask_buffer_bytes(nb: int, tb: int, max_kv: int) -> int:
    """Packed custom-mask buffer of a bucket: tb rows of at most max_kv bits, each of nb requests
    starting on its own byte (segment_packbits), so at most one byte of rounding per request."""
    return tb * max_kv // 8 + nb


def graph_bytes(nb: int, tb: int, max_kv: int, page_size: int, token_bytes: int) -> int:
    """Estimated device memory of one bucket's graph: what FlashInfer's wrapper keeps of its own (the
    int workspace is shared: GraphRunner), our static index / mask / input buffers, and `token_bytes`
    of graph-pool activations per token."""
    pages = nb * -(-max_kv // page_size)
    index = 4 * (3 * (nb + 1) + pages)             # int32 qo / kv / mask indptr + page ids
    inputs = 8 * 3 * tb + 4 * nb                    # ids, positions, write locations; last page lens
    return FI_WRAPPER_BYTES + mask_buffer_bytes(nb, tb, max_kv) + index + inputs + tb * token_bytes


def startup_buckets(req_buckets: Sequence[int], tok_buckets: Sequence[int], budget_bytes: int,
                    cost, max_tokens_per_request: int = 32) -> list[tuple[int, int]]:
    """Buckets to capture at start-up, in capture order, whose summed cost(nb, tb) fits budget_bytes.

    Candidates are the (nb, tb) with nb <= tb <= nb * max_tokens_per_request (every request carries
    at least one token; a tree depth / glue / decode carries a few per request, so wider buckets are
    prefill chunks, which run eager anyway).  Order: fewest tokens first, then fewest requests -- a
    forward of few tokens is launch-bound, which is what a graph removes.  The first candidate that
    does not fit ends the list (later ones are larger, so skipping ahead would only fragment it)."""
    cands = sorted(((nb, tb) for nb in req_buckets for tb in tok_buckets
                    if nb <= tb <= nb * max_tokens_per_request), key=lambda x: (x[1], x[0]))
    out, used = [], 0
    for nb, tb in cands:
        c = cost(nb, tb)
        if used + c > budget_bytes:
            break
        out.append((nb, tb))
        used += c
    return out


def graph_budget_bytes(env: Optional[dict] = None) -> int:
    """The start-up capture budget: SGLANG_SSD_DRAFT_GRAPH_MB (MiB, 0 = capture nothing)."""
    mb = env_number(GRAPH_MB_ENV, DEFAULT_GRAPH_MB, env, cast=float)
    return int(mb * 2**20)


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
        self.mask_bytes = mask_buffer_bytes(nb, tb, runner.max_kv)
        self.max_pages = nb * (-(-runner.max_kv // pool.page_size))
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            runner.workspace, "NHD", use_cuda_graph=True, backend="fa2",
            qo_indptr_buf=torch.zeros(nb + 1, **i32), paged_kv_indptr_buf=torch.zeros(nb + 1, **i32),
            paged_kv_indices_buf=torch.zeros(self.max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(nb, **i32),
            custom_mask_buf=torch.zeros(self.mask_bytes, dtype=torch.uint8, device=dev),
            mask_indptr_buf=torch.zeros(nb + 1, **i32))
        # one int workspace for every graph wrapper (8 MiB each otherwise: 454 MiB for 56 buckets on the
        # H200 run, results/gpu_draft_check.md). Safe: each replay is preceded by its own plan(), which
        # rewrites the plan info at the same offsets, in stream order after the previous replay
        self.wrapper.reset_workspace_buffer(runner.workspace, runner.int_workspace)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Optional[torch.Tensor] = None

    def attn(self, pool):
        wrapper, loc = self.wrapper, self.loc

        def call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.write_flat(layer, loc, k, v)
            return wrapper.run(q.contiguous(), (pool.k[layer], pool.v[layer]))
        return call


class GraphRunner:
    """Captures (at start-up: ``capture_startup``) and replays ``model(ids, positions, attention)``
    per bucket.  GPU only."""

    def __init__(self, model, pool, device: torch.device | str, max_tokens: int = 256,
                 max_requests: int = 64, max_kv: int = 8192):
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_kv = max_kv
        self.tok_buckets = default_buckets(max_tokens)
        self.req_buckets = default_buckets(max_requests)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.int_workspace = torch.empty(FI_INT_WORKSPACE, dtype=torch.uint8, device=self.device)
        # ONE side stream for every capture's warm-up: the caching allocator keeps blocks per stream, and
        # a new stream per capture reserved 32 MiB more per graph on the H200 (results/gpu_draft_check.md)
        self.capture_stream = torch.cuda.Stream(self.device)
        self.scratch_page = pool.alloc(1)[0]
        self.scratch_loc = self.scratch_page * pool.page_size
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.allowed: Optional[set] = None  # buckets that may hold a graph (None: any, captured lazily)
        self.generation = pool.generation
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.captures = 0
        self.startup_bytes = 0

    def token_bytes(self) -> int:
        """Graph-pool activation estimate per token: the residual stream kept as the output plus a
        forward's widest temporaries (q/k/v, gate/up/act), all in the model dtype."""
        c = self.model.cfg
        width = 2 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size
        return width * self.pool.k.element_size()

    def capture_startup(self, budget_bytes: int, max_tokens_per_request: int = 32) -> list[tuple[int, int]]:
        """Capture the start-up buckets (module docstring) on an all-pad batch (every request on the
        scratch page, so no real cache is touched), stopping also when the MEASURED device memory
        (torch.cuda.memory_reserved) would pass the budget.  Later batches use only these buckets."""
        est = lambda nb, tb: graph_bytes(nb, tb, self.max_kv, self.pool.page_size, self.token_bytes())
        keys = startup_buckets(self.req_buckets, self.tok_buckets, budget_bytes, est, max_tokens_per_request)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_reserved(self.device)
        for nb, tb in keys:
            if torch.cuda.memory_reserved(self.device) - base + est(nb, tb) > budget_bytes:
                break  # the estimate was low: the measured memory decides
            g = self.graphs[(nb, tb)] = _Graph(nb, tb, runner=self)
            zeros = torch.zeros(tb, dtype=torch.long, device=self.device)
            if not self._load(g, self._pad([], nb, tb), zeros, zeros):
                raise RuntimeError(f"an all-pad batch does not fit bucket {(nb, tb)}")
            self._capture(g)
        torch.cuda.synchronize(self.device)
        self.startup_bytes = torch.cuda.memory_reserved(self.device) - base
        self.allowed = set(self.graphs)
        n_cand = sum(1 for nb in self.req_buckets for tb in self.tok_buckets if nb <= tb <= nb * max_tokens_per_request)
        logger.info("draft CUDA graphs: captured %d of %d buckets at start-up (requests x tokens up to %s), "
                    "%.1f MiB device memory measured (budget %.0f MiB, %s) + %d MiB pinned host; "
                    "other batch shapes run eager", len(self.graphs), n_cand,
                    max(self.graphs, key=lambda x: (x[1], x[0]), default=None), self.startup_bytes / 2**20,
                    budget_bytes / 2**20, GRAPH_MB_ENV, len(self.graphs) * 8)
        return list(self.graphs)

    def _pad(self, seqs: Sequence, nb: int, tb: int) -> list:
        pads = [_PadSeq([self.scratch_page], torch.zeros(q, dtype=torch.long), 1,
                        torch.ones(q, 1, dtype=torch.bool)) for q in pad_q_lens([len(s.slots) for s in seqs], nb, tb)]
        return list(seqs) + pads

    def _load(self, g: _Graph, seqs: Sequence, ids: torch.Tensor, pos: torch.Tensor) -> bool:
        """plan() + static inputs for this batch; False when it does not fit the buffers."""
        plan = plan_batch([s.kv.pages if hasattr(s, "kv") else s.pages for s in seqs],
                          [s.slots for s in seqs], [s.kv_len for s in seqs], [s.mask for s in seqs],
                          self.pool.page_size, need_mask=True)  # the graph's kernel is the custom-mask one
        if plan.packed_bytes > g.mask_bytes or plan.kv_indices.numel() > g.max_pages:
            return False
        _, hkv, hd = self.pool.shape
        plan_wrapper(g.wrapper, plan, self.device, self.model.cfg.num_heads, hkv, hd, self.pool.dtype,
                     self.pool.dtype)
        t = ids.numel()
        g.ids[:t].copy_(ids)
        g.pos[:t].copy_(pos)
        g.ids[t:].zero_()
        g.pos[t:].zero_()
        g.loc.copy_(plan.write_loc, non_blocking=True)  # host -> device without waiting for the device
        return True

    def _capture(self, g: _Graph) -> None:
        attn = g.attn(self.pool)
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                self.model(g.ids, g.pos, attn)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.mempool):
            g.out = self.model(g.ids, g.pos, attn)
        self.captures += 1
        logger.debug("draft CUDA graph captured: %d requests x %d tokens", g.nb, g.tb)

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
        key = choose_bucket(len(seqs), n_tok, self.req_buckets, self.tok_buckets, self.allowed)
        if key is None:
            return None
        g = self.graphs.get(key)
        fresh = g is None
        if fresh:  # no start-up capture ran (allowed None), or a pool growth dropped the graphs
            g = self.graphs[key] = _Graph(*key, runner=self)
        padded = self._pad(seqs, *key)
        if not self._load(g, padded, ids, pos):
            return None
        if fresh or g.graph is None:
            self._capture(g)  # the warm-up runs write this batch's own K/V: harmless, replay rewrites it
        g.graph.replay()
        self.replays += 1
        return g.out[:n_tok]
