"""Online estimates of the acceptance rate a and the miss-model exponent r, and the fan-out planner.

Everything is kept per *source* of the speculation being verified: "primary" (it came from the
speculation cache, i.e. the previous lookup hit) or "backup" (the previous lookup missed and the
backup speculator produced it).  The two sources have different acceptance (a fast random backup
is almost always rejected at k = 0) and hence need different schedules F^p, F^b (notes 2.5, 5.4).

Forgetting: statistics are exponentially discounted, every observation of a source multiplies
that source's old ones by gamma = 2^{-1 / half_life} (half_life in observations of that source;
None = never forget).  Priors are
pseudo-counts that are NOT discounted, so they matter before data and fade as data arrives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from sglang_ssd.saguaro.topology import capped_geometric_pmf, geometric_fan_out, predicted_hit_rate

logger = logging.getLogger(__name__)

SOURCES = ("primary", "backup")


def _source(from_cache: bool) -> str:
    return "primary" if from_cache else "backup"


def _gamma(half_life: Optional[float]) -> float:
    if half_life is None:
        return 1.0
    if half_life <= 0:
        raise ValueError(f"half_life must be > 0 or None, got {half_life}")
    return 2.0 ** (-1.0 / half_life)


# ------------------------------------------------------------------------------------------ a
@dataclass
class _Counts:
    acc: float = 0.0  # discounted accepted drafts
    rej: float = 0.0  # discounted rejections
    rounds: float = 0.0


class AcceptanceEstimator:
    """MLE of the capped-geometric acceptance rate, with a Beta-like prior and forgetting.

    A round that accepted k drafts out of a usable cap m (m = K unless the chain was cut short)
    has likelihood a^k (1 - a)^{[k < m]}: k successes, then one failure unless it stopped at the
    cap.  Summing log-likelihoods over rounds, d/da = 0 gives the closed form

        a_hat = accepted / (accepted + rejections),

    here with pseudo-counts prior_weight * (prior_a, 1 - prior_a) added to both terms.
    """

    def __init__(self, k: int, prior_a: float = 0.6, prior_weight: float = 10.0,
                 half_life: Optional[float] = 500.0, prior_a_backup: Optional[float] = None):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.k = k
        self.prior = {"primary": float(prior_a),
                      "backup": float(prior_a if prior_a_backup is None else prior_a_backup)}
        for a in self.prior.values():
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"prior acceptance must be in [0, 1], got {a}")
        self.prior_weight = float(prior_weight)
        self.gamma = _gamma(half_life)
        self.counts = {s: _Counts() for s in SOURCES}

    def observe(self, k: int, from_cache: bool, cap: Optional[int] = None) -> None:
        """One verified row: k accepted drafts (0..cap), cap = usable drafts (default K)."""
        m = self.k if cap is None else min(int(cap), self.k)
        if not 0 <= k <= m:
            raise ValueError(f"accepted {k} outside [0, {m}]")
        c = self.counts[_source(from_cache)]
        c.acc, c.rej, c.rounds = c.acc * self.gamma, c.rej * self.gamma, c.rounds * self.gamma
        c.acc += k
        c.rej += 1.0 if k < m else 0.0  # stopping at the cap is not a rejection
        c.rounds += 1.0

    def estimate(self, from_cache: bool = True) -> float:
        s = _source(from_cache)
        c, a0, w = self.counts[s], self.prior[s], self.prior_weight
        num, den = c.acc + w * a0, c.acc + c.rej + w
        return num / den if den > 0 else a0

    def effective_rounds(self, from_cache: bool = True) -> float:
        return self.counts[_source(from_cache)].rounds


# ------------------------------------------------------------------------------------------ r
@dataclass
class _Bucket:
    n: float = 0.0       # discounted lookups at this fan-out
    misses: float = 0.0  # discounted misses


class MissRateEstimator:
    """Fit of the power-law miss model 1 - p_hit(F) = c F^{-r} (notes 2.4) per source.

    Per fan-out bucket F >= 1 the miss rate is smoothed with `pseudo_count` lookups at the prior
    curve, m_F = (misses + s c0 F^{-r0}) / (n + s), then y_F = log m_F is regressed on x_F = log F:

        y_F ~ log c - r x_F,     weight w_F = 1 / Var(log m_F) = n m_F / (1 - m_F)   (delta method)

    with independent Gaussian priors log c ~ N(log c0, sd_log_c^2), r ~ N(r0, sd_r^2): a 2x2
    weighted ridge solve (MAP).  With a single bucket (uniform fan-out) r is not identified by the
    data and stays near r0 while c adapts (the defaults make c the loosely known parameter,
    sd 1 in log space, and r the tighter one, sd 0.3); r is clamped to [r_min, r_max].
    """

    def __init__(self, prior_r: float = 1.0, prior_c: float = 1.0, sd_r: float = 0.3, sd_log_c: float = 1.0,
                 pseudo_count: float = 2.0, half_life: Optional[float] = 2000.0,
                 r_min: float = 0.05, r_max: float = 5.0):
        if prior_r <= 0 or prior_c <= 0 or sd_r <= 0 or sd_log_c <= 0:
            raise ValueError("prior_r, prior_c, sd_r, sd_log_c must be > 0")
        self.r0, self.c0, self.sd_r, self.sd_log_c = prior_r, prior_c, sd_r, sd_log_c
        self.pseudo_count = pseudo_count
        self.gamma = _gamma(half_life)
        self.r_min, self.r_max = r_min, r_max
        self.buckets: dict[str, dict[int, _Bucket]] = {s: {} for s in SOURCES}
        self._total = {s: _Bucket() for s in SOURCES}

    def observe(self, fan_out: int, hit: bool, from_cache: bool = True) -> None:
        """One lookup: fan_out = F cached guesses for the realised k, hit = whether it was found.

        F = 0 lookups are certain misses and carry no information about the curve; they only
        count towards the measured hit rate."""
        s = _source(from_cache)
        if self.gamma < 1.0:
            for b in self.buckets[s].values():
                b.n *= self.gamma
                b.misses *= self.gamma
            t = self._total[s]
            t.n, t.misses = t.n * self.gamma, t.misses * self.gamma
        self._total[s].n += 1.0
        self._total[s].misses += 0.0 if hit else 1.0
        if fan_out >= 1:
            b = self.buckets[s].setdefault(int(fan_out), _Bucket())
            b.n += 1.0
            b.misses += 0.0 if hit else 1.0

    def fit(self, from_cache: bool = True) -> tuple[float, float]:
        """-> (r, c) for the given source; the prior (r0, c0) before any data."""
        # Normal equations of  sum_F w_F (y_F - u + r x_F)^2 + (u - u0)^2/s_u^2 + (r - r0)^2/s_r^2
        # in theta = (u, r), u = log c.  Residual e = y - u + r x; d/du, d/dr give A theta = b.
        u0, lu, lr = math.log(self.c0), 1.0 / self.sd_log_c**2, 1.0 / self.sd_r**2
        a11, a12, a22, b1, b2 = lu, 0.0, lr, lu * u0, lr * self.r0
        for f, bk in self.buckets[_source(from_cache)].items():
            prior_m = min(1.0, self.c0 * f ** (-self.r0))
            m = (bk.misses + self.pseudo_count * prior_m) / (bk.n + self.pseudo_count)
            m = min(max(m, 1e-4), 1.0 - 1e-4)
            w = bk.n * m / (1.0 - m)
            x, y = math.log(f), math.log(m)
            # rows: u coefficient +1, r coefficient -x  (model y = u - r x)
            a11 += w
            a12 -= w * x
            a22 += w * x * x
            b1 += w * y
            b2 -= w * x * y
        det = a11 * a22 - a12 * a12
        u = (b1 * a22 - a12 * b2) / det
        r = (a11 * b2 - a12 * b1) / det
        return min(max(r, self.r_min), self.r_max), math.exp(u)

    def measured_hit_rate(self, from_cache: bool = True) -> Optional[float]:
        t = self._total[_source(from_cache)]
        return None if t.n <= 0 else 1.0 - t.misses / t.n


# ------------------------------------------------------------------------------------ planner
class FanOutPlanner:
    """Current Theorem-12 schedules (F^p, F^b), re-planned every `refresh_every` observations.

    Per verified row the caller reports ``observe(k, from_cache, hit, fan_out_at_k)``: the
    speculation it verified came from the cache (from_cache) or the backup, k drafts were
    accepted, and the next lookup with outcome k hit or missed in a cache built with fan_out_at_k
    guesses at k (the schedule of that row's source when the cache was built).
    """

    def __init__(self, budget: int, k: int, refresh_every: int = 256, f_max: Optional[int] = None,
                 acceptance: Optional[AcceptanceEstimator] = None, miss: Optional[MissRateEstimator] = None):
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        self.budget, self.k, self.f_max, self.refresh_every = budget, k, f_max, refresh_every
        self.acceptance = acceptance or AcceptanceEstimator(k)
        self.miss = miss or MissRateEstimator()
        self.observations = 0
        self._since_refresh = 0
        self._short: dict[tuple[bool, int], list[int]] = {}  # (from_cache, k < K) -> plan, until the next refresh
        self.refresh()

    def _plan(self, from_cache: bool) -> list[int]:
        r, _ = self.miss.fit(from_cache)
        return geometric_fan_out(self.budget, self.k, self.acceptance.estimate(from_cache), r, self.f_max)

    def refresh(self) -> None:
        self.fan_out_primary = self._plan(True)
        self.fan_out_backup = self._plan(False)
        self._short = {}
        self._since_refresh = 0
        logger.debug("fan-out re-planned: primary %s backup %s", self.fan_out_primary, self.fan_out_backup)

    def schedule(self, from_cache: bool) -> list[int]:
        """Fan-out to build the next cache with, for a row whose verified speculation was a hit."""
        return self.fan_out_primary if from_cache else self.fan_out_backup

    def schedules(self) -> tuple[list[int], list[int]]:
        return self.fan_out_primary, self.fan_out_backup

    def schedule_for(self, from_cache: bool, k: int) -> list[int]:
        """The schedule for a verify of k drafts: F_0..F_k over its k + 1 outcomes with the whole budget
        (the same fit of a and r, Theorem 12 with K = k); k >= K: ``schedule``.  A verify of fewer drafts
        than K (the worker's batch-size-aware k) has fewer outcomes to cover, not a smaller budget."""
        if k >= self.k:
            return self.schedule(from_cache)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        key = (bool(from_cache), int(k))
        if key not in self._short:
            r, _ = self.miss.fit(from_cache)
            self._short[key] = geometric_fan_out(self.budget, k, self.acceptance.estimate(from_cache), r, self.f_max)
        return self._short[key]

    def observe(self, k: int, from_cache: bool, hit: Optional[bool] = None,
                fan_out_at_k: Optional[int] = None, cap: Optional[int] = None) -> None:
        """hit None: no lookup followed (sync mode, finished request) -> acceptance only."""
        self.acceptance.observe(k, from_cache, cap)
        if hit is not None:
            f = self.schedule(from_cache)[k] if fan_out_at_k is None else fan_out_at_k
            self.miss.observe(f, hit, from_cache)
        self.observations += 1
        self._since_refresh += 1
        if self._since_refresh >= self.refresh_every:
            self.refresh()

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"budget": self.budget, "k": self.k, "observations": self.observations}
        for from_cache in (True, False):
            s = _source(from_cache)
            a = self.acceptance.estimate(from_cache)
            r, c = self.miss.fit(from_cache)
            sched = self.schedule(from_cache)
            out[s] = {
                "a": a, "r": r, "c": c, "fan_out": list(sched),
                "rounds": self.acceptance.effective_rounds(from_cache),
                "predicted_hit_rate": predicted_hit_rate(sched, capped_geometric_pmf(a, self.k), r, c),
                "measured_hit_rate": self.miss.measured_hit_rate(from_cache),
            }
        return out
