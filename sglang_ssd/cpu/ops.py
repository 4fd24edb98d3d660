"""Pure-torch implementations of the ``sgl_kernel`` CPU ops that SGLang 0.5.23 calls on CPU.

Semantics follow the Triton/CUDA reference kernels of the same ops in SGLang 0.5.23
(``sglang/kernels/ops/...``); every op mutates its output argument in place and returns None,
like the real kernels.  Each op is unit-tested against a plain-Python reference in
``tests/test_cpu_ops.py``.
"""

from __future__ import annotations

import ctypes

import torch


def _ranges(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with spans [start_b, end_b): (row index of every element, column of every element)."""
    lens = (end - start).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    # column = start_b + offset inside the row's span
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return rows, start.to(torch.int64)[rows] + offsets


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Scatter: req_to_token[req_pool_indices[b], start[b]:end[b]] = next (end-start) entries of out_cache_loc.

    ``out_cache_loc`` holds the requests' new slots packed back to back.
    """
    rows, cols = _ranges(start_offset, end_offset)
    if rows.numel() == 0:
        return
    req_to_token[req_pool_indices.to(torch.int64)[rows], cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out, pool_len):
    """Gather (inverse of the above): out (packed) = req_to_token[req_pool_indices[b], start[b]:end[b]]."""
    rows, cols = _ranges(start_offset, end_offset)
    if rows.numel() == 0:
        return
    out[: rows.numel()] = req_to_token[req_pool_indices.to(torch.int64)[rows], cols].to(out.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[b] = accept_tokens[b * stride + accept_lens[b] - 1] (the last accepted token of row b)."""
    bs = accept_lens.numel()
    idx = torch.arange(bs, dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact out_cache_loc[accept_index[i]] for every accept_index[i] != -1, order preserved."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (raw address data_ptrs[i], row size strides[i] bytes): row src -> row tgt.

    Reads all source rows before writing any target row, so overlapping src/tgt sets are safe.
    """
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    if src.numel() == 0:
        return
    n_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_rows * int(stride))).from_address(int(ptr))
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, int(stride))
        rows[tgt] = rows[src].clone()
