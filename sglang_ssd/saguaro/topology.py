"""Fan-out topology of the speculation cache: Theorem 12's capped geometric series (notes 2.5).

Model (notes 2.1, 2.4).  The verifier accepts k in {0..K} drafts with the capped geometric law

    P(k) = (1 - a) a^k  for k < K,      P(K) = a^K                      (a = a_p, i.i.d. acceptance)

and a cache holding F_k bonus guesses for outcome k hits with probability 1 - c F_k^{-r}.  With a
budget B = sum_k F_k the expected hit rate is

    H(F) = sum_k P(k) (1 - c F_k^{-r}).

Maximising H subject to sum_k F_k = B (Lagrange, continuous F): r c P(k) F_k^{-r-1} = lambda, so

    F_k  proportional to  P(k)^{1/(1+r)}
    =>  F_k = F_0 a^{k/(1+r)}                         for k < K
        F_K = F_0 a^{K/(1+r)} (1 - a)^{-1/(1+r)}      (the "cap": all-accepted outcome)

(c and lambda drop out, so the shape does not depend on c).  H is concave in F for r > 0, so this
stationary point is the global continuous optimum.  We compute the weights as P(k)^{1/(1+r)} in log
space, which covers the limits a -> 0 (all budget at k = 0), a -> 1 (all at k = K), r -> 0
(F proportional to P) and r -> inf (uniform) without special cases, then round to integers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

_SNAP = 1e-9  # continuous values this close to an integer are snapped before rounding


def capped_geometric_pmf(a: float, k: int) -> list[float]:
    """[P(0), .., P(K)]: P(j) = (1 - a) a^j for j < K, P(K) = a^K.  Sums to 1 for a in [0, 1]."""
    _check_a(a)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return [(1.0 - a) * a**j for j in range(k)] + [a**k]


def _check_a(a: float) -> None:
    if not (0.0 <= a <= 1.0):  # also rejects NaN
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")


def _log_weights(k: int, a: float, r: float) -> list[float]:
    """log P(j)^{1/(1+r)}; -inf where P(j) = 0."""
    e = 0.0 if math.isinf(r) else 1.0 / (1.0 + r)
    out = []
    for p in capped_geometric_pmf(a, k):
        if p <= 0.0:
            out.append(-math.inf)  # impossible outcome: no budget, for every r
        else:
            out.append(e * math.log(p))  # r = inf -> 0 for every possible outcome -> uniform
    return out


def geometric_fan_out_continuous(budget: float, k: int, a_p: float, r: float,
                                 f_max: Optional[float] = None) -> list[float]:
    """Continuous Theorem-12 allocation F_0..F_K summing to `budget`, each <= f_max if given.

    With a cap, water-filling: capped entries sit at f_max and the rest of the budget is shared by
    the others in proportion to their weights (the Lagrange condition restricted to the uncapped
    set, still the concave optimum).  If the uncapped entries all have weight 0 (e.g. a = 1 and
    f_max < B) the leftover is spread evenly over them.
    """
    if not (r >= 0.0):
        raise ValueError(f"r must be >= 0, got {r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    n = k + 1
    if f_max is not None and f_max * n < budget:
        raise ValueError(f"budget {budget} > f_max {f_max} * (K+1) {n}: cannot be allocated")
    lw = _log_weights(k, a_p, r)
    top = max(lw)
    w = [math.exp(x - top) if x > -math.inf else 0.0 for x in lw]  # max weight 1, no underflow trap
    x = [0.0] * n
    active, remaining = list(range(n)), float(budget)
    while active:
        total = sum(w[j] for j in active)
        for j in active:
            x[j] = remaining * w[j] / total if total > 0 else remaining / len(active)
        over = [j for j in active if f_max is not None and x[j] > f_max]
        if not over:
            break
        for j in over:  # pin to the cap and re-share what is left among the others
            x[j] = float(f_max)
            remaining -= f_max
            active.remove(j)
    return x


def round_largest_remainder(x: Sequence[float], total: int) -> list[int]:
    """Integers summing to exactly `total`: floor(x_j), then +1 to the largest fractional parts.

    Ties go to the lower index (sort key (-frac, j)), so the result is deterministic.  If x is
    non-increasing the result is too, and if every x_j <= some integer cap so is every result.
    """
    snapped = [float(round(v)) if abs(v - round(v)) < _SNAP else float(v) for v in x]
    out = [int(math.floor(v)) for v in snapped]
    rest = total - sum(out)
    if rest < 0 or rest > len(out):
        raise ValueError(f"values {list(x)} do not sum to {total}")
    order = sorted(range(len(out)), key=lambda j: (-(snapped[j] - out[j]), j))
    for j in order[:rest]:
        out[j] += 1
    return out


def geometric_fan_out(budget: int, k: int, a_p: float, r: float, f_max: Optional[int] = None) -> list[int]:
    """Integer Theorem-12 fan-out [F_0 .. F_K]: sum exactly `budget`, 0 <= F_j <= f_max.

    Largest-remainder rounding of ``geometric_fan_out_continuous``.  For a_p < 1 the entries
    j < K are non-increasing in j.  budget < K+1 leaves some F_j = 0 (outcomes never cached).
    """
    if int(budget) != budget or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget}")
    if f_max is not None and (int(f_max) != f_max or f_max < 0):
        raise ValueError(f"f_max must be a non-negative integer or None, got {f_max}")
    x = geometric_fan_out_continuous(budget, k, a_p, r, f_max)
    return round_largest_remainder(x, int(budget))


def uniform_fan_out(budget: int, k: int) -> list[int]:
    """B split over K+1 outcomes as evenly as possible; the first B mod (K+1) get one more."""
    if int(budget) != budget or budget < 0 or k < 0:
        raise ValueError(f"need budget >= 0 and k >= 0, got {budget}, {k}")
    q, m = divmod(int(budget), k + 1)
    return [q + (1 if j < m else 0) for j in range(k + 1)]


def predicted_hit_rate(fan_out: Sequence[float], accept_pmf: Sequence[float], r: float, c: float = 1.0) -> float:
    """sum_j P(j) clip(1 - c F_j^{-r}, 0, 1); an outcome with F_j = 0 never hits."""
    if len(fan_out) != len(accept_pmf):
        raise ValueError(f"fan_out has {len(fan_out)} entries, accept_pmf {len(accept_pmf)}")
    h = 0.0
    for f, p in zip(fan_out, accept_pmf):
        if f > 0:
            h += p * min(1.0, max(0.0, 1.0 - c * f ** (-r)))
    return h
