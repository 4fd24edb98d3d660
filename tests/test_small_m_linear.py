"""The few-row CPU linear (sglang_ssd/cpu/small_m_linear.py) and the hooks that route SGLang's matmuls
through it on the CPU engine (sglang_ssd/sglang/cpu_linear.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sglang_ssd.cpu import small_m_linear as sm
from sglang_ssd.cpu.small_m_linear import applies, max_rows, small_m_linear


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (4, 64), (5, 64), (6, 64), (9, 64), (2, 2, 64), (1, 4, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_same_product_as_f_linear(shape, bias):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    y = small_m_linear(x, w, b, m_max=5)
    ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    m = x.numel() // 64
    if 2 <= m <= 5:  # rerouted: exactly the W @ x^T product
        assert torch.equal(y.reshape(m, 96), (torch.mm(w, x.reshape(m, 64).t()).t() + (b if bias else 0)))
    else:  # F.linear itself, bit for bit
        assert torch.equal(y, ref)


def test_only_float32_cpu_few_rows_are_rerouted():
    w = torch.randn(8, 4)
    assert applies(torch.randn(4, 4), w, 5)
    assert not applies(torch.randn(1, 4), w, 5) and not applies(torch.randn(6, 4), w, 5)
    assert not applies(torch.randn(4, 4), w, 1)  # off
    assert not applies(torch.randn(4, 4, dtype=torch.bfloat16), w.bfloat16(), 5)
    assert not applies(torch.randn(4, 3), w, 5)  # shape mismatch: F.linear raises its own error
    with pytest.raises(RuntimeError):
        small_m_linear(torch.randn(4, 3), w)


needs_onednn = pytest.mark.skipif(not sm.packed_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [2, 4, 7, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_form_is_the_same_product(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    for form in sm.FORMS:
        y = sm.run_form(form, x.view(1, rows, 64), w, b)
        assert y.shape == (1, rows, 96)
        torch.testing.assert_close(y[0], F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_packed_copy_is_made_once_and_remade_when_the_weight_changes():
    w, x = torch.randn(96, 64), torch.randn(4, 64)
    p1 = sm.packed_weight(w)
    assert sm.packed_weight(w) is p1  # kept on the weight
    w.mul_(2)  # an in-place update (e.g. update_weights): the old packed copy would give the old product
    p2 = sm.packed_weight(w)
    assert p2 is not p1
    torch.testing.assert_close(sm.packed(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_env_knob():
    assert max_rows({}) == 32 and max_rows({"SGLANG_SSD_SMALL_M_LINEAR": "0"}) == 0
    with pytest.raises(ValueError, match="SGLANG_SSD_SMALL_M_LINEAR"):
        max_rows({"SGLANG_SSD_SMALL_M_LINEAR": "x"})
    with pytest.raises(ValueError, match=">= 0"):
        max_rows({"SGLANG_SSD_SMALL_M_LINEAR": "-1"})


HOOK_CHECK = textwrap.dedent("""
    import os, types, torch, torch.nn.functional as F
    from sglang_ssd.sglang import cpu_linear, plugin
    from sglang.srt.plugins.hook_registry import HookRegistry
    calls, real = [], cpu_linear.run_form
    cpu_linear.run_form = lambda form, x, *a, **k: (calls.append((form, x.shape[0])), real(form, x, *a, **k))[1]
    plugin.register()
    HookRegistry.apply_hooks()
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.logits_processor import LogitsProcessor
    form = os.environ["SGLANG_SSD_SMALL_M_ROUTE"]
    w = torch.randn(96, 64)
    layer = types.SimpleNamespace(weight=w)
    for m in (1, 4, 40):
        x = torch.randn(m, 64)
        y = UnquantizedLinearMethod().apply(layer, x)
        assert torch.allclose(y, F.linear(x, w), atol=1e-4)
        if m == 4 and calls:
            assert torch.equal(y, real(form, x, w))
    head = types.SimpleNamespace(weight=w, quant_method=None)
    lp = types.SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    x = torch.randn(4, 64)
    assert torch.allclose(LogitsProcessor._compute_lm_head(lp, x, head), x @ w.t(), atol=1e-4)
    print("ROUTED", calls)
