"""GPU tree attention for the draft: FlashInfer batch prefill over a paged KV pool with a custom mask.

Same interface as ``attention.BatchAttention`` (construct once per forward, call once per layer),
same semantics: request r's q_len_r new tokens write their K/V at explicit slots of its cache and
attend to its slots [0, kv_len_r) through an explicit boolean block [q_len_r, kv_len_r].

Two halves:
* ``plan_batch`` -- pure torch, CPU-testable: turns the per-request (page table, slots, kv_len,
  mask) blocks into FlashInfer's plan inputs for page size P, all on the host: ``qo_indptr``,
  ``paged_kv_indptr``, ``paged_kv_indices``, ``paged_kv_last_page_len``, the flat bool
  ``custom_mask`` with its element ``mask_indptr`` (tree.flatten_masks) -- or no mask at all when
  every request is a causal extend (planned ``causal=True``) -- the size of the per-request packed
  mask (``FlashInferPlan.packed`` builds it as ``flashinfer.segment_packbits(mask, mask_indptr,
  bitorder="little")`` does, for the tests), and the global pool locations the new K/V go to.
* ``FlashInferAttention`` -- GPU only (``import flashinfer`` happens inside, so importing this module
  never fails on CPU).  Written against the FlashInfer API documented for
  ``BatchPrefillWithPagedKVCacheWrapper`` (plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask=...,
  causal=..., q_data_type=..., kv_data_type=...), run(q, (k_cache, v_cache)) with NHD pages);
  tests/test_flashinfer_gpu.py checks it against SDPA on a GPU, and passed on an H200 with flashinfer 0.7.2
  (results/gpu_draft_check.md).

Why plan() gets the unpacked ``custom_mask`` and not our ``packed_custom_mask``: FlashInfer's kernel
reads request r's mask at ``maybe_custom_mask + maybe_mask_indptr[r]`` on a uint8 pointer (a BYTE
offset, each request's bits starting on a byte boundary, which is what segment_packbits returns),
but plan() given ``packed_custom_mask`` directly recomputes ``mask_indptr`` in mask ELEMENTS
(``_compute_page_mask_indptr``) -- right only for one request.  Passing the bool mask lets plan()
pack it and keep the matching byte indptr; our packer documents and tests that exact byte layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_ssd.draft.tree import causal_mask, flatten_masks

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace


def flashinfer_available() -> bool:
    """True when ``flashinfer`` imports (it only does on a CUDA build)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a CUDA-less build failing at import
        return False
    return True


# ------------------------------------------------------------------------------- bit packing
def packbits_little(bits: torch.Tensor) -> torch.Tensor:
    """numpy.packbits(bits, bitorder="little"): byte j holds bits[8j + i] at bit i; the tail is
    zero-padded to a whole byte.  (= flashinfer.packbits(bits, bitorder="little"))"""
    b = bits.reshape(-1).to(torch.uint8)
    pad = (-b.numel()) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=b.device)
    return (b.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8) if b.numel() else b.new_zeros(0)


def unpackbits_little(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of packbits_little: the first `count` bits as bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.to(torch.uint8)[:, None] >> shifts) & 1
    return bits.reshape(-1)[:count].bool()


