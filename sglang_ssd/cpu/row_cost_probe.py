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

``probe_target`` keeps what it measured on disk (SGLANG_SSD_ROW_COST_CACHE: a directory, default
~/.cache/sglang-ssd/row_costs; "0" = off), one JSON file per CPU model, torch version, target shapes and
route settings, and measures only the row counts it has not seen: every server on a machine then uses the
same costs (auto K no longer flips between two near-tied K from launch to launch), and batch-size-aware K
(sglang/round_k.py) needs no probe in a live round for a batch size seen before (a b = 8 probe took
~2-3 s on an AMD EPYC core: a stall of 20 rounds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile

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
    """``linear_row_costs`` for the checkpoint at model_path (row counts measured before on this machine
    come from the disk cache); None when its config.json cannot be read."""
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            hf = json.load(fh)
        hf = hf.get("text_config", hf)
        target_shapes(hf)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("saguaro auto K: cannot read the target's shapes from %s (%s)", model_path, exc)
        return None
    rows = sorted({int(m) for m in rows})
    path = cache_file(hf, env)
    known = _load(path) if path else {}
    need = [m for m in rows if m not in known]
    if need:
        known.update(linear_row_costs(hf, need, env))
        if path:
            _save(path, known)
    return {m: known[m] for m in rows}


CACHE_ENV = "SGLANG_SSD_ROW_COST_CACHE"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
    except OSError:
        return platform.processor() or platform.machine()
    pick = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "")
    return "|".join([pick("model name"), pick("cpu family"), pick("model\t"), pick("flags")])


def cache_file(hf: dict, env=None) -> str | None:
    """The cache file for this CPU, torch, target shapes and linear route (None: caching off)."""
    env = os.environ if env is None else env
    root = env.get(CACHE_ENV, "").strip() or os.path.expanduser("~/.cache/sglang-ssd/row_costs")
    if root == "0":
        return None
    layer, head, n_layers = target_shapes(hf)
    ident = json.dumps([_cpu_name(), torch.__version__, layer, head, n_layers, sml.route(env), sml.max_rows(env),
                        sml.min_rows(env), PROBE_BYTES])
    return os.path.join(root, hashlib.sha256(ident.encode()).hexdigest()[:24] + ".json")


def _load(path: str) -> dict[int, float]:
    try:
        with open(path) as fh:
            return {int(m): float(c) for m, c in json.load(fh)["costs"].items() if float(c) > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none yet, or unreadable: measure again


def _save(path: str, costs: dict[int, float]) -> None:
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        merged = {**_load(path), **costs}  # rows another server saved meanwhile are kept
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"cpu": _cpu_name().split("|")[0], "torch": torch.__version__,
                       "costs": {str(m): c for m, c in sorted(merged.items())}}, fh)
        os.replace(tmp, path)  # atomic: servers starting together never read half a file
        tmp = None
    except OSError as exc:
        logger.info("row cost cache not written (%s): %s", path, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
