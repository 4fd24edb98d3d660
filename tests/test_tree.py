"""Tree layout, positions and masks against a brute-force token-graph construction."""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft.tree import (causal_mask, flat_to_dense, flatten_masks, fork_indices, tree_kv_len,
                                   tree_mask, tree_positions, tree_slots)


def brute_force(p: int, k: int, fan_out: list[int], depth: int):
    """Build the token graph explicitly: node = (slot, position, parent slot); visibility = ancestors."""
    parent, pos = {}, {}
    for s in range(p + k + 1):                     # prefix + glue form one causal chain
        parent[s], pos[s] = (s - 1 if s else None), s
    forks = [j for j, f in enumerate(fan_out) for _ in range(f)]
    b = len(forks)
    for d in range(depth + 1):
        for i, j in enumerate(forks):
            s = p + k + 1 + d * b + i
            parent[s] = (p + j) if d == 0 else (s - b)   # depth 0 hangs off glue slot j
            pos[s] = pos[parent[s]] + 1
    kv_len = p + k + 1 + (depth + 1) * b
    mask = torch.zeros(b, kv_len, dtype=torch.bool)
    rows_pos = []
    for i in range(b):
        s = p + k + 1 + depth * b + i
        rows_pos.append(pos[s])
        while s is not None:                       # a token sees itself and all its ancestors
            mask[i, s] = True
            s = parent[s]
    return mask, torch.tensor(rows_pos)


CASES = [(0, 1, [1, 1]), (5, 3, [2, 2, 2, 2]), (7, 4, [3, 0, 2, 1, 2]), (1, 2, [0, 0, 4]), (12, 5, [6, 5, 4, 3, 2, 4])]


@pytest.mark.parametrize("p,k,fan_out", CASES)
def test_mask_and_positions_match_brute_force(p, k, fan_out):
    forks = fork_indices(fan_out)
    b = len(forks)
    for depth in range(k):
        want_mask, want_pos = brute_force(p, k, fan_out, depth)
        assert torch.equal(tree_mask(p, k, forks, depth), want_mask)
        assert torch.equal(tree_positions(p, forks, depth), want_pos)
        assert tree_kv_len(p, k, b, depth) == want_mask.shape[1]
        slots = tree_slots(p, k, b, depth)
        assert slots.tolist() == [p + k + 1 + depth * b + i for i in range(b)]
        # every query row sees exactly prefix + glue 0..j + its own depth+1 tree tokens
        m = tree_mask(p, k, forks, depth)
        assert m.sum(1).tolist() == [p + j + 1 + depth + 1 for j in forks]
        # a row's own slot is visible (needed: the token attends to itself)
        assert m[torch.arange(b), slots].all()


def test_fork_indices_order():
    assert fork_indices([2, 1, 0, 1]) == [0, 0, 1, 3]
    assert fork_indices([0, 0]) == []


def test_causal_mask():
    m = causal_mask(3, 2)
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]


def test_flatten_matches_flashinfer_layout():
    """FlashInfer custom_mask: per request row-major [qo_len, kv_len], concatenated; mask_indptr = cumsum."""
    p_list, k = [4, 0, 9], 2
    fans = [[1, 1, 1], [2, 0, 1], [0, 3, 1]]
    blocks = [tree_mask(p, k, fork_indices(f), 1) for p, f in zip(p_list, fans)]
    flat, indptr = flatten_masks(blocks)
    assert indptr.dtype == torch.int32
    assert indptr.tolist() == [0] + torch.cumsum(torch.tensor([b.numel() for b in blocks]), 0).tolist()
    for r, blk in enumerate(blocks):
        q_len, kv_len = blk.shape
        seg = flat[indptr[r]: indptr[r + 1]]
        for qi in range(q_len):           # element (qi, kj) of request r sits at indptr[r] + qi*kv_len + kj
            for kj in range(kv_len):
                assert bool(seg[qi * kv_len + kj]) == bool(blk[qi, kj])


def test_flat_to_dense_padding():
    blocks = [causal_mask(2, 3), tree_mask(3, 1, [0, 1, 1], 0), causal_mask(0, 1)]
    flat, _ = flatten_masks(blocks)
    q_lens = [b.shape[0] for b in blocks]
    kv_lens = [b.shape[1] for b in blocks]
    dense = flat_to_dense(flat, q_lens, kv_lens)
    assert dense.shape == (3, max(q_lens), max(kv_lens))
    for r, blk in enumerate(blocks):
        ql, kl = blk.shape
        assert torch.equal(dense[r, :ql, :kl], blk)
        assert not dense[r, :ql, kl:].any()                  # padding columns masked
        assert dense[r, ql:, 0].all() and not dense[r, ql:, 1:].any()   # padding rows see col 0 only
    with pytest.raises(ValueError):
        flat_to_dense(flat[:-1], q_lens, kv_lens)


def test_dense_mask_sdpa_equals_per_request_attention():
    """Padded batched SDPA with the dense mask == SDPA per request on its own block."""
    torch.manual_seed(0)
    blocks = [tree_mask(3, 2, [0, 2, 2], 1), causal_mask(4, 2)]
    flat, _ = flatten_masks(blocks)
    q_lens, kv_lens = [b.shape[0] for b in blocks], [b.shape[1] for b in blocks]
    dense = flat_to_dense(flat, q_lens, kv_lens)
    h, d = 2, 4
    qs = [torch.randn(h, ql, d) for ql in q_lens]
    ks = [torch.randn(h, kl, d) for kl in kv_lens]
    vs = [torch.randn(h, kl, d) for kl in kv_lens]
    qp = torch.zeros(2, h, dense.shape[1], d)
    kp = torch.zeros(2, h, dense.shape[2], d)
    vp = torch.zeros_like(kp)
    for r in range(2):
        qp[r, :, : q_lens[r]], kp[r, :, : kv_lens[r]], vp[r, :, : kv_lens[r]] = qs[r], ks[r], vs[r]
    out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=dense[:, None])
    assert not out.isnan().any()
    for r in range(2):
        ref = torch.nn.functional.scaled_dot_product_attention(qs[r], ks[r], vs[r], attn_mask=blocks[r])
        torch.testing.assert_close(out[r, :, : q_lens[r]], ref)
