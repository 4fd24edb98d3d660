"""The proposal distribution q as it travels on the wire.

Exactness of speculative sampling needs the verifier to use *exactly* the distribution the
draft sampled from.  The draft therefore quantises q to float16 for the wire and samples from
the dequantised copy; the verifier dequantises the very same bytes the same way.
"""

from __future__ import annotations

import torch


def quantize_proposal(q: torch.Tensor) -> torch.Tensor:
    """q (..., V) probabilities, any float dtype -> float16 copy for the wire."""
    return q.to(torch.float16)


def dequantize_proposal(q16: torch.Tensor) -> torch.Tensor:
    """float16 wire copy -> float32 distribution, renormalised along the last axis.

    Both ends call this on the same float16 values and must see bit-identical q, although the draft
    holds a row over its head's ids ([..., W]) on its own device and the verifier the same row
    scattered over the vocabulary ([..., V], zeros elsewhere) on the target's.  So the normaliser is
    the EXACT sum of the values: a float16 probability in [0, 1] is a whole number (<= 2^24) of units
    2^-24, so a float64 accumulator (53-bit significand) adds up to 2^29 of them without rounding, in
    any order, and zeros change nothing -- whatever the layout, the device or its reduction order.  (A float32 sum is exact
    only while partial sums stay below 1; past it the result depends on the order of the additions.)
    q = float32(q16) / float32(sum) is then one correctly rounded division of identical operands.
    """
    s = q16.sum(dim=-1, keepdim=True, dtype=torch.float64).to(torch.float32)
    return q16.to(torch.float32) / s.clamp_min(1e-30)


def proposal_from_logits(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Draft-side helper: softmax(logits / T) -> wire-quantised -> dequantised q used for sampling.

    Returns the float32 distribution the draft must sample from (and whose float16 image it sends).
    """
    if not torch.is_tensor(temperature):
        temperature = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    t = temperature.to(torch.float32)
    while t.dim() < logits.dim():
        t = t.unsqueeze(-1)
    probs = torch.softmax(logits.float() / t.clamp_min(1e-6), dim=-1)
    return dequantize_proposal(quantize_proposal(probs))
