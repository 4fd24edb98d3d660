"""The target distribution p that verification must preserve.

Speculative verification is exact only relative to a fixed target distribution: the one the
non-speculative sampler would draw the next token from.  This module rebuilds that distribution
(as an explicit [N, V] probability table) from the processed logits and the per-request sampling
parameters, mirroring SGLang 0.5.23:

* Greedy criterion -- ``sglang/srt/sampling/sampling_params.py`` ``SamplingParams.__post_init__``
  rewrites ``0 <= temperature < _SAMPLING_EPS (1e-6)`` to ``temperature = 1, top_k = 1`` and
  ``top_k == -1`` to ``TOP_K_ALL = 1 << 30``; ``sglang/srt/sampling/sampling_batch_info.py``
  ``SamplingBatchInfo.from_schedule_batch`` then calls a request greedy iff ``top_k <= 1``
  (valid top_k is -1 or >= 1, so this is ``top_k == 1``).  ``is_greedy`` accepts both the raw
  request values and the normalised batch tensors.  Greedy rows are decoded with
  ``torch.argmax(logits, -1)`` (``Sampler.forward``, ``is_all_greedy`` branch), so ties go to the
  lowest token id; ``target_probs`` returns a one-hot at that argmax.
* Sampled rows -- ``sglang/srt/layers/sampler.py``: ``Sampler.forward`` divides the logits by the
  per-row temperature and applies ``torch.softmax`` (``sampler_softmax`` is ``torch.softmax`` off
  Blackwell); ``Sampler._sample_from_probs`` -> ``top_k_top_p_min_p_sampling_from_probs_torch``
  (the "pytorch" sampling backend) then, on probabilities sorted in descending order
  (``probs.sort(dim=-1, descending=True)``):
    1. cumsum is taken over the *unfiltered* sorted probs;
    2. top-k: rank >= top_k is zeroed;
    3. top-p: a token is zeroed when the mass strictly before it exceeds top_p
       (``probs_sum - probs_sort > top_p``), i.e. keep the smallest prefix whose mass >= top_p,
       plus tokens whose preceding mass equals top_p exactly; rank 0 always survives.  Because
       the cumsum is over unfiltered probs, top-k and top-p act *jointly* on the original
       distribution (not top-p of the top-k-renormalised one);
    4. min-p: zero every token with prob < min_p * max prob;
    5. ``torch.multinomial`` samples from the (implicitly renormalised) survivors.
  This is ``filter_order="joint"``, the default.  FlashInfer's fused
  ``top_k_top_p_sampling_from_probs(filter_apply_order="joint")`` has the same intent.
* ``filter_order="sequential"`` -- top-k renormalise, then top-p on the renormalised probs, then
  min-p.  This is what the flashinfer backend does when any request has min_p > 0
  (``top_k_renorm_prob`` -> ``top_p_renorm_prob`` -> ``min_p_sampling_from_probs``) and what
  SGLang's own EAGLE verification uses (``speculative/eagle_utils.py``, without min-p).  The
  kernels' boundary conventions are not reproduced bit for bit; the pytorch ``>`` rule is used.

Covered: temperature, top_k, top_p, min_p.  NOT covered (must already be folded into ``logits`` by
the caller, as SGLang does in ``SamplingBatchInfo.apply_logits_bias`` and the custom logit
processor hook before ``Sampler.forward``): penalties, logit_bias, grammar masks, custom logit
processors.  Deterministic (seeded, Gumbel) sampling draws from the same distribution.

Two deliberate per-row simplifications (they only matter at float-rounding level): SGLang applies
the top-p / min-p masks batch-wide whenever *any* row needs them, so a row with top_p == 1 can
lose tail tokens whose float32 cumsum exceeds 1.0; here masks apply only to rows that ask for
them.  Exact ties straddling the top-k boundary are broken by the same ``torch.sort`` call as
SGLang (SGLang's ``max_top_k`` fast path uses ``torch.topk`` and may break such ties differently).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

logger = logging.getLogger(__name__)

SAMPLING_EPS = 1e-6  # sglang/srt/sampling/sampling_params.py: _SAMPLING_EPS
TOP_K_ALL = 1 << 30  # sglang/srt/sampling/sampling_params.py: TOP_K_ALL (top_k = -1 maps here)

FilterOrder = Literal["joint", "sequential"]


# SGLang 0.5.23 ``Sampler._sample_from_probs`` by ``--sampling-backend`` (GPU default "flashinfer",
# CPU default "pytorch"; srt/arg_groups/overrides.py ``_sampling_backend_default``)
SEQUENTIAL_WITH_MIN_P = ("flashinfer", "intel_xpu")  # top_k_renorm -> top_p_renorm -> min_p, batch-wide
JOINT = ("pytorch",)                                  # top_k_top_p_min_p_sampling_from_probs_torch
SAMPLING_BACKENDS = SEQUENTIAL_WITH_MIN_P + JOINT


def sampler_filter_order(backend: str, need_min_p: bool) -> FilterOrder:
    """The order SGLang's sampler applies top-k / top-p / min-p in, for the whole batch.

    flashinfer / intel_xpu: when any request of the batch has min_p > 0 (``need_min_p_sampling``),
    top_k_renorm_prob -> top_p_renorm_prob -> min_p_sampling_from_probs, i.e. "sequential"; else the
    fused ``top_k_top_p_sampling_from_probs(filter_apply_order="joint")``.  pytorch: joint always.
    Any other backend ("ascend" has its own sampler) is refused: the verifier could not know its p."""
    if backend in SEQUENTIAL_WITH_MIN_P:
        return "sequential" if need_min_p else "joint"
    if backend in JOINT:
        return "joint"
    raise ValueError(f"--sampling-backend {backend!r} is not supported with saguaro: its exact verify "
                     f"rebuilds the sampler's distribution for {list(SAMPLING_BACKENDS)} only")


def is_greedy(temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """BoolTensor[N]: rows SGLang decodes by argmax.

    SGLang: temperature in [0, 1e-6) becomes (temperature=1, top_k=1), and a row is greedy iff
    top_k <= 1.  Valid top_k is -1 (off) or >= 1, so the criterion is ``T < eps or top_k == 1``.
    """
    return (temperature.reshape(-1) < SAMPLING_EPS) | (top_k.reshape(-1) == 1)


def effective_top_k(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """top_k with "off" (-1, any value <= 0, TOP_K_ALL or >= V) mapped to V."""
    top_k = top_k.to(torch.long)
    off = (top_k <= 0) | (top_k >= vocab_size)
    return torch.where(off, torch.full_like(top_k, vocab_size), top_k)


def needs_filter(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """BoolTensor[N]: rows whose distribution is not the plain softmax(logits / T): top-k below the
    vocabulary, top-p < 1 or min-p > 0 (SGLang samples the others from the softmax as is)."""
    top_k, top_p, min_p = (x.reshape(-1) for x in (top_k, top_p, min_p))
    k_on = (top_k > 0) & (top_k < vocab_size)
    return k_on | (top_p < 1.0) | (min_p > 0.0)


def _renorm(w: torch.Tensor) -> torch.Tensor:
    # Rows always keep >= 1 token (rank 0 survives every filter), so the sum is > 0.
    return w / w.sum(dim=-1, keepdim=True)


def _filter_sorted_joint(
    sorted_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """top_k_top_p_min_p_sampling_from_probs_torch on descending-sorted probs (unnormalised out)."""
    n, v = sorted_p.shape
    rank = torch.arange(v, device=sorted_p.device).view(1, -1)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # exclusive cumsum, unfiltered probs
    drop = rank >= effective_top_k(top_k, v).view(-1, 1)  # top-k
    drop |= (top_p < 1.0).view(-1, 1) & (mass_before > top_p.view(-1, 1))  # top-p
    # min-p relative to the max prob (rank 0 is never dropped above, so this is SGLang's probs_sort[:, 0])
    drop |= sorted_p < sorted_p[:, :1] * min_p.view(-1, 1)
    return sorted_p.masked_fill(drop, 0.0)


def _filter_sorted_sequential(
    sorted_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """top_k_renorm -> top_p_renorm -> min-p, each on the previous stage's renormalised output."""
    n, v = sorted_p.shape
    rank = torch.arange(v, device=sorted_p.device).view(1, -1)
    w = _renorm(sorted_p.masked_fill(rank >= effective_top_k(top_k, v).view(-1, 1), 0.0))
    mass_before = torch.cumsum(w, dim=-1) - w  # now over the top-k-renormalised probs
    w = _renorm(w.masked_fill((top_p < 1.0).view(-1, 1) & (mass_before > top_p.view(-1, 1)), 0.0))
    return w.masked_fill(w < w[:, :1] * min_p.view(-1, 1), 0.0)


