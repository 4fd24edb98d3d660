"""Theorem-12 fan-out (sglang_ssd.saguaro.topology).

What the optimality tests assert, precisely:
* continuous: the continuous geometric allocation x maximises the model objective
  J(y) = sum_j P(j) (1 - y_j^{-r}) (unclipped, c = 1) over all positive y with sum y = B: J(x) >= J(y)
  for the uniform y = B/(K+1) and for random Dirichlet y (to 1e-12 relative), and satisfies the
  Lagrange condition P(j) x_j^{-r-1} = const;
* integer, rigorous: when every x_j and F_j (the rounded geometric) is >= 1 the clipped and unclipped
  objectives agree on both, and by the mean value theorem the rounding loss is at most
  L = sum_j P(j) r min(x_j, F_j)^{-r-1} |x_j - F_j|, hence H(F_geo) >= H(F_uniform) - L;
* integer, empirical: over the sampled domain (K <= 8, K+1 <= B <= 64, a in (0.02, 0.98), r in
  (0.1, 3)) the clipped H(F_geo) >= H(F_uniform) - 0.04 (worst case on a dense grid: 0.037 at K=3,
  B=6, a=0.15, r=3, where c = 1 makes F = 1 worthless).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ssd.saguaro.topology import (capped_geometric_pmf, geometric_fan_out, geometric_fan_out_continuous,
                                         predicted_hit_rate, round_largest_remainder, uniform_fan_out)

# notes 2.5 worked examples: K, B, a_p, r, N(K), continuous F, integer F, P(hit) geo / uniform
TABLE = [
    (4, 20, 0.64, 1.0, 3.635, [5.50, 4.40, 3.52, 2.82, 3.76], [5, 4, 4, 3, 4], 0.760, 0.750),
    (7, 24, 0.8, 1.0, 6.158, [3.90, 3.49, 3.12, 2.79, 2.49, 2.23, 2.00, 3.99], [4, 3, 3, 3, 3, 2, 2, 4], 0.681, 0.667),
    (7, 24, 0.8, 0.5, 5.713, [4.20, 3.62, 3.12, 2.69, 2.32, 2.00, 1.72, 4.34], [4, 4, 3, 3, 2, 2, 2, 4], 0.441, 0.423),
    (7, 24, 0.6, 1.0, 3.959, [6.06, 4.70, 3.64, 2.82, 2.18, 1.69, 1.31, 1.60], [6, 5, 4, 3, 2, 2, 1, 1], 0.732, 0.667),
]


@pytest.mark.parametrize("k,b,a,r,norm,cont,integer,h_geo,h_uni", TABLE)
def test_worked_examples(k, b, a, r, norm, cont, integer, h_geo, h_uni):
    x = geometric_fan_out_continuous(b, k, a, r)
    assert b / x[0] == pytest.approx(norm, abs=1e-3)  # F_0 = B / N(K)
    assert [round(v, 2) for v in x] == cont
    assert geometric_fan_out(b, k, a, r) == integer
    pmf = capped_geometric_pmf(a, k)
    assert round(predicted_hit_rate(integer, pmf, r), 3) == h_geo
    assert round(predicted_hit_rate(uniform_fan_out(b, k), pmf, r), 3) == h_uni


def test_closed_form_shape():
    k, a, r = 5, 0.7, 0.8
    x = geometric_fan_out_continuous(30, k, a, r)
    beta = a ** (1 / (1 + r))
    for j in range(1, k):
        assert x[j] / x[0] == pytest.approx(beta**j)
    assert x[k] / x[0] == pytest.approx(beta**k * (1 - a) ** (-1 / (1 + r)))


def test_edge_cases():
    assert geometric_fan_out(10, 4, 0.0, 1.0) == [10, 0, 0, 0, 0]       # a -> 0: only k = 0 happens
    assert geometric_fan_out(10, 4, 1.0, 1.0) == [0, 0, 0, 0, 10]       # a -> 1: only k = K happens
    assert geometric_fan_out(10, 4, 1e-12, 1.0)[0] == 10
    assert geometric_fan_out(10, 4, 1 - 1e-12, 1.0)[-1] == 10
    assert geometric_fan_out(12, 3, 0.5, math.inf) == [3, 3, 3, 3]     # r -> inf: uniform
    x = geometric_fan_out_continuous(20, 1, 0.7, 0.0)                   # r = 0: F proportional to P
    assert x == pytest.approx([6.0, 14.0])
    assert geometric_fan_out(3, 7, 0.8, 1.0) == [1, 1, 0, 0, 0, 0, 0, 1]  # B < K+1: largest three
    assert geometric_fan_out(0, 3, 0.5, 1.0) == [0, 0, 0, 0]
    assert geometric_fan_out(7, 0, 0.5, 1.0) == [7]
    assert geometric_fan_out(5, 1, 0.5, 1.0) == [3, 2]                   # K = 1: w = (0.5, 0.5)^(1/2), tie -> j=0
    assert geometric_fan_out(20, 4, 0.3, 1.0, f_max=6) == [6, 6, 4, 2, 2]   # water-filling: 9.4, 6.9 capped
    assert geometric_fan_out(10, 4, 1.0, 1.0, f_max=3) == [2, 2, 2, 1, 3]  # zero weights share the excess
    with pytest.raises(ValueError):
        geometric_fan_out(20, 3, 0.5, 1.0, f_max=4)                      # 4 * 4 < 20
    for bad in [(-1, 3, 0.5, 1.0), (5, 3, 1.5, 1.0), (5, 3, 0.5, -1.0), (5, 3, math.nan, 1.0)]:
        with pytest.raises(ValueError):
            geometric_fan_out(*bad)


def test_uniform_and_rounding():
    assert uniform_fan_out(24, 7) == [3] * 8
    assert uniform_fan_out(10, 3) == [3, 3, 2, 2]
    assert round_largest_remainder([1.5, 1.5, 1.0], 4) == [2, 1, 1]      # tie to lower index
    assert round_largest_remainder([2.9999999999999, 1.0000000000001], 4) == [3, 1]
    assert predicted_hit_rate([0, 4], [0.5, 0.5], 1.0) == pytest.approx(0.375)
    assert predicted_hit_rate([1, 1], [0.5, 0.5], 1.0, c=2.0) == 0.0     # clipped at 0
    assert capped_geometric_pmf(0.5, 2) == [0.5, 0.25, 0.25]


params = dict(k=st.integers(1, 8), a=st.floats(0.02, 0.98), r=st.floats(0.1, 3.0), extra=st.integers(0, 56))


@settings(max_examples=150, deadline=None)
@given(**params, f_cap=st.one_of(st.none(), st.integers(1, 64)))
def test_sum_monotone_cap(k, a, r, extra, f_cap):
    b = k + 1 + extra
    if f_cap is not None and f_cap * (k + 1) < b:
        f_cap = None
    f = geometric_fan_out(b, k, a, r, f_cap)
    assert sum(f) == b and len(f) == k + 1 and min(f) >= 0
    assert all(f[j] >= f[j + 1] for j in range(k - 1))                  # non-increasing over j < K
    if f_cap is not None:
        assert max(f) <= f_cap
    x = geometric_fan_out_continuous(b, k, a, r, f_cap)
    assert all(abs(fi - xi) < 1 for fi, xi in zip(f, x))                  # a rounding, not a re-plan


def _j(y, pmf, r):
    return sum(p * (1 - v ** (-r)) for p, v in zip(pmf, y))


@settings(max_examples=100, deadline=None)
@given(**params, seed=st.integers(0, 2**16))
def test_continuous_optimum(k, a, r, extra, seed):
    import random
    b = k + 1 + extra
    pmf = capped_geometric_pmf(a, k)
    x = geometric_fan_out_continuous(b, k, a, r)
    best = _j(x, pmf, r)
    tol = 1e-12 * max(1.0, abs(best))
    assert best >= _j([b / (k + 1)] * (k + 1), pmf, r) - tol
    rng = random.Random(seed)
    for _ in range(20):
        w = [rng.expovariate(1.0) + 1e-9 for _ in range(k + 1)]
        assert best >= _j([b * v / sum(w) for v in w], pmf, r) - tol
    lag = [p * v ** (-r - 1) for p, v in zip(pmf, x)]                   # Lagrange: constant
    assert max(lag) == pytest.approx(min(lag), rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(**params)
def test_integer_geometric_vs_uniform(k, a, r, extra):
    b = k + 1 + extra
    pmf = capped_geometric_pmf(a, k)
    x = geometric_fan_out_continuous(b, k, a, r)
    f = geometric_fan_out(b, k, a, r)
    h_geo, h_uni = predicted_hit_rate(f, pmf, r), predicted_hit_rate(uniform_fan_out(b, k), pmf, r)
    assert h_geo >= h_uni - 0.04
    if min(x) >= 1 and min(f) >= 1:
        loss = sum(p * r * min(xi, fi) ** (-r - 1) * abs(xi - fi) for p, xi, fi in zip(pmf, x, f))
        assert h_geo >= h_uni - loss - 1e-12
