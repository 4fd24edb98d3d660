"""K from measured verify costs (saguaro/k_choice.py) and the CPU row-cost probe (cpu/row_cost_probe.py)."""

import json
import math
import os

import pytest

from sglang_ssd.cpu.row_cost_probe import linear_row_costs, probe_target, target_shapes
from sglang_ssd.saguaro.k_choice import choose_k, expected_tokens, predicted_speedups


def test_expected_tokens():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert math.isclose(expected_tokens(0.5, 2), 1.75)
    for a in (0.1, 0.4, 0.9):  # grows with K, never past K + 1
        e = [expected_tokens(a, k) for k in range(1, 8)]
        assert all(x < y for x, y in zip(e, e[1:])) and all(x <= k + 2 for k, x in enumerate(e))
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_flat_costs_pick_the_largest_k_and_linear_costs_the_smallest():
    flat = {m: 10.0 for m in range(1, 7)}
    assert choose_k(flat, 0.6, 0.0, 5)[0] == 5
    linear = {m: 10.0 * m for m in range(1, 7)}  # a verify of m rows costs m decode steps: no K pays
    assert choose_k(linear, 0.6, 0.0, 5)[0] == 1


def test_a_cost_cliff_stops_k_before_it():
    # the Intel Xeon shape (results/small_m_linear_xeon.md): ~1.1x up to 3 rows, ~1.9x from 4
    xeon = {1: 40.0, 2: 43.0, 3: 46.0, 4: 75.0, 5: 78.0, 6: 80.0}
    k, table = choose_k(xeon, 0.45, 40.0, 5)
    assert k == 2 and table[2] == max(table.values())
    # the AMD EPYC shape with the W @ x^T route (results/small_m_linear.md): ~1.2-1.4x up to 5 rows
    amd = {1: 72.0, 2: 88.0, 3: 96.0, 4: 98.0, 5: 98.0, 6: 143.0}
    assert choose_k(amd, 0.45, 72.0, 5)[0] == 4


def test_ties_go_to_the_smaller_k_and_the_table_is_the_formula():
    costs = {1: 10.0, 2: 10.0, 3: 10.0}
    table = predicted_speedups(costs, 0.001, 5.0, 2)  # K = 2 adds almost nothing at alpha ~ 0
    assert math.isclose(table[1], expected_tokens(0.001, 1)) and choose_k(costs, 0.001, 5.0, 2)[0] == 1
    with pytest.raises(ValueError):
        choose_k({2: 1.0}, 0.5, 0.0, 3)


def test_a_cheaper_longer_chain_is_not_a_reason_for_a_larger_k():
    """A measured dip (4 rows timing under 2, as oneDNN's packed product can within noise) does not pick a
    larger K when the acceptance gives it nothing: costs for m >= 2 are the running max over 2..m."""
    dip = {1: 10.0, 2: 6.0, 3: 6.1, 4: 5.5, 5: 7.0}
    k, table = choose_k(dip, 0.01, 5.0, 4)
    assert k == 1
    assert math.isclose(table[3], expected_tokens(0.01, 3) * 15.0 / (5.0 + 6.1))  # t(4) taken as t(3)
    assert math.isclose(table[1], expected_tokens(0.01, 1) * 15.0 / 11.0)  # the AR step keeps its own cost
    assert choose_k(dip, 0.6, 5.0, 4)[0] == 3  # with real acceptance the flat stretch still pays


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


def test_target_shapes():
    layer, head, n = target_shapes(TINY)
    assert layer == [((4 + 2 * 2) * 16, 64), (64, 64), (256, 64), (64, 128)] and head == (512, 64) and n == 3


@pytest.mark.parametrize("route", ["measure", "wxt", "linear"])
def test_probe_measures_every_row_count(route):
    costs = linear_row_costs(TINY, range(1, 5), env={"SGLANG_SSD_SMALL_M_ROUTE": route})
    assert sorted(costs) == [1, 2, 3, 4] and all(c > 0 for c in costs.values())


def test_probe_target_reads_a_checkpoint(tmp_path, target_path):
    assert probe_target(str(tmp_path), [1, 2]) is None  # no config.json: the caller keeps its default K
    costs = probe_target(target_path, [1, 4])
    assert costs is not None and costs[1] > 0 and costs[4] > 0


