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
So the route is not fixed but **measured**: the first product of each (weight shape, M) times both forms
on that very input (best of a few calls each, once per process, well under a second in all) and keeps
W @ x^T only where it is at least 10% faster; every later call takes the kept route.

Only float32 weights and inputs on CPU are rerouted (what was measured); any other case, and M outside
[2, SMALL_M_MAX], calls ``F.linear`` unchanged.  The result is the same product up to float rounding
(another summation order, as F.linear's own GEMM-vs-GEMV choice already is).

    SGLANG_SSD_SMALL_M_LINEAR   largest M to reroute (default 5; 0 or 1 = off)
    SGLANG_SSD_SMALL_M_ROUTE    measure (default) | wxt (always W @ x^T, the earlier rule) | linear (never)
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from sglang_ssd.config import env_number

ENV = "SGLANG_SSD_SMALL_M_LINEAR"
ROUTE_ENV = "SGLANG_SSD_SMALL_M_ROUTE"
ROUTES = ("measure", "wxt", "linear")
DEFAULT_MAX_M = 5
MEASURE_CALLS = 5   # timed calls of each form (after one warm-up call)
MIN_GAIN = 0.9      # W @ x^T is kept only when it takes <= 90% of F.linear's time
logger = logging.getLogger(__name__)
_CHOICE: dict[tuple[int, int, int], bool] = {}  # (N, K, M) -> take W @ x^T


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


def prefer_wxt(x: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """For a call that ``applies``: take W @ x^T?  mode "measure": by the kept timing of this shape."""
    if mode != "measure":
        return mode == "wxt"
    flat = x.reshape(-1, x.shape[-1])
    key = (weight.shape[0], weight.shape[1], flat.shape[0])
    choice = _CHOICE.get(key)
    if choice is None:
        with torch.no_grad():
            t_lin = _best_time("linear", lambda: F.linear(flat, weight))
            t_wxt = _best_time("wxt", lambda: torch.mm(weight, flat.t()))
        choice = _CHOICE[key] = t_wxt <= MIN_GAIN * t_lin
        logger.info("few-row linear [%d x %d] at M = %d: F.linear %.3f ms, W @ x^T %.3f ms -> %s", key[0], key[1],
                    key[2], t_lin * 1e3, t_wxt * 1e3, "W @ x^T" if choice else "F.linear")
    return choice


def max_rows(env=None) -> int:
    return env_number(ENV, DEFAULT_MAX_M, env)


def applies(x: torch.Tensor, weight: torch.Tensor, m_max: int) -> bool:
    """True when (x, weight) take the W @ x^T route: CPU, float32, a plain 2-D weight, 2 <= rows <= m_max."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if weight.dim() != 2 or weight.device.type != "cpu" or type(weight.data) is not torch.Tensor:
        return False
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    m = x.numel() // max(x.shape[-1], 1)
    return 2 <= m <= m_max


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
