"""Features of a feature-conditioned (EAGLE-3) draft: what each KV slot hands to the position after it.

An EAGLE-3 head computes the token at slot t from the embedding of that token and the *feature* of slot
t - 1 (eagle3.py).  For committed positions the feature is the target's own (its aux hidden states,
sent by the worker with each Speculate and projected by the head's ``fc``); for positions the target
has not run yet it is the draft's own output at that slot.  ``FeatureBuffer`` holds one row per slot of
a request: target rows once they arrive (marked, never overwritten by a draft forward), else the output
of the last forward that wrote the slot, which the KV mirror (state.py) ties to the same context.

A forward can only use a parent's own output once that output exists, so ``split_extend`` cuts a
causal extend into passes: its leading rows whose parents are target-featured (or outside the forward)
run as one pass, the rest one row per pass (at most ``MAX_SEQUENTIAL`` of them: a longer featureless
run -- a request re-encoded after a reconnect, whose old features are gone -- uses the stale rows in
one pass; that costs draft quality only, never exactness, since q is always the distribution the
draft really sampled from).
"""

from __future__ import annotations

from typing import Optional

import torch

MAX_SEQUENTIAL = 16  # featureless extend rows computed one per pass before falling back to one pass


class FeatureBuffer:
    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device | str, capacity: int = 64):
        self.dim, self.dtype, self.device = dim, dtype, torch.device(device)
        self.h = torch.zeros(0, dim, dtype=dtype, device=self.device)
        self.target = torch.zeros(0, dtype=torch.bool, device=self.device)
        self.ensure(capacity)

    @property
    def capacity(self) -> int:
        return self.h.shape[0]

    def ensure(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = max(64, self.capacity)
        while cap < n:
            cap *= 2
        h = torch.zeros(cap, self.dim, dtype=self.dtype, device=self.device)
        t = torch.zeros(cap, dtype=torch.bool, device=self.device)
        h[: self.capacity], t[: self.capacity] = self.h, self.target
        self.h, self.target = h, t

    def gather(self, parents: torch.Tensor) -> torch.Tensor:
        """parents [q] slot indices (-1: none, slot 0's parent) -> features [q, D] (zeros for -1)."""
        out = self.h[parents.clamp(min=0)]
        return torch.where((parents >= 0)[:, None], out, torch.zeros_like(out))

    def store(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """The draft's own outputs at `slots`; rows holding a target feature keep it."""
        self.ensure(int(slots.max()) + 1)
        keep = ~self.target[slots]
        self.h[slots[keep]] = out[keep].to(self.dtype)

    def put_target(self, start: int, feats: torch.Tensor) -> None:
        """Projected target features [m, D] for positions start .. start + m - 1."""
        m = feats.shape[0]
        self.ensure(start + m)
        self.h[start: start + m] = feats.to(self.dtype)
        self.target[start: start + m] = True

    def is_target(self, slot: int) -> bool:
        return 0 <= slot < self.capacity and bool(self.target[slot])

    def nbytes(self) -> int:
        return self.h.numel() * self.h.element_size() + self.target.numel()


def parents_of(slots: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Each row's parent slot: slot - 1 for a causal extend (mask None); for a tree row the nearest
    slot it attends to other than itself (its parent node, or the glue position it forks from)."""
    if mask is None:
        return slots - 1
    q, kv_len = mask.shape
    m = mask.clone()
    m[torch.arange(q), slots] = False
    idx = torch.arange(kv_len).expand(q, kv_len)
    return torch.where(m, idx, torch.full_like(idx, -1)).max(dim=1).values


def split_extend(feats: FeatureBuffer, start: int, q: int) -> list[tuple[int, int]]:
    """A causal extend of q rows at slots start.. -> [(first row, end row)] passes, in order: rows whose
    parent is target-featured or before `start` together, then each featureless-parent row alone."""
    r = 1
    while r < q and feats.is_target(start + r - 1):
        r += 1
    passes = [(0, r)]
    if q - r > MAX_SEQUENTIAL:  # a long featureless run: one pass over stale features (see the docstring)
        return [(0, q)]
    passes += [(i, i + 1) for i in range(r, q)]
    return passes