def segment_packbits_little(flat: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack every segment flat[indptr[i]:indptr[i+1]] on its own (byte-aligned starts), as
    flashinfer.segment_packbits(flat, indptr, bitorder="little") does -> (packed uint8, byte indptr int32)."""
    ptr = indptr.tolist()
    parts = [packbits_little(flat[a:b]) for a, b in zip(ptr, ptr[1:])]
    sizes = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
    packed = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=flat.device)
    return packed, torch.cumsum(sizes, 0).to(torch.int32)


# ----------------------------------------------------------------------------------- planner
@dataclass
class FlashInferPlan:
    qo_indptr: torch.Tensor                 # int32 [N+1], host
    kv_indptr: torch.Tensor                 # int32 [N+1], host, in pages
    kv_indices: torch.Tensor                # int32 [sum pages], host: page ids, request-major
    last_page_len: torch.Tensor             # int32 [N], host, in 1..P
    custom_mask: Optional[torch.Tensor]     # bool [sum q_i * kv_i]; None: plan causal=True, no mask
    mask_indptr: Optional[torch.Tensor]     # int32 [N+1], in mask elements (None with the mask)
    packed_bytes: int                       # bytes of the per-request packed mask (graph buffer check)
    write_loc: torch.Tensor                 # int64 [sum q_i]: pool token locations of the new K/V
    page_size: int

    @property
    def causal(self) -> bool:
        """Every request is a causal extend: FlashInfer's own causal mode replaces the mask."""
        return self.custom_mask is None

    def kv_lens(self) -> torch.Tensor:
        """FlashInfer's own kv length rule: (pages - 1) * P + last_page_len."""
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1) * self.page_size + self.last_page_len

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8, byte indptr int32) as flashinfer.segment_packbits(mask, mask_indptr,
        bitorder="little") returns it -- what plan() builds on the device and the kernel reads.
        For the tests and reference checks only: the hot path never packs on the host."""
        if self.custom_mask is None:
            raise ValueError("a causal plan has no mask to pack")
        return segment_packbits_little(self.custom_mask, self.mask_indptr)


def _is_causal_extend(slots: torch.Tensor, kv_len: int) -> bool:
    """slots == kv_len - q .. kv_len - 1: FlashInfer's causal mode (query i sees kv <= kv_len - q + i,
    the bottom-right-aligned rule) then equals tree.causal_mask(kv_len - q, q)."""
    q = slots.numel()
    return q >= 1 and torch.equal(slots.to(torch.int64), torch.arange(kv_len - q, kv_len))


def plan_batch(page_tables: Sequence[Sequence[int] | torch.Tensor], slots: Sequence[torch.Tensor],
               kv_lens: Sequence[int], masks: Sequence[Optional[torch.Tensor]], page_size: int,
               need_mask: bool = False) -> FlashInferPlan:
    """Per request: its page table (pool page ids covering slots 0..), the slots its q tokens write,
    the kv length it attends to and its bool mask [q_len, kv_len] -> FlashInfer plan inputs.

    A mask of None marks a causal extend (slots kv_len - q .. kv_len - 1).  When every request is one
    and ``need_mask`` is False (eager path), the plan has no mask and is planned ``causal=True``:
    nothing [q, kv]-sized is built on the host or copied.  Otherwise the missing blocks are built
    (tree.causal_mask) -- CUDA-graph wrappers always run in custom-mask mode, so they need one.
    Everything returned is on the host: plan() reads indptrs there (its ``.to("cpu")`` is then free)."""
    p = page_size
    qo, kv_ptr, idx, last, loc = [0], [0], [], [], []
    for table, sl, kl, m in zip(page_tables, slots, kv_lens, masks):
        table = torch.as_tensor(table, dtype=torch.int64)
        q = int(sl.numel())
        sl = sl.to(torch.int64).cpu()
        if kl < 1:
            raise ValueError("kv_len must be >= 1 (FlashInfer's last page holds 1..P tokens)")
        if m is None and not _is_causal_extend(sl, kl):
            raise ValueError(f"mask None needs a causal extend: slots kv_len - q .. kv_len - 1 (kv_len {kl})")
        if m is not None and tuple(m.shape) != (q, kl):
            raise ValueError(f"mask {tuple(m.shape)} != (q_len, kv_len) = ({q}, {kl})")
        n_pages = -(-kl // p)
        if n_pages > table.numel() or (q and int(sl.max()) >= table.numel() * p):
            raise ValueError(f"page table of {table.numel()} pages does not cover kv_len {kl} / slots")
        qo.append(qo[-1] + q)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        idx.append(table[:n_pages])
        last.append(kl - (n_pages - 1) * p)
        loc.append(table[sl // p] * p + sl % p)
    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    packed_bytes = sum(-(-(q * kl) // 8) for q, kl in zip(q_lens, kv_lens))
    flat = mask_indptr = None
    if need_mask or any(m is not None for m in masks):
        blocks = [m.cpu() if m is not None else causal_mask(kl - q, q)
                  for m, q, kl in zip(masks, q_lens, kv_lens)]
        flat, mask_indptr = flatten_masks(blocks)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    return FlashInferPlan(
        qo_indptr=i32(qo), kv_indptr=i32(kv_ptr),
        kv_indices=torch.cat(idx).to(torch.int32) if idx else i32([]),
        last_page_len=i32(last), custom_mask=flat, mask_indptr=mask_indptr, packed_bytes=packed_bytes,
        write_loc=torch.cat(loc) if loc else torch.zeros(0, dtype=torch.int64), page_size=p)


def plan_wrapper(wrapper, plan: FlashInferPlan, device: torch.device, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """wrapper.plan() with what stays cheap: the indptrs and last page lengths as HOST int32 tensors
    (plan() needs them on the host and copies them to its buffers itself, so no device->host sync),
    the page ids and mask sent ahead non-blocking, and no mask at all for a causal plan.  A masked
    plan still syncs inside flashinfer (its mask_indptr .to(device) and segment_packbits' .item())."""
    mask = None if plan.custom_mask is None else plan.custom_mask.to(device, non_blocking=True)
    wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices.to(device, non_blocking=True),
                 plan.last_page_len, num_qo_heads, num_kv_heads, head_dim, plan.page_size,
                 custom_mask=mask, causal=plan.causal, q_data_type=q_dtype, kv_data_type=kv_dtype)


