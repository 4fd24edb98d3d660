"""Batch-size aware backup choice (sglang_ssd.saguaro.backup_policy), notes 2.8."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sglang_ssd.saguaro.backup_policy import (BackupPolicy, critical_batch_size, critical_batch_threshold,
                                              expected_speedup)

# notes 2.8 table: E_hit = E_n = 4, E_f = 1, T_f = 0, T_p <= 1 (m = 1); p_hit, T_n -> b*
TABLE = [(0.8, 0.6, 1.56, 2), (0.8, 0.3, 3.98, 4), (0.9, 0.3, 2.99, 3), (0.6, 0.3, None, None)]


def inputs(p, t_n, **kw):
    d = dict(p_hit=p, e_hit=4.0, e_miss_neural=4.0, e_miss_fast=1.0, t_p=0.8, t_b_neural=t_n, t_b_fast=0.0)
    d.update(kw)
    return d


@pytest.mark.parametrize("p,t_n,b_real,b_int", TABLE)
def test_notes_table(p, t_n, b_real, b_int):
    i = inputs(p, t_n)
    got = critical_batch_threshold(**i)
    assert (got is None) if b_real is None else got == pytest.approx(b_real, abs=0.005)
    assert critical_batch_size(**i) == b_int


def test_speedup_values():
    # notes 2.8: p = 0.8, T_n = 0.3 -> neural 3.77 / 3.61 / 3.40 / 3.20 / 3.08 at b = 1, 2, 4, 8, 32; fast 3.40
    want = {1: 3.77, 2: 3.61, 4: 3.40, 8: 3.20, 32: 3.08}
    for b, s in want.items():
        assert expected_speedup(0.8, 4.0, 4.0, 0.8, 0.3, b) == pytest.approx(s, abs=0.005)
        assert expected_speedup(0.8, 4.0, 1.0, 0.8, 0.0, b) == pytest.approx(3.40)
    # Theorem 7 at b = 1 by hand: (0.5*3 + 0.5*2) / (0.5*1.2 + 0.5*1.5) = 2.5 / 1.35
    assert expected_speedup(0.5, 3.0, 2.0, 1.2, 0.5) == pytest.approx(2.5 / 1.35)


def test_edge_cases():
    assert critical_batch_size(**inputs(1.0, 0.3)) is None       # never misses: equal speed, no strict win
    assert critical_batch_size(**inputs(0.0, 0.3)) is None       # always misses: 4/1.3 tokens/time > 1/1
    assert critical_batch_size(**inputs(0.0, 4.0)) == 1          # ... unless neural is slow: 4/5 < 1/1
    assert critical_batch_size(**inputs(0.8, 0.3, e_miss_fast=4.0)) == 1  # fast as accurate: always better
    assert critical_batch_size(**inputs(0.8, 0.3, t_b_fast=0.3)) is None   # fast not faster: never


@settings(max_examples=200, deadline=None)
@given(p=st.floats(0.0, 1.0), e_hit=st.floats(1.0, 8.0), e_n=st.floats(1.0, 8.0), e_f=st.floats(1.0, 8.0),
       t_p=st.floats(0.0, 2.0), t_n=st.floats(0.0, 2.0), t_f=st.floats(0.0, 2.0))
def test_decision_monotone_in_b_and_matches_scan(p, e_hit, e_n, e_f, t_p, t_n, t_f):
    """fast-wins(b) changes at most once along b, and critical_batch_size is its first True."""
    # a miss rate below float resolution (p = 1 - 1e-16) makes the two speedups differ only by rounding
    assume(p == 1.0 or 1.0 - p > 1e-9)
    wins = [expected_speedup(p, e_hit, e_f, t_p, t_f, b) > expected_speedup(p, e_hit, e_n, t_p, t_n, b)
            for b in range(1, 65)]
    assert sum(x != y for x, y in zip(wins, wins[1:])) <= 1
    b_star = critical_batch_size(p, e_hit, e_n, e_f, t_p, t_n, t_f, b_max=64)
    first = next((b for b, w in enumerate(wins, 1) if w), None)
    if e_n >= e_f:  # neural at least as accurate: once fast wins it keeps winning
        assert wins == sorted(wins)
        assert b_star == first
        real = critical_batch_threshold(p, e_hit, e_n, e_f, t_p, t_n, t_f)
        if real is not None and first is not None and abs(real - round(real)) > 1e-6 and real > 1:
            assert first == int(real) + 1


def feed(policy: BackupPolicy, rounds: int, p_hit: float, n_hit: int, n_miss: int, backup: str, t_b: float, b=8):
    hits = round(p_hit * b)
    for _ in range(rounds):
        policy.observe_round(from_cache=[True] * hits + [False] * (b - hits),
                             accept_lens=[n_hit] * hits + [n_miss] * (b - hits),
                             backup=backup, t_verify=0.02, t_build=0.016, t_backup=t_b * 0.02)


def test_policy_learns_and_switches_with_hysteresis():
    pol = BackupPolicy(min_dwell=10, margin=0.03)
    assert pol.choose(1) == "neural"  # priors: neural at b = 1
    feed(pol, 200, 0.75, 4, 4, "neural", 0.6)
    i = pol.inputs()
    # running means with 5 prior pseudo-observations: (5 * prior + 200 * x) / 205
    assert i["p_hit"] == pytest.approx((5 * 0.5 + 200 * 0.75) / 205) and i["e_hit"] == pytest.approx(4, abs=0.03)
    assert i["t_b_neural"] == pytest.approx(0.6, abs=0.01) and i["t_p"] == pytest.approx(0.8, abs=0.01)
    assert i["e_miss_fast"] == 1.0 and i["t_b_fast"] == 0.0  # never used yet: priors stand
    b_star = critical_batch_size(**i)
    assert b_star is not None and b_star > 1
    assert pol.choose(b_star - 1) == "neural"
    assert pol.choose(64) == "fast"
    assert pol.choose(1) == "fast"  # min_dwell: no immediate flap back
    feed(pol, 10, 0.75, 4, 4, "neural", 0.6)
    assert pol.choose(1) == "neural"
    rep = pol.report(8)
    assert rep["critical_batch_size"] == b_star and set(rep["speedups"]) == {"neural", "fast"}


def test_hysteresis_margin_blocks_near_ties():
    pol = BackupPolicy(min_dwell=0, margin=0.05)
    feed(pol, 200, 0.75, 4, 4, "neural", 0.6)
    assert critical_batch_size(**pol.inputs()) == 2
    s2, s3 = pol.speedups(2), pol.speedups(3)
    assert s2["neural"] < s2["fast"] < s2["neural"] * 1.05 and s3["fast"] > s3["neural"] * 1.05
    assert pol.choose(2) == "neural"  # fast wins at b = 2, but by less than the margin
    assert pol.choose(3) == "fast"
    assert pol.choose(2) == "fast"    # inside the band: no flap back either
    assert pol.choose(1) == "neural"  # neural ahead by > 5% at b = 1


def test_override():
    pol = BackupPolicy(override="fast")
    assert pol.choose(1) == "fast"
    pol.set_override("neural")
    assert pol.choose(1000) == "neural"
    with pytest.raises(ValueError):
        pol.set_override("jit")
    with pytest.raises(ValueError):
        pol.observe_round(from_cache=[True], accept_lens=[2], backup="random", t_verify=1.0)


def test_exploration_measures_the_unused_kind_then_the_model_decides():
    """With exploration, "auto" tries fast once a batch >= 2 comes (its prior E_miss = 1 token is
    never corrected otherwise), then keeps whichever the measured Corollary-16 model prefers."""
    pol = BackupPolicy(min_dwell=8, margin=0.03, explore_min_batch=2, reexplore_every=400)
    assert pol.choose(4) == "neural"               # the first kind is measured first
    feed(pol, 50, 0.5, 2, 1.5, "neural", 0.25, b=4)
    assert pol.choose(1) == "neural"               # batch 1: no exploration
    assert pol.choose(4) == "fast"                 # fast never measured: try it
    feed(pol, 40, 0.5, 2, 1.3, "fast", 0.01, b=4)  # it serves misses with ~1.3 tokens at ~no latency
    assert pol.inputs()["e_miss_fast"] == pytest.approx(1.3, abs=0.05)
    s = pol.speedups(4)
    assert s["fast"] > s["neural"] * 1.03 and pol.choose(4) == "fast"  # measured: fast stays
    # a fast kind that accepts nothing is left again once measured
    bad = BackupPolicy(min_dwell=8, margin=0.03, explore_min_batch=2, reexplore_every=400)
    feed(bad, 50, 0.5, 2, 1.8, "neural", 0.1, b=4)
    assert bad.choose(4) == "fast"
    feed(bad, 40, 0.5, 2, 1.0, "fast", 0.01, b=4)
    assert bad.choose(4) == "neural"
    feed(bad, 400, 0.5, 2, 1.8, "neural", 0.1, b=4)
    assert bad.choose(4) == "fast"                 # re-explored after reexplore_every rounds
    plain = BackupPolicy(min_dwell=0)
    feed(plain, 50, 0.5, 2, 1.8, "neural", 0.1, b=4)
    assert plain.choose(4) == "neural" and plain.inputs()["e_miss_fast"] == 1.0
