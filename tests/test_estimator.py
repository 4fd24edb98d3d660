"""Online estimators of a and r, and the fan-out planner (sglang_ssd.saguaro.estimator)."""

from __future__ import annotations

import random

import pytest

from sglang_ssd.saguaro.estimator import AcceptanceEstimator, FanOutPlanner, MissRateEstimator
from sglang_ssd.saguaro.topology import geometric_fan_out


def capped_geometric(rng: random.Random, a: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def test_acceptance_prior_then_mle():
    est = AcceptanceEstimator(k=4, prior_a=0.6, prior_weight=10.0, prior_a_backup=0.1)
    assert est.estimate(True) == pytest.approx(0.6) and est.estimate(False) == pytest.approx(0.1)
    est = AcceptanceEstimator(k=4, prior_weight=0.0, half_life=None)
    for k in (0, 2, 4, 4):  # accepted 10; rejections: rounds with k < 4 -> 2
        est.observe(k, True)
    assert est.estimate(True) == pytest.approx(10 / 12)
    est.observe(1, True, cap=1)  # stopped at the cap: no rejection
    assert est.estimate(True) == pytest.approx(11 / 13)
    with pytest.raises(ValueError):
        est.observe(5, True)


@pytest.mark.parametrize("a_p,a_b", [(0.75, 0.05), (0.4, 0.6)])
def test_acceptance_recovers_simulated(a_p, a_b):
    rng = random.Random(0)
    est = AcceptanceEstimator(k=5, half_life=None)
    for _ in range(4000):
        hit = rng.random() < 0.7
        est.observe(capped_geometric(rng, a_p if hit else a_b, 5), hit)
    assert est.estimate(True) == pytest.approx(a_p, abs=0.02)
    assert est.estimate(False) == pytest.approx(a_b, abs=0.03)


def test_acceptance_forgetting():
    rng = random.Random(1)
    est = AcceptanceEstimator(k=4, half_life=100)
    for _ in range(2000):
        est.observe(capped_geometric(rng, 0.85, 4), True)
    assert est.estimate() == pytest.approx(0.85, abs=0.04)
    for _ in range(1000):  # ten half-lives of a new regime
        est.observe(capped_geometric(rng, 0.3, 4), True)
    assert est.estimate() == pytest.approx(0.3, abs=0.06)
    slow = AcceptanceEstimator(k=4, half_life=None)
    rng = random.Random(1)
    for a, n in ((0.85, 2000), (0.3, 1000)):
        for _ in range(n):
            slow.observe(capped_geometric(rng, a, 4), True)
    assert slow.estimate() > 0.6  # without forgetting the old regime dominates


def simulate_miss(est: MissRateEstimator, rng: random.Random, c: float, r: float, fans, n: int, from_cache=True):
    for _ in range(n):
        f = rng.choice(fans)
        est.observe(f, rng.random() >= min(1.0, c * f ** (-r)), from_cache)


def test_miss_prior_before_data():
    est = MissRateEstimator(prior_r=0.8, prior_c=0.9)
    assert est.fit(True) == pytest.approx((0.8, 0.9))
    assert est.fit(False) == pytest.approx((0.8, 0.9))
    assert est.measured_hit_rate() is None


@pytest.mark.parametrize("c,r", [(0.9, 0.8), (0.6, 1.5), (1.0, 0.4)])
def test_miss_recovers_power_law(c, r):
    rng = random.Random(2)
    est = MissRateEstimator(half_life=None)
    simulate_miss(est, rng, c, r, [1, 2, 3, 4, 6, 8], 20_000)
    simulate_miss(est, rng, 0.5, 2.0, [1, 2, 3], 200, from_cache=False)  # other source: separate fit
    r_hat, c_hat = est.fit(True)
    assert r_hat == pytest.approx(r, abs=0.1) and c_hat == pytest.approx(c, rel=0.1)
    assert est.fit(False)[0] != pytest.approx(r_hat, abs=1e-3)


def test_miss_single_bucket_keeps_prior_slope():
    est = MissRateEstimator(prior_r=1.0, prior_c=1.0, half_life=None)
    simulate_miss(est, random.Random(3), 0.4, 1.0, [3], 5000)  # uniform fan-out: slope unidentified
    r_hat, c_hat = est.fit()
    assert r_hat == pytest.approx(1.0, abs=0.15)
    assert c_hat * 3 ** (-r_hat) == pytest.approx(0.4 / 3, rel=0.1)  # the one point is fitted
    est.observe(0, False)  # F = 0: a certain miss, counted in the hit rate only
    assert est.measured_hit_rate() == pytest.approx(1 - 0.4 / 3, abs=0.02)
    assert 0 not in est.buckets["primary"]


def test_miss_forgetting():
    rng = random.Random(4)
    est = MissRateEstimator(half_life=300)
    simulate_miss(est, rng, 0.9, 0.3, [1, 2, 4, 8], 3000)
    simulate_miss(est, rng, 0.9, 1.5, [1, 2, 4, 8], 3000)
    assert est.fit()[0] == pytest.approx(1.5, abs=0.2)


def test_planner_uses_priors_then_learns():
    planner = FanOutPlanner(budget=24, k=7, refresh_every=100,
                            acceptance=AcceptanceEstimator(7, prior_a=0.6, prior_a_backup=0.6),
                            miss=MissRateEstimator(prior_r=1.0))
    assert planner.fan_out_primary == geometric_fan_out(24, 7, 0.6, 1.0)
    assert planner.fan_out_backup == planner.fan_out_primary
    rng = random.Random(5)
    a_true = {True: 0.85, False: 0.05}
    for i in range(6000):
        src = i % 3 != 0
        k = capped_geometric(rng, a_true[src], 7)
        f = planner.schedule(src)[k]
        hit = f > 0 and rng.random() >= 0.8 * f ** (-0.7)
        planner.observe(k, src, hit, f)
    rep = planner.report()
    assert rep["primary"]["a"] == pytest.approx(0.85, abs=0.05)
    assert rep["backup"]["a"] == pytest.approx(0.05, abs=0.03)
    assert rep["primary"]["fan_out"] == planner.fan_out_primary and sum(planner.fan_out_backup) == 24
    assert planner.fan_out_backup[0] >= 15  # a fast-like backup is rejected at k = 0: budget goes there
    assert planner.fan_out_primary[-1] >= planner.fan_out_primary[0]  # high a: mass at k = K
    for s in ("primary", "backup"):
        assert rep[s]["measured_hit_rate"] == pytest.approx(rep[s]["predicted_hit_rate"], abs=0.08)
    assert rep["observations"] == 6000


def test_planner_plans_a_short_verify_over_its_own_outcomes_with_the_whole_budget():
    """schedule_for(src, k < K): Theorem 12 with K = k (k + 1 outcomes), the same fit, the same budget;
    k >= K is the ordinary schedule; a refresh re-plans the short ones too."""
    planner = FanOutPlanner(budget=12, k=3, refresh_every=50)
    for k in (1, 2):
        for src in (True, False):
            got = planner.schedule_for(src, k)
            r, _ = planner.miss.fit(src)
            assert got == geometric_fan_out(12, k, planner.acceptance.estimate(src), r)
            assert len(got) == k + 1 and sum(got) == 12
    assert planner.schedule_for(True, 3) == planner.schedule(True) and planner.schedule_for(False, 5) == planner.schedule(False)
    with pytest.raises(ValueError):
        planner.schedule_for(True, -1)
    before = planner.schedule_for(True, 1)
    for _ in range(50):  # every 1-draft verify accepted: a -> 1, so the "all accepted" outcome gets the budget
        planner.observe(1, True, None, None, cap=1)
    after = planner.schedule_for(True, 1)
    assert after != before and after[1] > after[0] and sum(after) == 12
    assert planner.acceptance.estimate(True) > 0.8
