"""The verify input SGLang's TARGET_VERIFY forward reads, for a chain of n = K+1 tokens.

Subclassing ``NgramVerifyInput`` keeps the spec-input type inside SGLang's hard-coded
``is_verify_input()`` set; we only change the shape facts: a chain (``tree_topk == 1``) whose
accept path can be as long as the chain.

The attention mask depends on the backend:
* CPU (``torch_native``): ``custom_mask = None``; hooks.torch_native_chain_verify runs the verify as
  a causal extend, which is exactly a chain's mask.
* GPU (flashinfer, triton): SGLang 0.5.23's ``NgramVerifyInput.generate_attn_arg_prefill`` hands
  ``custom_mask`` to ``BatchPrefillWithPagedKVCacheWrapper.plan`` (non-causal, so without a mask
  every chain token would see the whole chain) and pads it for CUDA-graph batch padding -- it
  calls ``custom_mask.numel()``, so None crashes there.  ``chain_full_mask`` builds the FULL_MASK
  layout NGRAM's worker builds (per request n rows x (seq_len + n) columns, row-major, requests
  concatenated): the committed prefix is all True and the n x n block is lower-triangular.
* GPU (fa3 / fa4, SGLang's default on Hopper): causal for a chain, never reads the mask, so the
  worker does not build it there (``verify_reads_mask``).
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.speculative.ngram_info import NgramVerifyInput


class ChainVerifyInput(NgramVerifyInput):
    @property
    def tree_topk(self) -> int:
        return 1

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num


def chain_full_mask(seq_lens: torch.Tensor, n: int, seq_lens_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Flat bool FULL mask of a chain verify: request b's row j (its token at position L_b + j)
    sees columns c < L_b + j + 1 of its L_b + n.  Built on seq_lens' device; the sizes come from
    ``seq_lens_cpu`` when given, so no device-to-host sync is needed."""
    dev = seq_lens.device
    lens_host = (seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()).to(torch.int64)
    bs = lens_host.numel()
    total = int(((lens_host + n) * n).sum())
    lens = seq_lens.to(torch.int64)
    row_len = (lens + n).repeat_interleave(n)                                    # [bs*n] kv per row
    limit = (lens[:, None] + torch.arange(1, n + 1, device=dev)).reshape(-1)     # [bs*n] visible cols
    row_start = torch.cumsum(row_len, 0) - row_len
    row = torch.repeat_interleave(torch.arange(bs * n, device=dev), row_len, output_size=total)
    col = torch.arange(total, device=dev) - row_start[row]
    return col < limit[row]


def build_chain_verify_input(chain: torch.Tensor, seq_lens: torch.Tensor, full_mask: bool = False,
                             seq_lens_cpu: Optional[torch.Tensor] = None) -> ChainVerifyInput:
    """chain: [bs, n] tokens (root first); seq_lens: [bs] committed KV lengths (root excluded).
    full_mask: give GPU backends the chain's FULL custom mask (see the module docstring)."""
    bs, n = chain.shape
    device = chain.device
    steps = torch.arange(n, device=device)
    positions = (seq_lens.to(torch.int64)[:, None] + steps).reshape(-1)
    # a chain as a degenerate tree: node j's only child is j+1, nobody has siblings
    retrieve_index = (torch.arange(bs, device=device)[:, None] * n + steps).to(torch.int64)
    next_token = torch.where(steps + 1 < n, steps + 1, -1).expand(bs, n).contiguous()
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    mask = chain_full_mask(seq_lens, n, seq_lens_cpu) if full_mask else None
    return ChainVerifyInput(
        draft_token=chain.reshape(-1), custom_mask=mask, positions=positions,
        retrieve_index=retrieve_index, retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling, draft_token_num=n, new_seq_lens=seq_lens,
    )


# TARGET_VERIFY backends that never read spec_info.custom_mask for a chain (tree_topk 1): fa3 / fa4
# (FlashAttentionBackend: causal over seq_lens + n when topk <= 1, flashattention_backend.py) and
# torch_native (hooks.torch_native_chain_verify: causal).  Every other backend gets the mask.
MASK_FREE_VERIFY = ("FlashAttentionBackend", "TorchNativeAttnBackend")


def verify_reads_mask(attn_backend) -> bool:
    """Whether the target's TARGET_VERIFY attention reads the chain's FULL custom mask (building it costs
    about 17 bytes of temporaries per mask entry: ~130 MB per round at b = 48, 32k context, n = 5).
    A hybrid backend is resolved to the one it verifies with; an unknown backend is assumed to read it."""
    if attn_backend is None:
        return True
    select = getattr(attn_backend, "_select_backend", None)
    if callable(select):  # HybridAttnBackend: decode or prefill backend per speculative_attention_mode
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        attn_backend = select(ForwardMode.TARGET_VERIFY)
    if type(attn_backend).__name__ not in MASK_FREE_VERIFY:
        return True
    return (getattr(attn_backend, "topk", 0) or 0) > 1