def test_round_k_shrinks_with_the_batch_when_rows_get_expensive():
    """choose_round_k: flat row costs keep K at any batch; costs that grow past a few rows (a CPU core's
    linears) keep K at b = 1 and shrink it at b = 8; the table is the formula."""
    from sglang_ssd.saguaro.k_choice import choose_round_k

    flat = lambda m: 40.0
    assert choose_round_k(flat, 8, 0.5, 40.0, 3)[0] == 3
    grows = lambda m: 40.0 if m <= 4 else 40.0 + 4.0 * (m - 4)  # flat to 4 rows, then 4 ms a row
    assert choose_round_k(grows, 1, 0.5, 40.0, 3)[0] == 3
    k8, table = choose_round_k(grows, 8, 0.5, 40.0, 3)
    assert k8 == 1, table
    assert table[2] == pytest.approx(expected_tokens(0.5, 2) * (40 + 56) / (40 + grows(24)))
    with pytest.raises(ValueError):
        choose_round_k(flat, 0, 0.5, 40.0, 3)


def test_round_k_policy_measures_once_per_batch_size(monkeypatch):
    """RoundK: off / an integer cap / measured (the probe asked once per new batch size for the missing
    row counts only); inactive off the CPU engine."""
    import sglang_ssd.cpu.row_cost_probe as probe
    from sglang_ssd.sglang.round_k import RoundK

    asked = []

    def fake_probe(path, rows, env=None):
        asked.append(list(rows))
        return {m: (30.0 if m <= 4 else 30.0 + 5.0 * (m - 4)) for m in rows}

    monkeypatch.setattr(probe, "probe_target", fake_probe)
    assert RoundK(False, 3, 0.5, "p", cpu=True)(8) == 3
    assert RoundK(2, 3, 0.5, "p", cpu=True)(1) == 2 and RoundK(7, 3, 0.5, "p", cpu=True)(1) == 3
    assert RoundK(True, 3, 0.5, "p", cpu=False)(8) == 3 and not asked  # GPU / features: never probed
    rk = RoundK(True, 3, 0.5, "p", cpu=True)
    assert rk(1) == 3 and not asked  # one request: K itself (auto K's or the user's choice), nothing probed
    assert rk(8) == 1 and asked == [[1, 8, 16, 24, 32]]
    assert rk(8) == 1 and rk(1) == 3 and len(asked) == 1  # kept per batch size
    assert rk(2) in (1, 2, 3) and asked[-1] == [2, 4, 6]  # 1 and 8 known already

    # at start-up: sizes 2 .. max_bs in one probe, none in a live round after it
    asked.clear()
    rk = RoundK(True, 3, 0.5, "p", cpu=True)
    rk.warm(4)
    assert asked == [sorted({1, *(b * m for b in range(2, 5) for m in range(1, 5))})]
    assert set(rk.by_bs) == {2, 3, 4} and rk(4) == rk.by_bs[4] and len(asked) == 1
    asked.clear()
    for off in (RoundK(False, 3, 0.5, "p", cpu=True), RoundK(2, 3, 0.5, "p", cpu=True),
                RoundK(True, 3, 0.5, "p", cpu=False)):
        off.warm(8)
    assert not asked  # off, a fixed cap, or not the CPU engine: nothing measured


def test_round_k_follows_the_measured_acceptance(monkeypatch):
    """k is chosen with alpha_prior until REFIT_ROWS verified rows are in, then with the fitted acceptance
    (accepted / (accepted + rejections)), again for every size seen and without a new probe."""
    import sglang_ssd.cpu.row_cost_probe as probe
    from sglang_ssd.sglang import round_k as rk_mod
    from sglang_ssd.sglang.round_k import RoundK

    asked = []

    def fake_probe(path, rows, env=None):
        asked.append(list(rows))
        return {m: (30.0 if m <= 4 else 30.0 + 5.0 * (m - 4)) for m in rows}

    monkeypatch.setattr(probe, "probe_target", fake_probe)
    rk = RoundK(True, 3, 0.5, "p", cpu=True)
    rk.warm(2)
    assert rk(2) == 1 and len(asked) == 1  # alpha 0.5: k = 1 at b = 2 on these costs
    rows = rk_mod.REFIT_ROWS
    rk.observe([1] * (rows - 1), [1] * (rows - 1))  # one row short of a fit: nothing changes
    assert rk.alpha == 0.5 and rk(2) == 1
    rk.observe([3] * 8 + [1], [3] * 8 + [3])  # 9 more rows: a fit over rows of mostly full acceptance
    assert rk.alpha > 0.9 and rk(2) == 3 and len(asked) == 1
    rk.observe([0] * rows, [3] * rows)  # then every draft rejected: the fit falls, k with it
    assert rk.alpha < 0.6 and rk(2) == 1
    rk.observe([0] * rows, [0] * rows)  # target-only rows say nothing
    assert rk._rows == 0
    fixed = RoundK(2, 3, 0.5, "p", cpu=True)
    fixed.observe([3] * rows, [3] * rows)
    assert fixed.alpha == 0.5  # a fixed cap does not fit anything


