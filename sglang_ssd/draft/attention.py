"""Masked attention over per-request KV caches for one ragged batch (the CPU / SDPA path).

A batch is N requests; request r contributes q_len_r query tokens (rows [off_r, off_r + q_len_r) of
the token-flat tensors), writes their K/V into its own cache at explicit ``slots``, and attends to
its slots [0, kv_len_r) through an explicit boolean mask block [q_len_r, kv_len_r].  The blocks go
through the FlashInfer flat layout (tree.flatten_masks) and back to a padded dense mask
(tree.flat_to_dense), so a FlashInfer backend could consume the very same mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang_ssd.draft.kv_cache import RequestKV
from sglang_ssd.draft.tree import causal_mask, flat_to_dense, flatten_masks


@dataclass
class AttnSeq:
    kv: RequestKV
    slots: torch.Tensor   # [q_len] long: where this request's new K/V go
    kv_len: int           # attend to slots [0, kv_len)
    mask: Optional[torch.Tensor]  # bool [q_len, kv_len]; None: causal extend at slots kv_len-q..kv_len-1

    def full_mask(self) -> torch.Tensor:
        """The explicit block (a causal extend's is built here, only by the paths that need one)."""
        if self.mask is not None:
            return self.mask
        q = len(self.slots)
        return causal_mask(self.kv_len - q, q)


# On CUDA, SDPA's cuDNN backend builds a plan for every new shape: a growing KV cache makes every
# forward a new shape, which cost 36-50 ms per call on the H200 (torch 2.11) against 0.25-0.3 ms
# without cuDNN (results/gpu_draft_check.md). Flash / memory-efficient take no mask with GQA, so math
# runs there; on a GPU the draft's own path is FlashInfer, this is its fallback.
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q, k, v, mask):
    """F.scaled_dot_product_attention with a boolean mask and GQA, never on cuDNN."""
    if q.is_cuda:
        with sdpa_kernel(_NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class BatchAttention:
    """Callable passed to CausalLM.forward: writes K/V, then runs SDPA with the explicit mask."""

    def __init__(self, seqs: Sequence[AttnSeq], device: torch.device):
        self.seqs = list(seqs)
        self.q_lens = [len(s.slots) for s in self.seqs]
        self.kv_lens = [s.kv_len for s in self.seqs]
        self.offsets = [0]
        for n in self.q_lens:
            self.offsets.append(self.offsets[-1] + n)
        self.slots = [s.slots.to(device) for s in self.seqs]
        masks = [s.full_mask() for s in self.seqs]
        for m, s, ql in zip(masks, self.seqs, self.q_lens):
            if tuple(m.shape) != (ql, s.kv_len):
                raise ValueError(f"mask {tuple(m.shape)} != (q_len, kv_len) = ({ql}, {s.kv_len})")
        flat, _ = flatten_masks(masks)
        # [N, 1, max_q, max_kv]: broadcast over heads
        self.mask = flat_to_dense(flat.to(device), self.q_lens, self.kv_lens).unsqueeze(1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for s, slots, a, b in zip(self.seqs, self.slots, self.offsets, self.offsets[1:]):
            s.kv.write(layer, slots, k[a:b], v[a:b])
        if len(self.seqs) == 1:  # no padding: attend straight over the cache view
            kc, vc = self.seqs[0].kv.view(layer, self.kv_lens[0])
            o = sdpa(q.transpose(0, 1)[None], kc[None].to(q.dtype), vc[None].to(q.dtype), self.mask)
            return o[0].transpose(0, 1)
        n, h, d = len(self.seqs), q.shape[1], q.shape[2]
        mq, mk = self.mask.shape[-2:]
        hkv = k.shape[1]
        qp = q.new_zeros(n, h, mq, d)
        kp = q.new_zeros(n, hkv, mk, d)
        vp = q.new_zeros(n, hkv, mk, d)
        for r, (s, a, b) in enumerate(zip(self.seqs, self.offsets, self.offsets[1:])):
            qp[r, :, : b - a] = q[a:b].transpose(0, 1)
            kc, vc = s.kv.view(layer, s.kv_len)
            kp[r, :, : s.kv_len] = kc
            vp[r, :, : s.kv_len] = vc
        # softmax(q k^T / sqrt(d) + (mask ? 0 : -inf)) v, GQA: kv head = q head // (H / Hkv)
        o = sdpa(qp, kp, vp, self.mask)
        return torch.cat([o[r, :, : b - a].transpose(0, 1)
                          for r, (a, b) in enumerate(zip(self.offsets, self.offsets[1:]))])