""")


@pytest.mark.parametrize("form", ["wxt", pytest.param("packed", marks=needs_onednn)])
@pytest.mark.parametrize("cpu_engine", ["1", "0"])
def test_hooks_route_sglang_matmuls_on_the_cpu_engine_only(cpu_engine, form):
    """In a fresh process (hooks patch SGLang's classes for good): with SGLANG_USE_CPU_ENGINE=1 the plugin
    routes a 4-row UnquantizedLinearMethod.apply and the plain lm-head product through the fixed form
    (a spy counts the calls), 1- and 40-row calls (beyond the 32-row default) stay F.linear; without the
    CPU engine nothing is rerouted."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE=cpu_engine, SGLANG_SSD_SMALL_M_ROUTE=form)  # not timing-dependent
    env.pop("SGLANG_SSD_SMALL_M_LINEAR", None)
    out = subprocess.run([sys.executable, "-c", HOOK_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ROUTED")][-1]
    assert line == (f"ROUTED [('{form}', 4), ('{form}', 4)]" if cpu_engine == "1" else "ROUTED []"), line


def test_measured_route_follows_the_fastest_form_once_per_shape(monkeypatch):
    """Route "measure": the first call of a (shape, M) times every form and keeps the fastest (another
    form than F.linear only when >= 10% faster); later calls of that shape do not time again; other routes
    are fixed."""
    timed = []
    cost = {"linear": 1.0, "wxt": 0.5, "packed": 0.7}
    monkeypatch.setattr(sm, "_best_time", lambda label, fn: (timed.append(label), cost[label])[1])
    monkeypatch.setattr(sm, "_CHOICE", {})
    monkeypatch.setattr(sm, "packed_available", lambda: True)
    w, x4, x3, x5 = torch.randn(24, 16), torch.randn(4, 16), torch.randn(3, 16), torch.randn(5, 16)
    assert sm.form_for(x4, w, "measure") == "wxt" and timed == ["linear", "wxt", "packed"]
    assert sm.form_for(x4, w, "measure") == "wxt" and len(timed) == 3  # kept: no second timing
    cost.update(wxt=0.95, packed=0.92)  # neither 10% faster: F.linear
    assert sm.form_for(x3, w, "measure") == "linear" and len(timed) == 6
    cost.update(packed=0.4)
    assert sm.form_for(x5, w, "measure") == "packed" and len(timed) == 9
    assert sm.form_for(x3, w, "wxt") == "wxt" and sm.form_for(x4, w, "linear") == "linear" and len(timed) == 9
    monkeypatch.setattr(sm, "packed_available", lambda: False)
    assert sm.form_for(x4, w, "packed") == "linear"  # no oneDNN: the fixed route falls back
    assert sm.route({}) == "measure" and sm.route({"SGLANG_SSD_SMALL_M_ROUTE": "PACKED"}) == "packed"
    with pytest.raises(ValueError, match="SMALL_M_ROUTE"):
        sm.route({"SGLANG_SSD_SMALL_M_ROUTE": "fast"})


@pytest.mark.skipif(not sm.packed_available(), reason="no oneDNN in this torch")
def test_a_packed_copy_made_only_to_be_timed_is_dropped(monkeypatch):
    """Measuring packs the weight; when no row count of that shape keeps "packed", the copy goes again,
    and it stays once some row count of the shape keeps it."""
    cost = {"linear": 1.0, "wxt": 0.95, "packed": 0.95}
    monkeypatch.setattr(sm, "_best_time", lambda label, fn: (fn(), cost[label])[1])  # runs each form for real
    monkeypatch.setattr(sm, "_CHOICE", {})
    w = torch.randn(24, 16)
    assert sm.form_for(torch.randn(3, 16), w, "measure") == "linear"
    assert getattr(w, sm._PACKED_ATTR, None) is None  # timed, not kept: dropped
    cost.update(packed=0.5)
    assert sm.form_for(torch.randn(8, 16), w, "measure") == "packed"
    assert getattr(w, sm._PACKED_ATTR, None) is not None
    cost.update(packed=0.95)
    assert sm.form_for(torch.randn(2, 16), w, "measure") == "linear"
    assert getattr(w, sm._PACKED_ATTR, None) is not None  # M = 8 still serves it


def test_one_row_steps_are_rerouted_only_when_asked():
    """SGLANG_SSD_SMALL_M_MIN: 2 by default (a one-row step keeps F.linear), 1 routes one-row steps too."""
    w, x1 = torch.randn(24, 16), torch.randn(1, 16)
    assert sm.min_rows({}) == 2 and not sm.applies(x1, w, 32, sm.min_rows({}))
    assert sm.min_rows({"SGLANG_SSD_SMALL_M_MIN": "1"}) == 1 and sm.applies(x1, w, 32, 1)
    assert sm.min_rows({"SGLANG_SSD_SMALL_M_MIN": "0"}) == 1  # never below one row
    assert torch.allclose(sm.run_form("packed" if sm.packed_available() else "wxt", x1, w), x1 @ w.t(), atol=1e-5)