def test_probe_costs_are_kept_on_disk(tmp_path, monkeypatch, target_path):
    """probe_target measures only row counts this machine has not measured (cache per CPU / torch / shapes /
    route); "0" turns the cache off."""
    import sglang_ssd.cpu.row_cost_probe as probe

    measured = []
    real = probe.linear_row_costs

    def counting(hf, rows, env=None):
        measured.append(list(rows))
        return real(hf, rows, env)

    monkeypatch.setattr(probe, "linear_row_costs", counting)
    env = {"SGLANG_SSD_ROW_COST_CACHE": str(tmp_path / "rc")}
    first = probe.probe_target(target_path, [1, 2], env)
    assert measured == [[1, 2]] and len(list((tmp_path / "rc").iterdir())) == 1
    again = probe.probe_target(target_path, [2, 3, 1], env)
    assert measured == [[1, 2], [3]] and again[1] == first[1] and again[2] == first[2] and set(again) == {1, 2, 3}
    # another route is another cache file (its costs differ)
    probe.probe_target(target_path, [1], dict(env, SGLANG_SSD_SMALL_M_ROUTE="linear"))
    assert measured[-1] == [1] and len(list((tmp_path / "rc").iterdir())) == 2
    # a damaged file is measured again, not trusted
    for f in (tmp_path / "rc").iterdir():
        f.write_text("{not json")
    probe.probe_target(target_path, [1], env)
    assert measured[-1] == [1]
    # two servers measuring different rows at once: the second save keeps the first one's rows
    f = probe.cache_file(json.load(open(os.path.join(target_path, "config.json"))), env)
    probe._save(f, {7: 1.0})
    probe._save(f, {9: 2.0})
    assert {7: 1.0, 9: 2.0}.items() <= probe._load(f).items() and not [p for p in os.listdir(tmp_path / "rc") if p.endswith(".tmp")]
    n = len(measured)
    probe.probe_target(target_path, [1], {"SGLANG_SSD_ROW_COST_CACHE": "0"})
    probe.probe_target(target_path, [1], {"SGLANG_SSD_ROW_COST_CACHE": "0"})
    assert len(measured) == n + 2  # off: measured every time


def test_a_chain_prefix_keeps_its_own_q():
    """Proposal.first(k): the first k drafts, their q rows and sums, max_accept capped at k."""
    import torch

    from sglang_ssd.sglang.link_state import Proposal

    p = Proposal(torch.arange(8).view(2, 4), torch.rand(2, 4, 5).half(), torch.tensor([True, False]),
                 torch.tensor([4, 1]), torch.tensor([True, False]), 0.1, torch.ones(2, 4))
    f = p.first(2)
    assert f.tokens.tolist() == [[0, 1], [4, 5]] and f.max_accept.tolist() == [2, 1]
    assert torch.equal(f.q16, p.q16[:, :2]) and f.q_sums.shape == (2, 2) and f.hit.tolist() == [True, False]
    assert p.first(4) is p and p.first(9) is p
    assert Proposal(p.tokens, None, p.q_valid, p.max_accept, p.hit).first(1).q16 is None


def test_round_k_cost_ignores_a_disturbed_timing():
    """A row count timed far too slow (the process was descheduled) counts as the next larger one."""
    from sglang_ssd.sglang.round_k import RoundK

    rk = RoundK(True, 3, 0.5, "p", cpu=True)
    rk.costs = {1: 30.0, 2: 30.0, 4: 31.0, 6: 9000.0, 8: 40.0}
    assert rk.cost(6) == 40.0 and rk.cost(4) == 31.0 and rk.cost(8) == 40.0 and rk.cost(3) == 31.0
