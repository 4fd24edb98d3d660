"""The build budget (sglang_ssd/draft/budget.py): fan-outs shrink while builds are cut by the next message
and grow back while builds fit the verify window with slack; builds never cut keep the fitted schedule."""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft import budget as B
from sglang_ssd.draft.budget import BuildBudget
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)
K, V = 3, 96
FAN = [4, 4, 2, 2]


def test_controller_shrinks_on_cuts_grows_with_slack_and_is_bounded():
    b = BuildBudget()
    assert b.fan(FAN) == FAN
    b.built(cut=True, build_s=0.1)
    assert b.scale == pytest.approx(B.SHRINK) and b.fan(FAN) == [3, 3, 2, 2]
    for _ in range(100):
        b.built(cut=True, build_s=0.1)
    assert b.scale == pytest.approx(B.MIN_SCALE) and b.fan(FAN) == [1, 1, 1, 1] and b.fan([3, 0, 1]) == [1, 0, 1]
    b.built(cut=False, build_s=0.01)             # no window seen yet: no growth
    assert b.scale == pytest.approx(B.MIN_SCALE)
    b.observe_window(0.1)
    b.built(cut=False, build_s=0.09)             # fits, but without slack: stays
    assert b.scale == pytest.approx(B.MIN_SCALE)
    for _ in range(200):
        b.built(cut=False, build_s=0.01)         # fits with slack: back to the full schedule, never above
    assert b.scale == 1.0 and b.fan(FAN) == FAN and b.grows > 0 and b.shrinks > 0
    off = BuildBudget(enabled=False)
    off.built(cut=True, build_s=1.0)
    assert off.scale == 1.0


def test_env_switch(monkeypatch):
    monkeypatch.setenv(B.ENV, "0")
    assert not B.enabled_by_env()
    monkeypatch.setenv(B.ENV, "1")
    assert B.enabled_by_env()
    monkeypatch.setenv(B.ENV, "maybe")
    with pytest.raises(ValueError, match=B.ENV):
        B.enabled_by_env()


def _stop_after(n: int):
    calls = [0]

    def stop():
        calls[0] += 1
        return calls[0] > n
    return stop


def test_engine_builds_fewer_branches_after_cuts_and_all_of_them_again_after_slack():
    runner = DraftRunner.from_dir(make_tiny_model(vocab_size=V, seed=1))
    e = DraftEngine(runner, seed=0, build_chunk_tokens=0)
    e.hello(Hello(PROTOCOL_VERSION, "t", K, "async", FAN, V, [1], FAN, "neural", fan_out_auto=False))
    e.prefill(Prefill(["a"], [[5, 9, 17, 33]], [0.0]))
    rnd = 0

    def speculate():
        nonlocal rnd
        reply = e.speculate(Speculate(rnd, ["a"], [-1], [3 + rnd], [0.0]))
        rnd += 1
        return reply

    speculate()
    e.build_cache()                                     # never stopped: the full schedule
    assert len(e.cache.keys("a")) == sum(FAN) and e.budget.scale == 1.0
    for _ in range(6):                                  # each build is cut after its first tree depth
        speculate()
        e.build_cache(_stop_after(2))
    assert e.budget.scale < 0.3 and e.health()["build_scale"] == e.budget.scale
    speculate()
    e.build_cache()
    assert len(e.cache.keys("a")) == K + 1              # one branch per glue index
    for _ in range(40):
        speculate()
        e.budget.observe_window(10.0)                   # a long verify window: builds fit with slack
        e.build_cache()
    assert e.budget.scale == 1.0 and len(e.cache.keys("a")) == sum(FAN)
