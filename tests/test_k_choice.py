"""K from measured verify costs (saguaro/k_choice.py) and the CPU row-cost probe (cpu/row_cost_probe.py)."""

import math

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