def filter_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    filter_order: FilterOrder = "joint",
) -> torch.Tensor:
    """Apply top-k / top-p / min-p to probs [N, V] and renormalise; returns [N, V] in vocab order."""
    # Same call as SGLang, so exact ties at the top-k boundary resolve the same way on one device.
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if filter_order == "joint":
        kept = _filter_sorted_joint(sorted_p, top_k, top_p, min_p)
    elif filter_order == "sequential":
        kept = _filter_sorted_sequential(sorted_p, top_k, top_p, min_p)
    else:
        raise ValueError(f"unknown filter_order {filter_order!r}")
    return torch.zeros_like(probs).scatter_(-1, order, _renorm(kept))


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    *,
    filter_order: FilterOrder = "joint",
) -> torch.Tensor:
    """Distribution [N, V] (float32) SGLang's non-speculative sampler draws from.

    logits: [N, V] processed logits (penalties / bias / grammar already applied).
    temperature, top_p, min_p: [N] (or SGLang's [N, 1]) float; top_k: [N] int, -1 / <= 0 / >= V
    means off.  Greedy rows (``is_greedy``) come back one-hot at ``torch.argmax(logits)``.
    """
    logits = logits.float()
    temperature, top_p, top_k, min_p = (x.reshape(-1) for x in (temperature, top_p, top_k, min_p))
    greedy = is_greedy(temperature, top_k)
    # Greedy rows are one-hot at the argmax; no softmax or sort is spent on them.
    probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    rows = (~greedy).nonzero().squeeze(-1)
    if rows.numel():
        t = temperature[rows].float().view(-1, 1)
        sub = torch.softmax(logits[rows] / t, dim=-1)  # Sampler.forward: logits.div_(T); softmax
        # Rows without top-k / top-p / min-p are SGLang's "simple sampling case": it samples from the
        # softmax as is, so they skip the sort (a full 49k-entry sort per row cost ~10 ms on a CPU core).
        filt = needs_filter(top_k[rows], top_p[rows], min_p[rows], logits.shape[-1]).nonzero().squeeze(-1)
        if filt.numel():
            fr = rows[filt]
            sub[filt] = filter_probs(sub[filt], top_k[fr], top_p[fr].float(), min_p[fr].float(), filter_order)
        probs[rows] = sub
    return probs
