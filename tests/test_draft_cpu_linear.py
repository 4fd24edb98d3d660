"""The CPU draft's linears on packed weights (draft/cpu_linear.py): the route's decision, what it reroutes,
and that the rerouted draft computes what F.linear does (its tokens match, its logits to float rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_ssd.cpu.small_m_linear import packed_available
from sglang_ssd.draft import cpu_linear
from sglang_ssd.draft.runner import DraftRunner
from tests.tiny_models import greedy_reference, make_reduced_head_model, make_tiny_eagle3, make_tiny_model, next_logits

pytestmark = pytest.mark.skipif(not packed_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_CHOICE", {})
    monkeypatch.delenv(cpu_linear.ENV, raising=False)


def test_measured_choice_uses_packed_only_when_it_pays():
    calls = []

    def timer(t_lin, t_pk):
        def f(dtype):
            calls.append(dtype)
            return t_lin, t_pk
        return f

    assert cpu_linear.use_packed(torch.float32, timer(1.0, 0.8))          # exactly PAYS: packed
    assert cpu_linear.use_packed(torch.float32, timer(1.0, 5.0))          # cached: not measured again
    assert not cpu_linear.use_packed(torch.bfloat16, timer(1.0, 0.81))    # another dtype, measured: no gain
    assert calls == [torch.float32, torch.bfloat16]


def test_env_routes_and_bad_value(monkeypatch):
    never = lambda dtype: pytest.fail("a fixed route must not measure")  # noqa: E731
    monkeypatch.setenv(cpu_linear.ENV, "linear")
    assert not cpu_linear.use_packed(torch.float32, never)
    monkeypatch.setenv(cpu_linear.ENV, "packed")
    assert cpu_linear.use_packed(torch.float32, never)
    monkeypatch.setenv(cpu_linear.ENV, "fast")
    with pytest.raises(ValueError, match=cpu_linear.ENV):
        cpu_linear.use_packed(torch.float32, never)


def test_packed_linear_matches_f_linear_and_takes_empty_input():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    for m in (1, 3, 17):
        x = torch.randn(2, m, 32, generator=g)
        torch.testing.assert_close(cpu_linear.packed_linear(x, w, b), nn.functional.linear(x, w, b))
    assert cpu_linear.packed_linear(torch.zeros(0, 32), w).shape == (0, 48)


@pytest.mark.parametrize("kind", ["plain", "reduced", "eagle3"])
def test_runner_reroutes_every_linear_and_keeps_outputs(monkeypatch, kind):
    if kind == "plain":
        path = make_tiny_model(vocab_size=96, seed=3)
    elif kind == "reduced":
        path = make_reduced_head_model(list(range(0, 96, 2)), vocab_size=96, seed=3)
    else:
        path = make_tiny_eagle3(seed=3)
    monkeypatch.setenv(cpu_linear.ENV, "linear")
    ref = DraftRunner.from_dir(path, dtype="float32")
    monkeypatch.setenv(cpu_linear.ENV, "packed")
    run = DraftRunner.from_dir(path, dtype="float32")
    assert ref.packed_linears == 0 and ref.health()["packed_linears"] == 0
    linears = [m for m in run.model.modules() if isinstance(m, nn.Linear)]
    assert run.packed_linears == len(linears) > 0
    assert all(type(m) is cpu_linear.PackedLinear for m in linears)
    assert run.model.head_linear is cpu_linear.packed_linear
    if kind == "eagle3":  # needs the target's features: the head alone, on the same hidden states
        h = torch.randn(5, run.model.cfg.base.hidden_size, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(run.model.head_logits(h), ref.model.head_logits(h), rtol=1e-4, atol=1e-4)
        return
    ctx = [5, 9, 17, 33, 2, 40, 41]
    torch.testing.assert_close(next_logits(run, ctx), next_logits(ref, ctx), rtol=1e-4, atol=1e-4)
    assert greedy_reference(run, ctx, 8) == greedy_reference(ref, ctx, 8)
