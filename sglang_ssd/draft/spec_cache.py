"""Speculation cache: (rid, k, bonus) -> K draft tokens (+ their proposal q) for the next round.

Built after a reply (during the verifier's forward) and consumed by the next Speculate of that
request: ``take`` returns the entry for the realised outcome and drops every other entry of the rid,
so an entry lives exactly one round.  Counts hits and misses per request and globally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class CachedSpec:
    tokens: torch.Tensor             # [K] long
    q16: Optional[torch.Tensor]      # [K, W] float16 wire q over the draft's columns (W = V for a full head), None for greedy


@dataclass
class _Round:
    index: dict[tuple[int, int], int]   # (k, bonus) -> branch row
    tokens: torch.Tensor                # [B, K]
    q16: Optional[torch.Tensor]         # [B, K, W]
    temperature: float


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    forced_misses: int = 0   # k = -1 (no previous speculation) or no cache built for the rid

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


@dataclass
class SpecCache:
    rounds: dict[str, _Round] = field(default_factory=dict)
    per_request: dict[str, Counters] = field(default_factory=dict)
    total: Counters = field(default_factory=Counters)

    def put(self, rid: str, keys: Sequence[tuple[int, int]], tokens: torch.Tensor,
            q16: Optional[torch.Tensor], temperature: float) -> None:
        """Replace rid's entries: keys[i] = (glue index j, bonus guess) owns tokens[i] (and q16[i])."""
        if len(keys) != tokens.shape[0] or (q16 is not None and q16.shape[0] != len(keys)):
            raise ValueError("keys, tokens and q16 disagree on the number of branches")
        index = {(int(j), int(b)): i for i, (j, b) in enumerate(keys)}
        if len(index) != len(keys):
            raise ValueError(f"duplicate cache keys for {rid}")
        self.rounds[rid] = _Round(index, tokens, q16, float(temperature))

    def take(self, rid: str, k: int, bonus: int, temperature: float) -> Optional[CachedSpec]:
        """Look up the realised outcome (k, bonus); always consumes rid's round.  None = miss.

        An entry built at another temperature (or without q when q is now needed) is a miss."""
        rnd = self.rounds.pop(rid, None)
        c = self.per_request.setdefault(rid, Counters())
        row = None if rnd is None or k < 0 else rnd.index.get((int(k), int(bonus)))
        if row is not None and rnd.temperature != float(temperature):
            row = None
        for cnt in (c, self.total):
            if row is not None:
                cnt.hits += 1
            else:
                cnt.misses += 1
                cnt.forced_misses += int(rnd is None or k < 0)
        if row is None:
            return None
        return CachedSpec(rnd.tokens[row], None if rnd.q16 is None else rnd.q16[row])

    def keys(self, rid: str) -> list[tuple[int, int]]:
        rnd = self.rounds.get(rid)
        return [] if rnd is None else list(rnd.index)

    def peek(self, rid: str, k: int, bonus: int) -> Optional[CachedSpec]:
        """Read an entry without consuming or counting (tests, debugging)."""
        rnd = self.rounds.get(rid)
        row = None if rnd is None else rnd.index.get((int(k), int(bonus)))
        if row is None:
            return None
        return CachedSpec(rnd.tokens[row], None if rnd.q16 is None else rnd.q16[row])

    def drop(self, rid: str) -> None:
        self.rounds.pop(rid, None)
        self.per_request.pop(rid, None)

    def clear(self) -> None:
        self.rounds.clear()
        self.per_request.clear()

    def num_entries(self) -> int:
        return sum(len(r.index) for r in self.rounds.values())

    def nbytes(self) -> int:
        return sum(r.tokens.numel() * 8 + (0 if r.q16 is None else r.q16.numel() * 2) for r in self.rounds.values())
