"""The wire form of a reply's q rows (SpecReply.q and q_ids, protocol v5).

The draft works over its head's column space (a reduced head: W of the V ids, sorted; rows [K, W]).  A fast
or hybrid backup's copied token may be an id the head lacks: its row is 0 over the columns at that depth and
the copy travels as (row, depth, token), one-hot at that id.  The verifier scatters the wire rows over V
with zeros elsewhere, so every row must keep its exact float16 values and be exactly 0 at the ids left out.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def wire_q(rows: list[torch.Tensor], k_spec: int, cols: Optional[torch.Tensor], v: int, head_ids: np.ndarray,
           outside: Sequence[tuple[int, int, int]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The reply's q rows [K, W] (over the columns) -> (q [m, K, W'] float16, q_ids): over the head's own
    ids (head_ids) unless ``outside`` lists copies (reply row, depth, token) of ids outside them: then over
    the head's ids plus those ids (sorted), each copy's q 1 at its id; empty q_ids (dense) if that is
    every id."""
    if not rows:
        w = v if cols is None else int(cols.numel())
        return np.zeros((0, k_spec, w), dtype=np.float16), head_ids
    q = torch.stack([r.cpu() for r in rows])  # cache rows may live on a GPU draft's device, backups on the CPU
    if not outside:
        return q.numpy(), head_ids
    cols = cols.cpu()
    extra = torch.as_tensor(sorted({t for _, _, t in outside}), dtype=cols.dtype)
    ids = torch.cat([cols, extra]).sort().values  # disjoint: the copies are ids the head lacks
    out = torch.zeros(len(rows), k_spec, int(ids.numel()), dtype=torch.float16)
    out.index_copy_(2, torch.searchsorted(ids, cols), q)
    r, d, t = (list(x) for x in zip(*outside))
    out[r, d, torch.searchsorted(ids, torch.as_tensor(t, dtype=ids.dtype))] = 1.0
    wire_ids = np.zeros(0, dtype=np.int64) if ids.numel() == v else ids.numpy().astype(np.int64)
    return out.numpy(), wire_ids
