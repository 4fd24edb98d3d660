"""Saguaro sampling sigma_{F,C} (Definition 14, notes 2.6) and its wire contract.

    sigma_{F,C}(q)_t  proportional to  C q_t  if t in top_F(q),   q_t otherwise,     0 < C <= 1

Why: after a rejection the bonus comes from norm(max(0, p - q')).  Down-weighting the draft's top-F
tokens (exactly the tokens the cache guesses as bonus) lowers q' there, so more residual mass, and
so more bonus draws, land on cached tokens: higher hit rate, at the cost of acceptance.

This is the paper's top-F; the reference code down-weights top-(F+1) (notes 5.7, 6.1).

Exactness (notes 2.7): verification is exact for ANY proposal as long as the verifier's q is the
one the draft sampled from.  The draft therefore sends the float16 image of sigma_{F,C}(q) and
samples from its dequantised copy (``proposal.dequantize_proposal``); the verifier dequantises the
same bytes, so ``verify_chain`` needs no change and never recomputes sigma.

Top set: the first F entries of a stable descending sort of the probabilities, i.e. order by
(-prob, index): ties go to the lower token id.  Deterministic on every device.
"""

from __future__ import annotations

import torch

from sglang_ssd.saguaro.proposal import dequantize_proposal, quantize_proposal
from sglang_ssd.saguaro.verify import sample_inverse_cdf


def _check(f: int, c: float) -> None:
    if f < 0:
        raise ValueError(f"F must be >= 0, got {f}")
    if not 0.0 < c <= 1.0:  # C = 0 would zero a one-hot row; NaN fails too
        raise ValueError(f"C must be in (0, 1], got {c}")


def _top_f_rows(probs: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Bool mask [n, V]: per row the first f_i tokens in (-prob, index) order (f [n] ints >= 0).

    O(V) per row instead of a full sort (which cost ~8 ms per 49k-token row on a CPU core, i.e. most of
    a draft tree step): the f_i-th largest value comes from topk, every token above it is in, and tokens
    equal to it fill the remaining places lowest id first (a cumulative count, only on rows with ties)."""
    f = f.clamp(0, probs.shape[-1])
    fmax = int(f.max()) if f.numel() else 0
    if fmax == 0:
        return torch.zeros_like(probs, dtype=torch.bool)
    vals = torch.topk(probs, fmax, dim=-1, sorted=True).values
    thr = vals.gather(-1, (f - 1).clamp_min(0)[:, None])  # the f_i-th largest value of row i
    mask = probs >= thr
    tied = (mask.sum(-1) != f).nonzero().squeeze(-1)  # more tokens equal the threshold than places left
    if tied.numel():
        sub, t = probs[tied], thr[tied]
        above = sub > t
        eq = sub == t
        need = f[tied][:, None] - above.sum(-1, keepdim=True)
        mask[tied] = above | (eq & (torch.cumsum(eq.to(torch.int32), -1) <= need))
    return mask & (f[:, None] > 0)


def top_f_mask(probs: torch.Tensor, f: int) -> torch.Tensor:
    """Bool mask [..., V] of the top-F tokens per row, ties to the lower index."""
    flat = probs.reshape(-1, probs.shape[-1])
    fs = torch.full((flat.shape[0],), min(f, probs.shape[-1]), dtype=torch.long, device=probs.device)
    return _top_f_rows(flat, fs).reshape(probs.shape)


def saguaro_probs(probs: torch.Tensor, f: int, c: float) -> torch.Tensor:
    """sigma_{F,C} of a distribution [..., V]: top-F scaled by C, renormalised.

    C = 1, F = 0 or F >= V (a uniform rescale) return `probs` itself, untouched.  A one-hot row
    stays exactly one-hot (C * 1 / (C * 1) == 1 in floating point, zeros stay zero).
    """
    _check(f, c)
    if c == 1.0 or f == 0 or f >= probs.shape[-1]:
        return probs
    w = torch.where(top_f_mask(probs, f), probs * c, probs)
    return w / w.sum(dim=-1, keepdim=True)


def saguaro_probs_rows(probs: torch.Tensor, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Per-row sigma_{F_i,C_i} of probs [n, V] (f [n] ints >= 0, c [n] in (0, 1]).  Rows with C = 1 or
    F = 0 are returned bit-identical (the same rule as saguaro_probs, row by row)."""
    f = torch.as_tensor(f, dtype=torch.long, device=probs.device).reshape(-1)
    c = torch.as_tensor(c, dtype=torch.float32, device=probs.device).reshape(-1)
    if bool(((c <= 0) | (c > 1) | torch.isnan(c)).any()) or bool((f < 0).any()):
        raise ValueError("saguaro_probs_rows: need F >= 0 and C in (0, 1]")
    active = (c < 1) & (f > 0) & (f < probs.shape[-1])
    if not bool(active.any()):
        return probs
    rows = active.nonzero().squeeze(-1)
    sub = probs[rows]
    top = _top_f_rows(sub, f[rows])  # first F_i per row in (-prob, index) order: ties -> lower id
    w = torch.where(top, sub * c[rows][:, None], sub)
    out = probs.clone()
    out[rows] = w / w.sum(dim=-1, keepdim=True)
    return out


def saguaro_proposal_wire(logits: torch.Tensor, temperatures: torch.Tensor | float, f: int,
                          c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft side: logits [..., V] -> (q float32 to sample from, q16 float16 to send).

    q16 = quantize(sigma_{F,C}(softmax(logits.float() / T.clamp_min(1e-6)))) and q =
    dequantize(q16), the same q the verifier derives from q16.  With C = 1 this is bit-identical
    to ``draft.sampling.proposal_wire`` / ``proposal.proposal_from_logits``.  Temperatures must be
    > 0 (greedy rows take the raw argmax and need no q).
    """
    _check(f, c)
    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device)
    while t.dim() < logits.dim():
        t = t.unsqueeze(-1)
    probs = torch.softmax(logits.float() / t.clamp_min(1e-6), dim=-1)
    q16 = quantize_proposal(saguaro_probs(probs, f, c))
    return dequantize_proposal(q16), q16


def saguaro_proposal_from_logits(logits: torch.Tensor, temperature: torch.Tensor | float, f: int,
                                 c: float) -> torch.Tensor:
    """Mirror of ``proposal.proposal_from_logits`` with sigma_{F,C}: the float32 q to sample from."""
    return saguaro_proposal_wire(logits, temperature, f, c)[0]


def saguaro_sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, f: int, c: float,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for ``draft.sampling.sample_rows`` with sigma_{F,C}: logits [n, V] ->
    (tokens [n], q16 [n, V] or None if all rows are greedy).  Greedy rows (T <= 0): raw argmax
    (sigma keeps a one-hot row one-hot, so greedy is unaffected) and a zero q16 row."""
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device).reshape(-1)
    tokens = logits.argmax(dim=-1)
    sampled = (temps > 0).nonzero().squeeze(-1)
    if sampled.numel() == 0:
        return tokens, None
    q, q16_rows = saguaro_proposal_wire(logits[sampled], temps[sampled], f, c)
    tokens[sampled] = sample_inverse_cdf(q, generator)
    q16 = torch.zeros(logits.shape, dtype=torch.float16, device=logits.device)
    q16[sampled] = q16_rows
    return tokens, q16
