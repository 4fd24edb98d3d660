"""Prompt lookup over the draft model's choices (saguaro/lookup.py has the rules and why).

Used wherever the draft model picks a row's next token: each depth of the cache build's tree and each step
of the just-in-time backup (sync mode's drafting included).  Greedy rows: ``apply`` after the argmax.
Sampled rows: ``mix_cols`` before the draw (sampling.sample_rows mixes q with the copy).  A row's context is its request's
committed tokens plus the speculative tokens before it in its branch (``extra``); the n-gram index is the
request's own (RequestState.ngram, shared with the fast backup) over the committed tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_ssd.draft.state import RequestState
from sglang_ssd.saguaro.lookup import lookup_from_env, mix_from_env, take_copy


class Lookup:
    """Replaces a greedy row's draft token by the n-gram copy when the rule says so, and gives sampled rows
    their copy column for the mixture; counts what it did."""

    def __init__(self, setting: Optional[tuple[int, float]] = None, mix: Optional[tuple[int, float]] = None,
                 from_env: bool = True):
        self.setting = setting if setting is not None or not from_env else lookup_from_env()
        self.mix = mix if mix is not None or not from_env else mix_from_env()
        self.mixed = 0    # sampled rows drawn from a mixture with a copy
        self.rows = 0     # greedy rows looked at
        self.copies = 0   # rows whose token became the copy (and differed from the draft's)
        self.guesses = 0  # bonus guesses of the cache build replaced by the copy (build.py)

    @property
    def on(self) -> bool:
        return self.setting is not None or self.mix is not None

    def reads(self, states: Sequence[RequestState]) -> bool:
        """Whether any of these rows is one the lookup acts on (greedy rows under the greedy rule, sampled
        rows under the mixture): the callers build the rows' contexts only then."""
        return any((self.mix if st.temperature > 0 else self.setting) is not None for st in states)

    def mix_cols(self, states: Sequence[RequestState], extras: Sequence[Sequence[int]],
                 to_cols) -> Optional[tuple[torch.Tensor, float]]:
        """For sample_rows' mix: per row the copy's column (to_cols: token ids -> columns, -1 outside a
        reduced head) where a sampled row's match is long enough, else -1; None when no row has one."""
        if self.mix is None:
            return None
        min_n, w = self.mix
        cols, any_copy = [-1] * len(states), False
        for i, (st, extra) in enumerate(zip(states, extras)):
            if st.temperature <= 0:
                continue
            n, tok = st.ngram_index().match_tail(extra)
            if n >= min_n:
                cols[i], any_copy = tok, True
        if not any_copy:
            return None
        toks = torch.as_tensor(cols)
        c = to_cols(toks.clamp_min(0)).cpu()
        c = torch.where(toks >= 0, c, torch.full_like(c, -1))
        self.mixed += int((c >= 0).sum())
        return (c, w) if bool((c >= 0).any()) else None

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
