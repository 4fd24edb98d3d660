"""Hooks that route SGLang's few-row float32 linears on CPU through ``sglang_ssd.cpu.small_m_linear``
(per weight shape and row count the measured fastest of F.linear, W @ x^T and a oneDNN-packed weight).

Registered by the plugin only on the CPU engine (``SGLANG_USE_CPU_ENGINE=1``) and so for every mode the
CPU recipe serves, plain SGLang (AR) included: AR's own decode steps at batch 2-32 take the same route,
so comparisons with it stay like for like.  Two places compute the target's matmuls:
  - ``UnquantizedLinearMethod.apply`` (qkv / o / gate_up / down projections), whose CPU branch is
    ``F.linear`` unless the layer uses the Intel AMX packed kernel;
  - ``LogitsProcessor._compute_lm_head``'s plain branch (``hidden @ W^T``), taken for an unquantized,
    non-LoRA head without AMX, fp32-head or RL on-policy options.
Everything else calls the original.
"""

from __future__ import annotations

import os

from sglang_ssd.cpu.small_m_linear import applies, form_for, max_rows, min_rows, route, run_form

LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"

_M_MAX = max_rows()
_M_MIN = min_rows()  # 2 by default: a one-row step (AR at b = 1) keeps F.linear unless asked
_ROUTE = route()  # measured per (shape, M) by default: the faster form differs between CPUs
_SGL = None  # (use_intel_amx_backend, should_apply_lm_head_quant_method), resolved at the first call


def _sglang_helpers():
    global _SGL
    if _SGL is None:  # lazily: the plugin imports this module in register(), before SGLang loads its layers
        from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
        from sglang.srt.utils import use_intel_amx_backend

        _SGL = (use_intel_amx_backend, should_apply_lm_head_quant_method)
    return _SGL


def linear_apply(orig, self, layer, x, bias=None):
    w = getattr(layer, "weight", None)
    if w is None or not applies(x, w, _M_MAX, _M_MIN) or _sglang_helpers()[0](layer):
        return orig(self, layer, x, bias)
    form = form_for(x, w, _ROUTE)
    return orig(self, layer, x, bias) if form == "linear" else run_form(form, x, w, bias)


def compute_lm_head(orig, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    amx, head_quant = _sglang_helpers()
    w = getattr(lm_head, "weight", None)
    plain = (w is not None and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
             and not head_quant(lm_head, getattr(lm_head, "quant_method", None))
             and not getattr(self, "use_fp32_lm_head", False)
             and getattr(self, "rl_on_policy_target", None) is None)
    if not plain or not applies(hidden_states, w, _M_MAX, _M_MIN) or amx(lm_head):
        return orig(self, hidden_states, lm_head, embedding_bias, **kwargs)
    form = form_for(hidden_states, w, _ROUTE)
    if form == "linear":
        return orig(self, hidden_states, lm_head, embedding_bias, **kwargs)
    return run_form(form, hidden_states, w)  # the plain branch adds no bias either


def enabled() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and _M_MAX >= _M_MIN and _ROUTE != "linear"
