"""Prompt lookup over the draft model's choices (saguaro/lookup.py has the rules and why).

Used wherever the draft model picks a row's next token: each depth of the cache build's tree and each step
of the just-in-time backup (sync mode's drafting included).  Greedy rows: ``apply`` after the argmax.
Sampled rows: ``mix_cols`` before the draw (sampling.sample_rows mixes q with the copy).  A row's context is its request's
committed tokens plus the speculative tokens before it in its branch (``extra``); the n-gram index is the
request's own (RequestState.ngram, shared with the fast backup) over the committed tokens.  A draft shipped
with a datastore (saguaro/datastore.py: the target's usual continuation of long n-grams, from its own answers)
also lets an unsure greedy row take that continuation where the request's own lookup did not replace it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_ssd.draft.state import RequestState
from sglang_ssd.saguaro.datastore import Datastore
from sglang_ssd.saguaro.lookup import corpus_from_env, lookup_from_env, mix_from_env, take_copy


class Lookup:
    """Replaces a greedy row's draft token by the n-gram copy when the rule says so, and gives sampled rows
    their copy column for the mixture; counts what it did."""

    def __init__(self, setting: Optional[tuple[int, float]] = None, mix: Optional[tuple[int, float]] = None,
                 from_env: bool = True, corpus: Optional[Datastore] = None, corpus_max_p: Optional[float] = None):
        self.setting = setting if setting is not None or not from_env else lookup_from_env()
        self.mix = mix if mix is not None or not from_env else mix_from_env()
        max_p = corpus_max_p if corpus_max_p is not None or not from_env else corpus_from_env()
        self.corpus = corpus if max_p is not None else None  # the datastore, None = no corpus rule
        self.corpus_max_p = max_p
        self.mixed = 0    # sampled rows drawn from a mixture with a copy
        self.rows = 0     # greedy rows looked at
        self.copies = 0   # rows whose token became the copy (and differed from the draft's)
        self.corpus_copies = 0  # rows whose token became the datastore's continuation
        self.guesses = 0  # bonus guesses of the cache build replaced by the copy (build.py)

    @property
    def on(self) -> bool:
        return self.setting is not None or self.mix is not None or self.corpus is not None

    def reads(self, states: Sequence[RequestState]) -> bool:
        """Whether any of these rows is one the lookup acts on (greedy rows under the greedy rule or the
        corpus rule, sampled rows under the mixture): the callers build the rows' contexts only then."""
        greedy = self.setting is not None or self.corpus is not None
        return any(self.mix is not None if st.temperature > 0 else greedy for st in states)

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
        tensor when any is): by the request's own copy under the greedy rule, else (the draft's token
        standing) by the datastore's continuation when the draft's top probability is below corpus_max_p."""
        if self.setting is None and self.corpus is None:
            return tokens
        rows, own, ns, corp = [], [], [], []
        for i, (st, extra) in enumerate(zip(states, extras)):
            if st.temperature > 0:
                continue
            self.rows += 1
            draft = int(tokens[i])
            n, tok = 0, -1  # the request's own copy, where it differs from the draft's token
            if self.setting is not None:
                n, tok = st.ngram_index().match_tail(extra)
                if n < self.setting[0] or tok == draft:
                    n, tok = 0, -1
            hit = self.corpus.next_token(st.tokens[-self.corpus.ns[0]:] + list(extra)) if self.corpus else None
            c = hit[1] if hit is not None and hit[1] != draft else -1  # the datastore's, likewise
            if tok >= 0 or c >= 0:
                rows.append(i)
                own.append(tok)
                ns.append(n)
                corp.append(c)
        if not rows:
            return tokens
        idx = torch.as_tensor(rows, device=logits.device)
        top_p = torch.softmax(logits.index_select(0, idx).float(), dim=-1).amax(dim=-1).cpu()
        own_t, corp_t = torch.as_tensor(own), torch.as_tensor(corp)
        take = (take_copy(torch.as_tensor(ns), top_p, self.setting[0], self.setting[1]) & (own_t >= 0)
                if self.setting is not None else torch.zeros(len(rows), dtype=torch.bool))
        take_c = ~take & (corp_t >= 0) & ((top_p < self.corpus_max_p) | (self.corpus_max_p >= 1.0)) \
            if self.corpus is not None else torch.zeros_like(take)
        if not bool((take | take_c).any()):
            return tokens
        out = tokens.clone()
        at = torch.as_tensor(rows)
        for sel, new in ((take, own_t), (take_c, corp_t)):
            sel = sel.nonzero().squeeze(-1)
            out[at[sel].to(out.device)] = new[sel].to(out.device, out.dtype)
        self.copies += int(take.sum())
        self.corpus_copies += int(take_c.sum())
        return out
