"""The CPU draft's linears on oneDNN-packed weights, where this CPU runs them faster than F.linear.

The draft's forwards are few-row products (a backup step: 1-8 rows; a tree-build chunk: up to ~64): on a
CPU core F.linear is weight-bandwidth bound there and, in bfloat16 (what ``draft_dtype: auto`` picks on
CPUs with native bf16), far from the bandwidth: on an AMD EPYC Zen 4 core the trained draft's 15 products
(2 layers + the 8,192-row head) took 4.2 / 2.8 / 3.3 / 4.4 ms for 1 / 2 / 4 / 16 rows with F.linear and
1.6 / 1.5 / 1.5 / 2.7 ms with the weight reordered once into oneDNN's blocked layout (the form the
target's few-row linears already use, ``cpu/small_m_linear.packed``); float32 3.8 vs 4.3 ms at one row,
3.1 vs 6.1 ms at four.  A backup step is on the critical path of every round that misses the cache (and
every SD round), so this is the draft's answer time.

Measured, not assumed: one draft-like product ([1 and 16 rows] x [576 -> 1536]) in the model's dtype, F.linear
against packed, best of a few timings, once per process and dtype; packed is used when it takes <= PAYS of
F.linear's time.  It then serves every nn.Linear of the model and the head's product (the packed copy
is made at a weight's first call and kept on it; ~the draft's weight bytes once more).  Exactness does not
depend on it: verification uses the q the draft sends, whatever arithmetic produced it.

    SGLANG_SSD_DRAFT_CPU_LINEAR   measure (default) | packed | linear
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ssd.cpu.small_m_linear import _best_time, packed, packed_available

logger = logging.getLogger(__name__)

ENV = "SGLANG_SSD_DRAFT_CPU_LINEAR"
ROUTES = ("measure", "packed", "linear")
ROWS, HIDDEN, OUT = (1, 16), 576, 1536
PAYS = 0.8  # packed must take <= 0.8x F.linear's time (a clear win, not noise)
_CHOICE: dict[torch.dtype, bool] = {}  # dtype -> packed pays (measured once per process)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear's product through the packed copy of weight (F.linear itself for an empty input)."""
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    return packed(x, weight, bias)


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward runs on the packed weight (the module keeps its parameters as they are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


def measure(dtype: torch.dtype) -> tuple[float, float]:
    """-> (seconds of the draft-like products with F.linear, with packed weights) on the calling thread."""
    w = torch.full((OUT, HIDDEN), 0.01, dtype=dtype)
    xs = [torch.full((m, HIDDEN), 0.5, dtype=dtype) for m in ROWS]
    with torch.no_grad():
        t_lin = _best_time("linear", lambda: [F.linear(x, w) for x in xs])
        t_pk = _best_time("packed", lambda: [packed_linear(x, w) for x in xs])
    return t_lin, t_pk


def use_packed(dtype: torch.dtype, timer: Optional[Callable[[torch.dtype], tuple[float, float]]] = None) -> bool:
    """Whether a CPU draft of this dtype runs its linears packed (env route, else measured once)."""
    route = os.environ.get(ENV, "measure").strip().lower()
    if route not in ROUTES:
        raise ValueError(f"{ENV}={route!r}: expected one of {ROUTES}")
    if route == "linear" or not packed_available():
        return False
    if route == "packed":
        return True
    if dtype not in _CHOICE:
        t_lin, t_pk = (timer or measure)(dtype)
        _CHOICE[dtype] = t_pk <= PAYS * t_lin
        logger.info("draft linears on CPU (%s): %s (draft-like products: F.linear %.3f ms, packed %.3f ms)",
                    str(dtype).replace("torch.", ""), "packed" if _CHOICE[dtype] else "F.linear",
                    t_lin * 1e3, t_pk * 1e3)
    return _CHOICE[dtype]


def route_linears(model: nn.Module, dtype: torch.dtype, timer=None) -> int:
    """Reroute a CPU draft model's linears (every nn.Linear and its head product) to packed weights when
    ``use_packed``; -> the number of modules rerouted (0: F.linear stays)."""
    if not use_packed(dtype, timer):
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.weight.device.type == "cpu":
            mod.__class__ = PackedLinear
            n += 1
    model.head_linear = packed_linear  # the head's F.linear(hidden, w) (w may be the tied embedding)
    return n
