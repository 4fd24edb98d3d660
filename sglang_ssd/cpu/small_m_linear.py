"""Linear layers for a few rows on CPU: y = (W @ x^T)^T instead of x @ W^T when 2 <= M <= SMALL_M_MAX.

A chain verify runs the target over M = K+1 = 4 rows per request; an AR decode step over M = 1.  On the
CPU recipe (fp32, one thread, MKL) ``F.linear`` takes a GEMV for M = 1 (weights streamed once, memory
bound) but an sgemm for M >= 2 whose small-M blocking is much slower: measured on an AMD EPYC (AVX2)
core with SmolLM2-135M's shapes, all projections plus the 49k-token head cost 1.80-2.23x the one-row time
for 2-5 rows; the same products written as ``torch.mm(W, x.t())`` (the weight as the left operand, the few
rows as columns) cost 1.23-1.36x, and are no better or slower from M = 6 on (results/small_m_linear.md,
scripts/bench_small_m.py).  Through the server this cut a b = 1 chain verify from ~240 to ~160 ms
(results/variants_small_m_linear.md).

On an Intel Xeon (AVX-512) core the same shapes behave the other way round: ``F.linear`` costs 1.07-1.15x
for 2-3 rows and 1.86-1.94x for 4-5, the W @ x^T form 2.1-2.3x for every M >= 2
(results/small_m_linear_xeon.md).
A third form, **packed**: the weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's CPU backend uses) and multiplied with
``torch.ops.mkldnn._linear_pointwise``.  No per-call packing of the weight, so from 4 rows on it stays close
to the one-row time where F.linear's sgemm does not: on the Xeon, the target's linears plus head for
M = 4 / 6 / 8 / 12 rows took 67 / 68 / 76 / 80 ms packed against 97 / 107 / 131 / 172 ms with F.linear
(one core, a throw-away script); scripts/bench_small_m.py times all three forms
(results/small_m_linear_packed_amd.md: an AMD EPYC with AVX-512).  It costs a second copy of every weight
it serves (made at that weight's first packed call, remade if the weight is changed in place); a copy made
only to be timed is dropped again when no row count of that shape keeps the packed form.

So the route is not fixed but **measured**: the first product of each (weight shape, M) times the forms on
that very input (best of a few calls each, once per process) and keeps the fastest, F.linear unless another
form is at least 10% faster; every later call takes the kept form.

Only float32 weights and inputs on CPU are rerouted (what was measured); any other case, and M outside
[2, SMALL_M_MAX], calls ``F.linear`` unchanged.  The result is the same product up to float rounding
(another summation order, as F.linear's own GEMM-vs-GEMV choice already is).

    SGLANG_SSD_SMALL_M_LINEAR   largest M to reroute (default 32; 0 or 1 = off)
    SGLANG_SSD_SMALL_M_MIN      smallest M to reroute (default 2; 1 = also one-row steps, e.g. AR's b = 1 decode)
    SGLANG_SSD_SMALL_M_ROUTE    measure (default) | wxt | packed (always that form) | linear (never)
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from sglang_ssd.config import env_number

ENV = "SGLANG_SSD_SMALL_M_LINEAR"
MIN_ENV = "SGLANG_SSD_SMALL_M_MIN"
ROUTE_ENV = "SGLANG_SSD_SMALL_M_ROUTE"
FORMS = ("linear", "wxt", "packed")
ROUTES = ("measure", *FORMS)
DEFAULT_MAX_M = 32  # b = 8 requests x K+1 = 4 rows
MEASURE_CALLS = 3   # timed calls of each form (after one warm-up call)
MIN_GAIN = 0.9      # another form is kept only when it takes <= 90% of F.linear's time
logger = logging.getLogger(__name__)
_CHOICE: dict[tuple[int, int, int], str] = {}  # (N, K, M) -> form
_PACKED_ATTR = "_sglang_ssd_packed"            # on the weight: ((its _version, data_ptr), packed copy)


def route(env=None) -> str:
    r = (os.environ if env is None else env).get(ROUTE_ENV, "measure").strip().lower()
    if r not in ROUTES:
        raise ValueError(f"{ROUTE_ENV}={r!r}: expected one of {ROUTES}")
    return r


def _best_time(label: str, fn) -> float:
    fn()
    best = float("inf")
    for _ in range(MEASURE_CALLS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, made once per weight and kept on it (remade when the
    weight was changed in place or re-pointed, e.g. by a weight update)."""
    try:
        key = (weight._version, weight.data_ptr())
    except RuntimeError:  # an inference-mode tensor keeps no version counter: it cannot change in place
        key = (0, weight.data_ptr())
    kept = getattr(weight, _PACKED_ATTR, None)
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        setattr(weight, _PACKED_ATTR, kept)
    return kept[1]


def drop_packed(weight: torch.Tensor) -> None:
    if getattr(weight, _PACKED_ATTR, None) is not None:
        delattr(weight, _PACKED_ATTR)


def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) with the packed copy of W, for callers that checked ``applies``."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed_weight(weight), bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def run_form(form: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if form == "wxt":
        return wxt(x, weight, bias)
    if form == "packed":
        return packed(x, weight, bias)
    return F.linear(x, weight, bias)


def form_for(x: torch.Tensor, weight: torch.Tensor, mode: str) -> str:
    """For a call that ``applies``: which form computes it.  mode "measure": the kept timing of this
    (shape, M); a fixed mode names its form ("packed" falls back to F.linear where oneDNN is missing)."""
    if mode != "measure":
        return "linear" if mode == "packed" and not packed_available() else mode
    flat = x.reshape(-1, x.shape[-1])
    key = (weight.shape[0], weight.shape[1], flat.shape[0])
    form = _CHOICE.get(key)
    if form is None:
        forms = [f for f in FORMS if f != "packed" or packed_available()]
        with torch.no_grad():
            times = {f: _best_time(f, lambda f=f: run_form(f, flat, weight)) for f in forms}
        best = min(times, key=times.get)
        form = _CHOICE[key] = best if times[best] <= MIN_GAIN * times["linear"] else "linear"
        if form != "packed" and not any(f == "packed" for k, f in _CHOICE.items() if k[:2] == key[:2]):
            drop_packed(weight)  # made only to be timed: no row count of this shape serves it
        logger.debug("few-row linear [%d x %d] at M = %d: %s -> %s", key[0], key[1], key[2],
                     ", ".join(f"{f} {t * 1e3:.3f} ms" for f, t in times.items()), form)
    return form


def max_rows(env=None) -> int:
    return env_number(ENV, DEFAULT_MAX_M, env)


def min_rows(env=None) -> int:
    return max(1, env_number(MIN_ENV, 2, env))


def applies(x: torch.Tensor, weight: torch.Tensor, m_max: int, m_min: int = 2) -> bool:
    """True when (x, weight) may be rerouted (``form_for``): CPU, float32, a plain 2-D weight,
    m_min <= rows <= m_max."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if weight.dim() != 2 or weight.device.type != "cpu" or type(weight.data) is not torch.Tensor:
        return False
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    m = x.numel() // max(x.shape[-1], 1)
    return m_min <= m <= m_max


def wxt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W @ x^T product for x [..., K], weight [N, K], for callers that checked ``applies``."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, flat.t()).t().contiguous()  # [M, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   m_max: int = DEFAULT_MAX_M) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K], weight [N, K]; W @ x^T when ``applies``."""
    if not applies(x, weight, m_max):
        return F.linear(x, weight, bias)
    return wxt(x, weight, bias)
