"""GPU tree attention for the draft: FlashInfer batch prefill over a paged KV pool with a custom mask.

Same interface as ``attention.BatchAttention`` (construct once per forward, call once per layer),
same semantics: request r's q_len_r new tokens write their K/V at explicit slots of its cache and
attend to its slots [0, kv_len_r) through an explicit boolean block [q_len_r, kv_len_r].

Two halves:
* ``plan_batch`` -- pure torch, CPU-testable: turns the per-request (page table, slots, kv_len,
  mask) blocks into FlashInfer's plan inputs for page size P: ``qo_indptr``, ``paged_kv_indptr``,
  ``paged_kv_indices``, ``paged_kv_last_page_len``, the flat bool ``custom_mask`` with its element
  ``mask_indptr`` (tree.flatten_masks), the per-request bit-packed mask exactly as
  ``flashinfer.segment_packbits(mask, mask_indptr, bitorder="little")`` returns it, and the global
  pool locations the new K/V are written to.
* ``FlashInferAttention`` -- GPU only (``import flashinfer`` happens inside, so importing this module
  never fails on CPU).  UNVERIFIED: written against the FlashInfer API documented for
  ``BatchPrefillWithPagedKVCacheWrapper`` (plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask=...,
  q_data_type=..., kv_data_type=...), run(q, (k_cache, v_cache)) with NHD pages), but never run:
  no GPU was available.  tests/test_flashinfer_attention.py checks it against SDPA on a GPU.

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
from typing import Sequence

import torch

from sglang_ssd.draft.tree import flatten_masks

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
    qo_indptr: torch.Tensor           # int32 [N+1]
    kv_indptr: torch.Tensor           # int32 [N+1], in pages
    kv_indices: torch.Tensor          # int32 [sum pages]: page ids, request-major
    last_page_len: torch.Tensor       # int32 [N], in 1..P
    custom_mask: torch.Tensor         # bool [sum q_i * kv_i]
    mask_indptr: torch.Tensor         # int32 [N+1], in mask elements
    packed_mask: torch.Tensor         # uint8: per-request little-endian packed mask
    packed_indptr: torch.Tensor       # int32 [N+1], in bytes
    write_loc: torch.Tensor           # int64 [sum q_i]: pool token locations of the new K/V
    page_size: int

    def kv_lens(self) -> torch.Tensor:
        """FlashInfer's own kv length rule: (pages - 1) * P + last_page_len."""
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1) * self.page_size + self.last_page_len


def plan_batch(page_tables: Sequence[Sequence[int] | torch.Tensor], slots: Sequence[torch.Tensor],
               kv_lens: Sequence[int], masks: Sequence[torch.Tensor], page_size: int) -> FlashInferPlan:
    """Per request: its page table (pool page ids covering slots 0..), the slots its q tokens write,
    the kv length it attends to and its bool mask [q_len, kv_len] -> FlashInfer plan inputs."""
    p = page_size
    qo, kv_ptr, idx, last, loc = [0], [0], [], [], []
    for table, sl, kl, m in zip(page_tables, slots, kv_lens, masks):
        table = torch.as_tensor(table, dtype=torch.int64)
        q = int(sl.numel())
        if kl < 1:
            raise ValueError("kv_len must be >= 1 (FlashInfer's last page holds 1..P tokens)")
        if tuple(m.shape) != (q, kl):
            raise ValueError(f"mask {tuple(m.shape)} != (q_len, kv_len) = ({q}, {kl})")
        n_pages = -(-kl // p)
        if n_pages > table.numel() or (q and int(sl.max()) >= table.numel() * p):
            raise ValueError(f"page table of {table.numel()} pages does not cover kv_len {kl} / slots")
        qo.append(qo[-1] + q)
        kv_ptr.append(kv_ptr[-1] + n_pages)
        idx.append(table[:n_pages])
        last.append(kl - (n_pages - 1) * p)
        sl = sl.to(torch.int64).cpu()
        loc.append(table[sl // p] * p + sl % p)
    flat, mask_indptr = flatten_masks([m.cpu() for m in masks])
    packed, packed_indptr = segment_packbits_little(flat, mask_indptr)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    return FlashInferPlan(
        qo_indptr=i32(qo), kv_indptr=i32(kv_ptr),
        kv_indices=torch.cat(idx).to(torch.int32) if idx else i32([]),
        last_page_len=i32(last), custom_mask=flat, mask_indptr=mask_indptr,
        packed_mask=packed, packed_indptr=packed_indptr,
        write_loc=torch.cat(loc) if loc else torch.zeros(0, dtype=torch.int64), page_size=p)


# ------------------------------------------------------------------------------ GPU attention
class FlashInferWorkspace:
    """One float workspace + one wrapper per draft process (plan() per forward reuses them)."""

    def __init__(self, device: torch.device | str):
        import flashinfer

        self.device = torch.device(device)
        self.buffer = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.buffer, "NHD")


class FlashInferAttention:
    """Callable passed to CausalLM.forward: writes K/V into the pool, then FlashInfer custom-mask
    attention over the requests' pages.  Items must hold ``PagedRequestKV`` of ``pool``.
    UNVERIFIED on hardware (see the module docstring)."""

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
        self.wrapper.plan(
            self.plan.qo_indptr.to(dev), self.plan.kv_indptr.to(dev), self.plan.kv_indices.to(dev),
            self.plan.last_page_len.to(dev), num_qo_heads, hkv, hd, pool.page_size,
            custom_mask=self.plan.custom_mask.to(dev), q_data_type=q_dtype, kv_data_type=pool.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write_flat(layer, self.write_loc, k, v)
        return self.wrapper.run(q.contiguous(), (self.pool.k[layer], self.pool.v[layer]))


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
