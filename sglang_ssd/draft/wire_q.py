"""The wire form of a reply's q rows (SpecReply.q and q_ids, protocol v5).

The draft works over its head's column space (a reduced head: W of the V ids, sorted; rows [K, W]); a fast or
hybrid backup's row is [K, V] since a copied token may be an id the head lacks.  The verifier scatters the wire
rows over V with zeros elsewhere, so every row must keep its exact float16 values and be exactly 0 at the ids
left out.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def wire_q(rows: list[torch.Tensor], k_spec: int, cols: Optional[torch.Tensor], v: int,
           head_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reply's q rows -> (q [m, K, W] float16, q_ids): over the head's own ids when every row is in
    the column space (cache entries, neural backups).  A fast / hybrid backup's row is dense over V
    (a copied token may be an id the head lacks): then q travels over the head's ids plus the ids
    those rows use outside them (their random tokens come from the head's ids); empty q_ids (dense)
    if that is every id.  Every row keeps its values; the ids it leaves out are exactly 0."""
    if not rows:
        w = v if cols is None else int(cols.numel())
        return np.zeros((0, k_spec, w), dtype=np.float16), head_ids
    if cols is None or all(r.shape[-1] == cols.numel() for r in rows):
        return torch.stack(rows).cpu().numpy(), head_ids
    rows, cols = [r.cpu() for r in rows], cols.cpu()
    wide = [i for i, r in enumerate(rows) if r.shape[-1] == v]
    narrow = [i for i, r in enumerate(rows) if r.shape[-1] != v]
    dense = torch.stack([rows[i] for i in wide])
    used = dense.flatten(0, -2).amax(0) > 0  # q >= 0: an id is used iff some row is > 0 there
    used[cols] = True
    ids = used.nonzero().squeeze(1)  # sorted, strictly increasing
    out = torch.zeros(len(rows), k_spec, int(ids.numel()), dtype=torch.float16)
    out[wide] = dense[:, :, ids]
    if narrow:  # rows over the head's ids: each head id's place among ids
        at = (used.cumsum(0) - 1)[cols]
        out[narrow] = torch.zeros(len(narrow), k_spec, int(ids.numel()), dtype=torch.float16).index_copy_(
            2, at, torch.stack([rows[i] for i in narrow]))
    wire_ids = np.zeros(0, dtype=np.int64) if ids.numel() == v else ids.numpy().astype(np.int64)
    return out.numpy(), wire_ids
