"""Batch-size aware choice of the backup speculator: neural (JIT draft) vs fast (n-gram / random).

Corollary 16 form (notes 2.8): with batch b a round is a hit round only if all b rows hit
(probability x = p_hit^b); one miss stalls the synchronous verify for the backup latency:

    speedup(b) = [p E_hit + (1 - p) E_miss] / [x max(1, T_p) + (1 - x)(1 + T_b)]

T_p, T_b are latencies relative to one verify.  Write N_n, N_f for the numerators with the neural
and fast E_miss, m = max(1, T_p), G = N_f (1 + T_n) - N_n (1 + T_f), Delta = N_n - N_f.  Fast beats
neural iff N_f (x m + (1-x)(1+T_n)) > N_n (x m + (1-x)(1+T_f)), i.e.

    h(x) = (1 - x) G - x m Delta = G - x (G + m Delta) > 0.

h is linear in x and x = p^b is monotone in b, so the set of b where fast wins is an interval
ending (or starting) at the threshold; in the usual case (Delta > 0, G > 0) fast wins exactly for

    b > b* = ln(G / (G + m Delta)) / ln p_hit,

and if G <= 0 (latency saving smaller than the token loss) neural always wins.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

CHOICES = ("neural", "fast")


def expected_speedup(p_hit: float, e_hit: float, e_miss: float, t_p: float, t_b: float, b: int = 1) -> float:
    """Corollary 16: expected tokens per round / expected round latency (verify = 1)."""
    x = p_hit**b
    return (p_hit * e_hit + (1.0 - p_hit) * e_miss) / (x * max(1.0, t_p) + (1.0 - x) * (1.0 + t_b))


def _h(x: float, p_hit: float, e_hit: float, e_miss_neural: float, e_miss_fast: float,
       t_p: float, t_b_neural: float, t_b_fast: float) -> float:
    """h(x) > 0 iff fast beats neural at all-hit probability x (see module doc)."""
    n_n = p_hit * e_hit + (1.0 - p_hit) * e_miss_neural
    n_f = p_hit * e_hit + (1.0 - p_hit) * e_miss_fast
    g = n_f * (1.0 + t_b_neural) - n_n * (1.0 + t_b_fast)
    return g - x * (g + max(1.0, t_p) * (n_n - n_f))


def critical_batch_threshold(p_hit: float, e_hit: float, e_miss_neural: float, e_miss_fast: float,
                             t_p: float, t_b_neural: float, t_b_fast: float) -> Optional[float]:
    """Real-valued b* = ln(G / (G + m Delta)) / ln p (fast wins for b > b*), or None when the closed
    form does not apply (G <= 0, Delta <= 0, p_hit not in (0, 1))."""
    n_n = p_hit * e_hit + (1.0 - p_hit) * e_miss_neural
    n_f = p_hit * e_hit + (1.0 - p_hit) * e_miss_fast
    g = n_f * (1.0 + t_b_neural) - n_n * (1.0 + t_b_fast)
    delta, m = n_n - n_f, max(1.0, t_p)
    if g <= 0 or delta <= 0 or not 0.0 < p_hit < 1.0:
        return None
    return math.log(g / (g + m * delta)) / math.log(p_hit)


def critical_batch_size(p_hit: float, e_hit: float, e_miss_neural: float, e_miss_fast: float,
                        t_p: float, t_b_neural: float, t_b_fast: float, b_max: int = 4096) -> Optional[int]:
    """Smallest integer b in [1, b_max] at which fast strictly beats neural; None if none.

    Evaluated on h(p^b) directly (exact w.r.t. the model, any sign pattern): h is monotone in b,
    so either b = 1 wins, or a binary search finds the first winning b, or none wins."""
    args = (p_hit, e_hit, e_miss_neural, e_miss_fast, t_p, t_b_neural, t_b_fast)
    wins = lambda b: _h(p_hit**b, *args) > 0.0  # noqa: E731
    if wins(1):
        return 1
    if not wins(b_max):
        return None
    lo, hi = 1, b_max  # wins(lo) False, wins(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


class _Ema:
    """Running mean that starts as a prior worth `prior_n` observations and becomes an EMA:
    step size max(alpha, 1 / (n + prior_n)), alpha = 1 - 2^{-1/half_life}."""

    def __init__(self, prior: float, prior_n: float, half_life: float):
        self.value, self.n, self.prior_n = float(prior), 0, prior_n
        self.alpha = 1.0 - 2.0 ** (-1.0 / half_life)

    def update(self, x: float) -> None:
        self.n += 1
        self.value += max(self.alpha, 1.0 / (self.n + self.prior_n)) * (x - self.value)


class BackupPolicy:
    """Chooses "neural" or "fast" per round from running estimates of the Corollary-16 inputs.

    override: "auto" (model-based), or "neural" / "fast" to force.  Hysteresis: the current choice
    only changes when the other one is predicted faster by more than `margin` (relative) and at
    least `min_dwell` rounds passed since the last switch.  Quantities of a backup kind are only
    measured while it is in use; until then its priors stand (fast: E_miss = 1 token, T_b = 0).

    Exploration (explore_min_batch set): a kind that has never served a miss is tried for min_dwell
    rounds once the first kind has served min_dwell rounds and a batch of at least explore_min_batch
    comes, and the kind not in use is
    re-tried after reexplore_every rounds without a switch.  Without it the pessimistic prior
    E_miss = 1 of the fast kind is never corrected: on the CPU pair "auto" stayed neural although
    fast was 1-19% faster at b = 2-8 (results/variants_backup_kind.md).
    """

    def __init__(self, override: str = "auto", margin: float = 0.03, min_dwell: int = 32,
                 half_life: float = 200.0, prior_n: float = 5.0, p_hit: float = 0.5, e_hit: float = 3.0,
                 e_miss_neural: Optional[float] = None, e_miss_fast: float = 1.0, t_p: float = 0.5,
                 t_b_neural: float = 0.5, t_b_fast: float = 0.0, initial: str = "neural",
                 explore_min_batch: Optional[int] = None, reexplore_every: int = 2048):
        self.set_override(override)
        self.explore_min_batch, self.reexplore_every = explore_min_batch, reexplore_every
        if initial not in CHOICES:
            raise ValueError(f"initial must be one of {CHOICES}, got {initial!r}")
        self.margin, self.min_dwell = margin, min_dwell
        ema = lambda v: _Ema(v, prior_n, half_life)  # noqa: E731
        self.p_hit, self.e_hit, self.t_p = ema(p_hit), ema(e_hit), ema(t_p)
        self.e_miss = {"neural": ema(e_hit if e_miss_neural is None else e_miss_neural), "fast": ema(e_miss_fast)}
        self.t_b = {"neural": ema(t_b_neural), "fast": ema(t_b_fast)}
        self.current, self.rounds, self._last_switch = initial, 0, -(10**9)

    def set_override(self, override: str) -> None:
        if override not in ("auto",) + CHOICES:
            raise ValueError(f"override must be 'auto', 'neural' or 'fast', got {override!r}")
        self.override = override

    def observe_round(self, *, from_cache: Sequence[bool], accept_lens: Sequence[int], backup: str,
                      t_verify: float, t_build: Optional[float] = None, t_backup: Optional[float] = None) -> None:
        """One verified batch.  from_cache[i]: row i's speculation came from the cache;
        accept_lens[i]: tokens it emitted (accepted drafts + bonus); backup: the kind that served
        this round's misses; t_verify: verify latency; t_build: the draft's cache build time;
        t_backup: backup latency on the critical path (only used if some row missed)."""
        if backup not in CHOICES:
            raise ValueError(f"backup must be one of {CHOICES}, got {backup!r}")
        if len(from_cache) != len(accept_lens) or not from_cache or t_verify <= 0:
            raise ValueError("need a non-empty batch with matching lengths and t_verify > 0")
        self.rounds += 1
        hits = [n for h, n in zip(from_cache, accept_lens) if h]
        misses = [n for h, n in zip(from_cache, accept_lens) if not h]
        self.p_hit.update(len(hits) / len(from_cache))
        if hits:
            self.e_hit.update(sum(hits) / len(hits))
        if misses:
            self.e_miss[backup].update(sum(misses) / len(misses))
            if t_backup is not None:
                self.t_b[backup].update(t_backup / t_verify)
        if t_build is not None:
            self.t_p.update(t_build / t_verify)

    def inputs(self) -> dict[str, float]:
        return {"p_hit": self.p_hit.value, "e_hit": self.e_hit.value,
                "e_miss_neural": self.e_miss["neural"].value, "e_miss_fast": self.e_miss["fast"].value,
                "t_p": self.t_p.value, "t_b_neural": self.t_b["neural"].value, "t_b_fast": self.t_b["fast"].value}

    def speedups(self, batch_size: int) -> dict[str, float]:
        i = self.inputs()
        return {kind: expected_speedup(i["p_hit"], i["e_hit"], i[f"e_miss_{kind}"], i["t_p"], i[f"t_b_{kind}"],
                                       batch_size) for kind in CHOICES}

    def choose(self, batch_size: int) -> str:
        """Backup kind for a round of this batch size (updates the hysteresis state)."""
        if self.override != "auto":
            return self.override
        s = self.speedups(batch_size)
        other = "fast" if self.current == "neural" else "neural"
        since = self.rounds - self._last_switch
        dwell_ok = since >= self.min_dwell
        # explore only once the kind in use has served min_dwell rounds (it is measured first)
        if (self.explore_min_batch is not None and batch_size >= self.explore_min_batch and dwell_ok
                and self.rounds >= self.min_dwell and (self.e_miss[other].n == 0 or since >= self.reexplore_every)):
            logger.info("backup %s -> %s at batch %d: exploring (%s)", self.current, other, batch_size,
                        "never measured" if self.e_miss[other].n == 0 else f"not tried for {since} rounds")
            self.current, self._last_switch = other, self.rounds
        elif dwell_ok and s[other] > s[self.current] * (1.0 + self.margin):
            logger.info("backup %s -> %s at batch %d (predicted speedup %.3f vs %.3f)",
                        self.current, other, batch_size, s[other], s[self.current])
            self.current, self._last_switch = other, self.rounds
        return self.current

    def report(self, batch_size: Optional[int] = None) -> dict[str, Any]:
        i = self.inputs()
        out: dict[str, Any] = dict(i, override=self.override, current=self.current, rounds=self.rounds,
                                   critical_batch_size=critical_batch_size(**i))
        if batch_size is not None:
            out["speedups"] = self.speedups(batch_size)
        return out
