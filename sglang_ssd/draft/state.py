"""Per-request draft state: the known context and which KV slots are valid for it.

KV validity is tracked by a mirror, not by case analysis: ``written[i]`` is the token whose key/value
sits in slot i, computed causally over ``written[:i]`` at position i.  Any slot i with
``written[:i+1] == seq[:i+1]`` is therefore reusable for a sequence ``seq``.  Scratch writes of the
speculation tree go to slots >= len(written) and never enter the mirror, so they can never be reused
by mistake; a forward that starts at slot s first truncates the mirror to s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from sglang_ssd.draft.kv_cache import RequestKV
from sglang_ssd.saguaro.ngram import NgramIndex

NGRAM_MAX_N, NGRAM_MIN_N = 4, 1  # the request's n-gram index (fast / hybrid backup, greedy lookup)


@dataclass
class RequestState:
    rid: str
    tokens: list[int]                         # C: all known tokens; tokens[-1] is the root
    kv: RequestKV
    temperature: float = 0.0
    saguaro_c: float = 1.0                    # Saguaro sampling C for this request's proposals
    written: list[int] = field(default_factory=list)
    kv_valid: int = 0                         # == common_prefix(written, tokens), kept incrementally
    last_spec: Optional[list[int]] = None     # the K tokens last sent for this rid
    last_hit: bool = False                    # did last_spec come from the cache?
    rounds: int = 0
    ngram: Optional[NgramIndex] = None        # n-gram index over `tokens` (built lazily: ngram_index())
    cache_fan: Optional[list[int]] = None     # fan-out per k of the cache last built for this request

    # --- context ---------------------------------------------------------------------------
    def advance(self, k: int, bonus: int) -> None:
        """Outcome of the last speculation: k accepted (-1: none sent) then `bonus`."""
        if k >= 0:
            assert self.last_spec is not None and k <= len(self.last_spec)
            self.tokens.extend(self.last_spec[:k])
        self.tokens.append(int(bonus))
        self.kv_valid = self.valid_prefix(self.tokens)
        self.rounds += 1

    def valid_prefix(self, seq: Sequence[int]) -> int:
        """Number of leading slots whose KV is correct for `seq` (seq must extend self.tokens[:kv_valid])."""
        i = min(self.kv_valid, len(seq))
        n = min(len(self.written), len(seq))
        while i < n and self.written[i] == seq[i]:
            i += 1
        return i

    # --- bookkeeping around forwards -------------------------------------------------------
    def begin_write(self, start: int) -> None:
        """Slots >= start are about to be overwritten: forget them before the forward runs."""
        self.invalidate_from(start)

    def invalidate_from(self, slot: int) -> None:
        """Slots >= slot must be computed again (an EAGLE-3 draft got the target's features for the
        positions before them); the next forward that needs them re-extends from there."""
        del self.written[slot:]
        self.kv_valid = min(self.kv_valid, slot)

    def end_write(self, tokens: Sequence[int]) -> None:
        """The forward that began at len(written) wrote `tokens` there."""
        self.written.extend(int(t) for t in tokens)
        self.kv_valid = self.valid_prefix(self.tokens)

    def ngram_index(self) -> NgramIndex:
        """The request's n-gram index, brought up to its tokens (contexts only grow: a new prefill makes a
        new state)."""
        if self.ngram is None:
            self.ngram = NgramIndex(NGRAM_MAX_N, NGRAM_MIN_N)
        self.ngram.extend(self.tokens[len(self.ngram):])
        return self.ngram

    @property
    def root_slot(self) -> int:
        return len(self.tokens) - 1