# ------------------------------------------------------------------------------ GPU attention
class FlashInferWorkspace:
    """One float workspace + one wrapper per draft process (plan() per forward reuses them).

    backend="fa2" pinned: an "auto" wrapper picks its kernel family once, at its first plan(), from
    whether that plan has a custom mask (flashinfer utils.determine_attention_backend) -- a first
    causal plan on Hopper would lock it on fa3, which has no custom-mask support, for the tree
    depths that follow.  fa2 runs both modes from one JIT module (the mask mode is a run-time switch)."""

    def __init__(self, device: torch.device | str):
        import flashinfer

        self.device = torch.device(device)
        self.buffer = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.buffer, "NHD", backend="fa2")


class FlashInferAttention:
    """Callable passed to CausalLM.forward: writes K/V into the pool, then FlashInfer attention
    (custom mask, or causal when every request is an extend) over the requests' pages.
    Items must hold ``PagedRequestKV`` of ``pool``."""

    def __init__(self, seqs: Sequence, pool, workspace: FlashInferWorkspace, num_qo_heads: int,
                 q_dtype: torch.dtype, wrapper=None):
        for s in seqs:
            if getattr(s.kv, "pool", None) is not pool:
                raise TypeError("FlashInferAttention needs PagedRequestKV caches of its pool")
        self.pool = pool
        self.plan = plan_batch([s.kv.pages for s in seqs], [s.slots for s in seqs],
                               [s.kv_len for s in seqs], [s.mask for s in seqs], pool.page_size)
        dev = pool.device
        self.write_loc = self.plan.write_loc.to(dev, non_blocking=True)
        _, hkv, hd = pool.shape
        self.wrapper = wrapper if wrapper is not None else workspace.wrapper
        plan_wrapper(self.wrapper, self.plan, dev, num_qo_heads, hkv, hd, q_dtype, pool.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write_flat(layer, self.write_loc, k, v)
        return self.wrapper.run(q.contiguous(), (self.pool.k[layer], self.pool.v[layer]))


def warm_up_flashinfer(pool, workspace: FlashInferWorkspace, num_qo_heads: int, tol: float = 5e-2) -> float:
    """One dummy plan() + run() of each variant the draft plans -- an all-extend batch (causal=True,
    no mask) and a tree depth batched with an extend (custom mask) -- through FlashInferAttention on
    `pool`, each checked against the SDPA path on the same pages.  Returns the worst relative error;
    raises when a kernel cannot be built or run (flashinfer JIT-compiles here: no nvcc -> RuntimeError
    "Could not find nvcc") or disagrees with SDPA, so the caller can fall back before serving."""
    from sglang_ssd.draft.attention import AttnSeq, BatchAttention
    from sglang_ssd.draft.tree import fork_indices, tree_kv_len, tree_mask, tree_slots

    _, hkv, hd = pool.shape
    dev, dt = pool.device, pool.dtype
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dt)
    k, fan = 2, [2, 1, 0]                      # K = 2 glue tokens, 3 branches at depth 0
    prefix, forks = 17, fork_indices(fan)
    kvs = [pool.new_request(48), pool.new_request(48)]
    try:
        batches = [  # (1) prefill extends: slots 0..19 and 0..6, causal
            [AttnSeq(kvs[0], torch.arange(0, prefix + k + 1), prefix + k + 1, None),
             AttnSeq(kvs[1], torch.arange(0, 7), 7, None)],
            # (2) request 0's first tree depth over its prefix + glue, next to an extend of request 1
            [AttnSeq(kvs[0], tree_slots(prefix, k, len(forks), 0), tree_kv_len(prefix, k, len(forks), 0),
                     tree_mask(prefix, k, forks, 0)),
             AttnSeq(kvs[1], torch.arange(7, 10), 10, None)]]
        worst = 0.0
        for seqs in batches:
            t = sum(len(s.slots) for s in seqs)
            q, kn, vn = rand(t, num_qo_heads, hd), rand(t, hkv, hd), rand(t, hkv, hd)
            attn = FlashInferAttention(seqs, pool, workspace, num_qo_heads, dt)
            if seqs is batches[0] and not attn.plan.causal:
                raise AssertionError("an all-extend batch must plan causal=True")
            out = attn(0, q, kn, vn).float()
            ref = BatchAttention(seqs, dev)(0, q, kn, vn).float()  # rewrites the same K/V, then reads
            err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            if not torch.isfinite(out).all() or err > tol:
                raise RuntimeError(f"FlashInfer output differs from SDPA (relative error {err:.3g} > {tol})")
            worst = max(worst, err)
    finally:
        for kv in kvs:
            kv.free()
    logger.info("draft FlashInfer warm-up done: causal and tree-mask kernels built, max rel. error vs SDPA %.2g",
                worst)
    return worst


