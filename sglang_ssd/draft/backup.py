"""Backup speculation for rows the cache missed: which kind, and the fast kind itself.

Two kinds (the paper's Section 4.3): "neural" = the draft model decodes K tokens just in time
(DraftEngine._decode_backup: accurate, costs K draft steps on the critical path); "fast" = n-gram /
prompt-lookup copying over the request's own tokens, uniform random tokens where nothing matches
(near-free, accepts less).  Each proposal carries its TRUE proposal distribution for the verifier:
one-hot for a copied token (a deterministic function of the context), uniform for a random one.

"hybrid" = the draft model decodes the first token (one step, which also brings its KV up to date for
the cache build that follows), the n-gram copy proposes the rest from the context plus that token.

The kind is the session's ``backup`` setting: "neural", "fast", "hybrid", or "auto" = BackupPolicy (Corollary 16:
fast wins past the critical batch size b*), fed by what the engine sees between rounds: which rows hit,
how many tokens each speculation yielded (k + 1 from the next Speculate), the interval between a reply
and the next request (taken as the verify time), and its own build / backup times.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

import torch

from sglang_ssd.draft.state import RequestState
from sglang_ssd.protocol import BACKUPS
from sglang_ssd.saguaro.backup_policy import BackupPolicy
HYBRID_STEPS_ENV = "SGLANG_SSD_HYBRID_STEPS"  # draft-model tokens before the n-gram tail: auto | 1, 2, ...
SAMPLED_HYBRID_STEPS = 2  # auto, a round with a sampled missed row (results/variants_hybrid_steps_t1.md)


def hybrid_steps() -> int:
    """How many leading tokens of a hybrid backup the draft model decodes: 0 = auto (1 when every missed
    row of the round is greedy, SAMPLED_HYBRID_STEPS when one is sampled), else that many (>= 1; K or more
    = a neural backup), from SGLANG_SSD_HYBRID_STEPS; read once when the draft engine starts.

    At T = 1 a copied token is accepted with probability p(token) only, so a second model token pays
    there: a missed row commits 1.36-1.45 -> 1.44-1.51 tokens for 2.7-5.6 ms more wait (b = 1 / 4 / 8,
    SSD tok/s 1.08 / 1.12 / 1.06x, AMD EPYC Zen 5); at T = 0 the same run's ratios were 1.01 / 0.87 / 1.04
    (noise), so greedy rounds keep one."""
    raw = os.environ.get(HYBRID_STEPS_ENV, "auto").strip().lower()
    if raw == "auto":
        return 0
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{HYBRID_STEPS_ENV}={raw!r}: expected auto or an integer >= 1")
    return int(raw)


def fast_backup(states: Sequence[RequestState], k: int, vocab_size: int,
                generator: Optional[torch.Generator],
                head: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
                cols: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], list[tuple[int, int, int]]]:
    """-> (tokens [m, K] long, q16 [m, K, W] float16 over the draft's column space (W = len(cols), or V
    without a reduced head; None if every row is greedy; greedy rows' q rows are zero), outside).  The
    n-gram index of each request grows incrementally with its context.

    A random token is drawn uniformly from the columns (q = 1/W on each); a copied token's q is one-hot at
    it: in its column when the head has that id, else the row over the columns is 0 at that depth and
    (row, depth, token) is listed in ``outside`` (a copy may be an id a reduced head lacks; wire_q adds
    those ids to the reply).  head (the "hybrid" kind): (tokens [m, h], q16 [m, h, W] or None) the draft
    model already proposed for the first h positions; the n-gram copy then continues after them (context
    + head).  Copied tail tokens are a deterministic function of context + head, so their one-hot q is the
    exact conditional proposal, as in the pure fast kind."""
    m = len(states)
    cols = None if cols is None else cols.cpu()
    w = vocab_size if cols is None else int(cols.numel())
    uniform = torch.full((w,), 1.0 / w, dtype=torch.float32).to(torch.float16)  # survives renormalising
    toks = torch.zeros(m, k, dtype=torch.long)
    h = 0 if head is None else int(head[0].shape[1])
    q16, outside = None, []
    for i, st in enumerate(states):
        index = st.ngram_index()
        lead = [] if head is None else head[0][i].tolist()
        proposed, is_random = (index.propose_after(lead, k - h, vocab_size, generator, ids=cols) if h
                               else index.propose(k, vocab_size, generator, ids=cols))
        toks[i] = torch.as_tensor(lead + proposed)
        if st.temperature <= 0:
            continue
        if q16 is None:
            q16 = torch.zeros(m, k, w, dtype=torch.float16)
        if h:
            q16[i, :h] = head[1][i].to(device="cpu", dtype=torch.float16)
        copied = [(j, t) for j, (t, rnd) in enumerate(zip(proposed, is_random), start=h) if not rnd]
        q16[i, [j for j, rnd in enumerate(is_random, start=h) if rnd]] = uniform
        if copied and cols is None:
            q16[i, [j for j, _ in copied], [t for _, t in copied]] = 1.0
        elif copied:
            ts = torch.as_tensor([t for _, t in copied])
            at = torch.searchsorted(cols, ts).clamp_max(w - 1)
            for (j, t), c, inside in zip(copied, at.tolist(), (cols[at] == ts).tolist()):
                if inside:
                    q16[i, j, c] = 1.0
                else:
                    outside.append((i, j, t))
    return toks, q16, outside


class BackupChooser:
    """Per-round choice of the backup kind, with the observations BackupPolicy needs."""

    def __init__(self, mode: str = "neural"):
        if mode not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {mode!r}")
        self.mode = mode
        # "auto" measures both kinds (exploration from batch 2, where fast can pay) before it trusts the model;
        # "hybrid" is a fixed choice (the policy's model covers neural vs fast only)
        self.policy = BackupPolicy(override="auto" if mode == "hybrid" else mode, explore_min_batch=2)
        self._t_reply: Optional[float] = None
        self._last: dict[str, float] = {}
        self.rows = {"neural": 0, "fast": 0, "hybrid": 0}

    def observe(self, states: Sequence[RequestState], ks: Sequence[int]) -> None:
        """Called at the start of a round: the previous round's speculations were verified."""
        if self._t_reply is None or not self._last or self.mode == "hybrid":
            return
        rows = [(st.last_hit, k + 1) for st, k in zip(states, ks) if k >= 0 and st.last_spec is not None]
        t_verify = time.perf_counter() - self._t_reply
        if not rows or t_verify <= 0:
            return
        self.policy.observe_round(from_cache=[h for h, _ in rows], accept_lens=[n for _, n in rows],
                                  backup=self._last["kind"], t_verify=t_verify,
                                  t_build=self._last.get("build_s"), t_backup=self._last.get("backup_s"))

    def choose(self, batch_size: int) -> str:
        return "hybrid" if self.mode == "hybrid" else self.policy.choose(batch_size)

    def replied(self, kind: str, n_rows: int, backup_s: Optional[float]) -> None:
        self.rows[kind] += n_rows
        self._last = {"kind": kind, **({"backup_s": backup_s} if backup_s is not None else {})}
        self._t_reply = time.perf_counter()

    def built(self, build_s: float) -> None:
        self._last["build_s"] = build_s

    def report(self, batch_size: Optional[int] = None) -> dict:
        return {"mode": self.mode, "rows": dict(self.rows), **self.policy.report(batch_size)}
