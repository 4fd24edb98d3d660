"""Greedy prompt lookup over the draft model's choices (saguaro/lookup.py has the rule and why).

Used wherever the draft model picks a greedy row's next token: each depth of the cache build's tree and
each step of the just-in-time backup (sync mode's drafting included).  A row's context is its request's
committed tokens plus the speculative tokens before it in its branch (``extra``); the n-gram index is the
request's own (RequestState.ngram, shared with the fast backup) over the committed tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_ssd.draft.state import RequestState
from sglang_ssd.saguaro.lookup import lookup_from_env, take_copy

class GreedyLookup:
    """Replaces a greedy row's draft token by the n-gram copy when the rule says so; counts both."""

    def __init__(self, setting: Optional[tuple[int, float]] = None, from_env: bool = True):
        self.setting = setting if setting is not None or not from_env else lookup_from_env()
        self.rows = 0     # greedy rows looked at
        self.copies = 0   # rows whose token became the copy (and differed from the draft's)
        self.guesses = 0  # bonus guesses of the cache build replaced by the copy (build.py)

    @property
    def on(self) -> bool:
        return self.setting is not None

    def guess(self, st: RequestState, extra: Sequence[int]) -> Optional[int]:
        """The copy after a greedy row's committed tokens + extra when its match is long enough, else None:
        a bonus-token guess for the cache (the build puts it in place of its last draft guess)."""
        if self.setting is None or st.temperature > 0:
            return None
        n, tok = st.ngram_index().match_tail(extra)
        return tok if n >= self.setting[0] else None

    def apply(self, states: Sequence[RequestState], extras: Sequence[Sequence[int]], logits: torch.Tensor,
              tokens: torch.Tensor) -> torch.Tensor:
        """states / extras: per row; logits [n, W] (the draft's, over its columns); tokens [n] long vocabulary
        ids the draft chose (argmax for greedy rows).  -> tokens, greedy rows possibly replaced (a new
        tensor when any is)."""
        if self.setting is None:
            return tokens
        min_n, max_p = self.setting
        rows, copies, ns = [], [], []
        for i, (st, extra) in enumerate(zip(states, extras)):
            if st.temperature > 0:
                continue
            self.rows += 1
            n, tok = st.ngram_index().match_tail(extra)
            if n >= min_n and tok != int(tokens[i]):
                rows.append(i)
                copies.append(tok)
                ns.append(n)
        if not rows:
            return tokens
        idx = torch.as_tensor(rows, device=logits.device)
        top_p = torch.softmax(logits.index_select(0, idx).float(), dim=-1).amax(dim=-1).cpu()
        take = take_copy(torch.as_tensor(ns), top_p, min_n, max_p)
        if not bool(take.any()):
            return tokens
        out = tokens.clone()
        sel = take.nonzero().squeeze(-1)
        out[torch.as_tensor(rows)[sel].to(out.device)] = torch.as_tensor(copies)[sel].to(out.device, out.dtype)
        self.copies += int(sel.numel())
        return out
