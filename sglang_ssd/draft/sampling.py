"""Per-row next-token choice: argmax at temperature 0, else a sample from the Saguaro proposal q.

Exactness contract with the verifier: the draft sends ``q16 = quantize_proposal(softmax(z / T))`` and
samples from ``dequantize_proposal(q16)``, which is bit-identical to ``proposal_from_logits(z, T)``
AND to what the verifier gets by dequantising the received bytes.  (Re-quantising the output of
``proposal_from_logits`` would NOT be: renormalisation can move a float16 rounding.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_ssd.saguaro.lookup import mix_copy
from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal
from sglang_ssd.saguaro.saguaro_sampling import saguaro_probs_rows
from sglang_ssd.saguaro.verify import sample_inverse_cdf


def proposal_wire(logits: torch.Tensor, temperatures: torch.Tensor, fs: Optional[torch.Tensor] = None,
                  cs: Optional[torch.Tensor] = None,
                  mix: Optional[tuple[torch.Tensor, float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V], temperatures [n] (> 0) -> (q float32 [n, V] to sample from, q16 float16 wire copy).

    Same arithmetic as proposal_from_logits: softmax(logits.float() / T.clamp_min(1e-6)), then, for rows
    with Saguaro sampling (C_i < 1, F_i > 0), sigma_{F_i,C_i} (saguaro_sampling.py); with mix = (cols [n], w),
    the rows with a copy column (>= 0) become (1 - w) q + w onehot(col) (saguaro/lookup.py); then quantised."""
    t = temperatures.to(device=logits.device, dtype=torch.float32).unsqueeze(-1)
    probs = torch.softmax(logits.float() / t.clamp_min(1e-6), dim=-1)
    if cs is not None and fs is not None:
        probs = saguaro_probs_rows(probs, fs, cs)
    if mix is not None:
        probs = mix_copy(probs, mix[0].to(probs.device), mix[1])
    q16 = quantize_proposal(probs)
    return dequantize_proposal(q16), q16


def sample_rows(logits: torch.Tensor, temperatures: Sequence[float] | torch.Tensor,
                generator: Optional[torch.Generator] = None, fs: Optional[Sequence[int] | torch.Tensor] = None,
                cs: Optional[Sequence[float] | torch.Tensor] = None,
                support: Optional[torch.Tensor] = None,
                mix: Optional[tuple[torch.Tensor, float]] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [n, V] float32 -> (tokens [n] long, q16 [n, V] float16 or None if every row is greedy).

    Rows with temperature <= 0 take the argmax of the raw logits and keep a zero q16 row (Saguaro
    sampling has no effect at temperature 0).  fs/cs (per row): Saguaro sampling sigma_{F,C}.
    support: the vocabulary ids a reduced draft head covers (logits are -inf, so q exactly 0,
    everywhere else): softmax, Saguaro sampling, quantisation and the draw then run over those ids
    only -- the same law, since zero-mass tokens have empty inverse-CDF intervals either way -- and
    q16 is scattered back to the full vocabulary.  mix = (cols [n] long, w): per row the column (in the
    logits' space) of an n-gram copy, -1 for none; sampled rows with one draw from the mixture
    (1 - w) q + w onehot(col), and that mixture is their q16 (not with support)."""
    if mix is not None and support is not None:
        raise ValueError("sample_rows: mix is given in the logits' columns, not with support")
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device).reshape(-1)
    sampled = (temps > 0).nonzero().squeeze(-1)
    if sampled.numel() == 0:
        return logits.argmax(dim=-1), None
    every = sampled.numel() == logits.shape[0]
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device) if every else logits.argmax(dim=-1)
    sf = sc = None
    if fs is not None and cs is not None:
        sf = torch.as_tensor(fs, dtype=torch.long).reshape(-1)[sampled.cpu()]
        sc = torch.as_tensor(cs, dtype=torch.float32).reshape(-1)[sampled.cpu()]
    z = logits if every else logits[sampled]
    q16 = torch.zeros(logits.shape, dtype=torch.float16, device=logits.device)
    if support is None:
        smix = None if mix is None else (mix[0].reshape(-1)[sampled.cpu()], mix[1])
        q, q16_rows = proposal_wire(z, temps[sampled], sf, sc, smix)
        tokens[sampled] = sample_inverse_cdf(q, generator)
        q16[sampled] = q16_rows
        return tokens, q16
    q, q16_rows = proposal_wire(z.index_select(1, support), temps[sampled], sf, sc)
    tokens[sampled] = support[sample_inverse_cdf(q, generator)]
    if every:
        q16.index_copy_(1, support, q16_rows)
    else:
        q16[sampled.unsqueeze(1), support.unsqueeze(0)] = q16_rows
    return tokens, q16
