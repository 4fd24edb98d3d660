"""draft_dtype auto on a CPU (sglang_ssd/draft/cpu_dtype.py): bfloat16 exactly when this CPU's bf16 product
is measured clearly faster than the float32 one; explicit dtypes and CUDA keep their meaning; a real draft
loads and runs in the dtype auto picked here."""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft import cpu_dtype
from sglang_ssd.draft.runner import DraftRunner, resolve_dtype
from tests.tiny_models import make_tiny_model


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "_CHOICE", None)
    monkeypatch.setenv(cpu_dtype.ENV, "measure")   # conftest pins float32 for the rest of the suite


@pytest.mark.parametrize("raw,want", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_env_fixes_the_choice_without_measuring(monkeypatch, raw, want):
    monkeypatch.setenv(cpu_dtype.ENV, raw)
    assert cpu_dtype.cpu_auto_dtype(lambda: pytest.fail("measured although fixed")) is want
    monkeypatch.setenv(cpu_dtype.ENV, "fp8")
    with pytest.raises(ValueError, match="SGLANG_SSD_DRAFT_CPU_DTYPE"):
        cpu_dtype.cpu_auto_dtype()


def test_decide_needs_a_clear_win():
    assert cpu_dtype.decide(1.0, 0.5) is torch.bfloat16
    assert cpu_dtype.decide(1.0, cpu_dtype.PAYS) is torch.bfloat16
    assert cpu_dtype.decide(1.0, 0.9) is torch.float32      # inside the noise: keep float32
    assert cpu_dtype.decide(1.0, 2.5) is torch.float32      # emulated bf16 (no AVX512-BF16 / AMX)


@pytest.mark.parametrize("times,want", [((1.0, 0.3), torch.bfloat16), ((1.0, 1.7), torch.float32)])
def test_auto_follows_the_measurement_once(fresh_choice, times, want):
    calls = []

    def timer():
        calls.append(1)
        return times

    assert cpu_dtype.cpu_auto_dtype(timer) is want
    assert cpu_dtype.cpu_auto_dtype(timer) is want
    assert len(calls) == 1                                   # measured once per process


def test_resolve_dtype_auto_on_cpu_is_the_measured_choice_and_explicit_stands(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_dtype, "measure", lambda: (1.0, 0.25))
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype(torch.float16, "cpu") is torch.float16
    assert resolve_dtype("auto", "cuda") is torch.bfloat16


def test_real_measurement_is_positive_and_a_draft_runs_in_the_auto_dtype(fresh_choice):
    t_f32, t_bf16 = cpu_dtype.measure()
    assert t_f32 > 0 and t_bf16 > 0
    runner = DraftRunner.from_dir(make_tiny_model(), "cpu", "auto")
    assert cpu_dtype._CHOICE in (torch.float32, torch.bfloat16)   # the process's measured choice, cached
    assert runner.dtype is cpu_dtype._CHOICE
    assert next(runner.model.parameters()).dtype is runner.dtype
