"""Choosing K, the drafts per round, from measured verify costs and an acceptance rate.

With the cache build off the critical path (SSD: a hit round costs max(verify, build) = the verify), the
speedup over AR of speculating K tokens is the paper's Theorem 7 with T_p <= 1 and a cheap backup:

    speedup(K) ~= E(K) * t_step(1) / t_step(K + 1),   E(K) = sum_{k=0..K} alpha^k = (1 - alpha^(K+1)) / (1 - alpha)

where t_step(m) is one target forward over m rows per request (m = 1: an AR decode step; m = K + 1: the chain
verify).  On a CPU the m-row cost is far from flat: an Intel Xeon core's few-row GEMM jumps from ~1.1x to
~1.9x the one-row time between 3 and 4 rows, an AMD EPYC core's W @ x^T route stays ~1.2-1.4x up to 5 rows
(results/small_m_linear*.md), so the best K differs between machines (K = 2 vs 3 on the Xeon:
results/variants_small_m_route.md).  ``choose_k`` takes the row costs and returns the K of the largest
predicted speedup.  Pure arithmetic: no torch, no SGLang.
"""

from __future__ import annotations

TIE = 0.01  # a larger K must predict > 1% more speedup to be chosen (it also costs the draft more work)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round commits with i.i.d. acceptance alpha and K drafts (the bonus included)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedups(row_costs: dict[int, float], alpha: float, overhead: float,
                       k_max: int) -> dict[int, float]:
    """K -> E(K) * t_step(1) / t_step(K + 1), t_step(m) = overhead + row_costs[m] (same unit: e.g. ms).

    ``row_costs[m]``: the measured part of a forward that grows with the rows (the linears); ``overhead``:
    the per-step rest (attention at short context, norms, the engine's own work), taken as fixed.
    For m >= 2 the cost is the largest measured over 2..m: a chain of more rows is never taken as cheaper
    than a shorter one (on the same route the measured dips are timing noise, e.g. oneDNN's packed product
    timing 2, 3 and 4 rows alike, and a K chosen on one would flip from run to run).  m = 1 stays as
    measured: the AR step may run on another route than the verify and really cost more."""
    if 1 not in row_costs or row_costs[1] <= 0:
        raise ValueError("row_costs needs a positive cost for m = 1 (the AR step)")
    one = overhead + row_costs[1]
    out, top = {}, 0.0
    for k in range(1, k_max + 1):
        if (k + 1) not in row_costs:
            continue
        top = max(top, row_costs[k + 1])
        out[k] = expected_tokens(alpha, k) * one / (overhead + top)
    return out


def choose_k(row_costs: dict[int, float], alpha: float, overhead: float, k_max: int) -> tuple[int, dict[int, float]]:
    """-> (the K of the best predicted speedup, K -> predicted speedup).  Ties within TIE go to the smaller K."""
    table = predicted_speedups(row_costs, alpha, overhead, k_max)
    if not table:
        raise ValueError(f"row_costs must cover m = 2 .. {k_max + 1}")
    best = min(table)
    for k in sorted(table):
        if table[k] > table[best] * (1.0 + TIE):
            best = k
    return best, table


def choose_round_k(row_cost, bs: int, alpha: float, overhead: float, k_max: int) -> tuple[int, dict[int, float]]:
    """The drafts to verify per request in a round of ``bs`` requests (batch-size-aware K, 1 <= k <= k_max).

    A round of bs requests runs the linears over bs * (k + 1) rows where AR runs them over bs rows, so the
    same ``E(k) * t(1) / t(k + 1)`` rule with batch-sized steps: speedup(k) = E(k) * (overhead +
    row_cost(bs)) / (overhead + row_cost(bs * (k + 1))).  row_cost: M rows -> ms of the target's linears
    (measured: a CPU core's cost is flat up to a few rows, then grows, so a wide verify that pays at
    b = 1 can cost 2x an AR step at b = 8).  Ties within TIE go to the smaller k."""
    if bs < 1 or k_max < 1:
        raise ValueError(f"bs and k_max must be >= 1, got {bs}, {k_max}")
    # the one-request rule on batch-sized steps: "m rows per request" costs row_cost(bs * m)
    return choose_k({m: row_cost(bs * m) for m in range(1, k_max + 2)}, alpha, overhead, k_max)
