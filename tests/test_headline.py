"""scripts/headline.py: the README's AR / SD / SSD table and the paper's Theorem 7 prediction from measured inputs."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from headline import ratio, summarize, theorem7  # noqa: E402


def _cell(variant, rep, tok_s, **kw):
    return {"variant": variant, "rep": rep, "tok_s": tok_s, "temperature": 0.0, "batch": 1, **kw}


def test_theorem7_all_hits_is_tokens_per_round_times_ar_over_verify():
    # every row a hit, build shorter than the verify: SSD/AR = E_hit * t_AR / t_verify
    ssd = [_cell("ssd", 0, 10.0, hit_rate=1.0, e_hit=2.0, e_miss=1.0, verify_ms=100.0, build_ms=50.0,
                 draft_backup_ms=0.0, backup_frac=0.0)]
    ar = [_cell("ar", 0, 10.0)]  # 100 ms per decode step
    assert math.isclose(theorem7(ssd, ar, 1), 2.0)
    # half the rows miss, each miss round pays a backup of 0.5 verify: denominator 0.5 * 1 + 0.5 * 1.5
    ssd[0].update(hit_rate=0.5, draft_backup_ms=25.0)  # 25 ms per round = 50 ms per missed row
    assert math.isclose(theorem7(ssd, ar, 1), (0.5 * 2.0 + 0.5 * 1.0) / (0.5 + 0.5 * 1.5))
    # a build longer than the verify costs its own length on a hit round (max(1, T_p))
    ssd[0].update(hit_rate=1.0, build_ms=200.0)
    assert math.isclose(theorem7(ssd, ar, 1), 1.0)


def test_ratios_pair_repeats_and_rows_need_all_modes():
    num = [_cell("ssd", 0, 12.0), _cell("ssd", 1, 20.0)]
    den = [_cell("sd", 0, 10.0), _cell("sd", 1, 10.0), _cell("sd", 2, 1.0)]
    assert math.isclose(ratio(num, den), 1.6)  # median of 1.2 and 2.0; repeat 2 has no partner
    split = {"wait_ms": 1.0, "verify_ms": 80.0, "accept_ms": 1.0, "worker_other_ms": 0.5, "sched_gap_ms": 4.5}
    cells = {(0.0, 1): {"ar": [_cell("ar", 0, 10.0)], "sd": [_cell("sd", 0, 11.0, k=2, accept_len=1.5, **split)],
                        "ssd": [_cell("ssd", 0, 12.1, k=2, accept_len=1.5, hit_rate=0.5, **split)]},
             (0.0, 2): {"ar": [_cell("ar", 0, 10.0)]}}
    rows = summarize(cells)
    assert len(rows) == 1 and rows[0]["b"] == 1
    assert math.isclose(rows[0]["ssd_sd"], 1.1) and math.isclose(rows[0]["ssd_ar"], 1.21)
    assert math.isclose(rows[0]["ssd_round_ms"], 87.0) and math.isclose(rows[0]["ssd_wait_frac"], 1.0 / 87.0)
