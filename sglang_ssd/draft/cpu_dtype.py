"""Which dtype a CPU draft runs in under ``draft_dtype: auto``: bfloat16 where this CPU's bf16 GEMMs are
faster than float32 ones, else float32.

CPUs with native bf16 dot products (AVX512-BF16, AMX: AMD Zen 4/5, Intel Sapphire Rapids and later) run the
draft's small-row products 2-3x faster in bf16 (an AMD EPYC Zen 5 core: the 2-layer draft's forward over 12
rows 13.3 -> 4.5 ms, 1 row 4.3 -> 2.0 ms), and half the weight bytes also halve the draft's memory traffic
beside the target; CPUs without them emulate bf16 and run it slower than float32.  So the choice is measured,
not guessed from flags: one product of a draft-like shape ([16, 576] x [576, 1536], the rows of a
tree-build chunk), best of a few timings in each dtype on the draft's own thread, before the model loads
(~0.1 s).  The draft's dtype never touches exactness: verification uses the q the draft sends, whatever
arithmetic produced it.

    SGLANG_SSD_DRAFT_CPU_DTYPE   measure (default) | float32 | bfloat16: what auto means on a CPU (the test
                                 suite pins float32, so its numerics checks do not depend on the CPU model)
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from sglang_ssd.cpu.small_m_linear import _best_time  # warm-up call, then the best of a few timed calls

logger = logging.getLogger(__name__)

ROWS, HIDDEN, OUT = 16, 576, 1536
PAYS = 0.8  # bf16 must take <= 0.8x the float32 time (a clear win, not noise)
_CHOICE: Optional[torch.dtype] = None  # measured once per process
ENV = "SGLANG_SSD_DRAFT_CPU_DTYPE"
FIXED = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure() -> tuple[float, float]:
    """-> (seconds of one draft-like product in float32, in bfloat16) on the calling thread."""
    times = []
    with torch.no_grad():
        for dt in (torch.float32, torch.bfloat16):
            x, w = torch.full((ROWS, HIDDEN), 0.5, dtype=dt), torch.full((OUT, HIDDEN), 0.01, dtype=dt)
            times.append(_best_time("draft dtype", lambda: F.linear(x, w)))
    return times[0], times[1]


def decide(t_f32: float, t_bf16: float) -> torch.dtype:
    return torch.bfloat16 if t_bf16 <= PAYS * t_f32 else torch.float32


def cpu_auto_dtype(timer: Optional[Callable[[], tuple[float, float]]] = None) -> torch.dtype:
    """The dtype ``auto`` means for a CPU draft in this process (measured on first call, then cached);
    timer: what measures (default ``measure``)."""
    global _CHOICE
    raw = os.environ.get(ENV, "measure").strip().lower()
    if raw in FIXED:
        return FIXED[raw]
    if raw != "measure":
        raise ValueError(f"{ENV}={raw!r}: expected measure, float32 or bfloat16")
    if _CHOICE is None:
        t_f32, t_bf16 = (timer or measure)()
        _CHOICE = decide(t_f32, t_bf16)
        logger.info("draft dtype auto on CPU: %s (a [%d, %d] x [%d, %d] product: float32 %.3f ms, bfloat16 %.3f ms)",
                    str(_CHOICE).replace("torch.", ""), ROWS, HIDDEN, HIDDEN, OUT, t_f32 * 1e3, t_bf16 * 1e3)
    return _CHOICE
