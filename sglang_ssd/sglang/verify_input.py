"""The verify input SGLang's TARGET_VERIFY forward reads, for a chain of n = K+1 tokens.

Subclassing ``NgramVerifyInput`` keeps the spec-input type inside SGLang's hard-coded
``is_verify_input()`` set; we only change the shape facts: a chain (``tree_topk == 1``) whose
accept path can be as long as the chain.
"""

from __future__ import annotations

import torch
from sglang.srt.speculative.ngram_info import NgramVerifyInput


class ChainVerifyInput(NgramVerifyInput):
    @property
    def tree_topk(self) -> int:
        return 1

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num


def build_chain_verify_input(chain: torch.Tensor, seq_lens: torch.Tensor) -> ChainVerifyInput:
    """chain: [bs, n] tokens (root first); seq_lens: [bs] committed KV lengths (root excluded)."""
    bs, n = chain.shape
    device = chain.device
    steps = torch.arange(n, device=device)
    positions = (seq_lens.to(torch.int64)[:, None] + steps).reshape(-1)
    # a chain as a degenerate tree: node j's only child is j+1, nobody has siblings
    retrieve_index = (torch.arange(bs, device=device)[:, None] * n + steps).to(torch.int64)
    next_token = torch.where(steps + 1 < n, steps + 1, -1).expand(bs, n).contiguous()
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    return ChainVerifyInput(
        draft_token=chain.reshape(-1), custom_mask=None, positions=positions,
        retrieve_index=retrieve_index, retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling, draft_token_num=n, new_seq_lens=seq_lens,
    )
