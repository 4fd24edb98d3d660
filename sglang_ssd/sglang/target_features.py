"""The target's features for an EAGLE-3 draft: captured in the target's forwards, sent with the next Speculate.

An EAGLE-3 head conditions on the target's residual stream at a few layers (its HelloReply names them).
The worker turns SGLang's own capture on for them (``set_eagle3_layers_to_capture``, as SGLang's EAGLE-3
workers do) and asks every target forward for its hidden states (``CaptureHiddenMode.FULL``): the
logits output then carries the concatenated aux states of every position it ran.  Of a prefill all
prompt positions are kept; of a verify the positions that were committed (root + accepted drafts: the
bonus token has not been run yet, the next verify runs it as its root).  They wait here, float16 on
the host, until the request's next Speculate carries them (``take``); a request that ends drops them.
Nothing here affects what the target computes or accepts: exactness does not depend on the features.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


def enable_capture(model, layers: Sequence[int], dim: int) -> None:
    """Turn on SGLang's aux hidden-state capture of `layers` (the draft's feature layers) on the target."""
    from sglang_ssd.config import SaguaroConfigError

    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise SaguaroConfigError(f"the draft is an EAGLE-3 head, but the target model {type(model).__name__} "
                                 "cannot capture hidden states for it (no set_eagle3_layers_to_capture)")
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    if hidden and hidden * len(layers) != dim:
        raise SaguaroConfigError(f"the EAGLE-3 draft takes features of width {dim}, but {len(layers)} layers of "
                                 f"the target (hidden size {hidden}) give {hidden * len(layers)}")
    model.set_eagle3_layers_to_capture(list(layers))
    logger.info("saguaro: capturing the target's hidden states at layers %s for the EAGLE-3 draft", list(layers))


class TargetFeatures:
    def __init__(self) -> None:
        self.layers: list[int] = []
        self.dim = 0
        self.pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # rid -> (first position, row blocks)
        self.captured_rows = 0
        self.sent_rows = 0

    @property
    def enabled(self) -> bool:
        return self.dim > 0

    def configure(self, layers: Sequence[int], dim: int) -> None:
        if self.enabled and (list(layers) != self.layers or dim != self.dim):
            logger.warning("saguaro: the draft now asks for features of layers %s (width %d), not %s (%d)",
                           list(layers), dim, self.layers, self.dim)
        self.layers, self.dim = list(layers), int(dim)

    def add(self, rid: str, start: int, rows: torch.Tensor) -> None:
        """Rows [m, F] (host float16) for positions start .. start + m - 1 of request `rid`."""
        if rows.shape[0] == 0:
            return
        self.captured_rows += rows.shape[0]
        cur = self.pending.get(rid)
        if cur is not None and cur[0] + sum(r.shape[0] for r in cur[1]) == start:
            cur[1].append(rows)
        else:  # not contiguous with what waits (a re-encoded request): the newer rows win
            self.pending[rid] = (start, [rows])

    def from_prefill(self, rids: Sequence[str], prefix_lens: Sequence[int], extend_lens: Sequence[int],
                     hidden: Optional[torch.Tensor]) -> None:
        """A prefill (or one chunk of it): request i ran positions prefix_lens[i] .. + extend_lens[i] - 1,
        its rows consecutive in `hidden` [sum(extend_lens), F]."""
        if hidden is None:
            return
        host = hidden.to("cpu", torch.float16)
        off = 0
        for rid, start, n in zip(rids, prefix_lens, extend_lens):
            self.add(rid, int(start), host[off: off + int(n)])
            off += int(n)

    def from_verify(self, rids: Sequence[str], seq_lens: Sequence[int], accept_lens: Sequence[int],
                    hidden: Optional[torch.Tensor], n: int) -> None:
        """A chain verify of width n: row b's chain ran at positions seq_lens[b] .. + n - 1; its first
        accept_lens[b] positions (root + accepted drafts) are committed."""
        if hidden is None:
            return
        idx = torch.cat([torch.arange(b * n, b * n + int(a)) for b, a in enumerate(accept_lens)])
        host = hidden[idx.to(hidden.device)].to("cpu", torch.float16)
        off = 0
        for rid, start, a in zip(rids, seq_lens, accept_lens):
            self.add(rid, int(start), host[off: off + int(a)])
            off += int(a)

    def take(self, rids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (feat_starts [n], feat_lens [n], features [sum, F] float16) for a Speculate of `rids`."""
        starts, lens, blocks = [], [], []
        for rid in rids:
            start, rows = self.pending.pop(rid, (0, []))
            m = sum(r.shape[0] for r in rows)
            starts.append(start)
            lens.append(m)
            blocks += rows
        feats = torch.cat(blocks).numpy() if blocks else np.zeros((0, self.dim), dtype=np.float16)
        self.sent_rows += feats.shape[0]
        return np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64), feats

    def drop(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.pending.pop(rid, None)