def select_backend(device: torch.device | str, requested: str = "auto",
                   dtype: torch.dtype = torch.bfloat16) -> str:
    """'flashinfer' when the draft runs on CUDA in fp16/bf16 and flashinfer imports, else 'sdpa'
    (FlashInfer's prefill kernels take half-precision q/KV only).  The choice is logged."""
    dev = torch.device(device)
    if requested not in ("auto", "sdpa", "flashinfer"):
        raise ValueError(f"draft attention backend must be auto, sdpa or flashinfer, got {requested!r}")
    if requested == "sdpa":
        choice, why = "sdpa", "requested"
    elif dev.type != "cuda":
        if requested == "flashinfer":
            raise ValueError(f"flashinfer attention needs a CUDA draft device, got {dev}")
        choice, why = "sdpa", f"device {dev} is not CUDA"
    elif dtype not in (torch.float16, torch.bfloat16):
        if requested == "flashinfer":
            raise ValueError(f"flashinfer attention needs float16/bfloat16, got {dtype}")
        choice, why = "sdpa", f"dtype {dtype} (FlashInfer prefill needs fp16/bf16)"
    elif not flashinfer_available():
        if requested == "flashinfer":
            raise ValueError("flashinfer attention requested but `import flashinfer` fails")
        choice, why = "sdpa", "flashinfer does not import"
    else:
        choice, why = "flashinfer", f"device {dev}, flashinfer imports"
    logger.info("draft attention backend: %s (%s)", choice, why)
    return choice


def pool_pages_for(tokens: int, page_size: int) -> int:
    """Pages to pre-allocate for `tokens` KV slots (whole requests round up; keep a margin)."""
    return max(64, -(-tokens // page_size) * 2)
