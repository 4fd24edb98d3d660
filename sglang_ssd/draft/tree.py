"""Speculation-tree layout, positions and attention masks (pure index math, no model code).

Per request, with P = committed prefix length (every known token except the newest, the root):

    slots [0, P)                      committed prefix
    slots [P, P+K]                    GLUE: [root, s_1 .. s_K], the speculation just sent, positions P..P+K
    slot  P+K+1 + d*B + i             TREE: branch i at depth d (d = 0..K-1), B = sum(fan_out)

Branch i is forked at glue index j(i) (outcome "j drafts accepted, bonus = guessed token"); branches
are numbered fork-index-major: fan_out[0] branches at j = 0, then fan_out[1] at j = 1, ...
Its depth-d token sits at RoPE position P + j(i) + 1 + d and sees exactly: the whole prefix, glue
slots P..P+j(i), and its own tokens at depths 0..d (row j of a lower-triangular glue block, then an
identity block per depth).

Masks are built in FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=...)``
layout: per request a row-major boolean block [q_len, kv_len] (True = attend), blocks concatenated
over requests and flattened; ``mask_indptr`` = cumsum of q_len * kv_len.  ``flat_to_dense`` turns
that into a padded [N, max_q, max_kv] mask for torch ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def fork_indices(fan_out: Sequence[int]) -> list[int]:
    """Glue index j of every branch: fan_out = [2, 1, 0, 1] -> [0, 0, 1, 3]."""
    return [j for j, f in enumerate(fan_out) for _ in range(f)]


def tree_slots(prefix_len: int, k: int, num_branches: int, depth: int) -> torch.Tensor:
    """KV slots of all branches at `depth`: P + K + 1 + depth*B + i."""
    start = prefix_len + k + 1 + depth * num_branches
    return torch.arange(start, start + num_branches)


def tree_positions(prefix_len: int, forks: Sequence[int], depth: int) -> torch.Tensor:
    """RoPE positions of all branches at `depth`: P + j(i) + 1 + depth."""
    return torch.as_tensor(forks, dtype=torch.long) + (prefix_len + 1 + depth)


def tree_kv_len(prefix_len: int, k: int, num_branches: int, depth: int) -> int:
    """Slots visible to the depth-`depth` forward: prefix + glue + (depth+1) tree blocks."""
    return prefix_len + k + 1 + (depth + 1) * num_branches


def tree_mask(prefix_len: int, k: int, forks: Sequence[int], depth: int) -> torch.Tensor:
    """Boolean [B, kv_len] block for one request's depth-`depth` tree forward (True = attend)."""
    b = len(forks)
    p = prefix_len
    mask = torch.zeros(b, tree_kv_len(p, k, b, depth), dtype=torch.bool)
    mask[:, :p] = True                                                    # whole prefix
    j = torch.as_tensor(forks, dtype=torch.long)
    glue = torch.arange(k + 1)
    mask[:, p : p + k + 1] = glue[None, :] <= j[:, None]                  # glue 0..j(i)
    eye = torch.eye(b, dtype=torch.bool)
    for d in range(depth + 1):                                            # own branch, depths 0..depth
        s = p + k + 1 + d * b
        mask[:, s : s + b] = eye
    return mask


def causal_mask(start: int, q_len: int) -> torch.Tensor:
    """[q_len, start+q_len] block of an extend: token i (at slot start+i) sees slots <= start+i."""
    cols = torch.arange(start + q_len)
    rows = torch.arange(start, start + q_len)
    return cols[None, :] <= rows[:, None]


def flatten_masks(blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request [q_i, kv_i] blocks -> (flat bool [sum q_i*kv_i], mask_indptr int32 [N+1]).

    This is the unpacked ``custom_mask`` FlashInfer's batch-prefill ``plan`` takes (it bit-packs
    it itself, little bit order, segment by segment)."""
    sizes = torch.tensor([0] + [blk.numel() for blk in blocks], dtype=torch.int64)
    flat = torch.cat([blk.reshape(-1) for blk in blocks]) if blocks else torch.zeros(0, dtype=torch.bool)
    return flat, torch.cumsum(sizes, 0).to(torch.int32)


def flat_to_dense(flat: torch.Tensor, q_lens: Sequence[int], kv_lens: Sequence[int],
                  pad_rows_attend_first: bool = True) -> torch.Tensor:
    """FlashInfer-layout flat mask -> padded dense bool [N, max_q, max_kv] for SDPA.

    Padding columns (kv >= kv_len) are False.  Padding rows (q >= q_len) attend to column 0 only when
    `pad_rows_attend_first`, so SDPA never sees an all-masked row (which would give NaN); their
    outputs are discarded by the caller."""
    n = len(q_lens)
    need = sum(ql * kl for ql, kl in zip(q_lens, kv_lens))
    if need != flat.numel():
        raise ValueError(f"flat mask has {flat.numel()} entries, lengths describe {need}")
    mq, mk = max(q_lens, default=0), max(kv_lens, default=0)
    dense = torch.zeros(n, mq, mk, dtype=torch.bool, device=flat.device)
    off = 0
    for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        dense[r, :ql, :kl] = flat[off : off + ql * kl].view(ql, kl)
        off += ql * kl
        if pad_rows_attend_first and ql < mq:
            dense[r, ql:, 0] = True
    return dense
