"""How the target's linears cost with the rows per request, measured on this CPU before the server starts.

``linear_row_costs`` builds weights of the target's shapes (from its config.json: q/k/v, o, gate/up, down
per layer and the lm head), float32, and times the products a forward over m rows per request makes, on one
thread (the CPU recipe's target thread), for each m, by the route the server will take
(sglang_ssd/cpu/small_m_linear.py: F.linear for one row; for 2 <= m <= SGLANG_SSD_SMALL_M_LINEAR the
fastest of F.linear, W @ x^T and the oneDNN-packed weight under the default "measure" route, else the
fixed one).  Weights are
filled, not random (same timing; fast to make), and distinct per layer up to PROBE_BYTES so that none stays
in cache, as in the real forward; the rest of the layers are counted by scaling.  About 2-4 s for
SmolLM2-135M.  sglang_ssd/saguaro/k_choice.py turns the costs into K.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from sglang_ssd.cpu import small_m_linear as sml

logger = logging.getLogger(__name__)
PROBE_BYTES = 320 << 20  # distinct layer weights made for the probe (past any L3); more layers are scaled


def target_shapes(hf: dict) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """-> (one layer's [out, in] weight shapes, the lm head's shape, number of layers) from a config dict."""
    h, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    hd = hf.get("head_dim") or h // heads
    layer = [((heads + 2 * kv) * hd, h), (h, heads * hd), (2 * inter, h), (h, inter)]
    return layer, (hf["vocab_size"], h), layers


def _product(x: torch.Tensor, w: torch.Tensor, route: str, m_max: int, m_min: int = 2) -> float:
    """Seconds of one x [m, in] by w [out, in] product by the server's route for m rows: the same
    ``applies`` / ``form_for`` decision cpu_linear makes (measured once per shape under "measure")."""
    form = sml.form_for(x, w, route) if sml.applies(x, w, m_max, m_min) else "linear"
    return sml._best_time("probe", lambda: sml.run_form(form, x, w))


def linear_row_costs(hf: dict, rows, env=None) -> dict[int, float]:
    """m -> milliseconds of the target's linears for m rows (one request), by the server's route."""
    env = os.environ if env is None else env
    route, m_max, m_min = sml.route(env), sml.max_rows(env), sml.min_rows(env)
    layer, head_shape, n_layers = target_shapes(hf)
    per_layer = sum(o * i for o, i in layer) * 4
    n_probe = max(1, min(n_layers, PROBE_BYTES // max(per_layer, 1)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            ws = [[torch.full(s, 0.01) for s in layer] for _ in range(n_probe)]
            head = torch.full(head_shape, 0.01)
            costs = {}
            for m in rows:
                t = 0.0
                for lw in ws:
                    for w in lw:
                        t += _product(torch.full((m, w.shape[1]), 0.5), w, route, m_max, m_min)
                t = t * n_layers / n_probe + _product(torch.full((m, head.shape[1]), 0.5), head, route, m_max, m_min)
                costs[m] = t * 1e3
    finally:
        torch.set_num_threads(threads)
    return costs


def probe_target(model_path: str, rows, env=None) -> dict[int, float] | None:
    """``linear_row_costs`` for the checkpoint at model_path; None when its config.json cannot be read."""
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            hf = json.load(fh)
        hf = hf.get("text_config", hf)
        target_shapes(hf)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("saguaro auto K: cannot read the target's shapes from %s (%s)", model_path, exc)
        return None
    return linear_row_costs(hf, rows, env)
