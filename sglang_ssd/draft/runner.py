"""DraftRunner: one batched forward of the draft model over a ragged list of per-request work items.

Every item says which tokens to run, at which RoPE positions, into which KV slots of its request's
cache they go, which slots they may see (explicit mask) and how many trailing rows need logits.
Extends (prefill, glue, just-in-time decode) and tree depths are all just items.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_ssd.draft.attention import AttnSeq, BatchAttention
from sglang_ssd.draft.kv_cache import RequestKV
from sglang_ssd.draft.model import CausalLM, load_model
from sglang_ssd.draft.tree import causal_mask

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardItem:
    kv: RequestKV
    tokens: torch.Tensor      # [q] long
    positions: torch.Tensor   # [q] long (RoPE)
    slots: torch.Tensor       # [q] long (KV slots written)
    kv_len: int               # attend to slots [0, kv_len)
    mask: torch.Tensor        # bool [q, kv_len]
    n_logits: int = 1         # logits for the last n_logits rows

    @classmethod
    def extend(cls, kv: RequestKV, tokens: Sequence[int], start: int, n_logits: int = 1) -> "ForwardItem":
        """Causal extend: tokens at slots = positions start..start+q-1, each seeing every slot up to itself."""
        q = len(tokens)
        idx = torch.arange(start, start + q)
        return cls(kv, torch.as_tensor(list(tokens), dtype=torch.long), idx, idx, start + q,
                   causal_mask(start, q), n_logits)


class DraftRunner:
    def __init__(self, model: CausalLM, device: str | torch.device = "cpu"):
        self.model = model
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.dtype = model.model.embed_tokens.weight.dtype
        self.forward_calls = 0
        self.forward_tokens = 0

    @classmethod
    def from_dir(cls, model_dir: str, device: str = "cpu", dtype: str | torch.dtype = "float32") -> "DraftRunner":
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        return cls(load_model(model_dir, device, dt), device)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_kv(self, capacity: int = 64) -> RequestKV:
        c = self.cfg
        return RequestKV(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, capacity)

    @torch.no_grad()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """-> per item float32 logits [n_logits, V] of its last n_logits rows."""
        if not items:
            return []
        for it in items:
            it.kv.ensure(max(it.kv_len, int(it.slots.max()) + 1))
        dev = self.device
        ids = torch.cat([it.tokens for it in items]).to(dev)
        pos = torch.cat([it.positions for it in items]).to(dev)
        attn = BatchAttention([AttnSeq(it.kv, it.slots, it.kv_len, it.mask) for it in items], dev)
        hidden = self.model(ids, pos, attn)
        # only the rows that need logits go through the (large) LM head
        rows, off = [], 0
        for it in items:
            q = len(it.tokens)
            rows.append(torch.arange(off + q - it.n_logits, off + q))
            off += q
        logits = self.model.logits(hidden[torch.cat(rows).to(dev)])
        self.forward_calls += 1
        self.forward_tokens += off
        return list(torch.split(logits, [it.n_logits for it in items]))
