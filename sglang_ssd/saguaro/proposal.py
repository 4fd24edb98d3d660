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

    Both ends call this on the same float16 values, so both see bit-identical q.
    """
    q = q16.to(torch.float32)
    return q / q.sum(dim=-1, keepdim=True).clamp_min(1e-30)


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
